"""OLMoE against transformers' OlmoeForCausalLM: the conformance kit on two tiny configs that
differ in dimensions, expert count and top-k (and one with GQA, clip_qkv and renormalised top-k)."""
import pytest
from transformers import OlmoeConfig

from colibri_core.errors import ColibriError
from colibri_core.testing import ConformanceSuite
from colibri_olmoe.model import OlmoeConfig as Parsed


def released_0924(config: dict) -> dict:
    """config.json as allenai/OLMoE-1B-7B-0924 ships it (written by transformers 4.43): RoPE as a
    top-level rope_theta with ``"rope_scaling": null``, no rope_parameters, ``torch_dtype``."""
    rope = config.pop("rope_parameters")
    return {**config, "rope_theta": rope["rope_theta"], "rope_scaling": None, "torch_dtype": "bfloat16",
            "transformers_version": "4.43.0.dev0"}


class TestTinyOlmoe(ConformanceSuite):
    hf_config = OlmoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        initializer_range=0.1, max_position_embeddings=256, eos_token_id=2,  # an id in the tiny vocabulary
    )
    config_variants = {"olmoe_1b_7b_0924": released_0924}


class TestTinyOlmoeWide(ConformanceSuite):
    seed = 1
    hf_config = OlmoeConfig(
        vocab_size=320, hidden_size=96, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, num_experts=12, num_experts_per_tok=3,
        norm_topk_prob=True, clip_qkv=3.0, initializer_range=0.1, max_position_embeddings=256,
        eos_token_id=2,  # an id in the tiny vocabulary
    )
    config_variants = {"olmoe_1b_7b_0924": released_0924}


def test_scaled_rope_in_a_released_config_is_refused_not_ignored():
    """A released config.json says RoPE scaling in `rope_scaling`; OLMoE runs default RoPE only, so
    linear or YaRN scaling is a one-line error rather than silently different positions."""
    config = released_0924(TestTinyOlmoe.hf_config.to_dict())
    assert Parsed.from_hf(config).rope_theta == config["rope_theta"]
    with pytest.raises(ColibriError, match="OLMoE with rope_type 'yarn' is not supported"):
        Parsed.from_hf({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
