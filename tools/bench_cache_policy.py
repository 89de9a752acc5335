"""Benchmark: the expert cache's eviction policies on a workload that changes topic halfway — bytes
of experts read per generated token and the cache's hit rate before and after the shift, for each
policy and cache size, printed as one JSON object (and a table on stderr).

    flock /tmp/colibri-cpu.lock .venv/bin/python tools/bench_cache_policy.py [MODEL_DIR]
        [--policies lru,lfu,lfu_aging] [--fractions 0.25,0.5] [--tokens 48] [--rounds-a 3] [--clients 1]

The workload (`PHASES`): phase A, prompts in the demo model's own domain (the King James Bible's
narrative and law), then phase B, prompts of another kind (modern English on machines and trade, and
French), each prompt sampled for --tokens tokens (temperature 0.7, a seed of its own); phase A's
prompts run --rounds-a times (other seeds), a user with a long history on one subject; --clients of
them decoded together (`Engine.generate_batch`; 1: one after another). One engine per policy and
cache size, in process: `--cache-slots` = the fraction of each layer's experts, no hot-store, no
routing history, prefetch on (as `colibri serve` runs). Phase B is reported in two halves (the first
prompts after the shift, then the rest) so that a policy slow to forget shows in the first. How far
the routing moved is printed too: per MoE layer, the total variation distance between the two
phases' expert frequencies, averaged. Bytes a token count the prompts' prefill reads too, as
tools/bench_serve.py does. Every policy must generate the same tokens (the tool checks it).

MODEL_DIR defaults to the bundled demo model (colibri_core/demo), a trained router; the prompts are
text, so the model needs a tokenizer that reads English. Numbers go to BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

import colibri_core
from colibri_core.demo import demo_model

PHASES = {
    "A": [
        "In the beginning God created the heaven and the earth.",
        "And Moses said unto the people, Fear ye not, stand still,",
        "Thou shalt love the LORD thy God with all thine heart,",
        "And the children of Israel journeyed from Rameses to Succoth,",
        "And Abraham rose up early in the morning, and saddled his ass,",
        "These are the generations of Jacob. Joseph, being seventeen years old,",
        "And it came to pass, when the king had heard the words of the law,",
        "Blessed is the man that walketh not in the counsel of the ungodly,",
        "And David went up, and wept as he went up, and had his head covered,",
        "Then answered Jesus and said unto them, Verily, verily, I say unto you,",
        "And he shall offer the bullock for a sin offering upon the altar,",
        "And the word of the LORD came unto Jonah the son of Amittai, saying,",
    ],
    "B": [
        "The quarterly report shows that revenue from cloud services grew by",
        "To install the package, open a terminal and run the following command:",
        "The engine's memory controller reads two cache lines per cycle, so",
        "Le gouvernement a annoncé hier une nouvelle réforme des retraites qui",
        "Our startup builds software that helps small businesses track invoices",
        "The train to Paris leaves at nine o'clock; passengers should check",
        "Nous avons visité le musée du Louvre pendant les vacances d'été avec",
        "Click the button in the top right corner to export your data as CSV",
        "The stock market fell sharply on Tuesday after the central bank raised",
        "La recette demande trois œufs, deux cents grammes de farine et du lait",
        "Researchers at the university trained a neural network on satellite images",
        "Please reset your password within 24 hours using the link in this email",
    ],
}


def prompts(engine) -> dict[str, list[list[int]]]:
    return {phase: [engine.tokenizer.encode(t) for t in texts] for phase, texts in PHASES.items()}


def run_phase(engine, batch: list[list[int]], first_seed: int, tokens: int, clients: int):
    """Generate `tokens` for each prompt of `batch`, `clients` at a time; returns the tokens, and the
    store's bytes read, hits and lookups, and the tokens generated, over the phase."""
    before = engine.stats()
    out = []
    for i in range(0, len(batch), clients):
        group = batch[i:i + clients]
        if clients == 1:
            out.append(engine.generate(group[0], tokens, temperature=0.7, seed=first_seed + i, stop_ids=()))
        else:  # one seed for the batch: each generation draws from its own sampler
            out += engine.generate_batch(group, tokens, temperature=0.7, seed=first_seed + i, stop_ids=())
    after = engine.stats()
    lookups = (after["expert_hits"] + after["expert_misses"]) - (before["expert_hits"] + before["expert_misses"])
    generated = after["generated_tokens"] - before["generated_tokens"]
    hits = after["expert_hits"] - before["expert_hits"]
    return out, {"bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / generated,
                 "hit_rate": hits / lookups, "generated_tokens": generated}


