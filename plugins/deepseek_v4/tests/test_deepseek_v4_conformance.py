"""DeepSeek V4 against transformers' DeepseekV4ForCausalLM: the conformance kit on tiny configs that
run every path — sliding, CSA and HCA layers (`layer_types` + `compress_rates`), 32 index heads with
index_topk below the number of compressed entries, hash-routed first layers with a table of distinct
experts, YaRN on the compressed layers, prompts not aligned to the windows, and the zero-initialised
parameters (sinks, position biases, hyper-connection bases, router bias) perturbed by the kit."""
import numpy as np
import torch
from transformers import DeepseekV4Config

from colibri_core.testing import ConformanceSuite


def tiny(**kw) -> DeepseekV4Config:
    base = dict(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=48, partial_rotary_factor=0.5, n_routed_experts=8, num_experts_per_tok=2,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=16,
        index_n_heads=32, index_head_dim=16, index_topk=3, initializer_range=0.1, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    return DeepseekV4Config(**{**base, **kw})


RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def released(config: dict) -> dict:
    """config.json in the form deepseek-ai ships it: the layer kinds as `compress_ratios` (0 / 4 / 128,
    the rates as compress_rate_csa / _hca), the hash layers as `num_hash_layers`, the rope width as
    `qk_rope_head_dim`, YaRN as a flat `rope_scaling` for the compressed layers; no layer_types,
    mlp_layer_types, compress_rates, partial_rotary_factor or nested rope_parameters."""
    types, mlp, rates = config.pop("layer_types"), config.pop("mlp_layer_types"), config.pop("compress_rates")
    compress = config.pop("rope_parameters")["compress"]
    rope = config.pop("partial_rotary_factor") * config["head_dim"]
    hashed = mlp.count("hash_moe")
    assert mlp == ["hash_moe"] * hashed + ["moe"] * (len(mlp) - hashed)
    out = {**config, "compress_ratios": [RATIO[t] for t in types], "num_hash_layers": hashed,
           "compress_rate_csa": rates["compressed_sparse_attention"],
           "compress_rate_hca": rates["heavily_compressed_attention"], "qk_rope_head_dim": int(rope)}
    if compress["rope_type"] == "yarn":
        out["rope_scaling"] = {"type": "yarn", "factor": compress["factor"], "beta_fast": 32, "beta_slow": 1,
                               "original_max_position_embeddings": compress["original_max_position_embeddings"]}
    return out


class DistinctHashTable:
    """HF initialises tid2eid to zeros (every token would pick expert 0): give every token k distinct
    random experts, the way a real table looks."""

    @classmethod
    def prepare_model(cls, model) -> None:
        gen = torch.Generator().manual_seed(cls.seed + 3)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                V, k = buf.shape
                experts = model.config.n_routed_experts
                buf.copy_(torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(V)]))


class TestTinyDeepseekV4(DistinctHashTable, ConformanceSuite):
    hf_config = tiny()
    prompt_tokens = 13  # not a multiple of either window
    config_variants = {"deepseek_release": released}


class TestTinyDeepseekV4Default(DistinctHashTable, ConformanceSuite):
    """Default RoPE everywhere, two hash layers, 3 groups, a wider shared expert, HCA windows of 4."""
    seed = 1
    prompt_tokens = 11
    hf_config = tiny(num_hidden_layers=5, layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                                      "sliding_attention", "compressed_sparse_attention",
                                                      "heavily_compressed_attention"],
                     mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], num_attention_heads=6,
                     o_groups=3, n_shared_experts=2, num_experts_per_tok=3, n_routed_experts=12,
                     compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4},
                     rope_parameters=None, index_topk=2, sliding_window=6)
    config_variants = {"deepseek_release": released}


def test_tiny_configs_exercise_every_path():
    cfg = TestTinyDeepseekV4.hf_config
    assert set(cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert cfg.index_n_heads >= 32 and cfg.rope_parameters["compress"]["rope_type"] == "yarn"
    entries = (TestTinyDeepseekV4.prompt_tokens + TestTinyDeepseekV4.new_tokens) // 4
    assert cfg.index_topk < entries and TestTinyDeepseekV4.prompt_tokens % 4 and TestTinyDeepseekV4.prompt_tokens % 8
    assert np.all(np.array(cfg.mlp_layer_types[:1]) == "hash_moe")
