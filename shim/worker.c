/*
 * The worker thread of a domain group. Its loop, in order: take new requests, progress
 * partially posted transfers, poll the completion queues, fail transfers past their
 * deadline, then publish completions. It never takes the GIL and never calls Python.
 *
 * Transfers: a request that becomes many work requests (chunks, pages) completes once,
 * with the first error; a contiguous write of several chunks sends its immediate only
 * after every data chunk completed, so the target sees it after the data (the transport
 * is unordered). A transfer that fails while work requests are still with the provider
 * is reported at once and kept as a zombie until the provider lets go of its buffers,
 * then a RELEASE record tells Python that the buffers may be reused.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#ifdef AFS_XFER_CHECK_PARTS
#include <sanitizer/asan_interface.h>
#endif

#define RX_TAG 1u
#define DEADLINE_CHECK_NS 2000000ull /* 2 ms */
#define SLEEP_MIN_NS 20000ull
#define SLEEP_MAX_NS 1000000ull /* without a wait object the target still progresses each ms */
#define SLEEP_WAITFD_MS 20
/* On the fds with nothing that needs a timer (timers_idle): every source of work wakes the
 * worker then, and each wake-up of an idle engine costs CPU (about 100 µs of it on the
 * 2-core VM, 50 a second at 20 ms: 0.5% of a core). */
#define SLEEP_IDLE_MS 100
/* Wake-ups by a provider's wait object in a row after which nothing was there to do: past
 * this many, and while the process has no descriptor left, the worker naps on timers
 * instead (as without a wait object: <= 1 ms) until work comes. libfabric 1.17 tcp with
 * every descriptor in use keeps its listening socket readable (accept() fails with
 * EMFILE, the pending connection stays): the fd never drains, and an idle worker burnt up
 * to a whole core (36-100% measured; under strace 5,600 wake-ups a second, each a ppoll,
 * epoll_waits and a failing accept). Only then: 1,000 connections arriving at once also
 * wake it with nothing to report, and napping through those delayed a new peer's first
 * write by 8 s. */
#define FRUITLESS_WAKES 64u
/* After bytes seen arriving only through a look at the provider's wait object
 * (AFP_ACTIVITY_ARRIVED: 1.17 tcp, which counts no remote writes), an adaptive worker keeps
 * polling this many spin_us instead of one. The look sees about 60% of the arrivals (those
 * that came before it rather than while the progress call that took them ran: 2,943 of
 * 5,000 awaited 8 B writes, 2-core machine), and with one spin_us two unseen in a row made
 * the target nap (631 naps per 5,000 writes, each a wake-up on the next write's path). */
#define ARRIVAL_SPINS 4u
#define BYE_WAIT_NS 20000000ull /* closing: the longest wait for goodbyes to go (20 ms) */

/* Whether this process is out of descriptors (so a provider's accept cannot succeed). */
static bool fds_exhausted(afs_engine *eng)
{
    int fd = fcntl(eng->wake_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return errno == EMFILE || errno == ENFILE;
    (void)close(fd); /* a fresh duplicate nobody else holds: nothing can go wrong worth acting on */
    return false;
}

#ifdef AFS_XFER_CHECK_PARTS
/* ASan build (internal.h): every part but the one of x's kind is made unaddressable. */
static void poison_other_parts(afs_xfer *x)
{
    const void *own = &x->ctrl;
    if (afs_xfer_is_rma(x))
        own = &x->rma;
    else if (x->kind == AFS_REQ_SEND)
        own = &x->send;
    else if (x->kind == AFS_REQ_EXPECT || x->kind == AFS_REQ_IMM_RETURN)
        own = &x->expect;
    else if (x->kind == AFS_REQ_CANCEL)
        own = &x->cancel;
    else if (x->kind == AFS_REQ_WATCH)
        own = &x->watch;
    else if (x->kind == AFS_REQ_RECV_RELEASE)
        own = &x->release;
    else if (x->kind == AFS_REQ_PEER)
        own = &x->peer;
#define AFS_POISON_PART(m)                                                                        \
    if (own != (const void *)&x->m)                                                               \
        ASAN_POISON_MEMORY_REGION(&x->m, sizeof(x->m));
    AFS_POISON_PART(rma)
    AFS_POISON_PART(send)
    AFS_POISON_PART(expect)
    AFS_POISON_PART(cancel)
    AFS_POISON_PART(watch)
    AFS_POISON_PART(release)
    AFS_POISON_PART(peer)
    AFS_POISON_PART(ctrl)
#undef AFS_POISON_PART
}
#endif

afs_xfer *afs_xfer_new(afs_engine *eng, uint32_t kind)
{
    afs_xfer *x = atomic_load_explicit(&eng->spare, memory_order_relaxed)
                      ? atomic_exchange_explicit(&eng->spare, NULL, memory_order_acquire)
                      : NULL;
    if (!x && !(x = calloc(1, sizeof(*x))))
        return NULL;
    x->kind = kind;
#ifdef AFS_XFER_CHECK_PARTS
    poison_other_parts(x);
#endif
    x->id = atomic_fetch_add_explicit(&eng->next_id, 1, memory_order_relaxed);
    return x;
}

void afs_xfer_spare(afs_engine *eng)
{
    if (atomic_load_explicit(&eng->spare, memory_order_relaxed))
        return;
    afs_xfer *x = calloc(1, sizeof(*x)), *none = NULL;
    if (x && !atomic_compare_exchange_strong_explicit(&eng->spare, &none, x, memory_order_release,
                                                      memory_order_relaxed))
        free(x); /* another thread's came first */
}

void afs_xfer_free(afs_xfer *x)
{
    if (!x)
        return;
    if (afs_xfer_is_rma(x)) {
        free(x->rma.src_idx);
        free(x->rma.dst_idx);
        free(x->rma.targets);
    } else if (x->kind == AFS_REQ_SEND) {
        free(x->send.payload);
    } else if (x->kind == AFS_REQ_RECV_RELEASE) {
        free(x->release.slots);
    }
    free(x->errtext);
#ifdef AFS_XFER_CHECK_PARTS
    ASAN_UNPOISON_MEMORY_REGION(x, sizeof(*x));
#endif
    free(x);
}

void afs_submit(afs_engine *eng, afs_xfer *x)
{
    if (eng->timings)
        x->t_enqueue = afs_now_ns();
    afs_mpsc_push(&eng->submitq, &x->qn);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&eng->worker_sleeping, memory_order_relaxed)) {
        uint64_t one = 1;
        ssize_t n = write(eng->wake_fd, &one, sizeof(one));
        (void)n; /* EAGAIN: counter saturated, the fd is readable anyway */
    }
}

int afs_ctrl_call(afs_engine *eng, afs_xfer *x)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (sem_init(&x->ctrl.done, 0, 0) != 0)
        return afs_fail(AFS_ENOMEM, "sem_init failed");
    afs_submit(eng, x);
    /* Waits in slices so that a stuck worker (peers.c) fails the call instead of hanging
     * it: then `x` stays the worker's (never freed, its semaphore never destroyed: a worker
     * that came back would still post it), and the caller must leave it alone. */
    for (;;) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 100000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        if (sem_timedwait(&x->ctrl.done, &until) == 0)
            break; /* else ETIMEDOUT or EINTR (nothing else for a valid semaphore) */
        if (atomic_load_explicit(&eng->stuck, memory_order_acquire))
            return afs_fail(AFS_ESTUCK, "%s", eng->stuck_text);
    }
    sem_destroy(&x->ctrl.done);
    if (x->ctrl.rc)
        return afs_fail(x->ctrl.rc, "%s", x->ctrl.err);
    return 0;
}

/* ---- lists ---- */

static void list_append(afs_xfer_list *l, afs_xfer *x)
{
    x->next = NULL;
    x->prev = l->tail;
    if (l->tail)
        l->tail->next = x;
    else
        l->head = x;
    l->tail = x;
    l->len++;
}

static void list_remove(afs_xfer_list *l, afs_xfer *x)
{
    if (x->prev)
        x->prev->next = x->next;
    else
        l->head = x->next;
    if (x->next)
        x->next->prev = x->prev;
    else
        l->tail = x->prev;
    x->prev = x->next = NULL;
    l->len--;
}

static void postq_push(afs_engine *eng, afs_xfer *x)
{
    if (x->in_postq)
        return;
    x->in_postq = true;
    x->pnext = NULL;
    eng->posts_stalled = false; /* this one may go at once */
    if (eng->postq_tail)
        eng->postq_tail->pnext = x;
    else
        eng->postq_head = x;
    eng->postq_tail = x;
}

/* ---- completion reporting ---- */

static void set_error(afs_xfer *x, int status, const char *fmt, const char *text)
{
    if (x->status)
        return; /* first error wins */
    x->status = status ? status : AFS_EIO;
    free(x->errtext);
    x->errtext = afs_strdup_printf(fmt, text);
}

static const char *to_gone_peer(afs_engine *eng, const afs_xfer *x, uint32_t *pid);

/* The provider failed x (posting it or its completion). To a same-host peer whose process
 * is gone or exiting, that is the peer's exit, reported as on_peer reports it: the provider
 * can see a SIGKILLed peer's connection reset before the pidfd watch does (procfs.c). */
static void fail_op(afs_engine *eng, afs_xfer *x, int status, const char *fmt, const char *text)
{
    uint32_t pid = 0;
    const char *why = NULL;
    if (!x->status && (why = to_gone_peer(eng, x, &pid)) != NULL) {
        /* what /proc showed, and the provider's own failure: the evidence, both */
        char *failed = afs_strdup_printf(fmt, text);
        char msg[320];
        snprintf(msg, sizeof(msg), "peer (process %u): %s (/proc: %s; the provider: %s)", pid,
                 afs_peer_down_text(AFS_PEER_EXITED), why, failed ? failed : "?");
        free(failed);
        set_error(x, AFS_EPEER, "%s", msg);
        return;
    }
    set_error(x, status, fmt, text);
}

static void record_timing(afs_engine *eng, const afs_xfer *x)
{
    bool read = afs_xfer_is_rma(x) && x->rma.read;
    afs_op_timing t = {x->id, x->kind + (read ? AFS_TIMING_READ : 0u), x->status, x->posted_wr,
                       x->t_enqueue, x->t_pickup, x->t_first_post, x->t_last_post, afs_now_ns()};
    pthread_mutex_lock(&eng->timing_lock);
    uint32_t at = (eng->timing_head + eng->timing_len) % eng->timing_cap;
    eng->timings[at] = t;
    if (eng->timing_len < eng->timing_cap) {
        eng->timing_len++;
    } else { /* full: the oldest goes, and is counted */
        eng->timing_head = (eng->timing_head + 1) % eng->timing_cap;
        eng->timing_dropped++;
    }
    pthread_mutex_unlock(&eng->timing_lock);
}

