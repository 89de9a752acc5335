"""Train the bundled demo model: a small genuine MoE of the OLMoE architecture, on the King James
Bible (public domain; Debian's `bible-kjv-text`), with a byte-level BPE tokenizer.

    apt-get install bible-kjv-text            # the corpus (provides the `bible` reader)
    python tools/train_demo.py colibri_core/demo/colibri-demo-kjv [--steps N]

Deterministic: a fixed seed, fixed data order, one thread (so reductions never change order). Exports a Hugging Face directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json), measures validation loss with the float32 model and with the converted
container, and converts it to the int4 container shipped in the repository. Uses torch and
transformers (the test extra), never needed at run time.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SEED = 1611
SEQ = 128  # training context (tokens)
BATCH = 16
VAL_EVERY = 50  # every 50th verse is held out for validation
MODEL = dict(vocab_size=2048, hidden_size=192, intermediate_size=256, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=6, num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
             router_aux_loss_coef=0.01, output_router_logits=True, norm_topk_prob=False, rms_norm_eps=1e-5,
             initializer_range=0.02, tie_word_embeddings=False)


def corpus() -> tuple[list[str], list[str]]:
    """(train verses, validation verses) of the KJV text, references stripped."""
    try:
        out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        sys.exit("the corpus needs Debian's bible-kjv-text: apt-get install bible-kjv-text")
    verses = [re.sub(r"^\S+\d+:\d+ ", "", line).strip() for line in out.splitlines() if line.strip()]
    train = [v for i, v in enumerate(verses) if i % VAL_EVERY]
    val = [v for i, v in enumerate(verses) if i % VAL_EVERY == 0]
    return train, val


def stream(tok, verses: list[str]) -> np.ndarray:
    return np.array([t for v in verses for t in tok.encode(v + "\n").ids], np.int64)


def val_loss_torch(model, val: np.ndarray) -> float:
    import torch

    n = (len(val) - 1) // SEQ
    losses = []
    with torch.no_grad():
        for i in range(0, n, 16):
            x = torch.tensor(np.stack([val[j * SEQ:(j + 1) * SEQ + 1] for j in range(i, min(n, i + 16))]))
            out = model(x[:, :-1], labels=x[:, :-1].clone())
            logits = out.logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                            x[:, 1:].reshape(-1), reduction="sum").item())
    return sum(losses) / (n * SEQ)


def val_loss_engine(model_dir: Path, val: np.ndarray) -> float:
    """Validation loss of a converted container, computed by colibri itself."""
    from colibri_core import load

    n = (len(val) - 1) // SEQ
    total = 0.0
    with load(model_dir) as engine:
        for j in range(n):
            x = val[j * SEQ:(j + 1) * SEQ + 1]
            logits = engine.logits(x[:-1]).astype(np.float64)  # (SEQ, V)
            top = logits.max(-1)
            logz = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
            total += float((logz - logits[np.arange(SEQ), x[1:]]).sum())
    return total / (n * SEQ)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dst", type=Path)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--quant", default="int4")
    args = ap.parse_args()

    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM
    from tokenizers import Tokenizer

    from colibri_core.convert import convert_checkpoint
    from colibri_olmoe.demo import write_tokenizer

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    train_verses, val_verses = corpus()
    work = Path(tempfile.mkdtemp(prefix="colibri-demo-"))
    eos = write_tokenizer(work, train_verses, MODEL["vocab_size"])
    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    train, val = stream(tok, train_verses), stream(tok, val_verses)
    print(f"corpus: {len(train):,} train tokens, {len(val):,} validation tokens", file=sys.stderr)

    config = OlmoeConfig(**MODEL, eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    model = OlmoeForCausalLM._from_config(config, experts_implementation="grouped_mm")  # same math, fast on CPU
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    rng = np.random.default_rng(SEED)
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        starts = rng.integers(0, len(train) - SEQ - 1, BATCH)
        x = torch.tensor(np.stack([train[s:s + SEQ + 1] for s in starts]))
        out = model(x[:, :-1], labels=x[:, :-1].clone())  # HF shifts labels itself: labels = inputs
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {out.loss.item():.3f} ({time.time() - t0:.0f} s)", file=sys.stderr)
    model.eval()
    val_f32 = val_loss_torch(model, val)
    seconds = time.time() - t0

    hf = work / "hf"
    model.config.output_router_logits = False
    model.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / name, hf / name)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos}, indent=2))
    if args.dst.exists():
        shutil.rmtree(args.dst)
    convert_checkpoint(hf, args.dst, args.quant)
    val_container = val_loss_engine(args.dst, val)
    report = {
        "corpus": "King James Bible (public domain), Debian bible-kjv-text; every 50th verse held out",
        "parameters": params, "steps": args.steps, "batch": BATCH, "seq": SEQ, "train_seconds": round(seconds),
        "train_tokens": int(len(train)), "val_tokens": int(len(val)),
        "val_loss_f32": round(val_f32, 4), "val_perplexity_f32": round(math.exp(val_f32), 2),
        f"val_loss_{args.quant}_container": round(val_container, 4),
        f"val_perplexity_{args.quant}_container": round(math.exp(val_container), 2),
        "quant": args.quant,
    }
    (args.dst.parent / f"{args.dst.name}.training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
