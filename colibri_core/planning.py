"""Sizing a model from its config.json alone, before anything is converted or loaded (what
`colibri plan` reports): resident bytes (every resident tensor's shape from the plugin's
`resident_shapes`, stored as the container would store it at --quant: the layout's f32 rules,
then `quant.layout`), the bytes of one routed expert and of all of them (the on-disk extents,
`container.reader.expert_extent` over `quant.packed_size`, with the layout's per-layer precision
floors), and the state: per token (`state_floats_per_token` plus `kept_apart_floats_per_token`,
at 4 bytes a float but `kv_cache_floats_per_token` at the KV cache type's size) and fixed
(`fixed_state_floats`). Everything comes from declared fields of the plugin's model class
and layout, never from guessing config.json names."""
from __future__ import annotations

import math
import re

import numpy as np

from . import plugins, quant
from .container.reader import expert_extent
from .errors import ColibriError
from .kv.cache import KV_CACHES, check_cache_type


NATIVE = "native"  # the official release's own formats, run without conversion (container/native.py)


def tensor_bytes(layout, name: str, shape: tuple[int, ...], kind: str) -> int:
    """Bytes of one resident tensor in a container converted at `kind` (or, for "native", as the
    official release is held in RAM: its fp8 matrices as they are, everything else float32)."""
    if kind == NATIVE:
        native = next((k for pattern, k in layout.native_resident if re.search(pattern, name)), None)
        if native is None or len(shape) != 2:
            return 4 * math.prod(shape)
        return sum(math.prod(s) * dt.itemsize for _, dt, s in quant.layout(native, *shape))
    if layout.stays_f32(name, len(shape)):
        return 4 * math.prod(shape)
    return sum(math.prod(s) * dt.itemsize for _, dt, s in quant.layout(kind, *shape))


def expert_bytes(layout, layer: int, kind: str) -> int:
    """Bytes of one routed expert of `layer`: its container extent at `kind`, or its tensors and
    scales in the official release's kind ("native")."""
    if kind == NATIVE:
        H, I = layout.hidden, layout.intermediate
        return sum(math.prod(s) * dt.itemsize for rows, cols in ((I, H), (I, H), (H, I))
                   for _, dt, s in quant.layout(layout.native_expert_kind, rows, cols))
    return expert_extent(layout.expert_kind(layer, kind), layout.hidden, layout.intermediate)[1]


def plan(model_cls, cfg, kind: str, kv_cache: str = "f32") -> dict:
    """The sizes of a model (its plugin's model class and parsed config) converted at `kind`, or run
    as released ("native"), its KV caches of type `kv_cache` (`load(kv_cache=...)`)."""
    if kind not in (*quant.KINDS, NATIVE):
        raise ColibriError(f"unknown quantisation {kind!r}: choose one of {', '.join(quant.KINDS)} or {NATIVE}")
    layout = model_cls.layout(cfg)
    if kind == NATIVE and layout.native_expert_kind is None:
        raise ColibriError(f"{model_cls.__name__} declares no native release format (ContainerLayout."
                           f"native_expert_kind): plan it at {', '.join(quant.KINDS)}")
    shapes = model_cls.resident_shapes(cfg)
    resident = sum(tensor_bytes(layout, name, shape, kind) for name, shape in shapes.items())
    per_layer = {layer: expert_bytes(layout, layer, kind) for layer in layout.moe_layers}
    state = list(model_cls.state_floats_per_token(cfg))
    out = {
        "quant": kind,
        "resident_bytes": resident,
        "resident_tensors": len(shapes),
        "expert_bytes": (max(per_layer.values(), default=0) if kind == NATIVE  # one routed expert at `kind`
                         else expert_extent(kind, layout.hidden, layout.intermediate)[1]),
        "experts_total": len(layout.moe_layers) * layout.n_experts,
        "experts_total_bytes": sum(per_layer.values()) * layout.n_experts,
        "moe_layers": len(layout.moe_layers),
        "experts_per_layer": layout.n_experts,
        "top_k": layout.top_k,
        "kv_floats_per_token_per_layer": state[0] if len(set(state)) == 1 else state,
        "kv_cache": kv_cache,
        "state_bytes_per_token": state_bytes_per_token(model_cls, cfg, kv_cache),
        "fixed_state_bytes": 4 * model_cls.fixed_state_floats(cfg),
    }
    for name, floats in model_cls.kept_apart_floats_per_token(cfg).items():
        out[f"{name}_floats_per_token_per_layer"] = list(floats)
    return out


def state_bytes_per_token(model_cls, cfg, kv_cache: str = "f32") -> int:
    """Bytes of per-sequence state each token adds: every layer's growing state
    (`state_floats_per_token`) plus any kept apart, such as DSA indexer keys, at 4 bytes a float —
    but the part in KV caches (`kv_cache_floats_per_token`) at the size of a `kv_cache` element."""
    kept_apart = model_cls.kept_apart_floats_per_token(cfg).values()
    floats = sum(model_cls.state_floats_per_token(cfg)) + sum(sum(f) for f in kept_apart)
    cached = sum(model_cls.kv_cache_floats_per_token(cfg))
    return 4 * (floats - cached) + np.dtype(KV_CACHES[check_cache_type(kv_cache)]).itemsize * cached


def plan_config(config: dict, kind: str, where: str = "config.json", kv_cache: str = "f32") -> dict:
    """`plan` for a config.json dict, served by whichever installed plugin serves it."""
    registry = plugins.registry()
    arch = registry.resolve(config, where=where)
    model_cls = registry.model_class(arch)
    return {"architecture": arch.name, **plan(model_cls, model_cls.parse_config(config), kind, kv_cache)}


def measured(model_dir) -> dict:
    """The same sizes, measured on a converted container (what `plan` must predict)."""
    from pathlib import Path

    from .container import Container

    with Container(model_dir) as c:
        files = [Path(c.expert_location(layer, 0)[0]) for layer in c.moe_layers]
        return {
            "quant": c.quant,
            "resident_bytes": c.resident_nbytes,
            "expert_bytes": c.expert_nbytes,
            "experts_total": len(c.moe_layers) * c.n_experts,
            "experts_total_bytes": sum(f.stat().st_size for f in files),
        }
