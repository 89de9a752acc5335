"""Structured output (colibri_core/structured.py) on the bundled demo model's tokenizer: masks,
forced tokens, rollback, every grammar kind, compile errors, and the demo model (a bad JSON writer)
made to write valid JSON by the mask."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from conftest import colibri  # at import: by the time a test runs, `conftest` may be a plugin's

from colibri_core.demo import demo_model
from colibri_core.errors import ColibriError
from colibri_core.structured import (
    TOOL_CLOSE,
    TOOL_OPEN,
    Constraint,
    Vocabulary,
    parse_tool_calls,
    tool_prompt,
)

EOS = 0  # the demo model's end-of-sequence id
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string", "maxLength": 16},
                                                                            "unit": {"enum": ["c", "f"]}},
                                                             "required": ["city", "unit"], "additionalProperties": False}}},
           {"type": "function", "function": {"name": "now"}}]


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.from_file(demo_model() / "tokenizer.json", 2048, [EOS])


def ids_of(vocab: Vocabulary, text: str) -> list[int]:
    return vocab.tok.tokenize_str(text)


def text_of(vocab: Vocabulary, ids) -> str:
    return vocab.tok.decode_str([t for t in ids if t != EOS])


def walk(c: Constraint, ids) -> None:
    for t in ids:
        c.advance(t)  # checks the mask: ValueError if the token is not allowed


# ---- the protocol ---------------------------------------------------------------------------------
def test_mask_is_the_models_vocabulary_and_forced_tokens_are_the_scaffolding(vocab):
    c = Constraint.json_schema(vocab, PERSON)
    m = c.mask()
    assert m.shape == (2048,) and m.dtype == bool and not m.flags.writeable
    assert np.flatnonzero(m).tolist() == ids_of(vocab, "{")  # compact JSON: only '{' may open it
    assert text_of(vocab, c.forced()) == '{"name":"'  # the first key is required: forced with its quote
    assert not c.finished() and not c.accepting()
    assert not m[EOS]  # nothing is whole yet: no end of sequence


def test_forced_tokens_are_allowed_one_by_one_and_empty_where_the_model_chooses(vocab):
    c = Constraint.json_schema(vocab, PERSON)
    walk(c, c.forced())
    assert c.forced() == []  # inside the name: the model's choice
    walk(c, ids_of(vocab, 'Abel"'))
    assert text_of(vocab, c.forced()) == ',"age":'


def test_advance_refuses_what_the_grammar_does_not_allow_and_changes_nothing(vocab):
    c = Constraint.json_schema(vocab, PERSON)
    before = c.mask().copy()
    for bad in (ids_of(vocab, "[")[0], EOS, -1, 2048, 10**9):
        with pytest.raises(ValueError):
            c.advance(bad)
    assert c.history == [] and np.array_equal(c.mask(), before)


def test_a_model_vocabulary_larger_than_the_tokenizer_never_allows_the_extra_ids():
    big = Vocabulary.from_file(demo_model() / "tokenizer.json", 2100, [EOS])
    c = Constraint.json_object(big)
    assert c.mask().shape == (2100,) and not c.mask()[2048:].any()
    with pytest.raises(ValueError):
        c.advance(2050)
    walk(c, ids_of(big, '{"a":1}'))
    assert c.finished() and not c.mask()[2048:].any() and c.mask()[EOS]


def test_eos_only_where_the_grammar_accepts_and_finished_after_it(vocab):
    c = Constraint.lark(vocab, 'start: "(" /c+/')
    walk(c, ids_of(vocab, "("))
    assert not c.mask()[EOS] and not c.accepting()
    walk(c, ids_of(vocab, "cc"))
    assert c.mask()[EOS] and c.accepting() and not c.finished()  # more c's may follow
    c.advance(EOS)
    assert c.finished() and not c.mask().any() and c.forced() == []
    with pytest.raises(ValueError):
        c.advance(ids_of(vocab, "c")[0])


def test_rollback_restores_every_earlier_state_exactly(vocab):
    doc = '{"name":"Cain","age":42,"tags":["a","bb"]}'
    c = Constraint.json_schema(vocab, PERSON)
    ids = ids_of(vocab, doc) + [EOS]
    states = []
    for t in ids:
        states.append((c.mask().copy(), c.forced(), c.finished()))
        c.advance(t)
    states.append((c.mask().copy(), c.forced(), c.finished()))
    assert c.finished() and json.loads(text_of(vocab, c.history)) == json.loads(doc)
    for k in (1, 2, 5, len(ids) - 3, len(ids)):  # the EOS, then deeper, then everything
        d = Constraint.json_schema(vocab, PERSON)
        walk(d, ids)
        d.rollback(k)
        mask, forced, finished = states[len(ids) - k]
        assert d.history == ids[:len(ids) - k]
        assert np.array_equal(d.mask(), mask) and d.forced() == forced and d.finished() == finished
        walk(d, ids[len(ids) - k:])  # and it goes on as before
        assert d.finished()


def test_rollback_of_rejected_drafts_at_every_position(vocab):
    """As speculative decoding uses it: advance a draft, roll back its rejected tail, advance the
    model's own token instead."""
    doc = ids_of(vocab, '{"name":"Seth","age":7,"tags":[]}')
    for cut in range(len(doc)):
        c = Constraint.json_schema(vocab, PERSON)
        walk(c, doc)
        c.rollback(len(doc) - cut)
        walk(c, doc[cut:])
        assert c.finished() and c.history == doc


