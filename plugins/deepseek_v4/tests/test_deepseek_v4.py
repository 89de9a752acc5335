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


def test_prefill_then_decode_equals_one_forward(oracle):
    """The prompt, then one token at a time (each window filled across calls, the CSA half-window
    carried), gives the logits of one forward over everything, within rounding."""
    ids = np.array(oracle.logits_ids)
    with load(oracle.container("f32"), activations="f32") as engine:
        model = engine.model
        whole = model.forward(ids, model.new_state())
        state = model.new_state()
        steps = [model.forward(ids[:13], state)]
        steps += [model.forward(ids[t:t + 1], state) for t in range(13, len(ids))]
    got = np.concatenate(steps)
    assert np.abs(got - whole).max() <= 1e-5 * np.abs(whole).max()


def test_state_saved_mid_window_continues_bit_identically(oracle, tmp_path):
    """A prefill ending inside every compressor's window (13 tokens: CSA windows of 4, HCA of 8):
    its arrays saved to disk and loaded into a fresh state continue exactly as the original."""
    ids = np.array(oracle.logits_ids)
    with load(oracle.container("int4"), activations="f32") as engine:
        model = engine.model
        state = model.new_state()
        model.forward(ids[:13], state)
        arrays = state.arrays()
        assert all(len(arrays[f"layer.{i}.compressor.buffer_kv"]) for i in (1, 2, 3))  # mid-window
        assert len(arrays["layer.1.compressor.carry_kv"]) and len(arrays["layer.1.indexer.carry_kv"])
        np.savez(tmp_path / "state.npz", **arrays)
        restored = model.new_state()
        restored.load_arrays(dict(np.load(tmp_path / "state.npz")))
        for t in range(13, 30):
            a, b = model.forward(ids[t:t + 1], state), model.forward(ids[t:t + 1], restored)
            assert np.array_equal(a, b), f"token {t}: the restored state diverges"
        with pytest.raises(ValueError, match="not from this model"):
            model.new_state().load_arrays({**arrays, "layer.1.compressor.buffer_kv": np.zeros((5, 3), np.float32)})


def test_plan_of_the_released_config():
    """`colibri plan` on DeepSeek-V4-Flash's config.json (data/: its published hyper-parameters):
    13.4 MB per routed expert in the release's fp4 with its scales and at int4 gs64 alike, 3,440 state
    floats per token (21 CSA layers × (512 + 128) / 4, 20 HCA layers × 512 / 128)."""
    from colibri_core.planning import plan_config

    config = json.loads((Path(__file__).parent / "data" / "deepseek-v4-flash.config.json").read_text())
    native, int4 = plan_config(config, "native"), plan_config(config, "int4")
    assert native["expert_bytes"] == 3 * (2048 * 4096 // 2 + 2048 * 4096 // 32)  # 13,369,344: E2M1 + UE8M0 / 32
    assert round(native["expert_bytes"] / 1e6, 1) == round(int4["expert_bytes"] / 1e6, 1) == 13.4
    assert native["experts_total"] == 43 * 256 and native["top_k"] == 6
    assert native["state_bytes_per_token"] == int4["state_bytes_per_token"] == 4 * 3440
    assert native["resident_bytes"] > int4["resident_bytes"]  # the release's bf16 tensors are held as float32


def test_official_layout_converts(official, tmp_path):
    """`colibri convert` re-quantises the release: its fp8 / fp4 tensors dequantised exactly (an f32
    container computes what the checkpoint run as it is does, within rounding), experts found under
    the official names, every UE8M0 scale accounted for."""
    from colibri_core.convert import convert_checkpoint

    convert_checkpoint(official, tmp_path / "f32", "f32", progress=False)
    convert_checkpoint(official, tmp_path / "int4", "int4", progress=False)
    ids = list(range(3, 40))
    with load(official, activations="f32") as a, load(tmp_path / "f32", activations="f32") as b:
        want, got = a.logits(ids), b.logits(ids)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    with load(tmp_path / "int4") as c:
        assert c.generate(ids, max_new_tokens=4, temperature=0)  # runs
