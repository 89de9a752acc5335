"""What the server measures: request counters, latency histograms, recent turns, a history of the
hit rate and token rate over time; and `/metrics` through prometheus-client, whose `Exporter` yields
the server's counters and the engine's (the worker's latest snapshot, snapshot.py) at each scrape,
as `colibri_` families, on a registry of the server's own."""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .snapshot import Snapshot

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # seconds
TURN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # cumulative: observations ≤ bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


class Metrics:
    """Server-side counters; the engine's own counters are read when a scrape asks for them."""

    def __init__(self, history_seconds: int = 600):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) → count
        self.ttft = Histogram(TTFT_BUCKETS)
        self.turn_seconds = Histogram(TURN_BUCKETS)
        self.turns: deque[dict] = deque(maxlen=50)  # the most recent turn records, newest last
        self.history: deque[dict] = deque(maxlen=history_seconds)  # one sample a second
        self._last_sample: dict | None = None
        self.started = time.time()
        self.registry = CollectorRegistry()  # this server's (a process may run several: the tests do)

    def count(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[endpoint, outcome] = self.requests.get((endpoint, outcome), 0) + 1

    def add_turn(self, turn: dict) -> None:
        with self._lock:
            self.turns.append(turn)
            if turn["time_to_first_token"] is not None:
                self.ttft.observe(turn["time_to_first_token"])
            self.turn_seconds.observe(turn["seconds"])

    def sample(self, stats: dict) -> None:
        """Add one point to the history from the engine's cumulative counters (called every second)."""
        now = time.time()
        keys = ("expert_hits", "expert_misses", "generated_tokens", "bytes_read")
        cur = {k: stats.get(k, 0) for k in keys}
        last, self._last_sample = self._last_sample, {"t": now, **cur}
        if last is None:
            return
        d = {k: cur[k] - last[k] for k in keys}
        dt = max(1e-9, now - last["t"])
        lookups = d["expert_hits"] + d["expert_misses"]
        lookups_all = stats.get("expert_hits", 0) + stats.get("expert_misses", 0)
        with self._lock:
            self.history.append({
                "t": now,
                "hit_rate": d["expert_hits"] / lookups if lookups else None,  # this second; None: idle
                "hit_rate_total": stats.get("expert_hits", 0) / lookups_all if lookups_all else None,
                "tokens_per_second": d["generated_tokens"] / dt,
                "read_bytes_per_second": d["bytes_read"] / dt,
            })

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "turns": list(self.turns), "history": list(self.history)}


# engine statistic → (metric, type, help); a number not named here is exported as a gauge
ENGINE = {
    "prompt_tokens": ("colibri_prompt_tokens_total", "counter", "Prompt tokens prefilled."),
    "generated_tokens": ("colibri_generation_tokens_total", "counter", "Tokens generated."),
    "prefill_seconds": ("colibri_prefill_seconds_total", "counter", "Seconds spent in prefill."),
    "decode_seconds": ("colibri_decode_seconds_total", "counter", "Seconds spent decoding."),
    "expert_hits": ("colibri_expert_hits_total", "counter", "Expert lookups served from RAM."),
    "expert_misses": ("colibri_expert_misses_total", "counter", "Expert lookups read from disk."),
    "bytes_read": ("colibri_bytes_read_total", "counter", "Bytes of experts read from disk."),
    "attention_seconds": ("colibri_attention_seconds_total", "counter", "Seconds in attention kernels."),
    "moe_seconds": ("colibri_moe_seconds_total", "counter", "Seconds in MoE blocks (expert compute and its waits)."),
    "io_stall_seconds": ("colibri_io_stall_seconds_total", "counter", "Seconds layers waited for expert reads."),
    "hit_rate": ("colibri_expert_hit_rate", "gauge", "Expert cache hit rate since start."),
    "decode_tokens_per_second": ("colibri_decode_tokens_per_second", "gauge", "Decode rate since start."),
    "cache_bytes": ("colibri_expert_cache_bytes", "gauge", "Bytes of experts in the cache."),
    "resident_bytes": ("colibri_resident_bytes", "gauge", "Bytes of resident (dense) weights."),
    "peak_rss_bytes": ("colibri_peak_rss_bytes", "gauge", "Peak resident set size of the process."),
    # remote shards (--ray; colibri_core/remote)
    "remote_calls": ("colibri_remote_calls_total", "counter", "Calls sent to remote expert shards (one per shard per MoE layer)."),
    "remote_failures": ("colibri_remote_failures_total", "counter", "Remote shards marked down (an error, a death or a missed deadline)."),
    "remote_timeouts": ("colibri_remote_timeouts_total", "counter", "Remote calls that missed their deadline."),
    "remote_rejoins": ("colibri_remote_rejoins_total", "counter", "Remote shards used again after a failure."),
    "remote_bytes_sent": ("colibri_remote_bytes_sent_total", "counter", "Bytes of hidden states and expert ids sent to remote shards."),
    "remote_bytes_received": ("colibri_remote_bytes_received_total", "counter", "Bytes of expert outputs received from remote shards."),
    "remote_seconds": ("colibri_remote_seconds_total", "counter", "Seconds from sending remote calls to their answers, summed."),
    "remote_fallback_experts": ("colibri_remote_fallback_experts_total", "counter", "Experts computed locally because their shard failed."),
    "remote_prefetches": ("colibri_remote_prefetches_total", "counter", "Lookahead guesses sent to shards still reading their experts."),
    "remote_local_fills": ("colibri_remote_local_fills_total", "counter", "Experts computed remotely then read into free local cache slots."),
    "remote_shards": ("colibri_remote_shards", "gauge", "Remote expert shards placed."),
    "remote_shards_up": ("colibri_remote_shards_up", "gauge", "Remote expert shards in use now."),
    "draft_drafted": ("colibri_draft_tokens_total", "counter", "Tokens drafted for speculative decoding."),
    "draft_accepted": ("colibri_draft_accepted_total", "counter", "Drafted tokens the model accepted."),
    "draft_forced_tokens": ("colibri_draft_forced_tokens_total", "counter", "Tokens a grammar forced, drafted and accepted."),
    "draft_acceptance": ("colibri_draft_acceptance_ratio", "gauge", "Accepted over drafted tokens."),
    "tokens_per_forward": ("colibri_tokens_per_forward", "gauge", "Generated tokens per forward pass (above 1 with accepted drafts)."),
    "prefix_cache_hits": ("colibri_prefix_cache_hits_total", "counter", "Prompts started from a cached prefix."),
    "prefix_cached_tokens": ("colibri_prefix_cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache instead of prefilled."),
    "prefix_cache_bytes": ("colibri_prefix_cache_bytes", "gauge", "Bytes of states the prefix cache holds."),
    "prefix_cache_entries": ("colibri_prefix_cache_entries", "gauge", "Prompts whose states the prefix cache holds."),
    "prefix_cache_budget": ("colibri_prefix_cache_budget_bytes", "gauge", "The prefix cache's byte budget (0: off)."),
}
PER_LAYER = (("layer_hit_rate", "colibri_layer_hit_rate", "gauge", "Expert cache hit rate per MoE layer."),
             ("layer_io_stall_seconds", "colibri_layer_io_stall_seconds_total", "counter",
              "Seconds each MoE layer waited for expert reads."))
