"""`convert`: a Hugging Face safetensors checkpoint -> a colibri container.

Steps: read every shard's header; check the tensor names and shapes against the plugin's
`ContainerLayout` (before anything is written); then, in the staging directory ``DST.partial/``,
write the resident tensors and one expert file per MoE layer, recording each finished file in
``progress.json`` with its checksum and the sha256 of the source bytes it was made from; copy
config and tokenizer files; write ``colibri.yaml`` last; rename the staging directory to DST.
Rerunning an interrupted conversion keeps the files already finished after re-checking their
checksums and re-reading their source tensors: a staging directory left by another source (even
one of the same shapes), quantisation or layout is discarded with a one-line notice. The
manifest's source fingerprint binds the source's content (``source.content``), so sessions and
routing histories of another model of the same shapes are never taken for this one's. Tensors
are read one at a time, never the whole checkpoint.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from .. import quant as q
from ..errors import ColibriError
from ..fsio import CONFIG_BYTES, TOKENIZER_BYTES, fsync_dir, read_text, write_atomic
from ..layout import PROJS, ContainerLayout
from .reader import (
    ARRAY, COPIED_FILES, EXTENT_ALIGN, FORMAT, FORMAT_VERSION, MANIFEST, READABLE_DTYPES, RESIDENT_FILE,
    SCALES_SUFFIX, ST_NAME, TRAILER, TRAILER_MAGIC, SafetensorsFile, crc32, crc32_file, expert_extent,
    expert_file_name, extent_crc, manifest_checksum_line, one_line,
)

PROGRESS = "progress.json"


class _Flow(dict):
    """A mapping written on one line in colibri.yaml."""


class _FlowList(list):
    """A list written on one line in colibri.yaml."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda d, m: d.represent_mapping("tag:yaml.org,2002:map", m, flow_style=True))
_Dumper.add_representer(_FlowList, lambda d, s: d.represent_sequence("tag:yaml.org,2002:seq", s, flow_style=True))


# ----------------------------------------------------------------------------- the source checkpoint


