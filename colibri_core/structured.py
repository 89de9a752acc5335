"""Structured output: which tokens a grammar allows next, from llguidance and the model's own tokenizer.

    vocab = Vocabulary.of(engine)                        # tokenizer.json + the model's vocabulary size
    c = Constraint.json_schema(vocab, {"type": "object", "properties": {"n": {"type": "integer"}}})
    c.mask()        # bool (V,): the tokens allowed next (V: the model's vocabulary; ids past the tokenizer's: never)
    c.advance(t)    # consume a chosen token (ValueError if the grammar does not allow it)
    c.forced()      # the tokens the grammar forces next ([] if none): drafts that need no model
    c.rollback(n)   # undo the last n tokens (rejected speculative drafts)
    c.finished()    # the grammar accepts and allows nothing more (or only end-of-sequence)

A constraint is built for one generation from a JSON object (`{"type": "json_object"}`), a JSON
schema, a Lark grammar (llguidance's dialect), a GBNF grammar (llama.cpp's, converted by llguidance)
or a set of tools (`tool_calls`: the answer is text or tool calls in one fixed format, which
`parse_tool_calls` reads back; each function's parameters are a schema of their own, so their
`$ref`s resolve as a response_format's do). A grammar that cannot be compiled is a `ColibriError`
carrying the compiler's message, and so is one llguidance cannot follow. A JSON schema or GBNF grammar
with a part an answer can reach but no finite answer can finish (a recursion without end: llguidance
would give up at its item limit only once the model walks into it) is refused when built, naming the
part (`endless_schema_part`, `endless_gbnf_rule`); then every new constraint is followed up to the
model's first choice (its first mask, the tokens it forces), which also refuses a Lark grammar whose
every answer recurses, and a limit met later is a `ColibriError` from `mask`/`advance`/`forced`,
mid-answer. JSON is compact by default
(no whitespace between tokens: a weak model cannot loop on blank lines, and the grammar then forces
every key and separator); a schema may ask for other separators with llguidance's `"x-guidance"`
options.

End-of-sequence tokens (the model's `eos_token_id`) are allowed exactly where the grammar accepts;
one consumed is kept here, not given to llguidance, so `rollback` undoes it like any other token.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from urllib.parse import unquote

import numpy as np

from .errors import ColibriError
from .fsio import GRAMMAR_BYTES, TOKENIZER_BYTES, read_text

__all__ = ["Constraint", "Vocabulary", "TOOL_OPEN", "TOOL_CLOSE", "parse_tool_calls", "tool_prompt"]

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON unless the schema's "x-guidance" says otherwise
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"  # the tool-call format (Hermes / Qwen): JSON between tags
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names (and '.')


def _llg():
    import llguidance

    return llguidance


class Vocabulary:
    """The model's tokens as llguidance sees them: its `tokenizer.json`, the size of the model's
    output (`vocab_size`, which may exceed the tokenizer's: ids past the tokenizer are never
    allowed) and its end-of-sequence ids."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids=()):
        from tokenizers import Tokenizer as Raw

        self.eos_ids = tuple(int(i) for i in eos_ids)
        try:
            self.n_tokens = Raw.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
            self.tok = _llg().LLTokenizer(tokenizer_json, n_vocab=self.n_tokens,
                                          eos_token=list(self.eos_ids) or None)
            # none given: the one llguidance found in the tokenizer, so an EOS is always kept here
            self.eos_ids = self.eos_ids or tuple(int(i) for i in self.tok.eos_tokens)
        except Exception as e:
            raise ColibriError(f"structured output: llguidance cannot read this tokenizer ({' '.join(str(e).split())[:200]})") from None
        self.vocab_size = int(vocab_size)
        self.words = (self.n_tokens + 31) // 32  # the bitmask's 32-bit words

    @classmethod
    def of(cls, engine) -> Vocabulary:
        """The engine's model's vocabulary (built once per tokenizer file and size)."""
        path = Path(engine.model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ColibriError(f"{engine.model_dir}: no tokenizer.json: structured output needs one")
        size = engine.model.vocab_size
        st = path.stat()
        eos = tuple(engine.generation.get("eos_token_id", []))
        return _vocabulary(str(path), st.st_mtime_ns, st.st_size, int(size), eos)

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int | None = None, eos_ids=()) -> Vocabulary:
        text = read_text(path, TOKENIZER_BYTES, fix="restore it from the model's original files or reconvert the model")
        v = cls(text, vocab_size or 0, eos_ids)
        if not vocab_size:
            v.vocab_size = v.n_tokens
        return v


