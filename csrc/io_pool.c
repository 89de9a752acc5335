// io_pool.c — the I/O thread pool declared in io_pool.h.
#define _GNU_SOURCE
#include "io_pool.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef O_DIRECT
#define O_DIRECT 0  // platforms without it: the caller's probe sees no difference
#endif

struct IoPool {
    pthread_mutex_t lock;
    pthread_cond_t work;     // signalled when a request is queued or the pool stops
    pthread_cond_t done;     // broadcast when a request finishes
    IoRequest *head, *tail;  // FIFO of queued requests
    int running;             // requests being read
    int stopping;
    int n_threads;
    pthread_t *threads;
    int keep_huge;           // never time huge pages faulting in (io_pool_keep_huge_pages)
};

// ---- crc32 (zlib's polynomial, reflected), slicing by 8: no zlib headers needed to build

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc_slicing(uint32_t c, const unsigned char *p, int64_t nbytes) {  // c: inverted crc
    pthread_once(&crc_once, crc_init);
    while (nbytes >= 8) {  // little-endian words, as the tables assume
        uint32_t lo = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        lo ^= c;
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
            crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        nbytes -= 8;
    }
    while (nbytes-- > 0) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xFF];
    return c;
}

uint32_t io_crc32_portable(uint32_t crc, const void *data, int64_t nbytes) {
    return ~crc_slicing(~crc, data, nbytes);
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CRC_CLMUL 1
#define CLMUL __attribute__((target("pclmul,sse4.1")))

// ---- crc32 by carry-less multiplication (Gopal et al., "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ", Intel 2009): four 128-bit lanes folded forward 512 bits at a time,
// folded into one lane, then 128 -> 64 -> 32 bits and a Barrett reduction. A fold forward by D bits
// multiplies by x^(D+32) and x^(D-32) mod P(x) (the low and high constant), for zlib's polynomial
// bit-reflected and shifted left by one. 6.8 GB/s against the tables' 1.5 GB/s here, so the I/O
// threads' checksums take little of the cores the kernels compute on.

#define VPCLMUL __attribute__((target("vpclmulqdq,avx512f")))
// crc_clmul's folds 4 x 512 bits at a time, by AVX-512's 512-bit carry-less multiply (a 512-bit
// register is four 128-bit lanes): 256 bytes a step instead of 64. Reads the whole 256-byte blocks of
// p[0, nbytes), nbytes >= 256, and leaves in x[0..3] the 4 lanes crc_clmul keeps, as if it had
// read those bytes itself; returns how many it read. One Zen 4 core: 14 -> 55 GB/s in L2, and from
// memory 14 -> 30, the speed one core reads at.
VPCLMUL static int64_t crc_fold_2048(__m128i x[4], uint32_t c, const unsigned char *p, int64_t nbytes) {
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1322d1430, 0x11542778a));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596, 0x154442bd4));
    __m512i z[4];
    for (int i = 0; i < 4; i++) z[i] = _mm512_loadu_si512(p + 64 * i);
    z[0] = _mm512_xor_si512(z[0], _mm512_castsi128_si512(_mm_cvtsi32_si128((int)c)));
    int64_t done = 256;
    for (; nbytes - done >= 256; done += 256) {
        for (int i = 0; i < 4; i++) {
            __m512i lo = _mm512_clmulepi64_epi128(z[i], k2048, 0x00), hi = _mm512_clmulepi64_epi128(z[i], k2048, 0x11);
            z[i] = _mm512_ternarylogic_epi64(lo, hi, _mm512_loadu_si512(p + done + 64 * i), 0x96);  // lo ^ hi ^ data
        }
    }
    for (int i = 1; i < 4; i++) {  // the four 64-byte lanes into the last one, each 512 bits before the next
        __m512i lo = _mm512_clmulepi64_epi128(z[i - 1], k512, 0x00), hi = _mm512_clmulepi64_epi128(z[i - 1], k512, 0x11);
        z[i] = _mm512_ternarylogic_epi64(lo, hi, z[i], 0x96);
    }
    x[0] = _mm512_castsi512_si128(z[3]);
    x[1] = _mm512_extracti32x4_epi32(z[3], 1);
    x[2] = _mm512_extracti32x4_epi32(z[3], 2);
    x[3] = _mm512_extracti32x4_epi32(z[3], 3);
    return done;
}

