"""The copies of a container an expert can be read from: the model directory (where its experts
are striped across two disks, the container answers each expert's file: stripe.py) and an optional
mirror (a byte-identical copy on another disk, ``--mirror DIR``).

The mirror is validated when the engine starts: its manifest must describe the same container
(same source fingerprint, expert layout and every file's size and checksums), its files must have
those sizes, and a few extents of every expert file are read and checked against the manifest.
Each expert is then read from one copy chosen by a deterministic hash of (layer, expert), weighted
by the bandwidth measured on each copy at start. Every extent read from either copy is verified
(crc32 trailer); a read error or a corrupt extent on the mirror falls back to the primary with one
warning and the mirror is not used again in this session.
"""
from __future__ import annotations

import time
import zlib
from pathlib import Path

from ..container import Container
from ..container.reader import extent_crc
from ..errors import ColibriError
from . import io

SAMPLES_PER_FILE = 4  # extents of each expert file checked when a mirror is opened


class Source:
    """One copy of the container: its expert files opened (lazily) with or without O_DIRECT, each
    expert read from the file the container names (`expert_extents`: a striped expert's is in the
    stripe directory, `stripe`, which `disk` names for the per-disk counts)."""

    def __init__(self, container: Container, direct: bool, name: str, warn_refused: bool = True):
        self.container = container
        # stripe.Stripe: which experts live in a second directory, or None (a checkpoint run as it is: never)
        self.stripe = container.stripe if isinstance(container, Container) else None
        self.name = name  # "primary" | "mirror"
        self.warn_refused = warn_refused  # O_DIRECT was asked for: its refusal is worth a warning
        self.direct_asked = direct and getattr(container, "direct_ok", True)  # a checkpoint's extents: no O_DIRECT
        self.direct_refused: str | None = None  # why O_DIRECT was refused, once known
        self.fds: dict[str, int] = {}  # path -> fd
        self.bandwidth = 0.0  # bytes/s measured at start (0: not measured)

    @property
    def direct(self) -> bool:
        return self.direct_asked and self.direct_refused is None

    def fd(self, layer: int) -> int:
        """The open expert file of `layer` (of its first expert's first extent)."""
        path, _, nbytes = self.container.expert_location(layer, 0)
        return self.fd_for(path, nbytes)

    def fd_for(self, path: str, nbytes: int = 1 << 20) -> int:
        """The file `path`, opened once (with O_DIRECT if asked and the container's extents allow it)."""
        fd = self.fds.get(path)
        if fd is None:
            fd, refused = io.open_expert_file(path, self.direct, probe_bytes=min(nbytes, 1 << 20))
            if refused and self.direct_refused is None:
                self.direct_refused = refused
                if self.warn_refused:
                    from .usage import warn

                    warn(io.direct_refused_message(path, refused))
            self.fds[path] = fd
        return fd

    def disk(self, layer: int, expert: int) -> str:
        """Where one expert is read from, by role — this copy ("primary", "mirror") or the stripe
        directory ("stripe") — for the store's counts per disk (a role, not a path: the server
        publishes the counts, never a path)."""
        return "stripe" if self.stripe is not None and self.stripe.holds(layer, expert) else self.name

    def measure(self, samples: int = 4) -> float:
        """Bytes/s of reading up to `samples` extents spread over the files (one thread)."""
        c = self.container
        picks = [(c.moe_layers[i * len(c.moe_layers) // samples], (i * 7919) % c.n_experts)
                 for i in range(min(samples, len(c.moe_layers) * c.n_experts))]
        buf, ptr = io.aligned_buffer(c.expert_nbytes)
        t0 = time.perf_counter()
        for layer, expert in picks:
            path, offset, nbytes = self.container.expert_location(layer, expert)
            io.lib.io_pread_all(self.fd_for(path, nbytes), ptr, nbytes, offset)
        dt = max(time.perf_counter() - t0, 1e-6)
        self.bandwidth = len(picks) * c.expert_nbytes / dt
        return self.bandwidth

    def close(self) -> None:
        while self.fds:
            io.close_fd(self.fds.popitem()[1])


def expert_table(c: Container) -> list:
    """Each expert file's (layer, size, crc32, extent crc32s): what a copy of the container must share."""
    return [(f["layer"], f["size"], f["crc32"], list(f["extent_crc32"])) for f in c.manifest["experts"]["files"]]


def open_mirror(primary: Container, mirror_dir: str | Path) -> Container:
    """Open `mirror_dir` and check that it is a byte-identical copy of `primary`; else ColibriError."""
    mirror_dir = Path(mirror_dir)
    if mirror_dir.resolve() == Path(primary.path).resolve():
        raise ColibriError(f"mirror {mirror_dir} is the model directory itself: name a copy on another disk")
    try:
        m = Container(mirror_dir)
    except ColibriError as e:
        raise ColibriError(f"mirror refused: {e}") from None
    pm, mm = primary.manifest, m.manifest
    differs = [key for key in ("architecture", "quant", "source", "files", "resident") if pm.get(key) != mm.get(key)]
    if expert_table(primary) != expert_table(m) or (primary.expert_nbytes, primary.n_experts) != (
            m.expert_nbytes, m.n_experts):
        differs.append("experts")
    if differs:
        raise ColibriError(f"mirror {mirror_dir} is not a copy of {primary.path}: its manifest differs "
                           f"({', '.join(differs)}); copy the model directory byte for byte")
    n = m.n_experts
    picks = sorted({0, n - 1, n // 3, (2 * n) // 3})[:SAMPLES_PER_FILE] if n > SAMPLES_PER_FILE else range(n)
    for layer in m.moe_layers:
        want = dict((f["layer"], f["extent_crc32"]) for f in m.manifest["experts"]["files"])[layer]
        for e in picks:
            path, offset, nbytes = m.expert_location(layer, e)  # a striped mirror's: the file that holds it
            with open(path, "rb") as f:
                f.seek(offset)
                if extent_crc(f.read(nbytes)) != want[e]:
                    raise ColibriError(f"mirror {mirror_dir} differs from {primary.path}: {path} expert {e} "
                                       f"does not match the manifest's checksum; copy the model again")
    return m


def expert_hash(layer: int, expert: int, salt: str = "") -> float:
    """A fixed number in [0, 1) for (layer, expert): experts ranked by it are spread evenly; another
    `salt`, another ranking (the stripe's must not follow the mirror's choice)."""
    return zlib.crc32(f"{salt}{layer}:{expert}".encode()) / 2**32


def choose(layer: int, expert: int, primary_share: float) -> int:
    """0 (primary) or 1 (mirror) for one expert: a fixed hash of (layer, expert) against the share."""
    return 0 if expert_hash(layer, expert) < primary_share else 1
