"""Resource bounds under load: 64 concurrent streaming clients against a bounded queue (some of
them walking away mid-stream), and a soak of mixed requests (good, bad, oversized, streamed,
abandoned): every request is answered 200, 4xx or 429, never 5xx; RSS stays within the RAM budget
plus a stated margin and flat across rounds; open file descriptors and threads do not grow; a
client that disconnects stops its generation within one token.

The soak runs SOAK_SECONDS in CI; RELIABILITY.md records a longer run
(COLIBRI_SOAK_SECONDS=3600 pytest tests/test_server_load.py -k soak -s).
"""
import json
import os
import random
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from live_server import LiveServer, Stream, get, post

pytestmark = pytest.mark.system  # load and soak

QUEUE = 8
PARALLEL = 4  # requests decoded together
CLIENTS = 64
BUDGET = 64 << 20  # --ram: weights + state + expert cache
MARGIN = 256 << 20  # the interpreter, numpy, tokenizers, uvicorn, buffers: what the budget does not cover
SOAK_SECONDS = float(os.environ.get("COLIBRI_SOAK_SECONDS", "15"))


def proc_figures(pid: int) -> dict:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    kib = lambda k: int(status[k].split()[0]) * 1024  # noqa: E731
    return {"rss": kib("VmRSS"), "peak_rss": kib("VmHWM"), "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


@pytest.fixture(scope="module")
def server(tiny_model):
    s = LiveServer("serve", tiny_model, "--queue", str(QUEUE), "--parallel", str(PARALLEL), "--ram", str(BUDGET))
    yield s
    rc = s.stop()
    assert rc == 130, s.text_log()
    assert "Traceback" not in s.text_log() and "internal error" not in s.text_log(), s.text_log()


def wait_idle(server, bound=60):
    deadline = time.monotonic() + bound
    while True:
        q = server.json("/api/stats")["queue"]
        if q["running"] == 0 and q["waiting"] == 0:
            return
        assert time.monotonic() < deadline, q
        time.sleep(0.02)


def stream_request(url, body, leave_after=None, timeout=120):
    """A raw streamed POST: (status, events received, finished with [DONE]); with `leave_after`,
    the client hangs up after that many events."""
    u = urllib.parse.urlsplit(url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        f = sock.makefile("rb")
        status = int(f.readline().split()[1])
        while f.readline() not in (b"\r\n", b""):
            pass
        events, done = 0, False
        if status != 200:
            return status, 0, False
        for line in f:
            if line.startswith(b"data: "):
                if line.startswith(b"data: [DONE]"):
                    done = True
                    break
                events += 1
                if leave_after is not None and events >= leave_after:
                    break
        return status, events, done
    finally:
        sock.close()


def test_64_streaming_clients_some_leaving(server):
    """While long generations take every place in the batch, 64 streaming clients arrive at once:
    QUEUE are queued and answered, decoding together (a quarter of all clients hang up after their
    first tokens), the rest get 429 at once; round after round, RSS, threads and descriptors stay
    where they were."""
    url = server.url + "/v1/completions"
    figures = []
    for round_ in range(4):
        wait_idle(server)
        blockers = [Stream(url, {"prompt": "a", "max_tokens": 4000, "temperature": 0, "stream": True,
                                 "ignore_eos": True}) for _ in range(PARALLEL)]
        for blocker in blockers:
            assert blocker.response.status == 200
            next(blocker.events())  # it runs
        bodies = [{"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0.8, "seed": i, "stream": True,
                   "ignore_eos": True} for i in range(CLIENTS)]
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(stream_request, url, b, 2 if i % 4 == 0 else None) for i, b in enumerate(bodies)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in futures) < CLIENTS - QUEUE and time.monotonic() < deadline:
                time.sleep(0.02)  # the refusals come back while the blocker still runs
            for blocker in blockers:
                blocker.close()  # its client leaves: the generation stops, the queue drains
            results = [f.result() for f in futures]
        statuses = [r[0] for r in results]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) == QUEUE and statuses.count(429) == CLIENTS - QUEUE, statuses
        for i, (status, events, done) in enumerate(results):
            if status == 200 and i % 4:
                assert done and events >= 1, (i, results[i])  # those who stayed got the whole answer
        wait_idle(server)
        assert server.get("/health")[0] == 200
        figures.append(proc_figures(server.proc.pid))
    stats = server.json("/api/stats")
    cancelled = [t for t in stats["turns"] if t["finish_reason"] == "cancelled"]
    assert cancelled and all(t["tokens_after_cancel"] is not None and t["tokens_after_cancel"] <= 1 for t in cancelled), \
        [t["tokens_after_cancel"] for t in cancelled]
    first, last = figures[1], figures[-1]  # round 0 warms up allocator pools, thread pools and caches
    assert last["rss"] - first["rss"] < 8 << 20, figures
    assert last["threads"] <= first["threads"] and last["fds"] <= first["fds"] + 2, figures
    assert max(f["peak_rss"] for f in figures) < BUDGET + MARGIN, figures


