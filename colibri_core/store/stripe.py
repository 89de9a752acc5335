"""Weighted striping: a container's expert extents split between the model directory and a second
directory on another disk, in the share of the two disks' measured bandwidths, so that each expert
is read from the disk that holds it and both disks read at once (colibrì's dual-SSD mode, without
a mirror's doubled space).

A container keeps one file per MoE layer, so the unit moved is an expert's extent: in every layer
the same share of its experts (chosen by `mirror.expert_hash`, so each layer's reads go to both
disks). `DIR2/colibri-stripe-ID/layer-LLL.bin` is as long as the model's own file and holds the
moved extents at their own offsets (a sparse file); in the model's file those extents' blocks are
freed (holes punched: its size, and so the container's manifest, are unchanged). `.coli_stripe`
in the model directory (JSON, then a crc32 line of the lines above) names the directory, the share,
the bandwidths it was chosen from and each layer's moved experts. It is the one record of where an
expert is: `Container` loads it when it opens the model (`load`) and answers each expert's file
from it (`expert_location`), so every reader follows it; `doctor` checks it (`problems`); `colibri
rm` removes the stripe directory with the model (`recorded`).

Moving is crash-safe a layer at a time: the layer's extents are copied to a temporary file in the
stripe directory, fsynced, read back and checked against the manifest's crc32s, renamed into place;
only then is the layer written into `.coli_stripe` (atomically), and only then are its extents'
blocks freed in the model's file. `--undo` runs the same steps backwards (copied back, fsynced and
checked, the record updated, the stripe file removed). A crash at any point leaves the recorded
placement whole (the other copy, if any, is only space not yet freed): rerunning the command
finishes it. Refused while an engine has the model open (`Container.exclusive`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

from ..container import Container
from ..container.stripe import STRIPE_FILE, Stripe, binding, save
from ..errors import ColibriError
from ..fsio import fsync_dir
from .mirror import SAMPLES_PER_FILE, expert_hash

_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (linux/falloc.h)
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def selection(c: Container, share: float) -> dict[int, list[int]]:
    """layer -> the experts to move for `share`: round(share × experts) of each layer, those with the
    lowest `expert_hash` salted "stripe" (a fixed choice, so a rerun picks the same ones, and one
    apart from a mirror's, so that each of the three files is read)."""
    k = round(share * c.n_experts)
    return {layer: sorted(sorted(range(c.n_experts), key=lambda e: expert_hash(layer, e, "stripe"))[:k])
            for layer in c.moe_layers}


def _copy_extents(c: Container, src: str, dst: str, layer: int, experts, create: bool) -> None:
    """Copy the extents of `experts` from file `src` into file `dst` (created as a sparse file as long
    as the layer's, if `create`), fsync it, and read them back: each must match the manifest."""
    nbytes = c.layer_expert_nbytes(layer)
    flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
    s, d = os.open(src, os.O_RDONLY), os.open(dst, flags, 0o644)
    try:
        if create:
            os.ftruncate(d, c.n_experts * nbytes)
        for e in experts:
            if os.pwrite(d, os.pread(s, nbytes, e * nbytes), e * nbytes) != nbytes:
                raise ColibriError(f"writing {dst} stopped short (disk full?)")
        os.fsync(d)
        for e in experts:
            if c.extent_fault(layer, e, os.pread(d, nbytes, e * nbytes)) is not None:
                raise ColibriError(f"layer {layer} expert {e} copied into {dst} does not match the manifest's "
                                   f"checksum (a disk error?): nothing was changed; check the disk and rerun")
    finally:
        os.close(s)
        os.close(d)


def _punch(path: str, c: Container, layer: int, experts) -> None:
    """Free the blocks of `experts`' extents in `path` (its size unchanged)."""
    nbytes = c.layer_expert_nbytes(layer)
    fd = os.open(path, os.O_RDWR)
    try:
        for e in experts:
            if _libc.fallocate(fd, _PUNCH_HOLE, e * nbytes, nbytes) != 0:
                err = ctypes.get_errno()
                why = "the filesystem cannot free part of a file" if err == errno.EOPNOTSUPP else os.strerror(err)
                raise ColibriError(f"cannot free the moved experts' space in {path}: {why}; the stripe is "
                                   f"recorded and reads from both disks, `colibri stripe --undo` takes it back")
        os.fsync(fd)
    finally:
        os.close(fd)


def stripe(model_dir: str | os.PathLike, directory: str | os.PathLike, share: str | float = "auto",
           progress=None, measure=None) -> Stripe:
    """Move `share` of every layer's experts of the container `model_dir` into `directory`
    (DIR2/colibri-stripe-ID), a layer at a time; "auto": the share `measure(model_dir, directory)`
    returns with the bandwidths it measured, (share, {"model", "stripe"} bytes/s) —
    `planning.stripe_share`, handed in by the caller (the store knows no planning). A stripe begun
    before into the same directory is finished with its own share. `progress(layer)` is called
    after each layer (the CLI's progress bar)."""
    with Container(model_dir) as c:
        c.exclusive("striping it")
        target = Path(directory).absolute() / f"colibri-stripe-{binding(c)}"
        if Path(directory).resolve() == Path(c.path).resolve() or target.resolve().is_relative_to(
                Path(c.path).resolve()):
            raise ColibriError(f"stripe directory {directory} is inside the model directory: name one on another disk")
        old = c.stripe
        if old is not None and old.directory != target:
            raise ColibriError(f"{c.path} is striped into {old.directory} already: `colibri stripe {c.path} --undo` "
                               f"first")
        if old is not None:
            if share != "auto" and float(share) != old.share:
                raise ColibriError(f"{c.path} is striped at share {old.share:g} already: `colibri stripe "
                                   f"{c.path} --undo` first to change it")
            current = old
        else:
            if share == "auto":
                Path(directory).mkdir(parents=True, exist_ok=True)
                share, bw = measure(c.path, directory)
            else:
                share, bw = float(share), {}
            if not 0 < share < 1:
                raise ColibriError(f"--share must be between 0 and 1 (the part of the experts moved), got {share:g}")
            if round(share * c.n_experts) == 0:
                raise ColibriError(f"share {share:.3g} moves none of a layer's {c.n_experts} experts: nothing to stripe")
            current = Stripe(target, share, bw, {})
        try:
            target.mkdir(parents=True, exist_ok=True)
            fsync_dir(target.parent)
            save(c, current)
            for layer, experts in selection(c, current.share).items():
                primary = c.expert_file(layer)
                if layer not in current.moved:
                    tmp = current.path(layer) + ".tmp"
                    _copy_extents(c, primary, tmp, layer, experts, create=True)
                    os.replace(tmp, current.path(layer))
                    fsync_dir(target)
                    current = Stripe(target, current.share, current.bandwidth,
                                     {**current.moved, layer: frozenset(experts)})
                    save(c, current)
                _punch(primary, c, layer, experts)  # again after a crash: freeing freed blocks changes nothing
                if progress is not None:
                    progress(layer)
        except OSError as e:  # a full disk, a permission: what is done is recorded
            raise ColibriError(f"striping {c.path} into {target} stopped: {e.strerror or e}"
                               f"{f' ({e.filename})' if e.filename else ''}; fix that and rerun the same command: "
                               f"it goes on from the layers already moved") from None
        return current


def unstripe(model_dir: str | os.PathLike, progress=None) -> None:
    """Bring every striped expert of `model_dir` back into the model's own files and remove the stripe
    (`progress(layer)` after each layer)."""
    with Container(model_dir) as c:
        current = c.stripe
        if current is None:
            raise ColibriError(f"{c.path} is not striped (no {STRIPE_FILE})")
        c.exclusive("bringing its experts back")
        try:
            for layer in sorted(current.moved):
                _copy_extents(c, current.path(layer), c.expert_file(layer), layer,
                              sorted(current.moved[layer]), create=False)
                current = Stripe(current.directory, current.share, current.bandwidth,
                                 {k: v for k, v in current.moved.items() if k != layer})
                save(c, current)
                os.unlink(current.path(layer))
                if progress is not None:
                    progress(layer)
            os.unlink(Path(c.path) / STRIPE_FILE)
            fsync_dir(Path(c.path))
            for leftover in current.directory.glob("layer-*.bin*"):  # a copy a crash left unrecorded
                leftover.unlink()
            current.directory.rmdir()
        except OSError as e:  # a full disk (the holes filled again), a permission: what is done is recorded
            raise ColibriError(f"bringing the experts of {c.path} back from {current.directory} stopped: "
                               f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}; fix that and rerun "
                               f"`colibri stripe {c.path} --undo`") from None


