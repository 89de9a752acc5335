"""What the server measures: request counters, latency histograms, recent turns, a history of the
hit rate and token rate over time, and their Prometheus text form (`colibri_` prefix). The engine's
own counters come from the worker's latest snapshot (snapshot.py)."""
from __future__ import annotations

import re
import threading
import time
from collections import deque

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

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


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


def _help(lines: list[str], name: str, kind: str, text: str) -> None:
    lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]


def prometheus(metrics: Metrics, stats: dict | None, queue: dict, model: str) -> str:
    """The Prometheus text exposition (version 0.0.4)."""
    lines: list[str] = []
    escaped = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # the format's label escapes
    label = f'model="{escaped}"'
    _help(lines, "colibri_requests_total", "counter", "HTTP generation requests by endpoint and outcome.")
    with metrics._lock:
        requests = dict(metrics.requests)
        ttft, turn = metrics.ttft, metrics.turn_seconds
        ttft_lines, turn_lines = ttft.lines("colibri_time_to_first_token_seconds"), turn.lines("colibri_request_seconds")
        last = metrics.turns[-1] if metrics.turns else None
    for (endpoint, outcome), n in sorted(requests.items()):
        lines.append(f'colibri_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} {n}')
    _help(lines, "colibri_time_to_first_token_seconds", "histogram",
          "From request arrival (queue included) to the first generated token.")
    lines += ttft_lines
    _help(lines, "colibri_request_seconds", "histogram", "Time from the start of a generation to its end.")
    lines += turn_lines
    _help(lines, "colibri_queue_depth", "gauge", "Requests waiting for the generation worker.")
    lines.append(f"colibri_queue_depth {queue['waiting']}")
    _help(lines, "colibri_queue_capacity", "gauge", "Requests that may wait before new ones get 429.")
    lines.append(f"colibri_queue_capacity {queue['capacity']}")
    _help(lines, "colibri_requests_running", "gauge", "Generations running now, decoded together (at most --parallel).")
    lines.append(f"colibri_requests_running {queue['running']}")
    _help(lines, "colibri_model_loaded", "gauge", "1 once the model is loaded.")
    lines.append(f"colibri_model_loaded{{{label}}} {0 if stats is None else 1}")
    if last is not None:
        _help(lines, "colibri_tokens_per_second", "gauge", "Decode rate of the most recent generation.")
        lines.append(f"colibri_tokens_per_second {last['decode_tokens_per_second']:.6f}")
    if stats is None:
        return "\n".join(lines) + "\n"
    counters = {  # engine counter → (metric, type, help)
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
    for key, value in sorted(stats.items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "time_to_first_token":
            continue
        name, kind, text = counters.get(key, ("colibri_" + re.sub(r"[^a-zA-Z0-9_]", "_", key), "gauge",
                                              f"Engine statistic {key}."))
        _help(lines, name, kind, text)
        lines.append(f"{name} {value}")
    for key, name, kind, text in (
            ("layer_hit_rate", "colibri_layer_hit_rate", "gauge", "Expert cache hit rate per MoE layer."),
            ("layer_io_stall_seconds", "colibri_layer_io_stall_seconds_total", "counter",
             "Seconds each MoE layer waited for expert reads.")):
        per_layer = stats.get(key)
        if isinstance(per_layer, dict):
            _help(lines, name, kind, text)
            lines += [f'{name}{{layer="{layer}"}} {value:.6f}' for layer, value in per_layer.items()]
    latency = stats.get("remote_latency")
    if isinstance(latency, dict):
        name = "colibri_remote_call_seconds"
        _help(lines, name, "histogram", "Latency of answered remote shard calls (send to answer).")
        lines += [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(latency["buckets"], latency["counts"])]
        lines += [f'{name}_bucket{{le="+Inf"}} {latency["count"]}', f"{name}_sum {latency['sum']:.6f}",
                  f"{name}_count {latency['count']}"]
    shards = stats.get("remote_shard_table")
    if isinstance(shards, dict):
        shards = list(shards.values())
        _help(lines, "colibri_remote_shard_up", "gauge", "1 while a remote shard is in use, per shard and node.")
        lines += [f'colibri_remote_shard_up{{shard="{r["shard"]}",address="{r["address"]}",node="{r["node"]}"}} '
                  f'{1 if r["state"] == "up" else 0}' for r in shards]
        _help(lines, "colibri_remote_shard_calls_total", "counter", "Answered calls per remote shard.")
        lines += [f'colibri_remote_shard_calls_total{{shard="{r["shard"]}"}} {r["calls"]}' for r in shards]
    return "\n".join(lines) + "\n"