// `c` is the inverted crc; nbytes >= 64 and a multiple of 16. `wide`: fold by crc_fold_2048 first.
CLMUL static uint32_t crc_clmul(uint32_t c, const unsigned char *p, int64_t nbytes, int wide) {
    const __m128i k512 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);  // fold forward 512 bits
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);  // fold 128 bits
    const __m128i k64 = _mm_set_epi64x(0, 0x163cd6124);             // 64 -> 32 bits
    const __m128i barrett = _mm_set_epi64x(0x1f7011641, 0x1db710641);  // mu, P(x)
    const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x[4];
    if (wide && nbytes >= 256) {
        int64_t done = crc_fold_2048(x, c, p, nbytes);
        p += done;
        nbytes -= done;
    } else {
        for (int i = 0; i < 4; i++) x[i] = _mm_loadu_si128((const __m128i *)(p + 16 * i));
        x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)c));
        p += 64;
        nbytes -= 64;
    }
    for (; nbytes >= 64; p += 64, nbytes -= 64) {
        for (int i = 0; i < 4; i++) {
            __m128i lo = _mm_clmulepi64_si128(x[i], k512, 0x00), hi = _mm_clmulepi64_si128(x[i], k512, 0x11);
            x[i] = _mm_xor_si128(_mm_xor_si128(lo, hi), _mm_loadu_si128((const __m128i *)(p + 16 * i)));
        }
    }
    __m128i a = x[0];
    for (int i = 1; i < 4; i++) {  // the four lanes into one
        a = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k128, 0x00), _mm_clmulepi64_si128(a, k128, 0x11)), x[i]);
    }
    for (; nbytes >= 16; p += 16, nbytes -= 16) {
        a = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k128, 0x00), _mm_clmulepi64_si128(a, k128, 0x11)),
                          _mm_loadu_si128((const __m128i *)p));
    }
    // 128 -> 64 bits
    a = _mm_xor_si128(_mm_srli_si128(a, 8), _mm_clmulepi64_si128(a, k128, 0x10));
    // 64 -> 32 bits
    a = _mm_xor_si128(_mm_srli_si128(a, 4), _mm_clmulepi64_si128(_mm_and_si128(a, low32), k64, 0x00));
    // Barrett reduction to the 32-bit remainder
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(a, low32), barrett, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), barrett, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(a, t), 1);
}

static int crc_clmul_ok, crc_wide_ok;
static pthread_once_t clmul_once = PTHREAD_ONCE_INIT;
static void clmul_init(void) {
    __builtin_cpu_init();
    crc_clmul_ok = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    crc_wide_ok = crc_clmul_ok && __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx512f");
}
#else
#define CRC_CLMUL 0
#endif

static uint32_t crc32_up_to(uint32_t crc, const void *data, int64_t nbytes, int wide) {
    const unsigned char *p = data;
    uint32_t c = ~crc;
#if CRC_CLMUL
    pthread_once(&clmul_once, clmul_init);
    if (crc_clmul_ok && nbytes >= 64) {
        int64_t head = nbytes & ~(int64_t)15;
        c = crc_clmul(c, p, head, wide && crc_wide_ok);
        p += head;
        nbytes -= head;
    }
#else
    (void)wide;
#endif
    return ~crc_slicing(c, p, nbytes);
}

uint32_t io_crc32(uint32_t crc, const void *data, int64_t nbytes) { return crc32_up_to(crc, data, nbytes, 1); }
uint32_t io_crc32_clmul128(uint32_t crc, const void *data, int64_t nbytes) { return crc32_up_to(crc, data, nbytes, 0); }

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int64_t io_pread_all(int fd, void *buf, int64_t nbytes, int64_t offset) {
    int64_t got = 0;
    while (got < nbytes) {
        ssize_t n = pread(fd, (char *)buf + got, (size_t)(nbytes - got), (off_t)(offset + got));
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) break;  // end of file: the caller sees a short read
        got += n;
    }
    return got;
}

static void slab_fault_in(void *buf, int64_t nbytes);

