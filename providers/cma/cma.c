/*
 * afabric provider "cma": host-memory writes and reads between processes (and engines) of
 * one node, by cross-memory attach: the WRITER copies into the target's memory itself with
 * process_vm_writev(2) (reads: process_vm_readv), as UCX's cma transport does. The target's
 * worker is not on the data's path: it only counts immediates, which arrive through its
 * shared-memory mailbox after the copy returned (so it counts them after the data is in
 * its memory: the transport contract), and is woken by a datagram only when it sleeps.
 *
 *  - Registering a region with remote access exports it: owner pid, address range,
 *    generation and access (write, read) go into an entry of this domain's export table
 *    (shared memory, ../common/node_seg.h); the key names the entry and its generation, so
 *    deregistration revokes at once. A writer checks every access against that entry (the
 *    target's own memory), never against the descriptor, which a peer could forge.
 *  - Nothing lands after deregister returns: a writer holds one of the target's writer slots
 *    (a word in the target's segment naming the writer's process, with a count of holds)
 *    from before it checks the entry's generation until its copy returned; deregister
 *    revokes the entry and then waits until every slot held at that moment has been let go.
 *    A slot whose process has exited (killed mid-copy: its copy stopped with it), or that
 *    names no process (stray bytes), is taken over: the wait is bounded by the writer's copy
 *    or its life. The slots are plain atomics, not pthread mutexes: bytes a peer scribbles
 *    there cost a wait, never a crash (glibc follows a robust mutex's list pointers and
 *    asserts on its kind). Writer and target share a PID namespace (cma_resolve).
 *  - Operations of 16 KiB up to the split threshold (AFABRIC_CMA_ASYNC_AT, cma_pool.h) run
 *    whole and in parallel on the domain's copy threads: post queues them and returns at
 *    once; the copy thread takes the writer slot, checks the entry, copies and releases the
 *    slot; the worker reports the operation (its error, or its immediate and then its
 *    completion) when it reaps it in poll, so the immediate still goes after the whole copy
 *    returned. Smaller copies run in post on the worker; completions are reported by the
 *    next poll. Paged writes are iovec batches of IOV_MAX pages. Large copies (256 KiB and
 *    more by default) are split over the copy threads; post returns only after every part
 *    returned, so the slot below is held, and the immediate waits, until all of them are
 *    done, and a failing part fails the operation once (the first failing part's error).
 *    Forget, deregister and close first wait for every queued operation (bounded by the
 *    copies: a dead target fails them at once with ESRCH).
 *  - SEND appends the message to the target's mailbox; posted receives take them in order.
 *  - Peer death: the owner of a segment holds an exclusive flock on it for its whole life;
 *    a dead peer's operations fail at once (EPEER), live peers are unaffected.
 *
 * Permissions: process_vm_writev needs ptrace access to the target (PTRACE_MODE_ATTACH:
 * same uid, target dumpable; Yama ptrace_scope 1 allows it only for a target that named us
 * its tracer, so open calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY); scope 2 needs
 * CAP_SYS_PTRACE, 3 forbids it; container seccomp profiles may refuse the syscall). open and
 * list_nics probe these and fail with AFP_ENODEV saying which; a copy refused at run time
 * (EPERM) fails its operation with a text that says why.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../common/node_core.h"
#include "afabric_provider.h"
#include "cma_pool.h"

#define CMA_ADDR_MAGIC 0x31414d43u /* "CMA1" */
#define CMA_SLOTS 64u              /* writer slots in each domain's segment */
#define CMA_MAX_WRITE (1ull << 40)
#define CMA_SLOT_PROBE_NS 1000000ull    /* slots held unchanged this long: holders alive? */
#define CMA_SLOT_STALL_NS 2000000000ull /* all 64 held unchanged by live writers: give up */

typedef struct cma_slot {
    /* holds << 32 | holder: holder 0 = free, else the writer's pid; holds counts the
     * takings, so a change of the word means a release */
    _Atomic uint64_t word;
    uint8_t pad[56];
} cma_slot;

