"""Benchmark (not a test): Qwen3.6-35B-A3B dimensions at int4, streamed from disk.

    python tools/bench_qwen36.py make bench-data/qwen36-int4 [--layers 40]
    python tools/bench_qwen36.py run bench-data/qwen36-int4 --ram 8GB [--cache-slots N] [--prompt 4] [--tokens 8]

`make` writes a synthetic container directly in the container format (no Hugging Face checkpoint:
at bf16 it would be ~70 GB): the released checkpoint's config.json (text config nested under
`text_config`, tensors under `model.language_model.*`) and random int4 weights — random nibbles and
float16 scales for every quantised matrix, random float32 for routers, norms, decay parameters.
The numbers it produces are speeds, not text: with random routers the routing is close to uniform,
so expert hit rates are lower than a real model's (whose routing is skewed and repeats).

`run` evicts the expert files from the page cache first (posix_fadvise DONTNEED) and, by default,
reads experts with O_DIRECT, so a miss really reads the disk (the machine's free RAM would otherwise
cache most of the container and hide the disk). It measures the machine's disk read bandwidth for
one-extent preads and its memory bandwidth, then prefills a random prompt and decodes greedily,
and prints: decode tok/s, expert hit rate, bytes read per token, time per token next to its floor
(bytes missed ÷ measured disk bandwidth, plus the compute time: decode time less the I/O stall).
Run heavy steps under `flock /tmp/colibri-cpu.lock` on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from colibri_core import load, quant
from colibri_core.bench.model import drop_file_pages
from colibri_core.sizes import available_memory
from colibri_core.container.reader import (
    ARRAY, MANIFEST, RESIDENT_FILE, SCALES_SUFFIX, crc32_file, expert_extent,
    expert_file_name, extent_crc,
)
from colibri_core.container.writer import _Dumper, _Flow, _FlowList, _manifest, _Plan, pack_extent
from colibri_qwen36.model import Qwen36

HEADROOM = 4 * 10**9  # `--ram fit` leaves this much of the available memory to everything else

# Qwen3.6-35B-A3B (config.json text_config of the released checkpoint)
TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
}


def random_qtensor(rng: np.random.Generator, kind: str, rows: int, cols: int) -> quant.QTensor:
    """A QTensor of random zero-mean values (q uniform in [-7, 7], scales ≈ 0.02 / 7), without a float copy.
    (Uniform nibbles 0..15 would give q a mean of -0.5: a common offset that makes every token's
    hidden state alike, and so its routing.)"""
    parts = {}
    for part, dtype, shape in quant.layout(kind, rows, cols):
        if part == "scales":
            parts[part] = rng.uniform(0.002, 0.004, shape).astype(dtype)
        elif dtype == np.uint8:
            lo, hi = (rng.integers(1, 16, shape, dtype=np.uint8) for _ in range(2))  # nibble q + 8, q in [-7, 7]
            parts[part] = lo | (hi << 4)
        else:
            parts[part] = rng.integers(-127, 128, shape, dtype=np.int8)
    return quant.QTensor(kind, rows, cols, parts["data"], parts.get("scales"))


def small_array(rng: np.random.Generator, name: str, shape) -> np.ndarray:
    if name.endswith("A_log"):
        return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return np.ones(shape, np.float32)
    if "norm" in name and len(shape) == 1:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


def make(dst: Path, layers: int, q: str = "int4") -> None:
    cfg_json = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                "tie_word_embeddings": False, "text_config": {**TEXT_CONFIG, "num_hidden_layers": layers}}
    cfg = Qwen36.parse_config(cfg_json)
    layout = Qwen36.layout(cfg)
    shapes = Qwen36.resident_shapes(cfg)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "experts").mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg_json, indent=2))
    rng = np.random.default_rng(0)

    # resident.safetensors, one tensor at a time
    from safetensors.numpy import save_file
    tensors, plan_resident = {}, []
    for name, shape in shapes.items():
        if layout.stays_f32(name, len(shape)):
            tensors[name] = small_array(rng, name, shape)
            plan_resident.append((name, ARRAY, shape))
        else:
            t = random_qtensor(rng, q, *shape)
            tensors[name] = t.data
            if t.scales is not None:
                tensors[name + SCALES_SUFFIX] = t.scales
            plan_resident.append((name, q, shape))
    save_file(tensors, str(dst / RESIDENT_FILE), metadata={"format": "colibri"})
    del tensors
    resident = {"size": (dst / RESIDENT_FILE).stat().st_size, "crc32": crc32_file(dst / RESIDENT_FILE)}
    print(f"resident: {resident['size'] / 1e9:.2f} GB", file=sys.stderr)

    # one expert file per layer: extent e at e * nbytes
    H, I, E = layout.hidden, layout.intermediate, layout.n_experts
    _, nbytes = expert_extent(q, H, I)
    files = []
    for layer in layout.moe_layers:
        path = dst / expert_file_name(layer)
        crcs, crc, size = [], 0, 0
        import zlib
        with open(path, "wb") as f:
            for e in range(E):
                buf = pack_extent([random_qtensor(rng, q, rows, cols) for rows, cols in ((I, H), (I, H), (H, I))],
                                  layer, e, nbytes)
                crcs.append(extent_crc(buf))
                f.write(buf)
                crc, size = zlib.crc32(buf, crc), size + len(buf)
        files.append({"layer": layer, "path": expert_file_name(layer), "size": size, "crc32": crc,
                      "extent_crc32": _FlowList(crcs)})
        print(f"layer {layer}: {size / 1e9:.2f} GB", file=sys.stderr)

    names = {"gate_up": layout.experts.fused_gate_up, "down": layout.experts.fused_down}
    plan = _Plan("qwen36", q, layout, plan_resident, "fused", names)
    source = {"fingerprint": "synthetic:tools/bench_qwen36.py", "tensors": len(shapes), "bytes": 0, "files": {}}
    copied = {"config.json": _Flow(size=(dst / "config.json").stat().st_size, crc32=crc32_file(dst / "config.json"))}
    manifest = _manifest(plan, "qwen36", "colibri-qwen36", "synthetic", source, copied, resident, files)
    (dst / MANIFEST).write_text(yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=100))


# ---- measuring -------------------------------------------------------------------------------

def disk_bandwidth(paths, nbytes: int, n: int = 200) -> float:
    """Bytes/s of single-threaded preads of whole random extents, from evicted files."""
    drop_file_pages(paths)
    rnd = random.Random(1)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    sizes = [os.fstat(fd).st_size // nbytes for fd in fds]
    t = time.perf_counter()
    for _ in range(n):
        i = rnd.randrange(len(fds))
        os.pread(fds[i], nbytes, rnd.randrange(sizes[i]) * nbytes)
    dt = time.perf_counter() - t
    for fd in fds:
        os.close(fd)
    drop_file_pages(paths)
    return n * nbytes / dt


def memory_bandwidth() -> float:
    """Bytes/s of reading a 512 MB array (NumPy sum), best of 3."""
    a = np.ones(128 << 20, np.float32)
    best = min(_timed(lambda: a.sum()) for _ in range(3))
    return a.nbytes / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(model: Path, ram: str | None, slots: int | None, prompt_len: int, tokens: int, keep_cache: bool,
        warm: bool = False, routing: str = "model", prefetch: bool = True) -> dict:
    if routing == "uniform":  # every token picks k distinct experts uniformly at random: LRU's worst case
        import colibri_qwen36.model as qm

        pick = np.random.default_rng(2)

        def uniform_topk(logits, k, renormalize):
            ids = np.stack([pick.choice(logits.shape[1], k, replace=False) for _ in range(logits.shape[0])])
            return np.full(ids.shape, 1 / k, np.float32), ids

        qm.softmax_topk = uniform_topk
    paths = sorted(str(p) for p in (model / "experts").glob("*.bin"))
    if ram == "fit":  # the largest budget that leaves HEADROOM of the machine's available memory to others
        ram = str(int(available_memory() - HEADROOM))
    engine = load(model, ram=ram, cache_slots=slots, direct=not keep_cache, prefetch=prefetch)  # O_DIRECT: every miss reads the disk
    c = engine.container
    disk = disk_bandwidth(paths, c.expert_nbytes)
    mem = memory_bandwidth()
    if warm:  # fill every layer's cache before measuring (steady state instead of a cold start)
        for layer in c.moe_layers:
            for e in range(engine.store.slots):
                engine.store.get(layer, e)
    drop_file_pages(paths)
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, engine.model.cfg.vocab_size, prompt_len)]
    s = engine.store
    t0 = time.perf_counter()
    stream = engine.stream(prompt, tokens, stop_ids=())
    next(stream)
    prefill = time.perf_counter() - t0
    keys = ("expert_hits", "expert_misses", "bytes_read", "io_stall_seconds")
    base = [s.stats()[k] for k in keys]
    t1 = time.perf_counter()
    n = 1 + sum(1 for _ in stream)
    decode = time.perf_counter() - t1
    steps = n - 1
    hits, misses, bytes_read, io = (s.stats()[k] - b for k, b in zip(keys, base))  # io: decode waiting on reads
    st = engine.stats()
    per_tok = decode / steps
    out = {
        "ram": ram, "warm_start": warm, "routing": routing, "cache_slots_per_layer": s.slots, "experts_per_layer": c.n_experts,
        "resident_gb": engine.resident_bytes / 1e9, "cache_gb_full": s.slots * len(c.moe_layers) * c.expert_nbytes / 1e9,
        "disk_gbps": disk / 1e9, "mem_gbps": mem / 1e9,
        "prompt_tokens": prompt_len, "prefill_s": prefill, "decode_tokens": steps,
        "decode_tok_s": steps / decode, "s_per_token": per_tok,
        "decode_hit_rate": hits / max(1, hits + misses), "overall_hit_rate": st["hit_rate"],
        "gb_read_per_token": bytes_read / steps / 1e9,
        "io_s_per_token": io / steps, "compute_s_per_token": (decode - io) / steps,
        "disk_floor_s_per_token": bytes_read / steps / disk,
        "peak_rss_gb": st["peak_rss_bytes"] / 1e9,
    }
    out["floor_s_per_token"] = out["disk_floor_s_per_token"] + out["compute_s_per_token"]
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the synthetic container")
    m.add_argument("dst", type=Path)
    m.add_argument("--layers", type=int, default=40)
    r = sub.add_parser("run", help="measure")
    r.add_argument("model", type=Path)
    r.add_argument("--ram", default=None, help='budget ("8GB"), or "fit": available memory minus 4 GB')
    r.add_argument("--warm", action="store_true", help="fill the expert caches before measuring")
    r.add_argument("--routing", choices=("model", "uniform"), default="model",
                   help="the (random) model's router, or uniform random top-k per token (worst case for the cache)")
    r.add_argument("--cache-slots", type=int, default=None)
    r.add_argument("--prompt", type=int, default=4)
    r.add_argument("--tokens", type=int, default=8)
    r.add_argument("--no-prefetch", action="store_true", help="no router lookahead (the store reads on demand only)")
    r.add_argument("--keep-page-cache", action="store_true", help="read through the page cache (no O_DIRECT)")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.dst, a.layers)
    else:
        print(json.dumps(run(a.model, a.ram, a.cache_slots, a.prompt, a.tokens, a.keep_page_cache, a.warm, a.routing,
                             not a.no_prefetch), indent=1))


if __name__ == "__main__":
    main()
