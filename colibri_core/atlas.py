"""What the experts know: every routed expert characterised by the topics that route to it, and
placed in three dimensions by that affinity (the dashboard's Atlas, `colibri atlas`, /api/atlas).

    prompts = read_prompts(default_prompts(model_dir))      # labelled by topic, each with its source
    atlas = characterise(engine, prompts, path)              # greedy, resumable, saved after each prompt
    placed = place(atlas, seed=0)                            # 3D positions, clusters, cross-layer hubs
    doc = document(atlas, placed, tiers, heat, sizes)        # JSON: /api/atlas, `colibri atlas --json`

Characterisation runs each prompt through the normal engine (the tiered store as usual, so a model
larger than RAM works) for a bounded number of greedy tokens, and counts per topic how often each
(MoE layer, expert) was routed to: the engine's probe counts (probe.py), diffed around each prompt.
An expert's *topic shares* are then how much more of each topic's routing in its layer it takes
than its layer's other experts, normalised over topics: `shares`. Beside them it counts each layer's
*co-activation*: how many tokens routed to both of two experts (the router's top-k of one token).

The file ``.coli_atlas`` lives in the model's state directory beside ``.coli_usage`` (statedir.py)
and is bound to the model the same way (store/usage.py's fingerprint):

    {"format": "colibri-atlas", "version": 1, "fingerprint": "sha256:…", "moe_layers": [0, 1, …],
     "n_experts": 64, "max_tokens": 16, "prompts_total": 48,
     "topics": [{"name": "law", "sources": ["…", …], "prompts": 8, "tokens": 812}, …],
     "counts": [[[…n_experts ints…] per MoE layer] per topic],
     "done": ["prompt key", …],                      # prompts counted so far (`prompt_key`)
     "workload": null or {"tokens": n, "counts": [[…] per MoE layer]},   # from .coli_usage
     "coactivation": [[[…n_experts ints…] per expert] per MoE layer],  # tokens routed to both
     "crc32": crc32 of the JSON of [topics, counts, done, workload, coactivation]}

It is written atomically after every prompt, so a run stopped at any point is continued by the
next one; a file of another model, another version or a damaged one is refused with one line
(`AtlasRefused`) and a new characterisation replaces it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from .demo import is_demo
from .errors import ColibriError
from .fsio import read_bounded, write_atomic

__all__ = ["ATLAS_FILE", "Prompt", "Atlas", "AtlasRefused", "read_prompts", "default_prompts", "characterise",
           "place", "document", "WORKLOAD"]

ATLAS_FILE = ".coli_atlas"
FORMAT = "colibri-atlas"
VERSION = 2  # 2: co-activation counts
WORKLOAD = "your workload"  # the topic the routing history (.coli_usage) adds: what the user ran
MAX_COUNT = 2**53
MAX_PROMPT_FILE = 16 << 20  # a prompt set larger than this is no prompt set
MAX_TOPICS = 256  # topics in a prompt set at most (what bounds an atlas file's size: `max_file_bytes`)
NEIGHBOURS = 8  # an expert's neighbourhood: its nearest experts by topic profile (`place`)
PULL, PULLS = 0.5, 2  # `place`: how far, and how many times, experts move toward those they fire with
SHARED_LAYERS = 3  # an expert in the neighbourhoods of experts from this many other layers is a cross-layer hub
TIERS = ("disk", "cached", "pinned")  # as the Brain's (server/brain.py)


class AtlasRefused(ColibriError):
    """An atlas file that is not a whole characterisation of this model (the message says why)."""


# ---- prompts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    topic: str
    text: str
    source: str  # where the text comes from (a public-domain work, or "self-written")


def default_prompts(model_dir) -> Path:
    """The prompt set shipped with colibri for `model_dir`: the bundled KJV demo's own (its books by
    genre), else the general one (code, mathematics, natural languages, chat, law, medicine, …)."""
    name = "kjv.json" if is_demo(model_dir) else "default.json"
    return Path(str(resources.files(__package__) / "atlas_prompts" / name))


def read_prompts(path) -> list[Prompt]:
    """A prompt set: JSON ``{"prompts": [{"topic": …, "text": …, "source": …}, …]}``; a one-line
    ColibriError naming what is wrong with it."""
    data = read_bounded(path, MAX_PROMPT_FILE, "prompt set")
    try:
        d = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        raise ColibriError(f"{path}: the prompt set is not JSON") from None
    items = d.get("prompts") if isinstance(d, dict) else None
    if not isinstance(items, list) or not items:
        raise ColibriError(f'{path}: a prompt set is {{"prompts": [{{"topic": …, "text": …, "source": …}}, …]}}')
    prompts = []
    for i, p in enumerate(items):
        if not (isinstance(p, dict) and all(isinstance(p.get(k), str) and p[k].strip() for k in ("topic", "text", "source"))):
            raise ColibriError(f"{path}: prompt {i} needs a non-empty topic, text and source")
        if p["topic"] == WORKLOAD:
            raise ColibriError(f"{path}: prompt {i}: the topic {WORKLOAD!r} is the routing history's")
        prompts.append(Prompt(p["topic"], p["text"], p["source"]))
    if len({p.topic for p in prompts}) > MAX_TOPICS:
        raise ColibriError(f"{path}: more than {MAX_TOPICS} topics")
    return prompts


def prompt_key(prompt: Prompt, max_tokens: int) -> str:
    """What names a counted prompt in the file: its topic, text and token bound, hashed."""
    return hashlib.sha256(json.dumps([prompt.topic, prompt.text, max_tokens]).encode()).hexdigest()[:24]


# ---- the file -----------------------------------------------------------------------------------

def _crc(value) -> int:
    return zlib.crc32(json.dumps(value, separators=(",", ":")).encode())


def _counts_ok(rows, layers: int, n_experts: int) -> bool:
    """(MoE layers, experts) of ints from 0 to MAX_COUNT."""
    return (isinstance(rows, list) and len(rows) == layers
            and all(isinstance(r, list) and len(r) == n_experts for r in rows)
            and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_COUNT for r in rows for c in r))


def max_file_bytes(topics: int, layers: int, n_experts: int) -> int:
    """The bound on an atlas file: every count at MAX_COUNT's 16 digits for `topics` + 1 (the
    workload) and the co-activation's experts² per layer, twice over, plus 16 MiB for topic names,
    sources and prompt keys."""
    return 2 * (topics + 1 + n_experts) * layers * n_experts * 17 + (16 << 20)


@dataclass
class Atlas:
    """Routing counts per (topic, MoE layer, expert) of one model, and the prompts they came from."""

    fingerprint: str
    moe_layers: list[int]
    n_experts: int
    max_tokens: int
    prompts_total: int = 0
    topics: list[dict] = field(default_factory=list)  # {"name", "sources", "prompts", "tokens"} each
    counts: np.ndarray = None  # (topics, MoE layers, experts) int64
    done: set[str] = field(default_factory=set)
    workload: dict | None = None  # {"tokens": n, "counts": (MoE layers, experts) int64} from .coli_usage
    coactivation: np.ndarray = None  # (MoE layers, experts, experts) int64: tokens routed to both (0 diagonal)

    def __post_init__(self):
        if self.counts is None:
            self.counts = np.zeros((len(self.topics), len(self.moe_layers), self.n_experts), np.int64)
        if self.coactivation is None:
            self.coactivation = np.zeros((len(self.moe_layers), self.n_experts, self.n_experts), np.int64)

    @property
    def complete(self) -> bool:
        return len(self.done) >= self.prompts_total

    def topic_index(self, name: str, source: str) -> int:
        """The row of topic `name` (added if new), `source` among its prompts' sources."""
        i = next((i for i, t in enumerate(self.topics) if t["name"] == name), None)
        if i is None:
            self.topics.append({"name": name, "sources": [], "prompts": 0, "tokens": 0})
            self.counts = np.concatenate([self.counts, np.zeros((1, *self.counts.shape[1:]), np.int64)])
            i = len(self.topics) - 1
        if source not in self.topics[i]["sources"]:
            self.topics[i]["sources"].append(source)
        return i

    def profile(self) -> tuple[list[str], np.ndarray]:
        """(topic names, counts (topics, MoE layers, experts)), the workload last if there is one."""
        names = [t["name"] for t in self.topics]
        counts = self.counts
        if self.workload is not None and self.workload["tokens"] > 0:
            names, counts = names + [WORKLOAD], np.concatenate([counts, self.workload["counts"][None]])
        return names, counts

    def shares(self) -> tuple[list[str], np.ndarray]:
        """(topic names, shares (MoE layers, experts, topics) float64): per expert, each topic's part
        of what routes to it beyond its layer's average, summing to 1 over topics (0 for an expert
        no topic routed to).

        Topic t's routing in layer l is split over the layer's experts (its share of t's routed
        tokens, so a frequent topic weighs no more than a rare one); an expert's topic shares are
        those fractions normalised over topics: 1/topics each for an expert every topic uses alike.
        """
        names, counts = self.profile()
        totals = counts.sum(axis=2, keepdims=True)  # (T, L, 1)
        split = np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)  # (T, L, E)
        per_expert = split.transpose(1, 2, 0)  # (L, E, T)
        norm = per_expert.sum(axis=2, keepdims=True)
        return names, np.divide(per_expert, norm, out=np.zeros(per_expert.shape), where=norm > 0)

    # -- saving and loading

    def _body(self) -> list:
        workload = None if self.workload is None else {"tokens": self.workload["tokens"],
                                                       "counts": self.workload["counts"].tolist()}
        return [self.topics, self.counts.tolist(), sorted(self.done), workload, self.coactivation.tolist()]

    def save(self, path: Path) -> None:
        """Write the atlas atomically (a temporary file renamed over the old one)."""
        body = self._body()
        d = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint, "moe_layers": self.moe_layers,
             "n_experts": self.n_experts, "max_tokens": self.max_tokens, "prompts_total": self.prompts_total,
             "topics": body[0], "counts": body[1], "done": body[2], "workload": body[3], "coactivation": body[4],
             "crc32": _crc(body)}
        path.parent.mkdir(parents=True, exist_ok=True)  # a state directory not made yet
        try:
            write_atomic(path, json.dumps(d, separators=(",", ":")).encode())
        except OSError as e:
            raise ColibriError(f"cannot save the atlas {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: Path, fingerprint: str, moe_layers: list[int], n_experts: int) -> Atlas:
        """The atlas in `path`, of the model with this fingerprint and expert layout; `AtlasRefused`
        (one line: why) for a file of another model or version, or a damaged one."""
        data = read_bounded(path, max_file_bytes(MAX_TOPICS, len(moe_layers), n_experts), "atlas")
        try:
            d = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):
            raise AtlasRefused(f"{path}: the atlas is corrupt (not JSON)") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise AtlasRefused(f"{path}: not a colibri atlas")
        if d.get("version") != VERSION:
            raise AtlasRefused(f"{path}: atlas version {str(d.get('version'))[:20]}, this colibri reads version {VERSION}")
        if d.get("fingerprint") != fingerprint:
            raise AtlasRefused(f"{path}: the atlas was made with another model")
        topics, counts, done, workload, coact = (d.get(k) for k in ("topics", "counts", "done", "workload",
                                                                     "coactivation"))
        layers = len(moe_layers)
        ok = (d.get("moe_layers") == list(moe_layers) and d.get("n_experts") == n_experts
              and all(isinstance(d.get(k), int) and d[k] >= 0 for k in ("max_tokens", "prompts_total"))
              and isinstance(topics, list) and all(
                  isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("sources"), list)
                  and all(isinstance(s, str) for s in t["sources"])
                  and all(isinstance(t.get(k), int) and t[k] >= 0 for k in ("prompts", "tokens")) for t in topics)
              and isinstance(counts, list) and len(counts) == len(topics)
              and all(_counts_ok(c, layers, n_experts) for c in counts)
              and isinstance(done, list) and all(isinstance(k, str) for k in done)
              and (workload is None or (isinstance(workload, dict) and isinstance(workload.get("tokens"), int)
                                        and _counts_ok(workload.get("counts"), layers, n_experts)))
              and isinstance(coact, list) and len(coact) == layers
              and all(_counts_ok(per_layer, n_experts, n_experts) for per_layer in coact))
        if not ok:
            raise AtlasRefused(f"{path}: the atlas is corrupt (bad counts)")
        if d.get("crc32") != _crc([topics, counts, done, workload, coact]):
            raise AtlasRefused(f"{path}: the atlas is corrupt (checksum mismatch)")
        shape = (len(topics), layers, n_experts)
        return cls(fingerprint, list(moe_layers), n_experts, d["max_tokens"], d["prompts_total"], topics,
                   np.asarray(counts, np.int64).reshape(shape), set(done),
                   None if workload is None else {"tokens": workload["tokens"],
                                                  "counts": np.asarray(workload["counts"], np.int64)},
                   np.asarray(coact, np.int64).reshape(layers, n_experts, n_experts))


