"""GGUF in: a GGUF of a tiny OLMoE checkpoint (written with the `gguf` package's GGUFWriter, with
llama.cpp's tensor names and metadata keys, quantised with gguf.quants), converted by `colibri
convert FILE.gguf OUT`, runs; its logits match the oracle (transformers) loaded with the GGUF's
dequantised weights, within what colibri's requantisation adds; the tokenizer rebuilt from the GGUF's
vocabulary and merges encodes as the original does; the requantisation error is reported."""
import json

import numpy as np
import pytest

from conftest import colibri

gguf = pytest.importorskip("gguf", reason="the bench extra (gguf) writes the GGUF files")

EXPERT = "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


ARCHS = {"OlmoeForCausalLM": ("olmoe", gguf.MODEL_ARCH.OLMOE), "Qwen3MoeForCausalLM": ("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE)}


def write_gguf(ckpt, path, qtype: str) -> None:
    """`ckpt` (an OLMoE or Qwen3-MoE checkpoint directory, per-expert form) as a GGUF, as llama.cpp's
    converter lays one out: matrices at `qtype`, norms and routers F32, experts fused into
    ffn_{gate,up,down}_exps, the BPE tokenizer as "gpt2"."""
    from safetensors.numpy import load_file

    config = json.loads((ckpt / "config.json").read_text())
    tokenizer = json.loads((ckpt / "tokenizer.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    L, E = config["num_hidden_layers"], config.get("num_experts") or config["num_local_experts"]
    name, arch = ARCHS[config["architectures"][0]]
    w = gguf.GGUFWriter(str(path), name)
    w.add_block_count(L)
    w.add_context_length(config.get("max_position_embeddings", 4096))
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    if config.get("head_dim"):
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    w.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    w.add_expert_count(E)
    w.add_expert_used_count(config["num_experts_per_tok"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    merges = tokenizer["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"])
    w.add_chat_template(json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"])
    tmap = gguf.get_tensor_name_map(arch, L)
    Q = getattr(gguf.GGMLQuantizationType, qtype)

    def add(name, a):
        if a.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, a.astype(np.float32))
        elif qtype == "Q4_K":  # gguf quantises no k-quant: random blocks, their scales kept small
            w.add_tensor(name, q4_k_blocks(a.shape), raw_dtype=Q)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, Q), raw_dtype=Q)

    for name, a in tensors.items():
        if ".experts." not in name:
            add(tmap.get_name(name.removesuffix(".weight")) + ".weight", a)
    for layer in range(L):
        for proj in ("gate", "up", "down"):
            add(f"blk.{layer}.ffn_{proj}_exps.weight",
                np.stack([tensors[EXPERT.format(layer=layer, expert=e, proj=proj)] for e in range(E)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q4_k_blocks(shape) -> np.ndarray:
    """Random Q4_K blocks of a float tensor of `shape` (its rows a multiple of 256): per 256 values
    f16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles."""
    rng = np.random.default_rng(sum(shape))
    blocks = rng.integers(0, 256, (int(np.prod(shape)) // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.array([0.0005, 0.0005], np.float16).view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


def dequantised_checkpoint(gguf_path, ckpt, out):
    """The HF checkpoint of the GGUF's dequantised weights (`ckpt`'s names and files)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    names = load_file(ckpt / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    tmap = gguf.get_tensor_name_map(ARCHS[config["architectures"][0]][1], config["num_hidden_layers"])

    def deq(t):
        return np.asarray(t.data, np.float32) if t.tensor_type == 0 else gguf.quants.dequantize(t.data, t.tensor_type)

    out.mkdir()
    tensors = {}
    for name, a in names.items():
        if ".experts." in name:
            layer, e, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6].removesuffix("_proj")
            tensors[name] = deq(by_name[f"blk.{layer}.ffn_{proj}_exps.weight"])[e].reshape(a.shape)
        else:
            tensors[name] = deq(by_name[tmap.get_name(name.removesuffix(".weight")) + ".weight"]).reshape(a.shape)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(out / "model.safetensors"))
    for f in ckpt.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    """A tiny OLMoE checkpoint (NumPy), with a trained byte-level BPE tokenizer."""
    from colibri_olmoe.demo import write_checkpoint, write_tokenizer

    d = tmp_path_factory.mktemp("gguf-olmoe")
    eos = write_tokenizer(d, ["the quick brown fox jumps over the lazy dog " * 20, "colibri streams experts"], 300)
    write_checkpoint(d, vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_experts=8, num_experts_per_tok=2, eos_token_id=eos)
    return d


@pytest.fixture(scope="module")
def olmoe256(olmoe, tmp_path_factory):
    """A tiny OLMoE checkpoint 256 wide (k-quant blocks hold 256 values), OLMoE's tokenizer."""
    import shutil

    from colibri_olmoe.demo import write_checkpoint

    d = tmp_path_factory.mktemp("gguf-olmoe256")
    write_checkpoint(d, vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                     num_experts=4, num_experts_per_tok=2, eos_token_id=json.loads(
                         (olmoe / "generation_config.json").read_text())["eos_token_id"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(olmoe / name, d / name)
    return d


@pytest.fixture(scope="module")
def qwen3moe(olmoe, tmp_path_factory):
    """A tiny random Qwen3-MoE checkpoint (transformers), GQA and per-head q/k norms; top-k weights
    normalised, as llama.cpp's qwen3moe always does; OLMoE's tokenizer."""
    import shutil

    torch = pytest.importorskip("torch")
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               num_local_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                               initializer_range=0.1)
    d = tmp_path_factory.mktemp("gguf-qwen3moe")
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(olmoe / name, d / name)
    return d


# (GGUF type, colibri quantisation, bound on the logits' relative error against the oracle): at f32
# the conversion adds nothing, so the tensor mapping must be exact; at int8 / int4 the bound is
# colibri's own quantisation error: on this model's original float32 weights colibri's int8 is
# 0.027 from the oracle and its int4 0.49 (random weights of std 0.1 amplify a weight's error)
CASES = [("olmoe", "Q8_0", "f32", 1e-4), ("olmoe", "Q8_0", "int8", 0.05), ("olmoe", "Q4_0", "int4", 0.6),
         ("olmoe", "F16", "int8", 0.05), ("olmoe", "BF16", "int8", 0.05), ("olmoe", "MXFP4", "int4", 0.6),
         ("olmoe256", "Q4_K", "f32", 1e-4), ("olmoe256", "Q4_K", "int4", 0.6),
         ("qwen3moe", "Q8_0", "f32", 1e-4), ("qwen3moe", "Q4_0", "int4", 0.6)]


@pytest.mark.parametrize("model,qtype,quant,bound", CASES)
def test_gguf_converts_runs_and_matches_its_dequantised_oracle(request, model, tmp_path, qtype, quant, bound):
    ckpt = request.getfixturevalue(model)
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from colibri_core.convert import convert_checkpoint
    from colibri_core.engine import load

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(ckpt, path, qtype)
    out = tmp_path / "out"
    r = colibri("convert", path, out, "--quant", quant)
    assert r.returncode == 0, r.stderr
    assert f"{qtype} tensors to {quant}" in r.stderr
    print(r.stderr.strip().splitlines()[-2])
    assert colibri("doctor", "--model", out, "--deep").returncode == 0
    assert colibri("run", "--model", out, "--max-tokens", "4", "the quick").returncode == 0
    original, rebuilt = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (ckpt, out))
    text = "the quick brown fox <|endoftext|> colibri, jumps!"
    assert rebuilt.encode(text).ids == original.encode(text).ids
    assert (out / "chat_template.jinja").read_text() == json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"]
    # the GGUF's weights requantised are exactly what `convert` makes of its dequantised checkpoint
    deq = dequantised_checkpoint(path, ckpt, tmp_path / "deq")
    convert_checkpoint(deq, tmp_path / "from-deq", quant, progress=False)
    for rel in ("resident.safetensors", "experts/layer-000.bin", "experts/layer-001.bin"):
        assert (out / rel).read_bytes() == (tmp_path / "from-deq" / rel).read_bytes(), rel
    ids = original.encode("the quick brown fox jumps over").ids
    oracle = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = oracle(torch.tensor([ids])).logits[0].numpy()
    engine = load(out)
    got = engine.logits(ids)
    engine.close()
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    print(f"{model} {qtype} -> {quant}: logits relative error {err:.2e} against the oracle with the GGUF's dequantised weights")
    assert err < bound
