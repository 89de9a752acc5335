// colibri dashboard: plain JavaScript, no build step. It reads /api/stats (every second) and
// /api/brain (several times a second, only when something changed), and chats through the same
// OpenAI-compatible /v1/chat/completions endpoint any client uses, streamed as server-sent events.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  key: localStorage.getItem("colibri-api-key") || "",
  messages: [],        // the conversation sent with each request
  abort: null,         // AbortController of the answer being streamed
  history: [],         // hit-rate samples from /api/stats
  lastSample: 0,
  brain: null,         // the latest /api/brain document
  atlas: null,         // /api/atlas (`colibri atlas`): each expert's topic shares, for the Brain's hover
  flashAt: 0,          // when the latest token's experts were last updated (ms)
  model: null,
};

// ---- HTTP ------------------------------------------------------------------------------------
function headers(extra) {
  const h = Object.assign({ "Content-Type": "application/json" }, extra || {});
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function getJSON(path) {
  const r = await fetch(path, { headers: headers() });
  if (r.status === 401) { $("key-box").hidden = false; throw new Error("API key needed"); }
  if (!r.ok) throw new Error((await r.json().catch(() => ({}))).error?.message || r.statusText);
  return r.json();
}

$("key-save").onclick = () => {
  state.key = $("api-key").value.trim();
  localStorage.setItem("colibri-api-key", state.key);
  $("key-box").hidden = true;
};

// ---- formatting --------------------------------------------------------------------------------
function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}
const secs = (s) => s == null ? "–" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
const pct = (x) => x == null ? "–" : (100 * x).toFixed(1) + "%";
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));

function bar(el, legendEl, parts, total) {
  // parts: [{label, value, color, text}] drawn as a stacked bar over `total`
  const sum = total || parts.reduce((a, p) => a + p.value, 0) || 1;
  el.innerHTML = parts.map((p) =>
    `<div style="width:${Math.max(0, 100 * p.value / sum)}%;background:${p.color}" title="${esc(p.label)}: ${esc(p.text)}"></div>`).join("");
  legendEl.innerHTML = parts.map((p) =>
    `<span><i class="sw" style="background:${p.color}"></i>${esc(p.label)} <b>${esc(p.text)}</b></span>`).join("");
}
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

// ---- tabs --------------------------------------------------------------------------------------
function route() {
  const brain = location.hash === "#brain";
  $("view-dashboard").hidden = brain;
  $("view-brain").hidden = !brain;
  $("tab-dashboard").classList.toggle("active", !brain);
  $("tab-brain").classList.toggle("active", brain);
  drawBrains();
}
window.addEventListener("hashchange", route);

// ---- chat --------------------------------------------------------------------------------------
function addMessage(role, text) {
  const hint = document.querySelector("#messages .hint");
  if (hint) hint.remove();
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.textContent = text;
  $("messages").appendChild(el);
  $("messages").scrollTop = $("messages").scrollHeight;
  return el;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

async function send(text) {
  $("chat-error").hidden = true;
  const convo = state.messages;  // this turn's conversation ("New chat" starts another; this one keeps its turns)
  convo.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.dataset.state = "waiting";
  const body = {
    model: state.model || undefined,
    messages: convo,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: parseInt($("max-tokens").value, 10) || 128,
    temperature: parseFloat($("temperature").value) || 0,
  };
  state.abort = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let first = null, chunks = 0, answer = "", usage = null, finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.abort.signal,
    });
    if (!r.ok) {
      const err = (await r.json().catch(() => ({}))).error || {};
      if (r.status === 401) $("key-box").hidden = false;
      throw new Error(err.message || r.statusText);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    out.dataset.state = "streaming";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const choice = chunk.choices && chunk.choices[0];
          if (!choice) continue;
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            if (first === null) first = performance.now();
            chunks++;
            answer += piece;
            out.textContent = answer;
            $("messages").scrollTop = $("messages").scrollHeight;
            const dt = (performance.now() - first) / 1000;
            if (dt > 0 && chunks > 1) showSpeed((chunks - 1) / dt, "this answer");
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    convo.push({ role: "assistant", content: answer });
  } catch (e) {
    if (e.name === "AbortError") {  // stopped: what is on screen is the assistant's turn
      finish = "stopped";
      convo.push({ role: "assistant", content: answer });
    } else { $("chat-error").textContent = e.message; $("chat-error").hidden = false; convo.pop(); }
  } finally {
    state.abort = null;
    setBusy(false);
    out.dataset.state = "done";
    out.textContent = answer;
    const meta = document.createElement("span");
    meta.className = "meta";
    const total = (performance.now() - t0) / 1000;
    meta.textContent = [
      usage ? usage.completion_tokens + " tokens" : chunks + " chunks",
      first ? "first token " + secs((first - t0) / 1000) : null,
      secs(total),
      finish ? "finish: " + finish : null,
    ].filter(Boolean).join(" · ");
    out.appendChild(meta);
    refreshStats();
  }
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.abort) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
});
$("stop").onclick = () => state.abort && state.abort.abort();
$("new-chat").onclick = () => {
  if (state.abort) state.abort.abort();
  state.messages = [];
  $("messages").innerHTML = '<div class="hint">New conversation.</div>';
};

