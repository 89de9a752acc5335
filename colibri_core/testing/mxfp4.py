"""GPT-OSS's release layout made from a float checkpoint, for tests: the experts as OpenAI ships them
(MXFP4: `*_blocks` E2M1 pairs, `*_scales` UE8M0 per 32 columns, rows the output units), everything
else bfloat16, and the same weights dequantised — what the oracle loads. numpy here; torch (the test
extra) only inside `release_layout`."""
from __future__ import annotations

import numpy as np

from ..quant import E2M1_VALUES

EXPERTS = ("gate_up_proj", "down_proj")  # GPT-OSS's fused expert tensors, (E, in, out)


def to_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., R, C] (C a multiple of 32) → (blocks uint8 [..., R, C/32, 16]: E2M1 pairs, low
    nibble first; scales uint8 [..., R, C/32]: UE8M0, the smallest power of two that fits the block)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    s = np.clip(np.ceil(np.log2(np.maximum(np.abs(groups).max(axis=-1), 1e-30) / 6.0)) + 127, 1, 254).astype(np.uint8)
    x = groups / (2.0 ** (s.astype(np.float64) - 127))[..., None]
    nib = np.abs(x[..., None] - E2M1_VALUES).argmin(axis=-1).astype(np.uint8)  # the nearest E2M1 value
    return nib[..., 0::2] | (nib[..., 1::2] << 4), s


def from_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`to_mxfp4` undone: float32 [..., R, C]."""
    nib = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)  # [..., R, C/32, 32]
    w = E2M1_VALUES[nib] * (2.0 ** (scales.astype(np.float64) - 127))[..., None]
    return w.reshape(*w.shape[:-2], -1).astype(np.float32)


def release_layout(tensors: dict) -> tuple[dict, dict]:
    """A GPT-OSS checkpoint's torch tensors {name: tensor} → (the release's tensors: EXPERTS as MXFP4
    blocks and scales, the rest bfloat16; the same weights dequantised to float32 under the
    checkpoint's names)."""
    import torch

    official, dequantised = {}, {}
    for name, t in tensors.items():
        if name.endswith(EXPERTS):  # (E, in, out) → rows of the release are the output units
            blocks, scales = to_mxfp4(t.transpose(1, 2).contiguous().numpy())
            official[name + "_blocks"], official[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            dequantised[name] = torch.from_numpy(from_mxfp4(blocks, scales)).transpose(1, 2).contiguous()
        else:
            official[name] = t.to(torch.bfloat16)
            dequantised[name] = official[name].float()
    return official, dequantised