def routing_shift(model, sets: dict[str, list[list[int]]]) -> float:
    """Mean over MoE layers of the total variation distance between the experts' shares of phase A's
    routing and phase B's (prompts only: the routing of their prefill), from the probe."""
    from colibri_core import probe

    shares = {}
    with colibri_core.load(model, cache_slots=10**6, usage=False, prefetch=False) as engine:
        layers, E = engine.container.moe_layers, engine.container.n_experts
        for phase, batch in sets.items():
            counts = np.zeros((len(layers), E))
            with probe.recording(names=("ffn_moe_ids",)) as rec:
                for p in batch:
                    engine.logits(p)
            for i, layer in enumerate(layers):
                for ids in rec.tensors[("ffn_moe_ids", layer)]:
                    counts[i] += np.bincount(np.asarray(ids).ravel(), minlength=E)
            shares[phase] = counts / counts.sum(axis=1, keepdims=True)
    return float(0.5 * np.abs(shares["A"] - shares["B"]).sum(axis=1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(demo_model()), help="model directory (default: the demo)")
    ap.add_argument("--policies", default="lru,lfu,lfu_aging")
    ap.add_argument("--fractions", default="0.25,0.5", help="cache slots as fractions of each layer's experts")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per prompt")
    ap.add_argument("--rounds-a", type=int, default=3, help="times phase A's prompts run before the shift")
    ap.add_argument("--clients", type=int, default=1, help="prompts decoded together")
    args = ap.parse_args()

    result = {"model": args.model, "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
              "tokens": args.tokens, "rounds_a": args.rounds_a, "clients": args.clients, "runs": []}
    with colibri_core.load(args.model, cache_slots=1, usage=False) as engine:
        E, sets = engine.container.n_experts, prompts(engine)
    half = len(sets["B"]) // 2
    parts = {"A": sets["A"] * args.rounds_a, "B, first half": sets["B"][:half], "B, second half": sets["B"][half:]}
    tokens_of = {}  # phase -> the tokens every policy must generate
    for fraction in map(float, args.fractions.split(",")):
        for policy in args.policies.split(","):
            slots = max(1, round(fraction * E))
            with colibri_core.load(args.model, cache_slots=slots, pin_gb=0, usage=False, policy=policy,
                                   prefix_cache=0) as engine:
                run = {"policy": policy, "fraction": fraction, "slots": slots, "experts": E, "phases": {}}
                t0 = time.perf_counter()
                for seed, (name, batch) in enumerate(parts.items()):
                    out, figures = run_phase(engine, batch, 1000 * seed, args.tokens, args.clients)
                    if tokens_of.setdefault(name, out) != out:
                        sys.exit(f"policy {policy} generated other tokens than {args.policies.split(',')[0]} in "
                                 f"phase {name}: eviction must never change an output")
                    run["phases"][name] = figures
                run["seconds"] = time.perf_counter() - t0
            result["runs"].append(run)
            cells = "  ".join(f"{name}: {f['bytes_read_per_token'] / 1e3:8.1f} kB/tok hit {f['hit_rate']:.3f}"
                              for name, f in run["phases"].items())
            print(f"{fraction:4.0%} {slots:3d}/{E} {policy:10s} {cells}", file=sys.stderr, flush=True)
    result["routing_shift_tvd"] = routing_shift(args.model, sets)
    print(f"routing shift A -> B: mean total variation distance {result['routing_shift_tvd']:.3f}", file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
