"""The container: convert tiny OLMoE checkpoints (per-expert, fused, sharded, bf16) and read them back.

The expected values come from `safetensors.torch` + `quant.quantize/dequantize`, never from the
container's own reader: a round trip must equal quantising the source tensor, and the source
itself at f32.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch  # the oracle (the test extra): where it is missing these tests fail, never skip
import transformers
import yaml

from colibri_core import quant
from colibri_core.container import FORMAT_VERSION, Container, convert, dequantize
from colibri_core.container import writer
from colibri_core.errors import ColibriError
from colibri_core.layout import PROJS, ContainerLayout, ExpertNames

ARCH = "olmoe"


def olmoe_layout(cfg: dict) -> ContainerLayout:
    """The OLMoE container layout, as the olmoe plugin would declare it."""
    n_layers = cfg["num_hidden_layers"]
    resident = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    for layer in range(n_layers):
        p = f"model.layers.{layer}."
        resident += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        resident += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        resident += [p + f"self_attn.{x}_norm.weight" for x in "qk"]
        resident += [p + "mlp.gate.weight"]
    return ContainerLayout(
        resident=tuple(resident),
        keep_f32=(r"mlp\.gate\.weight$",),
        moe_layers=tuple(range(n_layers)),
        n_experts=cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"],
        hidden=cfg["hidden_size"],
        intermediate=cfg["intermediate_size"],
        experts=ExpertNames(
            per_expert={p: f"model.layers.{{layer}}.mlp.experts.{{expert}}.{p}_proj.weight" for p in PROJS},
            fused_gate_up="model.layers.{layer}.mlp.experts.gate_up_proj",
            fused_down="model.layers.{layer}.mlp.experts.down_proj",
        ),
    )


def layout_of(src: Path) -> ContainerLayout:
    return olmoe_layout(json.loads((src / "config.json").read_text()))


def run_convert(src, dst, kind="int4", layout=None, **kw):
    kw.setdefault("progress", False)
    convert(src, dst, quant=kind, layout=layout or layout_of(Path(src)), architecture=ARCH,
            plugin="colibri-olmoe", plugin_version="0.1.0", **kw)


def load_source(src: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as float32, read by safetensors' own torch loader."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def qd(w: np.ndarray, kind: str) -> np.ndarray:
    return quant.dequantize(quant.quantize(w, kind))


def expected(src_tensors: dict, layout: ContainerLayout, kind: str) -> dict[str, np.ndarray]:
    out = {}
    for name, w in src_tensors.items():
        if name in layout.resident and layout.stays_f32(name, w.ndim):
            out[name] = w
        elif w.ndim == 3:  # fused experts: quantised per expert matrix
            out[name] = np.stack([qd(x, kind) for x in w])
        else:
            out[name] = qd(w, kind)
    return out


# ----------------------------------------------------------------------------- tiny checkpoints


def tiny_olmoe(hidden: int, intermediate: int, seed: int):
    torch.manual_seed(seed)
    cfg = transformers.OlmoeConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2)
    model = transformers.OlmoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms are initialised to 1: perturb them
                p.add_(torch.randn_like(p) * 0.1)
        experts = model.model.layers[0].mlp.experts
        experts.gate_up_proj[1, 3, :] = 0  # a zero row: scale 0, q 0
        experts.down_proj[2, :, :5] = 0  # a zero group start
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> checkpoint directory."""
    root = tmp_path_factory.mktemp("src")
    small = tiny_olmoe(hidden=32, intermediate=16, seed=0)
    odd = tiny_olmoe(hidden=96, intermediate=45, seed=1)  # int4: two groups, the last short; odd cols
    out = {"per_expert": root / "pe", "fused": root / "fu", "sharded": root / "sh", "bf16_fused": root / "bf"}
    small.save_pretrained(out["per_expert"])
    (out["per_expert"] / "tokenizer.json").write_text('{"fake": true}')
    (out["per_expert"] / "chat_template.jinja").write_text("{{ messages }}")
    odd.save_pretrained(out["fused"], save_original_format=False)
    odd.save_pretrained(out["sharded"], max_shard_size="40KB")
    odd.to(torch.bfloat16).save_pretrained(out["bf16_fused"], save_original_format=False)
    assert (out["sharded"] / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="module")
