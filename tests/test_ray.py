"""Expert shards on a Ray cluster (colibri_core/remote): a loopback `ray.cluster_utils.Cluster` (a
head, where the driver runs, and 2 worker nodes holding the shards) in one fixture for the module.

Generation with the experts spread over the nodes is token-identical to a single machine (tiny
OLMoE and GLM-5.2, both splits, prefill and decode; GPT-OSS, whose experts add biases); a slow node is treated as failed after the
deadline and used again once it answers; killing a node mid-generation completes the request with
identical tokens, and a node that joins afterwards takes the shard back. Also: placement sized to
each node's RAM, `plan --ray`, `doctor --ray`, `/metrics`, `run --ray` end to end, and a missing
Ray is one line. Ray is in the test extra: these tests never skip.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import colibri_core
from colibri_core.remote.client import RemoteWarning
from colibri_core.remote.placement import Node, cluster_plan, expected_calls, place

pytestmark = pytest.mark.system  # a Ray cluster on loopback
ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("tiny_model_tool", ROOT / "tools" / "tiny_model.py")
tiny_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_model)

NODE = dict(num_cpus=1, object_store_memory=80 << 20, memory=1 << 30)
PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3]
N = 10


def build(arch: str, out: Path) -> Path:
    """tools/tiny_model.py's tiny model of `arch` (int4), converted."""
    import torch
    from transformers import AutoModelForCausalLM

    from colibri_core.convert import convert_checkpoint

    torch.manual_seed(0)
    hf = out.with_name(out.name + "-hf")
    model = AutoModelForCausalLM.from_config(tiny_model.hf_config(arch), dtype=torch.float32)
    tiny_model.fill_hash_tables(model, 0)
    tiny_model.fill_expert_biases(model, 0)
    model.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model.DEMO / name, hf / name)
    convert_checkpoint(hf, out, "int4", progress=False)
    shutil.rmtree(hf)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-tiny")
    return {arch: build(arch, root / arch) for arch in ("olmoe", "glm52", "gpt_oss")}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=80 << 20,
                                                          include_dashboard=False))
    workers = [c.add_node(**NODE) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    c.workers = workers
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def reference(models):
    """Single-machine greedy tokens of each model (1 cache slot: every expert streamed from disk)."""
    out = {}
    for arch, m in models.items():
        with colibri_core.load(m, cache_slots=1, usage=False) as e:
            out[arch] = e.generate(PROMPT, N, stop_ids=())
    return out


def remote_load(model, cluster, **options):
    return colibri_core.load(model, cache_slots=1, usage=False, ray=cluster.address,
                             ray_options={"retry": 0.2, **options})


# ---- placement (no cluster) ------------------------------------------------------------------
def test_placement_is_sized_to_each_nodes_ram():
    nodes = [Node("a", "10.0.0.1", 10_000), Node("b", "10.0.0.2", 20_000)]
    layers = {1: 1000, 2: 1000, 3: 1000}
    for split in ("expert", "layer"):
        shards = place(nodes, layers, 16, split, share=1.0)
        assert [s.node.id for s in shards] == ["a", "b"]
        for s in shards:
            assert s.nbytes <= s.node.memory and s.nbytes == 1000 * s.n_experts
            for es in s.experts.values():
                assert list(es) == list(range(es[0], es[-1] + 1))  # contiguous ranges
        held = [(layer, e) for s in shards for layer, es in s.experts.items() for e in es]
        assert len(held) == len(set(held)) >= 20  # no expert twice; the cluster's room mostly used
    # room for everything: every expert placed, by expert id each layer on both nodes
    shards = place([Node("a", "1", 10**9), Node("b", "2", 10**9)], layers, 16, "expert")
    assert [s.describe() for s in shards] == ["1:0-7 2:0-7 3:0-7", "1:8-15 2:8-15 3:8-15"]
    assert expected_calls(shards, 16, 4) == pytest.approx(3 * 2 * (1 - 70 / 1820))
    by_layer = place([Node("a", "1", 10**9), Node("b", "2", 10**9)], layers, 16, "layer")
    assert [s.describe() for s in by_layer] == ["1:0-15 2:0-7", "2:8-15 3:0-15"]
    plan = cluster_plan(nodes, [1, 2, 3], 16, 1000, 4, "layer", share=1.0)
    assert plan["experts_remote"] + plan["experts_local"] == 48 and plan["experts_local"] > 0


def test_the_shard_computes_its_slots_as_the_local_block_does(models):
    """ShardServer without Ray: its slots equal the local MoE block's bit for bit (also int8
    activations), prefetch reorders what it reads next, another model's copy is refused."""
    from colibri_core.container import Container
    from colibri_core.errors import ColibriError
    from colibri_core.layers.moe import run_experts
    from colibri_core.remote.shard import ShardServer, identity

    c = Container(models["olmoe"])
    layer = c.moe_layers[1]
    shard = ShardServer(str(models["olmoe"]), {layer: [2, 3, 5, 8]}, identity(c), warm=False)
    shard.prefetch(layer, [8, 9, 5])  # 9 is not its expert
    assert shard._queue[:2] == [(layer, 8), (layer, 5)] and len(shard._queue) == 4
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (5, c.hidden)).astype(np.float32)
    ids = np.array([[2, 9], [3, 5], [0, 1], [8, 2], [5, 3]])
    mine = np.isin(ids, [2, 3, 5, 8])
    for act in ("f32", "int8"):
        want = np.zeros((5, 2, c.hidden), np.float32)
        run_experts(want, x, ids, {e: c.read_expert(layer, e) for e in (2, 3, 5, 8)}, act=act)
        got = shard.compute(layer, x, np.where(mine, ids, -1), act, "swiglu", None)
        assert np.array_equal(got, want[mine])
    with pytest.raises(ValueError, match="does not hold"):
        shard.compute(layer, x, ids, "f32", "swiglu", None)
    with pytest.raises(ColibriError, match="another model or conversion"):
        ShardServer(str(models["glm52"]), {}, identity(c), warm=False)
    c.close()


