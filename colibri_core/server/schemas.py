"""OpenAI request bodies as pydantic models, and what the handlers get from them.

The models check a body field by field and are the JSON Schema of the OpenAPI document the server
publishes (openapi.py generates it from them), so nothing is described twice. Anything wrong is an
`ApiError`: a 4xx with OpenAI's error body whose `param` names the field (`messages[2].content`),
never a 500; `validate` turns pydantic's first error into that one line.

What is accepted follows the OpenAI API and its common local extensions (vLLM's `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`; llama-server's `repeat_penalty`, `repeat_last_n`, `grammar`);
knobs the engine does not implement (llama-server's mirostat, DRY, XTC, …) are accepted only at
their neutral value (`neutral`), and a field the generation bodies do not declare is a 400 naming
it (extra="forbid"), so a client never silently gets something other than what it asked for. Every
optional field may be null, which means "the default".

Kept by hand, because pydantic does not say them: parsing the body (its depth, lone surrogates:
`parse_json`); the bounds that depend on the model served (`Limits`: its context, vocabulary, the
operator's `--max-tokens`), checked against the Limits given as validation context (`AtMost`,
`InVocabulary`) and written into the published schema by `limited`; the rules across fields
(stream_options only with stream, two names of one penalty, …); the conversion to the worker's
`Sampling` and structured output's `Structure`.
"""
import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar, Union, get_args

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PlainValidator,
                      Tag, ValidationError, ValidationInfo, WithJsonSchema, field_validator, model_validator)
from pydantic_core import PydanticCustomError, PydanticKnownError, core_schema

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = get_args(Role)
MAX_CHOICES = 8  # OpenAI's n: choices per request
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 512  # characters per stop string
MAX_DEPTH = 32  # nesting of arrays and objects in a request body
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's own limit
MAX_NAME = 512  # characters of a model id, a message's name, a tool call id
MAX_FUNCTION_NAME = 64  # OpenAI's limit on a function's name
CHARS_PER_TOKEN = 32  # text beyond this many characters per token of context is refused untokenized
MAX_LOGPROBS = 20  # most likely tokens listed with each token's log-probability (vLLM's default bound)
MAX_BIAS = 100  # |logit_bias| (OpenAI's bound)
# what to send instead of a field the generation bodies do not know
HINTS = {
    "functions": "use 'tools'", "function_call": "use 'tool_choice'",
    "n_probs": "use 'logprobs' (and 'top_logprobs' on chat)", "n_predict": "use 'max_tokens'",
    "json_schema": "use 'response_format' {\"type\": \"json_schema\", ...}",
    "penalize_nl": "colibri's penalties count every token, newlines too",
}


class ApiError(Exception):
    """An HTTP error with the OpenAI body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What one server accepts; the parts known only once the model is loaded are None before."""

    context: int | None = None  # the model's context length, in tokens
    vocab: int | None = None  # token ids are in [0, vocab)
    max_tokens: int | None = None  # the operator's cap on tokens generated per request (None: the context)
    max_body_bytes: int = 16 << 20

    @property
    def tokens_cap(self) -> int | None:
        caps = [c for c in (self.context, self.max_tokens) if c is not None]
        return min(caps) if caps else None

    @property
    def max_chars(self) -> int:
        """Characters of text one request may carry: CHARS_PER_TOKEN per token of context (text
        that long cannot fit, and tokenizing it would only cost time and memory)."""
        return CHARS_PER_TOKEN * self.context if self.context else self.max_body_bytes

    @property
    def max_token_ids(self) -> int:
        return self.context or (1 << 17)

    @property
    def token_id_max(self) -> int | None:
        return self.vocab - 1 if self.vocab else None


# ---- parsing the body: JSON, bounded ----------------------------------------------------------
def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object: strict JSON (no NaN or Infinity), nested at most
    MAX_DEPTH deep, every string valid Unicode (no lone surrogates)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, a number of more than 4300 digits
        raise ApiError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_kind(body)}", code="invalid_json")
    check_tree(body)
    return body


