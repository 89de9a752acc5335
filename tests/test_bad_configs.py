"""A config.json (or a manifest, or a plan option) with a value no model can have is one line that
names it, from `convert`, `run` and `plan` alike, for every plugin: never a traceback, a hang, a
model that converts and then crashes, or a plan of negative sizes."""
import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from conftest import colibri

from colibri_core import plugins
from colibri_core.container import Container
from colibri_core.convert import convert_checkpoint, parse_config
from colibri_core.errors import ColibriError
from colibri_core.layout import ContainerLayout, ExpertNames
from colibri_core.planning import plan_config

ROOT = Path(__file__).resolve().parent.parent
PLAN = ("plan", "--ram", "1GB", "--disk-bw", "1GB", "--mem-bw", "1GB")


def one_line_error(r) -> str:
    """The CLI's error, asserting it is the one line a ColibriError gives (no traceback)."""
    assert r.returncode == 1 and re.fullmatch(r"colibri: error: [^\n]+\n", r.stderr), (r.returncode, r.stderr)
    return r.stderr


def edited(checkpoint: Path, dst: Path, **changes) -> Path:
    """A copy of `checkpoint` whose config.json has `changes`."""
    shutil.copytree(checkpoint, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_zero_heads_is_one_line_naming_the_field_in_convert_run_and_plan(tiny_checkpoint, tmp_path):
    src = edited(tiny_checkpoint, tmp_path / "hf", num_attention_heads=0)
    for args in (("convert", src, tmp_path / "out"), ("run", "--model", src, "--max-tokens", "1", "the"),
                 (*PLAN, "--config", src / "config.json")):
        assert "num_attention_heads must be a positive integer, got 0" in one_line_error(colibri(*args)), args
    assert not (tmp_path / "out").exists()


def tiny_configs() -> dict:
    """tools/tiny_model.py's config of every shipped architecture, as config.json holds it."""
    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
    tiny_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_model)
    return {arch: tiny_model.hf_config(arch).to_dict() for arch in tiny_model.ARCHS}


def test_every_plugin_names_a_bad_size_and_a_top_k_beyond_its_experts(tmp_path):
    registry = plugins.registry()
    for arch, config in tiny_configs().items():
        model_cls = registry.model_class(registry.resolve(config))
        layout = model_cls.layout(parse_config(model_cls, config, tmp_path))  # the config as it is: fine
        for field, value in (("num_attention_heads", 0), ("hidden_size", -64), ("vocab_size", math.nan),
                             ("num_hidden_layers", 10**12), ("num_experts_per_tok", layout.n_experts + 1)):
            with pytest.raises(ColibriError, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: {field} ") as e:
                parse_config(model_cls, {**config, field: value}, tmp_path)
            assert "\n" not in str(e.value), (arch, field)


def test_top_k_beyond_the_experts_is_refused_by_convert_and_by_the_layout(tiny_checkpoint, tmp_path):
    src = edited(tiny_checkpoint, tmp_path / "hf", num_experts_per_tok=99)
    with pytest.raises(ColibriError, match="num_experts_per_tok 99 is more than the 8 routed experts"):
        convert_checkpoint(src, tmp_path / "out", "int4", progress=False)
    assert not (tmp_path / "out").exists()
    # a plugin's own names for its sizes reach the layout, which every plugin builds: it refuses too
    with pytest.raises(ColibriError, match=r"top-k must be 1\.\.8"):
        plan_config(json.loads((src / "config.json").read_text()), "int4")
    names = ExpertNames(per_expert={"gate": "g{layer}.{expert}", "up": "u{layer}.{expert}", "down": "d{layer}.{expert}"})
    shape = dict(resident=(), keep_f32=(), moe_layers=(0,), n_experts=16, top_k=2, hidden=64, intermediate=48,
                 experts=names)
    assert ContainerLayout(**shape).top_k == 2
    for bad in ({"top_k": 99}, {"top_k": 0}, {"n_experts": -4}, {"hidden": 64.0}, {"moe_layers": ()}):
        with pytest.raises(ColibriError):
            ContainerLayout(**{**shape, **bad})


@pytest.mark.parametrize("field, value, says", [
    ("num_experts", 0, "num_experts must be a positive integer, got 0"),
    ("num_experts", -4, "num_experts must be a positive integer, got -4"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer, got 0"),
    ("num_hidden_layers", 1e12, "num_hidden_layers must be a positive integer, got 1000000000000.0"),
    ("num_hidden_layers", 10**12, "num_hidden_layers 1000000000000 is more than colibri supports (at most 10,000)"),
    ("vocab_size", math.nan, "vocab_size must be a positive integer, got nan"),
])
def test_plan_refuses_a_size_that_is_no_positive_integer(tiny_checkpoint, tmp_path, field, value, says):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads((tiny_checkpoint / "config.json").read_text()), field: value}))
    r = colibri(*PLAN, "--config", config, "--quant", "int4", timeout=120)  # 10**12 layers: no hang either
    assert one_line_error(r) == f"colibri: error: {config}: {says}\n"


