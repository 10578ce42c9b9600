/*
 * Submitting operations. Everything a caller can get wrong is checked here, on the
 * caller's thread, before a request reaches the worker: a bad argument fails the call
 * itself with a typed code and nothing is posted.
 */
#include <linux/futex.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define MAX_CHUNK (1ull << 30) /* largest single work request of a contiguous write */

typedef struct mr_copy {
    uint64_t addr, len;
    uint32_t local_mask; /* the transports it is registered with */
    void *desc[AFS_ENG_NICS];
} mr_copy;

static int load_mr(afs_engine *eng, uint64_t id, mr_copy *out)
{
    afs_mr_entry *m = afs_slots_lookup(&eng->mrs, id);
    if (m) {
        out->addr = m->addr;
        out->len = m->len;
        out->local_mask = m->local_mask;
        memcpy(out->desc, m->desc, sizeof(out->desc));
        if (afs_slots_still(&eng->mrs, id))
            return 0;
    }
    return afs_fail(AFS_ESTALE, "local memory region is not registered with this engine "
                                "(deregistered, or from another engine)");
}

/* A peer whose NIC addresses a later incarnation has proved itself at has restarted: what
 * was imported from it is refused before anything is posted. So has one that is down by
 * its own state (exited, closed) where a later incarnation claims its NIC addresses. */
static int peer_current(afs_engine *eng, uint64_t peer_id)
{
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    uint64_t later = p ? atomic_load(&p->superseded_by) : 0;
    int32_t down = !later && p ? atomic_load(&p->down) : 0; /* peers.c */
    if (down == AFS_PEER_EXITED || down == AFS_PEER_CLOSED)
        later = afs_peer_later_claim(eng, p);
    if (down && !later)
        return afs_fail(AFS_EPEER, "peer %016llx: %s", (unsigned long long)p->incarnation,
                        afs_peer_down_text(down));
    if (p && !(atomic_load_explicit(&p->ka, memory_order_relaxed) & AFS_KA_USED))
        atomic_fetch_or(&p->ka, AFS_KA_USED); /* heartbeats go to it (keepalive.c) */
    return later ? afs_restarted_error(p->incarnation, later) : 0;
}

static int load_remote(afs_engine *eng, uint64_t id, afs_remote_entry *out)
{
    afs_remote_entry *r = afs_slots_lookup(&eng->remotes, id);
    if (r) {
        out->peer_id = r->peer_id;
        out->length = r->length;
        memcpy(out->fi_addr, r->fi_addr, sizeof(out->fi_addr));
        memcpy(out->rbase, r->rbase, sizeof(out->rbase));
        memcpy(out->key, r->key, sizeof(out->key));
        out->access = r->access;
        out->tp_mask = r->tp_mask;
        if (afs_slots_still(&eng->remotes, id))
            return peer_current(eng, out->peer_id);
    }
    return afs_fail(AFS_ESTALE, "remote descriptor handle is not live on this engine");
}

static bool range_ok(uint64_t off, uint64_t len, uint64_t size)
{
    return off <= size && len <= size - off;
}

static int check_imm(int64_t imm, bool *has, uint32_t *value)
{
    if (imm == AFS_NO_IMM) {
        *has = false;
        *value = 0;
        return 0;
    }
    if (imm < 0 || imm > (int64_t)UINT32_MAX)
        return afs_fail(AFS_EINVAL, "immediate %lld outside 0..4294967295", (long long)imm);
    *has = true;
    *value = (uint32_t)imm;
    return 0;
}

/* The route's NICs (transport `tp`) and their keys go into x. */
static void fill_targets(afs_engine *eng, afs_xfer *x, const mr_copy *m,
                         const afs_remote_entry *r, uint32_t tp)
{
    const afs_transport *t = &eng->tps[tp];
    x->rma.local_addr = m->addr;
    x->rma.nic_first = t->first;
    x->rma.nic_count = t->count;
    for (uint32_t k = t->first; k < t->first + t->count; k++) {
        x->rma.local_desc[k] = m->desc[k];
        x->rma.fi_addr[k] = r->fi_addr[k];
        x->rma.rbase[k] = r->rbase[k];
        x->rma.rkey[k] = r->key[k];
    }
}

/* What a descriptor lets this engine do: one that states its access (every descriptor
 * made since reads) and lacks the one asked for is refused before anything is posted, as
 * the target's provider would refuse it (the same code as a rejected key). */
static int check_access(const afs_remote_entry *r, bool read, uint64_t index)
{
    uint32_t need = read ? AFP_MR_REMOTE_READ : AFP_MR_REMOTE;
    if (!r->access || (r->access & need))
        return 0;
    char which[40] = "";
    if (index != UINT64_MAX)
        snprintf(which, sizeof which, " (target %llu)", (unsigned long long)index);
    return afs_fail(AFS_EKEY, "%s refused before posting%s: the region was registered "
                              "remote=\"%s\" (its owner does not let peers %s it)",
                    read ? "read" : "write", which, read ? "w" : "r", read ? "read" : "write");
}

