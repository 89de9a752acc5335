"""A failed expert read is never cached (colibri_core/store): the next request for that expert reads
it again — and gets it, or fails again while the file is still bad. It is never counted as a hit
with no tensors, and an earlier read's error is never raised again for a new request."""
import shutil

import numpy as np
import pytest

from colibri_core import quant
from colibri_core.container import Container
from colibri_core.engine import load
from colibri_core.errors import ColibriError
from colibri_core.testing.sessions import failing_read

EXPERT = 3


def counts(engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s["reads"], s["expert_hits"], s["expert_misses"]


def request(engine, layer: int, expert: int, raises: str | None = None):
    """`store.get` of one expert: (its tensors or None, the (reads, hits, misses) the request added)."""
    before = counts(engine)
    if raises is None:
        tensors = engine.store.get(layer, expert)
    else:
        with pytest.raises(ColibriError, match=raises):
            engine.store.get(layer, expert)
        tensors = None
    return tensors, tuple(b - a for a, b in zip(before, counts(engine)))


def same(got, want) -> bool:
    return all(np.array_equal(quant.dequantize(a), quant.dequantize(b)) for a, b in zip(got, want))


def test_a_failed_read_is_read_again(tiny_model):
    """An I/O error once: the next request reads the expert again and gets it (a miss both times)."""
    with Container(tiny_model) as c:
        layer = c.moe_layers[0]
        want = c.read_expert(layer, EXPERT)
    with load(tiny_model, cache_slots=1, usage=False) as engine:
        with failing_read():
            _, cost = request(engine, layer, EXPERT, raises="injected")
        assert cost == (1, 0, 1)
        tensors, cost = request(engine, layer, EXPERT)
        assert cost == (1, 0, 1), f"(reads, hits, misses) {cost}: the failed read was kept as if cached"
        assert same(tensors, want)
        tensors, cost = request(engine, layer, EXPERT)
        assert cost == (0, 1, 0) and same(tensors, want)


def test_a_corrupt_expert_fails_until_repaired(tiny_model, tmp_path):
    """A flipped byte in an expert's extent: every request reads it again and fails (checksum) while
    the file is bad, never with an earlier read's error; once repaired, the next request gets it."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    with Container(model) as c:
        layer = c.moe_layers[-1]
        want = c.read_expert(layer, EXPERT)
        path, offset, nbytes = c.expert_location(layer, EXPERT)
    where = offset + nbytes // 2
    with open(path, "r+b") as f:
        f.seek(where)
        good = f.read(1)
        f.seek(where)
        f.write(bytes([good[0] ^ 0xFF]))
    with load(model, cache_slots=1, usage=False) as engine:
        for _ in range(2):
            _, cost = request(engine, layer, EXPERT, raises="corrupt expert data")
            assert cost == (1, 0, 1), f"(reads, hits, misses) {cost}: the corrupt read was kept as if cached"
        with open(path, "r+b") as f:
            f.seek(where)
            f.write(good)
        tensors, cost = request(engine, layer, EXPERT)
        assert cost == (1, 0, 1), f"(reads, hits, misses) {cost} once repaired: an earlier read was reused"
        assert same(tensors, want)
