"""GLM-5.2 against transformers' GlmMoeDsaForCausalLM: the conformance kit on tiny configs that use
everything the real model does — 32 index heads, prompts longer than index_topk (so the indexer
really selects), IndexShare layers, group-limited routing (n_group > 1) and dense first layers."""
from transformers import GlmMoeDsaConfig

from colibri_core.testing import ConformanceSuite


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


class TestTinyGlm52Wide(ConformanceSuite):
    """Two dense layers, a longer shared run, 3 of 6 groups, a shared expert twice as wide, topk 5."""
    seed = 1
    hf_config = tiny(hidden_size=96, num_hidden_layers=5, num_attention_heads=6, n_routed_experts=24, n_group=6,
                     topk_group=3, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=2, index_topk=5,
                     indexer_types=["full", "shared", "shared", "full", "shared"], routed_scaling_factor=1.5)
