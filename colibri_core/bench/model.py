"""`colibri bench --model DIR` (also `colibri bench model --model DIR`): the decode benchmark protocol.

1. Measure the machine: disk bandwidth (O_DIRECT reads of random whole expert extents, 8 in
   flight on the store's 4-thread I/O pool: the floor's disk term; a sequential scan of the expert
   files is reported beside it) and memory bandwidth.
2. Resident compute time: every prompt run twice with every expert cached; the second pass reads
   nothing, so its decode time per token is pure compute on this machine, in this run.
3. For each budget (dense weights + 25 % / 50 % of the experts), with a fresh routing history:
   - session 1, cold: page cache dropped (where permitted) and experts read with O_DIRECT (where
     the filesystem allows it), then a few different prompts; then a warm repeat of the first
     prompt in the same session (warm: the expert cache holds what the session read);
   - session 2, learned: page cache dropped again, a new engine with the history session 1 wrote
     (so the hot-store pins the experts this workload routes to most), the same prompts. The
     hot-store is read in full before the first prompt (the warm-up: its seconds and experts are
     reported on their own, not in any per-token time).
4. Per run: tok/s, time to first token, hit rate, bytes read per token, I/O stall per token (and
   per MoE layer), prefetch recall, the CPU time the hypervisor stole (on a VM), and the decode
   time per token next to the floor max(bytes read ÷ disk bandwidth, resident compute time).
5. The measured floor: every prompt again on an engine with every expert cached, while the I/O
   pool reads, for each decoded token, as many bytes as the session read per token (random expert
   extents, whole and checksummed, O_DIRECT where allowed, as the store reads; drawn apart from
   step 1's, which a cache below O_DIRECT may still hold), every read started
   with its token and waited for at its end. That is compute and reads perfectly overlapped with
   no store at all: what this machine allows for those bytes. The formula floor above assumes a
   read costs no CPU; on a small VM it does (the hypervisor's disk emulation takes the vCPUs' time),
   and this floor shows how much.
Every engine takes the command's engine options (colibri_core/options.py: the same as `colibri run`'s)
but the budget, which the protocol sets: --ram and --cache-slots are refused, and the sessions read
with O_DIRECT and record their routing history into a scratch file. The kernels' arithmetic is
exact f32 activations unless --activations int8 (recorded in the results as "activations").
Generation samples at temperature 1 with a fixed seed per prompt: decode visits varied tokens (and
so varied experts), and every engine replays exactly the same tokens.

The model directory's own `.coli_usage` is never touched: sessions record into a scratch file.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from ..options import EngineOptions, command_options

MODEL_HELP = "Converted model directory to benchmark [env: COLIBRI_MODEL]."


def drop_page_cache() -> bool:
    """sync + echo 3 > /proc/sys/vm/drop_caches; False where not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_file_pages(paths) -> None:
    """Evict these files' pages from the page cache: each is flushed, then its clean pages are
    dropped (posix_fadvise DONTNEED: no privilege needed, unlike `drop_page_cache`)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _prompts(engine, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` different prompts of `length` tokens: from text when the model has a tokenizer, else
    deterministic random token ids (synthetic models have none)."""
    import numpy as np

    texts = ["The history of the hummingbird begins in", "def stream_experts(layer, budget):\n    ",
             "Mixture-of-experts models route each token to", "Once upon a time, on a small island,",
             "The capital of France is", "In 1969 the first"]
    if (engine.model_dir / "tokenizer.json").exists():
        out = []
        for t in texts[:n]:
            ids = engine.tokenizer.encode(t)
            out.append((ids * (length // max(1, len(ids)) + 1))[:length])
        if len(out) == n:
            return out
    rng = np.random.default_rng(seed)
    vocab = engine.model.cfg.vocab_size if hasattr(engine.model.cfg, "vocab_size") else 256
    return [[int(i) for i in rng.integers(0, vocab, length)] for _ in range(n)]


_COUNTERS = ("expert_hits", "expert_misses", "bytes_read", "prefetch_issued", "prefetch_used", "prefetch_skipped",
             "io_stall_seconds")


def _cpu_ticks() -> tuple[int, int] | None:
    """(steal, all) CPU time of every CPU from /proc/stat, in ticks; None where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (ticks[7], sum(ticks)) if len(ticks) == 8 else None


def _steal(t0: tuple[int, int] | None, t1: tuple[int, int] | None) -> float | None:
    """Share of the CPUs' time between two `_cpu_ticks` that the hypervisor stole (None: unknown)."""
    if t0 is None or t1 is None or t1[1] <= t0[1]:
        return None
    return (t1[0] - t0[0]) / (t1[1] - t0[1])


def _run(engine, prompt: list[int], new_tokens: int, seed: int) -> dict:
    """One generation, sampled at temperature 1 with `seed` (so decode visits varied tokens and
    routes, as text does, and every placement replays the same tokens): time to first token, then
    decode time and the store counters it moved."""
    t0 = time.perf_counter()
    s0 = first = None
    n = 0
    for _ in engine.stream(prompt, new_tokens, temperature=1.0, seed=seed, stop_ids=()):
        n += 1
        if first is None:
            first = time.perf_counter()
            s0 = engine.store.stats()
            c0 = engine.store.counters
            pred0 = (c0.predicted_needed, c0.needed_after_prediction)
            ticks0 = _cpu_ticks()
    end = time.perf_counter()
    steal = _steal(ticks0, _cpu_ticks())
    s1 = engine.store.stats()
    c1 = engine.store.counters
    d = {k: s1[k] - s0[k] for k in _COUNTERS}
    layer_stall = {layer: t - s0["layer_io_stall_seconds"][layer] for layer, t in s1["layer_io_stall_seconds"].items()}
    decoded = n - 1
    lookups = d["expert_hits"] + d["expert_misses"]
    pred_total = c1.needed_after_prediction - pred0[1]
    return {
        "prompt_tokens": len(prompt), "decoded_tokens": decoded,
        "ttft_seconds": first - t0, "decode_seconds": end - first,
        "seconds_per_token": (end - first) / decoded if decoded else 0.0,
        "tokens_per_second": decoded / (end - first) if decoded and end > first else 0.0,
        "hit_rate": d["expert_hits"] / lookups if lookups else 0.0,
        "bytes_read_per_token": d["bytes_read"] / decoded if decoded else 0.0,
        "prefetch_recall": (c1.predicted_needed - pred0[0]) / pred_total if pred_total else 0.0,
        "cpu_steal": steal,
        **{f"decode_{k}": v for k, v in d.items()},
        "decode_layer_io_stall_seconds": layer_stall,
    }


def _floor(run: dict, resident_spt: float, disk_bw: float) -> None:
    disk = run["bytes_read_per_token"] / disk_bw
    run["floor_seconds_per_token"] = max(disk, resident_spt)
    run["floor_disk_seconds"], run["resident_compute_seconds"] = disk, resident_spt
    run["vs_floor"] = run["seconds_per_token"] / run["floor_seconds_per_token"] if run["floor_seconds_per_token"] else 0.0


class _TokenReads:
    """The measured floor's reads (protocol step 5): random whole expert extents of the model, on a
    4-thread I/O pool with their crc32 computed, as the store reads; buffers are reused, as the
    store reuses evicted experts' buffers."""

    def __init__(self, container, seed: int = 0):
        from ..container.reader import TRAILER
        from ..store import io

        self.io, self.pool = io, io.IOPool(4)
        self.trailer = TRAILER.size  # the crc leaves out the trailer's own crc field, as the store's reads do
        self.fds: dict[str, int] = {}
        self.extents = []  # (fd, offset, nbytes) of every routed expert
        self.direct = True  # O_DIRECT allowed for every file
        for layer in container.moe_layers:
            for e in range(container.n_experts):
                path, offset, nbytes = container.expert_location(layer, e)
                if path not in self.fds:
                    self.fds[path], refused = io.open_expert_file(path, True)
                    self.direct = self.direct and refused is None
                self.extents.append((self.fds[path], offset, nbytes))
        self.rng = random.Random(seed)
        self.owed = 0.0  # bytes asked for and not read yet (less than the next extent)
        self.spare: dict[int, list] = {}  # nbytes -> buffers not in use

    def start(self, nbytes: float) -> list:
        """Start reading `nbytes` more, in whole extents (what is left over is read with a later call)."""
        self.owed += nbytes
        reads = []
        while True:
            fd, offset, n = self.extents[self.rng.randrange(len(self.extents))]
            if n > self.owed:
                return reads
            self.owed -= n
            free = self.spare.setdefault(n, [])
            buffer = free.pop() if free else self.io.aligned_buffer(n)
            reads.append(self.pool.submit(fd, offset, n, crc_hole=(n - self.trailer, 4), buffer=buffer))

    def bandwidth(self, nbytes: int) -> float:
        """Bytes/s reading at least `nbytes` of random whole extents with 8 reads in flight: the disk
        as the store's reads see it (on a VM a sequential scan can be much faster or slower)."""
        unit = max(n for _, _, n in self.extents)
        t0, got, window = time.perf_counter(), 0, []
        while got < nbytes:
            while len(window) < 8:
                window += self.start(unit)
            self.finish(window[:1])
            got += window.pop(0).req.got
        self.finish(window)
        got += sum(r.req.got for r in window)
        return got / (time.perf_counter() - t0)

    def finish(self, reads: list) -> None:
        for r in reads:
            self.pool.wait(r)
            self.spare[r.req.nbytes].append((r.buf, r.ptr))

    def close(self) -> None:
        self.pool.close()
        for fd in self.fds.values():
            self.io.close_fd(fd)


def _loaded_run(engine, prompt: list[int], new_tokens: int, seed: int, bytes_per_token: float,
                reads: _TokenReads) -> dict:
    """Decode time per token of `engine` (every expert cached) while `reads` reads `bytes_per_token`
    per decoded token: started before the token is computed, waited for once it is."""
    pending, n = None, 0
    for _ in engine.stream(prompt, new_tokens, temperature=1.0, seed=seed, stop_ids=()):
        if pending is None:
            t0, ticks0 = time.perf_counter(), _cpu_ticks()
        else:
            reads.finish(pending)
            n += 1
        pending = reads.start(bytes_per_token)
    end = time.perf_counter()
    steal = _steal(ticks0, _cpu_ticks())
    reads.finish(pending)  # started for a token that never came: not timed
    return {"seconds_per_token": (end - t0) / n if n else 0.0, "cpu_steal": steal}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _session_summary(runs: list[dict]) -> dict:
    tok = sum(r["decoded_tokens"] for r in runs)
    secs = sum(r["decode_seconds"] for r in runs)
    floor = sum(r["floor_seconds_per_token"] * r["decoded_tokens"] for r in runs)
    return {"decoded_tokens": tok, "seconds_per_token": secs / tok, "tokens_per_second": tok / secs,
            "floor_seconds_per_token": floor / tok, "vs_floor": secs / floor if floor else 0.0,
            "ttft_seconds": sum(r["ttft_seconds"] for r in runs) / len(runs),
            "hit_rate": sum(r["hit_rate"] for r in runs) / len(runs),
            "bytes_read_per_token": sum(r["bytes_read_per_token"] * r["decoded_tokens"] for r in runs) / tok,
            "io_stall_seconds_per_token": sum(r["decode_io_stall_seconds"] for r in runs) / tok,
            "layer_io_stall_seconds_per_token": {layer: sum(r["decode_layer_io_stall_seconds"][layer] for r in runs) / tok
                                                 for layer in runs[0]["decode_layer_io_stall_seconds"]},
            "prefetch_recall": sum(r["prefetch_recall"] for r in runs) / len(runs),
            "cpu_steal": _mean(r["cpu_steal"] for r in runs)}


def run_protocol(model_dir: Path, fractions=(0.25, 0.5), n_prompts: int = 3, prompt_tokens: int = 8,
                 new_tokens: int = 8, seed: int = 0, say=print, drop: bool = True,
                 options: EngineOptions | None = None) -> dict:
    """The protocol above; `drop=False` never drops the page cache (cold runs use O_DIRECT); every
    engine is `options` (default: EngineOptions()) with the protocol's budget."""
    from ..container import Container
    from ..engine import load
    from ..sizes import available_memory, format_bytes
    from ..errors import ColibriError
    from ..planning import expert_bandwidth, memory_bandwidth, sizes_from_container

    options = options or EngineOptions()
    if options.ram is not None or options.cache_slots is not None:
        raise ColibriError("colibri bench sets the budget itself (--budgets): leave out --ram and --cache-slots")
    sizes = sizes_from_container(model_dir)
    experts_bytes = sizes.experts_total * sizes.expert_nbytes
    whole, free = sizes.dense_bytes + experts_bytes, available_memory()
    if whole > free:  # the resident pass would be killed for memory after minutes of measuring
        raise ColibriError(f"colibri bench measures compute with every expert in memory: {format_bytes(whole)}, "
                           f"and {format_bytes(free)} is available; benchmark a model that fits (such as "
                           f"tools/make_synthetic_olmoe.py's, with --layers to size it)")
    c = Container(model_dir)
    scan_bw, _ = expert_bandwidth(c, 1 << 30)  # the experts' extents in order, each from the file holding it
    reads = _TokenReads(c, seed)
    try:
        disk_bw, direct_measured = reads.bandwidth(min(1 << 30, experts_bytes)), reads.direct  # the floor's disk term
    finally:
        reads.close()
    mem_bw = memory_bandwidth()
    can_drop = drop and drop_page_cache()
    say(f"machine: disk {format_bytes(disk_bw)}/s reading random experts ({'O_DIRECT' if direct_measured else 'page cache'}; "
        f"a sequential scan {format_bytes(scan_bw)}/s), memory "
        f"{format_bytes(mem_bw)}/s; sessions start with the page cache {'dropped' if can_drop else 'not dropped'}, "
        f"experts read with O_DIRECT where allowed")
    result = {"model": str(model_dir), "sizes": sizes.__dict__, "disk_bandwidth": disk_bw,
              "disk_bandwidth_sequential": scan_bw,
              "disk_bandwidth_o_direct": direct_measured, "memory_bandwidth": mem_bw,
              "page_cache_dropped": can_drop, "policy": options.policy, "prompt_tokens": prompt_tokens,
              "new_tokens": new_tokens, "budgets": []}

    # -- resident compute time: second pass over each prompt with every expert cached
    with load(model_dir, options, cache_slots=sizes.n_experts, usage=False, prefetch=False) as engine:
        prompts = _prompts(engine, n_prompts, prompt_tokens, seed)
        result["activations"] = engine.activations  # the kernels' arithmetic (--activations)
        resident = []
        for i, p in enumerate(prompts):
            _run(engine, p, new_tokens, seed + i)
            r = _run(engine, p, new_tokens, seed + i)
            assert r["decode_bytes_read"] == 0, "the resident pass read from disk"
            resident.append(r["seconds_per_token"])
    # Compute per token does not depend on the prompt (same dense work, top-k experts per layer):
    # the median over prompts is the resident compute time, robust to a noisy neighbour.
    resident_spt = sorted(resident)[len(resident) // 2]
    result["resident_seconds_per_token_runs"] = resident
    result["resident_seconds_per_token"] = resident_spt
    say(f"resident compute: {resident_spt:.3f} s/token (median of {', '.join(f'{t:.3f}' for t in resident)}; "
        f"{result['activations']} activations)")

    for frac in fractions:
        budget = sizes.dense_bytes + int(frac * experts_bytes)
        entry = {"fraction": frac, "ram": budget, "sessions": {}}
        with tempfile.TemporaryDirectory(prefix="colibri-bench-") as tmp:
            history = Path(tmp) / "usage.json"
            for name in ("cold", "learned"):
                if can_drop:
                    drop_page_cache()
                # O_DIRECT whenever the filesystem allows it: every byte counted as read came from the
                # device (not from the page cache), so the disk floor is exact for every prompt.
                with load(model_dir, options, ram=budget, usage=history, direct=True) as engine:
                    warm_seconds, warm_experts = engine.store.warm_up()
                    runs = []
                    for i, p in enumerate(prompts):
                        r = _run(engine, p, new_tokens, seed + i)
                        _floor(r, resident_spt, disk_bw)
                        runs.append(r)
                    s = engine.stats()
                    sess = {"runs": runs, **_session_summary(runs), "pinned_experts": s["pinned_experts"],
                            "warm_up_seconds": warm_seconds, "warm_up_experts": warm_experts,
                            "cache_slots_per_layer": s["cache_slots_per_layer"], "direct_io": s["direct_io"]}
                    if name == "cold":  # the warm repeat: the first prompt again, same session
                        w = _run(engine, prompts[0], new_tokens, seed)
                        _floor(w, resident_spt, disk_bw)
                        sess["warm_repeat"] = w
                entry["sessions"][name] = sess
                say(f"budget {100 * frac:.0f}% of experts ({format_bytes(budget)}), {name}: "
                    f"{sess['tokens_per_second']:.2f} tok/s, {sess['seconds_per_token']:.3f} s/token vs floor "
                    f"{sess['floor_seconds_per_token']:.3f} ({sess['vs_floor']:.2f}×), TTFT {sess['ttft_seconds']:.2f} s, "
                    f"hit rate {100 * sess['hit_rate']:.1f}%, read {format_bytes(sess['bytes_read_per_token'])}/token, "
                    f"I/O stall {1e3 * sess['io_stall_seconds_per_token']:.0f} ms/token, "
                    f"recall {100 * sess['prefetch_recall']:.1f}%, pinned {sess['pinned_experts']}, "
                    f"{sess['cache_slots_per_layer']} slots/layer{_steal_text(sess['cpu_steal'])}")
                stalls = [f"{layer}:{1e3 * t:.0f}" for layer, t in sess["layer_io_stall_seconds_per_token"].items()
                          if t >= 1e-3]
                if stalls:
                    say(f"    I/O stall by layer (ms/token, layers over 1 ms): {' '.join(stalls)}")
                if warm_experts:
                    say(f"    warm-up before the prompts: {warm_experts} pinned experts read in {warm_seconds:.2f} s")
                if name == "cold":
                    w = sess["warm_repeat"]
                    say(f"    warm repeat: {w['tokens_per_second']:.2f} tok/s, {w['seconds_per_token']:.3f} s/token, "
                        f"hit rate {100 * w['hit_rate']:.1f}%, read {format_bytes(w['bytes_read_per_token'])}/token")
        result["budgets"].append(entry)

    # -- the measured floor: resident compute while reading what each session read per token
    with load(model_dir, options, cache_slots=sizes.n_experts, usage=False, prefetch=False) as engine:
        for i, p in enumerate(prompts):  # read every expert the prompts route to
            _run(engine, p, new_tokens, seed + i)
        # not the disk probe's random extents (seed): where a cache sits below O_DIRECT (a VM host's
        # page cache), reading again the very extents the probe read would flatter the floor
        reads = _TokenReads(c, seed + 1)
        say("measured floor: every expert cached, reading each session's bytes per token meanwhile "
            "(random extents, started with each token, waited for at its end):")
        try:
            for entry in result["budgets"]:
                for name, sess in entry["sessions"].items():
                    loaded = [_loaded_run(engine, p, new_tokens, seed + i, r["bytes_read_per_token"], reads)
                              for i, (p, r) in enumerate(zip(prompts, sess["runs"]))]
                    for r, f in zip(sess["runs"], loaded):
                        r["measured_floor_seconds_per_token"], r["measured_floor_cpu_steal"] = f["seconds_per_token"], f["cpu_steal"]
                    floor = sum(f["seconds_per_token"] * r["decoded_tokens"] for r, f in zip(sess["runs"], loaded))
                    sess["measured_floor_seconds_per_token"] = floor / sess["decoded_tokens"]
                    sess["vs_measured_floor"] = sess["seconds_per_token"] / sess["measured_floor_seconds_per_token"]
                    sess["measured_floor_cpu_steal"] = _mean(f["cpu_steal"] for f in loaded)
                    say(f"    {100 * entry['fraction']:.0f}% {name} ({format_bytes(sess['bytes_read_per_token'])}/token): "
                        f"{sess['measured_floor_seconds_per_token']:.3f} s/token{_steal_text(sess['measured_floor_cpu_steal'])}; "
                        f"the session {sess['seconds_per_token']:.3f} ({sess['vs_measured_floor']:.2f}×)")
        finally:
            reads.close()
    return result


def _steal_text(steal: float | None) -> str:
    return "" if steal is None else f", CPU steal {100 * steal:.0f}%"


def register(bench_app: typer.Typer) -> None:
    """Wire `colibri bench --model DIR` (a callback, so `colibri bench kernels` and other
    subcommands still work) and its explicit spelling `colibri bench model --model DIR`."""

    def bench(model: Path, fractions: str, prompts: int, prompt_tokens: int, new_tokens: int,
              as_json: bool, out: Optional[Path], no_drop: bool, options: EngineOptions) -> None:
        from ..errors import ColibriError

        try:
            fr = tuple(float(f) for f in fractions.split(","))
        except ValueError:
            raise ColibriError(f"--budgets takes fractions like 0.25,0.5, got {fractions!r}") from None
        if not fr or not all(0 < f <= 1 for f in fr) or min(prompts, prompt_tokens, new_tokens) < 1 or new_tokens < 2:
            raise ColibriError("--budgets must be fractions in (0, 1]; --prompts, --prompt-tokens ≥ 1; --new-tokens ≥ 2")
        say = (lambda msg: print(msg, file=sys.stderr)) if as_json else print
        result = run_protocol(model, fr, prompts, prompt_tokens, new_tokens, say=say, drop=not no_drop, options=options)
        if out is not None:
            out.write_text(json.dumps(result, indent=2))
        if as_json:
            print(json.dumps(result, indent=2))

    opts = dict(
        fractions=typer.Option("0.25,0.5", "--budgets", help="Expert budgets as fractions of all experts."),
        prompts=typer.Option(3, "--prompts", help="Different prompts per session."),
        prompt_tokens=typer.Option(8, "--prompt-tokens", help="Tokens per prompt."),
        new_tokens=typer.Option(8, "--new-tokens", help="Tokens generated per prompt."),
        as_json=typer.Option(False, "--json", help="Print the results as JSON (progress goes to stderr)."),
        out=typer.Option(None, "--out", help="Also write the JSON results to this file."),
        no_drop=typer.Option(False, "--no-drop", help="Never drop the page cache: cold runs read with O_DIRECT."),
    )

    @bench_app.callback(invoke_without_command=True)
    @command_options
    def bench_callback(ctx: typer.Context,
                       model: Optional[Path] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
                       fractions: str = opts["fractions"], prompts: int = opts["prompts"],
                       prompt_tokens: int = opts["prompt_tokens"], new_tokens: int = opts["new_tokens"],
                       as_json: bool = opts["as_json"], out: Optional[Path] = opts["out"],
                       no_drop: bool = opts["no_drop"], *, options: EngineOptions):
        """Benchmarks. `colibri bench --model DIR` runs the decode protocol (cold, warm repeat, learned
        hot-store; at 25% and 50% of the experts) against the disk/compute floor."""
        if ctx.invoked_subcommand is not None:
            return
        if model is None:
            model = os.environ.get("COLIBRI_MODEL")
            if not model:
                print(ctx.get_help())
                raise typer.Exit(0)
        bench(Path(model), fractions, prompts, prompt_tokens, new_tokens, as_json, out, no_drop, options)

    @bench_app.command("model")
    @command_options
    def bench_model(model: Path = typer.Option(..., "--model", "-m", envvar="COLIBRI_MODEL", help=MODEL_HELP),
                    fractions: str = opts["fractions"], prompts: int = opts["prompts"],
                    prompt_tokens: int = opts["prompt_tokens"], new_tokens: int = opts["new_tokens"],
                    as_json: bool = opts["as_json"], out: Optional[Path] = opts["out"],
                    no_drop: bool = opts["no_drop"], *, options: EngineOptions):
        """The decode benchmark protocol (same as `colibri bench --model DIR`)."""
        bench(model, fractions, prompts, prompt_tokens, new_tokens, as_json, out, no_drop, options)
