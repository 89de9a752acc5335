"""The command line: generation, the budget, and bad input (one line, exit 1, nothing written)."""
import json
import os
import re
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
    plain = colibri("run", "--model", tiny_model, "--max-tokens", "2", "--stats", "fox").stderr
    assert "activations f32 · KV cache f32" in plain
    assert re.search(r"\nprefix cache 0 entries \(0 B of [\d.]+ [KMG]?B\) · hits 0 \(0 from disk\) · cached tokens 0 "
                     r"of \d+ prompt tokens$", plain.strip()), plain
    one_line_error(colibri("run", "--model", tiny_model, "--activations", "int3", "fox"),
                   "unknown activation arithmetic 'int3'")
    one_line_error(colibri("chat", "--model", tiny_model, "--kv-cache", "bf16"), "unknown KV cache type 'bf16'")
    one_line_error(colibri("serve", "--model", tiny_model, "--activations", "int3"), "unknown activation arithmetic")


def test_every_command_that_loads_a_model_lists_the_same_engine_options():
    """run, chat, serve, web and bench (`colibri bench --model`, `colibri bench model`) take every
    EngineOptions field that has a flag, from that one definition, and their --help lists each."""
    from dataclasses import fields

    import typer
    from typer.testing import CliRunner

    from colibri_core.cli import app
    from colibri_core.options import EngineOptions

    want = {f.name: f.metadata["flag"].split("/") for f in fields(EngineOptions) if f.metadata["flag"]}
    group = typer.main.get_command(app)
    commands = {"run": group.commands["run"], "chat": group.commands["chat"], "serve": group.commands["serve"],
                "web": group.commands["web"], "bench": group.commands["bench"],
                "bench model": group.commands["bench"].commands["model"]}
    for name, command in commands.items():
        got = {p.name: p.opts + p.secondary_opts for p in command.params if p.name in want}
        assert got == want, name
        shown = CliRunner().invoke(app, [*name.split(), "--help"], env={"COLUMNS": "200"}).output
        assert all(flag in shown for flags in want.values() for flag in flags), (name, shown)


def test_engine_options_are_checked_alike_in_every_command(tiny_model):
    """A wrong engine option is the same one line in each command (serve checked none of these)."""
    for command in ("run", "chat", "serve", "web"):
        one_line_error(colibri(command, "--model", tiny_model, "--policy", "nope", *(["fox"] if command == "run" else [])),
                       "unknown cache policy 'nope'")
    one_line_error(colibri("serve", "--model", tiny_model, "--io-threads", "0"), "--io-threads must be at least 1")
    one_line_error(colibri("bench", "--model", tiny_model, "--ram", "1GB"), "colibri bench sets the budget itself")


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
    assert r.stderr.count("peak RSS") == 3  # one stats line per answer
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


@pytest.mark.system
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


@pytest.mark.system
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


def installed_in(python: Path, dist: str) -> bool:
    code = f"import importlib.metadata as m\ntry:\n    m.version({dist!r})\nexcept m.PackageNotFoundError:\n    exit(1)"
    return subprocess.run([python, "-c", code]).returncode == 0


@pytest.mark.system  # real pip builds in a throwaway environment: seconds each
def test_install_builds_a_directory_into_a_wheel_and_checks_it_first(throwaway_env, tmp_path):
    """What only running the project tells (a setup.py alone; entry points left to setup.py, `dynamic`)
    is read off the wheel built from it, in an isolated build: a project that is no colibri plugin is
    one line and nothing is installed (both were installed, exit 0); one that is, is installed."""
    setup_only = tmp_path / "setuponly"
    setup_only.mkdir()
    (setup_only / "setup.py").write_text('from setuptools import setup\nsetup(name="setuponly", version="0.1")\n')
    one_line_error(colibri_in(throwaway_env, "install", setup_only), "setuponly 0.1 is not a colibri plugin")
    assert not installed_in(throwaway_env, "setuponly")

    def dynamic(name: str, entry_points: dict) -> Path:
        d = tmp_path / name
        (d / name).mkdir(parents=True)
        (d / name / "__init__.py").write_text("")
        (d / "pyproject.toml").write_text(
            '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
            f'[project]\nname = "{name}"\nversion = "0.1"\ndynamic = ["entry-points"]\n')
        (d / "setup.py").write_text(f"from setuptools import setup\nsetup(packages=[{name!r}], "
                                    f"entry_points={entry_points!r})\n")
        return d

    notplugin = dynamic("dyntool", {"console_scripts": ["dyntool = dyntool:main"]})
    one_line_error(colibri_in(throwaway_env, "install", notplugin), "dyntool 0.1 is not a colibri plugin")
    assert not installed_in(throwaway_env, "dyntool")
    plugin = dynamic("dynplug", {"colibri": ["dynplug = dynplug"]})
    r = colibri_in(throwaway_env, "install", plugin)
    assert r.returncode == 0, r.stderr
    assert throwaway_env.parent.parent in where(throwaway_env, "dynplug").parents  # the wheel, installed


