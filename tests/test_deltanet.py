"""Gated DeltaNet kernels (csrc/deltanet.c) against their float64 NumPy reference and against the
oracle's own torch implementation; the layer pieces (norms, partial RoPE, shared expert)."""
import numpy as np
import pytest

from colibri_core import kernels
from colibri_core.kernels import deltanet as dn
from colibri_core.kernels import kda
from colibri_core.kernels import reference_deltanet as ref
from colibri_core.layers.rope import apply_partial_rotate_half
from colibri_core.layers.norm import rms_norm_gated, rms_norm_zero_centred
from colibri_core.layers.rope import Rope


def delta_inputs(rng, n, hk, hv, dk, dv):
    """Inputs shaped like a real layer's: raw q/k (normalised inside), decays ≤ 0, β in (0, 1)."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    g = (-np.exp(f(hv) * 0.5) * np.log1p(np.exp(f(n, hv)))).astype(np.float32)  # −exp(A_log) · softplus
    beta = (1 / (1 + np.exp(-f(n, hv)))).astype(np.float32)
    return f(n, hk, dk), f(n, hk, dk), f(n, hv, dv), g, beta


def close(got, want, rel=2e-5):
    err = np.abs(got - want).max()
    assert err <= rel * max(1.0, np.abs(want).max()), f"max error {err:.3g}"


@pytest.mark.parametrize("n,channels,kernel", [(1, 5, 4), (3, 7, 4), (37, 13, 4), (9, 3, 1), (20, 6, 2)])
def test_causal_conv1d_matches_reference(n, channels, kernel):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, channels)).astype(np.float32)
    w = rng.standard_normal((channels, kernel)).astype(np.float32)
    state = rng.standard_normal((kernel - 1, channels)).astype(np.float32)
    want, want_state = ref.causal_conv1d(x, w, state)
    got = dn.causal_conv1d(x, w, state)  # updates state in place
    close(got, want, 1e-6)
    assert np.array_equal(state, want_state.astype(np.float32))


def test_causal_conv1d_in_pieces_equals_whole():
    """The rolling state carries the context: feeding 1, 2, 5, 1, … tokens at a time gives the same
    outputs as all at once (the same sums in the same order: bit-identical)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((30, 11)).astype(np.float32)
    w = rng.standard_normal((11, 4)).astype(np.float32)
    whole = dn.causal_conv1d(x, w, np.zeros((3, 11), np.float32))
    state, parts, t = np.zeros((3, 11), np.float32), [], 0
    for size in (1, 2, 5, 1, 1, 3, 17):
        parts.append(dn.causal_conv1d(x[t : t + size], w, state))
        t += size
    assert np.array_equal(np.concatenate(parts), whole)


def test_conv_and_recurrent_rules_give_the_same_bits_on_every_thread_count():
    """Decode-sized calls large enough to be split over the kernel threads (channel ranges; heads),
    Kimi Delta Attention's per-channel rule included."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    w = rng.standard_normal((4096, 4)).astype(np.float32)
    q, k, v, g, beta = delta_inputs(rng, 2, 4, 8, 64, 64)
    state0 = (rng.standard_normal((8, 64, 64)) * 0.3).astype(np.float32)
    g_kda = -np.abs(rng.standard_normal((2, 8, 64))).astype(np.float32)
    results, before = [], kernels.threads()
    try:
        for n in (1, 2, 3, 7):
            kernels.set_threads(n)
            conv_state, state, kda_state = np.zeros((3, 4096), np.float32), state0.copy(), state0.copy()
            results.append((dn.causal_conv1d(x, w, conv_state), conv_state,
                            dn.gated_delta_rule(q, k, v, g, beta, state, form="recurrent"), state,
                            kda.recurrent(v, v, v, g_kda, beta, kda_state), kda_state))
    finally:
        kernels.set_threads(before)
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("form,chunk", [("recurrent", 0), ("chunked", 64), ("chunked", 5), ("chunked", 1)])
@pytest.mark.parametrize("n,hk,hv,dk,dv", [(1, 1, 1, 4, 4), (37, 2, 6, 13, 7), (150, 3, 6, 16, 9)])
def test_gated_delta_rule_matches_float64_reference(form, chunk, n, hk, hv, dk, dv):
    rng = np.random.default_rng(n + hk)
    q, k, v, g, beta = delta_inputs(rng, n, hk, hv, dk, dv)
    state = (rng.standard_normal((hv, dk, dv)) * 0.3).astype(np.float32)  # a non-zero starting state
    want, want_state = ref.gated_delta_rule(q, k, v, g, beta, state)
    got = dn.gated_delta_rule(q, k, v, g, beta, state, form=form, chunk=chunk or 64)
    close(got, want)
    close(state, want_state)


def test_prefill_then_decode_equals_one_long_prefill_1000_tokens():
    """Chunked prefill of 600 tokens, then 400 single-token recurrent steps: the same outputs and state
    as one chunked pass over all 1,000 tokens, and as the float64 reference."""
    rng = np.random.default_rng(1000)
    n, hk, hv, dk, dv = 1000, 2, 4, 16, 16
    q, k, v, g, beta = delta_inputs(rng, n, hk, hv, dk, dv)
    want, want_state = ref.gated_delta_rule(q, k, v, g, beta, np.zeros((hv, dk, dv)))
    whole_state = np.zeros((hv, dk, dv), np.float32)
    whole = dn.gated_delta_rule(q, k, v, g, beta, whole_state)
    state = np.zeros((hv, dk, dv), np.float32)
    outs = [dn.gated_delta_rule(q[:600], k[:600], v[:600], g[:600], beta[:600], state)]
    for t in range(600, n):
        outs.append(dn.gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state))
    stepped = np.concatenate(outs)
    close(whole, want)
    close(stepped, want)
    close(stepped, whole)
    close(state, whole_state)
    close(state, want_state)


def test_gated_delta_rule_matches_the_oracles_torch_functions():
    """The oracle's own pure-torch chunked and recurrent rules (what HF runs without `fla`)."""
    import torch
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    rng = np.random.default_rng(3)
    n, hk, hv, dk, dv = 100, 2, 4, 16, 8
    q, k, v, g, beta = delta_inputs(rng, n, hk, hv, dk, dv)
    state0 = (rng.standard_normal((hv, dk, dv)) * 0.3).astype(np.float32)
    t = lambda a: torch.from_numpy(a.copy())[None]  # noqa: E731  (batch of 1)
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        out, final = fn(t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(state0), output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        state = state0.copy()
        got = dn.gated_delta_rule(q, k, v, g, beta, state)
        close(got, out[0].numpy())
        close(state, final[0].numpy())


def test_bad_arguments_are_value_errors():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = delta_inputs(rng, 4, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="state"):
        dn.gated_delta_rule(q, k, v, g, beta, np.zeros((4, 8, 7), np.float32))
    with pytest.raises(ValueError, match="multiple"):
        dn.gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], np.zeros((3, 8, 8), np.float32))
    with pytest.raises(ValueError, match="float32"):
        dn.gated_delta_rule(q.astype(np.float64), k, v, g, beta, np.zeros((4, 8, 8), np.float32))
    with pytest.raises(ValueError, match="state"):
        dn.causal_conv1d(np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32))


