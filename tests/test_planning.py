"""`colibri_core.planning` sizes a model from config.json alone: it must agree exactly with what
the converter writes (resident tensors, expert files) for the same config and quantisation. Its
split of a budget is the engine's (tests/test_store.py compares the two)."""
import json
import os

import numpy as np
import pytest
from conftest import colibri

from colibri_core import load
from colibri_core.container import Container
from colibri_core.convert import convert_checkpoint
from colibri_core.errors import ColibriError
from colibri_core.planning import measured, plan_config, report


def check_plan_matches_container(model_dir):
    c = Container(model_dir)
    p = plan_config(c.config, c.quant)
    assert {k: p[k] for k in measured(model_dir)} == measured(model_dir)
    return p


@pytest.mark.parametrize("quant", ["f32", "int8", "int4"])
def test_plan_of_olmoe_matches_its_container(tiny_checkpoint, tmp_path, quant):
    convert_checkpoint(tiny_checkpoint, tmp_path / quant, quant, progress=False)
    p = check_plan_matches_container(tmp_path / quant)
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    assert p["architecture"] == "olmoe"
    assert p["kv_floats_per_token_per_layer"] == 2 * cfg["hidden_size"]  # K and V, MHA
    assert p["state_bytes_per_token"] == 4 * 2 * cfg["hidden_size"] * cfg["num_hidden_layers"]


def test_plan_refuses_unknown_quant(tiny_checkpoint):
    with pytest.raises(ColibriError, match="unknown quantisation"):
        plan_config(json.loads((tiny_checkpoint / "config.json").read_text()), "int3")


def test_plan_sizes_the_state_at_the_kv_cache_type(tiny_checkpoint, tmp_path):
    """A float16 KV cache halves the part of the state a model declares in KV caches (all of OLMoE's:
    `kv_cache_floats_per_token`); `colibri plan --kv-cache` says so, and refuses an unknown type."""
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    f32, f16 = plan_config(config, "int4"), plan_config(config, "int4", kv_cache="f16")
    assert (f32["kv_cache"], f16["kv_cache"]) == ("f32", "f16")
    assert f16["state_bytes_per_token"] * 2 == f32["state_bytes_per_token"] == 4 * 2 * config["hidden_size"] * config["num_hidden_layers"]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    args = ("plan", "--config", cfg, "--ram", "1GB", "--disk-bw", "1GB", "--mem-bw", "1GB", "--json")
    r = colibri(*args, "--kv-cache", "f16")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["state_bytes_per_token"] == f16["state_bytes_per_token"]
    assert json.loads(colibri(*args, env={**os.environ, "COLIBRI_KV_CACHE": "f16"}).stdout)["model"]["kv_cache"] == "f16"
    r = colibri(*args, "--kv-cache", "bf16")
    assert r.returncode == 1 and r.stderr.strip() == "colibri: error: unknown KV cache type 'bf16' (expected one of f32, f16)"


def test_plan_checks_the_hot_store_size_where_the_split_is_made(tiny_checkpoint, tmp_path):
    """`planning.split` is the split `run` and `plan` share: a negative --pin-gb is one line for plan
    too (it used to pin a negative number of experts), and a hot-store that leaves a layer no cache
    slot is refused by the rule itself."""
    cfg = tmp_path / "config.json"
    cfg.write_text((tiny_checkpoint / "config.json").read_text())
    args = ("plan", "--config", cfg, "--disk-bw", "1GB", "--mem-bw", "1GB", "--ram")
    r = colibri(*args, "1GB", "--pin-gb", "-1")
    assert r.returncode == 1 and r.stderr.strip() == "colibri: error: --pin-gb must be 0 or more, got -1.0"
    p = json.loads(colibri(*args, "1GB", "--json").stdout)
    ram = p["model"]["dense_bytes"] + p["experts_bytes_total"] // 2  # room for half the experts
    r = colibri(*args, str(ram), "--pin-gb", str(ram / 1e9))
    assert r.returncode == 1 and "leaves no cache slot in some layer" in r.stderr, r.stderr


