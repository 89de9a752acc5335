"""`colibri serve`: a live server on loopback, driven with the official `openai` client.

One server process for the module (queue of 4 waiting requests). Every check that the server
generates the right thing compares it with the engine run directly in this process.
"""
import json
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from colibri_core import load
from colibri_core.chat_template import ChatTemplate
from colibri_core.tokenizer import Tokenizer
from conftest import colibri
from live_server import LiveServer, Stream, get, post, post_json

QUEUE = 4
PARALLEL = 2  # requests decoded together
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def server(tiny_model):
    s = LiveServer("serve", tiny_model, "--queue", str(QUEUE), "--parallel", str(PARALLEL))
    yield s
    rc = s.stop()
    assert rc == 130, s.text_log()  # stopped by Ctrl-C (SIGINT), gracefully: the shell's convention
    assert "Traceback" not in s.text_log() and "internal error" not in s.text_log(), s.text_log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(tiny_model):
    with load(tiny_model) as e:
        yield e


def model_id(tiny_model):
    return tiny_model.name


def stream_text(stream):
    """Concatenated content of a streamed chat or completion, with its chunks."""
    chunks = list(stream)
    text = ""
    for c in chunks:
        for choice in c.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text += piece or ""
    return text, chunks


def wait_idle(server, bound=60):
    deadline = time.monotonic() + bound
    while True:
        q = server.json("/api/stats")["queue"]
        if q["running"] == 0 and q["waiting"] == 0:
            return
        assert time.monotonic() < deadline, q
        time.sleep(0.02)


# ---- the API --------------------------------------------------------------------------------------
def test_health_and_models(server, client, tiny_model):
    status, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [model_id(tiny_model)]
    assert client.models.retrieve(model_id(tiny_model)).id == model_id(tiny_model)
    status, body = server.get("/")  # `serve` has no dashboard: the root says what there is
    assert status == 200 and "/v1/chat/completions" in json.loads(body)["endpoints"]
    status, body = server.get("/api/stats?since=yesterday")
    assert status == 400 and json.loads(body)["error"]["param"] == "since"


