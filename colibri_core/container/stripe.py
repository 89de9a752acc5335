"""The stripe record of a container whose experts are striped across two directories (`colibri
stripe`, colibri_core/store/stripe.py moves them): `.coli_stripe` in the model directory (JSON, then
a crc32 line of the lines above) names the stripe directory, the share, the bandwidths it was chosen
from and each layer's moved experts. It is the one record of where an expert is: `Container` loads
it when it opens the model (`load`) and answers each expert's file from it (`expert_location`), so
every reader follows it; `colibri list` and `rm` read it without opening the container (`recorded`).
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import ColibriError
from ..fsio import read_text, write_atomic

STRIPE_FILE = ".coli_stripe"
FORMAT = "colibri-stripe"
VERSION = 1
STRIPE_BYTES = 16 << 20  # .coli_stripe: a list of expert ids per layer, a few hundred KB at most


@dataclass(frozen=True)
class Stripe:
    """Where a striped container's moved extents are: `directory` (DIR2/colibri-stripe-ID), the
    share of each layer's experts moved there, the bandwidths (bytes/s) it was chosen from, and
    layer -> the experts moved (a layer not moved yet is absent)."""

    directory: Path
    share: float
    bandwidth: dict  # {"model": bytes/s, "stripe": bytes/s}, as measured when the share was chosen
    moved: dict  # layer -> frozenset of experts held in `directory`

    def holds(self, layer: int, expert: int) -> bool:
        return expert in self.moved.get(layer, ())

    def path(self, layer: int) -> str:
        return str(self.directory / f"layer-{layer:03d}.bin")

    def moved_bytes(self, c) -> int:
        return sum(len(experts) * c.layer_expert_nbytes(layer) for layer, experts in self.moved.items())


def binding(c) -> str:
    """An id of the container's expert section (every extent's crc32): a stripe belongs to one."""
    files = [(f["layer"], f["size"], f["crc32"], list(f["extent_crc32"])) for f in c.manifest["experts"]["files"]]
    table = json.dumps([files, c.expert_nbytes, c.n_experts]).encode()
    return f"{zlib.crc32(table):08x}"


def load(c) -> Stripe | None:
    """The stripe of the container `c` being opened (None if it is not striped; `Container.stripe`),
    checked: its record whole and of this container, its directory and every file there present
    with the right size."""
    path = Path(c.path) / STRIPE_FILE
    if not path.exists():
        return None
    try:
        d = read_record(path, "reconvert the model")
        if d["format"] != FORMAT or d["version"] != VERSION or d["container"] != binding(c):
            raise ColibriError(f"{path} is a stripe record of another container or colibri (the model was "
                               f"reconverted?): move its files back by hand or reconvert the model")
        stripe = Stripe(Path(d["directory"]), float(d["share"]), dict(d["bandwidth"]),
                        {int(layer): frozenset(int(e) for e in experts) for layer, experts in d["moved"].items()})
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ColibriError(f"{path} fails its checksum or is not a stripe record (damaged or edited): the "
                           f"placement of the model's experts is unknown; reconvert the model") from None
    if not stripe.directory.is_dir():
        raise ColibriError(f"{c.path}: its experts are striped into {stripe.directory}, which is missing "
                           f"(a disk not mounted?): mount it, or reconvert the model")
    for layer, experts in stripe.moved.items():
        if layer not in c.moe_layers or not all(0 <= e < c.n_experts for e in experts):
            raise ColibriError(f"{path} names layer {layer} experts that the container lacks: reconvert the model")
        size = c.n_experts * c.layer_expert_nbytes(layer)
        try:
            got = os.stat(stripe.path(layer)).st_size
        except OSError:
            raise ColibriError(f"{stripe.path(layer)} (striped experts of {c.path}) is missing: restore it, "
                               f"or reconvert the model") from None
        if got != size:
            raise ColibriError(f"{stripe.path(layer)} is {got} bytes, expected {size}: restore it, or reconvert "
                               f"the model")
    return stripe


def read_record(path: Path, fix: str):
    """The JSON body of the stripe record `path`; ValueError if it fails its checksum line."""
    lines = read_text(path, STRIPE_BYTES, "stripe record", fix).splitlines(keepends=True)
    body = "".join(lines[:-1])
    if not lines or lines[-1] != _checksum_line(body):
        raise ValueError
    return json.loads(body)


def _checksum_line(text: str) -> str:
    """The record's last line: the crc32 of every byte before it (as a manifest's)."""
    return f"# crc32 {zlib.crc32(text.encode('utf-8')):08x} of the lines above\n"


def save(c, stripe: Stripe) -> None:
    """Write `stripe` as the container `c`'s record (atomically)."""
    body = json.dumps({"format": FORMAT, "version": VERSION, "container": binding(c),
                       "directory": str(stripe.directory), "share": stripe.share, "bandwidth": stripe.bandwidth,
                       "moved": {str(layer): sorted(experts) for layer, experts in sorted(stripe.moved.items())}},
                      indent=1) + "\n"
    write_atomic(Path(c.path) / STRIPE_FILE, (body + _checksum_line(body)).encode())


def recorded(model_dir: str | os.PathLike) -> tuple[Path, float] | None:
    """(the stripe directory DIR2/colibri-stripe-ID, the share) `.coli_stripe` in `model_dir` names,
    or None if the model is not striped; read without opening the container (`colibri list` and
    `rm`: a model whose container or second disk is damaged or missing is removed all the same)."""
    path = Path(model_dir) / STRIPE_FILE
    if not path.exists():
        return None
    try:
        d = read_record(path, "remove the stripe directory by hand")
        directory, share = Path(d["directory"]), float(d["share"])
    except (ValueError, KeyError, TypeError):
        directory = None
    if directory is None or not directory.name.startswith("colibri-stripe-"):
        raise ColibriError(f"{path} fails its checksum or is not a stripe record: which directory holds the "
                           f"model's striped experts is unknown; remove {path} and that directory by hand")
    return directory, share
