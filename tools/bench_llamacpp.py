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

Quantisation: colibri int4 (groups of 64, f16 scales) against llama.cpp Q4_0 (groups of 32, f16
scales) for every matrix; colibri's router stays f32 as its converter keeps it; norms f32 in both.
colibri runs with `--activations int8` (llama.cpp also quantises activations to int8 for Q4_0);
`--activations f32` measures the exact mode.
Synthetic files go under bench-data/ (gitignored); `--keep` keeps them for the next run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
        self._pool: dict[tuple, list[np.ndarray]] = {}
        self._rng = np.random.default_rng(0)

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
        pool = self._pool.setdefault(shape, [])
        if len(pool) < self.POOL:
            scale = 1.0 / np.sqrt(shape[1])
            pool.append((self._rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)))
        return pool[hash(name) % len(pool)]

    def fingerprint(self) -> dict:
        return {"fingerprint": "sha256:synthetic", "tensors": len(self.shapes), "bytes": 0, "files": {}}


def build_colibri(d: Dims, dst: Path) -> None:
    """The int4 colibri container of `d`, through the real converter (quantisation memoised per pool matrix)."""
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
        return SyntheticCheckpoint(path, d)

    synthetic.FP8_SCALE_SUFFIX = real_checkpoint.FP8_SCALE_SUFFIX  # the writer reads it off the class
    writer.Checkpoint = synthetic
    writer.q.quantize = quantize
    try:
        layout = Olmoe.layout(Olmoe.parse_config(hf_config(d)))
        writer.convert(src, dst, quant="int4", layout=layout, architecture="olmoe", plugin="colibri-olmoe",
                       plugin_version="bench", progress=True, force=True)
    finally:
        writer.Checkpoint, writer.q.quantize = real_checkpoint, real_quantize
    shutil.rmtree(src)


# ----------------------------------------------------------------------------- GGUF for llama.cpp