def check_tree(body) -> None:
    """Depth and Unicode of a whole parsed body, without recursion."""
    stack = [(body, 1, "")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _check_unicode(v, where)
        elif isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep",
                               code="invalid_json", param=where or None)
            if isinstance(v, dict):
                for k, child in v.items():
                    path = f"{where}.{k}" if where else k
                    _check_unicode(k, path)
                    stack.append((child, depth + 1, path))
            else:
                stack += [(child, depth + 1, f"{where}[{i}]") for i, child in enumerate(v)]


def _check_unicode(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold the surrogate itself
        raise invalid(where or None, f"'{where}' is not valid Unicode: a lone surrogate "
                      f"U+{ord(s[e.start]):04X} at character {e.start}", "invalid_unicode") from None


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


# ---- the field types -------------------------------------------------------------------------------
def _refusal(code: str, text: str) -> PydanticCustomError:
    """An error of ours: `code` is the OpenAI error code, `text` follows the field's name."""
    return PydanticCustomError(code, "{text}", {"text": text})


def _integral(v):
    return int(v) if type(v) is float and v.is_integer() else v


def integer(ge: int | None = None, le: int | None = None):
    """A JSON integer: 5.0 is one (as in JSON Schema), true and "5" are not."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


def number(ge: float | None = None, le: float | None = None, gt: float | None = None):
    """A finite JSON number (an integer is one)."""
    return Annotated[float, Field(ge=ge, le=le, gt=gt)]


@dataclass(frozen=True)
class AtMost:
    """A bound set by the model served: `limit` names a Limits property, None meaning no bound.
    Checked before the type against the Limits given as validation context (`validate`), as a
    string's length, an array's length or an integer's value; in the JSON Schema a placeholder
    {"x-limit": limit} that `limited` replaces with maxLength, maxItems or maximum."""

    limit: str

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.with_info_before_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler):
        return {**handler(schema), "x-limit": self.limit}

    def check(self, v, info: ValidationInfo):
        bound = getattr(info.context, self.limit)
        if bound is None:
            return v
        if isinstance(v, str) and len(v) > bound:
            raise PydanticKnownError("string_too_long", {"max_length": bound})
        if isinstance(v, list) and len(v) > bound:
            raise PydanticKnownError("too_long", {"field_type": "List", "max_length": bound, "actual_length": len(v)})
        if type(v) in (int, float) and v > bound:
            raise PydanticKnownError("less_than_equal", {"le": bound})
        return v


class InVocabulary:
    """Token ids of the model served, checked as one list (a wrong id names the list: a prompt of
    thousands of ids is checked by min and max, not id by id)."""

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.with_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler):
        s = handler(schema)
        return {**s, "items": {**s["items"], "x-limit": "token_id_max"}}

    @staticmethod
    def check(ids: list[int], info: ValidationInfo) -> list[int]:
        high = info.context.token_id_max
        if high is not None and ids and max(ids) > high:
            raise _refusal("invalid_value", f"holds token id {max(ids)}, outside this model's vocabulary (0 … {high})")
        return ids


def neutral(value, what: str):
    """A knob colibri does not implement: accepted only at its neutral value (1.0 for 1; not true)."""
    def check(v):
        numbers = (int, float)
        same_kind = type(v) is type(value) or (type(v) in numbers and type(value) in numbers)
        if not same_kind or v != value:
            raise _refusal("unsupported_parameter", f"is not supported by colibri ({what})")
        return v

    return Annotated[Any, PlainValidator(check), WithJsonSchema({"const": value}),
                     Field(description=f"Not supported: accepted only as {json.dumps(value)} ({what}).")]


def refusing(*choices: str, why: str):
    """A string OpenAI allows more values of than colibri: another value is refused, saying why."""
    def check(v: str) -> str:
        if v not in choices:
            raise _refusal("unsupported_parameter", f"may be {' or '.join(map(repr, choices))}: {why}")
        return v

    return Annotated[str, AfterValidator(check), WithJsonSchema({"type": "string", "enum": list(choices)})]


KINDS = {str: "string", list: "array", dict: "object"}
KIND_NAMES = {"string": "a string", "array": "an array", "object": "an object"}


def by_kind(**options):
    """A value of one of several JSON kinds (string=, array=, object=), each checked by its own
    type; another kind is a 400 listing them. Pydantic's error locations hold the kind (a union's
    tag), which `_param` leaves out."""
    names = " or ".join(KIND_NAMES[k] for k in options)
    return Annotated[Union[tuple(Annotated[t, Tag(k)] for k, t in options.items())],
                     Discriminator(lambda v: KINDS.get(type(v)), custom_error_type="invalid_type",
                                   custom_error_message=f"must be {names}")]


Text = Annotated[str, AtMost("max_chars")]
Name = Annotated[str, Field(max_length=MAX_NAME)]
FunctionName = Annotated[str, Field(min_length=1, max_length=MAX_FUNCTION_NAME)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
MaxTokens = Annotated[integer(ge=1), AtMost("tokens_cap")]
_Ids = list[integer(ge=0)]
TokenIds = Annotated[_Ids, Field(min_length=1), AtMost("max_token_ids"), InVocabulary(),
                     Field(description="Token ids of this model's vocabulary.")]


def _token_keys(bias: dict[str, float], info: ValidationInfo) -> dict[int, float]:
    high = info.context.token_id_max
    for key in bias:
        if not (key.isascii() and key.isdigit()) or (high is not None and int(key) > high):
            raise _refusal("invalid_value", f"names {key!r}, not a token id" + (
                f" of this model's vocabulary (0 … {high})" if high is not None else ""))
    return {int(key): b for key, b in bias.items()}


LogitBias = Annotated[dict[str, number(-MAX_BIAS, MAX_BIAS)], AfterValidator(_token_keys), Field(
    json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}},
    description="Token id (a string) → bias from -100 to 100 added to the token's logit before sampling.")]


def _unbatch(v):
    """A completion prompt sent as a batch of exactly one prompt: that prompt."""
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        if len(v) > 1:
            raise _refusal("unsupported_parameter", f"holds {len(v)} prompts; send one per request")
        return v[0]
    return v


Prompt = Annotated[by_kind(string=Text, array=TokenIds), BeforeValidator(_unbatch, json_schema_input_type=Union[
    Text, TokenIds, Annotated[list[Text], Field(min_length=1, max_length=1)],
    Annotated[list[TokenIds], Field(min_length=1, max_length=1)]])]


# ---- the models ------------------------------------------------------------------------------------
class Body(BaseModel):
    """A request body: a field it does not declare is a 400 naming it; JSON's types exactly (no
    "5" for 5, no true for 1); finite numbers."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Part(BaseModel):
    """An object inside a body: fields it does not declare are let through (a message's go to the
    chat template as sent)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(Part):
    type: Literal["text"] = Field(description="Only text: this model reads text.")
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, dict) and isinstance(v.get("type"), str) and v["type"] != "text":
            raise _refusal("unsupported_content", f"is a part of type {v['type']!r}; this model takes text only")
        return v


class Message(Part):
    """A chat message: a role, and content (which an assistant message may leave out, as when it
    only calls tools); other fields go to the chat template as sent."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]})

    role: Role
    content: by_kind(string=Text, array=Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)]) | None = Field(
        None, validate_default=True, description="The message's text, or an array of text parts (joined).")
    name: Name | None = None
    tool_calls: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, v, info: ValidationInfo):
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticKnownError("missing")
        return v

    @property
    def text(self) -> str:
        c = self.content
        return "" if c is None else c if isinstance(c, str) else "".join(p.text for p in c)


