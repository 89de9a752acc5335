"""What a plugin tells the converter about its checkpoint: the container layout.

Every tensor of a HF checkpoint is either *resident* (kept in RAM: embeddings, attention, norms,
routers, shared experts) or part of a *routed expert* (streamed from disk). The layout names both,
says which resident tensors stay float32 whatever ``--quant`` asks, and which checkpoint tensors
the architecture does not use (skipped, e.g. MTP heads the model cannot run yet). Any other tensor
in the checkpoint, or one the layout expects and the checkpoint lacks, is a conversion error.
"""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field

from .errors import ColibriError

__all__ = ["ContainerLayout", "ExpertNames"]

PROJS = ("gate", "up", "down")  # storage order inside one expert's extent
PRECISION = ("f32", "int8", "int4")  # most precise first


def more_precise(a: str, b: str) -> str:
    """The more precise of two quantisation kinds."""
    return min(a, b, key=PRECISION.index)


@dataclass(frozen=True)
class ExpertNames:
    """How the routed experts of one MoE layer are named in a HF checkpoint.

    Patterns use ``{layer}`` and ``{expert}``. A checkpoint holds either the per-expert form
    (``gate`` ``[I, H]``, ``up`` ``[I, H]``, ``down`` ``[H, I]``) or the fused form
    (``gate_up`` ``[E, 2I, H]`` with gate rows first, ``down`` ``[E, H, I]``).
    """

    per_expert: dict[str, str]  # "gate" | "up" | "down" -> name pattern with {layer} and {expert}
    fused_gate_up: str | None = None  # name pattern with {layer}: [E, 2I, H]
    fused_down: str | None = None  # name pattern with {layer}: [E, H, I]
    # other per-expert name patterns a checkpoint may use, tried in order after `per_expert` when a
    # checkpoint is run without conversion (e.g. DeepSeek V4's official `layers.{layer}.ffn.experts…`)
    other_names: tuple[dict[str, str], ...] = ()


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
    # the experts' SwiGLU clamp: silu(min(gate x, L)) · clip(up x, -L, L) (DeepSeek V4: 10); None: none
    swiglu_limit: float | None = None
    # the experts' gated unit: "swiglu" (silu(gate x) · up x) or "situ" (Kimi K3's SiTU-GLU,
    # 4 tanh(g/4) σ(g) · 25 tanh(u/25); colibri_core.layers.situ)
    expert_activation: str = "swiglu"
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
