/* Private declarations shared by the shim's source files (never seen by ctypes). */
#ifndef AFABRIC_INTERNAL_H
#define AFABRIC_INTERNAL_H

#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "afabric_provider.h"
#include "afabric_shim.h"

#define AFS_MAX_NICS 8u       /* NICs of one transport (a domain group) */
#define AFS_ENG_NICS 16u      /* NICs of one engine, every transport's together */
#define AFS_ADDR_MAGIC "AFA1"  /* one transport (a single-provider engine) */
#define AFS_ADDR_MAGIC2 "AFA2" /* several transports (a routed engine) */
#define AFS_DESC_MAGIC "AFD1"  /* before reads: no access field (still decoded) */
#define AFS_DESC_MAGIC2 "AFD2" /* with the region's access (AFP_MR_REMOTE | AFP_MR_REMOTE_READ) */
#define AFS_DESC_MAGIC3 "AFD3" /* and which of the owner's transports hold the region */
#define AFS_MAX_PROVNAME 31u
/* Work requests posted for one transfer per progress round: the paper's release posts
 * at most 32 per round because EFA's small-message rate collapses otherwise. */
#define AFS_POST_ROUND 32u
#define AFS_POLL_BATCH 64u
/* Distinct immediate values the counter table keeps unless configured (about 2-4 MiB). */
#define AFS_MAX_IMM_VALUES_DEFAULT 65536u

/* ---- errors.c ---- */
int afs_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void afs_clear_error(void);
char *afs_strdup_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *afs_error_name(int code);

/* ---- util.c ---- */
uint64_t afs_now_ns(void);
/* Fewer CPUs than this for the calling thread: a third thread that spins (the Python loop's
 * polling, a benchmark's waiting) takes the time a worker needs (afabric/engine.py,
 * _POLL_MIN_CPUS), and a worker with nothing to do yields its core (worker.c). */
#define AFS_FEW_CPUS 4
bool afs_few_cpus(void);
uint64_t afs_random_u64(void);
uint64_t afs_mix64(uint64_t x);
uint32_t afs_crc32(const uint8_t *buf, size_t len);

/* ---- keys.c: remote keys (keyed by a per-engine secret) and incarnations ---- */
uint64_t afs_mr_key(const uint64_t secret[2], uint32_t nic, uint64_t counter);
uint64_t afs_new_incarnation(void); /* creation time (us) << 12 | random: later is larger */

/* ---- mpsc.c: Vyukov's intrusive multi-producer single-consumer queue ---- */
typedef struct afs_qnode {
    _Atomic(struct afs_qnode *) next;
} afs_qnode;

typedef struct afs_mpsc {
    _Atomic(afs_qnode *) head; /* producers swap here */
    afs_qnode *tail;           /* consumer only */
    afs_qnode stub;
} afs_mpsc;

void afs_mpsc_init(afs_mpsc *q);
void afs_mpsc_push(afs_mpsc *q, afs_qnode *n);
/* Returns NULL when empty or when a producer is between its two steps (retry later). */
afs_qnode *afs_mpsc_pop(afs_mpsc *q);
bool afs_mpsc_empty(afs_mpsc *q);

/* ---- ring.c: completion ring (worker -> Python) with an eventfd ---- */
typedef struct afs_ring {
    afs_completion *slots;
    uint32_t mask;
    _Atomic uint64_t head; /* consumer position */
    _Atomic uint64_t tail; /* producer position */
    _Atomic int consumer_waiting;
    int event_fd;
    /* producer-only overflow for when the ring is full: records are never dropped */
    afs_completion *overflow;
    size_t overflow_len, overflow_cap;
    bool pushed_since_notify;
    uint64_t held_since; /* producer: since when it holds a waiting consumer's signal (0: not) */
} afs_ring;

int afs_ring_init(afs_ring *r, uint32_t capacity);
void afs_ring_destroy(afs_ring *r);
void afs_ring_push(afs_ring *r, const afs_completion *c); /* worker */
/* worker: overflow + eventfd; `inflight`: operations still with the provider. Returns
 * whether it holds back a waiting consumer's signal (more completions are due soon). */
bool afs_ring_flush(afs_ring *r, size_t inflight, uint64_t now);
/* consumer; poll: leave the eventfd alone and ask for no signal (the consumer looks again) */
uint32_t afs_ring_drain(afs_ring *r, afs_completion *out, uint32_t max, bool poll);
uint64_t afs_ring_pending(afs_ring *r); /* consumer: records ready, and no signal wanted */
/* consumer: when the ring holds just operation `id`'s plain success, consume it */
bool afs_ring_take(afs_ring *r, uint64_t id);

/* ---- immtab.c: immediate counters ---- */
typedef struct afs_imm_entry {
    uint32_t imm;
    uint32_t used;
    uint64_t arrived;  /* counted and not yet consumed */
    uint64_t expected; /* 0 = no expectation */
    struct afs_xfer *waiter;
} afs_imm_entry;

typedef struct afs_immtab {
    afs_imm_entry *e;
    uint32_t cap; /* power of two */
    uint32_t len;
} afs_immtab;

int afs_immtab_init(afs_immtab *t);
void afs_immtab_destroy(afs_immtab *t);
afs_imm_entry *afs_immtab_get(afs_immtab *t, uint32_t imm, bool create);
void afs_immtab_maybe_remove(afs_immtab *t, afs_imm_entry *e);

/* ---- slots.c: stable tables with generations, read lock-free from submitting threads ---- */
#define AFS_SLOT_CHUNK 1024u
#define AFS_SLOT_CHUNKS 4096u

typedef struct afs_slot_hdr {
    _Atomic uint32_t gen; /* odd = live; changes on every free */
    uint32_t next_free;
} afs_slot_hdr;

