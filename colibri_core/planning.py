"""Planning: how a model sits in a RAM budget and how fast this machine could run it, before anything
is loaded. `colibri plan` prints it (`report`, `format_report`); the engine splits its budget at load
with the same rule (`split`).

Sizes, from a model's config.json alone (a model not downloaded yet): resident bytes (every resident
tensor's shape from the plugin's `resident_shapes`, stored as the container would store it at
--quant: the layout's f32 rules, then `quant.layout`), the bytes of one routed expert and of all of
them (the on-disk extents, `container.reader.expert_extent` over `quant.packed_size`, with the
layout's per-layer precision floors), and the state: per token (`state_floats_per_token` plus
`kept_apart_floats_per_token`, at 4 bytes a float but `kv_cache_floats_per_token` at the KV cache
type's size) and fixed (`fixed_state_floats`). Everything comes from declared fields of the
plugin's model class and layout, never from guessing config.json names; `measured` reads the same
sizes off a converted container.

The split of a RAM budget (`split_budget`):

- dense: the resident weights (embeddings, attention, norms, routers), always in RAM;
- state: per-sequence state (KV caches, …) at the planned context length (none where the engine
  splits: its state grows beside the budget);
- the rest holds experts. If every expert fits, all are cached. Otherwise the hot-store pins
  ``pin_bytes`` worth of experts (default: the share of the expert budget the routing history
  chooses, `store.usage.UsageHistory.pin_share`; none without history; never below top-k cache
  slots per layer where the budget allows), and the cache gets the remainder, at least one slot per
  MoE layer. A cache of fewer than top-k slots a layer gives up a few of them (up to top-k − 1
  experts' worth in all) to the reads a layer has beyond its slots (`transient_experts`), so that
  a token's experts are read at once instead of one at a time as slots free up.

Beside the budget, the prefix cache (prefix.py: the states of recent prompts) holds up to
`prefix_cache_budget` bytes: --prefix-cache as given, else `prefix.DEFAULT_SHARE` of the budget. The
engine sizes its cache with this function and `plan` shows it, so what a server holds is what was
planned: the budget plus the prefix cache (plus the state, where it grows beside the budget).

The machine: disk bandwidth (`disk_bandwidth`, read as the store reads) and memory bandwidth
(`memory_bandwidth`, read as the kernels read; `colibri bench kernels` times its kernels against
the same probe).

The floors (`make_plan`): expected bytes read per token assume uniform routing (each of a token's
layers × top-k experts is resident with probability cached / all experts): an upper bound, since
real routing is skewed and the hot-store pins the popular experts. Disk floor = those bytes ÷ disk
bandwidth; memory floor = the bytes the kernels touch per token (dense weights + layers × top-k
experts) ÷ memory bandwidth.
"""
from __future__ import annotations

import math
import os
import re
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import kernels, plugins, quant
from .container import Container
from .container.native import is_checkpoint
from .container.reader import MANIFEST, expert_extent
from .convert import parse_config
from .errors import ColibriError
from .fsio import read_json
from .kv.cache import KV_CACHES, check_cache_type
from .options import check_pin_gb
from .prefix import DEFAULT_SHARE
from .remote import cluster_nodes
from .remote.placement import SPLITS, cluster_plan
from .sizes import available_memory, format_bytes, parse_size
from .store import io
from .store.usage import UsageHistory, default_pinned

NATIVE = "native"  # the official release's own formats, run without conversion (container/native.py)
READ_BYTES = 512 << 20  # bytes one pass of the memory probe reads (≫ any last-level cache)


# ---- sizes from config.json ---------------------------------------------------------------------

def tensor_bytes(layout, name: str, shape: tuple[int, ...], kind: str) -> int:
    """Bytes of one resident tensor in a container converted at `kind` (or, for "native", as the
    official release is held in RAM: its fp8 matrices as they are, everything else float32)."""
    if kind == NATIVE:
        native = next((k for pattern, k in layout.native_resident if re.search(pattern, name)), None)
        if native is None or len(shape) != 2:
            return 4 * math.prod(shape)
        return sum(math.prod(s) * dt.itemsize for _, dt, s in quant.layout(native, *shape))
    if layout.stays_f32(name, len(shape)):
        return 4 * math.prod(shape)
    return sum(math.prod(s) * dt.itemsize for _, dt, s in quant.layout(kind, *shape))


