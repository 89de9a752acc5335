"""Striped against one disk: decode time per token with a model's experts all on its own disk, then
striped across two (`colibri stripe MODEL DIR2`, share auto), on the machine at hand.

    python tools/bench_stripe.py MODEL DIR2 [--tokens 16] [--cache-slots 8] [--runs 2] [--json]

1. Each directory's disk bandwidth (`planning.disk_bandwidth_at`: a 64 MB file written there and
   read back with O_DIRECT) and the share `auto` chooses from them.
2. Decode on one disk: `--runs` fresh engines (a cold expert cache each, `--cache-slots` per layer,
   O_DIRECT reads, so the page cache never answers), greedy, the same prompt.
3. `stripe(MODEL, DIR2, "auto")`, then the same runs striped: the tokens must be the same; bytes
   and summed read time per disk from the store's counters.
4. `--undo`: MODEL is left as it was found.

Two disks where the machine has one (root, Linux): two loop devices, each throttled on its own by a
blkio cgroup (v1; `io.max` on v2), the benchmark run inside it:

    truncate -s 1400M /dev/shm/a.img; truncate -s 900M /dev/shm/b.img
    A=$(losetup -f --show /dev/shm/a.img); B=$(losetup -f --show /dev/shm/b.img)
    mkfs.ext4 -q $A; mkfs.ext4 -q $B; mount $A /mnt/a; mount $B /mnt/b
    python tools/make_synthetic_olmoe.py /mnt/a/m --layers 4
    G=/sys/fs/cgroup/blkio/bench; mkdir $G
    echo "7:0 314572800" > $G/blkio.throttle.read_bps_device   # /dev/loop0: 300 MiB/s
    echo "7:1 157286400" > $G/blkio.throttle.read_bps_device   # /dev/loop1: 150 MiB/s
    sh -c "echo \\$\\$ > $G/cgroup.procs; exec python tools/bench_stripe.py /mnt/a/m /mnt/b"
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from colibri_core import load
from colibri_core.sizes import format_bytes
from colibri_core.planning import stripe_share
from colibri_core.store import stripe as stripe_mod


def decode(model: Path, tokens: int, slots: int, runs: int) -> dict:
    """Seconds per decoded token over `runs` fresh engines (cold caches), their tokens, per-disk counters."""
    per_token, answers, disks = [], [], []
    prompt = list(range(3, 11))
    for _ in range(runs):
        with load(model, cache_slots=slots, direct=True, usage=False) as e:
            answers.append(e.generate(prompt, tokens, stop_ids=()))
            s = e.stats()
        per_token.append(s["decode_seconds"] / max(1, s["generated_tokens"] - 1))
        disks.append(s["disks"])
    if any(a != answers[0] for a in answers):
        raise SystemExit("two runs of the same prompt gave different tokens")
    return {"seconds_per_token": statistics.median(per_token), "runs": per_token, "tokens": answers[0],
            "disks": disks[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("dir2", type=Path)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--cache-slots", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    share, bandwidth = stripe_share(args.model, args.dir2)
    one = decode(args.model, args.tokens, args.cache_slots, args.runs)
    placed = stripe_mod.stripe(args.model, args.dir2, "auto", measure=stripe_share)
    try:
        striped = decode(args.model, args.tokens, args.cache_slots, args.runs)
    finally:
        stripe_mod.unstripe(args.model)
    if striped["tokens"] != one["tokens"]:
        raise SystemExit("striped tokens differ from one disk's")
    result = {"machine": platform.machine(), "date": time.strftime("%Y-%m-%d"), "model": str(args.model),
              "dir2": str(args.dir2), "cache_slots": args.cache_slots, "tokens": args.tokens,
              "bandwidth_probe": bandwidth, "share_probe": share, "share_used": placed.share,
              "one_disk": one, "striped": striped,
              "speedup": one["seconds_per_token"] / striped["seconds_per_token"],
              "seconds": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"bandwidth: model's disk {format_bytes(bandwidth['model'])}/s, DIR2's {format_bytes(bandwidth['stripe'])}/s"
          f" -> share {share:.2f} (the stripe's own probe chose {placed.share:.2f})")
    for name, r in (("one disk", one), ("striped", striped)):
        per_disk = "; ".join(f"{d}: {format_bytes(c['bytes'])}, {c['read_seconds']:.2f} s reading"
                             for d, c in r["disks"].items())
        print(f"{name:9} {1e3 * r['seconds_per_token']:.0f} ms/token (runs: "
              f"{', '.join(f'{1e3 * x:.0f}' for x in r['runs'])}) · {per_disk}")
    print(f"striped / one disk: {result['speedup']:.2f}x faster; tokens identical", file=sys.stderr)


if __name__ == "__main__":
    main()
