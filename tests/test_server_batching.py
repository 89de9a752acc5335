"""`colibri serve --parallel N`: concurrent requests decode together (server/worker.py over the
engine's batch), each answered with the very text it gets alone, whatever runs beside it; a client
that leaves mid-answer frees its place; the dashboard's stats show every running request."""
import json
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


# ---- OpenAI's `n`: several choices of one prompt, a batch sharing the prompt's cached prefix ----------
PROMPT = "colibri streams experts " * 30  # over 64 tokens: the prefix cache keeps its state


def test_n_choices_are_what_each_gets_alone_and_share_the_prompt(server):
    """Choice i of a seeded request is the request with seed + i alone; the choices after the first
    start from the first's prompt state in the prefix cache; usage counts the prompt once."""
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5}
    alone = [ask(server, {**body, "seed": 5 + i})["choices"][0]["text"] for i in range(3)]
    greedy = ask(server, {**body, "temperature": 0})["choices"][0]["text"]
    hits = server.json("/api/stats")["engine"]["prefix_cache_hits"]
    answer = ask(server, {**body, "prompt": "a hummingbird hovers " * 30, "n": 3})  # a new prompt: only its first choice prefills it
    stats = server.json("/api/stats")
    n = answer["usage"]["prompt_tokens"]
    assert stats["engine"]["prefix_cache_hits"] == hits + 2
    assert sorted(t["cached_tokens"] for t in stats["turns"][-3:]) == [0, n - 1, n - 1]  # the first: no earlier prompt shares 64
    answer = ask(server, {**body, "n": 3})
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == alone
    one = ask(server, body)["usage"]
    assert answer["usage"]["prompt_tokens"] == one["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == sum(ask(server, {**body, "seed": 5 + i})["usage"]["completion_tokens"]
                                                       for i in range(3))
    greedy_n = ask(server, {**body, "temperature": 0, "n": 2})
    assert [c["text"] for c in greedy_n["choices"]] == [greedy, greedy]


def test_n_choices_stream_each_under_its_index(server, tiny_model):
    """A streamed chat with n=2: each chunk carries one choice's delta under its index, each choice
    ends with its own finish_reason, usage comes once at the end, and each choice's text is the
    non-streamed answer's."""
    body = {"messages": [{"role": "user", "content": "tell me about colibri"}], "max_tokens": 8, "temperature": 0.9,
            "seed": 1, "n": 2}
    status, whole = post_json(server.url + "/v1/chat/completions", body)
    assert status == 200, whole
    stream = Stream(server.url + "/v1/chat/completions",
                    {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for data in stream.events():
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk["usage"] is not None:
            usage = chunk["usage"]
            continue
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    stream.close()
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert usage == whole["usage"]


def test_n_beyond_what_the_server_holds_is_refused_by_name(server):
    status, answer = post_json(server.url + "/v1/completions", {"prompt": "a", "max_tokens": 2, "n": 8})
    assert status == 200 and len(answer["choices"]) == 8  # 3 places + 8 in the queue
    for n in (0, 9):
        status, answer = post_json(server.url + "/v1/completions", {"prompt": "a", "max_tokens": 2, "n": n})
        assert status == 400 and answer["error"]["param"] == "n", answer
    # more choices than places (--parallel + --queue) could never be admitted together: a 400, not a 429
    import asyncio
    from types import SimpleNamespace

    from colibri_core.server.app import _choices
    from colibri_core.server.schemas import ApiError
    small = SimpleNamespace(cfg=SimpleNamespace(parallel=1, max_queue=2))
    with pytest.raises(ApiError) as e:
        asyncio.run(_choices(small, None, 4, None))
    assert e.value.status == 400 and "--parallel plus --queue" in str(e.value)