def test_ports_out_of_range_are_one_line(tiny_model):
    """`serve --port 99999` listened on port 34463 (99999 % 65536)."""
    for command in ("serve", "web"):
        for port in ("99999", "65536", "-1"):
            one_line_error(colibri(command, "--model", tiny_model, "--port", port, timeout=60),
                           f"--port must be 0 (any free port) to 65535, got {port}")


def test_a_hot_store_larger_than_any_machine_is_one_line(tiny_model):
    """--pin-gb 1e308 was an OverflowError traceback (its bytes are no integer), in run and plan alike."""
    for value in ("1e308", "2e10"):
        one_line_error(colibri("run", "--model", tiny_model, "--pin-gb", value, "fox"),
                       f"--pin-gb {value.replace('e', 'e+')} is more memory than any machine has (at most "
                       "1.845e+10: 2**64 bytes)")
        one_line_error(colibri("plan", "--model", tiny_model, "--pin-gb", value), "is more memory than any machine")


def test_top_k_is_bounded_alike_in_the_cli_and_the_server(tiny_model):
    """RELIABILITY.md's bound, top_k < 2**31: the server's schema let 2**31 through, the engine any k.
    Below it, a k past the vocabulary is no cut (the tiny model's vocabulary: 300 tokens)."""
    from colibri_core.server.schemas import ApiError, parse_sampling

    with pytest.raises(ApiError, match="'top_k' must be at most 2147483647, got 2147483648"):
        parse_sampling({"top_k": 2**31})
    assert parse_sampling({"top_k": 2**31 - 1}).top_k == 2**31 - 1
    one_line_error(colibri("run", "--model", tiny_model, "--top-k", str(2**31), "fox"),
                   "top_k must be 0 (no cut) or more and below 2**31, got 2147483648")
    runs = [colibri("run", "--model", tiny_model, "--max-tokens", "6", "--temperature", "1", "--seed", "7",
                    *top_k, "fox") for top_k in ([], ["--top-k", str(2**31 - 1)])]
    assert runs[0].returncode == runs[1].returncode == 0 and runs[0].stdout == runs[1].stdout, runs[1].stderr


def test_text_that_is_not_utf8_is_one_line(tiny_model):
    """`colibri run $'\\xff'` was a TypeError traceback from the tokenizer; a chat line is refused and
    the chat goes on."""
    one_line_error(colibri("run", "--model", tiny_model, os.fsdecode(b"fox \xff")),
                   "an argument is not valid UTF-8: b'fox \\xff'")
    r = subprocess.run([*COLIBRI, "chat", "--model", str(tiny_model), "--max-tokens", "2"], capture_output=True,
                       input=b"\xff\nfox\n/exit\n")
    assert r.returncode == 0 and r.stderr.count(b"peak RSS") == 1, r.stderr
    assert b"colibri: error: this line is not valid UTF-8: b'\\xff'" in r.stderr and b"Traceback" not in r.stderr


def can_mount_read_only(d: Path) -> bool:
    """Whether this machine lets a process mount `d` read-only in a namespace of its own (unshare -rm)."""
    try:
        probe = subprocess.run(["unshare", "-rm", "mount", "--bind", "-o", "ro", d, d], capture_output=True)
    except FileNotFoundError:
        return False
    return probe.returncode == 0


def test_a_session_that_cannot_be_saved_is_refused_before_the_first_answer(tiny_model, tmp_path):
    """`chat --session` where the sessions directory cannot be made answered one turn, then exited at
    the save: a dangling link in the directory's place (mkdir fails, on any machine). (A read-only
    model directory is no such case: its sessions go to the per-user state directory,
    test_cli_more.py.)"""
    d = tmp_path / "m"
    shutil.copytree(tiny_model, d)
    chat = [*COLIBRI, "chat", "--model", str(d), "--session", "s", "--max-tokens", "3"]
    (d / ".sessions").symlink_to(tmp_path / "gone" / "sessions")
    r = subprocess.run(chat, capture_output=True, text=True, input="fox\n/exit\n")
    one_line_error(r, f"cannot save session s in {d / '.sessions'}: File exists")
    assert r.stdout == ""  # no answer