static const mb_kind CMA_KIND = {
    .tag = ":afabric-cma-",
    .wake = "afabric-cma-",
    .name = "cma",
    .magic = 0x31414d4331414641ull, /* "AFA1CMA1" */
    .extra_bytes = CMA_SLOTS * sizeof(cma_slot),
};

struct afp_mr {
    uint32_t export_idx;
    bool exported;
};

struct afp_domain {
    afn_core c;
    uint64_t token;
    pid_t pid;
    cma_pool pool; /* copy threads: large copies, whole operations in parallel */
    bool pool_ok;  /* cma_pool_init succeeded */
    struct sockaddr_un self_wake; /* our own wakeup name: copy threads wake a sleeping worker */
    socklen_t self_wake_len;
};

#define DERR(d, code, ...) AFN_ERR(&(d)->c, code, __VA_ARGS__)

static cma_slot *slots(const mb_seg *s) { return (cma_slot *)(void *)mb_extra(s); }

/* ------------------------------------------------------------------------------------ */
/* Permissions                                                                           */

static int read_int_file(const char *path, int *v)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int ok = fscanf(f, "%d", v) == 1 ? 0 : -1;
    fclose(f);
    return ok;
}

static bool has_cap_sys_ptrace(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return false;
    char line[256];
    unsigned long long caps = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "CapEff: %llx", &caps) == 1)
            break;
    fclose(f);
    return (caps >> 19) & 1u; /* CAP_SYS_PTRACE */
}

/* Can peers of our uid copy into this process, and can we copy into theirs? 0, or
 * AFP_ENODEV with the reason in err. `arm`: make it so where we can (Yama scope 1). */
static int probe_access(bool arm, char *err, size_t errlen)
{
    int scope = 0;
    if (read_int_file("/proc/sys/kernel/yama/ptrace_scope", &scope) == 0) {
        if (scope >= 3) {
            afp_errf(err, errlen, "Yama ptrace_scope is 3: cross-memory attach "
                                  "(process_vm_writev) is disabled on this machine [cma]");
            return AFP_ENODEV;
        }
        if (scope == 2 && !has_cap_sys_ptrace()) {
            afp_errf(err, errlen, "Yama ptrace_scope is 2: process_vm_writev needs "
                                  "CAP_SYS_PTRACE, which this process lacks [cma]");
            return AFP_ENODEV;
        }
        /* scope 1: only a tracer the target names may attach; every cma domain is a
         * target, so it names any process (of the same uid: the usual rules still hold) */
        if (scope == 1 && arm && prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) {
            afp_errf(err, errlen, "Yama ptrace_scope is 1 and prctl(PR_SET_PTRACER) failed: "
                                  "%s [cma]", strerror(errno));
            return AFP_ENODEV;
        }
    }
    int dumpable = prctl(PR_GET_DUMPABLE, 0, 0, 0, 0);
    if (dumpable != 1) {
        afp_errf(err, errlen, "this process is not dumpable (prctl PR_GET_DUMPABLE = %d: "
                              "setuid, or PR_SET_DUMPABLE 0): peers cannot copy into it [cma]",
                 dumpable);
        return AFP_ENODEV;
    }
    char probe = 0, out = 1;
    struct iovec l = {&out, 1}, r = {&probe, 1};
    if (process_vm_readv(getpid(), &l, 1, &r, 1, 0) != 1) {
        afp_errf(err, errlen, "process_vm_readv is refused here (%s): a seccomp profile "
                              "(containers: allow it, or CAP_SYS_PTRACE) or a kernel without "
                              "CONFIG_CROSS_MEMORY_ATTACH [cma]", strerror(errno));
        return AFP_ENODEV;
    }
    return 0;
}