def test_rollback_refuses_more_than_was_advanced(vocab):
    c = Constraint.json_object(vocab)
    walk(c, ids_of(vocab, "{}"))
    with pytest.raises(ValueError):
        c.rollback(3)
    with pytest.raises(ValueError):
        c.rollback(-1)
    c.rollback(0)
    assert c.finished()
    c.rollback(2)
    assert c.history == [] and c.mask()[ids_of(vocab, "{")[0]]


# ---- the grammar kinds ------------------------------------------------------------------------------
def test_json_object_accepts_any_object_and_only_objects(vocab):
    c = Constraint.json_object(vocab)
    assert not c.mask()[ids_of(vocab, "[")[0]]
    walk(c, ids_of(vocab, '{"a":[1,2.5,{"b":null}],"c":"x y","d":true}'))
    assert c.finished()  # the object is closed: nothing may follow but the end


def test_json_schema_from_text_and_with_its_own_whitespace_options(vocab):
    c = Constraint.json_schema(vocab, json.dumps(PERSON))
    walk(c, ids_of(vocab, '{"name":"x","age":1,"tags":[]}'))
    assert c.finished()
    loose = {**PERSON, "x-guidance": {"whitespace_flexible": True}}
    c = Constraint.json_schema(vocab, loose)
    walk(c, ids_of(vocab, '{ "name": "x",\n "age": 1, "tags": [ ] }'))
    assert c.accepting()


def test_lark_and_gbnf_and_told_apart_by_content(vocab):
    lark = 'start: ("yes" | "no") " " WORD\nWORD: /[a-z]{1,5}/'
    gbnf = 'root ::= ("yes" | "no") " " [a-z]{1,5}'
    for c in (Constraint.lark(vocab, lark), Constraint.gbnf(vocab, gbnf), Constraint.grammar(vocab, lark),
              Constraint.grammar(vocab, gbnf)):
        assert not c.mask()[ids_of(vocab, "m")[0]]
        walk(c, ids_of(vocab, "no abc"))
        assert c.accepting()
        walk(c, ids_of(vocab, "de"))
        assert c.finished()  # five letters: nothing more


def test_grammar_files_by_extension_or_content(vocab, tmp_path):
    (tmp_path / "g.lark").write_text('start: "a"+')
    (tmp_path / "g.gbnf").write_text('root ::= "a"+')
    (tmp_path / "g.txt").write_text('root ::= "a"+')
    (tmp_path / "s.json").write_text(json.dumps(PERSON))
    for name in ("g.lark", "g.gbnf", "g.txt"):
        c = Constraint.from_file(vocab, tmp_path / name, "grammar")
        walk(c, ids_of(vocab, "aaa"))
        assert c.accepting()
    c = Constraint.from_file(vocab, tmp_path / "s.json", "json_schema")
    assert text_of(vocab, c.forced()) == '{"name":"'
    with pytest.raises(ColibriError, match="cannot read"):
        Constraint.from_file(vocab, tmp_path / "missing.lark", "grammar")
    (tmp_path / "bad.gbnf").write_text('root ::= "a" | foo')  # a GBNF file read as GBNF, and wrong
    with pytest.raises(ColibriError, match="bad.gbnf.*GBNF grammar cannot be compiled"):
        Constraint.from_file(vocab, tmp_path / "bad.gbnf", "grammar")


