"""`colibri_core.planning` sizes a model from config.json alone: it must agree exactly with what
the converter writes (resident tensors, expert files) for the same config and quantisation."""
import json

import pytest

from colibri_core.container import Container
from colibri_core.convert import convert_checkpoint
from colibri_core.errors import ColibriError
from colibri_core.planning import measured, plan_config


def check_plan_matches_container(model_dir):
    c = Container(model_dir)
    p = plan_config(c.config, c.quant)
    assert {k: p[k] for k in measured(model_dir)} == measured(model_dir)
    return p


@pytest.mark.parametrize("quant", ["f32", "int8", "int4"])
def test_plan_of_olmoe_matches_its_container(tiny_checkpoint, tmp_path, quant):
    convert_checkpoint(tiny_checkpoint, tmp_path / quant, quant, progress=False)
    p = check_plan_matches_container(tmp_path / quant)
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    assert p["architecture"] == "olmoe"
    assert p["kv_floats_per_token_per_layer"] == 2 * cfg["hidden_size"]  # K and V, MHA
    assert p["state_bytes_per_token"] == 4 * 2 * cfg["hidden_size"] * cfg["num_hidden_layers"]


def test_plan_refuses_unknown_quant(tiny_checkpoint):
    with pytest.raises(ColibriError, match="unknown quantisation"):
        plan_config(json.loads((tiny_checkpoint / "config.json").read_text()), "int3")