# ---- characterisation ---------------------------------------------------------------------------

def characterise(engine, prompts: list[Prompt], path: Path, max_tokens: int = 16, restart: bool = False,
                 on_prompt: Callable[[Prompt, bool], None] | None = None,
                 warn: Callable[[str], None] | None = None) -> Atlas:
    """Run every prompt of `prompts` not yet counted in the atlas at `path` through `engine` (greedy,
    `max_tokens` new tokens, no early stop, nothing from the prefix cache, no drafting: each token
    routed once) and count its routing under its topic; the atlas is saved after each prompt.

    An atlas there already is continued when it counted only prompts of this set with this
    `max_tokens` (else, or with `restart`, begun anew: `warn` says why, by default a ColibriWarning).
    `on_prompt(prompt, counted)` is called for each prompt, after it is counted or found counted already.
    """
    from .store.usage import model_fingerprint, warn as colibri_warning

    warn = warn or colibri_warning
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ColibriError(f"--max-tokens must be at least 1, got {max_tokens}")
    c = engine.container
    fingerprint, layers = model_fingerprint(c), list(c.moe_layers)
    keys = [prompt_key(p, max_tokens) for p in prompts]
    atlas = None
    if path.exists() and not restart:
        try:
            atlas = Atlas.load(path, fingerprint, layers, c.n_experts)
        except ColibriError as e:
            warn(f"{e}; characterising anew")
        else:
            if atlas.max_tokens != max_tokens or not atlas.done <= set(keys):
                warn(f"{path} was made with other prompts or another --max-tokens; characterising anew")
                atlas = None
    if atlas is None:
        atlas = Atlas(fingerprint, layers, c.n_experts, max_tokens)
    atlas.prompts_total = len(set(keys))
    for prompt, key in zip(prompts, keys):
        if key in atlas.done:
            if on_prompt:
                on_prompt(prompt, False)
            continue
        routed, together, tokens = _route(engine, prompt, max_tokens)
        t = atlas.topic_index(prompt.topic, prompt.source)
        atlas.counts[t] += routed
        atlas.coactivation += together
        atlas.topics[t]["prompts"] += 1
        atlas.topics[t]["tokens"] += tokens
        atlas.done.add(key)
        atlas.save(path)
        if on_prompt:
            on_prompt(prompt, True)
    return atlas


