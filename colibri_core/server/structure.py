"""A request's structure (response_format, grammar, tools) → the engine's `Constraint`, and tool
calls back out of the answer in OpenAI's shape.

The constraint (colibri_core/structured.py) is built before the request is queued, off the event
loop: a JSON schema or GBNF grammar with a part no finite answer can finish (a recursion without
end, reached at once or after a choice) is refused by name, and every constraint is followed up to
the model's first choice, so what cannot be compiled or followed is a 400 naming it, streamed or
not, and never costs a queue slot. Tools are passed to the chat template; a
template that ignores them (its rendering is the same with and without) gets a system message
describing them and the call format instead, and earlier assistant calls are written into their
messages in that format, so the model sees its own calls. Calls come back as
`<tool_call>{"name", "arguments"}</tool_call>`, forced by the grammar, and are answered as
`tool_calls` (finish_reason "tool_calls"), whole or streamed as OpenAI streams them: each call's id
and name once its name is written, then its arguments as they are. A call cut short by max_tokens
comes back as the call so far (finish_reason "length"), whole or streamed, never as markup.
"""
from __future__ import annotations

import json
import re
import secrets

from ..errors import ColibriError
from ..structured import TOOL_CLOSE, TOOL_OPEN, Constraint, Vocabulary, parse_tool_calls, tool_prompt
from .schemas import Structure, invalid


def constraint(engine, s: Structure) -> Constraint | None:
    """The request's constraint (None: free text); a ColibriError becomes a 400 naming the field."""
    if s.response_format is None and s.grammar is None and not s.calls_tools:
        return None
    param = "tools" if s.calls_tools else "grammar" if s.grammar is not None else "response_format"
    try:
        vocab = Vocabulary.of(engine)
        answer = None
        if s.response_format is not None:
            spec = s.response_format
            answer = ({"type": "object"} if spec["type"] == "json_object"
                      else spec["json_schema"]["schema"] if spec["json_schema"]["schema"] is not None else {})
            if not s.calls_tools:
                return (Constraint.json_object(vocab) if spec["type"] == "json_object"
                        else Constraint.json_schema(vocab, answer))
        if s.grammar is not None:
            return Constraint.grammar(vocab, s.grammar)
        return Constraint.tool_calls(vocab, s.tools, s.tool_choice, s.parallel_tool_calls, answer=answer)
    except ColibriError as e:
        raise invalid(param, str(e), "invalid_grammar") from None


def chat_messages(template, messages: list[dict], s: Structure) -> list[dict]:
    """The messages to render: unchanged if the template renders the tools itself; otherwise earlier
    calls written into their assistant messages, and (when tools may be called) a system message
    describing them first."""
    if not s.tools:
        return messages
    if template is not None and _renders_tools(template, messages, s.tools):
        return messages
    out = [_with_calls(m) for m in messages]
    if s.calls_tools:
        try:
            prompt = tool_prompt(s.tools, s.tool_choice)
        except ColibriError as e:
            raise invalid("tools", str(e)) from None
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _renders_tools(template, messages: list[dict], tools: list) -> bool:
    try:
        return template.render(messages, tools=tools) != template.render(messages, tools=None)
    except Exception:  # the template refuses something: encode_chat reports it
        return True


def _with_calls(m: dict) -> dict:
    calls = m.get("tool_calls")
    if m.get("role") != "assistant" or not calls:
        return m
    text = [m.get("content") or ""]
    for c in calls:
        f = c.get("function") if isinstance(c.get("function"), dict) else {}
        args = f.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        text.append(TOOL_OPEN + json.dumps({"name": f.get("name"), "arguments": args}, ensure_ascii=False) + TOOL_CLOSE)
    return {**m, "content": "".join(text)}


def openai_calls(calls: list[dict], start: int = 0) -> list[dict]:
    """Parsed calls ([{"name", "arguments"}]) as OpenAI's streamed `tool_calls` deltas, from index `start`."""
    return [{"index": i, "id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False,
                                                                     separators=(",", ":"))}}
            for i, c in enumerate(calls, start)]


_WHOLE_CALL = re.compile(rf"\s*{re.escape(TOOL_OPEN)}.*?{re.escape(TOOL_CLOSE)}", re.S)
# a call as the grammar writes it (compact JSON): its head up to the arguments, and its end
_HEAD = re.compile(rf'\s*{re.escape(TOOL_OPEN)}\n?\{{"name":"([A-Za-z0-9_.-]+)","arguments":')
_END = re.compile(rf"\}}\n?{re.escape(TOOL_CLOSE)}")


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def forced_name(s: Structure) -> str | None:
    """The function every answer calls first, when the request leaves one choice: a named
    tool_choice, or 'required' with one tool."""
    if s.tool_choice not in ("none", "auto", "required"):
        return s.tool_choice
    if s.tool_choice == "required" and s.tools and len(s.tools) == 1:
        return s.tools[0]["function"]["name"]
    return None