def expert_bytes(layout, layer: int, kind: str) -> int:
    """Bytes of one routed expert of `layer`: its container extent at `kind`, or its tensors and
    scales in the official release's kind ("native")."""
    if kind == NATIVE:
        H, I = layout.hidden, layout.intermediate
        return sum(math.prod(s) * dt.itemsize for rows, cols in ((I, H), (I, H), (H, I))
                   for _, dt, s in quant.layout(layout.native_expert_kind, rows, cols))
    return expert_extent(layout.expert_kind(layer, kind), layout.hidden, layout.intermediate)[1]


def plan(model_cls, cfg, kind: str, kv_cache: str = "f32") -> dict:
    """The sizes of a model (its plugin's model class and parsed config) converted at `kind`, or run
    as released ("native"), its KV caches of type `kv_cache` (`load(kv_cache=...)`)."""
    if kind not in (*quant.KINDS, NATIVE):
        raise ColibriError(f"unknown quantisation {kind!r}: choose one of {', '.join(quant.KINDS)} or {NATIVE}")
    layout = model_cls.layout(cfg)
    if kind == NATIVE and layout.native_expert_kind is None:
        raise ColibriError(f"{model_cls.__name__} declares no native release format (ContainerLayout."
                           f"native_expert_kind): plan it at {', '.join(quant.KINDS)}")
    shapes = model_cls.resident_shapes(cfg)
    resident = sum(tensor_bytes(layout, name, shape, kind) for name, shape in shapes.items())
    per_layer = {layer: expert_bytes(layout, layer, kind) for layer in layout.moe_layers}
    state = list(model_cls.state_floats_per_token(cfg))
    out = {
        "quant": kind,
        "resident_bytes": resident,
        "resident_tensors": len(shapes),
        "expert_bytes": (max(per_layer.values(), default=0) if kind == NATIVE  # one routed expert at `kind`
                         else expert_extent(kind, layout.hidden, layout.intermediate)[1]),
        "experts_total": len(layout.moe_layers) * layout.n_experts,
        "experts_total_bytes": sum(per_layer.values()) * layout.n_experts,
        "moe_layers": len(layout.moe_layers),
        "experts_per_layer": layout.n_experts,
        "top_k": layout.top_k,
        "kv_floats_per_token_per_layer": state[0] if len(set(state)) == 1 else state,
        "kv_cache": kv_cache,
        "state_bytes_per_token": state_bytes_per_token(model_cls, cfg, kv_cache),
        "fixed_state_bytes": 4 * model_cls.fixed_state_floats(cfg),
    }
    for name, floats in model_cls.kept_apart_floats_per_token(cfg).items():
        out[f"{name}_floats_per_token_per_layer"] = list(floats)
    return out


def state_bytes_per_token(model_cls, cfg, kv_cache: str = "f32") -> int:
    """Bytes of per-sequence state each token adds: every layer's growing state
    (`state_floats_per_token`) plus any kept apart, such as DSA indexer keys, at 4 bytes a float —
    but the part in KV caches (`kv_cache_floats_per_token`) at the size of a `kv_cache` element."""
    kept_apart = model_cls.kept_apart_floats_per_token(cfg).values()
    floats = sum(model_cls.state_floats_per_token(cfg)) + sum(sum(f) for f in kept_apart)
    cached = sum(model_cls.kv_cache_floats_per_token(cfg))
    return 4 * (floats - cached) + np.dtype(KV_CACHES[check_cache_type(kv_cache)]).itemsize * cached


def plan_config(config: dict, kind: str, where: str = "config.json", kv_cache: str = "f32") -> dict:
    """`plan` for a config.json dict, served by whichever installed plugin serves it."""
    registry = plugins.registry()
    arch = registry.resolve(config, where=where)
    model_cls = registry.model_class(arch)
    return {"architecture": arch.name, **plan(model_cls, model_cls.parse_config(config), kind, kv_cache)}


def measured(model_dir) -> dict:
    """The same sizes, measured on a converted container (what `plan` must predict)."""
    with Container(model_dir) as c:
        files = [Path(c.expert_file(layer)) for layer in c.moe_layers]  # as long as ever when striped (holes)
        return {
            "quant": c.quant,
            "resident_bytes": c.resident_nbytes,
            "expert_bytes": c.expert_nbytes,
            "experts_total": len(c.moe_layers) * c.n_experts,
            "experts_total_bytes": sum(f.stat().st_size for f in files),
        }