@functools.lru_cache(maxsize=4)
def _vocabulary(path: str, mtime_ns: int, size: int, vocab_size: int, eos: tuple) -> Vocabulary:
    return Vocabulary.from_file(path, vocab_size, eos)


class Constraint:
    """One generation's grammar state (see the module docstring for the protocol)."""

    def __init__(self, vocab: Vocabulary, grammar: str, what: str = "grammar"):
        llg = _llg()
        self.vocab, self.what = vocab, what
        self.matcher = llg.LLMatcher(vocab.tok, grammar, log_level=0)
        if self.matcher.is_error():
            raise ColibriError(f"the {what} cannot be compiled: {_one_line(self.matcher.get_error())}")
        self.history: list[int] = []  # tokens advanced, EOS included
        self.eos_at: int | None = None  # index in history of the EOS that ended the grammar, if any
        self._mask: np.ndarray | None = None  # of the current state, until it changes
        self._bits = np.zeros(vocab.words, np.int32)
        self._check_start()

    def _check_start(self) -> None:
        """Follow the fresh grammar as the engine will up to the model's first choice: the first mask,
        then (on a copy) every token it forces and the mask after them. What llguidance cannot follow
        there (a rule every sentence must recurse through forces tokens until its item limit; a
        pattern no text matches) is refused now, not after the request is queued or streamed."""
        self.mask()  # kept: the engine asks for it first
        probe = self.matcher.deep_copy()
        probe.try_consume_tokens(probe.compute_ff_tokens())
        if not probe.is_error():
            probe.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if probe.is_error():
            raise self._failure(probe, "before the model's first choice")

    # ---- the kinds of grammar --------------------------------------------------------------------
    @classmethod
    def json_object(cls, vocab: Vocabulary) -> Constraint:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls(vocab, _llg().LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS),
                   "JSON object grammar")

    @classmethod
    def json_schema(cls, vocab: Vocabulary, schema: dict | str | bool) -> Constraint:
        """JSON valid against `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ColibriError(f"the JSON schema is not valid JSON ({e})") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ColibriError(f"the JSON schema must be an object, not {type(schema).__name__}")
        if why := endless_schema_part(schema):
            raise ColibriError(f"the JSON schema cannot be followed: {why}")
        try:
            grammar = _llg().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ColibriError(f"the JSON schema cannot be compiled: {_one_line(str(e))}") from None
        return cls(vocab, grammar, "JSON schema")

    @classmethod
    def lark(cls, vocab: Vocabulary, text: str) -> Constraint:
        """A Lark grammar in llguidance's dialect (`start` is the top rule; `%json {...}` embeds a schema)."""
        return cls(vocab, _llg().LLMatcher.grammar_from_lark(text), "Lark grammar")

    @classmethod
    def gbnf(cls, vocab: Vocabulary, text: str) -> Constraint:
        """A GBNF grammar (llama.cpp's; `root` is the top rule), converted to Lark by llguidance."""
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(text)
        except Exception as e:  # GbnfToLarkError, and plain Exceptions for unknown rules
            raise ColibriError(f"the GBNF grammar cannot be compiled: {_one_line(str(e))}") from None
        if why := endless_gbnf_rule(text):
            raise ColibriError(f"the GBNF grammar cannot be followed: {why}")
        return cls(vocab, _llg().LLMatcher.grammar_from_lark(lark), "GBNF grammar")

    @classmethod
    def grammar(cls, vocab: Vocabulary, text: str, kind: str | None = None) -> Constraint:
        """A Lark or GBNF grammar: `kind` "lark" or "gbnf", else told apart by its content
        (GBNF defines `root ::=`)."""
        if kind is None:
            from llguidance.gbnf_to_lark import is_lark_syntax

            kind = "lark" if is_lark_syntax(text) else "gbnf"
        if kind not in ("lark", "gbnf"):
            raise ColibriError(f"unknown grammar kind {kind!r}: lark or gbnf")
        return cls.lark(vocab, text) if kind == "lark" else cls.gbnf(vocab, text)

    @classmethod
    def from_file(cls, vocab: Vocabulary, path: str | Path, kind: str) -> Constraint:
        """`kind` "grammar" (Lark or GBNF: by extension .lark / .gbnf, else by content) or "json_schema"."""
        path = Path(path)
        text = read_text(path, GRAMMAR_BYTES, "JSON schema" if kind == "json_schema" else "grammar")
        try:
            if kind == "json_schema":
                return cls.json_schema(vocab, text)
            suffix = path.suffix.lower()
            return cls.grammar(vocab, text, "lark" if suffix == ".lark" else "gbnf" if suffix == ".gbnf" else None)
        except ColibriError as e:
            raise ColibriError(f"{path}: {e}") from None

    @classmethod
    def tool_calls(cls, vocab: Vocabulary, tools: list[dict], choice: str = "auto", parallel: bool = True,
                   answer: dict | None = None) -> Constraint:
        """Tool calls in the format `parse_tool_calls` reads: TOOL_OPEN {"name":…,"arguments":{…}}
        TOOL_CLOSE, each call's arguments valid against its function's parameters. `choice`:
        "auto" (text, or calls), "required" (calls), or one function's name (one call of it);
        `parallel`: more than one call allowed; `answer`: with "auto", a JSON schema the text
        answer must follow instead of free text."""
        functions = tool_functions(tools)
        if isinstance(choice, str) and choice not in ("auto", "required"):
            functions = [f for f in functions if f["name"] == choice]
            if not functions:
                raise ColibriError(f"tool_choice names the function {choice!r}, which is not among the tools")
            parallel = False
        # each schema is also checked alone, as a response_format is: in the grammar the model's first
        # choices (text or a call, a newline or not) come before it, and the check stops at a choice
        for f in functions:
            try:
                cls.json_schema(vocab, f["parameters"])
            except ColibriError as e:
                raise ColibriError(f"the parameters of {f['name']!r}: {e}") from None
        if answer is not None:
            cls.json_schema(vocab, answer)
        call = " | ".join(f"call_{i}" for i in range(len(functions)))
        text = "TEXT" if answer is None else "answer"
        rules = [f'start: {text + " | calls" if choice == "auto" else "calls"}',
                 f"calls: call {'(NL? call)*' if parallel else ''}",
                 f"call: {call}",
                 'NL: "\\n"',
                 # text that does not begin a tool call (leading whitespace, then the tag)
                 rf"TEXT: /(.|\n)*/ & ~/\s*{re.escape(TOOL_OPEN)}(.|\n)*/"]
        if answer is not None:
            rules.append(f"answer: %json {json.dumps(_with_options(answer))}")
        for i, f in enumerate(functions):
            # the call's head is literal text and its parameters a schema of their own, so their "$ref"s
            # ("#/$defs/…", "#") resolve against them as a response_format's do
            head = json.dumps(f'{{"name":"{f["name"]}","arguments":')
            rules.append(f'call_{i}: "{TOOL_OPEN}" NL? {head} %json {json.dumps(_with_options(f["parameters"]))} '
                         f'"}}" NL? "{TOOL_CLOSE}"')
        return cls(vocab, _llg().LLMatcher.grammar_from_lark("\n".join(rules)), "tools' grammar")

    # ---- the protocol the engine calls -------------------------------------------------------------
    def mask(self) -> np.ndarray:
        """The tokens allowed next, bool (V,) (read-only; the same array until the state changes)."""
        if self._mask is None:
            v = self.vocab
            if self.eos_at is not None:
                allowed = np.zeros(v.vocab_size, bool)
            else:
                self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
                if self.matcher.is_error():
                    raise self._failure(self.matcher)
                allowed = np.unpackbits(self._bits.view(np.uint8), count=v.n_tokens, bitorder="little").view(bool)
                if v.vocab_size != v.n_tokens:  # the model's output is wider (or narrower) than the tokenizer
                    n, allowed = min(v.n_tokens, v.vocab_size), allowed[:v.vocab_size]
                    allowed = np.concatenate([allowed, np.zeros(v.vocab_size - n, bool)])
            allowed.flags.writeable = False
            self._mask = allowed
        return self._mask

    def advance(self, token: int) -> None:
        """Consume `token`; a token the grammar does not allow now is a ValueError (nothing changes), a
        limit llguidance meets on an allowed one a ColibriError (the constraint is of no further use)."""
        token = int(token)
        if not (0 <= token < self.vocab.vocab_size and self.mask()[token]):
            raise ValueError(f"token {token} is not allowed by the {self.what} here")
        if token in self.vocab.eos_ids:
            self.eos_at = len(self.history)  # the end: kept here, llguidance is not told
        elif not self.matcher.consume_token(token):  # allowed by the mask: llguidance gave up (a limit)
            raise self._failure(self.matcher)
        self.history.append(token)
        self._mask = None

    def rollback(self, n: int) -> None:
        """Undo the last `n` advanced tokens."""
        if not 0 <= n <= len(self.history):
            raise ValueError(f"cannot roll back {n} tokens: {len(self.history)} were advanced")
        if n == 0:
            return
        keep = len(self.history) - n
        given = n
        if self.eos_at is not None and self.eos_at >= keep:
            self.eos_at, given = None, n - 1  # the EOS was never given to llguidance
        if given and not self.matcher.rollback(given):
            raise ValueError(f"llguidance cannot roll back {given} tokens: {_one_line(self.matcher.get_error())}")
        del self.history[keep:]
        self._mask = None

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens), [] if none."""
        if self.eos_at is not None or self.matcher.is_stopped():
            return []
        forced = self.matcher.compute_ff_tokens()
        if self.matcher.is_error():
            raise self._failure(self.matcher)
        out = []
        for t in forced:
            if t >= self.vocab.vocab_size:
                break
            out.append(int(t))
        return out

    def finished(self) -> bool:
        """Generation must stop: an EOS was consumed, or the grammar allows nothing more but EOS."""
        return self.eos_at is not None or self.matcher.is_stopped()

    def accepting(self) -> bool:
        """What was generated is a whole sentence of the grammar (it may still go on)."""
        return self.eos_at is not None or self.matcher.is_accepting()

    def _failure(self, matcher, where: str | None = None) -> ColibriError:
        """llguidance's error state (a grammar it cannot follow: its item or lexer limits) as one line."""
        where = where or (f"after {len(self.history)} tokens" if self.history else "at its start")
        message = _one_line(matcher.get_error())
        if message in ("NoExtension", "NoExtensionBias"):  # a stop reason, alone
            message = f"no text can continue it ({message})"
        if "Too many items" in message:  # llguidance's hint (avoid short lexemes) is not the usual cause
            message = (message.split("; try avoiding")[0] + ", as when every answer must recurse without end "
                       "(a required property, a minItems array or a rule that refers back to itself)")
        return ColibriError(f"the {self.what} cannot be followed {where}: {message}")


