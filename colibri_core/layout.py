"""What a plugin tells the converter about its checkpoint: the container layout.

Every tensor of a HF checkpoint is either *resident* (kept in RAM: embeddings, attention, norms,
routers, shared experts) or part of a *routed expert* (streamed from disk). The layout names both,
says which resident tensors stay float32 whatever ``--quant`` asks, and which checkpoint tensors
the architecture does not use (skipped, e.g. MTP heads the model cannot run yet). Any other tensor
in the checkpoint, or one the layout expects and the checkpoint lacks, is a conversion error.
"""
from __future__ import annotations

import functools
import importlib
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import ColibriError

__all__ = ["ContainerLayout", "ExpertFunction", "ExpertMath", "ExpertNames", "EXPERT_ACTIVATIONS"]

PROJS = ("gate", "up", "down")  # storage order inside one expert's extent
PRECISION = ("f32", "int8", "int4")  # most precise first


def more_precise(a: str, b: str) -> str:
    """The more precise of two quantisation kinds."""
    return min(a, b, key=PRECISION.index)


# the routed experts' gated units h = glu(g, u), g = gate x, u = up x, computed in C on every tier
# (colibri_core.kernels.reference.gated_unit defines each)
EXPERT_ACTIVATIONS = {
    "swiglu": "silu(min(g, L)) · clip(u, -L, L); no limit: the plain SwiGLU (DeepSeek V4: L = 10)",
    "swiglu_oai": "GPT-OSS's (clip(u, -L, L) + 1) · g' σ(alpha g'), g' = min(g, L) (L 7.0, alpha 1.702 by default)",
    "geglu_tanh": "gelu_tanh(g) · u, the tanh GELU (transformers' gelu_pytorch_tanh)",
    "situ": "Kimi K3's SiTU-GLU 4 tanh(g/4) σ(g) · 25 tanh(u/25)",
}
_CLAMPED = ("swiglu", "swiglu_oai")  # the gated units with a clamp limit
GPT_OSS_LIMIT, GPT_OSS_ALPHA = 7.0, 1.702  # swiglu_oai's defaults: transformers' GptOssExperts


@dataclass(frozen=True)
class ExpertFunction:
    """A plugin's own routed-expert FFN, declared instead of a core kind (`Experts(activation=...)`):
    `name` "package.module:function", imported wherever experts run (here, and on every Ray shard,
    which receives the name, not the code: the module must be importable there). Called once per
    expert per MoE call as ``function(x, gate, up, down, biases) -> y``: x (n, H) float32, the rows
    routed to the expert; gate (I, H), up (I, H), down (H, I) its weights dequantised to float32;
    biases (gate (I,), up (I,), down (H,)) or None; y (n, H) float32. Slower than the kinds (NumPy
    per expert, never the resident fused C call); placement still never changes the result."""

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[\w.]+:\w+", self.name):
            raise ColibriError(f"an expert function is named 'package.module:function', got {repr(self.name)[:60]}")
        _import_function(self.name)  # now: a missing module or function is a load-time error, not a mid-forward one

    @property
    def function(self) -> Callable:
        """The function itself, imported by its name (once per process)."""
        return _import_function(self.name)