def test_plan_shows_the_prefix_cache_the_engine_holds(tiny_model):
    """The prefix cache sits beside the budget; `plan` sizes it with the engine's own rule (a tenth of
    the budget by default, --prefix-cache as given), so a server holds what was planned."""
    bw = dict(disk_bw="1GB", mem_bw="1GB")
    for size, want in ((None, 5_000_000), ("2MB", 2_000_000), (0, 0)):
        planned = report(model=tiny_model, ram="50MB", prefix_cache=size, **bw)["prefix_cache"]["bytes"]
        with load(tiny_model, ram="50MB", prefix_cache=size) as engine:
            assert planned == engine.stats()["prefix_cache_budget"] == want
    args = ("plan", "--model", tiny_model, "--ram", "50MB", "--disk-bw", "1GB", "--mem-bw", "1GB")
    r = colibri(*args)
    assert r.returncode == 0 and "prefix cache, beside it    5.0 MB (states of recent prompts: 10% of the budget" in r.stdout
    assert "off (--prefix-cache 0)" in colibri(*args, "--prefix-cache", "0").stdout
    assert json.loads(colibri(*args, "--prefix-cache", "2MB", "--json").stdout)["prefix_cache"] == {
        "bytes": 2_000_000, "default_share": None}
    r = colibri(*args, "--prefix-cache", "lots")
    assert r.returncode == 1 and r.stderr.startswith("colibri: error: cannot read size 'lots'")
    with pytest.raises(ColibriError, match="--prefix-cache must be 0 [(]off[)] or more, got -1"):
        report(model=tiny_model, prefix_cache=-1, **bw)



def test_plan_shows_the_read_path_the_engine_takes(tiny_model):
    """`plan`'s read path is the engine's choice (planning.read_direct): O_DIRECT where experts are
    read while decoding, the page cache where all are cached, as --direct / --no-direct say."""
    bw = dict(disk_bw="1GB", mem_bw="1GB")
    m = report(model=tiny_model, ram="50MB", **bw)["model"]
    small = m["dense_bytes"] + 3 * m["moe_layers"] * m["expert_nbytes"]  # 3 experts a layer cached, or about
    for ram, asked, streamed in ((small, None, True), ("50MB", None, False), (small, False, True), ("50MB", True, False)):
        p = report(model=tiny_model, ram=ram, read_asked=asked, **bw)
        assert streamed == (p["split"]["cache_slots"] < p["model"]["n_experts"])
        assert p["read_direct"] == (streamed if asked is None else asked)
        with load(tiny_model, ram=ram, direct=asked, usage=False) as engine:
            assert engine.store.sources[0].direct_asked == p["read_direct"]
    args = ("plan", "--model", tiny_model, "--ram", "50MB", "--disk-bw", "1GB", "--mem-bw", "1GB")
    assert "read path: page cache (by default: every expert is cached)" in colibri(*args).stdout
    assert "read path: O_DIRECT (--direct)" in colibri(*args, "--direct").stdout


def test_the_engine_prefix_cache_never_holds_more_than_its_budget(tiny_model):
    """Prompts past the budget evict the least recently used: after every one the cache holds whole
    entries (each prompt's of the same size) within the budget, and still serves the latest."""
    # prompts of the same length sharing no prefix (their own seeds: no other test's prompt starts them)
    prompts = [list(np.random.default_rng(4700 + i).integers(3, 300, 130)) for i in range(7)]
    with load(tiny_model, prefill_chunk=64, prefix_cache="64MB") as engine:
        engine.generate(prompts[6], 2, stop_ids=())
        one = engine.stats()["prefix_cache_bytes"]  # one prompt's entry
    budget = int(2.5 * one)
    with load(tiny_model, prefill_chunk=64, prefix_cache=budget) as engine:
        for prompt in prompts[:6]:
            engine.generate(prompt, 2, stop_ids=())
            s = engine.stats()
            assert s["prefix_cache_bytes"] == s["prefix_cache_entries"] * one <= s["prefix_cache_budget"] == budget
        assert s["prefix_cache_entries"] == 2  # the two most recent prompts
        engine.generate(prompts[5], 2, stop_ids=())
        assert engine.stats()["prefix_cache_hits"] == s["prefix_cache_hits"] + 1
