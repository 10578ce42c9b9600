/* The CPU side shared by the node-local providers (nvlink, cma): see node_core.h. Moved out
 * of providers/nvlink/nvlink.c unchanged in behaviour; error texts name the provider
 * (mb_kind.name). */
#include "node_core.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CERR(c, code, fmt, ...)                                                                \
    AFN_ERR(c, code, fmt " [%s]", ##__VA_ARGS__, (c)->kind->name)

uint64_t afn_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void read_boot_id(uint8_t out[16])
{
    memset(out, 0, 16);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f)
        return;
    char line[64] = "";
    if (fgets(line, sizeof line, f)) {
        uint32_t n = 0;
        for (char *p = line; *p && n < 32; p++) {
            int v = (*p >= '0' && *p <= '9') ? *p - '0'
                    : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10
                                               : -1;
            if (v < 0)
                continue;
            out[n / 2] |= (uint8_t)(n % 2 ? v : v << 4);
            n++;
        }
    }
    fclose(f);
}

void *afn_grow(void *p, uint32_t *cap, uint32_t need, size_t elem)
{
    if (need <= *cap)
        return p;
    uint32_t c = *cap ? *cap : 16;
    while (c < need)
        c *= 2;
    void *q = realloc(p, (size_t)c * elem);
    if (q)
        *cap = c;
    return q;
}

