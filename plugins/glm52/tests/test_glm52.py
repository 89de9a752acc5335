"""GLM-5.2 beyond the conformance kit: the real checkpoint layout (fp8 e4m3 with block scales,
sharded, MTP and indexer tensors), the MTP head against a reference of the published MTP forward,
DSA with every key selected == dense attention bit for bit, and the router against transformers'."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_glm52_conformance import tiny
from transformers import AutoModelForCausalLM
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

from colibri_core.container import Container, dequantize
from colibri_core.convert import convert_checkpoint
from colibri_core.engine import load
from colibri_core.layers.router import sigmoid_group_topk

N = 4  # main layers of the tiny model; the MTP layer is layer N
FP8_BLOCK = 16  # block size of the synthetic fp8 checkpoint (real GLM-5.2: 128); small so blocks matter
KEEP_BF16 = ("embed_tokens", "lm_head", "norm", "layernorm", "mlp.gate.weight", "weights_proj", "bias")


def _mtp_config():
    """transformers' config of the tiny model *with* the MTP layer as an ordinary layer N."""
    return tiny(num_hidden_layers=N + 1, indexer_types=["full", "shared", "full", "shared", "full"])


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (rows, cols) f32 → (fp8 e4m3 weight, f32 scale_inv (ceil(rows/B), ceil(cols/B))) as in
    DeepSeek/GLM fp8 checkpoints: w ≈ fp8 * scale_inv per B×B block, scale = absmax / 448."""
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # (br, bc)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.float()


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A sharded GLM checkpoint as published: fp8 e4m3 matrices + NAME_scale_inv, bf16 for the rest,
    the MTP layer N (enorm, hnorm, eh_proj, shared_head, its own attention + indexer + MoE, and
    the copies of embed_tokens / lm_head). Returns (dir, the float32 values the converter must read)."""
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(_mtp_config(), attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    tensors = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if bool((p.reshape(-1) == p.reshape(-1)[0]).all()):  # perturb constant initialisations
                p = p + torch.randn(p.shape, generator=gen) * 0.1
            tensors[name] = p.float()
    # routed experts per expert, as in the published checkpoints
    for i in range(N + 1):
        prefix = f"model.layers.{i}.mlp.experts."
        if prefix + "gate_up_proj" in tensors:
            gate_up, down = tensors.pop(prefix + "gate_up_proj"), tensors.pop(prefix + "down_proj")
            inter = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter]
                tensors[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:]
                tensors[f"{prefix}{e}.down_proj.weight"] = down[e]
    H = model.config.hidden_size
    mtp = f"model.layers.{N}."
    tensors[mtp + "enorm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    tensors[mtp + "hnorm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    tensors[mtp + "shared_head.norm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    tensors[mtp + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=gen) * 0.1
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()

    stored, expected = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and not any(k in name for k in KEEP_BF16):
            q, scale = _fp8_blocks(w)
            stored[name], stored[name + "_scale_inv"] = q, scale
            expected[name] = (q.float() * _expand(scale, *w.shape)).numpy()
        else:
            stored[name] = w.to(torch.bfloat16)
            expected[name] = stored[name].float().numpy()
    d = tmp_path_factory.mktemp("glm-fp8")
    names = sorted(stored)
    shards = {f"model-0000{k + 1}-of-00002.safetensors": names[k::2] for k in range(2)}
    for fname, part in shards.items():
        save_file({n: stored[n] for n in part}, str(d / fname), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    config = tiny().to_dict()
    config.update(architectures=["GlmMoeDsaForCausalLM"], num_nextn_predict_layers=1,
                  quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK]})
    (d / "config.json").write_text(json.dumps(config))
    return d, expected


def test_fp8_sharded_checkpoint_converts_exactly(fp8_checkpoint, tmp_path):
    """Every tensor, fp8 blocks included, is read as torch widens it: fp8 → f32 × its block's scale."""
    src, expected = fp8_checkpoint
    convert_checkpoint(src, tmp_path / "f32", "f32", progress=False)
    got = dequantize(tmp_path / "f32")
    skipped = {f"model.layers.{N}.embed_tokens.weight", f"model.layers.{N}.shared_head.head.weight"}
    assert set(got) == set(expected) - skipped
    for name, w in got.items():
        assert np.array_equal(w, expected[name]), name


def test_mtp_experts_stay_int8(fp8_checkpoint, tmp_path):
    src, _ = fp8_checkpoint
    convert_checkpoint(src, tmp_path / "int4", "int4", progress=False)
    c = Container(tmp_path / "int4")
    assert c.moe_layers == (1, 2, 3, N)
    assert [c.layer_expert_kind(i) for i in c.moe_layers] == ["int4", "int4", "int4", "int8"]
    assert c.layer_expert_nbytes(N) > c.layer_expert_nbytes(1)
    assert c.read_expert(N, 3)[0].kind == "int8" and c.read_expert(1, 3)[0].kind == "int4"
    assert c.verify(deep=True) == []


def test_the_kits_moe_layers_check_reads_the_mtp_layer_as_draft_only(fp8_checkpoint, tmp_path, monkeypatch):
    """The conformance kit's moe_layers check on a model with an MTP layer (the conformance suites'
    tiny configs have none: transformers drops it): layer N is in layout.moe_layers and routers(),
    the forward pass never runs it, and GLM's lookahead leaves it out; the default lookahead (each
    router's successor, so layer 3 → the MTP layer) is refused."""
    from colibri_core.testing import checks
    from colibri_glm52.model import Glm52

    src, _ = fp8_checkpoint
    convert_checkpoint(src, tmp_path / "int4", "int4", progress=False)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 256, 12)]
    checks.check_moe_layers_of(tmp_path / "int4", ids, main_layers=N, oracle_routed=[1, 2, 3])
    monkeypatch.setattr(Glm52, "lookahead", lambda self: None)
    with pytest.raises(checks.ConformanceFailure, match=f"^moe_layers: layer 3's lookahead predicts layer {N}, "
                                                        "which the forward pass does not run"):
        checks.check_moe_layers_of(tmp_path / "int4", ids, main_layers=N)


