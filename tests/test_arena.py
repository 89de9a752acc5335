"""The resident weights' arena (colibri_core/arena.py): aligned views, its size, huge-page alignment."""
import mmap

import numpy as np
import pytest

from colibri_core.arena import ALIGN, HUGE_PAGE, Arena


def test_take_hands_out_aligned_disjoint_arrays():
    parts = [(np.float32, (3, 5)), (np.float16, (7,)), (np.uint8, (2, 33)), (np.int8, (1,))]
    arena = Arena(Arena.size(parts))
    arrays = [arena.take(dt, shape) for dt, shape in parts]
    for a, (dt, shape) in zip(arrays, parts):
        assert a.dtype == dt and a.shape == shape and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % ALIGN == 0
    for i, a in enumerate(arrays):
        a[...] = i + 1
    for i, a in enumerate(arrays):  # no array overlaps another
        assert (a == i + 1).all()
    with pytest.raises(ValueError, match="full"):
        arena.take(np.uint8, (1,))


def test_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    arena = Arena(Arena.size([(a.dtype, a.shape)]))
    b = arena.copy(a)
    assert (b == a).all() and b.dtype == a.dtype and np.shares_memory(b, arena.buf)


def test_size_rounds_every_array_up_to_a_cache_line():
    assert Arena.size([(np.float32, (1,)), (np.uint8, (65,))]) == ALIGN + 2 * ALIGN
    assert Arena.size([]) == 0


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS: the arena is ordinary memory")
def test_the_arena_starts_on_a_huge_page_boundary():
    arena = Arena(3 * HUGE_PAGE)
    assert arena.buf.ctypes.data % HUGE_PAGE == 0 and len(arena.buf) == 3 * HUGE_PAGE
