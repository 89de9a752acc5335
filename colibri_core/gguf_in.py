"""GGUF in: `colibri convert FILE.gguf OUT` for the architectures colibri has.

The GGUF is read with the `gguf` package (llama.cpp's own reader): its metadata becomes config.json,
tokenizer.json (a byte-level BPE from the vocabulary and merges), tokenizer_config.json and the chat
template; its tensors are mapped back to the Hugging Face names the plugin's layout asks for
(`gguf.get_tensor_name_map`, the table llama.cpp's converter maps them with; experts from the fused
``ffn_{gate,up,down}_exps``) and converted by the shard-by-shard converter (`container.streamed`),
one block at a time: each block's tensors are dequantised (`gguf.quants.dequantize`) into a float32
safetensors file that is deleted once written, so the disk holds the container and one block.
Where llama.cpp's converter reshapes a tensor on its way in (Qwen3.5/3.6's DeltaNet, `UNDO`), the
reshape is undone here; a split GGUF's parts are read as one file.

No GGUF format maps onto colibri's bit for bit: Q8_0 and Q4_0 scale blocks of 32 values (an f16
scale; Q4_0 stores -8..7) where colibri's int8 scales a whole row (f32) and its int4 groups of 64
(an f16 scale, -7..7). So every tensor — Q8_0, Q4_0, the k-quants, MXFP4, F16, BF16 — is
dequantised and requantised, and the error that adds is measured per tensor (relative RMS against
the GGUF's dequantised weights) and reported.
"""
from __future__ import annotations

import hashlib
import json
import re
import tempfile
from pathlib import Path

import numpy as np

from . import plugins, quant as q
from .errors import ColibriError

__all__ = ["convert_gguf", "hf_config", "parts_of", "read", "write_tokenizer"]

# GGUF general.architecture -> config.json's architecture, model_type and what GGUF does not say
ARCHS = {
    "olmoe": ("OlmoeForCausalLM", "olmoe", {"norm_topk_prob": False, "clip_qkv": None}),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", {"norm_topk_prob": True}),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", {}),  # Qwen3.5 / Qwen3.6 MoE
}


class _Split:
    """The parts of a split GGUF (llama.cpp's gguf-split: `NAME-00001-of-0000N.gguf`, the metadata in
    the first, each tensor in one part) read as one file: the first part's fields, every part's tensors."""

    def __init__(self, readers):
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]


SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # gguf-split's part names