static void push_done(afs_engine *eng, afs_xfer *x, bool release_later)
{
    if (eng->timings && x->kind != AFS_REQ_EXPECT)
        record_timing(eng, x);
    afs_completion c = {0};
    c.id = x->id;
    c.kind = AFS_C_DONE;
    c.status = x->status;
    c.data = (uint64_t)(uintptr_t)x->errtext;
    c.release_later = release_later ? 1u : 0u;
    c.first_post_ns = x->t_first_post;
    x->errtext = NULL; /* ownership moves to the record */
    afs_ring_push(&eng->ring, &c);
}

static void postq_remove(afs_engine *eng, afs_xfer *x)
{
    afs_xfer *prev = NULL;
    for (afs_xfer *c = eng->postq_head; c; prev = c, c = c->pnext) {
        if (c != x)
            continue;
        if (prev)
            prev->pnext = c->pnext;
        else
            eng->postq_head = c->pnext;
        if (eng->postq_tail == c)
            eng->postq_tail = prev;
        break;
    }
    x->in_postq = false;
    x->pnext = NULL;
}

static void finish(afs_engine *eng, afs_xfer *x)
{
    if (x->in_postq) /* failed before everything was posted (rare: scan is fine) */
        postq_remove(eng, x);
    bool outstanding = x->done_wr < x->posted_wr;
    if (x->done_hook) {
        x->done_hook(x->done_arg, x->status, x->errtext,
                     AFS_HOOK_REPORTED | (outstanding ? 0u : AFS_HOOK_RELEASED));
    } else if (!x->reported) {
        push_done(eng, x, outstanding);
    }
    x->reported = true;
    list_remove(&eng->active, x);
    if (outstanding) {
        list_append(&eng->zombies, x); /* freed when the provider completes the rest */
        return;
    }
    afs_xfer_free(x);
}

static void zombie_done(afs_engine *eng, afs_xfer *x)
{
    if (x->done_wr < x->posted_wr)
        return;
    list_remove(&eng->zombies, x);
    if (x->done_hook) {
        x->done_hook(x->done_arg, 0, NULL, AFS_HOOK_RELEASED);
    } else {
        afs_completion c = {0};
        c.id = x->id;
        c.kind = AFS_C_RELEASE;
        afs_ring_push(&eng->ring, &c);
    }
    afs_xfer_free(x);
}

/* Called whenever a transfer's counters change. */
static void check_xfer(afs_engine *eng, afs_xfer *x)
{
    if (x->reported) {
        zombie_done(eng, x);
        return;
    }
    if (x->done_wr < x->posted_wr)
        return;
    if (x->status == 0 && x->posted_wr < x->total_wr)
        return; /* more to post; it is in the post queue */
    if (x->status == 0 && afs_xfer_is_rma(x) && x->rma.imm_pending) {
        x->rma.imm_pending = false;
        x->total_wr++; /* the immediate-only write, now that the data is delivered */
        postq_push(eng, x);
        return;
    }
    finish(eng, x);
}

/* Nothing more of x will be posted (it failed): what was posted is all there is. */
static void stop_posting(afs_xfer *x)
{
    x->total_wr = x->posted_wr;
    if (afs_xfer_is_rma(x))
        x->rma.imm_pending = false;
}

/* ---- work-request generation ---- */

/* A contiguous write of at least this many bytes is split across the group's NICs;
 * smaller ones go whole to one NIC, the NICs taking turns. */
#define SHARD_MIN (256u << 10)
#define SHARD_ALIGN 4096u

static uint64_t shard_bytes(const afs_xfer *x, uint32_t shard)
{
    uint64_t start = (uint64_t)shard * x->rma.shard_len;
    if (start >= x->rma.length)
        return 0;
    return x->rma.length - start < x->rma.shard_len ? x->rma.length - start : x->rma.shard_len;
}

static uint64_t n_data_wrs(const afs_xfer *x)
{
    if (x->kind == AFS_REQ_PAGED || x->kind == AFS_REQ_SCATTER)
        return x->rma.count;
    if (x->rma.length == 0)
        return x->rma.has_imm ? 1 : 0;
    uint64_t n = 0;
    for (uint32_t s = 0; s < x->rma.shards; s++)
        n += (shard_bytes(x, s) + x->rma.chunk - 1) / x->rma.chunk;
    return n;
}

/* How a contiguous write is cut: shards over the NICs, then chunks of at most `chunk`. */
static void plan_shards(afs_xfer *x)
{
    x->rma.shards = 1;
    x->rma.shard_len = x->rma.length ? x->rma.length : 1;
    const uint32_t nics = x->rma.nic_count;
    if (nics > 1 && x->rma.length >= SHARD_MIN) {
        uint64_t per = (x->rma.length + nics - 1) / nics;
        per = (per + SHARD_ALIGN - 1) / SHARD_ALIGN * SHARD_ALIGN;
        x->rma.shard_len = per;
        x->rma.shards = (uint32_t)((x->rma.length + per - 1) / per);
    }
}

static void gen_wr(const afs_xfer *x, uint64_t k, afp_write *w, uint32_t *nic_out)
{
    const uint32_t first = x->rma.nic_first, nics = x->rma.nic_count;
    memset(w, 0, sizeof(*w));
    w->ctx = (uint64_t)(uintptr_t)x;
    uint32_t nic;
    if (x->kind == AFS_REQ_SCATTER) {
        const afs_target *t = &x->rma.targets[k];
        nic = t->nic;
        w->local_addr = (void *)(uintptr_t)(x->rma.local_addr + t->src_offset);
        w->local_desc = x->rma.local_desc[nic];
        w->length = t->length;
        w->peer = t->fi_addr;
        w->remote_addr = t->rbase + t->dst_offset;
        w->remote_key = t->rkey;
        w->has_imm = x->rma.has_imm;
        w->imm = x->rma.imm;
        *nic_out = nic;
        return;
    }
    if (x->kind == AFS_REQ_PAGED) {
        nic = first + (uint32_t)((x->rma.nic0 + k) % nics);
        uint64_t s = x->rma.src_offset + (uint64_t)x->rma.src_idx[k] * x->rma.src_stride;
        uint64_t d = x->rma.dst_offset + (uint64_t)x->rma.dst_idx[k] * x->rma.dst_stride;
        w->local_addr = (void *)(uintptr_t)(x->rma.local_addr + s);
        w->length = x->rma.length;
        w->remote_addr = x->rma.rbase[nic] + d;
        w->has_imm = x->rma.has_imm;
        w->imm = x->rma.imm;
    } else {
        uint64_t ndata = n_data_wrs(x);
        if (k >= ndata) { /* the deferred immediate: zero bytes, valid remote iov (EFA) */
            nic = first + x->rma.nic0 % nics;
            w->local_addr = (void *)(uintptr_t)x->rma.local_addr;
            w->remote_addr = x->rma.rbase[nic] + x->rma.dst_addr;
            w->has_imm = 1;
            w->imm = x->rma.imm;
        } else {
            uint32_t shard = 0;
            uint64_t chunks;
            while ((chunks = (shard_bytes(x, shard) + x->rma.chunk - 1) / x->rma.chunk) <= k &&
                   shard + 1 < x->rma.shards) {
                k -= chunks;
                shard++;
            }
            nic = first + (uint32_t)((x->rma.nic0 + shard) % nics);
            uint64_t off = (uint64_t)shard * x->rma.shard_len + k * x->rma.chunk;
            uint64_t left = shard_bytes(x, shard) - k * x->rma.chunk;
            w->local_addr = (void *)(uintptr_t)(x->rma.local_addr + off);
            w->length = left < x->rma.chunk ? left : x->rma.chunk;
            w->remote_addr = x->rma.rbase[nic] + x->rma.dst_addr + off;
            if (x->rma.has_imm && ndata == 1) {
                w->has_imm = 1;
                w->imm = x->rma.imm;
            }
        }
    }
    w->local_desc = x->rma.local_desc[nic];
    w->peer = x->rma.fi_addr[nic];
    w->remote_key = x->rma.rkey[nic];
    *nic_out = nic;
}

/* A paged write handed to a provider that batches pages itself (post_paged): one work
 * request for the whole write, one completion. */
static int post_whole(afs_engine *eng, afs_xfer *x)
{
    const struct afs_xfer_rma *r = &x->rma;
    const uint32_t k = r->nic_first;
    afs_nic *n = &eng->nics[k];
    afp_paged p = {(void *)(uintptr_t)r->local_addr, r->local_desc[k], r->fi_addr[k],
                   r->rbase[k], r->rkey[k], r->length, r->count, r->src_idx, r->src_stride,
                   r->src_offset, r->dst_idx, r->dst_stride, r->dst_offset,
                   (uint64_t)(uintptr_t)x, r->imm, r->has_imm ? 1u : 0u};
    uint64_t t_post = afs_now_ns();
    int rc = n->ops->post_paged(n->dom, &p);
    if (rc == AFS_EAGAIN) {
        afs_count(&n->st_retries, 1);
        return AFS_EAGAIN;
    }
    if (rc) {
        fail_op(eng, x, rc, "posting paged write: %s", n->ops->errbuf(n->dom));
        x->total_wr = x->posted_wr;
        return 0;
    }
    x->posted_wr = 1;
    x->t_first_post = t_post;
    if (eng->timings)
        x->t_last_post = afs_now_ns();
    afs_count(&n->st_writes, 1); /* one work request: `completions` counts it once */
    afs_count(&n->st_write_bytes, x->rma.count * x->rma.length);
    return 0;
}

/* Post up to one round of x's work requests, in runs of consecutive requests for the same
 * NIC. Returns AFS_EAGAIN when a provider's queue is full (stop posting this round). */
