#!/usr/bin/env bash
# Check csrc/matmul_avx512.c's algorithm on a CPU without AVX-512: compile it over SIMDe's portable
# intrinsics (apt-get install libsimde-dev) and compare every row dot product with the portable
# path bit for bit. Prints "0 of N ... differ" and exits 0 when they agree.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
cflags="-O1 -std=c11 -ffp-contract=off -pthread -Wno-unused-function"
# the AVX-512 file over SIMDe, its Path renamed so it can sit beside the real one
gcc $cflags -DCOLIBRI_SIMDE -DPATH_AVX512=PATH_AVX512_SIMDE -Itools/avx512_check -c csrc/matmul_avx512.c -o "$out/avx512_simde.o"
for f in matmul matmul_avx2 matmul_avx512 threads; do gcc $cflags -c csrc/$f.c -o "$out/$f.o"; done
gcc $cflags tools/avx512_check/check.c "$out"/*.o -lm -o "$out/check"
"$out/check"