typedef struct afs_slots {
    size_t elem_size; /* starts with afs_slot_hdr */
    _Atomic(uint8_t *) chunks[AFS_SLOT_CHUNKS];
    uint32_t n_alloc;   /* slots handed out so far (guarded by lock) */
    uint32_t free_head; /* UINT32_MAX = none */
    pthread_mutex_t lock; /* allocation only, never on the data path */
} afs_slots;

int afs_slots_init(afs_slots *s, size_t elem_size);
void afs_slots_destroy(afs_slots *s);
/* Allocates a slot; the element is zeroed except the header. Publish with afs_slots_publish. */
int afs_slots_alloc(afs_slots *s, uint32_t *index, void **elem);
uint64_t afs_slots_publish(afs_slots *s, uint32_t index); /* returns the id (gen<<32 | index) */
void afs_slots_release(afs_slots *s, uint32_t index);     /* gen bumps: ids become stale */
/* Element for an id if it is live now (caller must re-validate with afs_slots_still). */
void *afs_slots_lookup(afs_slots *s, uint64_t id);
bool afs_slots_still(afs_slots *s, uint64_t id);
void *afs_slots_at(afs_slots *s, uint32_t index); /* raw, NULL if never allocated */

/* ---- procfs.c: what /proc says of a process ---- */
typedef struct afs_proc_id {
    uint64_t host;  /* boot id and pid namespace, hashed; 0 = unknown */
    uint64_t start; /* start time (clock ticks after boot): a reused pid has another */
    uint32_t pid;
} afs_proc_id;
int afs_proc_self(afs_proc_id *out);
int afs_proc_stat(uint32_t pid, char *state, uint64_t *start); /* AFS_EIO if unreadable */
uint64_t afs_proc_start(uint32_t pid);                          /* 0 if unreadable */
/* Whether the process `pid` that started at `start` has exited or is exiting (PF_EXITING: a
 * SIGKILLed process's sockets close before its pidfd turns readable): what /proc showed, or
 * NULL for a process alive (or /proc unreadable for a reason of this process's, EMFILE). A
 * process whose main thread alone has exited (pthread_exit) reads as exiting too. */
const char *afs_proc_gone(uint32_t pid, uint64_t start);

/* ---- peers.c: watching same-host peers' processes ---- */
typedef struct afs_live afs_live;
#define AFS_PEER_EXITED 1  /* afs_peer_entry.down: for good */
#define AFS_PEER_STOPPED 2 /* until the process runs again (afs_config.peer_stop_ms) */
#define AFS_PEER_CLOSED 3  /* its engine said goodbye (keepalive.c): for good */
#define AFS_PEER_SILENT 4  /* unanswered heartbeats (afs_config.heartbeat_ms), until it answers */
void afs_live_watch(afs_engine *eng, uint64_t peer_id, const afs_proc_id *who);
int afs_live_start(afs_engine *eng); /* the thread, at engine creation: it watches the worker */
/* Closing: stop the thread (it submits to the worker), then, while waiting for the worker,
 * sweep for peers that exited since (their provider is told: a worker may be spinning on
 * what one held), then destroy. */
void afs_live_stop(afs_engine *eng);
void afs_live_sweep(afs_engine *eng);
void afs_live_destroy(afs_engine *eng);

/* ---- codec.c: address and descriptor blobs ---- */
/* One transport an address lists: its provider's name and its NICs in nic_addr[]. */
typedef struct afs_addr_tp {
    char name[AFS_MAX_PROVNAME + 1];
    uint32_t first, nics;
} afs_addr_tp;

typedef struct afs_addr_view {
    uint64_t incarnation;
    uint32_t nics;    /* every transport's together */
    uint32_t max_msg; /* largest message the engine receives (rounded down), 0 = unknown */
    afs_proc_id proc; /* the owner process, zeroed when the address does not say */
    char provider[AFS_MAX_PROVNAME + 1]; /* the first transport's name (messages) */
    uint32_t ntp;
    bool routed; /* AFA2 */
    afs_addr_tp tp[AFS_MAX_TRANSPORTS];
    const uint8_t *nic_addr[AFS_ENG_NICS];
    uint32_t nic_addr_len[AFS_ENG_NICS];
} afs_addr_view;

typedef struct afs_desc_view {
    afs_addr_view owner;
    const uint8_t *addr_blob;
    uint32_t addr_blob_len;
    uint64_t base;
    uint64_t length;
    int32_t device;
    uint64_t remote_base[AFS_ENG_NICS];
    uint64_t key[AFS_ENG_NICS];
    uint32_t access;  /* AFP_MR_REMOTE | AFP_MR_REMOTE_READ; 0: not stated (AFD1) */
    uint32_t tp_mask; /* the owner's transports (bit = index in its address) holding keys */
} afs_desc_view;

/* AFA1 when ntp is 1 and !routed, else AFA2 listing each transport (names[t], tp_nics[t]). */
int afs_addr_encode(bool routed, uint32_t ntp, const char *const *names, const uint32_t *tp_nics,
                    uint64_t incarnation, uint32_t max_msg, const uint8_t *const *addrs,
                    const uint32_t *lens, uint8_t *out, uint32_t cap, uint32_t *len);
int afs_addr_parse(const uint8_t *buf, uint32_t len, afs_addr_view *out);
/* AFD2, or AFD3 with `tp_mask` when `routed` (keys of transports outside it are 0). */
int afs_desc_encode(const uint8_t *addr_blob, uint32_t addr_len, uint64_t base, uint64_t length,
                    int32_t device, uint32_t access, uint32_t nics, const uint64_t *remote_base,
                    const uint64_t *key, bool routed, uint32_t tp_mask, uint8_t *out,
                    uint32_t cap, uint32_t *len);
int afs_desc_parse(const uint8_t *buf, uint32_t len, afs_desc_view *out);

/* ---- engine objects ---- */
/* One transport of an engine: a provider and its NICs (a domain group). */
typedef struct afs_transport {
    char *lib_path, *name, *fabric_provider, *nic_name, *bind_addr;
    uint32_t nics_wanted, reach;
    void *lib;
    const struct afp_ops *ops;
    uint32_t first, count; /* its NICs in afs_engine.nics */
    uint32_t caps;         /* its first NIC's AFP_CAP_* */
    uint64_t max_write;    /* its first NIC's max_msg_size */
} afs_transport;