// ---- live figures ------------------------------------------------------------------------------
function showSpeed(tps, note) {
  $("tps").textContent = tps ? tps.toFixed(1) : "–";
  $("tps-note").textContent = note ? "(" + note + ")" : "";
}

function renderStats(s) {
  state.model = s.model;
  const e = s.engine;  // the arithmetic (--activations, --kv-cache): what the tokens depend on besides the model
  $("model-name").textContent = s.model + (s.architecture ? " · " + s.architecture : "") +
    (s.context_length ? " · context " + s.context_length : "") +
    (e ? " · " + (e.activations === "f32" ? "exact" : e.activations + " activations") + " · KV cache " + e.kv_cache : "");
  const st = $("status");
  st.className = "pill " + (s.loaded ? "ok" : s.load_error ? "error" : "loading");
  st.textContent = s.loaded ? "ready" : s.load_error ? "failed: " + s.load_error : "loading";
  if (s.max_tokens) {  // the operator's --max-tokens: the field never asks for more
    const field = $("max-tokens");
    field.max = s.max_tokens;
    if (+field.value > s.max_tokens) field.value = s.max_tokens;
  }
  const last = s.turns.length ? s.turns[s.turns.length - 1] : null;
  const decoding = s.running.filter((r) => !r.prefilling);
  if (decoding.length) showSpeed(decoding.reduce((sum, r) => sum + r.tokens_per_second, 0),
                                 decoding.length > 1 ? "live, " + decoding.length + " together" : "live");
  else if (!state.abort && last) showSpeed(last.decode_tokens_per_second, "last turn");
  $("ttft").textContent = last ? secs(last.time_to_first_token) : "–";
  $("queue").textContent = s.queue.running + " · " + s.queue.waiting;
  $("hit").textContent = s.engine ? pct(s.engine.hit_rate) : "–";
  renderDrafting(s.engine);
  renderRunning(s.running, s.queue.parallel);
  renderPrefixCache(s.engine);
  const rates = s.engine && s.engine.layer_hit_rate;
  if (rates) $("layer-rates").textContent = "Cache hit rate per layer: " +
    Object.entries(rates).map(([layer, r]) => layer + ": " + pct(r)).join(" · ");

  if (last) {
    const sp = last.split;
    const total = sp.attention + sp.experts + sp.disk + sp.other;
    $("split-total").textContent = secs(total) + " · " + last.completion_tokens + " tokens";
    bar($("split-bar"), $("split-legend"), [
      { label: "attention", value: sp.attention, color: css("--attention"), text: secs(sp.attention) },
      { label: "expert compute", value: sp.experts, color: css("--experts"), text: secs(sp.experts) },
      { label: "waiting for disk", value: sp.disk, color: css("--disk"), text: secs(sp.disk) },
      { label: "other", value: sp.other, color: css("--other"), text: secs(sp.other) },
    ], total);
  } else {
    $("split-legend").textContent = "no turn yet";
  }

  const m = s.memory;
  if (m) {
    const used = m.resident_bytes + m.pinned_bytes + m.cache_capacity_bytes;
    const budget = Math.max(m.budget_bytes || 0, used);
    $("budget").textContent = (m.budget_bytes ? "budget " + bytes(m.budget_bytes) : "no RAM budget (--cache-slots)") +
      " · " + bytes(m.expert_bytes) + " per expert · " + bytes(m.disk_bytes) + " of experts on disk";
    bar($("ram-bar"), $("ram-legend"), [
      { label: "dense weights", value: m.resident_bytes, color: css("--dense"), text: bytes(m.resident_bytes) },
      { label: "pinned experts", value: m.pinned_bytes, color: css("--pinned"), text: bytes(m.pinned_bytes) },
      { label: "expert cache", value: m.cache_bytes, color: css("--cached"), text: bytes(m.cache_bytes) },
      { label: "cache free", value: m.cache_capacity_bytes - m.cache_bytes, color: css("--free"),
        text: bytes(m.cache_capacity_bytes - m.cache_bytes) },
      { label: "unused budget", value: budget - used, color: css("--unused"), text: bytes(budget - used) },
    ], budget);
    const e = m.experts;
    bar($("tier-bar"), $("tier-legend"), [
      { label: "pinned", value: e.pinned, color: css("--pinned"), text: String(e.pinned) },
      { label: "cached", value: e.cached, color: css("--cached"), text: String(e.cached) },
      { label: "on disk only", value: e.disk, color: css("--ondisk"), text: String(e.disk) },
    ], e.total);
  }

  renderCluster(s.engine);

  for (const h of s.history) if (h.t > state.lastSample) state.history.push(h);
  if (state.history.length) state.lastSample = state.history[state.history.length - 1].t;
  state.history = state.history.slice(-300);
  drawHitChart();
}

