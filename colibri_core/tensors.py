"""A plugin's tensors, declared once: the table `MoEModel.tensors(cfg)` returns.

Each resident tensor is one `Tensor` (its checkpoint name pattern, its shape from the config, whether
it stays float32, the other names released checkpoints give it, its native kind in the official
release); the routed experts are one `Experts` (their router, their names per expert or fused, with
shapes that say which axis is which, top-k and math). From the table the core derives everything
else a plugin used to write by hand: the container layout (`TensorTable.layout`: resident names,
keep-f32 rules, aliases, expert names — what conversion, no-conversion loading, dequantisation,
`plan` and the kit's missing / leftover checks read), the resident shapes, and the model's own
`take(weights, layer)`, so `__init__` reads tensors by key, never by name again.

Matrices are (rows, cols) = (out, in), as `linear` reads them. The experts' and the router's axes are
`Dim`s, sizes named from the config, so the table checks each axis by its role: a square matrix
(H = I) declared the wrong way round is refused, which its shape alone could not show.
"""
from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable, Union

from .errors import ColibriError
from .layout import ContainerLayout, ExpertFunction, ExpertNames

__all__ = ["Dim", "Tensor", "Experts", "ExpertFunction", "TensorTable"]


class Dim(int):
    """A size named from the config: ``Dim("H", cfg.hidden_size)``. Products and sums keep a name
    (``2 * I`` is "2*I", as the fused gate_up is declared), so an axis's role survives arithmetic and a
    square matrix's orientation is still visible."""

    name: str

    def __new__(cls, name: str, size: int) -> Dim:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise ColibriError(f"the model's config gives {repr(size)[:40]} as the size {name}: it must be an integer")
        d = super().__new__(cls, size)
        d.name = name
        return d

    def __repr__(self) -> str:
        return f"{self.name}={int(self)}"

    def __getnewargs__(self) -> tuple[str, int]:
        return self.name, int(self)

    def _join(self, other, op: str, value: int) -> Dim | int:
        return Dim(f"{_name(self)}{op}{_name(other)}", value)

    def __mul__(self, other):
        return self._join(other, "*", int(self) * int(other))

    def __rmul__(self, other):
        return Dim(f"{_name(other)}*{self.name}", int(other) * int(self))

    def __add__(self, other):
        return self._join(other, "+", int(self) + int(other))

    def __radd__(self, other):
        return Dim(f"{_name(other)}+{self.name}", int(other) + int(self))


def _name(d) -> str:
    return d.name if isinstance(d, Dim) else str(int(d))


Shape = Union[tuple, Callable[[int], tuple]]  # a tuple, or layer -> tuple where it differs by layer
Alias = Union[str, tuple]  # another name pattern, or (pattern, first row, end row): a slice of its first axis


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor. `name` may hold ``{layer}`` (then `layers` says which layers have it)
    and, inside `Experts`, ``{expert}``. `shape`: a matrix is (out, in); a callable of the layer where
    the shape differs by layer. `f32`: a matrix kept float32 whatever ``--quant`` asks (1-D tensors
    always are). `aliases`: other name patterns a released checkpoint uses, tried in order when
    `name` is absent, each a pattern or (pattern, first row, end row) for a slice of its first axis.
    `native`: the official release holds this matrix in that kind ("fp8"), run as it is."""

    name: str
    shape: Shape = ()
    layers: tuple[int, ...] | range | None = None
    f32: bool = False
    aliases: tuple[Alias, ...] = ()
    native: str | None = None

    def __post_init__(self) -> None:
        if self.layers is not None and "{layer}" not in self.name:
            raise ColibriError(f"tensor {self.name} has `layers` but no {{layer}} in its name")

    def names(self, layer: int | None = None) -> list[tuple[str, tuple]]:
        """[(checkpoint name, shape)] of this tensor in `layer` (None: the tensor without a layer)."""
        if layer is None:
            return [(self.name, tuple(self.shape))] if self.layers is None else []
        if self.layers is None or layer not in self.layers:
            return []
        shape = self.shape(layer) if callable(self.shape) else self.shape
        return [(self.name.format(layer=layer), tuple(shape))]

    def regex(self) -> str:
        """A regex matching exactly this tensor's names (every layer)."""
        return "^" + re.escape(self.name).replace(re.escape("{layer}"), r"\d+") + "$"


