/*
 * afabric provider over libfabric (RDM endpoints): efa, tcp, shm, sockets, udp, ...
 *
 * One code path for every libfabric provider: what differs between them (mode bits,
 * mr_mode bits, wait objects, delivery-complete support) is read from the fi_info that
 * fi_getinfo returns, never from the provider's name. The one exception is the default
 * bind address of tcp (see open_node()).
 *
 * A domain here is one libfabric fabric + domain + address vector + completion queue +
 * RDM endpoint. All state lives in the domain object; the only process-wide state is the
 * dlopen'ed libfabric function table (ofi_lib.c) and the list of this process's own
 * domains (see "Domains of this process" below: why closing one must not crash another).
 *
 * The test switch AFP_OPEN_FORCE_EFA_MODES makes a software provider behave like EFA
 * where it matters to the code above us, so that those paths run on any machine:
 *  - FI_RX_CQ_DATA: every remote immediate consumes one posted receive and its event
 *    carries that receive's ctx. Emulated by cancelling (fi_cancel) the oldest posted
 *    receive for each arriving immediate and reporting the immediate once the cancel has
 *    completed, i.e. once libfabric no longer owns the buffer (see emu_assign()).
 *  - FI_MR_LOCAL: local descriptors are always returned (and so always passed back).
 *  - FI_MR_PROV_KEY: keys are chosen here (a per-domain counter), not the shim's
 *    requested key, so a caller that ignores the returned rkey fails visibly.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "afabric_provider.h"
#include "ofi_lib.h"
#include "ofi_reap.h"
#include "ofi_shmfence.h"
#include "ofi_wake.h"

/* The API version of the headers we were built with: a newer libfabric then keeps the
 * semantics (and struct layouts) we were written against. */
#define OFI_API_VERSION FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION)
#define OFI_IMM_SIZE 4u      /* EFA's immediate size; every provider we serve has >= 4 */
#define OFI_POLL_BATCH 32u   /* CQ entries read per fi_cq_read call */
/* A progress call that found nothing to report but took longer than this moved data for
 * some operation in flight (1.17 shm copies a large write's segments inside the target's
 * and the initiator's fi_cq_read; an idle call takes well under a microsecond). Only for a
 * CQ without a wait fd: a worker that can sleep on the fd is woken when data comes, and a
 * tcp progress call is slow for other reasons too (accept failing with EMFILE). */
#define OFI_BUSY_POLL_NS 2000u
#define OFI_DEFAULT_DEPTH 256u
#define OFI_TCP_DEFAULT_NODE "127.0.0.1"

/* ------------------------------------------------------------------------------------ */
/* Per-operation context                                                                 */

/*
 * Every posted operation carries one of these as its libfabric context. It starts with
 * a struct fi_context2 because providers asking for FI_CONTEXT / FI_CONTEXT2 use the
 * memory the context points at as their own scratch space, for as long as the operation
 * is in flight. `kind` is the AFP_EV_* kind of the operation's normal completion.
 */
/* 1.17's shm sends delivery-complete writes up to this size through one bounce-buffer
 * chunk, taken by the target within the command (ofi_shmfence.c) */
#define OFI_SHM_ONE_CHUNK 4096u
/* 1.17 shm: how often the worker looks at its oldest pending response, and how long it must
 * have stayed pending before its target's queue is checked for a dropped write */
#define OFI_DROP_CHECK_NS 1000000ull
#define OFI_DROP_AFTER_NS 2000000ull
#define OFI_REGION_RETRY_NS 100000000ull /* a peer region not mapped yet: look again after */

struct ofi_op {
    struct fi_context2 fctx; /* must stay first: &op->fctx == op is what libfabric sees */
    uint64_t user_ctx;
    uint32_t kind;           /* AFP_EV_WRITE_DONE, AFP_EV_SEND_DONE or AFP_EV_RECV */
    uint32_t stolen;         /* emulation: receive being cancelled for an immediate */
    uint32_t stolen_imm;     /* emulation: that immediate */
    uint32_t dropped;        /* 1.17 shm: released as dropped by its target (check_dropped) */
    uint32_t rma;            /* OFI_RMA_WRITE or OFI_RMA_READ (one-sided), else 0 */
    uint64_t key;            /* one-sided: the remote key it named (for the error text) */
    uint64_t peer;           /* the AV index it went to (writes, reads, sends), else ~0 */
    struct ofi_op *next;     /* free list, or posted-receive list (emulation) */
    struct ofi_op *prev;     /* posted-receive list (emulation) */
};

enum { OFI_RMA_WRITE = 1, OFI_RMA_READ = 2 };

struct inproc;

struct shm_peer {
    char *path;          /* "/dev/shm/NAME", NULL when the peer's address names no file */
    uint64_t checked_ns; /* when it was last seen there */
    bool dead;           /* its process exited (peer_exited, taken in by take_dead) */
    uint8_t *base;       /* 1.17: our mapping of its region (peer_region), or NULL */
    size_t len;
    uint64_t looked_ns;  /* when peer_region last looked for it */
    ofi_wake_peer wk;    /* 1.17: its wake-up word and socket (ofi_wake.c) */
    uint32_t pending;    /* our operations in flight to it */
    uint64_t kicked_ns;  /* when we last sent it a wake-up */
};

/* A peer that is a domain of this same process (see inproc_*). */
struct inproc_ref {
    uint64_t fa;
    struct inproc *e;
};

struct afp_domain {
    const struct ofi_lib *lib;
    struct inproc *self;       /* this domain in the process-wide list */
    struct inproc_ref *inproc; /* resolved peers that are domains of this process */
    size_t n_inproc, cap_inproc;
    /* Peers whose address names a file in /dev/shm (FI_ADDR_STR "fi_shm://NAME"), by AV
     * index: checked before posting to them (see shm_file_gone) */
    struct shm_peer *shm_peers;
    size_t n_shm_peers;
    struct fi_info *info_list; /* what fi_getinfo returned; freed at close */
    struct fi_info *info;      /* the entry in use (points into info_list) */
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_cq *rx_cq; /* shm117 with FI_SOURCE: receives' own CQ (open_rx_cq), else NULL */
    bool rx_first;        /* poll_src: which of the two CQs is read first this time */
    struct fid_ep *ep;
    struct fid_cntr *rw_cntr; /* remote writes landed (FI_RMA_EVENT), or NULL */
    uint64_t rw_seen;
    int wait_fd; /* -1: CQ has no wait fd */

    /* What the provider asks for (or, with FORCE_EFA_MODES, what we pretend it does). */
    bool rx_cq_data;     /* provider really consumes receives for immediates */
    bool emu_rx_cq_data; /* we emulate that */
    bool mr_local;       /* hand out (and pass) local descriptors */
    bool prov_key;       /* provider really picks keys */
    bool emu_prov_key;   /* we pick keys (next_key) */
    bool virt_addr;
    bool mr_endpoint;
    bool hmem;
    bool delivery_complete;
    bool zero_len_dc; /* zero-length writes are sent delivery-complete too (ofi_open) */
    bool shm117;      /* libfabric 1.17's shm: a dead peer's region is fenced (ofi_shmfence.c) */
    unsigned prov_ver; /* FI_MAJOR(prov_version): libfabric major * 100 + minor (117, 205) */
    char *self_path;  /* shm117: our own region's /dev/shm file */
    int hold_fd[2];   /* shm117: shared locks on that file and the wake file (ofi_reap.c) */
    /* shm117: dead peers' region files, from the watch thread (peer_exited) to the worker
     * (take_dead), which marks them in shm_peers and releases their response slots. */
    pthread_mutex_t dead_mu;
    char **dead_paths; /* under dead_mu */
    size_t n_dead_paths;
    atomic_uint dead_news; /* bumped after each append */
    unsigned dead_seen;    /* worker: the news taken in */
    uint8_t *self_base;    /* worker: our own region, mapped (self_region) */
    size_t self_len;
    uint64_t head_rcnt, head_since, drop_check_ns; /* check_dropped's view of our queue */
    ofi_wake wake;        /* shm117: sleeping on a socket instead of napping (ofi_wake.c) */
    uint32_t tx_inflight; /* our writes, reads and sends with the provider */
    uint64_t rekick_ns;   /* when the peers with our operations pending were last kicked */
    bool rma_event;
    bool reads; /* opened with FI_READ | FI_REMOTE_READ (else post_reads and readable
                   regions are refused: a provider without RMA read still serves writes) */
    bool source; /* FI_SOURCE: completions of receives say who sent them (poll_from) */
    bool src_msg, src_imm; /* which events' sources are passed on (see trust_sources) */
    uint64_t self_fa;      /* our own address, taking AV index 0 (see trust_sources) */
    uint64_t write_flags; /* fixed fi_writemsg flags (FI_COMPLETION [| FI_DELIVERY_COMPLETE]) */
    uint64_t next_key;
    uint64_t max_msg_size;
    uint64_t inject_size;
    size_t addr_len;

    struct ofi_op *pool;
    uint32_t pool_size;
    struct ofi_op *free_ops;

    /* FI_RX_CQ_DATA emulation: receives still owned by libfabric (oldest first), the
     * immediates waiting for a receive, and how many cancels are in flight. */
    struct ofi_op rx_posted; /* list head (sentinel) */
    uint32_t *imm_q;
    size_t imm_head, imm_len, imm_cap;
    uint32_t stealing;

    char prov_name[AFP_NAME_LEN];
    char errbuf[AFP_ERRTEXT_LEN];
};

/* ------------------------------------------------------------------------------------ */
/* Errors                                                                                */

/* A positive libfabric/POSIX errno -> AFP_E* code. */
static int map_errno(int e)
{
    switch (e) {
    case 0:
        return AFP_OK;
    case FI_EAGAIN:
        return AFP_EAGAIN;
    case FI_EINVAL:
    case FI_EBADFLAGS:
        return AFP_EINVAL;
    case FI_ENOMEM:
    case FI_ENOSPC:
        return AFP_ENOMEM;
    case FI_EMSGSIZE:
    case FI_ETRUNC: /* the message did not fit the posted receive */
        return AFP_ETOOBIG;
    case FI_ENOKEY:
    case FI_EKEYREJECTED:
    case FI_EACCES:
        return AFP_EKEY;
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_EHOSTUNREACH:
    case FI_EHOSTDOWN:
    case FI_ENETUNREACH:
    case FI_ENETDOWN:
    case FI_ENOTCONN:
    case FI_ESHUTDOWN:
    case EPIPE:
        return AFP_EPEER;
    case FI_ECANCELED:
        return AFP_ECANCELED;
    case FI_ETIMEDOUT:
        return AFP_ETIMEDOUT;
    case FI_ENOSYS:
    case FI_EOPNOTSUPP:
        return AFP_EUNSUPPORTED;
    case FI_ENODATA:
    case FI_ENODEV:
        return AFP_ENODEV;
    case FI_EBUSY:
        return AFP_EBUSY;
    default:
        return AFP_EIO;
    }
}

/* Records "<what>: <libfabric text> (<provider>)" in the domain and maps the code. */
static int fail(afp_domain *d, const char *what, ssize_t fi_ret)
{
    int e = fi_ret < 0 ? (int)-fi_ret : (int)fi_ret;
    afp_errf(d->errbuf, sizeof d->errbuf, "%s: %s (%s)", what, d->lib->strerror(e),
         d->prov_name[0] ? d->prov_name : "libfabric");
    return map_errno(e);
}

/* ------------------------------------------------------------------------------------ */
/* Operation contexts                                                                    */