static int post_round(afs_engine *eng, afs_xfer *x)
{
    if (x->rma.whole)
        return post_whole(eng, x);
    afp_write wr[AFS_POST_ROUND];
    uint32_t nic_of[AFS_POST_ROUND];
    uint32_t n = 0;
    while (n < AFS_POST_ROUND && x->posted_wr + n < x->total_wr) {
        gen_wr(x, x->posted_wr + n, &wr[n], &nic_of[n]);
        n++;
    }
    uint32_t at = 0;
    while (at < n) {
        uint32_t nic = nic_of[at], run = 1;
        while (at + run < n && nic_of[at + run] == nic)
            run++;
        uint32_t posted = 0;
        afs_nic *n = &eng->nics[nic];
        /* stamped as posting starts (one clock read per operation; the loop's `now` may
         * predate a nap), so "posting" covers every provider call of the operation */
        uint64_t t_post = x->posted_wr == 0 ? afs_now_ns() : 0;
        int rc = x->rma.read ? n->ops->post_reads(n->dom, &wr[at], run, &posted)
                             : n->ops->post_writes(n->dom, &wr[at], run, &posted);
        if (posted && x->posted_wr == 0)
            x->t_first_post = t_post;
        x->posted_wr += posted;
        if (eng->timings && x->posted_wr == x->total_wr)
            x->t_last_post = afs_now_ns();
        uint64_t bytes = 0;
        for (uint32_t i = 0; i < posted; i++)
            bytes += wr[at + i].length;
        afs_count(x->rma.read ? &n->st_reads : &n->st_writes, posted);
        afs_count(x->rma.read ? &n->st_read_bytes : &n->st_write_bytes, bytes);
        if (rc == AFS_EAGAIN) {
            afs_count(&n->st_retries, 1);
            return AFS_EAGAIN;
        }
        if (rc) {
            fail_op(eng, x, rc, x->rma.read ? "posting read: %s" : "posting write: %s",
                    n->ops->errbuf(n->dom));
            x->total_wr = x->posted_wr; /* nothing more will be posted */
            x->rma.imm_pending = false;
            return 0;
        }
        at += run;
    }
    return 0;
}

static int post_send(afs_engine *eng, afs_xfer *x)
{
    afs_nic *n = &eng->nics[x->send.nic]; /* the first NIC of the peer's route */
    if (n->tx_free_len == 0)
        return AFS_EAGAIN;
    uint32_t slot = n->tx_free[n->tx_free_len - 1];
    uint64_t t_post = afs_now_ns();
    uint8_t *buf = n->tx_buf + (uint64_t)slot * eng->cfg.max_msg_size;
    memcpy(buf, x->send.payload, x->send.length);
    int rc = n->ops->post_send(n->dom, x->send.peer_fi_addr, buf, x->send.length, n->tx_desc,
                               (uint64_t)(uintptr_t)x);
    if (rc == AFS_EAGAIN) {
        afs_count(&n->st_retries, 1);
        return AFS_EAGAIN;
    }
    if (rc) {
        fail_op(eng, x, rc, "posting send: %s", n->ops->errbuf(n->dom));
        x->total_wr = x->posted_wr;
        return 0;
    }
    n->tx_free_len--;
    afs_count(&n->st_sends, 1);
    x->send.tx_slot = slot;
    x->posted_wr = 1;
    x->t_first_post = t_post;
    if (eng->timings)
        x->t_last_post = afs_now_ns();
    return 0;
}

/* A refusal (EAGAIN) means the provider's queue is full, and the queue waits, unless the
 * same operation has been refused this long: then its destination refuses (tcp;ofi_rxm
 * connecting to a peer that does not answer, 1.17 shm to a stopped peer), and operations to
 * other destinations are posted past it. Before, one write to a stopped peer held every
 * later write of the engine, to any peer, until its op_timeout (4.8 s of 5, shm and tcp). */
#define POST_REFUSED_NS 1000000ull
#define POST_REFUSED_MAX 8 /* destinations passed in one pass; past that the queue waits */

/* Where a queued operation goes, to tell a refusing destination from a full queue: the peer
 * of a send, the first NIC's address of a write or read to one region; 0 (never passed)
 * for one with several targets. */
static uint64_t post_dest(const afs_xfer *x)
{
    if (x->kind == AFS_REQ_SEND)
        return (x->send.peer_fi_addr | (uint64_t)x->send.nic << 56) + 1;
    if (afs_xfer_is_rma(x) && !x->rma.targets)
        return (x->rma.fi_addr[x->rma.nic_first] | (uint64_t)x->rma.nic_first << 56) + 1;
    return 0;
}

static bool progress_posts(afs_engine *eng, uint64_t now)
{
    bool did = false;
    afs_xfer *x = eng->postq_head;
    afs_xfer *keep_head = NULL, *keep_tail = NULL;
    bool full = false;
    uint64_t refused[POST_REFUSED_MAX];
    uint32_t n_refused = 0;
    bool stalled = true; /* until an operation kept may go soon */
    while (x) {
        if (full) {
            stalled = false;
            /* The provider's queue is full: the rest stays queued as it is, its links intact
             * (x and everything after it; eng->postq_tail is still its last). Relinking it
             * node by node cost a spinning worker ~80% of its own cycles at 4 KiB on shm
             * (perf, 64 writes in flight). One failed while queued leaves at finish(). */
            if (keep_tail)
                keep_tail->pnext = x;
            else
                keep_head = x;
            keep_tail = eng->postq_tail;
            break;
        }
        afs_xfer *next = x->pnext;
        x->pnext = NULL;
        const uint64_t dest = n_refused ? post_dest(x) : 0;
        bool passed = false; /* its destination refused earlier in this pass */
        for (uint32_t i = 0; i < n_refused && dest && !passed; i++)
            passed = dest == refused[i];
        bool refusing = passed;
        if (!passed && x->status == 0 && !x->reported && x->posted_wr < x->total_wr) {
            uint64_t before = x->posted_wr;
            int rc = x->kind == AFS_REQ_SEND ? post_send(eng, x) : post_round(eng, x);
            did |= x->posted_wr != before;
            if (x->posted_wr != before)
                x->refused_since = 0; /* it moves: refused since now at the earliest */
            if (rc == AFS_EAGAIN) {
                if (!x->refused_since)
                    x->refused_since = now;
                const uint64_t to = post_dest(x);
                if (now - x->refused_since < POST_REFUSED_NS || !to ||
                    n_refused == POST_REFUSED_MAX) {
                    full = true;
                } else {
                    refused[n_refused++] = to;
                    refusing = true;
                }
            } else {
                x->refused_since = 0;
            }
        }
        bool more = x->status == 0 && !x->reported && x->posted_wr < x->total_wr;
        if (more) {
            if (keep_tail)
                keep_tail->pnext = x;
            else
                keep_head = x;
            keep_tail = x;
            stalled &= refusing;
        } else {
            x->in_postq = false;
            check_xfer(eng, x); /* an error while posting may complete it */
        }
        x = next;
    }
    eng->postq_head = keep_head;
    eng->postq_tail = keep_tail;
    eng->posts_stalled = keep_head && stalled;
    return did;
}

/* ---- immediates and expectations ---- */

static void complete_expect(afs_engine *eng, afs_xfer *x, int status, const char *text)
{
    if (status)
        set_error(x, status, "%s", text);
    list_remove(&eng->expects, x);
    push_done(eng, x, false);
    afs_xfer_free(x);
}

static bool refuse_down_peer(afs_engine *eng, afs_xfer *x); /* below, with on_peer */

/* An operation starts: its deadline runs from now and its work requests queue up. */
static void start(afs_engine *eng, afs_xfer *x, uint64_t now)
{
    /* a write of afs_write_dynlen: its length is read now (dynlen.c), and the write cut again */
    if (x->kind == AFS_REQ_WRITE && x->rma.dyn_len) {
        afs_dynlen_resolve(x);
        plan_shards(x);
        x->total_wr = n_data_wrs(x);
        x->rma.imm_pending = x->rma.has_imm && x->total_wr > 1;
    }
    if (eng->cfg.op_timeout_ns)
        x->deadline_ns = now + eng->cfg.op_timeout_ns;
    list_append(&eng->active, x);
    if ((eng->allow && afs_allow_refuse_out(eng, x)) || /* allow.c: fails x, posts nothing */
        (eng->n_down && refuse_down_peer(eng, x)))
        stop_posting(x); /* nothing was posted yet */
    if (x->total_wr == 0)
        finish(eng, x);
    else
        postq_push(eng, x);
}

/* A triggered operation's condition holds: from now on it is an ordinary operation. */
static void disarm(afs_engine *eng, afs_xfer *x)
{
    list_remove(&eng->armed, x);
    x->rma.armed = false;
    if (x->rma.trig_kind == AFS_TRIG_WATCHER)
        atomic_fetch_sub(&eng->armed_on_watchers, 1);
}

static void fire(afs_engine *eng, afs_xfer *x, uint64_t now)
{
    disarm(eng, x);
    start(eng, x, now);
}

/* An immediate's waiter (an expectation or an operation triggered on a count) is done. */
static void satisfy(afs_engine *eng, afs_xfer *x, uint64_t now)
{
    if (x->kind == AFS_REQ_EXPECT)
        complete_expect(eng, x, 0, NULL);
    else
        fire(eng, x, now);
}

/* `n` arrivals of `imm` nobody can count: dropped, counted, remembered by value (so that
 * an expectation on it fails at once: wait_imm), and reported on the first drop and at
 * every power of two after it (the engine logs it; both tables stay bounded). */
static void imm_dropped(afs_engine *eng, uint32_t nic, uint32_t imm, uint64_t count)
{
    afs_nic *n = &eng->nics[nic];
    afs_count(&n->st_imms_dropped, 1);
    uint32_t exact = eng->cfg.max_imm_values > AFS_DROPPED_EXACT ? eng->cfg.max_imm_values
                                                                   : AFS_DROPPED_EXACT;
    afs_imm_entry *d = afs_immtab_get(&eng->imm_dropped, imm, false);
    if (!d && eng->imm_dropped.len < exact)
        d = afs_immtab_get(&eng->imm_dropped, imm, true);
    if (d) {
        d->arrived += count;
    } else {
        if (!eng->imm_dropped_bits)
            eng->imm_dropped_bits = calloc(AFS_DROPPED_BITS / 64, sizeof(uint64_t));
        if (eng->imm_dropped_bits) {
            uint32_t bit = (uint32_t)afs_mix64(imm) & (AFS_DROPPED_BITS - 1);
            eng->imm_dropped_bits[bit / 64] |= 1ull << (bit % 64);
        }
    }
    uint64_t total = 0;
    for (uint32_t k = 0; k < eng->nnics; k++)
        total += atomic_load_explicit(&eng->nics[k].st_imms_dropped, memory_order_relaxed);
    if (total & (total - 1))
        return;
    afs_completion c = {0};
    c.kind = AFS_C_NOTICE;
    c.id = AFS_NOTICE_IMMS_DROPPED;
    c.total = total;
    afs_ring_push(&eng->ring, &c);
}

/* `n` arrivals of `imm` (on `nic`). A value already in the table (expected, or arrived
 * before) is always counted; a new one only while the table holds fewer than
 * max_imm_values (100,000 distinct values that nobody expects must not all be kept) —
 * except arrivals given back by a withdrawn expectation (`returned`): they were counted
 * once already and are never dropped. */
