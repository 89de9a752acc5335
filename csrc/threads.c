// threads.c — the kernels' thread pool (pthreads).
//
// A job is `ntasks` independent tasks (ranges of whole output rows); the caller and the workers
// claim them one at a time. A task always runs start to end on one thread, and no task's result
// depends on another's, so the thread count changes the speed only, never a result.
//
// Claiming: one 64-bit word holds (generation:32 | ntasks:16 | next:16). The caller writes the
// job's function and context, then publishes a new word (release); a thread claims task `next` by
// a compare-and-swap of that word, so a thread that read an old job can never claim in a new one.
// Idle workers spin briefly (kernel calls come in bursts during a forward pass), then sleep on a
// condition variable.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "impl/kernels_impl.h"

#define MAX_THREADS 256
#define SPIN_NS 300000  // how long an idle worker polls before it sleeps

static struct {
    pthread_mutex_t run;         // held by the thread running a job (one job at a time)
    pthread_mutex_t sleep_mu;    // with wake: where idle workers sleep
    pthread_cond_t wake;
    atomic_int sleepers;
    atomic_uint_fast64_t claim;  // generation:32 | ntasks:16 | next:16
    atomic_int done;             // tasks of the current job finished
    void (*_Atomic fn)(void *, int);
    void *_Atomic ctx;
    atomic_int stop;
    int nthreads;                // threads wanted, the caller included
    int started;                 // workers running
    pthread_t workers[MAX_THREADS];
    int configured;
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if COLI_X86
    __builtin_ia32_pause();
#endif
}

// Claim and run tasks of the job published as `word` until none is left; returns how many ran.
static void run_tasks(uint64_t word) {
    for (;;) {
        uint32_t ntasks = (uint32_t)(word >> 16) & 0xffffu, next = (uint32_t)word & 0xffffu;
        if (next >= ntasks) return;
        void (*fn)(void *, int) = atomic_load_explicit(&P.fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&P.ctx, memory_order_relaxed);
        if (atomic_compare_exchange_weak_explicit(&P.claim, &word, word + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            fn(ctx, (int)next);
            atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
            word = word + 1;
            word = atomic_load_explicit(&P.claim, memory_order_acquire);
        }
        // on failure `word` holds the current word: a later task, or a newer job
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&P.claim) >> 32);
    for (;;) {
        uint64_t word = atomic_load_explicit(&P.claim, memory_order_acquire);
        if ((uint32_t)(word >> 32) == seen) {
            uint64_t start = now_ns();
            int polls = 0;
            while ((uint32_t)((word = atomic_load_explicit(&P.claim, memory_order_acquire)) >> 32) == seen &&
                   !atomic_load(&P.stop)) {
                cpu_relax();
                if (++polls % 256 == 0 && now_ns() - start > SPIN_NS) {
                    pthread_mutex_lock(&P.sleep_mu);
                    atomic_fetch_add(&P.sleepers, 1);
                    while ((uint32_t)(atomic_load(&P.claim) >> 32) == seen && !atomic_load(&P.stop)) {
                        pthread_cond_wait(&P.wake, &P.sleep_mu);
                    }
                    atomic_fetch_sub(&P.sleepers, 1);
                    pthread_mutex_unlock(&P.sleep_mu);
                    start = now_ns();
                }
            }
        }
        if (atomic_load(&P.stop)) return NULL;
        seen = (uint32_t)(word >> 32);
        run_tasks(word);
    }
}

static void stop_workers(void) {
    atomic_store(&P.stop, 1);
    pthread_mutex_lock(&P.sleep_mu);
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.sleep_mu);
    for (int i = 0; i < P.started; i++) pthread_join(P.workers[i], NULL);
    P.started = 0;
    atomic_store(&P.stop, 0);
}

static int default_threads(void) {
    const char *env = getenv("COLIBRI_THREADS");
    if (env != NULL && env[0] != '\0') {
        char *end;
        long n = strtol(env, &end, 10);
        if (*end == '\0' && n >= 1 && n <= MAX_THREADS) return (int)n;
        // an unusable value is reported by the Python layer (kernels.threads()); use the CPUs
    }
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    }
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
}

static void after_fork_in_child(void) {
    // The workers do not exist in a forked child: start fresh ones on the next job.
    pthread_mutex_init(&P.run, NULL);
    pthread_mutex_init(&P.sleep_mu, NULL);
    pthread_cond_init(&P.wake, NULL);
    atomic_store(&P.sleepers, 0);
    P.started = 0;
}

static void configure(void) {  // with P.run held
    if (!P.configured) {
        P.nthreads = default_threads();
        pthread_atfork(NULL, NULL, after_fork_in_child);
        P.configured = 1;
    }
}

int threads_get(void) {
    pthread_mutex_lock(&P.run);
    configure();
    int n = P.nthreads;
    pthread_mutex_unlock(&P.run);
    return n;
}

int threads_set(int n) {
    if (n < 1 || n > MAX_THREADS) return COLI_EINVAL;
    pthread_mutex_lock(&P.run);
    configure();
    if (n != P.nthreads) {
        stop_workers();
        P.nthreads = n;
    }
    pthread_mutex_unlock(&P.run);
    return COLI_OK;
}

void pool_run(void (*fn)(void *ctx, int task), void *ctx, int ntasks) {
    if (ntasks <= 0) return;
    if (ntasks > 65535 || pthread_mutex_trylock(&P.run) != 0) {
        for (int i = 0; i < ntasks; i++) fn(ctx, i);  // busy (another caller) or too many tasks
        return;
    }
    configure();
    if (P.nthreads <= 1) {
        pthread_mutex_unlock(&P.run);
        for (int i = 0; i < ntasks; i++) fn(ctx, i);
        return;
    }
    while (P.started < P.nthreads - 1) {
        if (pthread_create(&P.workers[P.started], NULL, worker, NULL) != 0) break;
        P.started++;
    }
    atomic_store_explicit(&P.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&P.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    uint64_t gen = (atomic_load(&P.claim) >> 32) + 1;
    uint64_t word = (gen << 32) | ((uint64_t)ntasks << 16);
    atomic_store_explicit(&P.claim, word, memory_order_seq_cst);  // publish (release)
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.sleep_mu);
        pthread_cond_broadcast(&P.wake);
        pthread_mutex_unlock(&P.sleep_mu);
    }
    run_tasks(word);
    while (atomic_load_explicit(&P.done, memory_order_acquire) < ntasks) cpu_relax();
    pthread_mutex_unlock(&P.run);
}
