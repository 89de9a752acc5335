"""A real `colibri serve` / `colibri web` process on loopback, for the server and dashboard tests."""
from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

STARTUP_SECONDS = 120  # a bound on waiting, not a performance assertion


class LiveServer:
    """`python -m colibri_core COMMAND --port 0 ARGS…`; its stderr is collected in `log`."""

    def __init__(self, command: str, model: Path, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "colibri_core", command, "--model", str(model),
                                      "--host", "127.0.0.1", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self._url = threading.Event()
        self.url = None
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._url.wait(STARTUP_SECONDS) or self.url is None:
            self.stop()
            raise RuntimeError("the server never said where it listens:\n" + self.text_log())
        deadline = time.monotonic() + STARTUP_SECONDS
        while self.get("/health")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server never became healthy:\n" + self.text_log())
            time.sleep(0.05)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"serving .* on (http://\S+?)[;\s]", line)
            if m and self.url is None:
                self.url = m.group(1)
                self._url.set()
        self._url.set()

    def text_log(self) -> str:
        return "".join(self.log)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        return get(self.url + path, headers)

    def json(self, path: str) -> dict:
        status, body = self.get(path)
        assert status == 200, (status, body)
        return json.loads(body)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # a graceful shutdown, as Ctrl-C
            try:
                self.proc.wait(120)  # a loaded CI machine can take a while to finish in-flight work
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    """GET `url`: status and body (status 0: nothing listens)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def post(url: str, body, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict, bytes]:
    """POST `body` (bytes, or an object sent as JSON) to `url`: status, headers, body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def post_json(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    status, _, raw = post(url, body, headers)
    return status, json.loads(raw)


class Stream:
    """A streamed POST whose client can walk away mid-answer (`close`)."""

    def __init__(self, url: str, body: dict):
        u = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        self.conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()

    def events(self):
        """The `data: …` payloads as they arrive."""
        for line in self.response:
            line = line.decode().rstrip("\n")
            if line.startswith("data: "):
                yield line[6:]

    def close(self) -> None:
        self.response.close()
        self.conn.close()
