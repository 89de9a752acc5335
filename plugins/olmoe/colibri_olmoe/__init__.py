"""colibri plugin for OLMoE (`OlmoeForCausalLM`). Registration only: the model lives in model.py
and is imported when an OLMoE model is converted or loaded."""
from colibri_core.hookspecs import Architecture, hookimpl


@hookimpl
def colibri_register_architectures(register):
    register(Architecture(
        name="olmoe",
        hf_architectures=("OlmoeForCausalLM",),
        model_types=("olmoe",),
        model="colibri_olmoe.model:Olmoe",
    ))