function renderDrafting(e) {
  // speculative decoding (--draft): generated tokens per forward, drafts accepted, grammar-forced tokens
  $("tpf").textContent = e && e.tokens_per_forward ? e.tokens_per_forward.toFixed(2) : "–";
  $("drafting").textContent = !e ? "" : e.draft_drafted
    ? "Drafting: " + e.draft_accepted + " of " + e.draft_drafted + " drafted tokens accepted (" +
      pct(e.draft_acceptance) + "), " + e.draft_forced_tokens + " of them forced by a grammar"
    : "Drafting: nothing drafted yet (drafts come from a grammar's forced tokens or the model's MTP head)";
}

function renderRunning(running, parallel) {
  // the requests decoding together (at most --parallel): each one's prompt (and how much of it the prefix
  // cache served), how far it is
  const one = (l) => l.kind + " · " + l.prompt_tokens + " prompt tokens" +
    (l.prefilling ? ", prefilling" : l.cached_tokens ? " (" + l.cached_tokens + " from the prefix cache)" : "") +
    " · " + l.tokens + " generated · " + secs(l.seconds);
  $("live").textContent = !running.length ? "Running: nothing"
    : "Running" + (parallel > 1 ? " (" + running.length + " of " + parallel + " places)" : "") + ": " +
      running.map(one).join(" | ");
}

function renderPrefixCache(e) {
  // the prefix cache (--prefix-cache): prompts held, the bytes they take against its budget, what it served
  if (!e) return;
  const held = e.prefix_cache_bytes, budget = e.prefix_cache_budget, free = Math.max(0, budget - held);
  $("prefix-budget").textContent = budget ? "budget " + bytes(budget) : "off (--prefix-cache 0)";
  $("prefix-entries").textContent = String(e.prefix_cache_entries);
  $("prefix-hits").textContent = String(e.prefix_cache_hits);
  $("prefix-tokens").textContent = String(e.prefix_cached_tokens);
  $("prefix-share").textContent = e.prompt_tokens ? pct(e.prefix_cached_tokens / e.prompt_tokens) : "–";
  bar($("prefix-bar"), $("prefix-legend"), [
    { label: "held", value: held, color: css("--cached"), text: bytes(held) },
    { label: "free", value: free, color: css("--free"), text: bytes(free) },
  ], Math.max(budget, held));
}