class CallStream:
    """Streamed text in; content, or tool-call deltas as OpenAI streams them, out.

    Until the answer is known to be text (it does not begin with TOOL_OPEN) it is held back. Once it
    is calls, each call's first delta (index, id, name) goes as soon as its name is written, then its
    arguments as they arrive (all but a trailing '}' that may be the call's own end); a call written
    otherwise than compactly is handed out whole when its closing tag arrives. `forced`: the
    function the first call is known to be (`forced_name`), named even if cut short before its name."""

    def __init__(self, forced: str | None = None):
        self.forced = forced
        self.held = ""
        self.mode: str | None = None  # None: undecided; "text"; "calls"
        self.n_calls = 0  # calls begun
        self.sent = None  # characters of the current call's arguments sent (None: no call open)

    def push(self, text: str) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send)."""
        if self.mode == "text":
            return text, []
        self.held += text
        if self.mode is None:
            head = self.held.lstrip()
            if head.startswith(TOOL_OPEN):
                self.mode = "calls"
            elif TOOL_OPEN.startswith(head):
                return "", []  # could still become a call
            else:
                self.mode, out, self.held = "text", self.held, ""
                return out, []
        deltas = []
        while True:
            if self.sent is None:
                head = _HEAD.match(self.held)
                whole = _WHOLE_CALL.match(self.held)
                if head and not (whole and whole.end() <= head.end()):
                    deltas.append({"index": self.n_calls, "id": "call_" + secrets.token_hex(12), "type": "function",
                                   "function": {"name": head.group(1), "arguments": ""}})
                    self.n_calls, self.sent, self.held = self.n_calls + 1, 0, self.held[head.end():]
                    continue
                parsed = parse_tool_calls(whole.group(0)) if whole else None
                if not parsed:
                    return "", deltas
                deltas += openai_calls(parsed, self.n_calls)
                self.n_calls += len(parsed)
                self.held = self.held[whole.end():]
                continue
            end = _END.search(self.held)
            args = self.held[:end.start()] if end else self.held[:max(0, self.held.rfind("}"))]
            if len(args) > self.sent:
                deltas.append({"index": self.n_calls - 1, "function": {"arguments": args[self.sent:]}})
                self.sent = len(args)
            if not end:
                return "", deltas
            self.held, self.sent = self.held[end.end():], None

    def flush(self) -> tuple[str, list[dict]]:
        """At the end, what is still held: the rest of a call's arguments cut short, or text. A call
        cut short before its name is written (its opening tag too) is dropped, unless it is the first
        and `forced` names it: then it is that call, with empty arguments."""
        held, self.held = self.held, ""
        if self.sent is not None:  # a call cut short (max_tokens): its arguments, without the call's own end
            end = held.rfind("}") + 1
            if end and (("\n" + TOOL_CLOSE).startswith(held[end:]) or TOOL_CLOSE.startswith(held[end:])):
                held = held[:end]  # a closing tag cut short
            if held.endswith("}") and _whole_json(held[:-1]):  # whole arguments, then the call's own "}"
                held = held[:-1]
            rest = held[self.sent:]
            return "", [{"index": self.n_calls - 1, "function": {"arguments": rest}}] if rest else []
        if self.mode is None and held.strip():  # cut inside the opening tag: a call begun
            self.mode = "calls"
        if self.mode == "calls" and self.n_calls == 0 and self.forced is not None:
            self.n_calls = 1
            return "", [{"index": 0, "id": "call_" + secrets.token_hex(12), "type": "function",
                         "function": {"name": self.forced, "arguments": ""}}]
        return ("" if self.mode == "calls" else held), []

    @property
    def called(self) -> bool:
        return self.n_calls > 0


def answer_calls(text: str, forced: str | None = None) -> tuple[str, list[dict]]:
    """A whole answer as (content, OpenAI's tool_calls): the calls `CallStream` streams, merged, so a
    whole answer and a streamed one say the same (a call cut short included)."""
    stream = CallStream(forced)
    content, deltas = stream.push(text)
    rest, more = stream.flush()
    calls = []
    for d in deltas + more:
        if "id" in d:
            calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content + rest, calls
