"""The server's sampling as the `openai` client and llama.cpp's clients use it, on the bundled demo model:
log-probabilities (chat and completions, streamed and not) equal to the engine's own log_softmax,
penalties, min_p and logit_bias, llama-server's names, a forced tool call cut by max_tokens, and every
documented request field of OpenAI's and llama-server's either working or refused by name."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from live_server import post

ASK = [{"role": "user", "content": "What is the weather in Ur of the Chaldees?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def chat(server, body: dict) -> tuple[int, dict]:
    status, _, raw = post(server.url + "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    return status, json.loads(raw)


# ---- log-probabilities ----------------------------------------------------------------------------------
def test_completion_logprobs_are_the_engines_log_softmax(demo_client, demo_engine):
    """Greedy: each token's logprob is log_softmax(engine.logits) at its position, its top 3 the most
    likely three, in the legacy shape (text_offset counting from the start of the text), streamed and not."""
    ids = demo_engine.tokenizer.encode("And God said")
    r = demo_client.completions.create(prompt=ids, model=demo_client.models.list().data[0].id, max_tokens=8,
                                       temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    answer = demo_engine.tokenizer.encode(r.choices[0].text, add_special_tokens=False)
    rows = [log_softmax(row) for row in demo_engine.logits(ids + answer)[len(ids) - 1:-1]]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]
    for token, logprob, top, row in zip(answer, lp.token_logprobs, lp.top_logprobs, rows):
        assert math.isclose(logprob, row[token], abs_tol=1e-5)
        assert np.allclose(sorted(top.values(), reverse=True), np.sort(row)[::-1][:len(top)], atol=1e-5)
    chunks = list(demo_client.completions.create(prompt=ids, model=r.model, max_tokens=8, temperature=0, logprobs=3,
                                                 stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs_whole_and_streamed_agree(demo_client):
    kw = dict(model=demo_client.models.list().data[0].id, messages=ASK, max_tokens=12, temperature=0, logprobs=True,
              top_logprobs=4)
    r = demo_client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert 0 < len(content) <= r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 4
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-9
        assert sum(math.exp(x) for x in tops) <= 1 + 1e-6
    streamed = [t for c in demo_client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = demo_client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": 2, "echo": True}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
])
def test_logprobs_refused_by_name(demo_server, path, body, param):
    status, _, raw = post(demo_server.url + path, body)
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


# ---- penalties, min_p, logit_bias ----------------------------------------------------------------------------
def test_penalties_min_p_and_bias_through_the_client(demo_client, demo_engine):
    model = demo_client.models.list().data[0].id
    kw = dict(model=model, prompt="In the beginning", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})

    def text(**more) -> str:
        extra = {**kw["extra_body"], **more.pop("extra_body", {})}
        return demo_client.completions.create(**{**kw, **more, "extra_body": extra}).choices[0].text

    looping = text()
    assert looping.count("Levites") >= 5
    assert text(frequency_penalty=0.5, presence_penalty=0.5).count("Levites") <= 2
    assert text(extra_body={"repetition_penalty": 1.3}).count("Levites") <= 2
    # llama-server's names: the same answer as vLLM's; -1: every token; 0: no penalty
    assert text(extra_body={"repeat_penalty": 1.3}) == text(extra_body={"repetition_penalty": 1.3})
    assert text(extra_body={"repeat_penalty": 1.3, "repeat_last_n": 0}) == looping
    assert text(extra_body={"repeat_penalty": 1.3, "repeat_last_n": -1}).count("Levites") <= 2
    levites = demo_engine.tokenizer.encode(" Levites", add_special_tokens=False)
    assert "Levites" not in text(logit_bias={str(t): -100 for t in levites})
    egypt = demo_engine.tokenizer.encode(" Egypt", add_special_tokens=False)[0]
    assert text(max_tokens=5, logit_bias={str(egypt): 100}) == " Egypt" * 5
    sampled = dict(temperature=1.5, seed=7, extra_body={"min_p": 0.2})
    assert text(**sampled) == text(**sampled) and text(temperature=1.5, seed=7, extra_body={"min_p": 1.0}) == looping


def test_two_names_of_one_penalty_that_differ_are_refused(demo_server):
    status, body = chat(demo_server, {"repeat_penalty": 1.1, "repetition_penalty": 1.2})
    assert status == 400 and body["error"]["param"] == "repeat_penalty"


# ---- a forced tool call cut by max_tokens ---------------------------------------------------------------------
def test_a_forced_call_cut_by_max_tokens_is_a_partial_call(demo_client):
    """Whatever max_tokens cuts it at, a forced call comes back as tool_calls (its name, the arguments so
    far), finish_reason "length", content null, streamed and not, never the template's markup."""
    model = demo_client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, tools=[WEATHER], parallel_tool_calls=False, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = demo_client.chat.completions.create(**kw, max_tokens=120)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.usage.completion_tokens > 10
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    for n in range(1, whole.usage.completion_tokens):
        r = demo_client.chat.completions.create(**kw, max_tokens=n)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and m.content is None, (n, m)
        [call] = m.tool_calls
        assert call.function.name == "get_weather" and arguments.startswith(call.function.arguments), (n, call)
        chunks = list(demo_client.chat.completions.create(**kw, max_tokens=n, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert not any(c.choices[0].delta.content for c in chunks if c.choices), n
        assert deltas[0].function.name == "get_weather"
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments, n
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# ---- every documented request field: it works, or it is a 400 naming it ----------------------------------------
# (field, a value a client sends, "ok" or the HTTP status): OpenAI's chat completions request body, then its
# legacy completions', then llama-server's /completion and OpenAI-compatible fields (its README), with values
# that change the answer where the field is a knob colibri lacks
OPENAI_CHAT = [
    ("model", None, "ok"), ("messages", ASK, "ok"), ("frequency_penalty", 0.5, "ok"), ("presence_penalty", -0.5, "ok"),
    ("logit_bias", {"5": -100}, "ok"), ("logprobs", True, "ok"), ("top_logprobs", 2, "needs logprobs"),
    ("max_tokens", 3, "ok"), ("max_completion_tokens", 3, "ok"), ("n", 9, 400), ("seed", 3, "ok"),
    ("stop", ["\n"], "ok"), ("stream", True, "ok"), ("stream_options", {"include_usage": True}, "needs stream"),
    ("temperature", 0.5, "ok"), ("top_p", 0.9, "ok"), ("tools", [WEATHER], "ok"), ("tool_choice", "none", "ok"),
    ("parallel_tool_calls", False, "ok"), ("response_format", {"type": "json_object"}, "ok"), ("user", "u1", "ok"),
    ("store", True, 400), ("metadata", {"a": "b"}, "ok"), ("modalities", ["text"], "ok"),
    ("modalities", ["text", "audio"], 400), ("audio", {"voice": "alloy", "format": "wav"}, 400),
    ("prediction", {"type": "content", "content": "x"}, 400), ("reasoning_effort", "low", 400),
    ("service_tier", "auto", "ok"), ("service_tier", "flex", 400), ("prompt_cache_key", "k", "ok"),
    ("safety_identifier", "s", "ok"), ("verbosity", "low", 400), ("web_search_options", {}, 400),
    ("functions", [WEATHER["function"]], 400), ("function_call", "auto", 400),
]
OPENAI_COMPLETIONS = [
    ("prompt", "And", "ok"), ("best_of", 2, 400), ("echo", True, "ok"), ("frequency_penalty", 1.0, "ok"),
    ("logit_bias", {"5": 50}, "ok"), ("logprobs", 2, "ok"), ("max_tokens", 3, "ok"), ("n", 9, 400),
    ("presence_penalty", 1.0, "ok"), ("seed", 1, "ok"), ("stop", "x", "ok"), ("stream", True, "ok"),
    ("suffix", "tail", 400), ("temperature", 1.0, "ok"), ("top_p", 0.5, "ok"), ("user", "u", "ok"),
]
LLAMA_SERVER = [
    ("temperature", 0.8, "ok"), ("dynatemp_range", 0.5, 400), ("dynatemp_exponent", 1.0, "ok"), ("top_k", 40, "ok"),
    ("top_p", 0.95, "ok"), ("min_p", 0.05, "ok"), ("n_predict", 8, 400), ("n_indent", 2, 400), ("n_keep", 4, "ok"),
    ("stream", False, "ok"), ("stop", ["\n\n"], "ok"), ("typical_p", 0.9, 400), ("typical_p", 1.0, "ok"),
    ("repeat_penalty", 1.1, "ok"), ("repeat_last_n", 64, "ok"), ("presence_penalty", 0.1, "ok"),
    ("frequency_penalty", 0.1, "ok"), ("dry_multiplier", 0.8, 400), ("dry_multiplier", 0, "ok"),
    ("dry_base", 1.75, "ok"), ("dry_allowed_length", 2, "ok"), ("dry_penalty_last_n", -1, "ok"),
    ("dry_sequence_breakers", ["\n", ":"], "ok"), ("xtc_probability", 0.5, 400), ("xtc_probability", 0, "ok"),
    ("xtc_threshold", 0.1, "ok"), ("mirostat", 2, 400), ("mirostat", 0, "ok"), ("mirostat_tau", 5.0, "ok"),
    ("mirostat_eta", 0.1, "ok"), ("grammar", 'root ::= "yes" | "no"', "ok"),
    ("json_schema", {"type": "object"}, 400), ("seed", 42, "ok"), ("ignore_eos", True, "ok"),
    ("logit_bias", [[15, -1.0]], 400), ("n_probs", 3, 400), ("min_keep", 0, "ok"), ("min_keep", 5, 400),
    ("t_max_predict_ms", 1000, 400), ("image_data", [], 400), ("id_slot", -1, "ok"), ("id_slot", 1, 400),
    ("cache_prompt", True, "ok"), ("return_tokens", True, 400), ("samplers", ["top_k", "min_p"], 400),
    ("timings_per_token", True, 400), ("post_sampling_probs", True, 400), ("response_fields", ["content"], 400),
    ("lora", [{"id": 0, "scale": 0.5}], 400), ("top_n_sigma", 1.0, 400), ("top_n_sigma", -1, "ok"),
    ("tfs_z", 0.9, 400), ("penalize_nl", False, 400), ("return_progress", True, 400),
    ("chat_template_kwargs", {"enable_thinking": False}, 400),
]


def _every_field():
    for path, fields in (("/v1/chat/completions", OPENAI_CHAT), ("/v1/completions", OPENAI_COMPLETIONS),
                         ("/v1/chat/completions", LLAMA_SERVER), ("/v1/completions", LLAMA_SERVER)):
        for name, value, expect in fields:
            if (name, path) in (("messages", "/v1/completions"), ("prompt", "/v1/chat/completions")):
                continue
            yield pytest.param(path, name, value, expect, id=f"{path.split('/')[-1]}-{name}-{json.dumps(value)[:20]}")


@pytest.mark.parametrize("path,name,value,expect", list(_every_field()))
def test_every_field_works_or_is_refused_by_name(demo_server, path, name, value, expect):
    base = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "And God"}
    body = {**base, "max_tokens": 3, name: value}
    if expect == "needs logprobs":
        body["logprobs"], expect = True, "ok"
    if expect == "needs stream":
        body["stream"], expect = True, "ok"
    status, _, raw = post(demo_server.url + path, body)
    if expect == "ok":
        assert status == 200, raw
    else:
        error = json.loads(raw)["error"]
        assert status == expect and error["param"] == name and f"'{name}'" in error["message"], raw
