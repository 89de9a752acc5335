"""DeepSeek V4 run from its official layout without conversion: float8 dense weights with UE8M0
block scales and fp4 experts computed on as they are, against the oracle loaded with the same
weights dequantised; the transformers checkpoint itself run as it is, bit for bit the f32
container; an expert split across shards read with two reads."""
import json
from pathlib import Path

import numpy as np
import pytest
import test_deepseek_v4_conformance as conformance
import torch
from colibri_deepseek_v4.model import DeepseekV4
from official_layout import write_official
from safetensors.numpy import save_file

from colibri_core.container.native import NativeCheckpoint
from colibri_core.engine import load
from colibri_core.errors import ColibriError
from colibri_core.quant import QTensor, dequantize
from colibri_core.testing.oracle import Oracle

SPLIT = (2, 5)  # (layer, expert) whose down projection lies in the second shard


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(conformance.TestTinyDeepseekV4, tmp_path_factory.mktemp("oracle"))


@pytest.fixture(scope="module")
def official(oracle, tmp_path_factory):
    dst = tmp_path_factory.mktemp("official") / "DeepSeek-V4-tiny"
    write_official(oracle.checkpoint, dst, split_expert=SPLIT)
    return dst


def _layout(model_dir: Path):
    cfg = DeepseekV4.parse_config(json.loads((model_dir / "config.json").read_text()))
    return DeepseekV4.layout(cfg)


def dequantized_oracle(official: Path, work: Path):
    """transformers' model with the official checkpoint's weights, dequantised to float32."""
    from transformers import AutoModelForCausalLM

    layout = _layout(official)
    ckpt = NativeCheckpoint(official, layout, "deepseek_v4")
    tensors = {n: dequantize(t) if isinstance(t, QTensor) else t for n, t in ckpt.resident().items()}
    names = layout.experts.per_expert
    for layer in layout.moe_layers:
        for e in range(layout.n_experts):
            for proj, w in zip(("gate", "up", "down"), ckpt.read_expert(layer, e)):
                tensors[names[proj].format(layer=layer, expert=e)] = dequantize(w)
    tensors = {n: np.ascontiguousarray(t, np.float32) for n, t in tensors.items()}
    tensors = {n: t.astype(np.int64) if n.endswith("tid2eid") else t for n, t in tensors.items()}
    work.mkdir()
    (work / "config.json").write_text((official / "config.json").read_text().replace('"quantization_config"', '"_q"'))
    save_file(tensors, str(work / "model.safetensors"), metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(work, attn_implementation="eager", dtype=torch.float32).eval()


def test_official_layout_runs_without_conversion(oracle, official, tmp_path):
    """The fp8 / fp4 checkpoint loads in place: dense matrices stay fp8, experts fp4; its logits and greedy
    tokens match transformers running the same weights dequantised."""
    ckpt = NativeCheckpoint(official, _layout(official), "deepseek_v4")
    resident = ckpt.resident()
    assert resident["model.layers.1.attn.wq_b.weight"].kind == "fp8"
    assert {w.kind for w in ckpt.read_expert(1, 0)} == {"fp4"}
    assert len(ckpt.expert_extents(*SPLIT)) == 2 and len(ckpt.expert_extents(1, 0)) == 1
    hf = dequantized_oracle(official, tmp_path / "hf")
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
    assert stats["expert_misses"] > 0  # read from the shards, 2 slots per layer


def test_checkpoint_runs_as_it_is_bit_for_bit_the_f32_container(oracle):
    """transformers' own float32 save run without conversion = the f32 container, bit for bit."""
    with load(oracle.checkpoint, activations="f32") as a, load(oracle.container("f32"), activations="f32") as b:
        assert np.array_equal(a.logits(oracle.logits_ids), b.logits(oracle.logits_ids))


def test_truncated_or_foreign_official_checkpoint_is_one_line(official, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(official, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ColibriError, match="truncated"):
        load(bad)
    config = json.loads((official / "config.json").read_text())
    shutil.copytree(official, tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "n_routed_experts": 12}))
    with pytest.raises(ColibriError, match="lacks expert 8 of layer 0"):
        load(tmp_path / "other")