typedef struct afs_nic {
    const struct afp_ops *ops; /* its transport's provider */
    uint32_t tp;               /* its transport (afs_engine.tps) */
    afp_domain *dom;
    afp_caps caps;
    uint8_t addr[AFP_MAX_ADDR_LEN];
    uint32_t addr_len;
    /* send/receive buffer pools, registered on this NIC */
    uint8_t *rx_buf, *tx_buf;
    afp_mr *rx_mr, *tx_mr;
    void *rx_desc, *tx_desc;
    /* counters (afs_nic_stats): written by the worker alone, read by anyone */
    _Atomic uint64_t st_writes, st_write_bytes, st_sends, st_recvs, st_imms, st_errors,
        st_retries, st_landed, st_completions, st_rejected, st_rejected_unknown, st_imms_dropped,
        st_reads, st_read_bytes, st_ctrl_sent, st_ctrl_received;
    uint32_t *tx_free; /* stack of free tx slots */
    uint32_t tx_free_len;
    /* receive slots the provider would not take back yet ("try again": its queue or context
     * pool was full of writes); the worker posts them again before polling (worker.c) */
    uint32_t *rx_retry;
    uint32_t rx_retry_len;
    uint64_t key_counter;
    uint64_t found_turn; /* worker: the loop turn whose look at it last found something */
} afs_nic;

typedef struct afs_mr_entry {
    afs_slot_hdr hdr;
    uint64_t addr, len;
    uint32_t flags;
    int32_t device;
    uint32_t local_mask;  /* transports it is registered with (bit = transport index) */
    uint32_t remote_mask; /* ... of which peers may reach it through these */
    afp_mr *mr[AFS_ENG_NICS];
    void *desc[AFS_ENG_NICS];
    uint64_t rkey[AFS_ENG_NICS];
    uint64_t rbase[AFS_ENG_NICS];
} afs_mr_entry;

typedef struct afs_peer_entry {
    afs_slot_hdr hdr;
    uint64_t fi_addr[AFS_ENG_NICS]; /* by this engine's NIC, on the transports in tp_mask */
    uint32_t tp_mask;               /* this engine's transports that reach it */
    uint32_t peer_tp[AFS_MAX_TRANSPORTS]; /* ... and the index of each in its address */
    char refused[256]; /* transports that did not reach it, and why ("" if none) */
    uint64_t incarnation;
    _Atomic uint64_t superseded_by; /* a later incarnation at the same NIC addresses, or 0 */
    _Atomic int32_t down;           /* peers.c: AFS_PEER_*, else 0 */
    _Atomic uint32_t ka;            /* AFS_KA_* (keepalive.c, peers.c, api.c) */
    uint32_t pid;                   /* its process as its address names it (0: unknown) */
    uint64_t start;                 /* ... and that process's start time */
    uint32_t max_msg;               /* largest message it receives, 0 = unknown */
    uint32_t addr_len;
    uint8_t addr[1024];
    /* each of its NICs' address in `addr`, by this engine's NIC (keepalive.c) */
    uint16_t nic_off[AFS_ENG_NICS], nic_len[AFS_ENG_NICS];
} afs_peer_entry;

#define AFS_KA_USED 1u     /* an operation went to it (api.c): heartbeats go to it */
#define AFS_KA_KNOWS_US 2u /* it resolved this engine (it said hello): a goodbye goes to it */
#define AFS_KA_WATCHED 4u  /* its process is watched (peers.c) */
/* It lives in this process (peers.c): no frames to it. An engine closed in this process is
 * refused by the provider already (docs/guide/peers.md), and libfabric 2.5.1's shm crashed in
 * fi_cq_readfrom when an in-process engine that had been sent to first (here: a hello)
 * then sent a large message (several frames) to the sender. */
#define AFS_KA_SAME_PROCESS 8u
/* A frame from the provider-named sender at its NIC addresses stated its incarnation
 * (keepalive.c): only a proven incarnation supersedes older ones at those addresses, or
 * makes an address of an older one be refused (engine.c). A claim proves nothing. */
#define AFS_KA_PROVEN 16u

/* A peer's down state (afs_peer_entry.down) moves to `why`: EXITED and CLOSED are final,
 * STOPPED replaces running or SILENT, SILENT only running. True if it moved (the caller
 * then tells the worker). peers.c and worker.c (keepalive.c's findings). */
static inline bool afs_peer_set_down(afs_peer_entry *p, int32_t why)
{
    int32_t was = atomic_load(&p->down);
    while (was != AFS_PEER_EXITED && was != AFS_PEER_CLOSED && was != why &&
           (why != AFS_PEER_SILENT || was == 0))
        if (atomic_compare_exchange_weak(&p->down, &was, why))
            return true;
    return false;
}

/* ... back to running from `from` (STOPPED or SILENT). */
static inline bool afs_peer_set_up(afs_peer_entry *p, int32_t from)
{
    int32_t was = from;
    return atomic_compare_exchange_strong(&p->down, &was, 0);
}

/* AFS_C_PEER's peer_flags for a peer down for `why` (0: up), and back. */
static inline uint32_t afs_peer_flags(int32_t why, bool watched)
{
    return (watched ? 1u : 0u) | (why == AFS_PEER_STOPPED ? 2u : 0u) |
           (why == AFS_PEER_CLOSED ? 4u : 0u) | (why == AFS_PEER_SILENT ? 8u : 0u);
}

static inline int32_t afs_peer_flags_why(uint32_t peer_flags)
{
    return peer_flags & 2u   ? AFS_PEER_STOPPED
           : peer_flags & 4u ? AFS_PEER_CLOSED
           : peer_flags & 8u ? AFS_PEER_SILENT
                             : AFS_PEER_EXITED;
}

