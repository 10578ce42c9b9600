/*
 * The cma domain's copy threads (issue 15): one process_vm_writev runs at 4-5 GB/s on the
 * 16-core GPU machine (docs/bench/issue15/cmabw.c), four in parallel 18-29, eight 38-61. A large
 * contiguous write or read (and a large paged write) is split into parts of at least
 * `min_part` bytes, at most `copiers` of them: the worker thread hands all but the first
 * to the pool, copies the first itself, then waits for every part. So the whole operation
 * still runs inside the worker's post call, as before: the caller's writer slot (held
 * around the copy, see cma.c) is released, and the immediate appended, only after every
 * part returned; the first failing part (in offset order) is the operation's one error.
 * Operations below `split_at` never touch the pool (no lock, no wakeup on their path).
 *
 * Threads are created on the first operation that splits, at most copiers - 1 of them
 * (copiers: AFABRIC_CMA_THREADS, default min(8, half the CPUs in sched_getaffinity);
 * parts of AFABRIC_CMA_MIN_PART bytes at least, default 128 KiB, for operations of
 * AFABRIC_CMA_SPLIT_AT bytes and more, default 256 KiB). An idle thread
 * spins at most CMA_SPIN_NS after its last part (back-to-back operations find it awake),
 * then sleeps on its condition variable: an idle engine's threads use no CPU. Close joins
 * them; no part can be in flight then (a split copy returns only when all parts did), so
 * the join waits for nothing but the threads' exit.
 *
 * No global state: the pool lives in the domain. Threading: cma_pool_copy and
 * cma_pool_fini are called from the domain's worker thread only (the provider ABI rule).
 */
#ifndef AFABRIC_CMA_POOL_H
#define AFABRIC_CMA_POOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "afabric_provider.h"

#define CMA_IOV 1024u           /* IOV_MAX on Linux: pages per process_vm_writev call */
#define CMA_MAX_COPIERS 8u      /* parts of one operation at most (the worker's included) */
#define CMA_SPIN_NS 50000ull    /* a copier (or the waiting worker) spins this long, then sleeps */

/* Bytes [off, off + len) of one operation, and how it went. */
typedef struct cma_part {
    pid_t pid;
    bool write;          /* process_vm_writev, else process_vm_readv */
    const afp_paged *pg; /* paged write (the bytes of its pages in order), or NULL */
    uint8_t *local;      /* contiguous: local address of byte 0; paged: source base */
    uint64_t remote;     /* contiguous: remote address of byte 0; paged: destination base */
    uint64_t off, len;
    int err; /* 0, or the errno of the failed copy (EFAULT: no progress) */
} cma_part;

typedef struct cma_copier {
    struct cma_pool *pool;
    pthread_t th;
    pthread_mutex_t mu; /* with cv: sleeping for a part (thread) or its end (worker) */
    pthread_cond_t cv;
    _Atomic uint64_t posted, finished; /* parts handed over / done (finished <= posted) */
    bool stop;                         /* under mu */
    cma_part part;                     /* written before posted moves, read after */
    struct iovec liov[CMA_IOV], riov[CMA_IOV];
} cma_copier;

typedef struct cma_pool {
    uint32_t copiers;  /* parts per operation at most, the worker included (1: never split) */
    uint64_t min_part; /* bytes per part at least */
    uint64_t split_at; /* operations of fewer bytes stay whole */
    uint32_t delay_us; /* testing hook (AFABRIC_CMA_TEST_PART_DELAY_US): copiers sleep first */
    uint32_t nthreads; /* started */
    bool no_more;      /* thread creation failed once: use what runs */
    cma_copier *c;     /* copiers - 1, allocated with the first thread */
    struct iovec liov[CMA_IOV], riov[CMA_IOV]; /* the worker's own part */
} cma_pool;

/* Settings from the environment and the CPUs this process may use; starts no thread. */
void cma_pool_init(cma_pool *p);
/* Stops and joins the threads, frees the pool's memory (safe on a pool never used). */
void cma_pool_fini(cma_pool *p);
/* Copies all `total` bytes of `op` (its off/len are ignored), split when large. Returns
 * only after every part returned: 0, or the errno of the first failing part (by offset). */
int cma_pool_copy(cma_pool *p, const cma_part *op, uint64_t total);
/* Parts an operation of `total` bytes would be split into (1: stays whole). */
uint32_t cma_pool_parts(const cma_pool *p, uint64_t total);

#endif
