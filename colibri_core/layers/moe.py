"""The routed-expert block: the core runs a layer's declared router, the lookahead for the next MoE
layer, and every expert the batch needs, fetched from the store and run by the C kernels.

Placement never changes the result: each expert's FFN is computed by the same kernel wherever its
weights came from and whichever experts were ready first, each token's expert output lands in a
fixed slot (its top-k rank), and the weighted sum over ranks is taken in rank order. The same holds
for remote shards (colibri_core/remote): a shard computes the slots of its experts with the same
kernels on another machine, and they land in the same slots.
"""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..errors import ColibriError
from ..probe import listening, record, route, timed
from ..quant import QTensor
from .router import Router, SoftmaxTopK
from .shared_expert import SharedExpert


def run_experts(outs: np.ndarray, x: np.ndarray, ids: np.ndarray, experts: dict, limit: float | None = None) -> None:
    """Fill the slots of `experts` ({expert id: (gate, up, down)}) in outs (T, k, H).

    outs[t, r] = FFN_{ids[t, r]}(x[t]) for every (t, r) routed to one of `experts` (SwiGLU, clamped at
    `limit` if given); each row is computed independently of the others, so batching never changes a
    result.
    """
    kernels.moe_experts(outs, x, ids, experts, limit=limit)  # one C call: every expert, every slot, threads inside


def run_situ_experts(outs: np.ndarray, x: np.ndarray, ids: np.ndarray, experts: dict, limit: float | None = None) -> None:
    """`run_experts` with Kimi K3's SiTU-GLU instead of SwiGLU (`layers.situ`; no clamp): the same
    fused C call, its gated unit switched."""
    kernels.moe_experts(outs, x, ids, experts, glu="situ")