static int cma_list_nics(const afp_open_args *args, afp_nic_info *out, uint32_t max,
                         uint32_t *n, char *err, size_t errlen)
{
    *n = 0;
    int rc = probe_access(false, err, errlen);
    if (rc)
        return rc;
    if (args && args->nic && *args->nic && strcmp(args->nic, "cma") != 0) {
        afp_errf(err, errlen, "the cma provider has one NIC, \"cma\" (got \"%s\")", args->nic);
        return AFP_ENODEV;
    }
    if (max) {
        memset(out, 0, sizeof *out);
        snprintf(out->name, sizeof out->name, "cma");
        snprintf(out->fabric, sizeof out->fabric, "node");
        snprintf(out->provider, sizeof out->provider, "cma;process_vm_writev");
        out->numa_node = -1;
    }
    *n = 1;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Writer slots                                                                          */

static uint64_t slot_taken(uint64_t w, uint32_t me) { return ((w >> 32) + 1) << 32 | me; }

static void nap_ns(long ns)
{
    struct timespec ts = {0, ns};
    (void)nanosleep(&ts, NULL);
}

/* A held slot whose process has exited: take it over (its copy stopped with it). */
static cma_slot *take_over(cma_slot *t, uint32_t me, uint64_t *held)
{
    for (uint32_t i = 0; i < CMA_SLOTS; i++) {
        uint64_t w = atomic_load_explicit(&t[i].word, memory_order_seq_cst);
        if ((uint32_t)w && mb_pid_gone((int32_t)(uint32_t)w) &&
            atomic_compare_exchange_strong(&t[i].word, &w, slot_taken(w, me))) {
            *held = slot_taken(w, me);
            return &t[i];
        }
    }
    return NULL;
}

/* Take one of the target's slots (any free one) as process `me`; *held gets the word we
 * wrote. Any thread (the copy threads take slots for the operations they run). With all 64
 * taken it tries again (a yield, then 50 us naps) rather than wait for one: that slot's
 * holder may be this process's own worker waiting for a split copy's parts, which the
 * waiting thread would run (a deadlock), while other writers' slots come free within a
 * copy. Holds unchanged for CMA_SLOT_PROBE_NS are checked (take_over); NULL once all 64 have
 * stayed the same, held by live domains, for CMA_SLOT_STALL_NS. */
static cma_slot *enter(uint32_t me, cma_slot *t, uint64_t *held)
{
    uint32_t first = me % CMA_SLOTS;
    uint64_t seen = 0, since = 0, probed = 0;
    for (uint32_t round = 0;; round++) {
        uint64_t print = 0xcbf29ce484222325ull; /* of every word: a release changes it */
        for (uint32_t i = 0; i < CMA_SLOTS; i++) {
            cma_slot *c = &t[(first + i) % CMA_SLOTS];
            uint64_t w = atomic_load_explicit(&c->word, memory_order_relaxed);
            if ((uint32_t)w == 0 &&
                atomic_compare_exchange_strong(&c->word, &w, slot_taken(w, me))) {
                *held = slot_taken(w, me);
                return c;
            }
            print = (print ^ w) * 0x100000001b3ull;
        }
        uint64_t now = afn_now_ns();
        if (print != seen || !since) {
            seen = print;
            since = now;
        } else if (now - since >= CMA_SLOT_PROBE_NS && now - probed >= CMA_SLOT_PROBE_NS) {
            probed = now;
            cma_slot *c = take_over(t, me, held);
            if (c)
                return c;
            if (now - since >= CMA_SLOT_STALL_NS)
                return NULL;
        }
        if (round < 64)
            sched_yield();
        else
            nap_ns(50000);
    }
}

static void leave(cma_slot *s, uint64_t held)
{
    /* not ours any more only if it was taken over: leave it then */
    (void)atomic_compare_exchange_strong(&s->word, &held, held & ~0xffffffffull);
}

static int slots_wedged(afp_domain *d, afn_peer *p)
{
    return DERR(d, AFP_EPEER, "peer (process %d): all %u writer slots of its segment have been "
                              "held by live writers, unchanged, for %.0f s (they are stopped, "
                              "or the segment is corrupt) [cma]",
                (int)p->pid, CMA_SLOTS, CMA_SLOT_STALL_NS / 1e9);
}

/* Enter one of the peer's slots, then check that the entry is still live (in that order:
 * deregister revokes, then waits for held slots). 0 with *out entered, or AFP_EKEY, or
 * AFP_EPEER (slots wedged). */
static int enter_live(afp_domain *d, afn_peer *p, const afn_import *im, uint64_t key,
                      cma_slot **out, uint64_t *held)
{
    cma_slot *s = enter((uint32_t)d->pid, slots(&p->seg), held);
    if (!s)
        return slots_wedged(d, p);
    if (atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)im->gen_addr, memory_order_seq_cst) !=
        key >> 32) {
        leave(s, *held);
        return DERR(d, AFP_EKEY, "remote key %016llx was deregistered at the target [cma]",
                    (unsigned long long)key);
    }
    *out = s;
    return 0;
}

