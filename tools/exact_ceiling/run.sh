#!/usr/bin/env bash
# The exact int4 mode's ceiling on this CPU, one core (ceiling.c says what it measures). Builds
# against csrc/ as the package does (-O3, no fused multiply-add), runs under the shared CPU lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cflags="-O3 -std=gnu11 -ffp-contract=off -pthread"
for f in matmul matmul_avx2 matmul_avx512 threads membench; do gcc $cflags -c csrc/$f.c -o "$out/$f.o"; done
gcc $cflags tools/exact_ceiling/ceiling.c "$out"/*.o -lm -o "$out/ceiling"
flock "${TMPDIR:-/tmp}/colibri-cpu.lock" "$out/ceiling"
