"""Write a checkpoint in DeepSeek V4's official layout from a transformers save_pretrained one (tests).

The official release names tensors without a prefix (`embed.weight`, `layers.N.attn.wq_a.weight`,
`head.weight`, `hc_head_fn`), stores the dense projections as float8 e4m3 with a UE8M0 scale per
128 × 128 block (`NAME.scale`, F8_E8M0), the routed experts as packed E2M1 fp4 in I8 (low nibble
first) with a UE8M0 scale per 32 columns, and the rest in bfloat16 / float32. `write_official`
quantises a float checkpoint that way (round to nearest, scales the smallest power of two that
fits), so the result is a faithful tiny stand-in for the real download.
"""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
from colibri_deepseek_v4.model import NATIVE_FP8, official_name
from safetensors.numpy import load_file

from colibri_core.quant import E2M1_VALUES, E4M3_VALUES

FP8 = re.compile(NATIVE_FP8)  # the plugin's declaration of the release (what `plan --quant native` sizes)
EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
BF16 = re.compile(r"^(embed|head)\.weight$|\.compressor\.(wkv|wgate)\.weight$|\.weights_proj\.weight$|\.ffn\.gate\.weight$")
E4M3_MAX, E2M1_MAX = 448.0, 6.0
E4M3_FINITE = np.flatnonzero(np.isfinite(E4M3_VALUES))


def _exponent(absmax: np.ndarray, top: float) -> np.ndarray:
    """UE8M0 bytes: the smallest 2^(s-127) with absmax / 2^(s-127) <= top."""
    e = np.ceil(np.log2(np.maximum(absmax, 1e-30) / top))
    return np.clip(e + 127, 1, 254).astype(np.uint8)


def _nearest(values: np.ndarray, codes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The code whose value is nearest to each x."""
    return codes[np.abs(x[..., None] - values[codes]).argmin(axis=-1)]


def to_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] → (e4m3 bytes [R, C], UE8M0 [ceil(R/128), ceil(C/128)])."""
    R, C = w.shape
    br, bc = math.ceil(R / 128), math.ceil(C / 128)
    padded = np.zeros((br * 128, bc * 128), np.float32)
    padded[:R, :C] = w
    absmax = np.abs(padded.reshape(br, 128, bc, 128)).max(axis=(1, 3))
    s = _exponent(absmax, E4M3_MAX)
    scale = np.repeat(np.repeat(2.0 ** (s.astype(np.float64) - 127), 128, 0), 128, 1)[:R, :C]
    return _nearest(E4M3_VALUES, E4M3_FINITE, (w / scale).astype(np.float32)).astype(np.uint8), s


def to_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] (C even, a multiple of 32) → (packed E2M1 int8 [R, C/2], UE8M0 [R, C/32])."""
    R, C = w.shape
    s = _exponent(np.abs(w.reshape(R, C // 32, 32)).max(axis=-1), E2M1_MAX)
    scale = np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, axis=1)
    nib = _nearest(E2M1_VALUES, np.arange(16), (w / scale).astype(np.float32)).astype(np.uint8)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).view(np.int8), s


def bf16(w: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (round to nearest even), as uint16."""
    bits = w.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_official(hf_dir: Path, dst: Path, split_expert: tuple[int, int] | None = None) -> None:
    """`hf_dir` (a save_pretrained checkpoint, per-expert names) → `dst` in the official layout.

    With `split_expert` (layer, expert), that expert's down projection goes to a second shard, as in
    released checkpoints whose expert tensors straddle shards."""
    tensors = load_file(str(next(hf_dir.glob("*.safetensors"))))
    shards: list[dict[str, np.ndarray]] = [{}, {}]
    dtypes: dict[str, str] = {}
    for name, w in tensors.items():
        out = official_name(name)
        shard = 1 if split_expert and out == "layers.{}.ffn.experts.{}.w2.weight".format(*split_expert) else 0
        if EXPERT.search(out):
            q, s = to_fp4(w)
            shards[shard][out], shards[shard][out[: -len(".weight")] + ".scale"] = q, s
            dtypes[out[: -len(".weight")] + ".scale"] = "F8_E8M0"
        elif FP8.search(out):
            q, s = to_fp8(w)
            shards[shard][out], shards[shard][out[: -len(".weight")] + ".scale"] = q, s
            dtypes[out], dtypes[out[: -len(".weight")] + ".scale"] = "F8_E4M3", "F8_E8M0"
        elif BF16.search(out):
            shards[shard][out] = bf16(w)
            dtypes[out] = "BF16"
        elif out.endswith("tid2eid"):
            shards[shard][out] = w.astype(np.int32)
        else:
            shards[shard][out] = w.astype(np.float32)
    dst.mkdir(parents=True)
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weight_map = {}
    files = [s for s in shards if s]
    for i, shard in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        _save(dst / fname, shard, dtypes)
        weight_map.update(dict.fromkeys(shard, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if (hf_dir / "generation_config.json").is_file():
        shutil.copy(hf_dir / "generation_config.json", dst)


ST_DTYPE = {np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16", np.dtype(np.int32): "I32",
            np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8"}


def _save(path: Path, tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
    """A safetensors file with its tensors laid out in name order (so one expert's weights and scales
    are contiguous, as in the official shards), under the official dtype names."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(tensors):
        a = tensors[name]
        header[name] = {"dtype": dtypes.get(name, ST_DTYPE[a.dtype]), "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