/* Owner: after revoking an entry, wait until no writer can still be copying under the old
 * generation (one that entered before the revocation): every slot held now is let go, or
 * its holder found gone (its slot is freed then). */
static void drain_writers(afp_domain *d)
{
    cma_slot *t = slots(&d->c.seg);
    atomic_thread_fence(memory_order_seq_cst);
    for (uint32_t i = 0; i < CMA_SLOTS; i++) {
        uint64_t w = atomic_load_explicit(&t[i].word, memory_order_seq_cst);
        if (!(uint32_t)w)
            continue;
        uint64_t since = afn_now_ns(), probed = 0;
        for (uint32_t turns = 0; atomic_load_explicit(&t[i].word, memory_order_seq_cst) == w;
             turns++) {
            uint64_t now = afn_now_ns();
            if (now - since >= CMA_SLOT_PROBE_NS && now - probed >= CMA_SLOT_PROBE_NS) {
                probed = now;
                if (mb_pid_gone((int32_t)(uint32_t)w)) {
                    (void)atomic_compare_exchange_strong(&t[i].word, &w, w & ~0xffffffffull);
                    break;
                }
            }
            if (turns < 1000)
                afp_cpu_relax();
            else
                nap_ns(20000);
        }
    }
}

/* ------------------------------------------------------------------------------------ */
/* Copies                                                                                */

/* Describes a failed copy (errno `e`) for the operation's error. */
static int copy_failed(afp_domain *d, afn_peer *p, const char *what, int e)
{
    char gone[AFP_ERRTEXT_LEN];
    if (!afn_peer_alive(p, true))
        return DERR(d, AFP_EPEER, "%s: %s [cma]", what, afn_gone_text(p, gone, sizeof gone));
    if (e == ESRCH)
        return DERR(d, AFP_EPEER, "%s: target process %d is gone [cma]", what, (int)p->pid);
    if (e == EPERM)
        return DERR(d, AFP_EIO, "%s: permission denied (EPERM) copying into process %d: it "
                                "must have our uid and be dumpable, and Yama/seccomp must allow "
                                "process_vm_writev [cma]", what, (int)p->pid);
    if (e == EFAULT)
        return DERR(d, AFP_EIO, "%s: an address is not mapped (EFAULT): the target's region "
                                "(or ours) was unmapped while registered [cma]", what);
    return DERR(d, AFP_EIO, "%s: %s [cma]", what, strerror(e));
}

#define CMA_QUEUED 1 /* handed to a copy thread: reported when reaped */

/* The copy threads' part of a queued operation: slot, generation check, copy, slot. */
static int run_job(cma_job *j, struct iovec *liov, struct iovec *riov)
{
    uint64_t held = 0;
    cma_slot *s = enter(j->writer, j->target, &held);
    if (!s)
        return CMA_JOB_WEDGED;
    int e = CMA_JOB_REVOKED;
    if (atomic_load_explicit(j->gen, memory_order_seq_cst) == j->want_gen) {
        cma_test_delay(j->delay_us); /* the testing hook holds the slot: deregister waits */
        e = cma_copy_part(&j->part, liov, riov);
    }
    leave(s, held);
    return e;
}

/* A copy thread finished a job: wake the worker if it sleeps (it said so before sleeping,
 * then looked for finished jobs: cma_trywait). */
