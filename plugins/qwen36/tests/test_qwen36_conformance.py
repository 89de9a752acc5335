"""Qwen3.6 against transformers' Qwen3_5MoeForCausalLM: the conformance kit on two tiny configs with
several full-attention intervals and several value heads per key head (and more than one key head,
so the head grouping is exercised), plus what this architecture adds: the released checkpoints'
nested config and `model.language_model.*` names, the hybrid state, a 1,000-token prefill-then-decode
run, and the sizes `colibri plan` reads."""
import json
import shutil

import numpy as np
import pytest
from transformers import Qwen3_5MoeTextConfig

from colibri_core import load
from colibri_core.convert import convert_checkpoint
from colibri_core.errors import ColibriError
from colibri_core.testing import ConformanceSuite
from colibri_qwen36.model import Qwen36


def released_text_config(config: dict) -> dict:
    """The text config as Qwen3.5-MoE / Qwen3.6 releases carry it (under text_config): the layer
    schedule as full_attention_interval (no layer_types), multimodal RoPE keys (mrope_section,
    mrope_interleaved: a no-op for text, where the three position ids coincide), the MTP head's keys
    (its weights are skipped), attn_output_gate, dtype."""
    interval = next(i for i in range(1, len(config["layer_types"]) + 1)
                    if config["layer_types"] == ["full_attention" if (j + 1) % i == 0 else "linear_attention"
                                                 for j in range(len(config["layer_types"]))])
    config.pop("layer_types")
    rope = {**config.pop("rope_parameters"), "mrope_interleaved": True, "mrope_section": [11, 11, 10]}
    return {**config, "full_attention_interval": interval, "rope_parameters": rope, "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False, "attn_output_gate": True, "dtype": "bfloat16"}


def top_level_rope(config: dict) -> dict:
    """RoPE at the top level as Qwen3-Next's config.json writes it: rope_theta and partial_rotary_factor
    as keys of their own, ``"rope_scaling": null``, no rope_parameters."""
    rope = config.pop("rope_parameters")
    return {**config, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"],
            "rope_scaling": None}


class Qwen36Checks:
    """Checks of this plugin beyond the conformance kit (mixed into each conformance subclass)."""

    def test_released_checkpoint_layout(self, oracle, tmp_path):
        """A checkpoint in the released form — config nested under text_config, text weights under
        model.language_model.*, a vision tower and an MTP head to skip, fused experts — converts to a
        container that computes exactly what the plain text checkpoint's container computes."""
        from safetensors.numpy import load_file, save_file

        src = tmp_path / "released"
        src.mkdir()
        text = json.loads((oracle.fused_checkpoint / "config.json").read_text())
        config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                  "tie_word_embeddings": text.get("tie_word_embeddings", False),
                  "text_config": {**text, "model_type": "qwen3_5_moe_text"},
                  "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 8}}
        (src / "config.json").write_text(json.dumps(config))
        tensors = {}
        for f in sorted(oracle.fused_checkpoint.glob("*.safetensors")):
            for name, t in load_file(str(f)).items():
                tensors[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
        assert any(".experts.gate_up_proj" in n for n in tensors), "expected a fused-expert checkpoint"
        tensors["model.visual.blocks.0.attn.qkv.weight"] = np.ones((24, 8), np.float32)
        tensors["mtp.fc.weight"] = np.ones((8, 16), np.float32)
        save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
        for q in ("f32", "int4"):
            convert_checkpoint(src, tmp_path / f"released-{q}", q, progress=False)
            with load(tmp_path / f"released-{q}") as a, load(oracle.container(q)) as b:
                assert a.arch.name == "qwen36"
                assert np.array_equal(a.logits(oracle.prompt), b.logits(oracle.prompt)), f"released layout differs at {q}"

    def test_state_arrays_round_trip(self, oracle):
        """The hybrid state (KV caches, conv and recurrent states) flattened with arrays() and
        restored with load_arrays() into a fresh state continues token-identically."""
        with load(oracle.container("int4")) as engine:
            session = engine.new_session()
            list(engine.stream(oracle.prompt, 5, session=session, stop_ids=()))
            arrays = session.state.arrays()
            assert {k.rsplit(".", 1)[-1] for k in arrays} == {"length", "k", "v", "conv", "recurrent"}
            restored = engine.new_session()
            restored.state.load_arrays({k: v.copy() for k, v in arrays.items()})
            restored.ids = list(session.ids)
            assert restored.state.length == session.state.length
            follow = session.ids + [1, 2, 3]
            a = list(engine.stream(follow, 12, session=session, stop_ids=()))
            b = list(engine.stream(follow, 12, session=restored, stop_ids=()))
            assert a == b
            for edit in ("drop", "reshape"):  # another model's state: refused, the fresh state untouched
                fresh = engine.new_session().state
                bad = dict(arrays)
                name = next(k for k in arrays if k.endswith(".recurrent"))
                if edit == "drop":
                    del bad[name]
                else:
                    bad[name] = bad[name][:, :-1]
                with pytest.raises(ValueError, match="not from this model"):
                    fresh.load_arrays(bad)
                assert fresh.length == 0 and all(not v.any() for k, v in fresh.arrays().items() if k != "length")

    def test_sizes_for_plan(self, oracle):
        """resident_shapes, state_floats_per_token and fixed_state_floats describe the real tensors."""
        from safetensors import safe_open

        cfg = Qwen36.parse_config(json.loads((oracle.checkpoint / "config.json").read_text()))
        shapes = Qwen36.resident_shapes(cfg)
        source = {}
        for f in oracle.checkpoint.glob("*.safetensors"):
            with safe_open(f, "np") as st:
                source.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        assert shapes == {k: source[k] for k in shapes}
        assert set(shapes) == set(oracle.layout.resident)
        with load(oracle.container("f32")) as engine:
            state = engine.model.new_state()
            engine.model.forward(np.asarray(oracle.prompt), state)
            arrays = state.arrays()
        per_token = Qwen36.state_floats_per_token(cfg)
        assert len(per_token) == cfg.num_hidden_layers
        for i, floats in enumerate(per_token):
            if floats:
                assert arrays[f"layer.{i}.k"].size + arrays[f"layer.{i}.v"].size == floats * len(oracle.prompt)
        fixed = sum(v.size for k, v in arrays.items() if k.endswith((".conv", ".recurrent")))
        assert Qwen36.fixed_state_floats(cfg) == fixed > 0

    def test_bad_config_is_one_clear_error(self, oracle, tmp_path):
        config = json.loads((oracle.checkpoint / "config.json").read_text())
        for edit, message in (({"layer_types": ["sliding_attention"] * config["num_hidden_layers"]}, "layer_types"),
                              ({"linear_num_value_heads": config["linear_num_key_heads"] + 1}, "multiple"),
                              ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type")):
            with pytest.raises(ColibriError, match=message):
                Qwen36.parse_config({**config, **edit})
        src = tmp_path / "no-experts"
        shutil.copytree(oracle.checkpoint, src)
        (src / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_experts"}))
        with pytest.raises(ColibriError, match="num_experts"):
            convert_checkpoint(src, tmp_path / "out", "int8", progress=False)
        assert not (tmp_path / "out").exists()


class TestTinyQwen36(Qwen36Checks, ConformanceSuite):
    """8 layers = 2 × (3 Gated DeltaNet + 1 gated attention); 2 key heads, 3 value heads each."""

    hf_config = Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=8, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, initializer_range=0.1, max_position_embeddings=2048,
    )
    config_variants = {"released_text_config": released_text_config, "top_level_rope": top_level_rope}

    def test_prefill_then_decode_equals_one_long_forward_1000_tokens(self, oracle):
        """Chunked prefill of the first 872 tokens, then 128 single-token recurrent decode steps:
        the logits match one forward pass over all 1,000 tokens, which matches the oracle's (the
        kernel-level test in tests/test_deltanet.py decodes 400 steps)."""
        rng = np.random.default_rng(self.seed + 1000)
        ids = rng.integers(0, self.hf_config.vocab_size, 1000)
        with load(oracle.container("f32")) as engine:
            model = engine.model
            whole = model.forward(ids, model.new_state())  # (1000, V)
            state = model.new_state()
            stepped = [model.forward(ids[:872], state)]
            stepped += [model.forward(ids[t : t + 1], state) for t in range(872, 1000)]
        stepped = np.concatenate(stepped)
        assert state.length == 1000
        err, tol = np.abs(stepped - whole).max(), self.rel_tol * np.abs(whole).max()
        assert err <= tol, f"prefill-then-decode differs from one forward by {err:.3g} > {tol:.3g}"
        ref = oracle.hf_logits("f32", ids.tolist())
        err, tol = np.abs(whole - ref).max(), self.rel_tol * np.abs(ref).max()
        assert err <= tol, f"1,000-token logits differ from transformers by {err:.3g} > {tol:.3g}"


    def test_float16_kv_cache(self, oracle):
        """kv_cache="f16" reaches the full-attention layers' caches (the linear-attention states stay
        float32): the logits do not depend on placement, differ from the float32 cache's, and stay
        close to transformers'."""
        ids = np.asarray(oracle.prompt)
        got = {}
        for slots in (1, 10**6):
            with load(oracle.container("f32"), kv_cache="f16", cache_slots=slots) as engine:
                state = engine.new_state()
                got[slots] = engine.model.forward(ids, state)
                dtypes = {name: a.dtype for name, a in state.arrays().items()}
        assert {d for name, d in dtypes.items() if name.endswith((".k", ".v"))} == {np.dtype(np.float16)}
        assert {d for name, d in dtypes.items() if name.endswith((".conv", ".recurrent"))} == {np.dtype(np.float32)}
        assert np.array_equal(got[1].view(np.uint32), got[10**6].view(np.uint32))
        with load(oracle.container("f32")) as engine:
            assert not np.array_equal(engine.model.forward(ids, engine.new_state()), got[1])
        ref = oracle.hf_logits("f32", oracle.prompt)
        err, tol = np.abs(got[1] - ref).max(), 0.01 * np.abs(ref).max()
        assert err <= tol, f"float16-cache logits differ from transformers by {err:.3g} > {tol:.3g}"

    def test_saved_session_continues_token_identically(self, oracle):
        """A conversation saved to disk (KV caches, conv and recurrent states) and reloaded by a fresh
        engine — as after a restart — continues with exactly the tokens of an uninterrupted run."""
        from colibri_core.kv import session
        model_dir = oracle.container("int4")
        identity = {"architecture": "qwen36", "quant": "int4"}
        with load(model_dir) as engine:
            saved = session.PersistentSession(engine.model, model_dir, identity, "qwen36-test")
            live = engine.new_session()
            live.state = saved.state
            first = list(engine.stream(oracle.prompt, 5, session=live, stop_ids=()))
            saved.state, saved.ids = live.state, list(live.ids)
            saved.save()
            follow = live.ids + first[-1:] + [1, 2]
            second = list(engine.stream(follow, 6, session=live, stop_ids=()))
            saved.state, saved.ids = live.state, list(live.ids)
            saved.save()
            follow = live.ids + second[-1:] + [7]
            want = list(engine.stream(follow, 10, session=live, stop_ids=()))
        with load(model_dir) as engine:  # a fresh process's view: only the file on disk
            resumed = session.PersistentSession(engine.model, model_dir, identity, "qwen36-test")
            assert resumed.notice is None and resumed.turns == 2 and resumed.state.length == len(resumed.ids)
            live = engine.new_session()
            live.state, live.ids = resumed.state, list(resumed.ids)
            assert list(engine.stream(follow, 10, session=live, stop_ids=())) == want


class TestTinyQwen36Wide(Qwen36Checks, ConformanceSuite):
    """An irregular layer schedule, 3 key heads × 2 value heads, a 3-tap conv, biased attention
    projections, tied embeddings, half-width RoPE, and a prompt longer than one 64-token chunk."""

    seed = 1
    prompt_tokens = 80  # the prefill spans two chunks (64 + 16)
    new_tokens = 16  # the first config already checks 32; this keeps the suite fast
    hf_config = Qwen3_5MoeTextConfig(
        vocab_size=320, hidden_size=96, num_hidden_layers=6,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                     "full_attention", "full_attention"],
        num_attention_heads=6, num_key_value_heads=3, head_dim=16, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=16,
        linear_conv_kernel_dim=3, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, tie_word_embeddings=True, initializer_range=0.1,
        max_position_embeddings=2048,
    )
    config_variants = {"top_level_rope": top_level_rope}  # an irregular layer schedule: no interval form