/* The checks every write (or read) starts with: an open engine, a valid immediate, a live
 * local region and a live remote descriptor (copied, so they cannot change under us) that
 * allows the access. */
/* The transport an operation between local region `m` and remote `r` takes (route.c),
 * which must have reads for a read. */
static int route(afs_engine *eng, uint32_t local_mask, const afs_remote_entry *r, bool read,
                 uint32_t *tp)
{
    int rc = afs_route_pick(eng, local_mask, r->tp_mask, tp);
    if (rc)
        return rc;
    if (read && !AFP_HAS_OP(eng->tps[*tp].ops, post_reads))
        return afs_fail(AFS_EUNSUPPORTED, "read: provider %s has no one-sided reads",
                        eng->tps[*tp].name);
    return 0;
}

static int load_write(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, int64_t imm,
                      bool read, bool *has_imm, uint32_t *imm_value, mr_copy *m,
                      afs_remote_entry *r, uint32_t *tp)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if ((rc = check_imm(imm, has_imm, imm_value)) || (rc = load_mr(eng, mr_id, m)) ||
        (rc = load_remote(eng, remote_id, r)) || (rc = route(eng, m->local_mask, r, read, tp)) ||
        (rc = check_access(r, read, UINT64_MAX)))
        return rc;
    return 0;
}

/* Sides in the caller's terms: a write's source is local, a read's is remote. Internally
 * (afs_xfer, gen_wr) offsets are always local ("src") and remote ("dst"). */
static const char *local_side(bool read) { return read ? "destination" : "source"; }
static const char *remote_side(bool read) { return read ? "source" : "destination"; }

static int build_contig(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                        uint64_t local_offset, uint64_t remote_offset, int64_t imm, bool read,
                        afs_xfer **out)
{
    bool has_imm = false;
    uint32_t imm_value = 0;
    mr_copy m;
    afs_remote_entry r;
    uint32_t tp;
    int rc = load_write(eng, mr_id, remote_id, imm, read, &has_imm, &imm_value, &m, &r, &tp);
    if (rc)
        return rc;
    if (!range_ok(local_offset, length, m.len))
        return afs_fail(AFS_ERANGE,
                        "%s [%llu, +%llu) outside the local region of %llu bytes",
                        local_side(read), (unsigned long long)local_offset,
                        (unsigned long long)length, (unsigned long long)m.len);
    if (!range_ok(remote_offset, length, r.length))
        return afs_fail(AFS_ERANGE,
                        "%s [%llu, +%llu) outside the remote region of %llu bytes",
                        remote_side(read), (unsigned long long)remote_offset,
                        (unsigned long long)length, (unsigned long long)r.length);
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_WRITE);
    if (!x)
        return afs_fail(AFS_ENOMEM, "%s: out of memory", read ? "read" : "write");
    fill_targets(eng, x, &m, &r, tp);
    x->rma.read = read;
    x->rma.local_addr = m.addr + local_offset;
    x->rma.length = length;
    x->rma.dst_addr = remote_offset;
    x->rma.has_imm = has_imm;
    x->rma.imm = imm_value;
    uint64_t maxw = eng->tps[tp].max_write;
    x->rma.chunk = (maxw && maxw < MAX_CHUNK) ? maxw : MAX_CHUNK;
    *out = x;
    return 0;
}

int afs_build_write(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                       uint64_t src_offset, uint64_t dst_offset, int64_t imm, afs_xfer **out)
{
    return build_contig(eng, mr_id, remote_id, length, src_offset, dst_offset, imm, false, out);
}

static int check_pages(const int64_t *idx, uint64_t count, uint64_t stride, uint64_t offset,
                       uint64_t page_len, uint64_t size, const char *side)
{
    if (!idx)
        return afs_fail(AFS_EINVAL, "%s page indices: NULL", side);
    if (page_len > size || offset > size - page_len)
        return afs_fail(AFS_ERANGE, "%s pages: offset %llu + page %llu outside %llu bytes", side,
                        (unsigned long long)offset, (unsigned long long)page_len,
                        (unsigned long long)size);
    /* page i spans [offset + idx*stride, +page_len): idx <= (size - page_len - offset)/stride */
    uint64_t room = size - page_len - offset;
    uint64_t max_idx = stride ? room / stride : UINT64_MAX;
    for (uint64_t i = 0; i < count; i++) {
        if (idx[i] < 0 || (uint64_t)idx[i] > max_idx)
            return afs_fail(AFS_ERANGE,
                            "%s page %llu: index %lld puts the page outside the region of "
                            "%llu bytes (stride %llu, offset %llu)",
                            side, (unsigned long long)i, (long long)idx[i],
                            (unsigned long long)size, (unsigned long long)stride,
                            (unsigned long long)offset);
    }
    return 0;
}