static void notify_worker(void *arg)
{
    afp_domain *d = arg;
    if (!atomic_load_explicit(&d->c.seg.hdr->sleeping, memory_order_seq_cst) ||
        d->c.send_fd < 0)
        return;
    char one = 1;
    (void)sendto(d->c.send_fd, &one, 1, MSG_DONTWAIT, (struct sockaddr *)&d->self_wake,
                 d->self_wake_len);
}

/* Reports the operations the copy threads finished: each once, its error or its immediate
 * (the whole copy returned) and completion. */
static void reap_jobs(afp_domain *d)
{
    cma_job *j = cma_pool_reap(&d->pool);
    while (j) {
        cma_job *next = j->next;
        d->pool.inflight--;
        int rc = 0;
        if (j->err == CMA_JOB_REVOKED)
            rc = DERR(d, AFP_EKEY, "remote key was deregistered at the target [cma]");
        else if (j->err == CMA_JOB_WEDGED)
            rc = slots_wedged(d, afn_peer_of(&d->c, j->peer));
        else if (j->err)
            rc = copy_failed(d, afn_peer_of(&d->c, j->peer),
                             !j->part.write ? "process_vm_readv" : "process_vm_writev", j->err);
        afn_op op = {j->ctx, j->peer, j->arrivals, j->imm, rc, rc ? strdup(d->c.errbuf) : NULL};
        afn_finish_op(&d->c, &op);
        free(j);
        j = next;
    }
}

/* Waits until no queued operation is left (reporting them): bounded by their copies. */
static void quiesce(afp_domain *d)
{
    uint32_t turns = 0;
    for (reap_jobs(d); d->pool.inflight; reap_jobs(d)) {
        if (++turns < 1000)
            afp_cpu_relax();
        else {
            struct timespec ts = {0, 20000};
            (void)nanosleep(&ts, NULL);
        }
    }
}

/* One contiguous write or read, checked and copied under a writer slot (or queued). */
static int one_copy(afp_domain *d, const afp_write *w, bool write)
{
    uint32_t need = write ? AFP_MR_REMOTE : AFP_MR_REMOTE_READ;
    afn_import *im = NULL;
    int rc = afn_translate(&d->c, w->peer, w->remote_key, w->remote_addr, w->length, need, NULL,
                           NULL, &im);
    if (rc || w->length == 0)
        return rc;
    afn_peer *p = afn_peer_of(&d->c, w->peer);
    cma_part op = {.pid = p->pid, .write = write, .local = w->local_addr,
                   .remote = w->remote_addr, .len = w->length};
    if (cma_pool_async(&d->pool, w->length)) {
        cma_job *j = calloc(1, sizeof *j);
        if (j) {
            *j = (cma_job){.part = op, .target = slots(&p->seg),
                           .gen = (const _Atomic uint64_t *)(uintptr_t)im->gen_addr,
                           .want_gen = w->remote_key >> 32, .writer = (uint32_t)d->pid, .ctx = w->ctx,
                           .peer = w->peer, .arrivals = write && w->has_imm ? 1u : 0u,
                           .imm = w->imm};
            if (cma_pool_submit(&d->pool, j) == 0)
                return CMA_QUEUED;
            free(j); /* no copy thread: copy it here */
        }
    }
    cma_slot *s = NULL;
    uint64_t held = 0;
    if ((rc = enter_live(d, p, im, w->remote_key, &s, &held)))
        return rc;
    int e = cma_pool_copy(&d->pool, &op, w->length); /* every part returned */
    leave(s, held);
    return e ? copy_failed(d, p, write ? "process_vm_writev" : "process_vm_readv", e) : 0;
}

static int post_copies(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted,
                       bool write)
{
    *posted = 0;
    for (uint32_t i = 0; i < n; i++) {
        const afp_write *w = &wr[i];
        int rc = one_copy(d, w, write);
        (*posted)++;
        if (rc == CMA_QUEUED)
            continue;
        afn_op op = {w->ctx, w->peer, write && w->has_imm ? 1u : 0u, w->imm, rc,
                     rc ? strdup(d->c.errbuf) : NULL};
        afn_finish_op(&d->c, &op);
    }
    return 0;
}

