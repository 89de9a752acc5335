"""What the HTTP server costs: decode tok/s and time to first token, engine alone vs through the API.

    python tools/bench_server.py --model models/demo-olmoe [--tokens 128] [--repeats 3]

Runs the engine in this process (greedy, end-of-sequence ignored, so every run makes --tokens
tokens), then `colibri serve` in a subprocess on loopback with the same prompt through the
`openai` client, streamed and not. Prints one line per mode (the best of --repeats runs).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time

import openai

PROMPT = "Once upon a time"


def engine_alone(model: str, tokens: int, repeats: int) -> tuple[float, float]:
    from colibri_core import load

    with load(model) as engine:
        ids = engine.tokenizer.encode(PROMPT)
        best = (0.0, float("inf"))
        for _ in range(repeats):
            t0 = time.perf_counter()
            first = None
            for i, _ in enumerate(engine.stream(ids, tokens, stop_ids=())):
                if i == 0:
                    first = time.perf_counter()
            end = time.perf_counter()
            best = (max(best[0], (tokens - 1) / (end - first)), min(best[1], first - t0))
    return best


def through_api(url: str, model: str, tokens: int, repeats: int, stream: bool) -> tuple[float, float]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    best = (0.0, float("inf"))
    for _ in range(repeats):
        t0 = time.perf_counter()
        if stream:
            first, n = None, 0
            for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                if chunk.usage:
                    n = chunk.usage.completion_tokens
                elif first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
            best = (max(best[0], (n - 1) / (end - first)), min(best[1], first - t0))
        else:
            r = client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
            end = time.perf_counter()
            best = (max(best[0], r.usage.completion_tokens / (end - t0)), best[1])
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from colibri_core.planning import memory_bandwidth

    print(f"memory bandwidth:    {memory_bandwidth() / 1e9:7.1f} GB/s (the kernel threads' read; the experts are "
          "cached in RAM here, so no disk)")
    tps, ttft = engine_alone(a.model, a.tokens, a.repeats)
    print(f"engine alone:        {tps:7.1f} tok/s decode · TTFT {1000 * ttft:6.1f} ms")
    proc = subprocess.Popen([sys.executable, "-m", "colibri_core", "serve", "--model", a.model, "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            url = url or (re.search(r"on (http://\S+?)[;\s]", line) or [None, None])[1]
            if "ready" in line:
                break
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the access log flowing
        model = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data[0].id
        tps, ttft = through_api(url, model, a.tokens, a.repeats, stream=True)
        print(f"API, streamed (SSE): {tps:7.1f} tok/s decode · TTFT {1000 * ttft:6.1f} ms (HTTP + template included)")
        tps, _ = through_api(url, model, a.tokens, a.repeats, stream=False)
        print(f"API, not streamed:   {tps:7.1f} tok/s end to end (prefill included)")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