class Checkpoint:
    """A HF checkpoint directory: config.json plus one or more safetensors files (headers only)."""

    def __init__(self, src: Path):
        self.path = src
        if not src.exists():
            raise ColibriError(f"checkpoint directory {src} does not exist")
        if not src.is_dir():
            raise ColibriError(f"{src} is not a directory (expected a Hugging Face checkpoint directory)")
        if not (src / "config.json").is_file():
            raise ColibriError(f"{src} has no config.json: not a Hugging Face checkpoint directory")
        index = src / "model.safetensors.index.json"
        weight_map = None
        if index.is_file():
            try:
                weight_map = json.loads(read_text(index, TOKENIZER_BYTES))["weight_map"]  # ~MBs for 100k tensors
                names = sorted(set(weight_map.values()))
            except RecursionError:
                raise ColibriError(f"cannot read {index}: nested too deeply") from None
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ColibriError(f"cannot read {index}: {one_line(e)}") from None
        else:
            names = sorted(p.name for p in src.glob("*.safetensors"))
        if not names:
            raise ColibriError(f"{src} holds no safetensors files (model.safetensors or "
                               "model.safetensors.index.json); colibri converts safetensors checkpoints")
        self.files: dict[str, SafetensorsFile] = {}
        for name in names:
            if not (src / name).is_file():
                raise ColibriError(f"checkpoint {src} lacks the shard {name} named in {index.name}")
            self.files[name] = SafetensorsFile(src / name)
        self.where: dict[str, SafetensorsFile] = {}
        for fname, st in self.files.items():
            for tname in st.tensors:
                if tname in self.where:
                    raise ColibriError(f"tensor {tname} appears in both {self.where[tname].path.name} and {fname}")
                self.where[tname] = st
        for tname, fname in (weight_map or {}).items():
            if self.where.get(tname) is not self.files[fname]:
                raise ColibriError(f"{index} places tensor {tname} in {fname}, which does not hold it")
        # while not None: "NAME[first:count]" -> sha256 of the stored bytes of every read (`source_digest`)
        self.digests: dict[str, str] | None = None

    FP8_SCALE_SUFFIX = "_scale_inv"  # NAME (float8 e4m3) + NAME_scale_inv (f32, one per block)

    E8M0_SCALE = ".scale"  # DeepSeek V4: NAME.weight (F8_E4M3, or fp4 packed in I8) + NAME.scale (F8_E8M0)

    MXFP4_PACKED = ".weight_packed"  # Kimi K3: NAME.weight_packed (E2M1 pairs in U8) + NAME.weight_scale (UE8M0 in U8)

    def _native_scale(self, name: str) -> str:
        if name.endswith(self.MXFP4_PACKED):
            return name.removesuffix(self.MXFP4_PACKED) + ".weight_scale"
        return name.removesuffix(".weight") + self.E8M0_SCALE

    def native_kind(self, name: str) -> str | None:
        """"fp8" / "fp4" for a tensor stored in a UE8M0-scaled native format (DeepSeek V4's release:
        its `NAME.scale` sibling is F8_E8M0; Kimi K3's MXFP4: `NAME.weight_packed` U8 with a U8
        `NAME.weight_scale`), else None."""
        scale = self._native_scale(name)
        if scale == name or scale not in self.where:
            return None
        if name.endswith(self.MXFP4_PACKED):
            return "fp4" if self.where[name].dtype(name) == self.where[scale].dtype(scale) == "U8" else None
        if self.where[scale].dtype(scale) != "F8_E8M0":
            return None
        return {"F8_E4M3": "fp8", "I8": "fp4"}.get(self.where[name].dtype(name))

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape (an fp4 matrix packs two columns per stored byte)."""
        shape = self.where[name].shape(name)
        return (*shape[:-1], 2 * shape[-1]) if self.native_kind(name) == "fp4" else shape

    def block_size(self) -> tuple[int, int]:
        """fp8 block scale size (rows, cols): config.json quantization_config.weight_block_size, or 128×128."""
        try:
            cfg = json.loads(read_text(self.path / "config.json", CONFIG_BYTES))
            size = (cfg.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
            return int(size[0]), int(size[1])
        except (ColibriError, ValueError, TypeError, IndexError, AttributeError, RecursionError):
            return 128, 128

    def scales_of(self, name: str) -> str | None:
        """The scale tensor of an fp8 / fp4 tensor (None for any other)."""
        if self.native_kind(name):
            return self._native_scale(name)
        if self.where[name].dtype(name) != "F8_E4M3":
            return None
        scale = name + self.FP8_SCALE_SUFFIX
        if scale not in self.where:
            raise ColibriError(f"tensor {name} is float8 e4m3 without block scales ({scale}), which colibri cannot "
                               f"convert: {self.path}")
        return scale

    def read_f32(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """The tensor (or rows first..first+count of its first axis) as float32; fp8 e4m3 weights are
        multiplied by their per-block scales (``NAME_scale_inv``, one per block of the last two axes);
        a UE8M0-scaled fp8 / fp4 matrix (``NAME.scale``) is dequantised by `quant.dequantize`."""
        kind = self.native_kind(name)
        if kind is not None:
            if first or count is not None or len(self.where[name].shape(name)) != 2:
                raise ColibriError(f"{kind} tensor {name} must be a whole matrix: {self.path}")
            scale = self.scales_of(name)
            rows, cols = self.shape(name)
            data = self.where[name].read(name).view(np.uint8)
            scales = self.where[scale].read(scale).view(np.uint8)
            if self.digests is not None:
                for n, raw in ((name, data), (scale, scales)):
                    self.digests[f"{n}[0:]"] = hashlib.sha256(raw).hexdigest()
            (_, _, dshape), (_, _, sshape) = q.layout(kind, rows, cols)
            if data.shape != dshape or scales.shape != sshape:
                raise ColibriError(f"{scale} has shape {list(scales.shape)}, expected {list(sshape)} for {kind} "
                                   f"{name} [{rows}, {cols}]: {self.path}")
            return q.dequantize(q.QTensor(kind, rows, cols, data, scales))
        w = self._read(name, first, count)
        scale_name = self.scales_of(name)
        if scale_name is None:
            return w
        if w.ndim < 2:
            raise ColibriError(f"fp8 tensor {name} has shape {list(w.shape)}: block scales need a matrix: {self.path}")
        br, bc = self.block_size()
        rows, cols = w.shape[-2:]
        blocks = (-(-rows // br), -(-cols // bc))
        full = self.shape(name)
        if self.shape(scale_name) != (*full[:-2], *blocks):
            raise ColibriError(f"{scale_name} has shape {list(self.shape(scale_name))}, expected "
                               f"{[*full[:-2], *blocks]} for {br}x{bc} blocks of {name} {list(full)}: {self.path}")
        s = self._read(scale_name, first, count) if w.ndim > 2 else self._read(scale_name)
        s = np.repeat(np.repeat(s, br, axis=-2)[..., :rows, :], bc, axis=-1)[..., :cols]  # (..., rows, cols)
        return (w * s).astype(np.float32)

    def _read(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """One tensor (or rows of it) as float32, its stored bytes' digest noted in `digests`."""
        st = self.where[name]
        raw = st.read(name, first, count)
        if self.digests is not None:
            self.digests[f"{name}[{first}:{'' if count is None else count}]"] = hashlib.sha256(raw).hexdigest()
        return st.widen(name, raw)

    def fingerprint(self) -> dict:
        """Digest of the tensor names, shapes, dtypes and the file sizes."""
        tensors = sorted([n, st.dtype(n), list(st.shape(n))] for n, st in self.where.items())
        files = {name: st.path.stat().st_size for name, st in self.files.items()}
        digest = hashlib.sha256(json.dumps([tensors, sorted(files.items())]).encode()).hexdigest()
        return {"fingerprint": f"sha256:{digest}", "tensors": len(tensors), "bytes": sum(files.values()),
                "files": files}


