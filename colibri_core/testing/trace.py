"""Per-layer intermediates of colibri and of its `transformers` oracle, and where they first diverge.

colibri's side comes from the core's named-intermediates hook (`colibri_core.probe.record`): the
MoE block records, per MoE layer, the residual stream entering it (``ffn_inp``), the router's input
(``ffn_norm``), the routing (``ffn_moe_ids``, ``ffn_moe_weights``); each plugin's forward records
the residual stream after each layer (``l_out``).

The oracle's side comes from forward hooks on modules found through what the plugin declares, never
by a module name (`find_routers`): each declared router's ``weight`` (the (E, H) checkpoint matrix,
float32 in the f32 container) is exactly one parameter of transformers' model. The module owning it
is that layer's router (transformers' routers return ``(logits, weights, ids)``; what it is called
on is the router's input); the module holding the router is the MoE block; the ``nn.ModuleList``
the router lies in is the decoder stack (each layer's output: ``l_out``; ``output_hidden_states``
is not used because transformers 5 hands back the *final-normalised* stream as the last entry); the
decoder layer's child whose output the MoE block is called on is the pre-MoE norm (its input:
``ffn_inp``, matched by the tensor passed). A declared router that cannot be found, or whose module
returns no routing, is named in `Trace.uncompared`: `moe_layers` fails on it, and no explanation
says routing agrees where it was never compared.

`first_divergence` walks the layers in order and, in each, the sub-blocks in the order they run:
attention (the residual stream entering the MoE), the pre-MoE norm (the router's input), the router
(the ids compared as sets per token, then their weights, matched by expert), then the layer's output
(the experts, since all that came before agrees). The first tensor off by more than
``rel_tol × max|oracle tensor|`` names the layer, the sub-block and the position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import probe
from ..quant import QTensor, dequantize

ORDER = ("ffn_inp", "ffn_norm", "ffn_moe_ids", "ffn_moe_weights", "l_out")  # within a layer, as computed


@dataclass
class Trace:
    """Teacher-forced logits (T, V) and intermediates {(name, layer): array} of one pass."""

    logits: np.ndarray
    tensors: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    n_layers: int | None = None  # decoder layers (the oracle's stack), when known
    calls: list[tuple[str, int]] = field(default_factory=list)  # colibri: every record, in order
    uncompared: dict[int, str] = field(default_factory=dict)  # oracle: MoE layer → why its routing is not recorded

    def get(self, name: str, layer: int) -> np.ndarray | None:
        return self.tensors.get((name, layer))

    def layers(self, name: str) -> list[int]:
        """Layers holding `name`, in the order they ran (colibri) or by index (oracle)."""
        if self.calls:
            return list(dict.fromkeys(layer for n, layer in self.calls if n == name))
        return sorted(layer for n, layer in self.tensors if n == name)


# ---- transformers' routers, found through the plugin's ----------------------------------------
@dataclass(frozen=True)
class OracleRouters:
    """Where transformers' model routes, found from the routers a plugin declares (`find_routers`)."""

    modules: dict[int, str]  # MoE layer → qualified name of transformers' router module
    stack: str | None  # qualified name of the decoder layers' nn.ModuleList (None: no router found)
    missing: dict[int, str]  # declared MoE layer in the decoder stack → why its router was not found

    def key(self) -> tuple:
        """A hashable summary (memoising the oracle's trace by the routers it hooks)."""
        return tuple(self.modules.items()), self.stack, tuple(self.missing.items())


def find_routers(model, declared: dict) -> OracleRouters:
    """transformers' router of each MoE layer the plugin declares (`declared`: `MoEModel.routers()`
    of the f32 container, {layer: Router}): the module owning the one parameter exactly equal to the
    Router's ``weight``, in the decoder stack at the same layer index. A layer that is not found is
    `missing` with the reason, unless it lies beyond the decoder stack (a draft head's, like
    GLM-5.2's MTP layer: transformers does not run it)."""
    import torch

    params = [(name, p.detach()) for name, p in model.named_parameters()]
    modules: dict[int, str] = {}
    missing: dict[int, str] = {}
    stack = None
    for layer, router in declared.items():
        weight = getattr(router, "weight", None)  # the Router contract has no weight: a custom one may lack it
        if weight is None:
            missing[layer] = (f"its router ({type(router).__name__}) has no `weight`, the (E, H) checkpoint matrix "
                              "the kit finds transformers' router by")
            continue
        w = torch.from_numpy(np.array(dequantize(weight) if isinstance(weight, QTensor) else weight, np.float32))
        same = [name for name, p in params if p.shape == w.shape and torch.equal(p, w)]
        if len(same) != 1:
            which = "no parameter" if not same else f"{len(same)} parameters (`{same[0]}`, `{same[1]}`)"
            missing[layer] = (f"its router's weight {tuple(w.shape)}, by which the kit finds transformers' router, "
                              f"equals {which} of transformers' model: declare the checkpoint's matrix, unchanged")
            continue
        name = same[0].rpartition(".")[0]
        where, index = _decoder_layer(model, name)
        if where is None or where != (stack or where) or index != layer:
            missing[layer] = f"its router's weight is transformers' `{same[0]}`, not a parameter of decoder layer {layer}"
            continue
        stack, modules[layer] = where, name
    n = len(model.get_submodule(stack)) if stack is not None else None
    return OracleRouters(modules, stack, {layer: why for layer, why in missing.items() if n is None or layer < n})


