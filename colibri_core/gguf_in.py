"""GGUF in: `colibri convert FILE.gguf OUT` for the architectures colibri has.

The GGUF is read with the `gguf` package (llama.cpp's own reader): its metadata becomes config.json,
tokenizer.json (a byte-level BPE from the vocabulary and merges), tokenizer_config.json and the chat
template; its tensors are mapped back to the Hugging Face names the plugin's layout asks for
(`gguf.get_tensor_name_map`, the table llama.cpp's converter maps them with; experts from the fused
``ffn_{gate,up,down}_exps``) and converted by the shard-by-shard converter (`container.streamed`),
one block at a time: each block's tensors are dequantised (`gguf.quants.dequantize`) into a float32
safetensors file that is deleted once written, so the disk holds the container and one block.
Where llama.cpp's converter reshapes, renames or splits a tensor on its way in (Qwen3.5/3.6's
DeltaNet; GPT-OSS's fused, interleaved, transposed experts and their biases: `UNDO`), that is undone
here; a split GGUF's parts are read as one file.

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
import shutil
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from . import plugins, quant as q
from .errors import ColibriError

__all__ = ["convert_gguf", "hf_config", "parts_of", "read", "write_tokenizer"]

# GGUF general.architecture -> config.json's architecture, model_type and what GGUF does not say
ARCHS = {
    "olmoe": ("OlmoeForCausalLM", "olmoe", {"norm_topk_prob": False, "clip_qkv": None}),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", {"norm_topk_prob": True}),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", {}),  # Qwen3.5 / Qwen3.6 MoE
    # llama.cpp's gpt-oss graph has its SwiGLU's clamp and slope built in: these, the released ones
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss", {"attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}),
}


class _Split:
    """The parts of a split GGUF (llama.cpp's gguf-split: `NAME-00001-of-0000N.gguf`, the metadata in
    the first, each tensor in one part) read as one file: the first part's fields, every part's tensors."""

    def __init__(self, readers):
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]


WORK_SUFFIX = ".gguf-work"  # beside the destination: the dequantised blocks while they are converted
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
    if model_type == "gpt_oss":
        # llama.cpp's sliding-window pattern: a per-layer array, or n (every layer but each n-th; 2 unless said)
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 2)
        sliding = pattern if isinstance(pattern, list) else [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
        config.update(num_local_experts=config.pop("num_experts"),
                      sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
                      layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                      rope_parameters=_rope(reader, arch, config.pop("rope_theta")))
    return config


def _rope(reader, arch: str, theta: float) -> dict:
    """rope_parameters from the GGUF's rope.scaling keys: plain RoPE or YaRN. YaRN's `truncate` is not in
    a GGUF: False, as GPT-OSS's released config.json says (the only model converted here with YaRN)."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise ColibriError(f"GGUF rope scaling {kind!r}: colibri converts {arch} GGUF files with YaRN or none")
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": _field(reader, f"{arch}.rope.scaling.factor"),
            "original_max_position_embeddings": _field(reader, f"{arch}.rope.scaling.original_context_length"),
            "beta_fast": _field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": _field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0), "truncate": False}
    attention_factor = _field(reader, f"{arch}.rope.scaling.yarn_attn_factor")
    return rope if attention_factor is None else {**rope, "attention_factor": attention_factor}


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


