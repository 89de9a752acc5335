"""colibri plugin for DeepSeek V4 (`DeepseekV4ForCausalLM`, model_type ``deepseek_v4``). Registration
only: the model lives in model.py and is imported when a DeepSeek V4 model is converted or loaded."""
from colibri_core.hookspecs import Architecture, hookimpl


@hookimpl
def colibri_register_architectures(register):
    register(Architecture(
        name="deepseek_v4",
        hf_architectures=("DeepseekV4ForCausalLM",),
        model_types=("deepseek_v4",),
        model="colibri_deepseek_v4.model:DeepseekV4",
    ))
