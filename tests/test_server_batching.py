"""`colibri serve --parallel N`: concurrent requests decode together (server/worker.py over the
engine's batch), each answered with the very text it gets alone, whatever runs beside it; a client
that leaves mid-answer frees its place; the dashboard's stats show every running request."""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from live_server import LiveServer, Stream, post_json


@pytest.fixture(scope="module")
def server(tiny_model):
    s = LiveServer("serve", tiny_model, "--parallel", "3", "--queue", "8")
    yield s
    s.stop()
    assert "Traceback" not in s.text_log() and "internal error" not in s.text_log(), s.text_log()


REQUESTS = [  # different prompts, lengths and samplers
    {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0},
    {"prompt": "colibri streams experts " * 30, "max_tokens": 12, "temperature": 1.0, "seed": 7},
    {"prompt": "a", "max_tokens": 30, "temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 3},
    {"prompt": "the lazy dog", "max_tokens": 16, "temperature": 1.0, "seed": 11, "stop": ["o"]},
]


def ask(server, body) -> dict:
    status, answer = post_json(server.url + "/v1/completions", {**body, "ignore_eos": True})
    assert status == 200, answer
    return answer


def test_concurrent_requests_get_what_they_get_alone(server):
    alone = [ask(server, body)["choices"][0]["text"] for body in REQUESTS]
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = [a["choices"][0]["text"] for a in pool.map(lambda b: ask(server, b), REQUESTS * 2)]
    assert together == alone * 2
    turns = server.json("/api/stats")["turns"][-2 * len(REQUESTS):]
    assert max(t["concurrent"] for t in turns) >= 2  # they did run together


def test_a_client_leaving_frees_its_place_and_spares_the_others(server):
    body = {"prompt": "the quick brown fox", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    leaving = [Stream(server.url + "/v1/completions", body) for _ in range(2)]
    for s in leaving:
        next(s.events())  # both run
    alone = ask(server, REQUESTS[0])["choices"][0]["text"]  # the third place
    running = server.json("/api/stats")["running"]
    assert len(running) == 2 and all(r["tokens"] >= 1 for r in running)
    for s in leaving:
        s.close()
    deadline = time.monotonic() + 30
    while server.json("/api/stats")["running"]:
        assert time.monotonic() < deadline, "the cancelled generations still run"
        time.sleep(0.02)
    assert ask(server, REQUESTS[0])["choices"][0]["text"] == alone
    finishes = [t["finish_reason"] for t in server.json("/api/stats")["turns"][-4:]]
    assert finishes.count("cancelled") == 2