def int4_container(sources, tmp_path_factory):
    dst = tmp_path_factory.mktemp("c") / "pe-int4"
    run_convert(sources["per_expert"], dst, "int4")
    return dst


@pytest.fixture
def damaged(int4_container, tmp_path):
    """A private copy of a converted container, to break."""
    dst = tmp_path / "copy"
    shutil.copytree(int4_container, dst)
    return dst


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("kind", ["f32", "int8", "int4"])
@pytest.mark.parametrize("source", ["per_expert", "fused", "sharded", "bf16_fused"])
def test_round_trip(sources, tmp_path, source, kind):
    src = sources[source]
    dst = tmp_path / "out"
    run_convert(src, dst, kind)
    layout = layout_of(src)
    src_tensors = load_source(src)
    got = dequantize(dst)
    assert sorted(got) == sorted(src_tensors)
    want = expected(src_tensors, layout, kind)
    for name, w in want.items():
        assert got[name].dtype == np.float32 and got[name].shape == w.shape, name
        np.testing.assert_array_equal(got[name], w, err_msg=name)
        if kind == "f32":
            np.testing.assert_array_equal(got[name], src_tensors[name], err_msg=name)
    assert not (tmp_path / "out.partial").exists()


def test_container_api(sources, int4_container):
    src = sources["per_expert"]
    layout = layout_of(src)
    c = Container(int4_container)
    assert c.path == int4_container and c.architecture == ARCH and c.quant == "int4"
    assert c.config == json.loads((src / "config.json").read_text())
    assert (c.moe_layers, c.n_experts, c.hidden, c.intermediate) == ((0, 1), 4, 32, 16)
    assert c.expert_nbytes % 4096 == 0
    src_tensors = load_source(src)

    res = c.resident()
    assert sorted(res) == sorted(layout.resident)
    for name, t in res.items():
        if layout.stays_f32(name, src_tensors[name].ndim) and src_tensors[name].ndim == 2:  # kept f32, exact
            assert isinstance(t, quant.QTensor) and t.kind == "f32"  # a matrix: for the C kernels
            np.testing.assert_array_equal(t.data, src_tensors[name])
        elif layout.stays_f32(name, src_tensors[name].ndim):  # 1-D: a plain ndarray, exact
            assert isinstance(t, np.ndarray) and t.dtype == np.float32
            np.testing.assert_array_equal(t, src_tensors[name])
        else:
            assert isinstance(t, quant.QTensor) and t.kind == "int4"
            ref = quant.quantize(src_tensors[name], "int4")
            np.testing.assert_array_equal(t.data, ref.data)
            np.testing.assert_array_equal(t.scales, ref.scales)

    for layer in c.moe_layers:
        path, _, _ = c.expert_location(layer, 0)
        assert os.path.getsize(path) == c.n_experts * c.expert_nbytes
        for e in range(c.n_experts):
            p, offset, nbytes = c.expert_location(layer, e)
            assert p == path and offset == e * c.expert_nbytes and nbytes == c.expert_nbytes
            assert offset % 4096 == 0 and nbytes % 4096 == 0
            got = c.read_expert(layer, e)
            for proj, t in zip(PROJS, got):
                ref = quant.quantize(src_tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"], "int4")
                assert (t.kind, t.rows, t.cols) == (ref.kind, ref.rows, ref.cols)
                np.testing.assert_array_equal(t.data, ref.data)
                np.testing.assert_array_equal(t.scales, ref.scales)
    with pytest.raises(ValueError):
        c.expert_location(2, 0)
    c.close()


def test_parse_expert_views_any_buffer(int4_container):
    c = Container(int4_container)
    path, offset, nbytes = c.expert_location(1, 3)
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(nbytes)
    ref = c.read_expert(1, 3)
    big = np.zeros(nbytes + 8192, np.uint8)  # e.g. a larger aligned I/O buffer
    big[:nbytes] = np.frombuffer(raw, np.uint8)
    for buf in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8).copy(), big):
        got = c.parse_expert(buf)
        for t, r in zip(got, ref):
            np.testing.assert_array_equal(t.data, r.data)
            np.testing.assert_array_equal(t.scales, r.scales)
    arr = big
    gate, up, down = c.parse_expert(arr)
    assert np.shares_memory(gate.data, arr) and np.shares_memory(down.scales, arr)  # views, no copy
    with pytest.raises(ColibriError):
        c.parse_expert(raw[:-1])


