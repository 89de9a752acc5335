"""Kimi K3 against its float64 NumPy reference (kimi_k3_reference.py), on a tiny config that uses every
part: 4 KDA layers with the −5 lower-bounded decay and a full-rank output gate, 2 gated NoPE MLA
layers with a q_lora query, attention residuals in blocks of 2 layers, a dense SiTU layer 0, a latent
MoE (8 experts top-3 on a 32-wide latent, 2 shared experts) — a 70-token prompt (longer than the
64-token chunk of the reference implementations' KDA), then decoding token by token, with the state saved
and restored mid-stream. Logits within 1e-4 · max|logit| at every position, identical greedy tokens.
"""
import numpy as np
import pytest
from kimi_k3_reference import TINY_K3, Reference, random_weights, save_checkpoint

from colibri_core import dequantize, load
from colibri_core.convert import convert_checkpoint

PROMPT, NEW = 70, 10
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The tiny K3: its weights, checkpoint (2 shards), f32 container, the prompt and the reference."""
    root = tmp_path_factory.mktemp("k3")
    weights = random_weights(TINY_K3, seed=0)
    save_checkpoint(root / "hf", TINY_K3, weights, shards=2)
    convert_checkpoint(root / "hf", root / "f32", "f32", progress=False)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, TINY_K3["vocab_size"], PROMPT)]
    return {"root": root, "weights": weights, "prompt": prompt, "ref": Reference(TINY_K3, weights)}


def decode(engine, prompt, n, restore_at=None):
    """Greedy: prefill `prompt`, then n tokens one forward each; the state is flattened with arrays()
    and restored into a fresh state after `restore_at` new tokens. Returns (tokens, logits of every
    position (len(prompt) + n − 1, V))."""
    model = engine.model
    state = model.new_state()
    rows = [model.forward(np.asarray(prompt, np.int64), state)]
    tokens = [int(rows[-1][-1].argmax())]
    for step in range(1, n):
        if step == restore_at:
            arrays = {k: v.copy() for k, v in state.arrays().items()}
            state = model.new_state()
            state.load_arrays(arrays)
        rows.append(model.forward(np.asarray(tokens[-1:], np.int64), state))
        tokens.append(int(rows[-1][-1].argmax()))
    return tokens, np.concatenate(rows)


def check_against_reference(ref: Reference, ids: list[int], got: np.ndarray, tokens: list[int], what: str):
    want = ref.logits(ids)  # (T, V) float64, teacher-forced on the engine's own continuation
    tol = REL_TOL * np.abs(want).max()
    err = np.abs(got - want).max(axis=-1)
    assert err.max() <= tol, f"{what}: max |logit difference| {err.max():.3g} > {tol:.3g} at position {err.argmax()}"
    for step, token in enumerate(tokens):  # each greedy token is the reference's, unless the reference ties
        row = want[len(ids) - len(tokens) + step]  # the position that predicted it
        top2 = np.sort(row)[-2:]
        assert token == row.argmax() or top2[1] - top2[0] < tol, f"{what}: greedy token {step} differs"
    return want


def test_engine_matches_the_reference_prefill_and_decode(k3):
    with load(k3["root"] / "f32", activations="f32") as engine:
        assert engine.arch.name == "kimi_k3"
        tokens, got = decode(engine, k3["prompt"], NEW)
    check_against_reference(k3["ref"], k3["prompt"] + tokens[:-1], got, tokens, "prefill + decode")


def test_save_restore_mid_stream_is_token_identical(k3):
    with load(k3["root"] / "f32", activations="f32") as engine:
        straight = decode(engine, k3["prompt"], NEW)
        restored = decode(engine, k3["prompt"], NEW, restore_at=4)
        assert restored[0] == straight[0]
        assert np.array_equal(restored[1], straight[1])
        arrays = engine.model.new_state().arrays()
        kinds = {k.rsplit(".", 1)[-1] for k in arrays}
        assert kinds == {"length", "conv", "recurrent", "latent", "k_rope"}
        # a session's arrays restored into a fresh one continue exactly as the session itself
        session = engine.new_session()
        assert engine.generate(k3["prompt"], 4, session=session, stop_ids=()) == straight[0][:4]
        again = engine.new_session()
        again.state.load_arrays({k: v.copy() for k, v in session.state.arrays().items()})
        again.ids = list(session.ids)
        follow = session.ids + [5, 6, 7]
        assert engine.generate(follow, 6, session=session, stop_ids=()) == \
            engine.generate(follow, 6, session=again, stop_ids=())


def test_routing_and_reference_agree(k3):
    """The engine's routing (recorded by the core's MoE block) is the reference's, bar near ties, and
    each router's prediction from its layer's own input is exactly its routing."""
    from colibri_core import probe

    ids = k3["prompt"]
    ref = k3["ref"]
    ref.logits(ids)
    with load(k3["root"] / "f32", activations="f32") as engine, probe.recording() as rec:
        engine.logits(ids)
        routers = engine.model.routers()
    assert list(routers) == [1, 2, 3, 4, 5]
    for layer, (want, choice) in ref.routing.items():
        got = rec.tensors[("ffn_moe_ids", layer)][-1]
        # the lookahead's predictor on the layer's own input (the mixed residual) is its routing
        predicted = routers[layer].predict(rec.tensors[("ffn_inp", layer)][-1], np.asarray(ids))
        assert np.array_equal(predicted, got)
        k = want.shape[1]
        margin = np.sort(choice, axis=-1)[:, ::-1]
        clear = (margin[:, k - 1] - margin[:, k]) > 1e-5
        assert clear.mean() > 0.9
        assert all(set(got[t]) == set(want[t]) for t in np.flatnonzero(clear)), f"layer {layer} routes otherwise"


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_quantised_containers_place_invisibly(k3, q):
    """At int8 / int4 the routed experts (SiTU, on the latent) run from the store: 1 slot per layer or
    all of them, lookahead on or off, give the same bits, and the reference agrees when given the
    container's dequantised weights (quantisation error is not a bug: the tiny random K3, with its
    std-1 residual projections, amplifies it)."""
    dst = k3["root"] / q
    if not dst.exists():
        convert_checkpoint(k3["root"] / "hf", dst, q, progress=False)
    prompt = k3["prompt"][:20]
    runs = []
    for slots, prefetch in ((TINY_K3["num_experts"], True), (1, True), (1, False)):
        with load(dst, cache_slots=slots, prefetch=prefetch, activations="f32") as engine:
            runs.append((engine.logits(prompt), engine.generate(prompt, 6, stop_ids=()), engine.stats()))
    for logits, tokens, _ in runs[1:]:
        assert np.array_equal(logits, runs[0][0]) and tokens == runs[0][1]
    assert runs[1][2]["prefetch_issued"] > 0
    # and they compute what the reference computes with the container's (dequantised) weights
    want = Reference(TINY_K3, dequantize(dst)).logits(prompt)
    assert np.abs(runs[0][0] - want).max() <= REL_TOL * np.abs(want).max()


def test_official_mxfp4_checkpoint_runs_without_conversion(k3, tmp_path):
    """The official layout — `language_model.` names, config under text_config, routed experts as MXFP4
    (`w{1,2,3}.weight_packed` U8 E2M1 pairs, low nibble the even column + `weight_scale` U8 UE8M0 per 32
    columns), an expert's six tensors contiguous in one of two shards, not in id order — loads with no
    conversion (the experts stay fp4; each read is its tensors' extent) and matches the reference
    given the same (MXFP4-rounded) weights, prefill and decode; `colibri convert` reads it too."""
    from safetensors import safe_open

    held = save_checkpoint(tmp_path / "official", TINY_K3, k3["weights"], mxfp4=True, shards=2)
    with safe_open(tmp_path / "official" / "model-00001-of-00002.safetensors", "np") as f:
        packed = [n for n in f.keys() if n.endswith("w1.weight_packed")]
        assert packed and f.get_tensor(packed[0]).dtype == np.uint8
    with load(tmp_path / "official", activations="f32") as engine:
        assert type(engine.container).__name__ == "NativeCheckpoint"
        gate, up, down = engine.container.read_expert(TINY_K3["first_k_dense_replace"], 3)
        assert gate.kind == up.kind == down.kind == "fp4"
        name = "language_model.model.layers.1.block_sparse_moe.experts.3.w{}.weight"
        for t, w in ((gate, 1), (up, 3), (down, 2)):
            assert np.array_equal(dequantize_qtensor(t), held[name.format(w)])  # E2M1 × 2^(s−127), bit for bit
        tokens, got = decode(engine, k3["prompt"], NEW, restore_at=5)
    ref = Reference(TINY_K3, held)
    check_against_reference(ref, k3["prompt"] + tokens[:-1], got, tokens, "MXFP4 checkpoint")
    # converting the release reads the MXFP4 experts too: at f32 they are the values written, exactly
    convert_checkpoint(tmp_path / "official", tmp_path / "f32", "f32", progress=False)
    stored = dequantize(tmp_path / "f32")
    as_stored = lambda n: n.replace(".weight", ".weight_packed") if ".experts." in n else n  # noqa: E731
    assert all(np.array_equal(stored[as_stored(n)], w) for n, w in held.items())
    with load(tmp_path / "f32", activations="f32") as engine:
        tokens32, got32 = decode(engine, k3["prompt"], 4)
    assert tokens32 == tokens[:4]
    assert np.abs(got32 - got[: len(got32)]).max() <= REL_TOL * np.abs(got).max()


def dequantize_qtensor(t):
    from colibri_core import quant

    return quant.dequantize(t)


def test_plan_of_the_official_config():
    """`colibri plan --config` on the flagship's shape, as released (native: MXFP4 experts): one expert
    is 17,547,264 bytes, the KDA state ≈ 445 MiB fixed, 576 floats per token per MLA layer."""
    import json
    import subprocess
    import sys

    from kimi_k3_reference import K3_FLAGSHIP, k3_config

    from colibri_core.planning import plan_config

    config = k3_config(**K3_FLAGSHIP)
    p = subprocess.run([sys.executable, "-m", "colibri_core", "plan", "--config", "/dev/stdin", "--quant", "native",
                        "--json", "--disk-bw", "2GB", "--mem-bw", "20GB", "--ram", "512GB"],
                       input=json.dumps(config), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    native, int4 = json.loads(p.stdout), plan_config(config, "int4")
    assert native["moe_layers"] == 92 and native["top_k"] == 16
    assert native["expert_bytes"] == 17_547_264  # the official MXFP4 expert: six tensors, data + scales
    assert native["experts_total"] == 92 * 896 and native["experts_total_bytes"] == 92 * 896 * 17_547_264
    kda_state = 3 * 3 * 12288 + 96 * 128 * 128  # conv window (K−1, 3·12288) + S (96, 128, 128), float32
    assert native["fixed_state_bytes"] == 69 * 4 * kda_state  # ≈ 443 MiB
    assert native["state_bytes_per_token"] == 24 * 576 * 4  # the MLA latent + shared key, 24 layers
    resident_params = native["resident_bytes"] / 4  # float32 in RAM
    expert_params = 3 * 3072 * 3584
    assert abs(resident_params + 16 * 92 * expert_params - 104e9) < 0.03 * 104e9  # 104B active
    assert abs(resident_params + 92 * 896 * expert_params - 2.8e12) < 0.03 * 2.8e12  # 2.8T total
    assert int4["experts_total_bytes"] < native["experts_total_bytes"] * 1.2  # int4 containers are no bigger
