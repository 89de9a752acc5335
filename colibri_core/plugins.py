"""The plugin manager: discovery through the entry-point group ``colibri``, the allow-list,
validation of registrations, and resolving a model directory's ``config.json`` to its plugin.

- ``COLIBRI_LOAD_PLUGINS=a,b`` loads only the named plugins (entry-point or distribution names);
  set but empty, it loads none: the escape hatch from a broken plugin.
- ``COLIBRI_TRACE_PLUGINS=1`` prints every hook call with its arguments and results on stderr.

A plugin declares the colibri versions it supports as its distribution's requirement on
``colibri`` (``dependencies = ["colibri>=0.1,<0.2"]``); one whose range leaves out this colibri is
not imported, and a model it would serve is a one-line error naming the plugin, its range and this
version (`colibri plugins` lists it as not loaded).
"""
from __future__ import annotations

import dataclasses
import email.parser
import importlib
import os
import re
import sys
import types
import warnings
import zipfile
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, entry_points
from importlib.metadata import version as dist_version
from pathlib import Path

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from . import __version__, hookspecs
from .errors import ColibriError
from .fsio import CONFIG_BYTES, read_text
from .hookspecs import Architecture

# The plugin distributions shipped in this repository, by their directory in it: what
# `colibri install NAME` accepts as a NAME (from a source checkout; without one, pip looks NAME up).
SHIPPED_PLUGINS = {
    "colibri-olmoe": "plugins/olmoe",
    "colibri-glm52": "plugins/glm52",
    "colibri-qwen36": "plugins/qwen36",
    "colibri-kimi-k3": "plugins/kimi_k3",
    "colibri-deepseek-v4": "plugins/deepseek_v4",
    "colibri-gpt-oss": "plugins/gpt_oss",
}
# The shipped plugin serving each config.json model_type, named when no installed plugin serves a model.
KNOWN_PLUGINS = {
    "olmoe": "colibri-olmoe",
    "glm_moe_dsa": "colibri-glm52",
    "qwen3_5_moe": "colibri-qwen36",
    "qwen3_5_moe_text": "colibri-qwen36",
    "kimi_linear": "colibri-kimi-k3",
    "kimi_k3": "colibri-kimi-k3",
    "deepseek_v4": "colibri-deepseek-v4",
    "gpt_oss": "colibri-gpt-oss",
}
REPOSITORY = Path(__file__).resolve().parent.parent  # a source checkout's root (SHIPPED_PLUGINS are below it)


def core_version() -> str:
    """This colibri's version: its distribution's (what pip sees), else the package's own."""
    try:
        return dist_version("colibri")
    except PackageNotFoundError:  # colibri_core imported from a source tree that was never installed
        return __version__


def shipped_name(name: str) -> str:
    """The shipped plugin distribution `name` stands for (`colibri-glm52`, `colibri_glm52` or just
    `glm52`); a ColibriError naming the shipped plugins if it is none of them."""
    dist = canonicalize_name(name)
    for candidate in (dist, f"colibri-{dist}"):
        if candidate in SHIPPED_PLUGINS:
            return candidate
    raise ColibriError(f"unknown plugin {name!r}: colibri ships {', '.join(SHIPPED_PLUGINS)}; "
                       f"to install another, give its directory or wheel")


def shipped_plugin(name: str) -> Path | None:
    """The directory of shipped plugin `name` in this source checkout (None when colibri was installed
    without its source, from a wheel); a ColibriError naming the shipped plugins if `name` is none of them."""
    path = REPOSITORY / SHIPPED_PLUGINS[shipped_name(name)]
    return path if (path / "pyproject.toml").is_file() else None


def supported_range(dist) -> str | None:
    """The colibri versions distribution `dist` (importlib.metadata) declares it supports, as a
    specifier string ('' for any version), or None when it does not depend on colibri at all."""
    for line in dist.requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) == "colibri" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return ",".join(sorted(map(str, req.specifier), key=lambda c: (not c.startswith(">"), c)))  # lower bound first
    return None


def version_problem(dist, core: str | None = None) -> str | None:
    """Why plugin distribution `dist` cannot run on this colibri (or on version `core`), in words; None if it can."""
    wanted = supported_range(dist)
    core = core or core_version()
    if not wanted or SpecifierSet(wanted).contains(Version(core), prereleases=True):
        return None
    return f"supports colibri {wanted}, not this colibri {core}"


def core_pin() -> list[str]:
    """What pip is given beside a plugin so that installing it never changes colibri: this
    colibri's exact version, when it is installed as a distribution pip knows."""
    try:
        return [f"colibri=={dist_version('colibri')}"]
    except PackageNotFoundError:
        return []