static int cma_post_writes(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted)
{
    return post_copies(d, wr, n, posted, true);
}

static int cma_post_reads(afp_domain *d, const afp_write *rd, uint32_t n, uint32_t *posted)
{
    return post_copies(d, rd, n, posted, false);
}

static int paged_copy(afp_domain *d, const afp_paged *p)
{
    if (p->count == 0)
        return DERR(d, AFP_EINVAL, "paged write of no pages [cma]");
    /* the shim checked the pages against the descriptor; the owner's entry is what counts */
    int64_t lo = 0, hi = 0;
    for (uint64_t k = 0; k < p->count; k++) {
        lo = p->dst_idx[k] < lo ? p->dst_idx[k] : lo;
        hi = p->dst_idx[k] > hi ? p->dst_idx[k] : hi;
    }
    uint64_t span = 0, total = 0;
    if (__builtin_mul_overflow(p->count, p->page_len, &total))
        return DERR(d, AFP_EINVAL, "paged write of more than 2^64 bytes [cma]");
    if (lo < 0 || __builtin_mul_overflow((uint64_t)hi, p->dst_stride, &span) ||
        __builtin_add_overflow(span, p->page_len, &span))
        return DERR(d, AFP_EKEY, "paged write outside the remote region [cma]");
    afn_import *im = NULL;
    int rc = afn_translate(&d->c, p->peer, p->remote_key, p->remote_base + p->dst_offset, span,
                           AFP_MR_REMOTE, NULL, NULL, &im);
    if (rc || p->page_len == 0)
        return rc;
    afn_peer *peer = afn_peer_of(&d->c, p->peer);
    cma_part op = {.pid = peer->pid, .write = true, .pg = p,
                   .local = (uint8_t *)p->local_base + p->src_offset,
                   .remote = p->remote_base + p->dst_offset, .len = total};
    if (cma_pool_async(&d->pool, total)) {
        cma_job *j = calloc(1, sizeof *j);
        if (j) {
            *j = (cma_job){.part = op, .pg = *p, .target = slots(&peer->seg),
                           .gen = (const _Atomic uint64_t *)(uintptr_t)im->gen_addr,
                           .want_gen = p->remote_key >> 32, .writer = (uint32_t)d->pid, .ctx = p->ctx,
                           .peer = p->peer, .arrivals = p->has_imm ? p->count : 0,
                           .imm = p->imm};
            j->part.pg = &j->pg; /* the index arrays stay valid until completion */
            if (cma_pool_submit(&d->pool, j) == 0)
                return CMA_QUEUED;
            free(j);
        }
    }
    cma_slot *s = NULL;
    uint64_t held = 0;
    if ((rc = enter_live(d, peer, im, p->remote_key, &s, &held)))
        return rc;
    int e = cma_pool_copy(&d->pool, &op, total); /* every part returned */
    leave(s, held);
    return e ? copy_failed(d, peer, "process_vm_writev", e) : 0;
}

static int cma_post_paged(afp_domain *d, const afp_paged *p)
{
    int rc = paged_copy(d, p);
    if (rc == AFP_EINVAL || rc == CMA_QUEUED)
        return rc == CMA_QUEUED ? 0 : rc;
    afn_op op = {p->ctx, p->peer, p->has_imm ? p->count : 0, p->imm, rc,
                 rc ? strdup(d->c.errbuf) : NULL};
    afn_finish_op(&d->c, &op);
    return 0;
}

static int cma_post_send(afp_domain *d, uint64_t peer, const void *buf, uint64_t len, void *desc,
                         uint64_t ctx)
{
    (void)desc;
    return afn_post_send(&d->c, peer, buf, len, ctx);
}

static int cma_post_recv(afp_domain *d, void *buf, uint64_t len, void *desc, uint64_t ctx)
{
    (void)desc;
    return afn_post_recv(&d->c, buf, len, ctx);
}

