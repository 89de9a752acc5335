"""The conformance checks as plain functions of an `Oracle` (the suite's test methods call them; a
test can call them directly, e.g. on a deliberately broken plugin). Each raises `ConformanceFailure`
(an AssertionError) whose message starts with the check's name and says the layer and the position
where it applies."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import numpy as np

from .. import plugins, quant
from ..container import Container, dequantize
from ..engine import load
from ..kernels.deltanet import BLOCK
from .oracle import Oracle, edit_config, effective_lookahead, one_torch_thread
from .trace import explain


class ConformanceFailure(AssertionError):
    """A conformance check failed; the message names the check."""


class TieWarning(UserWarning):
    """A greedy token differs from the oracle's where the oracle itself is tied (reported, accepted)."""


def fail(check: str, message: str) -> None:
    raise ConformanceFailure(f"{check}: {message}")


def _common(a, b) -> int:
    """How many leading tokens a and b share."""
    d = _first_difference(a, b)
    return min(len(a), len(b)) if d is None else d


def _first_difference(a, b) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# ---- agreement with the oracle -------------------------------------------------------------------
def check_greedy(oracle: Oracle, q: str, n: int, rel_tol: float) -> list[str]:
    """The whole greedy continuation (n tokens) equals the oracle's. Where colibri's token differs,
    it is accepted as a tie only if the oracle itself cannot tell them apart at that step (its
    top-1/top-2 gap, and its preference for its own token over colibri's, both below rel_tol ×
    max|logit|); the comparison then continues teacher-forced from the oracle's token. Returns the
    ties (also printed and warned as `TieWarning`)."""
    check = f"greedy_{q}"
    expected = oracle.hf_greedy(q, n)
    prompt, P = oracle.prompt, len(oracle.prompt)
    ties: list[str] = []
    start = 0
    with load(oracle.container(q), activations="f32") as engine:
        while start < n:
            got = engine.generate(prompt + expected[:start], n - start, stop_ids=())
            d = _first_difference(got, expected[start:])
            if d is None:
                break
            i = start + d
            if d >= len(got):
                fail(check, f"position {i}: colibri stopped after {i} tokens, transformers generated {n}")
            path = prompt + expected
            ref = oracle.trace(q, path).logits[P - 1 + i]  # the oracle's logits where it chose expected[i]
            top2 = np.sort(ref)[-2:]
            gap, tol = float(top2[1] - top2[0]), rel_tol * float(np.abs(ref).max())
            behind = float(ref[expected[i]] - ref[got[d]])
            where = (f"position {i} (new token {i + 1} of {n} after the {P}-token prompt"
                     + (", teacher-forced from the oracle's tokens" if start else "") + ")")
            if not (gap < tol and behind < tol):
                earlier = f" Ties accepted before it: {'; '.join(ties)}." if ties else ""
                diagnosis = explain(oracle.engine_trace(q, path), oracle.trace(q, path), rel_tol)
                fail(check, f"{where}: colibri chose token {got[d]}, transformers {expected[i]}; the oracle's "
                            f"logit for its token is {behind:+.3g} over colibri's and its top-1/top-2 gap is "
                            f"{gap:.3g}, tolerance {tol:.3g}: not a tie.{earlier} On the oracle's tokens, {diagnosis}")
            tie = (f"position {i}: colibri {got[d]}, transformers {expected[i]} (oracle top-1/top-2 gap "
                   f"{gap:.3g} < tolerance {tol:.3g})")
            ties.append(tie)
            print(f"{check}: TIE at {tie}; continuing from the oracle's token")
            warnings.warn(f"{check}: tie at {tie}", TieWarning, stacklevel=2)
            start = i + 1
    return ties


def check_logits(oracle: Oracle, q: str, ids: list[int], rel_tol: float) -> None:
    """Teacher-forced logits within rel_tol × max|logit| of the oracle's; a failure names the first
    layer and sub-block where colibri's intermediates leave the oracle's (`trace.first_divergence`)."""
    check = f"logits_{q}"
    ref, got = oracle.trace(q, ids), oracle.engine_trace(q, ids)
    if got.logits.shape != ref.logits.shape or got.logits.dtype != np.float32:
        fail(check, f"colibri's logits are {got.logits.dtype} {got.logits.shape}, transformers' {ref.logits.shape}")
    diff = np.abs(got.logits - ref.logits)
    err, tol = float(np.nanmax(np.where(np.isnan(diff), np.inf, diff))), rel_tol * float(np.abs(ref.logits).max())
    if not err <= tol:
        position = int(np.argmax(np.where(np.isnan(diff), np.inf, diff).max(axis=1)))
        fail(check, f"max |logit difference| {err:.3g} > tolerance {tol:.3g} at position {position} of {len(ids)}; "
                    f"{explain(got, ref, rel_tol)}")


