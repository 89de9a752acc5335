"""The Atlas the dashboard draws (GET /api/atlas): the model's atlas file (colibri_core/atlas.py),
placed once per version of the file, with this server's tiers and routing heat from a `Snapshot`
(snapshot.py) laid over it on every request, as the Brain has them."""
from __future__ import annotations

import numpy as np

from .. import atlas
from ..store.usage import model_fingerprint
from .snapshot import Snapshot


def document(engine, snap: Snapshot, model_id: str) -> dict:
    """/api/atlas's JSON; a ColibriError when the model has no atlas yet or its file is refused. Reads
    only what never changes once the engine is loaded: its container's layout and state directory."""
    c = engine.container
    placed_atlas, placed = atlas.load_placed(engine.sessions_dir / atlas.ATLAS_FILE, model_fingerprint(c),
                                             list(c.moe_layers), c.n_experts)
    tiers = atlas.tier_codes(snap.cached, snap.pinned, snap.layers, snap.n_experts)
    heat = np.stack([snap.routed.get(layer, np.zeros(snap.n_experts, np.int64)) for layer in snap.layers])
    return atlas.document(placed_atlas, placed, tiers, heat, [c.layer_expert_nbytes(layer) for layer in c.moe_layers],
                          model_id)
