"""colibri plugin for Qwen3-MoE (`Qwen3MoeForCausalLM`). Registration only: the model lives in
model.py, imported when a Qwen3-MoE model is converted or loaded."""
from colibri_core.hookspecs import Architecture, hookimpl


@hookimpl
def colibri_register_architectures(register):
    register(Architecture(
        name="qwen3moe",
        hf_architectures=("Qwen3MoeForCausalLM",),
        model_types=("qwen3_moe",),
        model="colibri_qwen3moe.model:Qwen3Moe",
    ))
