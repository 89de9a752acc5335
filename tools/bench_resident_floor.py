"""Benchmark (not a test): resident decode against the memory-bandwidth floor, in each arithmetic.

    flock /tmp/colibri-cpu.lock python tools/bench_resident_floor.py MODEL_DIR [--activations int8 f32]
        [--rounds 3] [--tokens 16] [--prompt 16]

Loads one engine per arithmetic with every expert cached (all of them must fit in RAM together:
Qwen3.6-size models take `tools/bench_real_dims.py run --ram fit` instead), then for each round decodes
`--tokens` tokens after a `--prompt`-token random prompt on each engine in turn, the machine's read
bandwidth (`colibri bench kernels`' probe: the kernel threads streaming 512 MB) measured just before
and after each. The floor is the bytes a token touches — every resident tensor but the embedding
table (one row of it; all of it when lm_head is tied to it) and top-k experts in every MoE layer —
read at that bandwidth; the report is ms a token and the floor's share of it. Recurrent state (Gated
DeltaNet) and the KV cache are not counted.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import colibri_core
from colibri_core import kernels
from colibri_core.planning import memory_bandwidth as read_bandwidth


def bytes_per_token(engine) -> int:
    """Resident bytes less the embedding table (unless lm_head is the table), plus top-k experts a MoE layer."""
    model, c = engine.model, engine.container
    table = getattr(model, "embed_tokens", None)
    untouched = 0 if table is None or getattr(model, "lm_head", None) is table else table.nbytes
    top_k = type(model).layout(model.cfg).top_k
    return engine.resident_bytes - untouched + len(c.moe_layers) * top_k * c.expert_nbytes


def decode_seconds(engine, rng: np.random.Generator, prompt: int, tokens: int) -> float:
    """Seconds a decoded token, after a random prompt, on a fresh session."""
    session = engine.new_session()
    ids = [int(i) for i in rng.integers(2, 1000, prompt)]
    engine._feed(session, ids)
    start = time.perf_counter()
    for i in range(tokens):
        ids.append(3 + i)
        engine._feed(session, ids)
    return (time.perf_counter() - start) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--activations", nargs="+", default=["int8", "f32"], help="one engine each, alternated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    args = ap.parse_args()
    engines = {}
    for act in args.activations:
        engine = colibri_core.load(args.model, cache_slots=10**6, usage=False, activations=act)  # no routing history written
        for layer in engine.container.moe_layers:  # every expert resident
            for e in range(engine.container.n_experts):
                engine.store.get(layer, e)
        engines[act] = engine
    touched = bytes_per_token(next(iter(engines.values())))
    print(f"{args.model}: {touched / 1e6:.3g} MB a token; {kernels.threads()} threads, "
          f"{kernels.simd()}")
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        cells = []
        for act, engine in engines.items():
            before = read_bandwidth()
            seconds = decode_seconds(engine, rng, args.prompt, args.tokens)
            read = (before + read_bandwidth()) / 2
            cells.append(f"{act}: {seconds * 1e3:.1f} ms a token, floor {touched / read * 1e3:.3g} "
                         f"({100 * touched / read / seconds:.0f} %; read {read / 1e9:.1f} GB/s)")
        print(f"round {r + 1}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
