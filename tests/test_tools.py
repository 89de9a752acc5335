"""Every script under tools/ run once on a tiny input, its output checked for sense: a tool nothing runs
rots unseen (the benchmarks read engine internals that move). System tier: these are runs of whole
tools (seconds to a minute each), not units of behaviour. tools/tiny_model.py, bench_lookahead.py and
check_dist.sh are run elsewhere too (the `model` fixture below and many tests,
tests/test_bench_lookahead.py, .ci/run).

What cannot run here, said once: tools/bench_llamacpp.py's llama.cpp side needs llama-cpp-python
(which compiles llama.cpp, ~5 minutes) and gguf, the `bench` extra, which CI does not install; its
colibri side runs, and the side by side runs where the extra is installed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_core import kernels
from colibri_core.engine import load

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
NUM = r"[\d.]+(?:e[+-]?\d+)?"  # a number as Python's format `g` may print it


def tool(name: str, *args, timeout: float = 300, env: dict | None = None) -> str:
    """Run tools/NAME with `args`; its stdout (stderr too, after it). Fails on a non-zero exit."""
    cmd = [str(TOOLS / name)] if name.endswith(".sh") else [sys.executable, str(TOOLS / name)]
    r = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{name} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def module(name: str):
    """tools/NAME.py imported, to call a part of it."""
    spec = importlib.util.spec_from_file_location(f"tools.{name}", TOOLS / f"{name}.py")
    m = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    sys.path.insert(0, str(TOOLS))  # bench_real_dims imports bench_resident_floor
    try:
        spec.loader.exec_module(m)
    finally:
        sys.path.remove(str(TOOLS))
    return m


def floats(pattern: str, text: str) -> list[float]:
    """The numbers `pattern`'s groups match in `text`, first match; fails when nothing matches."""
    m = re.search(pattern, text)
    assert m, f"no {pattern!r} in:\n{text}"
    return [float(g) for g in m.groups()]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """tools/tiny_model.py's OLMoE (4 layers of 16 experts, the demo's 2,048-token vocabulary: the
    benchmarks draw prompt ids below 1,000), made by its command line."""
    out = tmp_path_factory.mktemp("tools") / "olmoe"
    tool("tiny_model.py", "olmoe", out)
    return out


# ----------------------------------------------------------------------------- C harnesses


def test_avx512_check_agrees_bit_for_bit():
    if not Path("/usr/include/simde").is_dir():
        pytest.skip("tools/avx512_check needs SIMDe: apt-get install libsimde-dev (.ci/run installs it)")
    out = tool("avx512_check/run.sh")
    bad, checked = floats(r"(\d+) of (\d+) row dot products differ", out)
    assert bad == 0 and checked > 0, out


def test_exact_ceiling_measures_every_path_this_cpu_runs(tmp_path):
    out = tool("exact_ceiling/run.sh", env={"TMPDIR": str(tmp_path)})  # its own CPU lock, not a caller's
    read = floats(r"read bandwidth of one core ([\d.]+) GB/s", out)[0]
    ghz, multiplies = floats(r"clock ([\d.]+) GHz \(dependent adds\); float multiplies a cycle: 256-bit ([\d.]+)", out)
    assert read > 0 and ghz > 0 and multiplies > 0, out
    for path in (p for p in ("avx2", "avx512") if kernels.simd_supported(p)):  # the SIMD paths it measures
        for kind, bytes64 in (("int4", 32), ("int8", 64)):  # each rate in GB/s, then in cycles per 64 weights
            figures = floats(rf"{path}\s+{kind}" + r"\s+([\d.]+) \(\s*([\d.]+)\)" * 3, out)
            for gbps, cycles in zip(figures[::2], figures[1::2]):
                assert gbps > 0 and cycles == pytest.approx(ghz * bytes64 / gbps, rel=0.06, abs=0.1), out
    if kernels.simd_supported("avx512"):  # the several-token ceiling: one core's vpdpbusd rate
        ns, int8_cap, int4_cap = floats(r"vpdpbusd \(512-bit\): ([\d.]+) ns.* at ([\d.]+) GB/s of int8 weights, ([\d.]+) of int4", out)
        assert ns > 0 and int8_cap == pytest.approx(2 * int4_cap, rel=0.02), out
    if kernels.simd_supported("avx2"):  # the same ceiling for the AVX2 path: its product steps' rate
        ns8, ns4, int8_cap, int4_cap = floats(r"int8 x int8 ([\d.]+) ns, int4 x int8 ([\d.]+) ns.* at ([\d.]+) GB/s of int8 weights, ([\d.]+) of int4", out)
        assert ns8 > 0 and ns4 > 0 and int8_cap == pytest.approx(4 / ns8, rel=0.05) and int4_cap == pytest.approx(4 / ns4, rel=0.05), out


