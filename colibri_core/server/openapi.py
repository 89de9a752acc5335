"""The OpenAPI 3.1 document the server publishes at /openapi.json.

Its request bodies are generated from the very pydantic models the handlers validate with
(schemas.py; in components/schemas, the models' $defs beside them), with this server's limits
(context length, vocabulary, `--max-tokens`) written in, so the document and the checks cannot
drift apart. The paths, the responses and the error body are described here, and the test suite
holds the server to them (schemathesis: tests/test_server_schema.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .. import __version__ as VERSION
from . import schemas
from .embeddings import EmbeddingBody

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {**{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                        "prompt_tokens_details": {  # prompt tokens the prefix cache served (colibri_core/prefix.py)
                            "type": "object", "required": ["cached_tokens"],
                            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}},
                        "completion_tokens_details": {  # speculative decoding's drafts, as OpenAI's Predicted Outputs
                            "type": "object", "required": ["accepted_prediction_tokens", "rejected_prediction_tokens"],
                            "properties": {k: {"type": "integer", "minimum": 0}
                                           for k in ("accepted_prediction_tokens", "rejected_prediction_tokens")}}}}
FINISH = {"type": ["string", "null"], "enum": ["stop", "length", None]}
TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name", "arguments"],
        "properties": {"name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
# each token's log-probability (with 'logprobs'; null without): chat's entries, completions' legacy arrays
_TOKEN = {"token": {"type": "string"}, "logprob": {"type": "number", "maximum": 0},
          "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}}
CHAT_LOGPROBS = {"type": ["object", "null"], "required": ["content"], "properties": {
    "content": {"type": "array", "items": {"type": "object", "required": ["token", "logprob", "bytes", "top_logprobs"],
                                          "properties": {**_TOKEN, "top_logprobs": {"type": "array", "items": {
                                              "type": "object", "required": list(_TOKEN), "properties": _TOKEN}}}}},
    "refusal": {"type": "null"}}}
COMPLETION_LOGPROBS = {"type": ["object", "null"],
                       "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                       "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                                      "token_logprobs": {"type": "array", "items": {"type": "number", "maximum": 0}},
                                      "top_logprobs": {"type": "array", "items": {
                                          "type": "object", "additionalProperties": {"type": "number", "maximum": 0}}},
                                      "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}


INDEX = {"type": "integer", "minimum": 0, "maximum": schemas.MAX_CHOICES - 1}  # of a choice (`n`)


def _completion(kind: str) -> dict:
    if kind == "chat":  # with `tools`, the answer may be calls: content null, finish_reason "tool_calls"
        choice = {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
            "index": INDEX, "finish_reason": {**FINISH, "enum": [*FINISH["enum"], "tool_calls"]},
            "logprobs": CHAT_LOGPROBS,
            "message": {"type": "object", "required": ["role", "content"], "properties": {
                "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                "tool_calls": {"type": "array", "items": TOOL_CALL, "minItems": 1}}}}}
    else:
        choice = {"type": "object", "required": ["index", "text", "finish_reason"], "properties": {
            "index": INDEX, "text": {"type": "string"}, "finish_reason": FINISH, "logprobs": COMPLETION_LOGPROBS}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion" if kind == "chat" else "text_completion"},
        "created": {"type": "integer"}, "model": {"type": "string"}, "system_fingerprint": {"type": "null"},
        "choices": {"type": "array", "items": choice, "minItems": 1, "maxItems": schemas.MAX_CHOICES},
        "usage": USAGE}}


MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "max_model_len": {"type": ["integer", "null"]}}}
HEALTH = {"type": "object", "required": ["status", "model"], "properties": {
    "status": {"enum": ["ok", "loading", "error"]}, "model": {"type": "string"}, "error": {"type": ["string", "null"]}}}
TOKENS = {"type": "object", "required": ["tokens", "count", "max_model_len"], "properties": {
    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}, "count": {"type": "integer", "minimum": 0},
    "max_model_len": {"type": ["integer", "null"]}}}
TEXT = {"type": "object", "required": ["content", "prompt"],
        "properties": {"content": {"type": "string"}, "prompt": {"type": "string"}}}
EMBEDDINGS = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"const": "list"}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"], "properties": {
        "object": {"const": "embedding"}, "index": {"type": "integer", "minimum": 0},
        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}},
                                {"type": "string", "description": "base64 of the little-endian float32 vector"}]}}}},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
              "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "total_tokens")}}}}
SSE = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
       "description": "One server-sent event: 'data: {chunk}' (a JSON object 'chat.completion.chunk' or "
       "'text_completion'; 'usage' in a last chunk if asked), the last one 'data: [DONE]'."}

# why each error status happens
WHY = {
    400: "The request is malformed or asks for something outside the bounds (the message names the field).",
    401: "The API key is missing or wrong (send 'Authorization: Bearer KEY').",
    403: "A foreign web page (Origin) or host name (Host) that --allow-origin does not allow.",
    404: "No such model (or endpoint).",
    408: "The request body did not arrive in time.",
    413: "The request body is larger than the server accepts.",
    429: "The queue is full: retry after Retry-After seconds.",
    503: "The model is still loading (or failed to load).",
}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict:
    out = {}
    for s in statuses:
        r = _json({"$ref": "#/components/schemas/Error"}, WHY[s])
        if s == 429:
            r["headers"] = {"Retry-After": {"schema": {"type": "string"}, "required": True,
                                            "description": "Seconds until a queue slot is likely free."}}
        out[str(s)] = r
    return out


def _op(summary: str, responses: dict, *, errors=(), secured=True, params: list | None = None,
        key: bool = False) -> dict:
    op = {"summary": summary, "responses": {**responses, **_errors(*errors, 403, *((401,) if key and secured else ()))}}
    if params:
        op["parameters"] = params
    if not secured:
        op["security"] = []
    return op


@dataclass(frozen=True)
class Post:
    """A route that takes a JSON body, validated by the pydantic model `body`; `ok` is its 200
    response (an OpenAPI response object)."""

    path: str
    summary: str
    body: type[BaseModel]
    ok: dict
    errors: tuple[int, ...] = (400, 404, 503)


def _streamed(kind: str, what: str) -> dict:
    return {"description": f"{what} (JSON), or its stream (\"stream\": true).", "content": {
        "application/json": {"schema": _completion(kind)}, "text/event-stream": {"schema": SSE}}}


# the routes with a request body, one line each (the models' schemas are generated)
POSTS = [
    Post("/v1/chat/completions", "Chat, with the model's own chat template.", schemas.ChatBody,
         _streamed("chat", "The answer"), (400, 404, 429, 503)),
    Post("/v1/completions", "Completion of a prompt (text or token ids).", schemas.CompletionBody,
         _streamed("completion", "The completion"), (400, 404, 429, 503)),
    Post("/tokenize", "Text, or a conversation through the chat template, to token ids.", schemas.TokenizeBody,
         _json(TOKENS, "The token ids.")),
    Post("/detokenize", "Token ids to text.", schemas.DetokenizeBody, _json(TEXT, "The text.")),
    Post("/v1/embeddings", "Mean-pooled final hidden states of texts or token ids.", EmbeddingBody,
         _json(EMBEDDINGS, "One embedding per input, in order."), (400, 404, 429, 503)),
]


@functools.cache
def _body_schemas(models: tuple[type[BaseModel], ...]) -> tuple[dict, dict]:
    """Each model's reference, and the schemas they refer to (as the models declare them: the
    bounds of a server are written in by `schemas.limited`)."""
    refs, top = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    return {m: refs[m, "validation"] for m in models}, top["$defs"]


def document(lim: schemas.Limits, *, model_id: str, api_key: bool, dashboard: bool) -> dict:
    """The OpenAPI 3.1 document of a server with these limits (and key, and dashboard)."""
    k = dict(key=api_key)
    refs, defs = _body_schemas(tuple(p.body for p in POSTS))
    paths = {p.path: {"post": {**_op(p.summary, {"200": p.ok}, errors=(*p.errors, 408, 413), **k), "requestBody": {
        "required": True, "content": {"application/json": {"schema": refs[p.body]}}}}} for p in POSTS}
    paths |= {
        "/health": {"get": _op("503 while the model loads, then 200.", {
            "200": _json(HEALTH, "The model is loaded."), "503": _json(HEALTH, "Loading, or failed to load.")},
            secured=False)},
        "/v1/models": {"get": _op("The one model this server serves.", {"200": _json({
            "type": "object", "required": ["object", "data"], "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": MODEL}}}, "The model list.")}, **k)},
        "/v1/models/{model}": {"get": _op("One model, by id.", {"200": _json(MODEL, "The model.")}, errors=(404,),
                                          params=[{"name": "model", "in": "path", "required": True,
                                                   "schema": {"type": "string"}}], **k)},
        "/metrics": {"get": _op("Prometheus text exposition (colibri_ prefix).", {"200": {
            "description": "The metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}}}, **k)},
        "/api/stats": {"get": _op("What the dashboard shows: queue, timings, memory, recent turns.",
                                  {"200": _json({"type": "object"}, "The figures.")}, errors=(400,), **k,
                                  params=[{"name": "since", "in": "query", "required": False,
                                           "schema": {"type": "number"},
                                           "description": "Only history samples after this time (seconds since the epoch)."}])},
        "/api/brain": {"get": _op("The expert map: every (layer, expert) with its tier and routing heat.",
                                  {"200": _json({"type": "object"}, "The map (or {'unchanged': true}).")},
                                  errors=(503,), **k,
                                  params=[{"name": "since", "in": "query", "required": False,
                                           "schema": {"type": "string"},
                                           "description": "The 'passes' of the map the caller has."}])},
        "/api/atlas": {"get": _op("The Atlas: per expert its layer, index, 3D position, topic shares, heat and tier "
                                  "(from `colibri atlas`).", {"200": _json({"type": "object"}, "The atlas.")},
                                  errors=(404, 503), **k)},
        "/openapi.json": {"get": _op("This document.", {"200": _json({"type": "object"}, "OpenAPI 3.1.")}, **k)},
    }
    if dashboard:
        paths["/"] = {"get": _op("The dashboard.", {"200": {"description": "The page.", "content": {
            "text/html": {"schema": {"type": "string"}}}}} | ({"401": {"description": "The login form.", "content": {
                "text/html": {"schema": {"type": "string"}}}}} if api_key else {}), secured=False)}
        paths["/atlas"] = {"get": _op("The dashboard's Atlas page: every expert as a 3D galaxy by routing affinity.",
                                      {"200": {"description": "The page.", "content": {
                                          "text/html": {"schema": {"type": "string"}}}}}, **k)}
        paths["/static/{file}"] = {"get": _op("The dashboard's script and style.", {
            "200": {"description": "The file.", "content": {"text/css": {"schema": {"type": "string"}},
                                                            "text/javascript": {"schema": {"type": "string"}},
                                                            "text/html": {"schema": {"type": "string"}}}}},
            errors=(404,), params=[{"name": "file", "in": "path", "required": True, "schema": {"type": "string"}}], **k)}
    else:
        paths["/"] = {"get": _op("What this server serves.", {"200": _json({"type": "object"}, "Name, model, endpoints.")}, **k)}
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "colibri", "version": VERSION,
                 "description": f"OpenAI-compatible API of a colibri server serving '{model_id}'. Bounds: "
                                f"request bodies ≤ {lim.max_body_bytes} bytes, JSON nested ≤ {schemas.MAX_DEPTH} deep, "
                                f"text ≤ {lim.max_chars} characters, ≤ {schemas.MAX_STOP} stop strings of "
                                f"≤ {schemas.MAX_STOP_CHARS} characters, max_tokens ≤ {lim.tokens_cap or 'the context'}."},
        "paths": paths,
        "components": {"schemas": {**schemas.limited(defs, lim), "Error": ERROR}},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