def check_wheel(path: Path, source: Path | None = None) -> None:
    """A ColibriError (one line) unless `path` is a wheel of a colibri plugin that supports this
    colibri; the message names `source` (the directory the wheel was built from) when given."""
    if path.suffix != ".whl":
        raise ColibriError(f"{path}: not a wheel (.whl) or a plugin directory")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            metadata = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(metadata) != 1:
                raise ColibriError(f"{path}: not a wheel (no .dist-info/METADATA)")
            meta = email.parser.Parser().parsestr(z.read(metadata[0]).decode("utf-8"))
            ep_file = metadata[0].replace("METADATA", "entry_points.txt")
            groups = z.read(ep_file).decode("utf-8").split() if ep_file in names else []
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError) as e:
        raise ColibriError(f"{path}: not a readable wheel ({e})") from e
    dist = f"{meta['Name']} {meta['Version']}"
    where = source or path
    if "[colibri]" not in groups:
        raise ColibriError(f"{where}: {dist} is not a colibri plugin (no entry point in the group colibri)")
    problem = version_problem(types.SimpleNamespace(requires=meta.get_all("Requires-Dist") or []))
    if problem:
        raise ColibriError(f"{where}: {dist} {problem}")


def check_plugin_dir(path: Path) -> None:
    """A ColibriError (one line) if the directory's pyproject.toml says, without anything of the
    project being run, that it is no colibri plugin (no entry point in the group colibri) or not one
    for this colibri. What it cannot tell (entry points left to setup.py: `dynamic`, or no
    pyproject.toml; every project under Python 3.10, which has no tomllib) the check of the wheel
    built from it tells (`check_wheel`)."""
    pyproject = path / "pyproject.toml"
    try:
        import tomllib
    except ImportError:
        return
    if not pyproject.is_file():
        return
    try:
        project = tomllib.loads(read_text(pyproject, CONFIG_BYTES)).get("project", {})
    except tomllib.TOMLDecodeError as e:
        raise ColibriError(f"{pyproject}: cannot read it ({e})") from None
    name = f"{project.get('name', path.name)} {project.get('version', '')}".strip()
    if "colibri" not in project.get("entry-points", {}) and "entry-points" not in project.get("dynamic", []):
        raise ColibriError(f"{path}: {name} is not a colibri plugin (its pyproject.toml has no "
                           "[project.entry-points.colibri])")
    problem = version_problem(types.SimpleNamespace(requires=project.get("dependencies", [])))
    if problem:
        raise ColibriError(f"{path}: {name} {problem}")


@dataclass
class Installed:
    """An installed plugin distribution as its metadata describes it (nothing imported)."""
    distribution: str
    version: str
    names: list[str]  # its entry points in the group ``colibri``
    requires: str | None  # the colibri versions it supports ('' any; None: it names no colibri)
    problem: str | None  # why it cannot run on this colibri, or None


def installed() -> list[Installed]:
    """Every installed distribution with an entry point in the group ``colibri``, by name."""
    found: dict[str, Installed] = {}
    for ep in entry_points(group="colibri"):
        if ep.dist is None:
            continue
        key = canonicalize_name(ep.dist.name)
        if key not in found:  # the first on sys.path is the one imported
            found[key] = Installed(ep.dist.name, ep.dist.version, [], supported_range(ep.dist), version_problem(ep.dist))
        if ep.name not in found[key].names:
            found[key].names.append(ep.name)
    return sorted(found.values(), key=lambda i: canonicalize_name(i.distribution))


def installed_name(name: str) -> str:
    """The installed plugin distribution `name` stands for (its distribution or entry-point name);
    a ColibriError naming the installed plugins if it is none of them."""
    want = canonicalize_name(name)
    if want == "colibri":
        raise ColibriError(f"colibri uninstall removes plugins; to remove colibri itself: {sys.executable} -m pip "
                           "uninstall colibri")
    plugins = installed()
    for p in plugins:
        if want in (canonicalize_name(p.distribution), *(canonicalize_name(n) for n in p.names)):
            return p.distribution
    listed = ", ".join(p.distribution for p in plugins) or "none"
    raise ColibriError(f"no installed plugin is called {name!r} (installed: {listed})")


def versions_text() -> str:
    """`colibri --version`: this colibri's version, then each installed plugin's and the colibri
    versions it supports (read from metadata: nothing is imported)."""
    import platform

    lines = [f"colibri {core_version()} (Python {platform.python_version()}, {Path(__file__).resolve().parent})"]
    for p in installed():
        supports = "any colibri" if not p.requires else f"colibri {p.requires}"
        lines.append(f"{p.distribution} {p.version} (supports {supports})"
                     + (": not loaded (not this colibri)" if p.problem else ""))
    return "\n".join(lines)


