"""Benchmark: `colibri serve` under many clients — concurrent streams, a replayed agent session, and
llama.cpp (its server under the same load, and decoding as many sequences together) — each figure
against the same server one at a time.

    .venv/bin/python tools/bench_serve.py --quick [--json OUT]          # seconds: tiny model, every part
    .venv/bin/python tools/bench_serve.py --parts sweep --regimes resident --clients 1,8 --parallel 8
    .venv/bin/python tools/bench_serve.py --parts sweep,llamaserver --regimes resident --clients 1,8 \
        [--resident-model bench-data/olmoe-synth-16l] [--llama-server bench-data/llama-server]
    .venv/bin/python tools/bench_serve.py [--parts sweep,session,llamacpp,llamaserver] [--resident-layers 16]
        [--streamed-layers 4] [--clients 1,2,4,8,16] [--parallel 8] [--prompt 32] [--tokens 64]
        [--threads N] [--data bench-data] [--json OUT]

The tool takes the machine's CPU lock (colibri-cpu.lock in the temp directory) for the whole run:
do not wrap it in `flock` yourself (it would wait for itself). Its servers do not take the lock.

Models (built once under --data, kept for the next run; a word-level tokenizer.json is added, token
i written "<ti>", so every generated token streams as one chunk and answers map back to ids):
  resident  OLMoE-1B-7B's dimensions (`--resident-layers N` keeps the first N of 16): llama.cpp's
            Q4_0 GGUF of random weights (tools/bench_llamacpp.py's build_gguf), and colibri's int4
            container converted from it (its build_colibri of the GGUF), so that the two engines
            route alike; every expert cached (`--cache-slots` = experts per layer). Random weights
            route more evenly than a trained router: `--resident-model DIR` measures another
            container instead (tools/make_synthetic_olmoe.py's routes as skewed as real models).
  streamed  Qwen3.6-35B-A3B's dimensions (tools/bench_real_dims.py make; `--streamed-layers N` is a
            slice of its first N of 40 layers), the expert cache at 25 % of the experts' bytes
            (`--cache-slots` = a quarter of the experts per layer, no hot-store, O_DIRECT reads);
            `--streamed-model DIR` streams another container (the skewed routers above), and
            `--streamed-policy P` sets its expert cache policy (default: the engine's).
  --quick   tools/bench_llamacpp.py's `tiny` dimensions in a temporary directory: colibri's container
            from the converter's random pool in both regimes, llama.cpp's GGUF apart (the figures
            check the tool, they compare nothing).

Every server runs with bench_llamacpp.py's arithmetic (`--activations int8 --kv-cache f16`) and
`COLIBRI_THREADS=--threads`; llama.cpp with as many threads.

Parts (`--parts`):
  sweep     For each regime, two servers: one at a time (`--parallel 1`) and batched (`--parallel
            P`), each warmed by one request of --warm ids, then for C in --clients: C streaming
            clients (threads, http.client), each one /v1/completions of --prompt distinct random
            ids, --tokens tokens (temperature 0, end of sequence ignored), all released together.
            Per C: aggregate generated tokens/s (all tokens over the wall time from the first
            request sent to the last answer's end), time to first token and inter-token latency
            (the gaps between a stream's chunks; median and p90), and from /api/stats before and
            after: bytes of experts read, reads and expert lookups per generated token (the
            prompts' prefill included), and the bytes a token against the first C's. The prefix
            cache is off (`--prefix-cache 0`): every prompt is distinct, and the second server
            would otherwise find the first's spilled entries. A `colibri serve` without --parallel
            (its --help does not list it) runs one at a time: then only that baseline is measured,
            and the tool says so loudly.
  session   An agent session replayed through the resident server: a first prompt of --first random
            ids, then each of --turns turns resends the whole conversation (the model's answer of
            --answer tokens, and --growth new ids). Each turn's time to first token with the prefix
            cache (`--prefix-cache` RAM), without it (0), and with a server restarted before every
            turn (the entries it spilled to disk found again: a server reads them back into RAM
            while idle, and the JSON says whether the turn's hit was read back so or from disk
            then). The answers must agree in all three.
            The three are measured turn by turn (the first two servers kept running beside the
            restarted ones), so a host whose speed drifts over the minutes a mode takes does not
            favour one mode.
  llamacpp  llama.cpp (llama-cpp-python's low-level API, what llama-server's `--parallel N` does:
            `n_seq_max = N`, a unified KV cache, one `llama_decode` a step with one token per
            sequence) on the resident GGUF: N sequences of --prompt ids prefilled in one batch, then
            greedy to --tokens each, for N = 1 and P alternated --rounds times; the median aggregate
            tokens/s (the same wall-time definition) against colibri's at C = P clients. Needs the
            `bench` extra (gguf, llama-cpp-python): without it this part says why and measures
            nothing.
  llamaserver
            llama.cpp's own server (`--llama-server`, built from the llama.cpp sources llama-cpp-python
            vendors: its `llama-server` target) under the sweep's load — the same prompts, warm-up,
            clients and --tokens, `ignore_eos` — at `--parallel 1` and `--parallel P` (`--cont-batching`,
            `-t`/`-tb` --threads, a context of P × each slot's), on the resident regime's weights as a
            GGUF (`--resident-gguf`; by default the GGUF the container was converted from, or with
            --resident-model its Q4_0 written beside it, bit-exact: colibri's int4 groups of 64 are
            two Q4_0 blocks each); each aggregate tokens/s against colibri's resident sweep at the
            same clients. Without the binary this part says why and measures nothing.

Prints a table per part and, with --json, writes every figure with the commands' settings, the
machine (CPU, cores, memory read bandwidth) and the date.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import http.client
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median

import numpy as np

import bench_llamacpp
import bench_real_dims
from colibri_core.container import Container
from colibri_core.options import EngineOptions
from colibri_core.prefix import DIRNAME as PREFIX_DIRNAME

ROOT = Path(__file__).resolve().parent.parent
ARITHMETIC = ["--activations", "int8", "--kv-cache", "f16"]  # bench_llamacpp.py's: llama.cpp's Q4_0 / f16 KV


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Regime:
    name: str  # "resident" | "streamed"
    model: Path  # the colibri container
    flags: tuple[str, ...]  # `colibri serve` options that make the regime
    note: str


def word_tokenizer(model: Path) -> None:
    """A tokenizer.json for a synthetic container: token i is the word "<ti>" (words split on spaces),
    so each token decodes to text of its own and an answer's text encodes back to its ids."""
    if (model / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size(model))}, unk_token="<t1>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))


