"""The command line: generation, the budget, and bad input (one line, exit 1, nothing written)."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from conftest import COLIBRI, colibri


def snapshot(d):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def test_run_prints_text_then_stats(tiny_model):
    r = colibri("run", "--model", tiny_model, "--max-tokens", "8", "the quick brown")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tok/s" in r.stderr and "expert hit rate" in r.stderr and "peak RSS" in r.stderr


def test_model_from_environment(tiny_model):
    r = colibri("run", "--max-tokens", "2", "fox", env={**os.environ, "COLIBRI_MODEL": str(tiny_model)})
    assert r.returncode == 0, r.stderr


def test_small_budget_streams_experts_and_gives_the_same_tokens(tiny_model):
    from colibri_core import load

    prompt = list(range(3, 40))
    with load(tiny_model) as full:
        want = full.generate(prompt, 12, stop_ids=())
        assert full.stats()["cache_slots_per_layer"] == 8
    c = full.container
    tiny_budget = full.resident_bytes + len(c.moe_layers) * c.expert_nbytes  # one slot per layer
    with load(tiny_model, ram=tiny_budget) as small:
        assert small.generate(prompt, 12, stop_ids=()) == want
        s = small.stats()
    assert s["cache_slots_per_layer"] == 1
    assert s["expert_misses"] > 0 and s["bytes_read"] > 0
    assert s["expert_misses"] > full.stats()["expert_misses"]


def test_arithmetic_options_reach_the_engine(tiny_model):
    """--activations and --kv-cache (or their environment variables) choose the engine's arithmetic,
    which --stats reports; an unknown one is one line."""
    r = colibri("run", "--model", tiny_model, "--max-tokens", "3", "--stats", "--activations", "int8", "--kv-cache",
                "f16", "fox")
    assert r.returncode == 0 and "activations int8 · KV cache f16" in r.stderr, r.stderr
    r = colibri("run", "--model", tiny_model, "--max-tokens", "3", "--stats", "fox",
                env={**os.environ, "COLIBRI_ACTIVATIONS": "int8", "COLIBRI_KV_CACHE": "f16"})
    assert r.returncode == 0 and "activations int8 · KV cache f16" in r.stderr, r.stderr
    assert "activations f32 · KV cache f32" in colibri("run", "--model", tiny_model, "--max-tokens", "2", "--stats",
                                                      "fox").stderr
    one_line_error(colibri("run", "--model", tiny_model, "--activations", "int3", "fox"),
                   "unknown activation arithmetic 'int3'")
    one_line_error(colibri("chat", "--model", tiny_model, "--kv-cache", "bf16"), "unknown KV cache type 'bf16'")
    one_line_error(colibri("serve", "--model", tiny_model, "--activations", "int3"), "unknown activation arithmetic")


def test_cli_small_budget_shows_misses(tiny_model):
    a = colibri("run", "--model", tiny_model, "--max-tokens", "10", "--temperature", "0", "lazy dog")
    b = colibri("run", "--model", tiny_model, "--max-tokens", "10", "--cache-slots", "1", "lazy dog")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout
    assert "0 misses" not in b.stderr


def one_line_error(r, *fragments):
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: "), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_not_a_model(tmp_path):
    before = snapshot(tmp_path)
    one_line_error(colibri("run", "--model", tmp_path, "hi"), str(tmp_path))
    assert snapshot(tmp_path) == before


def test_unknown_architecture_names_the_plugin(tiny_model, tmp_path):
    d = tmp_path / "glm"
    shutil.copytree(tiny_model, d)
    cfg = (d / "config.json").read_text().replace('"OlmoeForCausalLM"', '"GlmMoeDsaForCausalLM"').replace('"olmoe"', '"glm_moe_dsa"')
    (d / "config.json").write_text(cfg)
    before = snapshot(d)
    only_olmoe = {**os.environ, "COLIBRI_LOAD_PLUGINS": "olmoe"}  # colibri-glm52 may be installed
    one_line_error(colibri("run", "--model", d, "hi", env=only_olmoe), "colibri-glm52")
    assert snapshot(d) == before


@pytest.mark.parametrize("damage", ["truncate", "flip", "yaml"])
def test_damaged_container(tiny_model, tmp_path, damage):
    d = tmp_path / "m"
    shutil.copytree(tiny_model, d)
    expert_file = sorted((d).rglob("*.bin"))[0]
    if damage == "truncate":
        data = expert_file.read_bytes()
        expert_file.write_bytes(data[: len(data) - 4096])
    elif damage == "flip":
        from colibri_core.container import Container

        data = bytearray(expert_file.read_bytes())
        for offset in range(0, len(data), Container(d).expert_nbytes):
            data[offset + 100] ^= 0xFF  # inside every expert of the first MoE layer
        expert_file.write_bytes(bytes(data))
    else:
        (d / "colibri.yaml").write_text("format: colibri-container\nformat_version: [1\n")
    before = snapshot(d)
    r = colibri("run", "--model", d, "--max-tokens", "4", "the quick brown fox")
    one_line_error(r)
    assert snapshot(d) == before


def test_convert_errors_are_one_line(tmp_path):
    one_line_error(colibri("convert", tmp_path / "nope", tmp_path / "out"), "nope")
    assert not (tmp_path / "out").exists()


def test_convert_cli(tiny_checkpoint, tmp_path):
    r = colibri("convert", tiny_checkpoint, tmp_path / "c", "--quant", "int8")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load((tmp_path / "c" / "colibri.yaml").read_text())["quant"] == "int8"
    one_line_error(colibri("convert", tiny_checkpoint, tmp_path / "c2", "--quant", "int3"), "int3")


def test_chat_streams_and_handles_commands(tiny_model):
    r = colibri("chat", "--model", tiny_model, "--max-tokens", "5", "--temperature", "0",
                input="hello there\n/stats\nand again\n/reset\nfresh start\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("tok/s") == 3  # one stats line per answer
    assert "expert_hits " in r.stderr and "per-layer hit rate" in r.stderr and "(conversation reset)" in r.stderr


@pytest.mark.parametrize("option, value, message", [
    ("--max-tokens", "0", "max_new_tokens must be an integer of at least 1"), ("--max-tokens", "-1", "max_new_tokens"),
    ("--temperature", "nan", "temperature"), ("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
    ("--top-p", "nan", "top_p"), ("--top-k", "-3", "top_k"), ("--pin-gb", "nan", "--pin-gb"),
    ("--pin-gb", "inf", "--pin-gb")])
def test_sampling_out_of_range_is_one_line(tiny_model, option, value, message):
    """Each was a traceback, or (--max-tokens 0) a generation that never ended."""
    one_line_error(colibri("run", "--model", tiny_model, option, value, "fox", timeout=120), message)


def test_seed_minus_one_is_random(tiny_model):
    """As the server takes it (and llama.cpp's --seed -1); below that, a usage error."""
    runs = [colibri("run", "--model", tiny_model, "--max-tokens", "12", "--temperature", "1", "--seed", "-1", "fox")
            for _ in range(3)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert len({r.stdout for r in runs}) > 1
    assert colibri("run", "--model", tiny_model, "--seed", "-2", "fox").returncode == 2


def tokens_made(stderr: str) -> int:
    return int(stderr.strip().splitlines()[-1].split()[0].lstrip("["))


def test_the_context_bounds_a_run(tmp_path):
    """The demo's context is 1024 tokens: a longer prompt is one line (as the server's 400), and an
    answer ends where the context does."""
    line = "And the LORD said unto Moses, "
    one_line_error(colibri("run", "--max-tokens", "5", line * 300), "this model's context is 1024")
    from colibri_core import load
    from colibri_core.demo import demo_model

    with load(demo_model()) as engine:
        n = len(engine.tokenizer.encode(line * 144))
    assert 1000 < n < 1020
    r = colibri("run", "--max-tokens", "200", "--temperature", "0", line * 144)
    assert r.returncode == 0 and tokens_made(r.stderr) <= 1024 - n, r.stderr


def test_output_that_cannot_be_written_is_one_line(tiny_model):
    with open("/dev/full", "w") as full:
        r = subprocess.run([*COLIBRI, "run", "--model", str(tiny_model), "--max-tokens", "3",
                            "fox"], stdout=full, stderr=subprocess.PIPE, text=True)
    one_line_error(r, "No space left on device")
    p = subprocess.Popen([*COLIBRI, "run", "--model", str(tiny_model), "--max-tokens", "64",
                          "--temperature", "0", "fox"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.read(1)
    p.stdout.close()  # the reader goes away (`| head -c 1`)
    assert "Traceback" not in p.stderr.read() and p.wait() in (0, 1)


def test_chat_stats_are_the_turns(tiny_model):
    r = colibri("chat", "--model", tiny_model, "--max-tokens", "3", "--temperature", "0",
                input="hello there\nand again\n/exit\n")
    lines = [line for line in r.stderr.splitlines() if "tok/s" in line]
    assert r.returncode == 0 and len(lines) == 2, r.stderr
    assert all(tokens_made(line) <= 3 for line in lines), lines  # the second turn's, not the running total


def test_demo_sessions_are_saved_outside_the_package(tmp_path):
    """The bundled demo may sit in a read-only site-packages: its sessions go to the user's state dir,
    and nothing is written beside it."""
    from colibri_core.demo import demo_model

    before = snapshot(demo_model())
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    r = colibri("chat", "--session", "s", "--max-tokens", "3", input="And God said\n/exit\n", env=env)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.rglob("s.coli_session")), sorted(tmp_path.rglob("*"))
    assert snapshot(demo_model()) == before


# ---- colibri install, into a throwaway environment ------------------------------------------------
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def throwaway_env(tmp_path) -> Path:
    """A fresh venv (no pip of its own) that sees everything installed beside colibri: `colibri
    install` run with its python installs into it, never into colibri's own environment."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]  # processed as a site dir, so its editable installs count
    (Path(purelib) / "colibri-parent.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


def colibri_in(python: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "colibri_core", *map(str, args)], capture_output=True, text=True)


def where(python: Path, module: str) -> Path:
    code = f"import {module}; print({module}.__file__)"
    return Path(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip())


def test_example_plugin_installs_as_the_guide_says(throwaway_env, tmp_path):
    """docs/plugins.md's last step: `colibri install DIR` (a regular install: the files are copied)
    and `colibri plugins` lists the plugin with what it serves."""
    example = tmp_path / "qwen3moe"  # a copy, so the build leaves nothing in the repository
    shutil.copytree(REPO / "examples" / "qwen3moe", example,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    r = colibri_in(throwaway_env, "install", example)
    assert r.returncode == 0, r.stderr
    assert throwaway_env.parent.parent in where(throwaway_env, "colibri_qwen3moe").parents  # installed, not linked
    (plugin,) = [p for p in json.loads(colibri_in(throwaway_env, "plugins", "--json").stdout)
                 if p["name"] == "colibri-qwen3moe"]
    assert plugin["architectures"] == [{"name": "qwen3moe", "hf_architectures": ["Qwen3MoeForCausalLM"],
                                        "model_types": ["qwen3_moe"], "model": "colibri_qwen3moe.model:Qwen3Moe"}]
    text = colibri_in(throwaway_env, "plugins").stdout
    assert "qwen3moe: architectures Qwen3MoeForCausalLM; model_type qwen3_moe" in text


def test_install_editable_picks_up_edits(throwaway_env, tmp_path):
    """`colibri install -e DIR`: the environment points at DIR, so an edit counts without reinstalling."""
    pkg = tmp_path / "colibri-toyplug"
    (pkg / "colibri_toyplug").mkdir(parents=True)
    register = ("from colibri_core.hookspecs import Architecture, hookimpl\n\n@hookimpl\n"
                "def colibri_register_architectures(register):\n"
                "    register(Architecture({name!r}, ('ToyForCausalLM',), ('toy',), 'colibri_toyplug.model:Toy'))\n")
    (pkg / "colibri_toyplug" / "__init__.py").write_text(register.format(name="toy"))
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "colibri-toyplug"\nversion = "0.0.1"\n'
        '[project.entry-points.colibri]\ntoyplug = "colibri_toyplug"\n')
    r = colibri_in(throwaway_env, "install", "--editable", pkg)
    assert r.returncode == 0, r.stderr
    assert where(throwaway_env, "colibri_toyplug") == pkg / "colibri_toyplug" / "__init__.py"
    assert "toy: architectures ToyForCausalLM; model_type toy" in colibri_in(throwaway_env, "plugins").stdout
    (pkg / "colibri_toyplug" / "__init__.py").write_text(register.format(name="toy_renamed"))
    assert "toy_renamed: architectures ToyForCausalLM" in colibri_in(throwaway_env, "plugins").stdout


def test_install_errors_are_one_line(tmp_path):
    one_line_error(colibri("install", tmp_path / "missing" / "plugin-dir"), "no such plugin directory")
    one_line_error(colibri("install", "colibri-mystery"), "unknown plugin 'colibri-mystery'",
                   "colibri-olmoe, colibri-glm52, colibri-qwen36")
    wheel = tmp_path / "x.whl"
    wheel.write_bytes(b"")
    one_line_error(colibri("install", "-e", wheel), "--editable needs a plugin directory")
    # a directory that is no colibri plugin, or one for another colibri: refused before pip runs
    notplugin = tmp_path / "notplugin"
    notplugin.mkdir()
    (notplugin / "pyproject.toml").write_text('[project]\nname = "notplugin"\nversion = "0.0.1"\n')
    one_line_error(colibri("install", notplugin), "notplugin 0.0.1 is not a colibri plugin")
    future = tmp_path / "future"
    future.mkdir()
    (future / "pyproject.toml").write_text('[project]\nname = "colibri-future"\nversion = "9.0"\n'
                                           'dependencies = ["colibri>=9"]\n'
                                           '[project.entry-points.colibri]\nfuture = "colibri_future"\n')
    one_line_error(colibri("install", future), "colibri-future 9.0 supports colibri >=9, not this colibri")


@pytest.mark.parametrize("args, want", [
    (["colibri-olmoe"], [str(REPO / "plugins" / "olmoe")]),
    (["colibri_glm52"], [str(REPO / "plugins" / "glm52")]),
    (["-e", "colibri-qwen36"], ["-e", str(REPO / "plugins" / "qwen36")]),
    (["--editable", "examples/qwen3moe"], ["-e", str(REPO / "examples" / "qwen3moe")]),
])
def test_install_runs_pip_in_colibri_environment(monkeypatch, args, want):
    """A shipped plugin's name installs its directory in this checkout; pip runs with colibri's python."""
    from typer.testing import CliRunner

    import colibri_core
    from colibri_core import cli

    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda argv: calls.append(argv) or 0)
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(cli.app, ["install", *args])
    assert r.exit_code == 0, r.output
    assert calls == [[sys.executable, "-m", "pip", "install", *want, f"colibri=={colibri_core.__version__}"]]