# ----------------------------------------------------------------------------- the plan


@dataclass
class _Plan:
    architecture: str
    quant: str
    layout: ContainerLayout
    resident: list[tuple[str, str, tuple[int, ...]]]  # (name, kind, logical shape); kind ARRAY or a quant kind
    form: str  # "per_expert" | "fused"
    names: dict[str, str]  # expert name patterns of that form
    sources: dict[str, tuple[str, int | None, int | None]] = dataclasses.field(default_factory=dict)  # aliases read

    def read_resident(self, ckpt: Checkpoint, name: str) -> np.ndarray:
        """Resident tensor `name` as float32, from the checkpoint tensor (or rows of it) that holds it."""
        src, first, end = self.sources.get(name, (name, None, None))
        return ckpt.read_f32(src) if first is None else ckpt.read_f32(src, first, end - first)

    def expert_weights(self, ckpt: Checkpoint, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, H], up [I, H], down [H, I]) of one expert, float32."""
        if self.form == "fused":  # the expert's slices, as the layout says they lie
            gate_up = ckpt.read_f32(self.names["gate_up"].format(layer=layer), e, 1)[0]  # [2I, H] or [H, 2I]
            down = ckpt.read_f32(self.names["down"].format(layer=layer), e, 1)[0]  # [H, I] or [I, H]
            return self.layout.experts.split_fused(gate_up, down)
        return tuple(ckpt.read_f32(self.names[p].format(layer=layer, expert=e)) for p in PROJS)


def _plan(ckpt: Checkpoint, layout: ContainerLayout, architecture: str, quant: str) -> _Plan:
    """Check the checkpoint's names and shapes against the layout; decide how each tensor is stored."""
    E, H, I = layout.n_experts, layout.hidden, layout.intermediate
    names = layout.experts
    fused = bool(names.fused_gate_up and layout.moe_layers
                 and names.fused_gate_up.format(layer=layout.moe_layers[0]) in ckpt.where)
    try:
        if fused:
            if not names.fused_down:
                raise ColibriError(f"architecture {architecture}: the layout names fused gate_up but not fused down")
            patterns = {"gate_up": names.fused_gate_up, "down": names.fused_down}
        else:  # the layout's per-expert names, else the first of its other names the checkpoint holds
            first = (layout.moe_layers or (0,))[0]
            patterns = next((dict(n) for n in (names.per_expert, *names.other_names)
                             if n["gate"].format(layer=first, expert=0) in ckpt.where), names.per_expert)
            patterns = {p: patterns[p] for p in PROJS}
        # each resident tensor under its own name, else under the first alias the checkpoint holds
        sources = {name: next(((src, a, b) for src, a, b in layout.sources(name) if src in ckpt.where),
                              (name, None, None)) for name in layout.resident}
        expected: dict[str, tuple[int, ...] | None] = dict.fromkeys(src for src, _, _ in sources.values())
        for layer in layout.moe_layers:
            if fused:
                gate_up, down = names.fused_shapes(E, H, I)
                expected[patterns["gate_up"].format(layer=layer)] = gate_up
                expected[patterns["down"].format(layer=layer)] = down
            else:
                for e in range(E):
                    for p in PROJS:
                        expected[patterns[p].format(layer=layer, expert=e)] = (H, I) if p == "down" else (I, H)
    except (KeyError, IndexError, ValueError) as err:
        raise ColibriError(f"architecture {architecture} has a bad expert name pattern ({one_line(err)})") from None

    missing = [n for n in expected if n not in ckpt.where]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ColibriError(f"checkpoint lacks tensor {missing[0]} (needed by architecture {architecture}){more}: "
                           f"{ckpt.path}")
    scales = {ckpt.scales_of(n) for n in expected if n in ckpt.where} - {None}  # fp8 / fp4 scales
    unused = [n for n in sorted(ckpt.where) if n not in expected and n not in scales and not layout.ignored(n)
              and not (n.endswith(Checkpoint.FP8_SCALE_SUFFIX) and layout.ignored(n[: -len(Checkpoint.FP8_SCALE_SUFFIX)]))]
    if unused:
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        raise ColibriError(f"checkpoint has tensor {unused[0]} that architecture {architecture} does not use"
                           f"{more}: {ckpt.path}")
    for name, shape in expected.items():
        if ckpt.where[name].dtype(name) not in READABLE_DTYPES:
            raise ColibriError(f"tensor {name} has dtype {ckpt.where[name].dtype(name)}, which colibri cannot "
                               f"convert (it reads {', '.join(READABLE_DTYPES)}): {ckpt.path}")
        ckpt.scales_of(name)  # an fp8 tensor without its block scales is an error now, not mid-write
        if shape is not None and ckpt.shape(name) != shape:
            raise ColibriError(f"tensor {name} has shape {list(ckpt.shape(name))}, but architecture {architecture} "
                               f"expects {list(shape)} (experts {E}, hidden {H}, intermediate {I}): {ckpt.path}")
    resident = []
    for name in layout.resident:
        src, first, end = sources[name]
        shape = ckpt.shape(src)
        if first is not None:
            if not (shape and 0 <= first < end <= shape[0]):
                raise ColibriError(f"tensor {src} has shape {list(shape)}: it cannot hold rows {first}..{end} as "
                                   f"{name} (architecture {architecture}): {ckpt.path}")
            shape = (end - first, *shape[1:])
        resident.append((name, ARRAY if layout.stays_f32(name, len(shape)) else quant, shape))
    return _Plan(architecture, quant, layout, resident, "fused" if fused else "per_expert", patterns,
                 {n: s for n, s in sources.items() if s != (n, None, None)})