# ---- the router lookahead ------------------------------------------------------------------------
def check_lookahead_predicts_routing(oracle: Oracle, ids: list[int]) -> None:
    """Every MoE layer's declared predictor, applied to the layer's *own* residual stream, gives the
    ids the layer routed (the lookahead is the same routing, only run earlier): for every MoE layer
    the forward pass runs, every position of `ids`. Residual, token ids and routing come from the
    core's named-intermediates recording (`ffn_inp`, `ffn_moe_tokens`, `ffn_moe_ids`)."""
    check = "lookahead_predicts_routing"
    trace = oracle.engine_trace("f32", ids)
    with load(oracle.container("f32"), activations="f32") as engine:
        routers = engine.model.routers()
        layers = trace.layers("ffn_moe_ids")
        if not layers:
            fail(check, "the forward pass ran no MoE layer through MoEModel.moe")
        for layer in layers:
            routed, residual = trace.get("ffn_moe_ids", layer), trace.get("ffn_inp", layer)
            guess = routers[layer].predict(residual, trace.get("ffn_moe_tokens", layer))
            if guess is None:
                fail(check, f"layer {layer}: {type(routers[layer]).__name__}.predict returned None (cannot guess) "
                            "on its own layer's residual stream, at every position")
            guess = np.asarray(guess)
            if guess.shape != routed.shape:
                fail(check, f"layer {layer}: predict gives ids of shape {guess.shape}, the layer routed {routed.shape}")
            bad = np.nonzero((guess != routed).any(axis=1))[0]
            if len(bad):
                t = int(bad[0])
                fail(check, f"layer {layer}, position {t}: predict on the layer's own residual stream gives experts "
                            f"{guess[t].tolist()}, the layer routed {routed[t].tolist()} (best first; "
                            f"{len(bad)} of {len(routed)} positions differ)")


def check_lookahead_active(oracle: Oracle, q: str) -> dict:
    """With 1 expert slot per layer a generation issues prefetches (the lookahead really runs, and
    its recall is reported). Returns the run's stats."""
    check = f"lookahead_active_{q}"
    run = oracle.engine_run(q, 1, prefetch=True)
    s = run["stats"]
    line = (f"{check}: 1 slot per layer, prompt logits + {len(run['tokens'])} tokens: {s['prefetch_issued']} "
            f"prefetches issued, {s['prefetch_used']} used, recall {s['prefetch_recall']:.1%} "
            f"({s['expert_hits']} hits, {s['expert_misses']} misses); lookahead {run['lookahead']}")
    print(line)
    if not run["lookahead"]:
        return s  # the caller skips: no layer has a lookahead target
    if s["prefetch_issued"] <= 0:
        fail(check, f"routers and lookahead targets are declared ({run['lookahead']}), but no prefetch was issued "
                    f"at 1 slot per layer at any layer or position: {line}")
    return s


def check_prefetch_invisible(oracle: Oracle, q: str, slots=(1, 2)) -> None:
    """Prefetch on or off, at 1 and 2 slots per layer: bit-identical logits, identical tokens."""
    check = f"prefetch_invisible_{q}"
    for n in slots:
        on, off = oracle.engine_run(q, n, prefetch=True), oracle.engine_run(q, n, prefetch=False)
        if off["stats"]["prefetch_issued"]:
            fail(check, f"{n} slot(s): {off['stats']['prefetch_issued']} prefetches issued with prefetch=False")
        if not np.array_equal(on["logits"], off["logits"]):
            position = int(np.argmax((on["logits"] != off["logits"]).any(axis=1)))
            fail(check, f"{n} slot(s): logits differ with prefetch on and off, first at position {position}")
        i = _first_difference(on["tokens"], off["tokens"])
        if i is not None:
            fail(check, f"{n} slot(s): generated tokens differ with prefetch on and off at position {i}: "
                        f"{on['tokens'][i:i + 1]} vs {off['tokens'][i:i + 1]}")


