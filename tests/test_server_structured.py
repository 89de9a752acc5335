"""Structured output through the server, driven with the official `openai` client on the bundled demo
model (a bad JSON writer: what makes its output valid is the constraint, colibri_core/structured.py).

The property test: 50 random JSON schemas from a seeded generator (nested objects, arrays, enums,
required and optional fields, bounded strings and integers, booleans, null), each asked for with
`response_format: json_schema`, greedy and sampled in turn; every answer must end by itself
(finish_reason "stop"), parse, and validate with `jsonschema`. No answer may be cut short: the
generator only makes schemas whose longest valid compact JSON is bounded (strings by maxLength,
arrays by maxItems, integers by minimum/maximum, no additional properties; floats are left out as
their digits are unbounded), `max_tokens` is that bound in bytes (a token is at least one byte), and
a schema whose bound does not fit the demo model's context is replaced by the generator's next one
(counted, and few). Tool calls round-trip through `client.chat.completions.create(tools=...)`,
streamed and not.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import openai
import pydantic
import pytest

from colibri_core.structured import endless_gbnf_rule, endless_schema_part
from live_server import Stream, post

N_SCHEMAS = 50
MAX_BOUND = 700  # the demo model's context is 1024 tokens; the prompt takes ~20
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Ur of the Chaldees?"}]
# every answer nests without end; DEEP: the same, after a first choice the model makes; TRAP: answers exist,
# but "b", which the model may choose to write, nests without end
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
           "$ref": "#/$defs/n"}
DEEP = {"$defs": ENDLESS["$defs"], "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"$ref": "#/$defs/n"}},
        "required": ["a", "b"], "additionalProperties": False}
TRAP = {**DEEP, "required": ["a"]}


@pytest.fixture(scope="module")
def model(demo_server):
    return demo_server.json("/v1/models")["data"][0]["id"]


# ---- random schemas, with the most bytes their compact JSON may take ------------------------------------
WORDS = ["alpha", "beta", "Gamma", "delta one", "x", "yes", "no", "a\"b"]
KEYS = ["name", "id", "tags", "count", "kind", "items", "meta", "ok", "value", "child", "list", "note"]


def random_schema(rng: random.Random, depth: int = 0) -> tuple[dict, int]:
    """(schema, the most bytes a compact JSON value of it takes)."""
    kinds = ["string", "integer", "boolean", "enum", "null"] + (["object", "array", "object"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        n = rng.randint(0, 5)
        return {"type": "string", "maxLength": n}, 2 + 12 * n  # a character: at most a surrogate pair's \\uXXXX\\uXXXX
    if kind == "integer":
        lo = rng.randint(-1000, 100)
        hi = lo + rng.randint(0, 5000)
        return {"type": "integer", "minimum": lo, "maximum": hi}, max(len(str(lo)), len(str(hi)))
    if kind == "boolean":
        return {"type": "boolean"}, 5
    if kind == "null":
        return {"type": "null"}, 4
    if kind == "enum":
        values = rng.sample(WORDS, rng.randint(1, 4)) + ([rng.randint(0, 99)] if rng.random() < 0.3 else [])
        return {"enum": values}, max(len(json.dumps(v)) for v in values)
    if kind == "array":
        item, bound = random_schema(rng, depth + 1)
        most = rng.randint(0, 3)
        least = rng.randint(0, most)
        return {"type": "array", "items": item, "minItems": least, "maxItems": most}, 2 + most * (bound + 1)
    keys = rng.sample(KEYS, rng.randint(1, 3))
    props, total = {}, 2
    for k in keys:
        props[k], bound = random_schema(rng, depth + 1)
        total += len(json.dumps(k)) + 1 + bound + 1
    required = [k for k in keys if rng.random() < 0.6]
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema, total


def schemas(n: int, seed: int = 19) -> tuple[list[tuple[dict, int]], int]:
    """n top-level object schemas whose bound fits; and how many were replaced for not fitting."""
    rng, out, replaced = random.Random(seed), [], 0
    while len(out) < n:
        props, total = {}, 2
        for k in rng.sample(KEYS, rng.randint(1, 3)):
            props[k], bound = random_schema(rng, 1)
            total += len(json.dumps(k)) + 1 + bound + 1
        schema = {"type": "object", "properties": props, "additionalProperties": False,
                  "required": [k for k in props if rng.random() < 0.7]}
        if total > MAX_BOUND:
            replaced += 1
            continue
        out.append((schema, total))
    return out, replaced


def test_the_schema_generator_covers_what_the_issue_asks_for():
    made, replaced = schemas(N_SCHEMAS)
    text = json.dumps([s for s, _ in made])
    nested = sum('"type": "object"' in json.dumps(list(s["properties"].values())) for s, _ in made)
    assert len(made) == N_SCHEMAS and replaced <= N_SCHEMAS // 4
    assert nested >= 10 and text.count('"array"') >= 10 and text.count('"enum"') >= 10
    assert sum(bool(s["required"]) for s, _ in made) >= 40 and text.count('"integer"') >= 10


def test_random_schemas_give_valid_json(demo_client, model):
    made, _ = schemas(N_SCHEMAS)
    for i, (schema, bound) in enumerate(made):
        sampled = i % 2 == 1
        r = demo_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe the ark as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            max_tokens=bound, temperature=1.0 if sampled else 0.0, seed=i)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (i, schema, choice)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)


def test_json_object_streamed_and_not(demo_client, model):
    r = demo_client.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                            max_tokens=60, temperature=0)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    chunks = list(demo_client.chat.completions.create(model=model, messages=ASK,
                                                      response_format={"type": "json_object"}, max_tokens=60,
                                                      temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text  # greedy: the same


def test_usage_counts_the_drafted_tokens(demo_client, model):
    """A schema's forced tokens (keys, punctuation) are drafted and always accepted; the usage block
    reports them where OpenAI counts a prediction's tokens."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    r = demo_client.chat.completions.create(model=model, messages=ASK, max_tokens=60, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= len('{"name":"",ok":}') // 4, details  # at least the keys' tokens
    assert details.rejected_prediction_tokens == 0 and details.accepted_prediction_tokens < r.usage.completion_tokens
    plain = demo_client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0  # no grammar, no MTP head


def tool_args(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    schema = {"get_weather": WEATHER, "now": CLOCK}[call.function.name]["function"]["parameters"]
    jsonschema.validate(args, schema)
    return args


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """The tool calls of a streamed answer, put together from their deltas as a client does (with how
    many deltas carried arguments)."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                c["id"] = d.id or c["id"]
                c["pieces"] += bool(d.function and d.function.arguments)
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[i] for i in sorted(calls)], finish, content


def test_a_tool_call_round_trips(demo_client, model):
    r = demo_client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    tool_args(call)
    # the call and its result go back into the conversation; the model answers in text
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 31}'}]
    r = demo_client.chat.completions.create(model=model, messages=history, tools=[WEATHER, CLOCK], tool_choice="none",
                                            max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_a_tool_call_answer_is_what_the_published_schema_says(demo_server):
    """Content null, `tool_calls`, finish_reason "tool_calls": all in /openapi.json's chat answer, which
    clients generated from it would otherwise reject."""
    doc = demo_server.json("/openapi.json")
    schema = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    for choice in ("required", "none"):
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "parallel_tool_calls": False, "max_tokens": 120}
        status, _, raw = post(demo_server.url + "/v1/chat/completions", body)
        answer = json.loads(raw)
        assert status == 200 and (answer["choices"][0]["finish_reason"] == "tool_calls") == (choice == "required"), raw
        jsonschema.validate(answer, schema)


def test_a_tool_call_round_trips_streamed(demo_client, model):
    kw = dict(model=model, messages=ASK, tools=[WEATHER, CLOCK], parallel_tool_calls=False, max_tokens=120,
              temperature=0)
    whole = demo_client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    calls, finish, content = streamed_calls(demo_client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, **kw))
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    (call,) = whole.choices[0].message.tool_calls
    assert calls[0]["name"] == call.function.name == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["pieces"] > 1  # the arguments arrive as they are written
    assert json.loads(calls[0]["arguments"]) == tool_args(call)  # greedy: the same call


def test_several_calls_streamed(demo_client, model):
    calls, finish, _ = streamed_calls(demo_client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200, stream=True))
    assert calls and all(c["name"] in ("get_weather", "now") for c in calls)
    assert finish in ("tool_calls", "length")  # a weak model may go on calling until max_tokens
    for c in calls if finish == "tool_calls" else calls[:-1]:  # cut at max_tokens: the last call may be partial
        json.loads(c["arguments"])


def test_auto_is_text_or_calls(demo_client, model):
    r = demo_client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=40)
    m = r.choices[0].message
    assert (m.tool_calls is None and m.content) or (m.content is None and m.tool_calls)


def test_completions_take_response_format_and_grammar(demo_client, model):
    r = demo_client.completions.create(model=model, prompt="And God said", max_tokens=40,
                                       extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "n", "schema": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                                              "required": ["n"], "additionalProperties": False}}}})
    assert json.loads(r.choices[0].text)["n"] in (1, 2) and r.choices[0].finish_reason == "stop"
    for grammar in ('root ::= ("yes" | "no") "!"', 'start: ("yes" | "no") "!"'):
        r = demo_client.completions.create(model=model, prompt="Is it good?", max_tokens=10,
                                           extra_body={"grammar": grammar})
        assert r.choices[0].text in ("yes!", "no!")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "the JSON schema cannot be compiled: Invalid type: foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                          "pattern": "(("}}}},
     "response_format", "unclosed group"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"grammar": "start: foo"}, "grammar", 'the Lark grammar cannot be compiled: at 1(8): unknown name: "foo"'),
    ({"grammar": 'root ::= "a" | foo'}, "grammar", "the GBNF grammar cannot be compiled"),
    ({"grammar": "start: /a/", "response_format": {"type": "json_object"}}, "grammar", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"},
     "tools", "Invalid type: nope"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tools",
     "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only function tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    # every answer, or one the model may choose, nests without end: found when the constraint is built
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": ENDLESS}}}, "response_format",
     "the JSON schema cannot be followed: #: no finite JSON answers it (it recurses without end through #/$defs/n)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "items": {"$ref": "#"}, "minItems": 1}}}}, "response_format", "#: no finite JSON answers it"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": DEEP}}}, "response_format",
     "#: no finite JSON answers it"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TRAP}}}, "response_format",
     "the JSON schema cannot be followed: #/properties/b: no finite JSON answers it"),
    ({"grammar": 'root ::= "(" root ")"'}, "grammar", "the GBNF grammar cannot be followed: rule 'root': no finite text"),
    ({"grammar": 'root ::= "x" | "(" loop\nloop ::= "(" loop'}, "grammar", "rule 'loop': no finite text matches it"),
    # a Lark grammar is not analysed: llguidance gives up on it while forcing the first tokens
    ({"grammar": 'start: "(" start ")"'}, "grammar", "the Lark grammar cannot be followed before the model's first "
                                                     "choice: parser error: Too many items"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": TRAP}}]}, "tools",
     "the parameters of 'f': the JSON schema cannot be followed: #/properties/b: "),
])
def test_what_cannot_be_compiled_is_a_400_in_openais_shape(demo_server, body, param, message):
    status, _, raw = post(demo_server.url + "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param, error
    assert message in error["message"] and "\n" not in error["message"]


def test_a_grammar_that_cannot_be_followed_is_a_400_before_a_stream_begins(demo_server):
    body = {"messages": ASK, "max_tokens": 4, "stream": True, "grammar": 'root ::= "(" root ")"'}
    status, _, raw = post(demo_server.url + "/v1/chat/completions", body)
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error", raw  # JSON, not events


def test_a_grammar_given_up_on_mid_answer_is_a_clean_error(demo_server):
    """A Lark grammar (not analysed before it runs): "a" or "b" first (the model's choice), then a
    recursion without end: llguidance gives up mid-answer. A one-line server_error, streamed or not; no
    traceback in the log (the fixture)."""
    body = {"messages": ASK, "max_tokens": 60, "temperature": 0, "grammar": 'start: ("a" | "b") loop\nloop: "(" loop'}
    status, _, raw = post(demo_server.url + "/v1/chat/completions", body)
    error = json.loads(raw)["error"]
    assert status == 500 and error["code"] == "generation_failed", raw
    assert error["message"].startswith("the Lark grammar cannot be followed after ") and "\n" not in error["message"]
    s = Stream(demo_server.url + "/v1/chat/completions", {**body, "stream": True})
    *_, last, done = s.events()
    s.close()
    assert json.loads(last)["error"]["message"] == error["message"] and done == "[DONE]"


def test_a_pydantic_tool_with_defs_round_trips(demo_client, model):
    """openai.pydantic_function_tool puts a nested model in "$defs", referred to as "#/$defs/Addr"."""

    class Addr(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)

    class Ship(pydantic.BaseModel):
        to: Addr
        gift: bool

    tool = openai.pydantic_function_tool(Ship, name="ship")
    assert "$defs" in tool["function"]["parameters"]
    r = demo_client.chat.completions.create(model=model, messages=ASK, tools=[tool], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=80)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "ship"
    Ship.model_validate_json(call.function.arguments)


def test_the_openai_client_sees_a_bad_schema_as_bad_request(demo_client, model):
    with pytest.raises(openai.BadRequestError, match="Invalid type: foo"):
        demo_client.chat.completions.create(model=model, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})


def test_openapi_describes_the_structured_fields(demo_server):
    doc = demo_server.json("/openapi.json")
    text = json.dumps(doc)
    assert '"json_schema"' in text and '"parallel_tool_calls"' in text and '"required"' in text


def test_an_answer_that_ends_on_its_last_allowed_token_is_a_stop(demo_server):
    body = {"messages": [{"role": "user", "content": "Yes?"}], "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "b", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}}
    whole = json.loads(post(demo_server.url + "/v1/chat/completions", {**body, "max_tokens": 50})[2])
    n = whole["usage"]["completion_tokens"]
    for stream in (False, True):
        for m, finish in ((n, "stop"), (n - 1, "length")):
            raw = post(demo_server.url + "/v1/chat/completions",
                       {**body, "max_tokens": m, "stream": stream})[2].decode()
            assert re.search(f'"finish_reason": ?"{finish}"', raw), (m, raw)


def test_call_stream_gives_the_same_calls_however_the_text_is_cut():
    from colibri_core.server.structure import CallStream

    text = ('<tool_call>\n{"name":"get_weather","arguments":{"city":"U}r","unit":"celsius"}}\n</tool_call>'
            '<tool_call>{"name":"now","arguments":{}}</tool_call> <tool_call>{ "name": "now", "arguments": {}}</tool_call>')
    want = [("get_weather", {"city": "U}r", "unit": "celsius"}), ("now", {}), ("now", {})]
    for trial in range(300):
        rng = random.Random(trial)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 40)))
        stream, calls = CallStream(), {}
        for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] + [None]:
            content, deltas = stream.push(piece) if piece is not None else stream.flush()
            assert content == ""
            for d in deltas:
                c = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                if "id" in d:
                    assert c["name"] is None and d["id"].startswith("call_")
                    c["name"] = d["function"]["name"]
                c["arguments"] += d["function"]["arguments"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == want, (trial, calls)
    s = CallStream()
    assert s.push(" <tool")[0] == "" and s.push("s are")[0] == " <tools are" and s.push(" here")[0] == " here"
    s = CallStream()
    s.push('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call><tool_c')
    assert s.flush() == ("", [])  # a second call cut short before its name: dropped


def test_auto_with_a_response_format_is_valid_json_or_calls(demo_client, model):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    for seed in range(4):
        r = demo_client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=80, seed=seed,
                                                temperature=1.0, response_format={"type": "json_schema", "json_schema": {
                                                    "name": "a", "schema": schema}})
        m = r.choices[0].message
        if m.tool_calls:
            assert r.choices[0].finish_reason in ("tool_calls", "length") and m.content is None
            tool_args(m.tool_calls[0])
        else:
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(m.content), schema)


# ---- recursion-heavy schemas, grammars and tools, fuzzed ---------------------------------------------------
# Generated with a fixed seed, each with an oracle of what it allows: "clean" (every part that an answer can
# reach has a finite value: any prefix can be finished), "endless" (no answer at all: every value nests
# without end) or "trap" (answers exist, but some choice leads into a part that has none). The contract: a
# clean constraint is a finished answer or a 400; a schema, tool or GBNF grammar without end is a 400 naming
# the part (colibri_core/structured.py finds it before the request is queued); a Lark grammar without end
# (not analysed there) may also fail when the model walks into it, a one-line 500 "generation_failed"
# (streamed: a server_error event), as llguidance gives up only then.
FUZZ_CASES = 200
LEAVES = [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}, {"type": "null"},
          {"enum": ["ark", "dove"]}, {"type": "string", "maxLength": 4}]
TERMINALS = ["(", ")", "[", "]", "a", "b", "x", ",", "0"]


def fuzz_schema(rng: random.Random, refs: list[str], depth: int = 0, kind: str | None = None) -> dict:
    """A random schema node whose `$ref`s point at `refs` ("#" or "#/$defs/NAME")."""
    kind = kind or rng.choices(["leaf", "ref", "object", "array", "anyOf"],
                               [3, 3, 3, 2, 2] if depth < 4 else [1, 1, 0, 0, 0])[0]
    if kind == "leaf":
        return dict(rng.choice(LEAVES))
    if kind == "ref":
        return {"$ref": rng.choice(refs)}
    if kind == "object":
        keys = rng.sample(KEYS, rng.randint(1, 3))
        return {"type": "object", "properties": {k: fuzz_schema(rng, refs, depth + 1) for k in keys},
                "required": [k for k in keys if rng.random() < 0.5], "additionalProperties": False}
    if kind == "array":
        least = rng.choice([0, 0, 1, 2])
        return {"type": "array", "items": fuzz_schema(rng, refs, depth + 1), "minItems": least,
                "maxItems": least + rng.randint(0, 3)}
    return {"anyOf": [fuzz_schema(rng, refs, depth + 1) for _ in range(rng.randint(2, 3))]}


def recursive_schema(rng: random.Random, root: str | None = None) -> dict:
    """A root schema with 0–2 `$defs`, refs anywhere (cycles through "#" and the defs), sometimes
    wrapped in a chain of 4–18 required objects (deep nesting; past the body's depth bound: a 400)."""
    names = rng.sample(["n", "tree", "Node", "pair"], rng.randint(0, 2))
    refs = ["#"] + [f"#/$defs/{n}" for n in names]
    schema = fuzz_schema(rng, refs, 0, root or rng.choice(["object", "array", "anyOf"]))
    if rng.random() < 0.25:
        for _ in range(rng.randint(4, 18)):
            schema = {"type": "object", "properties": {"d": schema}, "required": ["d"], "additionalProperties": False}
    if names:  # at the root, where "#/$defs/…" points
        schema["$defs"] = {n: fuzz_schema(rng, refs, 1) for n in names}
    return schema


def schema_class(schema: dict) -> str:
    """"clean", "endless" or "trap" (see above), by the least fixpoint of which refs have a finite value."""
    targets = {"#": schema, **{f"#/$defs/{n}": s for n, s in schema.get("$defs", {}).items()}}

    def finite(s: dict, known: set) -> bool:
        if "$ref" in s:
            return s["$ref"] in known
        if "anyOf" in s:
            return any(finite(a, known) for a in s["anyOf"])
        if s.get("type") == "object":
            return all(finite(s["properties"][k], known) for k in s["required"])
        if s.get("type") == "array":
            return s["minItems"] == 0 or finite(s["items"], known)
        return True

    known: set = set()
    while (more := {t for t, s in targets.items() if finite(s, known)}) != known:
        known = more

    def nodes(s: dict, refs: set):  # the parts an answer can enter (not the items of an array of none)
        yield s
        if "$ref" in s and s["$ref"] not in refs:
            refs.add(s["$ref"])
            yield from nodes(targets[s["$ref"]], refs)
        for child in [*s.get("properties", {}).values(), *s.get("anyOf", [])]:
            yield from nodes(child, refs)
        if "items" in s and s["maxItems"] > 0:
            yield from nodes(s["items"], refs)

    if "#" not in known:
        return "endless"
    return "clean" if all(finite(s, known) for s in nodes(schema, {"#"})) else "trap"


def recursive_grammar(rng: random.Random) -> tuple[list[list[list[tuple]]], str]:
    """Rules (rule 0 the start) as alternatives of items ("t", text) or ("r", rule, "" | "*" | "?" | "+"),
    half of the time one of the classic recursions; and its class, as for schemas."""
    classic = rng.choice([None, None, None, [[[("t", "("), ("r", 0, ""), ("t", ")")]]],
                          [[[("t", "("), ("r", 0, ""), ("t", ")")], [("t", "x")]]],
                          [[[("r", 0, ""), ("t", "a")], [("t", "a")]]],
                          [[[("t", "["), ("r", 0, "*"), ("t", "]")]]]])
    rules = classic or [[[("t", rng.choice(TERMINALS)) if rng.random() < 0.55 else
                          ("r", rng.randrange(n), rng.choice(["", "", "*", "?", "+"]))
                          for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 3))]
                        for n in [rng.randint(1, 4)] for _ in range(n)]
    known: set = set()
    while (more := {i for i, alts in enumerate(rules) if any(
            all(it[0] == "t" or it[2] in ("*", "?") or it[1] in known for it in alt) for alt in alts)}) != known:
        known = more
    reached, todo = {0}, [0]
    while todo:
        for alt in rules[todo.pop()]:
            for it in alt:
                if it[0] == "r" and it[1] not in reached:
                    reached.add(it[1])
                    todo.append(it[1])
    return rules, "endless" if 0 not in known else "clean" if reached <= known else "trap"


def grammar_text(rules, dialect: str) -> str:
    """GBNF (`root ::= …`) or Lark (`start: …`)."""
    name = (lambda i: "root" if i == 0 else f"r{i}") if dialect == "gbnf" else (lambda i: "start" if i == 0 else f"r{i}")
    sep = " ::= " if dialect == "gbnf" else ": "
    item = lambda it: json.dumps(it[1]) if it[0] == "t" else name(it[1]) + it[2]
    return "\n".join(name(i) + sep + " | ".join(" ".join(map(item, alt)) for alt in alts) for i, alts in enumerate(rules))


def fuzz_case(rng: random.Random, i: int) -> tuple[str, dict, str, str]:
    """(what, the request body, its endpoint, its class)."""
    what = rng.choice(["response_format", "response_format", "gbnf", "lark", "tools"])
    chat = what == "tools" or rng.random() < 0.6
    body = {"max_tokens": rng.randint(8, 32), "stream": rng.random() < 0.5, "seed": i,
            "temperature": rng.choice([0.0, 1.0])}
    if what == "response_format":
        schema = recursive_schema(rng)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"r{i}", "schema": schema}}
        kind = schema_class(schema)
    elif what == "tools":
        params = [recursive_schema(rng, "object") for _ in range(rng.choice([1, 1, 2]))]
        body["tools"] = [{"type": "function", "function": {"name": f"f{j}", "parameters": p}} for j, p in enumerate(params)]
        body["tool_choice"] = rng.choice(["auto", "required", {"type": "function", "function": {"name": "f0"}}])
        classes = {schema_class(p) for p in params}
        kind = "endless" if "endless" in classes else "trap" if "trap" in classes else "clean"
    else:
        rules, kind = recursive_grammar(rng)
        body["grammar"] = grammar_text(rules, what)
    if chat:
        return what, {"messages": [{"role": "user", "content": "Build it."}], **body}, "/v1/chat/completions", kind
    return what, {"prompt": "And God said", **body}, "/v1/completions", kind


def test_fuzz_case_classes_are_what_they_say():
    assert schema_class(ENDLESS) == schema_class(DEEP) == "endless"
    assert schema_class({**DEEP, "required": ["a"]}) == "trap"
    assert schema_class({"type": "array", "items": {"$ref": "#"}, "minItems": 0, "maxItems": 2}) == "clean"
    assert schema_class({"type": "array", "items": {"$ref": "#"}, "minItems": 1, "maxItems": 2}) == "endless"
    assert recursive_grammar(random.Random(0))[1] in ("clean", "endless", "trap")
    rng = random.Random(54)
    made = [fuzz_case(rng, i) for i in range(FUZZ_CASES)]
    counts = {(w, k): sum(c[0] == w and c[3] == k for c in made) for w in ("response_format", "tools") for k in
              ("clean", "endless", "trap")}
    assert all(n >= 3 for n in counts.values()), counts  # every kind of case occurs
    assert sum('"d"' in json.dumps(c[1]) for c in made) >= 20  # deep nesting
    assert sum("gbnf" == c[0] for c in made) >= 20 and sum("lark" == c[0] for c in made) >= 20


def test_the_engine_refuses_exactly_the_fuzz_cases_without_end():
    """structured.py's check (a fixpoint of its own, over every JSON schema keyword it models) agrees
    with the labeller above on every schema, tool and GBNF grammar of the fuzz, and on ten times more."""
    rng = random.Random(54)
    for i in range(FUZZ_CASES * 10):
        what, body, _, kind = fuzz_case(rng, i)
        if what == "response_format":
            why = endless_schema_part(body["response_format"]["json_schema"]["schema"])
        elif what == "tools":
            why = next(filter(None, (endless_schema_part(t["function"]["parameters"]) for t in body["tools"])), None)
        elif what == "gbnf":
            why = endless_gbnf_rule(body["grammar"])
        else:
            continue
        assert (why is None) == (kind == "clean"), (i, kind, why, body)


@pytest.mark.system
def test_recursive_schemas_grammars_and_tools_are_answered_or_refused(demo_server):
    """Every case: a finished answer (200) or a 400 invalid_request_error in one line, streamed or not;
    a 400 naming the part without end for every schema, tool or GBNF grammar that has one; never a 5xx,
    but the one-line generation_failed of a Lark grammar without end; no traceback."""
    rng, seen = random.Random(54), {}
    for i in range(FUZZ_CASES):
        what, body, path, kind = fuzz_case(rng, i)
        status, _, raw = post(demo_server.url + path, body, timeout=120)
        text = raw.decode()
        if kind != "clean" and what != "lark":  # refused: no end (or a body nested too deep, a prompt too long)
            assert status == 400 and re.search(r"no finite (JSON answers|text matches) it|nested more|context length",
                                               json.loads(raw)["error"]["message"]), (i, kind, body, text)
        if status == 200 and body["stream"]:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", (i, body, text)
            chunks = [json.loads(e) for e in events[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            finish = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
            outcome = "500 mid-stream" if errors else "200"
            assert (errors and kind != "clean" and what == "lark" and errors[0]["code"] == "generation_failed") or \
                (not errors and finish), \
                (i, kind, body, text)
        elif status == 200:
            outcome = "200"
            assert json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), (i, body, text)
        else:
            error = json.loads(raw)["error"]
            outcome = str(status)
            assert "\n" not in error["message"], (i, body, error)
            assert (status == 400 and error["type"] == "invalid_request_error") or \
                (status == 500 and kind != "clean" and what == "lark" and error["code"] == "generation_failed"), \
                (i, kind, body, error)
        seen[(kind, outcome)] = seen.get((kind, outcome), 0) + 1
    print(f"\n{FUZZ_CASES} requests (seed 54):", ", ".join(f"{k} {o}: {n}" for (k, o), n in sorted(seen.items())))
    log = demo_server.text_log()
    assert "Traceback" not in log and "internal error" not in log, log