static void *worker(void *arg) {
    IoPool *p = arg;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (!p->head && !p->stopping) pthread_cond_wait(&p->work, &p->lock);
        if (!p->head) break;  // stopping and nothing left to read
        IoRequest *r = p->head;
        p->head = r->next;
        if (!p->head) p->tail = NULL;
        r->state = IO_RUNNING;
        p->running++;
        pthread_mutex_unlock(&p->lock);

        double t0 = now();
        if (!p->keep_huge) slab_fault_in(r->buf, r->nbytes);
        int64_t n = io_pread_all(r->fd, r->buf, r->nbytes, r->offset);
        uint32_t crc = 0;
        if (n > 0 && r->want_crc) {
            int64_t hole = r->hole_offset < n ? r->hole_offset : n;
            int64_t after = hole + r->hole_len < n ? hole + r->hole_len : n;
            crc = io_crc32(io_crc32(0, r->buf, hole), (const char *)r->buf + after, n - after);
        }
        double dt = now() - t0;

        pthread_mutex_lock(&p->lock);
        r->got = n < 0 ? 0 : n;
        r->err = n < 0 ? (int)-n : 0;
        r->seconds = dt;
        r->crc = crc;
        r->state = IO_DONE;
        p->running--;
        pthread_cond_broadcast(&p->done);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

IoPool *io_pool_new(int threads) {
    if (threads < 1) return NULL;
    IoPool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->threads = calloc((size_t)threads, sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return NULL;
    }
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&p->threads[i], NULL, worker, p) != 0) break;
        p->n_threads++;
    }
    if (p->n_threads == 0) {
        io_pool_free(p);
        return NULL;
    }
    return p;
}

void io_pool_free(IoPool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    p->stopping = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->lock);
    for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->lock);
    free(p->threads);
    free(p);
}

int io_submit(IoPool *p, IoRequest *r) {
    pthread_mutex_lock(&p->lock);
    if (p->stopping) {
        pthread_mutex_unlock(&p->lock);
        return -1;
    }
    r->state = IO_QUEUED;
    r->got = 0;
    r->err = 0;
    r->next = NULL;
    if (p->tail) p->tail->next = r;
    else p->head = r;
    p->tail = r;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->lock);
    return 0;
}

void io_wait(IoPool *p, IoRequest *r) {
    pthread_mutex_lock(&p->lock);
    while (r->state != IO_DONE) pthread_cond_wait(&p->done, &p->lock);
    pthread_mutex_unlock(&p->lock);
}

int io_done(IoPool *p, IoRequest *r) {
    pthread_mutex_lock(&p->lock);
    int d = r->state == IO_DONE;
    pthread_mutex_unlock(&p->lock);
    return d;
}

int io_pending(IoPool *p) {
    pthread_mutex_lock(&p->lock);
    int n = p->running;
    for (IoRequest *r = p->head; r; r = r->next) n++;
    pthread_mutex_unlock(&p->lock);
    return n;
}

int io_open(const char *path, int direct) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    return fd < 0 ? -errno : fd;
}

int io_close(int fd) { return close(fd) < 0 ? -errno : 0; }

int io_probe(int fd, int64_t nbytes) {
    void *buf = io_alloc(nbytes);
    if (!buf) return -ENOMEM;
    int64_t n = io_pread_all(fd, buf, nbytes, 0);
    io_free(buf);
    return n < 0 ? (int)n : 0;
}