def _layout_digest(layout: ContainerLayout) -> str:
    text = json.dumps(dataclasses.asdict(layout), sort_keys=True, default=list)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------- writing files


class _CrcWriter:
    """A file written front to back, with its running crc32 and size."""

    def __init__(self, path: Path):
        self.f, self.crc, self.size = open(path, "wb"), 0, 0

    def write(self, data) -> None:
        self.f.write(data)
        self.crc = crc32(data, self.crc)
        self.size += len(data)

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"size": self.size, "crc32": self.crc}


def _write_resident(ckpt: Checkpoint, plan: _Plan, path: Path, bar) -> dict:
    """resident.safetensors, written one tensor at a time (the header is known up front)."""
    parts = []  # (stored name, dtype, shape)
    for name, kind, shape in plan.resident:
        if kind == ARRAY:
            parts.append((name, np.dtype(np.float32), shape))
        else:
            parts += [(name if part == "data" else name + SCALES_SUFFIX, dtype, pshape)
                      for part, dtype, pshape in q.layout(kind, *shape)]
    header, offset = {"__metadata__": {"format": "colibri"}}, 0
    for pname, dtype, pshape in parts:
        nbytes = int(np.prod(pshape)) * dtype.itemsize
        header[pname] = {"dtype": ST_NAME[dtype], "shape": list(pshape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    out = _CrcWriter(path)
    out.write(len(head).to_bytes(8, "little") + head)
    for name, kind, shape in plan.resident:
        w = plan.read_resident(ckpt, name)
        if kind == ARRAY:
            arrays = [w]
        else:
            t = q.quantize(w, kind)
            arrays = [t.data] if t.scales is None else [t.data, t.scales]
        for a in arrays:
            out.write(np.ascontiguousarray(a).tobytes())
        bar.update(1)
    rec = out.close()
    if rec["size"] != 8 + len(head) + offset:
        raise AssertionError(f"{path}: wrote {rec['size']} bytes, expected {8 + len(head) + offset}")
    return rec


def pack_extent(tensors, layer: int, expert: int, nbytes: int) -> bytearray:
    """One expert's extent: its (gate, up, down) QTensors packed in order, zero padding, and the
    trailer naming (layer, expert) with the extent's crc32 — `nbytes` bytes in all."""
    buf = bytearray()
    for t in tensors:
        q.pack(t, buf)
    buf += bytes(nbytes - TRAILER.size - len(buf))
    buf += TRAILER.pack(0, TRAILER_MAGIC, layer, expert)
    buf[nbytes - TRAILER.size: nbytes - TRAILER.size + 4] = extent_crc(buf).to_bytes(4, "little")
    return buf


def _write_layer(ckpt: Checkpoint, plan: _Plan, layer: int, path: Path, bar) -> dict:
    """One MoE layer's expert file: extent e at e * expert_nbytes.

    Experts are quantised on a few threads (NumPy releases the GIL), at most 2 per thread in flight,
    and written in order."""
    lay = plan.layout
    kind = lay.expert_kind(layer, plan.quant)
    _, nbytes = expert_extent(kind, lay.hidden, lay.intermediate)

    def extent(e: int) -> bytearray:
        return pack_extent([q.quantize(w, kind) for w in plan.expert_weights(ckpt, layer, e)], layer, e, nbytes)

    out, crcs = _CrcWriter(path), []

    def write(buf: bytearray) -> None:
        crcs.append(int.from_bytes(buf[nbytes - TRAILER.size: nbytes - TRAILER.size + 4], "little"))
        out.write(buf)
        bar.update(1)

    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        pending = deque()
        for e in range(lay.n_experts):
            pending.append(pool.submit(extent, e))
            if len(pending) > 2 * workers:
                write(pending.popleft().result())
        while pending:
            write(pending.popleft().result())
    return {**out.close(), "extent_crc32": crcs}


class _Staging:
    """DST.partial/: the files finished so far, recorded in progress.json with their checksums and
    the digest of the source bytes each was made from.

    A staging directory is resumed only for the same key (format, source structure, quantisation,
    architecture, layout) and only if every finished file is still whole and its source bytes
    still hash to what they did (`check_sources`); otherwise it is discarded with a one-line notice.
    Anything else in it (a file cut short by a kill, a temporary) is removed before writing
    (`check_sources`)."""

    def __init__(self, path: Path, key: dict, say):
        self.path, self.say = path, say
        rec = None
        if path.exists() or path.is_symlink():
            if not (path.is_dir() and not path.is_symlink() and _is_staging(path)):
                raise ColibriError(f"{path} exists and is not a colibri staging directory: remove it or "
                                   "choose another destination")
            try:
                rec = json.loads(read_text(path / PROGRESS, CONFIG_BYTES))
            except (ColibriError, ValueError, RecursionError):
                rec = None
            if isinstance(rec, dict) and rec.get("key") == key and isinstance(rec.get("files"), dict):
                n = len(rec["files"])
                say(f"resuming the conversion in {path}" + (f" (checking its {n} finished files against the "
                                                            "source first)" if n else ""))
            else:
                if (path / PROGRESS).exists():
                    say(f"discarding {path}: an unfinished conversion of another source, quantisation or layout "
                        "(or by another colibri version)")
                elif (path / MANIFEST).exists():  # killed between its last two steps: too late to check
                    say(f"discarding {path}: a conversion interrupted as it was being published; converting "
                        "from the start")
                self._clear()
                rec = None
        self.rec = rec or {"key": key, "files": {}}
        path.mkdir(parents=True, exist_ok=True)
        self.save()  # progress.json first: a directory holding it is recognisably ours
        (path / "experts").mkdir(exist_ok=True)

    def _clear(self) -> None:
        shutil.rmtree(self.path)

    def _remove_strays(self) -> None:
        """Remove what no finished file accounts for: a file a kill cut short, temporaries."""
        keep = {PROGRESS, *self.rec["files"]}
        for f in sorted(self.path.rglob("*"), reverse=True):
            rel = f.relative_to(self.path).as_posix()
            if f.is_dir() and not f.is_symlink():
                if rel != "experts" and not any(f.iterdir()):
                    f.rmdir()
            elif rel not in keep:
                f.unlink()

    def save(self) -> None:
        write_atomic(self.path / PROGRESS, json.dumps(self.rec).encode())

    def check_sources(self, source_digest, src: Path, extents: dict[str, int]) -> None:
        """Check every finished file against the source: one no longer whole, or not one this
        conversion writes (`extents`: expert file -> its expert count), is forgotten (it will be
        rewritten); one made from other source bytes (`source_digest(rel)` differs: another
        checkpoint of the same shapes, or this one changed since) discards the whole directory."""
        files = self.rec["files"]
        for rel in list(files):
            rec, f = files[rel], self.path / rel
            crcs = rec.get("extent_crc32") if isinstance(rec, dict) else None
            ours = isinstance(rec, dict) and (rel == RESIDENT_FILE or (
                rel in extents and isinstance(crcs, list) and len(crcs) == extents[rel]))
            if not (ours and f.is_file() and f.stat().st_size == rec.get("size") and crc32_file(f) == rec.get("crc32")):
                del files[rel]
                if rel == RESIDENT_FILE or rel in extents:  # never a path a damaged progress.json names
                    f.unlink(missing_ok=True)
                continue
            if rec.get("source") != source_digest(rel):
                self.say(f"discarding {self.path}: its {rel} was converted from other weights than {src} "
                         "(another checkpoint, or this one changed since); converting from the start")
                self._clear()
                self.rec = {"key": self.rec["key"], "files": {}}
                self.path.mkdir(parents=True)
                self.save()
                (self.path / "experts").mkdir()
                return
        self.save()
        self._remove_strays()

    def finished(self, rel: str) -> dict | None:
        """The record of a file finished earlier (checked by `check_sources`)."""
        return self.rec["files"].get(rel)

    def done(self, rel: str, rec: dict) -> dict:
        self.rec["files"][rel] = rec
        self.save()
        return rec


def _is_staging(path: Path) -> bool:
    """Whether every entry of `path` is one the converter writes (a kill can leave any of them
    without progress.json: the directory made, a temporary not yet renamed)."""
    known = {PROGRESS, MANIFEST, RESIDENT_FILE, "experts", *COPIED_FILES}
    for f in path.iterdir():
        name = re.sub(r"\.\d+\.tmp$", "", f.name)  # write_atomic's NAME.PID.tmp
        if name not in known:
            return False
        if name == "experts" and not (f.is_dir() and all(
                re.fullmatch(r"layer-\d{3,}\.bin", g.name) for g in f.iterdir())):
            return False
    return True


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- convert


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, quant: str, layout: ContainerLayout,
            architecture: str, plugin: str, plugin_version: str, progress: bool = True,
            force: bool = False) -> None:
    """Convert the HF checkpoint in `src` into a colibri container at `dst`.

    `quant` (f32, int8, int4) applies to the routed experts and to every resident matrix the layout
    does not keep float32. Resumable: rerunning after an interruption continues in ``DST.partial``.
    `force` replaces an existing container at `dst`.
    """
    src, dst = Path(src), Path(dst)
    if quant not in q.KINDS:
        raise ColibriError(f"unknown quantisation {quant!r}: choose one of {', '.join(q.KINDS)}")
    ckpt = Checkpoint(src)
    plan = _plan(ckpt, layout, architecture, quant)
    if dst.resolve() == src.resolve():
        raise ColibriError(f"the destination {dst} is the checkpoint itself: choose another directory")
    _check_destination(dst, force)
    source = ckpt.fingerprint()
    key = {"format_version": FORMAT_VERSION, "source": source["fingerprint"], "quant": quant,
           "architecture": architecture, "layout": _layout_digest(layout), "records": "source-digest"}

    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr)

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = _Staging(dst.with_name(dst.name + ".partial"), key, say)
    layer_of = {expert_file_name(layer): layer for layer in layout.moe_layers}

    def reads(rel: str, write=None):
        """Write file `rel` (`write(path, bar)`), or with no `write` only read its source tensors as
        writing it would; either way returns the digest of the source bytes read."""
        ckpt.digests = {}
        if write is not None:
            rec = write(staging.path / rel)
        elif rel == RESIDENT_FILE:
            for name, _, _ in plan.resident:
                plan.read_resident(ckpt, name)  # as _write_resident reads it (aliases included)
        else:
            for e in range(layout.n_experts):
                plan.expert_weights(ckpt, layer_of[rel], e)
        digest = "sha256:" + hashlib.sha256(json.dumps(sorted(ckpt.digests.items())).encode()).hexdigest()
        ckpt.digests = None
        return digest if write is None else {**rec, "source": digest}

    staging.check_sources(reads, src, dict.fromkeys(layer_of, layout.n_experts))
    total = len(plan.resident) + len(layout.moe_layers) * layout.n_experts
    bar = _progressbar(total, f"converting {src.name} -> {dst.name} ({quant})") if progress else _NoBar()
    layers = []
    with bar:
        resident = staging.finished(RESIDENT_FILE)
        if resident is None:
            resident = staging.done(RESIDENT_FILE, reads(RESIDENT_FILE, lambda p: _write_resident(ckpt, plan, p, bar)))
        else:
            bar.update(len(plan.resident))
        for layer in layout.moe_layers:
            rel = expert_file_name(layer)
            rec = staging.finished(rel)
            if rec is None:
                rec = staging.done(rel, reads(rel, lambda p: _write_layer(ckpt, plan, layer, p, bar)))
            else:
                bar.update(layout.n_experts)
            entry = {"layer": layer, "path": rel, "size": rec["size"], "crc32": rec["crc32"],
                     "extent_crc32": _FlowList(rec["extent_crc32"])}
            kind = layout.expert_kind(layer, quant)
            if kind != quant:  # this layer's experts are kept more precise than experts.kind
                entry["kind"] = kind
                entry["expert_nbytes"] = expert_extent(kind, layout.hidden, layout.intermediate)[1]
            layers.append(entry)
    # the source's identity binds its content: two checkpoints of the same shapes differ here
    content = [staging.finished(RESIDENT_FILE)["source"]] + [staging.finished(e["path"])["source"] for e in layers]
    source["content"] = "sha256:" + hashlib.sha256(json.dumps(content).encode()).hexdigest()
    source["fingerprint"] = "sha256:" + hashlib.sha256(
        json.dumps([source["fingerprint"], source["content"]]).encode()).hexdigest()
    copied = {}
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, staging.path / name)
            copied[name] = _Flow(size=(staging.path / name).stat().st_size, crc32=crc32_file(staging.path / name))
    manifest = _manifest(plan, architecture, plugin, plugin_version, source, copied, resident, layers)
    text = yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    text += manifest_checksum_line(text)
    write_atomic(staging.path / MANIFEST, text.encode("utf-8"))
    (staging.path / PROGRESS).unlink()
    fsync_dir(staging.path)
    _publish(staging.path, dst, force)