static void imm_arrived_n(afs_engine *eng, uint32_t nic, uint32_t imm, uint64_t n, bool returned,
                          uint64_t now)
{
    afs_imm_entry *e = afs_immtab_get(&eng->imm, imm, false);
    if (!e && !returned && eng->imm.len >= eng->cfg.max_imm_values) {
        imm_dropped(eng, nic, imm, n);
        return;
    }
    if (!e)
        e = afs_immtab_get(&eng->imm, imm, true);
    if (!e) { /* out of memory: the counter cannot grow */
        imm_dropped(eng, nic, imm, n);
        return;
    }
    e->arrived += n;
    if (e->expected && e->arrived >= e->expected) {
        afs_xfer *x = e->waiter;
        e->arrived -= e->expected;
        e->expected = 0;
        e->waiter = NULL;
        afs_immtab_maybe_remove(&eng->imm, e);
        satisfy(eng, x, now);
    }
}

static void imm_arrived(afs_engine *eng, uint32_t nic, uint32_t imm, uint64_t now)
{
    imm_arrived_n(eng, nic, imm, 1, false, now);
}

/* Whether arrivals of `imm` were dropped at the bound (imm_dropped): x fails, saying so,
 * and the value is forgotten (said once: it is free for later use). */
static bool dropped_before(afs_engine *eng, afs_xfer *x, uint32_t imm)
{
    char msg[240];
    afs_imm_entry *d = afs_immtab_get(&eng->imm_dropped, imm, false);
    uint32_t bit = (uint32_t)afs_mix64(imm) & (AFS_DROPPED_BITS - 1);
    uint64_t *word = eng->imm_dropped_bits ? &eng->imm_dropped_bits[bit / 64] : NULL;
    if (d) {
        snprintf(msg, sizeof(msg),
                 "%llu arrival(s) of immediate %u were dropped: the engine already counted "
                 "max_imm_values=%u other values; raise Engine(max_imm_values=...)",
                 (unsigned long long)d->arrived, imm, eng->cfg.max_imm_values);
        d->arrived = 0;
        afs_immtab_maybe_remove(&eng->imm_dropped, d);
    } else if (word && (*word & (1ull << (bit % 64)))) {
        snprintf(msg, sizeof(msg),
                 "arrivals of immediate %u may have been dropped: more than %u distinct values "
                 "were dropped at max_imm_values=%u; raise Engine(max_imm_values=...)",
                 imm, (unsigned)eng->imm_dropped.len, eng->cfg.max_imm_values);
        *word &= ~(1ull << (bit % 64));
    } else {
        return false;
    }
    set_error(x, AFS_EDROPPED, "%s", msg);
    return true;
}

/* Registers x (an expectation, or an operation triggered on a count) as the waiter of
 * immediate `imm` for `count` arrivals; satisfies it at once from early arrivals.
 * Returns false (x failed, typed) when another waiter holds that immediate or arrivals of
 * it were dropped at the bound. */
static bool wait_imm(afs_engine *eng, afs_xfer *x, uint32_t imm, uint64_t count, uint64_t now)
{
    afs_imm_entry *e = afs_immtab_get(&eng->imm, imm, true);
    if (!e) {
        set_error(x, AFS_ENOMEM, "%s", "immediate table: out of memory");
        return false;
    }
    if (e->expected) {
        char msg[96];
        snprintf(msg, sizeof(msg), "an expectation for immediate %u is already pending", imm);
        set_error(x, AFS_EBUSY, "%s", msg);
        afs_immtab_maybe_remove(&eng->imm, e);
        return false;
    }
    if (e->arrived >= count) {
        e->arrived -= count;
        afs_immtab_maybe_remove(&eng->imm, e);
        satisfy(eng, x, now);
        return true;
    }
    if (dropped_before(eng, x, imm)) { /* what it waits for was dropped: it would wait for ever */
        afs_immtab_maybe_remove(&eng->imm, e);
        return false;
    }
    e->expected = count;
    e->waiter = x;
    return true;
}

static void start_expect(afs_engine *eng, afs_xfer *x, uint64_t now)
{
    list_append(&eng->expects, x); /* complete_expect removes it */
    if (x->expect.count == 0) {
        complete_expect(eng, x, 0, NULL);
        return;
    }
    if (!wait_imm(eng, x, x->expect.imm, x->expect.count, now)) {
        list_remove(&eng->expects, x);
        push_done(eng, x, false);
        afs_xfer_free(x);
    }
}

/* Holds a triggered operation until its condition holds (or fires it now). */
static void arm(afs_engine *eng, afs_xfer *x, uint64_t now)
{
    x->rma.armed = true;
    list_append(&eng->armed, x);
    if (x->rma.trig_kind == AFS_TRIG_WATCHER) {
        /* while anything is armed on a watcher its thread spins instead of napping */
        atomic_fetch_add(&eng->armed_on_watchers, 1);
        afs_watcher *w = afs_slots_lookup(&eng->watchers, x->rma.trig_watcher);
        if (!w) {
            set_error(x, AFS_ESTALE, "%s", "trigger's watcher was destroyed");
            disarm(eng, x);
            list_append(&eng->active, x);
            finish(eng, x);
            return;
        }
        if (w->current >= x->rma.trig_value)
            fire(eng, x, now);
        return;
    }
    if (x->rma.trig_value == 0) {
        fire(eng, x, now);
        return;
    }
    if (!wait_imm(eng, x, (uint32_t)x->rma.trig_watcher, x->rma.trig_value, now)) {
        disarm(eng, x);
        list_append(&eng->active, x);
        finish(eng, x);
    }
}

/* The watcher thread saw a change: report it, and fire what it arms. */
static void on_watch(afs_engine *eng, afs_xfer *req, uint64_t now)
{
    afs_watcher *w = afs_slots_lookup(&eng->watchers, req->watch.watcher_id);
    if (w)
        w->current = req->watch.new_value;
    afs_completion c = {0};
    c.kind = AFS_C_WATCH;
    c.id = req->watch.watcher_id;
    c.watch_old = req->watch.old_value;
    c.watch_new = req->watch.new_value;
    afs_ring_push(&eng->ring, &c);
    afs_xfer *x = eng->armed.head;
    while (x) {
        afs_xfer *next = x->next;
        if (x->rma.trig_kind == AFS_TRIG_WATCHER && x->rma.trig_watcher == req->watch.watcher_id &&
            req->watch.new_value >= x->rma.trig_value) {
            if (eng->timings)
                x->t_pickup = req->t_enqueue; /* "pickup": the watcher thread saw it */
            fire(eng, x, now);
        }
        x = next;
    }
}

/* Operations armed on a watcher fire from here as soon as the worker (awake while any is
 * armed) sees the word reach their value: the watcher thread's pass and its hand-over
 * through the submit queue are not on their path (2-core machine, shm: bump -> first post
 * p50 7.8 -> 3.6-5.8 us bumped from the loop, 38.8 -> 8.6-15.8 from a thread). The watcher
 * thread still reports every change to Python (on_watch) and fires whatever this did not. A cancel submitted before the change is
 * taken first: seen the word, the worker notes how many cancels were submitted, takes its
 * queue, and fires only once it took that many (else, one stuck behind a producer that is
 * mid-push, it looks again next turn). A word is freed only at engine close. */
static bool take_requests(afs_engine *eng, uint64_t now); /* below, with the deadlines */

static bool fire_watched(afs_engine *eng, uint64_t now)
{
    bool any = false;
    for (afs_xfer *x = eng->armed.head; x; x = x->next) {
        if (x->rma.trig_kind != AFS_TRIG_WATCHER)
            continue;
        afs_watcher *w = afs_slots_lookup(&eng->watchers, x->rma.trig_watcher);
        x->rma.trig_seen = w && w->word &&
                           atomic_load_explicit(w->word, memory_order_acquire) >= x->rma.trig_value;
        any |= x->rma.trig_seen;
    }
    if (!any)
        return false;
    uint64_t cancels = atomic_load_explicit(&eng->cancels_submitted, memory_order_acquire);
    take_requests(eng, now);
    bool cancels_in = eng->cancels_taken >= cancels; /* none left behind a half push */
    uint64_t seen_ns = eng->timings ? afs_now_ns() : 0;
    afs_xfer *x = eng->armed.head;
    while (x) {
        afs_xfer *next = x->next;
        if (x->rma.trig_seen) {
            x->rma.trig_seen = false;
            if (cancels_in) {
                if (eng->timings)
                    x->t_pickup = seen_ns; /* its "pickup": the change was seen */
                fire(eng, x, now);
            }
        }
        x = next;
    }
    return true;
}

/* Withdraws an expectation or disarms a triggered operation (fired ones run on). */
static void cancel_waiting(afs_engine *eng, uint64_t id)
{
    afs_xfer_list *lists[2] = {&eng->expects, &eng->armed};
    for (int l = 0; l < 2; l++) {
        for (afs_xfer *x = lists[l]->head; x; x = x->next) {
            if (x->id != id)
                continue;
            uint32_t imm =
                x->kind == AFS_REQ_EXPECT ? x->expect.imm : (uint32_t)x->rma.trig_watcher;
            bool on_imm = x->kind == AFS_REQ_EXPECT || x->rma.trig_kind == AFS_TRIG_IMM;
            afs_imm_entry *e = on_imm ? afs_immtab_get(&eng->imm, imm, false) : NULL;
            if (e && e->waiter == x) {
                e->expected = 0;
                e->waiter = NULL;
                afs_immtab_maybe_remove(&eng->imm, e);
            }
            if (x->kind == AFS_REQ_EXPECT) {
                complete_expect(eng, x, AFS_ECANCELED, "expectation canceled");
            } else {
                set_error(x, AFS_ECANCELED, "%s", "triggered operation disarmed before it fired");
                disarm(eng, x);
                list_append(&eng->active, x);
                x->total_wr = 0;
                finish(eng, x);
            }
            return;
        }
    }
}

/* ---- control requests ---- */

/* Registers region `m` with every transport that takes its kind of memory (afs_reg_flags),
 * all or nothing. */
