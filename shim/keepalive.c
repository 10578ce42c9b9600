/*
 * The shim's own control frames: hello, heartbeat and goodbye between engines (worker only).
 *
 * A peer's process that dies is noticed through its pidfd (peers.c) on this host; an engine
 * that is closed in a process that lives on, or a peer that stops answering without dying
 * (another host, a hung process), is not. For those, engines tell each other, with small
 * sends of their own that never reach the application:
 *
 *  - PING (with the sender's address): sent once to every peer when it is resolved (a
 *    "hello": the peer learns who resolved it; one that has not resolved the sender hands
 *    the address up, AFS_C_HELLO, and the facade resolves it in turn), and with
 *    afs_config.heartbeat_ms every interval to each peer operations went to (or that said
 *    hello). Always answered with a PONG, whether heartbeats are on here or not.
 *  - PONG: the answer. Any PING or PONG from a peer counts as hearing from it; a peer not
 *    heard from for AFS_HEARTBEAT_MISSES intervals is down (AFS_PEER_SILENT, "silent")
 *    until it is heard again.
 *  - BYE: when the engine closes, to every peer that said hello to it (it resolved this
 *    engine) or that operations went to, best effort within BYE_WAIT_NS (worker.c): the
 *    peer marks this engine down for good (AFS_PEER_CLOSED, "closed") and fails what is in
 *    flight to it (after AFS_KA_GRACE_MS) and everything after it.
 *
 * Who sent a frame: the provider's own word (poll_from's source handle), matched with the
 * incarnation the frame states. A BYE is acted on only when the provider names its sender
 * and that sender is the peer whose incarnation the frame states: a peer can say goodbye
 * for itself only, never for another (on providers that cannot name senders goodbyes are
 * ignored; heartbeats, or op_timeout, still find a closed peer). A PING from an address not
 * resolved here is answered once it is (learned: at most LEARN_MAX addresses per engine,
 * and only where the claimed NIC address is the one the provider names, when it names
 * one); its claim can only make this engine send one goodbye to the claimed address when
 * it closes. A PING or PONG whose sender the provider names, stating that sender's own
 * incarnation, is the proof that the incarnation lives at that NIC address
 * (afs_peer_proven): only then does it supersede an older one there.
 *
 * This file sits below worker.c: what it finds (a peer silent, answering again, gone,
 * an address to learn) goes to the worker through the afs_ka_hook it is given.
 *
 * Costs: one frame per resolved peer (hello); with heartbeats, one frame each way per
 * interval per peer in use (no allocation: the frames use the engine's send buffers, at
 * most tx_depth / 8 of them at a time, and a peer has at most one PING in flight); off, a
 * branch per loop. Frames are counted in afs_nic_stats.ctrl_sent/ctrl_received, not in
 * sends/recvs. Engines of one process send each other none (AFS_KA_SAME_PROCESS).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* A control frame's send context: tx slot << 40 | peer slot index << 8 | tag. The low byte
 * of a transfer's context (a pointer) is a multiple of 16, worker.c's RX_TAG is 1. */
#define KA_TAG_PING 2u
#define KA_TAG_BYE 3u
#define KA_TAG_PONG 4u
#define KA_VERSION 1u
enum { KA_PING = 1, KA_PONG = 2, KA_BYE = 3 };
/* magic "\xafK" (the facade's frames start "\xafM"), version, kind, address length (u16),
 * 2 bytes 0, the sender's incarnation (u64 LE); then the sender's address (PING). */
#define KA_HDR 16u
#define LEARN_MAX 4096u /* addresses handed up to be resolved (a flood of made-up ones is cut) */
#define LEARNING 64u    /* incarnations handed up and not resolved yet */
/* A provider answers the first sends to a new peer with "try again" while it connects
 * (libfabric tcp); a hello is posted again each loop for up to this long. */
#define HELLO_TRY_NS 10000000000ull

typedef struct ka_peer {
    uint64_t id;         /* the peer this state is of (a slot is reused with a new id) */
    uint64_t last_heard; /* ns */
    uint64_t hello_until; /* a hello to post ("try again" at first, to a new peer), until */
    bool ping_out;        /* a PING of ours is with the provider */
    bool silent;          /* reported down as silent */
    bool bye_sent;        /* closing: its goodbye is posted */
} ka_peer;

typedef struct ka_grace {
    uint64_t id, until;
} ka_grace;