def test_manifest(sources, int4_container):
    m = yaml.safe_load((int4_container / "colibri.yaml").read_text())
    assert m["format"] == "colibri-container" and m["format_version"] == FORMAT_VERSION == 1
    assert (m["architecture"], m["plugin"], m["quant"], m["checksum"]) == (
        ARCH, {"name": "colibri-olmoe", "version": "0.1.0"}, "int4", "crc32")
    assert m["quantisation"] == {"experts": "int4", "matrices": "int4", "kept": "f32"}
    assert m["resident"]["tensors"]["model.norm.weight"] == {"kind": "array", "shape": [32]}
    assert m["resident"]["tensors"]["model.layers.0.mlp.gate.weight"] == {"kind": "array", "shape": [4, 32]}
    assert m["resident"]["tensors"]["lm_head.weight"] == {"kind": "int4", "shape": [128, 32]}
    ex = m["experts"]
    assert ex["source_form"] == "per_expert" and set(ex["names"]) == set(PROJS)
    assert [f["path"] for f in ex["files"]] == ["experts/layer-000.bin", "experts/layer-001.bin"]
    assert len(set(ex["files"][0]["extent_crc32"])) == 4  # one real checksum per expert
    assert ex["files"][0]["crc32"] != ex["files"][1]["crc32"]
    assert m["source"]["fingerprint"].startswith("sha256:")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert name in m["files"]
        assert (int4_container / name).read_bytes() == (sources["per_expert"] / name).read_bytes()
    assert sorted(p.name for p in int4_container.iterdir()) == sorted(
        ["colibri.yaml", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja",
         "resident.safetensors", "experts"])


