"""Packaging: one version, the shipped-plugin tables in step with plugins/*/, each plugin's
supported colibri versions (a mismatch is one line, the plugin never imported), `colibri
--version`, `colibri install` / `uninstall` (pip, with colibri kept as it is) and the data the
wheel carries. Building and installing the wheels for real is `make check-dist` (tools/check_dist.sh)."""
import json
import os
import subprocess
import sys
import zipfile
from importlib import resources
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest

import colibri_core
from colibri_core import plugins
from colibri_core.demo import demo_model
from colibri_core.errors import ColibriError

from conftest import colibri

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def plugin_dirs() -> list[Path]:
    """Every plugins/*/ with a pyproject.toml that git tracks (one being written is not shipped yet)."""
    found = sorted(p.parent for p in (REPO / "plugins").glob("*/pyproject.toml"))
    tracked = subprocess.run(["git", "ls-files", "plugins/*/pyproject.toml"], cwd=REPO, capture_output=True,
                             text=True).stdout.split()
    return [d for d in found if f"plugins/{d.name}/pyproject.toml" in tracked] if tracked else found


PLUGIN_DIRS = plugin_dirs()


def one_line_error(r, *fragments):
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith("colibri: error: ") and r.stderr.count("\n") == 1, r.stderr
    for f in fragments:
        assert f in r.stderr, r.stderr


