"""What structured output costs per token: llguidance's mask, Constraint.mask() (the mask as the
engine's bool (V,) array), advance and forced, at every position of a valid answer, and the compile
time of each grammar kind; on a model's tokenizer (default: the bundled demo model's).

    .venv/bin/python tools/bench_structured.py [--model DIR] [--repeat 200] [--decode 5]

--decode N: also decode 96 tokens greedily N times each, with no constraint and under a JSON-object
constraint (drafting off), alternating, and give the median tokens per second of each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from colibri_core.demo import demo_model
from colibri_core.structured import TOOL_CLOSE, TOOL_OPEN, Constraint, Vocabulary

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 8},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}]
CASES = {  # kind: (make a constraint, a valid answer)
    "json_object": (lambda v: Constraint.json_object(v), '{"a":[1,2,{"b":null}],"text":"In the beginning God created"}'),
    "json_schema": (lambda v: Constraint.json_schema(v, SCHEMA),
                    '{"name":"Methuselah son of Enoch","age":150,"tags":["a","ccc","bb"],"address":{"city":"Ur","zip":"1"}}'),
    "lark": (lambda v: Constraint.lark(v, 'start: sentence+\nsentence: WORD (" " WORD)* "." " "?\nWORD: /[A-Za-z]+/'),
             "And God said. Let there be light. And there was light."),
    "gbnf": (lambda v: Constraint.gbnf(v, 'root ::= (word " ")* word "."\nword ::= [a-zA-Z]+'),
             "In the beginning God created the heaven and the earth."),
    "tools (auto)": (lambda v: Constraint.tool_calls(v, TOOLS, "auto"),
                     f'{TOOL_OPEN}{{"name":"get_weather","arguments":{{"city":"Ur","unit":"c"}}}}{TOOL_CLOSE}'),
}


def us(xs) -> str:
    xs = sorted(xs)
    return f"{1e6 * statistics.median(xs):7.1f} {1e6 * xs[int(0.99 * (len(xs) - 1))]:7.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=demo_model())
    ap.add_argument("--repeat", type=int, default=200, help="walks of each answer")
    ap.add_argument("--decode", type=int, default=0, help="decode runs with and without a constraint")
    args = ap.parse_args()
    cfg = json.loads((args.model / "config.json").read_text())
    gen = args.model / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id", []) if gen.is_file() else []
    t = time.perf_counter()
    vocab = Vocabulary.from_file(args.model / "tokenizer.json", cfg.get("vocab_size"), [eos] if isinstance(eos, int) else eos)
    print(f"{args.model.name}: {vocab.n_tokens} tokens (model vocabulary {vocab.vocab_size}); "
          f"tokenizer for llguidance built in {1e3 * (time.perf_counter() - t):.0f} ms")
    print(f"{'grammar':14} {'compile ms':>10} {'tokens':>6} | µs median / p99:  {'llguidance mask':>15} "
          f"{'mask() (bool V)':>15} {'advance':>15} {'forced':>15}")
    for kind, (make, text) in CASES.items():
        ids = vocab.tok.tokenize_str(text)
        compile_s = []
        raw, full, adv, ff = [], [], [], []
        for _ in range(args.repeat):
            c, bits = make(vocab), np.zeros(vocab.words, np.int32)
            for tok in ids:  # llguidance alone: its bitmask at each position
                t = time.perf_counter()
                c.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
                raw.append(time.perf_counter() - t)
                c.matcher.consume_token(tok)
            t = time.perf_counter()
            c = make(vocab)
            compile_s.append(time.perf_counter() - t)
            for tok in ids:  # the engine's protocol: the mask, the forced tokens, then the token chosen
                t = time.perf_counter()
                c.mask()
                full.append(time.perf_counter() - t)
                t = time.perf_counter()
                c.forced()
                ff.append(time.perf_counter() - t)
                t = time.perf_counter()
                c.advance(tok)
                adv.append(time.perf_counter() - t)
        print(f"{kind:14} {1e3 * statistics.median(compile_s):10.2f} {len(ids):6d} |                  "
              f"{us(raw):>15} {us(full):>15} {us(adv):>15} {us(ff):>15}")

    if args.decode:
        decode(args.model, vocab, args.decode)


def decode(model: Path, vocab: Vocabulary, runs: int) -> None:
    from colibri_core.engine import load

    with load(model, usage=False) as engine:
        ids = engine.tokenizer.encode("And God said, Let there be light")
        rates: dict[str, list[float]] = {"free": [], "json_object": []}
        for _ in range(runs):
            for kind in rates:
                c = Constraint.json_object(vocab) if kind == "json_object" else None
                before = dict(engine.counters)
                engine.generate(ids, 96, stop_ids=(), constraint=c, draft="off")
                n = engine.counters["generated_tokens"] - before["generated_tokens"] - 1  # decode steps
                rates[kind].append(n / (engine.counters["decode_seconds"] - before["decode_seconds"]))
        print("decode (greedy, up to 96 tokens, prefill excluded), tok/s median: "
              + " · ".join(f"{k} {statistics.median(v):.1f}" for k, v in rates.items()))

if __name__ == "__main__":
    main()