static void ctrl_reg(afs_engine *eng, afs_xfer *x)
{
    afs_mr_entry *m = x->ctrl.mr;
    const uint32_t remote = AFP_MR_REMOTE | AFP_MR_REMOTE_READ;
    uint32_t k;
    m->local_mask = m->remote_mask = 0;
    for (k = 0; k < eng->nnics; k++) {
        afs_nic *n = &eng->nics[k];
        uint32_t flags = afs_reg_flags(eng, &eng->tps[n->tp], m);
        if (flags == UINT32_MAX)
            continue;
        uint64_t key = afs_mr_key(eng->key_secret, k, ++n->key_counter);
        int rc = n->ops->reg_mr(n->dom, (void *)(uintptr_t)m->addr, m->len, flags, m->device,
                                key, &m->mr[k], &m->desc[k], &m->rkey[k], &m->rbase[k]);
        if (rc) {
            x->ctrl.rc = rc;
            snprintf(x->ctrl.err, sizeof(x->ctrl.err), "registering %llu bytes on %s: %s",
                     (unsigned long long)m->len, n->caps.provider, n->ops->errbuf(n->dom));
            goto out_undo;
        }
        m->local_mask |= 1u << n->tp;
        if (flags & remote)
            m->remote_mask |= 1u << n->tp;
    }
    if (!m->local_mask || ((m->flags & remote) && !m->remote_mask)) {
        x->ctrl.rc = AFS_EUNSUPPORTED;
        snprintf(x->ctrl.err, sizeof(x->ctrl.err),
                 "no transport of this engine (%s) %s %s memory", eng->provider_full,
                 m->local_mask ? "lets peers reach" : "registers",
                 (m->flags & AFP_MR_DEVICE) ? "CUDA device" : "host");
        goto out_undo;
    }
    return;
out_undo:
    while (k-- > 0) {
        if (m->mr[k])
            eng->nics[k].ops->dereg_mr(eng->nics[k].dom, m->mr[k]);
        m->mr[k] = NULL;
    }
    m->local_mask = m->remote_mask = 0;
}

/* Remote writes and immediates this engine has seen land, over all NICs. */
static uint64_t landed_total(afs_engine *eng)
{
    uint64_t sum = 0;
    for (uint32_t k = 0; k < eng->nnics; k++)
        sum += atomic_load_explicit(&eng->nics[k].st_landed, memory_order_relaxed) +
               atomic_load_explicit(&eng->nics[k].st_imms, memory_order_relaxed);
    return sum;
}

/*
 * Deregistering a remote region on a provider whose target copies the bytes itself
 * (AFP_CAP_TARGET_COPIES: libfabric 1.17's tcp;ofi_rxm reads an accepted write's payload from
 * the socket straight into the region over many progress calls, shm's SAR protocol copies in
 * steps): closing the key stops new writes, not one already accepted, and its bytes kept
 * landing up to ~6 ms after deregister returned. So the caller is answered only
 * once the worker, polling as usual, has seen no remote write complete for DEREG_QUIET_NS
 * (an accepted write completes as its last byte lands), or after DEREG_MAX_NS at most.
 * The counter is per engine, not per region: writes streaming into other regions keep it
 * moving, and the deregistration then takes DEREG_MAX_NS.
 */
#define DEREG_QUIET_NS 50000000ull  /* 50 ms */
#define DEREG_MAX_NS 2000000000ull  /* 2 s */

bool afs_target_copies(const afs_engine *eng)
{
    for (uint32_t k = 0; k < eng->nnics; k++)
        if (eng->nics[k].caps.flags & AFP_CAP_TARGET_COPIES)
            return true;
    return false;
}

static bool settle_dereg(afs_engine *eng, afs_xfer *x, uint64_t now)
{
    /* readable regions too: a read accepted before the revocation may still be answered from
     * the region by the target's progress (nothing counts those, so they get the quiet time) */
    if (!(x->ctrl.mr->flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ)) || x->ctrl.rc)
        return false;
    if (!afs_target_copies(eng))
        return false;
    x->ctrl.settle_seen = landed_total(eng);
    x->ctrl.settle_since = now;
    x->deadline_ns = now + DEREG_MAX_NS;
    list_append(&eng->settling, x);
    return true;
}

/* Answers the deregistrations whose remote writes have stopped landing (after a poll). */
static void settle_deregs(afs_engine *eng, uint64_t now)
{
    uint64_t seen = landed_total(eng);
    afs_xfer *x = eng->settling.head;
    while (x) {
        afs_xfer *next = x->next;
        if (seen != x->ctrl.settle_seen) {
            x->ctrl.settle_seen = seen;
            x->ctrl.settle_since = now;
        }
        if (now - x->ctrl.settle_since >= DEREG_QUIET_NS || now >= x->deadline_ns) {
            list_remove(&eng->settling, x);
            sem_post(&x->ctrl.done); /* the caller owns x */
        }
        x = next;
    }
}

static void ctrl_dereg(afs_engine *eng, afs_xfer *x)
{
    afs_mr_entry *m = x->ctrl.mr;
    for (uint32_t k = 0; k < eng->nnics; k++) {
        if (!m->mr[k])
            continue;
        int rc = eng->nics[k].ops->dereg_mr(eng->nics[k].dom, m->mr[k]);
        m->mr[k] = NULL;
        if (rc && !x->ctrl.rc) {
            x->ctrl.rc = rc;
            snprintf(x->ctrl.err, sizeof(x->ctrl.err), "deregistering: %s",
                     eng->nics[k].ops->errbuf(eng->nics[k].dom));
        }
    }
}

/* Resolves the peer on each transport engine.c matched (tp_want). A single-provider
 * engine fails on the first refusal; a routed one notes it (x->ctrl.refused), lets go of
 * that transport's NICs resolved so far, and fails only if no transport resolved it. */
static void ctrl_resolve(afs_engine *eng, afs_xfer *x)
{
    for (uint32_t t = 0; t < eng->ntp; t++) {
        const afs_transport *tp = &eng->tps[t];
        if (!(x->ctrl.tp_want & (1u << t)))
            continue;
        uint32_t i;
        int rc = 0;
        for (i = 0; i < tp->count && !rc; i++) {
            afs_nic *n = &eng->nics[tp->first + i];
            rc = tp->ops->resolve(n->dom, x->ctrl.addr[tp->first + i],
                                  x->ctrl.addr_len[tp->first + i],
                                  &x->ctrl.fi_addr[tp->first + i]);
        }
        if (!rc) {
            x->ctrl.tp_got |= 1u << t;
            continue;
        }
        const char *text = tp->ops->errbuf(eng->nics[tp->first + i - 1].dom);
        if (!eng->routed) {
            x->ctrl.rc = rc;
            snprintf(x->ctrl.err, sizeof(x->ctrl.err), "resolving peer address: %s", text);
            return;
        }
        size_t at = strlen(x->ctrl.refused);
        if (at < sizeof(x->ctrl.refused))
            snprintf(x->ctrl.refused + at, sizeof(x->ctrl.refused) - at, "%s%s: %s",
                     at ? "; " : "", tp->name, text);
        for (uint32_t j = 0; j + 1 < i; j++) /* the NICs it did resolve */
            if (AFP_HAS_OP(tp->ops, forget))
                (void)tp->ops->forget(eng->nics[tp->first + j].dom,
                                      x->ctrl.fi_addr[tp->first + j]);
    }
    if (!x->ctrl.tp_got && !x->ctrl.rc) {
        x->ctrl.rc = AFS_EPEER;
        snprintf(x->ctrl.err, sizeof(x->ctrl.err), "no transport reaches the peer: %.200s",
                 x->ctrl.refused);
    }
}

static void run_ctrl(afs_engine *eng, afs_xfer *x, uint64_t now)
{
    if (atomic_load_explicit(&eng->stuck, memory_order_acquire)) {
        /* back from being stuck: its caller may have given up (afs_ctrl_call), and what
         * the request points to may be gone; only the semaphore is still its */
        x->ctrl.rc = AFS_ESTUCK;
        snprintf(x->ctrl.err, sizeof(x->ctrl.err), "the engine's worker was stuck");
        sem_post(&x->ctrl.done);
        return;
    }
    switch (x->ctrl.op) {
    case AFS_CTRL_REG:
        ctrl_reg(eng, x);
        break;
    case AFS_CTRL_DEREG:
        ctrl_dereg(eng, x);
        if (settle_dereg(eng, x, now))
            return; /* answered by settle_deregs */
        break;
    case AFS_CTRL_RESOLVE:
        ctrl_resolve(eng, x);
        break;
    case AFS_CTRL_ALLOW: /* allow.c frees the list this one replaces */
        eng->allow = x->ctrl.allow;
        break;
    default:
        x->ctrl.rc = AFS_EINVAL;
        snprintf(x->ctrl.err, sizeof(x->ctrl.err), "unknown control request %u", x->ctrl.op);
    }
    sem_post(&x->ctrl.done); /* the caller owns x */
}

/* ---- intake ---- */

/* Gives a receive buffer back to the provider. "Try again" happens under load (writes in
 * flight can hold every context of the provider's pool): the slot then waits in rx_retry
 * and the worker posts it again each round. Dropping it instead loses one buffer each
 * time, and the engine stops receiving once all are gone (seen once: tcp, rx_depth 8,
 * no message after the 59th of a write flood). */
static void repost_rx(afs_engine *eng, uint32_t nic, uint32_t slot)
{
    afs_nic *n = &eng->nics[nic];
    if (atomic_load(&eng->stop) || afs_post_rx(eng, nic, slot) == 0)
        return;
    if (n->rx_retry_len < eng->cfg.rx_depth) /* a slot is out at most once: always room */
        n->rx_retry[n->rx_retry_len++] = slot;
}

static bool retry_rx(afs_engine *eng)
{
    bool did = false;
    for (uint32_t k = 0; k < eng->nnics; k++) {
        afs_nic *n = &eng->nics[k];
        while (n->rx_retry_len && afs_post_rx(eng, k, n->rx_retry[n->rx_retry_len - 1]) == 0) {
            n->rx_retry_len--;
            did = true;
        }
    }
    return did;
}

static void release_rx(afs_engine *eng, afs_xfer *x)
{
    for (uint32_t i = 0; i < x->release.n_slots; i++) {
        uint32_t nic = x->release.slots[i] / eng->cfg.rx_depth;
        uint32_t slot = x->release.slots[i] % eng->cfg.rx_depth;
        if (nic < eng->nnics)
            repost_rx(eng, nic, slot);
    }
    afs_xfer_free(x);
}

static void on_peer(afs_engine *eng, const afs_xfer *req); /* below, with the deadlines */

/* Deadlines are stamped when the worker takes a request (one clock read per loop, not
 * one per operation on the caller's thread); the few microseconds a request waits in the
 * queue are well inside any sensible timeout. */