def test_tool_calls_required_named_and_auto(vocab):
    call = f'{TOOL_OPEN}{{"name":"get_weather","arguments":{{"city":"Ur","unit":"c"}}}}{TOOL_CLOSE}'
    c = Constraint.tool_calls(vocab, WEATHER, "required")
    assert text_of(vocab, c.forced()) == TOOL_OPEN
    walk(c, ids_of(vocab, call + "\n" + f'{TOOL_OPEN}{{"name":"now","arguments":{{}}}}{TOOL_CLOSE}'))
    assert c.accepting() and c.mask()[EOS]
    assert parse_tool_calls(text_of(vocab, c.history)) == [
        {"name": "get_weather", "arguments": {"city": "Ur", "unit": "c"}}, {"name": "now", "arguments": {}}]

    c = Constraint.tool_calls(vocab, WEATHER, "get_weather")  # one call of that function
    assert text_of(vocab, c.forced()) == TOOL_OPEN  # then an optional newline: the model's choice
    walk(c, ids_of(vocab, call))
    assert c.finished()
    c = Constraint.tool_calls(vocab, WEATHER, "get_weather")
    with pytest.raises(ValueError):
        walk(c, ids_of(vocab, f'{TOOL_OPEN}{{"name":"now"'))

    c = Constraint.tool_calls(vocab, WEATHER, "auto")  # text, or calls
    walk(c, ids_of(vocab, "It is warm."))
    assert c.accepting() and parse_tool_calls(text_of(vocab, c.history)) is None
    c = Constraint.tool_calls(vocab, WEATHER, "auto", parallel=False)
    walk(c, ids_of(vocab, call))
    assert c.finished()  # one call only


def test_tool_calls_arguments_follow_the_parameters(vocab):
    c = Constraint.tool_calls(vocab, WEATHER, "required")
    with pytest.raises(ValueError):
        walk(c, ids_of(vocab, f'{TOOL_OPEN}{{"name":"get_weather","arguments":{{"city":"Ur","unit":"k"'))


def test_tool_parameters_with_defs_resolve_as_a_response_format_does(vocab):
    """pydantic (and openai.pydantic_function_tool) put nested models in "$defs" and refer to them
    with "#/$defs/…": resolved against the parameters, as for a response_format, not refused."""
    addr = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
            "additionalProperties": False}
    params = {"$defs": {"Addr": addr}, "type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"},
                                                                        "more": {"$ref": "#"}},
              "required": ["to"], "additionalProperties": False}
    ship = [{"type": "function", "function": {"name": "ship", "parameters": params}}]
    c = Constraint.tool_calls(vocab, ship, "required", parallel=False)
    walk(c, c.forced() + ids_of(vocab, '{"name":"ship","arguments":'))
    assert text_of(vocab, c.forced()) == '{"to":{"city":"'
    walk(c, c.forced())
    at = len(c.history)
    with pytest.raises(ValueError):  # Addr's own bound, from "$defs"
        walk(c, ids_of(vocab, "Babylonia"))
    c.rollback(len(c.history) - at)
    walk(c, ids_of(vocab, 'Ur"},"more":{"to":{"city":"Ai"}}}}' + TOOL_CLOSE))
    assert c.accepting()
    (call,) = parse_tool_calls(text_of(vocab, c.history))
    jsonschema.validate(call["arguments"], params)


def test_parse_tool_calls():
    assert parse_tool_calls("hello") is None
    assert parse_tool_calls(f'{TOOL_OPEN}{{"name":"f","arguments":{{"a":1}}') is None  # cut short
    assert parse_tool_calls(f' {TOOL_OPEN}\n{{"name":"f","arguments":{{"a":[1]}}}}\n{TOOL_CLOSE}') == [
        {"name": "f", "arguments": {"a": [1]}}]
    assert "get_weather" in tool_prompt(WEATHER, "required") and TOOL_OPEN in tool_prompt(WEATHER)


# ---- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schema, message", [
    ({"type": "foo"}, "Invalid type: foo"),
    ({"type": "string", "pattern": "(("}, "unclosed group"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "Unsatisfiable schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "/nope"),
    ("[1", "not valid JSON"),
    ([1], "must be an object"),
])
def test_a_schema_that_cannot_be_compiled_says_why(vocab, schema, message):
    with pytest.raises(ColibriError, match="JSON schema") as e:
        Constraint.json_schema(vocab, schema)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_grammars_that_cannot_be_compiled_say_why(vocab):
    with pytest.raises(ColibriError, match=r'Lark grammar cannot be compiled: .*unknown name: "foo"'):
        Constraint.lark(vocab, "start: foo")
    with pytest.raises(ColibriError, match="GBNF grammar cannot be compiled: .*foo"):
        Constraint.gbnf(vocab, 'root ::= "a" | foo')
    with pytest.raises(ColibriError, match="unknown grammar kind"):
        Constraint.grammar(vocab, "start: foo", "yacc")


