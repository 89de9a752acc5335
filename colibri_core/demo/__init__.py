"""The bundled demo model: `colibri-demo-kjv/`, a converted OLMoE-architecture model trained on the
King James Bible by tools/train_demo.py (`colibri-demo-kjv.training.json` says how). It ships inside
the `colibri` wheel as package data and is the default model when no --model is given.

Found through importlib.resources, so it is the same lookup from a source checkout, an editable
install or an installed wheel. Treat it as read-only: it may sit in a system-wide site-packages.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["NAME", "demo_model"]

NAME = "colibri-demo-kjv"


def demo_model() -> Path:
    """The demo model's directory (it holds `colibri.yaml` unless the installation lost it)."""
    where = resources.files(__name__) / NAME
    # Installed as files (wheel, editable or checkout), the resource is a real directory; colibri
    # reads experts with pread, so an installation inside a zip archive would have none.
    return where if isinstance(where, Path) else Path(str(where))