/* src_* are the local pages and dst_* the remote ones (a read passes them swapped). */
static int build_paged(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t page_len,
                       uint64_t count, const int64_t *src_idx, uint64_t src_stride,
                       uint64_t src_offset, const int64_t *dst_idx, uint64_t dst_stride,
                       uint64_t dst_offset, int64_t imm, bool read, afs_xfer **out)
{
    bool has_imm = false;
    uint32_t imm_value = 0;
    mr_copy m;
    afs_remote_entry r;
    uint32_t tp;
    int rc = load_write(eng, mr_id, remote_id, imm, read, &has_imm, &imm_value, &m, &r, &tp);
    if (rc)
        return rc;
    if (page_len > eng->tps[tp].max_write)
        return afs_fail(AFS_ETOOBIG, "page of %llu bytes exceeds the provider's %llu",
                        (unsigned long long)page_len,
                        (unsigned long long)eng->tps[tp].max_write);
    if (count > (1ull << 31))
        return afs_fail(AFS_EINVAL, "too many pages in one request (%llu)",
                        (unsigned long long)count);
    if ((rc = check_pages(src_idx, count, src_stride, src_offset, page_len, m.len,
                          local_side(read))) ||
        (rc = check_pages(dst_idx, count, dst_stride, dst_offset, page_len, r.length,
                          remote_side(read))))
        return rc;
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_PAGED);
    if (!x)
        return afs_fail(AFS_ENOMEM, "paged %s: out of memory", read ? "read" : "write");
    x->rma.read = read;
    size_t bytes = (size_t)(count ? count : 1) * sizeof(int64_t);
    x->rma.src_idx = malloc(bytes);
    x->rma.dst_idx = malloc(bytes);
    if (!x->rma.src_idx || !x->rma.dst_idx) {
        afs_xfer_free(x);
        return afs_fail(AFS_ENOMEM, "paged %s: out of memory for %llu pages",
                        read ? "read" : "write", (unsigned long long)count);
    }
    memcpy(x->rma.src_idx, src_idx, (size_t)count * sizeof(int64_t));
    memcpy(x->rma.dst_idx, dst_idx, (size_t)count * sizeof(int64_t));
    fill_targets(eng, x, &m, &r, tp);
    x->rma.count = count;
    x->rma.length = page_len;
    x->rma.src_stride = src_stride;
    x->rma.src_offset = src_offset;
    x->rma.dst_stride = dst_stride;
    x->rma.dst_offset = dst_offset;
    x->rma.has_imm = has_imm;
    x->rma.imm = imm_value;
    *out = x;
    return 0;
}

static int set_trigger(afs_engine *eng, afs_xfer *x, uint32_t kind, uint64_t a, uint64_t b)
{
    switch (kind) {
    case AFS_TRIG_NONE:
        return 0;
    case AFS_TRIG_WATCHER:
        if (!afs_slots_lookup(&eng->watchers, a))
            return afs_fail(AFS_ESTALE, "trigger: watcher is not live on this engine");
        break;
    case AFS_TRIG_IMM:
        if (a > UINT32_MAX)
            return afs_fail(AFS_EINVAL, "trigger: immediate %llu outside 0..4294967295",
                            (unsigned long long)a);
        break;
    default:
        return afs_fail(AFS_EINVAL, "unknown trigger kind %u", kind);
    }
    x->rma.trig_kind = kind;
    x->rma.trig_watcher = a;
    x->rma.trig_value = b;
    return 0;
}

int afs_submit_built(afs_engine *eng, afs_xfer *x, uint32_t trig_kind, uint64_t trig_a,
                        uint64_t trig_b, uint64_t *xfer_id)
{
    int rc = set_trigger(eng, x, trig_kind, trig_a, trig_b);
    if (rc) {
        afs_xfer_free(x);
        return rc;
    }
    *xfer_id = x->id;
    afs_submit(eng, x);
    return 0;
}

int32_t afs_write(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                  uint64_t src_offset, uint64_t dst_offset, int64_t imm, uint32_t trig_kind,
                  uint64_t trig_a, uint64_t trig_b, uint64_t *xfer_id)
{
    afs_xfer *x;
    if (!xfer_id)
        return afs_fail(AFS_EINVAL, "write: NULL output");
    int rc = afs_build_write(eng, mr_id, remote_id, length, src_offset, dst_offset, imm, &x);
    if (rc)
        return rc;
    return afs_submit_built(eng, x, trig_kind, trig_a, trig_b, xfer_id);
}

