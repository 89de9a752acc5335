"""The router lookahead's recall at each distance: how many of the experts a MoE layer routes to its
guess named from 1, 2 and 3 MoE layers before (a measurement, not a test).

    flock /tmp/colibri-cpu.lock .venv/bin/python tools/lookahead_recall.py            # the bundled demo model
    flock /tmp/colibri-cpu.lock .venv/bin/python tools/lookahead_recall.py bench-data/olmoe-synth-16l

Generates from `--prompts` prompts (sampled at temperature 1, a seed each, every expert resident) while
recording each MoE layer's residual stream and routing (`probe.recording`: `ffn_inp`, `ffn_moe_ids`);
then applies every later router the lookahead reaches (`layers.moe.MoE.ahead`: the model's
`lookahead()` followed up to LOOKAHEAD_DISTANCES) to each layer's residual stream, as the MoE block
does while decoding, and scores the guess against that later layer's routing. Recall: of the k
experts a decoded token routed to, the share its guess named (the store's `prefetch_recall` for one
token); prefill tokens are left out (a prompt's batch union is read whatever is guessed).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from colibri_core import probe
from colibri_core.bench.model import _prompts
from colibri_core.demo import demo_model
from colibri_core.engine import load
from colibri_core.layers.moe import MoE


def measure(model: Path, prompts: int, prompt_tokens: int, new_tokens: int) -> dict:
    """{"layers": {layer: {distance: recall}}, "distance": {distance: recall over every layer and token},
    "tokens": decoded tokens scored}."""
    with load(model, cache_slots=10**6, usage=False, prefetch=False) as engine:
        routers = engine.model.routers()
        ahead = MoE(None, routers, engine.model.lookahead()).ahead  # {layer: later MoE layers, nearest first}
        right: dict[tuple[int, int], int] = {}  # (layer, distance) -> experts guessed right
        routed: dict[tuple[int, int], int] = {}  # (layer, distance) -> experts routed
        tokens = 0
        for seed, prompt in enumerate(_prompts(engine, prompts, prompt_tokens, 0)):
            with probe.recording(names=("ffn_inp", "ffn_moe_ids", "ffn_moe_tokens")) as rec:
                for _ in engine.stream(prompt, new_tokens, temperature=1.0, seed=seed, stop_ids=()):
                    pass
            passes = len(rec.tensors[("ffn_moe_ids", next(iter(routers)))])
            for p in range(1, passes):  # pass 0 is the prompt's prefill
                tokens += 1
                for layer, later in ahead.items():
                    residual = rec.get("ffn_inp", layer, p)  # (1, H)
                    token_ids = rec.get("ffn_moe_tokens", layer, p)  # (1,)
                    for d, target in enumerate(later, 1):
                        guess = routers[target].predict(residual, token_ids)  # (1, k)
                        ids = rec.get("ffn_moe_ids", target, p)  # (1, k)
                        right[layer, d] = right.get((layer, d), 0) + len(np.intersect1d(guess, ids))
                        routed[layer, d] = routed.get((layer, d), 0) + ids.size
    layers: dict[int, dict[int, float]] = {}
    for (layer, d), n in routed.items():
        layers.setdefault(layer, {})[d] = right[layer, d] / n
    distances = sorted({d for _, d in routed})
    overall = {d: sum(right[k] for k in right if k[1] == d) / sum(routed[k] for k in routed if k[1] == d)
               for d in distances}
    return {"layers": layers, "distance": overall, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, nargs="?", default=None, help="a converted model (default: the demo)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48, help="tokens decoded after each prompt")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    model = args.model or demo_model()
    result = measure(model, args.prompts, args.prompt_tokens, args.tokens)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{model}: {result['tokens']} decoded tokens")
    for d, r in result["distance"].items():
        print(f"distance {d}: recall {100 * r:.1f} %")
    for layer, per in result["layers"].items():
        print(f"  layer {layer}: " + ", ".join(f"d{d} {100 * r:.1f} %" for d, r in per.items()))


if __name__ == "__main__":
    main()