# ---- the budget split ---------------------------------------------------------------------------

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


def default_budget() -> int:
    """The RAM budget where none is given: 80 % of the memory available now."""
    return int(0.8 * available_memory())


def prefix_cache_budget(size: int | str | None, budget: int) -> int:
    """Bytes the prefix cache may hold beside the RAM `budget` (a `Split`'s; 0 where --cache-slots
    sized the cache instead): `size` as given (bytes or "2GB"; 0: off), else `DEFAULT_SHARE` of the
    budget (of `default_budget()` where there is none). The engine's cache and `plan` use this."""
    if size is None:
        return int(DEFAULT_SHARE * (budget or default_budget()))
    nbytes = parse_size(size)
    if nbytes < 0:
        raise ColibriError(f"--prefix-cache must be 0 (off) or more, got {size}")
    return nbytes


def split(ram: int | str | None, dense: int, expert_nbytes: int, moe_layers: int, n_experts: int, top_k: int,
          state: int = 0, pin_gb: float | None = None, history: UsageHistory | None = None,
          cache_slots: int | None = None) -> Split:
    """The split the engine makes at load and `colibri plan` shows, from the user's settings: `ram`
    the budget in bytes or "4GB" (default: 80 % of the memory available), `state` bytes of it
    reserved for state, `pin_gb` the hot-store's size (default: the share the routing `history`
    chooses; none without history), `cache_slots` experts cached per layer (then the budget is not
    split: the cache has that many slots, the hot-store `pin_gb`)."""
    if pin_gb is not None:
        check_pin_gb(pin_gb)
    pin_bytes = None if pin_gb is None else int(pin_gb * 1e9)
    if cache_slots is not None:  # at least 1 (EngineOptions checks it)
        slots = min(cache_slots, n_experts)
        pinned = 0 if slots >= n_experts else int((pin_bytes or 0) // expert_nbytes)
        return Split(0, dense, state, slots, slots * moe_layers * expert_nbytes, pinned, pinned * expert_nbytes,
                     slots >= n_experts, max(0, top_k - slots))
    budget = parse_size(ram) if ram is not None else default_budget()
    fit = experts_fit(budget, dense, state, expert_nbytes)
    share = history.pin_share(fit, top_k) if history is not None and pin_bytes is None else 0.0
    return split_budget(budget, dense, state, expert_nbytes, moe_layers, n_experts, pin_bytes, share, top_k)


# ---- the machine's bandwidths -------------------------------------------------------------------

def disk_bandwidth(paths, nbytes: int = 256 << 20, chunk: int = 4 << 20, threads: int = 4) -> tuple[float, bool]:
    """(bytes/s reading up to `nbytes` from the start of `paths` (one path or several), whether O_DIRECT
    was used for all of them): `read_bandwidth` of the files from their start."""
    paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
    return read_bandwidth([(path, 0, Path(path).stat().st_size) for path in paths], nbytes, chunk, threads)


def expert_bandwidth(c: Container, nbytes: int = 256 << 20, threads: int = 4) -> tuple[float, bool]:
    """(bytes/s, O_DIRECT used) reading up to `nbytes` of the container's expert extents, a layer after
    another, each whole from the file that holds it (`expert_location`): what decode reads. A
    striped container's experts come from both directories at once, in the stripe's share, so the
    figure is of the two disks together (reading the model's files from their start would read the
    moved experts' holes, which cost no disk time)."""
    extents = [c.expert_location(layer, e) for layer in c.moe_layers for e in range(c.n_experts)]
    return read_bandwidth(extents, nbytes, max(n for _, _, n in extents), threads)


def read_bandwidth(extents, nbytes: int, chunk: int = 4 << 20, threads: int = 4) -> tuple[float, bool]:
    """(bytes/s reading up to `nbytes` of `extents` ((path, offset, bytes), in order; offsets 4 KB-
    aligned), whether O_DIRECT was used for all of them): `chunk`-byte preads on the C I/O pool with
    `threads` threads, as the store reads. With O_DIRECT the page cache is bypassed, so this is the
    device; where O_DIRECT is refused, a cold page cache is the caller's business."""
    pool = io.IOPool(threads)
    fds, direct, jobs, total = {}, True, [], 0
    try:
        for path, offset, length in extents:
            size = min(nbytes - total, length) // 4096 * 4096
            if size <= 0:
                continue
            if path not in fds:
                fds[path], refused = io.open_expert_file(path, True, probe_bytes=4096)
                direct = direct and refused is None
            jobs += [(fds[path], offset + off, min(chunk, size - off)) for off in range(0, size, chunk)]
            total += size
        if not jobs:
            raise ColibriError(f"{extents[0][0]} is too small to measure disk bandwidth")
        t0 = time.perf_counter()
        reads = [pool.submit(fd, off, n) for fd, off, n in jobs]
        done = 0
        for r in reads:
            pool.wait(r)
            done += r.req.got
        dt = time.perf_counter() - t0
    finally:
        pool.close()
        for fd in fds.values():
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


def stripe_share(model_dir: str | os.PathLike, directory: str | os.PathLike, rounds: int = 3) -> tuple[float, dict]:
    """(share of the experts for `directory`, {"model", "stripe"} bytes/s) for `colibri stripe
    --share auto`: the bandwidth of each directory's disk measured (`disk_bandwidth_at`: a file
    written there and read back, with O_DIRECT where the filesystem takes it), the share in
    proportion to them. The median of `rounds` probes, the two disks in turn: a disk's first read
    runs fast while a throttle or a drive's cache lets a burst through (a throttled loop device:
    406 MB/s first, then 322-331)."""
    probes = {"model": [], "stripe": []}
    for _ in range(rounds):
        for key, where in (("model", model_dir), ("stripe", directory)):
            try:
                probes[key].append(disk_bandwidth_at(where)[0])
            except OSError as e:
                raise ColibriError(f"cannot measure the disk bandwidth of {where} ({e.strerror or e}: the probe "
                                   f"writes a 64 MB file there): pass --share instead of auto") from None
    bw = {key: statistics.median(values) for key, values in probes.items()}
    return bw["stripe"] / (bw["model"] + bw["stripe"]), bw


class ReadProbe:
    """One pass of the kernel threads over `nbytes` of RAM (the C `mem_read`, each thread streaming
    its own share, as the matrix-vector kernels stream weights): calling it reads every byte once."""

    def __init__(self, nbytes: int = READ_BYTES):
        self.buf = np.ones(nbytes // 8, np.uint64)
        self.ptr = kernels.ffi.from_buffer(self.buf)
        self.nbytes = self.buf.nbytes

    def __call__(self) -> None:
        kernels.lib.mem_read(self.ptr, self.nbytes)


def memory_bandwidth(nbytes: int = READ_BYTES, passes: int = 9) -> float:
    """Bytes/s the kernel threads read from RAM: the median of `passes` passes of a `ReadProbe`,
    after one to warm up (the buffer's pages faulted in)."""
    probe = ReadProbe(nbytes)
    probe()
    seconds = []
    for _ in range(passes):
        t0 = time.perf_counter()
        probe()
        seconds.append(time.perf_counter() - t0)
    return probe.nbytes / statistics.median(seconds)


# ---- `colibri plan` -----------------------------------------------------------------------------

@dataclass
class ModelSizes:
    architecture: str
    quant: str
    dense_bytes: int  # resident weights
    expert_nbytes: int  # one expert's extent on disk (and in RAM)
    moe_layers: int
    n_experts: int  # per MoE layer
    top_k: int  # experts per token per layer
    state_bytes_per_token: int  # at the KV cache type below
    kv_cache: str = "f32"  # the KV caches' element type the state is sized for (`load(kv_cache=...)`)

    @property
    def experts_total(self) -> int:
        return self.moe_layers * self.n_experts


def sizes_from_container(model_dir: str | Path, kv_cache: str = "f32") -> ModelSizes:
    """The sizes `make_plan` needs, read off a converted container."""
    with Container(model_dir) as c:
        registry = plugins.registry()
        arch = registry.resolve(c.config, where=str(model_dir))
        model_cls = registry.model_class(arch)
        cfg = parse_config(model_cls, c.config, model_dir)
        return ModelSizes(arch.name, c.quant, c.resident_nbytes, c.expert_nbytes, len(c.moe_layers), c.n_experts,
                          model_cls.layout(cfg).top_k, state_bytes_per_token(model_cls, cfg, kv_cache), kv_cache)


def sizes_from_config(config_path: str | Path, quant_kind: str, kv_cache: str = "f32",
                      config: dict | None = None) -> tuple[ModelSizes, dict]:
    """The sizes `make_plan` needs, and `plan`'s full report, from config.json alone (or from
    `config`, a configuration read elsewhere that `config_path` names in errors)."""
    config = read_json(config_path) if config is None else config
    if not isinstance(config, dict):
        raise ColibriError(f"{config_path} is not a model configuration (a JSON object)")
    registry = plugins.registry()
    arch = registry.resolve(config, where=str(config_path))
    model_cls = registry.model_class(arch)
    cfg = parse_config(model_cls, config, config_path)
    try:
        report = plan(model_cls, cfg, quant_kind, kv_cache)
    except NotImplementedError:
        raise ColibriError(f"plugin {arch.plugin} cannot plan {arch.name} from config.json alone; "
                           f"convert the model and use --model") from None
    sizes = ModelSizes(arch.name, quant_kind, report["resident_bytes"], report["expert_bytes"], report["moe_layers"],
                       report["experts_per_layer"], report["top_k"], report["state_bytes_per_token"], kv_cache)
    return sizes, report


def read_direct(asked: bool | None, cache_slots: int, n_experts: int) -> bool:
    """Whether experts are read with O_DIRECT: as `asked` (--direct / --no-direct), else where they
    are read while decoding (fewer cache slots than experts). Measured with colibrì's C engine on
    the same weights (cold, 8 slots per layer): 2.58 tok/s with O_DIRECT against 2.31 through the
    page cache, whose copies cost the CPU the kernels need on 2 cores; with every expert cached, the
    page cache keeps the files warm for the next start. Where the filesystem refuses O_DIRECT the
    store reads through the page cache (store/mirror.py)."""
    return asked if asked is not None else cache_slots < n_experts


def make_plan(sizes: ModelSizes, ram: int | str | None, context: int, pin_gb: float | None,
              history: UsageHistory | None, disk_bw: float, mem_bw: float,
              prefix_cache: int | str | None = None, parallel: int = 1) -> dict:
    """The split of `ram` with `context` tokens of state reserved for each of `parallel` sequences
    (a server's --parallel: the requests decoded together each hold a state), the prefix cache
    beside it (`prefix_cache`: its size, None for the default share), expected bytes read per token,
    and floor times (seconds per token); `history`: the model's routing history, which chooses the
    hot-store's share, or None."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:  # 0: no state, as the engine splits
        raise ColibriError(f"--context must be a number of tokens (0 or more), got {context!r}")
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ColibriError(f"--parallel must be a number of requests (1 or more), got {parallel!r}")
    s = split(ram, sizes.dense_bytes, sizes.expert_nbytes, sizes.moe_layers, sizes.n_experts, sizes.top_k,
              state=sizes.state_bytes_per_token * context * parallel, pin_gb=pin_gb, history=history)
    resident_experts = min(sizes.experts_total, s.cache_slots * sizes.moe_layers + s.pinned_experts)
    resident_share = resident_experts / sizes.experts_total
    needed = sizes.moe_layers * sizes.top_k  # expert uses per token
    read_per_token = needed * (1 - resident_share) * sizes.expert_nbytes
    touched = sizes.dense_bytes + needed * sizes.expert_nbytes
    disk_floor = read_per_token / disk_bw if disk_bw else 0.0
    mem_floor = touched / mem_bw if mem_bw else 0.0
    return {
        "model": asdict(sizes),
        "experts_total": sizes.experts_total,
        "experts_bytes_total": sizes.experts_total * sizes.expert_nbytes,
        "context_tokens": context,
        "parallel": parallel,
        "split": s.as_dict(),
        "prefix_cache": {"bytes": prefix_cache_budget(prefix_cache, s.budget), "default_share":
                         DEFAULT_SHARE if prefix_cache is None else None},  # beside the budget
        "resident_expert_share": resident_share,
        "expected_bytes_read_per_token": read_per_token,
        "bytes_touched_per_token": touched,
        "disk_bandwidth": disk_bw,
        "memory_bandwidth": mem_bw,
        "floor_seconds_per_token": {"disk": disk_floor, "memory": mem_floor, "floor": max(disk_floor, mem_floor)},
    }


def report(model: Path | None = None, config: Path | None = None, quant: str = "int4", ram: int | str | None = None,
           pin_gb: float | None = None, context: int = 0, kv_cache: str = "f32", disk_bw: int | str | None = None,
           mem_bw: int | str | None = None, ray: str | None = None, ray_split: str = "expert",
           prefix_cache: int | str | None = None, parallel: int = 1, read_asked: bool | None = None) -> dict:
    """`colibri plan` as JSON: the sizes of a converted directory `model` (or a checkpoint run as it
    is) or of a `config` alone at `quant`, the split of `ram` with `context` tokens of state
    reserved for each of `parallel` requests decoded together, the prefix cache beside it (`prefix_cache` bytes or "2GB"; default: its share of the
    budget), and the floors at `disk_bw` / `mem_bw` (bytes/s, or "2GB"; default: measured here, the
    disk on the model's expert files or where its config lies). `ray`: a cluster to place the
    experts on, cut `ray_split`; `read_asked`: --direct / --no-direct (None: `read_direct`'s default)."""
    if (model is None) == (config is None):
        raise ColibriError("plan needs exactly one of --model DIR or --config config.json")
    if ray is not None and ray_split not in SPLITS:
        raise ColibriError(f"--ray-split must be one of {', '.join(SPLITS)}, got {ray_split!r}")
    if prefix_cache is not None:  # a mistake is one line before anything is measured
        prefix_cache_budget(prefix_cache, 0)
    if model is not None and is_checkpoint(model) and not (Path(model) / MANIFEST).exists():
        config, quant, model = Path(model) / "config.json", NATIVE, None  # a checkpoint run as it is
    # the sizes first: an unknown KV cache type or quantisation is one line before anything is measured
    if model is not None:
        sizes, out = sizes_from_container(model, kv_cache), measured(model)
        with Container(model) as c, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a damaged history is the engine's to report; here it plans none
            history = UsageHistory(c)
        # the directories the disk probe reads the experts from: the model's, and a stripe's
        disk_dirs = [str(model)] + ([str(c.stripe.directory)] if c.stripe is not None else [])
    else:
        sizes, out = sizes_from_config(config, quant, kv_cache)
        history, disk_dirs = None, [str(Path(config).resolve().parent)]
    # then the split (no floors yet): a budget, --pin-gb or --context it refuses is one line before
    # the probes spend seconds measuring
    make_plan(sizes, ram, context, pin_gb, history, 0.0, 0.0, prefix_cache, parallel)
    if disk_bw is not None:
        disk, direct = float(parse_size(disk_bw)), None
    elif model is not None:
        disk, direct = expert_bandwidth(c)  # (closed above: the probe opens the files it reads)
    else:
        disk, direct = disk_bandwidth_at(Path(config).resolve().parent)
    memory = float(parse_size(mem_bw)) if mem_bw is not None else memory_bandwidth()
    plan = make_plan(sizes, ram, context, pin_gb, history, disk, memory, prefix_cache, parallel)
    out = {"source": str(model if model is not None else config), **out, **plan, "disk_bandwidth_direct": direct,
           "disk_bandwidth_directories": None if disk_bw is not None else disk_dirs,
           "read_direct_asked": read_asked,
           "read_direct": read_direct(read_asked, plan["split"]["cache_slots"], sizes.n_experts)}
    if ray is not None:
        out["ray"] = ray_placement(ray, ray_split, sizes)
    return out


def ray_placement(address: str, split: str, sizes: ModelSizes) -> dict:
    """Which experts the Ray cluster at `address` would hold (`remote.placement.cluster_plan`): each
    node's shard and RAM, what stays on the local disk, remote calls per token."""
    _, _, nodes = cluster_nodes(address)
    return {"address": address, **cluster_plan(nodes, range(sizes.moe_layers), sizes.n_experts, sizes.expert_nbytes,
                                               sizes.top_k, split)}


def prefix_line(cache: dict) -> str:
    """The prefix cache's part of `format_report`: its bytes and where the size came from."""
    if not cache["bytes"]:
        return "off (--prefix-cache 0)"
    why = (f"{100 * cache['default_share']:g}% of the budget; --prefix-cache SIZE to change it"
           if cache["default_share"] is not None else "--prefix-cache")
    return f"{format_bytes(cache['bytes'])} (states of recent prompts: {why})"


def read_path_line(p: dict) -> str:
    """How `report`'s engine would read experts (`read_direct`), and why."""
    asked = p["read_direct_asked"]
    why = ("--direct" if asked else "--no-direct") if asked is not None else \
        "by default: experts are read while decoding" if p["read_direct"] else "by default: every expert is cached"
    if p["read_direct"] and p["disk_bandwidth_direct"] is False:
        return f"page cache ({why}, but this filesystem refuses O_DIRECT)"
    return f"{'O_DIRECT' if p['read_direct'] else 'page cache'} ({why})"


def disk_dirs_note(dirs: list[str] | None) -> str:
    """What `format_report` adds to the disk figure of a striped model: both disks read together."""
    if not dirs or len(dirs) == 1:
        return ""
    return f"; the experts read from {' and '.join(dirs)} together, in the stripe's share, as decode reads them"


def format_report(p: dict) -> str:
    """`report` as `colibri plan` prints it."""
    m, sp, f, fb = p["model"], p["split"], p["floor_seconds_per_token"], format_bytes
    context, parallel = p["context_tokens"], p["parallel"]
    share = f", {100 * sp['pin_share']:.0f}% of the expert budget, chosen from the routing history" if sp["pin_share"] else ""
    direct = p["disk_bandwidth_direct"]
    lines = [
        f"{p['source']}: {m['architecture']}, {m['quant']}",
        f"  resident (dense) weights   {fb(m['dense_bytes'])}",
        f"  bytes per expert           {fb(m['expert_nbytes'])}",
        f"  experts in all             {p['experts_total']} ({m['moe_layers']} MoE layers × {m['n_experts']}, "
        f"top-{m['top_k']}) = {fb(p['experts_bytes_total'])}",
        f"  state per token            {fb(m['state_bytes_per_token'])} (KV cache {m['kv_cache']})",
        f"budget {fb(sp['budget'])}:",
        f"  dense                      {fb(sp['dense'])}",
        f"  {f'state ({parallel} × {context} tokens)' if parallel > 1 else f'state ({context} tokens)':27}"
        f"{fb(sp['state'])}" if context else
        f"  state                      beside the budget: {fb(m['state_bytes_per_token'])} a token"
        + (f" for each of {parallel} requests decoded together" if parallel > 1 else "")
        + " (--context N reserves N tokens' worth)",
        f"  expert cache               {fb(sp['cache_bytes'])} ({sp['cache_slots']} slots per layer)",
        f"  pinned (hot-store)         {fb(sp['pinned_bytes'])} ({sp['pinned_experts']} experts{share})",
    ]
    if sp["transient_experts"]:
        lines.append(f"  reads past the slots       {fb(sp['transient_experts'] * m['expert_nbytes'])} "
                     f"({sp['transient_experts']} experts a layer reads at once beyond its slots)")
    lines += [
        f"  experts resident           {100 * p['resident_expert_share']:.1f}%",
        f"  prefix cache, beside it    {prefix_line(p['prefix_cache'])}",
        f"per token: expected read {fb(p['expected_bytes_read_per_token'])} (uniform routing; skew and pinning "
        f"read less), touched in RAM {fb(p['bytes_touched_per_token'])}",
        f"read path: {read_path_line(p)}",
        f"machine: disk {fb(p['disk_bandwidth'])}/s "
        f"({'given' if direct is None else 'O_DIRECT' if direct else 'page cache: may be optimistic'}"
        f"{disk_dirs_note(p['disk_bandwidth_directories'])}), "
        f"memory {fb(p['memory_bandwidth'])}/s",
        f"floor per token: disk {f['disk']:.3f} s, memory {f['memory']:.3f} s → {f['floor']:.3f} s "
        f"({1 / f['floor'] if f['floor'] else float('inf'):.1f} tok/s at best)",
    ]
    if "ray" in p:
        r = p["ray"]
        lines.append(f"Ray cluster {r['address']} ({r['split']} split, {len(r['nodes'])} nodes besides this one):")
        lines += [f"  node {n['address']} ({n['node'][:8]})  memory {fb(n['memory'])}, holds {n['experts']} experts "
                  f"({fb(n['bytes'])})" + (f": layer:experts {n['placement']}" if n["placement"] else "")
                  for n in r["nodes"]]
        lines += [f"  experts on the cluster {r['experts_remote']}, read from the local disk {r['experts_local']}",
                  f"  per token: {r['remote_calls_per_token']:.1f} remote calls expected (uniform routing; at most "
                  f"{r['max_calls_per_layer']} per MoE layer, in parallel)"]
    return "\n".join(lines)
