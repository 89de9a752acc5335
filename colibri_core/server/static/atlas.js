// colibri Atlas: every routed expert as a point in 3D, placed by the topics that route to it
// (/api/atlas, made by `colibri atlas`), drawn with three.js (vendored: static/vendor, tools/vendor_three.sh).
// Colour by topic, tier or heat; tiers and heat follow /api/brain live; hover and click show an
// expert's topic shares as the JSON has them.
import * as THREE from "three";
import { OrbitControls } from "/static/vendor/OrbitControls.js";

THREE.ColorManagement.enabled = false;  // colours as written: the points and the legend's swatches alike
const $ = (id) => document.getElementById(id);
const TIER_HUE = [[222, 30], [160, 60], [40, 90]];  // disk, cached, pinned: as the Brain's (app.js)
const TIER_LABEL = { disk: "on disk", cached: "cached", pinned: "pinned" };
const view = {  // what the page shows; also read by tests/test_atlas.py
  doc: null, mode: "topic", query: "", frames: 0, ready: false, error: null,
  tiers: null, heat: null,  // per expert: live tier code (0 disk, 1 cached, 2 pinned) and routing heat
};
window.atlasView = view;

function headers() {
  const key = localStorage.getItem("colibri-api-key");
  return key ? { Authorization: "Bearer " + key } : {};
}
async function getJSON(path) {
  const r = await fetch(path, { headers: headers() });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.error?.message || r.statusText);
  return body;
}
const pct = (x) => (100 * x).toFixed(1) + "%";
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));

// An expert's topics, largest share first: [[name, share], …] (the JSON's "shares", in "topics" order).
function topTopics(i, n) {
  const names = view.doc.topics.map((t) => t.name);
  return view.doc.experts[i].shares.map((s, t) => [names[t], s]).filter(([, s]) => s > 0)
    .sort((a, b) => b[1] - a[1]).slice(0, n);
}
view.topTopics = topTopics;

// ---- the scene ---------------------------------------------------------------------------------
const canvas = $("atlas-canvas");
const renderer = new THREE.WebGLRenderer({ canvas, antialias: true, preserveDrawingBuffer: true });
renderer.setPixelRatio(window.devicePixelRatio || 1);
const scene = new THREE.Scene();
scene.background = new THREE.Color(0x0b0e12);
const camera = new THREE.PerspectiveCamera(50, 1, 0.01, 100);
camera.position.set(0, 0.4, 2.6);
const controls = new OrbitControls(camera, canvas);
controls.enableDamping = true;
const raycaster = new THREE.Raycaster();
let points = null;  // THREE.Points, one vertex per expert

// Round points, sized by `size`, a ring where `ring` is 1 (pinned): the only custom shader here.
const material = new THREE.ShaderMaterial({
  transparent: true, depthWrite: false,
  uniforms: { scale: { value: 1 } },
  vertexShader: `
    attribute float size; attribute float ring; attribute vec3 color;
    varying vec3 vColor; varying float vRing;
    uniform float scale;
    void main() {
      vColor = color; vRing = ring;
      vec4 mv = modelViewMatrix * vec4(position, 1.0);
      gl_PointSize = size * scale / -mv.z;
      gl_Position = projectionMatrix * mv;
    }`,
  fragmentShader: `
    varying vec3 vColor; varying float vRing;
    void main() {
      float r = length(gl_PointCoord - vec2(0.5));
      if (r > 0.5) discard;
      vec3 c = (vRing > 0.5 && r > 0.36) ? vec3(1.0) : vColor;
      gl_FragColor = vec4(c, 1.0 - smoothstep(0.42, 0.5, r));
    }`,
});

function resize() {
  const w = canvas.clientWidth, h = canvas.clientHeight;
  renderer.setSize(w, h, false);
  camera.aspect = w / Math.max(1, h);
  camera.updateProjectionMatrix();
  material.uniforms.scale.value = h / 60;
}
window.addEventListener("resize", resize);

