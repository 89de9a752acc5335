"""Benchmark (not a test): a model at its real dimensions, from a synthetic int4 container, resident
and streamed from disk.

    python tools/bench_real_dims.py make bench-data/qwen36-int4 [--arch qwen36] [--layers 40]
    python tools/bench_real_dims.py make bench-data/glm52-slice --arch glm52 --layers 6
    python tools/bench_real_dims.py run bench-data/qwen36-int4 --ram 8GB|fit [--cache-slots N] [--warm]
        [--prompt 4] [--tokens 8] [--no-prefetch]
    python tools/bench_real_dims.py alternate bench-data/qwen36-int4 lookahead|transient --ram 8GB [--rounds 6]
        [--same-prompt]

Architectures (`--arch`): `qwen36`, Qwen3.6-35B-A3B (the released config; every one of its 40 layers
fits this machine: 17.9 GB); `glm52`, GLM-5.2 (the config the plugin's plan test reconstructs,
plugins/glm52/tests/data/glm52_config.json): 78 layers, 390 GB of experts at int4 — no machine here
holds it, so `--layers N` makes a *slice*, its first N layers (3 dense, then MoE: 5.1 GB of experts
a layer) at the real per-layer dimensions, without the MTP layer.

`make` writes the container directly in the container format (no Hugging Face checkpoint: Qwen3.6 at
bf16 would be ~70 GB): the config.json and random int4 weights — random nibbles and float16 scales
for every quantised matrix, random float32 for routers, norms, decay parameters. The numbers it
produces are speeds, not text: with random routers the routing is close to uniform, so expert hit
rates are lower than a real model's (whose routing is skewed and repeats).

`run` evicts the expert files from the page cache first (posix_fadvise DONTNEED) and, by default,
reads experts with O_DIRECT, so a miss really reads the disk (the machine's free RAM would otherwise
cache most of the container and hide the disk). It measures the disk bandwidth of the store's own
reads (random extents, O_DIRECT, 8 in flight) and, after decoding, the memory read bandwidth
(`colibri bench kernels`' probe); it prefills a random prompt and decodes greedily, and prints:
decode tok/s, expert hit rate, bytes read per token, time per token next to its floors: the disk floor (bytes missed ÷ disk bandwidth, plus the compute
time: decode time less the I/O stall) and the bandwidth floor (the bytes a token touches —
`bench_resident_floor.bytes_per_token` — ÷ read bandwidth: what a resident step could take at best).
`--warm` reads the hot-store and fills every layer's cache first (a steady state, not a cold start;
without it the hot-store is read in the background while the measured tokens decode).

`alternate` measures a store option against its absence in one warm engine, decode segments with it
on and off taking turns, so the machine's drift and the cache's state hit both alike: the router
lookahead, or the reads past the slots of a budget under top-k slots a layer.

For a slice, every decoder layer is timed (GLM-5.2's `_decoder_layer`), and the whole model's decode
step is *extrapolated*: the slice's step, plus each missing dense or MoE layer at the median time of
those measured (the MoE layers' medians include their misses and reads at this budget), with the
whole model's floors beside it. Run heavy steps under `flock /tmp/colibri-cpu.lock` on a shared
machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import numpy as np
import yaml

from bench_resident_floor import bytes_per_token
from colibri_core import load, planning, quant
from colibri_core.planning import memory_bandwidth as read_bandwidth
from colibri_core.bench.model import _TokenReads, drop_file_pages
from colibri_core.sizes import available_memory
from colibri_core.container.reader import (
    ARRAY, MANIFEST, RESIDENT_FILE, SCALES_SUFFIX, crc32_file, expert_extent,
    expert_file_name, extent_crc,
)
from colibri_core.container.writer import _Dumper, _Flow, _FlowList, _manifest, _Plan, pack_extent
from colibri_glm52.model import Glm52
from colibri_qwen36.model import Qwen36

ROOT = Path(__file__).resolve().parent.parent
HEADROOM = 4 * 10**9  # `--ram fit` leaves this much of the available memory to everything else

# Qwen3.6-35B-A3B (config.json text_config of the released checkpoint)
QWEN36_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
}


def qwen36_config(layers: int) -> dict:
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": {**QWEN36_TEXT_CONFIG, "num_hidden_layers": layers}}


def glm52_config(layers: int) -> dict:
    """GLM-5.2's config (as the plan test reconstructs it) with its first `layers` layers and no MTP layer."""
    cfg = json.loads((ROOT / "plugins/glm52/tests/data/glm52_config.json").read_text())
    cfg.pop("_colibri_note")
    return {**cfg, "num_hidden_layers": layers, "num_nextn_predict_layers": 0}