# ---- the plugin contract -------------------------------------------------------------------------
def check_state_round_trip(oracle: Oracle, q: str = "int4", follow: int = 8) -> None:
    """`new_state()` is a `colibri_core.kv.State`; its `arrays()` taken mid-stream (right after the
    prompt's prefill) and `load_arrays()`-ed into a fresh state continue exactly like the original:
    same length, same tokens. (The session checks cover the same protocol through files on disk,
    after whole turns.)"""
    from ..kv import State

    check = "state_round_trip"
    prompt = oracle.prompt
    with load(oracle.container(q), activations="f32") as engine:
        state = engine.model.new_state()
        if not isinstance(state, State):
            fail(check, f"new_state() returned {type(state).__name__}, not a colibri_core.kv.State")
        if state.length != 0:
            fail(check, f"a fresh state holds {state.length} tokens")
        original = engine.new_session()
        first = engine.generate(prompt, 1, stop_ids=(), session=original)  # the prefill, and its first token
        if original.state.length != len(prompt):
            fail(check, f"after a {len(prompt)}-token prefill the state's length is {original.state.length}")
        arrays = original.state.arrays()
        odd = [k for k, v in arrays.items() if not isinstance(v, np.ndarray)]
        if odd:
            fail(check, f"arrays()[{odd[0]!r}] is a {type(arrays[odd[0]]).__name__}, not a numpy array")
        restored = engine.new_session()
        restored.state.load_arrays({k: np.array(v, copy=True) for k, v in arrays.items()})
        restored.ids = list(original.ids)
        if restored.state.length != original.state.length:
            fail(check, f"restored length {restored.state.length} != the original's {original.state.length}")
        want = engine.generate(prompt + first, follow, stop_ids=(), session=original)
        got = engine.generate(prompt + first, follow, stop_ids=(), session=restored)
    i = _first_difference(got, want)
    if i is not None:
        fail(check, f"position {len(prompt) + 1 + i} (token {i + 1} after the restored prefill): the restored state "
                    f"gives {got[i:i + 1]}, the original {want[i:i + 1]}")


def check_kv_cache_floats(oracle: Oracle, q: str = "int4") -> None:
    """`kv_cache_floats_per_token` declares the state the KV cache type applies to (`colibri plan
    --kv-cache f16` sizes it by it): each layer's part of `state_floats_per_token`, and after the same
    prompt a session's state under kv_cache="f16" holds exactly 2 bytes × tokens × Σ declared floats
    fewer than under "f32"."""
    from ..convert import read_config

    check = "kv_cache_floats"
    cls = oracle.model_class
    cfg = cls.parse_config(read_config(oracle.checkpoint))
    declared, grows = list(cls.kv_cache_floats_per_token(cfg)), list(cls.state_floats_per_token(cfg))
    if len(declared) != len(grows) or any(not 0 <= d <= g for d, g in zip(declared, grows)):
        fail(check, f"kv_cache_floats_per_token {declared} is not a part of state_floats_per_token {grows}, layer by layer")
    held = {}
    for kv in ("f32", "f16"):
        with load(oracle.container(q), kv_cache=kv) as engine:
            session = engine.new_session()
            engine.generate(oracle.prompt, 1, stop_ids=(), session=session)  # the prompt's state, and one token
            held[kv] = sum(a.nbytes for a in session.state.arrays().values())
    saved, want = held["f32"] - held["f16"], 2 * len(oracle.prompt) * sum(declared)
    if saved != want:
        fail(check, f"after a {len(oracle.prompt)}-token prompt the state holds {saved} bytes fewer under kv_cache='f16' "
                    f"than under 'f32', but kv_cache_floats_per_token {declared} says {want}: declare the floats a "
                    f"token adds to your KVCaches")


def check_short_forward_is_decode_exact(oracle: Oracle, q: str = "int4", n: int = 6) -> None:
    """A forward of n ≤ EXACT_BATCH new tokens gives, bit for bit, the logits of those tokens fed one
    at a time (drafted tokens are verified in one forward: drafting must never change a token). A
    state that can drop tokens in place (`State.truncate`, how rejected drafts are dropped) is then,
    truncated after the first of them, the state that never saw the others: same arrays, same next
    logits."""
    from ..kernels.deltanet import EXACT_BATCH

    check = "short_forward_is_decode_exact"
    ids = np.asarray(oracle.logits_ids[: len(oracle.prompt) + min(n, EXACT_BATCH)], np.int64)
    p = len(oracle.prompt)
    with load(oracle.container(q), activations="f32") as engine:
        model = engine.model
        batched, single = model.new_state(), model.new_state()
        model.forward(ids[:p], batched)
        model.forward(ids[:p], single)
        together = model.forward(ids[p:], batched)  # (n, V)
        alone = np.concatenate([model.forward(ids[t:t + 1], single) for t in range(p, len(ids))])
        for t in range(len(ids) - p):
            if not np.array_equal(together[t], alone[t]):
                fail(check, f"token {t + 1} of a {len(ids) - p}-token forward after the prompt: its logits differ from "
                            f"feeding it alone by up to {float(np.abs(together[t] - alone[t]).max()):.3g} (compute each "
                            f"query over exactly its own keys, and recurrent states token by token, for up to "
                            f"{EXACT_BATCH} tokens: see colibri_core.kernels.deltanet.EXACT_BATCH)")
        if batched.truncate(p + 1):
            never = model.new_state()
            model.forward(ids[:p + 1], never)
            a, b = batched.arrays(), never.arrays()
            differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not np.array_equal(a[k], b[k]))
            if batched.length != p + 1 or differ:
                fail(check, f"truncate({p + 1}) after a {len(ids) - p}-token forward returned True but left length "
                            f"{batched.length} and arrays {differ[:3]} unlike a state fed only {p + 1} tokens")
            nxt = ids[p + 1:p + 2]
            if not np.array_equal(model.forward(nxt, batched), model.forward(nxt, never)):
                fail(check, f"after truncate({p + 1}) the next token's logits differ from a state fed only {p + 1} tokens")