def config(model: Path) -> dict:
    cfg = json.loads((model / "config.json").read_text())
    return cfg.get("text_config", cfg)  # Qwen3.6 nests the language model's


def vocab_size(model: Path) -> int:
    return config(model)["vocab_size"]


def experts_per_layer(model: Path) -> int:
    return config(model)["num_experts"]


def tiny_model(data: Path) -> Path:
    """bench_llamacpp.py's `tiny` dimensions through the real converter (seconds)."""
    dst = data / "tiny-int4"
    if not (dst / "colibri.yaml").is_file():
        bench_llamacpp.build_colibri(bench_llamacpp.MODELS["tiny"], dst, "int4")
    return dst


def resident_model(args) -> Path:
    """--resident-model, or colibri's int4 container of llama.cpp's GGUF (bench_llamacpp.GgufCheckpoint:
    its weights requantised, so that both engines route alike: how wide the union of a batch's experts
    is depends on the routing)."""
    if args.resident_model:
        return args.resident_model
    if args.quick:
        return tiny_model(args.data)
    gguf = gguf_model(args)
    dst = args.data / f"{gguf.stem}-int4-of-gguf"
    if not (dst / "colibri.yaml").is_file():
        bench_llamacpp.build_colibri(llama_dims(args), dst, "int4", gguf)
    return dst


def streamed_model(args) -> Path:
    """--streamed-model, or a Qwen3.6 slice at real dimensions (uniformly random routers)."""
    if args.streamed_model:
        return args.streamed_model
    if args.quick:
        return tiny_model(args.data)
    dst = args.data / f"qwen36-{args.streamed_layers}l"
    if not (dst / "colibri.yaml").is_file():
        bench_real_dims.make(dst.with_name(dst.name + ".partial"), "qwen36", args.streamed_layers)
        dst.with_name(dst.name + ".partial").rename(dst)
    return dst


