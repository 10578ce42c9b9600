/*
 * Routes: which of an engine's transports carries an operation. A single-provider engine
 * has one transport and every route is it. A routed engine (afs_engine_create_routed) holds
 * its transports in the order it prefers them (same host, same node, then the network): a
 * peer is reached on those of them that resolved it (engine.c), a region is held by those
 * it registered with (worker.c), and an operation takes the first transport that holds
 * both of its regions.
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

uint32_t afs_peer_nic(const afs_engine *eng, const afs_peer_entry *p)
{
    return p->tp_mask ? eng->tps[afs_tp_first(p->tp_mask)].first : 0;
}

void afs_tp_names(const afs_engine *eng, uint32_t mask, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = '\0';
    for (uint32_t t = 0; t < eng->ntp && at < len; t++) {
        if (!(mask & (1u << t)))
            continue;
        int n = snprintf(buf + at, len - at, "%s%s", at ? ", " : "", eng->tps[t].name);
        if (n < 0)
            break;
        at += (size_t)n;
    }
    if (!buf[0])
        snprintf(buf, len, "none");
}

int afs_route_pick(afs_engine *eng, uint32_t local_mask, uint32_t remote_mask, uint32_t *tp)
{
    uint32_t both = local_mask & remote_mask;
    if (both) {
        *tp = afs_tp_first(both);
        return 0;
    }
    char local[96], remote[96];
    afs_tp_names(eng, local_mask, local, sizeof local);
    afs_tp_names(eng, remote_mask, remote, sizeof remote);
    return afs_fail(AFS_EUNSUPPORTED,
                    "no transport of this engine carries it: the local region is registered "
                    "with %s, the remote one reached through %s (CUDA memory needs a "
                    "transport that takes it: nvlink within a node, efa or verbs with GPU "
                    "support across nodes)",
                    local, remote);
}

uint32_t afs_reg_flags(const afs_engine *eng, const afs_transport *t, const afs_mr_entry *m)
{
    const uint32_t remote = AFP_MR_REMOTE | AFP_MR_REMOTE_READ;
    if (!eng->routed)
        return m->flags;
    if (m->flags & AFP_MR_DEVICE)
        return (t->caps & AFP_CAP_DEVICE_MEM) ? m->flags : UINT32_MAX;
    if ((t->caps & AFP_CAP_DEVICE_ONLY) ||
        ((m->flags & AFP_MR_REMOTE_READ) && !AFP_HAS_OP(t->ops, post_reads)))
        return m->flags & ~remote;
    return m->flags;
}
