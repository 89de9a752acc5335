"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: the conformance kit on a tiny config with GQA,
a head width other than hidden_size / heads, a dense layer between MoE layers, renormalised top-k,
tied embeddings and the tanh-GELU gated unit (GeGLU), also read from a config.json in the released
checkpoints' form; the released models' SwiGLU on a second one; and the choice of dense layers
checked against transformers' own."""
import pytest
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from colibri_core.testing import DROP, ConformanceSuite
from colibri_qwen3moe.model import Qwen3Moe

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
            initializer_range=0.1, max_position_embeddings=256)


class TestTinyQwen3Moe(ConformanceSuite):
    hf_config = Qwen3MoeConfig(**TINY, mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=True,
                               hidden_act="gelu_pytorch_tanh")
    # the released checkpoints' config.json says num_experts, and keeps rope_theta at the top level
    config_variants = {"released": {"num_experts": TINY["num_experts"], "num_local_experts": DROP,
                                    "rope_theta": 10000.0, "rope_scaling": None, "rope_parameters": DROP}}



class TestTinyQwen3MoeSwiGLU(ConformanceSuite):
    hf_config = Qwen3MoeConfig(**TINY, mlp_only_layers=[2])  # SiLU, as released; untied lm_head
    config_variants = TestTinyQwen3Moe.config_variants


@pytest.mark.parametrize("mlp_only_layers, decoder_sparse_step", [([], 1), ([0, 3], 1), ([], 2), ([1], 2)])
def test_dense_layers_as_transformers_chooses_them(mlp_only_layers, decoder_sparse_step):
    config = Qwen3MoeConfig(**TINY, mlp_only_layers=mlp_only_layers, decoder_sparse_step=decoder_sparse_step)
    hf = Qwen3MoeForCausalLM(config)
    want = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts"))
    assert Qwen3Moe.parse_config(config.to_dict()).moe_layers == want
