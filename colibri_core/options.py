"""The engine's settings, defined once: `EngineOptions`.

    options = EngineOptions(ram="4GB", activations="int8")   # checked here: a mistake is one line
    engine = load("models/olmoe-int4", options)               # or load(dir, ram="4GB", activations="int8")

`load`, `Engine`, the server (`ServerConfig.engine`), `colibri bench` and every command that loads
a model take their engine settings from one of these. Each field's metadata is also its command-line
option (flag, help, environment variable): `command_options` adds them to a typer command, so `run`,
`chat`, `serve`, `web` and `bench` accept exactly the same ones. A field left None that names an
environment variable takes it (COLIBRI_ACTIVATIONS, COLIBRI_KV_CACHE, COLIBRI_RAY), in Python as on
the command line. Settings of one command alone (sampling, --host, --budgets) stay that command's.
"""
from __future__ import annotations

import functools
import inspect
import numbers
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from .errors import ColibriError
from .prefix import PREFILL_CHUNK

__all__ = ["EngineOptions", "check_pin_gb", "cli_option", "command_options", "ray_paths"]

# --lookahead's default: the next MoE layer alone. Measured (BENCHMARKS.md, "Lookahead beyond one
# layer"): on the demo model the guesses' recall falls from 79 % one layer ahead to 72 % and 58 %;
# in a cold 50 % session at OLMoE size reading 2 or 3 layers ahead cut the I/O stall 2-3 ms a token
# but not the time (85-88 ms against 85), at the same bytes: deeper is an option, not the default.
LOOKAHEAD_DEPTH = 1


def _option(default, flag: str | None, help: str, cli=None, env: str | None = None, unset=None,
            metavar: str | None = None):
    """A field and its command-line option: `flag` (None: a setting of the Python API alone), `help`,
    `cli` the type the command line parses, `env` the environment variable a None takes, `unset`
    what a None becomes when that variable is not set either, `metavar` the values --help shows (a
    choice's, which are checked here, in `_check`, for the Python API too)."""
    default_kw = {"default_factory": default} if callable(default) else {"default": default}
    return field(**default_kw, metadata={"flag": flag, "help": help, "cli": cli, "env": env, "unset": unset,
                                         "metavar": metavar})


