"""A Hugging Face or official checkpoint directory run as it is, without conversion.

`NativeCheckpoint` offers what the engine and the expert store use of a `Container`, read in place
from the checkpoint's safetensors shards, named through the plugin's layout (its resident names and
their aliases, its expert name patterns and their `ExpertNames.other_names`):

- resident tensors: float32 / bfloat16 / float16 widened to float32; float8 e4m3 with a UE8M0 scale
  per 128 × 128 block (``NAME.scale``, F8_E8M0: DeepSeek V4) kept as an `fp8` QTensor the kernels
  compute on; float8 with float32 block scales (``NAME_scale_inv``: DeepSeek V3, GLM) dequantised;
  integer tensors (a hash table) as float32;
- routed experts: per expert, gate / up / down with their scales, as an `fp4` QTensor (packed E2M1
  in I8 with a UE8M0 scale per 32 columns: DeepSeek V4's experts; or MXFP4 as Kimi K3 stores it,
  ``NAME.weight_packed`` U8 + ``NAME.weight_scale`` U8, the same bytes), `fp8`, or float32; or fused
  MXFP4 as GPT-OSS's release stores its experts: per layer ``FUSED_blocks`` (E, R, C/32, 16) U8 +
  ``FUSED_scales`` (E, R, C/32) U8 for the layout's fused gate_up and down names, rows the output units
  (gate and up rows alternating where the layout says ``gate_up_interleaved``: they are parted into
  two matrices as the expert is read, its bytes unchanged). Each expert is read as the fewest
  extents that cover its tensors: one read where they are contiguous in one shard (the official
  layout), sorted reads where they are not (tensors split across shards).

Nothing is verified by checksum (a checkpoint carries none): headers, shapes and dtypes are checked
when the directory is opened, and every file's size against its header. The fingerprint sessions
and the routing history are bound to hashes config.json, every shard's header and size, and
samples of its bytes. `colibri convert` turns the directory into a checksummed container.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from .. import quant
from ..arena import Arena
from ..errors import ColibriError
from ..fsio import CONFIG_BYTES, read_bounded, read_json
from ..layout import PROJS, ContainerLayout
from .reader import SafetensorsFile
from .writer import Checkpoint

__all__ = ["NativeCheckpoint", "is_checkpoint"]

E8M0_SCALE = ".scale"  # DeepSeek V4: NAME.weight (F8_E4M3 or packed fp4 in I8) + NAME.scale (F8_E8M0)
PACKED = ".weight_packed"  # Kimi K3: NAME.weight_packed (E2M1 pairs in U8) + NAME.weight_scale (UE8M0 in U8)
BLOCKS, SCALES = "_blocks", "_scales"  # GPT-OSS: fused FUSED_blocks (E, R, C/32, 16) U8 + FUSED_scales (E, R, C/32) U8
MERGE_GAP = 1 << 16  # tensors of one expert this close in one shard are read in one extent
SAMPLE = 1 << 16  # bytes of each shard hashed into the fingerprint, at its start, middle and end


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A directory with config.json and safetensors shards (and no colibri manifest)."""
    p = Path(path)
    return (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file())


def _scale_name(name: str) -> str:
    if name.endswith(PACKED):  # Kimi K3's MXFP4: NAME.weight_packed (U8) + NAME.weight_scale (U8)
        return name.removesuffix(PACKED) + ".weight_scale"
    return name.removesuffix(".weight") + E8M0_SCALE