function build(doc) {
  view.doc = doc;
  const n = doc.experts.length;
  view.tiers = Uint8Array.from(doc.experts, (e) => doc.tier_names.indexOf(e.tier));
  view.heat = Float64Array.from(doc.experts, (e) => e.heat);
  const pos = new Float32Array(3 * n), size = new Float32Array(n);
  doc.experts.forEach((e, i) => {
    pos.set(e.position, 3 * i);
    size[i] = e.shared ? 3.6 : 2.4;
  });
  const geometry = new THREE.BufferGeometry();
  geometry.setAttribute("position", new THREE.BufferAttribute(pos, 3));
  geometry.setAttribute("color", new THREE.BufferAttribute(new Float32Array(3 * n), 3));
  geometry.setAttribute("size", new THREE.BufferAttribute(size, 1));
  geometry.setAttribute("ring", new THREE.BufferAttribute(new Float32Array(n), 1));
  geometry.computeBoundingSphere();
  points = new THREE.Points(geometry, material);
  scene.add(points);
  raycaster.params.Points.threshold = 0.012;
  $("model-name").textContent = `${doc.model} · ${n} experts (${doc.layers.length} layers × ${doc.n_experts}) · ` +
    `${doc.topics.length} topics · ${doc.prompts_done}/${doc.prompts_total} prompts` + (doc.complete ? "" : " (incomplete)");
  $("atlas-labels").innerHTML = doc.clusters.map((c, i) =>
    `<div class="cluster-label" data-cluster="${i}">${esc(c.topic)}</div>`).join("");
  canvas.dataset.experts = String(n);
  recolour();
}

// ---- colour ------------------------------------------------------------------------------------
function topicColour(t, count) {  // distinct hues, golden-angle apart
  return new THREE.Color().setHSL(((t * 0.618034) % 1 + 1) % 1, 0.7, 0.58);
}

function matches(i) {
  if (!view.query) return true;
  const q = view.query.toLowerCase();
  return topTopics(i, 3).some(([name]) => name.toLowerCase().includes(q));
}

function recolour() {
  const doc = view.doc;
  if (!doc) return;
  const colours = points.geometry.attributes.color, ring = points.geometry.attributes.ring;
  const names = doc.topics.map((t) => t.name);
  const maxHeat = Math.max(1, ...view.heat);
  let matched = 0;
  const c = new THREE.Color();
  doc.experts.forEach((e, i) => {
    if (view.mode === "topic") {
      if (e.dominant === null) c.setRGB(0.25, 0.27, 0.3); else c.copy(topicColour(names.indexOf(e.dominant), names.length));
    } else if (view.mode === "tier") {
      const [hue, sat] = TIER_HUE[view.tiers[i]];
      c.setHSL(hue / 360, sat / 100, 0.55);
    } else {
      const h = Math.log1p(view.heat[i]) / Math.log1p(maxHeat);
      c.setHSL(0.08 + 0.08 * h, 0.9, 0.12 + 0.6 * h);
    }
    const hit = matches(i);
    matched += hit;
    if (!hit) c.multiplyScalar(0.15);
    colours.setXYZ(i, c.r, c.g, c.b);
    ring.setX(i, view.tiers[i] === 2 ? 1 : 0);
  });
  colours.needsUpdate = true;
  ring.needsUpdate = true;
  view.matched = matched;
  $("atlas-matches").textContent = view.query ? `${matched} experts with "${view.query}" among their top topics` : "";
  canvas.dataset.mode = view.mode;
  legend();
}

function legend() {
  const doc = view.doc;
  let items;
  if (view.mode === "topic") {
    const counts = new Map(doc.clusters.map((c) => [c.topic, c.experts]));
    items = doc.topics.map((t, i) => [topicColour(i, doc.topics.length).getStyle(), `${t.name} ${counts.get(t.name) || 0}`]);
  } else if (view.mode === "tier") {
    const counts = [0, 0, 0];
    view.tiers.forEach((t) => counts[t]++);
    items = doc.tier_names.map((name, t) =>
      [`hsl(${TIER_HUE[t][0]} ${TIER_HUE[t][1]}% 55%)`, `${TIER_LABEL[name]} ${counts[t]}`]);
  } else {
    items = [["hsl(29 90% 12%)", "never routed"], ["hsl(58 90% 72%)", "routed most"]];
  }
  $("atlas-legend").innerHTML = items.map(([colour, label]) =>
    `<span><i style="background:${colour}"></i>${esc(label)}</span>`).join("");
}

$("atlas-mode").addEventListener("change", (e) => { view.mode = e.target.value; recolour(); });
$("atlas-search").addEventListener("input", (e) => { view.query = e.target.value.trim(); recolour(); });

// ---- hover and click ---------------------------------------------------------------------------
function pick(clientX, clientY) {
  if (!points) return -1;
  const r = canvas.getBoundingClientRect();
  const ndc = new THREE.Vector2(((clientX - r.left) / r.width) * 2 - 1, -((clientY - r.top) / r.height) * 2 + 1);
  raycaster.setFromCamera(ndc, camera);
  const hits = raycaster.intersectObject(points);
  hits.sort((a, b) => a.distanceToRay - b.distanceToRay);
  return hits.length ? hits[0].index : -1;
}

