"""Where colibri writes what it keeps of a model: saved sessions (`.sessions/`), the prefix cache's
spill (`.prefix_cache/`) and the routing history (`.coli_usage`).

    state_dir(model_dir, given)   # --state-dir DIR, else beside the model, else the user's state dir

Beside a converted container whose directory colibri may write in, as before (the container is
colibri's own output); anywhere else in the user's state directory, so colibri never writes into a
checkpoint it was pointed at (a Hugging Face directory run as it is, often in the hub's shared
cache), nor fails a session's first save on a read-only model directory.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from .demo import demo_state_dir, is_demo

__all__ = ["state_dir", "user_state_dir", "writable"]

log = logging.getLogger("colibri")


def user_state_dir(model_dir: str | os.PathLike) -> Path:
    """$XDG_STATE_HOME/colibri/NAME-HASH (by default under ~/.local/state): NAME the model directory's,
    HASH 8 hex digits of its resolved path (two checkouts named alike keep apart)."""
    path = Path(model_dir).resolve()
    key = hashlib.sha256(os.fsencode(path)).hexdigest()[:8]
    root = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return root / "colibri" / f"{path.name}-{key}"


def writable(directory: Path) -> bool:
    """Whether a file can be made in `directory`: tried with a nameless file (O_TMPFILE where the
    system has it), as permission bits cannot tell (root ignores them; a read-only mount does not
    show in them)."""
    try:
        tempfile.TemporaryFile(dir=directory).close()
    except OSError:
        return False
    return True


def state_dir(model_dir: str | os.PathLike, given: str | os.PathLike | None, checkpoint: bool) -> Path:
    """The directory for the model in `model_dir`: `given` (--state-dir) if any; the bundled demo's
    (`demo_state_dir`); the model directory itself for a converted container (`checkpoint` False)
    colibri can write in; else `user_state_dir`. Nothing is made here: each writer makes its part."""
    if given is not None:
        chosen = Path(given)
    elif is_demo(model_dir):
        chosen = demo_state_dir()
    elif not checkpoint and writable(Path(model_dir)):
        chosen = Path(model_dir)
    else:
        chosen = user_state_dir(model_dir)
    log.info("state directory (sessions, prefix cache, routing history): %s", chosen)
    return chosen
