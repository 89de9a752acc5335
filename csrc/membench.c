// membench.c — the machine's read bandwidth, measured the way the kernels read weights: every
// pool thread streams its own contiguous share of one buffer (for `colibri bench kernels`).
#include <stdlib.h>

#include "impl/kernels_impl.h"

typedef struct {
    const uint64_t *words;  // [n]
    size_t n;
    int tasks;
    uint64_t *sums;  // [tasks]
} ReadJob;

static void read_task(void *ctx, int task) {
    const ReadJob *j = ctx;
    size_t per = (j->n + (size_t)j->tasks - 1) / (size_t)j->tasks;
    size_t i0 = (size_t)task * per, i1 = i0 + per < j->n ? i0 + per : j->n;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // independent sums: the loads, not the adds, limit
    size_t i = i0;
    for (; i + 4 <= i1; i += 4) {
        s0 += j->words[i];
        s1 += j->words[i + 1];
        s2 += j->words[i + 2];
        s3 += j->words[i + 3];
    }
    for (; i < i1; i++) s0 += j->words[i];
    j->sums[task] = s0 + s1 + s2 + s3;
}

uint64_t mem_read(const void *buf, size_t nbytes) {
    int tasks = threads_get();
    uint64_t sums[256] = {0};
    ReadJob j = {buf, nbytes / sizeof(uint64_t), tasks, sums};
    pool_run(read_task, &j, tasks);
    uint64_t s = 0;
    for (int t = 0; t < tasks; t++) s += sums[t];
    return s;
}
