"""What the router lookahead saves a streamed decode, and what a perfect one would (a benchmark, not a test).

    flock /tmp/colibri-cpu.lock python tools/bench_lookahead.py bench-data/olmoe-1b-7b-16l-int4 --fraction 0.5 --rounds 2

Decodes the same prompts and seeds at a cache of `--fraction` of each layer's experts (O_DIRECT
reads, no routing history, so no hot-store: the `colibri bench` cold session's split) with the
lookahead in three modes, taking turns, a fresh engine each:

  off      no lookahead: every miss is read once its layer has routed;
  on       the routers' own guesses (the default);
  perfect  each layer's guess is the routing it will choose, recorded beforehand from a resident
           run of the same prompts and seeds (sampling at temperature 1 with a seed replays the same
           tokens whatever the placement). No engine can guess this well: it bounds what a better
           one-layer guess could save on this disk.

Each session decodes one untimed prompt first (the cache fills), then `--prompts` prompts. Printed
per session: decode ms a token, I/O stall, MB read a token, the lookahead's recall; then each mode's
median. What it shows on one machine (BENCHMARKS.md, *What bounds a streamed token on this disk*):
how much of a streamed token's time the reads routing decides cost, and whether guessing better one
layer ahead would remove it.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from colibri_core import probe
from colibri_core.bench.model import _prompts, _run
from colibri_core.engine import load
from colibri_core.planning import sizes_from_container


def plan(engine, n: int, prompt_tokens: int, new_tokens: int) -> list[tuple[list[int], int, int]]:
    """(prompt, tokens, seed): the untimed prompt, then `n` timed ones."""
    prompts = _prompts(engine, n + 1, prompt_tokens, 0)
    return [(prompts[0], new_tokens, 100)] + [(p, new_tokens, i) for i, p in enumerate(prompts[1:])]


def record_routing(model: Path, n: int, prompt_tokens: int, new_tokens: int) -> dict[int, list]:
    """{MoE layer: [ids (T, k) of each forward pass, in order]} of the plan, every expert resident."""
    with load(model, cache_slots=10**6, usage=False, prefetch=False) as engine:
        with probe.recording(names=("ffn_moe_ids",)) as rec:
            for prompt, tokens, seed in plan(engine, n, prompt_tokens, new_tokens):
                _run(engine, prompt, tokens, seed)
        return {layer: rec.tensors[("ffn_moe_ids", layer)] for layer in engine.container.moe_layers}


def session(model: Path, slots: int, mode: str, routing: dict[int, list] | None, n: int, prompt_tokens: int,
            new_tokens: int) -> dict:
    with load(model, cache_slots=slots, usage=False, direct=True, prefetch=mode != "off") as engine:
        if mode == "perfect":  # each router's guess: the routing its layer will choose this forward pass
            passes = [0]
            forward = engine.model.forward

            def counted(*args, **kwargs):
                out = forward(*args, **kwargs)
                passes[0] += 1
                return out

            engine.model.forward = counted
            for layer, router in engine.model.routers().items():
                router.predict = lambda residual, token_ids, layer=layer: routing[layer][passes[0]]
        runs = [_run(engine, prompt, tokens, seed) for prompt, tokens, seed in plan(engine, n, prompt_tokens, new_tokens)]
    timed = runs[1:]
    tok = sum(r["decoded_tokens"] for r in timed)
    return {"ms": 1e3 * sum(r["decode_seconds"] for r in timed) / tok,
            "stall": 1e3 * sum(sum(r["decode_layer_io_stall_seconds"].values()) for r in timed) / tok,
            "mb": sum(r["bytes_read_per_token"] * r["decoded_tokens"] for r in timed) / tok / 1e6,
            "recall": statistics.mean(r["prefetch_recall"] for r in timed) if mode != "off" else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--fraction", type=float, default=0.5, help="cache slots a layer, as a share of its experts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded after each prompt")
    ap.add_argument("--modes", default="off,on,perfect")
    args = ap.parse_args()
    modes = args.modes.split(",")
    n_experts = sizes_from_container(args.model).n_experts
    slots = max(1, round(args.fraction * n_experts))
    routing = record_routing(args.model, args.prompts, args.prompt_tokens, args.tokens) if "perfect" in modes else None
    print(f"{args.model}: {slots} of {n_experts} experts cached a layer, {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens + {args.tokens} decoded, O_DIRECT, no hot-store")
    results = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            s = session(args.model, slots, m, routing, args.prompts, args.prompt_tokens, args.tokens)
            results[m].append(s)
            print(f"round {r + 1} {m:8s} {s['ms']:6.1f} ms a token, stall {s['stall']:5.1f} ms, "
                  f"{s['mb']:6.1f} MB read a token, recall {100 * s['recall']:.0f} %", flush=True)
    for m, runs in results.items():
        print(f"median {m:8s} {statistics.median(s['ms'] for s in runs):6.1f} ms a token, stall "
              f"{statistics.median(s['stall'] for s in runs):5.1f} ms, {statistics.median(s['mb'] for s in runs):6.1f} MB")


if __name__ == "__main__":
    main()
