"""OpenAI request bodies, checked field by field; anything wrong is an `ApiError` (a 4xx with the
OpenAI error body), never a 500.

What is accepted follows the OpenAI API and its common local extensions (vLLM: `top_k`,
`ignore_eos`); sampling knobs the engine does not implement (penalties, logit bias, log
probabilities, several choices) are accepted only at their neutral value and refused otherwise,
so a client never silently gets something other than what it asked for. Fields nobody here
knows are ignored, as vLLM and llama-server do.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16  # stop strings per request


class ApiError(Exception):
    """An HTTP error with the OpenAI body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_kind(body)}", code="invalid_json")
    return body


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


# ---- typed field readers: absent or null gives the default ------------------------------------
def get_int(body: dict, name: str, default=None, *, low: int | None = None, high: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(name, f"'{name}' must be an integer, not {_kind(v)}", "invalid_type")
    if low is not None and v < low:
        raise invalid(name, f"'{name}' must be at least {low}, got {v}")
    if high is not None and v > high:
        raise invalid(name, f"'{name}' must be at most {high}, got {v}")
    return v


def get_float(body: dict, name: str, default=None, *, low: float, high: float, low_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"'{name}' must be a number, not {_kind(v)}", "invalid_type")
    if v < low or (low_open and v == low) or v > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise invalid(name, f"'{name}' must be in {interval}, got {v}")
    return float(v)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean, not {_kind(v)}", "invalid_type")
    return v


def get_str(body: dict, name: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid(name, f"'{name}' must be a string, not {_kind(v)}", "invalid_type")
    return v


def neutral(body: dict, name: str, value, what: str) -> None:
    """Refuse a knob the engine does not implement unless it is at its neutral `value` (or absent)."""
    v = body.get(name)
    if v is None or v == value or (isinstance(value, dict) and v == {}):
        return
    raise invalid(name, f"'{name}' is not supported by colibri ({what})", "unsupported_parameter")


# ---- what both endpoints share ------------------------------------------------------------------
@dataclass
class Sampling:
    """One generation request, as the worker runs it."""

    model: str | None  # the model id asked for (None: the one model)
    max_tokens: int | None  # None: up to the context length (or generation_config's max_new_tokens)
    temperature: float | None  # None: generation_config.json's default, else 1.0
    top_p: float | None
    top_k: int | None  # 0 = no top-k cut
    seed: int | None
    stop: list[str] = field(default_factory=list)  # stop strings, never part of the output
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    ignore_eos: bool = False  # vLLM extension: keep generating past end-of-sequence tokens


def parse_sampling(body: dict, max_tokens_names=("max_tokens",)) -> Sampling:
    model = get_str(body, "model")
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = get_int(body, name, max_tokens, low=1)
    top_k = get_int(body, "top_k", None, low=-1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid("stop", f"'stop' must be a string or an array of strings, not {_kind(stop)}", "invalid_type")
    if len(stop) > MAX_STOP:
        raise invalid("stop", f"'stop' holds {len(stop)} strings; at most {MAX_STOP} are allowed")
    if any(s == "" for s in stop):
        raise invalid("stop", "'stop' strings must not be empty")
    stream = get_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", f"'stream_options' must be an object, not {_kind(options)}", "invalid_type")
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    get_int(body, "n", 1, low=1, high=1)
    neutral(body, "presence_penalty", 0, "only 0")
    neutral(body, "frequency_penalty", 0, "only 0")
    neutral(body, "repetition_penalty", 1, "only 1")
    neutral(body, "min_p", 0, "only 0")
    neutral(body, "logit_bias", {}, "only an empty map")
    return Sampling(
        model=model,
        max_tokens=max_tokens,
        temperature=get_float(body, "temperature", low=0.0, high=2.0),
        top_p=get_float(body, "top_p", low=0.0, high=1.0, low_open=True),
        top_k=None if top_k is None else max(top_k, 0),  # vLLM's -1 means "no cut", as 0 does here
        seed=get_int(body, "seed"),
        stop=stop,
        stream=stream,
        include_usage=bool(options and get_bool(options, "include_usage")),
        ignore_eos=get_bool(body, "ignore_eos"),
    )


# ---- POST /v1/chat/completions ------------------------------------------------------------------
@dataclass
class ChatRequest:
    sampling: Sampling
    messages: list[dict]  # role + content (a string) + whatever else the template may read
    tools: list | None


def _text_content(content, where: str) -> str:
    """A message's content as text: a string, or an array of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(where, f"'{where}' parts must be objects with a 'type'", "invalid_type")
            if part["type"] != "text":
                raise invalid(where, f"'{where}' holds a part of type {part['type']!r}; this model takes text only",
                              "unsupported_content")
            if not isinstance(part.get("text"), str):
                raise invalid(where, f"'{where}' text parts need a string 'text'", "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(where, f"'{where}' must be a string or an array of content parts, not {_kind(content)}",
                  "invalid_type")


def parse_chat(body: dict) -> ChatRequest:
    sampling = parse_sampling(body, ("max_tokens", "max_completion_tokens"))
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid("messages", f"'messages' must be an array, not {_kind(messages)}", "invalid_type")
    if not messages:
        raise invalid("messages", "'messages' must hold at least one message")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"'{where}' must be an object, not {_kind(m)}", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise invalid(f"{where}.content", f"'{where}.content' is required", "missing_required_parameter")
        out.append({**m, "content": "" if content is None else _text_content(content, f"{where}.content")})
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools", f"'tools' must be an array, not {_kind(tools)}", "invalid_type")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise invalid("tool_choice", "'tool_choice' may be 'auto' or 'none': colibri cannot force a tool call",
                      "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid("response_format", "'response_format' may only be {\"type\": \"text\"}: structured output "
                      "is not supported", "unsupported_parameter")
    neutral(body, "logprobs", False, "log probabilities are not returned")
    neutral(body, "top_logprobs", 0, "log probabilities are not returned")
    return ChatRequest(sampling, out, tools or None)


# ---- POST /v1/completions -----------------------------------------------------------------------
@dataclass
class CompletionRequest:
    sampling: Sampling
    prompt: str | list[int]  # text, or token ids
    echo: bool  # put the prompt before the completion


def parse_completion(body: dict) -> CompletionRequest:
    sampling = parse_sampling(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("prompt", "'prompt' must not be empty")
        if all(isinstance(p, (str, list)) for p in prompt):
            raise invalid("prompt", f"'prompt' holds {len(prompt)} prompts; send one per request", "unsupported_parameter")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise invalid("prompt", "'prompt' must be a string, an array of token ids, or a batch of one of these",
                          "invalid_type")
    elif not isinstance(prompt, str):
        raise invalid("prompt", f"'prompt' must be a string or an array of token ids, not {_kind(prompt)}", "invalid_type")
    neutral(body, "suffix", "", "no fill-in-the-middle")
    neutral(body, "best_of", 1, "only 1")
    neutral(body, "logprobs", 0, "log probabilities are not returned")
    return CompletionRequest(sampling, prompt, get_bool(body, "echo"))