static struct ofi_op *op_get(afp_domain *d, uint32_t kind, uint64_t user_ctx)
{
    struct ofi_op *op = d->free_ops;
    if (!op)
        return NULL;
    d->free_ops = op->next;
    if (kind != AFP_EV_RECV)
        d->tx_inflight++;
    memset(&op->fctx, 0, sizeof op->fctx);
    op->user_ctx = user_ctx;
    op->kind = kind;
    op->stolen = 0;
    op->dropped = 0;
    op->rma = 0;
    op->key = 0;
    op->peer = UINT64_MAX;
    op->next = op->prev = NULL;
    return op;
}

static void op_put(afp_domain *d, struct ofi_op *op)
{
    if (op->kind != AFP_EV_RECV && d->tx_inflight)
        d->tx_inflight--;
    if (op->peer < d->n_shm_peers && d->shm_peers[op->peer].pending)
        d->shm_peers[op->peer].pending--;
    op->peer = UINT64_MAX; /* no longer in flight to anyone */
    op->next = d->free_ops;
    d->free_ops = op;
}

/* A completion's op_context -> our op, or NULL when it is not one of ours (remote-write
 * entries carry NULL, or on some providers whatever the provider put there). */
static struct ofi_op *op_from_ctx(afp_domain *d, void *ctx)
{
    uintptr_t p = (uintptr_t)ctx, base = (uintptr_t)d->pool;
    if (!ctx || p < base || p >= base + (uintptr_t)d->pool_size * sizeof *d->pool ||
        (p - base) % sizeof *d->pool)
        return NULL;
    return ctx;
}

/* ------------------------------------------------------------------------------------ */
/* FI_RX_CQ_DATA emulation                                                               */

static void rx_link(afp_domain *d, struct ofi_op *op)
{
    op->prev = d->rx_posted.prev;
    op->next = &d->rx_posted;
    d->rx_posted.prev->next = op;
    d->rx_posted.prev = op;
}

static void rx_unlink(struct ofi_op *op)
{
    op->prev->next = op->next;
    op->next->prev = op->prev;
    op->next = op->prev = NULL;
}

static bool imm_push(afp_domain *d, uint32_t imm)
{
    if (d->imm_len == d->imm_cap) {
        size_t cap = d->imm_cap ? d->imm_cap * 2 : 64;
        uint32_t *q = malloc(cap * sizeof *q);
        if (!q)
            return false;
        for (size_t i = 0; i < d->imm_len; i++) /* unwrap the ring into the new array */
            q[i] = d->imm_q[(d->imm_head + i) % d->imm_cap];
        free(d->imm_q);
        d->imm_q = q;
        d->imm_cap = cap;
        d->imm_head = 0;
    }
    d->imm_q[(d->imm_head + d->imm_len) % d->imm_cap] = imm;
    d->imm_len++;
    return true;
}

static uint32_t imm_pop(afp_domain *d)
{
    uint32_t imm = d->imm_q[d->imm_head];
    d->imm_head = (d->imm_head + 1) % d->imm_cap;
    d->imm_len--;
    return imm;
}

/*
 * Gives each waiting immediate the oldest posted receive, as EFA would, and cancels that
 * receive. The IMM event is produced only when the cancel's completion arrives (the
 * buffer is then ours again, so the shim may repost it at once). If a message wins the
 * race for the receive instead, poll reports the message and the immediate waits for
 * the next receive. An immediate with no receive posted waits here, like EFA's RNR retry.
 */
static void emu_assign(afp_domain *d)
{
    while (d->imm_len && d->rx_posted.next != &d->rx_posted) {
        struct ofi_op *op = d->rx_posted.next;
        rx_unlink(op);
        op->stolen = 1;
        op->stolen_imm = imm_pop(d);
        d->stealing++;
        ssize_t ret = fi_cancel(&d->ep->fid, op);
        if (ret) /* already matched: it completes normally and poll re-queues the imm */
            fail(d, "fi_cancel (FI_RX_CQ_DATA emulation)", ret);
    }
}

/* A receive op leaves libfabric (completed, failed or cancelled). For a stolen receive
 * whose cancel lost the race, its immediate goes back to the queue. */
static void emu_rx_done(afp_domain *d, struct ofi_op *op)
{
    if (!d->emu_rx_cq_data || op->kind != AFP_EV_RECV)
        return;
    if (!op->stolen) {
        rx_unlink(op);
        return;
    }
    d->stealing--;
    if (!imm_push(d, op->stolen_imm))
        afp_errf(d->errbuf, sizeof d->errbuf, "out of memory: emulated immediate %u dropped",
             op->stolen_imm);
}

/* ------------------------------------------------------------------------------------ */
/* Domains of this process                                                               */

/*
 * Two engines of one process on libfabric 1.17's shm: a peer in the same process is not
 * mapped from /dev/shm, its AV entry points straight at that endpoint's own shared region.
 * Once that endpoint is closed (its region unmapped), a write to it dereferences unmapped
 * memory: SIGSEGV in pthread_spin_lock on the worker thread, 3 of 3 runs. So
 * this process's domains are listed here by address, every domain that resolves one of
 * them holds a reference, and:
 *  - a closed domain is marked closed at once (writes and sends to it fail with AFP_EPEER
 *    before anything is posted; resolving it fails the same way), but its libfabric objects,
 *    and so its shared region, stay open until no other domain of the process refers to it;
 *  - a closing domain first removes its own AV entries of such peers (while their regions
 *    are still mapped), then lets go of them; the last one to let go closes the objects.
 * Software providers only do this in-process shortcut, but it costs nothing elsewhere (a
 * peer of another process is never in the list), so it is not tied to a provider name.
 */
struct inproc {
    struct inproc *next;
    afp_domain *owner;
    uint8_t name[AFP_MAX_ADDR_LEN];
    size_t name_len;
    uint32_t refs;       /* the owner until it closes, plus each domain that resolved it */
    _Atomic bool closed; /* the owner was closed: it will never progress again */
};

static pthread_mutex_t g_inproc_lock = PTHREAD_MUTEX_INITIALIZER;
static struct inproc *g_inproc;

static void close_objects(afp_domain *d);

static void inproc_add(afp_domain *d, const void *name, size_t len)
{
    struct inproc *e = calloc(1, sizeof *e);
    if (!e || len > sizeof e->name) {
        free(e); /* unlisted: only the in-process shortcut loses its guard */
        return;
    }
    e->owner = d;
    memcpy(e->name, name, len);
    e->name_len = len;
    e->refs = 1;
    pthread_mutex_lock(&g_inproc_lock);
    e->next = g_inproc;
    g_inproc = e;
    pthread_mutex_unlock(&g_inproc_lock);
    d->self = e;
}

/* Drops one reference; the last one closes the owner's objects (never the caller's own). */
static void inproc_release(struct inproc *e)
{
    afp_domain *finish = NULL;
    pthread_mutex_lock(&g_inproc_lock);
    if (--e->refs == 0) {
        for (struct inproc **p = &g_inproc; *p; p = &(*p)->next) {
            if (*p == e) {
                *p = e->next;
                break;
            }
        }
        finish = e->owner;
    }
    pthread_mutex_unlock(&g_inproc_lock);
    if (finish) {
        free(e);
        close_objects(finish);
    }
}

/* If `addr` is an open domain of this process (other than d), takes a reference to it.
 * Returns AFP_EPEER (nothing taken) if it is one that was closed. */
static int inproc_resolve(afp_domain *d, const void *addr, size_t len, struct inproc **out)
{
    int rc = 0;
    *out = NULL;
    pthread_mutex_lock(&g_inproc_lock);
    for (struct inproc *e = g_inproc; e; e = e->next) {
        if (e == d->self || e->name_len != len || memcmp(e->name, addr, len) != 0)
            continue;
        if (atomic_load(&e->closed)) {
            rc = AFP_EPEER;
        } else {
            e->refs++;
            *out = e;
        }
        break;
    }
    pthread_mutex_unlock(&g_inproc_lock);
    if (rc)
        afp_errf(d->errbuf, sizeof d->errbuf,
                 "peer is an engine of this process that was closed (%s)", d->prov_name);
    return rc;
}

/* Whether `peer` is a domain of this process that was closed since it was resolved. */
static bool inproc_gone(afp_domain *d, uint64_t peer)
{
    for (size_t i = 0; i < d->n_inproc; i++) {
        if (d->inproc[i].fa != peer)
            continue;
        if (!atomic_load(&d->inproc[i].e->closed))
            return false;
        afp_errf(d->errbuf, sizeof d->errbuf,
                 "peer is an engine of this process that was closed (%s)", d->prov_name);
        return true;
    }
    return false;
}

/*
 * A peer of another process whose endpoint was closed: libfabric 1.17's shm cannot map it
 * any more (its /dev/shm file is gone), and a write posted to it anyway never completes and
 * stalls every later completion of the endpoint (docs/limitations.md). Its FI_ADDR_STR
 * address ("fi_shm://NAME") names that file, so resolve refuses a peer whose file is gone,
 * and posting checks again, at most every SHM_RECHECK_NS per peer (a stat is ~1 us; a peer
 * closed within that window of the last check is still posted to).
 */
#define SHM_PREFIX "fi_shm://"
#define SHM_RECHECK_NS 10000000ull /* 10 ms */

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* "/dev/shm/NAME" for an address "fi_shm://NAME" (NUL-terminated within len), else NULL. */
static char *shm_path(const void *addr, size_t len)
{
    const char *a = addr;
    size_t plen = sizeof SHM_PREFIX - 1;
    const char *end = memchr(a, '\0', len);
    if (!end || (size_t)(end - a) <= plen || strncmp(a, SHM_PREFIX, plen) != 0 ||
        strchr(a + plen, '/'))
        return NULL;
    size_t n = strlen("/dev/shm/") + (size_t)(end - a - (ptrdiff_t)plen) + 1;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "/dev/shm/%s", a + plen);
    return p;
}

static bool shm_file_gone(afp_domain *d, uint64_t peer, uint64_t now)
{
    if (peer >= d->n_shm_peers || !d->shm_peers[peer].path)
        return false;
    struct shm_peer *sp = &d->shm_peers[peer];
    if (sp->dead) {
        afp_errf(d->errbuf, sizeof d->errbuf, "peer process exited (%s) (%s)", sp->path,
                 d->prov_name);
        return true;
    }
    if (now - sp->checked_ns < SHM_RECHECK_NS)
        return false;
    if (access(sp->path, F_OK) == 0 || errno != ENOENT) { /* only ENOENT says it is gone */
        sp->checked_ns = now;
        return false;
    }
    afp_errf(d->errbuf, sizeof d->errbuf, "peer endpoint is closed (%s is gone) (%s)", sp->path,
             d->prov_name);
    return true;
}

/* libfabric's shm speaks a different protocol in each version over the same /dev/shm
 * regions: a 1.17 engine writing to a 2.5.1 one wedged inside libfabric. So the names made
 * here (unique_shm_name, 1.17 only) carry the version in the top 16 bits of their random
 * part, and resolve refuses a peer whose name says another libfabric than ours. */
#define SHM_TAG_SHIFT 48

/* The version (FI_MAJOR of prov_version) in an address "fi_shm://<pid>:<16 hex>:...", the
 * shape unique_shm_name gives; 0 for any other shape (libfabric's own naming). */
