/*
 * The CPU side that the node-local providers (nvlink: CUDA IPC; cma: cross-memory attach)
 * share, compiled into each of them (build_native.py adds providers/common/ to both):
 *  - the domain's own segment (node_seg.h), its wakeup socket and its export slots;
 *  - peers: their segments, liveness (the owner's flock, probed at most every
 *    AFN_LIVENESS_NS), wakeups;
 *  - imports: (peer, key) -> the owner's export entry as last checked (range, access, the
 *    provider's address delta), revalidated against the entry's generation on every use;
 *  - completions: a ring of events for poll; immediates appended to the target's mailbox
 *    only when the provider says the data has landed (afn_finish_op), held and retried
 *    while the target's mailbox is full;
 *  - the mailbox consumer (immediates, SEND payloads into posted receives), trywait,
 *    send/recv, address/resolve/forget. Our ring found corrupt is reset (node_seg.h) and
 *    each reset is reported once, as a failed receive (AFP_EV_ERROR on a posted receive:
 *    the shim counts it in the NIC's `errors` and posts the buffer again) whose text says
 *    what was wrong: records were lost, and the application cannot be told which.
 * What moves the bytes (CUDA copies, process_vm_writev) stays in each provider.
 *
 * Threading: called from the shim's worker thread of the domain only (provider ABI rule).
 */
#ifndef AFN_NODE_CORE_H
#define AFN_NODE_CORE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "afabric_provider.h"
#include "node_seg.h"

#define AFN_LIVENESS_NS 200000ull /* a peer's flock is probed at most every 200 us */
#define AFN_REPAIR_POLLS 256u     /* our header's fixed fields are checked this often */

typedef struct afn_addr {
    uint32_t magic;
    uint32_t version;
    uint64_t token;
    uint8_t boot_id[16]; /* same node (kernel boot) as us? */
    char seg[MB_NAME_LEN];
} afn_addr;

typedef struct afn_peer {
    bool used, dead;
    uint8_t gone;  /* once dead: MB_OWNER_CLOSED or MB_OWNER_GONE (the error texts differ) */
    int32_t pid;   /* the owner's, read once at resolve (the segment's copy may change) */
    mb_seg seg;
    uint64_t token;
    uint64_t checked_ns;
    struct sockaddr_un wake;
    socklen_t wake_len;
} afn_peer;

typedef struct afn_import {
    uint64_t peer, key; /* 0 key: empty slot */
    uint64_t gen_addr;  /* where the entry's generation lives (the peer's mapping) */
    uint64_t base, len; /* owner's registered range */
    int64_t delta;      /* our address = owner's address + delta */
    uint32_t access;    /* what the owner allows: AFP_MR_REMOTE | AFP_MR_REMOTE_READ */
    bool tomb;
} afn_import;

/* One operation's outcome, reported by afn_finish_op. */
typedef struct afn_op {
    uint64_t ctx;
    uint64_t peer;
    uint64_t arrivals; /* immediates to deliver once the data has landed (0: none) */
    uint32_t imm;
    int32_t status;
    char *text;
} afn_op;

typedef struct afn_ev { /* a completion waiting to be handed to the shim */
    uint32_t kind, op;
    int32_t status;
    uint32_t imm;
    uint64_t ctx, len;
    char *text;
} afn_ev;

typedef struct afn_recv {
    void *buf;
    uint64_t len, ctx;
} afn_recv;

/* Maps a fresh import: sets *delta (our address = owner's + delta) for export entry `e` of
 * `peer`. 0 or an AFP_E* code with the domain's errbuf set. */
typedef int (*afn_map_fn)(void *arg, uint64_t peer, const mb_export *e, int64_t *delta);