class Function(Part):
    name: FunctionName = Field(description="Letters, digits, '_', '-' or '.'.")
    description: Text | None = None
    parameters: dict | None = Field(None, description="The arguments' JSON schema; a call's arguments always follow it.")
    strict: bool | None = Field(None, description="Accepted: arguments always follow 'parameters'.")


class Tool(Part):
    type: refusing("function", why="only function tools are supported")
    function: Function


class NamedFunction(Part):
    name: FunctionName


class ToolChoiceFunction(Part):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Part):
    name: Annotated[str, Field(max_length=MAX_FUNCTION_NAME)] | None = None
    description: Text | None = None
    schema_: dict | None = Field(None, alias="schema", description="The JSON schema the answer is valid against.")
    strict: bool | None = Field(None, description="Accepted: the answer always follows the schema.")


class ResponseFormat(Part):
    """'json_object': the answer is a JSON object; 'json_schema': JSON valid against
    json_schema.schema (enforced token by token)."""

    model_config = ConfigDict(json_schema_extra={"allOf": [{
        "anyOf": [{"properties": {"type": {"enum": ["text", "json_object"]}}},
                  {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}],
        "description": "'json_schema' with type 'json_schema'."}]})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Part):
    include_usage: bool | None = Field(None, description="A last chunk with 'usage'.")


