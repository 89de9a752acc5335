"""Reading a colibri container: `Container` opens and validates one; also the raw safetensors reader
the converter uses for HF checkpoints (it widens bfloat16, which safetensors' NumPy loader cannot).

The format itself is described in `colibri_core/container/__init__.py`.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import yaml

from .. import quant
from ..arena import Arena
from ..errors import ColibriError
from ..fsio import MANIFEST_BYTES, read_bounded, read_json
from ..kernels._colibri_kernels import ffi, lib
from ..layout import PROJS
from . import stripe

FORMAT = "colibri-container"
FORMAT_VERSION = 1
MANIFEST = "colibri.yaml"
RESIDENT_FILE = "resident.safetensors"
SCALES_SUFFIX = ".__scales"  # resident QTensor NAME is stored as NAME (data) + NAME.__scales
EXTENT_ALIGN = 4096
# The last 16 bytes of every expert extent: u32 crc32, magic, u32 layer, u32 expert. The crc covers
# every other byte of the extent (`extent_crc`); it is not the extent's last field, because a crc32
# followed by nothing would make the crc32 of every whole extent (and file) one constant.
TRAILER = struct.Struct("<I4sII")
TRAILER_MAGIC = b"CLXE"
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
CHUNK = 16 << 20
ARRAY = "array"  # resident kind of a float32 ndarray kept as is (norms, routers, biases)

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def expert_file_name(layer: int) -> str:
    return f"experts/layer-{layer:03d}.bin"


def expert_extent(kind: str, hidden: int, intermediate: int) -> tuple[tuple[int, int, int], int]:
    """((gate, up, down) offsets inside one extent, extent size in bytes)."""
    offsets, end = [], 0
    for proj in PROJS:
        offsets.append(end)
        end = quant.packed_size(kind, *_proj_shape(proj, hidden, intermediate), end)
    return tuple(offsets), _align(end + TRAILER.size, EXTENT_ALIGN)


def crc32(data, crc: int = 0) -> int:
    """zlib.crc32(data, crc) of a buffer of bytes, by the I/O pool's carry-less multiplies
    (csrc/io_pool.c: 30-55 GB/s a core on Zen 4, zlib ~4)."""
    mv = memoryview(data)
    if mv.nbytes == 0:
        return crc
    mv = mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    return lib.io_crc32(crc, ffi.from_buffer(mv), mv.nbytes)


def extent_crc(extent) -> int:
    """crc32 of an extent's bytes except the trailer's crc field (what the trailer and manifest hold)."""
    mv = memoryview(extent)
    n = mv.nbytes
    return crc32(mv[n - 12:], crc32(mv[: n - 16]))


_MANIFEST_CRC = re.compile(r"# crc32 ([0-9a-f]{8}) of the lines above\n?\Z")


def manifest_checksum_line(text: str) -> str:
    """The manifest's last line: the crc32 of every byte before it (`manifest_checksum_ok`)."""
    return f"# crc32 {zlib.crc32(text.encode('utf-8')):08x} of the lines above\n"


def manifest_checksum_ok(text: str) -> bool:
    """False if the manifest ends in a checksum line its text fails (manifests written before it
    was added have none, and are taken as they are)."""
    start = text.rfind("\n", 0, len(text) - 1) + 1
    m = _MANIFEST_CRC.match(text, start)
    return m is None or int(m.group(1), 16) == zlib.crc32(text[:start].encode("utf-8"))


def crc32_file(path: str | os.PathLike, crc: int = 0) -> int:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = crc32(chunk, crc)
    return crc


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _proj_shape(proj: str, hidden: int, intermediate: int) -> tuple[int, int]:
    return (hidden, intermediate) if proj == "down" else (intermediate, hidden)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1"),  # float8 e4m3fn, read as raw bytes; widened through FP8_E4M3
    "F8_E8M0": np.dtype("u1"),  # UE8M0 scales (2^(s-127)), read as raw bytes (DeepSeek V4)
}
READABLE_DTYPES = tuple(_ST_DTYPES)