typedef struct afn_core {
    const mb_kind *kind;
    uint32_t addr_magic;
    uint64_t token;
    uint8_t boot_id[16];
    mb_seg seg;     /* ours */
    int wake_fd;    /* bound to our abstract name: the wait fd */
    int send_fd;    /* for waking peers */
    uint32_t free_exports, next_export; /* export slots: free list through export_next */
    uint32_t *export_next;

    afn_peer *peers;
    uint32_t npeers, peers_cap;
    afn_import *imports;
    uint32_t imp_cap, imp_len; /* open addressing, power of two */

    afn_op *held;      /* landed data whose immediate waits for mailbox room */
    uint32_t nheld, held_cap;
    afn_ev *evq;       /* ring of completions for poll */
    uint32_t evq_head, evq_len, evq_cap;
    afn_recv *rq;      /* posted receives, FIFO ring */
    uint32_t rq_head, rq_len, rq_cap;

    uint32_t polls;               /* mb_repair runs every AFN_REPAIR_POLLS polls, and before
                                     sleeping */
    uint64_t mb_resets;           /* our ring found corrupt and reset, since open */
    bool mb_report_pending;       /* the last reset is still to be reported */
    char mb_report[AFP_ERRTEXT_LEN];

    char errbuf[AFP_ERRTEXT_LEN];
} afn_core;

#define AFN_ERR(c, code, ...) (afp_errf((c)->errbuf, sizeof (c)->errbuf, __VA_ARGS__), (code))

uint64_t afn_now_ns(void);
void *afn_grow(void *p, uint32_t *cap, uint32_t need, size_t elem);
char *afn_dup_text(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Sets up `c` (zeroed by the caller) and creates our segment and wakeup socket. */
int afn_open(afn_core *c, const mb_kind *kind, uint32_t addr_magic, uint64_t token, char *err,
             size_t errlen);
/* Releases everything afn_open and later calls made (safe on a half-open core). */
void afn_close(afn_core *c);

void afn_push_ev(afn_core *c, uint32_t kind, int32_t status, uint64_t ctx, uint32_t imm,
                 uint64_t len, uint32_t op, char *text);
void afn_write_failed(afn_core *c, uint64_t ctx, int status, char *text);
/* Reports an operation: its error, or its immediates (after the data landed) and done. */
void afn_finish_op(afn_core *c, afn_op *op);

afn_peer *afn_peer_of(afn_core *c, uint64_t handle);
/* Alive, as far as we can tell at most AFN_LIVENESS_NS ago (force: ask now). */
bool afn_peer_alive(afn_peer *p, bool force);
/* Why a dead peer is: "its engine was closed" or "its process is gone", with its pid. */
const char *afn_gone_text(const afn_peer *p, char *buf, size_t len);

/* Export slots of our table: a free index, or UINT32_MAX when all are taken. */
uint32_t afn_export_take(afn_core *c);
/* Publishes entry `idx` (the caller filled everything but gen); returns the key. */
uint64_t afn_export_publish(afn_core *c, uint32_t idx);
/* Revokes entry `idx` at once (its generation moves on) and frees the slot. */
void afn_export_revoke(afn_core *c, uint32_t idx);

/* The import for [raddr, +len) of region `key` of `peer`, checked against the owner's export
 * entry (not the descriptor, which a peer could forge): its generation, range and what it
 * allows (`need`). map_fn is called for an entry seen for the first time. 0 or AFP_E* with
 * errbuf set. */
int afn_translate(afn_core *c, uint64_t peer, uint64_t key, uint64_t raddr, uint64_t len,
                  uint32_t need, afn_map_fn map_fn, void *map_arg, afn_import **out);
void afn_forget_imports(afn_core *c, uint64_t peer);

/* poll's CPU part: clears our sleeping flag, retries held immediates, drains the mailbox and
 * copies up to `max` queued events into `ev`. Returns how many. */
uint32_t afn_poll_events(afn_core *c, afp_event *ev, uint32_t max);
/* trywait: 0 if it is safe to sleep (`busy`: the provider still has work in flight). */
int afn_trywait(afn_core *c, bool busy);

int afn_post_send(afn_core *c, uint64_t peer, const void *buf, uint64_t len, uint64_t ctx);
int afn_post_recv(afn_core *c, void *buf, uint64_t len, uint64_t ctx);
int afn_address(afn_core *c, void *buf, size_t *len);
int afn_resolve(afn_core *c, const void *addr, size_t len, uint64_t *peer);
/* Detaches a peer (the provider first stops using its imports/mappings). */
int afn_forget(afn_core *c, uint64_t peer);

#endif