# ---- versions -------------------------------------------------------------------------------------
def test_one_version():
    """pyproject reads the version from colibri_core.__version__; what pip sees is the same."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "colibri_core.__version__"}
    assert dist_version("colibri") == colibri_core.__version__ == plugins.core_version()


def test_version_names_core_and_plugins():
    r = colibri("--version")
    assert r.returncode == 0, r.stderr
    first, *rest = r.stdout.splitlines()
    assert first.startswith(f"colibri {colibri_core.__version__} (Python ")
    assert f"colibri-olmoe {dist_version('colibri-olmoe')} (supports colibri >=0.1,<0.2)" in rest
    r = colibri("plugins")
    assert r.stdout.splitlines()[0] == f"colibri {colibri_core.__version__}"
    assert "colibri-olmoe 0.1.0: hooks colibri_register_architectures; supports colibri >=0.1,<0.2" in r.stdout
    rows = json.loads(colibri("plugins", "--json").stdout)
    assert rows[0]["name"] == "colibri" and rows[0]["version"] == colibri_core.__version__
    (olmoe,) = [p for p in rows if p["name"] == "colibri-olmoe"]
    assert olmoe["requires_colibri"] == ">=0.1,<0.2" and olmoe["loaded"] and olmoe["error"] is None


# ---- the shipped plugins: every plugins/*/ directory, generically ----------------------------------
@pytest.mark.parametrize("where", PLUGIN_DIRS, ids=lambda p: p.name)
def test_shipped_plugin_is_in_the_tables(where):
    """A new plugins/NAME/ directory is a shipped plugin only once plugins.py names it: the
    distribution `colibri install` takes, and every model_type it serves (the name a missing
    architecture's error gives). Its pyproject declares the colibri versions it supports."""
    project = tomllib.loads((where / "pyproject.toml").read_text())["project"]
    dist = project["name"]
    assert plugins.SHIPPED_PLUGINS.get(dist) == f"plugins/{where.name}", \
        f"add {dist!r}: 'plugins/{where.name}' to SHIPPED_PLUGINS in colibri_core/plugins.py"
    assert project["entry-points"]["colibri"], f"{dist}: no entry point in the group colibri"
    (req,) = [d for d in project["dependencies"] if d.split(">")[0].split("<")[0].split("=")[0].strip() == "colibri"]
    from packaging.requirements import Requirement

    spec = Requirement(req).specifier
    assert colibri_core.__version__ in spec and any(s.operator == "<" for s in spec), \
        f"{dist}: declare the colibri versions it supports, with an upper bound (e.g. colibri>=0.1,<0.2), got {req!r}"
    served = [a for a in plugins.registry().architectures.values() if a.plugin == dist]
    assert served, f"{dist} is not installed (make setup-test installs every plugins/*/)"
    for arch in served:
        for model_type in arch.model_types:
            assert plugins.KNOWN_PLUGINS.get(model_type) == dist, \
                f"add {model_type!r}: {dist!r} to KNOWN_PLUGINS in colibri_core/plugins.py"


def test_the_example_plugin_declares_its_range_too():
    """docs/plugins.md teaches it: the example's pyproject (the guide's code block) has a bounded range."""
    project = tomllib.loads((REPO / "examples" / "qwen3moe" / "pyproject.toml").read_text())["project"]
    assert "colibri>=0.1,<0.2" in project["dependencies"]


def test_tables_name_only_plugin_directories():
    assert sorted(plugins.SHIPPED_PLUGINS.values()) == [f"plugins/{p.name}" for p in PLUGIN_DIRS]
    assert set(plugins.KNOWN_PLUGINS.values()) <= set(plugins.SHIPPED_PLUGINS)


def test_shipped_names():
    assert plugins.shipped_name("colibri_glm52") == plugins.shipped_name("glm52") == "colibri-glm52"
    with pytest.raises(ColibriError, match="unknown plugin 'colibri-nope': colibri ships colibri-olmoe, "):
        plugins.shipped_name("colibri-nope")


# ---- a plugin for another colibri -------------------------------------------------------------------
def fake_dist(site: Path, name: str, version: str, requires: str | None, module_code: str) -> None:
    """An installed distribution `name` (its metadata and module) in the directory `site`."""
    module = name.replace("-", "_")
    info = site / f"{module}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + (f"Requires-Dist: {requires}\n" if requires else ""))
    (info / "entry_points.txt").write_text(f"[colibri]\n{module.removeprefix('colibri_')} = {module}\n")
    (site / f"{module}.py").write_text(module_code)


@pytest.fixture
def future_plugin(tmp_path, monkeypatch):
    """colibri-future 9.0, which supports colibri >=9 and breaks if imported."""
    site = tmp_path / "site"
    fake_dist(site, "colibri-future", "9.0", "colibri>=9", "raise RuntimeError('imported although incompatible')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(plugins.KNOWN_PLUGINS, "future_moe", "colibri-future")
    return site


def test_incompatible_plugin_is_not_imported_and_named_when_needed(future_plugin):
    reg = plugins.Registry()
    reg.load_entry_points()  # no import, no error: the other plugins work
    assert "future" not in reg.plugins and "olmoe" in reg.plugins
    version, wanted, message = reg.incompatible["colibri-future"]
    assert (version, wanted) == ("9.0", ">=9")
    want = (f"m: FutureForCausalLM (model_type future_moe) is served by plugin colibri-future 9.0 supports "
            f"colibri >=9, not this colibri {colibri_core.__version__}: install a matching version "
            f"(colibri install its wheel or directory) or leave it out with COLIBRI_LOAD_PLUGINS")  # not shipped
    with pytest.raises(ColibriError) as e:
        reg.resolve({"architectures": ["FutureForCausalLM"], "model_type": "future_moe"}, where="m")
    assert str(e.value) == want
    with pytest.raises(ColibriError, match=r"no loaded plugin serves .* \(not loaded: plugin colibri-future 9.0"):
        reg.resolve({"architectures": ["Unknown"], "model_type": "unknown"}, where="m")


def test_incompatible_plugin_on_the_command_line(future_plugin, tiny_model, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(future_plugin), os.environ.get("PYTHONPATH", "")])}
    r = colibri("plugins", env=env)
    assert r.returncode == 0, r.stderr
    assert (f"colibri-future 9.0: not loaded: supports colibri >=9, not this colibri {colibri_core.__version__}"
            in r.stdout)
    (row,) = [p for p in json.loads(colibri("plugins", "--json", env=env).stdout) if p["name"] == "colibri-future"]
    assert not row["loaded"] and row["requires_colibri"] == ">=9" and "supports colibri >=9" in row["error"]
    assert "colibri-future 9.0 (supports colibri >=9): not loaded" in colibri("--version", env=env).stdout
    model = tmp_path / "future"  # a container whose config.json names an architecture only colibri-future serves
    model.mkdir()
    for f in tiny_model.iterdir():
        (model / f.name).symlink_to(f)
    (model / "config.json").unlink()
    config = json.loads((tiny_model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["FutureForCausalLM"],
                                                   "model_type": "future_moe"}))
    one_line_error(colibri("run", "--model", model, "hi", env=env), "not loaded: plugin colibri-future 9.0 supports "
                   f"colibri >=9, not this colibri {colibri_core.__version__}")


