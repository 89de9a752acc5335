"""Embeddings (issue 53): `Engine.embed` — the mean of the last decoder layer's output over the input's
tokens — and POST /v1/embeddings as the `openai` client calls it, on the bundled demo model: floats and
base64 bit for bit the engine's, batches of texts and of token ids, beside a streaming generation, and
every malformed request a 400 naming its field."""
from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest

from colibri_core import load
from colibri_core.demo import demo_model
from colibri_core.errors import ColibriError
from colibri_core.probe import recording
from live_server import Stream, post

TEXTS = ["In the beginning God created the heaven and the earth.", "And God said, Let there be light.",
         "Jesus wept."]


def embeds(engine, texts) -> list[np.ndarray]:
    return [engine.embed(engine.tokenizer.encode(t)) for t in texts]


# ---- the engine ---------------------------------------------------------------------------------------
def test_embed_is_the_mean_of_the_last_layers_output(demo_engine):
    """What the docs say it is: the last layer's l_out (the residual stream the final norm reads), recorded
    in a plain forward, averaged over the tokens; float32 of the model's width."""
    ids = demo_engine.tokenizer.encode(TEXTS[0])
    with recording(("l_out",)) as rec:
        demo_engine.logits(ids)
    last = rec.get("l_out", rec.layers("l_out")[-1])  # (T, H)
    vector = demo_engine.embed(ids)
    assert vector.dtype == np.float32 and vector.shape == (demo_engine.container.config["hidden_size"],)
    assert np.array_equal(vector, np.mean(last, axis=0, dtype=np.float64).astype(np.float32))
    a, b, c = embeds(demo_engine, TEXTS)
    assert not np.array_equal(a, b)


def test_embed_leaves_no_state_and_is_the_same_in_pieces(demo_engine):
    """Sessions and the prefix cache are untouched; a long input cut into 64-token pieces gives the bits
    of the default 256-token pieces."""
    ids = (demo_engine.tokenizer.encode(" ".join(TEXTS)) * 60)[:1000]
    before = {k: demo_engine.stats()[k] for k in ("prefix_cache_entries", "prompt_tokens", "generated_tokens")}
    whole = demo_engine.embed(ids)
    assert {k: demo_engine.stats()[k] for k in before} == before
    with load(demo_model(), prefill_chunk=64) as small:
        assert np.array_equal(small.embed(ids), whole)


def test_embed_refuses_nothing_too_much_and_a_busy_engine(demo_engine):
    with pytest.raises(ColibriError, match="nothing to embed"):
        demo_engine.embed([])
    with pytest.raises(ColibriError, match="1025 tokens to embed; this model's context is 1024"):
        demo_engine.embed([5] * 1025)
    with pytest.raises(ColibriError, match="not in this model's vocabulary"):
        demo_engine.embed([demo_engine.model.vocab_size])
    with demo_engine.batch():
        with pytest.raises(ColibriError, match="already generating"):
            demo_engine.embed([5, 6])


def test_an_architecture_without_one_hidden_state_per_token_is_refused(demo_engine):
    """A plugin that records no layer output, or one of several streams a token (DeepSeek-V4's
    hyper-connections: T·n rows), has nothing to pool: one line naming the plugin."""
    from colibri_core.probe import Recorder

    none, streams = Recorder(), Recorder()
    streams.add(3, {"l_out": np.zeros((8, 192), np.float32)})  # 4 tokens, 2 streams each
    with pytest.raises(ColibriError, match=r"plugin colibri-olmoe .*: olmoe records no layer output"):
        demo_engine._last_layer_output(none, 4)
    with pytest.raises(ColibriError, match=r"olmoe gives no embeddings: its layers' output is \(8, 192\) for 4 tokens"):
        demo_engine._last_layer_output(streams, 4)


