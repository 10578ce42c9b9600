/*
 * afs_allow_peers: making an allow-list snapshot and installing it. It resolves the listed
 * peers (engine.c) and hands the snapshot to the worker with a control call (worker.c), so
 * it stands above both; the snapshot's readers, which the worker and the engine call, are
 * in allow.c, below them.
 */
#include <stdlib.h>
#include <string.h>

#include "allow.h"

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Builds a snapshot from `count` addresses (concatenated in `blobs`, lengths in `lens`),
 * resolving each peer. */
static int build(afs_engine *eng, const uint8_t *blobs, const uint32_t *lens, uint32_t count,
                 afs_allow **out)
{
    afs_allow *a = calloc(1, sizeof(*a));
    if (!a)
        return afs_fail(AFS_ENOMEM, "allow-list: out of memory");
    a->blob = calloc(count ? count : 1, sizeof(*a->blob));
    a->blob_len = calloc(count ? count : 1, sizeof(*a->blob_len));
    int rc = 0;
    for (uint32_t k = 0; k < eng->nnics && a->blob && a->blob_len; k++)
        if (!(a->fi_addr[k] = calloc(count ? count : 1, sizeof(uint64_t))))
            break;
    if (!a->blob || !a->blob_len || !a->fi_addr[eng->nnics - 1]) {
        afs_allow_free(a);
        return afs_fail(AFS_ENOMEM, "allow-list: out of memory");
    }
    uint64_t at = 0;
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *blob = blobs + at;
        at += lens[i];
        afs_addr_view v;
        uint64_t peer_id;
        if ((rc = afs_addr_parse(blob, lens[i], &v)) ||
            (rc = afs_find_or_resolve_peer(eng, &v, blob, lens[i], &peer_id)))
            goto fail;
        afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
        if (!p) {
            rc = afs_fail(AFS_ESTALE, "allow-list: peer %u was forgotten while resolving", i);
            goto fail;
        }
        if (!(a->blob[i] = malloc(lens[i] ? lens[i] : 1))) {
            rc = afs_fail(AFS_ENOMEM, "allow-list: out of memory");
            goto fail;
        }
        memcpy(a->blob[i], blob, lens[i]);
        a->blob_len[i] = lens[i];
        for (uint32_t k = 0; k < eng->nnics; k++)
            a->fi_addr[k][i] = (p->tp_mask & (1u << eng->nics[k].tp)) ? p->fi_addr[k]
                                                                        : AFS_NO_HANDLE;
        a->n = i + 1;
    }
    for (uint32_t k = 0; k < eng->nnics; k++)
        qsort(a->fi_addr[k], a->n, sizeof(uint64_t), cmp_u64);
    *out = a;
    return 0;
fail:
    afs_allow_free(a);
    return rc;
}

int32_t afs_allow_peers(afs_engine *eng, const uint8_t *blobs, const uint32_t *lens,
                        uint32_t count, uint32_t flags)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    bool on = flags & AFS_ALLOW_ON;
    if ((flags & ~(AFS_ALLOW_ON | AFS_ALLOW_UNKNOWN)) || (count && (!blobs || !lens)) ||
        (!on && flags) || (!on && count))
        return afs_fail(AFS_EINVAL, "allow-list: bad arguments");
    afs_allow *a = NULL;
    if (on && (rc = build(eng, blobs, lens, count, &a)))
        return rc;
    if (a)
        a->accept_unknown = flags & AFS_ALLOW_UNKNOWN;
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_CTRL);
    if (!x) {
        afs_allow_free(a);
        return afs_fail(AFS_ENOMEM, "allow-list: out of memory");
    }
    x->ctrl.op = AFS_CTRL_ALLOW;
    x->ctrl.allow = a;
    pthread_mutex_lock(&eng->peer_lock);
    rc = afs_ctrl_call(eng, x); /* the worker switches to `a` (worker.c run_ctrl) */
    afs_allow *old = NULL;
    if (rc == 0) {
        old = eng->allow_book;
        eng->allow_book = a;
    }
    pthread_mutex_unlock(&eng->peer_lock);
    if (rc != AFS_ESTUCK) /* stuck: x stays the worker's (run_ctrl will not read `a`) */
        afs_xfer_free(x);
    afs_allow_free(rc ? a : old); /* the worker holds neither any more */
    return rc;
}