# ---- the layer pieces against the oracle's torch modules ---------------------------------------

def test_norms_match_the_oracle():
    import torch
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 3, 24)).astype(np.float32)
    z = rng.standard_normal((7, 3, 24)).astype(np.float32)
    w = (rng.standard_normal(24) * 0.2).astype(np.float32)
    zc = hf.Qwen3_5MoeRMSNorm(24, eps=1e-6)
    gated = hf.Qwen3_5MoeRMSNormGated(24, eps=1e-6)
    with torch.no_grad():
        zc.weight.copy_(torch.from_numpy(w))
        gated.weight.copy_(torch.from_numpy(w))
        close(rms_norm_zero_centred(x, w, 1e-6), zc(torch.from_numpy(x)).numpy(), 1e-6)
        close(rms_norm_gated(x, z, w, 1e-6), gated(torch.from_numpy(x), torch.from_numpy(z)).numpy(), 1e-6)


def block_inputs(rng, hidden=48, hk=2, hv=4, dk=8, dv=6, K=4):
    """A DeltaNetBlock of random int4 projections (f32 for b and a, as the containers keep them) and
    its float64 reference's arguments (the same weights dequantised)."""
    from colibri_core.quant import dequantize, quantize
    channels = 2 * hk * dk + hv * dv
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    qkv, z, out = (quantize(f(r, c) * 0.3, "int4") for r, c in ((channels, hidden), (hv * dv, hidden), (hidden, hv * dv)))
    b, a = f(hv, hidden) * 0.2, f(hv, hidden) * 0.2
    conv, neg_a, dt_bias, norm = f(channels, K) * 0.5, -np.exp(f(hv) * 0.5), f(hv), 1 + f(dv) * 0.1
    block = dn.DeltaNetBlock(qkv, z, b, a, conv, neg_a, dt_bias, norm, out, key_heads=hk, value_heads=hv,
                             key_dim=dk, value_dim=dv, eps=1e-6)
    dense = [dequantize(qkv), dequantize(z), b, a, conv, None, neg_a, dt_bias, norm, dequantize(out)]
    states = (f(K - 1, channels) * 0.3, f(hv, dk, dv) * 0.3)
    return block, dense, states, dict(key_heads=hk, key_dim=dk, eps=1e-6)


@pytest.mark.parametrize("n", [1, 5, 16, 40])  # recurrent up to EXACT_BATCH (16), chunked above
def test_deltanet_block_matches_float64_reference(n):
    """The whole token mixer in one C call against its float64 definition, twice in a row (the
    conv and recurrent states carried), exact arithmetic."""
    rng = np.random.default_rng(n)
    block, dense, (conv_state, state), kw = block_inputs(rng)
    want_conv, want_state = conv_state.astype(np.float64), state.astype(np.float64)
    for _ in range(2):
        x = rng.standard_normal((n, block.hidden)).astype(np.float32)
        dense[5] = want_conv
        want, want_conv, want_state = ref.deltanet_block(x, *dense, state=want_state, **kw)
        got = block(x, conv_state, state)
        close(got, want, 1e-4)
        close(conv_state, want_conv)
        close(state, want_state, 1e-4)


