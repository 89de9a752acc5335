"""Write a synthetic colibri container with OLMoE-1B-7B's dimensions at int4 (≈3.6 GB), for benchmarks.

    python tools/make_synthetic_olmoe.py bench-data/olmoe-synth [--layers 16] [--seed 0]

Random weights written straight in the container format (no HF checkpoint, no quantisation pass):
int4 values drawn uniformly from -7..7 (mean 0), one float16 scale per group sized so weights have
std ≈ 0.02. Routing is skewed the way real MoE routers are: column 0 of the embedding is a large
constant, so the normalised hidden state keeps a steady component along it, and each layer's router
row e carries a popularity term along that component (a per-layer permutation of a decaying
profile). In every layer the top quarter of the experts takes about two thirds of the routings and
most experts are used now and then; since the steady component persists across layers, router
lookahead predicts well — as on real models.

The result is a normal container: `colibri run`, `plan`, `doctor --deep` and `bench` read it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from importlib.metadata import version
from pathlib import Path

import numpy as np
import yaml

from colibri_core import quant as q
from colibri_core.container.reader import (
    ARRAY, MANIFEST, RESIDENT_FILE, SCALES_SUFFIX, ST_NAME, expert_extent,
    expert_file_name, extent_crc,
)
from colibri_core.container.writer import _Dumper, _Flow, _FlowList, _manifest, _Plan, pack_extent
from colibri_olmoe.model import Olmoe

OLMOE_1B_7B = {  # allenai/OLMoE-1B-7B-0924 config.json (the fields colibri reads)
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
    "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "clip_qkv": None, "max_position_embeddings": 4096, "hidden_act": "silu",
    "tie_word_embeddings": False, "eos_token_id": None,
}
WEIGHT_STD = 0.02
STEADY = 8.0  # the embedding's constant column 0
POPULARITY = 0.6  # router weight along column 0 of the most popular expert (top quarter: ~2/3 of routings)
OUT_STD = 0.005  # o_proj and expert down: small writes to the residual stream, which persists across layers


def int4_random(rng, rows: int, cols: int, std: float = WEIGHT_STD) -> q.QTensor:
    """A random int4 matrix: q uniform in -7..7 (mean 0, std 4.3), scales for weights of std `std`.

    Not all 16 nibbles: q = -8 would give every weight a mean of -std/9, and every matrix would then
    add the same offset to all its outputs; layer after layer that common part grows until the
    residual stream is the same for every token (norm 46 -> 6450 over 16 layers) and later layers
    route every token to the same few experts."""
    (_, _, dshape), (_, _, sshape) = q.layout("int4", rows, cols)
    nibbles = rng.integers(1, 16, (*dshape, 2), dtype=np.uint8)  # q + 8, two per byte
    data = nibbles[..., 0] | (nibbles[..., 1] << 4)
    scales = np.full(sshape, std / 4.32, np.float16)
    return q.QTensor("int4", rows, cols, data, scales)


def router(rng, E: int, H: int) -> np.ndarray:
    """(E, H) float32: noise plus a popularity term along hidden unit 0."""
    profile = POPULARITY * (1 - np.arange(E) / E) ** 3  # decaying: a few experts are popular
    w = (rng.standard_normal((E, H)) * 0.05).astype(np.float32)
    w[:, 0] = profile[rng.permutation(E)]
    return w


def write_resident(path: Path, tensors: list[tuple[str, object]]) -> dict:
    """resident.safetensors from (name, QTensor | ndarray) pairs; {size, crc32}."""
    parts = []
    for name, t in tensors:
        if isinstance(t, np.ndarray):
            parts.append((name, t))
        else:
            parts += [(name, t.data), (name + SCALES_SUFFIX, t.scales)]
    header, offset = {"__metadata__": {"format": "colibri"}}, 0
    for name, a in parts:
        header[name] = {"dtype": ST_NAME[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    crc, size = 0, 0
    with open(path, "wb") as f:
        for chunk in [len(head).to_bytes(8, "little") + head] + [np.ascontiguousarray(a).tobytes() for _, a in parts]:
            f.write(chunk)
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": crc}


def write_layer(path: Path, rng, layer: int, H: int, I: int, E: int) -> dict:
    _, nbytes = expert_extent("int4", H, I)
    crc, crcs = 0, []
    with open(path, "wb") as f:
        for e in range(E):
            shapes = ((I, H, WEIGHT_STD), (I, H, WEIGHT_STD), (H, I, OUT_STD))
            buf = pack_extent([int4_random(rng, rows, cols, std) for rows, cols, std in shapes], layer, e, nbytes)
            crcs.append(extent_crc(buf))
            f.write(buf)
            crc = zlib.crc32(buf, crc)
    return {"size": E * nbytes, "crc32": crc, "extent_crc32": crcs}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layers", type=int, default=16, help="MoE layers (16 as in OLMoE-1B-7B)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    config = {**OLMOE_1B_7B, "num_hidden_layers": args.layers}
    cfg = Olmoe.parse_config(config)
    layout = Olmoe.layout(cfg)
    H, I, E, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.vocab_size
    rng = np.random.default_rng(args.seed)
    dst = args.dst
    if (dst / MANIFEST).exists():
        sys.exit(f"{dst} already holds a container")
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "experts").mkdir(parents=True)
    t0 = time.time()

    embed = (rng.standard_normal((V, H), dtype=np.float32))  # (V, H)
    embed[:, 0] = STEADY
    resident = [("model.embed_tokens.weight", q.quantize(embed, "int4"))]
    del embed
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        resident += [(p + "input_layernorm.weight", np.ones(H, np.float32)),
                     (p + "post_attention_layernorm.weight", np.ones(H, np.float32)),
                     (p + "self_attn.q_norm.weight", np.ones(H, np.float32)),
                     (p + "self_attn.k_norm.weight", np.ones(H, np.float32)),
                     (p + "mlp.gate.weight", router(rng, E, H))]
        resident += [(p + f"self_attn.{n}.weight", int4_random(rng, H, H, OUT_STD if n == "o_proj" else WEIGHT_STD))
                     for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    resident += [("model.norm.weight", np.ones(H, np.float32)), ("lm_head.weight", int4_random(rng, V, H))]
    order = {name: k for k, name in enumerate(layout.resident)}
    resident.sort(key=lambda nt: order[nt[0]])
    res = write_resident(staging / RESIDENT_FILE, resident)
    print(f"resident weights: {res['size'] / 1e9:.2f} GB ({time.time() - t0:.0f} s)", file=sys.stderr)

    layers = []
    for layer in layout.moe_layers:
        rel = expert_file_name(layer)
        rec = write_layer(staging / rel, rng, layer, H, I, E)
        layers.append({"layer": layer, "path": rel, "size": rec["size"], "crc32": rec["crc32"],
                       "extent_crc32": _FlowList(rec["extent_crc32"])})
        print(f"layer {layer}: {rec['size'] / 1e9:.2f} GB ({time.time() - t0:.0f} s)", file=sys.stderr)

    copied = {}
    for name, d in (("config.json", config), ("generation_config.json", {"eos_token_id": None})):
        (staging / name).write_text(json.dumps(d, indent=2))
        data = (staging / name).read_bytes()
        copied[name] = _Flow(size=len(data), crc32=zlib.crc32(data))
    plan = _Plan("olmoe", "int4", layout,
                 [(n, ARRAY if isinstance(t, np.ndarray) else "int4", list(t.shape) if isinstance(t, np.ndarray)
                   else [t.rows, t.cols]) for n, t in resident],
                 "per_expert", dict(layout.experts.per_expert))
    digest = hashlib.sha256(json.dumps([config, args.seed, "synthetic"]).encode()).hexdigest()
    source = {"fingerprint": f"sha256:{digest}", "tensors": len(resident), "bytes": 0, "files": {},
              "synthetic": f"tools/make_synthetic_olmoe.py --layers {args.layers} --seed {args.seed}"}
    manifest = _manifest(plan, "olmoe", "colibri-olmoe", version("colibri-olmoe"), source, copied, res, layers)
    (staging / MANIFEST).write_text(yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                                              width=100))
    os.rename(staging, dst)
    total = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    print(f"wrote {dst}: {total / 1e9:.2f} GB in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