@dataclass(frozen=True)
class Experts:
    """The routed experts of the MoE layers `layers`: E = `n`, H = `hidden`, I = `intermediate`
    (`Dim`s), each token sent to `top_k`, picked by `router` (a resident (E, H) matrix on each of
    `layers`, float32, rows the experts; its `layers` are these. A latent MoE's router reads the
    model's width, not the experts' H).

    Their tensors, either or both forms (a checkpoint holds one): per expert `gate` (I, H), `up`
    (I, H), `down` (H, I), names with ``{layer}`` and ``{expert}`` (their `aliases`: the released
    checkpoint's names, in the same order for all three); fused `gate_up` (E, 2I, H) and `down_fused`
    (E, H, I), or both transposed, (E, H, 2I) and (E, I, H) (GPT-OSS: ``x @ W``), `interleaved` when
    gate and up alternate along 2I. Shapes are checked by their axes' names, so a matrix declared the
    wrong way round is refused even where H = I.

    `activation`, `limit`, `alpha`: the gated unit (`colibri_core.layout.EXPERT_ACTIVATIONS`), or
    `activation` the plugin's own `ExpertFunction("package.module:function")` (slower, see there);
    `min_kind`: (layer, kind) stored at least this precisely; `native`: the official release's expert
    kind ("fp4" | "fp8"), run without conversion."""

    layers: tuple[int, ...] | range
    n: Dim
    hidden: Dim
    intermediate: Dim
    top_k: int
    router: Tensor  # (E, H), name pattern with {layer}
    gate: Tensor | None = None
    up: Tensor | None = None
    down: Tensor | None = None
    gate_up: Tensor | None = None
    down_fused: Tensor | None = None
    interleaved: bool = False
    activation: str | ExpertFunction = "swiglu"
    limit: float | None = None
    alpha: float | None = None
    min_kind: tuple[tuple[int, str], ...] = ()
    native: str | None = None

    def __post_init__(self) -> None:
        E, H, I = self.n, self.hidden, self.intermediate
        for what, d in (("n", E), ("hidden", H), ("intermediate", I)):
            if not isinstance(d, Dim):
                raise ColibriError(f"Experts.{what} must be a Dim (a size named from the config), got {d!r}")
        per_expert = (self.gate, self.up, self.down)
        if any(per_expert) and not all(per_expert):
            raise ColibriError("Experts: declare gate, up and down together (or none, for fused-only checkpoints)")
        if (self.gate_up is None) != (self.down_fused is None):
            raise ColibriError("Experts: declare gate_up and down_fused together")
        if not any(per_expert) and self.gate_up is None:
            raise ColibriError("Experts: declare the experts' tensors, per expert or fused")
        # the router: (E, the model's width), H, or wider than a latent MoE's experts
        width = self.router.shape[-1] if len(self.router.shape) == 2 and _name(self.router.shape[-1]) != E.name else H
        _check_axes(f"the router {self.router.name}", self.router.shape, [(E, width)])
        for role, t, want in (("gate", self.gate, (I, H)), ("up", self.up, (I, H)), ("down", self.down, (H, I))):
            if t is not None:
                _check_axes(f"the experts' {role} {t.name}", t.shape, [want])
        if self.gate_up is not None:
            _check_axes(f"the experts' gate_up {self.gate_up.name}", self.gate_up.shape,
                        [(E, 2 * I, H), (E, H, 2 * I)])
            _check_axes(f"the experts' down_fused {self.down_fused.name}", self.down_fused.shape,
                        [(E, H, I), (E, I, H)])
            if self.transposed != (_names(self.down_fused.shape) == _names((E, I, H))):
                raise ColibriError(f"the experts' gate_up {self.gate_up.name} and down_fused {self.down_fused.name} "
                                   "are declared in different orientations (both (out, in) or both (in, out))")

    @property
    def transposed(self) -> bool:
        """The fused tensors are stored (in, out)."""
        return self.gate_up is not None and _names(self.gate_up.shape) == _names((self.n, self.hidden, 2 * self.intermediate))

    def names(self) -> ExpertNames:
        """The layout's `ExpertNames`."""
        per_expert = {} if self.gate is None else {"gate": self.gate.name, "up": self.up.name, "down": self.down.name}
        others = () if self.gate is None else tuple(
            {"gate": g, "up": u, "down": d} for g, u, d in zip(self.gate.aliases, self.up.aliases, self.down.aliases))
        return ExpertNames(per_expert=per_expert, other_names=others,
                           fused_gate_up=self.gate_up.name if self.gate_up else None,
                           fused_down=self.down_fused.name if self.down_fused else None,
                           fused_transposed=self.transposed, gate_up_interleaved=self.interleaved)