class NativeCheckpoint:
    """A checkpoint directory served in place (see the module docstring)."""

    quant = "native"
    direct_ok = False  # extents at any byte offset: read through the page cache, never O_DIRECT

    def __init__(self, model_dir: str | os.PathLike, layout: ContainerLayout, architecture: str,
                 activations: str = "f32"):
        self.path = Path(model_dir)
        self.activations = activations  # the arithmetic of the fp4 experts' products (QTensor.act)
        self.architecture = architecture
        self.layout = layout
        ckpt = Checkpoint(self.path)
        self._ckpt = ckpt
        self.config = read_json(self.path / "config.json", "restore it from the model's original files")
        for st in ckpt.files.values():
            end = max((off + n for _, _, off, n in st.tensors.values()), default=st.data_start)
            if st.path.stat().st_size < end:
                raise ColibriError(f"checkpoint shard {st.path} is truncated ({st.path.stat().st_size} bytes, its "
                                   f"header needs {end}); download it again")
        used: set[str] = set()
        self._resident = {}  # name -> (source name, first row, end row)
        for name in layout.resident:
            src = next(((s, a, b) for s, a, b in layout.sources(name) if s in ckpt.where), None)
            if src is None:
                raise ColibriError(f"{self.path}: the checkpoint lacks tensor {name} (nor any alias of it)")
            self._resident[name] = src
            used.add(src[0])
        self.moe_layers = tuple(layout.moe_layers)
        self.n_experts, self.hidden, self.intermediate = layout.n_experts, layout.hidden, layout.intermediate
        self._experts = {}  # (layer, expert) -> ([(path, offset, nbytes)], [(proj, kind, [(extent, rel, nbytes) data, scales])])
        for layer in self.moe_layers:
            for e in range(self.n_experts):
                self._experts[layer, e] = self._locate_expert(layer, e, used)
        for name in used.copy():
            for scale in (_scale_name(name), name + Checkpoint.FP8_SCALE_SUFFIX):
                if scale in ckpt.where:
                    used.add(scale)
        left = [n for n in sorted(ckpt.where) if n not in used and not layout.ignored(n)
                and not layout.ignored(n.removesuffix(E8M0_SCALE) + ".weight")]
        if left:
            raise ColibriError(f"{self.path}: the checkpoint holds tensor {left[0]} ({len(left)} unknown), which "
                               f"the {architecture} layout does not use")
        nbytes = {layer: max(sum(n for _, _, n in self._experts[layer, e][0]) for e in range(self.n_experts))
                  for layer in self.moe_layers}
        self._nbytes = nbytes
        self.expert_nbytes = max(nbytes.values(), default=0)
        self.manifest = {"source": {"fingerprint": self._fingerprint()}}
        self._fds: dict[str, int] = {}

    # -- experts

    def _expert_sources(self, layer: int, e: int) -> dict[str, str] | None:
        names = self.layout.experts
        for pattern in (p for p in (names.per_expert, *names.other_names) if p):  # {}: fused only
            found = {p: pattern[p].format(layer=layer, expert=e) for p in PROJS}
            if all(n in self._ckpt.where for n in found.values()):
                return found
        return None

    def _locate_expert(self, layer: int, e: int, used: set[str]):
        found = self._expert_sources(layer, e)
        if found is None and self._fused_mxfp4(layer):
            return self._locate_fused(layer, e, used)
        if found is None:
            want = self.layout.experts.per_expert["gate"].format(layer=layer, expert=e)
            raise ColibriError(f"{self.path}: the checkpoint lacks expert {e} of layer {layer} ({want} or another "
                               "name the layout knows); a fused-expert checkpoint must be converted first")
        parts = []  # (proj, kind, data name, scale name or None)
        for proj, name in found.items():
            st = self._ckpt.where[name]
            rows, cols = (self.hidden, self.intermediate) if proj == "down" else (self.intermediate, self.hidden)
            dtype, scale = st.dtype(name), _scale_name(name)
            if (dtype == "I8" or (dtype == "U8" and name.endswith(PACKED))) and scale in self._ckpt.where:
                kind = "fp4"
            elif dtype == "F8_E4M3" and scale in self._ckpt.where:
                kind = "fp8"
            elif dtype in ("F32", "BF16", "F16"):
                kind, scale = "f32", None
            else:
                raise ColibriError(f"{self.path}: expert tensor {name} has dtype {dtype} without a UE8M0 scale "
                                   f"({scale}); colibri runs fp4, fp8 and float experts as they are")
            itemsize = {"BF16": 2, "F16": 2}.get(dtype)
            for part, dt, shape in quant.layout(kind, rows, cols)[: 2 if scale else 1]:
                src = name if part == "data" else scale
                got = self._ckpt.where[src].tensors[src][3]
                expect = int(np.prod(shape)) * (itemsize if part == "data" and itemsize else dt.itemsize)
                if got != expect:
                    raise ColibriError(f"{self.path}: expert tensor {src} holds {got} bytes, expected {expect} for "
                                       f"a {kind} [{rows}, {cols}] expert matrix")
            parts.append((proj, kind, name, scale))
            used.update({name} | ({scale} if scale else set()))
        return self._extents([(proj, kind, self._piece(data), self._piece(scale) if scale else None,
                               self._ckpt.where[data].dtype(data)) for proj, kind, data, scale in parts])

    def _piece(self, name: str, first: int = 0, count: int | None = None) -> tuple[str, int, int]:
        """(file, byte offset, byte count) of tensor `name`, or of `count` of its first-axis rows from `first`."""
        st = self._ckpt.where[name]
        _, shape, off, nb = st.tensors[name]
        if count is None:
            return str(st.path), off, nb
        row = nb // shape[0]
        return str(st.path), off + first * row, count * row

    def _fused_mxfp4(self, layer: int) -> bool:
        """Whether `layer`'s experts are fused MXFP4 (`BLOCKS` / `SCALES`, module docstring)."""
        names = self.layout.experts
        return bool(names.fused_gate_up and names.fused_down) and all(
            n.format(layer=layer) + part in self._ckpt.where for n in (names.fused_gate_up, names.fused_down)
            for part in (BLOCKS, SCALES))

    def _locate_fused(self, layer: int, e: int, used: set[str]):
        """Expert e's rows of a layer's fused MXFP4 tensors: gate_up [2I, H] and down [H, I] in fp4."""
        names, E, H, I = self.layout.experts, self.n_experts, self.hidden, self.intermediate
        if H % quant.FP4_GROUP or I % quant.FP4_GROUP:
            raise ColibriError(f"{self.path}: MXFP4 experts need hidden ({H}) and intermediate ({I}) sizes that are "
                               f"multiples of {quant.FP4_GROUP}")
        parts = []
        for proj, pattern, rows, cols in (("gate_up", names.fused_gate_up, 2 * I, H), ("down", names.fused_down, H, I)):
            data, scale = (pattern.format(layer=layer) + part for part in (BLOCKS, SCALES))
            want = {data: (E, rows, -(-cols // quant.FP4_GROUP), quant.FP4_GROUP // 2),
                    scale: (E, rows, -(-cols // quant.FP4_GROUP))}
            for n, shape in want.items():
                st = self._ckpt.where[n]
                if st.dtype(n) != "U8" or st.shape(n) != shape:
                    raise ColibriError(f"{self.path}: expert tensor {n} is {st.dtype(n)} {list(st.shape(n))}, expected U8 "
                                       f"{list(shape)} (MXFP4 experts {E}, hidden {H}, intermediate {I})")
            used.update(want)
            parts.append((proj, "fp4", self._piece(data, e, 1), self._piece(scale, e, 1), "U8"))
        return self._extents(parts)

    def _extents(self, parts: list) -> tuple[list, list]:
        """The extents covering `parts` [(proj, kind, data piece, scale piece or None, dtype)] and each
        part's (extent, offset in it, byte count) of data and scales."""
        # the byte ranges to read, by shard, sorted; neighbours closer than MERGE_GAP merged
        pieces = sorted((*piece, i) for i, (_, _, data, scale, _) in enumerate(parts)
                        for piece in (data, scale) if piece)
        extents, where = [], {}
        for path, off, nb, _ in pieces:
            if extents and extents[-1][0] == path and off <= extents[-1][1] + extents[-1][2] + MERGE_GAP:
                p, start, length = extents[-1]
                extents[-1] = (p, start, max(length, off + nb - start))
            else:
                extents.append((path, off, nb))
            where[path, off, nb] = (len(extents) - 1, off - extents[-1][1], nb)
        return extents, [(proj, kind, where[data], where[scale] if scale else None, dtype)
                         for proj, kind, data, scale, dtype in parts]

    def expert_extents(self, layer: int, expert: int) -> list[tuple[str, int, int]]:
        """(file, byte offset, byte count) of each extent holding one expert's tensors."""
        return list(self._experts[layer, expert][0])

    def expert_location(self, layer: int, expert: int) -> tuple[str, int, int]:
        """The first extent of one expert (where its file is, for opening and disk measurements)."""
        return self._experts[layer, expert][0][0]

    def crc_hole(self, layer: int) -> None:
        """No checksums to verify in a checkpoint (a container's extents carry theirs)."""
        return None

    def layer_expert_nbytes(self, layer: int) -> int:
        return self._nbytes[layer]

    def expert_views(self, bufs, layer: int, expert: int, crc: int | None = None):
        """(gate, up, down) QTensors over the extents' bytes `bufs` (one buffer per extent, in order):
        fp4 / fp8 in place, float32 in place, bfloat16 / float16 widened."""
        if not isinstance(bufs, (list, tuple)):
            bufs = [bufs]
        views = [np.frombuffer(b, np.uint8) for b in bufs]
        out = {}
        for proj, kind, (ei, off, nb), scale, dtype in self._experts[layer, expert][1]:
            rows, cols = (self.hidden, self.intermediate) if proj == "down" else (self.intermediate, self.hidden)
            rows *= 2 if proj == "gate_up" else 1
            raw = views[ei][off:off + nb]
            if kind == "f32":
                if dtype == "F32":
                    data = raw.view(np.float32).reshape(rows, cols)
                elif dtype == "BF16":
                    data = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
                else:
                    data = raw.view(np.float16).astype(np.float32).reshape(rows, cols)
                out[proj] = quant.QTensor("f32", rows, cols, data)
                continue
            (_, ddt, dshape), (_, sdt, sshape) = quant.layout(kind, rows, cols)
            si, soff, snb = scale
            out[proj] = quant.QTensor(kind, rows, cols, raw.view(ddt).reshape(dshape),
                                      views[si][soff:soff + snb].view(sdt).reshape(sshape), self.activations)
        if "gate_up" in out:  # fused: its rows parted into gate and up (copies of their bytes)
            gate_up, inter = out.pop("gate_up"), self.intermediate
            rows = ((slice(0, None, 2), slice(1, None, 2)) if self.layout.experts.gate_up_interleaved
                    else (slice(0, inter), slice(inter, None)))
            out["gate"], out["up"] = (quant.QTensor(gate_up.kind, inter, gate_up.cols, np.ascontiguousarray(gate_up.data[r]),
                                                    np.ascontiguousarray(gate_up.scales[r]), gate_up.act) for r in rows)
        return out["gate"], out["up"], out["down"]

    def read_expert(self, layer: int, expert: int):
        """(gate, up, down) of one expert, read with plain preads (tests, `doctor`)."""
        bufs = []
        for path, offset, nbytes in self.expert_extents(layer, expert):
            with open(path, "rb") as f:
                bufs.append(os.pread(f.fileno(), nbytes, offset))
        return self.expert_views(bufs, layer, expert)

    # -- resident tensors

    def resident(self) -> dict[str, quant.QTensor | np.ndarray]:
        """Every resident tensor by its layout name: matrices as QTensors (fp8 kept, the rest float32),
        other arrays as float32 ndarrays; all of them copied, one at a time, into one `Arena` (huge pages)."""
        kept = {name: self._kept(name) for name in self._resident}  # name -> fp8 (rows, cols), or None
        parts = []
        for name, (src, first, end) in self._resident.items():
            if kept[name] is not None and not self.layout.stays_f32(name, 2):
                parts += [(dt, shape) for _, dt, shape in quant.layout("fp8", *kept[name])]
            else:
                shape = self._ckpt.where[src].shape(src)
                parts.append((np.float32, (((end or shape[0]) - (first or 0)), *shape[1:])))
        arena = Arena(Arena.size(parts))
        out = {}
        for name, (src, first, end) in self._resident.items():
            st: SafetensorsFile = self._ckpt.where[src]
            count = None if end is None else end - (first or 0)
            if kept[name] is not None:
                rows, cols = kept[name]
                scale = _scale_name(src)
                data = st.read(src).reshape(rows, cols)
                scales = self._ckpt.where[scale].read(scale).view(np.uint8).reshape(-(-rows // quant.FP8_BLOCK), -1)
                t = quant.QTensor("fp8", rows, cols, data, scales)
                out[name] = (quant.QTensor("f32", rows, cols, arena.copy(quant.dequantize(t))) if self.layout.stays_f32(name, 2)
                             else quant.QTensor("fp8", rows, cols, arena.copy(data), arena.copy(scales)))
                continue
            w = self._ckpt.read_f32(src, first or 0, count) if st.dtype(src) in ("F32", "BF16", "F16", "F8_E4M3") \
                else st.read(src, first or 0, count).astype(np.float32)
            w = arena.copy(np.asarray(w, np.float32))
            out[name] = quant.QTensor("f32", w.shape[0], w.shape[1], w) if w.ndim == 2 else w
        return out

    def _kept(self, name: str) -> tuple[int, int] | None:
        """(rows, cols) of resident tensor `name` if it is a whole fp8 matrix with its block scales
        (kept fp8, or dequantised when the layout keeps it f32), else None."""
        src, first, end = self._resident[name]
        st = self._ckpt.where[src]
        if st.dtype(src) == "F8_E4M3" and _scale_name(src) in self._ckpt.where and first is None and end is None:
            return st.shape(src)
        return None

    # -- identity, files

    def _fingerprint(self) -> str:
        h = hashlib.sha256(read_bounded(self.path / "config.json", CONFIG_BYTES))
        for name, st in sorted(self._ckpt.files.items()):
            size = st.path.stat().st_size
            h.update(f"{name}:{size}:".encode())
            with open(st.path, "rb") as f:
                h.update(f.read(st.data_start))  # the header
                for at in (st.data_start, (st.data_start + size) // 2, size - SAMPLE):
                    f.seek(max(at, 0))
                    h.update(f.read(SAMPLE))
        return "native-" + h.hexdigest()[:32]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"NativeCheckpoint({str(self.path)!r}, architecture={self.architecture!r})"
