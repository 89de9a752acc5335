"""The C I/O thread pool (csrc/io_pool.c) seen from Python: aligned buffers, reads, O_DIRECT.

    pool = IOPool(threads=4)
    fd, direct = open_expert_file(path, direct=True)       # falls back with one warning if refused
    read = pool.submit(fd, offset, nbytes)                  # returns at once; a worker preads
    buf = pool.wait(read)                                   # GIL released while waiting; a memoryview

Buffers are 4096-byte aligned (from 2 MB on, back to back in huge-page slabs: csrc/io_pool.c says
why) and freed when the last view of them is gone (the QTensors the container parses from a buffer
view it without copying). A read in flight keeps its request and buffer alive in the pool until it
is done; `close` waits for every read.
"""
from __future__ import annotations

import os
import time

from ..errors import ColibriError
from ..kernels._colibri_kernels import ffi, lib


def aligned_buffer(nbytes: int):
    """A writable 4096-aligned buffer of `nbytes` (a cffi buffer; freed with its last view)."""
    ptr = lib.io_alloc(nbytes)
    if ptr == ffi.NULL:
        raise MemoryError(f"cannot allocate an aligned buffer of {nbytes} bytes")
    ptr = ffi.gc(ptr, lib.io_free, size=nbytes)
    return ffi.buffer(ptr, nbytes), ptr


class Read:
    """One extent read in flight (or done): `source`, layer, expert and where it goes."""

    __slots__ = ("req", "buf", "ptr", "layer", "expert", "source", "path", "t0")

    def __init__(self, req, buf, ptr, layer, expert, source, path):
        self.req, self.buf, self.ptr = req, buf, ptr
        self.layer, self.expert, self.source, self.path = layer, expert, source, path
        self.t0 = time.perf_counter()


class ReadGroup:
    """One expert read as several extents (a checkpoint run without conversion whose expert tensors are
    not contiguous): the parts' reads, waited for and reported together; no checksum."""

    __slots__ = ("parts", "layer", "expert", "source", "path", "req")

    class _Req:
        crc = None

        def __init__(self, parts):
            self._parts = parts

        @property
        def seconds(self) -> float:
            return sum(p.req.seconds for p in self._parts)

    def __init__(self, parts: list[Read], layer, expert, source, path):
        self.parts, self.layer, self.expert, self.source, self.path = parts, layer, expert, source, path
        self.req = ReadGroup._Req(parts)


class IOPool:
    """Worker threads reading extents with pread; `threads` reads in parallel. Buffers from 2 MB on
    come in huge pages until faulting them in proves slow (csrc/io_pool.c), unless
    `keep_huge_pages` (a cache that will hold every expert: faulted once, read every token)."""

    def __init__(self, threads: int = 4, keep_huge_pages: bool = False):
        self._pool = None  # until the threads start: `close` (and `__del__`) of a pool that never did
        self._inflight: set[Read] = set()
        if threads < 1:
            raise ColibriError(f"the I/O pool needs at least one thread, got {threads}")
        self.threads = threads
        pool = lib.io_pool_new(threads)
        if pool == ffi.NULL:
            raise ColibriError(f"cannot start {threads} I/O threads")
        self._pool = pool
        if keep_huge_pages:  # reads filling a cache of every expert once: csrc/io_pool.c says why
            lib.io_pool_keep_huge_pages(pool)

    def submit(self, fd: int, offset: int, nbytes: int, *, layer=-1, expert=-1, source=None, path="",
               crc_hole: tuple[int, int] | None = None, buffer=None) -> Read:
        """Start reading; with `crc_hole` (offset, length) the worker also computes the crc32 of
        the bytes read less that hole (`Read.req.crc`). The bytes go into `buffer` (an
        `aligned_buffer` of at least `nbytes`, not in use by another read) or a fresh buffer."""
        buf, ptr = buffer if buffer is not None else aligned_buffer(nbytes)
        req = ffi.new("IoRequest *")
        req.fd, req.buf, req.offset, req.nbytes = fd, ptr, offset, nbytes
        if crc_hole is not None:
            req.want_crc, (req.hole_offset, req.hole_len) = 1, crc_hole
        read = Read(req, buf, ptr, layer, expert, source, path)
        if lib.io_submit(self._pool, req) != 0:
            raise ColibriError("the I/O pool is closed")
        self._inflight.add(read)
        return read

    def submit_group(self, extents: list[tuple[int, int, int]], *, layer=-1, expert=-1, source=None,
                     path="") -> ReadGroup:
        """Start reading extents [(fd, offset, nbytes)] of one expert, each into its own buffer."""
        return ReadGroup([self.submit(fd, offset, nbytes, layer=layer, expert=expert, source=source, path=path)
                          for fd, offset, nbytes in extents], layer, expert, source, path)

    def done(self, read: Read | ReadGroup) -> bool:
        if isinstance(read, ReadGroup):
            return all(self.done(p) for p in read.parts)
        return read not in self._inflight or bool(lib.io_done(self._pool, read.req))

    def wait(self, read: Read | ReadGroup) -> float:
        """Block until `read` is done (GIL released); the seconds spent waiting."""
        if isinstance(read, ReadGroup):
            return sum(self.wait(p) for p in read.parts)
        if read not in self._inflight:
            return 0.0
        t0 = time.perf_counter()
        lib.io_wait(self._pool, read.req)
        self._inflight.discard(read)
        return time.perf_counter() - t0

    @staticmethod
    def result(read: Read | ReadGroup) -> tuple[memoryview | list[memoryview] | None, str | None]:
        """(the bytes read, None) or (None, what went wrong) for a finished read (a group: the list of
        its parts' bytes)."""
        if isinstance(read, ReadGroup):
            results = [IOPool.result(p) for p in read.parts]
            err = next((e for _, e in results if e), None)
            return (None, err) if err else ([b for b, _ in results], None)
        req = read.req
        if req.err:
            return None, os.strerror(req.err)
        if req.got != req.nbytes:
            return None, f"short read ({req.got} of {req.nbytes} bytes: truncated file)"
        return memoryview(read.buf), None

    def close(self) -> None:
        """Wait for every read in flight, then stop the threads."""
        if self._pool is None:
            return
        for read in list(self._inflight):
            self.wait(read)
        lib.io_pool_free(self._pool)
        self._pool = None

    def __del__(self):
        self.close()


def open_expert_file(path: str, direct: bool, probe_bytes: int = 4096) -> tuple[int, str | None]:
    """(fd, None) — or, when `direct` was asked for and refused, (fd, why) with the fd reading
    through the page cache.

    With `direct`, open with O_DIRECT and probe one aligned read (some filesystems accept the flag
    at open and refuse the read).
    """
    refused = None
    if direct:
        fd, err = _open_direct(path, probe_bytes)
        if err == 0:
            return fd, None
        if fd >= 0:
            lib.io_close(fd)
        refused = os.strerror(err)
    fd = lib.io_open(path.encode(), 0)
    if fd < 0:
        raise ColibriError(f"cannot open expert file {path}: {os.strerror(-fd)}")
    return fd, refused


def _open_direct(path: str, probe_bytes: int) -> tuple[int, int]:
    """(fd or -errno, errno of the open or of the probe read; 0 when O_DIRECT works)."""
    fd = lib.io_open(path.encode(), 1)
    return fd, (-fd if fd < 0 else -lib.io_probe(fd, probe_bytes))


def direct_refused_message(path: str, why: str) -> str:
    return (f"O_DIRECT refused for {path} ({why}): the filesystem does not support it; "
            f"reading through the page cache instead")


def close_fd(fd: int) -> None:
    lib.io_close(fd)
