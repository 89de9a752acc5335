"""Shared fixtures: a tiny random OLMoE container built with NumPy alone (no oracle needed); the
bundled demo model served live, with its `openai` client and the engine loaded in the test's own
process (tests/test_server_*.py); headless Chromium driven over the DevTools protocol (the browser
tests, system tier)."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from colibri_core.convert import convert_checkpoint
from colibri_core.demo import demo_model
from live_server import LiveServer

COLIBRI = [sys.executable, "-m", "colibri_core"]


@pytest.fixture(autouse=True, scope="session")
def state_home(tmp_path_factory) -> Path:
    """The per-user state directory (colibri_core/statedir.py: sessions and routing history of models
    whose own directory is not written to) of this test run, never the real home's; the colibri
    processes the tests start inherit it."""
    d = tmp_path_factory.mktemp("state-home")
    os.environ["XDG_STATE_HOME"] = str(d)
    return d


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from colibri_olmoe.demo import write_checkpoint, write_tokenizer

    d = tmp_path_factory.mktemp("tiny-hf")
    eos = write_tokenizer(d, ["the quick brown fox jumps over the lazy dog " * 20, "colibri streams experts"], 300)
    write_checkpoint(d, vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                     num_experts=8, num_experts_per_tok=2, eos_token_id=eos)
    return d


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("tiny") / "int4"
    convert_checkpoint(tiny_checkpoint, dst, "int4", progress=False)
    return dst


def store_model(d: Path) -> Path:
    """A converted int4 OLMoE in `d`/m: 4 MoE layers × 16 experts, top-2 — enough experts for the
    store's eviction, lookahead and striping to matter (the store's tests build it per module)."""
    from colibri_olmoe.demo import write_checkpoint

    write_checkpoint(d / "hf", vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                     num_experts=16, num_experts_per_tok=2, seed=3)
    convert_checkpoint(d / "hf", d / "m", "int4", progress=False)
    return d / "m"


def resident_baseline(model: Path, prompt: list[int], n_new: int, slots: int) -> tuple:
    """(`prompt`'s logits, its `n_new` greedy tokens) with every expert of `model` resident (`slots`:
    its experts a layer), no prefetch, no history: what any placement must give, bit for bit."""
    from colibri_core import load

    with load(model, cache_slots=slots, prefetch=False, usage=False) as e:
        return e.logits(prompt), e.generate(prompt, n_new, stop_ids=())


def colibri(*args, env=None, **kw) -> subprocess.CompletedProcess:
    """Run the `colibri` CLI in a subprocess."""
    return subprocess.run([*COLIBRI, *map(str, args)], capture_output=True, text=True, env=env, **kw)


# ---- the bundled demo model, served live ----------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_server():
    """`colibri serve` of the demo model, one per test module; a traceback or an internal error in
    its log fails the module's last test."""
    s = LiveServer("serve", demo_model())
    yield s
    s.stop()
    assert "Traceback" not in s.text_log() and "internal error" not in s.text_log(), s.text_log()


@pytest.fixture(scope="module")
def demo_client(demo_server):
    """The `openai` client of `demo_server`, retrying nothing."""
    import openai

    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def demo_engine():
    """The demo model loaded in the test's process: what the server's answers are compared with."""
    from colibri_core import load

    with load(demo_model()) as e:
        yield e


# ---- headless Chromium (tests/test_dashboard.py, tests/test_atlas.py) -----------------------------------
# Debian's `chromium`, which CI installs (.ci/run); where it is missing a browser test fails and says so,
# it never skips.

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-port=0", "--remote-allow-origins=*", "--window-size=1500,1000",
                  "--hide-scrollbars"]
WAIT = 60  # seconds: a bound on waiting for the page, never a performance assertion
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"  # where the browser tests' screenshots go too


class DevTools:
    """The smallest Chrome DevTools protocol client: call a method, wait for its answer."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=WAIT, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, what: str):
        """Poll until `expression` is true (an exception, as on a page still loading, counts as false)."""
        deadline = time.monotonic() + WAIT
        while not self.js(f"(() => {{ try {{ return !!({expression}); }} catch (e) {{ return false; }} }})()"):
            if time.monotonic() > deadline:
                raise AssertionError(f"the dashboard never showed {what} ({expression})")
            time.sleep(0.05)

    def screenshot(self, *paths: Path) -> bytes:
        import base64

        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(png)
        return png


def _chromium(profile: Path, what: str, *flags: str, domains=("Page",)):
    """Headless Chromium with its user data in `profile`, started with `flags` beside CHROMIUM_FLAGS;
    yields the DevTools client of its page, the protocol's `domains` enabled, and stops it after."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail(f"Debian's chromium is not installed, so {what} cannot be tested: "
                    "apt-get install -y chromium (CI's .ci/run installs it)", pytrace=False)
    proc = subprocess.Popen([exe, *CHROMIUM_FLAGS, *flags, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + WAIT
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"chromium did not start: {proc.stderr.read().decode(errors='replace')[-2000:]}")
        time.sleep(0.05)
    port = port_file.read_text().split()[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=WAIT) as r:
        page = next(t for t in json.load(r) if t["type"] == "page")
    tools = DevTools(page["webSocketDebuggerUrl"])
    for domain in domains:
        tools.call(f"{domain}.enable")
    yield tools
    tools.ws.close()
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium for the dashboard (tests/test_dashboard.py)."""
    yield from _chromium(tmp_path_factory.mktemp("chromium-profile"), "the dashboard", domains=("Page", "Runtime"))


@pytest.fixture(scope="module")
def webgl_browser(tmp_path_factory):
    """Chromium for the Atlas page (tests/test_atlas.py), with WebGL drawn by SwiftShader (a CPU
    renderer: there is no GPU)."""
    yield from _chromium(tmp_path_factory.mktemp("chromium-atlas"), "the Atlas page",
                         "--use-angle=swiftshader", "--enable-unsafe-swiftshader")
