"""Train a tiny GLM-5.2 and its MTP head, so the head's drafts are accepted for real (the MTP
benchmark in BENCHMARKS.md), then convert it.

    apt-get install bible-kjv-text            # the corpus, as for tools/train_demo.py
    python tools/train_mtp.py /tmp/glm-mtp [--lm-steps 400] [--steps 300] [--quant int4]

The model is tools/tiny_model.py's glm52 with one decoder layer more, which becomes the MTP layer.
1. The main model (its first layers) learns the King James Bible with the demo's tokenizer, as
   tools/train_demo.py teaches the demo model: a random model's next token is close to noise, and
   no head predicts noise (on one, 400 head steps reached ~10 % agreement).
2. The main model is frozen; the head — enorm, hnorm, eh_proj, its decoder layer, shared_head.norm —
   learns, from the model's final hidden state at t and token t + 1, the token the model itself
   chooses at t + 2 (distillation), on the model's own greedy continuations of held-out verses,
   which is where it drafts, and exactly as colibri runs it (`Glm52.mtp_forward`: the published
   DeepSeek-V3 MTP module, GLM's layout).
Needs the test extra (torch, transformers); deterministic (fixed seeds, one thread); a few minutes.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import shutil
import time
from pathlib import Path

import numpy as np


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_model, train_demo = _tool("tiny_model"), _tool("train_demo")
SEQ, BATCH = 128, 16  # language-model phase: context and batch (tokens)
PROMPT, NEW = 8, 40  # head phase: a verse's first tokens, then the model's greedy continuation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lm-steps", type=int, default=400, help="steps of the main model on the text")
    ap.add_argument("--steps", type=int, default=300, help="steps of the MTP head")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    from colibri_core.convert import convert_checkpoint

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    base = tiny_model.hf_config("glm52")
    n = base.num_hidden_layers  # the MTP layer's index
    full_cfg = type(base)(**{**{k: v for k, v in base.to_dict().items() if k != "layer_types"},
                             "num_hidden_layers": n + 1, "indexer_types": [*base.indexer_types, "full"],
                             "mlp_layer_types": [*base.mlp_layer_types, "sparse"]})
    full = AutoModelForCausalLM.from_config(full_cfg, attn_implementation="eager", dtype=torch.float32).eval()
    main_model = AutoModelForCausalLM.from_config(base, attn_implementation="eager", dtype=torch.float32)
    main_model.load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith(f"model.layers.{n}.")})

    tok = Tokenizer.from_file(str(tiny_model.DEMO / "tokenizer.json"))
    train_verses, val_verses = train_demo.corpus()
    train, val = train_demo.stream(tok, train_verses), train_demo.stream(tok, val_verses)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()

    # ---- 1. the main model learns the text (tools/train_demo.py's recipe)
    opt = torch.optim.AdamW(main_model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.lm_steps)))))
    main_model.train()
    for step in range(args.lm_steps):
        starts = rng.integers(0, len(train) - SEQ - 1, BATCH)
        x = torch.tensor(np.stack([train[s:s + SEQ + 1] for s in starts]))
        loss = main_model(x[:, :-1], labels=x[:, :-1].clone()).loss  # HF shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(main_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 100 == 0 or step == args.lm_steps - 1:
            print(f"text step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    main_model.eval()
    for p in main_model.parameters():
        p.requires_grad_(False)
    full.load_state_dict(main_model.state_dict(), strict=False)  # the MTP layer (n) keeps its own
    print(f"main model: validation loss {train_demo.val_loss_torch(main_model, val[:20_000]):.3f}")

    # ---- 2. the head learns what the model itself chooses next, on its own greedy continuations
    prompts = [p for p in (tok.encode(v).ids[:PROMPT] for v in val_verses) if len(p) == PROMPT]

    def batch(size: int, first: int | None = None):
        """(hidden at t, token t+1, the model's own choice after t+1), every position of `size` greedy
        continuations (the head, like colibri's, attends from position 0)."""
        picks = range(first, first + size) if first is not None else rng.integers(0, len(prompts), size)
        with torch.no_grad():
            ids = torch.tensor([prompts[i] for i in picks])
            ids = main_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                      min_new_tokens=NEW, do_sample=False, eos_token_id=[], pad_token_id=0)
            hidden = main_model.model(ids).last_hidden_state  # (B, S, H): final-normalised, what lm_head reads
        return hidden[:, :-1], ids[:, 1:], main_model.lm_head(hidden[:, 1:]).argmax(-1)

    H = base.hidden_size
    full_cfg._attn_implementation = "eager"
    layer = full.model.layers[n].train()
    enorm, hnorm, head_norm = (hf.GlmMoeDsaRMSNorm(H, base.rms_norm_eps) for _ in range(3))
    eh_proj = torch.nn.Linear(2 * H, H, bias=False)
    rope = hf.GlmMoeDsaRotaryEmbedding(full_cfg)
    params = [*layer.parameters(), *enorm.parameters(), *hnorm.parameters(), *head_norm.parameters(),
              *eh_proj.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    embed, lm_head = main_model.model.embed_tokens, main_model.lm_head

    def mtp_logits(h, next_ids):
        """(B, T, H) hidden at t, (B, T) token t+1 → (B, T, V) logits for token t+2."""
        x = eh_proj(torch.cat([enorm(embed(next_ids)), hnorm(h)], dim=-1))
        T = x.shape[1]
        pos = torch.arange(T)[None].expand(x.shape[0], -1)
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        out, _ = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos))
        return lm_head(head_norm(out))

    held = batch(32, first=0)  # the first prompts; training draws from all of them
    for step in range(args.steps):
        h, nxt, target = batch(BATCH)
        logits = mtp_logits(h, nxt)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            with torch.no_grad():
                agree = (mtp_logits(held[0], held[1]).argmax(-1) == held[2])[:, PROMPT - 1:].float().mean().item()
            print(f"head step {step}: loss {loss.item():.3f}, agreement with the model on 32 held-out "
                  f"continuations {100 * agree:.1f}% ({time.perf_counter() - t0:.0f} s)")

    full.mtp_extra = {"enorm.weight": enorm.weight, "hnorm.weight": hnorm.weight,
                      "shared_head.norm.weight": head_norm.weight, "eh_proj.weight": eh_proj.weight}
    hf_dir = args.out.with_name(args.out.name + "-hf")
    tiny_model.save_with_mtp(full, hf_dir, args.seed)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model.DEMO / name, hf_dir / name)
    convert_checkpoint(hf_dir, args.out, args.quant, progress=False)
    shutil.rmtree(hf_dir)
    print(f"glm52 with a trained MTP head ({args.quant}) written to {args.out}")


if __name__ == "__main__":
    main()