def check_one_forward_is_pieces(oracle: Oracle, q: str = "int4", chunk: int = 64) -> None:
    """One forward over a long prompt (3·chunk + 7 tokens) gives, bit for bit, the logits and the
    state of forwards cut at the multiples of `chunk` (a multiple of kernels.deltanet.BLOCK): the
    engine prefills in one forward (each MoE layer reads its experts once), and the prefix cache
    restores a state at such a multiple as if the prefill had stopped there). A model declaring
    `token_exact` gives them also for forwards cut anywhere (pieces of one token, of a few, of more
    than EXACT_BATCH across a block's end): the prefix cache then restores rows at any token and
    keeps a turn's decoded end. In both arithmetics."""
    check = "one_forward_is_pieces"
    ids = np.random.default_rng(11).integers(0, oracle.suite.hf_config.vocab_size, 3 * chunk + 7)
    for activations in ("f32", "int8"):
        with load(oracle.container(q), activations=activations) as engine:
            model = engine.model
            splits = {f"the multiples of {chunk}": [*range(0, len(ids), chunk), len(ids)]}
            if model.token_exact:
                splits["odd positions (the model declares token_exact)"] = [
                    0, 1, 2, 19, 20, 37, chunk + 37, chunk + 38, 2 * chunk + 22, 2 * chunk + 42, len(ids)]
            whole = model.new_state()
            together = model.forward(ids, whole)  # (T, V)
            for at, cuts in splits.items():
                cut = model.new_state()
                apart = np.concatenate([model.forward(ids[a:b], cut) for a, b in zip(cuts, cuts[1:])])
                where = f"{activations} activations, a {len(ids)}-token forward against forwards cut at {at}"
                differ = np.flatnonzero((together != apart).any(axis=1))
                if len(differ):
                    fail(check, f"{where}: the logits of position {int(differ[0])} differ by up to "
                                f"{float(np.abs(together - apart).max()):.3g} (compute in blocks aligned at absolute "
                                f"positions, each over the keys up to its end: colibri_core.kernels.deltanet.BLOCK; "
                                f"token_exact: each token as alone)")
                a, b = whole.arrays(), cut.arrays()
                differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not np.array_equal(a[k], b[k]))
                if differ:
                    fail(check, f"{where}: the state arrays {differ[:3]} differ after the prompt")