static unsigned shm_name_version(const void *addr, size_t len)
{
    const char *a = addr, *end = memchr(a, '\0', len);
    size_t plen = sizeof SHM_PREFIX - 1;
    if (!end || (size_t)(end - a) <= plen || strncmp(a, SHM_PREFIX, plen) != 0)
        return 0;
    const char *q = a + plen;
    while (q < end && *q >= '0' && *q <= '9')
        q++;
    if (q == a + plen || q >= end || *q != ':')
        return 0;
    uint64_t tag = 0;
    for (int i = 1; i <= 16; i++) {
        char c = q + i < end ? q[i] : '\0';
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0)
            return 0;
        tag = tag << 4 | (uint64_t)v;
    }
    return q + 17 < end && q[17] == ':' ? (unsigned)(tag >> SHM_TAG_SHIFT) : 0;
}

/* AFP_EWRONGPROV for a shm peer whose address was made under another libfabric. */
static int shm_same_libfabric(afp_domain *d, const void *addr, size_t len)
{
    if (strcmp(d->prov_name, "shm") != 0)
        return 0;
    unsigned ours = d->shm117 ? d->prov_ver : 0, theirs = shm_name_version(addr, len);
    if (theirs == ours)
        return 0;
    char peer[40] = "another libfabric";
    if (theirs < 100 || theirs > 999) /* an untagged random part: an earlier afabric's name */
        snprintf(peer, sizeof peer, "another libfabric%s", theirs ? " or afabric build" : "");
    else
        snprintf(peer, sizeof peer, "libfabric %u.%u", theirs / 100, theirs % 100);
    afp_errf(d->errbuf, sizeof d->errbuf,
             "peer's shm address %.*s is from %s, this engine's from libfabric %u.%u: shm does not "
             "work across libfabric versions; use one libfabric in every process (AFABRIC_LIBFABRIC)",
             (int)strnlen(addr, len), (const char *)addr, peer, d->prov_ver / 100,
             d->prov_ver % 100);
    return AFP_EWRONGPROV;
}

/* Remembers (or refuses) a peer whose address names a /dev/shm file; 0 or AFP_E*. */
static int shm_peer_add(afp_domain *d, const void *addr, size_t len, char **path)
{
    *path = shm_path(addr, len);
    if (!*path)
        return 0;
    if (access(*path, F_OK) != 0) {
        afp_errf(d->errbuf, sizeof d->errbuf, "peer endpoint is closed (%s is gone) (%s)",
                 *path, d->prov_name);
        free(*path);
        *path = NULL;
        return AFP_EPEER;
    }
    return 0;
}

static int shm_peer_keep(afp_domain *d, uint64_t fa, char *path)
{
    if (!path)
        return 0;
    if (fa >= d->n_shm_peers) {
        size_t n = fa + 1 > 2 * d->n_shm_peers ? fa + 1 : 2 * d->n_shm_peers;
        struct shm_peer *t = realloc(d->shm_peers, n * sizeof *t);
        if (!t) {
            free(path);
            return 0; /* unchecked: only the early refusal is lost */
        }
        memset(t + d->n_shm_peers, 0, (n - d->n_shm_peers) * sizeof *t);
        d->shm_peers = t;
        d->n_shm_peers = n;
    }
    free(d->shm_peers[fa].path);
    ofi_wake_peer_close(&d->shm_peers[fa].wk); /* another endpoint now: looked up afresh */
    d->shm_peers[fa].path = path;
    d->shm_peers[fa].checked_ns = mono_ns();
    d->shm_peers[fa].dead = false;
    return 0;
}

/* An operation goes to AV index `fa`: counted there while in flight (op_put uncounts). */
static void op_to(afp_domain *d, struct ofi_op *op, uint64_t fa)
{
    op->peer = fa;
    if (fa < d->n_shm_peers)
        d->shm_peers[fa].pending++;
}

/* While operations of ours are pending to a peer, its progress may be needed more than
 * once (1.17's bounce-buffer protocol): a peer that went to sleep meanwhile is woken again,
 * looked at every REKICK_NS while we poll. A peer just sent a wake-up gets no other for
 * KICK_GAP_NS (a batch of writes to a sleeping peer sends one datagram, not one each): one
 * that went back to sleep within it is woken by the next look. */
#define REKICK_NS 100000ull
#define KICK_GAP_NS 20000ull

/* 1.17 shm: after posting to `fa`, wake it if it sleeps (ofi_wake.c). */
static void kick(afp_domain *d, uint64_t fa)
{
    if (!d->wake.hdr || fa >= d->n_shm_peers || !d->shm_peers[fa].path)
        return;
    struct shm_peer *sp = &d->shm_peers[fa];
    ofi_wake_peer_open(&sp->wk, sp->path);
    if (!ofi_wake_sleeps(&sp->wk))
        return;
    uint64_t now = mono_ns();
    if (now - sp->kicked_ns < KICK_GAP_NS)
        return;
    sp->kicked_ns = now;
    ofi_wake_kick(&d->wake, &sp->wk);
}

static void rekick(afp_domain *d, uint64_t now)
{
    if (!d->tx_inflight || now - d->rekick_ns < REKICK_NS)
        return;
    d->rekick_ns = now;
    for (uint64_t fa = 0; fa < d->n_shm_peers; fa++)
        if (d->shm_peers[fa].pending)
            kick(d, fa);
}

static bool op_went_to_dead(afp_domain *d, const struct ofi_op *op)
{
    return op->peer < d->n_shm_peers && d->shm_peers[op->peer].dead;
}

static bool went_to_dead(void *arg, void *context, bool sar, uint64_t size)
{
    (void)sar;
    (void)size;
    afp_domain *d = arg;
    struct ofi_op *op = op_from_ctx(d, context);
    return op && op_went_to_dead(d, op);
}

/* Our own region, found once (shm117). */
static bool self_region(afp_domain *d)
{
    if (!d->self_base && d->self_path)
        (void)ofi_shm_region(d->self_path, &d->self_base, &d->self_len);
    return d->self_base != NULL;
}

/* Our mapping of peer `fa`'s region: 1.17 maps it at the first operation to the peer and
 * keeps it; until then, looked for again at most every OFI_REGION_RETRY_NS. */
static const uint8_t *peer_region(afp_domain *d, uint64_t fa, uint64_t now, size_t *len)
{
    if (fa >= d->n_shm_peers || !d->shm_peers[fa].path)
        return NULL;
    struct shm_peer *sp = &d->shm_peers[fa];
    if (!sp->base && (!sp->looked_ns || now - sp->looked_ns > OFI_REGION_RETRY_NS)) {
        sp->looked_ns = now;
        (void)ofi_shm_region(sp->path, &sp->base, &sp->len);
    }
    *len = sp->len;
    return sp->base;
}

/* A pending write (or read) whose target is idle (every command queued to it taken and
 * answered): dropped, never to be answered (ofi_shmfence.c says why that is the test). Not a send: 1.17's target
 * takes a message nobody has posted a receive for off its queue, and answers it later. */
static bool was_dropped(void *arg, void *context, bool sar, uint64_t size)
{
    afp_domain *d = arg;
    struct ofi_op *op = op_from_ctx(d, context);
    if (!op || op->kind != AFP_EV_WRITE_DONE || op->peer == UINT64_MAX ||
        (sar && size > OFI_SHM_ONE_CHUNK))
        return false;
    size_t len = 0;
    const uint8_t *base = peer_region(d, op->peer, mono_ns(), &len);
    return base && ofi_shm_idle(base, len);
}

static void mark_dropped(void *arg, void *context)
{
    struct ofi_op *op = op_from_ctx(arg, context);
    if (op)
        op->dropped = 1;
}

/* Worker, each poll (1.17 shm): when the oldest response has stayed pending a while, looks
 * whether its target dropped it (refused the write) and then completes it with an error,
 * instead of leaving every later completion of the endpoint behind it for good. One at a
 * time, the oldest: it is the one holding the others up, and a long transfer costs a look
 * per OFI_DROP_CHECK_NS at one slot. */
static void check_dropped(afp_domain *d, uint64_t now)
{
    if (now - d->drop_check_ns < OFI_DROP_CHECK_NS || !self_region(d))
        return;
    d->drop_check_ns = now;
    uint64_t rcnt;
    if (!ofi_shm_head_pending(d->self_base, d->self_len, &rcnt)) {
        d->head_since = 0;
        return;
    }
    if (!d->head_since || rcnt != d->head_rcnt) {
        d->head_rcnt = rcnt; /* a new oldest: give it its time */
        d->head_since = now;
        return;
    }
    if (now - d->head_since >= OFI_DROP_AFTER_NS &&
        ofi_shm_release(d->self_base, d->self_len, true, was_dropped, mark_dropped, d,
                        -FI_EKEYREJECTED))
        d->head_since = 0;
}

/* Worker (posting and polling threads are the same): takes in the dead peers' files that
 * peer_exited queued, marks those peers (no more posts to them) and fails the operations
 * still pending to them, whose response slots would otherwise hold up every later
 * completion of this endpoint (ofi_shmfence.c). */
static void take_dead(afp_domain *d)
{
    unsigned news = atomic_load_explicit(&d->dead_news, memory_order_acquire);
    if (news == d->dead_seen)
        return;
    d->dead_seen = news;
    pthread_mutex_lock(&d->dead_mu);
    char **paths = d->dead_paths;
    size_t n = d->n_dead_paths;
    d->dead_paths = NULL;
    d->n_dead_paths = 0;
    pthread_mutex_unlock(&d->dead_mu);
    bool marked = false;
    for (size_t i = 0; i < n; i++) {
        for (size_t fa = 0; fa < d->n_shm_peers; fa++) {
            struct shm_peer *sp = &d->shm_peers[fa];
            if (sp->path && !sp->dead && strcmp(sp->path, paths[i]) == 0)
                sp->dead = marked = true;
        }
        free(paths[i]);
    }
    free(paths);
    if (marked && self_region(d))
        (void)ofi_shm_release(d->self_base, d->self_len, false, went_to_dead, NULL, d,
                              -FI_ECONNRESET);
}

static void shm_peers_free(afp_domain *d)
{
    for (size_t i = 0; i < d->n_shm_peers; i++) {
        free(d->shm_peers[i].path);
        ofi_wake_peer_close(&d->shm_peers[i].wk);
    }
    free(d->shm_peers);
    for (size_t i = 0; i < d->n_dead_paths; i++)
        free(d->dead_paths[i]);
    free(d->dead_paths);
    d->dead_paths = NULL;
    d->n_dead_paths = 0;
    d->shm_peers = NULL;
    d->n_shm_peers = 0;
}

/* ------------------------------------------------------------------------------------ */
/* Discovery                                                                             */

/* "tcp" accepts "tcp" and layered "tcp;ofi_rxm" (libfabric 1.x), never "tcp-foo". */
static bool prov_matches(const char *have, const char *want)
{
    if (!want || !*want)
        return true;
    if (!have)
        return false;
    size_t n = strlen(want);
    return strncmp(have, want, n) == 0 && (have[n] == '\0' || have[n] == ';');
}

/* libfabric 1.17 ignores domain-name hints for tcp/net/sockets, so the NIC filter is
 * ours. Entries that cannot carry a 4-byte immediate are unusable. */
static bool info_usable(const struct fi_info *fi, const afp_open_args *a)
{
    if (!fi->fabric_attr || !fi->domain_attr || !fi->ep_attr)
        return false;
    if (!prov_matches(fi->fabric_attr->prov_name, a->fabric_provider))
        return false;
    if (a->nic && *a->nic &&
        (!fi->domain_attr->name || strcmp(fi->domain_attr->name, a->nic) != 0))
        return false;
    return fi->domain_attr->cq_data_size >= OFI_IMM_SIZE;
}