def q4_0_random(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 blocks as raw bytes: per 32 columns an f16 scale and 16 bytes of nibbles."""
    nblocks = rows * cols // 32
    blocks = np.empty((nblocks, 18), np.uint8)
    scales = (rng.random(nblocks, dtype=np.float32) * 0.01 + 0.002).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(nblocks, 2)
    blocks[:, 2:] = rng.integers(0, 256, (nblocks, 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 18)


def build_gguf(d: Dims, path: Path) -> None:
    import gguf

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
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>".encode() for i in range(d.vocab)])
    w.add_token_scores([0.0] * d.vocab)
    w.add_token_types([gguf.TokenType.NORMAL] * d.vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    Q4 = gguf.GGMLQuantizationType.Q4_0
    tensors = []  # (name, byte shape, dtype, raw dtype or None, make): streamed, one tensor in memory at a time

    def q4(name, rows, cols, experts=1):
        shape = (rows, cols // 32 * 18) if experts == 1 else (experts, rows, cols // 32 * 18)
        tensors.append((name, shape, np.uint8, Q4, lambda: q4_0_random(rng, experts * rows, cols).reshape(shape)))

    def f32(name, shape, make=None):
        tensors.append((name, shape, np.float32, None, make or (lambda: np.ones(shape, np.float32))))

    H, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    q4("token_embd.weight", d.vocab, H)
    for i in range(d.layers):
        b = f"blk.{i}."
        f32(b + "attn_norm.weight", (H,))
        q4(b + "attn_q.weight", q, H)
        q4(b + "attn_k.weight", kv, H)
        q4(b + "attn_v.weight", kv, H)
        q4(b + "attn_output.weight", H, q)
        per_head = d.gguf_arch == "qwen3moe"  # Qwen3: q/k norm per head; OLMoE: over the full width
        f32(b + "attn_q_norm.weight", (d.head_dim,) if per_head else (q,))
        f32(b + "attn_k_norm.weight", (d.head_dim,) if per_head else (kv,))
        f32(b + "ffn_norm.weight", (H,))
        f32(b + "ffn_gate_inp.weight", (d.experts, H),
            lambda: rng.standard_normal((d.experts, H), dtype=np.float32) * np.float32(0.05))
        q4(b + "ffn_gate_exps.weight", d.inter, H, d.experts)
        q4(b + "ffn_up_exps.weight", d.inter, H, d.experts)
        q4(b + "ffn_down_exps.weight", H, d.inter, d.experts)
    f32("output_norm.weight", (H,))
    q4("output.weight", d.vocab, H)
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


def run_colibri(model: Path, d: Dims, prompt: int, gen: int, threads: int, activations: str) -> dict:
    import colibri_core
    from colibri_core import kernels

    kernels.set_threads(threads)
    engine = colibri_core.load(model, cache_slots=d.experts, activations=activations)
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
            "threads": kernels.threads(), "activations": activations}


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


def read_bandwidth(threads: int) -> float:
    from colibri_core import kernels
    from colibri_core.bench.kernels import read_bandwidth as rb

    kernels.set_threads(threads)
    return rb() / 1e9


def child(args) -> None:
    d = MODELS[args.model]
    if args.layers:
        d = Dims(**{**asdict(d), "layers": args.layers})
    if args.child == "colibri":
        r = run_colibri(Path(args.path), d, args.prompt, args.gen, args.threads, args.activations)
    elif args.child == "llama":
        r = run_llama(Path(args.path), d, args.prompt, args.gen, args.threads)
    else:
        r = {"read_gbps": read_bandwidth(args.threads)}
    r["load_average_after"] = os.getloadavg()[0]  # other work on the machine during the run
    print("RESULT " + json.dumps(r))


def in_child(kind: str, path: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--path", str(path), "--model", args.model,
           "--prompt", str(args.prompt), "--gen", str(args.gen), "--threads", str(args.threads),
           "--activations", args.activations, "--layers", str(args.layers or 0)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{kind} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="olmoe")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefill)")
    ap.add_argument("--gen", type=int, default=32, help="decoded tokens")
    ap.add_argument("--activations", choices=("int8", "f32"), default="int8")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of the two engines (median reported)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic models in bench-data/")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    d = MODELS[args.model]
    if args.layers:
        d = Dims(**{**asdict(d), "layers": args.layers})
    tag = f"{d.name}-{d.layers}l"
    DATA.mkdir(exist_ok=True)
    cdir, gpath = DATA / f"{tag}-int4", DATA / f"{tag}-q4_0.gguf"
    if not (cdir / "colibri.yaml").is_file():
        build_colibri(d, cdir)
    if not gpath.is_file():
        build_gguf(d, gpath.with_suffix(".partial"))
        gpath.with_suffix(".partial").rename(gpath)
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

    def median(key: str, engine: str | None = None) -> float:
        vals = sorted(r[key] if engine is None else r[engine][key] for r in rounds)
        return vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2

    result = {"model": asdict(d), "threads": args.threads, "prompt_tokens": args.prompt, "decode_tokens": args.gen,
              "read_gbps": read, "load_average_before": load_before, "rounds": rounds,
              "decode_ratio": median("decode_ratio"), "prefill_ratio": median("prefill_ratio")}
    print(json.dumps(result, indent=2))
    print(f"{tag}: median of {args.rounds} rounds: decode colibri {median('decode_tok_s', 'colibri'):.1f} tok/s vs "
          f"llama.cpp {median('decode_tok_s', 'llama_cpp'):.1f} ({result['decode_ratio']:.2f}x); prefill "
          f"{median('prefill_tok_s', 'colibri'):.1f} vs {median('prefill_tok_s', 'llama_cpp'):.1f} "
          f"({result['prefill_ratio']:.2f}x); read {read:.1f} GB/s, {args.threads} threads")
    if not args.keep:
        shutil.rmtree(cdir, ignore_errors=True)
        gpath.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