def check_prefix_cache_is_invisible(model_dir: Path, vocab_size: int, chunk: int = 64, new: int = 6) -> None:
    """A prompt served from the prefix cache gives, bit for bit, the tokens and logits of a cold
    prefill (the engine's `prefill_chunk` made `chunk`, so a short prompt crosses several boundaries):
    a first prompt of 3·chunk + 5 tokens; a shorter one (its state cut at 2·chunk); one extending the
    first (restored at 3·chunk, then prefilled across another boundary); one diverging from it
    mid-way (restored at chunk). A model declaring `token_exact` is restored at the token instead:
    the longest prefix a prompt shares with an earlier prompt or an earlier turn's end (its prompt and
    the tokens decoded after it, the last one never fed), if of BLOCK tokens or more. Greedy (the
    logits of the prompt's last token and of each step compared) and sampled, with the number of
    prompt tokens the cache served as the rule says, and the same drafts (a drafter reading the
    model's hidden states gets the cached prefix's back).
    Then each prompt again in an engine started afresh, the earlier ones' entries spilled to disk
    when theirs closed: every hit is read from disk, with the same bits."""
    check = "prefix_cache"
    rng = np.random.default_rng(7)
    first = rng.integers(0, vocab_size, 3 * chunk + 5).tolist()
    prompts = {  # name -> (prompt, tokens the cache should serve, after the ones before, at BLOCK's step)
        "the first prompt (nothing cached)": (first, 0),
        "a shorter prompt (rows cut at 2·chunk)": (first[: 2 * chunk + 7], 2 * chunk),
        "a prompt extending the first": (first + rng.integers(0, vocab_size, chunk + 4).tolist(), 3 * chunk),
        "a prompt diverging mid-way": (first[: chunk + 10] + rng.integers(0, vocab_size, 2 * chunk).tolist(), chunk),
    }

    def run(engine, prompt) -> dict:
        """The prompt greedy (tokens; the logits each was chosen from, (new, V); prompt tokens the
        cache served), then sampled (served from the entry the greedy call left, where cached):
        tokens and (drafted, accepted) tokens."""
        seen, forward = [], engine.model.forward

        def spy(ids, state, last_only=False):  # the last row of each forward: what the next token is chosen from
            out = forward(ids, state, last_only=last_only)
            seen.append(out[-1].copy())
            return out

        before = engine.stats()
        engine.model.forward = spy
        try:
            greedy = engine.generate(prompt, new, stop_ids=(), draft="off")
        finally:
            del engine.model.forward
        middle = engine.stats()
        sampled = engine.generate(prompt, new, temperature=1.0, seed=3, stop_ids=())
        after = engine.stats()
        return {"greedy tokens": greedy, "logits": np.stack(seen[-new:]), "sampled tokens": sampled,
                "turns": [prompt + greedy[:-1], prompt + sampled[:-1]],  # what each call's state held at its end
                "cached": middle["prefix_cached_tokens"] - before["prefix_cached_tokens"],
                "from disk": middle["prefix_cache_disk_hits"] - before["prefix_cache_disk_hits"],
                "drafts": tuple(after[k] - middle[k] for k in ("draft_drafted", "draft_accepted"))}

    def engines():
        return (load(model_dir, activations="f32", prefix_cache=0, prefill_chunk=chunk),
                load(model_dir, activations="f32", prefix_cache="1GB", prefill_chunk=chunk))

    cold, warm = engines()
    with cold, warm:
        warm.prefix_cache.clear()  # entries an earlier run left on disk: the first prompt is cold
        turns = []  # the earlier calls' states at their ends: where a token_exact model is restored
        for what, (prompt, expected) in prompts.items():
            if warm.model.token_exact:
                expected = max((_common(t, prompt[:-1]) for t in turns), default=0)
                expected = expected if expected >= BLOCK else 0  # fewer: not worth a restore
                prompts[what] = (prompt, expected)  # the same after a restart: the same turns, spilled
            want = run(cold, prompt)
            _compare_cached(check, f"{what} ({len(prompt)} tokens, prefill chunk {chunk})", want, run(warm, prompt),
                            expected)
            turns += want["turns"]
        warm.prefix_cache.clear()
    for i, (what, (prompt, expected)) in enumerate(prompts.items()):  # both engines fresh: the same drafting history
        cold, restarted = engines()
        with cold, restarted:
            want, got = run(cold, prompt), run(restarted, prompt)
            if got["from disk"] != (expected > 0):
                fail(check, f"{what}, after a restart: {got['from disk']} prompts restored from disk, not "
                            f"{int(expected > 0)}: an entry spilled when the engine closed was not found again")
            _compare_cached(check, f"{what} ({len(prompt)} tokens, prefill chunk {chunk}), after a restart (its "
                                   f"prefix read from disk)", want, got, expected)
            if i == len(prompts) - 1:
                restarted.prefix_cache.clear()  # the model directory as it was