static inline const char *afs_peer_down_text(int32_t why)
{
    return why == AFS_PEER_STOPPED  ? "its process is stopped"
           : why == AFS_PEER_CLOSED ? "its engine was closed (it said goodbye)"
           : why == AFS_PEER_SILENT ? "it is silent (heartbeats unanswered)"
                                    : "its process has exited";
}

/* An imported descriptor, its keys by this engine's NIC, on the transports in tp_mask. */
typedef struct afs_remote_entry {
    afs_slot_hdr hdr;
    uint64_t peer_id;
    uint64_t fi_addr[AFS_ENG_NICS];
    uint64_t length;
    uint64_t rbase[AFS_ENG_NICS];
    uint64_t key[AFS_ENG_NICS];
    uint32_t access;  /* as the descriptor states it (0: not stated) */
    uint32_t tp_mask; /* transports that reach its owner and hold its keys */
} afs_remote_entry;

/* Request kinds travelling through the submit queue. */
enum afs_req_kind {
    AFS_REQ_CTRL = 1,
    AFS_REQ_WRITE,
    AFS_REQ_PAGED,
    AFS_REQ_SEND,
    AFS_REQ_EXPECT,
    AFS_REQ_CANCEL,
    AFS_REQ_RECV_RELEASE,
    AFS_REQ_SCATTER, /* one write per target (a barrier is a scatter of zero-length writes) */
    AFS_REQ_WATCH,   /* the watcher thread saw a word change: (watcher, old, new) */
    AFS_REQ_IMM_RETURN, /* arrivals (imm, count) an expectation consumed after its withdrawal */
    AFS_REQ_PEER /* peers.c: peer target_id is up (status 0) or down: fail what goes to it */
};

/* One target of a scatter or barrier, resolved at submit time. */
typedef struct afs_target {
    uint64_t fi_addr, rbase, rkey;
    uint64_t length, src_offset, dst_offset;
    uint32_t nic;
    uint32_t reserved;
} afs_target;

/* ---- watchers: 64-bit words a GPU kernel (or anyone) bumps; watcher.c ---- */
typedef struct afs_watcher {
    afs_slot_hdr hdr;
    _Atomic(uint64_t) *word; /* host address (mapped into the GPU's space when CUDA) */
    uint64_t device_ptr;     /* the same word as the GPU sees it, or 0 */
    int32_t device;          /* CUDA device of the mapping, or -1 */
    uint32_t alloc;          /* how it was allocated (host or CUDA mapped) */
    uint64_t last;           /* watcher thread only: the last value reported */
    uint64_t current;        /* worker only: the value triggers compare against */
} afs_watcher;

enum afs_ctrl_op { AFS_CTRL_REG = 1, AFS_CTRL_DEREG, AFS_CTRL_RESOLVE, AFS_CTRL_ALLOW };

typedef struct afs_allow afs_allow; /* allow.c: an allow-list snapshot */

/* The one hook into the worker's completion path. A request whose `done_hook` is set is
 * not reported on the completion ring: the worker (its thread) calls
 * `done_hook(done_arg, status, text, what)` instead. Each request is reported exactly once
 * (AFS_HOOK_REPORTED: its outcome, `status` its failure, 0 if none, `text` the failure's
 * detail or NULL, valid during the call only; AFS_ECLOSED when the
 * engine closes under it) and released exactly once (AFS_HOOK_RELEASED: the provider holds
 * none of its work requests any more; it is freed right after), in one call or two: a
 * failed request whose work requests are still posted (a timeout, a dead peer) is reported
 * at once and released when the provider lets go, which may be never (libfabric 1.17 shm
 * and a dead peer). The only user is the raw benchmark loop (afs_bench_*, api.c), which
 * drives the submit path from C; the rest of the worker knows nothing of benchmarks. */
enum { AFS_HOOK_REPORTED = 1u, AFS_HOOK_RELEASED = 2u };
typedef void (*afs_done_hook)(void *arg, int32_t status, const char *text, uint32_t what);

/*
 * One request travelling through the submit queue: a common head every kind uses (queue
 * node, list links, deadline, failure, completion hook, timing, work-request counters) and
 * the part of its kind, in a union. One allocation per operation, as before, but each
 * kind's fields are visibly its own (`x->rma.length`, `x->ctrl.err`) and the request is the
 * size of the head and its largest part instead of every kind's fields side by side. Read
 * or write a part only after checking `kind` (afs_xfer_is_rma): the parts overlap. The
 * ASan build lays them side by side instead and poisons every part but the request's own
 * (afs_xfer_new), so touching another kind's part is reported, not silently read.
 */
