"""Shard-by-shard conversion (`colibri pull`): a checkpoint whose shards arrive one after another,
each converted as it lands and deleted once every tensor in it is written.

The container is the one `convert` writes from the same checkpoint (same plan, `writer._plan`; same
quantisation; byte-identical resident.safetensors and expert files); only the order of the work
differs. Every container file is allocated at its final size up front (sparse) and each *unit* — one
resident tensor, or one expert's extent — is written at its offset as soon as the shards holding its
source tensors have landed. A unit whose tensors straddle two shards keeps the earlier shard's part
in a small stash file (the raw bytes of just those tensors), so that the earlier shard is deleted
before the next one downloads: the disk holds the container, one shard and the stash.

Resume: ``DST.partial/progress.jsonl`` starts with the key (hub repo, the revision's commit hash,
quantisation, architecture, layout) and records each finished unit (crc32 of its bytes, digest of
the source bytes it was made from) after its bytes are flushed. A staging directory of another key
(another revision, even of the same shapes) is discarded, so a resumed pull never mixes revisions.
On resume every recorded unit's bytes are checked against their crc32; one that fails is written
again (its shard downloaded again if it was deleted already).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import yaml

from .. import quant as q
from ..errors import ColibriError
from ..fsio import fsync_dir, write_atomic
from ..layout import ContainerLayout
from .reader import (
    ARRAY, COPIED_FILES, FORMAT_VERSION, MANIFEST, RESIDENT_FILE, SCALES_SUFFIX, ST_NAME, TRAILER, SafetensorsFile,
    crc32, crc32_file, expert_extent, expert_file_name, manifest_checksum_line,
)
from .writer import (
    Checkpoint, _check_destination, _Dumper, _Flow, _FlowList, _layout_digest, _manifest, _NoBar, _plan,
    _progressbar, _publish, pack_extent,
)

__all__ = ["RemoteCheckpoint", "convert_streamed"]

LOG = "progress.jsonl"
STASH = "stash"


@dataclass
class RemoteCheckpoint:
    """What the streamed converter needs of a checkpoint it does not hold yet."""

    small_files: Path  # a directory holding config.json and the tokenizer files (downloaded first)
    sizes: dict[str, int]  # shard file name -> its size in bytes, in download order
    headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]]  # shard -> tensor -> (dtype, shape)
    fetch: Callable[[str], Path]  # downloads a shard (resuming a partial download) and returns its path
    release: Callable[[str], None]  # deletes a downloaded shard
    binding: dict  # what pins the content ({"repo", "revision": the commit hash}; a GGUF's {"gguf", "sha256"}):
    # the progress log's key and the manifest's source.origin


class _Header:
    """A shard known by its header alone (read with range requests): dtypes and shapes, no bytes."""

    def __init__(self, name: str, tensors: dict[str, tuple[str, tuple[int, ...]]]):
        self.path, self.tensors = Path(name), tensors

    def dtype(self, name: str) -> str:
        return self.tensors[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name][1])


def _checkpoint(remote: RemoteCheckpoint) -> Checkpoint:
    """A `Checkpoint` whose tensors are placed by the shards' headers; each shard's bytes are swapped
    in as it lands (`_land`)."""
    ckpt = Checkpoint.__new__(Checkpoint)
    ckpt.path, ckpt.files, ckpt.where, ckpt.digests = remote.small_files, {}, {}, None
    for shard, tensors in remote.headers.items():
        header = _Header(shard, tensors)
        for name in tensors:
            if name in ckpt.where:
                raise ColibriError(f"tensor {name} appears in both {ckpt.where[name].path.name} and {shard}")
            ckpt.where[name] = header
    return ckpt


@dataclass
class _Unit:
    """One piece written on its own: a resident tensor, or one expert's extent."""

    id: str  # "resident:NAME" or "experts:LAYER:EXPERT"
    rel: str  # the container file it lies in
    offset: int
    nbytes: int
    tensors: frozenset[str]  # the checkpoint tensors it is made from (scales included)
    read: Callable[[], list[np.ndarray]]  # its weights, float32, read from the checkpoint
    pack: Callable[[list[np.ndarray]], bytes]  # those weights quantised: the unit's bytes