/* ofi.c's own bit in a copy of afp_open_args.flags (never the shim's): ask for no RMA read. */
#define OFI_OPEN_NO_READS 0x80000000u

static struct fi_info *make_hints(const struct ofi_lib *lib, const afp_open_args *a, bool dc,
                                  bool hmem, bool rma_event, bool source)
{
    struct fi_info *h = lib->dupinfo(NULL); /* = fi_allocinfo() */
    if (!h)
        return NULL;
    h->ep_attr->type = FI_EP_RDM;
    h->caps = FI_MSG | FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    if (!(a->flags & OFI_OPEN_NO_READS))
        h->caps |= FI_READ | FI_REMOTE_READ;
    if (hmem)
        h->caps |= FI_HMEM;
    if (rma_event)
        h->caps |= FI_RMA_EVENT;
    if (source)
        h->caps |= FI_SOURCE;
    /* Offer every mode we can honour; the provider keeps in info->mode the ones it needs. */
    h->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                              FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;
    h->domain_attr->cq_data_size = OFI_IMM_SIZE;
    h->domain_attr->threading = FI_THREAD_DOMAIN; /* one thread per domain (ABI rule) */
    if (dc)
        h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    if (a->fabric_provider && *a->fabric_provider) {
        h->fabric_attr->prov_name = strdup(a->fabric_provider); /* fi_freeinfo frees it */
        if (!h->fabric_attr->prov_name) {
            lib->freeinfo(h);
            return NULL;
        }
    }
    return h;
}

/* fi_getinfo with our hints; returns libfabric's code (-FI_ENODATA: nothing matched). */
static int query(const struct ofi_lib *lib, const afp_open_args *a, const char *node, bool dc,
                 bool hmem, bool rma_event, bool source, struct fi_info **list)
{
    *list = NULL;
    struct fi_info *hints = make_hints(lib, a, dc, hmem, rma_event, source);
    if (!hints)
        return -FI_ENOMEM;
    int ret = lib->getinfo(OFI_API_VERSION, node, NULL, node ? FI_SOURCE : 0, hints, list);
    lib->freeinfo(hints);
    return ret;
}

/* tcp with node=NULL binds the first interface (eth0): without an explicit address or
 * NIC, bind loopback, which is what a single-machine setup wants. */
static const char *open_node(const afp_open_args *a)
{
    if (a->bind_addr && *a->bind_addr)
        return a->bind_addr;
    if ((!a->nic || !*a->nic) && a->fabric_provider &&
        (strcmp(a->fabric_provider, "tcp") == 0 || strcmp(a->fabric_provider, "net") == 0))
        return OFI_TCP_DEFAULT_NODE;
    return NULL;
}

static const char *str_or_empty(const char *s)
{
    return s ? s : "";
}

static void fill_nic(const struct fi_info *fi, afp_nic_info *out)
{
    memset(out, 0, sizeof *out);
    out->numa_node = -1;
    snprintf(out->name, sizeof out->name, "%s", str_or_empty(fi->domain_attr->name));
    snprintf(out->fabric, sizeof out->fabric, "%s", str_or_empty(fi->fabric_attr->name));
    snprintf(out->provider, sizeof out->provider, "%s",
             str_or_empty(fi->fabric_attr->prov_name));
    /* core and utility providers' prov_version: FI_VERSION(major * 100 + minor, patch * 10) */
    uint32_t v = fi->fabric_attr->prov_version, mm = FI_MAJOR(v);
    if (mm >= 100 && mm < 10000)
        out->lib_version = AFP_LIB_VERSION(mm / 100, mm % 100, FI_MINOR(v) / 10);
    const struct fid_nic *nic = fi->nic;
    if (!nic)
        return;
    if (nic->link_attr)
        out->link_speed_bps = nic->link_attr->speed;
    if (nic->bus_attr && nic->bus_attr->bus_type == FI_BUS_PCI) {
        const struct fi_pci_attr *p = &nic->bus_attr->attr.pci;
        snprintf(out->pci, sizeof out->pci, "%04x:%02x:%02x.%x", p->domain_id, p->bus_id,
                 p->device_id, p->function_id);
        /* libfabric has no NUMA field; the kernel knows it from the PCI address */
        char path[96];
        snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/numa_node", out->pci);
        FILE *f = fopen(path, "r");
        if (f) {
            int node;
            if (fscanf(f, "%d", &node) == 1 && node >= 0)
                out->numa_node = node;
            fclose(f);
        }
    }
}

/* One NIC may be listed several times: once per address family or endpoint flavour,
 * and on libfabric 2.x both as native "tcp" and as "tcp;ofi_rxm". The first entry is the
 * one open() would pick. */
static bool same_nic(const struct fi_info *x, const struct fi_info *y)
{
    return strcmp(str_or_empty(x->domain_attr->name), str_or_empty(y->domain_attr->name)) == 0;
}

static int ofi_list_nics(const afp_open_args *a, afp_nic_info *out, uint32_t max, uint32_t *n,
                         char *err, size_t errlen)
{
    const char *why = NULL;
    struct fi_info *list = NULL;
    uint32_t count = 0;
    int rc = 0;

    if (n)
        *n = 0;
    if (!a || !n || (max && !out)) {
        afp_errf(err, errlen, "list_nics: invalid arguments");
        return AFP_EINVAL;
    }
    const struct ofi_lib *lib = ofi_lib_get(&why);
    if (!lib) {
        afp_errf(err, errlen, "%s", why);
        return AFP_EPROVIDER;
    }
    /* The plainest hints: a NIC is listed if it can be opened at all. Only an explicit
     * bind address narrows the query (no loopback default: we want every interface). */
    const char *node = a->bind_addr && *a->bind_addr ? a->bind_addr : NULL;
    afp_open_args plain = *a; /* RMA read not needed to be listed (select_info falls back) */
    plain.flags |= OFI_OPEN_NO_READS;
    a = &plain;
    int ret = query(lib, a, node, false, false, false, false, &list);
    if (ret == -FI_ENODATA)
        goto out; /* no NIC is not an error here */
    if (ret) {
        afp_errf(err, errlen, "fi_getinfo(%s): %s", str_or_empty(a->fabric_provider),
             lib->strerror(-ret));
        rc = map_errno(-ret);
        goto out;
    }
    for (const struct fi_info *fi = list; fi; fi = fi->next) {
        if (!info_usable(fi, a))
            continue;
        bool dup = false;
        for (const struct fi_info *prev = list; prev != fi && !dup; prev = prev->next)
            dup = info_usable(prev, a) && same_nic(prev, fi);
        if (dup)
            continue;
        if (count < max)
            fill_nic(fi, &out[count]);
        count++;
    }
out:
    if (list)
        lib->freeinfo(list);
    *n = count;
    return rc;
}

/* Whether device memory could exist in this process at all. FI_HMEM is worth asking
 * for only then: a provider may answer it with a slower variant (shm: no inject, no
 * inline sends) even when the libfabric build has no CUDA support. */
static bool cuda_present(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!h)
        return false;
    dlclose(h);
    return true;
}

/* Whether to ask for FI_HMEM. Device memory is what the hardware providers (efa, verbs) are
 * for (GPUDirect), so they ask wherever libcuda loads. The software ones (shm, tcp) do not
 * unless AFABRIC_OFI_HMEM=1: Debian's and PyPI's libfabric have no CUDA support, so FI_HMEM
 * gains nothing there, and it costs: 1.17's shm moved 64 KiB host-memory writes at 4.0-4.8
 * GB/s with it against 10.5-14.6 without (16-core GPU host, tools/repro/fi_setup_bw.c -m 1 against -m 0).
 * AFABRIC_OFI_HMEM=0 keeps it off everywhere. */
static bool want_hmem(const afp_open_args *a)
{
    const char *force = getenv("AFABRIC_OFI_HMEM");
    if (force && strcmp(force, "0") == 0)
        return false;
    bool software = a->fabric_provider && *a->fabric_provider &&
                    (prov_matches(a->fabric_provider, "shm") ||
                    prov_matches(a->fabric_provider, "tcp") ||
                    prov_matches(a->fabric_provider, "sockets") ||
                    prov_matches(a->fabric_provider, "udp") ||
                    prov_matches(a->fabric_provider, "net"));
    if (software && !(force && strcmp(force, "1") == 0))
        return false;
    return cuda_present();
}

/* The same choice with FI_SOURCE as well, if the provider offers it: receive completions
 * then name their sender (the shim's allow-list). Optional: without it, sources are unknown. */
static void with_source(afp_domain *d, const afp_open_args *a, const char *node, bool dc,
                        bool hmem, bool rma_event)
{
    struct fi_info *list = NULL;
    if (query(d->lib, a, node, dc, hmem, rma_event, true, &list) != 0)
        return;
    for (struct fi_info *fi = list; fi; fi = fi->next) {
        if (info_usable(fi, a) && (fi->caps & FI_SOURCE) &&
            strcmp(fi->fabric_attr->prov_name, d->info->fabric_attr->prov_name) == 0 &&
            fi->domain_attr->mr_mode == d->info->domain_attr->mr_mode &&
            fi->mode == d->info->mode) {
            d->lib->freeinfo(d->info_list);
            d->info_list = list;
            d->info = fi;
            d->source = true;
            return;
        }
    }
    d->lib->freeinfo(list);
}

/* Picks the fi_info to open: the richest set of attributes the provider accepts first
 * (FI_HMEM for device memory, FI_DELIVERY_COMPLETE for writes, FI_RMA_EVENT so a target
 * can see remote writes land), then less. */
static int select_info(afp_domain *d, const afp_open_args *a)
{
    static const struct {
        bool hmem, dc, rma_event;
    } rungs[] = {{true, true, true},   {true, true, false},  {true, false, true},
                 {true, false, false}, {false, true, true},  {false, true, false},
                 {false, false, true}, {false, false, false}};
    const char *node = open_node(a);
    bool try_hmem = want_hmem(a);
    int ret = -FI_ENODATA;
    /* every rung with RMA read first, then (a provider without it) every rung without */
    const size_t nrungs = sizeof rungs / sizeof rungs[0];
    afp_open_args no_reads = *a;
    no_reads.flags |= OFI_OPEN_NO_READS;

    for (size_t k = 0; k < 2 * nrungs; k++) {
        const afp_open_args *args = k < nrungs ? a : &no_reads;
        size_t r = k % nrungs;
        struct fi_info *list = NULL;
        if (rungs[r].hmem && !try_hmem)
            continue;
        ret = query(d->lib, args, node, rungs[r].dc, rungs[r].hmem, rungs[r].rma_event, false,
                    &list);
        if (ret == -FI_ENODATA)
            continue;
        if (ret)
            return fail(d, "fi_getinfo", ret);
        for (struct fi_info *fi = list; fi; fi = fi->next) {
            if (info_usable(fi, args)) {
                d->info_list = list;
                d->info = fi;
                d->delivery_complete = rungs[r].dc;
                d->rma_event = rungs[r].rma_event;
                d->reads = k < nrungs;
                with_source(d, args, node, rungs[r].dc, rungs[r].hmem, rungs[r].rma_event);
                return 0;
            }
        }
        d->lib->freeinfo(list);
    }
    afp_errf(d->errbuf, sizeof d->errbuf,
         "no usable libfabric domain for provider '%s'%s%s%s%s (RDM, RMA write, %u-byte "
         "remote CQ data)",
         str_or_empty(a->fabric_provider), a->nic ? ", nic " : "", str_or_empty(a->nic),
         node ? ", address " : "", str_or_empty(node), OFI_IMM_SIZE);
    return AFP_ENODEV;
}