// Where expert `i` is on the screen now (client pixels): for tests, and the curious.
view.screenOf = (i) => {
  const p = new THREE.Vector3(...view.doc.experts[i].position).project(camera);
  const r = canvas.getBoundingClientRect();
  return { x: r.left + (p.x + 1) / 2 * r.width, y: r.top + (1 - p.y) / 2 * r.height };
};

function describe(i) {
  const e = view.doc.experts[i];
  return `layer ${e.layer} · expert ${e.index} · ${TIER_LABEL[view.doc.tier_names[view.tiers[i]]]} · heat ${view.heat[i]}\n` +
    topTopics(i, 3).map(([name, s]) => `${name} ${pct(s)}`).join(" · ");
}
view.describe = describe;

canvas.addEventListener("mousemove", (ev) => {
  const i = pick(ev.clientX, ev.clientY), tip = $("atlas-tip");
  view.hovered = i;
  if (i < 0) { tip.hidden = true; return; }
  tip.hidden = false;
  tip.style.left = ev.clientX + 12 + "px"; tip.style.top = ev.clientY + 12 + "px";
  tip.textContent = describe(i);
});
canvas.addEventListener("mouseleave", () => { $("atlas-tip").hidden = true; });

let downAt = null;  // a click, not the end of an orbit drag
canvas.addEventListener("pointerdown", (ev) => { downAt = [ev.clientX, ev.clientY]; });
canvas.addEventListener("pointerup", (ev) => {
  if (!downAt || Math.hypot(ev.clientX - downAt[0], ev.clientY - downAt[1]) > 4) return;
  const i = pick(ev.clientX, ev.clientY);
  view.selected = i;
  const box = $("atlas-details");
  box.hidden = i < 0;
  if (i < 0) return;
  const e = view.doc.experts[i];
  const rows = [["layer", e.layer], ["expert", e.index], ["size", (e.size / 1e6).toFixed(2) + " MB"],
                ["tier", TIER_LABEL[view.doc.tier_names[view.tiers[i]]]], ["hits", e.hits + " (characterisation)"],
                ["heat", view.heat[i] + " (this server)"], ["hub", e.shared ? "shared across layers" : "no"]];
  box.innerHTML = `<h3>Layer ${e.layer} · expert ${e.index}</h3><table>` +
    rows.map(([k, v]) => `<tr><td>${k}</td><td>${esc(v)}</td></tr>`).join("") + "</table><h3>Topics</h3><table>" +
    topTopics(i, 8).map(([name, s]) => `<tr><td>${esc(name)}</td><td>${pct(s)}</td></tr>`).join("") + "</table>";
});

// ---- live tiers and heat -----------------------------------------------------------------------
async function follow() {
  if (!view.doc) return;
  try {
    const b = await getJSON("/api/brain" + (view.passes != null ? "?since=" + view.passes : ""));
    if (b.unchanged || b.n_experts !== view.doc.n_experts) return;  // unchanged, or not the model the atlas is of
    view.passes = b.passes;
    const E = view.doc.n_experts;
    let changed = false;
    b.layers.forEach((layer, l) => {
      const row = view.doc.layers.indexOf(layer);
      if (row < 0) return;
      for (let e = 0; e < E; e++) {
        const i = row * E + e, tier = +b.tiers[l][e], heat = b.heat[l][e];
        if (view.tiers[i] !== tier || view.heat[i] !== heat) { view.tiers[i] = tier; view.heat[i] = heat; changed = true; }
      }
    });
    if (changed) recolour();
  } catch (e) { /* the server went away: the picture stays */ }
}

// ---- loop --------------------------------------------------------------------------------------
const labelAt = new THREE.Vector3();
function frame(now) {
  controls.update();
  renderer.render(scene, camera);
  if (view.doc) {
    const w = canvas.clientWidth, h = canvas.clientHeight;
    document.querySelectorAll(".cluster-label").forEach((el) => {
      labelAt.set(...view.doc.clusters[+el.dataset.cluster].position).project(camera);
      el.style.left = (labelAt.x + 1) / 2 * w + "px";
      el.style.top = (1 - labelAt.y) / 2 * h + "px";
      el.hidden = labelAt.z > 1;
    });
  }
  view.frames++;
  view.lastFrame = now;
  requestAnimationFrame(frame);
}

async function start() {
  resize();
  requestAnimationFrame(frame);
  try {
    const t0 = performance.now();
    build(await getJSON("/api/atlas"));
    view.loadMs = performance.now() - t0;
    view.ready = true;
    setInterval(follow, 1000);
  } catch (e) {
    view.error = e.message;
    $("atlas-empty").hidden = false;
    $("atlas-empty").textContent = "No atlas to draw: " + e.message;
  }
}
start();