def _resident_header(plan) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """resident.safetensors' header (as `writer._write_resident` writes it) and each resident
    tensor's byte range in the file (its data part, then its scales)."""
    parts = []  # (stored name, dtype, shape, resident tensor)
    for name, kind, shape in plan.resident:
        if kind == ARRAY:
            parts.append((name, np.dtype(np.float32), shape, name))
        else:
            parts += [(name if part == "data" else name + SCALES_SUFFIX, dtype, pshape, name)
                      for part, dtype, pshape in q.layout(kind, *shape)]
    header, offset, ranges = {"__metadata__": {"format": "colibri"}}, 0, {}
    for pname, dtype, pshape, owner in parts:
        nbytes = int(np.prod(pshape)) * dtype.itemsize
        header[pname] = {"dtype": ST_NAME[dtype], "shape": list(pshape), "data_offsets": [offset, offset + nbytes]}
        first = ranges.get(owner, (offset, offset))[0]
        ranges[owner] = (first, offset + nbytes)
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    head = len(head).to_bytes(8, "little") + head
    return head, {name: (len(head) + a, b - a) for name, (a, b) in ranges.items()}


def _units(ckpt: Checkpoint, plan) -> tuple[list[_Unit], dict[str, int], bytes]:
    """Every unit in the order `convert` writes them, each container file's size, and the resident
    file's header."""
    lay = plan.layout

    def with_scales(names) -> frozenset[str]:
        return frozenset(names) | frozenset(s for s in map(ckpt.scales_of, names) if s)

    head, ranges = _resident_header(plan)
    units = []
    for name, kind, _ in plan.resident:
        def pack(weights, kind=kind) -> bytes:  # as writer._write_resident stores a tensor
            if kind == ARRAY:
                return np.ascontiguousarray(weights[0]).tobytes()
            t = q.quantize(weights[0], kind)
            return b"".join(np.ascontiguousarray(a).tobytes() for a in (t.data, t.scales) if a is not None)
        src = plan.sources.get(name, (name, None, None))[0]
        units.append(_Unit(f"resident:{name}", RESIDENT_FILE, *ranges[name], with_scales([src]),
                           lambda name=name: [plan.read_resident(ckpt, name)], pack))
    sizes = {RESIDENT_FILE: len(head) + sum(n for _, n in ranges.values())}
    for layer in lay.moe_layers:
        kind = lay.expert_kind(layer, plan.quant)
        _, nbytes = expert_extent(kind, lay.hidden, lay.intermediate)
        rel = expert_file_name(layer)
        sizes[rel] = lay.n_experts * nbytes
        for e in range(lay.n_experts):
            if plan.form == "fused":
                names = [plan.names[p].format(layer=layer) for p in ("gate_up", "down")]
            else:
                names = [plan.names[p].format(layer=layer, expert=e) for p in ("gate", "up", "down")]

            def pack(weights, layer=layer, e=e, kind=kind, nbytes=nbytes) -> bytes:
                return bytes(pack_extent([q.quantize(w, kind) for w in weights], layer, e, nbytes))
            units.append(_Unit(f"experts:{layer}:{e}", rel, e * nbytes, nbytes, with_scales(names),
                               lambda layer=layer, e=e: list(plan.expert_weights(ckpt, layer, e)), pack))
    return units, sizes, head


# ----------------------------------------------------------------------------- the staging directory