def test_deltanet_block_tokens_together_give_the_bits_of_one_at_a_time():
    """Up to EXACT_BATCH tokens (a verified speculative draft) give the bits of decoding them one by
    one, in both arithmetics."""
    for act in ("f32", "int8"):
        rng = np.random.default_rng(7)
        block, _, (conv_state, state), _ = block_inputs(rng)
        x = rng.standard_normal((dn.EXACT_BATCH, block.hidden)).astype(np.float32)
        c1, s1, c2, s2 = conv_state.copy(), state.copy(), conv_state.copy(), state.copy()
        together = block(x, c1, s1, act)
        one_by_one = np.concatenate([block(x[t : t + 1], c2, s2, act) for t in range(len(x))])
        assert np.array_equal(together, one_by_one) and np.array_equal(s1, s2) and np.array_equal(c1, c2)


def test_several_sequences_in_one_call_get_their_own_bits():
    """`DeltaNetBlock.seqs`, a batch's sequences in one call (the projections on all rows, the conv
    and the rule per sequence), gives each sequence the bits and states of its own call: a decode
    step, a draft, and a prompt long enough for the chunked rule side by side."""
    for act in ("f32", "int8"):
        rng = np.random.default_rng(8)
        block, _, (conv_state, state), _ = block_inputs(rng)
        lengths = [1, 5, 2 * dn.CHUNK + 3]
        alone = [(conv_state + i, state * (i + 1)) for i in range(3)]  # three different states
        together = [(c.copy(), r.copy()) for c, r in alone]
        x = rng.standard_normal((sum(lengths), block.hidden)).astype(np.float32)
        out = block.seqs(x, lengths, together, act)
        at = np.cumsum([0] + lengths)
        for i, (c, r) in enumerate(alone):
            assert np.array_equal(block(x[at[i]:at[i + 1]], c, r, act), out[at[i]:at[i + 1]])
            assert np.array_equal(c, together[i][0]) and np.array_equal(r, together[i][1])


def test_deltanet_block_matches_the_oracles_layer():
    """The block against transformers' Qwen3_5MoeGatedDeltaNet (its pure-torch path) with the same
    float32 weights, a 20-token prompt from a zero state."""
    import torch
    from transformers.models.qwen3_5_moe import configuration_qwen3_5_moe as hfc
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    cfg = hfc.Qwen3_5MoeTextConfig(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                   num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(0)
    layer = hf.Qwen3_5MoeGatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():  # constant-initialised parameters perturbed
            p.add_(torch.randn_like(p) * 0.2)
    w = {n: p.detach().numpy().astype(np.float32) for n, p in layer.named_parameters()}
    block = dn.DeltaNetBlock(w["in_proj_qkv.weight"], w["in_proj_z.weight"], w["in_proj_b.weight"], w["in_proj_a.weight"],
                             w["conv1d.weight"][:, 0, :], -np.exp(w["A_log"]), w["dt_bias"], w["norm.weight"],
                             w["out_proj.weight"], key_heads=2, value_heads=4, key_dim=8, value_dim=6, eps=1e-6)
    x = np.random.default_rng(0).standard_normal((20, 48)).astype(np.float32)
    with torch.no_grad():
        want = layer(torch.from_numpy(x)[None])[0].numpy()
    got = block(x, np.zeros(block.state_shapes[0], np.float32), np.zeros(block.state_shapes[1], np.float32))
    close(got, want, 1e-4)


def test_deltanet_block_rejects_wrong_shapes():
    rng = np.random.default_rng(1)
    block, _, (conv_state, state), _ = block_inputs(rng)
    x = rng.standard_normal((2, block.hidden)).astype(np.float32)
    with pytest.raises(ValueError, match="state"):
        block(x, conv_state, state[:, :-1].copy())
    with pytest.raises(ValueError, match="x must be"):
        block(x[:, :-1].copy(), conv_state, state)
    with pytest.raises(ValueError, match="projections"):
        dn.DeltaNetBlock(*(block._keep[0][:4]), block._keep[1], *block._keep[2], block._keep[0][0], key_heads=2,
                         value_heads=4, key_dim=8, value_dim=6, eps=1e-6)


def test_partial_rope_rotates_only_the_leading_dims():
    import torch
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 2, 16)).astype(np.float32)
    cos, sin = Rope(4, 10000.0).cos_sin(np.arange(3, 8))
    got = apply_partial_rotate_half(x, cos, sin)
    xt = torch.from_numpy(x).transpose(0, 1)[None]  # (1, heads, T, D)
    want, _ = hf.apply_rotary_pos_emb(xt, xt, torch.from_numpy(cos)[None], torch.from_numpy(sin)[None])
    close(got, want[0].transpose(0, 1).numpy(), 1e-6)
    assert np.array_equal(got[..., 4:], x[..., 4:])