#if defined(__SANITIZE_ADDRESS__)
#define AFS_XFER_CHECK_PARTS 1
#define AFS_XFER_PARTS struct
#else
#define AFS_XFER_PARTS union
#endif
typedef struct afs_xfer {
    afs_qnode qn; /* first: the queue node */
    uint32_t kind;
    uint64_t id;
    struct afs_xfer *prev, *next; /* active/zombie/expect/armed/settling list links (worker) */
    struct afs_xfer *pnext;       /* post queue link (worker) */
    bool in_postq;
    uint64_t deadline_ns;
    int32_t status;
    bool reported;
    char *errtext;
    afs_done_hook done_hook;  /* see afs_done_hook: called instead of a completion record */
    void *done_arg;

    /* work-request counters of the posting kinds (RMA and send) */
    uint64_t total_wr;  /* data WRs to post */
    uint64_t posted_wr;
    uint64_t done_wr;
    uint64_t t_first_post; /* ns, for timing triggered and regular operations */
    uint64_t refused_since; /* ns: the provider has refused its next post (EAGAIN) since */
    uint64_t t_enqueue, t_pickup, t_last_post; /* AFS_CFG_TIMING only */

    AFS_XFER_PARTS {
        /* AFS_REQ_WRITE, AFS_REQ_PAGED, AFS_REQ_SCATTER: one-sided writes and reads */
        struct afs_xfer_rma {
            bool imm_pending; /* contiguous multi-WR write: immediate goes after the data */
            bool whole;       /* paged write handed to the provider whole (post_paged) */
            bool has_imm;
            bool read; /* a read (afs_read*, afs_gather): local_* is the destination, the remote
                          side (rbase + dst_*, targets' dst_offset) the source; never an imm */
            uint32_t imm;

            /* the route's NICs: eng->nics[nic_first .. nic_first + nic_count - 1] (a
             * scatter's targets have their own); the arrays are by the engine's NIC */
            uint32_t nic_first, nic_count;
            /* write / paged */
            uint64_t local_addr;
            void *local_desc[AFS_ENG_NICS];
            uint64_t fi_addr[AFS_ENG_NICS];
            uint64_t rbase[AFS_ENG_NICS];
            uint64_t rkey[AFS_ENG_NICS];
            uint64_t length;   /* contiguous: bytes; paged: page length */
            uint64_t dst_addr; /* contiguous: remote offset already added to rbase */
            uint64_t chunk;
            uint64_t count; /* paged: pages; scatter: targets */
            int64_t *src_idx, *dst_idx;
            uint64_t src_stride, src_offset, dst_stride, dst_offset;

            /* scatter / barrier */
            afs_target *targets;
            uint32_t nic0; /* first NIC of a round-robin spread (worker-assigned) */
            uint32_t shards;
            uint64_t shard_len;

            /* triggered operations: posted by the worker when the condition holds */
            uint32_t trig_kind; /* AFS_TRIG_* */
            bool armed;
            bool trig_seen; /* worker.c, fire_watched: its word was seen at its value */
            uint64_t trig_watcher, trig_value;

            /* dynamic length (dynlen.c, AFS_REQ_WRITE only): `length` is the maximum until
             * the write starts */
            bool dyn_len;
            const uint32_t *dyn_word;
            int64_t dyn_base;
            uint64_t dyn_scale;
        } rma;

        /* AFS_REQ_SEND */
        struct afs_xfer_send {
            uint32_t nic; /* the first NIC of the peer's route */
            uint64_t peer_fi_addr;
            uint8_t *payload; /* a copy, owned */
            uint64_t length;
            uint32_t tx_slot;
        } send;

        /* AFS_REQ_EXPECT: wait for `count` arrivals of `imm`; AFS_REQ_IMM_RETURN: give back
         * `count` arrivals of `imm` an expectation consumed after its withdrawal */
        struct afs_xfer_expect {
            uint32_t imm;
            uint64_t count;
        } expect;

        /* AFS_REQ_CANCEL: withdraw an expectation or disarm a triggered operation */
        struct afs_xfer_cancel {
            uint64_t xfer_id;
        } cancel;

        /* AFS_REQ_WATCH: the watcher thread saw a word change */
        struct afs_xfer_watch {
            uint64_t watcher_id;
            uint64_t old_value, new_value;
        } watch;

        /* AFS_REQ_RECV_RELEASE: receive slots handed back to the provider */
        struct afs_xfer_release {
            uint32_t *slots; /* owned */
            uint32_t n_slots;
        } release;

        /* AFS_REQ_PEER (peers.c): peer `peer_id` is up (status 0) or down */
        struct afs_xfer_peer {
            uint64_t peer_id;
            uint32_t pid;   /* its process, 0 if unknown */
            uint32_t flags; /* 1: its process is watched; 2: down because stopped */
        } peer;

        /* AFS_REQ_CTRL: a synchronous control request (afs_ctrl_call); the caller owns it */
        struct afs_xfer_ctrl {
            uint32_t op; /* AFS_CTRL_* */
            int32_t rc;
            char err[AFP_ERRTEXT_LEN];
            sem_t done;
            afs_mr_entry *mr;
            /* AFS_CTRL_RESOLVE: the peer's NIC addresses by this engine's NIC, on the
             * transports in tp_want; the worker sets tp_got and `refused` */
            const uint8_t *addr[AFS_ENG_NICS];
            uint32_t addr_len[AFS_ENG_NICS];
            uint64_t fi_addr[AFS_ENG_NICS];
            uint32_t tp_want, tp_got;
            char refused[256];
            afs_allow *allow; /* AFS_CTRL_ALLOW: the worker's new list (NULL: every peer) */
            /* AFS_CTRL_DEREG: remote writes seen, and since when */
            uint64_t settle_seen, settle_since;
        } ctrl;
    };
} afs_xfer;

/* The kinds whose part is `rma`. */
static inline bool afs_xfer_is_rma(const afs_xfer *x)
{
    return x->kind == AFS_REQ_WRITE || x->kind == AFS_REQ_PAGED || x->kind == AFS_REQ_SCATTER;
}

typedef struct afs_xfer_list {
    afs_xfer *head, *tail;
    size_t len;
} afs_xfer_list;

#define AFS_HANDOFF_CLOSER_LEFT 1 /* afs_engine_destroy returned without the worker */
#define AFS_HANDOFF_WORKER_DONE 2 /* the worker returned */

struct afs_engine {
    afs_config cfg;
    /* The process has few CPUs and the target's worker copies what we write: a caller that
     * looks for completions (afs_pending_wait, the benchmark's wait) yields between looks,
     * or it takes the CPU that worker, or ours, needs (set once the NICs are open). */
    bool look_yields;
    char *provider_name; /* afabric's name ("tcp"; "auto" for a routed engine) */
    afs_transport tps[AFS_MAX_TRANSPORTS];
    uint32_t ntp;
    bool routed; /* afs_engine_create_routed: AFA2 addresses, AFD3 descriptors */
    uint32_t nnics;
    afs_nic nics[AFS_ENG_NICS];
    uint64_t incarnation;
    uint64_t key_secret[2]; /* remote keys derive from it (keys.c); never leaves the engine */
    uint8_t address[1024];
    uint32_t address_len;
    char provider_full[64];

