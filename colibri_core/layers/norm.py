"""Normalisations."""
import numpy as np

from .. import kernels


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) * weight.  x (..., D), weight (D,).

    One C call (kernels.rms_norm; NumPy reference: kernels.reference.rms_norm)."""
    return kernels.rms_norm(x, weight, eps)