# ---- identity -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,split", [("olmoe", "expert"), ("olmoe", "layer"), ("glm52", "expert"),
                                        ("gpt_oss", "expert")])  # GPT-OSS: experts with biases
def test_tokens_identical_to_a_single_machine(models, reference, cluster, arch, split):
    with remote_load(models[arch], cluster, split=split) as e:
        got = e.generate(PROMPT, N, stop_ids=())
        s = e.stats()
        logits_remote = e.logits(PROMPT + got[:3])
    assert got == reference[arch]
    assert s["remote_shards_up"] == s["remote_shards"] == 2
    assert s["remote_failures"] == 0 and s["remote_fallback_experts"] == 0
    assert s["remote_local_fills"] > 0  # the local cache in front: free slots took remotely computed experts
    assert all(r["calls"] > 0 for r in s["remote_shard_table"].values())  # both nodes computed experts
    assert s["remote_calls"] >= N and s["remote_bytes_sent"] > 0 and s["remote_latency"]["count"] == s["remote_calls"]
    assert s["expert_misses"] < s["remote_calls"]  # the disk is read only for what the cluster does not serve
    with colibri_core.load(models[arch], cache_slots=1, usage=False) as e:
        assert np.array_equal(e.logits(PROMPT + got[:3]), logits_remote)  # bit for bit, a 11-token prefill


# ---- a slow node -------------------------------------------------------------------------------
def test_a_slow_node_is_failed_after_the_deadline_and_used_again(models, reference, cluster):
    with remote_load(models["olmoe"], cluster, timeout=0.5) as e:
        slow = e.experts.remote.shards[0]
        ray.get(slow.actor.set_delay.remote(1.5))
        with pytest.warns(RemoteWarning, match="no answer within the 0.5 s deadline"):
            got = e.generate(PROMPT, N, stop_ids=())
        assert got == reference["olmoe"]
        s = e.stats()
        assert s["remote_timeouts"] >= 1 and s["remote_fallback_experts"] > 0 and slow.state == "down"
        ray.get(slow.actor.set_delay.remote(0.0), timeout=30)  # queued behind its late calls: they are done
        calls = slow.calls
        with pytest.warns(RemoteWarning, match="is back"):
            deadline = time.monotonic() + 30
            while slow.state != "up" and time.monotonic() < deadline:
                e.experts.remote.maintain()
                time.sleep(0.05)
        assert e.generate(PROMPT, N, stop_ids=()) == reference["olmoe"]
        assert slow.state == "up" and slow.calls > calls and e.stats()["remote_rejoins"] >= 1


# ---- the command line, /metrics -------------------------------------------------------------
def test_plan_and_doctor_show_the_cluster(models, cluster):
    from typer.testing import CliRunner

    from colibri_core.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["plan", "--model", str(models["olmoe"]), "--ray", cluster.address, "--disk-bw", "1GB",
                            "--mem-bw", "10GB", "--ram", "1GB"])
    assert r.exit_code == 0, r.output
    assert "2 nodes besides this one" in r.output and "remote calls expected" in r.output
    assert "layer:experts 0:0-7 1:0-7 2:0-7 3:0-7" in r.output
    r = runner.invoke(app, ["doctor", "--model", str(models["olmoe"]), "--ray", cluster.address])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if "ray node" in line]
    assert len(lines) == 2 and all(line.startswith("PASS") and "same experts as here" in line for line in lines)
    r = runner.invoke(app, ["doctor", "--model", str(models["olmoe"]), "--ray", cluster.address,
                            "--ray-model", str(models["glm52"])])  # the nodes' copy: another model
    assert r.exit_code == 1 and "FAIL  ray node" in r.output and "another model" in r.output