    pthread_t worker;
    bool worker_started;
    _Atomic int stop;
    _Atomic int closed;
    _Atomic int worker_sleeping;
    _Atomic uint64_t worker_naps; /* afs_engine_worker_stats */
    /* The worker's heartbeat: the time of its loop's last turn, and whether it was found
     * stuck in one (peers.c's thread watches it; AFS_C_STUCK). `stuck_text` is written
     * once, before `stuck` is set; `stuck_reported` belongs to the draining thread. */
    _Atomic uint64_t beat_ns;
    _Atomic int stuck;
    char stuck_text[320];
    bool stuck_reported;
    /* Closing gave up waiting for a stuck worker (engine.c): whichever of the two finishes
     * last frees the engine, the worker through `teardown` (set by engine.c). */
    _Atomic int handoff; /* AFS_HANDOFF_* */
    void (*teardown)(afs_engine *eng);
    int wake_fd; /* eventfd: submitters wake a sleeping worker */
    afs_mpsc submitq;
    _Atomic uint64_t next_id;
    /* A zeroed transfer for the next afs_xfer_new, made by the ring's consumer while it
     * waits for a completion (afs_xfer_spare): an awaited write's submission then does not
     * pay for calloc, which the worker's frees of what the loop allocates make slow */
    _Atomic(afs_xfer *) spare;

    afs_ring ring;
    /* AFS_CFG_TIMING: operation timings, worker -> caller (a lock; off the data path when
     * timing is off, and one uncontended lock per operation when it is on) */
    afs_op_timing *timings;
    uint32_t timing_cap, timing_head, timing_len;
    uint64_t timing_dropped;
    pthread_mutex_t timing_lock;
    afs_slots mrs, peers, remotes;
    pthread_mutex_t peer_lock; /* guards peer lookup by address (control path only) */
    afs_allow *allow_book;     /* allow.c: the allow-list as callers see it (peer_lock) */
    afs_allow *allow;          /* the same list, the worker's copy; NULL = every peer */

    /* worker-owned */
    afs_immtab imm;
    /* Values whose arrivals were dropped at max_imm_values (`arrived` = how many), so that
     * an expectation on one fails at once instead of waiting for what will never be
     * counted: exactly, for up to AFS_DROPPED_EXACT values (or max_imm_values if larger);
     * past that in a hashed bitmap of AFS_DROPPED_BITS bits, where an expectation on a
     * value whose bit is set fails as "may have been dropped" (a flood that large has
     * broken the engine's counting already; a bit is cleared when it is reported). Both
     * are made on the first drop; worker only. */
    afs_immtab imm_dropped;
    uint64_t *imm_dropped_bits;
    afs_xfer_list active;  /* posting or waiting for completions, in deadline order */
    afs_xfer_list zombies; /* reported failed, waiting for the provider to let go */
    afs_xfer_list expects; /* expect_imm requests waiting for arrivals */
    afs_xfer_list armed;   /* triggered operations waiting for their condition */
    afs_xfer_list settling; /* deregistrations waiting for accepted remote writes to land */
    uint32_t rr;           /* round-robin NIC for small writes */
    afs_slots watchers;
    pthread_t watch_thread;
    bool watch_started;
    _Atomic int watch_stop;
    _Atomic uint32_t armed_on_watchers; /* operations waiting for a watcher value */
    /* cancels submitted (counted after the push) and taken by the worker: fire_watched
     * fires only once every cancel submitted before the change it saw was taken */
    _Atomic uint64_t cancels_submitted;
    uint64_t cancels_taken;
    void *cuda; /* libcuda handle once a CUDA watcher was made (watcher.c) */
    afs_xfer *postq_head, *postq_tail; /* transfers with work requests left to post */
    bool posts_stalled; /* worker: all of the post queue waits on refusing destinations */
    uint64_t last_deadline_check;
    afs_live *live; /* peers.c: same-host peers' processes watched (NULL: none yet) */
    uint64_t *down_peers; /* worker-owned: ids of the peers it was told are down, so that */
    uint32_t n_down, cap_down; /* a request taken after that fails instead of posting */
    uint64_t gone_peer;        /* worker-owned: the last peer /proc showed gone (worker.c) */
    const char *gone_why;      /* worker-owned: what /proc showed of it (a literal) */
    struct afs_ka *ka; /* keepalive.c: worker-owned (NULL: nothing sent yet) */
};

/* One-writer counter bump: a relaxed load and store, no locked instruction. */
static inline void afs_count(_Atomic uint64_t *c, uint64_t n)
{
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + n,
                          memory_order_relaxed);
}

/* keepalive.c: the shim's own control frames (hello, heartbeat, goodbye), worker only. It
 * sits below worker.c: what it finds, the worker acts on through this hook. */
enum afs_ka_finding {
    AFS_KA_HEARD = 1,  /* peer_id answered again after it was found silent: up */
    AFS_KA_SILENT,     /* peer_id left HEARTBEAT_MISSES intervals unanswered: down */
    AFS_KA_CLOSED,     /* peer_id said goodbye: down for good */
    AFS_KA_GRACE_OVER, /* fail what is still in flight to peer_id (closed) */
    AFS_KA_HELLO       /* an engine not resolved here said hello from address blob/len */
};
typedef void (*afs_ka_hook)(afs_engine *eng, uint32_t finding, uint64_t peer_id,
                            const uint8_t *blob, uint32_t len);
bool afs_ka_owns(uint64_t ctx);          /* a send completion of a control frame */
void afs_ka_sent(afs_engine *eng, const afp_event *ev);
bool afs_ka_recv(afs_engine *eng, uint32_t nic, const uint8_t *buf, uint64_t len, uint64_t src,
                 afs_ka_hook hook);