function renderCluster(e) {
  // the remote shards (--ray): one row per shard, its node, state, experts and calls
  const card = $("cluster-card");
  card.hidden = !(e && e.remote_shards);
  if (card.hidden) return;
  const answered = e.remote_latency ? e.remote_latency.count : 0;
  $("cluster-summary").textContent = e.remote_shards_up + "/" + e.remote_shards + " shards up · " +
    (e.remote_calls / Math.max(1, e.generated_tokens)).toFixed(1) + " calls/token · " +
    (answered ? (1e3 * e.remote_seconds / answered).toFixed(2) + " ms per call" : "no call yet") + " · sent " +
    bytes(e.remote_bytes_sent) + " · failures " + e.remote_failures + " · rejoins " + e.remote_rejoins;
  const table = $("cluster-shards");
  table.replaceChildren();
  const head = table.insertRow();
  for (const h of ["shard", "node", "state", "experts", "calls", "ms/call"]) {
    const th = document.createElement("th"); th.textContent = h; head.appendChild(th);
  }
  for (const r of Object.values(e.remote_shard_table || {})) {
    const row = table.insertRow();
    row.className = r.state;
    row.title = r.placement + (r.last_error ? "\nlast error: " + r.last_error : "");
    for (const v of [r.shard, r.address + " (" + r.node.slice(0, 8) + ")", r.state + (r.warming ? ", warming" : ""),
                     r.experts + " (" + bytes(r.bytes) + ")", r.calls,
                     r.calls ? (1e3 * r.seconds / r.calls).toFixed(2) : "–"]) {
      row.insertCell().textContent = String(v);
    }
  }
}

function drawHitChart() {
  const c = $("hit-chart");
  const ctx = fitCanvas(c, c.clientWidth || 560, 150);
  const W = c.clientWidth || 560, H = 150, pad = 22;
  ctx.clearRect(0, 0, W, H);
  ctx.strokeStyle = css("--line"); ctx.fillStyle = css("--dim"); ctx.font = "10px system-ui";
  for (const y of [0, 0.5, 1]) {
    const py = H - pad - y * (H - 2 * pad);
    ctx.beginPath(); ctx.moveTo(30, py); ctx.lineTo(W - 30, py); ctx.stroke();
    ctx.fillText((y * 100).toFixed(0) + "%", 2, py + 3);
  }
  const pts = state.history;
  c.dataset.samples = String(pts.length);
  if (pts.length < 2) { ctx.fillText("waiting for samples…", 40, H / 2); return; }
  const t0 = pts[0].t, t1 = pts[pts.length - 1].t || t0 + 1;
  const x = (t) => 30 + (W - 60) * (t - t0) / Math.max(1, t1 - t0);
  const y = (v) => H - pad - v * (H - 2 * pad);
  const maxTps = Math.max(1, ...pts.map((p) => p.tokens_per_second));
  const line = (get, color, dash) => {
    ctx.strokeStyle = color; ctx.setLineDash(dash || []); ctx.lineWidth = 1.5; ctx.beginPath();
    let pen = false;
    pts.forEach((p, i) => {
      const v = get(p);
      if (v == null) { pen = false; return; }
      if (pen) ctx.lineTo(x(p.t), y(v)); else ctx.moveTo(x(p.t), y(v));
      const prev = i > 0 ? get(pts[i - 1]) : null, next = i + 1 < pts.length ? get(pts[i + 1]) : null;
      if (prev == null && next == null) ctx.arc(x(p.t), y(v), 1.5, 0, 2 * Math.PI);  // an isolated second
      pen = true;
    });
    ctx.stroke(); ctx.setLineDash([]);
  };
  line((p) => p.tokens_per_second / maxTps, css("--attention"), [3, 3]);
  line((p) => p.hit_rate_total, css("--dim"), [6, 3]);
  line((p) => p.hit_rate, css("--accent"));
  ctx.fillStyle = css("--attention");
  ctx.textAlign = "right";
  ctx.fillText(maxTps.toFixed(0) + " tok/s", W - 2, pad - 6);
  ctx.textAlign = "left";
  ctx.fillStyle = css("--dim");
  ctx.fillText(Math.round(t1 - t0) + " s", W - 50, H - 4);
}

