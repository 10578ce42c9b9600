/* The cma domain's copy threads: see cma_pool.h. */
#include "cma_pool.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CMA_DEFAULT_COPIERS 8u
#define CMA_DEFAULT_MIN_PART (128ull << 10)
/* 16-core GPU machine: 256 / 512 KiB writes 4.1 / 4.7 GB/s whole, 7.1 / 12.1 split */
#define CMA_DEFAULT_SPLIT_AT (256ull << 10)
#define CMA_ALIGN 4096ull /* parts start on page boundaries of the operation */
/* whole operations of 16 KiB and more go to the copy threads, smaller ones are copied inline:
 * on the 16-core GPU machine (afabric bench p2p --provider cma) 4 KiB writes, window 64, raw C loop
 * moved 1.18-1.46 GB/s handed over against 2.26 inline (the hand-over costs ~1 us an
 * operation), 64 KiB 24-29 GB/s handed over against 3.2 inline (earlier run); 16 KiB is
 * between those two measured points, not measured itself */
#define CMA_DEFAULT_ASYNC_AT (16ull << 10)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A byte count from the environment ("262144", "256K", "1M", "1G"); dflt when unset or bad. */
static uint64_t env_bytes(const char *name, uint64_t dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return dflt;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return dflt;
    unsigned shift = 0;
    if (*end == 'K' || *end == 'k')
        shift = 10;
    else if (*end == 'M' || *end == 'm')
        shift = 20;
    else if (*end == 'G' || *end == 'g')
        shift = 30;
    if (shift)
        end++;
    if (*end != '\0' || v > (UINT64_MAX >> shift))
        return dflt;
    return (uint64_t)v << shift;
}

int cma_pool_init(cma_pool *p, cma_run_fn run, cma_notify_fn notify, void *notify_arg)
{
    memset(p, 0, sizeof *p);
    p->run = run;
    p->notify = notify;
    p->notify_arg = notify_arg;
    atomic_init(&p->qlen, 0);
    atomic_init(&p->done, NULL);
    uint32_t cpus = 1;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        cpus = (uint32_t)CPU_COUNT(&set);
    /* half the CPUs we may use (the target, our loop and the worker need the rest: on 2
     * CPUs a second copier only slowed the copy), 8 at most: on the 16-core GPU machine 4
     * copiers of 256 KiB moved 1 MiB writes at 13.6-13.9 GB/s (0.83x fi_rma_bw shm), 8 of
     * 128 KiB at 14.6-23.3 (afabric bench p2p --provider cma; docs/providers/cma.md) */
    uint64_t copiers = cpus / 2 < CMA_DEFAULT_COPIERS ? cpus / 2 : CMA_DEFAULT_COPIERS;
    copiers = env_bytes("AFABRIC_CMA_THREADS", copiers); /* an explicit count is taken as is */
    p->copiers = copiers < 1 ? 1u : copiers > CMA_MAX_COPIERS ? CMA_MAX_COPIERS : (uint32_t)copiers;
    p->min_part = env_bytes("AFABRIC_CMA_MIN_PART", CMA_DEFAULT_MIN_PART);
    if (p->min_part < 64 * 1024)
        p->min_part = 64 * 1024;
    p->split_at = env_bytes("AFABRIC_CMA_SPLIT_AT", CMA_DEFAULT_SPLIT_AT);
    uint64_t delay = env_bytes("AFABRIC_CMA_TEST_PART_DELAY_US", 0);
    p->delay_us = delay > 999999u ? 999999u : (uint32_t)delay;
    p->async_at = env_bytes("AFABRIC_CMA_ASYNC_AT", CMA_DEFAULT_ASYNC_AT);
    if (pthread_mutex_init(&p->mu, NULL) != 0)
        return -1;
    if (pthread_cond_init(&p->cv, NULL) != 0) {
        pthread_mutex_destroy(&p->mu);
        return -1;
    }
    p->sync_ok = true;
    return 0;
}

/* ---- copying ---------------------------------------------------------------------- */

/* Consume `done` bytes from iov[i...]; returns the first index with bytes left. */
static uint32_t skip_iov(struct iovec *iov, uint32_t i, uint64_t done)
{
    while (done) {
        uint64_t k = done < iov[i].iov_len ? done : iov[i].iov_len;
        iov[i].iov_base = (uint8_t *)iov[i].iov_base + k;
        iov[i].iov_len -= k;
        done -= k;
        if (!iov[i].iov_len)
            i++;
    }
    return i;
}