/* ------------------------------------------------------------------------------------ */
/* Open / close                                                                          */

static void ofi_close(afp_domain *d)
{
    if (!d)
        return;
    /* Peers of this process first: our AV entries of them go while their regions are still
     * mapped, then our references (the last one closes a peer closed before us). */
    for (size_t i = 0; i < d->n_inproc; i++) {
        fi_addr_t fa = d->inproc[i].fa;
        if (d->av) {
            int ret = fi_av_remove(d->av, &fa, 1, 0);
            (void)ret; /* going away regardless */
        }
        inproc_release(d->inproc[i].e);
    }
    free(d->inproc);
    d->inproc = NULL;
    d->n_inproc = 0;
    if (!d->self) {
        close_objects(d);
        return;
    }
    atomic_store(&d->self->closed, true); /* writes to us fail at once from now on */
    inproc_release(d->self); /* closes our objects now, or when the last referrer lets go */
}

static void close_objects(afp_domain *d)
{
    /* Reverse order of creation. A failing fi_close cannot be acted upon by anyone (the
     * domain is going away), so teardown continues regardless. */
    struct fid *fids[] = {d->ep ? &d->ep->fid : NULL, d->rw_cntr ? &d->rw_cntr->fid : NULL,
                          d->rx_cq ? &d->rx_cq->fid : NULL, d->cq ? &d->cq->fid : NULL,
                          d->av ? &d->av->fid : NULL, d->domain ? &d->domain->fid : NULL,
                          d->fabric ? &d->fabric->fid : NULL};
    for (size_t i = 0; i < sizeof fids / sizeof fids[0]; i++) {
        if (!fids[i])
            continue;
        int ret = fi_close(fids[i]); /* -FI_EBUSY if MRs are still registered: leaked */
        (void)ret;
    }
    if (d->info_list)
        d->lib->freeinfo(d->info_list);
    shm_peers_free(d);
    ofi_wake_close(&d->wake);
    for (int i = 0; i < 2; i++) /* after the files are gone: nothing left to reap */
        if (d->hold_fd[i] >= 0)
            (void)close(d->hold_fd[i]);
    free(d->self_path);
    pthread_mutex_destroy(&d->dead_mu);
    free(d->imm_q);
    free(d->pool);
    free(d);
}

/* The CQ, with a wait fd if the provider offers one (adaptive polling sleeps on it). */
static int open_cq(afp_domain *d, size_t size)
{
    struct fi_cq_attr attr = {
        .size = size,
        .format = FI_CQ_FORMAT_DATA,
        .wait_obj = FI_WAIT_FD,
        .wait_cond = FI_CQ_COND_NONE,
    };
    int ret = fi_cq_open(d->domain, &attr, &d->cq, NULL);
    if (ret) {
        attr.wait_obj = FI_WAIT_NONE; /* provider refuses fds (e.g. efa): spin-poll only */
        ret = fi_cq_open(d->domain, &attr, &d->cq, NULL);
        if (ret)
            return fail(d, "fi_cq_open", ret);
        return 0;
    }
    int fd = -1;
    ret = fi_control(&d->cq->fid, FI_GETWAIT, &fd);
    d->wait_fd = ret == 0 ? fd : -1;
    return 0;
}

/*
 * libfabric 1.17's CQs (util_cq) keep each entry's source in an array beside the ring,
 * written only for a completion that comes with a source: one without (a sender not in our
 * AV, on shm; any remote CQ data, on tcp;ofi_rxm) leaves the slot's old value there, and
 * fi_cq_readfrom reports that. It is 0 until the ring has gone round, then the source of
 * the slot's last completion that had one: on shm, a sender not in our AV is named as the
 * resolved peer whose message used the slot before (after one peer's 64 MiB message, 1024
 * fragments, every slot of a default-sized ring names that peer): its messages would read
 * as forged, a forger's as that peer's, and the allow-list would pass what it names
 * (tools/repro/shm117_source_probe.c). An entry that does not fit the ring carries its own
 * source, FI_ADDR_NOTAVAIL for such a sender, and in a ring of one slot every entry is one
 * of those. So on 1.17's shm receives complete on a CQ of their own with one slot
 * (open_rx_cq), read one entry per call; 2.x writes every entry's source.
 */
#define OFI_RX_CQ_SLOTS 1u

/* A CQ for receive completions alone, on 1.17's shm with FI_SOURCE (see above). shm has no
 * wait fd for CQs: a sleeping worker is woken through ofi_wake.c. */
static int open_rx_cq(afp_domain *d)
{
    struct fi_cq_attr attr = {
        .size = OFI_RX_CQ_SLOTS,
        .format = FI_CQ_FORMAT_DATA,
        .wait_obj = FI_WAIT_NONE,
    };
    int ret = fi_cq_open(d->domain, &attr, &d->rx_cq, NULL);
    return ret ? fail(d, "fi_cq_open(receives)", ret) : 0;
}

/* Which senders FI_SOURCE names exactly, as seen (tests/test_allow.py, tests/test_messages.py)
 * with libfabric 1.17 and 2.5: shm (1.17: with open_rx_cq) and 2.x's native tcp name the
 * sender of messages and immediates, with FI_ADDR_NOTAVAIL for one never inserted in the
 * AV; 1.17's tcp;ofi_rxm names a message's sender but gives remote CQ data no source of its
 * own (see above). So immediates over rxm have no source, and other providers' sources are
 * not passed on until tested. Index 0 of the AV is taken by our own address: no peer ever
 * gets the value a source slot starts at. */
static void trust_sources(afp_domain *d, const char *self_name)
{
    uint8_t padded[AFP_MAX_ADDR_LEN + 8] = {0};
    memcpy(padded, self_name, d->addr_len);
    fi_addr_t fa = FI_ADDR_NOTAVAIL;
    if (fi_av_insert(d->av, padded, 1, &fa, 0, NULL) != 1 || fa != 0) {
        d->source = false; /* the AV would not give us index 0: no sources at all */
        return;
    }
    d->self_fa = fa;
    if (strcmp(d->prov_name, "shm") == 0 || strcmp(d->prov_name, "tcp") == 0) {
        d->src_msg = d->src_imm = true;
    } else if (strncmp(d->prov_name, "tcp", 3) == 0 && strstr(d->prov_name, "ofi_rxm")) {
        d->src_msg = true;
    }
}

/* libfabric 1.17's shm names an endpoint's region file after the process id and a count of
 * the process's endpoints ("/dev/shm/<pid>:<uid>:<n>"), and cannot create one whose file
 * exists already: a file left by a killed process whose pid comes round again made
 * Engine("shm") fail with EBUSY. Its source address is the name's stem ("fi_shm://<pid>"):
 * a random part after the pid makes every endpoint's file its own. The pid stays first,
 * where tools (and tests) read it. */
static int unique_shm_name(afp_domain *d)
{
    static const char prefix[] = "fi_shm://";
    struct fi_info *info = d->info;
    if (info->addr_format != FI_ADDR_STR || !info->src_addr ||
        strncmp(info->src_addr, prefix, sizeof prefix - 1) != 0)
        return 0; /* not the naming measured: left to libfabric */
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof nonce, GRND_NONBLOCK) != (ssize_t)sizeof nonce)
        nonce = mono_ns() ^ ((uint64_t)(uintptr_t)d << 16);
    /* the version tag (shm_same_libfabric) above 48 random bits */
    nonce = (uint64_t)d->prov_ver << SHM_TAG_SHIFT | (nonce & ((1ull << SHM_TAG_SHIFT) - 1));
    char name[64];
    int n = snprintf(name, sizeof name, "%s%ld:%016llx", prefix, (long)getpid(),
                     (unsigned long long)nonce);
    char *copy = n > 0 && (size_t)n < sizeof name ? strdup(name) : NULL;
    if (!copy) {
        afp_errf(d->errbuf, sizeof d->errbuf, "open: out of memory");
        return AFP_ENOMEM;
    }
    free(info->src_addr); /* fi_freeinfo frees the new one with the list */
    info->src_addr = copy;
    info->src_addrlen = (size_t)n + 1;
    return 0;
}