// ---- buffers. Two kinds, by size.
//
// Under 2 MB: posix_memalign, preceded by one IO_ALIGN block holding the size. A few freed ones are
// kept for the next read of the same size (a streaming session frees an evicted expert's buffer and
// reads another expert of the same size at once: reusing the memory saves page-faulting a fresh one).
//
// 2 MB and more (expert extents of real models): slabs. A slab is one mapping of as many buffers of
// one size as fit in ~64 MB, back to back from a 2 MB boundary, transparent huge pages asked for
// (madvise) over all of it, so every buffer is a few physically contiguous runs. That is what makes
// reading cheap on a VM: an O_DIRECT read is one device segment per contiguous run, and a virtio
// disk's host pays per segment. Measured on this project's VM (resident decode while another
// process reads 600 MB/s of random extents with O_DIRECT): 3.3 MB buffers of one huge page plus 4 KB
// pages slowed decode 1.5x with 17-20 % CPU steal; 4 MB buffers of two whole huge pages 1.2-1.3x,
// ~10 % steal; 1 MB buffers of 4 KB pages 1.8-1.9x, 27 %. Back to back, buffers waste no memory
// (a slab rounds up to a whole huge page at most); a freed buffer's slot is reused for the next read
// of its size, already faulted in; of the slabs whose buffers are all free, the last one is kept
// and the others unmapped.
//
// Faulting huge pages in can cost more than they save. On a VM whose host takes free memory back
// (a Firecracker guest with free page reporting, 2026-12-04), a fresh 2 MB page cost 0.9-2.9 s of a
// vCPU per GB to fault against 0.4-0.7 for 4 KB pages (the host backs it anew); O_DIRECT reads of
// 4.5 MB extents into fresh huge pages, 4 threads, ran at 0.55-0.66 GB/s using 1.6-1.9 s of CPU per
// GB, into fresh 4 KB pages at 0.9-1.8 GB/s using 0.4-0.6; a model larger than RAM decoded its
// cold tokens 1.45x faster on 4 KB pages, warm ones alike. Elsewhere a huge page faults for
// ~0.1 s per GB, and compute reads a cached expert up to 9 % faster through 2 MB TLB entries. So
// the I/O thread faults each fresh buffer of a huge-page slab in itself (MADV_POPULATE_WRITE) before
// reading into it, timing it; once HUGE_FAULT_SAMPLE bytes cost more than HUGE_FAULT_SLOW, later
// slabs take 4 KB pages. Buffers already faulted in are reused as they are. A pool whose reads fill
// a cache of every expert once (a resident model: io_pool_keep_huge_pages) times nothing, and its
// slabs take huge pages: its faults are paid once, at load, and its TLB entries every token.
#define HUGE_PAGE ((size_t)2 << 20)
#define SLAB_BYTES ((size_t)64 << 20)
#define HUGE_FAULT_SLOW 0.8              // s per GB: faulting huge pages slower than this, 4 KB pages after
#define HUGE_FAULT_SAMPLE ((int64_t)64 << 20)  // … measured over this many bytes at a time
#define SPARE_MAX 8                      // small buffers kept
#define SPARE_BYTES ((int64_t)16 << 20)  // … and their bytes at most

typedef struct Slab {
    struct Slab *next;
    char *base;     // 2 MB-aligned
    size_t len;     // mapped bytes, whole huge pages
    int64_t size;   // the buffers' size (io_alloc's nbytes)
    int64_t stride; // size rounded up to IO_ALIGN
    int n, used;
    int huge;                // transparent huge pages asked for
    unsigned char *faulted;  // n flags: buffer i faulted in (huge slabs: by slab_fault_in)
    unsigned char busy[];    // n flags: buffer i in use (then the n `faulted` flags)
} Slab;

static Slab *slabs;
static int small_pages;             // later slabs take 4 KB pages: faulting huge ones proved slow
static double fault_slow = HUGE_FAULT_SLOW;
static double fault_seconds;        // huge-page faulting timed since the last decision …
static int64_t fault_bytes;         // … and its bytes
static void *spare[SPARE_MAX];
static int n_spare;
static int64_t spare_bytes;
static pthread_mutex_t buffers_lock = PTHREAD_MUTEX_INITIALIZER;