int32_t afs_write_paged(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t page_len,
                        uint64_t count, const int64_t *src_idx, uint64_t src_stride,
                        uint64_t src_offset, const int64_t *dst_idx, uint64_t dst_stride,
                        uint64_t dst_offset, int64_t imm, uint32_t trig_kind, uint64_t trig_a,
                        uint64_t trig_b, uint64_t *xfer_id)
{
    afs_xfer *x;
    if (!xfer_id)
        return afs_fail(AFS_EINVAL, "paged write: NULL output");
    int rc = build_paged(eng, mr_id, remote_id, page_len, count, src_idx, src_stride,
                         src_offset, dst_idx, dst_stride, dst_offset, imm, false, &x);
    if (rc)
        return rc;
    return afs_submit_built(eng, x, trig_kind, trig_a, trig_b, xfer_id);
}

/* A scatter (or barrier), or with `read` a gather. src_offsets are local and dst_offsets
 * remote (a gather passes them swapped). */
static int scatter_rw(afs_engine *eng, uint64_t mr_id, uint64_t count, const uint64_t *remote_ids,
                      const uint64_t *lengths, const uint64_t *src_offsets,
                      const uint64_t *dst_offsets, int64_t imm, bool read, uint32_t trig_kind,
                      uint64_t trig_a, uint64_t trig_b, uint64_t *xfer_id)
{
    const char *op = read ? "gather" : "scatter";
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    bool barrier = lengths == NULL;
    if (!xfer_id || (count && !remote_ids) ||
        (!barrier && (!src_offsets || !dst_offsets)) || (read && barrier))
        return afs_fail(AFS_EINVAL, "%s: NULL argument", op);
    if (count > (1u << 24))
        return afs_fail(AFS_EINVAL, "%s: too many targets (%llu)", op, (unsigned long long)count);
    bool has_imm = false;
    uint32_t imm_value = 0;
    if ((rc = check_imm(imm, &has_imm, &imm_value)))
        return rc;
    if (barrier && !has_imm)
        return afs_fail(AFS_EINVAL, "barrier: an immediate is required");
    mr_copy m = {0};
    m.local_mask = (1u << eng->ntp) - 1u; /* a barrier's zero-length writes need no region */
    if (!barrier && (rc = load_mr(eng, mr_id, &m)))
        return rc;
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_SCATTER);
    if (!x)
        return afs_fail(AFS_ENOMEM, "%s: out of memory", op);
    x->rma.read = read;
    x->rma.targets = calloc(count ? count : 1, sizeof(afs_target));
    if (!x->rma.targets) {
        afs_xfer_free(x);
        return afs_fail(AFS_ENOMEM, "%s: out of memory for %llu targets", op,
                        (unsigned long long)count);
    }
    for (uint64_t i = 0; i < count; i++) {
        afs_remote_entry r;
        afs_target *t = &x->rma.targets[i];
        uint32_t tp;
        if ((rc = load_remote(eng, remote_ids[i], &r)) ||
            (rc = route(eng, m.local_mask, &r, read, &tp)) || (rc = check_access(&r, read, i))) {
            afs_xfer_free(x);
            return rc;
        }
        /* targets spread round-robin over their route's NICs */
        t->nic = eng->tps[tp].first + (uint32_t)(i % eng->tps[tp].count);
        t->fi_addr = r.fi_addr[t->nic];
        t->rbase = r.rbase[t->nic];
        t->rkey = r.key[t->nic];
        if (barrier)
            continue;
        t->length = lengths[i];
        t->src_offset = src_offsets[i];
        t->dst_offset = dst_offsets[i];
        if (!range_ok(t->src_offset, t->length, m.len) ||
            !range_ok(t->dst_offset, t->length, r.length)) {
            /* in the caller's terms: source -> destination */
            uint64_t from = read ? t->dst_offset : t->src_offset;
            uint64_t to = read ? t->src_offset : t->dst_offset;
            rc = afs_fail(AFS_ERANGE,
                          "%s %s %llu: [%llu, +%llu) -> [%llu, +%llu) outside the "
                          "local region (%llu bytes) or the remote one (%llu bytes)",
                          op, read ? "source" : "target", (unsigned long long)i,
                          (unsigned long long)from, (unsigned long long)t->length,
                          (unsigned long long)to, (unsigned long long)t->length,
                          (unsigned long long)m.len, (unsigned long long)r.length);
            afs_xfer_free(x); /* after the message: t points into x */
            return rc;
        }
        if (t->length > eng->tps[tp].max_write) {
            rc = afs_fail(AFS_ETOOBIG, "%s %s %llu: %llu bytes exceed the provider's "
                          "largest %s", op, read ? "source" : "target", (unsigned long long)i,
                          (unsigned long long)t->length, read ? "read" : "write");
            afs_xfer_free(x);
            return rc;
        }
    }
    x->rma.local_addr = m.addr;
    memcpy(x->rma.local_desc, m.desc, sizeof(x->rma.local_desc));
    x->rma.count = count;
    x->rma.has_imm = has_imm;
    x->rma.imm = imm_value;
    return afs_submit_built(eng, x, trig_kind, trig_a, trig_b, xfer_id);
}

