"""Bindings of the Gated DeltaNet kernels (csrc/deltanet.c); the float64 references are in
`colibri_core.kernels.reference_deltanet`.

    from colibri_core.kernels import deltanet
    out = deltanet.causal_conv1d(x, weight, state)                   # state updated in place
    out = deltanet.gated_delta_rule(q, k, v, g, beta, state)         # recurrent (n <= EXACT_BATCH) or chunked
    block = deltanet.DeltaNetBlock(...); out = block(x, conv_state, state)   # a whole token mixer, one call

Arguments are checked here before C sees them (a wrong shape or dtype raises ValueError); the
states are float32 arrays updated in place. The C calls release the GIL.
"""
from __future__ import annotations

import numpy as np

from colibri_core.kernels import _act_code, _activations, _check, _floats, _qmatrix, weights_act
from colibri_core.kernels._colibri_kernels import ffi, lib
from colibri_core.quant import QTensor, quantize

__all__ = ["EXACT_BATCH", "BLOCK", "query_blocks"]  # public (docs/plugins.md): what a plugin's own attention needs

CHUNK = 64  # tokens per chunk in the chunked form (as the reference implementations use)
# A forward of at most this many tokens computes each exactly as if it came alone (the recurrent
# form here, per-query attention in the layers): speculative drafts are verified in one forward
# and must give the very bits decoding them one by one gives.
EXACT_BATCH = 16
# A longer forward computes in blocks of BLOCK: attention's query blocks aligned at its absolute
# multiples (`query_blocks`), each over exactly the keys up to its own end (never masked later ones:
# they would change the sums' bits), a block's part of at most EXACT_BATCH tokens one query at a
# time; the chunked rule's chunks from the forward's first token, a last one of at most EXACT_BATCH
# tokens recurrent. A forward starting at a multiple of BLOCK then gives every position the bits of
# forwards cut at multiples of BLOCK (the prefix cache restores a state at such a cut: prefix.py).
BLOCK = CHUNK


def query_blocks(start: int, n: int) -> list[tuple[int, int]]:
    """The queries of a forward of n tokens from position `start`, in the groups an attention computes
    together: [(i, j), …] offsets in the forward, cut at the absolute multiples of BLOCK, a block's
    part of at most EXACT_BATCH tokens one query at a time. Each group attends to exactly the keys
    before position start + j (BLOCK)."""
    cuts = [0, *range(BLOCK - start % BLOCK, n, BLOCK), n]
    groups = []
    for a, b in zip(cuts, cuts[1:]):
        groups += [(t, t + 1) for t in range(a, b)] if b - a <= EXACT_BATCH else [(a, b)]
    return groups


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray, silu: bool = True) -> np.ndarray:
    """Depthwise causal conv1d (+ SiLU) over x float32 (n, C) with weight (C, K); `state` float32
    (K-1, C) holds the previous K-1 inputs and is updated in place. Returns float32 (n, C)."""
    n, channels = _matrix(x, "causal_conv1d: x").shape
    if weight.dtype != np.float32 or weight.ndim != 2 or weight.shape[0] != channels:
        raise ValueError(f"causal_conv1d: weight must be float32 [{channels}, K], got {weight.dtype} {list(weight.shape)}")
    K = weight.shape[1]
    _state(state, (K - 1, channels), "causal_conv1d: state")
    x, weight = np.ascontiguousarray(x), np.ascontiguousarray(weight)
    out = np.empty((n, channels), np.float32)
    _check(lib.causal_conv1d(_floats(out, True), _floats(state, True), _floats(x), _floats(weight),
                             n, channels, K, int(bool(silu))), "causal_conv1d")
    return out