def combine(outs: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ_rank weights[t, r] · outs[t, r], summed in rank order. outs (T, k, H), weights (T, k) → (T, H)."""
    return kernels.moe_combine(outs, weights)  # one C call, the same float32 operations as NumPy's


class MoE:
    """Every MoE layer of one model: its declared routers, the lookahead between them, the store.

    `routers` {layer: Router} in the order the forward pass runs them; `lookahead` {layer: the MoE
    layer whose experts it predicts} (by default each layer's successor in `routers`); `swiglu_limit`
    the experts' SwiGLU clamp (`ContainerLayout.swiglu_limit`); `activation` their gated unit
    (`ContainerLayout.expert_activation`: "swiglu", or "situ", Kimi K3's SiTU-GLU).
    """

    def __init__(self, store, routers: dict[int, Router], lookahead: dict[int, int] | None = None,
                 swiglu_limit: float | None = None, activation: str = "swiglu"):
        for layer, router in routers.items():
            if not isinstance(router, Router):
                raise ColibriError(f"MoE layer {layer}: the model declared a {type(router).__name__}, not a colibri Router")
        layers = list(routers)
        if activation not in ("swiglu", "situ"):
            raise ColibriError(f"unknown expert activation {activation!r} (colibri runs 'swiglu' and 'situ')")
        self.store, self.routers, self.swiglu_limit = store, routers, swiglu_limit
        self.run = run_experts if activation == "swiglu" else run_situ_experts
        self.activation = activation
        self.lookahead = dict(zip(layers, layers[1:])) if lookahead is None else dict(lookahead)

    @timed("moe")
    def __call__(self, layer: int, x: np.ndarray, residual: np.ndarray, token_ids: np.ndarray,
                 expert_input: np.ndarray | None = None, shared: SharedExpert | None = None) -> np.ndarray:
        """MoE layer `layer`: x (T, H) the router's input (the layer's normalised residual stream),
        residual (T, H) the residual stream it was computed from (the lookahead's input), token_ids
        (T,) → (T, H) = Σ_rank weight · expert(expert_input), expert_input defaulting to x; with a
        `shared` expert, + shared(x) (the bits of adding it to this call's result).

        The store reads the batch union once and yields the experts already resident first, the
        others in groups as their reads arrive, so compute overlaps the reads; once this layer's
        reads are queued, the next MoE layer's router guesses its experts from `residual` and the
        store starts reading those too. A layer that holds all its experts (the store's
        `resident_table`) runs its experts and their weighted sum as one C call (`kernels.moe_block`),
        the same bits, and a `SoftmaxTopK` router in that call too (`kernels.moe_block_softmax`:
        the Python between them was ~5 % of an OLMoE-size decode step). The shared expert runs in that call too, as one more rank (when it has the
        routed experts' gated unit and clamp, and no probe listens for the routed sum alone), or
        else while the first reads are in flight.
        """
        router = self.routers.get(layer)
        if router is None:
            raise ColibriError(f"MoE layer {layer} has no declared router (declared: {list(self.routers)})")
        xe = x if expert_input is None else expert_input  # (T, H)
        nxt = self.lookahead.get(layer)
        predict = None if nxt is None else (nxt, lambda: self.routers[nxt].predict(residual, token_ids))
        remote = getattr(self.store, "remote", None)  # remote shards behind the store (colibri_core/remote)
        table = self.store.resident_table(layer, predict) if remote is None else None
        if table is not None:  # the layer holds all its experts: the experts and their weighted sum, one C call
            fused = shared is not None and self._fuses(shared, expert_input)
            kw = dict(limit=self.swiglu_limit, glu=self.activation)
            if fused:
                kw.update(shared=shared.table, shared_scale=shared.scale(x))
            if expert_input is None and type(router) is SoftmaxTopK and isinstance(router.weight, QTensor):
                # the core's softmax router runs in the same call (a subclass may route otherwise)
                out, weights, ids = kernels.moe_block_softmax(x, router.weight, router.k, router.renormalize, table, **kw)
            else:
                weights, ids = router.route(x, token_ids)  # (T, k) each, best first
                out = kernels.moe_block(xe, ids, weights, table, **kw)
            self._routed(layer, x, residual, token_ids, weights, ids)
            self.store.count_resident(layer, ids)
            return out if fused else self._add_shared(layer, out, x, shared)
        weights, ids = router.route(x, token_ids)  # (T, k) each, best first
        self._routed(layer, x, residual, token_ids, weights, ids)
        T, k = ids.shape
        outs = np.zeros((T, k, xe.shape[1]), np.float32)  # (T, k, H): one slot per (token, rank)
        sent = None
        if remote is not None:  # experts not resident here go to their shard's actor now, one call per shard
            sent = remote.dispatch(layer, xe, ids, self.store.resident(layer), self.activation, self.swiglu_limit)
            if predict is not None:
                predict = (nxt, remote.watch(nxt, predict[1]))  # the lookahead also warms the remote shards
        skip = sent.experts if sent is not None else frozenset()
        shared_out = None
        for ready in self.store.experts(layer, ids, predict=predict, skip=skip):  # {expert: (gate, up, down)}, resident first
            self.run(outs, xe, ids, ready, self.swiglu_limit)
            if shared is not None and shared_out is None:  # the reads are queued now: compute it meanwhile
                shared_out = shared(x)
        if sent is not None:
            failed = remote.collect(sent, outs)  # the shards' slots; a failed or late shard's experts are …
            if failed:  # … read and computed here, within this call
                for ready in self.store.experts(layer, ids, skip=skip - failed, record=False):
                    self.run(outs, xe, ids, ready, self.swiglu_limit)
        out = combine(outs, weights)  # (T, H)
        return self._add_shared(layer, out, x, shared, shared_out)

    @staticmethod
    def _routed(layer: int, x: np.ndarray, residual: np.ndarray, token_ids: np.ndarray, weights: np.ndarray,
                ids: np.ndarray) -> None:
        """Tell the probe and the recorder (if either listens) the layer's routing."""
        route(layer, ids)
        record(layer, ffn_inp=residual, ffn_norm=x, ffn_moe_ids=ids, ffn_moe_weights=weights, ffn_moe_tokens=token_ids)

    def _fuses(self, shared: SharedExpert, expert_input: np.ndarray | None) -> bool:
        """Whether `shared` can run in the routed experts' C call: quantised weights of one kind, the
        same input, gated unit and clamp as theirs, and no probe asking for the routed sum alone."""
        return (shared.table is not None and expert_input is None and shared.glu == self.activation
                and shared.limit == self.swiglu_limit and not listening())

    def _add_shared(self, layer: int, out: np.ndarray, x: np.ndarray, shared: SharedExpert | None,
                    shared_out: np.ndarray | None = None) -> np.ndarray:
        """The routed experts' sum `out` (T, H), recorded, + the shared expert's output on x."""
        record(layer, ffn_moe_out=out)
        if shared is None:
            return out
        shared_out = shared(x) if shared_out is None else shared_out
        record(layer, ffn_shexp=shared_out)
        return out + shared_out