int32_t afs_scatter(afs_engine *eng, uint64_t mr_id, uint64_t count, const uint64_t *remote_ids,
                    const uint64_t *lengths, const uint64_t *src_offsets,
                    const uint64_t *dst_offsets, int64_t imm, uint32_t trig_kind,
                    uint64_t trig_a, uint64_t trig_b, uint64_t *xfer_id)
{
    return scatter_rw(eng, mr_id, count, remote_ids, lengths, src_offsets, dst_offsets, imm,
                      false, trig_kind, trig_a, trig_b, xfer_id);
}

/* ---- reads: the same builders, the sides swapped (local = the destination) ---- */

int32_t afs_read(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                 uint64_t src_offset, uint64_t dst_offset, uint32_t trig_kind, uint64_t trig_a,
                 uint64_t trig_b, uint64_t *xfer_id)
{
    afs_xfer *x;
    if (!xfer_id)
        return afs_fail(AFS_EINVAL, "read: NULL output");
    int rc = build_contig(eng, mr_id, remote_id, length, dst_offset, src_offset, AFS_NO_IMM,
                          true, &x);
    if (rc)
        return rc;
    return afs_submit_built(eng, x, trig_kind, trig_a, trig_b, xfer_id);
}

int32_t afs_read_paged(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t page_len,
                       uint64_t count, const int64_t *src_idx, uint64_t src_stride,
                       uint64_t src_offset, const int64_t *dst_idx, uint64_t dst_stride,
                       uint64_t dst_offset, uint32_t trig_kind, uint64_t trig_a, uint64_t trig_b,
                       uint64_t *xfer_id)
{
    afs_xfer *x;
    if (!xfer_id)
        return afs_fail(AFS_EINVAL, "paged read: NULL output");
    int rc = build_paged(eng, mr_id, remote_id, page_len, count, dst_idx, dst_stride,
                         dst_offset, src_idx, src_stride, src_offset, AFS_NO_IMM, true, &x);
    if (rc)
        return rc;
    return afs_submit_built(eng, x, trig_kind, trig_a, trig_b, xfer_id);
}

int32_t afs_gather(afs_engine *eng, uint64_t mr_id, uint64_t count, const uint64_t *remote_ids,
                   const uint64_t *lengths, const uint64_t *src_offsets,
                   const uint64_t *dst_offsets, uint32_t trig_kind, uint64_t trig_a,
                   uint64_t trig_b, uint64_t *xfer_id)
{
    if (!lengths)
        return afs_fail(AFS_EINVAL, "gather: NULL lengths");
    return scatter_rw(eng, mr_id, count, remote_ids, lengths, dst_offsets, src_offsets,
                      AFS_NO_IMM, true, trig_kind, trig_a, trig_b, xfer_id);
}

int32_t afs_send(afs_engine *eng, uint64_t peer_id, const uint8_t *buf, uint64_t len,
                 uint64_t *xfer_id)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (!xfer_id || (!buf && len))
        return afs_fail(AFS_EINVAL, "send: NULL argument");
    if (len > eng->cfg.max_msg_size)
        return afs_fail(AFS_ETOOBIG, "message of %llu bytes exceeds the maximum of %u",
                        (unsigned long long)len, eng->cfg.max_msg_size);
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    uint32_t nic = p ? afs_peer_nic(eng, p) : 0;
    uint64_t fi_addr = p ? p->fi_addr[nic] : 0;
    if (!p || !afs_slots_still(&eng->peers, peer_id))
        return afs_fail(AFS_ESTALE, "peer handle is not live on this engine");
    if ((rc = peer_current(eng, peer_id)))
        return rc;
    if (p->max_msg && len > p->max_msg) /* the receiver could not take it: never post it */
        return afs_fail(AFS_ETOOBIG, "message of %llu bytes exceeds the peer's maximum of %u",
                        (unsigned long long)len, p->max_msg);
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_SEND);
    if (!x)
        return afs_fail(AFS_ENOMEM, "send: out of memory");
    x->send.payload = malloc(len ? len : 1);
    if (!x->send.payload) {
        afs_xfer_free(x);
        return afs_fail(AFS_ENOMEM, "send: out of memory");
    }
    if (len)
        memcpy(x->send.payload, buf, len);
    x->send.length = len;
    x->send.peer_fi_addr = fi_addr;
    x->send.nic = nic;
    *xfer_id = x->id;
    afs_submit(eng, x);
    return 0;
}