struct afs_ka {
    ka_peer *p; /* by peer slot index (grows with the table, never per beat) */
    uint32_t cap;
    ka_grace *grace; /* peers that said goodbye, with operations given until `until` */
    uint32_t n_grace, cap_grace;
    uint32_t out, bye_out; /* frames with the provider; goodbyes among them */
    uint64_t next_beat;
    uint64_t learning[LEARNING]; /* incarnations that said hello, handed up (ring) */
    uint32_t n_learned;
    uint32_t hellos_due; /* peers with hello_until set */
};

bool afs_ka_timers_idle(const afs_engine *eng)
{
    const struct afs_ka *ka = eng->ka;
    return !eng->cfg.heartbeat_ms && (!ka || (!ka->n_grace && !ka->hellos_due && !ka->out));
}

bool afs_ka_owns(uint64_t ctx)
{
    uint64_t t = ctx & 0xffu;
    return t == KA_TAG_PING || t == KA_TAG_BYE || t == KA_TAG_PONG;
}

static struct afs_ka *ka_of(afs_engine *eng)
{
    if (!eng->ka)
        eng->ka = calloc(1, sizeof(struct afs_ka));
    return eng->ka;
}

/* The state of peer slot `index`, grown to hold it (NULL: out of memory). */
static ka_peer *state_of(struct afs_ka *ka, uint32_t index, uint64_t id, uint64_t now)
{
    if (index >= ka->cap) {
        uint32_t cap = ka->cap ? ka->cap : 64;
        while (cap <= index)
            cap *= 2;
        ka_peer *p = realloc(ka->p, cap * sizeof(*p));
        if (!p)
            return NULL;
        memset(p + ka->cap, 0, (cap - ka->cap) * sizeof(*p));
        ka->p = p;
        ka->cap = cap;
    }
    ka_peer *s = &ka->p[index];
    if (s->id != id)
        *s = (ka_peer){.id = id, .last_heard = now};
    return s;
}

static uint32_t peers_alloc(afs_engine *eng)
{
    pthread_mutex_lock(&eng->peers.lock);
    uint32_t n = eng->peers.n_alloc;
    pthread_mutex_unlock(&eng->peers.lock);
    return n;
}

/* Live peer at slot `i` (and its id), NULL if none. */
static afs_peer_entry *peer_at(afs_engine *eng, uint32_t i, uint64_t *id)
{
    afs_peer_entry *p = afs_slots_at(&eng->peers, i);
    uint32_t gen = p ? atomic_load_explicit(&p->hdr.gen, memory_order_acquire) : 0;
    if (!(gen & 1u))
        return NULL;
    *id = ((uint64_t)gen << 32) | i;
    return p;
}

/* Posts one frame to `fi_addr` on NIC `nic`; false if it could not (best effort). */
static bool ka_send(afs_engine *eng, uint32_t nic, uint64_t fi_addr, uint32_t index,
                    uint8_t kind, uint32_t peer_max)
{
    struct afs_ka *ka = ka_of(eng);
    afs_nic *n = &eng->nics[nic];
    uint32_t max_out = eng->cfg.tx_depth / 8 ? eng->cfg.tx_depth / 8 : 1;
    if (!ka || n->tx_free_len == 0 || (kind != KA_BYE && ka->out >= max_out))
        return false;
    uint32_t slot = n->tx_free[n->tx_free_len - 1];
    uint8_t *buf = n->tx_buf + (uint64_t)slot * eng->cfg.max_msg_size;
    uint32_t alen = kind == KA_PING ? eng->address_len : 0;
    uint32_t room = peer_max && peer_max < eng->cfg.max_msg_size ? peer_max : eng->cfg.max_msg_size;
    if (KA_HDR + alen > room)
        alen = 0; /* the peer could not take it: it learns nothing, it still answers */
    buf[0] = 0xaf;
    buf[1] = 'K';
    buf[2] = KA_VERSION;
    buf[3] = kind;
    buf[4] = (uint8_t)alen;
    buf[5] = (uint8_t)(alen >> 8);
    buf[6] = buf[7] = 0;
    for (int b = 0; b < 8; b++)
        buf[8 + b] = (uint8_t)(eng->incarnation >> (8 * b));
    memcpy(buf + KA_HDR, eng->address, alen);
    uint64_t tag = kind == KA_PING ? KA_TAG_PING : kind == KA_BYE ? KA_TAG_BYE : KA_TAG_PONG;
    uint64_t ctx = ((uint64_t)nic << 56) | ((uint64_t)slot << 40) | ((uint64_t)index << 8) | tag;
    int rc = n->ops->post_send(n->dom, fi_addr, buf, KA_HDR + alen, n->tx_desc, ctx);
    if (rc) {
        afs_clear_error();
        return false;
    }
    n->tx_free_len--;
    ka->out++;
    if (kind == KA_BYE)
        ka->bye_out++;
    afs_count(&n->st_ctrl_sent, 1);
    return true;
}