@dataclass(frozen=True)
class EngineOptions:
    # ---- the memory budget (planning.split splits it)
    ram: int | str | None = _option(None, "--ram", "RAM budget for weights and expert cache, e.g. 4GB (default: 80% "
                                    "of available).", cli=Optional[str])
    cache_slots: int | None = _option(None, "--cache-slots", "Expert cache slots per layer (overrides --ram).",
                                      cli=Optional[int])
    pin_gb: float | None = _option(None, "--pin-gb", "Hot-store size in GB for the most-routed experts (default: up "
                                   "to 3/4 of the expert budget once there is routing history, the share under which "
                                   "replaying it misses least; 0: off).", cli=Optional[float])
    # ---- the expert store (store/): none of these changes an output, only speed
    prefetch: bool = _option(True, "--prefetch/--no-prefetch", "Router lookahead: read the next layer's predicted "
                             "experts early.", cli=bool)
    lookahead: int = _option(LOOKAHEAD_DEPTH, "--lookahead", "MoE layers ahead the router lookahead reads predicted "
                             "experts for (1-3; each distance read only while its guesses are mostly right).",
                             cli=int)
    direct: bool | None = _option(None, "--direct/--no-direct", "Read experts with O_DIRECT, bypassing the page "
                                  "cache (default: on where experts are read while decoding, i.e. they do not all "
                                  "fit the expert budget, and the filesystem takes it: copying out of the page "
                                  "cache costs the CPU the kernels need; asked for and refused: a warning).",
                                  cli=Optional[bool])
    mirror: str | Path | None = _option(None, "--mirror", "A byte-identical copy of the model on another disk to read "
                                        "experts from too.", cli=Optional[Path])
    policy: str = _option("lfu_aging", "--policy", "Expert cache eviction policy: lfu_aging (LFU whose counts halve "
                          "as they age), lru, lfu, or one a plugin registers.", cli=str,
                          metavar="<lfu_aging|lru|lfu|NAME>")
    io_threads: int = _option(4, "--io-threads", "Threads reading experts from disk.", cli=int)
    # routing history: in .coli_usage in the state directory (True), in another file (a path), or none (False)
    usage: bool | str | Path = _option(True, None, "")
    # ---- where colibri writes what it keeps of a model (statedir.py)
    state_dir: str | Path | None = _option(None, "--state-dir", "Directory for this model's saved sessions, prefix "
                                           "cache spill and routing history (default: beside a converted model "
                                           "colibri may write in, else $XDG_STATE_HOME/colibri/NAME-HASH; a "
                                           "checkpoint run as it is is never written to).", cli=Optional[Path])
    # ---- the arithmetic: a choice that changes the output (off by default, and for the oracle)
    # "f32": exact (the oracle's); "int8": activations quantised per block of 64 (kernels module docstring)
    activations: str | None = _option(None, "--activations", "The matrix products' arithmetic: f32 (exact, the "
                                      "oracle's; default) or int8 (activations quantised per block of 64: faster, a "
                                      "different arithmetic).", cli=Optional[str], env="COLIBRI_ACTIVATIONS",
                                      unset="f32", metavar="<f32|int8>")
    # "f32": keys and values as computed; "f16": rounded to float16 when cached (kv/cache.py)
    kv_cache: str | None = _option(None, "--kv-cache", "Attention's cached keys and values: f32 (default) or f16 "
                                   "(half the memory, faster decode at long contexts, a different arithmetic).",
                                   cli=Optional[str], env="COLIBRI_KV_CACHE", unset="f32",
                                   metavar="<f32|f16>")
    # ---- experts in other machines' RAM (colibri_core/remote; needs colibri[ray]): again only speed
    ray: str | None = _option(None, "--ray", "A Ray cluster (auto, HOST:PORT) whose other nodes hold the routed "
                              "experts in RAM; the local store stays a cache in front (needs colibri[ray]).",
                              cli=Optional[str], env="COLIBRI_RAY")
    ray_split: str = _option("expert", "--ray-split", "How experts are cut into shards, one per node: expert (each "
                             "layer's ids split over the nodes) or layer (ranges of layers per node).", cli=str,
                             metavar="<expert|layer>")
    ray_models: tuple[str, ...] = _option((), "--ray-model", "The model's path on the Ray nodes (default: the same "
                                          "path): PATH for all, or NODE=PATH for one (NODE: its IP or Ray node id); "
                                          "repeat for several.", cli=Optional[list[str]])
    ray_timeout: float = _option(10.0, "--ray-timeout", "Seconds a node has to answer one layer's call; a node later "
                                 "than that is treated as failed and its experts are read from the local disk.",
                                 cli=float)
    # remote.client.RemoteConfig's other fields (start_timeout, retry, share, fill_local); split,
    # timeout, model_paths or default_path given here win over the ray_* fields above
    ray_options: dict = _option(dict, None, "")
    # ---- the prefix cache (colibri_core/prefix.py): only speed, a cached prefix gives the same bits
    prefix_cache: int | str | None = _option(None, "--prefix-cache", "RAM for the states of recent prompts, so a "
                                             "prompt sharing a prefix with one is prefilled only past it, e.g. 2GB "
                                             "(default: a tenth of --ram, beside it; 0: off).", cli=Optional[str])
    no_prefix_cache: bool = _option(False, "--no-prefix-cache", "Turn the prefix cache off (as --prefix-cache 0): "
                                    "every prompt is prefilled from its first token.", cli=bool)
    # tokens between the boundaries the prefix cache keeps states at: a multiple of 64
    # (kernels.deltanet.BLOCK; a test makes it small)
    prefill_chunk: int = _option(PREFILL_CHUNK, None, "")

    def __post_init__(self):
        for f in fields(self):  # a None takes its environment variable, else its `unset`
            if f.metadata["env"] and getattr(self, f.name) is None:
                object.__setattr__(self, f.name, os.environ.get(f.metadata["env"]) or f.metadata["unset"])
        if self.no_prefix_cache:
            if self.prefix_cache not in (None, 0, "0"):
                raise ColibriError(f"--no-prefix-cache and --prefix-cache {self.prefix_cache} contradict each other: "
                                   "give one")
            object.__setattr__(self, "prefix_cache", 0)
        object.__setattr__(self, "ray_models", tuple(self.ray_models))
        object.__setattr__(self, "ray_options", dict(self.ray_options or {}))  # a copy: these options never change
        self._check()

    def _check(self) -> None:
        """A one-line ColibriError for the first setting out of its range (before anything loads)."""
        from . import kernels, plugins
        from .kv.cache import check_cache_type
        from .layers.moe import LOOKAHEAD_DISTANCES
        from .remote.placement import SPLITS
        from .sizes import parse_size

        if self.ram is not None:
            parse_size(self.ram)
        if self.prefix_cache is not None and parse_size(self.prefix_cache) < 0:
            raise ColibriError(f"--prefix-cache must be 0 (off) or more, got {self.prefix_cache}")
        if not (_integer(self.prefill_chunk) and self.prefill_chunk >= 1):
            raise ColibriError(f"prefill_chunk must be an integer of at least 1, got {self.prefill_chunk!r}")
        if self.cache_slots is not None and not (_integer(self.cache_slots) and self.cache_slots >= 1):
            raise ColibriError(f"--cache-slots must be at least 1, got {self.cache_slots}")
        if self.pin_gb is not None:
            check_pin_gb(self.pin_gb)
        if not (_integer(self.lookahead) and 1 <= self.lookahead <= LOOKAHEAD_DISTANCES):
            raise ColibriError(f"--lookahead must be 1 to {LOOKAHEAD_DISTANCES} MoE layers, got {self.lookahead}")
        if not (_integer(self.io_threads) and self.io_threads >= 1):
            raise ColibriError(f"--io-threads must be at least 1, got {self.io_threads}")
        if not isinstance(self.usage, (bool, str, os.PathLike)):  # None would have become a file named "None"
            raise ColibriError(f"usage must be True, False or a file path, got {self.usage!r}")
        plugins.registry().cache_policy(self.policy)
        kernels.check_activations(self.activations)
        check_cache_type(self.kv_cache)
        if self.ray_split not in SPLITS:
            raise ColibriError(f"--ray-split must be one of {', '.join(SPLITS)}, got {self.ray_split!r}")
        if not self.ray_timeout > 0:
            raise ColibriError(f"--ray-timeout must be positive, got {self.ray_timeout}")
        if self.ray is not None:  # without Ray installed: one line, before anything loads
            from .remote import require_ray

            require_ray()
            from .remote.client import RemoteConfig

            known = {f.name for f in fields(RemoteConfig)} - {"address"}
            unknown = sorted(set(self.ray_options) - known)
            if unknown:
                raise ColibriError(f"unknown ray option {unknown[0]!r} (expected some of {', '.join(sorted(known))})")

    def remote_config(self):
        """The Ray client's `remote.client.RemoteConfig` of these options (None without `ray`)."""
        if self.ray is None:
            return None
        from .remote.client import RemoteConfig

        paths, default = ray_paths(self.ray_models)
        return RemoteConfig(self.ray, **{"split": self.ray_split, "model_paths": paths, "default_path": default,
                                         "timeout": self.ray_timeout, **self.ray_options})


