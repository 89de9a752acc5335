"""The command line: generation, the budget, and bad input (one line, exit 1, nothing written)."""
import os
import shutil

import pytest
import yaml

from conftest import colibri


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
    assert '"expert_hits"' in r.stderr and "(conversation reset)" in r.stderr


def test_install_runs_pip_in_colibri_environment(tmp_path):
    """`colibri install DIR` installs a third-party plugin that `colibri plugins` then lists."""
    import sys
    import subprocess

    pkg = tmp_path / "colibri-toyplug"
    (pkg / "colibri_toyplug").mkdir(parents=True)
    (pkg / "colibri_toyplug" / "__init__.py").write_text(
        "from colibri_core.hookspecs import Architecture, hookimpl\n\n@hookimpl\n"
        "def colibri_register_architectures(register):\n"
        "    register(Architecture('toy', ('ToyForCausalLM',), ('toy',), 'colibri_toyplug.model:Toy'))\n")
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "colibri-toyplug"\nversion = "0.0.1"\n'
        '[project.entry-points.colibri]\ntoyplug = "colibri_toyplug"\n')
    try:
        r = colibri("install", pkg)
        assert r.returncode == 0, r.stderr
        listed = colibri("plugins", "--json")
        assert "colibri-toyplug" in listed.stdout and '"toy"' in listed.stdout
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "colibri-toyplug"], check=True)
    one_line_error(colibri("install", tmp_path / "missing" / "plugin-dir-name-that-is-not-on-pypi"))