# ---- the soak ---------------------------------------------------------------------------------------
def _chunked(url: str, size: int) -> int:
    """POST `size` bytes with chunked transfer encoding; the status (0 if the server hung up first)."""
    u = urllib.parse.urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=60)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"[" * (1 << 20)
        try:
            for _ in range(size >> 20):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered 413 and closed before the whole body was sent
            pass
        reply = sock.recv(64)
        return int(reply.split()[1]) if reply else 0
    except OSError:
        return 0
    finally:
        sock.close()


# Oversized chunked bodies at once: each is held up to the 16 MiB per-request bound before its 413, so
# four at once would reach the server-wide 64 MiB of bodies in flight, answered 503 by design
# (test_server_limits tests that bound); the soak holds the other bounds to 4xx.
OVERSIZED_AT_ONCE = threading.Semaphore(3)


def mixed_requests(url: str, deadline: float, seed: int, out: list) -> None:
    rng = random.Random(seed)
    gen = url + "/v1/completions"
    chat = url + "/v1/chat/completions"
    while time.monotonic() < deadline:
        kind = rng.randrange(12)
        if kind == 0:
            status = post(chat, {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 8,
                                 "temperature": 0.7, "seed": rng.randrange(1 << 30)})[0]
        elif kind == 1:
            status = stream_request(gen, {"prompt": "colibri", "max_tokens": 12, "stream": True, "seed": -1})[0]
        elif kind == 2:
            status = stream_request(gen, {"prompt": "the lazy dog", "max_tokens": 200, "stream": True,
                                          "ignore_eos": True}, leave_after=3)[0]
        elif kind == 3:
            status = post(gen, rng.choice([b"[" * 100_000, b'{"prompt": "a\\ud800"}', b'{"prompt": NaN}',
                                           b'{"prompt": "a", "temperature": 1e-310, "max_tokens": 4}',
                                           b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", b"\xff\xfe"]))[0]
        elif kind == 4:
            status = post(gen, {"prompt": "x" * (5 << 20)})[0]  # far beyond the text bound: refused untokenized
        elif kind == 5:
            with OVERSIZED_AT_ONCE:
                status = _chunked(gen, 24 << 20)  # beyond the body limit, chunked: refused as it arrives
        elif kind == 6:
            status = post(url + "/tokenize", {"content": "the quick brown fox " * rng.randrange(1, 500)})[0]
        elif kind == 7:
            status = post(url + "/detokenize", {"tokens": [rng.randrange(300) for _ in range(rng.randrange(1, 2000))]})[0]
        elif kind == 8:
            status = get(url + rng.choice(["/metrics", "/api/stats", "/api/brain", "/openapi.json", "/v1/models"]))[0]
        elif kind == 9:
            status = post(gen, {"prompt": [rng.randrange(300) for _ in range(rng.randrange(1, 3000))], "max_tokens": 4})[0]
        elif kind == 10:
            status = post(chat, {"messages": [{"role": "user", "content": "hi"}], "n": 3})[0]
        else:
            status = post(gen, {"prompt": "the", "max_tokens": 6, "stop": ["e", "o"], "echo": True})[0]
        out.append((kind, status))


def run_clients(url: str, seconds: float, out: list, samples: list | None = None, pid: int = 0, log=None):
    """Six clients sending mixed requests for `seconds`; with `samples`, the process's figures
    every half second."""
    deadline = time.monotonic() + seconds
    threads = [threading.Thread(target=mixed_requests, args=(url, deadline, seed, out)) for seed in range(6)]
    for t in threads:
        t.start()
    started = time.monotonic()
    while any(t.is_alive() for t in threads):
        if samples is not None:
            samples.append(proc_figures(pid))
            if log is not None:  # a long run leaves its figures behind, whatever its verdict
                print(json.dumps({"t": round(time.monotonic() - started, 1), "requests": len(out), **samples[-1]}),
                      file=log, flush=True)
        time.sleep(0.5)
    for t in threads:
        t.join()


def idle_figures(server) -> dict:
    wait_idle(server)
    time.sleep(2)  # connections close, buffers are freed
    return proc_figures(server.proc.pid)


def test_soak_mixed_requests(server):
    """SOAK_SECONDS of mixed requests from 6 clients, after a warm-up of the same: never a 5xx;
    peak RSS within budget + margin (in-flight bodies included: up to 6 x 24 MiB at once); idle
    RSS, descriptors and threads after the soak where they were idle after the warm-up."""
    run_clients(server.url, 10.0, [])  # thread pools, allocator arenas, caches
    before = idle_figures(server)
    out: list = []
    samples: list = []
    log = open(os.environ["COLIBRI_SOAK_LOG"], "w") if os.environ.get("COLIBRI_SOAK_LOG") else None
    run_clients(server.url, SOAK_SECONDS, out, samples, server.proc.pid, log)
    after = idle_figures(server)
    statuses = [s for _, s in out]
    # never a 5xx; a status 0 (no answer) only where the client was still sending a refused body
    bad = {(k, s) for k, s in out if s >= 500 or (s == 0 and k != 5)}
    rss = [f["rss"] for f in samples]
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    report = {"seconds": SOAK_SECONDS, "requests": len(out),
              "by_status": {s: statuses.count(s) for s in sorted(set(statuses))},
              "idle_rss_mib": [mib(before["rss"]), mib(after["rss"])], "peak_rss_mib": mib(after["peak_rss"]),
              "rss_mib_min_max": [mib(min(rss)), mib(max(rss))],
              "rss_mib_median_by_fifth": [mib(sorted(rss[i * len(rss) // 5:(i + 1) * len(rss) // 5] or [0])[
                  len(rss[i * len(rss) // 5:(i + 1) * len(rss) // 5]) // 2]) for i in range(5)],
              "fds": [before["fds"], after["fds"], max(f["fds"] for f in samples)],
              "threads": [before["threads"], after["threads"], max(f["threads"] for f in samples)]}
    print("soak:", json.dumps(report))
    if log is not None:
        print(json.dumps({"report": report}), file=log, flush=True)
        log.close()
    assert statuses and not bad, bad
    assert statuses.count(200) > len(statuses) // 4, report  # the server did serve, not only refuse
    assert after["peak_rss"] < BUDGET + MARGIN, report
    # no growth with the number of requests: the worker gives freed pages back when idle, so the
    # idle figures agree within about 1 MiB (without that, allocator retention swung them by ±35 MiB)
    assert after["rss"] - before["rss"] < 8 << 20, report
    assert after["fds"] <= before["fds"] + 2 and after["threads"] <= before["threads"] + 1, report