@pytest.mark.parametrize("tools, choice, message", [
    (WEATHER, "nope", "not among the tools"),
    ([], "auto", "empty"),
    ([{"type": "retrieval"}], "auto", "function tool"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools\\[0\\].function.name"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "auto", "defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "auto", "Invalid type"),
])
def test_bad_tools_are_one_line(vocab, tools, choice, message):
    with pytest.raises(ColibriError, match=message):
        Constraint.tool_calls(vocab, tools, choice)


# ---- on the demo model --------------------------------------------------------------------------------
def constrained_greedy(engine, prompt: str, c: Constraint, max_tokens: int) -> str:
    """The engine under a constraint: Engine.stream's `constraint=` where it is there, else the
    same masked greedy loop over the model's forward pass."""
    ids = engine.tokenizer.encode(prompt)
    out = []
    session = engine.new_session()
    logits = engine._feed(session, ids)
    for _ in range(max_tokens):
        if c.finished():
            break
        token = int(np.argmax(np.where(c.mask(), logits, -np.inf)))
        c.advance(token)
        out.append(token)
        if token == EOS:
            break
        logits = engine._feed(session, ids + out)
    return engine.tokenizer.decode(out)


@pytest.fixture(scope="module")
def engine():
    from colibri_core.engine import load

    e = load(demo_model(), usage=False)
    yield e
    e.close()


def test_the_demo_model_writes_invalid_json_alone_and_valid_json_under_the_schema(engine, vocab):
    prompt = "And the LORD said unto Moses,"
    free = engine.tokenizer.decode(engine.generate(engine.tokenizer.encode(prompt), 30))
    with pytest.raises(ValueError):
        json.loads(free)
    text = constrained_greedy(engine, prompt, Constraint.json_schema(vocab, PERSON), 80)
    jsonschema.validate(json.loads(text), PERSON)
    c = Constraint.tool_calls(vocab, WEATHER, "required", parallel=False)
    calls = parse_tool_calls(constrained_greedy(engine, prompt, c, 80))
    assert calls and calls[0]["name"] in ("get_weather", "now")


# ---- the CLI ------------------------------------------------------------------------------------------
def test_run_and_chat_follow_a_grammar_or_a_schema(tmp_path):
    import re

    (tmp_path / "yn.gbnf").write_text('root ::= ("yes" | "no") ", " [a-z ]{3,20} "."\n')
    (tmp_path / "p.json").write_text(json.dumps(PERSON))
    r = colibri("run", "Who begat Enos?", "--grammar", tmp_path / "yn.gbnf")
    assert r.returncode == 0 and re.fullmatch(r"(yes|no), [a-z ]{3,20}\.\n", r.stdout), r
    r = colibri("run", "Who begat Enos?", "--chat", "--json-schema", tmp_path / "p.json")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), PERSON)
    r = colibri("chat", "--json-schema", tmp_path / "p.json", "--temperature", "0", input="Who begat Enos?\nAnd Seth?\n")
    answers = [json.loads(line.removeprefix("> ")) for line in r.stdout.splitlines() if line.strip("> ")]
    assert r.returncode == 0 and len(answers) == 2, r
    for a in answers:
        jsonschema.validate(a, PERSON)


def test_run_refuses_a_grammar_it_cannot_compile_in_one_line(tmp_path):
    (tmp_path / "bad.lark").write_text("start: foo\n")
    r = colibri("run", "x", "--grammar", tmp_path / "bad.lark")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f'colibri: error: {tmp_path / "bad.lark"}: the Lark grammar cannot be '
                                                 'compiled: at 1(8): unknown name: "foo"')
    r = colibri("run", "x", "--grammar", tmp_path / "bad.lark", "--json-schema", tmp_path / "bad.lark")
    assert r.returncode == 1 and "not both" in r.stderr