@pytest.mark.parametrize("context", ["-100", "-1"])
def test_plan_refuses_a_negative_context(tiny_model, context):
    r = colibri(*PLAN, "--model", tiny_model, "--context", context)
    assert one_line_error(r) == f"colibri: error: --context must be a number of tokens (0 or more), got {context}\n"
    r = colibri(*PLAN, "--model", tiny_model, "--context", "0", "--json")  # no state: the engine's own split
    assert r.returncode == 0 and json.loads(r.stdout)["split"]["state"] == 0, r.stderr


def test_architectures_given_as_a_string_is_one_class_name():
    registry = plugins.registry()
    assert registry.resolve({"architectures": "OlmoeForCausalLM"}).name == "olmoe"
    for bad in ({"architectures": 5}, {"architectures": ["OlmoeForCausalLM", 5]}, {"model_type": ["olmoe"]}):
        with pytest.raises(ColibriError, match="must be"):
            registry.resolve(bad, where="m")


def test_manifest_out_of_step_with_a_tensor_names_the_tensor(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    manifest = model / "colibri.yaml"
    lines = manifest.read_text().splitlines(keepends=True)
    if lines[-1].startswith("# crc32 "):  # as a manifest written before the checksum line (the demo's)
        lines.pop()
    text = "".join(lines)
    assert "lm_head.weight: {kind: int4" in text
    manifest.write_text(text.replace("lm_head.weight: {kind: int4", "lm_head.weight: {kind: int8"))
    with pytest.raises(ColibriError) as e:
        Container(model)
    assert str(e.value) == (f"{model}: colibri.yaml does not describe the files beside it (it differs at tensor "
                            "lm_head.weight): a manifest or files from another model or conversion; reconvert the model")


# ---- one validation of config.json, before convert, run, plan or doctor does anything ------------
CONVERT, RUN = ("convert",), ("run", "--max-tokens", "1", "--model")


@pytest.mark.parametrize("changes, says", [
    ({"num_hidden_layers": None}, "num_hidden_layers must be a positive integer, got None"),
    ({"num_attention_heads": 6}, "hidden_size 64 is not a multiple of num_attention_heads 6"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite positive number, got nan"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a finite positive number, got -1e-05"),
    ({"rope_parameters": {"rope_theta": -10000.0, "rope_type": "default"}},
     "rope_parameters.rope_theta must be a finite positive number, got -10000.0"),
    ({"rope_parameters": None, "rope_theta": math.inf}, "rope_theta must be a finite positive number, got inf"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ({"max_position_embeddings": -1}, "max_position_embeddings must be a positive integer, got -1"),
    ({"eos_token_id": ["a", None]}, "eos_token_id must be a token id (an integer of at least 0) or a list of them"),
])
def test_a_bad_field_is_one_line_naming_it_in_convert_run_plan_and_doctor(tiny_checkpoint, tmp_path, changes, says):
    src = edited(tiny_checkpoint, tmp_path / "hf", **changes)
    said = f"{src / 'config.json'}: {says}"
    for args in ((*CONVERT, src, tmp_path / "out"), (*RUN, src, "the"), (*PLAN, "--config", src / "config.json")):
        assert said in one_line_error(colibri(*args)), args
    assert not (tmp_path / "out").exists()
    r = colibri("doctor", "--deep", "--model", src)
    assert r.returncode == 1 and f"FAIL  files: {said}" in r.stdout, r.stdout


@pytest.mark.parametrize("eos, says", [
    (["a", None], "eos_token_id must be a token id (an integer of at least 0) or a list of them, got ['a', None]"),
    (-1, "eos_token_id must be a token id (an integer of at least 0) or a list of them, got -1"),
])
def test_generation_config_token_ids_that_are_no_ids_are_refused_by_convert_run_and_doctor(tiny_checkpoint, tmp_path,
                                                                                            eos, says):
    src = shutil.copytree(tiny_checkpoint, tmp_path / "hf")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    said = f"{src / 'generation_config.json'}: {says}"
    for args in ((*CONVERT, src, tmp_path / "out"), (*RUN, src, "the")):
        assert said in one_line_error(colibri(*args)), args
    assert not (tmp_path / "out").exists()
    r = colibri("doctor", "--model", src)
    assert r.returncode == 1 and f"FAIL  files: {said}" in r.stdout, r.stdout


def test_generation_config_ids_beyond_the_vocabulary_are_dropped_with_one_warning(tiny_checkpoint, tmp_path):
    from colibri_core.convert import generation_defaults

    src = shutil.copytree(tiny_checkpoint, tmp_path / "hf")
    eos = json.loads((src / "generation_config.json").read_text())["eos_token_id"]
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 300, 50279], "pad_token_id": 1}))
    beyond = r"eos_token_id 300, 50279: beyond the vocabulary \(300 tokens\), ignored$"
    with pytest.warns(UserWarning, match=beyond) as caught:
        assert generation_defaults(src)["eos_token_id"] == [eos]  # the one id the model can generate: still a stop
    assert len(caught) == 1
    r = colibri(*RUN, src, "the")
    assert r.returncode == 0 and r.stderr.count("colibri: warning:") == 1, r.stderr