def test_serve_with_ray_exports_the_cluster(models, cluster):
    """`colibri web --ray`: /metrics has the remote calls, bytes and latency histogram, /api/stats
    (the dashboard's Cluster card) every shard."""
    from prometheus_client.parser import text_string_to_metric_families

    from live_server import LiveServer, post_json

    server = LiveServer("web", models["olmoe"], "--cache-slots", "1", "--ray", cluster.address)
    try:
        status, body = post_json(server.url + "/v1/completions", {"prompt": "the quick", "max_tokens": 4})
        assert status == 200, body
        status, text = server.get("/metrics")
        stats = server.json("/api/stats")["engine"]
    finally:
        server.stop()
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    assert families["colibri_remote_calls"].type == "counter"
    assert families["colibri_remote_calls"].samples[0].value > 0
    assert families["colibri_remote_bytes_sent"].samples[0].value > 0
    hist = families["colibri_remote_call_seconds"]
    assert hist.type == "histogram" and any(s.name.endswith("_count") and s.value > 0 for s in hist.samples)
    assert [s.value for s in families["colibri_remote_shard_up"].samples] == [1.0, 1.0]
    assert stats["remote_shards_up"] == 2 and len(stats["remote_shard_table"]) == 2
    assert all(r["state"] == "up" and r["calls"] > 0 for r in stats["remote_shard_table"].values())


def test_run_with_ray_on_the_command_line(models, cluster):
    m = models["olmoe"]
    with colibri_core.load(m, cache_slots=1, usage=False) as e:
        ids = e.tokenizer.encode("the quick brown")
        want = e.tokenizer.decode(e.generate(ids, 6))
    r = subprocess.run([sys.executable, "-m", "colibri_core", "run", "--model", str(m), "--cache-slots", "1",
                        "--max-tokens", "6", "--ray", cluster.address, "--stats", "the quick brown"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == want
    assert "remote (expert split): 2/2 shards up" in r.stderr and "shard 1 on" in r.stderr


def test_without_ray_the_option_is_one_line(models):
    code = ("import sys; sys.modules['ray'] = None; from colibri_core.cli import main; "
            f"sys.argv = ['colibri', 'run', '--model', {str(models['olmoe'])!r}, '--ray', 'auto', 'hi']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == "colibri: error: --ray needs Ray, which is not installed: pip install 'colibri[ray]'"


def test_an_unreachable_cluster_is_one_line_at_once(models):
    r = subprocess.run([sys.executable, "-m", "colibri_core", "run", "--model", str(models["olmoe"]), "--ray",
                        "127.0.0.1:9", "hi"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().startswith("colibri: error: cannot join the Ray cluster at 127.0.0.1:9: nothing answers")


# ---- a node dies mid-generation; another joins --------------------------------------------------
def test_a_node_killed_mid_generation_then_a_new_node_takes_its_shard(models, reference, cluster):
    """Last in the module: it removes a worker node for good."""
    with remote_load(models["glm52"], cluster) as e:
        victim = e.experts.remote.shards[1]
        node = next(w for w in cluster.workers if w.node_id == victim.shard.node.id)
        got = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for token in e.stream(PROMPT, N, stop_ids=()):
                got.append(token)
                if len(got) == 3:
                    cluster.remove_node(node)  # the raylet and the shard's actor die
        assert got == reference["glm52"]  # the same request, completed
        assert any("failed" in str(w.message) for w in caught if w.category is RemoteWarning)
        s = e.stats()
        assert victim.state == "down" and s["remote_fallback_experts"] > 0 and s["remote_shards_up"] == 1
        assert e.generate(PROMPT, N, stop_ids=()) == reference["glm52"]  # on one node + the local disk
        # a replacement node joins: the shard is started there and used again
        cluster.add_node(**NODE)
        deadline = time.monotonic() + 60
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RemoteWarning)
            while victim.state != "up" and time.monotonic() < deadline:
                e.experts.remote.maintain()
                time.sleep(0.1)
        assert victim.state == "up", victim.last_error
        assert victim.shard.node.id != node.node_id
        calls = victim.calls
        assert e.generate(PROMPT, N, stop_ids=()) == reference["glm52"]
        assert victim.calls > calls and e.stats()["remote_shards_up"] == 2 and e.stats()["remote_rejoins"] == 1
