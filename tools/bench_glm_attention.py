"""Benchmark: one GLM-5.2 attention layer at the real dimensions (MLA 64 heads, latent 512 + rope
64, DSA indexer 32 × 128, top 2048), random int4 weights, against a context already in the cache.

    flock /tmp/colibri-cpu.lock .venv/bin/python tools/bench_glm_attention.py [--context 4096]

Prints the measured memory bandwidth (a NumPy copy), the resident bytes the layer's attention
weights take, and the time of one decode step and of a 256-token prefill chunk: what 78 layers
cost per token before any expert is read. Numbers go to BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from colibri_core import quant
from colibri_core.kv.cache import Rows
from colibri_core.layers.dsa import Indexer
from colibri_core.layers.mla import MLA, MLACache, MLADims
from colibri_core.layers.rope import Rope

H, HEADS, QL, C, R, NOPE, V = 6144, 64, 2048, 512, 64, 192, 256
IH, ID, TOPK = 32, 128, 2048


def bandwidth() -> float:
    a = np.ones(256 << 20, np.uint8)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best  # read + write


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=256)
    args = ap.parse_args()
    rng = np.random.default_rng(0)

    def mat(rows, cols):
        return quant.quantize((rng.standard_normal((rows, cols), np.float32) * 0.02), "int4")

    dims = MLADims(HEADS, QL, C, NOPE, R, V, scale=(NOPE + R) ** -0.5)
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    mla = MLA(dims, mat(QL, H), ones(QL), mat(HEADS * (NOPE + R), QL), mat(C + R, H), ones(C),
              mat(HEADS * (NOPE + V), C), mat(H, HEADS * V))
    idx = Indexer(mat(IH * ID, QL), mat(ID, H), ones(ID), np.zeros(ID, np.float32),
                  rng.standard_normal((IH, H), np.float32) * 0.02, n_heads=IH, head_dim=ID, rope_dim=R, topk=TOPK)
    weights = [mla.q_a, mla.q_b, mla.kv_a, mla.kv_b, mla.o_proj, idx.wq_b, idx.wk]
    wbytes = sum(w.nbytes for w in weights) + idx.weights_proj.nbytes
    rope = Rope(R, 1e6)
    cache, keys = MLACache(dims), Rows(ID)
    S = args.context
    cache.latent.append(rng.standard_normal((S, C), np.float32))
    cache.k_rope.append(rng.standard_normal((S, R), np.float32))
    keys.append(rng.standard_normal((S, ID), np.float32))

    def step(T: int) -> float:
        x = rng.standard_normal((T, H), np.float32)
        cos, sin = rope.cos_sin(np.arange(cache.length, cache.length + T))
        t = time.perf_counter()
        q_resid, q_nope, q_rope = mla.query(x, cos, sin)
        mla.compress(x, cos, sin, cache)
        keep = idx.select(x, q_resid, cos, sin, keys)
        mla.attend(q_nope, q_rope, cache, keep)
        return time.perf_counter() - t

    step(1)
    decode = min(step(1) for _ in range(5))
    prefill = step(args.prefill)
    bw = bandwidth()
    print(f"memory bandwidth (NumPy copy, read+write): {bw / 1e9:.1f} GB/s")
    print(f"attention weights of one layer (int4, indexer weights_proj f32): {wbytes / 1e6:.1f} MB "
          f"-> {wbytes / bw * 1e3:.2f} ms at that bandwidth")
    print(f"context {S}: decode step {decode * 1e3:.1f} ms/layer ({78 * decode:.2f} s for 78 layers); "
          f"prefill {args.prefill} tokens {prefill * 1e3:.0f} ms/layer")
    print(f"cache per token per layer: {4 * (C + R)} B MLA + {4 * ID} B indexer keys")


if __name__ == "__main__":
    main()
