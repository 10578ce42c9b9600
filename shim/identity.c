/*
 * Who lives at a NIC address: which incarnation a keepalive frame proved there
 * (afs_peer_proven, from keepalive.c on the worker) and which later one merely claims it
 * (afs_peer_later_claim, from api.c). Lock-free over the peer table: the worker never takes
 * peer_lock (a resolve holds it while it waits for the worker).
 */
#include <string.h>

#include "internal.h"

/* Whether two live entries name the same NIC addresses (their address blobs' NIC parts) on
 * the network transports: a same-host transport's address names the engine, not a place a
 * restarted one takes again (cma's segment is new each time). */
static bool same_nic_addrs(const afs_engine *eng, const afs_peer_entry *a,
                           const afs_peer_entry *b)
{
    bool any = false;
    for (uint32_t k = 0; k < eng->nnics; k++) {
        if (eng->tps[eng->nics[k].tp].reach != AFS_REACH_NETWORK)
            continue;
        if (a->nic_len[k] != b->nic_len[k])
            return false;
        if (a->nic_len[k] &&
            memcmp(a->addr + a->nic_off[k], b->addr + b->nic_off[k], a->nic_len[k]) != 0)
            return false;
        any |= a->nic_len[k] != 0;
    }
    return any;
}

/* Peer slots handed out so far (the slot table's own lock, held for a read). */
static uint32_t slots_in_use(afs_engine *eng)
{
    pthread_mutex_lock(&eng->peers.lock);
    uint32_t n = eng->peers.n_alloc;
    pthread_mutex_unlock(&eng->peers.lock);
    return n;
}

void afs_peer_proven(afs_engine *eng, afs_peer_entry *p)
{
    if (atomic_fetch_or(&p->ka, AFS_KA_PROVEN) & AFS_KA_PROVEN)
        return;
    /* superseded_by only ever goes from 0 to an incarnation */
    uint32_t n = slots_in_use(eng);
    for (uint32_t i = 0; i < n; i++) {
        afs_peer_entry *q = afs_slots_at(&eng->peers, i);
        uint32_t gen = q ? atomic_load_explicit(&q->hdr.gen, memory_order_acquire) : 0;
        if (!(gen & 1u) || q == p || q->incarnation == p->incarnation || !same_nic_addrs(eng, p, q))
            continue;
        afs_peer_entry *older = q->incarnation < p->incarnation ? q : p;
        afs_peer_entry *later = older == q ? p : q;
        /* A proven later one retires the older (a late frame of the older one, proving it
         * after the later one did, changes nothing). */
        if (!(atomic_load(&later->ka) & AFS_KA_PROVEN))
            continue;
        uint64_t none = 0;
        atomic_compare_exchange_strong(&older->superseded_by, &none, later->incarnation);
    }
}

uint64_t afs_peer_later_claim(afs_engine *eng, const afs_peer_entry *p)
{
    uint32_t n = slots_in_use(eng);
    uint64_t later = 0;
    for (uint32_t i = 0; i < n; i++) {
        afs_peer_entry *q = afs_slots_at(&eng->peers, i);
        uint32_t gen = q ? atomic_load_explicit(&q->hdr.gen, memory_order_acquire) : 0;
        if ((gen & 1u) && q->incarnation > p->incarnation && q->incarnation > later &&
            same_nic_addrs(eng, p, q))
            later = q->incarnation;
    }
    return later;
}

