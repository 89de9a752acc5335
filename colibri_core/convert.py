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


# config.json's counts and widths, by the names HF configs give them: where a config (or its
# text_config) gives one, it must be an integer in this range; the bound on layers keeps a typo from
# building a model of a trillion layers (plugins loop over them before anything is read)
SIZES = {name: (1, 2**31 - 1) for name in (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
    "num_experts_per_token", "n_group", "num_expert_group", "topk_group", "decoder_sparse_step",
    "full_attention_interval")}
SIZES["num_hidden_layers"] = (1, 10_000)
SIZES["num_nextn_predict_layers"] = (0, 10_000)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # routed experts per MoE layer
TOP_KS = ("num_experts_per_tok", "num_experts_per_token")  # experts each token is routed to per MoE layer


def check_sizes(config: dict, path: Path) -> None:
    """A ColibriError naming `path` and the field unless each count or width `config` gives (SIZES)
    is an integer in its range, and its top-k (num_experts_per_tok) at most its routed experts:
    checked before a plugin reads them, so that a 0, a NaN or a typo is one line for every plugin."""
    text = config.get("text_config")
    for prefix, scope in [("", config)] + ([("text_config.", text)] if isinstance(text, dict) else []):
        for name, (low, high) in SIZES.items():
            value = scope.get(name)
            if value is None:  # absent or null: the plugin's default, or its own error
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                least = "a positive integer" if low == 1 else f"an integer of at least {low}"
                raise ColibriError(f"{path}: {prefix}{name} must be {least}, got {repr(value)[:40]}")
            if value > high:
                raise ColibriError(f"{path}: {prefix}{name} {value} is more than colibri supports (at most {high:,})")
        experts = max(((scope[n], n) for n in EXPERT_COUNTS if scope.get(n) is not None), default=None)
        for name in TOP_KS:
            if experts and scope.get(name) is not None and scope[name] > experts[0]:
                raise ColibriError(f"{path}: {prefix}{name} {scope[name]} is more than the {experts[0]} routed "
                                   f"experts of a layer ({prefix}{experts[1]})")


def parse_config(model_cls, config: dict, where: str | Path):
    """`model_cls.parse_config(config)`, a value of the wrong type or range in it a one-line error
    naming the file: `where` is the model directory holding config.json, or the config file itself.
    `convert`, `run` and `plan` all parse a config through here."""
    path = Path(where) / "config.json" if Path(where).is_dir() else Path(where)
    check_sizes(config, path)
    try:
        return model_cls.parse_config(config)
    except ColibriError:
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, IndexError, OverflowError,
            RecursionError) as e:
        what = f"lacks key {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:200]
        raise ColibriError(f"{path}: {model_cls.__name__} cannot read it ({what})") from None


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
