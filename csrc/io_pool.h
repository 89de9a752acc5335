// io_pool.h — a pool of I/O threads reading expert extents with pread into aligned buffers.
//
// The store (colibri_core/store/io.py) submits one IoRequest per expert extent it needs; worker
// threads take requests first in, first out, pread the whole extent (looping over short reads and
// EINTR) and mark the request done. Waiting releases the GIL (cffi releases it around every call),
// so Python computes the experts already resident while the reads run.
//
// Buffers come from io_alloc: 4096-byte aligned, as O_DIRECT requires of the buffer, the file
// offset and the length (expert extents are 4096-aligned multiples of 4096); from 2 MB on, back to
// back in huge-page slabs (io_pool.c says why, and when they take 4 KB pages instead). Freed
// buffers of the sizes being read are reused (a read overwrites every byte it is checked on).
//
// This header is also cffi's cdef (colibri_core/kernels/_build.py drops the lines starting with
// '#'): keep it to plain declarations.
#ifndef COLIBRI_IO_POOL_H
#define COLIBRI_IO_POOL_H

#include <stdint.h>

enum {
    IO_ALIGN = 4096,    // buffer, offset and length alignment for O_DIRECT
    IO_QUEUED = 0,      // IoRequest.state: waiting for a worker
    IO_RUNNING = 1,     //                  being read
    IO_DONE = 2,        //                  finished (see err, got)
};

// One read: nbytes from fd at offset into buf. The caller keeps the request and its buffer alive
// until the request is done (io_wait). With want_crc, the worker also computes the crc32 (zlib's
// polynomial) of the bytes read, leaving out hole_len bytes at hole_offset (an extent's own crc
// field), so verification costs the compute thread nothing.
typedef struct IoRequest {
    int fd;
    void *buf;                // io_alloc'd, at least nbytes
    int64_t offset;
    int64_t nbytes;
    int want_crc;             // compute crc below once read
    int64_t hole_offset;      // bytes [hole_offset, hole_offset + hole_len) are left out of the crc
    int64_t hole_len;
    uint32_t crc;             // crc32 of the bytes read, less the hole (when want_crc)
    int64_t got;              // bytes read (== nbytes on success; less at end of file)
    int err;                  // errno of a failed read, 0 on success
    int state;                // IO_QUEUED | IO_RUNNING | IO_DONE (read under the pool's lock)
    double seconds;           // wall time of the read itself
    struct IoRequest *next;   // the queue's link (owned by the pool)
} IoRequest;

typedef struct IoPool IoPool;

IoPool *io_pool_new(int threads);            // NULL when threads < 1 or out of memory
void io_pool_free(IoPool *pool);             // waits for queued reads, joins the threads
int io_submit(IoPool *pool, IoRequest *req); // 0, or -1 when the pool is shutting down
void io_wait(IoPool *pool, IoRequest *req);  // blocks (GIL released) until req is done
int io_done(IoPool *pool, IoRequest *req);   // 1 when req is done, without blocking
int io_pending(IoPool *pool);                // requests queued or running

// open(path, O_RDONLY | (direct ? O_DIRECT : 0)); returns fd or -errno.
int io_open(const char *path, int direct);
int io_close(int fd);
// One aligned probe read (O_DIRECT can be accepted by open and refused by read): 0 or -errno.
int io_probe(int fd, int64_t nbytes);
uint32_t io_crc32(uint32_t crc, const void *data, int64_t nbytes);  // zlib.crc32(data, crc)
uint32_t io_crc32_portable(uint32_t crc, const void *data, int64_t nbytes);  // the same, tables only
uint32_t io_crc32_clmul128(uint32_t crc, const void *data, int64_t nbytes);  // the same, no 512-bit folds
void *io_alloc(int64_t nbytes);              // 4096-aligned, NULL when out of memory; may reuse a freed one
void io_free(void *buf);                     // its memory is reused for the next buffer of its size
// Huge-page slabs until faulting them in costs more than this (s per GB, negative: the default;
// io_pool.c): sets the limit and forgets what was measured. Whether later slabs take 4 KB pages:
void io_slab_fault_limit(double seconds_per_gb);
int io_slab_small_pages(void);
void io_pool_keep_huge_pages(IoPool *pool);  // huge pages again; this pool's reads never time them
// Read nbytes at offset into buf on the calling thread (GIL released): bytes read or -errno.
int64_t io_pread_all(int fd, void *buf, int64_t nbytes, int64_t offset);

#endif