def check_batch_equals_solo(model_dir: Path, vocab_size: int, chunk: int = 64, new: int = 8) -> None:
    """Three generations decoded together (`engine.batch`, colibri_core/batch.py) get, bit for bit, the
    tokens and the final states they get alone: prompts of 5, 2·chunk + 9 and 23 tokens (the long one
    prefilled in chunks while the others decode: the engine's `prefill_chunk` made `chunk`), one
    greedy with the model's drafts (an MTP head's: verified several tokens a forward), one sampled at
    temperature 1, one with top-k and top-p, the third joining a step later.
    Every dense product, attention block and MoE layer of a step runs once for all of them, their
    rows stacked: each row's bits must not depend on the others (the reduction-order contract)."""
    check = "batch_equals_solo"
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in (5, 2 * chunk + 9, 23)]
    sampling = [dict(draft="auto"), dict(temperature=1.0, seed=3, draft="off"),
                dict(temperature=0.8, top_k=5, top_p=0.9, seed=11, draft="off")]
    with load(model_dir, activations="f32", prefix_cache=0, prefill_chunk=chunk) as engine:
        alone = []
        for prompt, how in zip(prompts, sampling):
            session = engine.new_session()
            tokens = engine.generate(prompt, new, stop_ids=(), session=session, **how)
            alone.append((tokens, session.state.arrays()))
        sessions = [engine.new_session() for _ in prompts]
        with engine.batch() as batch:
            runs = [batch.add(p, new, stop_ids=(), session=s, **how) for p, s, how in list(zip(prompts, sessions, sampling))[:2]]
            batch.step()  # the first two's first forwards (the long prompt's first chunk)
            runs.append(batch.add(prompts[2], new, stop_ids=(), session=sessions[2], **sampling[2]))
            while batch.running():
                batch.step()
    for i, (run, session, (tokens, arrays)) in enumerate(zip(runs, sessions, alone)):
        what = f"generation {i} of 3 ({len(prompts[i])}-token prompt, {sampling[i] or 'greedy'})"
        if run.error is not None:
            fail(check, f"{what} failed in the batch: {type(run.error).__name__}: {run.error}")
        d = _first_difference(run.tokens, tokens)
        if d is not None:
            fail(check, f"{what}: token {d} differs from the same generation alone ({run.tokens} against {tokens}): "
                        f"a forward's rows must not depend on the other generations' rows beside them")
        got = session.state.arrays()
        differ = sorted(k for k in arrays.keys() | got.keys() if k not in got or k not in arrays
                        or not np.array_equal(arrays[k], got[k]))
        if differ:
            fail(check, f"{what}: the state arrays {differ[:3]} differ from the same generation's alone")


def _compare_cached(check: str, what: str, want: dict, got: dict, expected: int) -> None:
    """Fail `check` where a call served from the prefix cache (`got`) differs from the cold one."""
    if got["cached"] != expected:
        fail(check, f"{what}: the cache served {got['cached']} of its tokens, the rule says {expected}")
    for name in ("greedy tokens", "sampled tokens"):
        i = _first_difference(got[name], want[name])
        if i is not None:
            fail(check, f"{what}: {name} differ from a cold prefill's at new token {i}: "
                        f"{got[name][i:i + 1]} vs {want[name][i:i + 1]}")
    differ = np.flatnonzero((got["logits"] != want["logits"]).any(axis=1))
    if len(differ):
        fail(check, f"{what}: the logits of new token {int(differ[0])} differ from a cold prefill's by up to "
                    f"{float(np.abs(got['logits'] - want['logits']).max()):.3g}")
    if got["drafts"] != want["drafts"]:
        fail(check, f"{what}, sampled again from the cache: {got['drafts']} tokens (drafted, accepted), after a "
                    f"cold prefill {want['drafts']}: a drafter did not get the cached prefix's hidden states")


def check_moe_layers(oracle: Oracle, ids: list[int]) -> None:
    """The MoE layers agree everywhere they are declared (`check_moe_layers_of` on the f32 container),
    and the forward pass runs exactly the layers where transformers' model routes: its routers,
    found through the routers the plugin declares (`trace.find_routers`: each Router's ``weight`` is
    one parameter of transformers' model, in the decoder layer of the same index). A declared router
    not found there, or one that returns no routing, fails: its routing could not be compared."""
    ref = oracle.trace("f32", ids)
    if ref.uncompared:  # never a pass where routing was not compared
        layer = min(ref.uncompared)
        fail("moe_layers", f"layer {layer}: transformers' routing cannot be compared: {ref.uncompared[layer]} "
             "(colibri_core/testing/trace.py; declare unsupported={'moe_layers': why} if the model cannot give it)")
    if not ref.layers("ffn_moe_ids"):
        fail("moe_layers", "routers() declares no router, so the kit cannot check which layers route")
    check_moe_layers_of(oracle.container("f32"), ids, ref.n_layers, ref.layers("ffn_moe_ids"),
                        oracle.engine_trace("f32", ids))


