"""`colibri convert`: a Hugging Face checkpoint → a container, laid out by its architecture's plugin."""
from __future__ import annotations

import dataclasses
import math
import warnings
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


# config.json's fields by the names HF configs give them, which plugins' config dataclasses keep:
# where a config gives one (at any depth: text_config, rope_parameters, …, but not in the configs of
# parts colibri does not run, vision_config, quantization_config, …) it must be what its spec says,
# and where a plugin's parsed config holds one it must be that and not null. Checked before a
# plugin reads them, so that a 0, a NaN, a null or a typo is one line for every plugin.
# Counts and widths: an integer in this range; the bound on layers keeps a typo from building a
# model of a trillion layers (plugins loop over them before anything is read).
# config.json's names for the longest sequence a model was made for, in the order they are looked up:
# `run` and the server bound prompts by it (Engine.context_length)
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "n_ctx")
SIZES = {name: (1, 2**31 - 1) for name in (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
    "num_experts_per_token", "n_group", "num_expert_group", "topk_group", "decoder_sparse_step",
    "full_attention_interval", *CONTEXT_KEYS)}
SIZES["num_hidden_layers"] = (1, 10_000)
SIZES["num_nextn_predict_layers"] = (0, 10_000)
POSITIVE = ("rms_norm_eps", "layer_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta",  # a finite number > 0
            "routed_scaling_factor")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # a token id (an integer ≥ 0), a list of them, or null
NOT_NULL = ("hidden_size", "num_hidden_layers", "num_attention_heads")  # no HF config writes these null;
# the others' null (as absent) stands for the plugin's default, checked once parsed
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # routed experts per MoE layer
TOP_KS = ("num_experts_per_tok", "num_experts_per_token")  # experts each token is routed to per MoE layer


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def field_problem(name: str, value) -> str | None:
    """What is wrong with `value` as the config field `name` ("must be …"), None if nothing is or
    no spec names the field."""
    if name in SIZES:
        low, high = SIZES[name]
        if not _integer(value) or value < low:
            least = "a positive integer" if low == 1 else f"an integer of at least {low}"
            return f"must be {least}, got {repr(value)[:40]}"
        if value > high:
            return f"{value} is more than colibri supports (at most {high:,})"
    elif name in POSITIVE:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            return f"must be a finite positive number, got {repr(value)[:40]}"
    elif name in TOKEN_IDS and value is not None:
        if not all(_integer(i) and i >= 0 for i in (value if isinstance(value, list) else [value])):
            return f"must be a token id (an integer of at least 0) or a list of them, got {repr(value)[:40]}"
    return None


def check_fields(config: dict, path: Path, prefix: str = "") -> None:
    """A ColibriError naming `path` and the field unless each field `config` gives, at any depth, is
    what its spec (SIZES, POSITIVE, TOKEN_IDS) says (or null, but for NOT_NULL), and each top-k at
    most its routed experts."""
    for name, value in config.items():
        problem = None if value is None and name not in NOT_NULL else field_problem(name, value)
        if problem:
            raise ColibriError(f"{path}: {prefix}{name} {problem}")
        if isinstance(value, dict) and (name == "text_config" or not name.endswith("_config")):
            check_fields(value, path, f"{prefix}{name}.")
    experts = max(((config[n], n) for n in EXPERT_COUNTS if config.get(n) is not None), default=None)
    for name in TOP_KS:
        if experts and config.get(name) is not None and config[name] > experts[0]:
            raise ColibriError(f"{path}: {prefix}{name} {config[name]} is more than the {experts[0]} routed "
                               f"experts of a layer ({prefix}{experts[1]})")


def check_parsed(cfg, path: Path) -> None:
    """The fields a plugin's parsed config (a dataclass) holds by a spec's name, defaults and values
    derived from others included, checked as `check_fields` checks config.json's but null refused;
    and key/value heads dividing the attention heads (GQA), wherever a config has both."""
    if not dataclasses.is_dataclass(cfg):
        return
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for name, value in values.items():
        problem = field_problem(name, value)
        if problem:
            raise ColibriError(f"{path}: {name} {problem}")
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ColibriError(f"{path}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads} "
                           "(each key/value head serves a whole group of query heads)")


def vocab_size(config: dict) -> int | None:
    """The vocabulary config.json gives (its text_config's in a multimodal config); None if none."""
    text = config.get("text_config")
    value = config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)
    return value if _integer(value) else None


def generation_defaults(model_dir: str | Path) -> dict:
    """``generation_config.json`` as a dict ({} if absent); ``eos_token_id`` normalised to a list.
    A token id that is no integer of at least 0 is a one-line error naming the file and the field;
    an eos_token_id beyond config.json's vocabulary (which the model could never generate) is dropped
    with one warning: transformers' own default configs carry some (OLMoE's 50279, in tiny models)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    fix = "restore it from the model's original files or reconvert the model"
    cfg = read_json(path, fix)
    if not isinstance(cfg, dict):
        raise ColibriError(f"{path}: not a JSON object: {fix}")
    for name in TOKEN_IDS:
        problem = field_problem(name, cfg.get(name))
        if problem:
            raise ColibriError(f"{path}: {name} {problem}: {fix}")
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else eos)
    vocab = vocab_size(read_config(model_dir))
    beyond = [i for i in eos if vocab is not None and i >= vocab]
    if beyond:
        warnings.warn(f"{path}: eos_token_id {', '.join(map(str, beyond))}: beyond the vocabulary ({vocab} tokens), "
                      "ignored", stacklevel=2)
    cfg["eos_token_id"] = [i for i in eos if i not in beyond]
    return cfg


def parse_config(model_cls, config: dict, where: str | Path):
    """`model_cls.parse_config(config)`, checked field by field (`check_fields`, `check_parsed`): a
    value of the wrong type or range a one-line error naming the file and the field. `where` is the
    model directory holding config.json, or the config file itself. `convert`, `run`, `plan` and
    `doctor` all parse a config through here."""
    path = Path(where) / "config.json" if Path(where).is_dir() else Path(where)
    check_fields(config, path)
    try:
        cfg = model_cls.parse_config(config)
    except ColibriError as e:  # the plugin's own refusal (a relation, an unsupported variant): of this file
        raise ColibriError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, IndexError, OverflowError,
            RecursionError) as e:
        what = f"lacks key {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:200]
        raise ColibriError(f"{path}: {model_cls.__name__} cannot read it ({what})") from None
    check_parsed(cfg, path)
    return cfg


def convert_checkpoint(src: str | Path, dst: str | Path, quant: str, progress: bool = True) -> Architecture:
    """Convert `src` into the container `dst` at `quant`; returns the architecture that served it."""
    registry = plugins.registry()
    config = read_config(src)
    arch = registry.resolve(config, where=str(src))
    model_cls = registry.model_class(arch)
    layout = model_cls.layout(parse_config(model_cls, config, src))
    generation_defaults(src)  # its token ids, checked before anything is written
    try:
        convert(src, dst, quant=quant, layout=layout, architecture=arch.name, plugin=arch.plugin,
                plugin_version=arch.version, progress=progress)
    except OSError as e:  # a full disk, a read error, a permission: what is finished is kept
        where = f" ({e.filename})" if e.filename else ""
        raise ColibriError(f"converting {src} into {dst} stopped: {e.strerror or e}{where}; fix that and rerun "
                           "the same command: it resumes from the files already finished") from None
    return arch