@functools.lru_cache(maxsize=None)
def _import_function(name: str) -> Callable:
    module, attr = name.split(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ColibriError(f"the expert function {name} cannot be imported here: {e}") from None
    if not callable(fn):
        raise ColibriError(f"the expert function {name} is a {type(fn).__name__}, not a function")
    return fn


@dataclass(frozen=True)
class ExpertMath:
    """The routed experts' gated unit, as a plugin declares it (`ContainerLayout.expert_activation`,
    `swiglu_limit`, `swiglu_alpha`): `activation` one of EXPERT_ACTIVATIONS, `limit` the clamp L of
    "swiglu" / "swiglu_oai" (None: none; "swiglu_oai": 7.0), `alpha` "swiglu_oai"'s sigmoid slope
    (None: 1.702); or `activation` a plugin's `ExpertFunction` (no limit, no alpha: the function
    holds its constants). A ColibriError (one line) for math the kernels do not compute."""

    activation: str | ExpertFunction = "swiglu"
    limit: float | None = None
    alpha: float | None = None

    def __post_init__(self) -> None:
        a, limit, alpha = self.activation, self.limit, self.alpha
        if isinstance(a, ExpertFunction):
            if limit is not None or alpha is not None:
                raise ColibriError(f"the expert function {a.name} takes no swiglu_limit or swiglu_alpha "
                                   f"(got {limit!r}, {alpha!r}): its constants are its own")
            return
        if a not in EXPERT_ACTIVATIONS:
            raise ColibriError(f"unknown expert activation {a!r} (colibri computes {', '.join(EXPERT_ACTIVATIONS)})")
        if limit is not None and a not in _CLAMPED:
            raise ColibriError(f"the expert activation {a!r} has no clamp: swiglu_limit must be None, got {limit!r}")
        if alpha is not None and a != "swiglu_oai":
            raise ColibriError(f"swiglu_alpha goes with the expert activation 'swiglu_oai' only, not {a!r}")
        if a == "swiglu_oai":  # GPT-OSS's constants unless the plugin declares others
            object.__setattr__(self, "limit", GPT_OSS_LIMIT if limit is None else limit)
            object.__setattr__(self, "alpha", GPT_OSS_ALPHA if alpha is None else alpha)
        for what, value in (("swiglu_limit", self.limit), ("swiglu_alpha", self.alpha)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not math.isfinite(value) or (what == "swiglu_limit" and value <= 0)):
                raise ColibriError(f"the experts' {what} must be a finite{' positive' * (what == 'swiglu_limit')} "
                                   f"number, got {repr(value)[:40]}")


@dataclass(frozen=True)
class ExpertNames:
    """How the routed experts of one MoE layer are named in a HF checkpoint.

    Patterns use ``{layer}`` and ``{expert}``. A checkpoint holds either the per-expert form
    (``gate`` ``[I, H]``, ``up`` ``[I, H]``, ``down`` ``[H, I]``) or the fused form
    (``gate_up`` ``[E, 2I, H]`` with gate rows first, ``down`` ``[E, H, I]``), or the fused form as
    the two flags below declare it: ``fused_transposed`` the input axis before the output axis
    (``gate_up`` ``[E, H, 2I]``, ``down`` ``[E, I, H]``: ``x @ W``, GPT-OSS), ``gate_up_interleaved``
    gate and up alternating along the 2I axis, gate first. Both tensors share the orientation, and
    at least one of them is never square (2I = H and I = H cannot both hold), so a checkpoint saved
    in the other orientation fails the shape check even where H = I makes ``down`` square.
    """

    per_expert: dict[str, str]  # "gate" | "up" | "down" -> name pattern with {layer} and {expert}
    fused_gate_up: str | None = None  # name pattern with {layer}: [E, 2I, H] ([E, H, 2I] transposed)
    fused_down: str | None = None  # name pattern with {layer}: [E, H, I] ([E, I, H] transposed)
    fused_transposed: bool = False
    gate_up_interleaved: bool = False
    # other per-expert name patterns a checkpoint may use, tried in order after `per_expert` when a
    # checkpoint is run without conversion (e.g. DeepSeek V4's official `layers.{layer}.ffn.experts…`)
    other_names: tuple[dict[str, str], ...] = ()

    def fused_shapes(self, E: int, H: int, I: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The shapes of the fused gate_up and down tensors of a layer, as the checkpoint holds them."""
        return ((E, H, 2 * I), (E, I, H)) if self.fused_transposed else ((E, 2 * I, H), (E, H, I))

    def split_fused(self, gate_up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One expert's slices of the fused tensors (as the checkpoint holds them, without the expert
        axis) → its gate [I, H], up [I, H], down [H, I], C-contiguous."""
        if self.fused_transposed:
            gate_up, down = gate_up.T, down.T  # [2I, H], [H, I]
        inter = gate_up.shape[0] // 2
        gate, up = (gate_up[0::2], gate_up[1::2]) if self.gate_up_interleaved else (gate_up[:inter], gate_up[inter:])
        return tuple(np.ascontiguousarray(m) for m in (gate, up, down))

    def join_fused(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`split_fused` undone: one expert's gate_up and down slices as the checkpoint holds them,
        C-contiguous (what is stacked from them is, and is written to safetensors as it is)."""
        if self.gate_up_interleaved:
            gate_up = np.empty((2 * gate.shape[0], gate.shape[1]), gate.dtype)
            gate_up[0::2], gate_up[1::2] = gate, up
        else:
            gate_up = np.concatenate([gate, up])
        pair = (gate_up.T, down.T) if self.fused_transposed else (gate_up, down)
        return tuple(np.ascontiguousarray(m) for m in pair)


@dataclass(frozen=True)
class ContainerLayout:
    """What a plugin's `MoEModel.layout(cfg)` returns: the checkpoint's tensors and the routed experts'
    shape. Every field is read by the converter, by `colibri plan` or by the store."""

    resident: tuple[str, ...]  # every non-expert tensor the model needs, by checkpoint name
    keep_f32: tuple[str, ...]  # regexes (re.search) of resident tensors never quantised
    moe_layers: tuple[int, ...]  # layer indices that have routed experts
    n_experts: int  # routed experts per MoE layer (E)
    top_k: int  # experts each token is routed to per MoE layer (k): planning sizes reads with it
    hidden: int  # expert input / output width (H)
    intermediate: int  # expert hidden width (I)
    experts: ExpertNames
    ignore: tuple[str, ...] = field(default=())  # regexes of checkpoint tensors skipped on purpose
    # (layer, kind): that layer's experts are stored at least this precisely whatever --quant says
    # (f32 > int8 > int4), e.g. GLM's MTP layer keeps int8 experts in an int4 container
    expert_min_kind: tuple[tuple[int, str], ...] = field(default=())
    # the experts' clamp L of "swiglu" / "swiglu_oai" (DeepSeek V4: 10; GPT-OSS: 7); None: none
    # ("swiglu_oai": 7.0). With expert_activation and swiglu_alpha: `expert_math`
    swiglu_limit: float | None = None
    # the experts' gated unit, one of EXPERT_ACTIVATIONS: "swiglu" (the default), "swiglu_oai"
    # (GPT-OSS), "geglu_tanh", "situ" (Kimi K3); or the plugin's own `ExpertFunction`
    expert_activation: str | ExpertFunction = "swiglu"
    # "swiglu_oai"'s sigmoid slope (None: GPT-OSS's 1.702); None for the other activations
    swiglu_alpha: float | None = None
    # how the official release stores its weights, for running and planning it without conversion:
    # (regex, kind) of the resident matrices it holds in a native kind ("fp8"; the others are widened
    # to float32 in RAM) and its experts' kind ("fp4" | "fp8"; None: the plugin declares no release)
    native_resident: tuple[tuple[str, str], ...] = field(default=())
    native_expert_kind: str | None = None
    # resident tensors a checkpoint may hold under another name: (name, other name, first row, end row),
    # the rows a slice of the other tensor's first axis (None, None: all of it). Used when `name` itself
    # is absent, e.g. Kimi-Linear's q/k/v convs stacked into one conv1d by transformers' fused save
    aliases: tuple[tuple[str, str, int | None, int | None], ...] = field(default=())

    def __post_init__(self) -> None:
        """A ColibriError (one line) for a layout no model can have, whichever plugin built it from
        whatever config: sizes that are not positive integers, a top-k beyond the routed experts."""
        for what, value in (("routed experts per MoE layer", self.n_experts), ("expert width (hidden)", self.hidden),
                            ("expert hidden width (intermediate)", self.intermediate), ("top-k", self.top_k)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ColibriError(f"the model's config gives {repr(value)[:40]} as its {what}: it must be a "
                                   "positive integer")
        if self.top_k > self.n_experts:
            raise ColibriError(f"the model's config routes each token to {self.top_k} experts (top-k) of the "
                               f"{self.n_experts} routed experts of a layer: top-k must be 1..{self.n_experts}")
        if not self.moe_layers:
            raise ColibriError("the model's config gives no layer of routed experts (colibri runs MoE models)")
        ExpertMath(self.expert_activation, self.swiglu_limit, self.swiglu_alpha)  # checked: one line if bad

    @property
    def expert_math(self) -> ExpertMath:
        """The routed experts' gated unit declared by `expert_activation`, `swiglu_limit`, `swiglu_alpha`."""
        return ExpertMath(self.expert_activation, self.swiglu_limit, self.swiglu_alpha)

    def stays_f32(self, name: str, ndim: int) -> bool:
        """True if resident tensor `name` is kept float32 (all 1-D tensors are)."""
        return ndim != 2 or any(re.search(p, name) for p in self.keep_f32)

    def expert_kind(self, layer: int, quant: str) -> str:
        """The quantisation of `layer`'s experts in a container converted at `quant`."""
        return more_precise(quant, dict(self.expert_min_kind).get(layer, quant))

    def ignored(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.ignore)

    def sources(self, name: str) -> list[tuple[str, int | None, int | None]]:
        """Where resident tensor `name` may be found: itself, then its aliases, in order."""
        return [(name, None, None)] + [(other, a, b) for n, other, a, b in self.aliases if n == name]