def check_moe_layers_of(model_dir: Path, ids: list[int], main_layers: int, oracle_routed: list[int] | None = None,
                        trace=None) -> None:
    """The MoE layers of the model in `model_dir` (a converted container) agree everywhere:

    - `routers()` declares exactly `layout.moe_layers`, in the same order (the order the forward
      pass runs them: the default lookahead predicts each router's successor);
    - the forward pass (on `ids`) runs each MoE layer at most once, in that order, and, given
      `oracle_routed`, exactly the layers transformers routes in;
    - a layout layer the forward pass does not run must lie beyond the main decoder stack (index ≥
      `main_layers`): a layer only a draft head runs, like GLM-5.2's MTP layer (in
      `layout.moe_layers` and `routers()`, run by `mtp_forward`, never by `forward`);
    - the lookahead (`lookahead()`, default: each router's successor) maps MoE layers to MoE layers
      the forward pass runs *later*: predicting a layer it never runs (a draft-only layer) reads
      experts for nothing, predicting an earlier one is too late to help.
    """
    from .trace import engine_trace

    check = "moe_layers"
    with load(model_dir, activations="f32") as engine:
        layout = list(engine.container.moe_layers)  # the converter wrote the layout's
        declared = list(engine.model.routers())
        lookahead = effective_lookahead(engine.model)
    if declared != layout:
        extra, missing = sorted(set(declared) - set(layout)), sorted(set(layout) - set(declared))
        what = (f"layer {extra[0]} has a router but is not in layout.moe_layers" if extra else
                f"layer {missing[0]} is in layout.moe_layers but has no router" if missing else "the order differs")
        fail(check, f"routers() declares layers {declared}, layout.moe_layers is {layout}: {what}")
    trace = trace if trace is not None else engine_trace(model_dir, ids)
    calls = [layer for name, layer in trace.calls if name == "ffn_moe_ids"]
    run = list(dict.fromkeys(calls))
    twice = [layer for layer in run if calls.count(layer) > 1]
    if twice:
        fail(check, f"layer {twice[0]}: the forward pass ran its MoE {calls.count(twice[0])} times in one pass")
    unknown = [layer for layer in run if layer not in declared]
    if unknown:
        fail(check, f"layer {unknown[0]}: the forward pass ran a MoE layer routers() does not declare")
    if run != [layer for layer in declared if layer in run]:
        fail(check, f"the forward pass runs MoE layers in the order {run}, routers() declares {declared}")
    if oracle_routed is not None and run != list(oracle_routed):
        odd = sorted(set(run) ^ set(oracle_routed))
        fail(check, f"layer {odd[0] if odd else run[0]}: the forward pass runs MoE layers {run}, transformers' model "
                    f"routes in {list(oracle_routed)}")
    for layer in declared:
        if layer not in run and layer < main_layers:
            fail(check, f"layer {layer} is in layout.moe_layers and within the {main_layers} decoder layers, but "
                        "the forward pass never runs its MoE")
    for src, dst in lookahead.items():
        if src not in declared or dst not in declared:
            fail(check, f"lookahead {src} → {dst}: layer {src if src not in declared else dst} is not a MoE layer")
        if dst not in run:
            fail(check, f"layer {src}'s lookahead predicts layer {dst}, which the forward pass does not run "
                        "(a draft-only layer): its prefetches would be read for nothing")
        if src in run and run.index(dst) <= run.index(src):
            fail(check, f"layer {src}'s lookahead predicts layer {dst}, which the forward pass runs before it")


def check_config_variant(oracle: Oracle, name: str, edits, work: Path, rel_tol: float) -> None:
    """A released-style config.json (the oracle's config with `edits`) describes the same model:
    transformers computes the same logits from it; the plugin resolves it to the same architecture
    and parses it to an equal config dataclass and layout; the checkpoint with that config.json
    converts (f32) and loads, and computes bit-identical logits to the base container."""
    import torch
    from transformers import AutoModelForCausalLM

    check = f"config_variant[{name}]"
    base = json.loads((oracle.checkpoint / "config.json").read_text())
    variant = edit_config(base, edits)
    if variant == base:
        fail(check, "the variant does not change config.json")
    registry = plugins.registry()
    arch, want = registry.resolve(variant), registry.resolve(base)
    if arch.name != want.name:
        fail(check, f"resolves to architecture {arch.name} ({arch.plugin}), the base config to {want.name}")
    cls = oracle.model_class
    got_cfg, want_cfg = cls.parse_config(variant), cls.parse_config(base)
    if got_cfg != want_cfg:
        if dataclasses.is_dataclass(want_cfg):
            diffs = [f"{f.name}={getattr(got_cfg, f.name)!r} (base {getattr(want_cfg, f.name)!r})"
                     for f in dataclasses.fields(want_cfg) if getattr(got_cfg, f.name) != getattr(want_cfg, f.name)]
        else:
            diffs = [f"{got_cfg!r} != {want_cfg!r}"]
        fail(check, f"parse_config differs from the base config's: {', '.join(diffs)}")
    if cls.layout(got_cfg) != cls.layout(want_cfg):
        fail(check, "the layout differs from the base config's")
    src = work / name
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(variant, indent=2))
    for f in oracle.checkpoint.iterdir():
        if f.name != "config.json":
            os.symlink(f, src / f.name)
    with one_torch_thread(), torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32).eval()
        logits = hf(torch.tensor([oracle.prompt])).logits[0].float().numpy()
    ref = oracle.trace("f32", oracle.prompt).logits
    err, tol = float(np.abs(logits - ref).max()), rel_tol * float(np.abs(ref).max())
    if not err <= tol:
        fail(check, f"transformers reads the variant as another model: its logits differ by {err:.3g} > {tol:.3g} "
                    "(the variant is not the same model; fix the variant)")
    dst = work / f"{name}-f32"
    oracle.convert(src, dst, "f32")
    with load(dst, activations="f32") as engine:
        got = engine.logits(oracle.prompt)
    if not np.array_equal(got, oracle.engine_trace("f32", oracle.prompt).logits):
        fail(check, "the container converted from the variant computes other logits than the base container")