def _progressbar(total: int, label: str):
    import typer

    return typer.progressbar(length=total, label=label, file=sys.stderr)


def _manifest(plan: _Plan, architecture, plugin, plugin_version, source, copied, resident, layers) -> dict:
    lay = plan.layout
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": architecture,
        "plugin": _Flow(name=plugin, version=plugin_version),
        "quant": plan.quant,
        "checksum": "crc32",
        "quantisation": _Flow(experts=plan.quant, matrices=plan.quant, kept="f32"),
        "source": source,
        "files": copied,
        "resident": {
            "files": {RESIDENT_FILE: _Flow(size=resident["size"], crc32=resident["crc32"])},
            "tensors": {name: _Flow(kind=kind, shape=list(shape)) for name, kind, shape in plan.resident},
        },
        "experts": {
            "moe_layers": _FlowList(lay.moe_layers),
            "n_experts": lay.n_experts,
            "hidden": lay.hidden,
            "intermediate": lay.intermediate,
            "kind": plan.quant,
            "expert_nbytes": expert_extent(plan.quant, lay.hidden, lay.intermediate)[1],
            "extent": {"order": _FlowList(PROJS), "part_align": 64, "align": EXTENT_ALIGN,
                       "trailer": "last 16 bytes: u32 crc32 of all other extent bytes, CLXE, u32 layer, u32 expert"},
            "source_form": plan.form,
            "names": dict(plan.names),
            **_fused_layout(plan),
            "files": layers,
        },
    }


