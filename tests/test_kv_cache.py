"""The KV cache (colibri_core/kv/cache.py): rows kept across every reallocation, arrays from one huge
page up in their own huge-page mapping with their capacity filling its pages; and the float16 cache
(`kv_cache="f16"`, COLIBRI_KV_CACHE): an explicit choice, off by default, deterministic and
placement-invariant, close to the float32 cache, and saved and resumed as any state."""
import shutil

import numpy as np
import pytest

import colibri_core
from colibri_core.arena import HUGE_PAGE
from colibri_core.errors import ColibriError
from colibri_core.kv.cache import KVCache, Rows


def test_growth_keeps_every_row_and_moves_to_huge_pages():
    cache = KVCache(2, 64, capacity=4)  # a row is 512 bytes: 4096 rows fill a huge page
    rng = np.random.default_rng(0)
    ks, vs = [], []
    for T in (3, 1, 60, 1000, 3000, 1):  # capacity 4 → 128 → 2128 → 8128 asked: two huge pages, 8192 rows
        k, v = rng.standard_normal((2, T, 2, 64), dtype=np.float32)
        cache.append(k, v)
        ks.append(k), vs.append(v)
        held_k, held_v = cache.view()
        assert (held_k == np.concatenate(ks)).all() and (held_v == np.concatenate(vs)).all()
    assert cache.length == 4065 and cache.k.shape == cache.v.shape == (8192, 2, 64)
    for a in (cache.k, cache.v):
        assert a.ctypes.data % HUGE_PAGE == 0 and a.dtype == np.float32 and a.flags.c_contiguous


def test_a_prompt_that_fills_the_cache_leaves_room_to_decode():
    """Growing, the cache takes twice what is needed: the first decoded token after a long prompt
    does not copy the whole cache into new pages."""
    for cache in (KVCache(2, 64, capacity=4), KVCache(2, 64, "f16", capacity=4)):
        cache.append(*np.ones((2, 3000, 2, 64), np.float32))
        k, v = cache.k, cache.v
        for _ in range(10):
            cache.append(*np.ones((2, 1, 2, 64), np.float32))
        assert cache.k is k and cache.v is v and cache.length == 3010
    rows = Rows(8, capacity=4)
    rows.append(np.ones((100, 8), np.float32))
    data = rows.data
    rows.append(np.ones((1, 8), np.float32))
    assert rows.data is data


def test_a_huge_array_fills_its_pages_and_a_small_one_stays_as_asked():
    assert KVCache(4, 100, capacity=3).k.shape == (3, 4, 100)  # small: NumPy's memory, capacity as given
    big = KVCache(3, 100, capacity=1000)  # 1000 rows of 1200 bytes: below a huge page
    assert big.k.shape[0] == 1000
    rows = Rows(3, 100, capacity=2000)  # 2.4 MB: two huge pages, 3495 rows of 1200 bytes fit in them
    assert rows.data.shape == (2 * HUGE_PAGE // 1200, 3, 100) and rows.data.ctypes.data % HUGE_PAGE == 0
    rows.append(np.ones((5, 3, 100), np.float32))
    assert rows.view().shape == (5, 3, 100) and (rows.view() == 1).all()


def test_float16_rows_grow_and_round_as_numpy():
    cache = KVCache(2, 64, "f16", capacity=4)
    k, v = np.random.default_rng(1).standard_normal((2, 300, 2, 64), dtype=np.float32)
    cache.append(k[:3], v[:3]), cache.append(k[3:], v[3:])
    held_k, held_v = cache.view()
    assert held_k.dtype == np.float16 and (held_k == k.astype(np.float16)).all() and (held_v == v.astype(np.float16)).all()
    assert KVCache(2, 64).k.dtype == np.float32  # the default
    with pytest.raises(ColibriError, match="unknown KV cache type 'f8'"):
        KVCache(2, 64, "f8")


def test_float16_cache_is_placement_invariant_close_to_float32_and_resumes(tiny_model, tmp_path, monkeypatch):
    ids = [5, 17, 3, 99, 42, 7, 8, 250]
    with colibri_core.load(tiny_model) as exact:
        assert exact.kv_cache == "f32" and exact.new_state()["layer.0"].k.dtype == np.float32
        want = exact.logits(ids)
    got = {}
    for slots in (1, 3, 8):
        with colibri_core.load(tiny_model, cache_slots=slots, kv_cache="f16") as e:
            assert e.new_state()["layer.0"].k.dtype == np.float16
            got[slots] = (e.logits(ids), e.generate(ids, 6, stop_ids=()))
    for slots in (3, 8):
        assert np.array_equal(got[slots][0].view(np.uint32), got[1][0].view(np.uint32))
        assert got[slots][1] == got[1][1]
    assert not np.array_equal(got[1][0], want)  # a different arithmetic, really in use
    assert np.abs(got[1][0] - want).max() <= 0.01 * np.abs(want).max()

    model = tmp_path / "m"  # a session's float16 state saved, then resumed by a fresh engine: the same tokens
    shutil.copytree(tiny_model, model)
    monkeypatch.setenv("COLIBRI_KV_CACHE", "f16")
    with colibri_core.load(model) as e:
        assert e.kv_cache == "f16"
        whole = e.generate(ids, 8, stop_ids=())
        first = e.generate(ids, 4, stop_ids=(), session="s")
        assert e.open_session("s").state["layer.0"].k.dtype == np.float16
    with colibri_core.load(model) as e:
        assert first + e.generate(ids + first, 4, stop_ids=(), session="s") == whole
    with pytest.raises(ColibriError, match="unknown KV cache type 'bf16'"):
        colibri_core.load(tiny_model, kv_cache="bf16")