def parts_of(path: Path) -> list[Path]:
    """[path], or every part of the split GGUF whose first part is `path`, in order."""
    m = SPLIT.search(path.name)
    if m is None:
        return [path]
    if int(m[1]) != 1:
        raise ColibriError(f"{path.name} is part {int(m[1])} of a split GGUF: give its first part, -00001-of-{m[2]}.gguf")
    parts = [path.with_name(f"{path.name[:m.start()]}-{i:05d}-of-{m[2]}.gguf") for i in range(1, int(m[2]) + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ColibriError(f"the split GGUF {path.name} lacks its part {missing[0]}")
    return parts


def read(parts: list[Path]):
    """A GGUFReader of the GGUF file `parts[0]`, or the parts of a split GGUF read as one."""
    import gguf

    readers = []
    for part in parts:
        try:
            readers.append(gguf.GGUFReader(str(part)))
        except (OSError, ValueError) as e:
            raise ColibriError(f"cannot read GGUF file {part}: {' '.join(str(e).split())[:200]}") from None
    count = _field(readers[0], "split.count", 1)
    if count != len(parts):
        raise ColibriError(f"{parts[0].name} is part of a GGUF split in {count} files; {len(parts)} given")
    return readers[0] if len(readers) == 1 else _Split(readers)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader) -> dict:
    """config.json of the GGUF's model, from its metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ColibriError(f"GGUF architecture {arch!r}: colibri converts {', '.join(ARCHS)} GGUF files")
    name, model_type, extra = ARCHS[arch]
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    layers = _field(reader, f"{arch}.block_count") - _field(reader, f"{arch}.nextn_predict_layers", 0)  # less MTP's
    config = {"architectures": [name], "model_type": model_type,
              "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
              "hidden_size": hidden, "num_hidden_layers": layers,
              "num_attention_heads": heads,
              "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
              "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
              "num_experts": _field(reader, f"{arch}.expert_count"),
              "num_experts_per_tok": _field(reader, f"{arch}.expert_used_count"),
              "intermediate_size": _field(reader, f"{arch}.expert_feed_forward_length")
              or _field(reader, f"{arch}.feed_forward_length"),
              "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
              "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
              "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
              "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
              "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
              "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"), **extra}
    if model_type == "qwen3_moe":
        config["moe_intermediate_size"] = config["intermediate_size"]
        config["decoder_sparse_step"], config["mlp_only_layers"] = 1, []
    if model_type == "qwen3_5_moe_text":
        value_heads = _field(reader, f"{arch}.ssm.time_step_rank")
        recurrent = _field(reader, f"{arch}.attention.recurrent_layers")
        interval = _field(reader, f"{arch}.full_attention_interval", 4)
        config.update(
            moe_intermediate_size=config["intermediate_size"],
            shared_expert_intermediate_size=_field(reader, f"{arch}.expert_shared_feed_forward_length"),
            linear_conv_kernel_dim=_field(reader, f"{arch}.ssm.conv_kernel"),
            linear_key_head_dim=_field(reader, f"{arch}.ssm.state_size"),
            linear_num_key_heads=_field(reader, f"{arch}.ssm.group_count"),
            linear_num_value_heads=value_heads,
            linear_value_head_dim=_field(reader, f"{arch}.ssm.inner_size") // value_heads,
            layer_types=["linear_attention" if (recurrent[i] if recurrent else (i + 1) % interval) else "full_attention"
                         for i in range(layers)],
            # text alone: the multimodal rope's sections all see one position, which is plain RoPE
            rope_parameters={"rope_type": "default", "rope_theta": config.pop("rope_theta"),
                             "partial_rotary_factor": _field(reader, f"{arch}.rope.dimension_count") / config["head_dim"]})
    return config


def _untile(w: np.ndarray, axis: int, key_heads: int, head_dim: int) -> np.ndarray:
    """Value heads along `axis` from llama.cpp's tiled order ([v0 of every key head, v1 of every …])
    back to Hugging Face's grouped one ([the values of key head 0, of key head 1, …])."""
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(-1, key_heads, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(w, 0, axis)


def _from_qwen35(config: dict):
    """Undo what llama.cpp's converter does to Qwen3.5 / Qwen3.6 tensors (convert_hf_to_gguf.py's
    Qwen3NextModel and _LinearAttentionVReorderBase.modify_tensors): A_log stored as A = -exp(A_log),
    zero-centred norms stored with their +1 (all but the DeltaNet's gated norm), and, where there
    are more value heads than key heads, the value heads of every DeltaNet tensor tiled."""
    hk, dk, dv = config["linear_num_key_heads"], config["linear_key_head_dim"], config["linear_value_head_dim"]
    tiled = config["linear_num_value_heads"] != hk

    def undo(name: str, w: np.ndarray) -> np.ndarray:
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return w - 1
        if ".linear_attn." not in name or not tiled:
            return np.log(-w) if name.endswith(".A_log") else w
        if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):  # q and k rows as they are, then v's
            return np.concatenate([w[:2 * hk * dk], _untile(w[2 * hk * dk:], 0, hk, dv)])
        if name.endswith(".in_proj_z.weight"):
            return _untile(w, 0, hk, dv)
        if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".dt_bias")):
            return _untile(w, 0, hk, 1)
        if name.endswith(".A_log"):
            return np.log(-_untile(w, 0, hk, 1))
        if name.endswith(".out_proj.weight"):
            return _untile(w, 1, hk, dv)
        return w

    return undo


