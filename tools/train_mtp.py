"""Train the MTP head of a tiny GLM-5.2 against its own model, so its drafts are accepted for real
(the MTP benchmark in BENCHMARKS.md), then convert it.

    python tools/train_mtp.py /tmp/glm-mtp [--steps 300] [--quant int4]

The model is tools/tiny_model.py's glm52 with one decoder layer more, which becomes the MTP layer.
The main model (its first layers) is frozen;
the head — enorm, hnorm, eh_proj, its decoder layer, shared_head.norm — learns, from the model's
final hidden state at t and token t + 1, the token the model itself chooses at t + 2, on fresh random
contexts every step (distillation), exactly as colibri runs it (`Glm52.mtp_forward`: the published DeepSeek-V3 MTP
module, GLM's layout). Needs the test extra (torch, transformers); a few minutes of one core.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import time
from pathlib import Path

spec = importlib.util.spec_from_file_location("tiny_model", Path(__file__).with_name("tiny_model.py"))
tiny_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    from colibri_core.convert import convert_checkpoint

    torch.manual_seed(args.seed)
    base = tiny_model.hf_config("glm52")
    n = base.num_hidden_layers  # the MTP layer's index
    full_cfg = type(base)(**{**{k: v for k, v in base.to_dict().items() if k != "layer_types"},
                             "num_hidden_layers": n + 1, "indexer_types": [*base.indexer_types, "full"],
                             "mlp_layer_types": [*base.mlp_layer_types, "sparse"]})
    full = AutoModelForCausalLM.from_config(full_cfg, attn_implementation="eager", dtype=torch.float32).eval()
    main_model = AutoModelForCausalLM.from_config(base, attn_implementation="eager", dtype=torch.float32).eval()
    main_model.load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith(f"model.layers.{n}.")})
    for p in main_model.parameters():
        p.requires_grad_(False)

    # ---- data: what the main model itself chooses next, on random contexts (a fresh batch each step)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def batch(size: int, length: int = 32):
        """(hidden at t, token t+1, the model's own choice after t+1) for random token sequences."""
        with torch.no_grad():
            ids = torch.randint(0, base.vocab_size, (size, length), generator=gen)
            out = main_model(ids, output_hidden_states=False)
            hidden = main_model.model(ids).last_hidden_state  # (B, S, H): final-normalised, what lm_head reads
        return hidden[:, :-1], ids[:, 1:], out.logits[:, 1:].argmax(-1)

    # ---- the head: layer n of `full` + its own norms and projection, as Glm52.mtp_forward runs it
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

    held = batch(16)
    t0 = time.perf_counter()
    for step in range(args.steps):
        h, nxt, target = batch(16)
        logits = mtp_logits(h, nxt)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            with torch.no_grad():
                acc = (mtp_logits(held[0], held[1]).argmax(-1) == held[2]).float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, held-out agreement with the model {100 * acc:.1f}% "
                  f"({time.perf_counter() - t0:.0f} s)")

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
