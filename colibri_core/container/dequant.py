"""`dequantize`: every tensor a container holds, back as float32 under the source checkpoint's names."""
from __future__ import annotations

import os

import numpy as np

from .. import quant
from ..layout import PROJS, ExpertNames
from .reader import Container


def dequantize(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """float32 arrays by source checkpoint name and shape: resident tensors, then the routed experts
    (fused ``[E, 2I, H]`` / ``[E, H, I]`` if the source was fused, or as its manifest's
    ``fused_layout`` says they lay; per-expert 2-D matrices if not).
    Tensors the conversion skipped (the layout's `ignore`) are not held, so not returned."""
    out: dict[str, np.ndarray] = {}
    with Container(model_dir) as c:
        for name, t in c.resident().items():
            out[name] = quant.dequantize(t) if isinstance(t, quant.QTensor) else np.asarray(t, np.float32)
        experts = c.manifest["experts"]
        names, fused = experts["names"], experts["source_form"] == "fused"
        lay = experts.get("fused_layout", {})
        form = ExpertNames({}, fused_transposed=lay.get("transposed", False),
                           gate_up_interleaved=lay.get("gate_up_interleaved", False))
        for layer in c.moe_layers:
            mats = [[quant.dequantize(t) for t in c.read_expert(layer, e)] for e in range(c.n_experts)]
            if fused:
                joined = [form.join_fused(*gud) for gud in mats]
                out[names["gate_up"].format(layer=layer)] = np.stack([gu for gu, _ in joined])
                out[names["down"].format(layer=layer)] = np.stack([d for _, d in joined])
            else:
                for e, gud in enumerate(mats):
                    for proj, m in zip(PROJS, gud):
                        out[names[proj].format(layer=layer, expert=e)] = m
    return out