# ---- the endpoint ---------------------------------------------------------------------------------------
def test_openai_client_floats_are_the_engines_bits(demo_client, demo_engine):
    r = demo_client.embeddings.create(model=demo_client.models.list().data[0].id, input=TEXTS, encoding_format="float")
    want = embeds(demo_engine, TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list" and r.data[0].object == "embedding"
    for d, w in zip(r.data, want):
        assert np.array_equal(np.asarray(d.embedding, np.float32), w)
    n = sum(len(demo_engine.tokenizer.encode(t)) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n
    assert r.model == demo_client.models.list().data[0].id


def test_openai_client_base64_default_and_token_ids(demo_client, demo_engine):
    """The client asks for base64 unless told otherwise and decodes it (asked for by name, it hands the
    string over); token ids, one list or several."""
    ids = [demo_engine.tokenizer.encode(t) for t in TEXTS]
    want = embeds(demo_engine, TEXTS)
    one = demo_client.embeddings.create(model="colibri-demo-kjv", input=TEXTS[1])
    assert len(one.data) == 1 and np.array_equal(np.asarray(one.data[0].embedding, np.float32), want[1])
    by_ids = demo_client.embeddings.create(model="colibri-demo-kjv", input=ids[2])
    assert np.array_equal(np.asarray(by_ids.data[0].embedding, np.float32), want[2])
    batch = demo_client.embeddings.create(model="colibri-demo-kjv", input=ids, encoding_format="base64")
    for d, w in zip(batch.data, want):
        assert np.array_equal(np.frombuffer(base64.b64decode(d.embedding), "<f4"), w)


def test_base64_is_little_endian_float32(demo_server, demo_engine):
    status, _, raw = post(demo_server.url + "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64",
                                                           "user": "someone"})
    assert status == 200, raw
    data = base64.b64decode(json.loads(raw)["data"][0]["embedding"])
    assert np.array_equal(np.frombuffer(data, "<f4"), embeds(demo_engine, TEXTS[:1])[0])


def test_beside_a_streaming_generation_the_same_bits(demo_server, demo_client, demo_engine):
    """An embedding job joins the batch while a generation streams (its forwards in chunks between the
    generation's steps): its vectors are still the engine's alone, the generation's text unchanged."""
    long = (demo_engine.tokenizer.encode(" ".join(TEXTS)) * 40)[:900]
    body = {"prompt": "And God said", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}  # ~1 s
    status, _, raw = post(demo_server.url + "/v1/completions", body)
    alone = json.loads(raw)["choices"][0]["text"]
    stream = Stream(demo_server.url + "/v1/completions", {**body, "stream": True})
    events = stream.events()
    texts = [json.loads(next(events))["choices"][0]["text"]]  # it is decoding
    r = demo_client.embeddings.create(model="colibri-demo-kjv", input=[long, long[:300]])
    after = [json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]"]
    stream.close()
    assert len(after) > 100, "the generation was over before the embeddings were: nothing ran beside them"
    assert "".join(texts + after) == alone
    assert np.array_equal(np.asarray(r.data[0].embedding, np.float32), demo_engine.embed(long))
    assert np.array_equal(np.asarray(r.data[1].embedding, np.float32), demo_engine.embed(long[:300]))


@pytest.mark.parametrize("body, param, code", [
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": [[]]}, "input[0]", "invalid_value"),
    ({"input": ["Jesus wept.", ""]}, "input[1]", "invalid_value"),
    ({"input": [5] * 1025}, "input[0]", "array_too_long"),
    ({"input": "wept " * 2000}, "input", "context_length_exceeded"),
    ({"input": [[1, 2], [3, 2048]]}, "input[1]", "invalid_value"),
    ({"input": [1, "two"]}, "input[0]", "invalid_type"),
    ({"input": True}, "input", "invalid_type"),
    ({}, "input", "missing_required_parameter"),
    ({"input": "x", "dimensions": 64}, "dimensions", "unsupported_parameter"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"input": "x", "pooling": "cls"}, "pooling", "unsupported_parameter"),
])
def test_malformed_requests_are_400s_naming_the_field(demo_server, body, param, code):
    status, _, raw = post(demo_server.url + "/v1/embeddings", body)
    error = json.loads(raw)["error"]
    assert status == 400 and (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error" and param.split("[")[0] in error["message"]


def test_another_model_is_a_404_and_the_client_raises(demo_client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        demo_client.embeddings.create(model="gpt-4", input="x")
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        demo_client.embeddings.create(model="colibri-demo-kjv", input="x", dimensions=8)
