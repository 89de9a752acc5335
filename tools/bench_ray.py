"""Remote expert shards on a loopback Ray cluster vs local-disk streaming, at the same local RAM budget.

    python tools/make_synthetic_olmoe.py bench-data/olmoe-synth-4 --layers 4
    flock /tmp/colibri-cpu.lock .venv/bin/python tools/bench_ray.py bench-data/olmoe-synth-4 --ram-share 0.25

Starts `ray.cluster_utils.Cluster` (a head, where this driver runs, and `--workers` nodes of
`--node-memory` each), then decodes the same prompts twice with a local budget of the dense weights
+ `--ram-share` of the experts: once streaming the other experts from the local disk (O_DIRECT,
page cache dropped where allowed), once with them held by the cluster's nodes (`load(ray=...)`).
Sampling at temperature 1 with a fixed seed per prompt; both runs must produce the same tokens.
Prints one JSON object: decode tok/s, disk reads and remote calls per token, the mean remote call
latency, bytes sent and received per token.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import colibri_core
from colibri_core.container import Container

PROMPTS = [[11, 52, 903, 4, 77, 1500, 3, 640], [7, 7, 301, 2047, 88, 12, 965, 400], [1000, 2, 3, 4, 5, 6, 7, 8]]


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def session(engine, new_tokens: int) -> dict:
    tokens, decode, generated = [], 0.0, 0
    before = engine.stats()
    for i, prompt in enumerate(PROMPTS):
        engine.counters["decode_seconds"] = 0.0
        gen_before = engine.counters["generated_tokens"]
        out = engine.generate(prompt, new_tokens, temperature=1.0, seed=i, stop_ids=())
        decode += engine.counters["decode_seconds"]
        generated += engine.counters["generated_tokens"] - gen_before - 1  # decoded after the first token
        tokens.append(out)
    s = engine.stats()
    d = {k: s.get(k, 0) - before.get(k, 0) for k in ("reads", "bytes_read", "remote_calls", "remote_seconds",
                                                      "remote_bytes_sent", "remote_bytes_received", "io_stall_seconds")
         if isinstance(s.get(k, 0), (int, float))}
    answered = s["remote_latency"]["count"] - before["remote_latency"]["count"] if "remote_latency" in s else 0
    n = sum(len(t) for t in tokens)
    return {"tokens": tokens, "decode_tokens_per_second": generated / decode, "decoded": generated,
            "disk_reads_per_token": d["reads"] / n, "disk_bytes_per_token": d["bytes_read"] / n,
            "io_stall_seconds": d["io_stall_seconds"],
            "remote_calls_per_token": d.get("remote_calls", 0) / n,
            "remote_call_ms_mean": 1e3 * d.get("remote_seconds", 0) / answered if answered else None,
            "remote_ms_per_token": 1e3 * d.get("remote_seconds", 0) / n,
            "remote_bytes_sent_per_token": d.get("remote_bytes_sent", 0) / n,
            "remote_bytes_received_per_token": d.get("remote_bytes_received", 0) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--ram-share", type=float, default=0.25, help="share of the experts the local budget holds")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--node-memory", default="2GB")
    ap.add_argument("--split", default="expert")
    ap.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from colibri_core.sizes import parse_size

    c = Container(args.model)
    experts = len(c.moe_layers) * c.n_experts * c.expert_nbytes
    budget = c.resident_nbytes + int(args.ram_share * experts)
    c.close()
    opts = dict(ram=budget, usage=False, direct=args.direct, pin_gb=0)
    result = {"model": str(args.model), "ram_budget": budget, "ram_share": args.ram_share, "split": args.split,
              "workers": args.workers}
    # 1. local-disk streaming
    result["page_cache_dropped"] = drop_caches()
    with colibri_core.load(args.model, **opts) as e:
        e.generate(PROMPTS[0][:2], 2, stop_ids=())  # kernels and first reads out of the way
        local = session(e, args.tokens)
        result["cache_slots"] = e.split.cache_slots
    # 2. the same budget, the other experts on the cluster's nodes
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=100 << 20,
                                                                include_dashboard=False))
    for _ in range(args.workers):
        cluster.add_node(num_cpus=1, object_store_memory=100 << 20, memory=parse_size(args.node_memory))
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    result["cluster_start_seconds"] = time.perf_counter() - t0
    try:
        drop_caches()
        t0 = time.perf_counter()
        with colibri_core.load(args.model, ray=cluster.address, ray_options={"split": args.split}, **opts) as e:
            result["ray_load_seconds"] = time.perf_counter() - t0
            deadline = time.monotonic() + 300
            while any(st.warming for st in e.experts.remote.shards) and time.monotonic() < deadline:
                e.experts.remote.maintain()  # wait for the shards to hold every expert in RAM
                time.sleep(0.2)
            result["shards_warm_seconds"] = time.perf_counter() - t0
            e.generate(PROMPTS[0][:2], 2, stop_ids=())
            remote = session(e, args.tokens)
            result["placement"] = {r["address"] + "/" + r["node"][:8]: r["placement"]
                                   for r in e.stats()["remote_shard_table"].values()}
    finally:
        ray.shutdown()
        cluster.shutdown()
    result["identical_tokens"] = local.pop("tokens") == remote.pop("tokens")
    result["local_disk"], result["ray"] = local, remote
    print(json.dumps(result, indent=2, default=lambda v: float(v) if isinstance(v, np.floating) else str(v)))


if __name__ == "__main__":
    main()