def _decoder_layer(model, name: str) -> tuple[str | None, int | None]:
    """(qualified name of the outermost nn.ModuleList above module `name`, `name`'s index in it)."""
    import torch

    parts = name.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if isinstance(model.get_submodule(prefix), torch.nn.ModuleList) and parts[i].isdigit():
            return prefix, int(parts[i])
    return None, None


def _residual_hooks(decoder_layer, block, put) -> list:
    """Hooks that `put` the residual stream entering the MoE `block`: the input of the decoder layer's
    child whose output `block` is called on (the pre-MoE norm), matched by the tensor passed."""
    ran = []  # (output, input) of each child of the decoder layer, since the block last ran

    def after(module, args, out) -> None:
        if args:
            ran.append((out, args[0]))

    def before(module, args) -> None:
        for out, inp in ran:
            if args and out is args[0]:
                put(inp)
        ran.clear()

    hooks = [child.register_forward_hook(after) for child in decoder_layer.children() if child is not block]
    return hooks + [block.register_forward_pre_hook(before)]


def oracle_trace(model, ids: list[int], routers: OracleRouters) -> Trace:
    """The oracle's logits and intermediates on ids (one forward pass, hooks removed after), at the
    modules `routers` found (`find_routers`, on any `transformers` model of the same class)."""
    import torch

    tensors: dict[tuple[str, int], np.ndarray] = {}
    uncompared = dict(routers.missing)

    def put(name: str, layer: int, t) -> None:
        if isinstance(t, (tuple, list)):
            t = t[0]
        t = t.detach().float()
        tensors[(name, layer)] = t.reshape(-1, t.shape[-1]).numpy().copy()  # (T, ·): the batch of 1 dropped

    def on_router(layer: int, name: str, args, out) -> None:
        put("ffn_norm", layer, args[0])
        if isinstance(out, (tuple, list)) and len(out) == 3:  # transformers' routers: (logits, weights, ids)
            tensors[("ffn_moe_ids", layer)] = out[2].detach().reshape(len(ids), -1).numpy().astype(np.int64)
            tensors[("ffn_moe_weights", layer)] = out[1].detach().float().reshape(len(ids), -1).numpy().copy()
        else:
            uncompared[layer] = f"transformers' router `{name}` returns no (logits, weights, ids)"

    layers = list(model.get_submodule(routers.stack)) if routers.stack is not None else []
    hooks = []  # a forward hook returning something replaces the module's output: these return None
    for i, L in enumerate(layers):
        hooks.append(L.register_forward_hook(lambda m, a, o, i=i: put("l_out", i, o)))
    for layer, name in routers.modules.items():
        router, block = model.get_submodule(name), model.get_submodule(name.rpartition(".")[0])
        hooks.append(router.register_forward_hook(lambda m, a, o, i=layer, n=name: on_router(i, n, a, o)))
        hooks += _residual_hooks(layers[layer], block, lambda t, i=layer: put("ffn_inp", i, t))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()
    return Trace(logits, tensors, len(layers) if layers else None, uncompared=uncompared)


def engine_trace(model_dir: Path, ids: list[int], **load_kw) -> Trace:
    """colibri's teacher-forced logits and named intermediates on ids (one forward pass)."""
    from ..engine import load

    with load(model_dir, activations="f32", **load_kw) as engine, probe.recording() as rec:
        logits = engine.logits(ids)
    return Trace(logits, {key: seen[-1] for key, seen in rec.tensors.items()}, calls=list(rec.calls))