static bool take_requests(afs_engine *eng, uint64_t now)
{
    bool did = false;
    afs_qnode *qn;
    while ((qn = afs_mpsc_pop(&eng->submitq)) != NULL) {
        afs_xfer *x = (afs_xfer *)qn;
        did = true;
        if (eng->timings)
            x->t_pickup = afs_now_ns();
        switch (x->kind) {
        case AFS_REQ_CTRL:
            run_ctrl(eng, x, now);
            break;
        case AFS_REQ_WRITE:
        case AFS_REQ_PAGED:
        case AFS_REQ_SCATTER:
            x->rma.nic0 = eng->rr++ % (x->rma.nic_count ? x->rma.nic_count : 1);
            if (x->kind == AFS_REQ_WRITE)
                plan_shards(x);
            x->rma.whole = x->kind == AFS_REQ_PAGED && x->rma.nic_count == 1 && !x->rma.read &&
                           AFP_HAS_OP(eng->nics[x->rma.nic_first].ops, post_paged);
            x->total_wr = x->rma.whole ? (x->rma.count ? 1 : 0) : n_data_wrs(x);
            x->rma.imm_pending = x->kind == AFS_REQ_WRITE && x->rma.has_imm && x->total_wr > 1;
            if (x->rma.trig_kind != AFS_TRIG_NONE)
                arm(eng, x, now);
            else
                start(eng, x, now);
            break;
        case AFS_REQ_SEND:
            x->total_wr = 1;
            start(eng, x, now);
            break;
        case AFS_REQ_EXPECT:
            start_expect(eng, x, now);
            break;
        case AFS_REQ_CANCEL:
            cancel_waiting(eng, x->cancel.xfer_id);
            afs_xfer_free(x);
            eng->cancels_taken++;
            break;
        case AFS_REQ_WATCH:
            on_watch(eng, x, now);
            afs_xfer_free(x);
            break;
        case AFS_REQ_RECV_RELEASE:
            release_rx(eng, x);
            break;
        case AFS_REQ_PEER:
            on_peer(eng, x);
            afs_xfer_free(x);
            break;
        case AFS_REQ_IMM_RETURN: /* counted again, as if they had just arrived */
            imm_arrived_n(eng, 0, x->expect.imm, x->expect.count, true, now);
            afs_xfer_free(x);
            break;
        default:
            afs_xfer_free(x);
        }
    }
    return did;
}

/* ---- completions ---- */

/* A work request of x completed: x made progress, so its deadline starts again from now
 * (op_timeout bounds the time without progress, not the whole transfer: a 10 M-page write
 * that keeps completing pages is not dead). The active list stays in deadline order. */
static void made_progress(afs_engine *eng, afs_xfer *x, uint64_t now)
{
    if (x->reported || !eng->cfg.op_timeout_ns)
        return;
    x->deadline_ns = now + eng->cfg.op_timeout_ns;
    if (eng->active.tail != x) {
        list_remove(&eng->active, x);
        list_append(&eng->active, x);
    }
}

static void on_op_done(afs_engine *eng, const afp_event *ev, uint64_t now)
{
    afs_xfer *x = (afs_xfer *)(uintptr_t)ev->ctx;
    if (!x)
        return;
    if (ev->status == 0)
        made_progress(eng, x, now);
    if (x->kind == AFS_REQ_SEND && x->posted_wr) {
        afs_nic *n = &eng->nics[x->send.nic];
        n->tx_free[n->tx_free_len++] = x->send.tx_slot;
    }
    /* The shim never cancels a write or send, so a provider's "canceled" means it gave up
     * on the operation (tcp;ofi_rxm reports a target's refusal of a remote access so). */
    int status = ev->status == AFS_ECANCELED ? AFS_EIO : ev->status;
    if (status)
        fail_op(eng, x, status, "%s", ev->errtext[0] ? ev->errtext : afs_error_name(status));
    x->done_wr++;
    check_xfer(eng, x);
}

_Static_assert(AFS_SRC_UNKNOWN == AFP_SRC_UNKNOWN && AFS_SRC_UNRESOLVED == AFP_SRC_UNRESOLVED,
               "a RECV completion passes the provider's source on as it is");

static void on_recv(afs_engine *eng, uint32_t nic, const afp_event *ev, uint64_t src)
{
    uint32_t slot = (uint32_t)(ev->ctx >> 16);
    if (ev->kind == AFP_EV_ERROR || ev->status) {
        /* truncated (oversize) or failed receive: nothing to deliver, reuse the buffer */
        repost_rx(eng, nic, slot);
        return;
    }
    afs_completion c = {0};
    c.kind = AFS_C_RECV;
    c.id = afs_src_id(eng, nic, src); /* AFP_SRC_* and AFS_SRC_* have the same values */
    c.data = (uint64_t)(uintptr_t)(eng->nics[nic].rx_buf + (uint64_t)slot * eng->cfg.max_msg_size);
    c.len = ev->len;
    c.slot = nic * eng->cfg.rx_depth + slot;
    afs_ring_push(&eng->ring, &c);
}

/* keepalive.c's findings (afs_ka_hook): a peer's state moves, and the worker hears of it
 * through its queue like any other AFS_REQ_PEER; an address to learn goes up to Python. */
static void ka_found(afs_engine *eng, uint32_t finding, uint64_t peer_id, const uint8_t *blob,
                     uint32_t len)
{
    if (finding == AFS_KA_HELLO) {
        uint8_t *copy = malloc(len);
        if (!copy)
            return;
        memcpy(copy, blob, len);
        afs_completion c = {0};
        c.kind = AFS_C_HELLO;
        c.data = (uint64_t)(uintptr_t)copy;
        c.len = len;
        afs_ring_push(&eng->ring, &c);
        return;
    }
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    if (!p)
        return;
    bool watched = atomic_load(&p->ka) & AFS_KA_WATCHED;
    int32_t why = finding == AFS_KA_SILENT ? AFS_PEER_SILENT : AFS_PEER_CLOSED;
    uint32_t flags = afs_peer_flags(finding == AFS_KA_HEARD ? 0 : why, watched);
    if (finding == AFS_KA_GRACE_OVER)
        flags |= AFS_PEER_GRACE_OVER;
    else if (finding == AFS_KA_HEARD ? !afs_peer_set_up(p, AFS_PEER_SILENT)
                                     : !afs_peer_set_down(p, why))
        return;
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_PEER);
    if (!x)
        return; /* out of memory: the down flag still refuses new operations */
    x->peer.peer_id = peer_id;
    x->status = finding == AFS_KA_HEARD ? 0 : AFS_EPEER;
    x->peer.pid = p->pid;
    x->peer.flags = flags;
    afs_submit(eng, x);
}

/* What one look at a NIC found (poll_nic). */
enum nic_found { FOUND_NOTHING = 0, FOUND_SLOW_CALL = 1, FOUND_WORK = 2, FOUND_ARRIVAL = 3 };

/* FOUND_SLOW_CALL: only a progress call that took long without an event of its own
 * (AFP_EV_ACTIVITY with len 0, not ARRIVED): data moving for a transfer in flight, or a call
 * that ran on cold caches after a nap (the worker tells the two apart, afs_worker_main).
 * FOUND_ARRIVAL: work, and among it bytes that arrived without an event of their own and
 * were seen only by a look at the provider's wait object (AFP_ACTIVITY_ARRIVED). */
static enum nic_found poll_nic(afs_engine *eng, uint32_t nic, uint64_t now)
{
    afp_event ev[AFS_POLL_BATCH];
    uint64_t src[AFS_POLL_BATCH]; /* senders, for the allow-list (allow.c) */
    uint32_t n = 0;
    int rc = afs_allow_poll(eng, nic, ev, src, AFS_POLL_BATCH, &n);
    if (rc && rc != AFS_EAGAIN)
        return FOUND_NOTHING; /* a failing CQ; errors of operations arrive as events */
    afs_nic *nn = &eng->nics[nic];
    bool slow_call_only = n > 0, arrival = false;
    for (uint32_t i = 0; i < n; i++) {
        const afp_event *e = &ev[i];
        bool is_rx = (e->ctx & 0xffu) == RX_TAG;
        bool arrived = e->kind == AFP_EV_ACTIVITY && e->op == AFP_ACTIVITY_ARRIVED;
        slow_call_only &= e->kind == AFP_EV_ACTIVITY && e->len == 0 && !arrived;
        arrival |= arrived;
        if (e->kind != AFP_EV_RECV && e->kind != AFP_EV_IMM && afs_ka_owns(e->ctx)) {
            afs_ka_sent(eng, e); /* keepalive.c: one of the shim's own frames went */
            continue;
        }
        if (e->kind == AFP_EV_RECV && is_rx && !e->status &&
            afs_ka_recv(eng, nic, nn->rx_buf + (e->ctx >> 16) * eng->cfg.max_msg_size, e->len,
                        src[i], ka_found)) {
            repost_rx(eng, nic, (uint32_t)(e->ctx >> 16)); /* a control frame: not a message */
            continue;
        }
        if (eng->allow && (e->kind == AFP_EV_RECV || e->kind == AFP_EV_IMM) &&
            afs_allow_refuse_src(eng, nic, src[i])) {
            if (is_rx) /* dropped before anyone sees it: the buffer goes straight back */
                repost_rx(eng, nic, (uint32_t)(e->ctx >> 16));
            continue;
        }
        if (e->kind == AFP_EV_ERROR) /* a failed receive too: e.g. an oversize message */
            afs_count(&nn->st_errors, 1);
        if (e->kind == AFP_EV_WRITE_DONE || e->kind == AFP_EV_SEND_DONE ||
            (e->kind == AFP_EV_ERROR && !is_rx))
            afs_count(&nn->st_completions, 1);
        switch (e->kind) {
        case AFP_EV_IMM:
            afs_count(&nn->st_imms, 1);
            if (is_rx)
                repost_rx(eng, nic, (uint32_t)(e->ctx >> 16));
            imm_arrived(eng, nic, e->imm, now);
            break;
        case AFP_EV_RECV:
            afs_count(&nn->st_recvs, 1);
            on_recv(eng, nic, e, src[i]);
            break;
        case AFP_EV_WRITE_DONE:
        case AFP_EV_SEND_DONE:
            on_op_done(eng, e, now);
            break;
        case AFP_EV_ERROR:
            if (is_rx)
                on_recv(eng, nic, e, src[i]);
            else
                on_op_done(eng, e, now);
            break;
        case AFP_EV_ACTIVITY: /* counted in n: keeps an adaptive worker spinning */
            afs_count(&nn->st_landed, e->len);
            break;
        default:
            break;
        }
    }
    return n == 0 ? FOUND_NOTHING : slow_call_only ? FOUND_SLOW_CALL : arrival ? FOUND_ARRIVAL : FOUND_WORK;
}

/* ---- peers (peers.c): a peer's process is gone ---- */

