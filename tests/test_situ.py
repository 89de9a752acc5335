"""Kimi K3's SiTU-GLU in the fused expert kernel (csrc/expert_ffn.c with GLU_SITU) against its NumPy
definition (colibri_core/layers/situ.py) on the dequantised weights, every weight kind, awkward sizes;
and many experts in one call exactly as one expert at a time."""
import numpy as np
import pytest

from colibri_core import kernels, quant
from colibri_core.layers.situ import situ


@pytest.mark.parametrize("kind", ["f32", "int8", "int4"])
@pytest.mark.parametrize("n, hidden, inter", [(1, 32, 24), (5, 70, 33), (17, 64, 96)])
def test_fused_situ_matches_the_definition(kind, n, hidden, inter):
    rng = np.random.default_rng(n + hidden)
    gate, up = (quant.quantize(rng.standard_normal((inter, hidden)).astype(np.float32) * s, kind) for s in (0.6, 3.0))
    down = quant.quantize(rng.standard_normal((hidden, inter)).astype(np.float32) * 0.2, kind)
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    g, u, d = (quant.dequantize(w).astype(np.float64) for w in (gate, up, down))
    want = situ(x @ g.T, x @ u.T).astype(np.float64) @ d.T
    got = kernels.expert_ffn(gate, up, down, x, act="f32", glu="situ")
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(x @ g.T).max() > 4 and np.abs(x @ u.T).max() > 25  # both caps bite


def test_many_experts_in_one_call_are_each_alone():
    rng = np.random.default_rng(0)
    experts = {e: tuple(quant.quantize(rng.standard_normal(s).astype(np.float32), "int4")
                        for s in ((24, 40), (24, 40), (40, 24))) for e in range(5)}
    x = rng.standard_normal((7, 40)).astype(np.float32)
    ids = np.stack([rng.permutation(5)[:3] for _ in range(7)])
    outs = np.zeros((7, 3, 40), np.float32)
    kernels.moe_experts(outs, x, ids, experts, act="f32", glu="situ")
    for t in range(7):
        for r in range(3):
            alone = kernels.expert_ffn(*experts[ids[t, r]], x[t:t + 1], act="f32", glu="situ")[0]
            assert np.array_equal(outs[t, r], alone)
    with pytest.raises(ValueError, match="gated unit"):
        kernels.moe_experts(outs, x, ids, experts, glu="gelu")