def _read_with(knob: str):
    return Field(None, description=f"Accepted: read only with '{knob}', which colibri does not do.")


class LlamaServerKnobs(Body):
    """llama-server's knobs that colibri does not have, accepted at the neutral values its clients
    send, and the settings that only they read (which then change nothing, as in llama-server)."""

    typical_p: neutral(1, "no locally typical sampling") | None = None
    tfs_z: neutral(1, "no tail-free sampling") | None = None
    top_n_sigma: neutral(-1, "no top-n-sigma sampling") | None = None
    min_keep: neutral(0, "every cut keeps at least the most likely token") | None = None
    mirostat: neutral(0, "no mirostat") | None = None
    mirostat_tau: number(-1e9, 1e9) | None = _read_with("mirostat")
    mirostat_eta: number(-1e9, 1e9) | None = _read_with("mirostat")
    dynatemp_range: neutral(0, "no dynamic temperature") | None = None
    dynatemp_exponent: number(-1e9, 1e9) | None = _read_with("dynatemp_range")
    dry_multiplier: neutral(0, "no DRY sampling") | None = None
    dry_base: number(-1e9, 1e9) | None = _read_with("dry_multiplier")
    dry_allowed_length: number(-1e9, 1e9) | None = _read_with("dry_multiplier")
    dry_penalty_last_n: number(-1e9, 1e9) | None = _read_with("dry_multiplier")
    dry_sequence_breakers: Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                                     Field(max_length=MAX_STOP)] | None = _read_with("dry_multiplier")
    xtc_probability: neutral(0, "no XTC sampling") | None = None
    xtc_threshold: number(-1e9, 1e9) | None = _read_with("xtc_probability")
    id_slot: neutral(-1, "one slot: the server's queue") | None = None
    n_keep: integer(-1, (1 << 31) - 1) | None = Field(None, description="Accepted: colibri never shifts the context "
                                                      "(a prompt and max_tokens past it are a 400).")
    cache_prompt: bool | None = Field(None, description="Accepted: the prefix cache serves a repeated prefix always, "
                                      "bit for bit as a cold prefill would.")


