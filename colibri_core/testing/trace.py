"""Per-layer intermediates of colibri and of its `transformers` oracle, and where they first diverge.

colibri's side comes from the core's named-intermediates hook (`colibri_core.probe.record`): the
MoE block records, per MoE layer, the residual stream entering it (``ffn_inp``), the router's input
(``ffn_norm``), the routing (``ffn_moe_ids``); each plugin's forward records the residual stream
after each layer (``l_out``). The oracle's side comes from forward hooks on its decoder layers (the
layer's output; ``output_hidden_states`` is not used because transformers 5 hands back the *final-
normalised* stream as the last entry), on each layer's ``post_attention_layernorm`` (its input is
the residual stream entering the MLP, its output the router's input) and on ``mlp.gate`` (the
router: transformers' routers return ``(logits, weights, ids)``).

`first_divergence` walks the layers in order and, in each, the sub-blocks in the order they run:
attention (the residual stream entering the MoE), the post-attention norm (the router's input),
the router (the ids compared as sets per token, then their weights, matched by expert), then the
layer's output (the experts, since all that came before agrees). The first tensor off by more than
``rel_tol × max|oracle tensor|`` names the layer, the sub-block and the position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import probe

ORDER = ("ffn_inp", "ffn_norm", "ffn_moe_ids", "ffn_moe_weights", "l_out")  # within a layer, as computed


@dataclass
class Trace:
    """Teacher-forced logits (T, V) and intermediates {(name, layer): array} of one pass."""

    logits: np.ndarray
    tensors: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    n_layers: int | None = None  # decoder layers (the oracle's stack), when known
    calls: list[tuple[str, int]] = field(default_factory=list)  # colibri: every record, in order

    def get(self, name: str, layer: int) -> np.ndarray | None:
        return self.tensors.get((name, layer))

    def layers(self, name: str) -> list[int]:
        """Layers holding `name`, in the order they ran (colibri) or by index (oracle)."""
        if self.calls:
            return list(dict.fromkeys(layer for n, layer in self.calls if n == name))
        return sorted(layer for n, layer in self.tensors if n == name)


def decoder_layers(model):
    """The oracle's decoder layers (a `transformers` CausalLM), or None if not found."""
    for path in ("model.layers", "model.language_model.layers", "model.decoder.layers", "transformer.h"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if obj is not None:
            return list(obj)
    return None


def oracle_trace(model, ids: list[int]) -> Trace:
    """The oracle's logits and intermediates on ids (one forward pass, hooks removed after)."""
    import torch

    tensors: dict[tuple[str, int], np.ndarray] = {}

    def put(name: str, layer: int, t) -> None:
        if isinstance(t, (tuple, list)):
            t = t[0]
        t = t.detach().float()
        tensors[(name, layer)] = t.reshape(-1, t.shape[-1]).numpy().copy()  # (T, ·): the batch of 1 dropped

    def on_gate(layer: int, out) -> None:
        if isinstance(out, (tuple, list)) and len(out) == 3:  # transformers' routers: (logits, weights, ids)
            tensors[("ffn_moe_ids", layer)] = out[2].detach().reshape(len(ids), -1).numpy().astype(np.int64)
            tensors[("ffn_moe_weights", layer)] = out[1].detach().float().reshape(len(ids), -1).numpy().copy()

    def on_norm(layer: int, inputs, out) -> None:
        put("ffn_inp", layer, inputs[0])
        put("ffn_norm", layer, out)

    layers = decoder_layers(model)
    hooks = []  # a forward hook returning something replaces the module's output: these return None
    for i, L in enumerate(layers or ()):
        hooks.append(L.register_forward_hook(lambda m, a, o, i=i: put("l_out", i, o)))
        norm = getattr(L, "post_attention_layernorm", None)
        if norm is not None:
            hooks.append(norm.register_forward_hook(lambda m, a, o, i=i: on_norm(i, a, o)))
        gate = getattr(getattr(L, "mlp", None), "gate", None)
        if isinstance(gate, torch.nn.Module):
            hooks.append(gate.register_forward_hook(lambda m, a, o, i=i: on_gate(i, o)))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()
    return Trace(logits, tensors, None if layers is None else len(layers))


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


def _where(name: str, layer: int, has_moe: bool) -> str:
    if name == "ffn_inp":
        return "attention (the token mixer: the residual stream entering the MoE)" + (
            ", or the embeddings" if layer == 0 else "")
    if name == "ffn_norm":
        return "router input (the post-attention norm)"
    if name == "ffn_moe_ids":
        return "router (the experts chosen)"
    if name == "ffn_moe_weights":
        return "router (the weights of the experts chosen; the experts agree)"
    if has_moe:
        return "experts (routed experts, shared expert or their sum; attention, norm and routing agree)"
    return "attention or the dense MLP (a layer without MoE: nothing recorded inside it)"


def first_divergence(engine: Trace, oracle: Trace, rel_tol: float) -> Divergence | None:
    """The first (layer, sub-block) where colibri's intermediate differs from the oracle's beyond
    rel_tol × max|oracle's|, or None if every intermediate both sides recorded agrees."""
    layers = sorted({layer for _, layer in engine.tensors} & {layer for _, layer in oracle.tensors})
    for layer in layers:
        has_moe = engine.get("ffn_moe_ids", layer) is not None
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
                return Divergence(layer, _where(name, layer, has_moe), name, 0,
                                  detail=f"{name} has shape {a.shape}, transformers' {b.shape}")
            diff = np.abs(a - b)
            err, tol = float(diff.max()), rel_tol * float(np.abs(b).max())
            if not err <= tol:  # NaN counts as a difference
                position = int(np.unravel_index(np.nanargmax(np.where(np.isnan(diff), np.inf, diff)), diff.shape)[0])
                return Divergence(layer, _where(name, layer, has_moe), name, position, err, tol)
    return None


def explain(engine: Trace, oracle: Trace, rel_tol: float) -> str:
    """One sentence for a failure message: where colibri first leaves its oracle."""
    if not oracle.tensors:
        return "the oracle's decoder layers were not found, so no layer can be named"
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