def test_fused_source_restores_fused_names(sources, tmp_path):
    dst = tmp_path / "fu"
    run_convert(sources["fused"], dst, "int8")
    c = Container(dst)
    assert c.manifest["experts"]["source_form"] == "fused"
    got = dequantize(dst)
    assert got["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 90, 96)
    assert got["model.layers.1.mlp.experts.down_proj"].shape == (4, 96, 45)


def test_container_never_writes(int4_container):
    before = {p: p.stat().st_mtime_ns for p in int4_container.rglob("*")}
    c = Container(int4_container)
    c.resident()
    c.read_expert(0, 1)
    assert c.verify(deep=True) == []
    dequantize(int4_container)
    c.close()
    assert {p: p.stat().st_mtime_ns for p in int4_container.rglob("*")} == before


def test_progress_goes_to_stderr(sources, tmp_path, capsys):
    run_convert(sources["per_expert"], tmp_path / "out", "int8", progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "converting" in err


# ----------------------------------------------------------------------------- conversion errors


def rewrite_checkpoint(src: Path, dst: Path, edit) -> Path:
    """A copy of a single-file f32 checkpoint with its tensors edited by `edit(dict)`."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def assert_one_line_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_missing_tensor(sources, tmp_path):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    src = rewrite_checkpoint(sources["per_expert"], tmp_path / "src", lambda t: t.pop(name))
    dst = tmp_path / "out"
    with pytest.raises(ColibriError) as ei:
        run_convert(src, dst, layout=layout_of(sources["per_expert"]))
    assert_one_line_error(ei, f"checkpoint lacks tensor {name} (needed by architecture {ARCH})")
    assert not dst.exists() and not (tmp_path / "out.partial").exists()


def test_missing_resident_tensor(sources, tmp_path):
    src = rewrite_checkpoint(sources["per_expert"], tmp_path / "src", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ColibriError) as ei:
        run_convert(src, tmp_path / "out", layout=layout_of(sources["per_expert"]))
    assert_one_line_error(ei, "checkpoint lacks tensor model.norm.weight")
    assert list(tmp_path.iterdir()) == [tmp_path / "src"]


def test_unused_tensor(sources, tmp_path):
    extra = "model.layers.0.mlp.shared_expert.weight"
    src = rewrite_checkpoint(sources["per_expert"], tmp_path / "src",
                             lambda t: t.update({extra: np.ones((2, 2), np.float32)}))
    with pytest.raises(ColibriError) as ei:
        run_convert(src, tmp_path / "out", layout=layout_of(sources["per_expert"]))
    assert_one_line_error(ei, f"checkpoint has tensor {extra} that architecture {ARCH} does not use")
    assert list(tmp_path.iterdir()) == [tmp_path / "src"]
    # ... unless the layout ignores it on purpose
    layout = dataclasses.replace(layout_of(sources["per_expert"]), ignore=(r"shared_expert",))
    run_convert(src, tmp_path / "out", layout=layout)
    assert extra not in dequantize(tmp_path / "out")


def test_shape_mismatch(sources, tmp_path):
    layout = dataclasses.replace(layout_of(sources["per_expert"]), intermediate=17)
    with pytest.raises(ColibriError) as ei:
        run_convert(sources["per_expert"], tmp_path / "out", layout=layout)
    assert_one_line_error(ei, "has shape [16, 32]", "expects [17, 32]")
    layout = dataclasses.replace(layout_of(sources["fused"]), n_experts=3)
    with pytest.raises(ColibriError) as ei:
        run_convert(sources["fused"], tmp_path / "out", layout=layout)
    assert_one_line_error(ei, "gate_up_proj has shape [4, 90, 96]", "expects [3, 90, 96]")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_unreadable_dtype(sources, tmp_path):
    """A dtype colibri cannot widen (here fp8 e5m2) is refused before anything is written."""
    src = tmp_path / "src"
    shutil.copytree(sources["per_expert"], src)
    f = src / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + n])
    header["model.layers.1.mlp.experts.0.down_proj.weight"]["dtype"] = "F8_E5M2"
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    f.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])
    with pytest.raises(ColibriError) as ei:
        run_convert(src, tmp_path / "out")
    assert_one_line_error(ei, "model.layers.1.mlp.experts.0.down_proj.weight has dtype F8_E5M2")
    assert list(tmp_path.iterdir()) == [src]


def test_bad_inputs(sources, tmp_path):
    layout = layout_of(sources["per_expert"])
    empty = tmp_path / "empty"
    empty.mkdir()
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    shutil.copy(sources["per_expert"] / "config.json", only_config)
    no_config = tmp_path / "nocfg"
    shutil.copytree(sources["per_expert"], no_config)
    (no_config / "config.json").unlink()
    cases = [(tmp_path / "nope", "int4", "does not exist"), (sources["per_expert"] / "config.json", "int4",
             "not a directory"), (empty, "int4", "no config.json"), (no_config, "int4", "no config.json"),
             (only_config, "int4", "no safetensors"), (sources["per_expert"], "int3", "unknown quantisation")]
    for src, kind, needle in cases:
        with pytest.raises(ColibriError) as ei:
            run_convert(src, tmp_path / "out", kind, layout=layout)
        assert_one_line_error(ei, needle)
    assert not (tmp_path / "out").exists()


def test_existing_destination(sources, tmp_path):
    dst = tmp_path / "out"
    run_convert(sources["per_expert"], dst, "int8")
    with pytest.raises(ColibriError) as ei:
        run_convert(sources["per_expert"], dst, "int4")
    assert_one_line_error(ei, "already holds a colibri container")
    assert Container(dst).quant == "int8"
    run_convert(sources["per_expert"], dst, "int4", force=True)
    assert Container(dst).quant == "int4"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ColibriError) as ei:
        run_convert(sources["per_expert"], other, "int4", force=True)
    assert_one_line_error(ei, "not empty")
    assert (other / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- resume


def interrupt_after_first_layer(monkeypatch):
    real = writer._write_layer

    def crashing(ckpt, plan, layer, path, bar):
        if layer > 0:
            path.write_bytes(b"half a layer")
            raise RuntimeError("simulated crash")
        return real(ckpt, plan, layer, path, bar)

    monkeypatch.setattr(writer, "_write_layer", crashing)


def count_writes(monkeypatch) -> list:
    calls = []
    real_layer, real_resident = writer._write_layer, writer._write_resident

    def layer(ckpt, plan, layer, path, bar):
        calls.append(layer)
        return real_layer(ckpt, plan, layer, path, bar)

    def resident(ckpt, plan, path, bar):
        calls.append("resident")
        return real_resident(ckpt, plan, path, bar)

    monkeypatch.setattr(writer, "_write_layer", layer)
    monkeypatch.setattr(writer, "_write_resident", resident)
    return calls


def test_resume(sources, tmp_path, monkeypatch):
    src, dst = sources["fused"], tmp_path / "out"
    staging = tmp_path / "out.partial"
    with monkeypatch.context() as mp:
        interrupt_after_first_layer(mp)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run_convert(src, dst, "int4")
    assert not dst.exists() and (staging / "experts" / "layer-000.bin").is_file()
    assert not (staging / "colibri.yaml").exists()
    with pytest.raises(ColibriError) as ei:  # a half-written container is never taken for a whole one
        Container(staging)
    assert_one_line_error(ei, "unfinished conversion")
    mtime = (staging / "experts" / "layer-000.bin").stat().st_mtime_ns

    calls = count_writes(monkeypatch)
    run_convert(src, dst, "int4")
    assert calls == [1]  # the resident file and layer 0 were kept
    assert (dst / "experts" / "layer-000.bin").stat().st_mtime_ns == mtime
    assert not staging.exists() and not (dst / "progress.json").exists()
    assert Container(dst).verify(deep=True) == []
    want = expected(load_source(src), layout_of(src), "int4")
    got = dequantize(dst)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_resume_rewrites_damaged_layer(sources, tmp_path, monkeypatch):
    src, dst = sources["per_expert"], tmp_path / "out"
    with monkeypatch.context() as mp:
        interrupt_after_first_layer(mp)
        with pytest.raises(RuntimeError):
            run_convert(src, dst, "int8")
    f = tmp_path / "out.partial" / "experts" / "layer-000.bin"
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(data)
    calls = count_writes(monkeypatch)
    run_convert(src, dst, "int8")
    assert calls == [0, 1]
    assert Container(dst).verify(deep=True) == []


def test_resume_discards_other_conversion(sources, tmp_path, monkeypatch):
    src, dst = sources["per_expert"], tmp_path / "out"
    with monkeypatch.context() as mp:
        interrupt_after_first_layer(mp)
        with pytest.raises(RuntimeError):
            run_convert(src, dst, "int4")
    calls = count_writes(monkeypatch)
    run_convert(src, dst, "int8")  # another quantisation: start over
    assert calls == ["resident", 0, 1]
    assert Container(dst).quant == "int8"
    want = expected(load_source(src), layout_of(src), "int8")
    got = dequantize(dst)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_foreign_staging_dir_is_kept(sources, tmp_path):
    staging = tmp_path / "out.partial"
    staging.mkdir()
    (staging / "precious.txt").write_text("mine")
    with pytest.raises(ColibriError) as ei:
        run_convert(sources["per_expert"], tmp_path / "out")
    assert_one_line_error(ei, "not a colibri staging directory")
    assert (staging / "precious.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- damaged containers


def test_truncated_expert_file(damaged):
    f = damaged / "experts" / "layer-001.bin"
    os.truncate(f, f.stat().st_size - 4096)
    with pytest.raises(ColibriError) as ei:
        Container(damaged)
    assert_one_line_error(ei, str(damaged), "layer-001.bin", "truncated")


def test_missing_expert_file(damaged):
    (damaged / "experts" / "layer-000.bin").unlink()
    with pytest.raises(ColibriError) as ei:
        Container(damaged)
    assert_one_line_error(ei, "layer-000.bin is missing")


@pytest.mark.parametrize("where", [10, 3000, 4096 - 20, 4096 - 14])  # data, padding, crc, trailer fields
def test_flipped_byte_in_expert(damaged, where):
    c = Container(damaged)  # open checks only sizes of expert files
    layer, expert = 1, 2
    path, offset, nbytes = c.expert_location(layer, expert)
    data = bytearray(Path(path).read_bytes())
    data[offset + where] ^= 0x10
    Path(path).write_bytes(data)
    with pytest.raises(ColibriError) as ei:
        c.read_expert(layer, expert)
    assert_one_line_error(ei, "checksum")
    if where < 4096 - 16:
        assert_one_line_error(ei, "layer-001.bin", "layer 1 expert 2")
    with pytest.raises(ColibriError):
        c.parse_expert(bytes(data[offset: offset + nbytes]))
    c.read_expert(layer, expert + 1)  # the others are fine
    c.read_expert(0, expert)
    assert c.verify(deep=False) == []
    problems = c.verify(deep=True)
    assert any("layer 1 expert 2" in p for p in problems), problems
    assert any("whole-file checksum" in p for p in problems), problems
    assert not any("expert 3" in p or "layer 0" in p for p in problems), problems


def test_swapped_extents(damaged):
    c = Container(damaged)
    path, _, n = c.expert_location(0, 0)
    data = bytearray(Path(path).read_bytes())
    data[:n], data[n: 2 * n] = data[n: 2 * n], data[:n]
    Path(path).write_bytes(data)
    with pytest.raises(ColibriError) as ei:
        c.read_expert(0, 0)
    assert_one_line_error(ei, "holds layer 0 expert 1")
    assert any("expert 0" in p for p in c.verify(deep=True))


def test_flipped_byte_in_resident_file(damaged):
    f = damaged / "resident.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 1
    f.write_bytes(data)
    with pytest.raises(ColibriError) as ei:
        Container(damaged)
    assert_one_line_error(ei, "resident.safetensors fails its checksum")


def test_edited_config_file(damaged):
    with open(damaged / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(ColibriError) as ei:
        Container(damaged)
    assert_one_line_error(ei, "config.json")


@pytest.mark.parametrize("text, needle", [
    ("format: colibri-container\nformat_version: 1\n  bad: [indent\n", "cannot parse colibri.yaml"),
    ("just a string\n", "not a colibri container manifest"),
    ("format: something-else\nformat_version: 1\n", "not a colibri container manifest"),
    ("format: colibri-container\nformat_version: 2\n", "format_version 2"),
    ("format: colibri-container\nformat_version: 1\narchitecture: olmoe\n", "lacks key"),
    (b"\xff\xfe\x00garbage", "cannot parse colibri.yaml"),
])
def test_bad_manifest(damaged, text, needle):
    p = damaged / "colibri.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ColibriError) as ei:
        Container(damaged)
    assert_one_line_error(ei, str(damaged), needle)


def test_manifest_key_edits(damaged):
    p = damaged / "colibri.yaml"
    m = yaml.safe_load(p.read_text())
    m["experts"]["expert_nbytes"] = 8192
    p.write_text(yaml.safe_dump(m))
    with pytest.raises(ColibriError) as ei:
        Container(damaged)
    assert_one_line_error(ei, "expert_nbytes")
    m["experts"]["expert_nbytes"] = 4096
    m["experts"]["files"][0]["path"] = "../../etc/passwd"
    p.write_text(yaml.safe_dump(m))
    with pytest.raises(ColibriError) as ei:
        Container(damaged)
    assert_one_line_error(ei, "bad file path")


def test_not_a_container(sources, tmp_path):
    with pytest.raises(ColibriError) as ei:
        Container(sources["per_expert"])
    assert_one_line_error(ei, "Hugging Face checkpoint", "run `colibri convert")
    with pytest.raises(ColibriError) as ei:
        Container(sources["per_expert"] / "config.json")
    assert_one_line_error(ei, "not a directory")
    with pytest.raises(ColibriError) as ei:
        Container(tmp_path / "nope")
    assert_one_line_error(ei, "does not exist")
    with pytest.raises(ColibriError) as ei:
        Container(tmp_path)
    assert_one_line_error(ei, "no colibri.yaml")
