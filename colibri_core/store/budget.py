"""The RAM budget split (dense / state / expert cache / pinned) and the machine's bandwidths.

`split_budget` is the one rule the engine and `colibri plan` both use:

- dense: the resident weights (embeddings, attention, norms, routers), always in RAM;
- state: per-sequence state (KV caches, …) at the planned context length;
- the rest holds experts. If every expert fits, all are cached. Otherwise the hot-store pins
  ``pin_bytes`` worth of experts (default: `pin_share` of the expert budget, which the routing
  history chooses (usage.UsageHistory.pin_share; none without history), and never below top-k
  cache slots per layer where the budget allows), and the cache gets the remainder, at least one
  slot per MoE layer. A cache of fewer than
  top-k slots a layer gives up a few of them (up to top-k − 1 experts' worth in all) to the reads a
  layer has beyond its slots (`transient_experts`), so that a token's experts are read at once
  instead of one at a time as slots free up.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ColibriError

# the hot-store's default share of the expert budget once there is routing history: replaying the
# bench workload (tools/sim_expert_cache.py), a second session with 3/4 pinned (by usage.pin_value)
# reads 44 % (at 25 % of the experts) and 71 % (at 50 %) fewer experts per decoded token than cold
# LRU; with 1/2 pinned by routing count, 7 % and 9 % fewer. Measured (BENCHMARKS.md, issue 3): 15 %
# faster than cold at 50 %, but slower at 25 %, where the smaller cache makes misses wait for slots.
# It is the largest share the history may choose: where routing is popular only for a while (a
# prompt's own experts), a smaller hot-store and a larger cache miss less (BENCHMARKS.md, issue 21).
PIN_SHARE = 0.75
PIN_SHARES = (0.0, 0.25, 0.5, PIN_SHARE)  # the shares the routing history chooses among (UsageHistory.pin_share)


@dataclass
class Split:
    budget: int  # bytes in all
    dense: int  # resident weights
    state: int  # per-sequence state reserved
    cache_slots: int  # cache slots per MoE layer
    cache_bytes: int  # cache_slots × MoE layers × bytes per expert
    pinned_experts: int  # hot-store capacity (experts over all layers)
    pinned_bytes: int
    all_resident: bool  # every expert fits in the cache
    transient_experts: int = 0  # reads a layer may have in flight beyond its cache slots
    pin_share: float = 0.0  # the default hot-store's share of the expert budget (pin_bytes not given)

    def as_dict(self) -> dict:
        return asdict(self)


def experts_fit(budget: int, dense: int, state: int, expert_nbytes: int) -> int:
    """How many experts `budget` holds beside the dense weights and the state."""
    return (budget - dense - state) // expert_nbytes


def default_pinned(fit: int, moe_layers: int, top_k: int, share: float) -> int:
    """Experts the default hot-store pins with `share` of a budget of `fit` experts: never so many
    that a layer's cache would hold fewer than `top_k` (where the budget allows it)."""
    return min(int(fit * share), max(0, fit - moe_layers * top_k))


def split_budget(budget: int, dense: int, state: int, expert_nbytes: int, moe_layers: int, n_experts: int,
                 pin_bytes: int | None = None, pin_share: float = 0.0, top_k: int = 1) -> Split:
    """Split `budget` bytes; a ColibriError if it cannot hold one expert per MoE layer.

    Without `pin_bytes` the hot-store gets `pin_share` of the expert budget (`default_pinned`: the
    cache keeps at least `top_k` slots per layer where the budget allows it). With fewer, a layer's
    experts past its slots would be read one at a time, each once a computed one frees its slot
    (each a stall): up to top_k − 1 experts' worth goes to reads of their own instead
    (`transient_experts`, never below one slot a layer), all of a token's started at once."""
    fit = experts_fit(budget, dense, state, expert_nbytes)
    if fit < moe_layers:
        need = dense + state + moe_layers * expert_nbytes
        from ..sizes import format_bytes

        what = "resident weights + state + one expert per layer" if state else "resident weights + one expert per layer"
        raise ColibriError(f"RAM budget {format_bytes(budget)} is below this model's minimum {format_bytes(need)} ({what})")
    transient = 0
    if fit >= moe_layers * n_experts:
        pinned, slots = 0, n_experts
    else:
        if pin_bytes is None:
            pinned = default_pinned(fit, moe_layers, top_k, pin_share)
        else:
            pinned = int(pin_bytes // expert_nbytes)
            if pinned > fit - moe_layers:
                raise ColibriError(f"--pin-gb {pin_bytes / 1e9:g} leaves no cache slot in some layer: the budget "
                                   f"holds {fit} experts and the cache needs {moe_layers} (one per MoE layer)")
        pinned = min(pinned, fit - moe_layers)
        slots = min(n_experts, (fit - pinned) // moe_layers)
        if slots < top_k:
            transient = min(top_k - 1, fit - pinned - moe_layers)
            slots = (fit - pinned - transient) // moe_layers
            transient = min(transient, top_k - slots)
    return Split(budget, dense, state, slots, slots * moe_layers * expert_nbytes, pinned, pinned * expert_nbytes,
                 slots >= n_experts, transient, pin_share if pin_bytes is None and pinned else 0.0)


# ----------------------------------------------------------------------------- bandwidths

def disk_bandwidth(paths, nbytes: int = 256 << 20, chunk: int = 4 << 20, threads: int = 4) -> tuple[float, bool]:
    """(bytes/s reading up to `nbytes` from the start of `paths` (one path or several), whether O_DIRECT
    was used for all of them): `chunk`-byte preads on the C I/O pool with `threads` threads, as
    the store reads. With O_DIRECT the page cache is bypassed, so this is the device; where
    O_DIRECT is refused, a cold page cache is the caller's business."""
    from . import io

    paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
    pool = io.IOPool(threads)
    fds, direct, jobs, total = [], True, [], 0
    try:
        for path in paths:
            size = min(nbytes - total, Path(path).stat().st_size) // 4096 * 4096
            if size <= 0:
                continue
            fd, refused = io.open_expert_file(path, True, probe_bytes=4096)
            fds.append(fd)
            direct = direct and refused is None
            jobs += [(fd, off, min(chunk, size - off)) for off in range(0, size, chunk)]
            total += size
        if not jobs:
            raise ColibriError(f"{paths[0]} is too small to measure disk bandwidth")
        t0 = time.perf_counter()
        reads = [pool.submit(fd, off, n) for fd, off, n in jobs]
        done = 0
        for r in reads:
            pool.wait(r)
            done += r.req.got
        dt = time.perf_counter() - t0
    finally:
        pool.close()
        for fd in fds:
            io.close_fd(fd)
    return done / max(dt, 1e-9), direct


def disk_bandwidth_at(directory: str | os.PathLike, nbytes: int = 64 << 20) -> tuple[float, bool]:
    """Disk bandwidth of the filesystem holding `directory`, through a temporary file written there
    (read back with O_DIRECT where allowed; removed afterwards)."""
    block = os.urandom(1 << 20)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".colibri-bw-") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return disk_bandwidth(f.name, nbytes)


def memory_bandwidth(nbytes: int = 128 << 20, repeats: int = 3) -> float:
    """Bytes/s of reading memory: the best of `repeats` sums over a `nbytes` array (one core)."""
    import numpy as np

    a = np.ones(nbytes // 8, np.float64)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