def test_every_plugin_names_a_null_size_a_bad_eps_theta_or_context_and_heads_that_do_not_divide(tmp_path):
    """The fields every shipped architecture shares, checked for each: a null where a size is needed,
    an eps or a RoPE theta that is no finite positive number, a context below 1, token ids that are
    no ids, and GQA's heads (key/value heads dividing query heads; query heads dividing the hidden
    size where head_dim is derived from it)."""
    registry = plugins.registry()
    path = re.escape(str(tmp_path / "config.json"))
    for arch, config in {**tiny_configs(), "qwen3moe": qwen3moe_config()}.items():
        model_cls = registry.model_class(registry.resolve(config))
        cfg = parse_config(model_cls, config, tmp_path)
        # fine: a null (none, or the default) the plugin does not read, and the config of a part colibri does not run
        fine = {**config, "max_position_embeddings": None, "vision_config": {"num_attention_heads": [4, 8]}}
        assert parse_config(model_cls, fine, tmp_path) == cfg
        text = "text_config" in config
        scope = config["text_config"] if text else config
        bad = [({"num_hidden_layers": None}, "num_hidden_layers must be a positive integer, got None"),
               ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite positive number"),
               ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite positive number"),
               ({"rope_theta": -1.0}, "rope_theta must be a finite positive number"),
               ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
               ({"eos_token_id": ["a", None]}, "eos_token_id must be a token id")]
        if hasattr(cfg, "num_key_value_heads") and cfg.num_attention_heads > 1 and cfg.num_key_value_heads > 1:
            bad.append(({"num_key_value_heads": cfg.num_attention_heads - 1}, "num_key_value_heads .* does not divide"))
        if arch in ("olmoe", "qwen36", "qwen3moe"):  # without head_dim, each derives it as hidden_size / heads
            bad.append(({"head_dim": None, "num_attention_heads": scope["hidden_size"] - 1},
                        "hidden_size .* is not a multiple of num_attention_heads"))
        for changes, says in bad:
            edited_config = {**config, "text_config": {**scope, **changes}} if text else {**config, **changes}
            with pytest.raises(ColibriError, match=rf"^{path}: (text_config\.)?{says}") as e:
                parse_config(model_cls, edited_config, tmp_path)
            assert "\n" not in str(e.value), (arch, changes)


def qwen3moe_config() -> dict:
    """examples/qwen3moe's tiny config, as config.json holds it."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2).to_dict()