static int cma_poll(afp_domain *d, afp_event *ev, uint32_t max, uint32_t *n)
{
    reap_jobs(d);
    *n = afn_poll_events(&d->c, ev, max);
    return 0;
}

static int cma_trywait(afp_domain *d)
{
    if (cma_pool_done_pending(&d->pool))
        return AFP_EAGAIN;
    int rc = afn_trywait(&d->c, false);
    /* sleeping is set (seq_cst): a copy thread that finishes from now on wakes us, and one
     * that finished before is seen here */
    if (rc == 0 && cma_pool_done_pending(&d->pool)) {
        atomic_store(&d->c.seg.hdr->sleeping, 0);
        return AFP_EAGAIN;
    }
    return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Memory                                                                                */

static int cma_reg_mr(afp_domain *d, void *addr, uint64_t len, uint32_t flags, int32_t device,
                      uint64_t requested_key, struct afp_mr **out, void **local_desc,
                      uint64_t *rkey, uint64_t *remote_base)
{
    (void)requested_key; /* keys name export entries: the provider picks them */
    (void)device;
    if (flags & AFP_MR_DEVICE)
        return DERR(d, AFP_EUNSUPPORTED, "cma moves host memory only (CUDA memory: use the "
                                         "nvlink provider) [cma]");
    struct afp_mr *m = calloc(1, sizeof *m);
    if (!m)
        return DERR(d, AFP_ENOMEM, "out of memory [cma]");
    *rkey = 0;
    if (flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ)) {
        uint32_t idx = afn_export_take(&d->c);
        if (idx == UINT32_MAX) {
            free(m);
            return DERR(d, AFP_ENOMEM, "more than %u regions registered [cma]", MB_EXPORTS);
        }
        mb_export *e = &mb_exports(&d->c.seg)[idx];
        memset((uint8_t *)e + sizeof e->gen, 0, sizeof *e - sizeof e->gen);
        e->base = (uint64_t)(uintptr_t)addr;
        e->len = len;
        e->pid = (int32_t)d->pid;
        e->device = -1;
        e->access = flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ);
        *rkey = afn_export_publish(&d->c, idx);
        m->export_idx = idx;
        m->exported = true;
    }
    *out = m;
    *local_desc = m;
    *remote_base = (uint64_t)(uintptr_t)addr;
    return 0;
}

static int cma_dereg_mr(afp_domain *d, struct afp_mr *m)
{
    if (!m)
        return 0;
    quiesce(d); /* no queued copy still reads or writes a local region */
    if (m->exported) {
        afn_export_revoke(&d->c, m->export_idx);
        drain_writers(d); /* a writer that checked the entry before has finished its copy */
    }
    free(m);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Domain                                                                                */

static void cma_close(afp_domain *d)
{
    if (!d)
        return;
    if (d->pool_ok) {
        quiesce(d); /* no copy in flight when the domain goes */
        cma_pool_fini(&d->pool); /* idle: a split copy returns only after all its parts */
    }
    afn_close(&d->c);
    free(d);
}

static int cma_open(const afp_open_args *args, afp_domain **out, char *err, size_t errlen)
{
    *out = NULL;
    uint32_t n = 0;
    afp_nic_info info;
    int rc = cma_list_nics(args, &info, 1, &n, err, errlen);
    if (rc)
        return rc;
    if ((rc = probe_access(true, err, errlen)))
        return rc;
    afp_domain *d = calloc(1, sizeof *d);
    if (!d) {
        afp_errf(err, errlen, "out of memory");
        return AFP_ENOMEM;
    }
    d->pid = getpid();
    if (cma_pool_init(&d->pool, run_job, notify_worker, d) != 0) {
        free(d);
        afp_errf(err, errlen, "cannot make the copy threads' mutex [cma]");
        return AFP_EIO;
    }
    d->pool_ok = true;
    uint64_t seed = 0;
    FILE *f = fopen("/dev/urandom", "r");
    if (!f || fread(&seed, sizeof seed, 1, f) != 1)
        seed = (uint64_t)(uintptr_t)d * 0x9e3779b97f4a7c15ull;
    if (f)
        fclose(f);
    d->token = seed ^ afn_now_ns() ^ ((uint64_t)d->pid << 32);
    mb_wake_name(&CMA_KIND, d->token, &d->self_wake, &d->self_wake_len);
    if ((rc = afn_open(&d->c, &CMA_KIND, CMA_ADDR_MAGIC, d->token, err, errlen)) != 0) {
        cma_close(d);
        return rc;
    }
    *out = d;
    return 0;
}

static const char *cma_errbuf(afp_domain *d) { return d->c.errbuf; }

static int cma_caps(afp_domain *d, afp_caps *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->provider, sizeof out->provider, "cma;process_vm_writev");
    out->flags = AFP_CAP_VIRT_ADDR | AFP_CAP_PROV_KEY | AFP_CAP_DELIVERY_COMPLETE;
    out->imm_size = 4;
    out->max_msg_size = CMA_MAX_WRITE;
    out->inject_size = 0;
    out->addr_len = sizeof(afn_addr);
    out->wait_fd = d->c.wake_fd;
    return 0;
}