static int ofi_open(const afp_open_args *a, afp_domain **out, char *err, size_t errlen)
{
    const char *why = NULL;
    afp_domain *d = NULL;
    int rc, ret;

    if (!a || !out) {
        afp_errf(err, errlen, "open: invalid arguments");
        return AFP_EINVAL;
    }
    *out = NULL;
    const struct ofi_lib *lib = ofi_lib_get(&why);
    if (!lib) {
        afp_errf(err, errlen, "%s", why);
        return AFP_EPROVIDER;
    }
    d = calloc(1, sizeof *d);
    if (!d) {
        afp_errf(err, errlen, "open: out of memory");
        return AFP_ENOMEM;
    }
    d->lib = lib;
    d->wait_fd = -1;
    d->hold_fd[0] = d->hold_fd[1] = -1;
    d->wake.fd = d->wake.send_fd = -1;
    pthread_mutex_init(&d->dead_mu, NULL);
    d->rx_posted.next = d->rx_posted.prev = &d->rx_posted;

    rc = select_info(d, a);
    if (rc)
        goto out_close;
    const struct fi_info *info = d->info;
    snprintf(d->prov_name, sizeof d->prov_name, "%s", info->fabric_attr->prov_name);

    bool force = a->flags & AFP_OPEN_FORCE_EFA_MODES;
    uint64_t mr_mode = (uint64_t)info->domain_attr->mr_mode;
    d->rx_cq_data = info->mode & FI_RX_CQ_DATA;
    d->emu_rx_cq_data = force && !d->rx_cq_data;
    d->mr_local = (mr_mode & FI_MR_LOCAL) || force;
    d->prov_key = mr_mode & FI_MR_PROV_KEY;
    d->emu_prov_key = force && !d->prov_key;
    d->virt_addr = mr_mode & FI_MR_VIRT_ADDR;
    d->mr_endpoint = mr_mode & FI_MR_ENDPOINT;
    d->hmem = info->caps & FI_HMEM;
    /* fi_writemsg ignores tx_attr->op_flags: the completion level goes in every call. */
    d->write_flags = FI_COMPLETION | (d->delivery_complete ? FI_DELIVERY_COMPLETE : 0);
    /* A zero-length write with an immediate (what barrier sends) to a revoked key: sent with
     * FI_COMPLETION alone, tcp;ofi_rxm (1.17) and tcp (2.5.1) report success and the target
     * drops it; delivery-complete, they report the refusal. shm is the exception,
     * measured: 1.17 never completes a zero-length FI_DELIVERY_COMPLETE write and stalls its
     * queue behind it, 2.5.1 reports success either way (docs/limitations.md). */
    d->zero_len_dc = d->delivery_complete && strcmp(d->prov_name, "shm") != 0;
    /* core providers' prov_version is FI_VERSION(major * 100 + minor, revision * 10) */
    d->prov_ver = FI_MAJOR(info->fabric_attr->prov_version);
    d->shm117 = strcmp(d->prov_name, "shm") == 0 && d->prov_ver == 117;
    d->next_key = 1;
    d->max_msg_size = info->ep_attr->max_msg_size;
    d->inject_size = info->tx_attr->inject_size;

    uint32_t tx = a->tx_depth ? a->tx_depth : OFI_DEFAULT_DEPTH;
    uint32_t rx = a->rx_depth ? a->rx_depth : OFI_DEFAULT_DEPTH;
    d->pool_size = tx + rx;
    d->pool = calloc(d->pool_size, sizeof *d->pool);
    if (!d->pool) {
        afp_errf(d->errbuf, sizeof d->errbuf, "open: out of memory");
        rc = AFP_ENOMEM;
        goto out_close;
    }
    for (uint32_t i = d->pool_size; i-- > 0;)
        op_put(d, &d->pool[i]);

    ret = d->lib->fabric(info->fabric_attr, &d->fabric, NULL);
    if (ret) {
        rc = fail(d, "fi_fabric", ret);
        goto out_close;
    }
    ret = fi_domain(d->fabric, d->info, &d->domain, NULL);
    if (ret) {
        rc = fail(d, "fi_domain", ret);
        goto out_close;
    }
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    ret = fi_av_open(d->domain, &av_attr, &d->av, NULL);
    if (ret) {
        rc = fail(d, "fi_av_open", ret);
        goto out_close;
    }
    /* Room for our own operations plus remote immediates that take no receive. */
    rc = open_cq(d, 2 * (size_t)d->pool_size);
    if (rc)
        goto out_close;
    if (d->shm117) {
        ofi_reap_dead(); /* files of killed processes' endpoints */
        rc = unique_shm_name(d);
        if (rc)
            goto out_close;
    }
    ret = fi_endpoint(d->domain, d->info, &d->ep, NULL);
    if (ret) {
        rc = fail(d, "fi_endpoint", ret);
        goto out_close;
    }
    ret = fi_ep_bind(d->ep, &d->av->fid, 0);
    if (ret) {
        rc = fail(d, "fi_ep_bind(av)", ret);
        goto out_close;
    }
    if (d->shm117 && d->source) {
        rc = open_rx_cq(d);
        if (rc)
            goto out_close;
        ret = fi_ep_bind(d->ep, &d->rx_cq->fid, FI_RECV);
        if (ret) {
            rc = fail(d, "fi_ep_bind(receive cq)", ret);
            goto out_close;
        }
    }
    ret = fi_ep_bind(d->ep, &d->cq->fid, d->rx_cq ? FI_TRANSMIT : FI_TRANSMIT | FI_RECV);
    if (ret) {
        rc = fail(d, "fi_ep_bind(cq)", ret);
        goto out_close;
    }
    if (d->rma_event) {
        /* Counts remote writes landing here: a target's only sign of progress when the
         * writes carry no immediate (its CQ stays empty), so adaptive polling stays awake
         * while a peer streams into it instead of sleeping on a provider with no wait fd. */
        struct fi_cntr_attr cattr = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_NONE};
        ret = fi_cntr_open(d->domain, &cattr, &d->rw_cntr, NULL);
        if (ret) {
            rc = fail(d, "fi_cntr_open", ret);
            goto out_close;
        }
        ret = fi_ep_bind(d->ep, &d->rw_cntr->fid, FI_REMOTE_WRITE);
        if (ret) {
            rc = fail(d, "fi_ep_bind(cntr)", ret);
            goto out_close;
        }
    }
    ret = fi_enable(d->ep);
    if (ret) {
        rc = fail(d, "fi_enable", ret);
        goto out_close;
    }
    char name[AFP_MAX_ADDR_LEN];
    size_t name_len = sizeof name;
    ret = fi_getname(&d->ep->fid, name, &name_len);
    if (ret) {
        rc = fail(d, "fi_getname", ret); /* -FI_ETOOSMALL: longer than the ABI allows */
        goto out_close;
    }
    d->addr_len = name_len;
    if (d->shm117) {
        d->self_path = shm_path(name, name_len); /* NULL: the self-unwedge is skipped */
        (void)ofi_wake_open(&d->wake, d->self_path); /* failing: naps on timers, as before */
        d->hold_fd[0] = ofi_reap_hold(d->self_path);
        d->hold_fd[1] = ofi_reap_hold(d->wake.path);
    }
    if (d->source)
        trust_sources(d, name);
    inproc_add(d, name, name_len);
    *out = d;
    return 0;

out_close:
    afp_errf(err, errlen, "%s", d->errbuf);
    ofi_close(d);
    return rc;
}

static const char *ofi_errbuf(afp_domain *d)
{
    return d ? d->errbuf : "no domain";
}

static int ofi_caps(afp_domain *d, afp_caps *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->provider, sizeof out->provider, "%s", d->prov_name);
    out->flags = (d->rx_cq_data || d->emu_rx_cq_data ? AFP_CAP_IMM_NEEDS_RECV : 0) |
                 (d->hmem ? AFP_CAP_DEVICE_MEM : 0) | (d->mr_local ? AFP_CAP_MR_LOCAL : 0) |
                 (d->virt_addr ? AFP_CAP_VIRT_ADDR : 0) |
                 (d->prov_key || d->emu_prov_key ? AFP_CAP_PROV_KEY : 0) |
                 (d->delivery_complete ? AFP_CAP_DELIVERY_COMPLETE : 0) |
                 /* fi_info cannot say who copies a remote write; tcp and shm copy in our
                  * progress calls (and efa's protocol layer may): assume it, everywhere */
                 AFP_CAP_TARGET_COPIES;
    out->imm_size = OFI_IMM_SIZE;
    out->max_msg_size = d->max_msg_size;
    out->inject_size = d->inject_size;
    out->addr_len = (uint32_t)d->addr_len;
    out->wait_fd = d->wake.hdr ? d->wake.fd : d->wait_fd;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Addresses                                                                             */

static int ofi_address(afp_domain *d, void *buf, size_t *len)
{
    size_t have = *len;
    int ret = fi_getname(&d->ep->fid, buf, &have);
    if (ret == -FI_ETOOSMALL) {
        afp_errf(d->errbuf, sizeof d->errbuf, "address: buffer of %zu bytes, need %zu", *len,
             have);
        *len = have;
        return AFP_EINVAL;
    }
    if (ret)
        return fail(d, "fi_getname", ret);
    *len = have;
    return 0;
}

static int ofi_resolve(afp_domain *d, const void *addr, size_t len, uint64_t *peer)
{
    /* The provider reads its own address length whatever we say, and lengths differ
     * between peers (shm names grow with the pid and the endpoint counter): hand it a
     * zero-padded copy that is never shorter than what it reads. */
    uint8_t padded[AFP_MAX_ADDR_LEN + 8] = {0};
    if (len == 0 || len > AFP_MAX_ADDR_LEN || d->addr_len > sizeof padded) {
        afp_errf(d->errbuf, sizeof d->errbuf, "resolve: address of %zu bytes (1..%u allowed)", len,
             AFP_MAX_ADDR_LEN);
        return AFP_EBADDESC;
    }
    memcpy(padded, addr, len);
    int rc = shm_same_libfabric(d, padded, len + 1);
    if (rc)
        return rc;
    if (d->n_inproc == d->cap_inproc) { /* room first: nothing to undo after the insert */
        size_t cap = d->cap_inproc ? 2 * d->cap_inproc : 4;
        struct inproc_ref *r = realloc(d->inproc, cap * sizeof *r);
        if (!r) {
            afp_errf(d->errbuf, sizeof d->errbuf, "resolve: out of memory");
            return AFP_ENOMEM;
        }
        d->inproc = r;
        d->cap_inproc = cap;
    }
    struct inproc *e = NULL;
    rc = inproc_resolve(d, addr, len, &e);
    if (rc)
        return rc;
    char *path = NULL;
    if (!e && (rc = shm_peer_add(d, padded, len + 1, &path)))
        return rc;
    if (e && d->shm117) /* its region, for check_dropped (its lifetime is inproc's business) */
        path = shm_path(padded, len + 1);
    fi_addr_t fa = FI_ADDR_NOTAVAIL;
    int ret = fi_av_insert(d->av, padded, 1, &fa, 0, NULL);
    if (ret != 1) {
        rc = fail(d, "fi_av_insert", ret < 0 ? ret : -FI_EINVAL);
        if (e)
            inproc_release(e);
        free(path);
        return rc;
    }
    if (e)
        d->inproc[d->n_inproc++] = (struct inproc_ref){fa, e};
    shm_peer_keep(d, fa, path);
    *peer = fa;
    return 0;
}

static int ofi_forget(afp_domain *d, uint64_t peer)
{
    fi_addr_t fa = peer;
    int ret = fi_av_remove(d->av, &fa, 1, 0);
    if (peer < d->n_shm_peers) {
        free(d->shm_peers[peer].path);
        d->shm_peers[peer].path = NULL;
    }
    for (size_t i = 0; i < d->n_inproc; i++) {
        if (d->inproc[i].fa != peer)
            continue;
        inproc_release(d->inproc[i].e); /* after the AV entry went: see ofi_close */
        d->inproc[i] = d->inproc[--d->n_inproc];
        break;
    }
    return ret ? fail(d, "fi_av_remove", ret) : 0;
}

/* ------------------------------------------------------------------------------------ */
/* Memory registration                                                                   */

static int ofi_reg_mr(afp_domain *d, void *addr, uint64_t len, uint32_t flags, int32_t device,
                      uint64_t requested_key, afp_mr **out, void **local_desc, uint64_t *rkey,
                      uint64_t *remote_base)
{
    struct fid_mr *mr = NULL;
    int rc, ret;

    if ((flags & AFP_MR_REMOTE_READ) && !d->reads) {
        afp_errf(d->errbuf, sizeof d->errbuf, "%s: no RMA read (FI_REMOTE_READ)", d->prov_name);
        return AFP_EUNSUPPORTED;
    }
    uint64_t access = FI_SEND | FI_RECV | FI_WRITE | FI_READ;
    if (flags & AFP_MR_REMOTE)
        access |= FI_REMOTE_WRITE;
    if (flags & AFP_MR_REMOTE_READ)
        access |= FI_REMOTE_READ;
    /* Real FI_MR_PROV_KEY: the provider ignores the request. Emulated: a key of our own
     * (unique per domain; never the shim's), so only the returned rkey works. */
    uint64_t key = d->prov_key ? 0 : d->emu_prov_key ? d->next_key++ : requested_key;

    if (flags & AFP_MR_DEVICE) {
        if (!d->hmem) {
            afp_errf(d->errbuf, sizeof d->errbuf,
                     "%s: no device-memory (FI_HMEM) support%s", d->prov_name,
                     strcmp(d->prov_name, "shm") == 0 || strncmp(d->prov_name, "tcp", 3) == 0
                         ? " (asked for only with AFABRIC_OFI_HMEM=1 and a CUDA-enabled "
                           "libfabric)"
                         : "");
            return AFP_EUNSUPPORTED;
        }
        struct iovec iov = {.iov_base = addr, .iov_len = len};
        struct fi_mr_attr attr = {
            .mr_iov = &iov,
            .iov_count = 1,
            .access = access,
            .requested_key = key,
            .iface = FI_HMEM_CUDA,
        };
        attr.device.cuda = device;
        ret = fi_mr_regattr(d->domain, &attr, 0, &mr);
    } else {
        ret = fi_mr_reg(d->domain, addr, len, access, 0, key, 0, &mr, NULL);
    }
    if (ret) {
        fail(d, "fi_mr_reg", ret);
        return ret == -FI_ENOMEM ? AFP_ENOMEM : AFP_EREG;
    }
    if (d->mr_endpoint) { /* such MRs only work once bound to the endpoint and enabled */
        ret = fi_mr_bind(mr, &d->ep->fid, 0);
        if (ret) {
            fail(d, "fi_mr_bind", ret);
            rc = AFP_EREG;
            goto out_close;
        }
        ret = fi_mr_enable(mr);
        if (ret) {
            fail(d, "fi_mr_enable", ret);
            rc = AFP_EREG;
            goto out_close;
        }
    }
    /* A local-only region may have no key at all (libfabric 2.x tcp: FI_KEY_NOTAVAIL);
     * for a remote one that value means keys beyond 64 bits (fi_mr_raw_attr): unserved. */
    uint64_t k = fi_mr_key(mr);
    if (k == FI_KEY_NOTAVAIL && (flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ))) {
        afp_errf(d->errbuf, sizeof d->errbuf, "%s: memory keys need fi_mr_raw_attr",
             d->prov_name);
        rc = AFP_EUNSUPPORTED;
        goto out_close;
    }
    *local_desc = d->mr_local ? fi_mr_desc(mr) : NULL;
    *rkey = k;
    *remote_base = d->virt_addr ? (uint64_t)(uintptr_t)addr : 0;
    *out = (afp_mr *)mr;
    return 0;

