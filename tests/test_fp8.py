"""fp8 e4m3 checkpoints (DeepSeek / GLM layout: NAME float8_e4m3fn + NAME_scale_inv f32 per
128×128 block) are widened to float32 at read time exactly as torch widens them."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from colibri_core.container.reader import FP8_E4M3
from colibri_core.container.writer import Checkpoint
from colibri_core.errors import ColibriError


def test_every_fp8_byte_matches_torch():
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(FP8_E4M3, want, equal_nan=True)


def write(d, tensors, block=None):
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    cfg = {"architectures": ["X"]}
    if block:
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": block}
    (d / "config.json").write_text(json.dumps(cfg))
    return Checkpoint(d)


def test_block_scales_default_128(tmp_path):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(300, 200, generator=g) * 50).to(torch.float8_e4m3fn)  # 3 x 2 blocks, ragged edges
    scale = torch.rand(3, 2, generator=g) + 0.01
    ck = write(tmp_path / "a", {"w.weight": q, "w.weight_scale_inv": scale, "n.weight": torch.ones(4, dtype=torch.bfloat16)})
    want = q.float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert np.array_equal(ck.read_f32("w.weight"), want.numpy())
    assert ck.scales_of("n.weight") is None
    fused = (torch.randn(3, 40, 20, generator=g)).to(torch.float8_e4m3fn)  # [E, 2I, H], 16×16 blocks
    s3 = torch.rand(3, 3, 2, generator=g)
    ck = write(tmp_path / "b", {"e": fused, "e_scale_inv": s3}, block=[16, 16])
    got = ck.read_f32("e", 1, 2)
    want = fused[1:3].float() * s3[1:3].repeat_interleave(16, 1)[:, :40].repeat_interleave(16, 2)[:, :, :20]
    assert np.array_equal(got, want.numpy())


def test_fp8_without_or_with_wrong_scales_is_an_error(tmp_path):
    q = torch.zeros(130, 10).to(torch.float8_e4m3fn)
    ck = write(tmp_path / "a", {"w.weight": q})
    with pytest.raises(ColibriError, match="without block scales"):
        ck.read_f32("w.weight")
    ck = write(tmp_path / "b", {"w.weight": q, "w.weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ColibriError, match=r"expected \[2, 1\] for 128x128 blocks"):
        ck.read_f32("w.weight")
