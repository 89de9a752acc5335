"""A tiny random model of any shipped architecture, converted and ready for `colibri run` — to try a
store or CLI feature on every architecture without a download (needs the test extra: torch,
transformers). Its vocabulary is the demo model's tokenizer, so prompts are text; its output is
random text, its routing real.

    python tools/tiny_model.py glm52 /tmp/tiny-glm52 [--quant int4]
    colibri run --model /tmp/tiny-glm52 --cache-slots 2 --stats --max-tokens 24 "And the LORD said"
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from colibri_core.demo import demo_model

DEMO = demo_model()  # the bundled demo model (colibri_core/demo)
VOCAB = 2048  # the demo tokenizer's


def hf_config(arch: str):
    """The conformance suites' tiny configs (plugins/*/tests), with the demo's vocabulary."""
    import transformers as tf

    if arch == "olmoe":
        return tf.OlmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                              num_attention_heads=4, num_experts=16, num_experts_per_tok=2)
    if arch == "glm52":
        return tf.GlmMoeDsaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24,
            qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, index_topk=8, index_n_heads=32, index_head_dim=32,
            first_k_dense_replace=1, indexer_types=["full", "shared", "full", "shared"], initializer_range=0.1,
            max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen36":
        return tf.Qwen3_5MoeTextConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, full_attention_interval=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=16,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            initializer_range=0.1, max_position_embeddings=2048)
    if arch == "deepseek_v4":
        return tf.DeepseekV4Config(
            vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            head_dim=32, q_lora_rank=48, partial_rotary_factor=0.5, n_routed_experts=16, num_experts_per_tok=2,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=16,
            index_n_heads=32, index_head_dim=16, index_topk=3, initializer_range=0.1, max_position_embeddings=2048,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "kimi_linear":
        return tf.KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1, initializer_range=0.1,
            linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 2,
                                "short_conv_kernel_size": 4}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gpt_oss":
        return tf.GptOssConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=16, num_experts_per_tok=2, sliding_window=8,
            initializer_range=0.1, max_position_embeddings=2048,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    raise SystemExit(f"unknown architecture {arch!r}: {', '.join(ARCHS)}")


ARCHS = ("olmoe", "glm52", "qwen36", "deepseek_v4", "kimi_linear", "gpt_oss")


def fill_hash_tables(model, seed: int) -> None:
    """Hash-routed layers' tables (DeepSeek V4's tid2eid) initialise to zeros: give each token k
    distinct random experts, as a trained table has."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.stack([torch.randperm(model.config.n_routed_experts, generator=gen)[:buf.shape[1]]
                                       for _ in range(buf.shape[0])]))


def fill_expert_biases(model, seed: int) -> None:
    """The routed experts' biases (GPT-OSS's `experts.*_bias`) initialise to zeros: random ones, as a
    trained model has, so a path that dropped them would show."""
    import torch

    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def save_with_mtp(model, out: Path, seed: int) -> None:
    """Save a GLM-5.2 model built with one layer more than its config says as that config plus an MTP
    layer: the extra decoder layer becomes layer N with the MTP head's own tensors (enorm, hnorm,
    eh_proj, shared_head.norm; random, or trained by tools/train_mtp.py), as released checkpoints
    hold it (transformers itself drops MTP layers)."""
    import json

    import torch
    from safetensors.torch import save_file

    n = model.config.num_hidden_layers - 1  # the MTP layer's index
    H = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 7)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}  # experts fused
    mtp = getattr(model, "mtp_extra", None) or {
        "enorm.weight": 1 + torch.randn(H, generator=gen) * 0.1, "hnorm.weight": 1 + torch.randn(H, generator=gen) * 0.1,
        "shared_head.norm.weight": 1 + torch.randn(H, generator=gen) * 0.1,
        "eh_proj.weight": torch.randn(H, 2 * H, generator=gen) * 0.1}
    tensors.update({f"model.layers.{n}.{k}": v.detach().clone().contiguous() for k, v in mtp.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.update(architectures=["GlmMoeDsaForCausalLM"], num_hidden_layers=n, num_nextn_predict_layers=1,
                  indexer_types=config["indexer_types"][:n], mlp_layer_types=config["mlp_layer_types"][:n])
    config.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def build(arch: str, out: Path, quant: str = "int4", seed: int = 0, mtp: bool = False) -> Path:
    """Write a tiny random `arch` model, converted at `quant`, to `out` (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from colibri_core.convert import convert_checkpoint

    if mtp and arch != "glm52":
        raise SystemExit("--mtp: only glm52 has an MTP head here")
    torch.manual_seed(seed)
    hf = out.with_name(out.name + "-hf")
    config = hf_config(arch)
    if mtp:  # one decoder layer more: it becomes the MTP layer
        extra = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
        config = type(config)(**{**extra, "num_hidden_layers": config.num_hidden_layers + 1,
                                 "indexer_types": [*config.indexer_types, "full"],
                                 "mlp_layer_types": [*config.mlp_layer_types, "sparse"]})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fill_hash_tables(model, seed)
    fill_expert_biases(model, seed)
    if mtp:
        save_with_mtp(model, hf, seed)
    else:
        model.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, hf / name)
    convert_checkpoint(hf, out, quant, progress=False)
    shutil.rmtree(hf)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arch", choices=ARCHS)
    ap.add_argument("out", type=Path)
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mtp", action="store_true", help="glm52: with an MTP layer (random)")
    args = ap.parse_args()
    build(args.arch, args.out, args.quant, args.seed, args.mtp)
    print(f"{args.arch} ({args.quant}) written to {args.out}")


if __name__ == "__main__":
    main()