/* Copy n iovec pairs (equal total length), resuming after partial transfers: 0 or errno. */
static int copy_vec(pid_t pid, bool write, struct iovec *l, struct iovec *r, uint32_t n)
{
    uint64_t want = 0;
    for (uint32_t i = 0; i < n; i++)
        want += r[i].iov_len;
    uint32_t li = 0, ri = 0;
    while (want) {
        ssize_t got = write ? process_vm_writev(pid, l + li, n - li, r + ri, n - ri, 0)
                            : process_vm_readv(pid, l + li, n - li, r + ri, n - ri, 0);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return got < 0 ? errno : EFAULT;
        want -= (uint64_t)got;
        li = skip_iov(l, li, (uint64_t)got); /* skip what was done on both sides */
        ri = skip_iov(r, ri, (uint64_t)got);
    }
    return 0;
}

/* One part: contiguous bytes, or the bytes of a paged write's pages in order (a part may
 * start and end inside a page), in batches of CMA_IOV iovecs. */
int cma_copy_part(const cma_part *pt, struct iovec *liov, struct iovec *riov)
{
    if (!pt->pg) {
        struct iovec l = {pt->local + pt->off, pt->len};
        struct iovec r = {(void *)(uintptr_t)(pt->remote + pt->off), pt->len};
        return copy_vec(pt->pid, pt->write, &l, &r, 1);
    }
    const afp_paged *pg = pt->pg;
    uint64_t k = pt->off / pg->page_len, in = pt->off % pg->page_len, left = pt->len;
    while (left) {
        uint32_t m = 0;
        for (; m < CMA_IOV && left; m++, k++) {
            uint64_t take = pg->page_len - in < left ? pg->page_len - in : left;
            liov[m] = (struct iovec){pt->local + (uint64_t)pg->src_idx[k] * pg->src_stride + in,
                                     take};
            riov[m] = (struct iovec){
                (void *)(uintptr_t)(pt->remote + (uint64_t)pg->dst_idx[k] * pg->dst_stride + in),
                take};
            left -= take;
            in = 0;
        }
        int e = copy_vec(pt->pid, pt->write, liov, riov, m);
        if (e)
            return e;
    }
    return 0;
}

/* ---- threads ---------------------------------------------------------------------- */