out_close:
    ret = fi_close(&mr->fid);
    (void)ret; /* the error being reported is the first one */
    return rc;
}

static int ofi_dereg_mr(afp_domain *d, afp_mr *mr)
{
    int ret = fi_close(&((struct fid_mr *)mr)->fid);
    return ret ? fail(d, "fi_close(mr)", ret) : 0;
}

/* ------------------------------------------------------------------------------------ */
/* Posting                                                                               */

/* Writes, or with `read` reads (fi_readmsg: the same message, remote -> local). */
static int post_rma(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted, bool read)
{
    /* Work-request template: the message's shape is fixed for the batch; each write only
     * changes addresses, lengths, key, peer, immediate and context. */
    struct iovec iov;
    void *desc;
    struct fi_rma_iov rma;
    struct fi_msg_rma msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = 1,
        .rma_iov = &rma,
        .rma_iov_count = 1,
    };
    uint32_t i;
    int rc = 0;
    uint64_t now = d->n_shm_peers ? mono_ns() : 0;
    if (d->shm117)
        take_dead(d);

    for (i = 0; i < n; i++) {
        const afp_write *w = &wr[i];
        if (d->n_shm_peers && shm_file_gone(d, w->peer, now)) {
            rc = AFP_EPEER;
            break;
        }
        if (w->length > d->max_msg_size) {
            afp_errf(d->errbuf, sizeof d->errbuf, "%s of %llu bytes > %s max %llu",
                 read ? "read" : "write", (unsigned long long)w->length, d->prov_name,
                 (unsigned long long)d->max_msg_size);
            rc = AFP_ETOOBIG;
            break;
        }
        if (d->n_inproc && inproc_gone(d, w->peer)) {
            rc = AFP_EPEER;
            break;
        }
        struct ofi_op *op = op_get(d, AFP_EV_WRITE_DONE, w->ctx);
        if (!op) {
            rc = AFP_EAGAIN; /* every context in flight: the shim polls, then retries */
            break;
        }
        op_to(d, op, w->peer);
        op->rma = read ? OFI_RMA_READ : OFI_RMA_WRITE;
        op->key = w->remote_key;
        iov.iov_base = w->local_addr;
        iov.iov_len = w->length;
        desc = w->local_desc;
        /* Zero-length (immediate-only) write: no local buffer, so an MR_LOCAL provider
         * never looks at a NULL descriptor; the remote side keeps a real address and key
         * (EFA rejects a zero-length write without them). */
        msg.iov_count = w->length ? 1 : 0;
        rma.addr = w->remote_addr;
        rma.len = w->length;
        rma.key = w->remote_key;
        msg.addr = w->peer;
        msg.context = op;
        msg.data = w->imm;
        /* Delivery-complete for zero-length writes too where the provider completes them
         * (zero_len_dc): only then is an immediate-only write the target refused an error. */
        uint64_t flags = w->length || d->zero_len_dc ? d->write_flags : FI_COMPLETION;
        if (w->has_imm)
            flags |= FI_REMOTE_CQ_DATA;
        /* a read completes locally once its data is here: no delivery level to ask for */
        ssize_t ret = read ? fi_readmsg(d->ep, &msg, FI_COMPLETION) : fi_writemsg(d->ep, &msg, flags);
        if (ret) {
            op_put(d, op);
            /* -FI_EAGAIN: provider queue full or peer connecting. Never poll here: the
             * events would have nowhere to go. */
            rc = ret == -FI_EAGAIN ? AFP_EAGAIN
                                   : fail(d, read ? "fi_readmsg" : "fi_writemsg", ret);
            break;
        }
        kick(d, w->peer);
    }
    *posted = i;
    return rc;
}

static int ofi_post_writes(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted)
{
    return post_rma(d, wr, n, posted, false);
}

static int ofi_post_reads(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted)
{
    if (!d->reads) {
        *posted = 0;
        afp_errf(d->errbuf, sizeof d->errbuf, "%s: no RMA read (FI_READ)", d->prov_name);
        return AFP_EUNSUPPORTED;
    }
    return post_rma(d, wr, n, posted, true);
}

static int ofi_post_send(afp_domain *d, uint64_t peer, const void *buf, uint64_t len,
                         void *desc, uint64_t ctx)
{
    if (len > d->max_msg_size) {
        afp_errf(d->errbuf, sizeof d->errbuf, "send of %llu bytes > %s max %llu",
             (unsigned long long)len, d->prov_name, (unsigned long long)d->max_msg_size);
        return AFP_ETOOBIG;
    }
    if (d->shm117)
        take_dead(d);
    if ((d->n_inproc && inproc_gone(d, peer)) ||
        (d->n_shm_peers && shm_file_gone(d, peer, mono_ns())))
        return AFP_EPEER;
    struct ofi_op *op = op_get(d, AFP_EV_SEND_DONE, ctx);
    if (!op)
        return AFP_EAGAIN;
    op_to(d, op, peer);
    struct iovec iov = {.iov_base = (void *)(uintptr_t)buf, .iov_len = len};
    struct fi_msg msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = len ? 1 : 0,
        .addr = peer,
        .context = op,
    };
    ssize_t ret = fi_sendmsg(d->ep, &msg, FI_COMPLETION);
    if (ret) {
        op_put(d, op);
        return ret == -FI_EAGAIN ? AFP_EAGAIN : fail(d, "fi_sendmsg", ret);
    }
    kick(d, peer);
    return 0;
}

