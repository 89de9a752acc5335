"""`colibri convert`: a Hugging Face checkpoint → a container, laid out by its architecture's plugin."""
from __future__ import annotations

import json
from pathlib import Path

from . import plugins
from .container import convert
from .errors import ColibriError
from .hookspecs import Architecture

__all__ = ["convert_checkpoint"]


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ColibriError(f"{model_dir}: not a model directory (no config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ColibriError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e


def convert_checkpoint(src: str | Path, dst: str | Path, quant: str, progress: bool = True) -> Architecture:
    """Convert `src` into the container `dst` at `quant`; returns the architecture that served it."""
    registry = plugins.registry()
    config = read_config(src)
    arch = registry.resolve(config, where=str(src))
    model_cls = registry.model_class(arch)
    layout = model_cls.layout(model_cls.parse_config(config))
    convert(src, dst, quant=quant, layout=layout, architecture=arch.name, plugin=arch.plugin,
            plugin_version=arch.version, progress=progress)
    return arch