# every answer recurses without end, or one the model may choose does: refused when the constraint is built,
# naming the part no finite answer finishes and where its recursion closes, not mid-answer
N = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}  # nests for ever
ENDLESS = [
    ({"$defs": {"n": N}, "$ref": "#/$defs/n"}, "#: no finite JSON answers it (it recurses without end through #/$defs/n)"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1},
     "#: no finite JSON answers it (it recurses without end through #)"),
    # the first choice (a boolean) is free; the recursion comes after it
    ({"$defs": {"n": N}, "type": "object", "properties": {"a": {"type": "boolean"}, "b": {"$ref": "#/$defs/n"}},
      "required": ["a", "b"]}, "#: no finite JSON answers it (it recurses without end through #/$defs/n)"),
    # traps: answers exist, but a choice (an optional property, extra properties, an array's items, a branch,
    # a nested model's property) leads into a part that has none
    ({"$defs": {"n": N}, "type": "object", "properties": {"a": {"type": "boolean"}, "b": {"$ref": "#/$defs/n"}},
      "required": ["a"]}, "#/properties/b: no finite JSON answers it (it recurses without end through #/$defs/n)"),
    ({"$defs": {"n": N}, "type": "object", "additionalProperties": {"$ref": "#/$defs/n"}}, "#/additionalProperties: "),
    ({"$defs": {"n": N}, "type": "array", "items": {"$ref": "#/$defs/n"}}, "#/items: "),
    ({"$defs": {"n": N}, "anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}, "#/anyOf/1: "),
    ({"$defs": {"a/b": {"$ref": "#/$defs/n"}, "n": N,
                "Box": {"type": "object", "properties": {"in": {"$ref": "#/$defs/a~1b"}}}}, "$ref": "#/$defs/Box"},
     "#/$defs/Box/properties/in: no finite JSON answers it (it recurses without end through #/$defs/n)"),
]


@pytest.mark.parametrize("schema, message", ENDLESS)
def test_a_schema_with_a_part_no_finite_answer_finishes_is_refused_when_built(vocab, schema, message):
    with pytest.raises(ColibriError) as e:
        Constraint.json_schema(vocab, schema)
    assert str(e.value).startswith(f"the JSON schema cannot be followed: {message}"), str(e.value)


@pytest.mark.parametrize("schema", [
    # recursion with a way out everywhere: optional, an array that may be empty, a branch, through "#"
    {"$defs": {"Node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                        "required": ["kids"]}}, "$ref": "#/$defs/Node"},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
    # unreachable: an unused definition, items of an array of none, a property a sibling forbids
    {"$defs": {"n": N}, "type": "object", "properties": {"a": {"type": "boolean"}}},
    {"$defs": {"n": N}, "type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 0},
    {"$defs": {"n": N}, "type": "object", "allOf": [{"properties": {"b": {"$ref": "#/$defs/n"}}}],
     "properties": {"b": False}},
    {"$defs": {"n": N}, "type": "object", "properties": {"b": {"$ref": "#/$defs/n"}},
     "patternProperties": {"^b$": False}},
    # without a "type", a required property does not make it an object: any number answers it
    {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},
])
def test_a_schema_every_reachable_part_of_which_can_end_is_accepted(vocab, schema):
    Constraint.json_schema(vocab, schema)


def test_pydantic_and_openai_schemas_with_defs_are_accepted(vocab):
    import openai
    import pydantic

    class Addr(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)

    class Tree(pydantic.BaseModel):
        name: str
        at: Addr | None = None
        kids: list[Tree] = []

    Tree.model_rebuild()
    schema = Tree.model_json_schema()
    assert "$defs" in schema and "anyOf" in json.dumps(schema)
    Constraint.json_schema(vocab, schema)
    Constraint.tool_calls(vocab, [openai.pydantic_function_tool(Tree, name="plant")], "required")


@pytest.mark.parametrize("source, message", [
    ('root ::= "(" root ")"', "rule 'root': no finite text matches it (it recurses without end through rule 'root')"),
    ('root ::= "x" | "(" loop\nloop ::= "(" loop', "rule 'loop': no finite text matches it (it recurses without end "
                                                  "through rule 'loop')"),
    ('root ::= "x" | a\na ::= "(" b+\nb ::= a ")"', "rule 'a': no finite text matches it (it recurses without end "
                                                 "through rule 'a')"),
])
def test_a_gbnf_grammar_with_a_rule_no_finite_text_matches_is_refused_when_built(vocab, source, message):
    with pytest.raises(ColibriError) as e:
        Constraint.grammar(vocab, source)
    assert str(e.value) == f"the GBNF grammar cannot be followed: {message}"


@pytest.mark.parametrize("source", ['root ::= "(" root ")" | "x"', 'root ::= "[" root* "]"',
                                    'root ::= "x" | loop?\nloop ::= "a" | "(" loop ")"'])
def test_a_gbnf_grammar_whose_rules_all_end_is_accepted(vocab, source):
    Constraint.gbnf(vocab, source)


def test_an_endless_lark_grammar_is_refused_by_llguidance_before_the_first_choice(vocab):
    """Lark grammars are not analysed here (llguidance gives Python no parse of them): one whose every
    answer recurses is refused as llguidance meets its item limit while forcing the first tokens."""
    with pytest.raises(ColibriError) as e:
        Constraint.lark(vocab, 'start: "(" start ")"')
    message = str(e.value)
    assert message.startswith("the Lark grammar cannot be followed before the model's first choice: ")
    assert "Too many items" in message and "recurse without end" in message and "\n" not in message


def test_a_tool_whose_arguments_never_end_is_refused_when_built(vocab):
    endless = {"type": "function", "function": {"name": "f", "parameters": ENDLESS[3][0]}}
    with pytest.raises(ColibriError, match=r"^the parameters of 'f': the JSON schema cannot be followed: #/properties/b: "):
        Constraint.tool_calls(vocab, [WEATHER[0], endless], "auto")


def test_a_grammar_no_text_matches_is_refused_when_built(vocab):
    with pytest.raises(ColibriError, match="^the Lark grammar cannot be followed at its start: no text can continue"):
        Constraint.lark(vocab, r"start: /[^\x00-\U0010ffff]/")


# not analysed (Lark): the first choice ("a" or "b") is free, the endless recursion comes after it
MIDWAY = 'start: ("a" | "b") loop\nloop: "(" loop\n'


def test_a_grammar_the_engine_gives_up_on_mid_answer_is_a_one_line_error(vocab):
    c = Constraint.lark(vocab, MIDWAY)
    walk(c, c.forced())
    with pytest.raises(ColibriError, match=r"the Lark grammar cannot be followed after \d+ tokens: .*Too many items"):
        for _ in range(8):  # a choice (the lowest id allowed), then what it forces
            walk(c, [int(np.flatnonzero(c.mask())[0])])
            walk(c, c.forced())


def test_run_refuses_an_endless_grammar_in_one_line_and_ends_a_failing_one_in_one_line(tmp_path):
    (tmp_path / "nest.gbnf").write_text('root ::= "x" | "(" loop\nloop ::= "(" loop\n')
    r = colibri("run", "x", "--grammar", tmp_path / "nest.gbnf")
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"colibri: error: {tmp_path / 'nest.gbnf'}: the GBNF grammar cannot be followed: rule 'loop'")
    (tmp_path / "midway.lark").write_text(MIDWAY)
    r = colibri("run", "x", "--grammar", tmp_path / "midway.lark", "--temperature", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("colibri: error: the Lark grammar cannot be followed after ")


def test_grammar_drafts_give_the_tokens_of_decoding_without_drafts(engine, vocab):
    ids = engine.tokenizer.encode("And the LORD said unto Moses,")
    plain = engine.generate(ids, 80, constraint=Constraint.json_schema(vocab, PERSON), draft="off")
    drafted = engine.generate(ids, 80, constraint=Constraint.json_schema(vocab, PERSON), draft="grammar")
    assert drafted == plain


def test_tools_auto_with_a_schema_for_the_answer(vocab):
    c = Constraint.tool_calls(vocab, WEATHER, "auto", answer=PERSON)
    assert text_of(vocab, np.flatnonzero(c.mask())) in ("{<", "<{")  # an object, or a call
    walk(c, ids_of(vocab, '{"name":"Enoch","age":65,"tags":[]}'))
    assert c.finished()
    c = Constraint.tool_calls(vocab, WEATHER, "auto", answer=PERSON)
    with pytest.raises(ValueError):
        walk(c, ids_of(vocab, "It is warm."))
    c = Constraint.tool_calls(vocab, WEATHER, "auto", answer=PERSON)
    walk(c, ids_of(vocab, f'{TOOL_OPEN}{{"name":"now","arguments":{{}}}}{TOOL_CLOSE}'))
    assert c.accepting()


def test_without_eos_ids_the_tokenizers_own_is_used_and_rolled_back_like_any_token():
    v = Vocabulary.from_file(demo_model() / "tokenizer.json", 2048, [])
    assert v.eos_ids == (EOS,)  # <|endoftext|>, found by llguidance
    c = Constraint.lark(v, 'start: "(" /c+/')
    walk(c, ids_of(v, "(cc") + [EOS])
    assert c.finished()
    c.rollback(2)
    assert not c.finished() and not c.accepting() and c.history == ids_of(v, "(cc")[:-1]