def _with_options(schema: dict) -> dict:
    """A schema embedded in a Lark grammar, with JSON_OPTIONS unless it sets its own."""
    return schema if isinstance(schema, dict) and "x-guidance" in schema else {**schema, "x-guidance": JSON_OPTIONS}


def _one_line(message: str) -> str:
    """llguidance's message as one line: its lines once each, without the source excerpts and carets
    it draws under them."""
    keep = []
    for line in message.split("<state>")[0].splitlines():  # not the parser state dumped after it
        line = line.strip()
        if line and line not in keep and not re.fullmatch(r"\^+|\d+ \|.*", line):
            keep.append(line)
    return " ".join(" ".join(keep).split())[:600]


# ---- what no finite answer can finish ---------------------------------------------------------------------
# llguidance follows a schema or grammar lazily: a part that recurses without end (an object whose required
# property nests it again, a rule every alternative of which refers back to itself) is met only when an
# answer enters it, and then as its item limit, mid-answer. So every part an answer can reach is checked
# here first, by the least fixpoint of which parts have a finite value ("productive" nonterminals).
class _Finite:
    """An AND/OR graph: a node is finite when all its parts are ("all"; none: a leaf) or any is ("any").
    `solve` finds the least fixpoint in time linear in the edges (each part counts down its parents)."""

    def __init__(self):
        self.kind: list[str] = []
        self.parts: list[list[int]] = []

    def add(self, kind: str = "all", parts=()) -> int:
        self.kind.append(kind)
        self.parts.append(list(parts))
        return len(self.kind) - 1

    def solve(self) -> list[bool]:
        parents: list[list[int]] = [[] for _ in self.kind]
        need = []
        for i, (kind, parts) in enumerate(zip(self.kind, self.parts)):
            for p in parts:
                parents[p].append(i)
            need.append(len(parts) if kind == "all" else 1)
        finite = [False] * len(need)
        todo = [i for i, n in enumerate(need) if n == 0]
        while todo:
            i = todo.pop()
            finite[i] = True
            for p in parents[i]:
                if need[p] > 0:
                    need[p] -= 1
                    if need[p] == 0:
                        todo.append(p)
        return finite

    def cycle(self, start: int, finite: list[bool], names: dict[int, str]) -> str:
        """The first named node met twice from `start` down its parts that are not finite (every part of
        an "any" node, some part of an "all" one): where the recursion closes."""
        seen, i = set(), start
        while not (i in names and i in seen):
            if i in names:
                seen.add(i)
            i = next(p for p in self.parts[i] if not finite[p])
        return names[i]