# GGUF architecture -> (the Hugging Face tensor names llama.cpp renames outside its name map, as
# (HF suffix, the GGUF name's HF form); the function undoing its converter's reshapes, given config.json)
UNDO = {"qwen35moe": (((".linear_attn.dt_bias", ".linear_attn.dt_proj.bias"),), _from_qwen35)}


# llama.cpp's pre-tokenizer names -> the split regex its tokenizer.json has (default: GPT-2's)
PRE_SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def write_tokenizer(reader, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json, generation_config.json and chat_template.jinja from
    the GGUF's metadata (a byte-level BPE: tokenizer.ggml.model "gpt2")."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ColibriError(f"GGUF tokenizer {kind!r}: colibri builds byte-level BPE tokenizers (\"gpt2\") only")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    split = PRE_SPLITS.get(_field(reader, "tokenizer.ggml.pre", ""))
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == 3])  # 3: control
    tok.save(str(out / "tokenizer.json"))
    bos, eos = (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None if bos is None else tokens[bos],
           "eos_token": None if eos is None else tokens[eos]}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    template = _field(reader, "tokenizer.chat_template")
    if template:
        (out / "chat_template.jinja").write_text(template)


def _block_tensors(reader, layout, tmap, layers: int, renames=()) -> dict[str, dict[str, tuple]]:
    """Virtual shard ("globals", "blk.N") -> HF name -> (GGUF tensor, expert index or None, HF shape)
    of the model's `layers` layers (blocks past them: an MTP head colibri does not run)."""
    gguf_tensors = {t.name: t for t in reader.tensors}
    used, shards = set(), {}

    def gguf_of(hf: str) -> str:
        for ours, theirs in renames:
            hf = hf[:-len(ours)] + theirs if hf.endswith(ours) else hf
        base, suffix = hf, ""  # A_log, dt_bias: a parameter without .weight
        for end in (".weight", ".bias"):
            if hf.endswith(end):
                base, suffix = hf[:-len(end)], end
        g = tmap.get_name(base)
        if g is None or g + suffix not in gguf_tensors:
            raise ColibriError(f"the GGUF has no tensor for {hf} (looked for {g}{suffix})")
        return g + suffix

    def shard_of(gname: str) -> str:
        m = re.match(r"blk\.(\d+)\.", gname)
        return f"blk.{int(m[1]):05d}" if m else "globals"

    for name in layout.resident:
        if name == "lm_head.weight" and "output.weight" not in gguf_tensors:  # tied embeddings
            g = "token_embd.weight"
        else:
            g = gguf_of(name)
        t = gguf_tensors[g]
        shape = tuple(int(d) for d in reversed(t.shape))
        if name.endswith("conv1d.weight") and len(shape) == 2:  # llama.cpp squeezes (channels, 1, kernel)
            shape = (shape[0], 1, shape[1])
        shards.setdefault(shard_of(g), {})[name] = (t, None, shape)
        used.add(g)
    names = layout.experts.per_expert
    for layer in layout.moe_layers:
        for proj, part in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            g = f"blk.{layer}.{part}.weight"
            if g not in gguf_tensors:
                raise ColibriError(f"the GGUF lacks {g} (the experts of layer {layer})")
            t = gguf_tensors[g]
            shape = tuple(int(d) for d in reversed(t.shape))  # (E, rows, cols)
            for e in range(layout.n_experts):
                shards.setdefault(shard_of(g), {})[names[proj].format(layer=layer, expert=e)] = (t, e, shape[1:])
            used.add(g)
    mtp = {g for g in gguf_tensors if (m := re.match(r"blk\.(\d+)\.", g)) and int(m[1]) >= layers}
    unused = sorted(set(gguf_tensors) - used - mtp - {"rope_freqs.weight"})  # the MTP head's layers: not run
    if unused:
        raise ColibriError(f"the GGUF has tensor {unused[0]} that colibri's {layout.__class__.__name__} does not use"
                           + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""))
    return dict(sorted(shards.items()))


