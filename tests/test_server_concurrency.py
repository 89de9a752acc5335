"""The engine has one owner, the generation worker: `/metrics`, `/api/stats` and `/api/brain`,
hammered from several threads while generations run and the hot-store is revised after each turn,
always answer 200, and each answer is one consistent moment (the snapshot the worker publishes
between two tokens), never a picture torn mid-pass.
"""
import json
import shutil
import threading
import time

import pytest

from colibri_core import load
from colibri_core.store.usage import MIN_HISTORY_TOKENS
from live_server import LiveServer, get, post

pytestmark = pytest.mark.system  # seconds of hammering

SECONDS = 4  # of hammering: a bound on the test's time, not a performance assertion
POLLERS = 4
PATHS = ("/metrics", "/api/stats", "/api/brain")


def pinning_model(tiny_model, tmp_path):
    """A copy of the tiny model with enough routing history for the hot-store, and the serve options
    for 8 of its 16 experts: 4 pinned (revised after every turn; asked for, since the share the
    history would choose depends on the workload), 2 cache slots per layer."""
    model = tmp_path / tiny_model.name
    shutil.copytree(tiny_model, model)
    with load(model, cache_slots=8) as engine:
        prompt = engine.tokenizer.encode("the quick brown fox")
        while engine.store.usage.tokens < MIN_HISTORY_TOKENS:
            engine.generate(prompt, 16, temperature=1.0, seed=engine.store.usage.tokens, stop_ids=())
        nbytes = engine.container.expert_nbytes
        options = ("--ram", str(engine.resident_bytes + 8 * nbytes), "--pin-gb", str(4 * nbytes / 1e9))
    return model, options


def generate_until(url: str, deadline: float, done: list) -> None:
    """Short sampled completions, one after another: many turns, so many hot-store revisions."""
    seed = 0
    while time.monotonic() < deadline:
        seed += 1
        body = {"prompt": ["the quick brown fox", "colibri streams experts", "a"][seed % 3], "max_tokens": 6,
                "temperature": 1.0, "seed": seed, "ignore_eos": True}
        status, _, raw = post(url + "/v1/completions", body)
        done.append((status, raw))


def poll_until(url: str, deadline: float, answers: list) -> None:
    while time.monotonic() < deadline:
        for path in PATHS:
            status, body = get(url + path)
            answers.append((path, status, body))


def test_engine_reads_during_generations_are_consistent(tiny_model, tmp_path):
    model, options = pinning_model(tiny_model, tmp_path)
    server = LiveServer("serve", model, *options)
    try:
        stats = server.json("/api/stats")["engine"]
        assert stats["pin_capacity"] == 4 and stats["cache_slots_per_layer"] == 2, stats
        assert post(server.url + "/v1/completions", {"prompt": "a", "max_tokens": 4})[0] == 200  # a generation has run
        deadline = time.monotonic() + SECONDS
        generated: list = []
        answers: list = []
        threads = [threading.Thread(target=generate_until, args=(server.url, deadline, generated))]
        threads += [threading.Thread(target=poll_until, args=(server.url, deadline, answers)) for _ in range(POLLERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SECONDS + 120)
    finally:
        rc = server.stop()
    assert rc == 130 and "Traceback" not in server.text_log(), server.text_log()
    assert generated and all(status == 200 for status, _ in generated), generated[:3]
    failed = [(path, status, body[:300]) for path, status, body in answers if status != 200]
    assert not failed, f"{len(failed)} of {len(answers)} answers were not 200: {failed[:3]}"

    brains = [json.loads(body) for path, _, body in answers if path == "/api/brain"]
    passes = {b["passes"] for b in brains}
    assert len(passes) >= 5, f"the polls never overlapped the generations: passes {sorted(passes)}"
    for b in brains:
        assert sum(map(sum, b["heat"])) > 0 and any(t.strip("0") for t in b["tiers"]), b  # never empty
        # every pass routes each token to top-k experts in every MoE layer: equal totals, unless
        # the picture was read between two layers of a pass
        assert len({sum(h) for h in b["heat"]}) == 1, f"heat torn mid-pass: {[sum(h) for h in b['heat']]}"
        assert all(len(latest) == 2 for latest in b["latest"]), b["latest"]
        assert sum(t.count("2") for t in b["tiers"]) <= 4 and all(t.count("1") <= 2 for t in b["tiers"]), b["tiers"]
    for path, _, body in answers:
        if path == "/api/stats":
            s = json.loads(body)
            assert s["memory"]["experts"]["pinned"] <= 4 and s["memory"]["experts"]["cached"] <= 2 * 2, s["memory"]
