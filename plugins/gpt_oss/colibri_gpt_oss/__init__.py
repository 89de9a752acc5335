"""colibri plugin for GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b). Registration only:
the model lives in model.py and is imported when a GPT-OSS model is converted or loaded."""
from colibri_core.hookspecs import Architecture, hookimpl


@hookimpl
def colibri_register_architectures(register):
    register(Architecture(
        name="gpt_oss",
        hf_architectures=("GptOssForCausalLM",),
        model_types=("gpt_oss",),
        model="colibri_gpt_oss.model:GptOss",
    ))
