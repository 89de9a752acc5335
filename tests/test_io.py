"""The C I/O pool seen from Python (colibri_core/store/io.py): a pool that never started leaves
nothing behind."""
import gc
import sys

import pytest

from colibri_core.errors import ColibriError
from colibri_core.store import io


def test_a_pool_that_never_started_is_collected_quietly(monkeypatch):
    """`__init__` failing (no threads asked for; the C pool refusing to start) raises one ColibriError;
    collecting the half-built pool then raises nothing more (`__del__` closes only what started)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ColibriError, match="at least one thread"):
        io.IOPool(0)

    class Refusing:  # the C library, failing to start threads
        io_pool_new = staticmethod(lambda threads: io.ffi.NULL)

    with monkeypatch.context() as m, pytest.raises(ColibriError, match="cannot start 2 I/O threads"):
        m.setattr(io, "lib", Refusing)
        io.IOPool(2)
    gc.collect()
    assert not unraisable, [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable]
    pool = io.IOPool(1)  # a pool that started is closed once, by `close` or on collection
    pool.close()
    pool.close()
    del pool
    gc.collect()
    assert not unraisable
