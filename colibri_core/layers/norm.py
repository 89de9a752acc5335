"""Normalisations."""
import numpy as np

from .. import kernels

__all__ = ["rms_norm", "rms_norm_zero_centred", "rms_norm_gated"]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) * weight.  x (..., D), weight (D,).

    One C call (kernels.rms_norm; NumPy reference: kernels.reference.rms_norm)."""
    return kernels.rms_norm(x, weight, eps)


def rms_norm_zero_centred(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm (Qwen3.5/3.6): x / sqrt(mean(x²) + eps) * (1 + weight).  x (..., D), weight (D,).

    The weight is stored as an offset from 1, so it initialises to 0."""
    return rms_norm(x, np.float32(1) + weight, eps)


def rms_norm_gated(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gated RMSNorm (the Gated DeltaNet output norm): rms_norm(x, weight) * silu(gate), norm first.

    x, gate (..., D); weight (D,) plain (not zero-centred)."""
    gate = gate.astype(np.float32, copy=False)
    with np.errstate(over="ignore"):  # exp overflowing to inf gives silu = -0, as it should
        silu = gate / (np.float32(1) + np.exp(-gate))
    return rms_norm(x, weight, eps) * silu