void afs_ka_sent(afs_engine *eng, const afp_event *ev)
{
    struct afs_ka *ka = eng->ka;
    uint32_t nic = (uint32_t)(ev->ctx >> 56);
    afs_nic *n = &eng->nics[nic < eng->nnics ? nic : 0];
    uint32_t slot = (uint32_t)((ev->ctx >> 40) & 0xffffu);
    uint32_t index = (uint32_t)((ev->ctx >> 8) & 0xffffffffu);
    if (n->tx_free_len < eng->cfg.tx_depth)
        n->tx_free[n->tx_free_len++] = slot;
    if (!ka)
        return;
    if (ka->out)
        ka->out--;
    if ((ev->ctx & 0xffu) == KA_TAG_BYE && ka->bye_out)
        ka->bye_out--;
    if ((ev->ctx & 0xffu) == KA_TAG_PING && index < ka->cap)
        ka->p[index].ping_out = false;
}

/* The peer a frame comes from: the provider names `src` (on `nic`) and the frame states
 * `inc`. With `src` unknown (the provider cannot name senders) the claim alone decides, and
 * *verified says so. */
static afs_peer_entry *sender_of(afs_engine *eng, uint32_t nic, uint64_t src, uint64_t inc,
                                 uint64_t *id, uint32_t *index, bool *verified)
{
    *verified = src != AFP_SRC_UNKNOWN;
    if (src == AFP_SRC_UNRESOLVED)
        return NULL;
    uint32_t n = peers_alloc(eng);
    for (uint32_t i = 0; i < n; i++) {
        afs_peer_entry *p = peer_at(eng, i, id);
        if (p && p->incarnation == inc &&
            (!*verified ||
             ((p->tp_mask & (1u << eng->nics[nic].tp)) && p->fi_addr[nic] == src))) {
            *index = i;
            return p;
        }
    }
    return NULL;
}

static void heard(afs_engine *eng, uint64_t id, uint32_t index, uint64_t now, afs_ka_hook hook)
{
    struct afs_ka *ka = ka_of(eng);
    ka_peer *s = ka ? state_of(ka, index, id, now) : NULL;
    if (!s)
        return;
    s->last_heard = now;
    if (s->silent) {
        s->silent = false;
        hook(eng, AFS_KA_HEARD, id, NULL, 0);
    }
}

/* Whether the address a hello claims (`blob`) can be its sender's: where the provider names
 * the sender (a handle resolved here), its NIC address must be the claimed one's. A sender
 * the provider cannot name is learned all the same: what is learned is resolved unproven
 * and supersedes nothing until a frame from that NIC address states it (afs_peer_proven). */
static bool claim_matches_sender(afs_engine *eng, uint32_t nic, uint64_t src, const uint8_t *blob,
                                 uint32_t len)
{
    if (src == AFP_SRC_UNKNOWN || src == AFP_SRC_UNRESOLVED)
        return true;
    afs_addr_view v;
    if (afs_addr_parse(blob, len, &v) != 0)
        return false;
    /* the claimed address's NIC that corresponds to ours: same transport, same place */
    const afs_transport *tp = &eng->tps[eng->nics[nic].tp];
    uint32_t j = 0;
    while (j < v.ntp && strcmp(v.tp[j].name, tp->name) != 0)
        j++;
    if (j == v.ntp || nic - tp->first >= v.tp[j].nics)
        return false;
    const uint32_t at = v.tp[j].first + (nic - tp->first);
    uint32_t n = peers_alloc(eng);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t id;
        afs_peer_entry *q = peer_at(eng, i, &id);
        if (!q || !(q->tp_mask & (1u << (tp - eng->tps))) || q->fi_addr[nic] != src ||
            !q->nic_len[nic])
            continue;
        /* the provider names a peer known here: the claim must be of its NIC address */
        return q->nic_len[nic] == v.nic_addr_len[at] &&
               memcmp(q->addr + q->nic_off[nic], v.nic_addr[at], v.nic_addr_len[at]) == 0;
    }
    return true; /* a handle this engine did not resolve (another engine's): unproven */
}

/* A hello from an engine not resolved here: its address goes up to be resolved (once per
 * incarnation while pending, LEARN_MAX in all); once it is, it gets a goodbye. */
static void learn(afs_engine *eng, uint64_t inc, const uint8_t *blob, uint32_t len,
                  afs_ka_hook hook)
{
    struct afs_ka *ka = ka_of(eng);
    if (!ka || !len || ka->n_learned >= LEARN_MAX)
        return;
    for (uint32_t i = 0; i < LEARNING; i++)
        if (ka->learning[i] == inc)
            return; /* handed up already */
    ka->learning[ka->n_learned++ % LEARNING] = inc;
    hook(eng, AFS_KA_HELLO, 0, blob, len);
}