FAMILY = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


def _family(kind: str, name: str, text: str, value: float | None = None, labels=()):
    return FAMILY[kind](name, text, value=value, labels=labels or None)


def _histogram(name: str, text: str, bounds, cumulative, count: int, total: float) -> HistogramMetricFamily:
    """Bucket bounds printed with %g (le="1", not prometheus-client's "1.0"), as scrapers have always seen them."""
    buckets = [(f"{b:g}", c) for b, c in zip(bounds, cumulative)] + [("+Inf", count)]
    return HistogramMetricFamily(name, text, buckets=buckets, sum_value=total)


class Exporter:
    """The prometheus-client collector of a server's families, read at each scrape: its request
    counters and latency histograms (`metrics`), the queue (`queue()`: waiting, capacity, running),
    and the engine's statistics (`snapshot()`: the worker's latest, None while the model loads)."""

    def __init__(self, metrics: Metrics, model: str, snapshot: Callable[[], Snapshot | None], queue: Callable[[], dict]):
        self.metrics, self.model, self.snapshot, self.queue = metrics, model, snapshot, queue

    def collect(self):
        m, snap, queue = self.metrics, self.snapshot(), self.queue()
        stats = snap.stats if snap is not None else None
        requests = _family("counter", "colibri_requests_total", "HTTP generation requests by endpoint and outcome.",
                           labels=("endpoint", "outcome"))
        with m._lock:
            for labels, n in sorted(m.requests.items()):
                requests.add_metric(labels, n)
            ttft = _histogram("colibri_time_to_first_token_seconds", "From request arrival (queue included) to the "
                              "first generated token.", m.ttft.buckets, m.ttft.counts, m.ttft.count, m.ttft.sum)
            turn = _histogram("colibri_request_seconds", "Time from the start of a generation to its end.",
                              m.turn_seconds.buckets, m.turn_seconds.counts, m.turn_seconds.count, m.turn_seconds.sum)
            last = m.turns[-1] if m.turns else None
        yield from (requests, ttft, turn)
        yield _family("gauge", "colibri_queue_depth", "Requests waiting for the generation worker.", queue["waiting"])
        yield _family("gauge", "colibri_queue_capacity", "Requests that may wait before new ones get 429.", queue["capacity"])
        yield _family("gauge", "colibri_requests_running", "Generations running now, decoded together (at most --parallel).",
                      queue["running"])
        loaded = _family("gauge", "colibri_model_loaded", "1 once the model is loaded.", labels=("model",))
        loaded.add_metric((self.model,), 0 if stats is None else 1)
        yield loaded
        if last is not None:
            yield _family("gauge", "colibri_tokens_per_second", "Decode rate of the most recent generation.",
                          last["decode_tokens_per_second"])
        if stats is not None:
            yield from self._engine(stats)

    def _engine(self, stats: dict):
        for key, value in sorted(stats.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "time_to_first_token":
                continue
            name, kind, text = ENGINE.get(key, ("colibri_" + re.sub(r"[^a-zA-Z0-9_]", "_", key), "gauge",
                                                f"Engine statistic {key}."))
            yield _family(kind, name, text, value)
        for key, name, kind, text in PER_LAYER:
            if isinstance(per_layer := stats.get(key), dict):
                family = _family(kind, name, text, labels=("layer",))
                for layer, value in per_layer.items():
                    family.add_metric((str(layer),), value)
                yield family
        if isinstance(latency := stats.get("remote_latency"), dict):
            yield _histogram("colibri_remote_call_seconds", "Latency of answered remote shard calls (send to answer).",
                             latency["buckets"], latency["counts"], latency["count"], latency["sum"])
        if isinstance(shards := stats.get("remote_shard_table"), dict):
            up = _family("gauge", "colibri_remote_shard_up", "1 while a remote shard is in use, per shard and node.",
                         labels=("shard", "address", "node"))
            calls = _family("counter", "colibri_remote_shard_calls_total", "Answered calls per remote shard.",
                            labels=("shard",))
            for r in shards.values():
                up.add_metric((str(r["shard"]), str(r["address"]), str(r["node"])), 1 if r["state"] == "up" else 0)
                calls.add_metric((str(r["shard"]),), r["calls"])
            yield from (up, calls)