# ----------------------------------------------------------------------------- benchmarks


def test_bench_llamacpp_colibri_side(tmp_path):
    """The colibri half of the side by side, on the script's own tiny dimensions: its container
    (through the real converter) and its child runs. The llama.cpp half: the next test."""
    bench = module("bench_llamacpp")
    dst = tmp_path / "tiny-int4"
    bench.build_colibri(bench.MODELS["tiny"], dst, "int4")

    def child(kind: str) -> dict:
        out = tool("bench_llamacpp.py", "--child", kind, "--path", dst, "--model", "tiny", "--prompt", 16,
                   "--gen", 4, "--threads", 1, "--activations", "f32", "--kv-cache", "f32")
        return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])

    ours = child("colibri")
    assert ours["prefill_tok_s"] > 0 and ours["decode_tok_s"] > 0 and ours["threads"] == 1
    assert ours["simd"] == kernels.simd() and (ours["activations"], ours["kv_cache"]) == ("f32", "f32")
    assert child("read")["read_gbps"] > 0


def test_bench_llamacpp_side_by_side(tmp_path):
    pytest.importorskip("gguf", reason="the `bench` extra is not installed (pip install -e '.[bench]': gguf and "
                        "llama-cpp-python, which compiles llama.cpp): only colibri's side ran")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the `bench` extra): only colibri's "
                        "side ran")
    out = tool("bench_llamacpp.py", "--model", "tiny", "--rounds", 1, "--prompt", 16, "--gen", 4, "--threads", 1,
               "--data", tmp_path, timeout=900)
    result = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert result["decode_ratio"] > 0 and result["prefill_ratio"] > 0
    assert result["rounds"][0]["llama_cpp"]["decode_tok_s"] > 0


def test_bench_prefill_gives_the_same_bits_twice(model):
    def once() -> tuple[float, str]:
        out = tool("bench_prefill.py", model, "--tokens", 16, "--rounds", 2)
        rate = floats(r"prefill 16 tokens \(f32\) best [\d.]+ ms \(([\d.]+) tok/s\)", out)[0]
        return rate, re.search(r"logits sha256 ([0-9a-f]{12})", out)[1]

    (rate1, hash1), (rate2, hash2) = once(), once()
    assert rate1 > 0 and rate2 > 0
    assert hash1 == hash2, "the same prompt's logits differ between two runs"


def test_bench_simd_decode_times_every_path(model):
    paths = [p for p in kernels.SIMD_PATHS if kernels.simd_supported(p)]
    out = tool("bench_simd_decode.py", model, "--paths", ",".join(paths), "--tokens", 2 * len(paths), "--prompt", 8)
    for path in paths:
        median, fastest, n = floats(rf"{path}\s+([\d.]+) ms a token \(min ([\d.]+), (\d+) tokens\)", out)
        assert 0 < fastest <= median and n == 2, out


def test_bench_resident_floor_is_below_the_measured_time(model):
    out = tool("bench_resident_floor.py", model, "--activations", "int8", "f32", "--rounds", 1, "--tokens", 4,
               "--prompt", 8, "--batch", 3)
    assert floats(rf"({NUM}) MB a token", out)[0] > 0
    for act in ("int8", "f32"):
        ms, floor, read = floats(rf"{act}: ([\d.]+) ms a token, floor ({NUM}) \(\d+ %; read ([\d.]+) GB/s\)", out)
        assert 0 < ms and floor <= ms and read > 0, out
    # each batch step against its own floor: the dense bytes once and the union of the 3 rows' experts
    for step, floor, share, experts, read, ratio in re.findall(
            rf"3 together: step ([\d.]+) ms, its floor ({NUM}) \((\d+) %; (\d+) experts; read ([\d.]+) GB/s\), "
            rf"([\d.]+)x the tokens/s of one", out):
        assert float(step) > 0 and 0 < float(floor) and int(experts) > 0 and float(ratio) > 0, out
    assert out.count("3 together") == 2, out


def test_profile_decode_accounts_for_the_step(model):
    out = tool("profile_decode.py", model, "--tokens", 4, "--prompt", 8)
    shares = floats(r"C kernels (\d+)%, other built-ins \(NumPy, dict, …\) (\d+)%, Python code (-?\d+)%", out)
    assert shares[0] > 0 and abs(sum(shares) - 100) <= 2, out
    out = tool("profile_decode.py", model, "--tokens", 4, "--prompt", 8, "--per-call")
    timed, in_c = floats(r"([\d.]+) timed .*; C calls ([\d.]+) ms", out)
    assert 0 < in_c <= timed, out
    assert re.search(r"^\s+\w+\s+[\d.]+ calls\s+[\d.]+ ms per token", out, re.M), out