@dataclass(frozen=True)
class Arch:
    model: type  # the plugin's model class
    package: str  # its distribution
    config: Callable[[int], dict]  # layers -> config.json of the model's first `layers` layers
    layers: int  # the released model's (main) layers
    norms_scale: bool  # RMSNorm weights multiply (≈ 1); else they are zero-centred (1 + w, w ≈ 0)


ARCHS = {
    "qwen36": Arch(Qwen36, "colibri-qwen36", qwen36_config, 40, norms_scale=False),
    "glm52": Arch(Glm52, "colibri-glm52", glm52_config, 78, norms_scale=True),
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


def small_array(rng: np.random.Generator, name: str, shape, norms_scale: bool) -> np.ndarray:
    """A float32 tensor (router, norm, bias, decay parameter) of a believable size."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return np.ones(shape, np.float32)
    noise = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    if norms_scale and "norm" in name and name.endswith(".weight") and len(shape) == 1:
        return 1 + noise  # an RMSNorm or LayerNorm weight (GLM-5.2); Qwen3.6's are zero-centred
    return noise


def make(dst: Path, arch_name: str, layers: int, q: str = "int4") -> None:
    arch = ARCHS[arch_name]
    cfg_json = arch.config(layers)
    cfg = arch.model.parse_config(cfg_json)
    layout = arch.model.layout(cfg)
    shapes = arch.model.resident_shapes(cfg)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "experts").mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg_json, indent=2))
    rng = np.random.default_rng(0)

    # resident.safetensors, one tensor at a time
    from safetensors.numpy import save_file
    tensors, plan_resident = {}, []
    for name, shape in shapes.items():
        if layout.stays_f32(name, len(shape)):
            tensors[name] = small_array(rng, name, shape, arch.norms_scale)
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
    plan = _Plan(arch_name, q, layout, plan_resident, "fused", names)
    source = {"fingerprint": "synthetic:tools/bench_real_dims.py", "tensors": len(shapes), "bytes": 0, "files": {}}
    copied = {"config.json": _Flow(size=(dst / "config.json").stat().st_size, crc32=crc32_file(dst / "config.json"))}
    manifest = _manifest(plan, arch_name, arch.package, "synthetic", source, copied, resident, files)
    (dst / MANIFEST).write_text(yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=100))


# ---- measuring -------------------------------------------------------------------------------

def disk_bandwidth(container, nbytes: int = 1 << 30) -> float:
    """Bytes/s of the store's own reads: random whole expert extents, O_DIRECT, 8 in flight on a
    4-thread I/O pool, crc32 computed (`colibri bench`'s disk term)."""
    reads = _TokenReads(container, seed=1)
    try:
        return reads.bandwidth(nbytes)
    finally:
        reads.close()


class LayerClock:
    """Seconds each decoder layer takes, step by step: wraps the model's per-layer method (GLM-5.2's
    `_decoder_layer`), so that a slice's layers can be extrapolated to the whole model."""

    def __init__(self, model):
        self.seconds: dict[int, list[float]] = {}  # layer -> seconds of each step since `clear`
        inner = model._decoder_layer

        def timed(L, *args):
            t = time.perf_counter()
            out = inner(L, *args)
            self.seconds.setdefault(L["layer"], []).append(time.perf_counter() - t)
            return out

        model._decoder_layer = timed

    def clear(self) -> None:
        self.seconds.clear()

    def median(self, layers) -> float:
        """The median over `layers` of each one's median step."""
        return float(np.median([np.median(self.seconds[i]) for i in layers]))


def whole_model(engine, arch: Arch, clock: LayerClock, out: dict, steps: int, bytes_read: int) -> dict:
    """The whole model's decode step extrapolated from a slice's (`out`, measured): each missing dense
    or MoE layer at the median of the slice's, its floors at the bandwidths measured beside it."""
    c, cfg = engine.container, arch.model.parse_config(arch.config(arch.layers))
    moe, slice_layers = set(c.moe_layers), range(engine.model.cfg.num_hidden_layers)
    dense = [i for i in slice_layers if i not in moe]
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.num_hidden_layers - n_moe
    dense_s, moe_s = clock.median(dense), clock.median(c.moe_layers)
    sizes = planning.plan(arch.model, cfg, "int4")
    layout = arch.model.layout(cfg)
    embed = "model.embed_tokens.weight"
    touched = (sizes["resident_bytes"] - planning.tensor_bytes(layout, embed, arch.model.resident_shapes(cfg)[embed], "int4")
               + n_moe * sizes["top_k"] * sizes["expert_bytes"])
    read = bytes_read / steps / len(c.moe_layers) * n_moe  # a MoE layer's reads a token, every MoE layer
    step = out["s_per_token"] + (n_dense - len(dense)) * dense_s + (n_moe - len(c.moe_layers)) * moe_s
    return {
        "layers": cfg.num_hidden_layers, "dense_layers": n_dense, "moe_layers": n_moe,
        "dense_layer_s": dense_s, "moe_layer_s": moe_s,
        "outside_layers_s": out["s_per_token"] - sum(np.median(v) for v in clock.seconds.values()),
        "s_per_token": step, "tok_s": 1 / step,
        "touched_gb_per_token": touched / 1e9, "bandwidth_floor_s_per_token": touched / (out["mem_gbps"] * 1e9),
        "gb_read_per_token": read / 1e9, "disk_floor_s_per_token": read / (out["disk_gbps"] * 1e9),
        "ram_for_these_slots_gb": (sizes["resident_bytes"] + n_moe * engine.store.slots * sizes["expert_bytes"]) / 1e9,
    }


def budget(ram: str | None) -> str | None:
    """`ram` as `load` takes it; "fit" is the largest budget that leaves HEADROOM of the machine's
    available memory to others."""
    return str(int(available_memory() - HEADROOM)) if ram == "fit" else ram


def warm(engine) -> None:
    """Read the hot-store and fill every layer's cache (a steady state, not a cold start)."""
    engine.store.warm_up()
    for layer in engine.container.moe_layers:
        for e in range(engine.store.slots):
            engine.store.get(layer, e)


def run(model: Path, ram: str | None, slots: int | None, prompt_len: int, tokens: int, keep_cache: bool,
        warm_start: bool = False, prefetch: bool = True) -> dict:
    paths = sorted(str(p) for p in (model / "experts").glob("*.bin"))
    ram = budget(ram)
    engine = load(model, ram=ram, cache_slots=slots, direct=not keep_cache, prefetch=prefetch)  # O_DIRECT: every miss reads the disk
    c = engine.container
    arch = ARCHS[c.architecture]
    disk = disk_bandwidth(c)
    if warm_start:
        warm(engine)
    drop_file_pages(paths)
    sliced = engine.model.cfg.num_hidden_layers < arch.layers
    clock = LayerClock(engine.model) if sliced and hasattr(engine.model, "_decoder_layer") else None
    if sliced and clock is None:
        print(f"{c.architecture}: a slice, but its model has no per-layer method to time: not extrapolated",
              file=sys.stderr)
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, engine.model.cfg.vocab_size, prompt_len)]
    s = engine.store
    t0 = time.perf_counter()
    stream = engine.stream(prompt, tokens, stop_ids=())
    next(stream)
    prefill = time.perf_counter() - t0
    if clock is not None:
        clock.clear()  # decode steps only
    keys = ("expert_hits", "expert_misses", "bytes_read", "io_stall_seconds")
    base = [s.stats()[k] for k in keys]
    t1 = time.perf_counter()
    n = 1 + sum(1 for _ in stream)
    decode = time.perf_counter() - t1
    steps = n - 1
    hits, misses, bytes_read, io = (s.stats()[k] - b for k, b in zip(keys, base))  # io: decode waiting on reads
    mem = read_bandwidth()  # after decoding: the probe sweeps the caches
    touched = bytes_per_token(engine)
    st = engine.stats()
    per_tok = decode / steps
    out = {
        "architecture": c.architecture, "layers": engine.model.cfg.num_hidden_layers,
        "ram": ram, "warm_start": warm_start, "cache_slots_per_layer": s.slots, "experts_per_layer": c.n_experts,
        "resident_gb": engine.resident_bytes / 1e9, "cache_gb_full": s.slots * len(c.moe_layers) * c.expert_nbytes / 1e9,
        "disk_gbps": disk / 1e9, "mem_gbps": mem / 1e9,
        "prompt_tokens": prompt_len, "prefill_s": prefill, "decode_tokens": steps,
        "decode_tok_s": steps / decode, "s_per_token": per_tok,
        "decode_hit_rate": hits / max(1, hits + misses), "overall_hit_rate": st["hit_rate"],
        "gb_read_per_token": bytes_read / steps / 1e9,
        "io_s_per_token": io / steps, "compute_s_per_token": (decode - io) / steps,
        "disk_floor_s_per_token": bytes_read / steps / disk,
        "touched_gb_per_token": touched / 1e9, "bandwidth_floor_s_per_token": touched / mem,
        "peak_rss_gb": st["peak_rss_bytes"] / 1e9,
    }
    out["floor_s_per_token"] = out["disk_floor_s_per_token"] + out["compute_s_per_token"]
    if clock is not None:
        out["whole_model_extrapolated"] = whole_model(engine, arch, clock, out, steps, bytes_read)
    engine.close()
    return out