static bool goes_to(const afs_engine *eng, const afs_xfer *x, const afs_peer_entry *p)
{
    switch (x->kind) {
    case AFS_REQ_WRITE:
    case AFS_REQ_PAGED: {
        const uint32_t k = x->rma.nic_first;
        return (p->tp_mask & (1u << eng->nics[k].tp)) && x->rma.fi_addr[k] == p->fi_addr[k];
    }
    case AFS_REQ_SEND:
        return (p->tp_mask & (1u << eng->nics[x->send.nic].tp)) &&
               x->send.peer_fi_addr == p->fi_addr[x->send.nic];
    case AFS_REQ_SCATTER:
        for (uint64_t i = 0; i < x->rma.count; i++)
            if (x->rma.targets[i].nic < eng->nnics &&
                (p->tp_mask & (1u << eng->nics[x->rma.targets[i].nic].tp)) &&
                x->rma.targets[i].fi_addr == p->fi_addr[x->rma.targets[i].nic])
                return true;
        return false;
    default:
        return false;
    }
}

/* x goes to a same-host peer whose process has exited or is exiting (its pid in *pid): what
 * /proc showed, else NULL. Only on a failure: it reads /proc once per watched peer x goes to,
 * except for the last one found gone (a process gone stays gone: a dead peer's thousands of
 * failures read /proc once). */
static const char *to_gone_peer(afs_engine *eng, const afs_xfer *x, uint32_t *pid)
{
    pthread_mutex_lock(&eng->peers.lock);
    uint32_t n = eng->peers.n_alloc;
    pthread_mutex_unlock(&eng->peers.lock);
    for (uint32_t i = 0; i < n; i++) {
        afs_peer_entry *p = afs_slots_at(&eng->peers, i);
        uint32_t gen = p ? atomic_load(&p->hdr.gen) : 0;
        if (!(gen & 1u) || atomic_load(&p->superseded_by) ||
            !(atomic_load(&p->ka) & AFS_KA_WATCHED) || !goes_to(eng, x, p))
            continue;
        uint64_t id = ((uint64_t)gen << 32) | i;
        const char *why = eng->gone_peer == id ? eng->gone_why : afs_proc_gone(p->pid, p->start);
        if (why) {
            eng->gone_peer = id;
            eng->gone_why = why;
            *pid = p->pid;
            return why;
        }
    }
    return NULL;
}

/* The worker's own list of down peers. api.c refuses an operation to a down peer before
 * queueing it, but one queued just before the peer went down is taken after on_peer has
 * failed what was in flight: posted, it would wait for op_timeout (forever, for a caller
 * that waits for the provider to let go: libfabric 1.17 shm never completes work requests
 * to a dead peer). start() fails it instead. */
static void note_down(afs_engine *eng, uint64_t peer_id, bool down)
{
    for (uint32_t i = 0; i < eng->n_down; i++) {
        if (eng->down_peers[i] == peer_id) {
            if (!down)
                eng->down_peers[i] = eng->down_peers[--eng->n_down];
            return;
        }
    }
    if (!down)
        return;
    if (eng->n_down == eng->cap_down) {
        uint32_t cap = eng->cap_down ? eng->cap_down * 2 : 8;
        uint64_t *grown = realloc(eng->down_peers, cap * sizeof(*grown));
        if (!grown)
            return; /* out of memory: only the pre-queue check (api.c) refuses it then */
        eng->down_peers = grown;
        eng->cap_down = cap;
    }
    eng->down_peers[eng->n_down++] = peer_id;
}

static bool refuse_down_peer(afs_engine *eng, afs_xfer *x)
{
    for (uint32_t i = 0; i < eng->n_down;) {
        afs_peer_entry *p = afs_slots_lookup(&eng->peers, eng->down_peers[i]);
        if (!p || atomic_load(&p->superseded_by)) {
            /* gone, or restarted: its NIC addresses are the new incarnation's now */
            eng->down_peers[i] = eng->down_peers[--eng->n_down];
            continue;
        }
        int32_t down = atomic_load(&p->down);
        if (goes_to(eng, x, p) && (down == AFS_PEER_EXITED || down == AFS_PEER_CLOSED) &&
            afs_peer_later_claim(eng, p)) {
            /* a later incarnation lives at its NIC addresses (a restart not proven yet):
             * what goes there is the new one's (the old one's are refused in api.c) */
            eng->down_peers[i] = eng->down_peers[--eng->n_down];
            continue;
        }
        if (goes_to(eng, x, p)) {
            char msg[96];
            snprintf(msg, sizeof(msg), "peer %016llx: its process %s",
                     (unsigned long long)p->incarnation,
                     atomic_load(&p->down) == AFS_PEER_STOPPED ? "is stopped" : "has exited");
            set_error(x, AFS_EPEER, "%s", msg);
            return true;
        }
        i++;
    }
    return false;
}

/* Fails every operation in flight to the peer at once (zombies until the provider lets go,
 * as after a timeout), then reports the peer up or down (AFS_C_PEER, with its address). */
static void on_peer(afs_engine *eng, const afs_xfer *req)
{
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, req->peer.peer_id);
    if (!p)
        return;
    uint32_t flags = req->peer.flags;
    note_down(eng, req->peer.peer_id, req->status != 0);
    if (req->status) {
        char msg[96];
        snprintf(msg, sizeof(msg), "peer (process %llu): %s", (unsigned long long)req->peer.pid,
                 afs_peer_down_text(afs_peer_flags_why(flags)));
        /* after a goodbye, what is in flight gets a moment to complete (keepalive.c) */
        afs_xfer *x = afs_ka_grace(eng, req->peer.peer_id, flags) ? NULL : eng->active.head, *next;
        while (x) {
            next = x->next;
            if (!x->reported && goes_to(eng, x, p)) {
                set_error(x, AFS_EPEER, "%s", msg);
                stop_posting(x);
                finish(eng, x);
            }
            x = next;
        }
        for (x = eng->armed.head; x; x = next) { /* triggered ones would post to it later */
            next = x->next;
            if (goes_to(eng, x, p)) {
                set_error(x, AFS_EPEER, "%s", msg); /* first error wins over the cancel's */
                cancel_waiting(eng, x->id);
            }
        }
    }
    if (flags & AFS_PEER_GRACE_OVER)
        return; /* reported when the goodbye came */
    afs_completion c = {0};
    c.id = req->peer.peer_id;
    c.kind = AFS_C_PEER;
    c.status = req->status;
    uint8_t *addr = malloc(p->addr_len ? p->addr_len : 1);
    if (addr)
        memcpy(addr, p->addr, p->addr_len);
    c.data = (uint64_t)(uintptr_t)addr;
    c.len = addr ? p->addr_len : 0;
    c.peer_pid = req->peer.pid; /* 0 if unknown */
    c.peer_flags = req->peer.flags; /* AFS_C_PEER's peer_flags (peers.c) */
    afs_ring_push(&eng->ring, &c);
    afs_ka_peer(eng, req->peer.peer_id, req->status); /* keepalive.c: a new peer gets a hello */
}

static void check_deadlines(afs_engine *eng, uint64_t now)
{
    afs_xfer *x = eng->active.head;
    while (x) {
        afs_xfer *next = x->next;
        if (x->deadline_ns > now)
            break; /* submitted later than everything before it: not due either */
        if (!x->reported) {
            char msg[192];
            snprintf(msg, sizeof(msg),
                     "no progress for %.1f s: %llu of %llu work requests completed, %llu "
                     "posted (peer dead, unreachable or not progressing)",
                     (double)eng->cfg.op_timeout_ns / 1e9, (unsigned long long)x->done_wr,
                     (unsigned long long)x->total_wr, (unsigned long long)x->posted_wr);
            set_error(x, AFS_ETIMEDOUT, "%s", msg);
            stop_posting(x);
            finish(eng, x);
        }
        x = next;
    }
}

/* ---- sleeping ---- */

/* Whether nothing of the worker's own needs a timer: no operation in flight, failed and not
 * yet let go, waiting for arrivals or armed; no deregistration settling, no receive buffer
 * to repost, no keepalive tick due. Then only a provider's fd, a writer's wake-up datagram
 * (shm) or a request (the wake eventfd) can bring work, and each of them wakes the worker. */
static bool timers_idle(const afs_engine *eng)
{
    if (eng->active.head || eng->zombies.head || eng->expects.head || eng->armed.head ||
        eng->settling.head || eng->postq_head || !afs_ka_timers_idle(eng))
        return false;
    for (uint32_t k = 0; k < eng->nnics; k++)
        if (eng->nics[k].rx_retry_len)
            return false;
    return true;
}

/* Returns whether a provider's wait object (not the wake eventfd, not the timer) woke it. */
static bool worker_sleep(afs_engine *eng, uint64_t *sleep_ns, bool timers_only)
{
    atomic_store(&eng->worker_sleeping, 1);
    atomic_thread_fence(memory_order_seq_cst);
    if (!afs_mpsc_empty(&eng->submitq) || atomic_load(&eng->stop)) {
        atomic_store(&eng->worker_sleeping, 0);
        return false;
    }
    struct pollfd fds[1 + AFS_ENG_NICS];
    nfds_t nfds = 0;
    fds[nfds].fd = eng->wake_fd;
    fds[nfds].events = POLLIN;
    nfds++;
    bool all_fds = !timers_only;
    for (uint32_t k = 0; all_fds && k < eng->nnics; k++) {
        afs_nic *n = &eng->nics[k];
        if (n->caps.wait_fd < 0 || !AFP_HAS_OP(n->ops, trywait) || n->ops->trywait(n->dom) != 0) {
            all_fds = false;
            break;
        }
        fds[nfds].fd = n->caps.wait_fd;
        fds[nfds].events = POLLIN;
        nfds++;
    }
    struct timespec ts;
    if (all_fds) {
        long ms = timers_idle(eng) ? SLEEP_IDLE_MS : SLEEP_WAITFD_MS;
        ts.tv_sec = ms / 1000;
        ts.tv_nsec = (ms % 1000) * 1000000L;
    } else {
        nfds = 1;
        ts.tv_sec = 0;
        ts.tv_nsec = (long)*sleep_ns;
        *sleep_ns = *sleep_ns * 2 > SLEEP_MAX_NS ? SLEEP_MAX_NS : *sleep_ns * 2;
    }
    int rc = ppoll(fds, nfds, &ts, NULL);
    bool by_provider = false;
    if (rc > 0 && (fds[0].revents & POLLIN)) {
        uint64_t junk;
        ssize_t r = read(eng->wake_fd, &junk, sizeof(junk));
        (void)r;
    }
    for (nfds_t i = 1; rc > 0 && i < nfds; i++)
        by_provider |= fds[i].revents != 0;
    atomic_store(&eng->worker_sleeping, 0);
    atomic_fetch_add_explicit(&eng->worker_naps, 1, memory_order_relaxed);
    return by_provider;
}

