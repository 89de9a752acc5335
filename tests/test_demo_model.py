"""The shipped demo model (colibri_core/demo/colibri-demo-kjv, trained by tools/train_demo.py): the conformance
checks that apply to a trained model — agreement with the transformers oracle loaded with its
dequantised weights, and placement invariance — plus the default-model CLI path."""
import numpy as np
import pytest

from colibri_core import dequantize, load
from colibri_core.cli import DEFAULT_MODEL

from conftest import colibri

PROMPT = "And God said unto Noah"


@pytest.fixture(scope="module")
def demo():
    assert (DEFAULT_MODEL / "colibri.yaml").is_file(), f"the demo model is missing from {DEFAULT_MODEL}"
    return DEFAULT_MODEL


def test_matches_the_oracle_with_dequantised_weights(demo, tmp_path):
    import shutil

    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    shutil.copy(demo / "config.json", tmp_path)
    save_file(dequantize(demo), str(tmp_path / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    with load(demo) as engine:
        ids = engine.tokenizer.encode(PROMPT)
        got_tokens = engine.generate(ids, 24, stop_ids=())
        got = engine.logits(ids + got_tokens)
    with torch.no_grad():
        want_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        want = hf(torch.tensor([ids + got_tokens])).logits[0].numpy()
    assert got_tokens == want_tokens
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_placement_invariance(demo):
    ids = list(range(10, 60))
    runs = []
    for slots in (1, 3, 8):
        with load(demo, cache_slots=slots) as engine:
            runs.append((engine.logits(ids), engine.generate(ids[:8], 16, stop_ids=())))
    for logits, tokens in runs[:-1]:
        assert np.array_equal(logits, runs[-1][0]) and tokens == runs[-1][1]


def test_default_model_writes_english():
    r = colibri("run", "--max-tokens", "30", "--temperature", "0", "And the LORD said")
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert len(words) >= 10 and {"the", "and"} & {w.lower().strip(",.;:") for w in words}
    assert "misses" in r.stderr and "read" in r.stderr