@dataclass
class Divergence:
    layer: int
    where: str  # the sub-block: attention, router input, router, experts, …
    name: str  # the intermediate compared
    position: int
    err: float = 0.0
    tol: float = 0.0
    detail: str = ""

    def __str__(self) -> str:
        what = self.detail or f"{self.name} differs by {self.err:.3g} > {self.tol:.3g}"
        return f"layer {self.layer}, {self.where}: {what} at position {self.position}"


def _where(name: str, layer: int, has_moe: bool, uncompared: str | None = None) -> str:
    if name == "ffn_inp":
        return "attention (the token mixer: the residual stream entering the MoE)" + (
            ", or the embeddings" if layer == 0 else "")
    if name == "ffn_norm":
        return "router input (the norm before the MoE)"
    if name == "ffn_moe_ids":
        return "router (the experts chosen)"
    if name == "ffn_moe_weights":
        return "router (the weights of the experts chosen; the experts agree)"
    if has_moe and uncompared:
        return f"router or experts (transformers' routing was not recorded here: {uncompared})"
    if has_moe:
        return "experts (routed experts, shared expert or their sum; attention, norm and routing agree)"
    return "attention or the dense MLP (a layer without MoE: nothing recorded inside it)"


def first_divergence(engine: Trace, oracle: Trace, rel_tol: float) -> Divergence | None:
    """The first (layer, sub-block) where colibri's intermediate differs from the oracle's beyond
    rel_tol × max|oracle's|, or None if every intermediate both sides recorded agrees."""
    layers = sorted({layer for _, layer in engine.tensors} & {layer for _, layer in oracle.tensors})
    for layer in layers:
        has_moe = engine.get("ffn_moe_ids", layer) is not None
        uncompared = oracle.uncompared.get(layer)
        for name in ORDER:
            a, b = engine.get(name, layer), oracle.get(name, layer)
            if a is None or b is None:
                continue
            if name == "ffn_moe_ids":
                for t, (x, y) in enumerate(zip(a, b)):
                    if set(x.tolist()) != set(y.tolist()):
                        return Divergence(layer, _where(name, layer, has_moe), name, t, detail=(
                            f"colibri routes to experts {sorted(x.tolist())}, transformers to {sorted(y.tolist())}"))
                continue
            if name == "ffn_moe_weights":  # each side's weights in its own rank order: match them by expert
                ids_a, ids_b = engine.get("ffn_moe_ids", layer), oracle.get("ffn_moe_ids", layer)
                if ids_a is None or ids_b is None or a.shape != b.shape:
                    continue
                a = np.take_along_axis(a, np.argsort(ids_a, axis=1), axis=1)
                b = np.take_along_axis(b, np.argsort(ids_b, axis=1), axis=1)
            if a.shape != b.shape:
                return Divergence(layer, _where(name, layer, has_moe, uncompared), name, 0,
                                  detail=f"{name} has shape {a.shape}, transformers' {b.shape}")
            diff = np.abs(a - b)
            err, tol = float(diff.max()), rel_tol * float(np.abs(b).max())
            if not err <= tol:  # NaN counts as a difference
                position = int(np.unravel_index(np.nanargmax(np.where(np.isnan(diff), np.inf, diff)), diff.shape)[0])
                return Divergence(layer, _where(name, layer, has_moe, uncompared), name, position, err, tol)
    return None


def explain(engine: Trace, oracle: Trace, rel_tol: float) -> str:
    """One sentence for a failure message: where colibri first leaves its oracle."""
    if not oracle.tensors:
        first = next(iter(oracle.uncompared.items()), None)
        why = f" (layer {first[0]}: {first[1]})" if first else ""
        return f"no router the plugin declares was found in transformers' model{why}, so no layer can be named"
    if not any(n == "l_out" for n, _ in engine.tensors):
        note = " (the plugin records no l_out: add `probe.record(i, l_out=h)` after each layer)"
    else:
        note = ""
    d = first_divergence(engine, oracle, rel_tol)
    if d is None:
        same = engine.logits.shape == oracle.logits.shape
        err = float(np.abs(engine.logits - oracle.logits).max()) if same else np.inf
        if err <= rel_tol * float(np.abs(oracle.logits).max()):
            return f"colibri's logits and every recorded intermediate agree with the oracle's on them{note}"
        return ("every layer's recorded intermediates agree: the divergence is after the last layer "
                f"(final norm or lm_head){note}")
    before = f"layers before {d.layer} agree" if d.layer else "it is the first layer"
    return f"first divergence: {d} ({before}){note}"