def test_bench_server_measures_engine_and_api(model):
    out = tool("bench_server.py", "--model", model, "--tokens", 8, "--repeats", 1)
    alone, alone_ttft = floats(r"engine alone:\s+([\d.]+) tok/s decode · TTFT\s+([\d.]+) ms", out)
    streamed, streamed_ttft = floats(r"API, streamed \(SSE\):\s+([\d.]+) tok/s decode · TTFT\s+([\d.]+) ms", out)
    whole = floats(r"API, not streamed:\s+([\d.]+) tok/s", out)[0]
    assert min(alone, alone_ttft, streamed, streamed_ttft, whole) > 0, out


def test_bench_prefix_replays_a_session_with_and_without_the_cache_and_after_a_restart(model):
    out = tool("bench_prefix.py", model, "--turns", 3, "--first", 300, "--growth", 80, "--answer", 4,
               "--prefill-chunk", 64, "--prefix-cache", "64MB")
    result = json.loads(out[out.index("{"):out.rindex("}") + 1])
    cached = result["cached_tokens"]
    # the tiny OLMoE is token_exact: each turn is served to the last answer's end (its last token never fed)
    assert cached["no_cache"] == [0, 0, 0] and cached["cache"] == cached["restart"] == [0, 303, 387], out
    assert all(t > 0 for ttft in result["ttft_s"].values() for t in ttft), out
    assert not list(model.glob(".prefix_cache/*/*.coli_prefix")), "the tool left spilled entries beside the model"


def test_bench_serve_quick_runs_every_part(tmp_path):
    """Its own tiny model: the sweep (1, 2, 4 clients; batched too where `serve` has --parallel), the
    replayed session, and llama.cpp's N sequences where the bench extra is installed."""
    report = tmp_path / "serve.json"
    tool("bench_serve.py", "--quick", "--json", report, env={"TMPDIR": str(tmp_path)})  # its own CPU lock
    r = json.loads(report.read_text())
    for regime in ("resident", "streamed"):
        s = r["sweep"][regime]
        for mode in ("one_at_a_time", "batched") if r["serve_has_parallel"] else ("one_at_a_time",):
            assert [p["clients"] for p in s[mode]] == [1, 2, 4], s
            for p in s[mode]:
                assert p["generated_tokens"] == 6 * p["clients"] and p["chunks_per_token"] == 1, p
                assert p["aggregate_tok_s"] > 0 and 0 < p["ttft_s"]["median"] <= p["ttft_s"]["p90"], p
                assert (p["bytes_read_per_token"] > 0) == (regime == "streamed"), p  # a quarter cached, or all
        assert (s["ratios"] is None) == (not r["serve_has_parallel"]), s
    session = r["session"]
    assert session["cached_tokens"]["no_cache"] == [0, 0, 0], session
    # prompts of 300, 384 and 468 tokens: a token_exact model's state is reused to the last answer's end
    assert session["cached_tokens"]["cache"] == session["cached_tokens"]["restart"] == [0, 303, 387], session
    # each restarted server's hit: its entry read back while idle, or from disk when the prompt came
    first, *later = session["restart_read_back"]
    assert first == {"warmed": 0, "disk_hits": 0} and all(r["warmed"] or r["disk_hits"] == 1 for r in later), session
    if "skipped" in r["llamacpp"]:
        assert importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None
    else:
        assert [run["sequences"] for run in r["llamacpp"]["runs"]] == [1, 4] and r["llamacpp"]["ratio"] > 0
    assert not list(tmp_path.glob("bench-serve-*")), "the quick run left its models behind"


def test_bench_structured_times_every_grammar():
    out = tool("bench_structured.py", "--repeat", 2, "--decode", 1)
    for kind in ("json_object", "json_schema", "lark", "gbnf", r"tools \(auto\)"):
        compile_ms, tokens = floats(rf"(?m)^{kind}\s+([\d.]+)\s+(\d+) \|", out)
        assert compile_ms > 0 and tokens > 0, out
    free, constrained = floats(r"tok/s median: free ([\d.]+) · json_object ([\d.]+)", out)
    assert free > 0 and constrained > 0, out


def test_sim_expert_cache_records_and_replays(model, tmp_path):
    trace = tmp_path / "trace.json"
    out = tool("sim_expert_cache.py", "record", "--model", model, "--trace", trace, "--prompts", 2,
               "--prompt-tokens", 4, "--new-tokens", 4)
    assert floats(r"(\d+) forward passes over 2 prompts", out)[0] >= 2 * 4
    t = json.loads(trace.read_text())
    assert len(t["moe_layers"]) == 4 and t["n_experts"] == 16
    out = tool("sim_expert_cache.py", "simulate", "--trace", trace)
    # a decoded token routes 2 experts in each of 4 layers: no placement misses more than that
    for reads, demand, wasted in re.findall(r"cold LRU \d+ slots: ([\d.]+) \(([\d.]+), ([\d.]+)\)", out):
        assert float(demand) <= 8 and float(reads) >= float(demand) and float(wasted) >= 0, out
    assert re.search(r"pin\s+\d+ \+\s+\d+ slots: by count", out), out


