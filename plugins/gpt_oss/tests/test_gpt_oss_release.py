"""GPT-OSS's official release layout run without conversion: the experts as fused MXFP4
(`*_blocks` E2M1 pairs, `*_scales` UE8M0 per 32 columns, rows the output units, gate and up rows
alternating), everything else bfloat16, against transformers loaded with the same weights
dequantised; and the orientation of fused expert tensors checked where H = I makes down square."""
import json

import numpy as np
import pytest
import test_gpt_oss_conformance as conformance
import torch
from colibri_gpt_oss.model import GptOss
from safetensors.torch import load_file, save_file

from colibri_core.container.native import NativeCheckpoint
from colibri_core.convert import convert_checkpoint
from colibri_core.engine import load
from colibri_core.errors import ColibriError
from colibri_core.testing.mxfp4 import EXPERTS, release_layout
from colibri_core.testing.oracle import Oracle

@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(conformance.TestTinyGptOss, tmp_path_factory.mktemp("oracle"))


@pytest.fixture(scope="module")
def release(oracle, tmp_path_factory):
    """(the release-layout directory, transformers over its weights dequantised)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("release")
    src = load_file(str(next(oracle.checkpoint.glob("*.safetensors"))))
    official, plain = release_layout(src)
    config = json.loads((oracle.checkpoint / "config.json").read_text())
    (root / "gpt-oss-tiny").mkdir()
    (root / "gpt-oss-tiny" / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}))
    save_file(official, str(root / "gpt-oss-tiny" / "model.safetensors"), metadata={"format": "pt"})
    (root / "plain").mkdir()
    (root / "plain" / "config.json").write_text(json.dumps(config))
    save_file(plain, str(root / "plain" / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(root / "plain", attn_implementation="eager", dtype=torch.float32).eval()
    return root / "gpt-oss-tiny", hf


def test_release_layout_runs_without_conversion(oracle, release):
    """The MXFP4 experts load in place as fp4 (gate and up parted from their alternating rows), the
    bfloat16 tensors widened; logits and greedy tokens match transformers over the same weights."""
    official, hf = release
    cfg = GptOss.parse_config(json.loads((official / "config.json").read_text()))
    ckpt = NativeCheckpoint(official, GptOss.layout(cfg), "gpt_oss")
    gate, up, down = ckpt.read_expert(1, 3)
    assert (gate.kind, up.kind, down.kind) == ("fp4", "fp4", "fp4")
    assert (gate.rows, gate.cols, down.rows, down.cols) == (cfg.intermediate_size, cfg.hidden_size,
                                                            cfg.hidden_size, cfg.intermediate_size)
    ids = oracle.logits_ids
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
        greedy = hf.generate(torch.tensor([oracle.prompt]), max_new_tokens=16, eos_token_id=[], do_sample=False,
                             pad_token_id=0)[0, len(oracle.prompt):].tolist()
    with load(official, activations="f32", cache_slots=2) as engine:
        got = engine.logits(ids)
        tokens = engine.generate(oracle.prompt, max_new_tokens=16, temperature=0)
        stats = engine.stats()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert tokens == greedy
    assert stats["expert_misses"] > 0  # read from the checkpoint, 2 slots per layer


def test_square_expert_matrices_in_the_wrong_orientation_are_refused(tmp_path):
    """H = I: down_proj is square, so its shape cannot tell (E, I, H) from (E, H, I); gate_up's can
    ((E, H, 2I) against (E, 2I, H)), and the layout declares one orientation for both: a checkpoint
    saved the other way round is refused in one line, never converted transposed."""
    suite = conformance.TestTinyGptOssSquare
    assert suite.hf_config.hidden_size == suite.hf_config.intermediate_size
    oracle = Oracle(suite, tmp_path / "oracle")
    src = tmp_path / "turned"
    src.mkdir()
    (src / "config.json").write_text((oracle.checkpoint / "config.json").read_text())
    tensors = load_file(str(next(oracle.checkpoint.glob("*.safetensors"))))
    save_file({n: t.transpose(1, 2).contiguous() if n.endswith(EXPERTS) else t for n, t in tensors.items()},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ColibriError, match=r"gate_up_proj has shape \[12, 96, 48\], but architecture gpt_oss "
                                           r"expects \[12, 48, 96\]"):
        convert_checkpoint(src, tmp_path / "out", "f32", progress=False)
