"""The routed-expert block: the core runs a layer's declared router, the lookahead for the next MoE
layers, and every expert the batch needs, which it asks of the expert source (colibri_core/experts.py:
the local store, and the remote shards where there are some) and the C kernels compute.

Placement never changes the result: each expert's FFN is computed by the same kernel wherever its
weights came from and whichever experts were ready first, each token's expert output lands in a
fixed slot (its top-k rank), and the weighted sum over ranks is taken in rank order. The same holds
for remote shards (colibri_core/remote): a shard computes the slots of its experts with the same
kernels and the block's `ExpertFFN` on another machine, and they land in the same slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .. import batch, kernels
from ..errors import ColibriError
from ..kernels.decoder import MoELayer
from ..layout import ExpertFunction, ExpertMath
from ..probe import listening, record, route, spent, timed
from ..quant import QTensor, dequantize
from .router import Router, SoftmaxTopK
from .shared_expert import SharedExpert

# The farthest MoE layer a layer's lookahead guesses: the store reads up to its `lookahead` of these
# (--lookahead); a guess not asked for is never computed. Recall falls with distance (the demo model:
# 79 %, 72 %, 58 % at 1, 2, 3 layers ahead; BENCHMARKS.md, "Lookahead beyond one layer").
LOOKAHEAD_DISTANCES = 3


def run_experts(outs: np.ndarray, x: np.ndarray, ids: np.ndarray, experts: dict, limit: float | None = None,
                glu: str | ExpertFunction = "swiglu", act: str | None = None, alpha: float | None = None,
                biases: dict | None = None) -> None:
    """Fill the slots of `experts` ({expert id: (gate, up, down)}) in outs (T, k, H).

    outs[t, r] = FFN_{ids[t, r]}(x[t]) for every (t, r) routed to one of `experts`, with the gated
    unit `glu` (`kernels.GLUS`: "swiglu" clamped at `limit` if given, "swiglu_oai" with `limit` and
    `alpha`, "geglu_tanh", "situ"), in the activation arithmetic `act` (None: the weights' own,
    `QTensor.act`), with each expert's `biases` ({expert id: (gate_bias, up_bias, down_bias)}, None:
    none). Each row is computed independently of the others, so batching never changes a result.
    `glu` a plugin's `ExpertFunction`: `run_function` instead.
    """
    if isinstance(glu, ExpertFunction):
        run_function(outs, x, ids, experts, glu, biases)
        return
    kernels.moe_experts(outs, x, ids, experts, act, limit, glu, alpha, biases)  # one C call: every expert, every slot, threads inside


def run_function(outs: np.ndarray, x: np.ndarray, ids: np.ndarray, experts: dict, fn: ExpertFunction,
                 biases: dict | None = None) -> None:
    """`run_experts` with a plugin's expert function: one call per expert, on every row routed to it
    (its slots in row-major order) with its weights dequantised to float32, in float32 whatever the
    activation arithmetic. An expert's rows are the same wherever it is computed (here, streamed,
    on a shard), so its slots get the same bits; batching keeps its bits only where the function
    computes each row independently of the others. A result of the wrong shape or dtype is one error."""
    function, H = fn.function, outs.shape[-1]
    for e, (gate, up, down) in experts.items():
        t, r = np.nonzero(ids == e)  # the expert's slots, row-major
        if not len(t):
            continue
        xs = np.ascontiguousarray(x[t], np.float32)  # (n, H)
        y = function(xs, dequantize(gate), dequantize(up), dequantize(down), None if biases is None else biases.get(e))
        if not isinstance(y, np.ndarray) or y.dtype != np.float32 or y.shape != (len(t), H):
            got = f"{y.dtype} {list(y.shape)}" if isinstance(y, np.ndarray) else type(y).__name__
            raise ColibriError(f"the expert function {fn.name} returned {got} for expert {e}: it must return "
                               f"float32 [{len(t)}, {H}] (one row per row of x)")
        outs[t, r] = y


@dataclass(frozen=True)
class ExpertFFN(ExpertMath):
    """The routed experts' math, the block's to choose and the same wherever an expert runs (the
    expert source computes local experts with it and sends its fields to remote shards): the
    layout's `ExpertMath` (`activation`, `limit`, `alpha`), checked there, computed in C (a plugin's
    `ExpertFunction` activation: in NumPy, `run_function`); `biases`
    one layer's expert biases (gate (E, I), up (E, I), down (E, H) float32) where the model declares
    them (`MoEModel.expert_biases`), else None."""

    biases: tuple | None = field(default=None, compare=False)

    def __call__(self, outs: np.ndarray, x: np.ndarray, ids: np.ndarray, experts: dict) -> None:
        """`run_experts` with this math: the slots of `experts` in outs (T, k, H)."""
        run_experts(outs, x, ids, experts, self.limit, self.activation, alpha=self.alpha,
                    biases=self.biases_of(experts))

    def biases_of(self, experts) -> dict | None:
        """{expert: (gate_bias, up_bias, down_bias)} of the ids `experts` (None: the experts have none)."""
        if self.biases is None:
            return None
        return {e: tuple(None if b is None else b[e] for b in self.biases) for e in experts}


def combine(outs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_rank weights[t, r] · outs[t, r], summed in rank order. outs (T, k, H), weights (T, k) → (T, H)."""
    return kernels.moe_combine(outs, weights)  # one C call, the same float32 operations as NumPy's