def test_a_plugin_that_fails_to_import_leaves_install_and_version_working(tmp_path):
    site = tmp_path / "site"
    fake_dist(site, "colibri-broken", "1.0", "colibri>=0.1", "raise RuntimeError('broken plugin')\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    one_line_error(colibri("plugins", env=env), "plugin colibri-broken 1.0 failed to import", "COLIBRI_LOAD_PLUGINS")
    assert colibri("--version", env=env).returncode == 0
    # the repair commands run: here they fail only for their own reasons
    one_line_error(colibri("uninstall", "colibri-nope", env=env), "no installed plugin is called 'colibri-nope'",
                   "colibri-broken")
    one_line_error(colibri("install", "colibri-nope", env=env), "unknown plugin 'colibri-nope'")


# ---- install / uninstall -----------------------------------------------------------------------------
def wheel(path: Path, name: str, version: str, requires=(), plugin=True) -> Path:
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
        if plugin:
            z.writestr(f"{info}/entry_points.txt", "[colibri]\nx = x\n")
    return path


def test_install_checks_a_wheel_first(tmp_path):
    w = wheel(tmp_path / "colibri_future-9.0-py3-none-any.whl", "colibri-future", "9.0", ["colibri>=9,<10"])
    one_line_error(colibri("install", w), f"colibri-future 9.0 supports colibri >=9,<10, not this colibri "
                                          f"{colibri_core.__version__}")
    w = wheel(tmp_path / "numpyish-1.0-py3-none-any.whl", "numpyish", "1.0", plugin=False)
    one_line_error(colibri("install", w), "numpyish 1.0 is not a colibri plugin")
    (tmp_path / "junk.whl").write_bytes(b"not a zip")
    one_line_error(colibri("install", tmp_path / "junk.whl"), "not a readable wheel")
    (tmp_path / "notes.txt").write_text("")
    one_line_error(colibri("install", tmp_path / "notes.txt"), "not a wheel (.whl) or a plugin directory")
    one_line_error(colibri("install", tmp_path), "not a plugin directory (it has no pyproject.toml)")
    plugins.check_wheel(wheel(tmp_path / "ok.whl", "colibri-ok", "1.0", ["colibri>=0.1,<0.2"]))


def invoke(monkeypatch, *args, plugin=True):
    """Run the CLI in-process with pip replaced: the pip command lines it would run, the throwaway
    wheel directory written TMP. A build writes the wheel of a plugin (plugin=False: of a project
    that is none)."""
    from typer.testing import CliRunner

    from colibri_core import cli

    calls = []

    def build(argv, **kw):
        calls.append(argv)
        wheel(Path(argv[argv.index("--wheel-dir") + 1]) / "x-1.0-py3-none-any.whl", "x", "1.0", plugin=plugin)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(cli.subprocess, "run", build)
    monkeypatch.setattr(cli.subprocess, "call", lambda argv: calls.append(argv) or 0)
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(cli.app, list(args))
    tmp = calls[0][calls[0].index("--wheel-dir") + 1] if calls and "wheel" in calls[0] else None
    return r, [[a.replace(tmp, "TMP") if tmp else a for a in argv] for argv in calls]


PIN = f"colibri=={colibri_core.__version__}"  # installing a plugin never changes colibri
PIP = [sys.executable, "-m", "pip"]  # colibri's own python: pip installs into colibri's environment


def built(directory: str) -> list[str]:
    return [*PIP, "wheel", "--no-deps", "--use-pep517", "--wheel-dir", "TMP", str(REPO / directory)]


@pytest.mark.parametrize("args, want", [
    (["glm52"], [built("plugins/glm52"), [*PIP, "install", "TMP/x-1.0-py3-none-any.whl", PIN]]),  # a short name
    (["colibri_olmoe"], [built("plugins/olmoe"), [*PIP, "install", "TMP/x-1.0-py3-none-any.whl", PIN]]),
    (["plugins/olmoe"], [built("plugins/olmoe"), [*PIP, "install", "TMP/x-1.0-py3-none-any.whl", PIN]]),
    (["-e", "colibri-qwen36"], [built("plugins/qwen36"), [*PIP, "install", "-e", str(REPO / "plugins/qwen36"), PIN]]),
    (["--editable", "examples/qwen3moe"], [built("examples/qwen3moe"),
                                           [*PIP, "install", "-e", str(REPO / "examples/qwen3moe"), PIN]]),
])
def test_install_builds_checks_then_installs_pinning_colibri(monkeypatch, args, want):
    """A directory (a shipped plugin's name: its directory in this checkout) is built into a wheel,
    which is installed (-e: the directory) once checked; pip runs with colibri's python."""
    r, calls = invoke(monkeypatch, "install", *args)
    assert r.exit_code == 0, r.output
    assert calls == want


def test_install_installs_nothing_when_the_built_wheel_is_no_plugin(monkeypatch):
    for args in (["plugins/olmoe"], ["-e", "plugins/olmoe"]):
        r, calls = invoke(monkeypatch, "install", *args, plugin=False)
        assert r.exit_code == 1 and calls == [built("plugins/olmoe")]
        assert str(r.exception) == (f"{REPO / 'plugins' / 'olmoe'}: x 1.0 is not a colibri plugin (no entry point "
                                    "in the group colibri)")


def test_install_by_name_without_a_checkout_asks_pip(monkeypatch, tmp_path):
    """Installed from a wheel, colibri has no plugins/ beside it: the name goes to pip's index."""
    monkeypatch.setattr(plugins, "REPOSITORY", tmp_path)
    r, calls = invoke(monkeypatch, "install", "colibri-glm52")
    assert r.exit_code == 0, r.output
    assert calls == [[*PIP, "install", "colibri-glm52", PIN]]
    r, calls = invoke(monkeypatch, "install", "-e", "colibri-glm52")
    assert r.exit_code == 1 and "colibri-glm52's source is not beside this colibri" in str(r.exception)


def test_uninstall(monkeypatch):
    for name in ("colibri-olmoe", "olmoe", "colibri_olmoe"):
        r, calls = invoke(monkeypatch, "uninstall", name)
        assert r.exit_code == 0, r.output
        assert calls == [[*PIP, "uninstall", "--yes", "colibri-olmoe"]]
    r, calls = invoke(monkeypatch, "uninstall", "colibri")
    assert calls == [] and "to remove colibri itself" in str(r.exception)
    r, calls = invoke(monkeypatch, "uninstall", "colibri-nope")
    assert calls == [] and "no installed plugin is called 'colibri-nope' (installed: " in str(r.exception)
    assert "colibri-olmoe" in str(r.exception)


# ---- what the wheel carries -------------------------------------------------------------------------
def test_data_found_through_importlib_resources():
    assert demo_model() == resources.files("colibri_core.demo") / "colibri-demo-kjv"
    assert (demo_model() / "colibri.yaml").is_file()
    from colibri_core.server.app import STATIC

    assert STATIC == resources.files("colibri_core.server") / "static" and (STATIC / "index.html").is_file()


def test_package_data_covers_every_tracked_data_file():
    """The wheel's package-data patterns match exactly the data files git tracks (so nothing a run
    writes beside the demo, and nothing untracked, is packaged; nothing tracked is left out)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    matched = {str(f.relative_to(REPO)) for package, patterns in data.items()
               for pattern in patterns for f in (REPO / package.replace(".", "/")).glob(pattern) if f.is_file()}
    tracked = subprocess.run(["git", "ls-files", "colibri_core/demo", "colibri_core/server/static",
                              "colibri_core/atlas_prompts"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip(reason="not a git checkout")
    assert matched == {t for t in tracked if not t.endswith(".py")}