static void *slab_alloc(int64_t nbytes) {  // buffers_lock held
    int64_t stride = (nbytes + IO_ALIGN - 1) / IO_ALIGN * IO_ALIGN;
    for (Slab *s = slabs; s; s = s->next) {
        if (s->size != nbytes || s->used == s->n) continue;
        for (int i = 0; i < s->n; i++) {
            if (!s->busy[i]) {
                s->busy[i] = 1;
                s->used++;
                return s->base + i * stride;
            }
        }
    }
    size_t want = SLAB_BYTES / (size_t)stride < 1 ? (size_t)stride : SLAB_BYTES / (size_t)stride * (size_t)stride;
    size_t len = (want + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    int n = (int)(len / (size_t)stride);  // the rounding up may hold one more
    Slab *s = calloc(1, sizeof *s + 2 * (size_t)n);
    if (!s) return NULL;
    char *m = mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        free(s);
        return NULL;
    }
    char *base = (char *)(((uintptr_t)m + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
    if (base > m) munmap(m, (size_t)(base - m));
    munmap(base + len, (size_t)(m + HUGE_PAGE - base));
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
    s->huge = !small_pages;
    madvise(base, len, s->huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
    s->faulted = s->busy + n;
    s->base = base;
    s->len = len;
    s->size = nbytes;
    s->stride = stride;
    s->n = n;
    s->used = s->busy[0] = 1;
    s->next = slabs;
    slabs = s;
    return base;
}

static Slab *slab_of(void *buf) {  // buffers_lock held; NULL when buf is not a slab's
    for (Slab *s = slabs; s; s = s->next)
        if ((char *)buf >= s->base && (char *)buf < s->base + s->len) return s;
    return NULL;
}

// Before the first read into a buffer of a huge-page slab: fault it in on this (I/O) thread, timed,
// and switch later slabs to 4 KB pages once huge ones prove slow to fault (the comment above).
static void slab_fault_in(void *buf, int64_t nbytes) {
#ifdef MADV_POPULATE_WRITE
    pthread_mutex_lock(&buffers_lock);
    Slab *s = slab_of(buf);
    int64_t i = s ? ((char *)buf - s->base) / s->stride : 0;
    int fresh = s && s->huge && !s->faulted[i];
    if (fresh) s->faulted[i] = 1;
    pthread_mutex_unlock(&buffers_lock);
    if (!fresh) return;
    struct timespec t0, t1;  // this thread's CPU time: other threads running meanwhile do not count
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    if (madvise(buf, (size_t)nbytes, MADV_POPULATE_WRITE) != 0) return;  // refused (before Linux 5.14): pread faults it
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
    double dt = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    pthread_mutex_lock(&buffers_lock);
    fault_seconds += dt;
    fault_bytes += nbytes;
    if (fault_bytes >= HUGE_FAULT_SAMPLE) {
        small_pages |= fault_seconds / fault_bytes * 1e9 > fault_slow;
        fault_seconds = 0;
        fault_bytes = 0;
    }
    pthread_mutex_unlock(&buffers_lock);
#else
    (void)buf, (void)nbytes;
#endif
}

void io_slab_fault_limit(double seconds_per_gb) {
    pthread_mutex_lock(&buffers_lock);
    fault_slow = seconds_per_gb < 0 ? HUGE_FAULT_SLOW : seconds_per_gb;
    small_pages = 0;
    fault_seconds = 0;
    fault_bytes = 0;
    pthread_mutex_unlock(&buffers_lock);
}

int io_slab_small_pages(void) { return small_pages; }

void io_pool_keep_huge_pages(IoPool *pool) {
    pool->keep_huge = 1;
    io_slab_fault_limit(fault_slow);  // forgets an earlier pool's decision: its slabs take huge pages
}

static int slab_free(void *buf) {  // buffers_lock held; 0 when buf is not a slab's
    Slab *s = slab_of(buf);
    if (!s) return 0;
    s->busy[((char *)buf - s->base) / s->stride] = 0;
    if (--s->used == 0) {  // kept (a read of its size may follow at once); an older empty one goes
        for (Slab **link = &slabs; *link; link = &(*link)->next) {
            Slab *old = *link;
            if (old != s && old->used == 0) {
                *link = old->next;
                munmap(old->base, old->len);
                free(old);
                break;
            }
        }
    }
    return 1;
}

static int64_t *size_of(void *buf) { return (int64_t *)((char *)buf - IO_ALIGN); }

void *io_alloc(int64_t nbytes) {
    if (nbytes < IO_ALIGN) nbytes = IO_ALIGN;
    pthread_mutex_lock(&buffers_lock);
    void *buf = NULL;
    if ((size_t)nbytes >= HUGE_PAGE) {
        buf = slab_alloc(nbytes);
    } else {
        for (int i = 0; i < n_spare && !buf; i++) {
            if (*size_of(spare[i]) == nbytes) {
                buf = spare[i];
                spare[i] = spare[--n_spare];
                spare_bytes -= nbytes;
            }
        }
    }
    pthread_mutex_unlock(&buffers_lock);
    if (buf || (size_t)nbytes >= HUGE_PAGE) return buf;
    void *block;
    if (posix_memalign(&block, IO_ALIGN, (size_t)nbytes + IO_ALIGN) != 0) return NULL;
    buf = (char *)block + IO_ALIGN;
    *size_of(buf) = nbytes;
    return buf;
}

void io_free(void *buf) {
    if (buf == NULL) return;
    pthread_mutex_lock(&buffers_lock);
    if (slab_free(buf)) {
        pthread_mutex_unlock(&buffers_lock);
        return;
    }
    int64_t nbytes = *size_of(buf);  // under 2 MB: kept, the oldest kept dropped to make room
    while (n_spare == SPARE_MAX || (n_spare > 0 && spare_bytes + nbytes > SPARE_BYTES)) {
        void *old = spare[0];
        spare_bytes -= *size_of(old);
        spare[0] = spare[--n_spare];
        free(size_of(old));
    }
    spare[n_spare++] = buf;
    spare_bytes += nbytes;
    pthread_mutex_unlock(&buffers_lock);
}