def problems(c: Container, stripe: Stripe, deep: bool) -> list[str]:
    """What is wrong with a striped container's expert files (empty: nothing): a few extents of each
    stripe file (every extent of every file, and each file's whole crc32, if `deep`: `verify`'s
    deep pass) read from the file that holds them and checked against the manifest. (`load`
    checked presence and sizes.)"""
    if deep:
        return c.verify(deep=True)
    found = []
    for layer, moved in sorted(stripe.moved.items()):
        picks = sorted(moved)[:: max(1, len(moved) // SAMPLES_PER_FILE)][:SAMPLES_PER_FILE]
        found += c.extent_problems(layer, picks)[0]
    return found


def summary(c: Container, stripe: Stripe) -> str:
    """One line on where a striped container's experts are (`plan`, `doctor`, `colibri stripe`)."""
    from ..sizes import format_bytes

    moved = stripe.moved_bytes(c)
    bw = stripe.bandwidth
    chosen = (f"share {stripe.share:.2f} from {format_bytes(bw['model'])}/s measured beside the model and "
              f"{format_bytes(bw['stripe'])}/s there" if bw else f"share {stripe.share:.2f} as given")
    unfinished = "" if len(stripe.moved) == len(c.moe_layers) else \
        f"; {len(c.moe_layers) - len(stripe.moved)} layers not moved yet (rerun `colibri stripe` to finish)"
    return f"{format_bytes(moved)} of {format_bytes(c.experts_nbytes)} of experts in {stripe.directory} ({chosen}){unfinished}"
