"""colibri plugin for Qwen3.6 / Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, and the text part of
`Qwen3_5MoeForConditionalGeneration` checkpoints). Registration only: the model lives in model.py
and is imported when such a model is converted or loaded."""
from colibri_core.hookspecs import Architecture, hookimpl


@hookimpl
def colibri_register_architectures(register):
    register(Architecture(
        name="qwen36",
        hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        model="colibri_qwen36.model:Qwen36",
    ))