def _fp8_e4m3_table() -> np.ndarray:
    """float32 value of every float8 e4m3fn byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m/8 · 2^-6); no infinities, S.1111.111 is NaN."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return (sign * mag).astype(np.float32)


FP8_E4M3 = _fp8_e4m3_table()  # (256,) float32: byte -> value
ST_NAME = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int8): "I8",
           np.dtype(np.uint8): "U8"}


class SafetensorsFile:
    """The header of one safetensors file, and reads of single tensors (or first-axis slices)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8 or n > 1 << 30:
                    raise ValueError(f"header length {n} does not fit in a {size}-byte file")
                header = json.loads(f.read(n))
                if not isinstance(header, dict):
                    raise ValueError("its header is not a JSON object")
        except (OSError, ValueError, RecursionError, struct.error) as e:
            why = "its header is nested too deeply" if isinstance(e, RecursionError) else one_line(e)
            raise ColibriError(f"cannot read safetensors file {self.path}: {why}") from None
        self.data_start = 8 + n
        self.metadata = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, t in header.items():
            try:
                dtype, shape, (begin, end) = t["dtype"], tuple(int(d) for d in t["shape"]), t["data_offsets"]
                itemsize = _ST_DTYPES[dtype].itemsize if dtype in _ST_DTYPES else None
                ok = 0 <= begin <= end <= size - self.data_start
                if itemsize is not None and end - begin != int(np.prod(shape)) * itemsize:
                    ok = False
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise ColibriError(f"corrupt safetensors file {self.path}: bad header entry for {name}")
            self.tensors[name] = (dtype, shape, self.data_start + begin, end - begin)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def dtype(self, name: str) -> str:
        return self.tensors[name][0]

    def read(self, name: str, first: int = 0, count: int | None = None, into: np.ndarray | None = None) -> np.ndarray:
        """The tensor (or rows first..first+count of its first axis) in its stored dtype
        (BF16 as raw uint16), read into `into` (a C-contiguous array of as many bytes) if given."""
        dtype, shape, start, nbytes = self.tensors[name]
        if dtype not in _ST_DTYPES:
            raise ColibriError(f"tensor {name} in {self.path} has dtype {dtype}, which colibri cannot read "
                               f"(it reads {', '.join(READABLE_DTYPES)})")
        npdt = _ST_DTYPES[dtype]
        if shape and (first or count is not None):
            row = int(np.prod(shape[1:])) * npdt.itemsize
            count = shape[0] - first if count is None else count
            start, nbytes, shape = start + first * row, count * row, (count, *shape[1:])
        out = np.empty(nbytes, np.uint8) if into is None else into.reshape(-1).view(np.uint8)
        if out.nbytes != nbytes:
            raise ValueError(f"reading {name}: {nbytes} bytes into an array of {out.nbytes}")
        with open(self.path, "rb") as f:
            f.seek(start)
            if f.readinto(memoryview(out)) != nbytes:
                raise ColibriError(f"safetensors file {self.path} is truncated (reading {name})")
        return out.view(npdt).reshape(shape)

    def read_f32(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """The tensor widened to float32 (exactly, for F16/BF16 and small integers)."""
        return self.widen(name, self.read(name, first, count))

    def widen(self, name: str, a: np.ndarray) -> np.ndarray:
        """`read`'s array of tensor `name` as float32 (`read_f32` is ``widen(read(…))``)."""
        dtype = self.dtype(name)
        if dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        if dtype == "F8_E4M3":
            return FP8_E4M3[a]
        out = a.astype(np.float32)
        if dtype not in ("F64", "F32", "F16") and not np.array_equal(out, a):
            raise ColibriError(f"tensor {name} in {self.path} holds {dtype} values float32 cannot represent")
        return out


# ----------------------------------------------------------------------------- the container


class _Bad(Exception):
    """A manifest problem (turned into a ColibriError naming the container)."""


def _get(d, dotted: str, typ):
    cur = d
    for key in dotted.split("."):
        if not isinstance(cur, dict) or key not in cur:
            raise _Bad(f"{MANIFEST} lacks key {dotted}")
        cur = cur[key]
    if not isinstance(cur, typ) or (typ is int and isinstance(cur, bool)):
        raise _Bad(f"{MANIFEST} key {dotted} has a bad value: {cur!r}"[:200])
    return cur


def _safe_rel(rel: str) -> str:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in Path(rel).parts:
        raise _Bad(f"{MANIFEST} lists a bad file path {rel!r}")
    return rel


def hold(manifest: Path, doing: str | None = None) -> int | None:
    """A descriptor holding a lock (flock) on a container's `manifest`: shared (`doing` None) for
    every open `Container`, exclusive for `doing`, which changes the model's files in place
    (`colibri stripe`, `rm`), so a model is never rearranged while open, nor opened while being
    rearranged; ColibriError when the other kind is held. None where there is nothing to hold
    (no such file, a filesystem without locks)."""
    try:
        fd = os.open(manifest, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # reading the manifest says what is wrong
        return None
    try:
        _lock(fd, manifest.parent, doing)
    except ColibriError:
        os.close(fd)
        raise
    except OSError:  # no locks here (some network filesystems)
        os.close(fd)
        return None
    return fd


def _lock(fd: int, model: Path, doing: str | None) -> None:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if doing is None else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ColibriError(f"{model} is being changed by another process (colibri stripe or rm): wait for it to finish"
                           if doing is None else f"{model} is open elsewhere (a server, chat or run uses it): stop "
                           f"that before {doing}") from None


class Container:
    """A converted model directory, opened read-only and validated.

    Opening checks the manifest, that every listed file exists with its recorded size, and the
    checksums of the small files (config, tokenizer, resident tensors). Expert extents are checked
    when read (`parse_expert`); `verify(deep=True)` re-hashes everything.

    A striped container (`colibri stripe`: part of each layer's experts moved to a second
    directory) is opened with its stripe (`stripe`, from `.coli_stripe`, checked), and
    `expert_location` answers the file that holds each expert: every reader follows it.

    `resident()` returns a QTensor for every resident matrix stored quantised or as a float32
    matrix (manifest kind f32/int8/int4), and a float32 ndarray of the logical shape for every
    tensor kept as is (manifest kind ``array``: all 1-D tensors and those the layout keeps f32,
    e.g. routers). Every quantised matrix it parses carries `activations`, the arithmetic of its
    products (``QTensor.act``: the engine's option).
    """

    def __init__(self, model_dir: str | os.PathLike, activations: str = "f32"):
        self.path = Path(model_dir)
        self.activations = activations
        p = self.path
        if not p.exists():
            raise ColibriError(f"model directory {p} does not exist")
        if not p.is_dir():
            raise ColibriError(f"{p} is not a directory (expected a colibri model directory)")
        mpath = p / MANIFEST
        if not mpath.is_file():
            if p.name.endswith(".partial"):
                raise ColibriError(f"{p} is an unfinished conversion: rerun `colibri convert` to finish it")
            if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
                raise ColibriError(f"{p} is a Hugging Face checkpoint, not a colibri container: "
                                   f"run `colibri convert {p} DST` and use DST")
            raise ColibriError(f"{p} is not a colibri container (no {MANIFEST})")
        self._in_use = hold(mpath)  # shared, until close(): `exclusive` (stripe, rm) refuses while it is
        data = read_bounded(mpath, MANIFEST_BYTES, "container manifest", "reconvert the model")
        try:
            text = data.decode("utf-8")
            if not manifest_checksum_ok(text):
                raise ColibriError(f"{p}: {MANIFEST} fails its own checksum (damaged or edited); reconvert the model")
            manifest = yaml.load(text, Loader=_Loader)
        except RecursionError:
            raise ColibriError(f"{p}: cannot parse {MANIFEST} (nested too deeply); reconvert the model") from None
        except (UnicodeDecodeError, yaml.YAMLError) as e:
            raise ColibriError(f"{p}: cannot parse {MANIFEST} ({one_line(e)[:300]}); reconvert the model") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ColibriError(f"{p}: {MANIFEST} is not a colibri container manifest; reconvert the model")
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
            fix = "upgrade colibri, or reconvert the model with this one" if newer else \
                "reconvert the model with this colibri"
            raise ColibriError(f"{mpath}: container format_version {repr(version)[:40]}, but this colibri reads version "
                               f"{FORMAT_VERSION}: {fix}")
        self.manifest = manifest
        try:
            self._load_manifest()
        except _Bad as e:
            where = "" if MANIFEST in str(e) else f"{MANIFEST}: "
            raise ColibriError(f"{p}: {where}{e}; reconvert the model") from None
        problems = self._cheap_problems()
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            if len(problems) > 1 and not any(x.endswith(" is missing") for x in problems):
                names = list(dict.fromkeys(self._subject(x) for x in problems))  # in order, once each
                names = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
                raise ColibriError(f"{p}: {MANIFEST} does not describe the files beside it (it differs at {names}): "
                                   "a manifest or files from another model or conversion; reconvert the model")
            raise ColibriError(f"damaged colibri container {p}: {problems[0]}{more}; reconvert the model")
        self.config = read_json(p / "config.json", "reconvert the model")
        if not isinstance(self.config, dict):
            raise ColibriError(f"{p / 'config.json'} is not a model configuration (a JSON object): reconvert the model")
        self._fds: dict[str, int] = {}  # expert file path -> its fd, opened on first read
        self._lock = threading.Lock()
        self.stripe = stripe.load(self)  # the experts moved to a second directory (`colibri stripe`), or None

    # -- manifest

    def _load_manifest(self) -> None:
        m = self.manifest
        self.architecture = _get(m, "architecture", str)
        self.quant = _get(m, "quant", str)
        if self.quant not in quant.KINDS:
            raise _Bad(f"unknown quant {self.quant!r}")
        if _get(m, "checksum", str) != "crc32":
            raise _Bad(f"unknown checksum {m['checksum']!r}")
        self._copied = {_safe_rel(k): v for k, v in _get(m, "files", dict).items()}
        if "config.json" not in self._copied:
            raise _Bad(f"{MANIFEST} does not list config.json")
        self._resident_files = {_safe_rel(k): v for k, v in _get(m, "resident.files", dict).items()}
        for rel, entry in (*self._copied.items(), *self._resident_files.items()):
            _get(entry, "size", int), _get(entry, "crc32", int)
        self._resident = {}
        for name, t in _get(m, "resident.tensors", dict).items():
            kind, shape = _get(t, "kind", str), tuple(_get(t, "shape", list))
            if kind not in (ARRAY, *quant.KINDS) or not all(isinstance(d, int) and d >= 0 for d in shape) or (
                    kind != ARRAY and len(shape) != 2):
                raise _Bad(f"resident tensor {name} has a bad entry {t!r}"[:200])
            self._resident[name] = (kind, shape)
        self.moe_layers = tuple(_get(m, "experts.moe_layers", list))
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in self.moe_layers):
            raise _Bad(f"experts.moe_layers is not a list of layer numbers: {self.moe_layers!r}"[:200])
        self.n_experts = _get(m, "experts.n_experts", int)
        self.hidden = _get(m, "experts.hidden", int)
        self.intermediate = _get(m, "experts.intermediate", int)
        self.expert_kind = _get(m, "experts.kind", str)
        if self.expert_kind not in quant.KINDS:
            raise _Bad(f"unknown expert quantisation {self.expert_kind!r}")
        self._offsets, nbytes = expert_extent(self.expert_kind, self.hidden, self.intermediate)
        if _get(m, "experts.expert_nbytes", int) != nbytes:
            raise _Bad(f"experts.expert_nbytes {m['experts']['expert_nbytes']} disagrees with the expert shapes")
        self.expert_nbytes = nbytes  # of experts.kind; `layer_expert_nbytes` for one layer
        self._layers = {}
        self._extents = {}  # layer -> (kind, (gate, up, down) offsets, extent bytes)
        self._paths = {}  # layer -> its expert file's path (a str: built once, asked for on every read)
        for f in _get(m, "experts.files", list):
            layer = _get(f, "layer", int)
            rel = _safe_rel(_get(f, "path", str))
            crcs = _get(f, "extent_crc32", list)
            kind, layer_nbytes = self.expert_kind, nbytes
            if "kind" in f:  # a layer kept more precise than experts.kind (e.g. GLM's MTP experts)
                kind = _get(f, "kind", str)
                if kind not in quant.KINDS:
                    raise _Bad(f"unknown expert quantisation {kind!r} for {rel}")
                offsets, layer_nbytes = expert_extent(kind, self.hidden, self.intermediate)
                if _get(f, "expert_nbytes", int) != layer_nbytes:
                    raise _Bad(f"expert_nbytes of {rel} disagrees with the expert shapes")
            self._extents[layer] = (kind, expert_extent(kind, self.hidden, self.intermediate)[0], layer_nbytes)
            if _get(f, "size", int) != self.n_experts * layer_nbytes or len(crcs) != self.n_experts:
                raise _Bad(f"expert file entry {rel} disagrees with n_experts/expert_nbytes")
            _get(f, "crc32", int)
            self._layers[layer] = f
            self._paths[layer] = str(self.path / rel)
        if sorted(self._layers) != sorted(self.moe_layers) or len(self.moe_layers) != len(self._layers):
            raise _Bad("experts.files does not list one file per MoE layer")
        form = _get(m, "experts.source_form", str)
        if form not in ("per_expert", "fused"):
            raise _Bad(f"unknown experts.source_form {form!r}")
        for key in ("gate_up", "down") if form == "fused" else PROJS:
            _get(m, f"experts.names.{key}", str)

    def _listed_files(self):
        """(relative path, entry) of every file the manifest lists."""
        yield from self._copied.items()
        yield from self._resident_files.items()
        for layer in self.moe_layers:
            yield self._layers[layer]["path"], self._layers[layer]

    def _cheap_problems(self) -> list[str]:
        """Missing files, wrong sizes, checksums of the small files, resident headers vs manifest."""
        problems = []
        for rel, entry in self._listed_files():
            f = self.path / rel
            try:
                size = f.stat().st_size
            except OSError:
                problems.append(f"{f} is missing")
                continue
            want = entry.get("size") if isinstance(entry, dict) else None
            if size != want:
                what = " (truncated)" if isinstance(want, int) and size < want else ""
                problems.append(f"{f} is {size} bytes, expected {want}{what}")
            elif rel in self._copied or rel in self._resident_files:
                if crc32_file(f) != entry.get("crc32"):
                    problems.append(f"{f} fails its checksum (corrupt)")
        if problems:
            return problems
        self._where = {}  # stored tensor name -> the resident file holding it (used by `resident`)
        for rel in self._resident_files:
            try:
                st = SafetensorsFile(self.path / rel)
            except ColibriError as e:
                return [str(e)]
            for name in st.tensors:
                self._where[name] = st
        for name, (kind, shape) in self._resident.items():
            for part, dtype, pshape in self._parts(name, kind, shape):
                st = self._where.get(part)
                if st is None or st.shape(part) != tuple(pshape) or st.dtype(part) != ST_NAME[dtype]:
                    problems.append(f"resident tensor {part} is missing or has the wrong shape/dtype")
        return problems

    def _subject(self, problem: str) -> str:
        """What one of `_cheap_problems`' lines is about: a file (relative to the container) or a
        resident tensor (its scales named as the tensor)."""
        if problem.startswith(f"{self.path}{os.sep}"):
            return problem[len(str(self.path)) + 1:].split(" ")[0]
        if problem.startswith("resident tensor "):
            part = problem.split(" ")[2]
            return "tensor " + (part[:-len(SCALES_SUFFIX)] if part.endswith(SCALES_SUFFIX) else part)
        return problem

    @staticmethod
    def _parts(name: str, kind: str, shape: tuple[int, ...]):
        """(stored tensor name, dtype, shape) of each part of a resident tensor."""
        if kind == ARRAY:
            return [(name, np.dtype(np.float32), shape)]
        return [(name if part == "data" else name + SCALES_SUFFIX, dtype, pshape)
                for part, dtype, pshape in quant.layout(kind, *shape)]

    # -- resident tensors

    @property
    def resident_nbytes(self) -> int:
        """Bytes the resident tensors take in RAM, from the manifest (nothing is read)."""
        total = 0
        for kind, shape in self._resident.values():
            parts = [(np.dtype(np.float32), shape)] if kind == ARRAY else [(dt, s) for _, dt, s in quant.layout(kind, *shape)]
            total += sum(dt.itemsize * int(np.prod(s)) for dt, s in parts)
        return total

    def resident(self) -> dict[str, quant.QTensor | np.ndarray]:
        """Every resident tensor by checkpoint name (read from disk on each call): matrices as QTensors
        (kind f32 for those the layout keeps unquantised), other arrays as ndarrays; all of them views
        of one `Arena` (huge pages: the dense matrices stream through the TLB every token)."""
        parts = {name: self._parts(name, kind, shape) for name, (kind, shape) in self._resident.items()}
        arena = Arena(Arena.size((dtype, pshape) for p in parts.values() for _, dtype, pshape in p))
        out = {}
        for name, (kind, shape) in self._resident.items():
            arrays = [self._where[part].read(part, into=arena.take(dtype, pshape)) for part, dtype, pshape in parts[name]]
            if kind == ARRAY and arrays[0].ndim == 2 and arrays[0].dtype == np.float32:
                out[name] = quant.QTensor("f32", shape[0], shape[1], arrays[0], None)  # a matrix kept f32: C kernels
            elif kind == ARRAY:
                out[name] = arrays[0]
            else:
                out[name] = quant.QTensor(kind, shape[0], shape[1], arrays[0], arrays[1] if len(arrays) > 1 else None,
                                          self.activations)
        return out

    # -- routed experts

    def layer_expert_kind(self, layer: int) -> str:
        """The quantisation of one MoE layer's experts (experts.kind unless the layer overrides it)."""
        return self._extents[layer][0]

    def layer_expert_nbytes(self, layer: int) -> int:
        """The extent size of one MoE layer's experts."""
        return self._extents[layer][2]

    @property
    def experts_nbytes(self) -> int:
        """The extents of every routed expert of every MoE layer, summed."""
        return sum(self.n_experts * self.layer_expert_nbytes(layer) for layer in self.moe_layers)

    def expert_location(self, layer: int, expert: int) -> tuple[str, int, int]:
        """(file path, byte offset, byte count) of one expert's extent: in the layer's file, or in the
        stripe directory's file of that layer if the expert was moved there (the same offset)."""
        if layer not in self._layers or not 0 <= expert < self.n_experts:
            raise ValueError(f"no expert {expert} in layer {layer} (MoE layers {self.moe_layers}, "
                             f"{self.n_experts} experts)")
        nbytes = self._extents[layer][2]
        path = self.stripe.path(layer) if self.stripe is not None and self.stripe.holds(layer, expert) \
            else self._paths[layer]
        return path, expert * nbytes, nbytes

    def expert_file(self, layer: int) -> str:
        """The path of the layer's own expert file in the model directory (where the manifest puts
        it; a striped container's moved experts are holes there)."""
        return self._paths[layer]

    def expert_extents(self, layer: int, expert: int) -> list[tuple[str, int, int]]:
        """[(file path, byte offset, byte count)]: a container holds each expert in one extent."""
        return [self.expert_location(layer, expert)]

    def crc_hole(self, layer: int) -> tuple[int, int]:
        """(offset, length) of the bytes an extent's crc32 leaves out: the trailer's own crc field."""
        return self.layer_expert_nbytes(layer) - TRAILER.size, 4

    def parse_expert(self, buf, layer: int | None = None) -> tuple[quant.QTensor, quant.QTensor, quant.QTensor]:
        """(gate, up, down) viewing one extent held in `buf` (of `layer`, or of a layer stored at
        experts.kind); its checksum is verified first."""
        return self._parse(buf, layer)[2]

    def _parse(self, buf, layer: int | None = None):
        mv = memoryview(buf)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        kind, offsets, n = self._extents[layer] if layer in self._extents else (
            self.expert_kind, self._offsets, self.expert_nbytes)
        if mv.nbytes < n:
            raise ColibriError(f"{self.path}: expert buffer of {mv.nbytes} bytes is shorter than an extent ({n})")
        mv = mv[:n]
        crc, magic, layer, expert = TRAILER.unpack_from(mv, n - TRAILER.size)
        if magic != TRAILER_MAGIC or extent_crc(mv) != crc:
            where = (f"{self.expert_location(layer, expert)[0]} layer {layer} expert {expert}"
                     if layer in self._layers and expert < self.n_experts and magic == TRAILER_MAGIC
                     else f"{self.path} (an extent with an unreadable trailer)")
            raise ColibriError(f"corrupt expert data in {where}: checksum mismatch; "
                               f"run `colibri doctor --deep` and reconvert the model")
        shapes = [_proj_shape(p, self.hidden, self.intermediate) for p in PROJS]
        tensors = tuple(quant.from_buffer(kind, r, c, mv, off, self.activations)[0]
                        for (r, c), off in zip(shapes, offsets))
        return layer, expert, tensors

    def read_expert(self, layer: int, expert: int) -> tuple[quant.QTensor, quant.QTensor, quant.QTensor]:
        """(gate, up, down) of one expert: one pread of its extent, then `parse_expert`."""
        path, offset, nbytes = self.expert_location(layer, expert)
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = self._fds[path] = os.open(path, os.O_RDONLY)
                    except OSError as e:
                        raise ColibriError(f"cannot open expert file {path}: {e.strerror}") from None
        buf = os.pread(fd, nbytes, offset)
        if len(buf) != nbytes:
            raise ColibriError(f"expert file {path} is truncated (layer {layer} expert {expert}); reconvert the model")
        return self.expert_views(buf, layer, expert)

    def expert_views(self, buf, layer: int, expert: int, crc: int | None = None):
        """(gate, up, down) QTensor views of the extent of (`layer`, `expert`) held in `buf`, after
        checking it: its crc32 (`crc`, computed by the caller's I/O thread, else here) must equal
        both the trailer's and the manifest's, and the trailer must name this (layer, expert)."""
        kind, offsets, n = self._extents[layer]
        mv = memoryview(buf)
        mv = (mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B"))[:n]
        path = self.expert_location(layer, expert)[0]
        stored, magic, got_layer, got_expert = TRAILER.unpack_from(mv, n - TRAILER.size)
        if crc is None:
            crc = extent_crc(mv)
        whole = magic == TRAILER_MAGIC and crc == stored  # the extent agrees with its own trailer …
        if whole and (got_layer, got_expert) != (layer, expert):  # … but is another expert's
            raise ColibriError(f"expert file {path} holds layer {got_layer} expert {got_expert} where "
                               f"layer {layer} expert {expert} belongs; reconvert the model")
        if not whole or crc != self._layers[layer]["extent_crc32"][expert]:
            raise ColibriError(f"corrupt expert data in {path} layer {layer} expert {expert}: checksum "
                               f"mismatch; run `colibri doctor --model {self.path} --deep` and reconvert the model")
        shapes = [_proj_shape(p, self.hidden, self.intermediate) for p in PROJS]
        return tuple(quant.from_buffer(kind, rows, cols, mv, off, self.activations)[0]
                     for (rows, cols), off in zip(shapes, offsets))

    def close(self) -> None:
        """Close the expert files `read_expert` opened (it reopens them if called again) and let go
        of the model (`in_use`)."""
        fds = getattr(self, "_fds", {})
        while fds:
            os.close(fds.popitem()[1])
        fd, self._in_use = getattr(self, "_in_use", None), None
        if fd is not None:
            os.close(fd)

    def exclusive(self, doing: str) -> None:
        """Hold the model alone while `doing` (what for, said in the error) changes its files in
        place: ColibriError if another open `Container` holds it (another process's engine, or
        another one in this process)."""
        if self._in_use is not None:
            _lock(self._in_use, self.path, doing)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    # -- verification

    def verify(self, deep: bool = False) -> list[str]:
        """Problems found (empty: the container is whole). `deep` re-hashes every expert extent, each
        read from the file that holds it (`expert_location`)."""
        problems = self._cheap_problems()
        if not deep:
            return problems
        for layer in self.moe_layers:
            path = self.path / self._layers[layer]["path"]
            if not path.is_file() or path.stat().st_size != self._layers[layer]["size"]:
                continue  # reported above
            found, crc = self.extent_problems(layer, range(self.n_experts))
            problems += found
            if crc != self._layers[layer]["crc32"]:
                problems.append(f"{path} fails its whole-file checksum (corrupt)")
        return problems

    def extent_fault(self, layer: int, expert: int, buf) -> str | None:
        """What is wrong with `buf` as the extent of (`layer`, `expert`), checked against the manifest
        and its trailer: None, or the fault in words."""
        got = extent_crc(buf)
        if got != self._layers[layer]["extent_crc32"][expert]:
            return "fails its checksum (corrupt)"
        if TRAILER.unpack_from(buf, len(buf) - TRAILER.size) != (got, TRAILER_MAGIC, layer, expert):
            return "has a bad extent trailer"
        return None

    def extent_problems(self, layer: int, experts) -> tuple[list[str], int]:
        """(what is wrong with the extents of `experts` of `layer`, each read from the file that holds
        it and checked against the manifest and its trailer; the crc32 of them all, in order: of the
        whole file when `experts` are all of the layer's)."""
        problems, crc, files = [], 0, {}
        try:
            for e in experts:
                path, offset, nbytes = self.expert_location(layer, e)
                if path not in files:
                    files[path] = open(path, "rb")
                files[path].seek(offset)
                buf = files[path].read(nbytes)
                crc = crc32(buf, crc)
                fault = self.extent_fault(layer, e, buf)
                if fault is not None:
                    problems.append(f"{path}: layer {layer} expert {e} {fault}")
        finally:
            for f in files.values():
                f.close()
        return problems, crc

    def __repr__(self) -> str:
        return f"Container({str(self.path)!r}, architecture={self.architecture!r}, quant={self.quant!r})"
