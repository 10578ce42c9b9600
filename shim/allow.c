/*
 * The engine's optional allow-list of peers (afs_allow_peers).
 *
 * What it can stop, and where:
 *  - messages and immediates from a peer not on the list: the worker drops them as they
 *    are polled (the receive buffer goes straight back to the provider), before anything
 *    reaches the completion ring, and counts them (afs_nic_stats.rejected). Their sender
 *    comes from the provider's poll_from; an event whose sender the provider cannot name
 *    is refused too while a list is set (rejected_unknown), so the list is never bypassed
 *    silently;
 *  - this engine reaching out: resolving or importing a peer not on the list fails with
 *    AFS_EDENIED, and every write or send is checked again when it starts (the list may
 *    have changed since its peer was resolved).
 * What it cannot stop: a one-sided write from a peer holding one of our remote keys. It
 * lands in memory before any software sees it; keys are capabilities (docs/security.md).
 *
 * A list is an immutable snapshot. The worker reads its copy (eng->allow) without locks;
 * callers read theirs (eng->allow_book) under peer_lock; a change installs a new snapshot
 * in both, and frees the old one once the worker has let go of it.
 */
#include <stdlib.h>
#include <string.h>

#include "allow.h"

void afs_allow_free(afs_allow *a)
{
    if (!a)
        return;
    for (uint32_t k = 0; k < AFS_ENG_NICS; k++)
        free(a->fi_addr[k]);
    for (uint32_t i = 0; a->blob && i < a->n; i++)
        free(a->blob[i]);
    free(a->blob);
    free(a->blob_len);
    free(a);
}

static bool has_u64(const uint64_t *v, uint32_t n, uint64_t key)
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (v[mid] == key)
            return true;
        if (v[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return false;
}

/* A listed address is one engine instance: a peer that restarts (a new incarnation at the
 * same NIC addresses) is not on the list until it is listed again. */
int afs_allow_check_addr(afs_engine *eng, const afs_addr_view *v, const uint8_t *blob,
                         uint32_t len)
{
    int rc = 0;
    pthread_mutex_lock(&eng->peer_lock);
    const afs_allow *a = eng->allow_book;
    if (a) {
        bool found = false;
        for (uint32_t i = 0; i < a->n && !found; i++)
            found = a->blob_len[i] == len && memcmp(a->blob[i], blob, len) == 0;
        if (!found)
            rc = afs_fail(AFS_EDENIED,
                          "peer %016llx is not on this engine's allow-list: not resolved, "
                          "nothing posted",
                          (unsigned long long)v->incarnation);
    }
    pthread_mutex_unlock(&eng->peer_lock);
    return rc;
}

/* AFP_SRC_UNRESOLVED is never on a list (every listed peer was resolved: build): rejected. */
bool afs_allow_refuse_src(afs_engine *eng, uint32_t nic, uint64_t src)
{
    const afs_allow *a = eng->allow;
    afs_nic *n = &eng->nics[nic];
    if (src == AFP_SRC_UNKNOWN) {
        if (a->accept_unknown)
            return false;
        afs_count(&n->st_rejected_unknown, 1);
        return true;
    }
    if (has_u64(a->fi_addr[nic], a->n, src))
        return false;
    afs_count(&n->st_rejected, 1);
    return true;
}

static bool allowed_on(const afs_allow *a, uint32_t nic, uint64_t fi_addr)
{
    return has_u64(a->fi_addr[nic], a->n, fi_addr);
}

bool afs_allow_refuse_out(afs_engine *eng, afs_xfer *x)
{
    const afs_allow *a = eng->allow;
    bool ok = true;
    switch (x->kind) {
    case AFS_REQ_SEND:
        ok = allowed_on(a, x->send.nic, x->send.peer_fi_addr);
        break;
    case AFS_REQ_WRITE:
    case AFS_REQ_PAGED:
        for (uint32_t k = x->rma.nic_first; k < x->rma.nic_first + x->rma.nic_count && ok; k++)
            ok = allowed_on(a, k, x->rma.fi_addr[k]);
        break;
    case AFS_REQ_SCATTER:
        for (uint64_t i = 0; i < x->rma.count && ok; i++)
            ok = allowed_on(a, x->rma.targets[i].nic, x->rma.targets[i].fi_addr);
        break;
    default:
        break;
    }
    if (ok)
        return false;
    if (!x->status) {
        x->status = AFS_EDENIED;
        free(x->errtext);
        x->errtext = afs_strdup_printf("peer is not on this engine's allow-list (the list "
                                       "changed after it was resolved): nothing posted");
    }
    return true;
}

int afs_allow_poll(afs_engine *eng, uint32_t nic, afp_event *ev, uint64_t *src, uint32_t max,
                   uint32_t *n)
{
    afp_domain *dom = eng->nics[nic].dom;
    /* always with sources where the provider gives them: RECV completions carry the
     * sender (afs_completion.id), which the facade checks messages' own headers against */
    const struct afp_ops *ops = eng->nics[nic].ops;
    if (AFP_HAS_OP(ops, poll_from))
        return ops->poll_from(dom, ev, src, max, n);
    int rc = ops->poll(dom, ev, max, n);
    for (uint32_t i = 0; i < *n; i++)
        src[i] = AFP_SRC_UNKNOWN;
    return rc;
}

void afs_allow_destroy(afs_engine *eng)
{
    afs_allow_free(eng->allow_book); /* the worker's copy is the same snapshot */
    eng->allow_book = NULL;
    eng->allow = NULL;
}