void afs_ka_peer(afs_engine *eng, uint64_t peer_id, int32_t status); /* an AFS_REQ_PEER */
void afs_ka_tick(afs_engine *eng, uint64_t now, afs_ka_hook hook);   /* heartbeats, grace */
/* Nothing of the keepalive's needs a tick: heartbeats off, no goodbye's grace running, no
 * hello to retry, no control frame with the provider. */
bool afs_ka_timers_idle(const afs_engine *eng);
/* After a goodbye, operations in flight to the peer get AFS_KA_GRACE_MS to complete (ones it
 * took before closing may have their completions still on the way): true if so, and
 * AFS_KA_GRACE_OVER then fails what is left (an AFS_REQ_PEER with AFS_PEER_GRACE_OVER,
 * which reports nothing). */
bool afs_ka_grace(afs_engine *eng, uint64_t peer_id, uint32_t peer_flags);
#define AFS_KA_GRACE_MS 100u
#define AFS_PEER_GRACE_OVER 0x100u
/* Closing: posts the goodbyes not posted yet; true while some are left or in flight. */
bool afs_ka_goodbye(afs_engine *eng);
void afs_ka_free(afs_engine *eng);

/* worker.c */
void *afs_worker_main(void *arg);
/* Whether a NIC's provider has the target's worker copy a write's bytes
 * (AFP_CAP_TARGET_COPIES; worker.c). */
bool afs_target_copies(const afs_engine *eng);
void afs_submit(afs_engine *eng, afs_xfer *x);
/* A synchronous control request. On AFS_ESTUCK the worker keeps `x`: leave it (and what it
 * points to) allocated. */
int afs_ctrl_call(afs_engine *eng, afs_xfer *x);
afs_xfer *afs_xfer_new(afs_engine *eng, uint32_t kind);
void afs_xfer_free(afs_xfer *x);
/* Makes the spare transfer the next afs_xfer_new takes, if there is none: for a thread
 * with time to spare (waiting for a completion), not on a submission's path. */
void afs_xfer_spare(afs_engine *eng);

/* The submit functions behind afs_submit_req (request.c), one per AFS_OP_*: no longer
 * exported (ABI 4 passes one afs_request instead of their positional arguments).
 * api.c and dynlen.c define them. */
/* Writes take a trigger (AFS_TRIG_NONE: post now). A triggered write is held by the shim
 * and posted by its worker the moment the condition holds, with no Python in between. */
int32_t afs_write(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                  uint64_t src_offset, uint64_t dst_offset, int64_t imm,
                  uint32_t trig_kind, uint64_t trig_a, uint64_t trig_b,
                  uint64_t *xfer_id);
int32_t afs_write_paged(afs_engine *eng, uint64_t mr_id, uint64_t remote_id,
                        uint64_t page_len, uint64_t count, const int64_t *src_idx,
                        uint64_t src_stride, uint64_t src_offset, const int64_t *dst_idx,
                        uint64_t dst_stride, uint64_t dst_offset, int64_t imm,
                        uint32_t trig_kind, uint64_t trig_a, uint64_t trig_b,
                        uint64_t *xfer_id);
/* One write per target: remote_ids[i], lengths[i], src_offsets[i], dst_offsets[i]. With a
 * NULL mr (0) and NULL lengths/offsets every write is zero-length: a barrier. */
int32_t afs_scatter(afs_engine *eng, uint64_t mr_id, uint64_t count,
                    const uint64_t *remote_ids, const uint64_t *lengths,
                    const uint64_t *src_offsets, const uint64_t *dst_offsets,
                    int64_t imm, uint32_t trig_kind, uint64_t trig_a, uint64_t trig_b,
                    uint64_t *xfer_id);

/* One-sided reads, remote -> local: the counterparts of afs_write, afs_write_paged and
 * afs_scatter with the same checks (and triggers). `src` is always the remote side, `dst`
 * the local region `mr_id` (which the provider writes into). A descriptor that states its
 * access and lacks read is refused here (AFS_EKEY), before anything is posted. */
int32_t afs_read(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                 uint64_t src_offset, uint64_t dst_offset, uint32_t trig_kind,
                 uint64_t trig_a, uint64_t trig_b, uint64_t *xfer_id);
int32_t afs_read_paged(afs_engine *eng, uint64_t mr_id, uint64_t remote_id,
                       uint64_t page_len, uint64_t count, const int64_t *src_idx,
                       uint64_t src_stride, uint64_t src_offset, const int64_t *dst_idx,
                       uint64_t dst_stride, uint64_t dst_offset, uint32_t trig_kind,
                       uint64_t trig_a, uint64_t trig_b, uint64_t *xfer_id);
/* One read per source: lengths[i] bytes from src_offsets[i] of remote_ids[i] to
 * dst_offsets[i] of mr_id. */
int32_t afs_gather(afs_engine *eng, uint64_t mr_id, uint64_t count,
                   const uint64_t *remote_ids, const uint64_t *lengths,
                   const uint64_t *src_offsets, const uint64_t *dst_offsets,
                   uint32_t trig_kind, uint64_t trig_a, uint64_t trig_b,
                   uint64_t *xfer_id);

/* A write whose length is read when it starts (at its trigger, or now): the u32 `n` at byte
 * `len_offset` of registered host region `len_mr_id` (4-aligned) makes it
 * clamp(len_base + len_scale * n, 0, max_length) bytes. Ranges are checked against
 * max_length here; with an immediate, a write that comes out empty still delivers it. */
int32_t afs_write_dynlen(afs_engine *eng, uint64_t mr_id, uint64_t remote_id,
                         uint64_t max_length, uint64_t src_offset, uint64_t dst_offset,
                         int64_t imm, uint64_t len_mr_id, uint64_t len_offset,
                         int64_t len_base, uint64_t len_scale, uint32_t trig_kind,
                         uint64_t trig_a, uint64_t trig_b, uint64_t *xfer_id);

/* api.c (shared with dynlen.c) */
int afs_build_write(afs_engine *eng, uint64_t mr_id, uint64_t remote_id, uint64_t length,
                    uint64_t src_offset, uint64_t dst_offset, int64_t imm, afs_xfer **out);
