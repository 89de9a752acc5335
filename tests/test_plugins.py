"""The plugin contract: discovery, the allow-list, validation that names the distribution,
misspelt hooks, resolving config.json, and `colibri plugins` importing no model code."""
import json
import subprocess
import sys
import dataclasses
import types
from pathlib import Path

import pytest

from colibri_core import plugins
from colibri_core.errors import ColibriError
from colibri_core.hookspecs import Architecture, hookimpl

from conftest import colibri

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent

GOOD = Architecture(name="toy", hf_architectures=("ToyForCausalLM",), model_types=("toy",), model="toy.model:Toy")


def plugin_module(**hooks):
    m = types.ModuleType("fake_plugin")
    for name, fn in hooks.items():
        setattr(m, name, fn)
    return m


def registry_with(*archs, name="fake"):
    @hookimpl
    def colibri_register_architectures(register):
        for a in archs:
            register(a)

    reg = plugins.Registry()
    reg.add(name, f"colibri-{name}", "9.9", plugin_module(colibri_register_architectures=colibri_register_architectures))
    return reg


def test_register_and_resolve():
    reg = registry_with(GOOD)
    arch = reg.resolve({"architectures": ["ToyForCausalLM"]})
    assert arch.name == "toy" and arch.plugin == "colibri-fake" and arch.version == "9.9"
    assert reg.resolve({"model_type": "toy"}).name == "toy"
    assert reg.plugins["fake"].hooks == ["colibri_register_architectures"]


@pytest.mark.parametrize("bad, fragment", [
    ("not an architecture", "not a colibri Architecture"),
    (Architecture("Bad Name", ("X",), (), "m:C"), "lower_snake_case"),
    (Architecture("toy", ("X",), (), "no-colon"), "module:Class"),
    (Architecture("toy", (), (), "m:C"), "serves no"),
])
def test_bad_registrations_name_the_distribution(bad, fragment):
    with pytest.raises(ColibriError, match=fragment) as e:
        registry_with(bad)
    assert "colibri-fake 9.9" in str(e.value)


def test_duplicate_architecture_names_both_plugins():
    reg = registry_with(GOOD, name="one")

    @hookimpl
    def colibri_register_architectures(register):
        register(GOOD)

    with pytest.raises(ColibriError, match="colibri-two.*already registered by plugin colibri-one"):
        reg.add("two", "colibri-two", "1.0", plugin_module(colibri_register_architectures=colibri_register_architectures))


def test_misspelt_hook_is_loud():
    @hookimpl
    def colibri_register_architecture(register):  # missing "s"
        pass

    with pytest.raises(ColibriError, match="colibri-typo.*colibri_register_architecture"):
        plugins.Registry().add("typo", "colibri-typo", "0.1", plugin_module(colibri_register_architecture=colibri_register_architecture))


def test_plugin_mistakes_are_one_line_naming_the_plugin():
    """What an author gets wrong, each refused with the plugin's name: a hook without @hookimpl (pluggy
    skipped it: a plugin that served nothing), a hook argument misnamed (an AssertionError from pluggy
    unregistering what it never registered), a hook that raises (a bare TypeError), two plugins serving
    one config (the first loaded won, and a conformance suite tested the other plugin)."""
    def colibri_register_architectures(register):  # no @hookimpl
        register(GOOD)

    with pytest.raises(ColibriError, match="colibri-bare 0.1: colibri_register_architectures lacks @hookimpl"):
        plugins.Registry().add("bare", "colibri-bare", "0.1", plugin_module(colibri_register_architectures=colibri_register_architectures))

    @hookimpl
    def colibri_register_architectures(reg):  # noqa: F811 — the spec's argument is `register`
        pass

    with pytest.raises(ColibriError, match="colibri-arg 0.1: .*reg"):
        plugins.Registry().add("arg", "colibri-arg", "0.1", plugin_module(colibri_register_architectures=colibri_register_architectures))

    @hookimpl
    def colibri_register_architectures(register):  # noqa: F811
        register(Architecture(name="toy", hf_architectures=("X",), model_types=()))  # no model=

    with pytest.raises(ColibriError, match="colibri-boom 0.1: colibri_register_architectures failed: TypeError"):
        plugins.Registry().add("boom", "colibri-boom", "0.1", plugin_module(colibri_register_architectures=colibri_register_architectures))
    reg = registry_with(GOOD, name="one")
    with pytest.raises(ColibriError, match="colibri-two 9.9: architecture other serves ToyForCausalLM, as toy of "
                                           "plugin colibri-one does"):
        reg.add("two", "colibri-two", "9.9", registry_with(dataclasses.replace(GOOD, name="other", model_types=()),
                                                         name="two").plugins["two"].module)


def test_a_string_of_architectures_is_one_name():
    reg = registry_with(dataclasses.replace(GOOD, hf_architectures="ToyForCausalLM", model_types="toy"))
    assert reg.architectures["toy"].hf_architectures == ("ToyForCausalLM",)
    assert reg.resolve({"architectures": ["ToyForCausalLM"]}).name == "toy"
    with pytest.raises(ColibriError):
        reg.resolve({"architectures": ["T"]})


