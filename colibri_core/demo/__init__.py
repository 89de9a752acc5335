"""The bundled demo model: `colibri-demo-kjv/`, a converted OLMoE-architecture model trained on the
King James Bible by tools/train_demo.py (`colibri-demo-kjv.training.json` says how). It ships inside
the `colibri` wheel as package data and is the default model when no --model is given.

Found through importlib.resources, so it is the same lookup from a source checkout, an editable
install or an installed wheel. Treat it as read-only: it may sit in a system-wide site-packages.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

__all__ = ["NAME", "demo_model", "is_demo", "demo_state_dir"]

NAME = "colibri-demo-kjv"


def demo_model() -> Path:
    """The demo model's directory (it holds `colibri.yaml` unless the installation lost it)."""
    where = resources.files(__name__) / NAME
    # Installed as files (wheel, editable or checkout), the resource is a real directory; colibri
    # reads experts with pread, so an installation inside a zip archive would have none.
    return where if isinstance(where, Path) else Path(str(where))


def is_demo(path: str | os.PathLike) -> bool:
    """Whether `path` is the bundled demo's directory: package data, so nothing is written beside it."""
    try:
        return Path(path).resolve() == demo_model().resolve()
    except OSError:
        return False


def demo_state_dir() -> Path:
    """Where what colibri writes beside a model goes for the demo (saved chat sessions):
    $XDG_STATE_HOME/colibri/colibri-demo-kjv, by default under ~/.local/state."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "colibri" / NAME
