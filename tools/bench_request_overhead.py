"""What the server spends on a request besides the model: parsing and validating its body, and
requests/s of the smallest generation end to end.

    python tools/bench_request_overhead.py [--model DIR] [--seconds 10]

1. parse + validate: `schemas.parse_json` then `parse_chat` / `parse_completion` on three
   representative bodies (a one-turn chat; an 8-turn chat with a system prompt, tools and
   sampling knobs; a completion of 512 token ids with stop strings and logit_bias), µs per body,
   the best of 7 rounds.
2. end to end: POST /v1/chat/completions with max_tokens=1, one after another, through the ASGI
   app in this process (Starlette's TestClient: no sockets), on the model (default: the bundled
   demo), requests/s over --seconds after a warm-up.

To compare two trees, run the same script with PYTHONPATH set to each (the script only imports
`colibri_core`): e.g. `PYTHONPATH=/tmp/before python tools/bench_request_overhead.py`.
"""
from __future__ import annotations

import argparse
import json
import time

import colibri_core
from colibri_core.server import ServerConfig, create_app
from colibri_core.server.schemas import Limits, parse_chat, parse_completion, parse_json

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TURNS = [{"role": "system", "content": "You are a helpful assistant."}] + [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "the quick brown fox " * 8}
    for i in range(7)]
BODIES = {
    "chat, one turn": (parse_chat, {"model": "m", "messages": [{"role": "user", "content": "Hello there"}],
                                    "max_tokens": 16}),
    "chat, 8 turns + tools": (parse_chat, {"messages": TURNS, "tools": [WEATHER], "tool_choice": "auto",
                                           "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n\n"],
                                           "max_tokens": 64, "stream": True,
                                           "stream_options": {"include_usage": True}}),
    "completion, 512 ids": (parse_completion, {"prompt": list(range(512)), "max_tokens": 32, "temperature": 1.0,
                                               "top_k": 40, "stop": ["a", "b"], "logit_bias": {"5": -100},
                                               "presence_penalty": 0.5}),
}


def parse_cost(rounds: int = 7, n: int = 2000) -> dict[str, float]:
    lim = Limits(context=4096, vocab=50_000, max_tokens=None)
    out = {}
    for name, (parse, body) in BODIES.items():
        raw = json.dumps(body).encode()
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(n):
                parse(parse_json(raw), lim)
            best = min(best, (time.perf_counter() - t) / n)
        out[name] = best * 1e6
    return out


def requests_per_second(model: str, seconds: float) -> float:
    from starlette.testclient import TestClient

    app = create_app(ServerConfig(model))
    body = {"messages": [{"role": "user", "content": "In the beginning"}], "max_tokens": 1, "temperature": 0}
    with TestClient(app, base_url="http://127.0.0.1") as client:
        app.state.server.loaded.wait()
        for _ in range(20):  # warm-up
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            n += 1
        return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled demo)")
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    from colibri_core.demo import demo_model

    print(f"colibri_core from {colibri_core.__file__}")
    for name, us in parse_cost().items():
        print(f"parse + validate  {name:24s} {us:8.1f} µs")
    rps = requests_per_second(a.model or str(demo_model()), a.seconds)
    print(f"end to end        chat, max_tokens=1        {rps:8.1f} requests/s ({1000 / rps:.2f} ms each)")


if __name__ == "__main__":
    main()