def test_unserved_architecture_names_the_plugin_to_install():
    reg = plugins.Registry()
    with pytest.raises(ColibriError, match="colibri install colibri-qwen36"):
        reg.resolve({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe"})
    with pytest.raises(ColibriError, match="knows no plugin"):
        reg.resolve({"architectures": ["MysteryForCausalLM"], "model_type": "mystery"})


def test_allow_list(monkeypatch):
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "")
    reg = plugins.Registry()
    reg.load_entry_points()
    assert reg.plugins == {} and "colibri-olmoe" in reg.skipped
    with pytest.raises(ColibriError, match="COLIBRI_LOAD_PLUGINS leaves out"):
        reg.resolve({"model_type": "olmoe"})
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "colibri-olmoe")
    reg = plugins.Registry()
    reg.load_entry_points()
    assert list(reg.architectures) == ["olmoe"]
    with pytest.raises(ColibriError, match="no loaded plugin serves .*COLIBRI_LOAD_PLUGINS leaves out .*colibri-glm52"):
        reg.resolve({"architectures": ["ThirdPartyForCausalLM"], "model_type": "third_party"})
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "Colibri_OLMoE, olmoee")  # as pip spells names; a typo
    reg = plugins.Registry()
    with pytest.warns(UserWarning, match="names olmoee, which no installed plugin is called"):
        reg.load_entry_points()
    assert list(reg.architectures) == ["olmoe"]


def test_plugins_json_lists_olmoe():
    r = colibri("plugins", "--json")
    assert r.returncode == 0, r.stderr
    (olmoe,) = [p for p in json.loads(r.stdout) if p["name"] == "colibri-olmoe"]
    assert olmoe["architectures"] == [{"name": "olmoe", "hf_architectures": ["OlmoeForCausalLM"],
                                       "model_types": ["olmoe"], "model": "colibri_olmoe.model:Olmoe"}]
    assert olmoe["hooks"] == ["colibri_register_architectures"] and olmoe["version"]


def test_plugins_text_says_what_each_architecture_serves():
    r = colibri("plugins")
    assert r.returncode == 0, r.stderr
    assert "colibri-olmoe 0.1.0: hooks colibri_register_architectures" in r.stdout
    assert ("  qwen36: architectures Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration; "
            "model_type qwen3_5_moe, qwen3_5_moe_text") in r.stdout


def test_known_plugins_are_shipped_and_serve_what_they_claim():
    """Every distribution colibri names for a model_type is one this repository ships, in the
    directory the table says, and (installed, as `make setup-test` does) registers an architecture
    serving that model_type."""
    reg = plugins.registry()
    for model_type, dist in plugins.KNOWN_PLUGINS.items():
        assert dist in plugins.SHIPPED_PLUGINS, f"{model_type}: {dist} is not shipped"
        assert any(a.plugin == dist and model_type in a.model_types for a in reg.architectures.values()), \
            f"{dist} does not serve model_type {model_type}"
    for dist, where in plugins.SHIPPED_PLUGINS.items():
        pyproject = tomllib.loads((REPO / where / "pyproject.toml").read_text())
        assert pyproject["project"]["name"] == dist and pyproject["project"]["entry-points"]["colibri"]
        assert plugins.shipped_plugin(dist) == REPO / where
    with pytest.raises(ColibriError, match="unknown plugin 'colibri-nope': colibri ships colibri-olmoe, "):
        plugins.shipped_plugin("colibri-nope")


def test_test_module_names_are_unique():
    """pytest imports test modules by their file name (rootdir without __init__.py files): two
    test_conformance.py under different plugins would collide, so every name under testpaths differs."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "examples" in config["testpaths"], "the example plugin's tests must run with `make test`"
    names = [p.name for root in config["testpaths"] for p in (REPO / root).rglob("test_*.py")
             if ".venv" not in p.parts and "build" not in p.parts]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert "test_qwen3moe.py" in names


def test_listing_plugins_imports_no_model_code():
    code = ("import sys; from colibri_core import plugins; plugins.registry(); "
            "heavy = [m for m in ('numpy', 'colibri_olmoe.model', 'colibri_core.engine') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plugin_commands_hook(tmp_path):
    """A plugin can add a CLI command (checked through the real typer app)."""
    import typer
    from typer.testing import CliRunner

    @hookimpl
    def colibri_register_commands(app):
        @app.command()
        def hello():
            """Say hello."""
            print("hello from a plugin")

    reg = plugins.Registry()
    reg.add("cmd", "colibri-cmd", "1.0", plugin_module(colibri_register_commands=colibri_register_commands))
    app = typer.Typer()

    @app.command()
    def noop():
        pass

    reg.call_commands(app)
    assert "hello from a plugin" in CliRunner().invoke(app, ["hello"]).output


def test_trace_plugins(monkeypatch, capsys):
    monkeypatch.setenv("COLIBRI_TRACE_PLUGINS", "1")
    registry_with(GOOD)
    reg = plugins.Registry()
    reg.load_entry_points()
    reg.call_commands(types.SimpleNamespace(command=lambda *a, **k: (lambda f: f)))
    assert "colibri_register_commands" in capsys.readouterr().err