def _endless(graph: _Finite, names: dict[int, str], root: int, reach: dict[int, list[int]], none: str) -> str | None:
    """The first node (in document order) that an answer can reach from `root`, down `reach`, with no
    finite value (`none` says so), and where it recurses: None if every one has one."""
    finite = graph.solve()
    seen, todo = {root}, [root]
    while todo:
        i = todo.pop()
        if not finite[i]:
            return f"{names[i]}: {none} (it recurses without end through {graph.cycle(i, finite, names)})"
        for child in reversed(reach.get(i, [])):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return None


SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
COMBINATORS = {"$ref", "allOf", "anyOf", "oneOf"}
# keywords that constrain no object or array (annotations, bounds of numbers and strings): a schema with
# only these and the modelled ones below has no restriction on which of its parts an answer may enter
INERT = {"$schema", "$id", "$comment", "$defs", "definitions", "title", "description", "default", "examples",
         "deprecated", "readOnly", "writeOnly", "x-guidance", "minimum", "maximum", "exclusiveMinimum",
         "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format", "contentEncoding",
         "contentMediaType", "uniqueItems"}
MODELLED = COMBINATORS | {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
                          "minItems", "maxItems", "enum", "const"}


def endless_schema_part(schema: dict) -> str | None:
    """Why a JSON schema cannot be followed: the JSON pointer of the first part an answer can reach that
    no finite JSON answers ("#/properties/b: … recurses without end through #/$defs/n"), or None.

    A part is finite when its `$ref` target, every `allOf` part, some `anyOf`/`oneOf` branch and one of
    its types are: an object when each required property's schema is, an array when the items its
    `minItems` needs are, anything else always. These are necessary conditions whatever other keywords
    say, so "not finite" is never wrong; what is not modelled (another keyword, a `$ref` that is not
    local, a required key not in `properties`) counts as finite. An answer reaches a finite part's
    properties, `additionalProperties`, items up to `maxItems`, branches and `$ref` target, except where
    a keyword not modelled here, or one beside a `$ref`/`allOf`/`anyOf`/`oneOf`, might forbid them:
    there the search stops (a schema is never refused for a part no answer may reach)."""
    graph, names, reach = _Finite(), {}, {}
    ids: dict[str, int] = {}
    todo: list[tuple[object, str]] = []

    def at(s, ptr: str) -> int:  # the node of the part at `ptr` (built later, from `todo`)
        if ptr not in ids:
            ids[ptr] = graph.add()
            names[ids[ptr]] = ptr
            todo.append((s, ptr))
        return ids[ptr]

    def target(ref) -> int | None:  # a local "$ref" ("#", "#/$defs/n"): its node
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        s, tokens = schema, [unquote(t).replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/")]
        for token in tokens if ref != "#" else []:
            if isinstance(s, dict) and token in s:
                s = s[token]
            elif isinstance(s, list) and token.isdigit() and int(token) < len(s):
                s = s[int(token)]
            else:
                return None  # llguidance says what is wrong with it
        return at(s, "#" + "".join("/" + _escape(t) for t in tokens) if ref != "#" else "#")

    root = at(schema, "#")
    while todo:
        s, ptr = todo.pop()
        node = ids[ptr]
        if not isinstance(s, dict) or "enum" in s or "const" in s:
            continue  # true, false, literal values: finite, and nothing to enter
        if "$id" in s and ptr != "#":
            return None  # a new base for "#…" refs: not modelled here
        parts, enters = [], []
        if (ref := target(s.get("$ref"))) is not None:
            parts.append(ref)
            enters.append(ref)
        for key in ("allOf", "anyOf", "oneOf"):
            branches = s.get(key)
            if isinstance(branches, list) and branches:
                nodes = [at(b, f"{ptr}/{key}/{i}") for i, b in enumerate(branches)]
                parts += nodes if key == "allOf" else [graph.add("any", nodes)]
                enters += nodes
        types = s.get("type", SCHEMA_TYPES)
        types = [types] if isinstance(types, str) else types if isinstance(types, list) and types else SCHEMA_TYPES
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        required = s.get("required") if isinstance(s.get("required"), list) else []
        items, prefix = s.get("items"), s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        least, most = (max(s[k], 0) if type(s.get(k)) is int else None for k in ("minItems", "maxItems"))
        one_of_types = []
        for t in types:
            if t == "object":
                one_of_types.append(graph.add("all", [at(props[k], f"{ptr}/properties/{_escape(k)}")
                                                       for k in required if isinstance(k, str) and k in props]))
                enters += [at(v, f"{ptr}/properties/{_escape(k)}") for k, v in props.items()]
                if isinstance(s.get("additionalProperties"), dict):
                    enters.append(at(s["additionalProperties"], f"{ptr}/additionalProperties"))
            elif t == "array":
                n = least or 0
                needed = [at(p, f"{ptr}/prefixItems/{i}") for i, p in enumerate(prefix[:n])]
                if n > len(prefix) and isinstance(items, dict):
                    needed.append(at(items, f"{ptr}/items"))
                one_of_types.append(graph.add("all", needed))
                upto = len(prefix) if most is None else min(most, len(prefix))
                enters += [at(p, f"{ptr}/prefixItems/{i}") for i, p in enumerate(prefix[:upto])]
                if isinstance(items, dict) and (most is None or most > len(prefix)):
                    enters.append(at(items, f"{ptr}/items"))
            else:
                one_of_types.append(graph.add())
        parts.append(graph.add("any", one_of_types))
        graph.parts[node] = parts
        keys = set(s) - INERT
        parts_of_all = len(s["allOf"]) if isinstance(s.get("allOf"), list) else 0
        merged = keys & COMBINATORS and (len(keys) > 1 or parts_of_all > 1)  # whose parts restrict each other
        if keys <= MODELLED and not isinstance(items, list) and not merged:  # else: not searched (see above)
            reach[node] = enters
    return _endless(graph, names, root, reach, "no finite JSON answers it")


def _escape(key: str) -> str:
    """A key as a JSON pointer token."""
    return key.replace("~", "~0").replace("/", "~1")


def endless_gbnf_rule(text: str) -> str | None:
    """Why a GBNF grammar cannot be followed: the first rule an answer can reach (from `root`, down every
    alternative) that no finite text matches, and where it recurses ("rule 'loop': … through rule
    'loop'"), or None. A rule matches finite text when one of its alternatives does: every item of it
    (a literal or a character class always, a rule if it does, a repetition if it may be empty)."""
    from llguidance.gbnf_to_lark import (AlternativeNode, GrammarParser, RepetitionNode, RuleRefNode,
                                         SequenceNode)

    rules = GrammarParser().parse(text)  # llguidance's own parser (gbnf_to_lark has accepted the text)
    graph, reach = _Finite(), {}
    ids = {name: graph.add() for name in rules}
    names = {i: f"rule {name!r}" for name, i in ids.items()}

    def node(n, refs: list[int]) -> int:  # the node of one piece of a rule; `refs`: the rules it names
        if isinstance(n, RuleRefNode):
            if n.name in ids:
                refs.append(ids[n.name])
                return ids[n.name]
            return graph.add()
        if isinstance(n, RepetitionNode):
            if n.max_times == 0:
                return graph.add()
            inner = node(n.node, refs)
            return graph.add() if n.min_times == 0 else inner
        if isinstance(n, SequenceNode):
            return graph.add("all", [node(c, refs) for c in n.nodes])
        if isinstance(n, AlternativeNode):
            return graph.add("any", [node(c, refs) for c in n.alternatives])
        return graph.add()  # a literal or a character class

    for name, rule in rules.items():
        reach[ids[name]] = []
        graph.parts[ids[name]] = [node(rule.alternatives, reach[ids[name]])]
    return _endless(graph, names, ids["root"], reach, "no finite text matches it")


# ---- tools --------------------------------------------------------------------------------------------
def tool_functions(tools: list[dict]) -> list[dict]:
    """OpenAI's `tools` ({"type": "function", "function": {"name", "parameters", …}}) as
    [{"name", "description", "parameters"}]; a malformed tool is a ColibriError naming it."""
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ColibriError(f"'{where}' must be a function tool: {{\"type\": \"function\", \"function\": {{...}}}}")
        f = tool.get("function")
        if not isinstance(f, dict):
            raise ColibriError(f"'{where}.function' must be an object with a 'name'")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ColibriError(f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '-' or '.', "
                               f"got {name!r}"[:200])
        if name in seen:
            raise ColibriError(f"'{where}.function.name': the function {name!r} is defined twice")
        seen.add(name)
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ColibriError(f"'{where}.function.parameters' must be a JSON schema (an object)")
        description = f.get("description")
        out.append({"name": name, "description": description if isinstance(description, str) else "",
                    "parameters": params})
    if not out:
        raise ColibriError("'tools' is empty")
    return out


def tool_prompt(tools: list[dict], choice: str | dict = "auto") -> str:
    """A system message that teaches the tool-call format, for chat templates that ignore `tools`."""
    lines = ["You can call these functions. To call one, answer with",
             f'{TOOL_OPEN}{{"name": <function name>, "arguments": <its arguments as a JSON object>}}{TOOL_CLOSE}',
             "(one such block per call), and nothing else. Functions:"]
    for f in tool_functions(tools):
        lines.append(json.dumps({"name": f["name"], "description": f["description"], "parameters": f["parameters"]},
                                ensure_ascii=False))
    if choice == "required":
        lines.append("You must call at least one function.")
    elif isinstance(choice, str) and choice != "auto":
        lines.append(f"You must call the function {choice}.")
    return "\n".join(lines)


_CALL = re.compile(rf"{re.escape(TOOL_OPEN)}\s*(.*?)\s*{re.escape(TOOL_CLOSE)}", re.S)


def parse_tool_calls(text: str) -> list[dict] | None:
    """The calls in an answer made under `Constraint.tool_calls`: [{"name", "arguments" (a dict)}],
    or None if the answer is text (or a call cut short, which is no call)."""
    if not text.lstrip().startswith(TOOL_OPEN):
        return None
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
            return None
        calls.append({"name": call["name"], "arguments": call["arguments"]})
    return calls or None