bool afs_ka_recv(afs_engine *eng, uint32_t nic, const uint8_t *buf, uint64_t len, uint64_t src,
                 afs_ka_hook hook)
{
    if (len < KA_HDR || buf[0] != 0xaf || buf[1] != 'K')
        return false;
    afs_count(&eng->nics[nic].st_ctrl_received, 1);
    uint8_t kind = buf[3];
    uint32_t alen = (uint32_t)buf[4] | ((uint32_t)buf[5] << 8);
    uint64_t inc = 0;
    for (int b = 0; b < 8; b++)
        inc |= (uint64_t)buf[8 + b] << (8 * b);
    if (buf[2] != KA_VERSION || KA_HDR + (uint64_t)alen > len)
        return true; /* a frame of a later version, or malformed: consumed, ignored */
    uint64_t id = 0;
    uint32_t index = 0;
    bool verified;
    afs_peer_entry *p = sender_of(eng, nic, src, inc, &id, &index, &verified);
    if (!p && src == AFP_SRC_UNRESOLVED) /* resolved here only after its connection came up
                                          (the provider may not name it then): its claim */
        p = sender_of(eng, nic, AFP_SRC_UNKNOWN, inc, &id, &index, &verified);
    uint64_t now = afs_now_ns();
    if (p && verified && (kind == KA_PING || kind == KA_PONG))
        afs_peer_proven(eng, p); /* the provider names it, at its NIC address, and it states
                                    its own incarnation: a restart there is proven */
    switch (kind) {
    case KA_PING:
        if (p) {
            atomic_fetch_or(&p->ka, AFS_KA_KNOWS_US); /* claimed: at worst one goodbye more */
            heard(eng, id, index, now, hook);
            uint32_t out = afs_peer_nic(eng, p);
            (void)ka_send(eng, out, p->fi_addr[out], index, KA_PONG, p->max_msg);
        } else if (src != AFP_SRC_UNKNOWN && src != AFP_SRC_UNRESOLVED) {
            (void)ka_send(eng, nic, src, UINT32_MAX, KA_PONG, 0); /* a handle of ours, by another
                                                                   incarnation: answer it there */
        }
        if (!p && !atomic_load(&eng->stop) && claim_matches_sender(eng, nic, src, buf + KA_HDR, alen))
            learn(eng, inc, buf + KA_HDR, alen, hook);
        break;
    case KA_PONG:
        if (p)
            heard(eng, id, index, now, hook);
        break;
    case KA_BYE:
        if (p && verified)
            hook(eng, AFS_KA_CLOSED, id, NULL, 0);
        break;
    default:
        break;
    }
    return true;
}

/* A peer came up (resolved, or running again) or went down (AFS_REQ_PEER, from peers.c or
 * from here): a new peer gets a hello. */
void afs_ka_peer(afs_engine *eng, uint64_t peer_id, int32_t status)
{
    if (status || atomic_load(&eng->stop))
        return;
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    if (!p || atomic_load(&p->superseded_by) || atomic_load(&p->down) ||
        (atomic_load(&p->ka) & AFS_KA_SAME_PROCESS))
        return;
    struct afs_ka *ka = ka_of(eng);
    for (uint32_t i = 0; ka && i < LEARNING; i++) {
        if (ka->learning[i] && ka->learning[i] == p->incarnation) { /* it said hello first */
            atomic_fetch_or(&p->ka, AFS_KA_KNOWS_US);
            ka->learning[i] = 0;
        }
    }
    uint64_t now = afs_now_ns();
    uint32_t index = (uint32_t)peer_id;
    ka_peer *s = ka ? state_of(ka, index, peer_id, now) : NULL;
    if (!s || s->hello_until)
        return;
    s->ping_out = ka_send(eng, afs_peer_nic(eng, p), p->fi_addr[afs_peer_nic(eng, p)], index, KA_PING, p->max_msg);
    if (!s->ping_out) { /* again from afs_ka_tick */
        s->hello_until = now + HELLO_TRY_NS;
        ka->hellos_due++;
    }
}