def _normal(name: str) -> str:
    """A plugin's name as pip compares them: case, and runs of -, _ and . alike (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


@dataclass
class PluginInfo:
    name: str  # entry-point name
    distribution: str
    version: str
    module: object
    architectures: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    requires: str | None = None  # the colibri versions it supports ('' any; None: it names no colibri)


class Registry:
    """Loaded plugins and what they registered."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("colibri")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.architectures: dict[str, Architecture] = {}
        self.skipped: list[str] = []  # installed plugins left out by COLIBRI_LOAD_PLUGINS
        # installed plugins whose supported colibri versions leave this one out (never imported):
        # distribution -> (version, declared range, the one-line error that names them)
        self.incompatible: dict[str, tuple[str, str, str]] = {}
        self._policies = None  # name -> PolicyInfo, collected on first use
        from .store import policies  # the core's own cache policies, registered like a plugin's

        self._core_policies = policies
        self.pm.register(policies, name="colibri-core-policies")
        self._drafters = None  # name -> DrafterInfo, collected on first use
        from . import drafting  # the core's own drafters, registered like a plugin's

        self._core_drafters = drafting
        self.pm.register(drafting, name="colibri-core-drafters")
        if os.environ.get("COLIBRI_TRACE_PLUGINS"):
            self.pm.trace.root.setwriter(lambda msg: print(msg, end="", file=sys.stderr))
            self.pm.enable_tracing()

    # ---- discovery ----------------------------------------------------------------------
    def load_entry_points(self) -> None:
        allow = os.environ.get("COLIBRI_LOAD_PLUGINS")
        allowed = None if allow is None else {_normal(s) for s in allow.split(",") if s.strip()}
        found = set()
        for ep in entry_points(group="colibri"):
            dist = ep.dist.name if ep.dist else ep.name
            version = ep.dist.version if ep.dist else "?"
            names = {_normal(ep.name), _normal(dist)}
            found |= names
            if allowed is not None and not names & allowed:
                self.skipped.append(dist)
                continue
            problem = version_problem(ep.dist) if ep.dist else None
            if problem:  # checked before its import: its code may need what this colibri lacks
                how = f"colibri install {dist}" if dist in SHIPPED_PLUGINS else "colibri install its wheel or directory"
                self.incompatible[dist] = (version, supported_range(ep.dist), (
                    f"plugin {dist} {version} {problem}: install a matching version "
                    f"({how}) or leave it out with COLIBRI_LOAD_PLUGINS"))
                continue
            try:
                module = ep.load()
            except Exception as e:  # a broken plugin names itself, and how to get past it
                raise ColibriError(
                    f"plugin {dist} {version} failed to import: {type(e).__name__}: {e} "
                    f"(set COLIBRI_LOAD_PLUGINS to load only the others)"
                ) from e
            self.add(ep.name, dist, version, module)
            self.plugins[ep.name].requires = supported_range(ep.dist) if ep.dist else None
        if allowed is not None and allowed - found:  # a typo would load nothing it meant, silently
            warnings.warn(f"COLIBRI_LOAD_PLUGINS names {', '.join(sorted(allowed - found))}, which no installed "
                          f"plugin is called (installed: {', '.join(sorted(found)) or 'none'})", stacklevel=2)

    def add(self, name: str, distribution: str, version: str, module: object) -> None:
        """Register one plugin module (tests use this to add plugins by hand)."""
        if name in self.plugins:
            return
        known = {n for n in dir(hookspecs) if n.startswith("colibri_")}
        for attr in dir(module):
            if attr.startswith("colibri_") and callable(getattr(module, attr)) and attr not in known:
                raise ColibriError(f"plugin {distribution} {version}: {attr} is not a colibri hook "
                                   f"(known: {', '.join(sorted(known))})")
            if attr in known and not hasattr(getattr(module, attr), "colibri_impl"):  # pluggy would skip it
                raise ColibriError(f"plugin {distribution} {version}: {attr} lacks @hookimpl "
                                   "(from colibri_core import hookimpl), so colibri would never call it")
        try:
            self.pm.register(module, name=name)
            self.pm.check_pending()  # a misspelt hook implementation is a loud error
        except pluggy.PluginValidationError as e:
            if self.pm.is_registered(module):  # a bad signature is refused before it is registered
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
            names = {k: (v,) if isinstance(v, str) else tuple(v)  # ("Name") is a string, not a 1-tuple
                     for k, v in (("hf_architectures", arch.hf_architectures), ("model_types", arch.model_types))}
            for other in self.architectures.values():  # which one would serve the config: never a guess
                both = set(names["hf_architectures"]) & set(other.hf_architectures) or \
                    set(names["model_types"]) & set(other.model_types)
                if both:
                    raise ColibriError(f"{where}: architecture {arch.name} serves {sorted(both)[0]}, as {other.name} "
                                       f"of plugin {other.plugin} does: leave one out with COLIBRI_LOAD_PLUGINS")
            arch = dataclasses.replace(arch, plugin=info.distribution, version=info.version, **names)
            self.architectures[arch.name] = arch
            info.architectures.append(arch.name)

        others = [p for p in self.pm.get_plugins() if p is not info.module]
        try:
            self.pm.subset_hook_caller("colibri_register_architectures", remove_plugins=others)(register=register)
        except ColibriError:
            raise
        except Exception as e:  # the plugin's own code failed: it names itself, as a failed import does
            raise ColibriError(f"plugin {info.distribution} {info.version}: colibri_register_architectures failed: "
                               f"{type(e).__name__}: {e} (set COLIBRI_LOAD_PLUGINS to load only the others)") from e

    def resolve(self, config: dict, where: str = "model") -> Architecture:
        """The architecture serving a config.json: by ``architectures``, then ``model_type``."""
        names = config.get("architectures") or []
        names = [names] if isinstance(names, str) else names  # a single class name, not in a list
        model_type = config.get("model_type")
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ColibriError(f"{where}: the config's architectures must be a list of class names, "
                               f"got {repr(names)[:80]}")
        if model_type is not None and not isinstance(model_type, str):
            raise ColibriError(f"{where}: the config's model_type must be a string, got {repr(model_type)[:80]}")
        for arch in self.architectures.values():
            if any(n in arch.hf_architectures for n in names):
                return arch
        for arch in self.architectures.values():
            if model_type and model_type in arch.model_types:
                return arch
        what = f"{'/'.join(names) or '?'} (model_type {model_type or '?'})"
        hint = KNOWN_PLUGINS.get(model_type or "")
        if hint and hint in self.incompatible:
            raise ColibriError(f"{where}: {what} is served by {self.incompatible[hint][2]}")
        if hint and hint in self.skipped:
            raise ColibriError(f"{where}: {what} is served by plugin {hint}, which COLIBRI_LOAD_PLUGINS leaves out")
        if hint:
            raise ColibriError(f"{where}: no installed plugin serves {what}: install it with `colibri install {hint}`")
        if self.skipped:  # likewise: a plugin left out may serve it
            raise ColibriError(f"{where}: no loaded plugin serves {what} (COLIBRI_LOAD_PLUGINS leaves out "
                               f"{', '.join(sorted(self.skipped))})")
        if self.incompatible:  # one of them may be the one: say so
            not_loaded = "; ".join(m for _, _, m in self.incompatible.values())
            raise ColibriError(f"{where}: no loaded plugin serves {what} (not loaded: {not_loaded})")
        raise ColibriError(f"{where}: no installed plugin serves {what}, and colibri knows no plugin for it")

    def model_class(self, arch: Architecture):
        """Import an architecture's model class (the only place model code is imported)."""
        module, _, attr = arch.model.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except Exception as e:  # a missing module, a syntax error, its own code failing on import
            raise ColibriError(f"plugin {arch.plugin} {arch.version}: cannot import {arch.model}: "
                               f"{type(e).__name__}: {e}") from e

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

    # ---- drafters ------------------------------------------------------------------------
    def drafters(self) -> dict:
        """Every registered drafter by name (`colibri_core.drafting.DrafterInfo`), the core's first."""
        if self._drafters is not None:
            return self._drafters
        from .drafting import DrafterInfo

        found: dict[str, DrafterInfo] = {}
        sources = [("colibri", "", self._core_drafters)] + [
            (p.distribution, p.version, p.module) for p in self.plugins.values()]
        for dist, version, module in sources:
            where = f"plugin {dist} {version}".rstrip()

            def register(name, factory, description="", where=where, dist=dist) -> None:
                if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
                    raise ColibriError(f"{where}: drafter name {name!r} must be lower_snake_case")
                if not callable(factory):
                    raise ColibriError(f"{where}: drafter {name}: factory {factory!r} is not callable")
                if name in found:
                    raise ColibriError(f"{where}: drafter {name} is already registered by {found[name].plugin}")
                found[name] = DrafterInfo(name, factory, str(description), dist)

            others = [p for p in self.pm.get_plugins() if p is not module]
            self.pm.subset_hook_caller("colibri_register_drafters", remove_plugins=others)(register=register)
        self._drafters = found
        return found

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
