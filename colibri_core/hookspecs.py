"""The plugin contract: every hook colibri calls, with its exact signature.

Hooks are *collectors*: the core passes a ``register`` callback (or the CLI ``app``), validates
what the plugin registers and names the plugin's distribution in every error. A plugin may
accept any subset of a hook's arguments, so arguments are only ever added, never removed.

This module imports nothing heavy: listing plugins must not import model code.
"""
from __future__ import annotations

from dataclasses import dataclass

import pluggy

__all__ = ["Architecture", "hookimpl"]

hookspec = pluggy.HookspecMarker("colibri")
hookimpl = pluggy.HookimplMarker("colibri")


@dataclass(frozen=True)
class Architecture:
    """One model architecture a plugin serves.

    ``model`` is a lazy ``"package.module:Class"`` string (imported only when a model of this
    architecture is converted or loaded). The class is a `colibri_core.model.MoEModel`.
    """

    name: str  # short unique name, e.g. "olmoe"
    hf_architectures: tuple[str, ...]  # config.json "architectures" values served
    model_types: tuple[str, ...]  # config.json "model_type" values served (fallback)
    model: str  # "module:Class" implementing colibri_core.model.MoEModel
    plugin: str = ""  # set by the core: the distribution that registered it
    version: str = ""  # set by the core: that distribution's version


@hookspec
def colibri_register_architectures(register):
    """Register the model architectures this plugin serves.

    :param register: call ``register(Architecture(...))`` once per architecture.
    """


@hookspec
def colibri_register_commands(app):
    """Add commands to the ``colibri`` command line.

    :param app: the `typer.Typer` application; use ``@app.command()``.
    """


@hookspec
def colibri_register_cache_policies(register):
    """Register eviction policies for the per-layer expert cache (``--policy NAME``).

    :param register: call ``register(name, factory, description="")`` once per policy. ``name``
        is lower_snake_case and unique; ``factory(slots=..., n_experts=...)`` returns a
        `colibri_core.store.policies.CachePolicy` (one per MoE layer). The core's own ``lru``
        (the default) and ``lfu`` are registered through this same hook.
    """


@hookspec
def colibri_register_drafters(register):
    """Register draft providers for speculative decoding (``--draft NAME``).

    :param register: call ``register(name, factory, description="")`` once per drafter. ``name``
        is lower_snake_case and unique; ``factory(model)`` returns a `colibri_core.drafting.Drafter`
        for a loaded model, or None where it does not apply. The core's own ``grammar`` and ``mtp``
        are registered through this same hook.
    """