def _mtp_reference(weights: dict, hidden: np.ndarray, next_ids: np.ndarray, start: int) -> np.ndarray:
    """The published MTP forward (DeepSeek-V3 §2.2 as vLLM/SGLang run GLM's): NumPy for the MTP-specific
    parts (enorm, hnorm, eh_proj, shared head), transformers' own GlmMoeDsaDecoderLayer (layer N
    of a config that has it) for the transformer block. weights: float32 by checkpoint name."""
    cfg = _mtp_config()
    eps = cfg.rms_norm_eps
    p = f"model.layers.{N}."

    def rms(x, w):
        x = x.astype(np.float64)
        return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w).astype(np.float32)

    e = rms(weights["model.embed_tokens.weight"][next_ids], weights[p + "enorm.weight"])
    x = np.concatenate([e, rms(hidden, weights[p + "hnorm.weight"])], axis=-1) @ weights[p + "eh_proj.weight"].T
    cfg._attn_implementation = "eager"
    layer = hf.GlmMoeDsaDecoderLayer(cfg, N).eval()
    state = {k[len(p):]: torch.from_numpy(v) for k, v in weights.items() if k.startswith(p)}
    experts = layer.mlp.experts
    E = experts.gate_up_proj.shape[0]
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                state.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                     for e in range(E)])
    state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        state.pop(k)
    layer.load_state_dict(state, strict=True)
    T = len(next_ids)
    pos = torch.arange(start, start + T)[None]
    x_t = torch.from_numpy(x)[None]
    cos_sin = hf.GlmMoeDsaRotaryEmbedding(cfg)(x_t, pos)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out, _ = layer(x_t, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    return rms(out[0].numpy(), weights[p + "shared_head.norm.weight"]) @ weights["lm_head.weight"].T


def test_mtp_head_matches_reference(fp8_checkpoint, tmp_path):
    """MTP logits (int4 container, MTP experts int8) within 1e-4·max of the reference on the same
    dequantised weights; prompt longer than index_topk so the MTP layer's indexer selects; decoding
    the MTP head token by token (its own cache) agrees with one pass."""
    src, _ = fp8_checkpoint
    convert_checkpoint(src, tmp_path / "int4", "int4", progress=False)
    weights = dequantize(tmp_path / "int4")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, 13)
    with load(tmp_path / "int4") as engine:
        model = engine.model
        hidden = model.hidden(ids[:-1], model.new_state())  # (12, H), final-normalised
        got = model.mtp_forward(hidden, ids[1:], model.new_mtp_state())  # (12, V)
        state = model.new_mtp_state()
        stepped = np.concatenate([model.mtp_forward(hidden[:7], ids[1:8], state)] +
                                 [model.mtp_forward(hidden[t:t + 1], ids[t + 1:t + 2], state) for t in range(7, 12)])
    ref = _mtp_reference(weights, hidden, ids[1:], 0)
    tol = 1e-4 * np.abs(ref).max()
    assert np.abs(got - ref).max() <= tol
    assert np.abs(stepped - got).max() <= tol
    assert len(hidden) > _mtp_config().index_topk


