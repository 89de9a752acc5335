"""The C I/O pool seen from Python (colibri_core/store/io.py): a pool that never started leaves
nothing behind. Bounded reads of whole files (colibri_core/fsio.py): refused before reading, in one
line naming the file and the bound."""
import gc
import os
import resource
import sys

import pytest

from colibri_core.errors import ColibriError
from colibri_core.fsio import read_bounded, read_json, read_text
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


def test_a_file_past_its_bound_is_refused_unread(tmp_path):
    path = tmp_path / "colibri.yaml"
    with open(path, "wb") as f:
        f.truncate(8 << 30)  # sparse: nothing written
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ColibriError) as e:
        read_bounded(path, 64 << 20, "container manifest", "reconvert the model")
    assert str(e.value) == f"{path} (container manifest) is 8.6 GB, more than the 67.1 MB such a file may be: " \
                           "reconvert the model"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: nothing was read
    path.write_bytes(b"x" * 100)
    assert read_bounded(path, 100) == b"x" * 100  # at the bound: read whole
    with pytest.raises(ColibriError, match="is 100 B, more than the 99 B"):
        read_bounded(path, 99)


def test_a_file_that_holds_more_than_its_size_says_is_refused():
    """/proc files stat as 0 bytes: what is read is checked as well as the size."""
    assert "Name:" in read_text("/proc/self/status", 1 << 20)
    with pytest.raises(ColibriError, match=r"^/proc/self/status holds more than the 100 B such a file may be$"):
        read_bounded("/proc/self/status", 100)


def test_what_is_no_regular_file_is_read_within_the_bound(tmp_path):
    """A device that never ends is cut at the bound; a FIFO nobody writes reads as empty (its open
    would have waited for a writer); a pipe is read as it comes; a directory is refused."""
    with pytest.raises(ColibriError, match="^/dev/zero \\(JSON schema\\) holds more than the 16.8 MB such a file may be$"):
        read_bounded("/dev/zero", 16 << 20, "JSON schema")
    os.mkfifo(tmp_path / "fifo")
    assert read_bounded(tmp_path / "fifo", 16 << 20, "JSON schema") == b""
    r, w = os.pipe()
    os.write(w, b'{"type": "object"}')
    os.close(w)
    assert read_bounded(f"/dev/fd/{r}", 16 << 20) == b'{"type": "object"}'
    os.close(r)
    with pytest.raises(ColibriError, match=f"^{tmp_path} \\(JSON schema\\) is a directory, not a file$"):
        read_bounded(tmp_path, 16 << 20, "JSON schema")


def test_unreadable_json_is_one_line(tmp_path):
    with pytest.raises(ColibriError, match=f"^cannot read {tmp_path}/config.json: No such file or directory: fix it$"):
        read_json(tmp_path / "config.json", "fix it")
    (tmp_path / "config.json").write_bytes(b"\xff{}")
    with pytest.raises(ColibriError, match="config.json is not UTF-8 text"):
        read_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{} " * 100)
    with pytest.raises(ColibriError, match="config.json is 300 B, more than the 200 B such a file may be"):
        read_json(tmp_path / "config.json", limit=200)
