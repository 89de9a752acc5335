"""Side by side with llama.cpp: decode and prefill tok/s of colibri and llama.cpp in one run.

Not a test — a benchmark (minutes of CPU, gigabytes of disk and RAM). It builds the same synthetic
model for both engines — random weights, identical shapes — and measures each engine in its own
subprocess, one after the other, everything resident (colibri: every expert cached; llama.cpp:
the GGUF mmapped and touched), then prints tok/s and colibri / llama.cpp ratios.

    pip install -e '.[bench]'      # gguf + llama-cpp-python (compiles llama.cpp, ~5 min)
    flock /tmp/colibri-cpu.lock python tools/bench_llamacpp.py --model olmoe --threads 2

Models (`--model`):
  olmoe  OLMoE-1B-7B: 16 layers, hidden 2048, 16 heads (MHA), 64 experts of 1024, top-8, vocab 50304
  qwen3  Qwen3-30B-A3B's dimensions: 48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts of
         768, top-8, vocab 151936. llama.cpp runs its real qwen3moe graph; colibri has no qwen3_moe
         plugin in this branch, so it runs the OLMoE architecture at these dimensions (GQA, q/k norm
         over the full projected width instead of per head: the same matrices, a few KB of norm
         weights apart). `--layers N` keeps only the first N layers (RAM).

Quantisation (`--quant`): colibri int4 (groups of 64, f16 scales) against llama.cpp Q4_0 (groups of
32, f16 scales), or colibri int8 (a f32 scale per row) against Q8_0 (groups of 32, f16 scales), for
every matrix; colibri's router stays f32 as its converter keeps it; norms f32 in both. colibri runs
with `--activations int8` (llama.cpp also quantises activations to int8 for Q4_0/Q8_0) and
`--kv-cache f16` (llama.cpp's KV cache is float16 by default); `--activations f32 --kv-cache f32`
measures the exact mode.

Larger than RAM (`--memory SIZE`): the model's weights exceed the memory each engine gets, and the
experts are read from disk as the tokens need them. Each engine runs in a memory cgroup of SIZE
(its RSS and the page cache it fills count; needs root, else the machine's RAM is the limit and the
model must exceed it): llama.cpp with its GGUF mmapped (the page cache evicts as it must),
colibri with `ram=SIZE - 1 GiB` and O_DIRECT reads (its own expert cache). colibri's container is
converted from the GGUF (GgufCheckpoint), so both engines run the same model and route alike;
`--routing` chooses how that model routes (build_gguf). Before each run the page cache of both
models is dropped (posix_fadvise DONTNEED: no privilege needed). Each run
decodes `--gen` tokens cold (a fresh process, the first token its prompt) and `--gen` more warm
(the same process, caches filled); reported: tok/s, bytes read from disk per token (/proc/self/io:
mmap faults and O_DIRECT reads alike) and the disk floor (those bytes at the disk's O_DIRECT
bandwidth, measured on the model files in the same run).

    flock /tmp/colibri-cpu.lock python tools/bench_llamacpp.py --model qwen3 --quant int8 --memory 16GB \
        --routing token --gen 16 --rounds 3 --keep

Synthetic files go under bench-data/ (gitignored; `--data DIR` elsewhere); `--keep` keeps them for the next run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data"


@dataclass(frozen=True)
class Dims:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    inter: int
    top_k: int
    vocab: int
    gguf_arch: str  # llama.cpp's architecture for the GGUF


MODELS = {
    "tiny": Dims("tiny", 2, 256, 4, 4, 64, 8, 128, 2, 1024, "olmoe"),  # for checking this script
    "tiny-gqa": Dims("tiny-gqa", 2, 256, 4, 2, 128, 8, 128, 2, 1024, "qwen3moe"),
    "olmoe": Dims("olmoe-1b-7b", 16, 2048, 16, 16, 128, 64, 1024, 8, 50304, "olmoe"),
    "qwen3": Dims("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 128, 768, 8, 151936, "qwen3moe"),
}


# ----------------------------------------------------------------------------- colibri container


def hf_config(d: Dims) -> dict:
    return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": d.vocab,
            "hidden_size": d.hidden, "intermediate_size": d.inter, "num_hidden_layers": d.layers,
            "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads, "num_experts": d.experts,
            "num_experts_per_tok": d.top_k, "norm_topk_prob": False, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "clip_qkv": None, "tie_word_embeddings": False, "eos_token_id": 0, "head_dim": d.head_dim}


def tensor_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint, per-expert form (OLMoE names)."""
    H, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    t = {"model.embed_tokens.weight": (d.vocab, H), "model.norm.weight": (H,), "lm_head.weight": (d.vocab, H)}
    for i in range(d.layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,),
                  p + "mlp.gate.weight": (d.experts, H), p + "self_attn.q_proj.weight": (q, H),
                  p + "self_attn.k_proj.weight": (kv, H), p + "self_attn.v_proj.weight": (kv, H),
                  p + "self_attn.o_proj.weight": (H, q)})
        for e in range(d.experts):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = (d.inter, H)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = (d.inter, H)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = (H, d.inter)
    return t