class SamplingFields(LlamaServerKnobs):
    """The fields of both generation bodies that say how to sample."""

    model_config = ConfigDict(json_schema_extra={"allOf": [{
        "anyOf": [{"properties": {"stream": {"const": True}}, "required": ["stream"]},
                  {"properties": {"stream_options": {"type": "null"}}}],
        "description": "'stream_options' only with 'stream': true."}]})

    model: Name | None = Field(None, description="The model id (GET /v1/models); absent: the one model.")
    max_tokens: MaxTokens | None = Field(None, description="Most tokens to generate; absent: up to the context (or "
                                         "the model's generation_config max_new_tokens).")
    temperature: number(0.0, 2.0) | None = Field(None, description="0: greedy (as are values below 1e-5); absent: "
                                                 "generation_config.json's, else 1.")
    top_p: number(le=1.0, gt=0.0) | None = Field(None, description="Nucleus sampling; absent: generation_config.json's, "
                                                 "else 1.")
    top_k: integer(-1, (1 << 31) - 1) | None = Field(  # below 2**31, as engine.check_sampling bounds it
        None, description="vLLM's extension: the k most likely tokens; 0 or -1: no cut (as is a k past the vocabulary).")
    seed: integer(-(1 << 63), (1 << 64) - 1) | None = Field(None, description="Seed of the sampler: the same seed, the "
                                                            "same answer; -1 (or absent): random. A negative seed is "
                                                            "taken modulo 2**64.")
    stop: by_kind(string=StopString, array=Annotated[list[StopString], Field(max_length=MAX_STOP)]) | None = Field(
        None, description="Strings that end the answer; never part of it.")
    stream: bool | None = Field(None, description="Answer as server-sent events (text/event-stream), ending "
                                "'data: [DONE]'.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(None, description="vLLM's extension: keep generating past end-of-sequence tokens.")
    n: integer(1, MAX_CHOICES) | None = Field(None, description=f"How many choices to generate (at most {MAX_CHOICES}); "
                                              "absent: 1.")
    presence_penalty: number(-2.0, 2.0) | None = Field(None, description="Subtracted from the logit of every token the "
                                                       "answer holds (OpenAI's).")
    frequency_penalty: number(-2.0, 2.0) | None = Field(None, description="Subtracted from a token's logit once per "
                                                        "time the answer holds it (OpenAI's).")
    repetition_penalty: number(0.01, 100.0) | None = Field(None, description="vLLM's: a token of the prompt or the "
                                                           "answer has its logit divided by it (if positive) or "
                                                           "multiplied (if not); 1: none; absent: "
                                                           "generation_config.json's, else 1.")
    repeat_penalty: number(0.01, 100.0) | None = Field(None, description="llama-server's name of 'repetition_penalty'.")
    repeat_last_n: integer(-1, (1 << 31) - 1) | None = Field(None, description="llama-server's: every penalty counts "
                                                             "only the last N tokens of prompt and answer (-1: all of "
                                                             "them; 0: no penalty).")
    min_p: number(0.0, 1.0) | None = Field(None, description="Only tokens at least this fraction as likely as the most "
                                           "likely one; absent: generation_config.json's, else 0.")
    logit_bias: LogitBias | None = None
    user: Name | None = Field(None, description="Accepted and ignored.")


class StructureFields(Body):
    """The fields that constrain the answer (structured.py), in both generation bodies."""

    response_format: ResponseFormat | None = None
    grammar: Annotated[Text, Field(min_length=1)] | None = Field(None, description="llama-server's extension: a GBNF "
                                                                 "or Lark grammar the answer follows (not with "
                                                                 "response_format json or tools).")


class ChatBody(SamplingFields, StructureFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] = Field(
        description="The conversation, rendered by the model's chat template.")
    max_completion_tokens: MaxTokens | None = Field(None, description="The newer name of 'max_tokens' (wins over it).")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Functions the model may call: passed to the chat template (or described in a system "
                          "message if it ignores them); calls come back as 'tool_calls'.")
    tool_choice: by_kind(string=Literal["none", "auto", "required"], object=ToolChoiceFunction) | None = Field(
        None, description="'auto' (the default with tools): text or calls; 'required': calls; a named function: one "
                          "call of it; 'none': text.")
    parallel_tool_calls: bool | None = Field(None, description="More than one call in an answer (default true).")
    logprobs: bool | None = Field(None, description="Each token's log-probability in choices[].logprobs.content: the "
                                  "model's own distribution, before bias, penalties, temperature and cuts (vLLM's "
                                  "default).")
    top_logprobs: integer(0, MAX_LOGPROBS) | None = Field(None, description="With 'logprobs': the most likely tokens "
                                                          "listed at each position.")
    store: neutral(False, "no stored completions") | None = None
    metadata: dict | None = Field(None, description="Accepted and ignored (it describes stored completions).")
    modalities: Annotated[list[refusing("text", why="this model writes text only")], Field(max_length=1)] | None = \
        Field(None, description="Only [\"text\"].")
    service_tier: refusing("auto", "default", why="one tier") | None = None
    prompt_cache_key: Name | None = Field(None, description="Accepted: the prefix cache finds a shared prefix by its "
                                          "tokens.")
    safety_identifier: Name | None = Field(None, description="Accepted and ignored.")


class CompletionBody(SamplingFields, StructureFields):  # structure: vLLM's and llama-server's extensions
    """POST /v1/completions."""

    prompt: Prompt = Field(description="The text to complete, its token ids, or a batch of exactly one of these.")
    echo: bool | None = Field(None, description="Put the prompt before the completion.")
    suffix: neutral("", "no fill-in-the-middle") | None = None
    best_of: neutral(1, "one choice per request") | None = None
    logprobs: integer(0, MAX_LOGPROBS) | None = Field(
        None, description="Each token's log-probability and this many most likely tokens' (tokens, token_logprobs, "
                          "top_logprobs, text_offset): the model's own distribution, before bias, penalties, "
                          "temperature and cuts (vLLM's default); not with 'echo'.")


class TokenizeBody(Part):
    """POST /tokenize: one of 'content', 'prompt' or 'messages'."""

    model_config = ConfigDict(json_schema_extra={"allOf": [{
        "anyOf": [{"required": ["content"], "properties": {"content": {"type": "string"}}},
                  {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}],
        "description": "One of 'content', 'prompt' or 'messages'."}]})

    model: Name | None = None
    content: Text | None = None
    prompt: Text | None = Field(None, description="The same as 'content' (vLLM's name).")
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = Field(
        None, description="A conversation: rendered by the chat template, then tokenized.")
    add_special_tokens: bool | None = Field(None, description="Add the tokenizer's special tokens (BOS) to 'content' "
                                            "(default true).")
    add_special: bool | None = Field(None, description="llama-server's name of 'add_special_tokens'.")
    add_generation_prompt: bool | None = Field(None, description="With 'messages': end with the assistant's turn "
                                               "opening (default true).")


class DetokenizeBody(Part):
    """POST /detokenize."""

    model: Name | None = None
    tokens: Annotated[_Ids, AtMost("max_token_ids"), InVocabulary()] = Field(
        description="Token ids of this model's vocabulary.")


# ---- validating: pydantic's first error as one OpenAI error ----------------------------------------
M = TypeVar("M", bound=BaseModel)
# pydantic's error types → what the value should have been
TYPES = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
         "list_type": "an array", "dict_type": "an object", "model_type": "an object",
         "model_attributes_type": "an object"}


