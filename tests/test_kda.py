"""Kimi Delta Attention's recurrence (colibri_core/layers/kda.py) against its float64 definition
(colibri_core/kernels/reference_kda.py): the chunked form (prefill) and the recurrent form (decode),
awkward sizes, a prompt crossing the 64-token chunk, a prefill continued token by token, and both
decays (Kimi-Linear's softplus form, K3's lower-bounded sigmoid form, whose per-step decay is as
strong as e^-5)."""
import numpy as np
import pytest

from colibri_core.kernels import reference_kda
from colibri_core.kv import SequenceState
from colibri_core.layers.kda import KDADims, KDAState, kda_rule


def inputs(n, heads, d, lower_bound, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, heads, d)).astype(np.float32) for _ in range(3))
    f = rng.standard_normal((n, heads, d))
    if lower_bound:
        g = lower_bound / (1 + np.exp(-f))  # K3: g = lb · σ(·) in (lb, 0)
    else:
        g = -np.exp(rng.uniform(0, 1.5, heads))[None, :, None] * np.log1p(np.exp(f - 2))  # −e^A · softplus
    beta = 1 / (1 + np.exp(-rng.standard_normal((n, heads))))
    state = (rng.standard_normal((heads, d, d)) * 0.1).astype(np.float32)
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), state


@pytest.mark.parametrize("n, heads, d", [(1, 2, 16), (7, 3, 5), (64, 2, 8), (70, 3, 12), (130, 1, 9)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_kda_rule_matches_the_float64_definition(n, heads, d, lower_bound, form):
    q, k, v, g, beta, state = inputs(n, heads, d, lower_bound)
    want, want_state = reference_kda.kda_rule(q, k, v, g, beta, state)
    got_state = state.copy()
    got = kda_rule(q, k, v, g, beta, got_state, form=form)
    assert got.dtype == np.float32 and got.shape == (n, heads, d)
    assert np.abs(got - want).max() < 2e-5 * max(1.0, np.abs(want).max())
    assert np.abs(got_state - want_state).max() < 2e-5 * max(1.0, np.abs(want_state).max())


def test_prefill_then_decode_continues_the_recurrence():
    q, k, v, g, beta, state = inputs(70, 2, 8, -5.0, seed=3)
    want, _ = reference_kda.kda_rule(q, k, v, g, beta, state)
    s = state.copy()
    got = [kda_rule(q[:66], k[:66], v[:66], g[:66], beta[:66], s)]  # chunked: 64 + 2
    got += [kda_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s) for t in range(66, 70)]
    assert np.abs(np.concatenate(got) - want).max() < 2e-5 * np.abs(want).max()


def test_bad_shapes_are_refused():
    q, k, v, g, beta, state = inputs(4, 2, 8, None)
    with pytest.raises(ValueError, match="kda_rule"):
        kda_rule(q, k, v, g[:, :1], beta, state)
    with pytest.raises(ValueError, match="state"):
        kda_rule(q, k, v, g, beta, state[:1])
    s = SequenceState({"layer.0": KDAState(KDADims(2, 8, 4))})  # conv (K − 1, 3 Hh dk) = (3, 48)
    with pytest.raises(ValueError, match=r"layer.0.conv has shape \[2, 48\], this model needs \[3, 48\]"):
        s.load_arrays({**s.arrays(), "layer.0.conv": np.zeros((2, 48), np.float32)})


def test_the_c_kernel_gives_the_same_bits_token_by_token_or_together():
    """kda_recurrent (C) on n tokens at once == n calls of one token (what makes a verified draft
    exact), on an awkward head width."""
    q, k, v, g, beta, state = inputs(9, 3, 13, -5.0, seed=5)
    together = state.copy()
    a = kda_rule(q, k, v, g, beta, together, form="recurrent")
    apart = state.copy()
    b = np.concatenate([kda_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], apart) for t in range(9)])
    assert np.array_equal(a, b) and np.array_equal(together, apart)
