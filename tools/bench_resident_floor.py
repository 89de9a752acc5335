"""Benchmark (not a test): resident decode against the memory-bandwidth floor, in each arithmetic.

    flock /tmp/colibri-cpu.lock python tools/bench_resident_floor.py MODEL_DIR [--activations int8 f32]
        [--rounds 3] [--tokens 16] [--prompt 16] [--batch 8]

Loads one engine per arithmetic with every expert cached (all of them must fit in RAM together:
Qwen3.6-size models take `tools/bench_real_dims.py run --ram fit` instead), then for each round decodes
`--tokens` tokens after a `--prompt`-token random prompt on each engine in turn, the machine's read
bandwidth (`colibri bench kernels`' probe: the kernel threads streaming 512 MB) measured just before
and after each. The floor is the bytes a token touches — every resident tensor but the embedding
table (one row of it; all of it when lm_head is tied to it) and top-k experts in every MoE layer —
read at that bandwidth; the report is ms a token and the floor's share of it. Recurrent state (Gated
DeltaNet) and the KV cache are not counted.

`--batch N` also decodes N generations together (`engine.batch`, as `serve --parallel N` does) after
each round's single one, and reports each of their steps against its own floor: the resident bytes
once (less the embedding table) plus the union of the N rows' experts in every MoE layer, counted by
the store (its expert lookups: one per distinct expert a layer call runs), read at the same
bandwidth; and the N generations' tokens/s against the single one's.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import colibri_core
from colibri_core import kernels
from colibri_core.planning import memory_bandwidth as read_bandwidth


def dense_bytes(engine) -> int:
    """Resident bytes less the embedding table (unless lm_head is the table): what a step reads besides experts."""
    model = engine.model
    table = getattr(model, "embed_tokens", None)
    return engine.resident_bytes - (0 if table is None or getattr(model, "lm_head", None) is table else table.nbytes)


def bytes_per_token(engine) -> int:
    """dense_bytes, plus top-k experts a MoE layer."""
    model, c = engine.model, engine.container
    return dense_bytes(engine) + len(c.moe_layers) * type(model).layout(model.cfg).top_k * c.expert_nbytes


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


def batch_steps(engine, rng: np.random.Generator, n: int, prompt: int, tokens: int) -> list[tuple[float, int]]:
    """(seconds, experts run) of each decode step of n generations together, after their prompts' step."""
    counters, steps = engine.store.counters, []
    with engine.batch() as b:
        for _ in range(n):
            b.add([int(i) for i in rng.integers(2, 1000, prompt)], tokens, stop_ids=[])
        b.step()  # the prompts
        while b.running():
            lookups = counters.expert_hits + counters.expert_misses
            start = time.perf_counter()
            b.step()
            steps.append((time.perf_counter() - start, counters.expert_hits + counters.expert_misses - lookups))
    return [s for s in steps if s[1]]  # a last step may only end the generations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--activations", nargs="+", default=["int8", "f32"], help="one engine each, alternated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--batch", type=int, default=0, help="also decode this many generations together")
    args = ap.parse_args()
    engines = {}
    for act in args.activations:
        engine = colibri_core.load(args.model, cache_slots=10**6, usage=False, activations=act)  # no routing history written
        for layer in engine.container.moe_layers:  # every expert resident
            for e in range(engine.container.n_experts):
                engine.store.get(layer, e)
        engines[act] = engine
    touched = bytes_per_token(next(iter(engines.values())))
    dense = dense_bytes(next(iter(engines.values())))
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
            if args.batch > 1:
                before = read_bandwidth()
                steps = batch_steps(engine, rng, args.batch, args.prompt, args.tokens)
                read = (before + read_bandwidth()) / 2
                floors = [(dense + experts * engine.container.expert_nbytes) / read for _, experts in steps]
                step = float(np.median([s for s, _ in steps]))
                cells.append(f"{args.batch} together: step {step * 1e3:.1f} ms, its floor "
                             f"{np.median(floors) * 1e3:.3g} ({100 * np.median([f / s for f, (s, _) in zip(floors, steps)]):.0f} %; "
                             f"{np.median([e for _, e in steps]):.0f} experts; read {read / 1e9:.1f} GB/s), "
                             f"{args.batch * seconds / step:.2f}x the tokens/s of one")
        print(f"round {r + 1}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
