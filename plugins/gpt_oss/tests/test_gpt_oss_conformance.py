"""GPT-OSS against transformers' GptOssForCausalLM: the conformance kit on two tiny configs (one with
H = I, so a down matrix is square, default RoPE and its own layer schedule; one with YaRN), both
with windows shorter than the kit's prompts, and their released config.json form."""
from transformers import GptOssConfig

from colibri_core.testing import ConformanceSuite


def released(config: dict) -> dict:
    """config.json as openai/gpt-oss-20b / -120b ship it (written by transformers 4.55): RoPE as
    ``rope_scaling`` with a top-level ``rope_theta`` (no rope_parameters), ``experts_per_token``
    beside ``num_experts_per_tok``, ``initial_context_length``."""
    rope = dict(config.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    return {**config, "rope_theta": theta, "rope_scaling": rope,
            "experts_per_token": config["num_experts_per_tok"], "initial_context_length": 4096,
            "transformers_version": "4.55.0.dev0"}


class TestTinyGptOss(ConformanceSuite):
    hf_config = GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
        max_position_embeddings=256, initializer_range=0.1, eos_token_id=2,  # an id in the tiny vocabulary
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    )
    config_variants = {"gpt_oss_release": released}


class TestTinyGptOssSquare(ConformanceSuite):
    seed = 1
    hf_config = GptOssConfig(
        vocab_size=320, hidden_size=48, intermediate_size=48, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=3, head_dim=16, num_local_experts=12, num_experts_per_tok=3, sliding_window=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=256, initializer_range=0.1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config_variants = {"gpt_oss_release": released}