# store options `alternate` can switch in a running engine: (StoreConfig field, its value when off)
SWITCHES = {"lookahead": ("prefetch", False), "transient": ("transient", 0)}


def alternate(model: Path, switch: str, ram: str | None, slots: int | None, rounds: int, tokens: int,
              same_prompt: bool) -> dict:
    """A store option on and off in one warm engine, decode segments alternated (on, off, then off,
    on, …): ms a token of each, with the misses and reads a token. `switch`: "lookahead" (the router
    lookahead) or "transient" (reads past the slots: a budget under top-k slots a layer). Each segment
    decodes after a new random prompt (some misses), or with `same_prompt` the same one every time."""
    engine = load(model, ram=budget(ram), cache_slots=slots, direct=True)
    field, off = SWITCHES[switch]
    on = getattr(engine.store.config, field)
    if on == off:
        raise SystemExit(f"{switch} is off at this budget already ({engine.store.slots} slots a layer): nothing to compare")
    warm(engine)
    rng = np.random.default_rng(0)
    first = [int(i) for i in rng.integers(0, engine.model.cfg.vocab_size, 4)]
    keys = ("expert_misses", "reads", "prefetch_issued", "prefetch_used", "io_stall_seconds")
    seconds, counts = {on: [], off: []}, {on: [], off: []}
    for r in range(rounds):
        for value in (on, off) if r % 2 == 0 else (off, on):
            setattr(engine.store.config, field, value)
            prompt = first if same_prompt else [int(i) for i in rng.integers(0, engine.model.cfg.vocab_size, 4)]
            stream = engine.stream(prompt, tokens + 1, stop_ids=())
            next(stream)  # prefill
            before = engine.store.stats()
            t = time.perf_counter()
            n = sum(1 for _ in stream)
            seconds[value].append((time.perf_counter() - t) / n)
            after = engine.store.stats()
            counts[value].append([(after[k] - before[k]) / n for k in keys])
    engine.close()
    return {f"{switch} {'on' if value == on else 'off'} ({field}={value})": {
                "ms_per_token": [round(x * 1e3, 1) for x in seconds[value]],
                "median_ms_per_token": round(float(np.median(seconds[value])) * 1e3, 1),
                **{f"{k}_per_token": round(float(np.median([c[i] for c in counts[value]])), 3) for i, k in enumerate(keys)}}
            for value in (on, off)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the synthetic container")
    m.add_argument("dst", type=Path)
    m.add_argument("--arch", choices=sorted(ARCHS), default="qwen36")
    m.add_argument("--layers", type=int, default=None, help="the first N layers (default: every layer)")
    r = sub.add_parser("run", help="measure")
    r.add_argument("model", type=Path)
    r.add_argument("--ram", default=None, help='budget ("8GB"), or "fit": available memory minus 4 GB')
    r.add_argument("--warm", action="store_true", help="read the hot-store and fill the expert caches before measuring")
    r.add_argument("--cache-slots", type=int, default=None)
    r.add_argument("--prompt", type=int, default=4)
    r.add_argument("--tokens", type=int, default=8)
    r.add_argument("--no-prefetch", action="store_true", help="no router lookahead (the store reads on demand only)")
    r.add_argument("--keep-page-cache", action="store_true", help="read through the page cache (no O_DIRECT)")
    al = sub.add_parser("alternate", help="a store option on and off, alternated in one warm engine")
    al.add_argument("model", type=Path)
    al.add_argument("switch", choices=sorted(SWITCHES))
    al.add_argument("--ram", default=None, help='budget ("8GB"), or "fit"')
    al.add_argument("--cache-slots", type=int, default=None)
    al.add_argument("--rounds", type=int, default=6, help="pairs of segments")
    al.add_argument("--tokens", type=int, default=16, help="tokens a segment")
    al.add_argument("--same-prompt", action="store_true", help="every segment after the same prompt (nearly all hits)")
    a = ap.parse_args()
    if a.cmd == "alternate":
        print(json.dumps(alternate(a.model, a.switch, a.ram, a.cache_slots, a.rounds, a.tokens, a.same_prompt), indent=1))
    elif a.cmd == "make":
        make(a.dst, a.arch, a.layers or ARCHS[a.arch].layers)
    else:
        print(json.dumps(run(a.model, a.ram, a.cache_slots, a.prompt, a.tokens, a.keep_page_cache, a.warm,
                             not a.no_prefetch), indent=1))


if __name__ == "__main__":
    main()