def _route(engine, prompt: Prompt, max_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(how often `prompt` and its greedy continuation routed to each (MoE layer, expert); how many
    of their tokens routed to both of two experts, (MoE layers, experts, experts); the tokens they
    are): the engine probe's counts (probe.py) diffed around it, and each layer's routing as the
    probe is told it."""
    layers, probe, E = list(engine.container.moe_layers), engine.probe, engine.container.n_experts
    before = [probe.routed.get(layer, np.zeros(probe.n_experts, np.int64)).copy() for layer in layers]
    together = np.zeros((len(layers), E, E), np.int64)
    index = {layer: i for i, layer in enumerate(layers)}
    told = probe.add_route

    def add_route(layer: int, ids: np.ndarray) -> None:  # ids (T, k): each token's experts
        if layer in index:
            chosen = np.zeros((len(ids), E), np.int64)  # (T, E) one-hot of each token's experts
            np.put_along_axis(chosen, np.asarray(ids, np.int64).reshape(len(ids), -1), 1, axis=1)
            together[index[layer]] += chosen.T @ chosen
        told(layer, ids)

    ids = engine.tokenizer.encode(prompt.text)
    if not ids:
        raise ColibriError(f"a prompt of topic {prompt.topic!r} is no tokens")
    probe.add_route = add_route
    try:  # a session of its own: the whole prompt is prefilled (a prefix-cache hit would route nothing)
        answer = engine.generate(ids, max_tokens, temperature=0.0, stop_ids=(), session=engine.new_session(),
                                 draft="off")
    finally:
        del probe.add_route
    together[:, np.arange(E), np.arange(E)] = 0  # an expert with itself: its count, already in `routed`
    # the last token is generated, never fed: it routed nothing
    return (np.stack([probe.routed[layer] - b for layer, b in zip(layers, before)]), together,
            len(ids) + len(answer) - 1)


def add_workload(atlas: Atlas, counts: np.ndarray, tokens: int) -> None:
    """Make the routing history (.coli_usage: `counts` (MoE layers, experts), of `tokens` tokens) the
    atlas's "your workload" topic, replacing the one it had: the profile of what the user runs."""
    atlas.workload = {"tokens": int(tokens), "counts": np.asarray(counts, np.int64)} if tokens > 0 else None


# ---- placement in 3D ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Placed:
    """Where each expert goes, (MoE layer, expert) flattened layer-major: N = layers × experts."""

    topics: list[str]  # the topic names, workload last if any
    shares: np.ndarray  # (L, E, T) float64: `Atlas.shares`
    positions: np.ndarray  # (N, 3) float32, 95 % of them within the unit ball
    dominant: np.ndarray  # (N,) int: each expert's largest topic share, -1 where no topic routed to it
    shared: np.ndarray  # (N,) bool: in the neighbourhoods of experts of SHARED_LAYERS other layers
    clusters: list[dict]  # per topic some expert is dominated by: {"topic", "position", "experts"}


def place(atlas: Atlas, seed: int = 0) -> Placed:
    """Each expert's position from its topic profile, reduced to 3 dimensions, then drawn toward the
    experts it fires with.

    The profile is the square root of its topic shares (so Euclidean distance is the Hellinger
    distance between two experts' topic distributions); the reduction is PCA by LAPACK's SVD
    (numpy.linalg): exact, deterministic, and seconds for GLM-5.2's 19,456 experts, where a
    neighbour-graph method (UMAP, t-SNE) would bring scikit-learn and SciPy into the engine's
    dependencies for one picture. Each axis's sign is fixed (its largest loading positive). Then
    co-activation, which lives within a layer (expert 3 of two layers has nothing in common): PULLS
    times, each expert moves PULL of the way toward the mean position of its layer's experts
    weighted by the tokens routed to both (an expert that fires with no other stays). A small
    jitter from `seed` parts experts with the same profile (those never routed to).
    """
    topics, shares = atlas.shares()
    L, E, T = shares.shape
    x = np.sqrt(shares).reshape(L * E, T)  # (N, T)
    centred = x - x.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)  # (min(N, T), T)
    axes = np.zeros((3, T))
    axes[: min(3, len(vt))] = vt[:3]
    axes *= np.where(np.take_along_axis(axes, np.abs(axes).argmax(axis=1)[:, None], axis=1) < 0, -1.0, 1.0)
    positions = (centred @ axes.T).reshape(L, E, 3)
    weights = atlas.coactivation.astype(np.float64)  # (L, E, E)
    total = weights.sum(axis=2, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    fires = total > 0  # (L, E, 1)
    for _ in range(PULLS):
        positions = np.where(fires, (1 - PULL) * positions + PULL * (weights @ positions), positions)
    positions = positions.reshape(L * E, 3)
    radius = float(np.percentile(np.linalg.norm(positions, axis=1), 95)) or 1.0  # a few outliers do not shrink the rest
    positions = positions / radius + np.random.default_rng(seed).normal(0.0, 0.01, positions.shape)
    routed = shares.reshape(L * E, T).sum(axis=1) > 0
    dominant = np.where(routed, shares.reshape(L * E, T).argmax(axis=1), -1)
    clusters = [{"topic": topics[t], "position": positions[dominant == t].mean(axis=0).round(4).tolist(),
                 "experts": int((dominant == t).sum())} for t in range(T) if (dominant == t).any()]
    return Placed(topics, shares, positions.astype(np.float32), dominant, _shared(x, L, E), clusters)


def _shared(x: np.ndarray, L: int, E: int) -> np.ndarray:
    """(N,) bool: the experts that the NEIGHBOURS (a quarter of a layer's, at most) nearest of experts from at least SHARED_LAYERS
    other layers (every other layer, for a model with fewer) count among theirs: a topic profile
    several layers route alike, the cross-layer hubs of the Atlas."""
    n, k = len(x), min(NEIGHBOURS, max(1, E // 4), len(x) - 1)  # a model of few experts: fewer neighbours
    need = min(SHARED_LAYERS, L - 1)
    if need < 1 or k < 1:
        return np.zeros(n, bool)
    layer_of = np.repeat(np.arange(L), E)
    sq = (x * x).sum(axis=1)
    near = np.empty((n, k), np.int64)
    for start in range(0, n, 1024):  # (1024, N) distances at a time: 80 MB at GLM-5.2's size
        d = sq[start:start + 1024, None] + sq[None, :] - 2.0 * x[start:start + 1024] @ x.T
        d[np.arange(len(d)), np.arange(start, start + len(d))] = np.inf  # not its own neighbour
        near[start:start + 1024] = np.argpartition(d, k - 1, axis=1)[:, :k]
    source = np.repeat(layer_of, k)  # the layer of the expert whose neighbourhood it is
    target = near.ravel()
    other = source != layer_of[target]
    pairs = np.unique(target[other] * L + source[other])  # (neighbour, a layer that counts it) once each
    return np.bincount(pairs // L, minlength=n) >= need


# ---- the JSON -----------------------------------------------------------------------------------

def tier_codes(cached: dict, pinned: dict, moe_layers, n_experts: int) -> np.ndarray:
    """(MoE layers, experts) int: 0 on disk, 1 cached, 2 pinned (TIERS), from the store's placement
    (layer → experts in its cache, in its hot-store)."""
    codes = np.zeros((len(moe_layers), n_experts), np.int64)
    for i, layer in enumerate(moe_layers):
        codes[i, list(cached.get(layer, ()))] = 1
        codes[i, list(pinned.get(layer, ()))] = 2
    return codes


def document(atlas: Atlas, placed: Placed, tiers: np.ndarray | None, heat: np.ndarray | None,
             sizes: list[int], model: str) -> dict:
    """The atlas as JSON (/api/atlas, `colibri atlas --json`): for each expert its MoE layer, index,
    3D position, topic shares (in the order of "topics"), dominant topic, hits (tokens of the
    characterisation routed to it), heat (of the caller's routing), tier, size and whether it is a
    cross-layer hub. `tiers` and `heat` are (MoE layers, experts) ints (tier codes of TIERS), or None
    (all on disk, 0); `sizes` one expert's bytes per MoE layer."""
    L, E = len(atlas.moe_layers), atlas.n_experts
    tiers = np.zeros((L, E), np.int64) if tiers is None else tiers
    heat = np.zeros((L, E), np.int64) if heat is None else heat
    hits = atlas.counts.sum(axis=0)  # (L, E)
    shares = placed.shares.round(4)
    pos = placed.positions.astype(np.float64).round(4)
    topics = [dict(t) for t in atlas.topics]
    if placed.topics[-1:] == [WORKLOAD]:
        topics.append({"name": WORKLOAD, "sources": ["your routing history (.coli_usage)"], "prompts": 0,
                       "tokens": atlas.workload["tokens"]})
    experts = []
    for i in range(L * E):
        layer, e = divmod(i, E)
        experts.append({"layer": atlas.moe_layers[layer], "index": e, "position": pos[i].tolist(),
                        "shares": shares[layer, e].tolist(),
                        "dominant": placed.topics[placed.dominant[i]] if placed.dominant[i] >= 0 else None,
                        "hits": int(hits[layer, e]), "heat": int(heat[layer, e]), "tier": TIERS[int(tiers[layer, e])],
                        "size": int(sizes[layer]), "shared": bool(placed.shared[i])})
    return {"model": model, "complete": atlas.complete, "prompts_done": len(atlas.done),
            "prompts_total": atlas.prompts_total, "max_tokens": atlas.max_tokens, "topics": topics,
            "layers": list(atlas.moe_layers), "n_experts": E, "tier_names": list(TIERS),
            "clusters": placed.clusters, "experts": experts}


@functools.lru_cache(maxsize=2)
def _placed_file(path: str, stamp: tuple, fingerprint: str, moe_layers: tuple, n_experts: int) -> tuple[Atlas, Placed]:
    """The atlas file `path` loaded and placed, kept while its `stamp` (mtime, size) holds."""
    atlas = Atlas.load(Path(path), fingerprint, list(moe_layers), n_experts)
    return atlas, place(atlas)


def load_placed(path: Path, fingerprint: str, moe_layers: list[int], n_experts: int) -> tuple[Atlas, Placed]:
    """(the atlas at `path`, its placement), computed once per version of the file (the server's
    /api/atlas asks for it on every page load); a ColibriError when there is none or it is refused."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ColibriError(f"no atlas of this model yet ({path}): run `colibri atlas --model ...` first") from None
    return _placed_file(str(path), (st.st_mtime_ns, st.st_size), fingerprint, tuple(moe_layers), n_experts)
