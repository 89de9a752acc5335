"""The plugin manager: discovery through the entry-point group ``colibri``, the allow-list,
validation of registrations, and resolving a model directory's ``config.json`` to its plugin.

- ``COLIBRI_LOAD_PLUGINS=a,b`` loads only the named plugins (entry-point or distribution names);
  set but empty, it loads none: the escape hatch from a broken plugin.
- ``COLIBRI_TRACE_PLUGINS=1`` prints every hook call with its arguments and results on stderr.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

import pluggy

from . import hookspecs
from .errors import ColibriError
from .hookspecs import Architecture

# The plugin distributions shipped in this repository, by their directory in it: what
# `colibri install NAME` accepts as a NAME (from a source checkout; without one, pip looks NAME up).
SHIPPED_PLUGINS = {
    "colibri-olmoe": "plugins/olmoe",
    "colibri-glm52": "plugins/glm52",
    "colibri-qwen36": "plugins/qwen36",
}
# The shipped plugin serving each config.json model_type, named when no installed plugin serves a model.
KNOWN_PLUGINS = {
    "olmoe": "colibri-olmoe",
    "glm_moe_dsa": "colibri-glm52",
    "qwen3_5_moe": "colibri-qwen36",
    "qwen3_5_moe_text": "colibri-qwen36",
}
REPOSITORY = Path(__file__).resolve().parent.parent  # a source checkout's root (SHIPPED_PLUGINS are below it)


def shipped_plugin(name: str) -> Path | None:
    """The directory of shipped plugin `name` in this source checkout (None when colibri was installed
    without its source); a ColibriError naming the shipped plugins if `name` is none of them."""
    dist = re.sub(r"[-_.]+", "-", name).lower()
    if dist not in SHIPPED_PLUGINS:
        raise ColibriError(f"unknown plugin {name!r}: colibri ships {', '.join(SHIPPED_PLUGINS)}; "
                           f"to install another, give its directory or wheel")
    path = REPOSITORY / SHIPPED_PLUGINS[dist]
    return path if (path / "pyproject.toml").is_file() else None


@dataclass
class PluginInfo:
    name: str  # entry-point name
    distribution: str
    version: str
    module: object
    architectures: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)


class Registry:
    """Loaded plugins and what they registered."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("colibri")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.architectures: dict[str, Architecture] = {}
        self.skipped: list[str] = []  # installed plugins left out by COLIBRI_LOAD_PLUGINS
        self._policies = None  # name -> PolicyInfo, collected on first use
        from .store import policies  # the core's own cache policies, registered like a plugin's

        self._core_policies = policies
        self.pm.register(policies, name="colibri-core-policies")
        if os.environ.get("COLIBRI_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
            self.pm.enable_tracing()

    # ---- discovery ----------------------------------------------------------------------
    def load_entry_points(self) -> None:
        allow = os.environ.get("COLIBRI_LOAD_PLUGINS")
        allowed = None if allow is None else {s.strip() for s in allow.split(",") if s.strip()}
        for ep in entry_points(group="colibri"):
            dist = ep.dist.name if ep.dist else ep.name
            version = ep.dist.version if ep.dist else "?"
            if allowed is not None and ep.name not in allowed and dist not in allowed:
                self.skipped.append(dist)
                continue
            try:
                module = ep.load()
            except Exception as e:  # a broken plugin names itself, and how to get past it
                raise ColibriError(
                    f"plugin {dist} {version} failed to import: {type(e).__name__}: {e} "
                    f"(set COLIBRI_LOAD_PLUGINS to load only the others)"
                ) from e
            self.add(ep.name, dist, version, module)

    def add(self, name: str, distribution: str, version: str, module: object) -> None:
        """Register one plugin module (tests use this to add plugins by hand)."""
        if name in self.plugins:
            return
        known = {n for n in dir(hookspecs) if n.startswith("colibri_")}
        for attr in dir(module):
            if attr.startswith("colibri_") and callable(getattr(module, attr)) and attr not in known:
                raise ColibriError(f"plugin {distribution} {version}: {attr} is not a colibri hook "
                                   f"(known: {', '.join(sorted(known))})")
        try:
            self.pm.register(module, name=name)
            self.pm.check_pending()  # a misspelt hook implementation is a loud error
        except pluggy.PluginValidationError as e:
            self.pm.unregister(module)
            raise ColibriError(f"plugin {distribution} {version}: {e}") from e
        info = PluginInfo(name, distribution, version, module)
        info.hooks = sorted(
            h.name for h in self.pm.get_hookcallers(module) or [] if h.name.startswith("colibri_")
        )
        self.plugins[name] = info
        self._collect_architectures(info)

    # ---- architectures -------------------------------------------------------------------
    def _collect_architectures(self, info: PluginInfo) -> None:
        def register(arch) -> None:
            where = f"plugin {info.distribution} {info.version}"
            if not isinstance(arch, Architecture):
                raise ColibriError(f"{where} registered {arch!r}, not a colibri Architecture")
            if not re.fullmatch(r"[a-z][a-z0-9_]*", arch.name):
                raise ColibriError(f"{where}: architecture name {arch.name!r} must be lower_snake_case")
            if not re.fullmatch(r"[\w.]+:\w+", arch.model):
                raise ColibriError(f"{where}: architecture {arch.name}: model must be 'module:Class', got {arch.model!r}")
            if not (arch.hf_architectures or arch.model_types):
                raise ColibriError(f"{where}: architecture {arch.name} serves no config.json architectures or model_type")
            if arch.name in self.architectures:
                other = self.architectures[arch.name]
                raise ColibriError(f"{where}: architecture {arch.name} is already registered by plugin {other.plugin}")
            arch = dataclasses.replace(arch, plugin=info.distribution, version=info.version,
                                       hf_architectures=tuple(arch.hf_architectures),
                                       model_types=tuple(arch.model_types))
            self.architectures[arch.name] = arch
            info.architectures.append(arch.name)

        others = [p for p in self.pm.get_plugins() if p is not info.module]
        self.pm.subset_hook_caller("colibri_register_architectures", remove_plugins=others)(register=register)

    def resolve(self, config: dict, where: str = "model") -> Architecture:
        """The architecture serving a config.json: by ``architectures``, then ``model_type``."""
        names = config.get("architectures") or []
        model_type = config.get("model_type")
        for arch in self.architectures.values():
            if any(n in arch.hf_architectures for n in names):
                return arch
        for arch in self.architectures.values():
            if model_type and model_type in arch.model_types:
                return arch
        what = f"{'/'.join(names) or '?'} (model_type {model_type or '?'})"
        hint = KNOWN_PLUGINS.get(model_type or "")
        if hint and hint in self.skipped:
            raise ColibriError(f"{where}: {what} is served by plugin {hint}, which COLIBRI_LOAD_PLUGINS leaves out")
        if hint:
            raise ColibriError(f"{where}: no installed plugin serves {what}: install it with `colibri install {hint}`")
        raise ColibriError(f"{where}: no installed plugin serves {what}, and colibri knows no plugin for it")

    def model_class(self, arch: Architecture):
        """Import an architecture's model class (the only place model code is imported)."""
        module, _, attr = arch.model.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ColibriError(f"plugin {arch.plugin} {arch.version}: cannot import {arch.model}: {e}") from e

    # ---- cache policies ------------------------------------------------------------------
    def cache_policies(self) -> dict:
        """Every registered cache policy by name (`colibri_core.store.policies.PolicyInfo`)."""
        if self._policies is not None:
            return self._policies
        from .store.policies import PolicyInfo

        found: dict[str, PolicyInfo] = {}
        sources = [("colibri", "", self._core_policies)] + [
            (p.distribution, p.version, p.module) for p in self.plugins.values()]
        for dist, version, module in sources:
            where = f"plugin {dist} {version}".rstrip()

            def register(name, factory, description="", where=where, dist=dist) -> None:
                if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                    raise ColibriError(f"{where}: cache policy name {name!r} must be lower_snake_case")
                if not callable(factory):
                    raise ColibriError(f"{where}: cache policy {name}: factory {factory!r} is not callable")
                if not isinstance(description, str):
                    raise ColibriError(f"{where}: cache policy {name}: description must be a string")
                if name in found:
                    raise ColibriError(f"{where}: cache policy {name} is already registered by {found[name].plugin}")
                found[name] = PolicyInfo(name, factory, description, dist)

            others = [p for p in self.pm.get_plugins() if p is not module]
            self.pm.subset_hook_caller("colibri_register_cache_policies", remove_plugins=others)(register=register)
        self._policies = found
        return found

    def cache_policy(self, name: str):
        """The PolicyInfo registered as `name`, or a ColibriError listing the known ones."""
        policies = self.cache_policies()
        if name not in policies:
            raise ColibriError(f"unknown cache policy {name!r}: choose one of {', '.join(sorted(policies))}")
        return policies[name]

    def call_commands(self, app) -> None:
        self.pm.hook.colibri_register_commands(app=app)


_registry: Registry | None = None


def registry() -> Registry:
    """The process-wide registry, loading entry-point plugins on first use."""
    global _registry
    if _registry is None:
        reg = Registry()
        reg.load_entry_points()
        _registry = reg
    return _registry