def gated_delta_rule(q, k, v, g, beta, state: np.ndarray, form: str = "auto", chunk: int = CHUNK) -> np.ndarray:
    """The gated delta rule (see csrc/deltanet.h): q, k float32 (n, Hk, dk) (normalised inside),
    v (n, Hv, dv), g (log decay) and beta (n, Hv); `state` float32 (Hv, dk, dv), updated in place.

    `form`: "recurrent" (token by token), "chunked" (chunks of `chunk` tokens), or "auto":
    recurrent up to EXACT_BATCH tokens (decode, a verified draft: the bits of one token at a time),
    chunked for more (prefill), a last chunk of at most EXACT_BATCH tokens recurrent (so a prefill
    cut at multiples of CHUNK gets the bits of one: BLOCK). Returns float32 (n, Hv, dv).
    """
    n, hk, dk = _array(q, 3, "gated_delta_rule: q").shape
    _, hv, dv = _array(v, 3, "gated_delta_rule: v").shape
    if k.shape != q.shape or v.shape[0] != n or hv % hk:
        raise ValueError(f"gated_delta_rule: q, k must be [n, Hk, dk] and v [n, Hv, dv] with Hv a multiple "
                         f"of Hk; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    for a, name in ((g, "g"), (beta, "beta")):
        if _array(a, 2, f"gated_delta_rule: {name}").shape != (n, hv):
            raise ValueError(f"gated_delta_rule: {name} must be [{n}, {hv}], got {list(a.shape)}")
    _state(state, (hv, dk, dv), "gated_delta_rule: state")
    if form == "auto":
        head = 0 if n <= EXACT_BATCH else n - n % chunk if n % chunk <= EXACT_BATCH else n  # chunked tokens
        if 0 < head < n:
            first, rest = [x[:head] for x in (q, k, v, g, beta)], [x[head:] for x in (q, k, v, g, beta)]
            return np.concatenate([gated_delta_rule(*first, state, "chunked", chunk),
                                   gated_delta_rule(*rest, state, "recurrent")])
        form = "recurrent" if head == 0 else "chunked"
    q, k, v, g, beta = (np.ascontiguousarray(a) for a in (q, k, v, g, beta))
    out = np.empty((n, hv, dv), np.float32)
    args = (_floats(out, True), _floats(state, True), _floats(q), _floats(k), _floats(v), _floats(g),
            _floats(beta), n, hk, hv, dk, dv)
    if form == "recurrent":
        _check(lib.gated_delta_rule_recurrent(*args), "gated_delta_rule_recurrent")
    elif form == "chunked":
        if chunk < 1:
            raise ValueError(f"gated_delta_rule: chunk must be at least 1, got {chunk}")
        _check(lib.gated_delta_rule_chunked(*args, int(chunk)), "gated_delta_rule_chunked")
    else:
        raise ValueError(f"gated_delta_rule: form must be 'auto', 'recurrent' or 'chunked', got {form!r}")
    return out


class DeltaNetBlock:
    """A whole Gated DeltaNet token mixer as one C call (csrc/deltanet.h's `deltanet_block`): the
    four input projections (one matmul_multi) → causal conv1d + SiLU → β = sigmoid(b), g = neg_a ·
    softplus(a + dt_bias) → the gated delta rule (`gated_delta_rule`'s "auto" form) → RMSNorm per
    value head · silu(z) → out_proj, with no Python between the steps (the NumPy gates and norm and
    a wrapper per call took ≈ 0.15 ms a layer).

    Matrices are QTensors (a float32 array is taken as one of kind f32); built once per layer
    (checks the shapes, keeps the C struct), called per forward pass.
    """

    def __init__(self, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv_weight: np.ndarray, neg_a: np.ndarray,
                 dt_bias: np.ndarray, norm: np.ndarray, out_proj, *, key_heads: int, value_heads: int,
                 key_dim: int, value_dim: int, eps: float):
        mats = [w if isinstance(w, QTensor) else quantize(w, "f32")  # a float32 array: kind f32
                for w in (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj)]
        channels, nv = 2 * key_heads * key_dim + value_heads * value_dim, value_heads * value_dim
        hidden = mats[0].cols
        want = [(channels, hidden), (nv, hidden), (value_heads, hidden), (value_heads, hidden), (hidden, nv)]
        if [(m.rows, m.cols) for m in mats] != want or value_heads % key_heads:
            raise ValueError(f"deltanet_block: projections must be qkv, z, b, a, out {want} with value heads a "
                             f"multiple of key heads; got {[(m.rows, m.cols) for m in mats]}")
        conv_weight = np.ascontiguousarray(conv_weight, np.float32)
        if conv_weight.ndim != 2 or conv_weight.shape[0] != channels:
            raise ValueError(f"deltanet_block: conv_weight must be [{channels}, K], got {list(conv_weight.shape)}")
        vectors = [np.ascontiguousarray(a, np.float32) for a in (neg_a, dt_bias, norm)]
        for a, n, name in zip(vectors, (value_heads, value_heads, value_dim), ("neg_a", "dt_bias", "norm")):
            if a.shape != (n,):
                raise ValueError(f"deltanet_block: {name} must be ({n},), got {list(a.shape)}")
        b = ffi.new("DeltaNetBlock *")
        b.in_qkv, b.in_z, b.in_b, b.in_a, b.out_proj = (_qmatrix(m, name) for m, name in
                                                        zip(mats, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")))
        b.conv = ffi.from_buffer("float[]", conv_weight)
        b.neg_a, b.dt_bias, b.norm = (ffi.from_buffer("float[]", a) for a in vectors)
        b.hk, b.hv, b.dk, b.dv, b.conv_kernel = key_heads, value_heads, key_dim, value_dim, conv_weight.shape[1]
        b.exact_batch, b.chunk, b.eps = EXACT_BATCH, CHUNK, eps
        self._c, self._keep = b, (mats, conv_weight, vectors)  # the struct points into these
        self.hidden = hidden
        self.act = weights_act(mats)  # the arithmetic a call uses by default
        self.state_shapes = ((conv_weight.shape[1] - 1, channels), (value_heads, key_dim, value_dim))

    def __call__(self, x: np.ndarray, conv_state: np.ndarray, state: np.ndarray, act: str | None = None) -> np.ndarray:
        """x (T, hidden) normalised hidden states → (T, hidden); conv_state (K−1, channels) and state
        (Hv, dk, dv), float32, advance by T tokens in place."""
        return self.seqs(x, [len(x)], [(conv_state, state)], act)

    def seqs(self, x: np.ndarray, lengths: list[int], states: list[tuple], act: str | None = None) -> np.ndarray:
        """The mixer for several sequences in one call (a batch's generations): x (T, hidden) their
        rows stacked, `lengths` each one's rows, `states` each one's (conv_state, state) → (T,
        hidden), each sequence's rows and states the bits of its own call (the projections read the
        weights once for all)."""
        x = _activations(x, self.hidden, "deltanet_block: x")
        out = np.empty_like(x)
        if len(x):
            args = self.c_args(lengths, states)
            _check(lib.deltanet_block(_floats(out, True), _floats(x), len(lengths), args[0], self._c, *args[1:],
                                      _act_code(act or self.act)), "deltanet_block")
        return out

    def c_args(self, lengths: list[int], states: list[tuple]) -> tuple:
        """A call's (seq_T, conv_states, states) as C takes them, checked: `lengths` each sequence's
        rows, `states` each one's (conv_state, state)."""
        if len(states) != len(lengths) or not lengths or min(lengths) < 0:
            raise ValueError(f"deltanet_block: one (conv_state, state) per sequence, got {len(states)} for {len(lengths)}")
        for conv_state, state in states:
            _state(conv_state, self.state_shapes[0], "deltanet_block: conv_state")
            _state(state, self.state_shapes[1], "deltanet_block: state")
        return (ffi.new("int[]", lengths), ffi.new("float *[]", [_floats(c, True) for c, _ in states]),
                ffi.new("float *[]", [_floats(r, True) for _, r in states]))


def _array(a, ndim: int, what: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != ndim:
        got = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{what} must be a float32 array with {ndim} dimensions, got {got}")
    if a.size >= 2**31:
        raise ValueError(f"{what}: {a.size} elements is too many")
    return a


def _matrix(a, what: str) -> np.ndarray:
    return _array(a, 2, what)


def _state(a, shape: tuple[int, ...], what: str) -> None:
    """A state is updated in place: it must be exactly float32 `shape`, C-contiguous and writable."""
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == shape and a.flags.c_contiguous
            and a.flags.writeable and a.flags.aligned):
        got = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{what} must be a writable C-contiguous float32 array {list(shape)}, got {got}")