char *afn_dup_text(const char *fmt, ...)
{
    char buf[AFP_ERRTEXT_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return strdup(buf);
}

/* ------------------------------------------------------------------------------------ */
/* Domain                                                                                */

int afn_open(afn_core *c, const mb_kind *kind, uint32_t addr_magic, uint64_t token, char *err,
             size_t errlen)
{
    c->kind = kind;
    c->addr_magic = addr_magic;
    c->wake_fd = c->send_fd = -1;
    c->seg.fd = -1;
    c->free_exports = UINT32_MAX;
    c->token = token ? token : 1;
    read_boot_id(c->boot_id);
    c->export_next = calloc(MB_EXPORTS, sizeof *c->export_next);
    if (!c->export_next) {
        afp_errf(err, errlen, "out of memory");
        return AFP_ENOMEM;
    }
    mb_reap(kind); /* segments of killed processes */
    if (mb_create(&c->seg, kind, c->token, err, errlen) != 0)
        return AFP_EIO;
    /* wakeups: optional (without them the shim naps at most 1 ms between polls) */
    struct sockaddr_un sa;
    socklen_t sl;
    mb_wake_name(kind, c->token, &sa, &sl);
    c->wake_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (c->wake_fd >= 0 && bind(c->wake_fd, (struct sockaddr *)&sa, sl) != 0) {
        close(c->wake_fd);
        c->wake_fd = -1;
    }
    c->send_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    return 0;
}

void afn_close(afn_core *c)
{
    for (uint32_t i = 0; i < c->npeers; i++)
        if (c->peers[i].used)
            mb_detach(&c->peers[i].seg, false);
    for (uint32_t i = 0; i < c->evq_len; i++)
        free(c->evq[(c->evq_head + i) % c->evq_cap].text);
    for (uint32_t i = 0; i < c->nheld; i++)
        free(c->held[i].text);
    mb_detach(&c->seg, true);
    if (c->wake_fd >= 0)
        close(c->wake_fd);
    if (c->send_fd >= 0)
        close(c->send_fd);
    free(c->evq);
    free(c->rq);
    free(c->held);
    free(c->imports);
    free(c->peers);
    free(c->export_next);
}

/* ------------------------------------------------------------------------------------ */
/* Completions                                                                           */

void afn_push_ev(afn_core *c, uint32_t kind, int32_t status, uint64_t ctx, uint32_t imm,
                 uint64_t len, uint32_t op, char *text)
{
    if (c->evq_len == c->evq_cap) {
        uint32_t cap = c->evq_cap ? c->evq_cap * 2 : 256;
        afn_ev *q = malloc((size_t)cap * sizeof *q);
        if (!q) { /* cannot queue it: the shim's op timeout fails the operation */
            free(text);
            return;
        }
        for (uint32_t i = 0; i < c->evq_len; i++)
            q[i] = c->evq[(c->evq_head + i) % c->evq_cap];
        free(c->evq);
        c->evq = q;
        c->evq_cap = cap;
        c->evq_head = 0;
    }
    afn_ev *e = &c->evq[(c->evq_head + c->evq_len) % c->evq_cap];
    *e = (afn_ev){kind, op, status, imm, ctx, len, text};
    c->evq_len++;
}

void afn_write_failed(afn_core *c, uint64_t ctx, int status, char *text)
{
    afn_push_ev(c, AFP_EV_ERROR, status, ctx, 0, 0, AFP_EV_WRITE_DONE, text);
}

/* ------------------------------------------------------------------------------------ */
/* Peers                                                                                 */

afn_peer *afn_peer_of(afn_core *c, uint64_t handle)
{
    if (handle == 0 || handle > c->npeers || !c->peers[handle - 1].used)
        return NULL;
    return &c->peers[handle - 1];
}

bool afn_peer_alive(afn_peer *p, bool force)
{
    if (p->dead)
        return false;
    uint64_t t = afn_now_ns();
    if (force || t - p->checked_ns > AFN_LIVENESS_NS) {
        p->checked_ns = t;
        int st = mb_owner_state(&p->seg);
        if (st != MB_OWNER_LIVE) {
            p->dead = true;
            p->gone = (uint8_t)st;
        }
    }
    return !p->dead;
}

const char *afn_gone_text(const afn_peer *p, char *buf, size_t len)
{
    if (p->gone == MB_OWNER_CLOSED)
        snprintf(buf, len, "peer (process %d): its engine was closed", (int)p->pid);
    else
        snprintf(buf, len, "peer process %d is gone", (int)p->pid);
    return buf;
}

/* force: whether it sleeps or not (its ring needs its attention: a reset) */
static void wake_peer(afn_core *c, afn_peer *p, bool force)
{
    if ((!force && !atomic_load_explicit(&p->seg.hdr->sleeping, memory_order_acquire)) ||
        c->send_fd < 0)
        return;
    char one = 1;
    (void)sendto(c->send_fd, &one, 1, MSG_DONTWAIT, (struct sockaddr *)&p->wake, p->wake_len);
}

/* Appends a record to a peer's mailbox: 0, AFP_EAGAIN (full or busy: try again) or an
 * error with its text in `why` (AFP_EPEER: the peer is gone or closed, or its mailbox is
 * corrupt or wedged; AFP_ETOOBIG). */
static int push_to(afn_core *c, afn_peer *p, uint32_t kind, uint32_t imm, uint64_t arg,
                   const void *payload, uint64_t len, char *why, size_t whylen)
{
    char text[AFP_ERRTEXT_LEN];
    if (!afn_peer_alive(p, false)) {
        snprintf(why, whylen, "%s", afn_gone_text(p, text, sizeof text));
        return AFP_EPEER;
    }
    int rc = mb_push(&p->seg, c->token, kind, imm, arg, payload, len, text, sizeof text);
    if (rc == 0 || rc == -ESTALE) {
        wake_peer(c, p, rc == -ESTALE);
        return rc ? AFP_EAGAIN : 0;
    }
    if (rc == -EINVAL) {
        snprintf(why, whylen, "message of %llu bytes exceeds %s's %u", (unsigned long long)len,
                 c->kind->name, MB_MAX_MSG);
        return AFP_ETOOBIG;
    }
    if (!afn_peer_alive(p, true)) {
        snprintf(why, whylen, "%s", afn_gone_text(p, text, sizeof text));
        return AFP_EPEER;
    }
    if (rc == -EAGAIN)
        return AFP_EAGAIN;
    afp_errf(why, whylen, "peer (process %d): %s", (int)p->pid, text);
    return AFP_EPEER; /* -EBADMSG, -EDEADLK */
}

/* Deliver op's arrivals of its immediate (op->arrivals goes down as records go out, at most
 * MB_MAX_ARRIVALS per record). 0, AFP_EAGAIN or AFP_EPEER with `why`. */
static int deliver_imm(afn_core *c, afn_op *op, char *why, size_t whylen)
{
    afn_peer *p = afn_peer_of(c, op->peer);
    if (!p) {
        snprintf(why, whylen, "unknown peer handle %llu", (unsigned long long)op->peer);
        return AFP_EPEER;
    }
    while (op->arrivals) {
        uint64_t n = op->arrivals < MB_MAX_ARRIVALS ? op->arrivals : MB_MAX_ARRIVALS;
        int rc = push_to(c, p, MB_REC_IMM, op->imm, n, NULL, 0, why, whylen);
        if (rc)
            return rc;
        op->arrivals -= n;
    }
    return 0;
}

void afn_finish_op(afn_core *c, afn_op *op)
{
    if (op->status) {
        afn_write_failed(c, op->ctx, op->status, op->text);
        op->text = NULL;
        return;
    }
    if (op->arrivals) {
        char why[AFP_ERRTEXT_LEN] = "";
        int rc = deliver_imm(c, op, why, sizeof why);
        if (rc == AFP_EAGAIN) { /* the target is not draining: retry on the next poll */
            afn_op *h = afn_grow(c->held, &c->held_cap, c->nheld + 1, sizeof *h);
            if (h) {
                c->held = h;
                c->held[c->nheld++] = *op;
                return;
            }
            rc = AFP_ENOMEM;
            snprintf(why, sizeof why, "out of memory");
        }
        if (rc) {
            afn_write_failed(c, op->ctx, rc,
                             afn_dup_text("immediate %u not delivered: %s [%s]", op->imm, why,
                                          c->kind->name));
            return;
        }
    }
    afn_push_ev(c, AFP_EV_WRITE_DONE, 0, op->ctx, 0, 0, 0, NULL);
}

static void retry_held(afn_core *c)
{
    uint32_t n = c->nheld;
    c->nheld = 0;
    for (uint32_t i = 0; i < n; i++) {
        afn_op op = c->held[i];
        afn_finish_op(c, &op); /* re-holds it if the mailbox is still full */
    }
}

/* ------------------------------------------------------------------------------------ */
/* Exports                                                                               */

uint32_t afn_export_take(afn_core *c)
{
    uint32_t idx;
    if (c->free_exports != UINT32_MAX) {
        idx = c->free_exports;
        c->free_exports = c->export_next[idx];
    } else if (c->next_export < MB_EXPORTS) {
        idx = c->next_export++;
    } else {
        idx = UINT32_MAX;
    }
    return idx;
}

uint64_t afn_export_publish(afn_core *c, uint32_t idx)
{
    mb_export *e = &mb_exports(&c->seg)[idx];
    uint64_t gen = atomic_load(&e->gen); /* even: free */
    atomic_store_explicit(&e->gen, gen + 1, memory_order_release); /* live */
    return ((gen + 1) << 32) | idx;
}

void afn_export_revoke(afn_core *c, uint32_t idx)
{
    mb_export *e = &mb_exports(&c->seg)[idx];
    atomic_store_explicit(&e->gen, atomic_load(&e->gen) + 1, memory_order_seq_cst); /* revoked */
    c->export_next[idx] = c->free_exports;
    c->free_exports = idx;
}

/* ------------------------------------------------------------------------------------ */
/* Imports: (peer, key) -> our view of the peer's region                                 */

static uint64_t imp_hash(uint64_t peer, uint64_t key)
{
    uint64_t x = key ^ (peer * 0x9e3779b97f4a7c15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static afn_import *imp_find(afn_core *c, uint64_t peer, uint64_t key)
{
    if (!c->imp_cap)
        return NULL;
    uint32_t mask = c->imp_cap - 1;
    for (uint32_t i = (uint32_t)imp_hash(peer, key) & mask, n = 0; n < c->imp_cap;
         i = (i + 1) & mask, n++) {
        afn_import *e = &c->imports[i];
        if (!e->key && !e->tomb)
            return NULL;
        if (!e->tomb && e->key == key && e->peer == peer)
            return e;
    }
    return NULL;
}

static afn_import *imp_insert(afn_core *c, uint64_t peer, uint64_t key)
{
    if ((c->imp_len + 1) * 2 > c->imp_cap) {
        uint32_t cap = c->imp_cap ? c->imp_cap * 2 : 256;
        afn_import *old = c->imports;
        uint32_t old_cap = c->imp_cap;
        afn_import *t = calloc(cap, sizeof *t);
        if (!t)
            return NULL;
        c->imports = t;
        c->imp_cap = cap;
        c->imp_len = 0;
        for (uint32_t i = 0; i < old_cap; i++)
            if (old[i].key && !old[i].tomb) {
                afn_import *e = imp_insert(c, old[i].peer, old[i].key);
                *e = old[i];
            }
        free(old);
    }
    uint32_t mask = c->imp_cap - 1;
    uint32_t i = (uint32_t)imp_hash(peer, key) & mask;
    while (c->imports[i].key && !c->imports[i].tomb)
        i = (i + 1) & mask;
    afn_import *e = &c->imports[i];
    memset(e, 0, sizeof *e);
    e->peer = peer;
    e->key = key;
    c->imp_len++;
    return e;
}

void afn_forget_imports(afn_core *c, uint64_t peer)
{
    for (uint32_t i = 0; i < c->imp_cap; i++)
        if (c->imports[i].peer == peer && c->imports[i].key && !c->imports[i].tomb)
            c->imports[i].tomb = true;
}

/* Copy a live export entry out of the peer's table (seqlock): 0, or AFP_EKEY if the key
 * does not name a live entry. */
static int read_export(afn_peer *p, uint64_t key, mb_export *out)
{
    uint32_t idx = (uint32_t)(key & 0xffffffffu);
    uint64_t gen = key >> 32;
    if (idx >= MB_EXPORTS || !(gen & 1u))
        return AFP_EKEY;
    mb_export *e = &mb_exports(&p->seg)[idx];
    uint64_t g1 = atomic_load_explicit(&e->gen, memory_order_acquire);
    memcpy((uint8_t *)out + sizeof out->gen, (uint8_t *)e + sizeof e->gen,
           sizeof *e - sizeof e->gen);
    atomic_thread_fence(memory_order_acquire);
    uint64_t g2 = atomic_load_explicit(&e->gen, memory_order_relaxed);
    if (g1 != gen || g2 != gen)
        return AFP_EKEY;
    return 0;
}

int afn_translate(afn_core *c, uint64_t peer, uint64_t key, uint64_t raddr, uint64_t len,
                  uint32_t need, afn_map_fn map_fn, void *map_arg, afn_import **out)
{
    afn_peer *p = afn_peer_of(c, peer);
    if (!p)
        return CERR(c, AFP_EPEER, "unknown peer handle %llu", (unsigned long long)peer);
    char gone[AFP_ERRTEXT_LEN];
    if (!afn_peer_alive(p, false))
        return CERR(c, AFP_EPEER, "%s", afn_gone_text(p, gone, sizeof gone));
    afn_import *im = imp_find(c, peer, key);
    if (im && atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)im->gen_addr,
                                   memory_order_acquire) != key >> 32) {
        im->tomb = true; /* deregistered since: refused below */
        im = NULL;
    }
    if (!im) {
        mb_export e;
        if (read_export(p, key, &e))
            return CERR(c, AFP_EKEY,
                        "remote key %016llx is not (or no longer) registered at the target",
                        (unsigned long long)key);
        int64_t delta = 0;
        int rc = map_fn ? map_fn(map_arg, peer, &e, &delta) : 0;
        if (rc)
            return rc;
        im = imp_insert(c, peer, key);
        if (!im)
            return CERR(c, AFP_ENOMEM, "out of memory");
        im->gen_addr = (uint64_t)(uintptr_t)&mb_exports(&p->seg)[key & 0xffffffffu].gen;
        im->base = e.base;
        im->len = e.len;
        im->delta = delta;
        im->access = e.access ? e.access : AFP_MR_REMOTE;
    }
    if (!(im->access & need))
        return CERR(c, AFP_EKEY, "remote region does not allow %s (registered without it)",
                    need == AFP_MR_REMOTE_READ ? "reads" : "writes");
    if (raddr < im->base || len > im->len || raddr - im->base > im->len - len)
        return CERR(c, AFP_EKEY,
                    "remote access [%llx, +%llu) outside the registered region [%llx, +%llu)",
                    (unsigned long long)raddr, (unsigned long long)len,
                    (unsigned long long)im->base, (unsigned long long)im->len);
    *out = im;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Mailbox, polling                                                                      */

/* Our ring was corrupt (`why`): reset it, and report that once (report_reset). */
static void mailbox_corrupt(afn_core *c, uint64_t tail, const char *why)
{
    uint64_t dropped = mb_reset(&c->seg, tail);
    (void)mb_repair(&c->seg);
    c->mb_resets++;
    c->mb_report_pending = true;
    afp_errf(c->mb_report, sizeof c->mb_report,
             "this engine's mailbox was corrupt (%s): the %llu bytes of records in it were "
             "dropped, immediates or messages from peers may be lost (reset %llu) [%s]",
             why, (unsigned long long)dropped, (unsigned long long)c->mb_resets, c->kind->name);
}

/* A reset waiting to be reported fails the oldest posted receive with its text. */
static uint32_t report_reset(afn_core *c)
{
    if (!c->mb_report_pending || !c->rq_len)
        return 0;
    afn_recv rv = c->rq[c->rq_head];
    c->rq_head = (c->rq_head + 1) % c->rq_cap;
    c->rq_len--;
    c->mb_report_pending = false;
    afn_push_ev(c, AFP_EV_ERROR, AFP_EIO, rv.ctx, 0, 0, AFP_EV_RECV,
                afn_dup_text("%s", c->mb_report));
    return 1;
}

/* Our mailbox: immediates and messages from peers. At most `room` events, MB_DRAIN_RECORDS
 * records and MB_DRAIN_BYTES message bytes per call. */
static uint32_t drain_mailbox(afn_core *c, uint32_t room)
{
    mb_seg *s = &c->seg;
    uint32_t made = report_reset(c);
    char why[160];
    uint64_t tail = mb_tail(s, why, sizeof why);
    if (tail == s->head) {
        mb_publish_head(s); /* (repairs a head overwritten in the segment) */
        return made;
    }
    if (tail == UINT64_MAX) {
        mailbox_corrupt(c, tail, why);
        return made + report_reset(c);
    }
    uint32_t records = 0;
    uint64_t bytes = 0;
    mb_view v;
    int rc = 0;
    while (made < room && records < MB_DRAIN_RECORDS && bytes < MB_DRAIN_BYTES &&
           (rc = mb_next(s, tail, &v, why, sizeof why)) > 0) {
        records++;
        if (v.kind == MB_REC_IMM) {
            while (s->imm_done < v.arg && made < room) {
                afn_push_ev(c, AFP_EV_IMM, 0, 0, v.imm, 0, 0, NULL);
                s->imm_done++;
                made++;
            }
            if (s->imm_done < v.arg)
                break;
            mb_pop(s, &v);
            continue;
        }
        if (!c->rq_len)
            break; /* no receive posted: the message waits (the ring applies backpressure) */
        afn_recv rv = c->rq[c->rq_head];
        c->rq_head = (c->rq_head + 1) % c->rq_cap;
        c->rq_len--;
        if (v.arg > rv.len) {
            afn_push_ev(c, AFP_EV_ERROR, AFP_ETOOBIG, rv.ctx, 0, v.arg, AFP_EV_RECV,
                        afn_dup_text("message of %llu bytes truncated by a %llu-byte "
                                     "receive [%s]",
                                     (unsigned long long)v.arg, (unsigned long long)rv.len,
                                     c->kind->name));
        } else {
            memcpy(rv.buf, v.payload, v.arg);
            afn_push_ev(c, AFP_EV_RECV, 0, rv.ctx, 0, v.arg, 0, NULL);
        }
        bytes += v.bytes;
        made++;
        mb_pop(s, &v);
    }
    if (rc < 0) {
        mailbox_corrupt(c, tail, why);
        made += report_reset(c);
    }
    mb_publish_head(s);
    return made;
}

uint32_t afn_poll_events(afn_core *c, afp_event *ev, uint32_t max)
{
    if (atomic_load_explicit(&c->seg.hdr->sleeping, memory_order_relaxed)) {
        atomic_store(&c->seg.hdr->sleeping, 0);
        char junk[64];
        while (c->wake_fd >= 0 && recv(c->wake_fd, junk, sizeof junk, MSG_DONTWAIT) > 0) {
        }
    }
    if (++c->polls % AFN_REPAIR_POLLS == 0)
        (void)mb_repair(&c->seg);
    if (c->nheld)
        retry_held(c);
    if (c->evq_len < max)
        drain_mailbox(c, max - c->evq_len);
    uint32_t k = 0;
    while (k < max && c->evq_len) {
        afn_ev *e = &c->evq[c->evq_head];
        afp_event *o = &ev[k++];
        o->kind = e->kind;
        o->status = e->status;
        o->ctx = e->ctx;
        o->len = e->len;
        o->imm = e->imm;
        o->op = e->op;
        o->errtext[0] = '\0';
        if (e->text) {
            snprintf(o->errtext, sizeof o->errtext, "%s", e->text);
            free(e->text);
        }
        c->evq_head = (c->evq_head + 1) % c->evq_cap;
        c->evq_len--;
    }
    return k;
}

int afn_trywait(afn_core *c, bool busy)
{
    if (c->wake_fd < 0 || busy || c->nheld || c->evq_len)
        return AFP_EAGAIN;
    (void)mb_repair(&c->seg); /* (asleep, nobody else would) */
    atomic_store(&c->seg.hdr->sleeping, 1);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load(&c->seg.hdr->tail) != c->seg.head) {
        atomic_store(&c->seg.hdr->sleeping, 0);
        return AFP_EAGAIN;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Messages                                                                              */

int afn_post_send(afn_core *c, uint64_t peer, const void *buf, uint64_t len, uint64_t ctx)
{
    afn_peer *p = afn_peer_of(c, peer);
    if (!p) {
        afn_push_ev(c, AFP_EV_ERROR, AFP_EPEER, ctx, 0, 0, AFP_EV_SEND_DONE,
                    afn_dup_text("send: unknown peer handle %llu [%s]",
                                 (unsigned long long)peer, c->kind->name));
        return 0;
    }
    char why[AFP_ERRTEXT_LEN] = "";
    int rc = push_to(c, p, MB_REC_MSG, 0, len, buf, len, why, sizeof why);
    if (rc == AFP_EAGAIN)
        return rc;
    if (rc == AFP_ETOOBIG)
        return CERR(c, rc, "%s", why);
    if (rc) {
        afn_push_ev(c, AFP_EV_ERROR, rc, ctx, 0, 0, AFP_EV_SEND_DONE,
                    afn_dup_text("send: %s [%s]", why, c->kind->name));
        return 0;
    }
    afn_push_ev(c, AFP_EV_SEND_DONE, 0, ctx, 0, len, 0, NULL);
    return 0;
}

int afn_post_recv(afn_core *c, void *buf, uint64_t len, uint64_t ctx)
{
    if (c->rq_len == c->rq_cap) {
        uint32_t cap = c->rq_cap ? c->rq_cap * 2 : 64;
        afn_recv *q = malloc((size_t)cap * sizeof *q);
        if (!q)
            return CERR(c, AFP_ENOMEM, "out of memory");
        for (uint32_t i = 0; i < c->rq_len; i++)
            q[i] = c->rq[(c->rq_head + i) % c->rq_cap];
        free(c->rq);
        c->rq = q;
        c->rq_cap = cap;
        c->rq_head = 0;
    }
    c->rq[(c->rq_head + c->rq_len) % c->rq_cap] = (afn_recv){buf, len, ctx};
    c->rq_len++;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Addresses                                                                             */

int afn_address(afn_core *c, void *buf, size_t *len)
{
    if (*len < sizeof(afn_addr))
        return CERR(c, AFP_ERANGE, "address needs %zu bytes", sizeof(afn_addr));
    afn_addr a;
    memset(&a, 0, sizeof a);
    a.magic = c->addr_magic;
    a.version = MB_VERSION;
    a.token = c->token;
    memcpy(a.boot_id, c->boot_id, sizeof a.boot_id);
    snprintf(a.seg, sizeof a.seg, "%s", c->seg.name);
    memcpy(buf, &a, sizeof a);
    *len = sizeof a;
    return 0;
}

int afn_resolve(afn_core *c, const void *addr, size_t len, uint64_t *peer)
{
    afn_addr a;
    const char *name = c->kind->name;
    if (len != sizeof a)
        return CERR(c, AFP_EBADDESC, "not a%s %s address (%zu bytes)",
                    name[0] == 'n' ? "n" : "", name, len);
    memcpy(&a, addr, sizeof a);
    if (a.magic != c->addr_magic || a.version != MB_VERSION || a.seg[MB_NAME_LEN - 1] != '\0')
        return CERR(c, AFP_EBADDESC, "not a%s %s address (bad magic or version)",
                    name[0] == 'n' ? "n" : "", name);
    if (memcmp(a.boot_id, c->boot_id, sizeof a.boot_id) != 0)
        return CERR(c, AFP_EPEER, "peer is on another node: %s reaches the processes of one "
                                  "node only", name);
    for (uint32_t i = 0; i < c->npeers; i++)
        if (c->peers[i].used && c->peers[i].token == a.token) {
            *peer = i + 1;
            return 0;
        }
    afn_peer *ps = afn_grow(c->peers, &c->peers_cap, c->npeers + 1, sizeof *ps);
    if (!ps)
        return CERR(c, AFP_ENOMEM, "out of memory");
    c->peers = ps;
    afn_peer *p = &c->peers[c->npeers];
    memset(p, 0, sizeof *p);
    if (mb_attach(&p->seg, c->kind, a.seg, a.token, c->errbuf, sizeof c->errbuf) != 0) {
        /* a header overwritten is put back by its owner before it sleeps: wake it */
        struct sockaddr_un sa;
        socklen_t sl;
        mb_wake_name(c->kind, a.token, &sa, &sl);
        char one = 1;
        if (c->send_fd >= 0)
            (void)sendto(c->send_fd, &one, 1, MSG_DONTWAIT, (struct sockaddr *)&sa, sl);
        return AFP_EPEER;
    }
    int st = mb_owner_state(&p->seg);
    if (st != MB_OWNER_LIVE) {
        mb_detach(&p->seg, false);
        return CERR(c, AFP_EPEER, "peer %s %s", a.seg,
                    st == MB_OWNER_CLOSED ? "closed its engine" : "is gone");
    }
    p->pid = p->seg.pid;
    p->used = true;
    p->token = a.token;
    p->checked_ns = afn_now_ns();
    mb_wake_name(c->kind, a.token, &p->wake, &p->wake_len);
    c->npeers++;
    *peer = c->npeers;
    return 0;
}

int afn_forget(afn_core *c, uint64_t peer)
{
    afn_peer *p = afn_peer_of(c, peer);
    if (!p)
        return CERR(c, AFP_EINVAL, "unknown peer");
    afn_forget_imports(c, peer);
    mb_detach(&p->seg, false);
    p->used = false;
    return 0;
}