def test_full_selection_is_dense_attention_bit_for_bit(tmp_path):
    """With index_topk ≥ every sequence length the DSA selection keeps every key: the logits are
    bit-identical to dense MLA attention (indexer ignored). With a small index_topk they are not."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny(index_topk=4), attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "c", "int4", progress=False)
    ids = list(range(3, 40))
    with load(tmp_path / "c") as engine:
        sparse = engine.logits(ids)
        engine.model.dense_attention = True
        dense = engine.logits(ids)
        engine.model.dense_attention = False
        for L in engine.model.layers:
            if L["indexer"] is not None:
                L["indexer"].topk = 10**9  # forced: every key selected
        full = engine.logits(ids)
    assert np.array_equal(full, dense)
    assert not np.allclose(sparse, dense, atol=1e-3), "the indexer never changed a selection"


@pytest.mark.parametrize("n_group,topk_group,k", [(1, 1, 8), (4, 2, 4), (8, 3, 6)])
def test_router_matches_transformers(n_group, topk_group, k):
    """sigmoid_group_topk == GlmMoeDsaTopkRouter: same experts chosen, weights within float32 rounding."""
    cfg = tiny(n_routed_experts=32, n_group=n_group, topk_group=topk_group, num_experts_per_tok=k,
               routed_scaling_factor=2.5, hidden_size=48)
    router = hf.GlmMoeDsaTopkRouter(cfg)
    g = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
        router.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.2)
        x = torch.randn(64, 48, generator=g)
        logits, ref_w, ref_ids = router(x)
    w, ids = sigmoid_group_topk(logits.numpy(), router.e_score_correction_bias.numpy(), k, n_group, topk_group,
                                True, 2.5)
    order = np.argsort(ref_ids.numpy(), axis=1)
    ref_ids_sorted = np.take_along_axis(ref_ids.numpy(), order, axis=1)
    mine = np.argsort(ids, axis=1)
    assert np.array_equal(np.take_along_axis(ids, mine, axis=1), ref_ids_sorted)
    np.testing.assert_allclose(np.take_along_axis(w, mine, axis=1), np.take_along_axis(ref_w.numpy(), order, axis=1),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("quant", ["f32", "int4"])
def test_plan_matches_the_container(fp8_checkpoint, tmp_path, quant):
    """planning from config.json alone == what the converter wrote, MTP layer (int8 experts) included."""
    from colibri_core.planning import measured, plan_config

    src, _ = fp8_checkpoint
    convert_checkpoint(src, tmp_path / quant, quant, progress=False)
    p = plan_config(json.loads((src / "config.json").read_text()), quant)
    assert {k: p[k] for k in measured(tmp_path / quant)} == measured(tmp_path / quant)
    assert p["experts_total"] == 4 * 16 and p["kv_floats_per_token_per_layer"] == 32 + 16
    assert p["indexer_keys_floats_per_token_per_layer"] == [32, 0, 32, 0]


def test_plan_of_the_real_glm52_config():
    """GLM-5.2 at int4 from its config.json alone: resident ≈ 9.9 GB (±15 %), ≈ 19 MB per routed
    expert, 19,456 routed experts (75 MoE layers + the MTP layer, × 256), 576 floats per token per layer."""
    from pathlib import Path

    from colibri_core.planning import plan_config

    config = json.loads((Path(__file__).parent / "data" / "glm52_config.json").read_text())
    p = plan_config(config, "int4")
    assert p["architecture"] == "glm52"
    assert abs(p["resident_bytes"] / 9.9e9 - 1) <= 0.15, p["resident_bytes"]
    assert abs(p["expert_bytes"] / 19e6 - 1) <= 0.10, p["expert_bytes"]
    assert p["experts_total"] == 19_456 and p["moe_layers"] == 76
    assert p["kv_floats_per_token_per_layer"] == 576
    assert p["indexer_keys_floats_per_token_per_layer"] == [128] * 78


def test_plan_command_on_the_real_glm52_config():
    """`colibri plan --config config.json --quant int4 --json` reports the same sizes, plus the budget split."""
    import subprocess
    import sys
    from pathlib import Path

    config = Path(__file__).parent / "data" / "glm52_config.json"
    r = subprocess.run([sys.executable, "-m", "colibri_core", "plan", "--config", str(config), "--quant", "int4",
                        "--json", "--ram", "32GB", "--disk-bw", "1GB", "--mem-bw", "50GB"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert abs(p["resident_bytes"] / 9.9e9 - 1) <= 0.15 and abs(p["expert_bytes"] / 19e6 - 1) <= 0.10
    assert p["experts_total"] == 19_456 and p["kv_floats_per_token_per_layer"] == 576
    assert p["split"]["dense"] == p["resident_bytes"] and p["floor_seconds_per_token"]["floor"] > 0


def test_mtp_layer_without_its_own_indexer(fp8_checkpoint, tmp_path):
    """index_share_for_mtp_iteration: the MTP layer's indexer tensors are not expected (a checkpoint
    that has them is refused as leftover), and the head runs on the selection it is given."""
    src, _ = fp8_checkpoint
    shared = tmp_path / "shared"
    shared.mkdir()
    for f in src.iterdir():
        (shared / f.name).symlink_to(f)
    (shared / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    (shared / "config.json").write_text(json.dumps({**cfg, "index_share_for_mtp_iteration": True}))
    from colibri_core.errors import ColibriError

    with pytest.raises(ColibriError, match=rf"model\.layers\.{N}\.self_attn\.indexer\..* that architecture glm52 does not use"):
        convert_checkpoint(shared, tmp_path / "c", "int8", progress=False)
    from colibri_glm52.model import Glm52

    layout = Glm52.layout(Glm52.parse_config({**cfg, "index_share_for_mtp_iteration": True}))
    assert not any(n.startswith(f"model.layers.{N}.self_attn.indexer") for n in layout.resident)
    assert any(n.startswith(f"model.layers.{N}.self_attn.indexer") for n in Glm52.layout(Glm52.parse_config(cfg)).resident)


def test_a_model_in_aligned_blocks_that_declared_token_exact_fails_the_kit(tmp_path, monkeypatch):
    """GLM-5.2's attention computes long forwards in query blocks aligned at BLOCK, so it does not
    declare `token_exact`; declaring it anyway fails `one_forward_is_pieces` on the odd cuts (the
    prefix cache would restore rows at a token a cold prefill computes otherwise)."""
    from test_glm52_conformance import TestTinyGlm52

    from colibri_core.testing import checks
    from colibri_core.testing.oracle import Oracle
    from colibri_glm52.model import Glm52

    oracle = Oracle(TestTinyGlm52, tmp_path)
    checks.check_one_forward_is_pieces(oracle)  # the multiples of BLOCK: the same bits
    monkeypatch.setattr(Glm52, "token_exact", True)
    with pytest.raises(checks.ConformanceFailure, match="cut at odd positions .the model declares token_exact.: the logits"):
        checks.check_one_forward_is_pieces(oracle)