# ---- the container -------------------------------------------------------------------------------
def check_container_round_trip(oracle: Oracle, q: str, work: Path) -> None:
    """Each checkpoint the oracle saved that the layout reads — transformers' save (per-expert 2-D
    matrices, for most models) and its fused save ((E, 2I, H) gate_up, (E, H, I) down), or the fused
    save alone where the layout names the experts only fused — converts at q and dequantises back to
    its own tensors: every tensor held under a name of the checkpoint is its quantise-dequantise at q
    (exact at f32 and for the float32 resident tensors; quantisation is per row, so a fused (E, R, C)
    tensor round-trips as its E·R rows), and the suite's checkpoint (`oracle.checkpoint`) gives
    exactly its tensors, less those the layout ignores (the other save may hold resident tensors
    under names the layout reads as `aliases`). Converted from either, the containers hold the same
    resident tensors, as many weights, and compute bit-identical logits."""
    from safetensors import safe_open

    check = "container_round_trip"
    held = {}  # checkpoint → (container, its tensors dequantised)
    for src in dict.fromkeys((oracle.checkpoint, oracle.fused_checkpoint)):
        if src == oracle.checkpoint:
            dst = oracle.container(q)
        else:
            dst = work / src.name
            oracle.convert(src, dst, q)
        source = {}
        for f in sorted(src.glob("*.safetensors")):
            with safe_open(f, "np") as st:
                source.update({k: st.get_tensor(k) for k in st.keys()})
        got = dequantize(dst)
        want = {k for k in source if not oracle.layout.ignored(k)}
        if src == oracle.checkpoint and set(got) != want:
            fail(check, f"at {q}, from {src.name}/: tensors only in the container {sorted(set(got) - want)[:5]}, "
                        f"only in the checkpoint {sorted(want - set(got))[:5]}")
        for name in sorted(got.keys() & want):
            w, s = got[name], source[name]
            exact = q == "f32" or (name in oracle.layout.resident and oracle.layout.stays_f32(name, s.ndim))
            # a fused expert tensor's rows are its experts' rows; stored transposed (x @ W), its columns are
            turned = s.ndim == 3 and name not in oracle.layout.resident and oracle.layout.experts.fused_transposed
            m = np.swapaxes(s, 1, 2) if turned else s
            rows = m.reshape(-1, m.shape[-1])  # (·, C)
            back = quant.dequantize(quant.quantize(rows, q)).reshape(m.shape)
            expect = s if exact else np.swapaxes(back, 1, 2) if turned else back
            if not np.array_equal(w, expect.astype(np.float32)):
                fail(check, f"at {q}, from {src.name}/: {name} {list(s.shape)} differs after the round trip by up to "
                            f"{float(np.abs(w - expect).max()):.3g}")
        held[src] = dst, got
    if len(held) == 2:
        (a, got_a), (b, got_b) = held.values()
        both = f"at {q}, the containers converted from {' and '.join(f'{src.name}/' for src in held)}"
        with Container(a) as ca, Container(b) as cb:
            if ca.resident().keys() != cb.resident().keys():
                fail(check, f"{both} hold other resident tensors")
        if sum(v.size for v in got_a.values()) != sum(v.size for v in got_b.values()):
            fail(check, f"{both} hold other numbers of weights")
        with load(a, activations="f32") as ea, load(b, activations="f32") as eb:
            if not np.array_equal(ea.logits(oracle.prompt), eb.logits(oracle.prompt)):
                fail(check, f"{both} compute other logits")