def validate(model: type[M], body: dict, lim: Limits = Limits()) -> M:
    """`body` as `model`, with the bounds of `lim`; the first thing wrong (a field it does not know
    first) is a 400 naming it."""
    try:
        return model.model_validate(body, context=lim)
    except ValidationError as e:
        first = min(e.errors(include_url=False), key=lambda err: err["type"] != "extra_forbidden")
        raise _api_error(first) from None


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out and part in KIND_NAMES:  # a by_kind union's tag, not a field
            continue
        else:
            out += f".{part}" if out else part
    return out


def _num(x) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _api_error(err: dict) -> ApiError:
    kind, ctx, v = err["type"], err.get("ctx", {}), err["input"]
    p = _param(err["loc"])
    if not p:
        return invalid(None, f"the request body {err['msg']}", "invalid_type")
    code = "invalid_value"
    if kind in TYPES:
        text, code = f"must be {TYPES[kind]}, not {_kind(v)}", "invalid_type"
    elif kind == "invalid_type":  # by_kind's
        text, code = f"{err['msg']}, not {_kind(v)}", kind
    elif kind == "missing":
        text, code = "is required", "missing_required_parameter"
    elif kind == "extra_forbidden":
        text, code = f"is not a field colibri knows: {HINTS.get(p, 'colibri does not support it')}", "unsupported_parameter"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal"):
        bound = {"greater_than_equal": ("at least", "ge"), "greater_than": ("more than", "gt"),
                 "less_than_equal": ("at most", "le")}[kind]
        text = f"must be {bound[0]} {_num(ctx[bound[1]])}, got {_num(v)}"
    elif kind == "finite_number":
        text = f"must be a finite number, got {v}"
    elif kind in ("string_too_short", "too_short"):
        n = ctx["min_length"]
        text = "must not be empty" if n == 1 else f"must hold at least {n} {'characters' if 'string' in kind else 'items'}"
    elif kind == "string_too_long":
        text, code = f"holds {len(v)} characters; at most {ctx['max_length']} are accepted", kind
    elif kind == "too_long":
        text, code = f"holds {len(v)} items; at most {ctx['max_length']} are accepted", "array_too_long"
    elif kind == "literal_error":
        text = f"must be one of {ctx['expected']}, got {v!r}"
    elif kind in ("unsupported_parameter", "unsupported_content", "invalid_value"):  # ours (_refusal)
        text, code = err["msg"], kind
    else:
        text = f"is not valid: {err['msg']}"
    return invalid(p, f"'{p}' {text}", code)