def _names(shape) -> tuple:
    return tuple(_name(d) for d in shape)


def _check_axes(what: str, shape, allowed: list[tuple]) -> None:
    """Refuse a shape whose axes are not named as one of `allowed` (rows = out, cols = in)."""
    if callable(shape) or not all(isinstance(d, Dim) for d in shape):
        raise ColibriError(f"{what}: name every axis with a Dim, so the table can tell which is which; got {shape!r}")
    if _names(shape) not in [_names(a) for a in allowed]:
        want = " or ".join("(" + ", ".join(_names(a)) + ")" for a in allowed)
        raise ColibriError(f"{what} is declared ({', '.join(_names(shape))}), must be {want} (rows = out, cols = in)")


@dataclass(frozen=True)
class TensorTable:
    """Every tensor of a checkpoint the model uses: `resident` by key (the key is what `take` returns
    it under; the declaration order is the container's), the routed `experts`, and `ignore`: regexes
    of checkpoint tensors skipped on purpose (e.g. an MTP head nothing runs yet)."""

    resident: dict[str, Tensor]
    experts: Experts
    ignore: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for t in self.resident.values():
            if "{layer}" in t.name and t.layers is None:
                raise ColibriError(f"tensor {t.name}: a name with {{layer}} needs `layers`")

    @property
    def _router(self) -> Tensor:
        return replace(self.experts.router, layers=tuple(self.experts.layers), f32=True)

    def _declared(self) -> list[tuple[str, Tensor]]:
        """The resident declarations and the router, the router right after the last per-layer tensor."""
        items = list(self.resident.items())
        last = max((i for i, (_, t) in enumerate(items) if t.layers is not None), default=len(items) - 1)
        return items[:last + 1] + [("router", self._router)] + items[last + 1:]

    def resident_shapes(self) -> dict[str, tuple]:
        """Every resident tensor's shape by checkpoint name, in container order: the tensors before the
        first per-layer one, every layer's tensors layer by layer, then the rest."""
        items = self._declared()
        first = next(i for i, (_, t) in enumerate(items) if t.layers is not None)
        last = max(i for i, (_, t) in enumerate(items) if t.layers is not None)
        layers = sorted({i for _, t in items[first:last + 1] if t.layers is not None for i in t.layers})
        out = {}
        for _, t in items[:first]:
            out.update(t.names())
        for i in layers:
            for _, t in items[first:last + 1]:
                out.update(t.names(i))
        for _, t in items[first:]:  # the tensors of no layer declared among or after the layers' own
            out.update(t.names())
        return {name: tuple(int(d) for d in shape) for name, shape in out.items()}

    def layout(self) -> ContainerLayout:
        """The container layout all of the core reads (convert, no-conversion loading, plan, the kit)."""
        E = self.experts
        items = self._declared()
        aliases = []
        for _, t in items:
            for a in t.aliases:
                pattern, first, end = (a, None, None) if isinstance(a, str) else a
                for layer in ([None] if t.layers is None else t.layers):
                    aliases.append((t.name.format(layer=layer), pattern.format(layer=layer), first, end))
        return ContainerLayout(
            resident=tuple(self.resident_shapes()),
            keep_f32=tuple(t.regex() for _, t in items if t.f32),
            moe_layers=tuple(E.layers), n_experts=int(E.n), top_k=E.top_k, hidden=int(E.hidden),
            intermediate=int(E.intermediate), experts=E.names(), ignore=self.ignore, expert_min_kind=E.min_kind,
            swiglu_limit=E.limit, expert_activation=E.activation, swiglu_alpha=E.alpha,
            native_resident=tuple((t.regex(), t.native) for _, t in items if t.native), native_expert_kind=E.native,
            aliases=tuple(aliases),
        )

    def take(self, weights, layer: int | None = None) -> Taken:
        """`layer`'s resident tensors by key ("router" on an MoE layer), or those of no layer (None),
        each taken from the model's `Weights` when read."""
        return Taken(weights, {key: name for key, t in self._declared() for name, _ in t.names(layer)})


class Taken(Mapping):
    """One layer's tensors by key, each taken from `Weights` when read: a tensor declared but never
    read stays untaken, the model's "does not use tensor" error, as with `weights(name)` itself.
    `key in taken` asks whether the layer has it without taking it."""

    def __init__(self, weights, names: dict[str, str]):
        self._weights, self._names = weights, names

    def __getitem__(self, key: str):
        return self._weights(self._names[key])

    def __contains__(self, key) -> bool:
        return key in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