class SyntheticCheckpoint:
    """Stands in for container.writer.Checkpoint: the same interface, random float32 tensors made on
    demand (a small pool per shape, so building a 30B-parameter container takes minutes, not hours)."""

    POOL = 6  # distinct random matrices per shape

    def __init__(self, path: Path, d: Dims):
        self.path = path
        self.shapes = tensor_shapes(d)
        self.where = {name: self for name in self.shapes}
        self.files = {"synthetic": self}
        self._pool: dict[tuple, dict[int, np.ndarray]] = {}  # shape -> {pool index: matrix}

    def dtype(self, name: str) -> str:
        return "F32"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def scales_of(self, name: str) -> None:
        return None  # float32 throughout: no fp8 block scales

    def read_f32(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        shape = self.shapes[name]
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        # each name's pool matrix by a stable hash, each matrix from its own seed: the same model
        # whatever order the converter's threads ask in (Python's str hash differs per process)
        i = zlib.crc32(name.encode()) % self.POOL
        pool = self._pool.setdefault(shape, {})
        if i not in pool:
            rng = np.random.default_rng([i, *shape])
            pool[i] = rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(shape[1]))
        return pool[i]

    def fingerprint(self) -> dict:
        return {"fingerprint": "sha256:synthetic", "tensors": len(self.shapes), "bytes": 0, "files": {}}