class _Log:
    """DST.partial/progress.jsonl: the key on the first line, then one line per finished unit."""

    def __init__(self, staging: Path, key: dict, say):
        self.path = staging / LOG
        self.units: dict[str, dict] = {}
        if staging.exists():
            lines = self.path.read_text().splitlines() if self.path.is_file() else []
            try:
                same = json.loads(lines[0]) == key if lines else False
            except ValueError:
                same = False
            if not same:
                say(f"discarding {staging}: an unfinished pull of another revision, quantisation or layout")
                shutil.rmtree(staging)
            else:
                for line in lines[1:]:
                    try:
                        rec = json.loads(line)
                    except ValueError:  # the last line, cut short by a kill
                        break
                    self.units[rec["unit"]] = rec
                say(f"resuming the pull in {staging} ({len(self.units)} pieces written already)")
        if not staging.exists():
            staging.mkdir(parents=True)
            (staging / "experts").mkdir()
            write_atomic(self.path, (json.dumps(key) + "\n").encode())
        self.f = open(self.path, "a")

    def record(self, recs: list[dict]) -> None:
        """Append finished units (their bytes already flushed), durably."""
        for rec in recs:
            self.units[rec["unit"]] = rec
            self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def _allocate(staging: Path, sizes: dict[str, int], head: bytes, log: _Log, units: list[_Unit]) -> None:
    """Each container file at its final size (sparse; one of another size is started again), the
    resident header written; recorded units whose bytes no longer match their crc32 are forgotten."""
    for rel, size in sizes.items():
        path = staging / rel
        if not path.is_file() or path.stat().st_size != size:
            with open(path, "wb") as f:
                f.truncate(size)
            for u in units:
                if u.rel == rel:
                    log.units.pop(u.id, None)
    with open(staging / RESIDENT_FILE, "r+b") as f:
        if f.read(len(head)) != head:
            f.seek(0)
            f.write(head)
    for u in units:
        rec = log.units.get(u.id)
        if rec is not None:
            with open(staging / u.rel, "rb") as f:
                f.seek(u.offset)
                if crc32(f.read(u.nbytes)) != rec["crc32"]:
                    del log.units[u.id]


