"""GLM-5.2 against transformers' GlmMoeDsaForCausalLM: the conformance kit on tiny configs that use
everything the real model does — 32 index heads, prompts longer than index_topk (so the indexer
really selects), IndexShare layers, group-limited routing (n_group > 1) and dense first layers."""
from transformers import GlmMoeDsaConfig

from colibri_core.testing import ConformanceSuite


def released_glm5(config: dict) -> dict:
    """config.json in the form zai-org/GLM-5 ships it: the dense layers as first_k_dense_replace (no
    mlp_layer_types), the IndexShare schedule as an index_topk_pattern string (no indexer_types), no
    layer_types, and the DeepSeek-V3 keys transformers ignores (scoring_func, topk_method, ep_size, …)."""
    types, mlp = config.pop("indexer_types"), config.pop("mlp_layer_types")
    config.pop("layer_types", None)
    dense = config["first_k_dense_replace"]
    assert mlp == ["dense"] * dense + ["sparse"] * (len(mlp) - dense)
    return {**config, "index_topk_pattern": "".join("F" if t == "full" else "S" for t in types),
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "ep_size": 1, "moe_layer_freq": 1,
            "rope_interleave": True, "indexer_rope_interleave": True, "pretraining_tp": 1, "dtype": "bfloat16",
            "transformers_version": "5.0.2.dev0"}


def legacy_rope_and_index_freq(config: dict) -> dict:
    """The DeepSeek-V3.2 lineage's older form: RoPE as top-level rope_theta with ``"rope_scaling": null``,
    and the IndexShare schedule as index_topk_freq / index_skip_topk_offset."""
    config = released_glm5(config)
    pattern = config.pop("index_topk_pattern")
    n = len(pattern)
    freq, offset = next((f, o) for f in range(1, n + 1) for o in range(n + 1)
                        if "".join("F" if max(i - o + 1, 0) % f == 0 else "S" for i in range(n)) == pattern)
    rope = config.pop("rope_parameters")
    return {**config, "index_topk_freq": freq, "index_skip_topk_offset": offset,
            "rope_theta": rope["rope_theta"], "rope_scaling": None}


VARIANTS = {"glm5_release": released_glm5, "legacy_rope_index_freq": legacy_rope_and_index_freq}


def tiny(**kw) -> GlmMoeDsaConfig:
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24,
        qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, index_topk=8, index_n_heads=32, index_head_dim=32,
        first_k_dense_replace=1, indexer_types=["full", "shared", "full", "shared"], initializer_range=0.1,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return GlmMoeDsaConfig(**{**base, **kw})


class TestTinyGlm52(ConformanceSuite):
    hf_config = tiny()
    config_variants = VARIANTS


class TestTinyGlm52Wide(ConformanceSuite):
    """Two dense layers, a longer shared run, 3 of 6 groups, a shared expert twice as wide, topk 5."""
    seed = 1
    hf_config = tiny(hidden_size=96, num_hidden_layers=5, num_attention_heads=6, n_routed_experts=24, n_group=6,
                     topk_group=3, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=2, index_topk=5,
                     indexer_types=["full", "shared", "shared", "full", "shared"], routed_scaling_factor=1.5)
    config_variants = VARIANTS