def test_chat_streamed_equals_not_streamed(client, tiny_model, engine):
    kw = dict(model=model_id(tiny_model), messages=CHAT, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw)
    text, chunks = stream_text(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert whole.choices[0].message.content == text
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    # the server ran the model: the same tokens as the engine on the chat template's rendering
    prompt = engine.tokenizer.encode(ChatTemplate.from_dir(tiny_model).render(CHAT), add_special_tokens=False)
    want = engine.generate(prompt, 24)
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == len(want)
    assert text == engine.tokenizer.decode(want)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_completion_streamed_equals_not_streamed(client, tiny_model, engine):
    kw = dict(model=model_id(tiny_model), prompt="the lazy dog", max_tokens=20, temperature=0)
    whole = client.completions.create(**kw)
    text, chunks = stream_text(client.completions.create(**kw, stream=True))
    assert whole.choices[0].text == text
    want = engine.generate(engine.tokenizer.encode("the lazy dog"), 20)
    assert text == engine.tokenizer.decode(want)
    assert whole.choices[0].finish_reason == ("length" if len(want) == 20 and want[-1] not in engine.generation["eos_token_id"] else "stop")
    by_ids = client.completions.create(model=model_id(tiny_model), prompt=engine.tokenizer.encode("the lazy dog"),
                                       max_tokens=20, temperature=0, echo=True)
    assert by_ids.choices[0].text == "the lazy dog" + text


def _shared(a: list[int], b: list[int]) -> int:
    """Prompt tokens the prefix cache serves `b` from a state holding `a` (colibri_core/prefix.py):
    for the tiny OLMoE (token_exact) every token they share, leaving b's last one to feed (the tests
    below share hundreds; under 64 nothing would be restored)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b) - 1))


def _turn(engine, prompt: list[int], n: int) -> list[int]:
    """What a greedy request's state holds at its end, which the prefix cache keeps: the prompt and
    the tokens decoded after it, the last one never fed."""
    return prompt + engine.generate(prompt, n)[:-1]


def test_a_growing_conversation_is_served_from_the_prefix_cache(server, client, tiny_model, engine):
    """The second request of a conversation reports the prompt tokens the prefix cache served, in
    OpenAI's usage.prompt_tokens_details.cached_tokens (both endpoints, streamed and not), and in
    /metrics; it answers exactly as a server with --prefix-cache 0 does."""
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
    render, encode = ChatTemplate.from_dir(tiny_model).render, engine.tokenizer.encode
    kw = dict(model=model_id(tiny_model), max_tokens=8, temperature=0)
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": long}]
    one = client.chat.completions.create(messages=first, **kw)
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "colibri streams experts"}]
    two = client.chat.completions.create(messages=second, **kw)
    p1, p2 = (encode(render(m), add_special_tokens=False) for m in (first, second))
    cached = _shared(_turn(engine, p1, 8), p2)
    assert cached > len(p1) and one.usage.prompt_tokens_details.cached_tokens == 0  # into the answer
    assert two.usage.prompt_tokens_details.cached_tokens == cached
    _, chunks = stream_text(client.chat.completions.create(messages=second, **kw, stream=True,
                                                           stream_options={"include_usage": True}))
    served = [cached, len(p2) - 1]  # the same prompt again: all but its last token
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == served[-1]
    q1, q2 = encode(long), encode(long + " colibri streams experts")
    ckw = dict(model=model_id(tiny_model), max_tokens=4, temperature=0)
    assert client.completions.create(prompt=long, **ckw).usage.prompt_tokens_details.cached_tokens == 0
    _, chunks = stream_text(client.completions.create(prompt=long + " colibri streams experts", **ckw, stream=True,
                                                      stream_options={"include_usage": True}))
    served.append(_shared(_turn(engine, q1, 4), q2))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == served[-1] >= 256
    wait_idle(server)
    value = {line.split()[0]: float(line.split()[1]) for line in server.get("/metrics")[1].decode().splitlines()
             if line.startswith("colibri_prefix_")}
    assert value["colibri_prefix_cached_tokens_total"] >= sum(served) and value["colibri_prefix_cache_hits_total"] >= 3
    assert 0 < value["colibri_prefix_cache_bytes"] <= value["colibri_prefix_cache_budget_bytes"]
    off = LiveServer("serve", tiny_model, "--prefix-cache", "0")
    try:
        plain = openai.OpenAI(base_url=off.url + "/v1", api_key="none", max_retries=0, timeout=60)
        plain.chat.completions.create(messages=first, **kw)
        again = plain.chat.completions.create(messages=second, **kw)
    finally:
        assert off.stop() == 130, off.text_log()
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == two.choices[0].message.content


def test_a_restarted_server_finds_the_conversation_it_served(tiny_model, engine, tmp_path):
    """A server stopped with Ctrl-C closes its engine, which writes the prefix cache's entries beside
    the model; the next server reads them back while it waits for requests (`PrefixCache.warm`) and
    answers the conversation's next turn from RAM, with the same answer a cold prefill gives."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns(".prefix_cache", "*.coli_session*"))
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
    render, encode = ChatTemplate.from_dir(model).render, engine.tokenizer.encode
    kw = dict(model=model_id(model), max_tokens=8, temperature=0)
    first = [{"role": "user", "content": long}]
    answers = []
    for flags in ((), (), ("--prefix-cache", "0")):  # served, restarted, cold
        s = LiveServer("serve", model, *flags)
        try:
            api = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
            if not answers:
                answers.append(api.chat.completions.create(messages=first, **kw).choices[0].message.content)
                continue
            second = first + [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": "and then?"}]
            warmed = flags == ()
            deadline = time.monotonic() + 30
            while warmed and s.json("/api/stats").get("engine", {}).get("prefix_cache_warmed") != 1:
                assert time.monotonic() < deadline, s.json("/api/stats")
                time.sleep(0.02)
            answers.append(api.chat.completions.create(messages=second, **kw))
            engine_stats = s.json("/api/stats")["engine"]
            assert engine_stats["prefix_cache_disk_hits"] == 0  # warmed: a RAM hit
            assert engine_stats["prefix_cache_warmed"] == (1 if warmed else 0)
        finally:
            assert s.stop() == 130, s.text_log()
    restarted, cold = answers[1:]
    p1, p2 = (encode(render(m), add_special_tokens=False) for m in (first, second))
    assert restarted.usage.prompt_tokens_details.cached_tokens == _shared(_turn(engine, p1, 8), p2) > len(p1)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert restarted.choices[0].message.content == cold.choices[0].message.content


def test_raw_sse_framing(server, tiny_model):
    body = {"model": model_id(tiny_model), "messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
    status, headers, raw = post(server.url + "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    raw = raw.decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    for e in events[:-2]:
        assert e.startswith("data: ")
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_generation_config_and_seed(client, tiny_model):
    kw = dict(model=model_id(tiny_model), messages=CHAT, max_tokens=16, temperature=1.3, top_p=0.9, seed=7,
              extra_body={"top_k": 40})
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_stop_strings_are_honoured_and_hidden(client, tiny_model, engine):
    kw = dict(model=model_id(tiny_model), prompt="the quick brown", max_tokens=32, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 8, full
    stop = full[len(full) // 2: len(full) // 2 + 3]  # a string from the middle, likely across tokens
    head = full[: full.index(stop)]
    whole = client.completions.create(**kw, stop=[stop, "never appears \u2603"])
    assert whole.choices[0].text == head and whole.choices[0].finish_reason == "stop"
    text, chunks = stream_text(client.completions.create(**kw, stop=stop, stream=True))
    assert text == head
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(client, tiny_model):
    r = client.chat.completions.create(model=model_id(tiny_model), messages=CHAT, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_tokenize_detokenize(server, tiny_model):
    from transformers import AutoTokenizer

    tok = Tokenizer.from_dir(tiny_model)
    r = post_json(server.url + "/tokenize", {"content": "colibri streams experts"})[1]
    assert r["tokens"] == tok.encode("colibri streams experts") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 4096
    back = post_json(server.url + "/detokenize", {"tokens": r["tokens"]})[1]
    assert back["content"] == "colibri streams experts"
    # chat: the template rendered as transformers renders it
    hf = AutoTokenizer.from_pretrained(tiny_model)
    want = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert post_json(server.url + "/tokenize", {"messages": CHAT})[1]["tokens"] == list(want)


# ---- errors: a 4xx with the OpenAI body, never a 500 --------------------------------------------
def too_long(tiny_model):
    tok = Tokenizer.from_dir(tiny_model)
    text = "the quick brown fox jumps over the lazy dog " * 600
    assert len(tok.encode(text)) > 4096
    return text


BAD = [  # (name, path, raw body or json, status, param)
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("max_tokens negative", "/v1/chat/completions", {"messages": CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens string", "/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens bool", "/v1/completions", {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("temperature too high", "/v1/chat/completions", {"messages": CHAT, "temperature": 9}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("stream not bool", "/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("stop wrong type", "/v1/completions", {"prompt": "a", "stop": [1, 2]}, 400, "stop[0]"),
    ("n=9", "/v1/chat/completions", {"messages": CHAT, "n": 9}, 400, "n"),
    ("penalty out of range", "/v1/chat/completions", {"messages": CHAT, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("stream_options without stream", "/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("prompt missing", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-17", "messages": CHAT}, 404, "model"),
    ("image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ("long prompt + max_tokens", "/v1/completions", {"prompt": [5] * 4000, "max_tokens": 200}, 400, "max_tokens"),
    ("unknown endpoint", "/v1/images/generations", {"prompt": "x"}, 404, None),
    ("detokenize wrong type", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, name, path, body, status, param):
    got, _, raw = post(server.url + path, body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert err["param"] == param


def test_wrong_method(server):
    status, body = server.get("/v1/chat/completions")
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_prompt_longer_than_context(client, tiny_model, endpoint):
    text = too_long(tiny_model)
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=model_id(tiny_model), messages=[{"role": "user", "content": text}])
        else:
            client.completions.create(model=model_id(tiny_model), prompt=text, stream=True)
    assert e.value.status_code == 400
    assert e.value.body["code"] == "context_length_exceeded" and "4096" in e.value.body["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_too_many_tokens_names_the_field_sent(server, tiny_model, field):
    status, err = post_json(server.url + "/v1/chat/completions", {"messages": CHAT, field: 4096})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded" and err["error"]["param"] == field, err


def test_openai_client_errors(client, tiny_model):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id(tiny_model), prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"


# ---- queue, cancellation, load ------------------------------------------------------------------
def blocker(server, tiny_model) -> Stream:
    """A streamed request that runs until its client leaves (or 4000 tokens); returned once it runs."""
    body = {"model": model_id(tiny_model), "prompt": "a", "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stream = Stream(server.url + "/v1/completions", body)
    assert stream.response.status == 200
    next(stream.events())  # the first token is out: the generation runs
    return stream


def test_disconnect_cancels_generation(server, tiny_model):
    wait_idle(server)
    stream = blocker(server, tiny_model)
    assert server.json("/api/stats")["queue"]["running"] == 1
    stream.close()  # the client goes away mid-answer
    wait_idle(server)  # the worker stopped at the next token
    last = server.json("/api/stats")["turns"][-1]
    assert last["finish_reason"] == "cancelled" and last["completion_tokens"] < 4000


def test_disconnect_cancels_a_non_streamed_request(server, tiny_model):
    wait_idle(server)
    body = json.dumps({"model": model_id(tiny_model), "prompt": "b", "max_tokens": 4000, "ignore_eos": True}).encode()
    host, port = server.url[len("http://"):].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 60
    while not server.json("/api/stats")["running"]:  # wait until it generates
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    wait_idle(server)
    last = server.json("/api/stats")["turns"][-1]
    assert last["finish_reason"] == "cancelled" and last["completion_tokens"] < 4000


def one_client(c, model, i):
    try:
        if i % 2:
            r = c.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
            return "ok", r.choices[0].message.content
        text, _ = stream_text(c.completions.create(model=model, prompt="fox", max_tokens=6, temperature=0, stream=True))
        return "ok", text
    except openai.RateLimitError as e:
        return "429", (e.response.headers.get("retry-after"), e.body)


def test_16_clients_with_a_queue_of_4(server, tiny_model):
    """While long requests take every place in the batch, 16 clients arrive at once: 4 wait and are
    answered, 12 get 429 with Retry-After; the server stays up; repeated rounds leave the memory
    where it was."""
    clients = [openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) for _ in range(16)]
    rss = []
    for round_ in range(3):
        wait_idle(server)
        streams = [blocker(server, tiny_model) for _ in range(PARALLEL)]
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(one_client, c, model_id(tiny_model), i) for i, c in enumerate(clients)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in futures) < 16 - QUEUE and time.monotonic() < deadline:
                time.sleep(0.02)  # the refusals come back while the blockers still run
            for stream in streams:
                stream.close()  # the blockers' clients leave: their generations are cancelled
            results = [f.result() for f in futures]
        outcomes = [r[0] for r in results]
        assert outcomes.count("ok") == QUEUE and outcomes.count("429") == 16 - QUEUE, results
        for outcome, detail in results:
            if outcome == "429":
                retry_after, body = detail
                assert int(retry_after) >= 1 and body["code"] == "queue_full"
        assert server.get("/health")[0] == 200
        metrics = server.get("/metrics")[1].decode()
        assert 'outcome="rejected"' in metrics and 'outcome="cancelled"' in metrics
        rss.append(server.rss_bytes())
    growth = rss[-1] - rss[0]  # round 0 warms up allocator pools and caches
    assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 2 rounds: {rss}"
    for c in clients:
        c.close()


def test_metrics_are_prometheus_text(server, tiny_model):
    from prometheus_client.parser import text_string_to_metric_families

    body = {"model": model_id(tiny_model), "messages": CHAT, "max_tokens": 3, "temperature": 0}
    assert post(server.url + "/v1/chat/completions", body)[0] == 200  # counters that a generation moves
    assert post(server.url + "/v1/chat/completions", b"[1, 2]")[0] == 400
    status, body = server.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in ("colibri_generation_tokens", "colibri_prompt_tokens", "colibri_time_to_first_token_seconds",
                 "colibri_queue_depth", "colibri_expert_hits", "colibri_expert_misses", "colibri_bytes_read",
                 "colibri_tokens_per_second", "colibri_requests", "colibri_attention_seconds",
                 "colibri_layer_hit_rate", "colibri_layer_io_stall_seconds"):
        assert name in families, sorted(families)
    value = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    assert value["colibri_generation_tokens_total"] > 0 and value["colibri_expert_hits_total"] > 0
    assert value["colibri_time_to_first_token_seconds_count"] > 0
    outcomes = {s.labels["outcome"] for s in families["colibri_requests"].samples}
    assert {"ok", "invalid"} <= outcomes <= {"ok", "rejected", "cancelled", "invalid"}


def test_metrics_escape_the_model_name():
    """--model-name is the user's text: a quote, backslash or newline in it must not break the scrape."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from colibri_core.server.metrics import Exporter, Metrics

    name = 'org/kjv "demo"\\x\ny'
    metrics = Metrics()
    metrics.registry.register(Exporter(metrics, name, lambda: None, lambda: {"waiting": 0, "capacity": 4, "running": 0}))
    text = generate_latest(metrics.registry).decode()
    (sample,) = [s for f in text_string_to_metric_families(text) if f.name == "colibri_model_loaded" for s in f.samples]
    assert sample.labels == {"model": name}


def test_dashboard_json(server, tiny_model):
    stats = server.json("/api/stats")
    last = stats["turns"][-1]
    assert set(last["split"]) == {"attention", "experts", "disk", "other"}
    assert all(v >= 0 for v in last["split"].values())
    assert stats["memory"]["experts"]["total"] == 2 * 8
    assert (stats["engine"]["activations"], stats["engine"]["kv_cache"]) == ("f32", "f32")  # the defaults
    b = server.json("/api/brain")
    assert b["layers"] == [0, 1] and b["n_experts"] == 8
    assert [len(t) for t in b["tiers"]] == [8, 8] and sum(map(sum, b["heat"])) > 0
    assert all(len(latest) == 2 for latest in b["latest"])  # top-2 routing
    assert server.json(f"/api/brain?since={b['passes']}") == {"passes": b["passes"], "unchanged": True}


def test_dashboard_json_shows_the_prefix_cache_and_the_running_request(server, tiny_model):
    """/api/stats carries what the dashboard's Prefix cache card draws (entries, bytes against the
    budget, hits, cached tokens beside all prompt tokens) and, for the running request, how many of
    its prompt tokens the cache served."""
    wait_idle(server)
    before = server.json("/api/stats")["engine"]
    body = {"model": model_id(tiny_model), "prompt": " ".join(["colibri streams experts"] * 40), "temperature": 0}
    status, cold = post_json(server.url + "/v1/completions", {**body, "max_tokens": 1})  # its states are kept
    assert status == 200, cold
    prompt_tokens = cold["usage"]["prompt_tokens"]
    stream = Stream(server.url + "/v1/completions", {**body, "max_tokens": 2000, "ignore_eos": True, "stream": True})
    assert stream.response.status == 200
    next(stream.events())  # its prefill is done
    deadline = time.monotonic() + 30
    while True:  # the snapshot is published at the end of the step that sent the first token: soon after it
        [live] = server.json("/api/stats")["running"]
        if not live["prefilling"] or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    stream.close()
    wait_idle(server)
    cached = prompt_tokens - 1  # all of the same prompt but its last token (the tiny OLMoE is token_exact)
    assert cached >= 256
    assert (live["prompt_tokens"], live["cached_tokens"], live["prefilling"]) == (prompt_tokens, cached, False)
    e = server.json("/api/stats")["engine"]
    assert e["prefix_cache_hits"] == before["prefix_cache_hits"] + 1
    assert e["prefix_cached_tokens"] == before["prefix_cached_tokens"] + cached
    assert e["prompt_tokens"] == before["prompt_tokens"] + 2 * prompt_tokens
    assert e["prefix_cache_entries"] >= 1 and 0 < e["prefix_cache_bytes"] <= e["prefix_cache_budget"]


# ---- the CLI and the server's life ------------------------------------------------------------
def test_serve_help_and_bad_model(tmp_path):
    from typer.testing import CliRunner

    from colibri_core.cli import app
    from colibri_core.errors import ColibriError
    from colibri_core.server import ServerConfig, serve

    for command, words in (("serve", "OpenAI-compatible"), ("web", "dashboard")):
        r = CliRunner().invoke(app, [command, "--help"])
        assert r.exit_code == 0 and words in r.output and "--api-key" in r.output and "--queue" in r.output
    with pytest.raises(ColibriError, match="not a model directory"):
        serve(ServerConfig(tmp_path), port=0)  # refused before anything listens


def test_port_in_use_is_one_line(server, tiny_model):
    port = server.url.rsplit(":", 1)[1]
    r = colibri("serve", "--model", tiny_model, "--port", port)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: ") and port in lines[0], r.stderr


def test_loading_then_ready_and_api_key(tiny_model, monkeypatch):
    """In-process: /health is 503 while the model loads, then 200; --api-key guards the API."""
    import uvicorn

    from colibri_core.server import ServerConfig, bind, create_app
    from colibri_core.server.app import Server

    release = threading.Event()
    real_load = Server.load
    monkeypatch.setattr(Server, "load", lambda self: (release.wait(60), real_load(self)))
    sock = bind("127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    app = create_app(ServerConfig(tiny_model, api_key="sekret", model_name="tiny"))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not uv.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, body = get(url + "/health")
        assert status == 503 and json.loads(body)["status"] == "loading"
        auth = {"Authorization": "Bearer sekret"}
        status, body = post_json(url + "/v1/completions", {"prompt": "a"}, auth)
        assert status == 503 and body["error"]["code"] == "model_loading"
        release.set()
        while get(url + "/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, body = post_json(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert post_json(url + "/v1/completions", {"prompt": "a", "max_tokens": 2}, {"Authorization": "Bearer wrong"})[0] == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens >= 1
        assert get(url + "/metrics")[0] == 401  # the key guards everything but /health
        assert get(url + "/metrics", auth)[0] == 200  # Prometheus: authorization: {credentials: KEY}
    finally:
        release.set()
        uv.should_exit = True
        thread.join(30)