# ---- what the handlers get ----------------------------------------------------------------------------
@dataclass
class Sampling:
    """One generation request, as the worker runs it."""

    model: str | None  # the model id asked for (None: the one model)
    max_tokens: int | None  # None: up to the context length (or generation_config's max_new_tokens)
    temperature: float | None  # None: generation_config.json's default, else 1.0
    top_p: float | None
    top_k: int | None  # 0 = no top-k cut
    seed: int | None  # None: random
    stop: list[str] = field(default_factory=list)  # stop strings, never part of the output
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    ignore_eos: bool = False  # vLLM extension: keep generating past end-of-sequence tokens
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from, for errors that name it
    min_p: float | None = None  # None: generation_config.json's, else 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: generation_config.json's, else 1
    penalty_last_n: int | None = None  # llama-server's repeat_last_n (generate.Sampling); None: vLLM's rule
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # the most likely tokens listed with each token's log-probability; None: none


def _sampling(b: SamplingFields, max_tokens, max_tokens_param: str = "max_tokens",
              logprobs: int | None = None) -> Sampling:
    if b.stream_options is not None and not b.stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    repetition = b.repetition_penalty
    if b.repeat_penalty is not None:
        if repetition is not None and repetition != b.repeat_penalty:
            raise invalid("repeat_penalty", "'repeat_penalty' (llama-server's name) and 'repetition_penalty' differ: "
                          "send one")
        repetition = b.repeat_penalty
    last_n, seed = b.repeat_last_n, b.seed
    return Sampling(
        min_p=b.min_p,
        presence_penalty=b.presence_penalty or 0.0,
        frequency_penalty=b.frequency_penalty or 0.0,
        repetition_penalty=repetition,
        penalty_last_n=None if last_n is None else (1 << 31) - 1 if last_n == -1 else last_n,  # -1: every token
        logit_bias=b.logit_bias or {},
        logprobs=logprobs,
        model=b.model,
        max_tokens=max_tokens,
        temperature=b.temperature,
        top_p=b.top_p,
        top_k=None if b.top_k is None else max(b.top_k, 0),  # vLLM's -1 means "no cut", as 0 does here
        seed=None if seed is None or seed == -1 else seed % (1 << 64),  # -1: random, as llama-server means it
        stop=[b.stop] if isinstance(b.stop, str) else b.stop or [],
        stream=bool(b.stream),
        include_usage=bool(b.stream_options and b.stream_options.include_usage),
        ignore_eos=bool(b.ignore_eos),
        max_tokens_param=max_tokens_param,
    )


def parse_sampling(body: dict, lim: Limits = Limits()) -> Sampling:
    b = validate(SamplingFields, body, lim)
    return _sampling(b, b.max_tokens)