/* Hellos the provider said "try again" to. */
static void retry_hellos(afs_engine *eng, struct afs_ka *ka, uint64_t now)
{
    for (uint32_t i = 0; i < ka->cap && ka->hellos_due; i++) {
        ka_peer *s = &ka->p[i];
        if (!s->hello_until)
            continue;
        afs_peer_entry *p = afs_slots_lookup(&eng->peers, s->id);
        bool sent = p && !atomic_load(&p->down) &&
                    (s->ping_out || (s->ping_out = ka_send(eng, afs_peer_nic(eng, p), p->fi_addr[afs_peer_nic(eng, p)], i, KA_PING,
                                                           p->max_msg)));
        if (sent || !p || atomic_load(&p->down) || now > s->hello_until) {
            s->hello_until = 0;
            ka->hellos_due--;
        }
    }
}

bool afs_ka_grace(afs_engine *eng, uint64_t peer_id, uint32_t peer_flags)
{
    if ((peer_flags & AFS_PEER_GRACE_OVER) || afs_peer_flags_why(peer_flags) != AFS_PEER_CLOSED)
        return false;
    struct afs_ka *ka = ka_of(eng);
    if (!ka)
        return false;
    if (ka->n_grace == ka->cap_grace) {
        uint32_t cap = ka->cap_grace ? 2 * ka->cap_grace : 8;
        ka_grace *g = realloc(ka->grace, cap * sizeof(*g));
        if (!g)
            return false; /* failed at once instead */
        ka->grace = g;
        ka->cap_grace = cap;
    }
    ka->grace[ka->n_grace++] = (ka_grace){peer_id, afs_now_ns() + AFS_KA_GRACE_MS * 1000000ull};
    return true;
}

void afs_ka_tick(afs_engine *eng, uint64_t now, afs_ka_hook hook)
{
    struct afs_ka *ka = eng->ka;
    if (ka->hellos_due)
        retry_hellos(eng, ka, now);
    for (uint32_t i = 0; i < ka->n_grace;) {
        if (now < ka->grace[i].until) {
            i++;
            continue;
        }
        hook(eng, AFS_KA_GRACE_OVER, ka->grace[i].id, NULL, 0);
        ka->grace[i] = ka->grace[--ka->n_grace];
    }
    if (!eng->cfg.heartbeat_ms || now < ka->next_beat)
        return;
    uint64_t every = (uint64_t)eng->cfg.heartbeat_ms * 1000000ull;
    ka->next_beat = now + every;
    uint32_t n = peers_alloc(eng);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t id;
        afs_peer_entry *p = peer_at(eng, i, &id);
        uint32_t f = p ? atomic_load_explicit(&p->ka, memory_order_relaxed) : 0;
        if (!(f & (AFS_KA_USED | AFS_KA_KNOWS_US)) || (f & AFS_KA_SAME_PROCESS))
            continue;
        int32_t down = atomic_load(&p->down);
        if ((down && down != AFS_PEER_SILENT) || atomic_load(&p->superseded_by))
            continue;
        ka_peer *s = state_of(ka, i, id, now);
        if (!s)
            return;
        if (!s->silent && now - s->last_heard > AFS_HEARTBEAT_MISSES * every) {
            s->silent = true;
            hook(eng, AFS_KA_SILENT, id, NULL, 0);
        }
        if (!s->ping_out)
            s->ping_out = ka_send(eng, afs_peer_nic(eng, p), p->fi_addr[afs_peer_nic(eng, p)], i, KA_PING, p->max_msg);
    }
}

bool afs_ka_goodbye(afs_engine *eng)
{
    struct afs_ka *ka = ka_of(eng);
    if (!ka)
        return false;
    uint32_t unsent = 0, n = peers_alloc(eng);
    uint64_t now = afs_now_ns();
    for (uint32_t i = 0; i < n; i++) {
        uint64_t id;
        afs_peer_entry *p = peer_at(eng, i, &id);
        uint32_t f = p ? atomic_load(&p->ka) : 0;
        if (!(f & (AFS_KA_KNOWS_US | AFS_KA_USED)) || (f & AFS_KA_SAME_PROCESS) ||
            atomic_load(&p->superseded_by))
            continue;
        int32_t down = atomic_load(&p->down);
        ka_peer *s = state_of(ka, i, id, now);
        if (!s || s->bye_sent || down == AFS_PEER_EXITED || down == AFS_PEER_CLOSED)
            continue;
        s->bye_sent = ka_send(eng, afs_peer_nic(eng, p), p->fi_addr[afs_peer_nic(eng, p)], i, KA_BYE, p->max_msg);
        unsent += s->bye_sent ? 0u : 1u;
    }
    return unsent || ka->bye_out;
}

void afs_ka_free(afs_engine *eng)
{
    if (!eng->ka)
        return;
    free(eng->ka->p);
    free(eng->ka->grace);
    free(eng->ka);
    eng->ka = NULL;
}
