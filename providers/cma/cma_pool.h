/*
 * The cma domain's copy threads: one process_vm_writev runs at 4-5 GB/s on the
 * 16-core GPU machine (tools/repro/cma_parallel_copy.c), four in parallel 18-29, eight 38-61. A large
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
 * Whole operations in parallel (pipelining): an operation of at least `async_at`
 * bytes (AFABRIC_CMA_ASYNC_AT, default 16 KiB) that stays whole is a job: the worker queues it
 * (cma_pool_submit) and returns from post at once. A copy thread takes it, runs it through
 * the provider's `run` (which takes the target's writer slot, checks the entry's generation,
 * copies, releases the slot: all on that thread), pushes it on the done stack and calls
 * `notify` (the provider wakes its worker if it sleeps). The worker reaps done jobs
 * (cma_pool_reap) in poll and reports each once; completions come out of order. A thread
 * serves a split part handed to it before queued jobs. Smaller operations are copied inline
 * by the worker (handing them over costs more than the copy).
 *
 * No global state: the pool lives in the domain. Threading: every cma_pool_* function but
 * cma_pool_done_pending is called from the domain's worker thread only (the provider ABI rule).
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
    pthread_mutex_t mu; /* with cv: the worker sleeping for the end of this thread's part */
    pthread_cond_t cv;
    _Atomic uint64_t posted, finished; /* parts handed over / done (finished <= posted) */
    cma_part part;                     /* written before posted moves, read after */
    struct iovec liov[CMA_IOV], riov[CMA_IOV];
} cma_copier;

/* A whole operation handed to a copy thread. */
typedef struct cma_job {
    struct cma_job *next; /* queue, then done stack */
    cma_part part;        /* off 0, len the whole operation */
    afp_paged pg;         /* paged: the shim's index arrays stay valid until completion */
    void *target;         /* for run: the target's writer slots (in its segment's mapping) */
    const _Atomic uint64_t *gen; /* for run: the export entry's generation in the target */
    uint64_t want_gen;
    uint32_t writer; /* for run: our pid, the holder a writer slot names */
    uint64_t ctx, peer, arrivals; /* how the worker reports it */
    uint32_t imm;
    uint32_t delay_us; /* testing hook: run sleeps this long inside the slot, before copying */
    int err; /* set by run: 0, an errno, or CMA_JOB_REVOKED */
} cma_job;

#define CMA_JOB_REVOKED (-1)
#define CMA_JOB_WEDGED (-2) /* no writer slot of the target could be had (cma.c, enter) */

typedef int (*cma_run_fn)(cma_job *j, struct iovec *liov, struct iovec *riov);
typedef void (*cma_notify_fn)(void *arg);

typedef struct cma_pool {
    uint32_t copiers;  /* parts per operation at most, the worker included (1: never split) */
    uint64_t min_part; /* bytes per part at least */
    uint64_t split_at; /* operations of fewer bytes stay whole */
    uint32_t delay_us; /* testing hook (AFABRIC_CMA_TEST_PART_DELAY_US): copiers sleep first */
    uint32_t nthreads; /* started */
    bool no_more;      /* thread creation failed once: use what runs */
    uint64_t async_at; /* whole operations of this many bytes and more go to the threads */
    cma_copier *c;     /* copiers - 1, allocated with the first thread */
    pthread_mutex_t mu; /* job queue; idle threads sleep on cv */
    pthread_cond_t cv;
    bool sync_ok;       /* mu and cv initialised */
    bool stop;          /* under mu */
    cma_job *qhead, *qtail; /* under mu */
    _Atomic uint32_t qlen;
    _Atomic(cma_job *) done; /* finished jobs (a stack: any order) */
    uint32_t inflight;       /* jobs submitted and not reaped (worker only) */
    cma_run_fn run;
    cma_notify_fn notify;
    void *notify_arg;
    struct iovec liov[CMA_IOV], riov[CMA_IOV]; /* the worker's own part */
} cma_pool;

/* Settings from the environment and the CPUs this process may use; starts no thread.
 * 0, or -1 when the pool's mutex or condition variable cannot be made. */
int cma_pool_init(cma_pool *p, cma_run_fn run, cma_notify_fn notify, void *notify_arg);
/* Stops and joins the threads, frees the pool's memory (safe on a pool never used). No job
 * may be in flight (the provider reaps them all first). */
void cma_pool_fini(cma_pool *p);
/* Copies all `total` bytes of `op` (its off/len are ignored), split when large. Returns
 * only after every part returned: 0, or the errno of the first failing part (by offset). */
int cma_pool_copy(cma_pool *p, const cma_part *op, uint64_t total);
/* Parts an operation of `total` bytes would be split into (1: stays whole). */
uint32_t cma_pool_parts(const cma_pool *p, uint64_t total);
/* Copies one part (contiguous, or bytes [off, off + len) of a paged write): 0 or errno. */
int cma_copy_part(const cma_part *pt, struct iovec *liov, struct iovec *riov);
/* Sleeps `us` microseconds (the testing hook AFABRIC_CMA_TEST_PART_DELAY_US; 0: returns). */
void cma_test_delay(uint32_t us);
/* Would an operation of `total` bytes go to the threads as a whole job? */
bool cma_pool_async(const cma_pool *p, uint64_t total);
/* Queues a job (a thread is started if none runs): 0, or -1 (no thread: copy it inline). */
int cma_pool_submit(cma_pool *p, cma_job *j);
/* Takes every finished job (a list through next); the caller reports and frees them and
 * lowers inflight by their number. */
cma_job *cma_pool_reap(cma_pool *p);
/* Any finished job waiting to be reaped? (any thread) */
bool cma_pool_done_pending(cma_pool *p);

#endif