int32_t afs_expect_imm(afs_engine *eng, uint32_t imm, uint64_t count, uint64_t *xfer_id)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (!xfer_id)
        return afs_fail(AFS_EINVAL, "expect_imm: NULL output");
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_EXPECT);
    if (!x)
        return afs_fail(AFS_ENOMEM, "expect_imm: out of memory");
    x->expect.imm = imm;
    x->expect.count = count;
    x->deadline_ns = 0;
    *xfer_id = x->id;
    afs_submit(eng, x);
    return 0;
}

int32_t afs_cancel(afs_engine *eng, uint64_t xfer_id)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_CANCEL);
    if (!x)
        return afs_fail(AFS_ENOMEM, "cancel: out of memory");
    x->cancel.xfer_id = xfer_id;
    afs_submit(eng, x);
    atomic_fetch_add_explicit(&eng->cancels_submitted, 1, memory_order_release);
    return 0;
}

int32_t afs_imm_return(afs_engine *eng, uint32_t imm, uint64_t count)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (count == 0)
        return 0;
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_IMM_RETURN);
    if (!x)
        return afs_fail(AFS_ENOMEM, "imm_return: out of memory");
    x->expect.imm = imm;
    x->expect.count = count;
    afs_submit(eng, x);
    return 0;
}

static int32_t drain(afs_engine *eng, afs_completion *out, uint32_t max, uint32_t *count, bool poll)
{
    if (!eng || !out || !count)
        return afs_fail(AFS_EINVAL, "drain: NULL argument");
    *count = afs_ring_drain(&eng->ring, out, max, poll);
    /* A stuck worker (peers.c) is reported once, after everything it pushed before. */
    if (*count < max && !eng->stuck_reported &&
        atomic_load_explicit(&eng->stuck, memory_order_acquire)) {
        afs_completion *c = &out[(*count)++];
        memset(c, 0, sizeof(*c));
        c->kind = AFS_C_STUCK;
        c->status = AFS_ESTUCK;
        char *text = strdup(eng->stuck_text);
        c->data = (uint64_t)(uintptr_t)text;
        eng->stuck_reported = true;
    }
    return 0;
}

int32_t afs_drain(afs_engine *eng, afs_completion *out, uint32_t max, uint32_t *count)
{
    return drain(eng, out, max, count, false);
}

int32_t afs_poll(afs_engine *eng, afs_completion *out, uint32_t max, uint32_t *count)
{
    return drain(eng, out, max, count, true);
}

uint32_t afs_pending(afs_engine *eng)
{
    if (!eng)
        return 0;
    uint64_t n = afs_ring_pending(&eng->ring);
    if (!eng->stuck_reported && atomic_load_explicit(&eng->stuck, memory_order_acquire))
        n++;
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

uint32_t afs_pending_wait(afs_engine *eng, uint32_t max_ns)
{
    uint32_t n = afs_pending(eng); /* also asks the worker not to signal the fd */
    if (n || !eng || !max_ns)
        return n;
    afs_xfer_spare(eng); /* the next submission's, while the worker has this one */
    afs_ring *r = &eng->ring;
    uint64_t until = afs_now_ns() + max_ns;
    for (;;) {
        for (int i = 0; i < 8; i++) { /* the clock every 8 looks (a pause is up to ~50 ns) */
            afp_cpu_relax();
            if (atomic_load_explicit(&r->tail, memory_order_acquire) !=
                atomic_load_explicit(&r->head, memory_order_relaxed))
                return afs_pending(eng);
        }
        if (atomic_load_explicit(&eng->stuck, memory_order_acquire) || afs_now_ns() >= until)
            return afs_pending(eng);
        if (eng->look_yields)
            sched_yield();
    }
}

int32_t afs_recv_release(afs_engine *eng, const uint32_t *slots, uint32_t count)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (count == 0)
        return 0;
    if (!slots)
        return afs_fail(AFS_EINVAL, "recv_release: NULL slots");
    for (uint32_t i = 0; i < count; i++)
        if (slots[i] >= eng->nnics * eng->cfg.rx_depth)
            return afs_fail(AFS_EINVAL, "recv_release: slot %u out of range", slots[i]);
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_RECV_RELEASE);
    if (!x)
        return afs_fail(AFS_ENOMEM, "recv_release: out of memory");
    x->release.slots = malloc(sizeof(uint32_t) * count);
    if (!x->release.slots) {
        afs_xfer_free(x);
        return afs_fail(AFS_ENOMEM, "recv_release: out of memory");
    }
    memcpy(x->release.slots, slots, sizeof(uint32_t) * count);
    x->release.n_slots = count;
    afs_submit(eng, x);
    return 0;
}

/* ---- raw benchmark loops ---- */

typedef struct afs_bench_counter {
    _Atomic uint32_t done; /* reported; a futex word: the loop sleeps on it like Python on its fd */
    _Atomic uint32_t waiting;
    _Atomic int32_t status; /* the first failure's */
    _Atomic uint64_t refs; /* the loop's own, plus one per request not yet released */
    char text[384];        /* the first failure's detail, written before `status` */
} afs_bench_counter;