def test_bench_ray_matches_local_streaming(model):
    """A loopback Ray cluster (one worker node) and the local disk decode the same tokens."""
    out = tool("bench_ray.py", model, "--tokens", 4, "--workers", 1, "--node-memory", "1GB", timeout=600)
    r = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert r["identical_tokens"] is True
    assert r["ray"]["remote_calls_per_token"] > 0 and r["ray"]["decode_tokens_per_second"] > 0
    assert r["local_disk"]["disk_reads_per_token"] > 0 and r["local_disk"]["remote_calls_per_token"] == 0


def test_bench_real_dims_makes_runs_and_alternates(tmp_path, monkeypatch):
    """The script's container writer, `run` and `alternate`, on Qwen3.6's architecture at tiny
    dimensions (the real ones are 17.9 GB) and a 2-layer slice of it; the disk probe reads 8 MB."""
    bench = module("bench_real_dims")
    monkeypatch.setitem(bench.__dict__, "QWEN36_TEXT_CONFIG", {
        **bench.QWEN36_TEXT_CONFIG, "vocab_size": 1024, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "full_attention_interval": 2})
    probe = bench.disk_bandwidth
    monkeypatch.setattr(bench, "disk_bandwidth", lambda c: probe(c, 8 << 20))
    dst = tmp_path / "qwen36-slice"
    bench.make(dst, "qwen36", 2)
    with load(dst) as engine:
        assert engine.container.architecture == "qwen36" and engine.container.n_experts == 8
    r = bench.run(dst, None, 2, 4, 4, keep_cache=True)
    assert r["layers"] == 2 and r["decode_tokens"] == 3 and r["cache_slots_per_layer"] == 2
    assert r["decode_tok_s"] > 0 and 0 <= r["decode_hit_rate"] <= 1 and r["disk_gbps"] > 0
    assert r["bandwidth_floor_s_per_token"] <= r["s_per_token"]
    a = bench.alternate(dst, "lookahead", None, 2, 1, 2, same_prompt=False)
    assert len(a) == 2 and all(v["median_ms_per_token"] > 0 for v in a.values()), a


def test_make_synthetic_olmoe_writes_a_container_colibri_checks_and_runs(tmp_path):
    """One layer at OLMoE-1B-7B's dimensions (0.33 GB; all 16 are 3.6 GB), written straight in the
    container format: `colibri doctor --deep` passes it and it decodes."""
    dst = tmp_path / "synth"
    tool("make_synthetic_olmoe.py", dst, "--layers", 1)
    r = subprocess.run([sys.executable, "-m", "colibri_core", "doctor", "--deep", "--model", str(dst)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "PASS  checksums (deep)" in r.stdout, r.stdout + r.stderr
    with load(dst) as engine:
        assert engine.container.n_experts == 64 and len(engine.container.moe_layers) == 1
        assert len(engine.generate([5, 6, 7], 4, stop_ids=())) == 4


# ----------------------------------------------------------------------------- training

needs_corpus = pytest.mark.skipif(shutil.which("bible") is None, reason="the training corpus needs Debian's "
                                  "bible-kjv-text: apt-get install bible-kjv-text (.ci/run installs it)")


@needs_corpus
def test_train_demo_trains_converts_and_measures(tmp_path):
    dst = tmp_path / "demo"
    tool("train_demo.py", dst, "--steps", 2, timeout=600)
    report = json.loads((tmp_path / "demo.training.json").read_text())
    assert report["steps"] == 2 and report["train_tokens"] > 100_000
    # two steps from random weights: close to uniform over 2,048 tokens (ln 2048 = 7.6), the container
    # (int4) within a little of the float32 model
    assert 5 < report["val_loss_f32"] < 8.5
    assert abs(report["val_loss_int4_container"] - report["val_loss_f32"]) < 0.2, report
    with load(dst) as engine:
        assert len(engine.generate(engine.tokenizer.encode("And God said"), 4, stop_ids=())) == 4


@needs_corpus
def test_train_mtp_writes_a_model_that_drafts(tmp_path):
    out = tool("train_mtp.py", tmp_path / "glm-mtp", "--lm-steps", 2, "--steps", 2, timeout=600)
    assert floats(r"head step 1: loss ([\d.]+), agreement", out)[0] > 0, out
    with load(tmp_path / "glm-mtp") as engine:
        assert len(engine.generate(engine.tokenizer.encode("And God said"), 6, stop_ids=(), draft="mtp")) == 6
        assert engine.stats()["draft_drafted"] > 0