def _write_stash(path: Path, st, names: list[str]) -> None:
    """A safetensors file of `names`' stored bytes (their dtypes kept), read from `st`; atomic."""
    header, offset, blobs = {}, 0, []
    for name in names:
        raw = st.read(name).view(np.uint8).reshape(-1)
        header[name] = {"dtype": st.dtype(name), "shape": list(st.shape(name)), "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
        blobs.append(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for raw in blobs:
            f.write(raw.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def disk_bytes(*paths: Path) -> int:
    """Bytes the files under `paths` take on disk (allocated blocks: a sparse file counts what is written)."""
    total = 0
    for root in paths:
        files = [str(root)] if root.is_file() else (os.path.join(d, n) for d, _, names in os.walk(root) for n in names)
        for f in files:
            try:
                st = os.lstat(f)
            except FileNotFoundError:  # removed while the walk goes on (a shard deleted, a part renamed)
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
    return total


# ----------------------------------------------------------------------------- convert_streamed


def convert_streamed(remote: RemoteCheckpoint, dst: str | os.PathLike, *, quant: str, layout: ContainerLayout,
                     architecture: str, plugin: str, plugin_version: str, progress: bool = True, force: bool = False,
                     watch: tuple[Path, ...] = ()) -> int:
    """Convert `remote` into the container `dst`, fetching its shards one at a time and releasing
    each once it is written (see the module docstring). `force` replaces a container at `dst`.
    Returns the most bytes `watch` (the directories the shards and the container lie in) held on disk
    at the moments of the most use: each shard just landed, each stash just written."""
    dst = Path(dst)
    if quant not in q.KINDS:
        raise ColibriError(f"unknown quantisation {quant!r}: choose one of {', '.join(q.KINDS)}")
    ckpt = _checkpoint(remote)
    plan = _plan(ckpt, layout, architecture, quant)
    units, sizes, head = _units(ckpt, plan)
    _check_destination(dst, force)
    key = {"format_version": FORMAT_VERSION, "binding": remote.binding, "quant": quant, "architecture": architecture,
           "layout": _layout_digest(layout), "pull": 1}

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr)

    staging = dst.with_name(dst.name + ".partial")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if _finished_staging(staging, remote.binding):
        _publish(staging, dst, force)
        return disk_bytes(*watch)
    log = _Log(staging, key, say)
    for tmp in staging.glob("*.tmp"):  # write_atomic's NAME.PID.tmp: a kill inside the manifest's write
        tmp.unlink()
    _allocate(staging, sizes, head, log, units)
    stash_dir = staging / STASH
    stash_dir.mkdir(exist_ok=True)
    for f in stash_dir.iterdir():  # stashes written whole (renamed into place); a temporary is not
        try:
            st = SafetensorsFile(f) if f.suffix == ".safetensors" else None
        except ColibriError:
            st = None
        if st is None:
            f.unlink()
            continue
        for name in st.tensors:
            ckpt.where[name] = st
    shard_of = {name: shard for shard, tensors in remote.headers.items() for name in tensors}
    todo = [u for u in units if u.id not in log.units]
    peak = disk_bytes(*watch)
    bar = _progressbar(len(units), f"converting ({quant})") if progress else _NoBar()
    workers = min(8, os.cpu_count() or 1)
    with bar, ThreadPoolExecutor(workers) as pool:
        bar.update(len(units) - len(todo))
        for shard in remote.sizes:
            wanted = {t for u in todo for t in u.tensors if shard_of[t] == shard
                      and not isinstance(ckpt.where[t], SafetensorsFile)}
            if not wanted:
                continue
            st = _land(remote, shard, ckpt)
            peak = max(peak, disk_bytes(*watch))
            ready = [u for u in todo if all(isinstance(ckpt.where[t], SafetensorsFile) for t in u.tensors)]
            _write_units(staging, ready, ckpt, pool, workers, log, bar)
            ready_ids = {u.id for u in ready}
            todo = [u for u in todo if u.id not in ready_ids]
            needed = {t for u in todo for t in u.tensors}
            for f in stash_dir.iterdir():  # stashes whose units are all written now
                if not needed & set(SafetensorsFile(f).tensors):
                    f.unlink()
            later = sorted({t for u in todo for t in u.tensors if ckpt.where[t] is st})
            if later:  # units straddling into the next shards: keep just their tensors
                stash = stash_dir / (shard.replace("/", "--").removesuffix(".safetensors") + ".safetensors")
                _write_stash(stash, st, later)
                stashed = SafetensorsFile(stash)
                for name in later:
                    ckpt.where[name] = stashed
                peak = max(peak, disk_bytes(*watch))
            for name in st.tensors:  # the shard's other tensors: back to their header alone
                if ckpt.where[name] is st:
                    ckpt.where[name] = _Header(shard, remote.headers[shard])
            remote.release(shard)
        if todo:
            raise ColibriError(f"the checkpoint's shards never provided tensor {sorted(todo[0].tensors)[0]}")
    log.close()
    _finish(remote, staging, dst, plan, units, log, sizes, architecture, plugin, plugin_version, force)
    return peak


def _land(remote: RemoteCheckpoint, shard: str, ckpt: Checkpoint) -> SafetensorsFile:
    """Download `shard` and point its tensors at its bytes, after checking its header is the one planned from."""
    st = SafetensorsFile(remote.fetch(shard))
    planned = remote.headers[shard]
    if {n: (d, tuple(s)) for n, (d, s, _, _) in st.tensors.items()} != {n: (d, tuple(s)) for n, (d, s) in planned.items()}:
        raise ColibriError(f"{st.path}: its tensors are not those its header listed when the pull began")
    for name in st.tensors:
        if not isinstance(ckpt.where[name], SafetensorsFile):  # a stash, if one holds it, serves it already
            ckpt.where[name] = st
    return st


def _write_units(staging: Path, ready: list[_Unit], ckpt: Checkpoint, pool, workers: int, log: _Log, bar) -> None:
    """Write `ready` units at their offsets, flush, record them. Source tensors are read here, one
    unit at a time (their digests collected in `ckpt.digests`); quantising runs on the pool's
    threads, a few units per thread in flight."""
    files: dict[str, int] = {}
    batch = 2 * workers
    try:
        for i in range(0, len(ready), batch):
            pending = []
            for u in ready[i:i + batch]:
                ckpt.digests = {}
                weights = u.read()
                pending.append((u, pool.submit(u.pack, weights), _digest(ckpt.digests)))
                ckpt.digests = None
            recs = []
            for u, fut, source in pending:
                data = fut.result()
                if len(data) != u.nbytes:
                    raise AssertionError(f"{u.id}: {len(data)} bytes, expected {u.nbytes}")
                if u.rel not in files:
                    files[u.rel] = os.open(staging / u.rel, os.O_WRONLY)
                os.pwrite(files[u.rel], data, u.offset)
                recs.append({"unit": u.id, "crc32": crc32(data), "source": source})
                bar.update(1)
            for fd in files.values():
                os.fsync(fd)
            log.record(recs)
    finally:
        ckpt.digests = None
        for fd in files.values():
            os.close(fd)


def _digest(digests: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()


def _finish(remote: RemoteCheckpoint, staging: Path, dst: Path, plan, units: list[_Unit], log: _Log,
            sizes: dict[str, int], architecture: str, plugin: str, plugin_version: str, force: bool) -> None:
    """The manifest, as `convert` writes it, its source bound to the hub revision and to the source
    bytes every unit was made from; then the staging directory published as `dst`."""
    lay = plan.layout
    tensors = sorted([n, d, list(s)] for header in remote.headers.values() for n, (d, s) in header.items())
    shape_digest = hashlib.sha256(json.dumps([tensors, sorted(remote.sizes.items())]).encode()).hexdigest()
    content = "sha256:" + hashlib.sha256(json.dumps([log.units[u.id]["source"] for u in units]).encode()).hexdigest()
    identity = json.dumps([remote.binding, f"sha256:{shape_digest}", content])
    source = {"fingerprint": "sha256:" + hashlib.sha256(identity.encode()).hexdigest(), "tensors": len(tensors),
              "bytes": sum(remote.sizes.values()), "files": dict(remote.sizes), "content": content,
              "origin": _Flow(remote.binding)}
    resident = {"size": sizes[RESIDENT_FILE], "crc32": crc32_file(staging / RESIDENT_FILE)}
    layers = []
    for layer in lay.moe_layers:
        rel = expert_file_name(layer)
        kind = lay.expert_kind(layer, plan.quant)
        _, nbytes = expert_extent(kind, lay.hidden, lay.intermediate)
        crcs = []
        with open(staging / rel, "rb") as f:  # each extent's crc32, from its trailer
            for e in range(lay.n_experts):
                f.seek((e + 1) * nbytes - TRAILER.size)
                crcs.append(int.from_bytes(f.read(4), "little"))
        entry = {"layer": layer, "path": rel, "size": sizes[rel], "crc32": crc32_file(staging / rel),
                 "extent_crc32": _FlowList(crcs)}
        if kind != plan.quant:
            entry["kind"], entry["expert_nbytes"] = kind, nbytes
        layers.append(entry)
    copied = {}
    for name in COPIED_FILES:
        if (remote.small_files / name).is_file():
            shutil.copyfile(remote.small_files / name, staging / name)
            copied[name] = _Flow(size=(staging / name).stat().st_size, crc32=crc32_file(staging / name))
    manifest = _manifest(plan, architecture, plugin, plugin_version, source, copied, resident, layers)
    text = yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    text += manifest_checksum_line(text)
    write_atomic(staging / MANIFEST, text.encode("utf-8"))
    shutil.rmtree(staging / STASH)
    (staging / LOG).unlink()  # from here a resumed pull publishes what is here (`_finished_staging`)
    fsync_dir(staging)
    _publish(staging, dst, force)


def _finished_staging(staging: Path, binding: dict) -> bool:
    """Whether `staging` is a finished container of `binding` (a kill came between its manifest and
    its rename): then it is published as it is."""
    if (staging / LOG).exists() or not (staging / MANIFEST).is_file():
        return False
    try:
        manifest = yaml.safe_load((staging / MANIFEST).read_text())
        return manifest["source"]["origin"] == binding
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return False
