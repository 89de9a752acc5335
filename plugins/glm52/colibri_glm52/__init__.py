"""colibri plugin for GLM-5.2 (`GlmMoeDsaForCausalLM`, model_type ``glm_moe_dsa``). Registration
only: the model lives in model.py and is imported when a GLM model is converted or loaded."""
from colibri_core.hookspecs import Architecture, hookimpl


@hookimpl
def colibri_register_architectures(register):
    register(Architecture(
        name="glm52",
        hf_architectures=("GlmMoeDsaForCausalLM",),
        model_types=("glm_moe_dsa",),
        model="colibri_glm52.model:Glm52",
    ))