void cma_test_delay(uint32_t us)
{
    if (us) {
        struct timespec ts = {0, (long)us * 1000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
}

/* The oldest queued job, or NULL (under p->mu). */
static cma_job *pop_job(cma_pool *p)
{
    cma_job *j = p->qhead;
    if (j) {
        p->qhead = j->next;
        if (!p->qhead)
            p->qtail = NULL;
        atomic_fetch_sub_explicit(&p->qlen, 1, memory_order_relaxed);
    }
    return j;
}

static void run_job(cma_pool *p, cma_copier *c, cma_job *j)
{
    j->err = p->run(j, c->liov, c->riov);
    cma_job *head = atomic_load_explicit(&p->done, memory_order_relaxed);
    do
        j->next = head;
    while (!atomic_compare_exchange_weak_explicit(&p->done, &head, j, memory_order_seq_cst,
                                                  memory_order_relaxed));
    p->notify(p->notify_arg); /* after the push (seq_cst): a worker about to sleep sees one */
}

static void *copier_main(void *arg)
{
    cma_copier *c = arg;
    cma_pool *p = c->pool;
    uint64_t seen = 0;
    for (;;) {
        /* wait for a part or a job: spin a little (the next operation usually follows),
         * then sleep */
        uint64_t t0 = now_ns();
        while (atomic_load_explicit(&c->posted, memory_order_acquire) == seen &&
               !atomic_load_explicit(&p->qlen, memory_order_relaxed) &&
               now_ns() - t0 < CMA_SPIN_NS)
            afp_cpu_relax();
        cma_job *job = NULL;
        if (atomic_load_explicit(&c->posted, memory_order_acquire) == seen) {
            bool stop = false;
            pthread_mutex_lock(&p->mu);
            while (!p->stop && !p->qhead &&
                   atomic_load_explicit(&c->posted, memory_order_acquire) == seen)
                pthread_cond_wait(&p->cv, &p->mu);
            if (atomic_load_explicit(&c->posted, memory_order_acquire) == seen) {
                job = pop_job(p);
                stop = !job; /* neither part nor job: woken to stop */
            }
            pthread_mutex_unlock(&p->mu);
            if (stop)
                return NULL;
        }
        if (job) {
            run_job(p, c, job);
            continue;
        }
        seen = atomic_load_explicit(&c->posted, memory_order_acquire);
        cma_test_delay(p->delay_us);
        c->part.err = cma_copy_part(&c->part, c->liov, c->riov);
        atomic_store_explicit(&c->finished, seen, memory_order_release);
        pthread_mutex_lock(&c->mu); /* the worker may sleep on cv for it */
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
}

/* One copy thread with its mutex and condition variable: 0, or -1 with nothing left. */
static int start_copier(cma_pool *p, cma_copier *c)
{
    c->pool = p;
    if (pthread_mutex_init(&c->mu, NULL) != 0)
        goto out_fail;
    if (pthread_cond_init(&c->cv, NULL) != 0)
        goto out_mutex;
    if (pthread_create(&c->th, NULL, copier_main, c) != 0)
        goto out_cond;
    return 0;
out_cond:
    pthread_cond_destroy(&c->cv);
out_mutex:
    pthread_mutex_destroy(&c->mu);
out_fail:
    return -1;
}

/* Start threads until `want` run (or creation fails: then keep those that run, and try no
 * more). Returns how many of them the caller may use. */
static uint32_t ensure_threads(cma_pool *p, uint32_t want)
{
    if (p->nthreads < want && !p->no_more && !p->c) {
        p->c = calloc(p->copiers - 1, sizeof *p->c);
        p->no_more = p->c == NULL;
    }
    while (p->nthreads < want && !p->no_more) {
        if (start_copier(p, &p->c[p->nthreads]) != 0)
            p->no_more = true;
        else
            p->nthreads++;
    }
    return p->nthreads < want ? p->nthreads : want;
}

void cma_pool_fini(cma_pool *p)
{
    if (p->nthreads) {
        pthread_mutex_lock(&p->mu);
        p->stop = true;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    for (uint32_t i = 0; i < p->nthreads; i++) {
        cma_copier *c = &p->c[i];
        /* idle: cma_pool_copy waited for its parts, the provider reaped every job */
        pthread_join(c->th, NULL);
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
    }
    p->nthreads = 0;
    free(p->c);
    p->c = NULL;
    if (p->sync_ok) {
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        p->sync_ok = false;
    }
}

bool cma_pool_async(const cma_pool *p, uint64_t total)
{
    return p->copiers >= 2 && total >= p->async_at && cma_pool_parts(p, total) == 1;
}

int cma_pool_submit(cma_pool *p, cma_job *j)
{
    if (ensure_threads(p, p->copiers - 1) == 0)
        return -1;
    j->next = NULL;
    j->delay_us = p->delay_us;
    pthread_mutex_lock(&p->mu); /* held for a few stores: copiers hold it no longer */
    if (p->qtail)
        p->qtail->next = j;
    else
        p->qhead = j;
    p->qtail = j;
    atomic_fetch_add_explicit(&p->qlen, 1, memory_order_relaxed);
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    p->inflight++;
    return 0;
}

cma_job *cma_pool_reap(cma_pool *p)
{
    if (!atomic_load_explicit(&p->done, memory_order_relaxed))
        return NULL;
    return atomic_exchange_explicit(&p->done, NULL, memory_order_acquire);
}

bool cma_pool_done_pending(cma_pool *p)
{
    return atomic_load_explicit(&p->done, memory_order_seq_cst) != NULL;
}

uint32_t cma_pool_parts(const cma_pool *p, uint64_t total)
{
    if (p->copiers < 2 || total < p->split_at || total < 2 * p->min_part)
        return 1;
    uint64_t n = total / p->min_part;
    return n < p->copiers ? (uint32_t)n : p->copiers;
}

static void wait_part(cma_copier *c)
{
    uint64_t want = atomic_load_explicit(&c->posted, memory_order_relaxed);
    uint64_t t0 = now_ns();
    while (atomic_load_explicit(&c->finished, memory_order_acquire) != want &&
           now_ns() - t0 < CMA_SPIN_NS)
        afp_cpu_relax();
    if (atomic_load_explicit(&c->finished, memory_order_acquire) == want)
        return;
    pthread_mutex_lock(&c->mu);
    while (atomic_load_explicit(&c->finished, memory_order_acquire) != want)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

int cma_pool_copy(cma_pool *p, const cma_part *op, uint64_t total)
{
    cma_part own = *op;
    own.off = 0;
    own.len = total;
    uint32_t n = cma_pool_parts(p, total);
    if (n > 1)
        n = 1 + ensure_threads(p, n - 1);
    if (n <= 1)
        return cma_copy_part(&own, p->liov, p->riov);
    /* equal parts, rounded up to whole pages; the last takes what is left */
    uint64_t chunk = (total / n + CMA_ALIGN - 1) / CMA_ALIGN * CMA_ALIGN;
    uint32_t used = 1;
    for (uint64_t off = chunk; off < total; off += chunk, used++) {
        cma_copier *c = &p->c[used - 1];
        c->part = *op;
        c->part.off = off;
        c->part.len = total - off < chunk ? total - off : chunk;
        c->part.err = 0;
        atomic_fetch_add_explicit(&c->posted, 1, memory_order_release);
        pthread_mutex_lock(&p->mu); /* wakes it if it sleeps (no syscall when all spin) */
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    own.len = chunk;
    int err = cma_copy_part(&own, p->liov, p->riov);
    for (uint32_t i = 1; i < used; i++) { /* every part returns before the op reports */
        wait_part(&p->c[i - 1]);
        if (!err)
            err = p->c[i - 1].part.err;
    }
    return err;
}