static int ofi_post_recv(afp_domain *d, void *buf, uint64_t len, void *desc, uint64_t ctx)
{
    struct ofi_op *op = op_get(d, AFP_EV_RECV, ctx);
    if (!op)
        return AFP_EAGAIN;
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_msg msg = {
        .msg_iov = &iov,
        .desc = &desc,
        .iov_count = 1,
        .addr = FI_ADDR_UNSPEC,
        .context = op,
    };
    ssize_t ret = fi_recvmsg(d->ep, &msg, FI_COMPLETION);
    if (ret) {
        op_put(d, op);
        return ret == -FI_EAGAIN ? AFP_EAGAIN : fail(d, "fi_recvmsg", ret);
    }
    if (d->emu_rx_cq_data) {
        rx_link(d, op);
        emu_assign(d); /* an immediate may be waiting for exactly this receive */
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Completions                                                                           */

/* Whether an error completion of a one-sided operation is its target's refusal of the key
 * or range: libfabric's key errors, and tcp;ofi_rxm 1.17's answer to a key its target does
 * not know (FI_ECANCELED with ENOENT, where a reset connection gives ECONNRESET & co). */
static bool key_refused(const struct ofi_op *op, int err, int prov_errno)
{
    if (!op || !op->rma)
        return false;
    return err == FI_EKEYREJECTED || err == FI_ENOKEY || err == FI_EACCES ||
           (err == FI_ECANCELED && prov_errno == ENOENT);
}

/* The text of a refused one-sided operation: what the initiator can know (the target
 * refused this key: deregistered there, or never valid) and what the provider said. */
static void refused_text(const struct ofi_op *op, afp_event *ev, const char *why)
{
    bool rd = op->rma == OFI_RMA_READ;
    snprintf(ev->errtext, sizeof ev->errtext,
             "the target refused the %s %s remote key %016llx: its region was deregistered, or "
             "the key or range is not valid there (%.110s)",
             rd ? "read" : "write", rd ? "from" : "to", (unsigned long long)op->key, why);
}

/* One CQ entry -> at most one event; returns whether *ev was filled. */
static bool on_entry(afp_domain *d, const struct fi_cq_data_entry *e, afp_event *ev)
{
    struct ofi_op *op = op_from_ctx(d, e->op_context);

    memset(ev, 0, sizeof *ev);
    /* A remote write with immediate. Its entry's flags and len differ between providers
     * and its op_context may be NULL: only FI_REMOTE_CQ_DATA and data are reliable.
     * But 1.17's sockets provider also sets FI_REMOTE_CQ_DATA on the sender's own
     * completion of a write with immediate: an entry for one of our writes or sends is
     * never an arrival. */
    bool local = op && (op->kind == AFP_EV_WRITE_DONE || op->kind == AFP_EV_SEND_DONE);
    if ((e->flags & FI_REMOTE_CQ_DATA) && !local) {
        ev->kind = AFP_EV_IMM;
        ev->imm = (uint32_t)e->data;
        if (op && op->kind == AFP_EV_RECV && !op->stolen) {
            /* FI_RX_CQ_DATA: the immediate consumed this receive */
            emu_rx_done(d, op);
            ev->ctx = op->user_ctx;
            op_put(d, op);
            return true;
        }
        if (d->emu_rx_cq_data) {
            if (!imm_push(d, ev->imm)) {
                ev->status = AFP_ENOMEM; /* deliver it unpaired rather than lose it */
                snprintf(ev->errtext, sizeof ev->errtext, "emulated FI_RX_CQ_DATA: no memory");
                return true;
            }
            emu_assign(d);
            return false; /* reported when the cancel of its receive completes */
        }
        return true;
    }
    if (!op)
        return false; /* not ours and no immediate (e.g. an RMA event): nothing to say */
    ev->kind = op->kind;
    ev->ctx = op->user_ctx;
    if (op->kind == AFP_EV_RECV)
        ev->len = e->len;
    else if (d->shm117 && (op->dropped || op_went_to_dead(d, op))) {
        /* released by take_dead or check_dropped, perhaps as a success (ofi_shmfence.c):
         * not delivered */
        ev->op = op->kind;
        ev->kind = AFP_EV_ERROR;
        ev->status = op->dropped ? AFP_EKEY : AFP_EPEER;
        if (op->dropped)
            refused_text(op, ev, "shm: no answer; libfabric 1.17's shm drops what it refuses");
        else
            snprintf(ev->errtext, sizeof ev->errtext, "peer process exited (%s)", d->prov_name);
    }
    bool was_stolen = op->stolen;
    emu_rx_done(d, op);
    op_put(d, op);
    if (was_stolen)
        emu_assign(d); /* the message won the race: its immediate needs another receive */
    return true;
}

/* Reads one error entry of `cq`; returns 1 if *ev was filled, 0 if not, or a negative AFS
 * code. */
static int on_error(afp_domain *d, struct fid_cq *cq, afp_event *ev)
{
    struct fi_cq_err_entry ee;
    memset(&ee, 0, sizeof ee); /* err_data_size 0: the provider lends its own buffer */
    ssize_t ret = fi_cq_readerr(cq, &ee, 0);
    if (ret == -FI_EAGAIN)
        return 0;
    if (ret < 0)
        return fail(d, "fi_cq_readerr", ret);

    struct ofi_op *op = op_from_ctx(d, ee.op_context);
    memset(ev, 0, sizeof *ev);
    if (op && op->stolen && ee.err == FI_ECANCELED) {
        /* Emulated FI_RX_CQ_DATA: the receive is free; the immediate consumed it. */
        d->stealing--;
        ev->kind = AFP_EV_IMM;
        ev->imm = op->stolen_imm;
        ev->ctx = op->user_ctx;
        op_put(d, op);
        return 1;
    }

    ev->kind = AFP_EV_ERROR;
    ev->status = map_errno(ee.err);
    /* tcp;ofi_rxm (1.17) cancels what was in flight on a connection the peer's side reset
     * (its process died): FI_ECANCELED with the socket's errno as prov_errno. */
    int pe = ee.prov_errno < 0 ? -ee.prov_errno : ee.prov_errno;
    if (ee.err == FI_ECANCELED && (pe == ENOTCONN || pe == ECONNRESET || pe == EPIPE ||
                                   pe == ECONNREFUSED || pe == ECONNABORTED))
        ev->status = AFP_EPEER;
    if (op) {
        ev->ctx = op->user_ctx;
        ev->op = op->kind;
    } else {
        /* target-side failure (e.g. of a remote write): no operation of ours */
        ev->op = ee.flags & FI_REMOTE_CQ_DATA ? AFP_EV_IMM : 0;
    }
    char prov_text[AFP_ERRTEXT_LEN];
    const char *pt = fi_cq_strerror(cq, ee.prov_errno, ee.err_data, prov_text,
                                    sizeof prov_text);
    if (key_refused(op, ee.err, pe)) {
        char said[AFP_ERRTEXT_LEN / 2];
        snprintf(said, sizeof said, "%.24s said: %.40s: %.40s", d->prov_name,
                 d->lib->strerror(ee.err), pt ? pt : "");
        ev->status = AFP_EKEY;
        refused_text(op, ev, said);
    } else {
        snprintf(ev->errtext, sizeof ev->errtext, "%s: %s: %s", d->prov_name,
                 d->lib->strerror(ee.err), pt ? pt : "");
    }
    if (op) {
        bool was_stolen = op->stolen;
        emu_rx_done(d, op);
        op_put(d, op);
        if (was_stolen)
            emu_assign(d);
    }
    return 1;
}

/* Whether fd is readable now (without waiting). */
static bool fd_ready(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) > 0 && (p.revents & POLLIN);
}

/* Reads `cq` into ev[*n..max): its entries' events, with their senders in src when
 * `named` (fi_cq_readfrom); 0 or a negative AFS code. */
static int read_cq(afp_domain *d, struct fid_cq *cq, bool named, afp_event *ev, uint64_t *src,
                   uint32_t max, uint32_t *n, bool *busy)
{
    struct fi_cq_data_entry ent[OFI_POLL_BATCH];
    fi_addr_t from[OFI_POLL_BATCH];
    uint32_t got = *n;
    int rc = 0;
    /* Each entry yields at most one event, so reading no more entries than there are
     * free event slots means nothing read is ever dropped. */
    while (got < max) {
        size_t want = max - got < OFI_POLL_BATCH ? max - got : OFI_POLL_BATCH;
        uint64_t t0 = d->wait_fd < 0 ? mono_ns() : 0;
        ssize_t ret = named ? fi_cq_readfrom(cq, ent, want, from) : fi_cq_read(cq, ent, want);
        *busy |= ret == -FI_EAGAIN && d->wait_fd < 0 && mono_ns() - t0 > OFI_BUSY_POLL_NS;
        if (ret > 0) {
            for (ssize_t i = 0; i < ret; i++) {
                if (!on_entry(d, &ent[i], &ev[got]))
                    continue;
                if (src) {
                    bool trusted = ev[got].kind == AFP_EV_RECV ? d->src_msg
                                   : ev[got].kind == AFP_EV_IMM ? d->src_imm
                                                                : false;
                    fi_addr_t fa = named ? from[i] : FI_ADDR_NOTAVAIL;
                    bool known = fa != FI_ADDR_NOTAVAIL && fa != d->self_fa;
                    src[got] = !named || !trusted ? AFP_SRC_UNKNOWN
                               : known            ? (uint64_t)fa
                                                  : AFP_SRC_UNRESOLVED;
                }
                got++;
            }
            continue;
        }
        if (ret == -FI_EAGAIN)
            break;
        if (ret == -FI_EAVAIL) {
            if (src)
                src[got] = AFP_SRC_UNKNOWN;
            int r = on_error(d, cq, &ev[got]);
            if (r < 0) {
                rc = r;
                break;
            }
            if (r == 0)
                break; /* advertised error vanished; do not spin on it */
            got += (uint32_t)r;
            continue;
        }
        rc = fail(d, "fi_cq_read", ret);
        break;
    }
    *n = got;
    return rc;
}

/* Polls; with `src`, each event's sender as a resolve handle where FI_SOURCE names it
 * exactly (trust_sources), AFP_SRC_UNRESOLVED for a sender it says was never resolved, and
 * AFP_SRC_UNKNOWN for the rest: events whose source the provider leaves unset (remote CQ
 * data over tcp;ofi_rxm), untested providers, error entries and the emulated FI_RX_CQ_DATA
 * path. Only what libfabric states is passed on. */
static int poll_src(afp_domain *d, afp_event *ev, uint64_t *src, uint32_t max, uint32_t *n)
{
    uint32_t got = 0;
    int rc = 0;

    if (d->shm117) { /* before reading: released slots complete in this very call */
        uint64_t now = mono_ns();
        take_dead(d);
        check_dropped(d, now);
        if (d->wake.hdr) {
            ofi_wake_awake(&d->wake);
            rekick(d, now);
        }
    }
    /* A remote write without an immediate shows nowhere where the provider counts no remote
     * writes (1.17 tcp;ofi_rxm): its wait object ready before this call and drained by it is
     * the sign that bytes came in and its progress took them, so an adaptive target keeps
     * polling instead of napping until the next write wakes it (AFP_ACTIVITY_ARRIVED). One
     * that stays ready is not counted: a listening socket whose accept fails with EMFILE
     * stays readable however often progress runs (FRUITLESS_WAKES, shim/worker.c). */
    bool arriving = !d->rw_cntr && d->wait_fd >= 0 && fd_ready(d->wait_fd);
    bool busy = false, named = src && d->source;
    if (!d->rx_cq) {
        rc = read_cq(d, d->cq, named, ev, src, max, &got, &busy);
    } else {
        /* two CQs, first one then the other: neither starves the other of event slots */
        struct fid_cq *order[2] = {d->cq, d->rx_cq};
        if (d->rx_first) {
            order[0] = d->rx_cq;
            order[1] = d->cq;
        }
        d->rx_first = !d->rx_first;
        for (int k = 0; k < 2 && rc == 0; k++)
            rc = read_cq(d, order[k], named && order[k] == d->rx_cq, ev, src, max, &got, &busy);
    }
    uint64_t landed = 0;
    if (d->rw_cntr) {
        uint64_t c = fi_cntr_read(d->rw_cntr);
        landed = c - d->rw_seen;
    }
    /* Data moved without an event of our own (remote writes landed, or a long progress
     * call): an adaptive worker keeps polling instead of napping through the transfer. */
    if ((landed || (busy && got == 0)) && got < max) {
        memset(&ev[got], 0, sizeof ev[got]);
        ev[got].kind = AFP_EV_ACTIVITY;
        ev[got].len = landed;
        if (src)
            src[got] = AFP_SRC_UNKNOWN;
        d->rw_seen += landed;
        got++;
    }
    if (arriving && got == 0 && !fd_ready(d->wait_fd)) {
        memset(&ev[got], 0, sizeof ev[got]);
        ev[got].kind = AFP_EV_ACTIVITY;
        ev[got].op = AFP_ACTIVITY_ARRIVED;
        if (src)
            src[got] = AFP_SRC_UNKNOWN;
        got++;
    }
    *n = got;
    return got ? 0 : rc; /* events first; a persistent error shows on the next call */
}

static int ofi_poll(afp_domain *d, afp_event *ev, uint32_t max, uint32_t *n)
{
    return poll_src(d, ev, NULL, max, n);
}

static int ofi_poll_from(afp_domain *d, afp_event *ev, uint64_t *src, uint32_t max, uint32_t *n)
{
    return poll_src(d, ev, src, max, n);
}

static int ofi_trywait(afp_domain *d)
{
    if (d->wake.hdr) { /* 1.17 shm: nothing of ours in flight, nothing queued to us */
        if (d->tx_inflight || d->stealing || !self_region(d))
            return AFP_EAGAIN;
        ofi_wake_sleepy(&d->wake);
        if (ofi_shm_idle(d->self_base, d->self_len))
            return 0;
        ofi_wake_awake(&d->wake);
        return AFP_EAGAIN;
    }
    /* No fd to sleep on, or emulation work whose events come from our own cancels. */
    if (d->wait_fd < 0 || d->stealing)
        return AFP_EAGAIN;
    struct fid *fid = &d->cq->fid;
    int ret = fi_trywait(d->fabric, &fid, 1);
    if (ret == 0)
        return 0;
    if (ret != -FI_EAGAIN)
        fail(d, "fi_trywait", ret); /* keep polling: spinning is always correct */
    return AFP_EAGAIN;
}

/* The watch thread's news of a dead same-host peer (any thread; `d->shm117` and the address
 * are all it reads). */
static void ofi_peer_exited(afp_domain *d, const void *addr, size_t len, uint32_t pid)
{
    if (!d->shm117)
        return;
    char *path = shm_path(addr, len);
    if (path) {
        (void)ofi_shm_fence(path, pid); /* best effort: the shim's stuck-worker watch stays */
        pthread_mutex_lock(&d->dead_mu); /* the worker fails what is pending to it */
        char **t = realloc(d->dead_paths, (d->n_dead_paths + 1) * sizeof *t);
        if (t) {
            d->dead_paths = t;
            d->dead_paths[d->n_dead_paths++] = path;
            path = NULL;
        }
        pthread_mutex_unlock(&d->dead_mu);
        atomic_fetch_add_explicit(&d->dead_news, 1, memory_order_release);
    }
    free(path);
    if (d->self_path) /* it may have died writing to us, inside our region's lock */
        (void)ofi_shm_unwedge_self(d->self_path);
}

/* ------------------------------------------------------------------------------------ */

static const struct afp_ops g_ops = {
    .size = sizeof(struct afp_ops),
    .major = AFP_ABI_MAJOR,
    .minor = AFP_ABI_MINOR,
    .name = "ofi",
    .list_nics = ofi_list_nics,
    .open = ofi_open,
    .close = ofi_close,
    .errbuf = ofi_errbuf,
    .caps = ofi_caps,
    .address = ofi_address,
    .reg_mr = ofi_reg_mr,
    .dereg_mr = ofi_dereg_mr,
    .resolve = ofi_resolve,
    .forget = ofi_forget,
    .post_writes = ofi_post_writes,
    .post_send = ofi_post_send,
    .post_recv = ofi_post_recv,
    .poll = ofi_poll,
    .trywait = ofi_trywait,
    .poll_from = ofi_poll_from,
    .post_reads = ofi_post_reads,
    .peer_exited = ofi_peer_exited,
};

__attribute__((visibility("default"))) const struct afp_ops *afp_get_ops(void)
{
    return &g_ops;
}
