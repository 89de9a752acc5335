"""The tiered expert store: routed experts read from disk on demand into per-layer caches.

    store.py     ExpertStore: per-layer cache + hot-store of pinned experts, the batch union,
                 overlapped reads, router-lookahead prefetch, mirror selection, usage recording
                 (asked for experts by colibri_core/experts.py's ExpertSource, never by the model)
    policies.py  eviction policies (LRU, LFU), registered through the plugin hook
                 ``colibri_register_cache_policies`` like any plugin's
    usage.py     the routing history ``.coli_usage`` beside the model, and choosing the hot set
    io.py        the C I/O thread pool (csrc/io_pool.c): pread into aligned buffers, O_DIRECT
    mirror.py    the copies of the container an expert can be read from, weighted by bandwidth
    stats.py     the counters (hits, misses, bytes, prefetch recall, stall time, per layer) and
                 `Placement` (which experts each layer holds: the server's snapshot reads it)

Placement changes speed only: every expert, wherever it came from, is handed to the kernels as
the same QTensor views of its verified extent.

This package's ``__init__`` imports nothing heavy (the plugin manager imports `policies` when
listing plugins); `ExpertStore` is imported on first use.
"""
__all__ = ["ExpertStore", "StoreConfig"]


def __getattr__(name):
    if name in __all__:
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module 'colibri_core.store' has no attribute {name!r}")