static void bench_unref(afs_bench_counter *c)
{
    if (atomic_fetch_sub(&c->refs, 1) == 1)
        free(c);
}

/* Worker side (the requests' afs_done_hook): note the first failure and its detail; count
 * a reported benchmark operation and wake the loop once enough are done for it to refill (a
 * batch, as Python drains completions in batches). The counter lives on the heap and goes
 * with its last reference: a failed request may be released long after the loop returned
 * (or never). */
static void bench_count(void *arg, int32_t status, const char *text, uint32_t what)
{
    afs_bench_counter *c = arg;
    if (what & AFS_HOOK_REPORTED) {
        if (status && atomic_load(&c->status) == 0) { /* the worker's thread only */
            snprintf(c->text, sizeof(c->text), "%s", text ? text : "");
            atomic_store(&c->status, status);
        }
        uint32_t done = atomic_fetch_add(&c->done, 1) + 1;
        uint32_t want = atomic_load(&c->waiting);
        if (want && (int32_t)(done - want) >= 0) {
            atomic_store(&c->waiting, 0);
            syscall(SYS_futex, &c->done, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
        }
    }
    if (what & AFS_HOOK_RELEASED)
        bench_unref(c);
}

/* With at most this many in flight the caller looks for spin_us before it sleeps, as the
 * Python loop polls the ring (afabric/engine.py: _POLL_MAX_IN_FLIGHT). */
#define BENCH_POLL_MAX_IN_FLIGHT 4u

/* Caller side: wait until `done` reaches `want`: looking for up to `spin_ns`, then asleep
 * (for at most 1 ms at a time). `yields`: between looks (eng->look_yields, as
 * afs_pending_wait does for the Python loop). */
static void bench_wait(afs_bench_counter *c, uint32_t seen, uint32_t want, uint64_t spin_ns,
                       bool yields)
{
    if (spin_ns) {
        const uint64_t until = afs_now_ns() + spin_ns;
        do {
            for (int i = 0; i < 64; i++) {
                if ((int32_t)(atomic_load(&c->done) - want) >= 0)
                    return;
                afp_cpu_relax();
            }
            if (yields)
                sched_yield();
        } while (afs_now_ns() < until);
    }
    struct timespec ts = {0, 1000000};
    atomic_store(&c->waiting, want ? want : 1);
    uint32_t now = atomic_load(&c->done);
    if ((int32_t)(now - want) < 0)
        syscall(SYS_futex, &c->done, FUTEX_WAIT_PRIVATE, now == seen ? seen : now, &ts, NULL, 0);
    atomic_store(&c->waiting, 0);
}

/* Submits `iters` copies of `proto` keeping `window` in flight, until every one is
 * reported (or the first failure is, and every one submitted so far). Contiguous writes
 * rotate through `span` slots of their length, as the Python benchmark does, so neither
 * side measures one cache-resident buffer. With `lat_ns` (window 1), each operation's
 * nanoseconds from its submission to this loop seeing it reported go there, in order. */
static int bench_loop(afs_engine *eng, afs_xfer *proto, bool paged, uint64_t span, uint32_t window,
                      uint64_t iters, uint64_t *lat_ns, uint64_t *elapsed_ns)
{
    afs_bench_counter *c = malloc(sizeof(*c));
    if (!c)
        return afs_fail(AFS_ENOMEM, "bench: out of memory");
    atomic_init(&c->done, 0);
    atomic_init(&c->waiting, 0);
    atomic_init(&c->status, 0);
    atomic_init(&c->refs, 1);
    uint64_t submitted = 0;
    int rc = 0;
    if (window == 0)
        window = 1;
    if (span == 0)
        span = 1;
    if (lat_ns)
        window = 1;
    const uint64_t spin_ns = (uint64_t)eng->cfg.spin_us * 1000u;
    uint64_t t0 = afs_now_ns(), t_sub = t0, timed = 0;
    for (;;) {
        uint32_t done = atomic_load(&c->done);
        if (lat_ns && timed < done && timed < submitted) /* window 1: the one in flight */
            lat_ns[timed++] = afs_now_ns() - t_sub;
        while (rc == 0 && submitted < iters && submitted - done < window &&
               atomic_load(&c->status) == 0) {
            afs_xfer *x = afs_xfer_new(eng, proto->kind);
            if (!x) {
                rc = afs_fail(AFS_ENOMEM, "bench: out of memory");
                break;
            }
            uint64_t id = x->id;
            memcpy(x, proto, offsetof(afs_xfer, rma)); /* the head, then its part alone */
            x->rma = proto->rma;
            x->id = id;
            x->done_hook = bench_count;
            x->done_arg = c;
            if (paged) {
                size_t bytes = (size_t)proto->rma.count * sizeof(int64_t);
                x->rma.src_idx = malloc(bytes ? bytes : 1);
                x->rma.dst_idx = malloc(bytes ? bytes : 1);
                if (!x->rma.src_idx || !x->rma.dst_idx) {
                    afs_xfer_free(x);
                    rc = afs_fail(AFS_ENOMEM, "bench: out of memory");
                    break;
                }
                memcpy(x->rma.src_idx, proto->rma.src_idx, bytes);
                memcpy(x->rma.dst_idx, proto->rma.dst_idx, bytes);
            } else {
                uint64_t off = (submitted % span) * proto->rma.length;
                x->rma.local_addr += off;
                x->rma.dst_addr += off;
            }
            atomic_fetch_add(&c->refs, 1);
            t_sub = afs_now_ns();
            afs_submit(eng, x);
            submitted++;
        }
        done = atomic_load(&c->done);
        if (lat_ns && timed < done && timed < submitted)
            lat_ns[timed++] = afs_now_ns() - t_sub;
        if (done >= submitted && (submitted >= iters || rc || atomic_load(&c->status)))
            break;
        if (atomic_load(&eng->closed)) {
            rc = afs_fail(AFS_ECLOSED, "engine closed during benchmark");
            break;
        }
        if (atomic_load(&eng->stuck)) { /* what is in flight will never be reported */
            rc = afs_fail(AFS_ESTUCK, "%s", eng->stuck_text);
            break;
        }
        /* Small writes: refill once a quarter of the window has completed (a wakeup per
         * write would cost more than the write); large ones: at every completion, so the
         * window stays full as Python's lanes keep it. */
        uint64_t op_bytes = paged ? proto->rma.length * proto->rma.count : proto->rma.length;
        uint64_t batch = (op_bytes >= (64u << 10) || window < 4) ? 1 : window / 4;
        uint64_t want = done + batch;
        if (want > submitted)
            want = submitted;
        bench_wait(c, done, (uint32_t)want,
                   submitted - done <= BENCH_POLL_MAX_IN_FLIGHT ? spin_ns : 0, eng->look_yields);
    }
    *elapsed_ns = afs_now_ns() - t0;
    int32_t st = atomic_load(&c->status);
    if (!rc && st)
        rc = afs_fail(st, "benchmark %s failed: %s%s%s", proto->rma.read ? "read" : "write",
                      afs_error_name(st), c->text[0] ? ": " : "", c->text);
    bench_unref(c); /* after its text is copied */
    return rc;
}

static int bench_contig(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                        uint32_t window, uint64_t iters, bool read, uint64_t *lat_ns,
                        uint64_t *elapsed_ns)
{
    afs_xfer *proto;
    if (!elapsed_ns)
        return afs_fail(AFS_EINVAL, "bench: NULL output");
    int rc = build_contig(eng, mr_id, remote_id, length, 0, 0, AFS_NO_IMM, read, &proto);
    if (rc)
        return rc;
    mr_copy m;
    afs_remote_entry r;
    uint64_t span = 1;
    if (length && load_mr(eng, mr_id, &m) == 0 && load_remote(eng, remote_id, &r) == 0)
        span = (m.len < r.length ? m.len : r.length) / length;
    rc = bench_loop(eng, proto, false, span, window, iters, lat_ns, elapsed_ns);
    afs_xfer_free(proto);
    return rc;
}

int32_t afs_bench_write(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                        uint32_t window, uint64_t iters, uint64_t *elapsed_ns)
{
    return bench_contig(eng, mr_id, remote_id, length, window, iters, false, NULL, elapsed_ns);
}

int32_t afs_bench_write_lat(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                            uint64_t iters, uint64_t *lat_ns)
{
    uint64_t elapsed;
    if (!lat_ns)
        return afs_fail(AFS_EINVAL, "bench: NULL output");
    return bench_contig(eng, mr_id, remote_id, length, 1, iters, false, lat_ns, &elapsed);
}

int32_t afs_bench_read(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                       uint32_t window, uint64_t iters, uint64_t *elapsed_ns)
{
    return bench_contig(eng, mr_id, remote_id, length, window, iters, true, NULL, elapsed_ns);
}

int32_t afs_bench_paged(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t page_len,
                        uint64_t count, const int64_t *src_idx, const int64_t *dst_idx,
                        uint32_t window, uint64_t iters, uint64_t *elapsed_ns)
{
    afs_xfer *proto;
    if (!elapsed_ns)
        return afs_fail(AFS_EINVAL, "bench: NULL output");
    int rc = build_paged(eng, mr_id, remote_id, page_len, count, src_idx, page_len, 0, dst_idx,
                         page_len, 0, AFS_NO_IMM, false, &proto);
    if (rc)
        return rc;
    rc = bench_loop(eng, proto, true, 1, window, iters, NULL, elapsed_ns);
    afs_xfer_free(proto);
    return rc;
}