class GgufCheckpoint:
    """The GGUF's model as a writer checkpoint (HF names, dequantised to float32), so that colibri's
    container holds the weights llama.cpp runs, requantised: the two engines then route tokens
    alike (the synthetic pool's few distinct matrices route far more narrowly than random weights,
    which would flatter any cache). Norm weights are ones in both; colibri's OLMoE graph normalises
    q and k over the full width where llama.cpp's qwen3moe does per head."""

    def __init__(self, path: Path, d: Dims, gguf_path: Path):
        import gguf

        self.path, self.shapes = path, tensor_shapes(d)
        self.where = {name: self for name in self.shapes}
        self.files = {"synthetic": self}
        self._tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
        self._dequantize = gguf.quants.dequantize

    dtype, shape, scales_of = SyntheticCheckpoint.dtype, SyntheticCheckpoint.shape, SyntheticCheckpoint.scales_of

    @staticmethod
    def gguf_name(name: str) -> tuple[str, int | None]:
        """HF name -> (GGUF tensor, expert index or None)."""
        fixed = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
        if name in fixed:
            return fixed[name], None
        parts = name.split(".")  # model.layers.I.(self_attn.X_proj | mlp.gate | mlp.experts.E.X_proj).weight
        blk = f"blk.{parts[2]}."
        attn = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
        if parts[3] == "self_attn":
            return blk + attn[parts[4]] + ".weight", None
        if parts[4] == "gate":
            return blk + "ffn_gate_inp.weight", None
        return blk + {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[parts[6]] \
            + ".weight", int(parts[5])

    def read_f32(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        shape = self.shapes[name]
        if len(shape) == 1:
            return np.ones(shape, np.float32)  # norms: ones in the GGUF too
        gname, expert = self.gguf_name(name)
        t = self._tensors[gname]
        data = t.data if expert is None else t.data[expert]
        w = np.asarray(data, np.float32) if t.tensor_type == 0 else self._dequantize(np.asarray(data), t.tensor_type)
        w = w.reshape(shape)
        return w[first:None if count is None else first + count]

    def fingerprint(self) -> dict:
        return {"fingerprint": "sha256:gguf-synthetic", "tensors": len(self.shapes), "bytes": 0, "files": {}}


def build_colibri(d: Dims, dst: Path, kind: str, gguf_path: Path | None = None) -> None:
    """The `kind` (int4, int8) colibri container of `d`, through the real converter: of the
    synthetic pool (quantisation memoised per pool matrix), or of the GGUF at `gguf_path`."""
    from colibri_core import quant
    from colibri_core.container import writer
    from colibri_olmoe.model import Olmoe

    src = dst.with_name(dst.name + "-src")
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text(json.dumps(hf_config(d)))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    memo, real_quantize = {}, quant.quantize

    def quantize(w, kind):  # the pool repeats arrays: quantise each once
        key = (id(w), kind)
        if key not in memo:
            memo[key] = (w, real_quantize(w, kind))
        return memo[key][1]

    real_checkpoint = writer.Checkpoint
    def synthetic(path):
        return SyntheticCheckpoint(path, d) if gguf_path is None else GgufCheckpoint(path, d, gguf_path)

    synthetic.FP8_SCALE_SUFFIX = real_checkpoint.FP8_SCALE_SUFFIX  # the writer reads it off the class
    writer.Checkpoint = synthetic
    if gguf_path is None:
        writer.q.quantize = quantize
    try:
        layout = Olmoe.layout(Olmoe.parse_config(hf_config(d)))
        writer.convert(src, dst, quant=kind, layout=layout, architecture="olmoe", plugin="colibri-olmoe",
                       plugin_version="bench", progress=True, force=True)
    finally:
        writer.Checkpoint, writer.q.quantize = real_checkpoint, real_quantize
    shutil.rmtree(src)


# ----------------------------------------------------------------------------- GGUF for llama.cpp


def random_blocks(rng: np.random.Generator, rows: int, cols: int, payload: int, scale_lo: float, scale_span: float,
                  damp: float = 1.0) -> np.ndarray:
    """Random Q4_0 / Q8_0 blocks as raw bytes: per 32 columns an f16 scale in [scale_lo, scale_lo +
    scale_span) times `damp`, then `payload` random bytes (16 of nibbles, or 32 signed bytes)."""
    nblocks = rows * cols // 32
    blocks = np.empty((nblocks, 2 + payload), np.uint8)
    scales = ((rng.random(nblocks, dtype=np.float32) * scale_span + scale_lo) * damp).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(nblocks, 2)
    blocks[:, 2:] = rng.integers(0, 256, (nblocks, payload), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * (2 + payload))


GGUF_QUANTS = {"int4": ("Q4_0", 16, 0.002, 0.01), "int8": ("Q8_0", 32, 0.0002, 0.001)}  # type, payload, scales


ROUTINGS = {"weights": 1.0, "token": 0.0}  # --routing: the factor on the output projections' scales


def build_gguf(d: Dims, path: Path, quant: str, routing: str = "weights") -> None:
    """The GGUF of `d`: random Q4_0/Q8_0 blocks. `routing` "weights": as random weights route, which
    in a deep random network narrows to a few experts per layer (its hidden states grow alike);
    "token": the attention and expert output projections zero (still read and multiplied), so the
    residual stream stays each token's embedding and every layer routes each token afresh, as
    independently as random tokens are (the caches' worst case; damping them 100-fold instead
    still left 32 of 128 experts per layer serving 16 tokens)."""
    import gguf

    qname, payload, scale_lo, scale_span = GGUF_QUANTS[quant]

    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), d.gguf_arch)
    w.add_name(d.name)
    w.add_context_length(4096)
    w.add_embedding_length(d.hidden)
    w.add_block_count(d.layers)
    w.add_feed_forward_length(d.inter)
    w.add_expert_feed_forward_length(d.inter)
    w.add_head_count(d.heads)
    w.add_head_count_kv(d.kv_heads)
    w.add_key_length(d.head_dim)
    w.add_value_length(d.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(d.experts)
    w.add_expert_used_count(d.top_k)
    w.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + qname))
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(d.vocab)])
    w.add_token_scores([0.0] * d.vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * d.vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    Q = getattr(gguf.GGMLQuantizationType, qname)
    tensors = []  # (name, byte shape, dtype, raw dtype or None, make): streamed, one tensor in memory at a time

    def quantised(name, rows, cols, experts=1, damp=1.0):  # Q4_0 or Q8_0
        row = cols // 32 * (2 + payload)
        shape = (rows, row) if experts == 1 else (experts, rows, row)
        tensors.append((name, shape, np.uint8, Q, lambda: random_blocks(rng, experts * rows, cols, payload, scale_lo,
                                                                        scale_span, damp).reshape(shape)))

    damp = ROUTINGS[routing]

    def f32(name, shape, make=None):
        tensors.append((name, shape, np.float32, None, make or (lambda: np.ones(shape, np.float32))))

    H, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    quantised("token_embd.weight", d.vocab, H)
    for i in range(d.layers):
        b = f"blk.{i}."
        f32(b + "attn_norm.weight", (H,))
        quantised(b + "attn_q.weight", q, H)
        quantised(b + "attn_k.weight", kv, H)
        quantised(b + "attn_v.weight", kv, H)
        quantised(b + "attn_output.weight", H, q, damp=damp)
        per_head = d.gguf_arch == "qwen3moe"  # Qwen3: q/k norm per head; OLMoE: over the full width
        f32(b + "attn_q_norm.weight", (d.head_dim,) if per_head else (q,))
        f32(b + "attn_k_norm.weight", (d.head_dim,) if per_head else (kv,))
        f32(b + "ffn_norm.weight", (H,))
        f32(b + "ffn_gate_inp.weight", (d.experts, H),
            lambda: rng.standard_normal((d.experts, H), dtype=np.float32) * np.float32(0.05))
        quantised(b + "ffn_gate_exps.weight", d.inter, H, d.experts)
        quantised(b + "ffn_up_exps.weight", d.inter, H, d.experts)
        quantised(b + "ffn_down_exps.weight", H, d.inter, d.experts, damp=damp)
    f32("output_norm.weight", (H,))
    quantised("output.weight", d.vocab, H)
    for name, shape, dtype, raw, _ in tensors:
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, shape, dtype, raw, make) in enumerate(tensors):
        w.write_tensor_data(make())
        print(f"\rgguf {i + 1}/{len(tensors)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    w.close()


# ----------------------------------------------------------------------------- measuring


def prompt_ids(d: Dims, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(7).integers(2, d.vocab, n)]


def run_colibri(model: Path, d: Dims, prompt: int, gen: int, threads: int, activations: str, kv_cache: str) -> dict:
    import colibri_core
    from colibri_core import kernels

    kernels.set_threads(threads)
    engine = colibri_core.load(model, cache_slots=d.experts, activations=activations, kv_cache=kv_cache)
    ids = prompt_ids(d, prompt)
    engine.generate(ids[:8], 4, stop_ids=())  # warm-up: every expert of the short run read in
    for layer in range(d.layers):  # everything resident: read every expert once before timing
        for e in range(d.experts):
            engine.store.get(layer, e)
    engine._feed(engine.new_session(), ids)  # a full-size prefill first, as run_llama's warm-up does
    session = engine.new_session()
    t0 = time.perf_counter()
    engine._feed(session, ids)
    prefill = time.perf_counter() - t0
    out = list(ids)
    t1 = time.perf_counter()
    logits = None
    for _ in range(gen):
        out.append(int(np.random.default_rng(len(out)).integers(2, d.vocab)))
        logits = engine._feed(session, out)
    decode = time.perf_counter() - t1
    assert logits is not None and np.isfinite(logits).all()
    return {"prefill_tok_s": prompt / prefill, "decode_tok_s": gen / decode, "simd": kernels.simd(),
            "threads": kernels.threads(), "activations": activations, "kv_cache": kv_cache}


def run_llama(gguf_path: Path, d: Dims, prompt: int, gen: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=prompt + gen + 16, n_batch=max(prompt, 32),
                          n_ubatch=max(prompt, 32), n_threads=threads, n_threads_batch=threads,
                          use_mmap=True, use_mlock=False, verbose=False, logits_all=False)
    ids = prompt_ids(d, prompt)
    llm.eval(ids[:8])  # warm-up
    llm.reset()
    llm.eval(ids)  # touch every page once more (mmapped weights)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(gen):
        llm.eval([int(np.random.default_rng(prompt + i).integers(2, d.vocab))])
    decode = time.perf_counter() - t1
    return {"prefill_tok_s": prompt / prefill, "decode_tok_s": gen / decode, "threads": threads,
            "version": llama_cpp.__version__}


# ----------------------------------------------------------------------------- larger than RAM

MARGIN = 1 << 30  # what colibri's --ram leaves of the cgroup (at most an eighth): interpreter, NumPy, buffers


def read_bytes() -> int:
    """Bytes this process has caused to be read from the disk (page faults on mmapped files and O_DIRECT reads alike)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def decode_phases(step, gen: int) -> dict:
    """`step(i)` feeds the i-th token; `gen` tokens cold, then `gen` warm: tok/s and bytes read per token of each."""
    out = {}
    for phase, first in (("cold", 0), ("warm", gen)):
        b0, t0 = read_bytes(), time.perf_counter()
        for i in range(first, first + gen):
            step(i)
        dt, nbytes = time.perf_counter() - t0, read_bytes() - b0
        out[phase] = {"tok_s": gen / dt, "bytes_per_token": nbytes / gen}
    return out


def streamed_token(d: Dims, i: int) -> int:
    return int(np.random.default_rng(1000 + i).integers(2, d.vocab))


def parse_size(text: str) -> int:
    from colibri_core.sizes import parse_size as parse

    return parse(text)


def run_colibri_streamed(model: Path, d: Dims, gen: int, threads: int, activations: str, kv_cache: str,
                         memory: int) -> dict:
    import colibri_core
    from colibri_core import kernels

    kernels.set_threads(threads)
    t0 = time.perf_counter()
    ram = memory - min(MARGIN, memory // 8)
    engine = colibri_core.load(model, ram=ram, direct=True, usage=False, activations=activations, kv_cache=kv_cache)
    load = time.perf_counter() - t0
    session, ids = engine.new_session(), []

    def step(i):
        ids.append(streamed_token(d, i))
        engine._feed(session, ids)

    r = decode_phases(step, gen)
    return {**r, "load_s": load, "simd": kernels.simd(), "threads": kernels.threads(), "activations": activations,
            "kv_cache": kv_cache, "ram": ram, "cache_slots_per_layer": engine.split.cache_slots,
            "direct": engine.store.stats()["direct_io"]}


def run_llama_streamed(gguf_path: Path, d: Dims, gen: int, threads: int) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=2 * gen + 16, n_batch=32, n_ubatch=32, n_threads=threads,
                          n_threads_batch=threads, use_mmap=True, use_mlock=False, verbose=False, logits_all=False)
    load = time.perf_counter() - t0
    r = decode_phases(lambda i: llm.eval([streamed_token(d, i)]), gen)
    return {**r, "load_s": load, "threads": threads, "version": llama_cpp.__version__}


class MemoryLimit:
    """A memory cgroup (v2, or v1's memory controller) holding what its processes use — RSS and the
    page cache they fill — to `limit` bytes. Needs root; `reason` says why not where it cannot be made."""

    def __init__(self, limit: int):
        self.limit, self.path, self.reason = limit, None, None
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
        name = f"colibri-bench-{os.getpid()}"
        try:
            if (v2 / "cgroup.controllers").is_file():
                (v2 / "cgroup.subtree_control").write_text("+memory")
                self.path, self.files = v2 / name, ("memory.max", "memory.peak")
            else:
                self.path, self.files = v1 / name, ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
            self.path.mkdir()
            (self.path / self.files[0]).write_text(str(limit))
        except OSError as e:
            self.path, self.reason = None, f"no memory cgroup ({e.strerror}: {e.filename})"

    def enter(self) -> None:
        """For preexec_fn: the calling process joins the cgroup."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        """The most the cgroup held since the last reset (v1: reset by writing 0; v2's peak is per cgroup)."""
        return int((self.path / self.files[1]).read_text()) if self.path is not None else None

    def reset_peak(self) -> None:
        if self.path is not None and self.files[1].endswith("max_usage_in_bytes"):
            (self.path / self.files[1]).write_text("0")

    def close(self) -> None:
        if self.path is not None:
            self.path.rmdir()


def model_files(path: Path) -> list[Path]:
    return [p for p in sorted(path.rglob("*")) if p.is_file()] if path.is_dir() else [path]


def read_bandwidth(threads: int) -> float:
    from colibri_core import kernels
    from colibri_core.planning import memory_bandwidth as rb

    kernels.set_threads(threads)
    return rb() / 1e9


def child(args) -> None:
    d = MODELS[args.model]
    if args.layers:
        d = Dims(**{**asdict(d), "layers": args.layers})
    memory = parse_size(args.memory) if args.memory else 0
    if args.child == "colibri":
        r = (run_colibri_streamed(Path(args.path), d, args.gen, args.threads, args.activations, args.kv_cache, memory)
             if memory else run_colibri(Path(args.path), d, args.prompt, args.gen, args.threads, args.activations,
                                        args.kv_cache))
    elif args.child == "llama":
        r = (run_llama_streamed(Path(args.path), d, args.gen, args.threads) if memory
             else run_llama(Path(args.path), d, args.prompt, args.gen, args.threads))
    else:
        r = {"read_gbps": read_bandwidth(args.threads)}
    r["load_average_after"] = os.getloadavg()[0]  # other work on the machine during the run
    print("RESULT " + json.dumps(r))


# pip's llama-cpp-python is built for the CPU it compiles on; where that CPU has AMX (an Intel Xeon
# VM, 2026-12-03) its AMX kernels crashed (SIGSEGV in the first decode), so build it without them.
LLAMA_CRASH_HINT = (" — llama.cpp crashed; on a CPU with AMX rebuild it without: CMAKE_ARGS='-DGGML_NATIVE=OFF "
                    "-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON "
                    "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON' pip install --force-reinstall "
                    "--no-deps --no-cache-dir llama-cpp-python")


def in_child(kind: str, path: Path, args, limit: MemoryLimit | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--path", str(path), "--model", args.model,
           "--prompt", str(args.prompt), "--gen", str(args.gen), "--threads", str(args.threads),
           "--activations", args.activations, "--kv-cache", args.kv_cache, "--layers", str(args.layers or 0),
           "--memory", args.memory or ""]
    out = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit.enter if limit else None)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        hint = LLAMA_CRASH_HINT if kind == "llama" and out.returncode < 0 else ""
        raise SystemExit(f"{kind} run failed (exit {out.returncode}){hint}:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def larger_than_ram(args, d: Dims, cdir: Path, gpath: Path) -> None:
    """The `--memory` case: both engines cold and warm under the same memory limit, alternating."""
    from colibri_core.bench.model import drop_file_pages
    from colibri_core.sizes import available_memory, format_bytes
    from colibri_core.planning import disk_bandwidth

    memory = parse_size(args.memory)
    sizes = {"colibri": sum(p.stat().st_size for p in model_files(cdir)), "llama_cpp": gpath.stat().st_size}
    if min(sizes.values()) <= memory:
        raise SystemExit(f"--memory {args.memory}: the models ({format_bytes(min(sizes.values()))}) must be larger")
    limit = MemoryLimit(memory)
    ram = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    if limit.path is None:
        if min(sizes.values()) <= ram:
            raise SystemExit(f"{limit.reason}, and the models fit in this machine's RAM ({format_bytes(ram)})")
        print(f"{limit.reason}: the machine's RAM ({format_bytes(ram)}) is the limit", file=sys.stderr)
    paths = model_files(cdir) + [gpath]
    drop_file_pages(paths)
    disk, direct = disk_bandwidth([p for p in model_files(cdir) if p.stat().st_size > 1 << 28][:8], nbytes=2 << 30)
    read = in_child("read", cdir, args)["read_gbps"]
    rounds = []
    try:
        for i in range(args.rounds):
            r = {}
            for engine, path in (("colibri", cdir), ("llama_cpp", gpath)):
                drop_file_pages(paths)  # cold: nothing of either model in the page cache
                limit.reset_peak()
                r[engine] = {**in_child("colibri" if engine == "colibri" else "llama", path, args, limit),
                             "peak_memory": limit.peak()}
            for phase in ("cold", "warm"):
                r[phase + "_ratio"] = r["colibri"][phase]["tok_s"] / r["llama_cpp"][phase]["tok_s"]
            rounds.append(r)
            print(f"round {i + 1}: " + "; ".join(
                f"{ph} colibri {r['colibri'][ph]['tok_s']:.2f} vs llama.cpp {r['llama_cpp'][ph]['tok_s']:.2f} tok/s "
                f"({r[ph + '_ratio']:.2f}x), read {r['colibri'][ph]['bytes_per_token'] / 1e9:.2f} vs "
                f"{r['llama_cpp'][ph]['bytes_per_token'] / 1e9:.2f} GB/token" for ph in ("cold", "warm")), file=sys.stderr)
    finally:
        limit.close()
    result = {"model": asdict(d), "quant": args.quant, "routing": args.routing, "threads": args.threads,
              "decode_tokens": args.gen, "memory_limit": memory, "cgroup": limit.reason or "yes", "machine_ram": ram,
              "available_memory": available_memory(), "model_bytes": sizes, "disk_gbps": disk / 1e9,
              "disk_direct": direct, "read_gbps": read, "rounds": rounds}
    for ph in ("cold", "warm"):
        result[ph] = {"ratio": median(r[ph + "_ratio"] for r in rounds)}
        for engine in ("colibri", "llama_cpp"):
            bpt = median(r[engine][ph]["bytes_per_token"] for r in rounds)
            result[ph][engine] = {"tok_s": median(r[engine][ph]["tok_s"] for r in rounds), "bytes_per_token": bpt,
                                  "disk_floor_tok_s": disk / bpt if bpt else None}
    print(json.dumps(result, indent=2))
    for ph in ("cold", "warm"):
        c, ll = result[ph]["colibri"], result[ph]["llama_cpp"]
        floor = lambda e: f"{e['disk_floor_tok_s']:.2f}" if e["disk_floor_tok_s"] else "-"  # noqa: E731
        print(f"{ph}: colibri {c['tok_s']:.2f} tok/s ({c['bytes_per_token'] / 1e9:.2f} GB/token read, disk floor "
              f"{floor(c)} tok/s) vs llama.cpp {ll['tok_s']:.2f} ({ll['bytes_per_token'] / 1e9:.2f} GB/token, floor "
              f"{floor(ll)}): {result[ph]['ratio']:.2f}x (median of {args.rounds})")
    print(f"models: colibri {format_bytes(sizes['colibri'])}, llama.cpp {format_bytes(sizes['llama_cpp'])}; memory "
          f"{format_bytes(memory)} ({'cgroup' if limit.reason is None else limit.reason}); disk {disk / 1e9:.2f} GB/s "
          f"({'O_DIRECT' if direct else 'page cache'}); read {read:.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="olmoe")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefill)")
    ap.add_argument("--gen", type=int, default=32, help="decoded tokens")
    ap.add_argument("--activations", choices=("int8", "f32"), default="int8")
    ap.add_argument("--kv-cache", choices=("f16", "f32"), default="f16", help="colibri's KV cache (llama.cpp's is f16)")
    ap.add_argument("--quant", choices=sorted(GGUF_QUANTS), default="int4", help="int4 vs Q4_0, or int8 vs Q8_0")
    ap.add_argument("--memory", default="", help="larger than RAM: each engine gets this much memory (e.g. 12GB)")
    ap.add_argument("--routing", choices=sorted(ROUTINGS), default="weights",
                    help="with --memory: route as the random weights do, or by each token afresh (build_gguf)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of the two engines (median reported)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic models in --data")
    ap.add_argument("--data", type=Path, default=DATA, help="where the synthetic models go (default: bench-data/)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    d = MODELS[args.model]
    if args.layers:
        d = Dims(**{**asdict(d), "layers": args.layers})
    tag = f"{d.name}-{d.layers}l"
    args.data.mkdir(parents=True, exist_ok=True)
    cdir, gpath = args.data / f"{tag}-{args.quant}", args.data / f"{tag}-{GGUF_QUANTS[args.quant][0].lower()}.gguf"
    if args.memory:  # what is read from disk depends on the routing: colibri's container from the GGUF
        routed = "" if args.routing == "weights" else f"-{args.routing}-routed"
        gpath = gpath.with_name(gpath.stem + routed + ".gguf")
        cdir = cdir.with_name(cdir.name + routed + "-of-gguf")
    if not gpath.is_file():
        build_gguf(d, gpath.with_suffix(".partial"), args.quant, args.routing)
        gpath.with_suffix(".partial").rename(gpath)
    if not (cdir / "colibri.yaml").is_file():
        build_colibri(d, cdir, args.quant, gpath if args.memory else None)
    if args.memory:
        larger_than_ram(args, d, cdir, gpath)
        if not args.keep:
            shutil.rmtree(cdir, ignore_errors=True)
            gpath.unlink(missing_ok=True)
        return
    load_before = os.getloadavg()[0]
    read = in_child("read", cdir, args)["read_gbps"]
    # The engines alternate, round after round: this shared machine's speed drifts by up to 2x
    # within minutes, so each round's ratio compares runs made side by side; the median is reported.
    rounds = []
    for i in range(args.rounds):
        ours, theirs = in_child("colibri", cdir, args), in_child("llama", gpath, args)
        rounds.append({"colibri": ours, "llama_cpp": theirs,
                       "decode_ratio": ours["decode_tok_s"] / theirs["decode_tok_s"],
                       "prefill_ratio": ours["prefill_tok_s"] / theirs["prefill_tok_s"]})
        print(f"round {i + 1}: decode colibri {ours['decode_tok_s']:.1f} vs llama.cpp {theirs['decode_tok_s']:.1f} tok/s "
              f"({rounds[-1]['decode_ratio']:.2f}x); prefill {ours['prefill_tok_s']:.1f} vs "
              f"{theirs['prefill_tok_s']:.1f} ({rounds[-1]['prefill_ratio']:.2f}x)", file=sys.stderr)

    def med(key: str, engine: str | None = None) -> float:
        return median(r[key] if engine is None else r[engine][key] for r in rounds)

    result = {"model": asdict(d), "quant": args.quant, "threads": args.threads, "prompt_tokens": args.prompt,
              "decode_tokens": args.gen, "read_gbps": read, "load_average_before": load_before, "rounds": rounds,
              "decode_ratio": med("decode_ratio"), "prefill_ratio": med("prefill_ratio")}
    print(json.dumps(result, indent=2))
    print(f"{tag}: median of {args.rounds} rounds: decode colibri {med('decode_tok_s', 'colibri'):.1f} tok/s vs "
          f"llama.cpp {med('decode_tok_s', 'llama_cpp'):.1f} ({result['decode_ratio']:.2f}x); prefill "
          f"{med('prefill_tok_s', 'colibri'):.1f} vs {med('prefill_tok_s', 'llama_cpp'):.1f} "
          f"({result['prefill_ratio']:.2f}x); read {read:.1f} GB/s, {args.threads} threads; colibri with "
          f"{args.activations} activations and a {args.kv_cache} KV cache")
    if not args.keep:
        shutil.rmtree(cdir, ignore_errors=True)
        gpath.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
