"""`colibri web`: headless Chromium opens the dashboard, sends a message, sees the tokens stream in
and the brain map render, and saves screenshots (pytest's tmp dir and ./artifacts/).

Chromium is driven over the Chrome DevTools protocol (the `browser` fixture, tests/conftest.py). It
must be Debian's `chromium`; CI installs it (.ci/run). Where it is missing this test fails and says
so: it never skips.
"""
import json
import urllib.request

import pytest

from conftest import ARTIFACTS, WAIT
from live_server import LiveServer, Stream, post_json

pytestmark = pytest.mark.system  # a headless browser


@pytest.fixture(scope="module")
def web(tiny_model):
    s = LiveServer("web", tiny_model, "--cache-slots", "3")  # 3 of 8 experts per layer: some cached, some not
    yield s
    s.stop()
    assert "Traceback" not in s.text_log(), s.text_log()


def test_dashboard_chats_and_draws_the_brain(browser, web, tmp_path, tiny_model):
    b = browser
    b.call("Page.navigate", url=web.url + "/")
    b.wait_for(f"location.href.startsWith({json.dumps(web.url)}) && document.readyState === 'complete' && "
               "document.getElementById('status').textContent === 'ready'", "the model as ready")
    # every change of the answer's text is recorded, so the test sees tokens arrive one by one
    b.js("""document.getElementById('max-tokens').value = '40';
            document.getElementById('temperature').value = '0';
            window.__seen = [];
            new MutationObserver(() => {
              const m = document.querySelector('.msg.assistant');
              if (m && m.dataset.state === 'streaming') window.__seen.push(m.textContent.length);
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
            document.getElementById('prompt').value = 'the quick brown fox';
            document.getElementById('send').click(); true""")
    b.wait_for("document.querySelector('.msg.assistant')?.dataset.state === 'done'", "the answer finish")
    answer = b.js("document.querySelector('.msg.assistant').childNodes[0].nodeValue")
    seen = b.js("window.__seen")
    assert len(set(seen)) >= 3 and seen == sorted(seen), f"tokens did not stream in: {seen}"
    # what the page shows is what the API answers for the same conversation
    status, body = post_json(web.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 40, "temperature": 0})
    want = body["choices"][0]["message"]["content"]
    assert answer == want
    # the live figures and the brain map
    b.wait_for("document.getElementById('tps').textContent !== '–' && document.getElementById('ttft').textContent !== '–'",
               "tok/s and time to first token")
    b.wait_for("document.getElementById('split-legend').textContent.includes('waiting for disk')", "the time split")
    b.wait_for("document.getElementById('tier-legend').textContent.includes('cached')", "the tier bar")
    b.wait_for("document.getElementById('brain-mini').dataset.cells === '16' && "
               "+document.getElementById('brain-mini').dataset.lit > 0", "the brain map (2 layers × 8 experts, lit)")
    colours = b.js("""(() => { const c = document.getElementById('brain-mini');
                       const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                       const s = new Set(); for (let i = 0; i < d.length; i += 4) s.add(d[i] + ',' + d[i+1] + ',' + d[i+2]);
                       return s.size; })()""")
    assert colours >= 4, f"the brain canvas is nearly blank ({colours} colours)"
    tiers = b.js("document.querySelector('.brain-legend').textContent")
    assert "on disk" in tiers and "cached" in tiers
    b.wait_for("+document.getElementById('hit-chart').dataset.samples >= 2", "the hit-rate history")
    # a schema's forced tokens are drafted and accepted: the drafting figures appear
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    post_json(web.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
                                                 "temperature": 0, "response_format": {
                                                     "type": "json_schema", "json_schema": {"name": "b", "schema": schema}}})
    b.wait_for("+document.getElementById('tpf').textContent > 1 && "
               "/Drafting: [1-9]\\d* of [1-9]/.test(document.getElementById('drafting').textContent)",
               "the drafting figures (tokens per forward above 1, drafts accepted)")
    png = b.screenshot(tmp_path / "dashboard.png", ARTIFACTS / "dashboard.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    b.js("location.hash = '#brain'; true")
    b.wait_for("!document.getElementById('view-brain').hidden && "
               "document.getElementById('brain-full').dataset.cells === '16'", "the Brain page")
    b.wait_for("document.getElementById('brain-hottest').textContent.includes('Most routed')", "the hottest experts")
    b.screenshot(tmp_path / "brain.png", ARTIFACTS / "brain.png")


def test_dashboard_shows_the_prefix_cache_and_the_running_request(browser, web, tmp_path, tiny_model):
    """A prompt sent twice is served from the prefix cache the second time: while that request runs
    the Speed card names it and the prompt tokens the cache served; the Prefix cache card follows on
    its own, with what /api/stats says (prompts held, bytes against the budget, prompts and tokens
    served, their share of all prompt tokens)."""
    b = browser
    b.call("Page.navigate", url=web.url + "/")
    b.wait_for("document.getElementById('status').textContent === 'ready' && "
               "document.getElementById('live').textContent === 'Running: nothing'", "the model as ready, idle")
    assert b.js("document.getElementById('prefix-budget').textContent").startswith("budget ")
    b.js("""window.__live = [];
            new MutationObserver(() => window.__live.push(document.getElementById('live').textContent))
              .observe(document.getElementById('live'), {childList: true, characterData: true, subtree: true}); true""")
    body = {"prompt": " ".join(["colibri streams experts"] * 40), "temperature": 0}
    status, cold = post_json(web.url + "/v1/completions", {**body, "max_tokens": 1})
    assert status == 200, cold
    stream = Stream(web.url + "/v1/completions", {**body, "max_tokens": 3000, "ignore_eos": True, "stream": True})
    try:
        next(stream.events())  # its prefill is done: the page's next poll sees it run
        b.wait_for(r"window.__live.some((t) => /^Running \(1 of 4 places\): completion · \d+ prompt tokens \([1-9]\d* from the "
                   r"prefix cache\) · \d+ generated/.test(t))", "the running request, served from the prefix cache")
    finally:
        stream.close()
    b.wait_for("document.getElementById('live').textContent === 'Running: nothing'", "the request's end")
    e = json.loads(urllib.request.urlopen(web.url + "/api/stats", timeout=WAIT).read())["engine"]
    assert e["prefix_cache_hits"] >= 1
    figures = {"prefix-entries": e["prefix_cache_entries"], "prefix-hits": e["prefix_cache_hits"],
               "prefix-tokens": e["prefix_cached_tokens"],
               "prefix-share": f"{100 * e['prefix_cached_tokens'] / e['prompt_tokens']:.1f}%"}
    b.wait_for(" && ".join(f"document.getElementById({json.dumps(k)}).textContent === {json.dumps(str(v))}"
                           for k, v in figures.items()), f"the prefix cache's figures {figures}")
    legend = b.js("document.getElementById('prefix-legend').textContent")
    held, free = b.js(f"[bytes({e['prefix_cache_bytes']}), bytes({e['prefix_cache_budget'] - e['prefix_cache_bytes']})]")
    assert e["prefix_cache_bytes"] > 0 and legend == f"held {held}free {free}", legend
    b.screenshot(tmp_path / "prefix-cache.png", ARTIFACTS / "prefix-cache.png")


def test_dashboard_keeps_to_the_cap_and_the_conversation_after_stop(browser, tiny_model):
    """Under --max-tokens N the page never asks for more than N (its default of 128 was refused, every
    message, under a cap below it); a stopped answer stays in the conversation as the assistant's
    turn, so the next request alternates user and assistant as a chat template expects."""
    s = LiveServer("web", tiny_model, "--max-tokens", "1000")
    b = browser
    try:
        b.call("Page.navigate", url=s.url + "/")
        b.wait_for("document.getElementById('status').textContent === 'ready' && "
                   "document.getElementById('max-tokens').max === '1000'", "the field's bound at the server's cap")
        b.js("document.getElementById('max-tokens').value = '5000'; true")
        b.wait_for("document.getElementById('max-tokens').value === '1000'", "the field brought back to the cap")
        # the page's requests recorded, and their answers slowed (a chunk each 30 ms: the tiny model is
        # done in well under a poll otherwise), so that Stop lands midway
        b.js("""window.__bodies = [];
                const fetch0 = window.fetch;
                window.fetch = async (url, opts) => {
                  if (!String(url).endsWith('/v1/chat/completions')) return fetch0(url, opts);
                  window.__bodies.push(JSON.parse(opts.body));
                  const r = await fetch0(url, opts), reader = r.body.getReader();
                  const slow = new ReadableStream({async pull(c) {
                    const {value, done} = await reader.read();
                    if (done) { c.close(); return; }
                    await new Promise((go) => setTimeout(go, 30));
                    c.enqueue(value);
                  }});
                  return new Response(slow, {status: r.status, headers: r.headers});
                };
                document.getElementById('temperature').value = '0';
                document.getElementById('prompt').value = 'first';
                document.getElementById('send').click(); true""")
        b.wait_for("document.querySelector('.msg.assistant')?.dataset.state === 'streaming'", "the answer streaming")
        b.js("document.getElementById('stop').click(); true")
        b.wait_for("document.querySelector('.msg.assistant')?.dataset.state === 'done'", "the answer stopped")
        assert "finish: stopped" in b.js("document.querySelector('.msg.assistant').textContent")
        b.js("""document.getElementById('max-tokens').value = '3';
                document.getElementById('prompt').value = 'second';
                document.getElementById('send').click(); true""")
        b.wait_for("document.querySelectorAll('.msg.assistant')[1]?.dataset.state === 'done'", "the second answer")
        assert b.js("document.getElementById('chat-error').hidden"), b.js("document.getElementById('chat-error').textContent")
        first, second = b.js("window.__bodies")
        assert first["max_tokens"] == 1000
        assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"], second["messages"]
    finally:
        s.stop()
    assert "Traceback" not in s.text_log(), s.text_log()
