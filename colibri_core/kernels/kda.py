"""Binding of Kimi Delta Attention's recurrent kernel (csrc/deltanet.c, `kda_recurrent`); the float64
reference is `colibri_core.kernels.reference_kda`.

    from colibri_core.kernels import kda
    out = kda.recurrent(q, k, v, g, beta, state)      # state updated in place

Arguments are checked here before C sees them (a wrong shape or dtype raises ValueError); the state
is a float32 array updated in place. The C call releases the GIL.
"""
from __future__ import annotations

import numpy as np

from colibri_core.kernels import _check, _floats
from colibri_core.kernels._colibri_kernels import lib


def recurrent(q, k, v, g, beta, state: np.ndarray) -> np.ndarray:
    """q, k, v, g float32 (n, heads, d) (q, k normalised inside; g the per-channel log decay), beta
    float32 (n, heads); `state` float32 (heads, d, d), C-contiguous, updated in place. → (n, heads, d)."""
    arrays = [np.ascontiguousarray(a, np.float32) for a in (q, k, v, g, beta)]
    n, heads, d = arrays[0].shape
    if any(a.shape != (n, heads, d) for a in arrays[1:4]) or arrays[4].shape != (n, heads):
        raise ValueError(f"kda.recurrent: q, k, v, g must be (n, heads, d) and beta (n, heads); got "
                         f"{[list(a.shape) for a in arrays]}")
    if not (isinstance(state, np.ndarray) and state.dtype == np.float32 and state.shape == (heads, d, d)
            and state.flags.c_contiguous and state.flags.writeable):
        raise ValueError(f"kda.recurrent: state must be a writable C-contiguous float32 array {[heads, d, d]}")
    out = np.empty((n, heads, d), np.float32)
    _check(lib.kda_recurrent(_floats(out, True), _floats(state, True), *(_floats(a) for a in arrays), n, heads, d),
           "kda_recurrent")
    return out
