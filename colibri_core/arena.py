"""One block of memory for the resident weights, backed by transparent huge pages where the OS has them.

Each decode step streams every resident matrix once (attention projections, routers, lm_head):
gigabytes per second through the TLB. With 4 KB pages a 2048 x 2048 int4 projection (2 MB, below
the 4 MB from which NumPy itself asks for huge pages) spans 512 pages and its matrix-vector product
ran at 23.8 GB/s, in 2 MB pages at 31.5 GB/s (one process, alternated 40 times; BENCHMARKS.md).
So the container reads its resident tensors straight into one arena: a private anonymous mapping,
2 MB aligned, with MADV_HUGEPAGE (Linux; elsewhere, or when the kernel says no, ordinary pages).
The arrays handed out are views of it; the mapping lives as long as any of them does.
"""
from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
ALIGN = 64  # every array starts on a cache line


class Arena:
    """`nbytes` of zeroed memory handed out as aligned arrays by `take`, in order."""

    def __init__(self, nbytes: int):
        self.buf = huge_pages(nbytes)  # uint8, HUGE_PAGE aligned (ALIGN without mmap)
        self.used = 0

    def take(self, dtype, shape) -> np.ndarray:
        """The next free `shape` array of `dtype` (uninitialised, C-contiguous, 64-byte aligned)."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > len(self.buf):
            raise ValueError(f"arena of {len(self.buf)} bytes is full ({start} used, {nbytes} asked)")
        self.used = start + nbytes
        return self.buf[start:start + nbytes].view(dtype).reshape(shape)

    def copy(self, a: np.ndarray) -> np.ndarray:
        """A copy of `a` taken from the arena."""
        out = self.take(a.dtype, a.shape)
        out[...] = a
        return out

    @staticmethod
    def size(parts) -> int:
        """Bytes an arena needs for arrays of these (dtype, shape) pairs, alignment included."""
        return sum(-(-np.dtype(dt).itemsize * int(np.prod(s, dtype=np.int64)) // ALIGN) * ALIGN for dt, s in parts)


def huge_pages(nbytes: int) -> np.ndarray:
    """`nbytes` of zeroed memory (uint8) in its own mapping, 2 MB aligned, with MADV_HUGEPAGE
    (ordinary memory where there is no POSIX mmap); the array keeps the mapping alive."""
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if None in flags or nbytes == 0:  # not a POSIX mmap (Windows): ordinary memory
        buf = np.zeros(nbytes + ALIGN, np.uint8)
        skip = -buf.ctypes.data % ALIGN
        return buf[skip:skip + nbytes]
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags[0] | flags[1])
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(m, np.uint8)  # keeps m alive
    skip = -buf.ctypes.data % HUGE_PAGE  # huge pages need 2 MB aligned virtual addresses
    return buf[skip:skip + nbytes]