class MoE:
    """Every MoE layer of one model: its declared routers, the lookahead between them, where the
    experts come from.

    `store` the expert source (`colibri_core.experts.ExpertSource`, the model's `store`): the one
    object asked for a layer's experts; `routers` {layer: Router} in the order the forward pass runs
    them; `lookahead` {layer: the MoE layer whose experts it predicts} (by default each layer's
    successor in `routers`), followed up to LOOKAHEAD_DISTANCES layers ahead (`ahead`);
    `activation` the experts' gated unit (or the plugin's `ExpertFunction`), `swiglu_limit` its
    clamp and `swiglu_alpha` GPT-OSS's slope (the layout's `expert_math`): `ExpertFFN`; `biases`
    {layer: (gate (E, I), up (E, I), down (E, H))} the experts' biases where a model has them (GPT-OSS).
    """

    def __init__(self, store, routers: dict[int, Router], lookahead: dict[int, int] | None = None,
                 swiglu_limit: float | None = None, activation: str | ExpertFunction = "swiglu",
                 swiglu_alpha: float | None = None, biases: dict[int, tuple] | None = None):
        for layer, router in routers.items():
            if not isinstance(router, Router):
                raise ColibriError(f"MoE layer {layer}: the model declared a {type(router).__name__}, not a colibri Router")
        layers = list(routers)
        self.ffn = ExpertFFN(activation, swiglu_limit, swiglu_alpha)
        self.biases = {layer: tuple(None if b is None else np.ascontiguousarray(b, np.float32) for b in parts)
                       for layer, parts in (biases or {}).items()}
        self.experts, self.routers = store, routers
        self.lookahead = dict(zip(layers, layers[1:])) if lookahead is None else dict(lookahead)
        self.ahead = {layer: self._chain(layer) for layer in layers}  # {layer: the MoE layers it guesses, nearest first}
        self._whole: dict = {}  # (layer, id(block)) → its kernels.decoder.MoELayer, or False: it cannot take one

    def _chain(self, layer: int) -> list[int]:
        """The MoE layers `layer`'s lookahead guesses, nearest first: `lookahead` followed from it,
        at most LOOKAHEAD_DISTANCES of them."""
        chain, nxt = [], self.lookahead.get(layer)
        while nxt is not None and len(chain) < LOOKAHEAD_DISTANCES:
            chain.append(nxt)
            nxt = self.lookahead.get(nxt)
        return chain

    @timed("moe")
    def __call__(self, layer: int, x: np.ndarray, residual: np.ndarray, token_ids: np.ndarray,
                 expert_input: np.ndarray | None = None, shared: SharedExpert | None = None) -> np.ndarray:
        """MoE layer `layer`: x (T, H) the router's input (the layer's normalised residual stream),
        residual (T, H) the residual stream it was computed from (the lookahead's input), token_ids
        (T,) → (T, H) = Σ_rank weight · expert(expert_input), expert_input defaulting to x; with a
        `shared` expert, + shared(x) (the bits of adding it to this call's result).

        The source fills every (token, rank) slot (`ExpertSource.compute`): experts already resident
        first, the others as their reads (or remote shards' answers) arrive, so compute overlaps
        the reads; once this layer's reads are queued, each of the next MoE layers' routers (up to
        LOOKAHEAD_DISTANCES ahead, applied to `residual`, a stream the layers in between have not
        changed yet) guesses its experts, and the source starts fetching as many of those as the
        store's `lookahead` asks for, nearest first; a guess not asked for is never computed. A
        layer whose experts are all resident here (the source's `resident_table`) runs its experts
        and their weighted sum as one C call (`kernels.moe_block`), the same bits, and a
        `SoftmaxTopK` router in that call too (`kernels.moe_block_softmax`: the Python between them
        was ~5 % of an OLMoE-size decode step). The shared expert runs in that call too, as one more rank (when it has the routed
        experts' gated unit and clamp, and no probe listens for the routed sum alone), or else
        while the first reads are in flight.
        """
        router = self.routers.get(layer)
        if router is None:
            raise ColibriError(f"MoE layer {layer} has no declared router (declared: {list(self.routers)})")
        xe = x if expert_input is None else expert_input  # (T, H)
        predict = [(nxt, lambda nxt=nxt: self.routers[nxt].predict(residual, token_ids)) for nxt in self.ahead[layer]]
        # a layer with expert biases, or a plugin's expert function, runs its experts through the
        # source (the fused table holds no biases; the fused C call computes only the core kinds)
        biases = self.biases.get(layer)
        fused_math = biases is None and not isinstance(self.ffn.activation, ExpertFunction)
        table = self.experts.resident_table(layer, predict) if fused_math else None
        if table is not None:  # the layer holds all its experts: the experts and their weighted sum, one C call
            fused = shared is not None and self._fuses(shared, expert_input)
            kw = dict(limit=self.ffn.limit, glu=self.ffn.activation, alpha=self.ffn.alpha)
            if fused:
                kw.update(shared=shared.table, shared_scale=shared.scale(x))
            if expert_input is None and type(router) is SoftmaxTopK and isinstance(router.weight, QTensor):
                # the core's softmax router runs in the same call (a subclass may route otherwise)
                out, weights, ids = kernels.moe_block_softmax(x, router.weight, router.k, router.renormalize, table, **kw)
            else:
                weights, ids = router.route(x, token_ids)  # (T, k) each, best first
                out = kernels.moe_block(xe, ids, weights, table, **kw)
            self._routed(layer, x, residual, token_ids, weights, ids)
            self.experts.count_resident(layer, ids)
            return out if fused else self._add_shared(layer, out, x, shared)
        weights, ids = router.route(x, token_ids)  # (T, k) each, best first
        self._routed(layer, x, residual, token_ids, weights, ids)
        T, k = ids.shape
        outs = np.zeros((T, k, xe.shape[1]), np.float32)  # (T, k, H): one slot per (token, rank)
        meanwhile = None if shared is None else (lambda: shared(x))  # while the first reads are in flight
        ffn = self.ffn if biases is None else replace(self.ffn, biases=biases)
        shared_out = self.experts.compute(layer, outs, xe, ids, ffn, predict, meanwhile)
        out = combine(outs, weights)  # (T, H)
        return self._add_shared(layer, out, x, shared, shared_out)

    def layer_table(self, layer: int, block):
        """The expert table for running decoder layer `layer` (`block`, a `layers.decoder.MoEDecoderLayer`)
        as one C call (`whole_layer`), or None where it cannot: a recorder listens for intermediates,
        the block's math is not the core's with a `SoftmaxTopK` router, or the layer or one its
        lookahead guesses lacks an expert here (a guess from the residual stream midway would be
        due, and the C call has no Python midway). Nothing here depends on the batch's other
        generations, so each of them decides alike."""
        if listening():
            return None
        key = (layer, id(block))
        fused = self._whole.get(key)
        if fused is None:
            fused = self._whole[key] = self._layer_call(layer, block) or False
        if fused is False or not all(self.experts.holds_all(nxt) for nxt in self.ahead[layer]):
            return None
        return self.experts.resident_table(layer)

    def whole_layer(self, layer: int, block, table, parts: list[tuple]) -> list[np.ndarray]:
        """Decoder layer `layer` (`block`) as one C call (`kernels.decoder.MoELayer`) over `table`
        (`layer_table`'s) for each (h, state, cos, sin) of `parts` (a batch's generations, their rows
        stacked: the weights read once, the union of their experts once) → each one's (T, H), the
        bits of its blocks; the routing counted as this block counts its own."""
        fused, lengths = self._whole[layer, id(block)], [len(p[0]) for p in parts]
        h = batch.stack([p[0] for p in parts])
        attention = isinstance(block.mixer, kernels.AttnBlock)
        if attention:
            starts = [p[1].reserve(n) - n for p, n in zip(parts, lengths)]  # a WindowKV may move its rows first
            cos, sin = (batch.stack([p[i] for p in parts]) for i in (2, 3))
            out, weights, ids = fused(h, table, lengths, cos=cos, sin=sin,
                                      caches=[(p[1].k, p[1].v, s) for p, s in zip(parts, starts)])
            for p, s, n in zip(parts, starts, lengths):
                p[1].length = s + n
        else:
            out, weights, ids = fused(h, table, lengths, states=[(p[1].conv, p[1].recurrent) for p in parts])
        mixer_seconds, moe_seconds = fused.seconds()
        if attention:
            spent("attention", mixer_seconds)  # the sections gqa_block and this block time on the steps
        spent("moe", moe_seconds)
        route(layer, ids)
        self.experts.count_resident(layer, ids)
        return batch.cut(out, lengths)

    def _layer_call(self, layer: int, block) -> MoELayer | None:
        """The C call of decoder layer `layer`, or None where its MoE block is not the core's fused
        one (a router other than `SoftmaxTopK` over quantised weights, expert biases, a plugin's
        expert function, or a shared expert that cannot join the experts' call)."""
        router, shared = self.routers.get(layer), block.shared
        if (type(router) is not SoftmaxTopK or not isinstance(router.weight, QTensor) or layer in self.biases
                or isinstance(self.ffn.activation, ExpertFunction)):
            return None
        if shared is not None and not (self._fuses(shared, None) and
                                       (shared.expert_gate is None or isinstance(shared.expert_gate, QTensor))):
            return None
        mixer = block.mixer if isinstance(block.mixer, kernels.AttnBlock) else block.mixer.block
        return MoELayer(mixer, block.post_norm, block.eps, router.weight, router.k, router.renormalize,
                        input_norm=block.input_norm, shared=None if shared is None else shared.table,
                        shared_gate=None if shared is None else shared.expert_gate, glu=self.ffn.activation,
                        limit=self.ffn.limit, alpha=self.ffn.alpha)

    @staticmethod
    def _routed(layer: int, x: np.ndarray, residual: np.ndarray, token_ids: np.ndarray, weights: np.ndarray,
                ids: np.ndarray) -> None:
        """Tell the probe and the recorder (if either listens) the layer's routing."""
        route(layer, ids)
        record(layer, ffn_inp=residual, ffn_norm=x, ffn_moe_ids=ids, ffn_moe_weights=weights, ffn_moe_tokens=token_ids)

    def _fuses(self, shared: SharedExpert, expert_input: np.ndarray | None) -> bool:
        """Whether `shared` can run in the routed experts' C call: quantised weights of one kind, the
        same input, gated unit and clamp as theirs, and no probe asking for the routed sum alone."""
        return (shared.table is not None and expert_input is None and shared.glu == self.ffn.activation
                and shared.limit == self.ffn.limit and not listening())

    def _add_shared(self, layer: int, out: np.ndarray, x: np.ndarray, shared: SharedExpert | None,
                    shared_out: np.ndarray | None = None) -> np.ndarray:
        """The routed experts' sum `out` (T, H), recorded, + the shared expert's output on x."""
        record(layer, ffn_moe_out=out)
        if shared is None:
            return out
        shared_out = shared(x) if shared_out is None else shared_out
        record(layer, ffn_shexp=shared_out)
        return out + shared_out