def _dequantised(t, expert: int | None, shape) -> np.ndarray:
    """One GGUF tensor (or one expert of a fused one) as float32 in its HF shape (llama.cpp's layout)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = t.data if expert is None else t.data[expert]
    if t.tensor_type == GGMLQuantizationType.F32:
        w = np.asarray(data, np.float32)
    else:
        w = dequantize(np.asarray(data), t.tensor_type)
    return np.ascontiguousarray(w.reshape(shape), np.float32)


def convert_gguf(src: str | Path | list[Path], dst: str | Path, quant: str, progress: bool = True,
                 origin: dict | None = None, force: bool = False):
    """Convert the GGUF file `src` (or the parts of a split GGUF, in order) into the container `dst`
    at `quant`. `origin` joins the manifest's source.origin (a pull's repo and revision); `force`
    replaces a container at `dst`. Returns the architecture and the requantisation error per GGUF
    tensor type: {type: {"tensors", "mean_rel_rms", "max_rel_rms"}}."""
    import gguf
    from safetensors.numpy import save_file

    from .container.streamed import RemoteCheckpoint, convert_streamed
    from .convert import parse_config

    parts = [Path(p) for p in (src if isinstance(src, list) else [src])]
    dst = Path(dst)
    reader = read(parts)
    config = hf_config(reader)
    registry = plugins.registry()
    arch = registry.resolve(config, where=str(parts[0]))
    model_cls = registry.model_class(arch)
    layout = model_cls.layout(parse_config(model_cls, config, parts[0]))
    gguf_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == _field(reader, "general.architecture"))
    tmap = gguf.get_tensor_name_map(gguf_arch, config["num_hidden_layers"])
    renames, undo = UNDO.get(_field(reader, "general.architecture"), ((), None))
    undo = (lambda name, w: w) if undo is None else undo(config)
    blocks = _block_tensors(reader, layout, tmap, config["num_hidden_layers"], renames)
    digest = hashlib.sha256()
    for part in parts:
        with open(part, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
    errors: dict[str, list[float]] = {}

    with tempfile.TemporaryDirectory(prefix="colibri-gguf-", dir=dst.parent if dst.parent.exists() else None) as tmp:
        small = Path(tmp) / "files"
        small.mkdir()
        (small / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(reader, small)

        def fetch(shard: str) -> Path:
            """The block's tensors dequantised into a float32 safetensors file; their requantisation error noted."""
            arrays = {}
            for name, (t, expert, shape) in blocks[shard].items():
                w = arrays[name] = np.ascontiguousarray(undo(name, _dequantised(t, expert, shape)), np.float32)
                if w.ndim >= 2 and not layout.stays_f32(name, w.ndim):
                    back = q.dequantize(q.quantize(w, quant))
                    err = float(np.linalg.norm(back - w) / max(np.linalg.norm(w), 1e-30))
                    errors.setdefault(t.tensor_type.name, []).append(err)
            path = Path(tmp) / f"{shard}.safetensors"
            save_file(arrays, str(path))
            return path

        def release(shard: str) -> None:
            (Path(tmp) / f"{shard}.safetensors").unlink()

        headers = {shard: {n: ("F32", shape) for n, (_, _, shape) in tensors.items()} for shard, tensors in blocks.items()}
        sizes = {shard: sum(4 * int(np.prod(s)) for _, s in h.values()) for shard, h in headers.items()}
        remote = RemoteCheckpoint(small, sizes, headers, fetch, release,
                                  {**(origin or {}), "gguf": parts[0].name, "sha256": digest.hexdigest()})
        convert_streamed(remote, dst, quant=quant, layout=layout, architecture=arch.name, plugin=arch.plugin,
                         plugin_version=arch.version, progress=progress, force=force)
    return arch, {k: {"tensors": len(v), "mean_rel_rms": float(np.mean(v)), "max_rel_rms": float(np.max(v))}
                  for k, v in sorted(errors.items())}
