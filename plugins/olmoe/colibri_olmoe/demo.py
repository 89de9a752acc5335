"""A random-weight OLMoE checkpoint in Hugging Face format, written with NumPy alone (no torch).

Used by tests and tools (tools/train_demo.py, tests/conftest.py) that need a real container without the
`transformers` oracle. The weights are random: the text it generates is
not language, but every code path of the engine (routing, streaming experts, caching) is real.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_checkpoint(out: str | Path, *, vocab_size: int = 512, hidden_size: int = 64, intermediate_size: int = 64,
                     num_hidden_layers: int = 2, num_attention_heads: int = 4, num_experts: int = 8,
                     num_experts_per_tok: int = 2, seed: int = 0, eos_token_id: int | None = None,
                     std: float = 0.1) -> Path:
    """Write config.json, generation_config.json and model.safetensors (per-expert form) to `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    H, I, E, V = hidden_size, intermediate_size, num_experts, vocab_size

    def randn(*shape):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n):
        return (1 + randn(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": randn(V, H), "model.norm.weight": norm(H), "lm_head.weight": randn(V, H)}
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.q_norm.weight": norm(H), p + "self_attn.k_norm.weight": norm(H),
                  p + "mlp.gate.weight": randn(E, H) * 4})
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{name}.weight"] = randn(H, H)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = randn(I, H)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = randn(I, H)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = randn(H, I)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": V, "hidden_size": H,
        "intermediate_size": I, "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_attention_heads, "num_experts": E, "num_experts_per_tok": num_experts_per_tok,
        "norm_topk_prob": False, "rms_norm_eps": 1e-5, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "clip_qkv": None,
        "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": eos_token_id, "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}, indent=2))
    return out


def write_tokenizer(out: str | Path, texts: list[str], vocab_size: int) -> int:
    """Train a byte-level BPE on `texts`; write tokenizer.json and tokenizer_config.json (with a chat
    template) to `out`. Returns the id of the end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out)
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return tok.token_to_id("<|endoftext|>")