@dataclass
class Structure:
    """What the answer must be (structured.py); all None / "none": free text."""

    response_format: dict | None = None  # {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
    grammar: str | None = None  # GBNF or Lark
    tools: list | None = None  # OpenAI's tools, checked by the model's spec (structured.tool_functions checks more)
    tool_choice: str = "none"  # "none" | "auto" | "required" | a function's name
    parallel_tool_calls: bool = True

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _structure(b: StructureFields, tools: list | None = None, tool_choice=None, parallel: bool | None = None) -> Structure:
    fmt, grammar = b.response_format, b.grammar
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise invalid("response_format.json_schema", "'response_format.json_schema' is required with type 'json_schema'",
                      "missing_required_parameter")
    fmt = None if fmt is None or fmt.type == "text" else fmt.model_dump(by_alias=True)
    if isinstance(tool_choice, ToolChoiceFunction):
        tool_choice = tool_choice.function.name
    if tools and tool_choice is None:
        tool_choice = "auto"  # OpenAI's default with tools
    if tool_choice not in (None, "none", "auto") and not tools:
        raise invalid("tool_choice", f"'tool_choice' {tool_choice!r} needs 'tools'")
    if grammar is not None and (fmt is not None or (tools and tool_choice != "none")):
        raise invalid("grammar", "'grammar' cannot be combined with a JSON 'response_format' or with tools")
    return Structure(fmt, grammar, tools or None, tool_choice or "none", True if parallel is None else parallel)


def _template_messages(sent: list[dict], checked: list[Message]) -> list[dict]:
    """The messages as sent (every field the template may read), each with its content as one string."""
    return [{**m, "content": c.text} for m, c in zip(sent, checked)]


@dataclass
class ChatRequest:
    sampling: Sampling
    messages: list[dict]  # role + content (a string) + whatever else the template may read
    tools: list | None
    structure: Structure = field(default_factory=Structure)
    n: int = 1  # choices to generate


def parse_chat(body: dict, lim: Limits = Limits()) -> ChatRequest:
    b = validate(ChatBody, body, lim)
    param = "max_completion_tokens" if b.max_completion_tokens is not None else "max_tokens"
    tools = body["tools"] if b.tools else None  # as sent (checked): the template sees every field it was given
    structure = _structure(b, tools, b.tool_choice, b.parallel_tool_calls)
    if b.top_logprobs is not None and not b.logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    logprobs = (b.top_logprobs or 0) if b.logprobs else None
    return ChatRequest(_sampling(b, getattr(b, param), param, logprobs), _template_messages(body["messages"], b.messages),
                       tools, structure, b.n or 1)


@dataclass
class CompletionRequest:
    sampling: Sampling
    prompt: str | list[int]  # text, or token ids
    echo: bool  # put the prompt before the completion
    structure: Structure = field(default_factory=Structure)
    n: int = 1  # choices to generate


def parse_completion(body: dict, lim: Limits = Limits()) -> CompletionRequest:
    b = validate(CompletionBody, body, lim)
    if b.logprobs is not None and b.echo:
        raise invalid("logprobs", "'logprobs' with 'echo' (the prompt's log-probabilities) is not supported by "
                      "colibri", "unsupported_parameter")
    return CompletionRequest(_sampling(b, b.max_tokens, logprobs=b.logprobs), b.prompt, bool(b.echo), _structure(b),
                             b.n or 1)


def parse_tokenize(body: dict, lim: Limits = Limits()) -> dict:
    """/tokenize's fields (None where absent), its messages ready for the chat template."""
    b = validate(TokenizeBody, body, lim)
    return {**b.model_dump(exclude={"messages"}),
            "messages": None if b.messages is None else _template_messages(body["messages"], b.messages)}


def parse_detokenize(body: dict, lim: Limits = Limits()) -> dict:
    b = validate(DetokenizeBody, body, lim)
    return {"model": b.model, "tokens": b.tokens}


# ---- the published schema ------------------------------------------------------------------------------
LIMIT_KEYWORDS = {"string": "maxLength", "array": "maxItems", "integer": "maximum"}


def limited(schema, lim: Limits):
    """A copy of a JSON Schema generated from these models with each {"x-limit": ...} placeholder
    (AtMost, InVocabulary) replaced by the bound of `lim` (or dropped where it has none)."""
    if isinstance(schema, list):
        return [limited(s, lim) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: limited(v, lim) for k, v in schema.items() if k != "x-limit"}
    if "x-limit" in schema and (bound := getattr(lim, schema["x-limit"])) is not None:
        out[LIMIT_KEYWORDS[schema["type"]]] = bound
    return out
