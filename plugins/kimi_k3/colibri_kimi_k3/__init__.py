"""colibri plugin for the Kimi linear-attention family: Kimi-Linear (`KimiLinearForCausalLM`,
model_type ``kimi_linear``) and Kimi K3, each architecture with its own class in model.py
(`KimiLinear`, `KimiK3`: the same blocks, each its own config, tensors and layer graph).
Registration only: model.py is imported when a Kimi model is converted or loaded."""
from colibri_core.hookspecs import Architecture, hookimpl


@hookimpl
def colibri_register_architectures(register):
    register(Architecture(
        name="kimi_linear",
        hf_architectures=("KimiLinearForCausalLM",),
        model_types=("kimi_linear",),
        model="colibri_kimi_k3.model:KimiLinear",
    ))
    register(Architecture(
        name="kimi_k3",
        hf_architectures=("KimiK3ForCausalLM", "KimiK3ForConditionalGeneration"),
        model_types=("kimi_k3",),
        model="colibri_kimi_k3.model:KimiK3",
    ))