def ray_paths(models) -> tuple[dict[str, str], str | None]:
    """--ray-model's values ("PATH" for every node, "NODE=PATH" for one) as ({node: path}, path or None)."""
    paths, default = {}, None
    for item in models:
        node, sep, path = item.rpartition("=")
        if sep:
            paths[node] = path
        else:
            default = path
    return paths, default


# The largest hot-store (--pin-gb): 2**64 bytes, more memory than any machine addresses (1e308 GB was
# an OverflowError: its bytes are no finite float)
MAX_PIN_GB = 2**64 / 1e9


def check_pin_gb(pin_gb) -> None:
    """A one-line ColibriError unless `pin_gb` (--pin-gb, GB) is a hot-store size a machine could hold."""
    if not (isinstance(pin_gb, numbers.Real) and pin_gb >= 0):  # NaN too
        raise ColibriError(f"--pin-gb must be 0 or more, got {pin_gb}")
    if not pin_gb <= MAX_PIN_GB:
        raise ColibriError(f"--pin-gb {pin_gb:g} is more memory than any machine has (at most {MAX_PIN_GB:.4g}: "
                           "2**64 bytes)")


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def cli_option(name: str):
    """The typer option of field `name` (for a command that takes it alone, as `plan` takes --ram)."""
    import typer

    f = next(f for f in fields(EngineOptions) if f.name == name)
    default = None if f.metadata["cli"] is Optional[list[str]] else f.default  # a repeated option: a list or none
    return typer.Option(default, f.metadata["flag"], help=f.metadata["help"], envvar=f.metadata["env"],
                        show_default=default not in (None, False), metavar=f.metadata["metavar"])


def command_options(command):
    """`command` (a typer command with a parameter ``options: EngineOptions``) taking, in that
    parameter's place, one command-line option per field that has a flag, collected back into one
    EngineOptions when it runs: every command that loads a model accepts the same options."""
    hints = typing.get_type_hints(command)  # its own parameters' annotations, resolved where it was written
    flagged = [f for f in fields(EngineOptions) if f.metadata["flag"]]
    params = []
    for p in inspect.signature(command).parameters.values():
        if p.name != "options":
            params.append(p.replace(annotation=hints.get(p.name, p.annotation)))
            continue
        params += [inspect.Parameter(f.name, p.kind, default=cli_option(f.name), annotation=f.metadata["cli"])
                   for f in flagged]

    @functools.wraps(command)
    def run(*args, **kwargs):
        given = {f.name: kwargs.pop(f.name) for f in flagged}
        options = EngineOptions(**{name: value for name, value in given.items() if value is not None})
        return command(*args, **kwargs, options=options)

    run.__signature__ = inspect.Signature(params)
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run