int afs_submit_built(afs_engine *eng, afs_xfer *x, uint32_t trig_kind, uint64_t trig_a,
                     uint64_t trig_b, uint64_t *xfer_id);

/* worker.c: sets x->length from its length word (afs_write_dynlen's writes, when they start) */
void afs_dynlen_resolve(afs_xfer *x);
/* worker.c: hands receive buffer `slot` of NIC `nic` to the provider */
int afs_post_rx(afs_engine *eng, uint32_t nic, uint32_t slot);

/* allow.c: the allow-list (see there for what it can and cannot stop) */
int afs_allow_check_addr(afs_engine *eng, const afs_addr_view *v, const uint8_t *blob,
                         uint32_t len); /* AFS_EDENIED if not on the list */
bool afs_allow_refuse_src(afs_engine *eng, uint32_t nic, uint64_t src); /* worker; counts */
bool afs_allow_refuse_out(afs_engine *eng, afs_xfer *x); /* worker: sets x's error */
int afs_allow_poll(afs_engine *eng, uint32_t nic, afp_event *ev, uint64_t *src, uint32_t max,
                   uint32_t *n);
void afs_allow_free(afs_allow *a);
void afs_allow_destroy(afs_engine *eng);

/* watcher.c */
void *afs_watch_main(void *arg);
void afs_watchers_destroy(afs_engine *eng);

/* process.c: the soft fd limit raised to the hard one (at engine creation) */
void afs_raise_fd_limit(void);
/* process.c: calls that may load or initialise a provider library run between these two;
 * _end puts back every signal disposition that changed since _begin (see there why) */
typedef struct afs_sigkeep {
    struct sigaction act[NSIG];
    bool saved[NSIG];
    bool locked;
} afs_sigkeep;
void afs_sigkeep_begin(afs_sigkeep *k);
void afs_sigkeep_end(afs_sigkeep *k);

/* engine.c */
/* 0, or AFS_EINVAL (no engine) / AFS_ECLOSED; every entry point checks this first. Inline
 * here, so the files below engine.c (worker, watcher, allow, api, dynlen) need nothing of it. */
static inline int afs_engine_check_open(afs_engine *eng)
{
    if (!eng)
        return afs_fail(AFS_EINVAL, "NULL engine");
    if (atomic_load_explicit(&eng->closed, memory_order_acquire))
        return afs_fail(AFS_ECLOSED, "engine is closed");
    if (atomic_load_explicit(&eng->stuck, memory_order_acquire))
        return afs_fail(AFS_ESTUCK, "%s", eng->stuck_text);
    return 0;
}
int afs_load_provider(const char *path, void **lib, const struct afp_ops **ops);
int afs_restarted_error(uint64_t old_incarnation, uint64_t new_incarnation); /* AFS_ESTALE */
int afs_find_or_resolve_peer(afs_engine *eng, const afs_addr_view *v, const uint8_t *blob,
                             uint32_t blob_len, uint64_t *peer_id); /* no allow-list check */
/* ---- route.c: which transport carries what ---- */
/* A RECV completion's `id` for sender handle `src` on NIC `nic`: the handle itself on a
 * single-provider engine; on a routed one with the NIC in the top byte (handles of two
 * transports may be equal). */
static inline uint64_t afs_src_id(const afs_engine *eng, uint32_t nic, uint64_t src)
{
    if (!eng->routed || src == AFS_SRC_UNKNOWN || src == AFS_SRC_UNRESOLVED)
        return src;
    return (src & ((1ull << 56) - 1u)) | (uint64_t)nic << 56;
}
static inline uint64_t afs_peer_src(const afs_engine *eng, const afs_peer_entry *p,
                                    uint32_t nic)
{
    return afs_src_id(eng, nic, p->fi_addr[nic]);
}
/* The first (preferred) transport of a non-empty mask. */
static inline uint32_t afs_tp_first(uint32_t mask) { return (uint32_t)__builtin_ctz(mask); }
/* The NIC that messages and control frames to peer `p` leave from: its preferred
 * transport's first NIC. */
uint32_t afs_peer_nic(const afs_engine *eng, const afs_peer_entry *p);
/* The transport an operation from local region transports `local_mask` to remote region
 * transports `remote_mask` takes (AFS_EUNSUPPORTED, saying why, when none holds both). */
int afs_route_pick(afs_engine *eng, uint32_t local_mask, uint32_t remote_mask, uint32_t *tp);
/* Writes "name, name" of the transports in `mask` into buf. */
void afs_tp_names(const afs_engine *eng, uint32_t mask, char *buf, size_t len);
/* The flags region `m` registers with on transport `t`, or UINT32_MAX for none (routed
 * engines: CUDA memory only where the provider takes it, host memory local-only on a
 * provider that writes device memory only). */
uint32_t afs_reg_flags(const afs_engine *eng, const afs_transport *t, const afs_mr_entry *m);

/* ---- identity.c: which incarnation lives at a NIC address ---- */
/* A frame proved that `p`'s incarnation lives at its NIC addresses (keepalive.c, worker
 * thread, lock-free): older incarnations there are superseded from now on. */
void afs_peer_proven(afs_engine *eng, afs_peer_entry *p);
/* The latest incarnation resolved here that claims `p`'s NIC addresses, later than p's
 * (0: none). A claim only: it names the restart of a peer that is down by its own state
 * (api.c), it never takes a live one away. */
uint64_t afs_peer_later_claim(afs_engine *eng, const afs_peer_entry *p);
/* How far ahead of this host's clock an incarnation's creation time may be (clocks of
 * two hosts differ): one further ahead is refused on resolve, so no claim can stand above
 * every later restart. */
#define AFS_DROPPED_EXACT 65536u
#define AFS_DROPPED_BITS (1u << 20)
#define AFS_INCARNATION_AHEAD_US (24ull * 3600ull * 1000000ull)

#endif