def regimes(args) -> list[Regime]:
    out = []
    if "resident" in args.regimes:
        model = resident_model(args)
        out.append(Regime("resident", model, ("--cache-slots", str(experts_per_layer(model)), "--pin-gb", "0"),
                          "every expert cached in RAM"))
    if "streamed" in args.regimes:
        model = streamed_model(args)
        quarter = max(1, experts_per_layer(model) // 4)
        out.append(Regime("streamed", model, ("--cache-slots", str(quarter), "--policy", args.streamed_policy,
                                              "--pin-gb", "0", "--direct"),
                          f"{quarter} of {experts_per_layer(model)} experts a layer cached (25 % of the experts' "
                          f"bytes, {args.streamed_policy}), no hot-store, O_DIRECT reads"))
    for r in out:
        word_tokenizer(r.model)
    return out


def llama_dims(args) -> bench_llamacpp.Dims:
    if args.quick:
        return bench_llamacpp.MODELS["tiny"]
    return replace(bench_llamacpp.MODELS["olmoe"], layers=args.resident_layers)


def gguf_model(args) -> Path:
    d = llama_dims(args)
    path = args.data / f"{d.name}-{d.layers}l-q4_0.gguf"  # bench_llamacpp.py's name for it
    if not path.is_file():
        bench_llamacpp.build_gguf(d, path.with_suffix(".partial"), "int4")
        path.with_suffix(".partial").rename(path)
    return path


def resident_gguf(args) -> Path:
    """llama-server's model for the resident regime: the same weights as colibri's container. The GGUF
    the container was converted from, or with --resident-model its Q4_0 written beside it."""
    if args.resident_gguf:
        return args.resident_gguf
    if not args.resident_model:
        return gguf_model(args)
    model = args.resident_model
    path = model.with_name(model.name + "-q4_0.gguf")
    if not path.is_file():
        gguf_of_container(model, path.with_suffix(".partial"))
        path.with_suffix(".partial").rename(path)
    return path


def q4_0_blocks(t) -> np.ndarray:
    """An int4 QTensor as Q4_0 rows, bit-exact: each group of 64 (values q in -8..7, one f16 scale) is
    two Q4_0 blocks of 32 with that scale (nibble q + 8; byte j holds elements j and j + 16).
    uint8 (rows, cols / 32 × 18)."""
    from colibri_core import quant

    if t.kind != "int4" or t.cols % quant.INT4_GROUP:
        raise SystemExit(f"no exact Q4_0 of a {t.kind} matrix of {t.cols} columns")
    nib = (quant.int4_values(t) + 8).astype(np.uint8).reshape(t.rows, -1, 32)  # (rows, blocks, 32)
    qs = nib[..., :16] | (nib[..., 16:] << 4)  # (rows, blocks, 16)
    d = np.repeat(t.scales, 2, axis=1).view(np.uint8).reshape(t.rows, -1, 2)  # (rows, blocks, 2): f16 bytes
    return np.concatenate([d, qs], axis=2).reshape(t.rows, -1)


def gguf_of_container(model: Path, path: Path) -> None:
    """An OLMoE container with int4 matrices (make_synthetic_olmoe.py's) as a Q4_0 GGUF of the same
    weights, the header as bench_llamacpp.build_gguf writes it (tokens "<ti>"): llama.cpp then runs the
    model colibri runs, routers included (f32 in both)."""
    import gguf

    cfg = config(model)
    H, E, V, L = cfg["hidden_size"], cfg["num_experts"], cfg["vocab_size"], cfg["num_hidden_layers"]
    with Container(model) as c:
        res = c.resident()
        w = gguf.GGUFWriter(str(path), "olmoe")
        w.add_name(model.name)
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(H)
        w.add_block_count(L)
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(cfg["rope_theta"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_expert_count(E)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>".encode() for i in range(V)])
        w.add_token_scores([0.0] * V)
        w.add_token_types([gguf.TokenType.NORMAL] * V)
        w.add_bos_token_id(1)
        w.add_eos_token_id(0)
        Q4, I = gguf.GGMLQuantizationType.Q4_0, cfg["intermediate_size"]
        tensors = []  # (GGUF name, shape, dtype, raw type or None, make): written one at a time

        def dense(gname, name):
            t = res[name]
            if isinstance(t, np.ndarray):  # norms (ones), routers: f32 in both engines
                tensors.append((gname, t.shape, np.float32, None, lambda: np.ascontiguousarray(t, np.float32)))
            elif t.kind == "f32":
                tensors.append((gname, t.data.shape, np.float32, None, lambda: np.ascontiguousarray(t.data)))
            else:
                tensors.append((gname, (t.rows, t.cols // 32 * 18), np.uint8, Q4, lambda: q4_0_blocks(t)))

        def experts(gname, layer, proj):
            rows, cols = (H, I) if proj == 2 else (I, H)  # gate, up (I, H); down (H, I)
            tensors.append((gname, (E, rows, cols // 32 * 18), np.uint8, Q4,
                            lambda: np.stack([q4_0_blocks(c.read_expert(layer, e)[proj]) for e in range(E)])))

        dense("token_embd.weight", "model.embed_tokens.weight")
        for i in range(L):
            b, p = f"blk.{i}.", f"model.layers.{i}."
            for gname, name in (("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"),
                                ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                                ("attn_output", "self_attn.o_proj"), ("attn_q_norm", "self_attn.q_norm"),
                                ("attn_k_norm", "self_attn.k_norm"), ("ffn_norm", "post_attention_layernorm"),
                                ("ffn_gate_inp", "mlp.gate")):
                dense(b + gname + ".weight", p + name + ".weight")
            for proj, gname in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
                experts(b + gname + ".weight", i, proj)
        dense("output_norm.weight", "model.norm.weight")
        dense("output.weight", "lm_head.weight")
        for gname, shape, dtype, raw, _ in tensors:
            w.add_tensor_info(gname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize,
                              raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (gname, shape, dtype, raw, make) in enumerate(tensors):
            a = make()
            if a.shape != shape:
                raise SystemExit(f"{gname}: made {a.shape}, declared {shape}")
            w.write_tensor_data(a)
            print(f"\rgguf {i + 1}/{len(tensors)}", end="", file=sys.stderr)
        print(file=sys.stderr)
        w.close()


# ----------------------------------------------------------------------------- the server


def serve_flags() -> set[str]:
    """The options `colibri serve --help` lists."""
    out = subprocess.run([sys.executable, "-m", "colibri_core", "serve", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out.stdout))


class Server:
    """`colibri serve --model MODEL FLAGS` on a free loopback port, until `stop` (SIGTERM: the server
    shuts down as it does on a signal, its prefix cache spilled to disk)."""

    def __init__(self, model: Path, flags: list[str], threads: int, timeout: float):
        self.timeout = timeout  # seconds a request may wait for its next bytes before it fails
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colibri_core", "serve", "--model", str(model), "--port", "0", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "COLIBRI_THREADS": str(threads)})
        self.url, log = None, []
        for line in self.proc.stderr:
            log.append(line)
            self.url = self.url or (re.search(r" on (http://\S+?)[;\s]", line) or [None, None])[1]
            if "ready" in line:
                break
        else:
            raise SystemExit(f"colibri serve {' '.join(flags)} did not start:\n{''.join(log[-20:])}")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # keep the access log flowing
        self.host, self.port = self.url.removeprefix("http://").rsplit(":", 1)
        self.model = self.get("/v1/models")["data"][0]["id"]

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=self.timeout)
        try:
            conn.request("GET", path)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def engine_stats(self) -> dict:
        return self.get("/api/stats")["engine"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.stop()


LLAMA_SERVER_CRASH_HINT = (" — on a CPU with AMX, llama.cpp built with -DGGML_NATIVE=ON crashes in its warm-up: "
                           "build it with -DGGML_NATIVE=OFF and the AVX-512 flags (BENCHMARKS.md, 'Many clients at once')")


class LlamaServer(Server):
    """llama.cpp's `llama-server` on a free loopback port: `--parallel N --cont-batching`, a context of
    N × `slot` tokens (each slot's), `--threads` and `--threads-batch` as colibri's. It has no
    /api/stats: no expert traffic is counted."""

    def __init__(self, binary: Path, gguf: Path, parallel: int, slot: int, threads: int, timeout: float):
        self.timeout, self.host = timeout, "127.0.0.1"
        with socket.socket() as s:  # llama-server has no port 0: a free port, taken back just before
            s.bind((self.host, 0))
            self.port = str(s.getsockname()[1])
        self.flags = ["--parallel", str(parallel), "--cont-batching", "-t", str(threads), "-tb", str(threads),
                      "--ctx-size", str(parallel * slot)]
        self.proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", self.host, "--port", self.port,
                                      *self.flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        log = []
        threading.Thread(target=lambda: log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 600
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                hint = LLAMA_SERVER_CRASH_HINT if (self.proc.poll() or 0) < 0 else ""
                raise SystemExit(f"llama-server {' '.join(self.flags)} did not start (exit {self.proc.poll()}){hint}:\n"
                                 f"{''.join(log[-20:])}")
            time.sleep(0.5)
        self.model = self.get("/v1/models")["data"][0]["id"]

    def ready(self) -> bool:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=5)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200  # 503 while the model loads
        except OSError:
            return False
        finally:
            conn.close()

    def engine_stats(self) -> None:
        return None


def llama_server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return " ".join((out.stdout + out.stderr).split())


@dataclass
class Stream:
    """One streamed completion as its client saw it (perf_counter seconds)."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def complete(server: Server, prompt: list[int], tokens: int, start: threading.Barrier | None = None) -> Stream:
    """One streamed /v1/completions of `prompt` (token ids), greedy, exactly `tokens` tokens."""
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
    conn = http.client.HTTPConnection(server.host, int(server.port), timeout=server.timeout)
    if start is not None:
        conn.connect()  # the connection made before the start, so all requests leave together
        start.wait()
    s = Stream(time.perf_counter())
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"/v1/completions answered {r.status}: {r.read()[:500]!r}")
        for line in r:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"the server failed a stream: {event['error']}")
            if event["choices"] and event["choices"][0]["text"]:
                s.chunks.append(time.perf_counter())
                s.text += event["choices"][0]["text"]
            if event.get("usage"):
                s.completion_tokens = event["usage"]["completion_tokens"]
                s.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        conn.close()
    return s


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"median": None, "p90": None}
    return {"median": float(np.median(xs)), "p90": float(np.percentile(xs, 90))}


# ----------------------------------------------------------------------------- concurrency sweep

ENGINE_COUNTERS = ("generated_tokens", "bytes_read", "reads", "expert_hits", "expert_misses", "steps", "step_rereads")


def random_ids(seed: int, vocab: int, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(2, vocab, n)]


class Prompts:
    """Distinct random prompts: the n-th from its own seed, so every server gets the same sequence."""

    def __init__(self, vocab: int, length: int):
        self.vocab, self.length, self.n = vocab, length, 0

    def next(self) -> list[int]:
        self.n += 1
        return random_ids(10_000 + self.n, self.vocab, self.length)


def concurrent(server: Server, prompts: Prompts, clients: int, tokens: int) -> dict:
    """`clients` streams released together: aggregate tok/s, TTFT and inter-token latency, expert traffic."""
    start = threading.Barrier(clients)
    jobs = [prompts.next() for _ in range(clients)]
    results: list[Stream | BaseException] = [None] * clients

    def client(i: int) -> None:
        try:
            results[i] = complete(server, jobs[i], tokens, start)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            results[i] = e
            start.abort()

    before = server.engine_stats()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:  # the cause, not the other clients' broken barrier
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    after = server.engine_stats()
    generated = sum(s.completion_tokens for s in results)
    wall = max(s.chunks[-1] for s in results) - min(s.sent for s in results)
    point = {
        "clients": clients, "generated_tokens": generated, "wall_s": wall, "aggregate_tok_s": generated / wall,
        "ttft_s": percentiles([s.ttft for s in results]),
        "itl_s": percentiles([g for s in results for g in s.gaps]),
        "chunks_per_token": sum(len(s.chunks) for s in results) / generated,  # 1: the gaps are per token
    }
    if before is None:  # llama-server: no expert counters
        return point
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ENGINE_COUNTERS}
    per_token = max(1, d["generated_tokens"])
    return {
        **point,
        "bytes_read_per_token": d["bytes_read"] / per_token, "reads_per_token": d["reads"] / per_token,
        "expert_lookups_per_token": (d["expert_hits"] + d["expert_misses"]) / per_token,
        # forward steps (one per generation alone, one for all of a batch's), and experts read twice in one
        "steps": d["steps"], "step_rereads": d["step_rereads"],
    }


def sweep_server(regime: Regime, flags: list[str], args, label: str) -> list[dict]:
    with Server(regime.model, [*flags, *regime.flags, *ARITHMETIC, "--prefix-cache", "0",
                               "--queue", str(max(args.clients))], args.threads, args.timeout) as server:
        every = experts_bytes(regime.model) if regime.name == "resident" else None
        return measure(server, vocab_size(regime.model), args, f"{regime.name:9} {label}", every)


WARM_PROMPTS = 8  # the most warm-up prompts a resident server gets to cache every expert


def experts_bytes(model: Path) -> int:
    """Bytes of all of `model`'s routed experts (what the resident regime's cache ends up holding)."""
    with Container(model) as c:
        return c.experts_nbytes


def measure(server: Server, vocab: int, args, label: str, every: int | None = None) -> list[dict]:
    """The sweep's load on one server: warmed, then each of --clients concurrent clients in turn.
    Warming runs the kernels and reads the experts in: one long prompt routes to most of them; with
    `every` (the bytes of all experts: the resident regime) more prompts until the cache holds them
    all, so the sweep reads none (a sweep prompt routed to an expert no warm-up prompt reached read
    it: a flaky 'resident' figure with reads)."""
    prompts = Prompts(vocab, args.prompt)
    for seed in range(WARM_PROMPTS if every else 1):
        if every and server.engine_stats()["cache_bytes"] >= every:
            break
        complete(server, random_ids(seed, vocab, args.warm), min(8, args.tokens))
    else:
        if every and server.engine_stats()["cache_bytes"] < every:
            print(f"{label}: {WARM_PROMPTS} warm-up prompts left experts unread: the sweep reads them", file=sys.stderr)
    points = []
    for c in args.clients:
        points.append(concurrent(server, prompts, c, args.tokens))
        p = points[-1]
        traffic = ""
        if "bytes_read_per_token" in p:  # against the first C's (1 client's in the default sweep)
            p["bytes_read_vs_first"] = ratio(p["bytes_read_per_token"], points[0]["bytes_read_per_token"])
            traffic = f" · {p['bytes_read_per_token'] / 1e6:8.2f} MB read a token"
        print(f"{label:23} {c:3} clients: {p['aggregate_tok_s']:8.2f} tok/s · TTFT median "
              f"{p['ttft_s']['median'] * 1e3:8.1f} ms p90 {p['ttft_s']['p90'] * 1e3:8.1f} · ITL median "
              f"{p['itl_s']['median'] * 1e3:7.1f} ms p90 {p['itl_s']['p90'] * 1e3:7.1f}{traffic}", file=sys.stderr)
    return points


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where b is none or 0 (no bytes read; no gap between two chunks)."""
    return a / b if a is not None and b else None


def sweep(args, batching: bool) -> dict:
    out = {}
    for regime in regimes(args):
        r = {"model": str(regime.model), "serve_flags": [*regime.flags, *ARITHMETIC, "--prefix-cache", "0"],
             "note": regime.note,
             "one_at_a_time": sweep_server(regime, ["--parallel", "1"] if batching else [], args, "one at a time"),
             "batched": None, "ratios": None}
        if batching:
            r["batched"] = sweep_server(regime, ["--parallel", str(args.parallel)], args, f"parallel {args.parallel}")
            r["ratios"] = [{
                "clients": one["clients"],
                "aggregate_tok_s": ratio(many["aggregate_tok_s"], one["aggregate_tok_s"]),
                "ttft_median": ratio(many["ttft_s"]["median"], one["ttft_s"]["median"]),
                "itl_median": ratio(many["itl_s"]["median"], one["itl_s"]["median"]),
                "bytes_read_per_token": ratio(many["bytes_read_per_token"], one["bytes_read_per_token"]),
            } for one, many in zip(r["one_at_a_time"], r["batched"])]
            for q in r["ratios"]:
                print(f"{regime.name:9} parallel {args.parallel} / one at a time, {q['clients']:3} clients: "
                      + " · ".join(f"{k} {v:.2f}x" for k, v in q.items() if k != "clients" and v is not None),
                      file=sys.stderr)
        out[regime.name] = r
    return out


# ----------------------------------------------------------------------------- agent session


def clear_spilled(model: Path) -> None:
    shutil.rmtree(model / PREFIX_DIRNAME, ignore_errors=True)


def session(args) -> dict:
    """The replayed agent session through the resident server (see the module docstring)."""
    from tokenizers import Tokenizer

    model = resident_model(args)
    word_tokenizer(model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    flags = [*ARITHMETIC, "--cache-slots", str(experts_per_layer(model))]
    on, off = [*flags, "--prefix-cache", args.prefix_cache], [*flags, "--prefix-cache", "0"]
    vocab = vocab_size(model)
    warm = random_ids(1, vocab, 64)

    def turn(server: Server, prompt: list[int]) -> tuple[float, list[int], int]:
        s = complete(server, prompt, args.answer)
        return s.ttft, tok.encode(s.text).ids, s.cached_tokens

    runs, prompts, loads, read_back = {"cache": [], "no_cache": [], "restart": []}, [], [], []
    clear_spilled(model)  # the restarts start from an empty disk (the cached server spills only as it stops)
    with Server(model, on, args.threads, args.timeout) as cached, Server(model, off, args.threads, args.timeout) as cold:
        complete(cached, warm, 2)
        complete(cold, warm, 2)
        context = random_ids(2, vocab, args.first)
        for _ in range(args.turns):
            prompts.append(context)
            runs["cache"].append(turn(cached, context))  # the transcript, with the cache
            runs["no_cache"].append(turn(cold, context))
            t0 = time.perf_counter()
            with Server(model, on, args.threads, args.timeout) as server:  # what the last restart spilled as it stopped
                loads.append(time.perf_counter() - t0)
                complete(server, warm, 2)  # as warm as the others (a distinct prompt: no shared prefix)
                runs["restart"].append(turn(server, context))
                stats = server.engine_stats()  # the hit: an entry read back while idle, or from disk then
                read_back.append({"warmed": stats["prefix_cache_warmed"], "disk_hits": stats["prefix_cache_disk_hits"]})
            context = context + runs["cache"][-1][1] + random_ids(3 + len(prompts), vocab, args.growth)
    clear_spilled(model)

    answers = {mode: [r[1] for r in turns] for mode, turns in runs.items()}
    if not answers["cache"] == answers["no_cache"] == answers["restart"]:
        raise SystemExit("the answers differ between modes: a cached prefix did not give a cold prefill's bits")
    later = slice(1, None)  # turns 2…N: the ones a cache can serve

    def speedup(mode: str) -> float:
        return median(a[0] / b[0] for a, b in zip(runs["no_cache"][later], runs[mode][later]))

    result = {"model": str(model), "turns": args.turns, "first": args.first, "growth": args.growth,
              "answer": args.answer, "prefix_cache": args.prefix_cache, "prompt_tokens": [len(p) for p in prompts],
              "ttft_s": {mode: [round(r[0], 4) for r in turns] for mode, turns in runs.items()},
              "cached_tokens": {mode: [r[2] for r in turns] for mode, turns in runs.items()},
              "restart_ready_s": [round(t, 2) for t in loads], "restart_read_back": read_back,
              "median_speedup_turns_2_on": {"cache": speedup("cache"), "restart": speedup("restart")}}
    for i, n in enumerate(result["prompt_tokens"]):
        print(f"session turn {i + 1:2}: {n:6} prompt tokens · TTFT cache "
              f"{result['ttft_s']['cache'][i] * 1e3:9.1f} ms · none {result['ttft_s']['no_cache'][i] * 1e3:9.1f} ms "
              f"· after a restart {result['ttft_s']['restart'][i] * 1e3:9.1f} ms (cached "
              f"{result['cached_tokens']['cache'][i]} / {result['cached_tokens']['restart'][i]})", file=sys.stderr)
    return result


# ----------------------------------------------------------------------------- llama.cpp, N sequences


def llama_parallel(gguf_path: Path, seqs: int, prompt: int, tokens: int, threads: int) -> dict:
    """llama-server's `--parallel N` step by hand: N sequences in one unified KV cache, their prompts
    in one batch, then one `llama_decode` a step with each sequence's greedy next token."""
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(gguf_path).encode(), mp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx = seqs * (prompt + tokens + 16)
    cp.n_batch = cp.n_ubatch = max(seqs * prompt, 32)
    cp.n_seq_max, cp.kv_unified = seqs, True
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(cp.n_batch, 0, seqs)

    def decode(items) -> list[int]:
        """items: (token, position, sequence, wants logits); the greedy next token of each that wants them."""
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (vocab,))))
                for i, item in enumerate(items) if item[3]]

    def run() -> tuple[float, float]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        prompts = [random_ids(10_001 + s, vocab, prompt) for s in range(seqs)]  # drawn as the sweep's are
        t0 = time.perf_counter()
        nxt = decode([(t, i, s, i == prompt - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
        t1 = time.perf_counter()
        for step in range(tokens - 1):
            nxt = decode([(t, prompt + step, s, True) for s, t in enumerate(nxt)])
        return t1 - t0, time.perf_counter() - t1

    run()  # warm: the mmapped weights touched, the graph built
    prefill, decoding = run()
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"sequences": seqs, "aggregate_tok_s": seqs * tokens / (prefill + decoding),
            "decode_tok_s": seqs * (tokens - 1) / decoding, "prefill_s": prefill, "threads": threads,
            "version": L.__version__}


def llamacpp(args, sweep_result: dict | None) -> dict:
    """llama.cpp at N = 1 and N = --parallel, each in a child process, against colibri's sweep."""
    missing = [m for m in ("gguf", "llama_cpp") if not _importable(m)]
    if missing:
        print(f"llama.cpp: not measured: {', '.join(missing)} not installed (pip install -e '.[bench]')",
              file=sys.stderr)
        return {"skipped": f"{', '.join(missing)} not installed (the bench extra)"}
    path = gguf_model(args)
    runs = {n: [] for n in sorted({1, args.parallel})}
    for _ in range(args.rounds):  # alternated: the machine's speed drifts within minutes
        for n, done in runs.items():
            out = subprocess.run([sys.executable, __file__, "--child-llama", str(path), "--child-seqs", str(n),
                                  "--prompt", str(args.prompt), "--tokens", str(args.tokens), "--threads",
                                  str(args.threads)], capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                hint = bench_llamacpp.LLAMA_CRASH_HINT if out.returncode < 0 else ""
                raise SystemExit(f"llama.cpp with {n} sequences failed (exit {out.returncode}){hint}:\n"
                                 f"{out.stderr[-3000:]}")
            done.append(json.loads(lines[-1][7:]))
            print(f"llama.cpp {n:3} sequences: {done[-1]['aggregate_tok_s']:8.2f} tok/s aggregate "
                  f"({done[-1]['decode_tok_s']:.2f} decoding)", file=sys.stderr)
    medians = {n: median(r["aggregate_tok_s"] for r in done) for n, done in runs.items()}
    result = {"gguf": str(path), "dims": asdict(llama_dims(args)), "rounds": args.rounds,
              "runs": [r for done in runs.values() for r in done],
              "median_aggregate_tok_s": {str(n): tps for n, tps in medians.items()}, "ratio": None}
    resident = (sweep_result or {}).get("resident")
    colibri = None
    if resident is not None:
        mode = "batched" if resident["batched"] else "one_at_a_time"
        colibri = next((p for p in resident[mode] if p["clients"] == args.parallel), None)
        result["colibri_mode"] = mode
    if colibri is not None:
        result["colibri_aggregate_tok_s"] = colibri["aggregate_tok_s"]
        result["ratio"] = colibri["aggregate_tok_s"] / medians[args.parallel]
        print(f"colibri ({result['colibri_mode']}) / llama.cpp (median of {args.rounds}) at {args.parallel} clients: "
              f"{result['ratio']:.2f}x", file=sys.stderr)
    else:
        print(f"colibri / llama.cpp: no ratio (the resident sweep did not run {args.parallel} clients)",
              file=sys.stderr)
    return result


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# ----------------------------------------------------------------------------- llama.cpp's server


def llama_server(args, sweep_result: dict | None) -> dict:
    """llama-server at `--parallel 1` and `--parallel P` under the sweep's load (the same prompts, warm-up
    and --tokens, end of sequence ignored), on the resident regime's model as a GGUF, against colibri's
    resident sweep at each client count."""
    binary = args.llama_server
    if not binary.is_file():
        print(f"llama-server: not measured: no binary at {binary} (llama.cpp's llama-server target)",
              file=sys.stderr)
        return {"skipped": f"no llama-server at {binary}"}
    gguf, vocab = resident_gguf(args), vocab_size(resident_model(args))
    slot = max(args.warm + 8, args.prompt + args.tokens) + 16  # each slot's context, in tokens
    result = {"binary": str(binary), "version": llama_server_version(binary), "gguf": str(gguf),
              "slot_context": slot}
    for mode, n in (("one_at_a_time", 1), ("batched", args.parallel)):
        with LlamaServer(binary, gguf, n, slot, args.threads, args.timeout) as server:
            result[mode + "_flags"] = server.flags
            result[mode] = measure(server, vocab, args, f"llama-server --parallel {n}")
    result["batched_vs_one_at_a_time"] = [{"clients": one["clients"],
                                           "aggregate_tok_s": ratio(many["aggregate_tok_s"], one["aggregate_tok_s"])}
                                          for one, many in zip(result["one_at_a_time"], result["batched"])]
    resident = (sweep_result or {}).get("resident")
    if resident is None:
        print("colibri / llama-server: no ratio (the resident sweep did not run)", file=sys.stderr)
        return result
    result["colibri_over_llama_server"] = []
    for mode in ("one_at_a_time", "batched"):
        for ours, theirs in zip(resident[mode] or [], result[mode]):
            q = {"mode": mode, "clients": ours["clients"], "colibri_tok_s": ours["aggregate_tok_s"],
                 "llama_server_tok_s": theirs["aggregate_tok_s"],
                 "aggregate_tok_s": ratio(ours["aggregate_tok_s"], theirs["aggregate_tok_s"])}
            result["colibri_over_llama_server"].append(q)
            print(f"colibri / llama-server, {mode.replace('_', ' ')}, {q['clients']:3} clients: "
                  f"{q['aggregate_tok_s']:.2f}x", file=sys.stderr)
    return result


# ----------------------------------------------------------------------------- the run


@contextlib.contextmanager
def cpu_lock():
    """The machine's CPU lock (colibri-cpu.lock in the temp directory), taken as `flock` takes it: a
    blocking flock(2), queued with the other waiters (a polling lock, as filelock's, loses to them)."""
    with open(Path(tempfile.gettempdir()) / "colibri-cpu.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {f.name}", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases it


def machine(threads: int) -> dict:
    from colibri_core import kernels
    from colibri_core.planning import memory_bandwidth

    kernels.set_threads(threads)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "read_gbps": memory_bandwidth() / 1e9,
            "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens (seconds): the tool's own check")
    ap.add_argument("--parts", default="sweep,session,llamacpp,llamaserver",
                    help="comma-separated: sweep, session, llamacpp, llamaserver")
    ap.add_argument("--regimes", default="resident,streamed", help="the sweep's: resident, streamed")
    ap.add_argument("--clients", default="1,2,4,8,16", help="concurrent clients of the sweep")
    ap.add_argument("--parallel", type=int, default=8, help="the batched server's --parallel (and llama.cpp's N)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt ids of each sweep request")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each sweep request generates")
    ap.add_argument("--warm", type=int, default=512, help="prompt ids of the request that warms each sweep server")
    ap.add_argument("--resident-layers", type=int, default=16, help="OLMoE-1B-7B layers kept (16: all)")
    ap.add_argument("--resident-model", type=Path, help="the resident regime's container (default: built)")
    ap.add_argument("--resident-gguf", type=Path, help="llama-server's model for the resident regime (default: the "
                    "GGUF the container was built from; with --resident-model, its Q4_0 written beside it)")
    ap.add_argument("--llama-server", type=Path, default=ROOT / "bench-data" / "llama-server",
                    help="llama.cpp's llama-server binary (the llamaserver part)")
    ap.add_argument("--streamed-layers", type=int, default=4, help="Qwen3.6 layers kept (40: all, 17.9 GB)")
    ap.add_argument("--streamed-model", type=Path, help="the streamed regime's container (default: the Qwen3.6 slice)")
    ap.add_argument("--streamed-policy", default=EngineOptions().policy,
                    help="the streamed regime's expert cache policy (lru, lfu, lfu_aging; default: the engine's)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--first", type=int, default=1024, help="the session's first prompt, in ids")
    ap.add_argument("--growth", type=int, default=256, help="new ids each later turn adds")
    ap.add_argument("--answer", type=int, default=16, help="tokens the model answers each turn")
    ap.add_argument("--prefix-cache", default="2GB", help="the session's prefix cache (RAM) with the cache on")
    ap.add_argument("--rounds", type=int, default=3, help="llama.cpp runs of each N, alternated (median reported)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a request may wait for its next bytes "
                    "(a server that stopped answering fails the run; --quick: 60)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--data", type=Path, default=None, help="where the models are built and kept (default: "
                    "bench-data/; with --quick a temporary directory)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--child-llama", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-seqs", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_llama:
        print("RESULT " + json.dumps(llama_parallel(args.child_llama, args.child_seqs, args.prompt, args.tokens,
                                                    args.threads)))
        return
    parts, args.regimes = args.parts.split(","), args.regimes.split(",")
    args.clients = [int(c) for c in args.clients.split(",")]
    if args.quick:
        args.clients, args.parallel, args.prompt, args.tokens, args.warm, args.timeout = [1, 2, 4], 4, 8, 6, 32, 60
        args.rounds = 1
        # the session's turns pass the server's prefill chunk (256 tokens, the boundaries states are kept at)
        args.turns, args.first, args.growth, args.answer, args.prefix_cache = 3, 300, 80, 4, "64MB"
    temporary = args.data is None and args.quick
    args.data = Path(tempfile.mkdtemp(prefix="bench-serve-")) if temporary else (args.data or ROOT / "bench-data")
    args.data.mkdir(parents=True, exist_ok=True)

    batching = "--parallel" in serve_flags()
    if not batching:
        print("\n*** `colibri serve` has no --parallel: it serves one request at a time. Only that baseline is "
              "measured; no batched figures, no ratios. ***\n", file=sys.stderr)
    result = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                           if not k.startswith("child")},
              "serve_has_parallel": batching, "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        with cpu_lock():
            result["machine"] = machine(args.threads)
            if "sweep" in parts:
                result["sweep"] = sweep(args, batching)
            if "session" in parts:
                result["session"] = session(args)
            if "llamacpp" in parts:
                result["llamacpp"] = llamacpp(args, result.get("sweep"))
            if "llamaserver" in parts:
                result["llamaserver"] = llama_server(args, result.get("sweep"))
    finally:
        if temporary:
            shutil.rmtree(args.data, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