def _fused_layout(plan: _Plan) -> dict:
    """The manifest's note of how fused expert tensors lay in the source (`ExpertNames`' flags), so
    `dequantize` gives them back as they were; nothing for the default layout."""
    names = plan.layout.experts
    if plan.form != "fused" or not (names.fused_transposed or names.gate_up_interleaved):
        return {}
    return {"fused_layout": {"transposed": names.fused_transposed, "gate_up_interleaved": names.gate_up_interleaved}}


def _check_destination(dst: Path, force: bool) -> None:
    if not (dst.exists() or dst.is_symlink()):
        return
    if not dst.is_dir():
        raise ColibriError(f"{dst} exists and is not a directory: choose another destination")
    if (dst / MANIFEST).exists():
        if not force:
            raise ColibriError(f"{dst} already holds a colibri container: remove it or choose another destination")
    elif any(dst.iterdir()):
        raise ColibriError(f"{dst} exists and is not empty: choose another destination")


def _publish(staging: Path, dst: Path, force: bool) -> None:
    """Rename the finished staging directory to `dst` (replacing an old container if `force`)."""
    _check_destination(dst, force)
    old = None
    if dst.exists():
        if (dst / MANIFEST).exists():
            old = dst.with_name(dst.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.rename(dst, old)
        else:
            dst.rmdir()
    os.rename(staging, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old)
