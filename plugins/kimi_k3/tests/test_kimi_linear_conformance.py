"""Kimi-Linear against transformers' KimiLinearForCausalLM: the conformance kit on two tiny configs —
KDA and NoPE MLA layers in several schedules (from linear_attn_config and from layer_types), dense
first layers, group-limited routing (n_group > 1) and plain top-k (n_group = 1), a plain q_proj and a
q_lora query, a prompt longer than transformers' 64-token KDA chunk — plus the released checkpoints' config.json
and tensor names."""
import numpy as np
from transformers import KimiLinearConfig

from colibri_core import load
from colibri_core.convert import convert_checkpoint
from colibri_core.testing import ConformanceSuite

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def released(config: dict) -> dict:
    """config.json as moonshotai/Kimi-Linear-48B-A3B ships it: the schedule only in linear_attn_config
    (1-indexed kda_layers / full_attn_layers), the dense layers as first_k_dense_replace, and the keys
    transformers ignores (mla_use_nope, moe_router_activation_func, moe_layer_freq, …)."""
    types, mlp = config.pop("layer_types"), config.pop("mlp_layer_types")
    dense = mlp.count("dense")
    assert mlp == ["dense"] * dense + ["sparse"] * (len(mlp) - dense)
    lin = {"full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
           "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
           "head_dim": config.pop("linear_head_dim"), "num_heads": config.pop("linear_num_heads"),
           "short_conv_kernel_size": config.pop("linear_conv_kernel_dim")}
    for key in ("qk_head_dim", "head_dim"):
        config.pop(key, None)
    return {**config, "linear_attn_config": lin, "first_k_dense_replace": dense, "mla_use_nope": True,
            "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1, "use_grouped_topk": True,
            "dtype": "bfloat16"}


class KimiLinearChecks:
    """Beyond the kit: the released tensor names (the dense layer under `mlp.`, as the released
    checkpoints hold it, where transformers' save_pretrained writes `block_sparse_moe.`)."""

    def test_released_tensor_names(self, oracle, tmp_path):
        from safetensors.numpy import load_file, save_file

        src = tmp_path / "released"
        src.mkdir()
        (src / "config.json").write_text((oracle.checkpoint / "config.json").read_text())
        tensors = {}
        dense = [i for i in range(oracle.model.config.num_hidden_layers) if i not in oracle.layout.moe_layers]
        for f in sorted(oracle.checkpoint.glob("*.safetensors")):
            for name, t in load_file(str(f)).items():
                for i in dense:
                    name = name.replace(f"layers.{i}.block_sparse_moe.", f"layers.{i}.mlp.")
                tensors[name] = t
        assert any(".mlp.gate_proj" in n for n in tensors)
        save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
        convert_checkpoint(src, tmp_path / "c", "int8", progress=False)
        with load(tmp_path / "c") as a, load(oracle.container("int8")) as b:
            assert np.array_equal(a.logits(oracle.prompt), b.logits(oracle.prompt))


class TestTinyKimiLinear(KimiLinearChecks, ConformanceSuite):
    """KDA, MLA, KDA, MLA (from linear_attn_config); a dense first layer; 2 groups of 4 experts, 1
    chosen; a plain q_proj."""

    hf_config = KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1, initializer_range=0.1,
        linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 2,
                            "short_conv_kernel_size": 4}, **IDS)
    config_variants = {"released": released}


class TestTinyKimiLinearWide(ConformanceSuite):
    """MLA first, then KDA, KDA, MLA, KDA (layer_types); two dense layers; 12 experts top-3 in one
    group; two shared experts; a q_lora query; 4 KDA heads of 8 with a 3-tap conv; a 70-token prompt,
    so transformers' KDA prefill runs a whole 64-token chunk and a partial one."""

    seed = 1
    prompt_tokens = 70
    new_tokens = 16
    hf_config = KimiLinearConfig(
        vocab_size=256, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=6, v_head_dim=10, num_experts=12, num_experts_per_tok=3, n_group=1, topk_group=1,
        n_shared_experts=2, routed_scaling_factor=1.5, first_k_dense_replace=2, initializer_range=0.1,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 3}, **IDS)
    config_variants = {"released": released}
