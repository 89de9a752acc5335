"""`colibri convert`: a Hugging Face checkpoint → a container, laid out by its architecture's plugin."""
from __future__ import annotations

from pathlib import Path

from . import plugins
from .container import convert
from .errors import ColibriError
from .fsio import read_json
from .hookspecs import Architecture

__all__ = ["convert_checkpoint"]


def read_config(model_dir: str | Path, fix: str = "") -> dict:
    """`model_dir`/config.json as a dict; anything else is a one-line error naming the file (`fix`:
    what the user can do, said after it; default: restore the file)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        if model_dir.name.endswith(".partial") and model_dir.is_dir():
            raise ColibriError(f"{model_dir} is an unfinished conversion: rerun `colibri convert` to finish it")
        raise ColibriError(f"{model_dir}: not a model directory (no config.json)")
    fix = fix or ("reconvert the model" if (model_dir / "colibri.yaml").is_file()
                  else "restore it from the model's original files")
    config = read_json(path, fix)
    if not isinstance(config, dict):
        raise ColibriError(f"{path} is not a model configuration (a JSON object): {fix}")
    return config


def parse_config(model_cls, config: dict, where: str | Path):
    """`model_cls.parse_config(config)`, a value of the wrong type or range in it a one-line error."""
    try:
        return model_cls.parse_config(config)
    except ColibriError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        what = f"lacks key {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:200]
        raise ColibriError(f"{Path(where) / 'config.json'}: {model_cls.__name__} cannot read it ({what})") from None


def convert_checkpoint(src: str | Path, dst: str | Path, quant: str, progress: bool = True) -> Architecture:
    """Convert `src` into the container `dst` at `quant`; returns the architecture that served it."""
    registry = plugins.registry()
    config = read_config(src)
    arch = registry.resolve(config, where=str(src))
    model_cls = registry.model_class(arch)
    layout = model_cls.layout(parse_config(model_cls, config, src))
    try:
        convert(src, dst, quant=quant, layout=layout, architecture=arch.name, plugin=arch.plugin,
                plugin_version=arch.version, progress=progress)
    except OSError as e:  # a full disk, a read error, a permission: what is finished is kept
        where = f" ({e.filename})" if e.filename else ""
        raise ColibriError(f"converting {src} into {dst} stopped: {e.strerror or e}{where}; fix that and rerun "
                           "the same command: it resumes from the files already finished") from None
    return arch