static void pin_self(int cpu)
{
    /* Short sleeps must be short: the default 50 us timer slack would stretch a 20 us
     * nap to 70 us, which an idle target pays on every write that wakes it. */
    (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    if (cpu < 0)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    /* Pinning is a request: a core outside our cpuset just leaves the thread unpinned. */
    (void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void fail_queued(afs_engine *eng)
{
    afs_qnode *qn;
    for (int spins = 0; spins < 1000; spins++) {
        while ((qn = afs_mpsc_pop(&eng->submitq)) != NULL) {
            afs_xfer *x = (afs_xfer *)qn;
            if (x->kind == AFS_REQ_CTRL) {
                x->ctrl.rc = AFS_ECLOSED;
                snprintf(x->ctrl.err, sizeof(x->ctrl.err), "engine is closed");
                sem_post(&x->ctrl.done);
            } else {
                afs_xfer_free(x);
            }
        }
        if (afs_mpsc_empty(&eng->submitq))
            break;
        sched_yield();
    }
    afs_xfer *x;
    while ((x = eng->settling.head) != NULL) { /* closing: nothing lands any more */
        list_remove(&eng->settling, x);
        sem_post(&x->ctrl.done);
    }
    while ((x = eng->active.head) != NULL) {
        list_remove(&eng->active, x);
        if (x->done_hook)
            x->done_hook(x->done_arg, AFS_ECLOSED, "engine closed",
                         AFS_HOOK_REPORTED | AFS_HOOK_RELEASED);
        afs_xfer_free(x);
    }
    while ((x = eng->zombies.head) != NULL) {
        list_remove(&eng->zombies, x);
        if (x->done_hook)
            x->done_hook(x->done_arg, AFS_ECLOSED, NULL, AFS_HOOK_RELEASED);
        afs_xfer_free(x);
    }
    while ((x = eng->expects.head) != NULL) {
        list_remove(&eng->expects, x);
        afs_xfer_free(x);
    }
    while ((x = eng->armed.head) != NULL) {
        list_remove(&eng->armed, x);
        afs_xfer_free(x);
    }
    eng->postq_head = eng->postq_tail = NULL;
}

/* A routed engine's worker looks at a NIC that has nothing in flight and found nothing in
 * its last IDLE_NIC_TURNS looks only every IDLE_NIC_EVERY turns, until the loop has been
 * idle spin_us (then at every turn, so that nothing is pending there when it sleeps). Each
 * look is a provider call (libfabric tcp's progress: 1-2 µs on the 2-core machine), and
 * the round trips of the transport in use waited for it: the awaited 8 B write's raw p50
 * over cma, 3.5-4.5 µs on a cma engine, was 5.6 µs on a routed one. What arrives on a NIC
 * looked at less often waits at most IDLE_NIC_EVERY turns. */
#define IDLE_NIC_TURNS 64u
#define IDLE_NIC_EVERY 16u

static bool nic_due(const afs_engine *eng, uint32_t k, uint64_t turn, bool idle)
{
    const afs_nic *n = &eng->nics[k];
    if (eng->ntp == 1 || idle || turn - n->found_turn < IDLE_NIC_TURNS || n->rx_retry_len ||
        (turn + k) % IDLE_NIC_EVERY == 0)
        return true;
    uint64_t posted = atomic_load_explicit(&n->st_writes, memory_order_relaxed) +
                      atomic_load_explicit(&n->st_reads, memory_order_relaxed) +
                      atomic_load_explicit(&n->st_sends, memory_order_relaxed);
    return posted != atomic_load_explicit(&n->st_completions, memory_order_relaxed);
}

void *afs_worker_main(void *arg)
{
    afs_engine *eng = arg;
    const bool yields = afs_few_cpus(); /* before pinning: the process's CPUs */
    pin_self(eng->cfg.cpu);
    uint64_t idle_since = afs_now_ns();
    uint64_t sleep_ns = SLEEP_MIN_NS;
    const uint64_t spin_ns = (uint64_t)eng->cfg.spin_us * 1000ull;
    uint64_t now = idle_since;
    uint32_t fruitless = 0; /* provider wake-ups in a row with nothing to do (FRUITLESS_WAKES) */
    bool napped = false;    /* the last turn ended in a nap */
    uint64_t awake_until = 0; /* ARRIVAL_SPINS */
    uint64_t turn = IDLE_NIC_TURNS; /* nic_due: every NIC starts as if it found nothing */
    while (!atomic_load_explicit(&eng->stop, memory_order_acquire)) {
        atomic_store_explicit(&eng->beat_ns, now, memory_order_relaxed); /* peers.c watches it */
        bool did = take_requests(eng, now);
        /* before the posts: what fires is posted in this turn, not after a provider call */
        if (eng->armed.head && atomic_load_explicit(&eng->armed_on_watchers, memory_order_relaxed))
            did |= fire_watched(eng, now);
        if (eng->postq_head)
            did |= progress_posts(eng, now);
        did |= retry_rx(eng);
        bool slow = false, arrival = false;
        const bool idle = now - idle_since > spin_ns;
        turn++;
        for (uint32_t k = 0; k < eng->nnics; k++) {
            if (!nic_due(eng, k, turn, idle))
                continue;
            enum nic_found f = poll_nic(eng, k, now);
            if (f == FOUND_WORK || f == FOUND_ARRIVAL) /* a slow call alone is no work there */
                eng->nics[k].found_turn = turn;
            did |= f == FOUND_WORK || f == FOUND_ARRIVAL;
            slow |= f == FOUND_SLOW_CALL;
            arrival |= f == FOUND_ARRIVAL;
        }
        /* A slow progress call means data is moving, except the first after a nap: caches
         * gone cold make an idle call slow too, and believing it cost an idle shm engine a
         * spin_us spin per wake-up (0.46-0.59% of a core against 0.28-0.34 on the GPU
         * machine, docs/guide/progress.md). That one is believed if the next look is slow as well. */
        bool look_again = slow && napped && !did;
        did |= slow && !napped;
        napped = false;
        now = afs_now_ns();
        if (eng->settling.head) {
            settle_deregs(eng, now);
            did = true; /* keep polling: that is what lands (or refuses) the last bytes */
        }
        if (eng->ka)
            afs_ka_tick(eng, now, ka_found); /* keepalive.c: heartbeats, goodbyes' grace */
        if (now - eng->last_deadline_check > DEADLINE_CHECK_NS) {
            eng->last_deadline_check = now;
            if (eng->cfg.op_timeout_ns)
                check_deadlines(eng, now);
        }
        bool held = afs_ring_flush(&eng->ring, eng->active.len, now);
        if (did) {
            idle_since = now;
            sleep_ns = SLEEP_MIN_NS;
            fruitless = 0;
            if (arrival) /* ARRIVAL_SPINS: most arrivals go unseen, stay awake through them */
                awake_until = now + ARRIVAL_SPINS * spin_ns;
        } else if (!look_again && !held && eng->cfg.poll_mode == AFS_POLL_ADAPTIVE &&
                   now - idle_since > spin_ns && now >= awake_until &&
                   (!eng->postq_head || eng->posts_stalled) &&
                   !atomic_load(&eng->armed_on_watchers)) {
            /* (stays awake while operations are armed on watchers: they fire from here).
             * Not napping while our own operations are with the provider made 1 MiB shm
             * writes 1.5x faster on the 16-core host (libfabric 1.17's shm and tcp;ofi_rxm
             * move data only while a side polls), but a worker that spins inside shm's
             * progress holds its shared-region locks most of the time: a peer SIGKILLed
             * there wedged the survivor's worker (tests/test_faults.py, shm-send, 1 of 2
             * clean-clone CI runs). Kept out until the same-host path needs no such lock. */
            /* on timers while posts wait on refusing destinations: retried each nap (<= 1 ms) */
            if (worker_sleep(eng, &sleep_ns,
                             eng->posts_stalled || (fruitless >= FRUITLESS_WAKES && fds_exhausted(eng))))
                fruitless++;
            napped = true;
            now = afs_now_ns(); /* requests taken next are stamped with the time they came */
        } else if (yields) {
            /* Nothing to do this turn: on a machine of few CPUs the loop's thread and the
             * peer's worker need the core more than this look does. */
            sched_yield();
        }
    }
    /* Goodbyes to the peers that resolved this engine (keepalive.c), waited for a little:
     * best effort, closing is not held up for long. */
    for (uint64_t until = afs_now_ns() + BYE_WAIT_NS; afs_ka_goodbye(eng) && afs_now_ns() < until;)
        for (uint32_t k = 0; k < eng->nnics; k++)
            (void)poll_nic(eng, k, afs_now_ns());
    afs_ka_free(eng);
    fail_queued(eng);
    if (atomic_exchange(&eng->handoff, AFS_HANDOFF_WORKER_DONE) == AFS_HANDOFF_CLOSER_LEFT)
        eng->teardown(eng); /* closing gave up on this thread: the engine is its to free */
    return NULL;
}

/* A write of afs_write_dynlen (dynlen.c), when it starts: its length is
 * clamp(base + scale * word, 0, maximum), computed without overflow. */
void afs_dynlen_resolve(afs_xfer *x)
{
    const uint64_t max = x->rma.length;
    const uint64_t n = __atomic_load_n(x->rma.dyn_word, __ATOMIC_ACQUIRE);
    uint64_t len;
    if (x->rma.dyn_scale && n > UINT64_MAX / x->rma.dyn_scale) {
        len = max;
    } else {
        const uint64_t prod = n * x->rma.dyn_scale;
        if (x->rma.dyn_base < 0) {
            const uint64_t neg = (uint64_t)(-(x->rma.dyn_base + 1)) + 1;
            len = prod > neg ? prod - neg : 0;
        } else {
            const uint64_t pos = (uint64_t)x->rma.dyn_base;
            len = prod > UINT64_MAX - pos ? UINT64_MAX : prod + pos;
        }
    }
    x->rma.length = len < max ? len : max;
    x->rma.dyn_len = false; /* resolved once */
}

/* One receive buffer (slot `slot` of NIC `nic`) handed to the provider; its context says
 * which, and RX_TAG marks it as a receive when it completes. */
static uint64_t rx_ctx(uint32_t nic, uint32_t slot)
{
    return ((uint64_t)slot << 16) | ((uint64_t)nic << 8) | RX_TAG;
}

int afs_post_rx(afs_engine *eng, uint32_t nic, uint32_t slot)
{
    afs_nic *n = &eng->nics[nic];
    uint64_t sz = eng->cfg.max_msg_size;
    return n->ops->post_recv(n->dom, n->rx_buf + (uint64_t)slot * sz, sz, n->rx_desc,
                             rx_ctx(nic, slot));
}