async function refreshStats() {
  try { renderStats(await getJSON("/api/stats?since=" + state.lastSample)); }
  catch (e) { $("status").className = "pill error"; $("status").textContent = e.message; }
}

// ---- the brain map -----------------------------------------------------------------------------
const TIER_HUE = [[222, 30], [160, 60], [40, 90]];  // disk, cached, pinned: [hue, saturation %]

function fitCanvas(c, w, h) {
  const dpr = window.devicePixelRatio || 1;
  if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
    c.width = Math.round(w * dpr); c.height = Math.round(h * dpr); c.style.height = h + "px";
  }
  const ctx = c.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return ctx;
}

function drawBrain(c, maxCell) {
  const b = state.brain;
  if (!b || c.offsetParent === null) return;
  const L = b.layers.length, E = b.n_experts, label = 26;
  const W = c.clientWidth || 300;
  const cell = Math.max(2, Math.min(maxCell, Math.floor((W - label) / E)));
  const gap = cell >= 6 ? 1 : 0;
  const H = L * cell + 4;
  const ctx = fitCanvas(c, W, H);
  ctx.clearRect(0, 0, W, H);
  let maxHeat = 1;
  for (const row of b.heat) for (const h of row) if (h > maxHeat) maxHeat = h;
  const flash = Math.max(0, 1 - (performance.now() - state.flashAt) / 900);
  let lit = 0;
  const font = Math.min(11, cell);
  ctx.font = font + "px system-ui";
  ctx.textBaseline = "middle";
  for (let i = 0; i < L; i++) {
    if (cell >= 8 || i % Math.ceil(10 / cell) === 0) {
      ctx.fillStyle = css("--dim"); ctx.fillText(String(b.layers[i]), 0, i * cell + cell / 2);
    }
    const latest = new Set(b.latest[i] || []);
    for (let e = 0; e < E; e++) {
      const tier = +b.tiers[i][e], heat = b.heat[i][e];
      if (heat > 0) lit++;
      const [hue, sat] = TIER_HUE[tier];
      const light = 10 + 55 * Math.log1p(heat) / Math.log1p(maxHeat);
      ctx.fillStyle = `hsl(${hue} ${sat}% ${light}%)`;
      const x = label + e * cell, y = i * cell;
      ctx.fillRect(x, y, cell - gap, cell - gap);
      if (latest.has(e)) {
        if (flash > 0) {
          ctx.fillStyle = `rgba(255,255,255,${0.85 * flash})`;
          ctx.fillRect(x, y, cell - gap, cell - gap);
        }
        if (cell >= 6) {
          ctx.strokeStyle = "rgba(255,255,255,.9)"; ctx.lineWidth = Math.max(1, Math.min(3, cell / 16));
          ctx.strokeRect(x + ctx.lineWidth / 2, y + ctx.lineWidth / 2, cell - gap - ctx.lineWidth, cell - gap - ctx.lineWidth);
        }
      }
    }
  }
  c.dataset.cells = String(L * E);   // for tests and for the curious
  c.dataset.lit = String(lit);
  c.dataset.cell = String(cell);
  c.dataset.layout = JSON.stringify({ label, cell });
}

