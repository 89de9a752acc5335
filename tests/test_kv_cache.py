"""The KV cache's growth (colibri_core/kv/cache.py): rows kept across every reallocation, and arrays
from one huge page up in their own huge-page mapping with their capacity filling its pages."""
import numpy as np

from colibri_core.arena import HUGE_PAGE
from colibri_core.kv.cache import KVCache, Rows


def test_growth_keeps_every_row_and_moves_to_huge_pages():
    cache = KVCache(2, 64, capacity=4)  # a row is 512 bytes: 4096 rows fill a huge page
    rng = np.random.default_rng(0)
    ks, vs = [], []
    for T in (3, 1, 60, 1000, 3000, 1):  # capacity 4 → 64 → 1064 → 4064 asked: two huge pages, 8192 rows
        k, v = rng.standard_normal((2, T, 2, 64), dtype=np.float32)
        cache.append(k, v)
        ks.append(k), vs.append(v)
        held_k, held_v = cache.view()
        assert (held_k == np.concatenate(ks)).all() and (held_v == np.concatenate(vs)).all()
    assert cache.length == 4065 and cache.k.shape == cache.v.shape == (8192, 2, 64)
    for a in (cache.k, cache.v):
        assert a.ctypes.data % HUGE_PAGE == 0 and a.dtype == np.float32 and a.flags.c_contiguous


def test_a_huge_array_fills_its_pages_and_a_small_one_stays_as_asked():
    assert KVCache(4, 100, capacity=3).k.shape == (3, 4, 100)  # small: NumPy's memory, capacity as given
    big = KVCache(3, 100, capacity=1000)  # 1000 rows of 1200 bytes: below a huge page
    assert big.k.shape[0] == 1000
    rows = Rows(3, 100, capacity=2000)  # 2.4 MB: two huge pages, 3495 rows of 1200 bytes fit in them
    assert rows.data.shape == (2 * HUGE_PAGE // 1200, 3, 100) and rows.data.ctypes.data % HUGE_PAGE == 0
    rows.append(np.ones((5, 3, 100), np.float32))
    assert rows.view().shape == (5, 3, 100) and (rows.view() == 1).all()