def _alternate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """(E, I) gate and up biases -> (E, 2I), gate and up alternating: GPT-OSS's gate_up_proj_bias,
    which llama.cpp's converter (GptOssModel.modify_tensors) splits into [..., ::2] and [..., 1::2]."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


class Undo(NamedTuple):
    """What llama.cpp's converter does to one architecture's tensors beyond its name map, to be undone.

    `renames`: (HF suffix, the GGUF name's HF form) of the tensors it renames; `joins`: (HF suffix, the
    HF forms of the GGUF tensors it splits that tensor into, the function joining their float32 arrays
    back); `reshape`: given config.json, the function (HF name, array) -> array undoing its reshapes."""
    renames: tuple[tuple[str, str], ...] = ()
    joins: tuple[tuple[str, tuple[str, ...], Callable], ...] = ()
    reshape: Callable[[dict], Callable[[str, np.ndarray], np.ndarray]] | None = None


UNDO = {
    "qwen35moe": Undo(renames=((".linear_attn.dt_bias", ".linear_attn.dt_proj.bias"),), reshape=_from_qwen35),
    # GPT-OSS (convert_hf_to_gguf.py's GptOssModel): the sinks get a .weight, down_proj_bias becomes
    # down_proj.bias and the alternating gate_up_proj_bias two biases; its fused experts are split
    # into ffn_{gate,up,down}_exps (out, in) like any other's, so the layout's fused form is rebuilt
    # from those (`_fused`). MXFP4 experts are repacked bit for bit: dequantised, they are the release's.
    "gpt-oss": Undo(renames=((".self_attn.sinks", ".self_attn.sinks.weight"),
                             (".mlp.experts.down_proj_bias", ".mlp.experts.down_proj.bias")),
                    joins=((".mlp.experts.gate_up_proj_bias", (".mlp.experts.gate_proj.bias", ".mlp.experts.up_proj.bias"),
                            _alternate),)),
}


# llama.cpp's pre-tokenizer names -> the split regex its tokenizer.json has (default: GPT-2's)
PRE_SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # o200k (GPT-4o, GPT-OSS): the "original regex from tokenizer.json" of llama-vocab.cpp's GPT4O
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
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


class Entry(NamedTuple):
    """How one Hugging Face tensor is made from the GGUF: its `sources` ((GGUF tensor, expert index or
    None, the shape to read it in), dequantised in order), `join`ed when there are several (None: the
    one source as it is), in the HF `shape`."""
    sources: tuple[tuple[object, int | None, tuple[int, ...]], ...]  # (gguf ReaderTensor, expert, shape)
    shape: tuple[int, ...]
    join: Callable[..., np.ndarray] | None = None


def _fused(names, *stacks: np.ndarray) -> np.ndarray:
    """llama.cpp's stacked experts (E, out, in) as the layout's fused tensor holds them (`names`, its
    `ExpertNames`): gate and up (E, I, H) joined into gate_up, after one another or alternating, or
    down (E, H, I) alone; transposed to (in, out) where the layout says so."""
    if len(stacks) == 1:
        w = stacks[0]
    elif names.gate_up_interleaved:
        gate, up = stacks
        w = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])  # (E, 2I, H)
    else:
        w = np.concatenate(stacks, axis=1)  # (E, 2I, H)
    return w.transpose(0, 2, 1) if names.fused_transposed else w


def _block_tensors(reader, layout, tmap, layers: int, undo: Undo) -> dict[str, dict[str, Entry]]:
    """Virtual shard ("globals", "blk.N") -> HF name -> its `Entry` for the model's `layers` layers
    (blocks past them: an MTP head colibri does not run)."""
    gguf_tensors = {t.name: t for t in reader.tensors}
    used, shards = set(), {}

    def gguf_of(hf: str) -> str:
        for ours, theirs in undo.renames:
            hf = hf[:-len(ours)] + theirs if hf.endswith(ours) else hf
        base, suffix = hf, ""  # A_log, dt_bias: a parameter without .weight
        for end in (".weight", ".bias"):
            if hf.endswith(end):
                base, suffix = hf[:-len(end)], end
        g = tmap.get_name(base)
        if g is None or g + suffix not in gguf_tensors:
            raise ColibriError(f"the GGUF has no tensor for {hf} (looked for {g}{suffix})")
        return g + suffix

    def shape_of(t) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(t.shape))  # GGUF lists the axes innermost first

    def add(name: str, entry: Entry) -> None:
        first = entry.sources[0][0].name
        m = re.match(r"blk\.(\d+)\.", first)
        shards.setdefault(f"blk.{int(m[1]):05d}" if m else "globals", {})[name] = entry
        used.update(t.name for t, _, _ in entry.sources)

    joins = {suffix: (sources, join) for suffix, sources, join in undo.joins}
    for name in layout.resident:
        joined = next((s for s in joins if name.endswith(s)), None)
        if joined:
            sources, join = joins[joined]
            ts = [gguf_tensors[gguf_of(name[:-len(joined)] + s)] for s in sources]
            shape = join(*(np.empty(shape_of(t), np.float32) for t in ts)).shape  # joined: biases, small
            add(name, Entry(tuple((t, None, shape_of(t)) for t in ts), shape, join))
            continue
        if name == "lm_head.weight" and "output.weight" not in gguf_tensors:  # tied embeddings
            g = "token_embd.weight"
        else:
            g = gguf_of(name)
        t = gguf_tensors[g]
        shape = shape_of(t)
        if name.endswith("conv1d.weight") and len(shape) == 2:  # llama.cpp squeezes (channels, 1, kernel)
            shape = (shape[0], 1, shape[1])
        add(name, Entry(((t, None, shape),), shape))
    names = layout.experts
    for layer in layout.moe_layers:
        parts = {}
        for proj in ("gate", "up", "down"):
            g = f"blk.{layer}.ffn_{proj}_exps.weight"
            if g not in gguf_tensors:
                raise ColibriError(f"the GGUF lacks {g} (the experts of layer {layer})")
            parts[proj] = gguf_tensors[g]
        if names.per_expert:
            for proj, t in parts.items():
                shape = shape_of(t)[1:]  # (rows, cols) of one expert
                for e in range(layout.n_experts):
                    add(names.per_expert[proj].format(layer=layer, expert=e), Entry(((t, e, shape),), shape))
        else:  # the layout's fused form, (E, 2I, H) and (E, H, I) or both transposed
            gate_up, down = names.fused_shapes(layout.n_experts, layout.hidden, layout.intermediate)
            add(names.fused_gate_up.format(layer=layer),
                Entry(tuple((parts[p], None, shape_of(parts[p])) for p in ("gate", "up")), gate_up, partial(_fused, names)))
            add(names.fused_down.format(layer=layer),
                Entry(((parts["down"], None, shape_of(parts["down"])),), down, partial(_fused, names)))
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
    undo = UNDO.get(_field(reader, "general.architecture"), Undo())
    reshape = (lambda name, w: w) if undo.reshape is None else undo.reshape(config)
    blocks = _block_tensors(reader, layout, tmap, config["num_hidden_layers"], undo)
    resident = set(layout.resident)
    digest = hashlib.sha256()
    for part in parts:
        with open(part, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
    errors: dict[str, list[float]] = {}

    # the dequantised blocks, one at a time, in a directory named after `dst`: a killed conversion's is
    # found and replaced by the next one (a randomly named temporary would be left beside the model)
    tmp = dst.with_name(dst.name + WORK_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        small = Path(tmp) / "files"
        small.mkdir()
        (small / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(reader, small)

        def fetch(shard: str) -> Path:
            """The block's tensors dequantised into a float32 safetensors file; their requantisation error noted."""
            arrays = {}
            for name, entry in blocks[shard].items():
                pieces = [_dequantised(t, expert, shape) for t, expert, shape in entry.sources]
                w = pieces[0] if entry.join is None else entry.join(*pieces)
                w = arrays[name] = np.ascontiguousarray(reshape(name, w), np.float32)
                if name in resident:
                    matrices = [] if layout.stays_f32(name, w.ndim) else [w]
                else:  # an expert's matrices as llama.cpp holds them, (out, in): what colibri quantises
                    matrices = [m for p in pieces for m in (p if p.ndim == 3 else (p,))]
                for m in matrices:
                    back = q.dequantize(q.quantize(m, quant))
                    err = float(np.linalg.norm(back - m) / max(np.linalg.norm(m), 1e-30))
                    errors.setdefault(entry.sources[0][0].tensor_type.name, []).append(err)
            path = Path(tmp) / f"{shard}.safetensors"
            save_file(arrays, str(path))
            return path

        def release(shard: str) -> None:
            (Path(tmp) / f"{shard}.safetensors").unlink()

        headers = {shard: {n: ("F32", e.shape) for n, e in entries.items()} for shard, entries in blocks.items()}
        sizes = {shard: sum(4 * int(np.prod(s)) for _, s in h.values()) for shard, h in headers.items()}
        remote = RemoteCheckpoint(small, sizes, headers, fetch, release,
                                  {**(origin or {}), "gguf": parts[0].name, "sha256": digest.hexdigest()})
        convert_streamed(remote, dst, quant=quant, layout=layout, architecture=arch.name, plugin=arch.plugin,
                         plugin_version=arch.version, progress=progress, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return arch, {k: {"tensors": len(v), "mean_rel_rms": float(np.mean(v)), "max_rel_rms": float(np.max(v))}
                  for k, v in sorted(errors.items())}