static int cma_address(afp_domain *d, void *buf, size_t *len)
{
    return afn_address(&d->c, buf, len);
}

static int cma_resolve(afp_domain *d, const void *addr, size_t len, uint64_t *peer)
{
    int rc = afn_resolve(&d->c, addr, len, peer);
    if (rc)
        return rc;
    afn_peer *p = afn_peer_of(&d->c, *peer);
    uint64_t ns = mb_pidns(), theirs = p->seg.hdr->pidns;
    if (p->pid <= 0 || (theirs && ns && theirs != ns)) {
        int32_t pid = p->pid;
        (void)afn_forget(&d->c, *peer);
        return DERR(d, AFP_EPEER, "peer process %d is in another PID namespace: cma copies "
                                  "need both in one [cma]", (int)pid);
    }
    /* Whether the kernel lets us into it (its uid, its dumpable flag, Yama, seccomp): one
     * byte read from where it maps its own segment, so that a refusal is known here, at
     * resolve (a routed engine then takes another transport), not at the first write. */
    char byte = 0;
    struct iovec l = {&byte, 1}, r = {(void *)(uintptr_t)p->seg.hdr->owner_va, 1};
    if (process_vm_readv(p->pid, &l, 1, &r, 1, 0) != 1) {
        int e = errno;
        int32_t pid = p->pid;
        (void)afn_forget(&d->c, *peer);
        if (e == EPERM)
            return DERR(d, AFP_EPEER, "cross-memory attach into process %d is not allowed "
                                      "(EPERM): it must have our uid and be dumpable, and "
                                      "Yama ptrace_scope and seccomp must allow it [cma]",
                        (int)pid);
        return DERR(d, AFP_EPEER, "cross-memory attach into process %d failed: %s [cma]",
                    (int)pid, strerror(e));
    }
    return 0;
}

static int cma_forget(afp_domain *d, uint64_t peer)
{
    quiesce(d); /* queued copies use the peer's mapping */
    return afn_forget(&d->c, peer);
}

static const struct afp_ops cma_ops = {
    .size = sizeof(struct afp_ops),
    .major = AFP_ABI_MAJOR,
    .minor = AFP_ABI_MINOR,
    .name = "cma",
    .list_nics = cma_list_nics,
    .open = cma_open,
    .close = cma_close,
    .errbuf = cma_errbuf,
    .caps = cma_caps,
    .address = cma_address,
    .reg_mr = cma_reg_mr,
    .dereg_mr = cma_dereg_mr,
    .resolve = cma_resolve,
    .forget = cma_forget,
    .post_writes = cma_post_writes,
    .post_send = cma_post_send,
    .post_recv = cma_post_recv,
    .poll = cma_poll,
    .trywait = cma_trywait,
    .post_paged = cma_post_paged,
    .post_reads = cma_post_reads,
};

__attribute__((visibility("default"))) const struct afp_ops *afp_get_ops(void)
{
    return &cma_ops;
}