function drawBrains() {
  drawBrain($("brain-mini"), 36);
  drawBrain($("brain-full"), 56);
  const b = state.brain;
  if (!b) return;
  const counts = [0, 0, 0];
  for (const row of b.tiers) for (const ch of row) counts[+ch]++;
  const names = ["on disk", "cached", "pinned"];
  const legend = names.map((n, t) =>
    `<span><i class="sw" style="background:hsl(${TIER_HUE[t][0]} ${TIER_HUE[t][1]}% 50%)"></i>${n} <b>${counts[t]}</b></span>`).join("") +
    '<span><i class="sw" style="background:#fff"></i>latest token (flashes, then outlined)</span><span>brighter = routed more often</span>';
  document.querySelectorAll(".brain-legend").forEach((el) => { el.innerHTML = legend; });
  $("brain-caption").textContent = `${b.layers.length} layers × ${b.n_experts} experts · ${b.passes} forward passes`;
  const hottest = [];
  b.heat.forEach((row, i) => row.forEach((h, e) => { if (h > 0) hottest.push([h, b.layers[i], e]); }));
  hottest.sort((p, q) => q[0] - p[0]);
  $("brain-hottest").textContent = hottest.length ? "Most routed: " +
    hottest.slice(0, 8).map(([h, layer, e]) => `layer ${layer} expert ${e} (${h}×)`).join(" · ") : "No token routed yet.";
}

async function refreshBrain() {
  try {
    const since = state.brain ? "?since=" + state.brain.passes : "";
    const b = await getJSON("/api/brain" + since);
    if (!b.unchanged) {
      state.brain = b;
      state.flashAt = performance.now();
    }
  } catch (e) { /* loading, or no key yet: the stats poll reports it */ }
}

function animate() {
  if (state.brain && performance.now() - state.flashAt < 1000) drawBrains();
  requestAnimationFrame(animate);
}

function hover(e) {
  const c = e.target, b = state.brain, tip = $("brain-tip");
  if (!b || !c.dataset.layout) return;
  const { label, cell } = JSON.parse(c.dataset.layout);
  const r = c.getBoundingClientRect();
  const i = Math.floor((e.clientY - r.top) / cell), ex = Math.floor((e.clientX - r.left - label) / cell);
  if (i < 0 || i >= b.layers.length || ex < 0 || ex >= b.n_experts) { tip.hidden = true; return; }
  tip.hidden = false;
  tip.style.left = e.clientX + 12 + "px"; tip.style.top = e.clientY + 12 + "px";
  tip.textContent = `layer ${b.layers[i]} · expert ${ex} · ${["on disk", "cached", "pinned"][+b.tiers[i][ex]]} · ` +
    `routed ${b.heat[i][ex]}×` + atlasTopics(b.layers[i], ex);
}

function atlasTopics(layer, ex) {
  // the expert's top topics with their shares, from the atlas (none until `colibri atlas` has run)
  const a = state.atlas, row = a ? a.layers.indexOf(layer) : -1;
  if (row < 0 || ex >= a.n_experts) return "";
  const top = a.experts[row * a.n_experts + ex].shares.map((s, t) => [a.topics[t].name, s]).filter(([, s]) => s > 0)
    .sort((p, q) => q[1] - p[1]).slice(0, 3);
  return top.length ? " · " + top.map(([name, s]) => `${name} ${pct(s)}`).join(" · ") : "";
}

async function refreshAtlas() {
  try { state.atlas = await getJSON("/api/atlas"); } catch (e) { /* no atlas yet: the hover shows tier and heat */ }
}
$("brain-full").addEventListener("mousemove", hover);
$("brain-full").addEventListener("mouseleave", () => { $("brain-tip").hidden = true; });
window.addEventListener("resize", () => { drawBrains(); drawHitChart(); });

// ---- start -------------------------------------------------------------------------------------
route();
refreshStats();
refreshBrain().then(drawBrains);
refreshAtlas();
setInterval(refreshAtlas, 30000);  // a `colibri atlas` run may be adding prompts
setInterval(refreshStats, 1000);
setInterval(() => refreshBrain().then(drawBrains), 300);
requestAnimationFrame(animate);
