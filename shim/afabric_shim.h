/*
 * afabric shim: the whole ABI that Python's ctypes sees (afabric/_native.py).
 *
 * Rules: fixed-width types, structs only by pointer, no inline functions, every
 * exported name starts with `afs_`. Functions return 0 or a negative AFS_E* code;
 * results go through out-parameters placed last; the detail of a failure is in a
 * per-thread buffer read with afs_last_error() right after the failing call.
 *
 * This header is the one source of the ABI: afabric/_native_decl.py (ctypes constants,
 * structures, the FUNCTIONS table) and typings/afabric_shim.pyi (the typed stub) are
 * generated from it by `python -m afabric._gen_shim` (tests/test_stubs.py fails when they
 * are stale). Keep it to the subset that generator reads, which it enforces: `#define AFS_X
 * <integer>`, the AFS_ERROR_TABLE rows, `typedef struct afs_x afs_x;` handles, `typedef
 * struct afs_x {...} afs_x;` of fixed-width integers, `const char *`, `char x[N]` and
 * structures defined above it (by value),
 * enums of `AFS_X = <integer>`, and `AFS_API` prototypes of integers, handles and pointers
 * (`const uint8_t *` is a byte string, `const [u]int64_t *` an array passed by address).
 */
#ifndef AFABRIC_SHIM_H
#define AFABRIC_SHIM_H

#include <stdint.h>

#define AFS_ABI_VERSION 12u /* 2: afs_nic_stats.imms_dropped, afs_config.max_imm_values, AFS_C_NOTICE;
                              3: reads (afs_read*, afs_gather), afs_desc_info.access,
                              afs_nic_stats.reads/read_bytes;
                              a RECV completion's id is its sender (AFS_SRC_*), afs_peer_handle;
                              4: afs_submit_req (one afs_request per operation), named
                              afs_completion fields;
                              5: afs_config.heartbeat_ms, afs_nic_stats.ctrl_sent/received,
                              AFS_C_PEER flags 4 (closed) and 8 (silent), AFS_C_HELLO;
                              6: AFS_ESTUCK, AFS_C_STUCK, AFS_STUCK_MS;
                              7: afs_pending_wait (afs_poll and afs_pending came in 6, unbumped);
                              8: afs_submit_take;
                              9: afs_engine_worker_stats;
                              10: afs_bench_write_lat;
                              11: afs_watcher_store;
                              12: routed engines (afs_engine_create_routed, afs_engine_transport,
                              afs_peer_route, afs_peer_source) */

#if defined(__GNUC__)
#define AFS_API __attribute__((visibility("default")))
#else
#define AFS_API
#endif

/* The one error table: C uses the enum, Python reads names/texts through
 * afs_error_info() and maps names to exception classes. */
#define AFS_ERROR_TABLE(X)                                                                      \
    X(OK, 0, "success")                                                                         \
    X(EAGAIN, -1, "resource temporarily unavailable, try again")                               \
    X(EINVAL, -2, "invalid argument")                                                           \
    X(ERANGE, -3, "offset or length outside the memory region")                                 \
    X(ECLOSED, -4, "engine is closed")                                                          \
    X(ENOMEM, -5, "out of memory")                                                              \
    X(EBADDESC, -6, "malformed, truncated or forged descriptor or address")                     \
    X(ESTALE, -7, "memory region was deregistered")                                             \
    X(ETOOBIG, -8, "message larger than the maximum size")                                      \
    X(ETIMEDOUT, -9, "operation timed out")                                                     \
    X(EPEER, -10, "peer unreachable or connection lost")                                        \
    X(EKEY, -11, "remote key rejected")                                                         \
    X(EIO, -12, "transport error")                                                              \
    X(EPROVIDER, -13, "provider library could not be loaded or is incompatible")                \
    X(EUNSUPPORTED, -14, "operation not supported by this provider")                            \
    X(ECANCELED, -15, "operation canceled")                                                     \
    X(EBUSY, -16, "resource busy")                                                              \
    X(ENODEV, -17, "no usable NIC or domain")                                                   \
    X(EWRONGPROV, -18, "descriptor or address belongs to another provider")                     \
    X(EREG, -19, "memory registration failed")                                              \
    X(EDENIED, -20, "peer is not on the engine's allow-list")                                   \
    X(ESTUCK, -21, "the engine's worker is stuck inside the provider")                          \
    X(EDROPPED, -22, "arrivals of the immediate were dropped at the max_imm_values bound")

#define AFS_ENUM_ITEM(name, value, text) AFS_##name = (value),
enum afs_error { AFS_ERROR_TABLE(AFS_ENUM_ITEM) };
#undef AFS_ENUM_ITEM

typedef struct afs_engine afs_engine; /* opaque */

/* Engine configuration (passed by pointer; `size` = sizeof as the caller knows it). */
typedef struct afs_config {
    uint32_t size;
    uint32_t flags;             /* AFS_CFG_* */
    const char *provider_lib;   /* path of the provider's native library */
    const char *provider_name;  /* the afabric provider name ("tcp"), for messages */
    const char *fabric_provider;/* the name the provider library is given ("tcp") */
    const char *nic;            /* comma-separated NIC names (one domain each; a name may repeat
                                   to open several endpoints on one device), or NULL */
    const char *bind_addr;      /* interface address to bind, or NULL */
    int32_t cpu;                /* core to pin the worker to, or -1 */
    uint32_t poll_mode;         /* AFS_POLL_ADAPTIVE or AFS_POLL_SPIN */
    uint32_t spin_us;           /* adaptive: spin this long after activity before sleeping */
    uint32_t max_msg_size;      /* largest SEND/RECV message (receive buffer size) */
    uint32_t rx_depth;          /* receives kept posted */
    uint32_t tx_depth;          /* writes/sends in flight per domain */
    uint64_t op_timeout_ns;     /* a write or send not completed by then fails (0: never) */
    uint32_t nics;              /* without names: how many NICs (the first usable ones); 0 = 1 */
    uint32_t max_imm_values;    /* distinct immediate values the counter table keeps (0: 65,536);
                                   an arrival of a new value beyond that is dropped, counted
                                   (imms_dropped) and reported (AFS_C_NOTICE) */
    uint32_t peer_stop_ms;      /* a same-host peer stopped (SIGSTOP) this long is reported down
                                   until it runs again (0: never; shim/peers.c) */
    uint32_t heartbeat_ms;      /* keepalive every this many ms to each peer operations went to;
                                   one that answers none for AFS_HEARTBEAT_MISSES intervals is
                                   reported down until it answers (0: off; shim/keepalive.c) */
} afs_config;

#define AFS_HEARTBEAT_MISSES 3u

#define AFS_CFG_FORCE_EFA_MODES 0x1u /* testing hook (afabric.testing), not API */
#define AFS_CFG_TIMING 0x2u /* stamp each operation's stages (afs_timing_drain) */
#define AFS_POLL_ADAPTIVE 0u
#define AFS_POLL_SPIN 1u

typedef struct afs_engine_facts {
    int32_t event_fd;          /* readable when afs_drain has something */
    uint32_t caps;             /* provider AFP_CAP_* flags */
    uint64_t incarnation;      /* random per engine: descriptors and addresses carry it */
    uint64_t max_write_size;   /* provider's max message size */
    uint32_t max_msg_size;     /* SEND/RECV limit */
    uint32_t nics;
    char provider[64];         /* provider as the library reports it ("tcp;ofi_rxm") */
    uint32_t transports;       /* afs_engine_transport's indices: 0 .. transports - 1 */
    uint32_t reserved;
} afs_engine_facts;

/* Counters of one NIC (afs_engine_stats): kept by the worker, cheap enough to leave on. */
typedef struct afs_nic_stats {
    uint64_t writes;      /* write work requests posted */
    uint64_t write_bytes; /* bytes they carried */
    uint64_t sends, recvs;
    uint64_t imms;        /* immediates that arrived */
    uint64_t errors;      /* failed work requests, receives included (e.g. an oversize message) */
    uint64_t retries;     /* posts the provider answered with "try again" */
    uint64_t landed;      /* remote writes seen landing here (where the provider counts them) */
    uint64_t completions; /* write and send work requests completed (with or without error):
                             writes + sends - completions are still with the provider */
    uint64_t rejected;         /* messages/immediates dropped: sender not on the allow-list */
    uint64_t rejected_unknown; /* dropped while a list is set: the provider cannot name the sender */
    uint64_t imms_dropped;     /* immediates dropped: a new value while the table held max_imm_values */
    uint64_t reads;            /* read work requests posted (`completions` counts them too) */
    uint64_t read_bytes;       /* bytes they asked for */
    uint64_t ctrl_sent;        /* the shim's own control frames posted (hellos, heartbeats and
                                  their answers, goodbyes; shim/keepalive.c): not in `sends` */
    uint64_t ctrl_received;    /* ... received: not in `recvs` */
} afs_nic_stats;

/* Counters of the engine's worker thread (afs_engine_worker_stats). */
typedef struct afs_worker_stats {
    uint64_t naps; /* times it slept (adaptive polling, nothing to do for spin_us): the next
                      arrival or request then waits for it to wake */
} afs_worker_stats;

/* Where one operation's time went (AFS_CFG_TIMING), CLOCK_MONOTONIC ns; 0 = stage not
 * reached (e.g. failed before posting). */
typedef struct afs_op_timing {
    uint64_t id;
    uint32_t kind;   /* AFS request kind: 2 write, 3 paged, 4 send, 8 scatter; a read adds
                        AFS_TIMING_READ (18 read, 19 paged read, 24 gather) */
    int32_t status;
    uint64_t work_requests;
    uint64_t t_enqueue;    /* the caller handed it to the shim */
    uint64_t t_pickup;     /* the worker took it from the submit queue; an operation a watcher
                              triggered: the change that fired it was seen (by the worker,
                              or by the watcher thread) */
    uint64_t t_first_post; /* its first work request was posted */
    uint64_t t_last_post;  /* its last work request was posted */
    uint64_t t_complete;   /* its last completion was seen */
} afs_op_timing;

#define AFS_TIMING_READ 16u

/* Decoded descriptor (afs_desc_decode). */
typedef struct afs_desc_info {
    uint64_t incarnation;
    uint64_t base;       /* owner's virtual address of the region */
    uint64_t length;
    int32_t device;      /* -1 host, else CUDA device */
    uint32_t nics;
    char provider[32];
    uint32_t access;     /* what peers may do: AFP_MR_REMOTE (write) | AFP_MR_REMOTE_READ (read);
                            0 = not stated (a descriptor from before reads: the target decides) */
    uint32_t reserved;
} afs_desc_info;

/* One record drained from the completion ring. */
enum afs_completion_kind {
    AFS_C_DONE = 1,    /* id completed with status; text = error text (free with afs_text_free) */
    AFS_C_RELEASE = 2, /* id's buffers are no longer touched (after a failed DONE) */
    AFS_C_RECV = 3,    /* message: data/len valid until released with afs_recv_release(slot) */
    AFS_C_WATCH = 4,   /* watcher `id` changed from `watch_old` to `watch_new` */
    AFS_C_NOTICE = 5,  /* something was dropped: id AFS_NOTICE_*, `total` = how many so far */
    AFS_C_PEER = 6,    /* peer `id` resolved (status 0) or its process gone (AFS_EPEER): data =
                          its address (len bytes, free with afs_text_free), `peer_pid`, and
                          `peer_flags`: 1 its process is watched (same host), | 2 down because
                          stopped (an "up" follows when it runs again), | 4 down because its
                          engine closed (final), | 8 down because silent (heartbeat_ms: an
                          "up" follows when it answers) */
    AFS_C_HELLO = 7,   /* an engine that resolved this one said hello from an address this one
                          has not resolved: data = that address (len bytes, free with
                          afs_text_free). Resolving it makes this engine's goodbye reach it
                          when it closes (shim/keepalive.c); at most 4,096 per engine */
    AFS_C_STUCK = 8    /* the worker has spent AFS_STUCK_MS in one turn of its loop (inside a
                          provider call that does not return: seen with libfabric 1.17 shm, a
                          same-host peer SIGKILLed while it held the lock of its shared
                          region). status AFS_ESTUCK, data = text (free with afs_text_free).
                          Final: the engine refuses everything with AFS_ESTUCK from now on,
                          nothing in flight will complete; close it (afs_engine_destroy then
                          does not wait for the worker). Reported once, after the records
                          the worker pushed before it stopped. */
};

/* How long one turn of the worker's loop may take before the engine is stuck (AFS_C_STUCK):
 * far above any provider call's duration (microseconds to milliseconds), so that only a
 * worker that will not come back is declared stuck. */
#define AFS_STUCK_MS 5000u

#define AFS_NOTICE_IMMS_DROPPED 1u /* immediates of new values dropped: the table was full */

/* Triggers of triggered operations (afs_trigger.kind). */
#define AFS_TRIG_NONE 0u
#define AFS_TRIG_WATCHER 1u /* when watcher `source` holds a value >= `threshold` */
#define AFS_TRIG_IMM 2u     /* when `threshold` arrivals of immediate `source` were counted
                               (consumed) */

/* Each kind fills its own fields; the others are 0. */
typedef struct afs_completion {
    uint64_t id; /* RECV: the sender's afs_peer_handle, or AFS_SRC_UNRESOLVED / AFS_SRC_UNKNOWN */
    int32_t status;
    uint32_t kind;            /* AFS_C_* */
    uint64_t data;            /* RECV: address of the message; DONE with error: char* text or 0;
                                 PEER: its address */
    uint64_t len;             /* RECV: the message's length; PEER: the address's */
    uint32_t slot;            /* RECV: its receive buffer (afs_recv_release) */
    uint32_t release_later;   /* DONE: 1 = failed, the provider still holds its buffers (an
                                 AFS_C_RELEASE follows) */
    uint64_t first_post_ns;   /* DONE: when its first work request was posted (0 = none) */
    uint64_t watch_old;       /* WATCH: the value before */
    uint64_t watch_new;       /* WATCH: the value seen */
    uint64_t total;           /* NOTICE: how many so far */
    uint32_t peer_pid;        /* PEER: its process id (0: unknown) */
    uint32_t peer_flags;      /* PEER: 1 watched (same host), | 2 stopped, | 4 closed, | 8 silent */
} afs_completion;

#define AFS_NO_IMM (-1)
/* A RECV's sender as the provider reports it: not a peer this engine resolved / cannot tell. */
#define AFS_SRC_UNKNOWN 0xffffffffffffffffu
#define AFS_SRC_UNRESOLVED 0xfffffffffffffffeu

AFS_API uint32_t afs_abi_version(void);
AFS_API int32_t afs_error_count(void);
AFS_API int32_t afs_error_info(int32_t index, int32_t *code, const char **name, const char **text);
AFS_API const char *afs_last_error(void);
AFS_API void afs_text_free(uint64_t text);

/* Provider probing (no engine): NICs that the provider library sees. */
AFS_API int32_t afs_provider_probe(const afs_config *cfg, void *nics_out, uint32_t max,
                                   uint32_t *count, char *name_out, uint32_t name_len);

AFS_API int32_t afs_engine_create(const afs_config *cfg, afs_engine **out);

/* One transport of a routed engine (afs_engine_create_routed). */
typedef struct afs_transport_cfg {
    const char *provider_lib;    /* its provider's native library */
    const char *provider_name;   /* afabric's name for it ("cma"): peers' addresses match on it */
    const char *fabric_provider; /* the name the library is given ("tcp") */
    const char *nic;             /* comma-separated NIC names, or NULL */
    const char *bind_addr;       /* interface address to bind, or NULL */
    uint32_t nics;               /* without names: how many NICs (0 = 1) */
    uint32_t reach;              /* AFS_REACH_*: what it can reach (texts, afabric info) */
} afs_transport_cfg;

#define AFS_REACH_HOST 1u    /* processes of this host (kernel boot and PID namespace) */
#define AFS_REACH_NODE 2u    /* GPUs of this node */
#define AFS_REACH_NETWORK 3u /* any host */
#define AFS_MAX_TRANSPORTS 4u

/* An engine holding several transports, in the order given (the first that reaches a peer
 * and holds both regions of an operation carries it). `cfg`'s provider fields are unused
 * but for provider_name, the engine's name in messages ("auto"). */
AFS_API int32_t afs_engine_create_routed(const afs_config *cfg, const afs_transport_cfg *transports,
                                         uint32_t count, afs_engine **out);

/* What one of an engine's transports is (afs_engine_transport). */
typedef struct afs_transport_info {
    char name[32];           /* afabric's provider name ("cma") */
    char provider[64];       /* as its library reports it ("tcp;ofi_rxm") */
    uint32_t first_nic;      /* its NICs: first_nic .. first_nic + nics - 1 (afs_engine_stats) */
    uint32_t nics;
    uint32_t caps;           /* AFP_CAP_* */
    uint32_t reach;          /* AFS_REACH_* */
    uint64_t max_write_size; /* its largest single write */
} afs_transport_info;

AFS_API int32_t afs_engine_transport(afs_engine *eng, uint32_t index, afs_transport_info *out);
AFS_API int32_t afs_engine_destroy(afs_engine *eng);
AFS_API int32_t afs_engine_info(afs_engine *eng, afs_engine_facts *out);
AFS_API int32_t afs_engine_stats(afs_engine *eng, uint32_t nic, afs_nic_stats *out);
AFS_API int32_t afs_engine_worker_stats(afs_engine *eng, afs_worker_stats *out);
AFS_API int32_t afs_engine_address(afs_engine *eng, uint8_t *buf, uint32_t cap, uint32_t *len);

AFS_API int32_t afs_mr_register(afs_engine *eng, uint64_t addr, uint64_t len, uint32_t flags,
                                int32_t device, uint64_t *mr_id, uint8_t *desc, uint32_t cap,
                                uint32_t *desc_len);
AFS_API int32_t afs_mr_deregister(afs_engine *eng, uint64_t mr_id);

AFS_API int32_t afs_desc_decode(const uint8_t *buf, uint32_t len, afs_desc_info *out);
AFS_API int32_t afs_address_check(const uint8_t *buf, uint32_t len, uint64_t *incarnation,
                                  uint32_t *nics);
AFS_API int32_t afs_remote_import(afs_engine *eng, const uint8_t *desc, uint32_t len,
                                  uint64_t *remote_id);
AFS_API int32_t afs_remote_release(afs_engine *eng, uint64_t remote_id);
AFS_API int32_t afs_peer_resolve(afs_engine *eng, const uint8_t *addr, uint32_t len,
                                 uint64_t *peer_id);
/* The provider's handle of a resolved peer on the engine's first NIC: what a RECV
 * completion's `id` holds when the provider names the message's sender. */
AFS_API int32_t afs_peer_handle(afs_engine *eng, uint64_t peer_id, uint64_t *handle);
/* Whether a RECV completion's `id` names peer `peer_id` (on any of its transports). */
AFS_API int32_t afs_peer_source(afs_engine *eng, uint64_t peer_id, uint64_t src, uint32_t *match);
/* The transport (afs_engine_transport's index) that carries operations to resolved peer
 * `peer_id` on host memory (device < 0) or CUDA memory (device >= 0), and in `why` (a
 * buffer of why_len bytes) the transports that could not reach it and why ("" if none). */
AFS_API int32_t afs_peer_route(afs_engine *eng, uint64_t peer_id, int32_t device,
                               uint32_t *transport, char *why, uint32_t why_len);
/* The allow-list (allow.c): with AFS_ALLOW_ON, only the `count` peers whose addresses are
 * concatenated in `blobs` (lengths in `lens`) may be resolved, written to or sent to, and
 * only their messages and immediates are delivered; a message or immediate whose sender
 * the provider cannot name is dropped too, unless AFS_ALLOW_UNKNOWN. flags 0 (count 0):
 * no list, every peer. */
#define AFS_ALLOW_ON 0x1u
#define AFS_ALLOW_UNKNOWN 0x2u
AFS_API int32_t afs_allow_peers(afs_engine *eng, const uint8_t *blobs, const uint32_t *lens,
                                uint32_t count, uint32_t flags);

/* The submit path: one request struct per operation (afs_submit_req). A trigger
 * (AFS_TRIG_NONE: post now) makes the shim hold the request and its worker post it the
 * moment the condition holds, with no Python in between. */
typedef struct afs_trigger {
    uint32_t kind;      /* AFS_TRIG_* */
    uint32_t reserved;  /* 0 */
    uint64_t source;    /* WATCHER: the watcher id; IMM: the immediate value */
    uint64_t threshold; /* WATCHER: the value to reach; IMM: the arrivals to count */
} afs_trigger;

/* afs_request.op */
#define AFS_OP_WRITE 1u        /* length bytes, local src_offset -> remote dst_offset */
#define AFS_OP_WRITE_PAGED 2u  /* count pages of length bytes: page src_idx[i] -> dst_idx[i] */
#define AFS_OP_SCATTER 3u      /* count writes: lengths[i] from src_offsets[i] to dst_offsets[i] of
                                  remote_ids[i]; lengths 0: zero-length writes (a barrier) */
#define AFS_OP_WRITE_DYNLEN 4u /* AFS_OP_WRITE whose length is read when it starts (len_*) */
#define AFS_OP_READ 5u         /* length bytes, remote src_offset -> local dst_offset */
#define AFS_OP_READ_PAGED 6u   /* count pages: remote page src_idx[i] -> local page dst_idx[i] */
#define AFS_OP_GATHER 7u       /* count reads: lengths[i] from src_offsets[i] of remote_ids[i] to
                                  dst_offsets[i] of mr_id */

/* One operation. `size` = sizeof as the caller knows it: the shim reads that much (a shorter
 * one than AFS_REQUEST_MIN_SIZE is refused; bytes it does not know must be 0), so either
 * side may be built against a newer header. Fields an op does not name are ignored. Arrays
 * are passed by address (uint64_t), with `count` elements; "src" is the side data comes
 * from (local for writes, remote for reads), "dst" the side it goes to. */
typedef struct afs_request {
    uint32_t size;
    uint32_t op;          /* AFS_OP_* */
    uint64_t mr_id;       /* the local region (SCATTER barrier: 0) */
    uint64_t remote_id;   /* WRITE*, READ*: the imported remote descriptor */
    uint64_t length;      /* WRITE/READ: bytes (DYNLEN: the most); *_PAGED: bytes per page */
    uint64_t src_offset;  /* WRITE/READ: where the data is; *_PAGED: added to every src page */
    uint64_t dst_offset;  /* WRITE/READ: where it goes; *_PAGED: added to every dst page */
    int64_t imm;          /* writes: AFS_NO_IMM or 0..4294967295; reads: AFS_NO_IMM */
    uint64_t count;       /* *_PAGED: pages; SCATTER/GATHER: targets */
    uint64_t src_idx;     /* *_PAGED: address of int64_t[count] page indices */
    uint64_t src_stride;  /* *_PAGED: bytes between src pages */
    uint64_t dst_idx;     /* *_PAGED: address of int64_t[count] */
    uint64_t dst_stride;
    uint64_t remote_ids;  /* SCATTER/GATHER: address of uint64_t[count] */
    uint64_t lengths;     /* SCATTER/GATHER: address of uint64_t[count] (SCATTER 0: barrier) */
    uint64_t src_offsets; /* SCATTER/GATHER: address of uint64_t[count] */
    uint64_t dst_offsets; /* SCATTER/GATHER: address of uint64_t[count] */
    uint64_t len_mr_id;   /* DYNLEN: the host region holding the u32 length word n */
    uint64_t len_offset;  /* DYNLEN: its byte offset (4-aligned) */
    int64_t len_base;     /* DYNLEN: length = clamp(len_base + len_scale * n, 0, length) */
    uint64_t len_scale;
    afs_trigger trigger;
} afs_request;

#define AFS_REQUEST_MIN_SIZE 184u /* sizeof(afs_request) of ABI 4, the first with it */

/* Checks `req` (a bad one fails here with a typed code, nothing posted) and submits it;
 * *xfer_id gets the operation's id, which its AFS_C_DONE record carries. */
AFS_API int32_t afs_submit_req(afs_engine *eng, const afs_request *req, uint64_t *xfer_id);
/* afs_submit_req for an operation its caller awaits alone, then afs_pending_wait's look for
 * up to max_ns: when the ring then holds just this operation's plain success (done, no error
 * text, nothing held back), that record is consumed here and the result is AFS_TAKEN; else
 * AFS_TAKE_NONE (no record yet) or AFS_TAKE_OTHER (records to drain, this one's perhaps among
 * them). Either way the worker was asked not to signal the event fd, as by afs_poll. */
AFS_API int32_t afs_submit_take(afs_engine *eng, const afs_request *req, uint64_t *xfer_id,
                                uint32_t max_ns);
#define AFS_TAKE_NONE 0
#define AFS_TAKEN 1
#define AFS_TAKE_OTHER 2

/* Watchers: a 64-bit word in host memory (mapped into CUDA device `device`'s address space
 * when device >= 0) that anyone may bump; the shim reports each change it observes as an
 * AFS_C_WATCH record and fires operations triggered on it. */
AFS_API int32_t afs_watcher_create(afs_engine *eng, int32_t device, uint64_t *watcher_id,
                                   uint64_t *host_ptr, uint64_t *device_ptr);
AFS_API int32_t afs_watcher_destroy(afs_engine *eng, uint64_t watcher_id);
AFS_API int32_t afs_watcher_add(afs_engine *eng, uint64_t watcher_id, uint64_t delta,
                                uint64_t *value);
/* Stores `value` into the watcher's word (release) as a kernel's plain store does, for a
 * writer that is the word's only one; *stamp_ns gets CLOCK_MONOTONIC read just before the
 * store, so a benchmark times the change itself and not the caller's way to it. */
AFS_API int32_t afs_watcher_store(afs_engine *eng, uint64_t watcher_id, uint64_t value,
                                  uint64_t *stamp_ns);
AFS_API int32_t afs_send(afs_engine *eng, uint64_t peer_id, const uint8_t *buf, uint64_t len,
                         uint64_t *xfer_id);
AFS_API int32_t afs_expect_imm(afs_engine *eng, uint32_t imm, uint64_t count, uint64_t *xfer_id);
AFS_API int32_t afs_cancel(afs_engine *eng, uint64_t xfer_id);
/* Gives `count` arrivals of `imm` back to its counter: what an expectation consumed when it
 * completed after its caller had already withdrawn it (the completion raced the cancel). */
AFS_API int32_t afs_imm_return(afs_engine *eng, uint32_t imm, uint64_t count);

AFS_API int32_t afs_drain(afs_engine *eng, afs_completion *out, uint32_t max, uint32_t *count);
/* afs_drain for a consumer that polls: the event fd is neither read nor asked to be signalled
 * (the worker skips its write while the consumer looks); its last look must be afs_drain,
 * which asks for the signal again before it reports the ring empty. */
AFS_API int32_t afs_poll(afs_engine *eng, afs_completion *out, uint32_t max, uint32_t *count);
/* How many records afs_poll would return now (a cheap look, no syscall); like afs_poll it
 * asks the worker not to signal the event fd. */
AFS_API uint32_t afs_pending(afs_engine *eng);
/* afs_pending that keeps looking for up to max_ns (spinning; a ctypes caller has released
 * the GIL) until there is a record: an event loop that polls finds a completion a few
 * hundred ns after the worker pushed it instead of one loop iteration later. Where the
 * process has fewer than 4 CPUs and the target's worker copies (libfabric tcp, shm), it
 * yields the CPU between looks. */
AFS_API uint32_t afs_pending_wait(afs_engine *eng, uint32_t max_ns);
/* Timing records of completed operations (oldest first); *dropped gets how many were
 * overwritten because nobody drained them in time. */
AFS_API int32_t afs_timing_drain(afs_engine *eng, afs_op_timing *out, uint32_t max,
                                 uint32_t *count, uint64_t *dropped);
AFS_API int32_t afs_recv_release(afs_engine *eng, const uint32_t *slots, uint32_t count);

/* Raw benchmark loops: the same submit path driven from C, no Python per operation.
 * `window` operations in flight; returns elapsed nanoseconds for `iters` operations. */
AFS_API int32_t afs_bench_write(afs_engine *eng, uint64_t mr_id, uint64_t remote_id,
                                uint64_t length, uint32_t window, uint64_t iters,
                                uint64_t *elapsed_ns);
/* The write loop one at a time: lat_ns[i] gets write i's nanoseconds from its submission to
 * the loop seeing it reported (`iters` entries, each filled once its write is reported). */
AFS_API int32_t afs_bench_write_lat(afs_engine *eng, uint64_t mr_id, uint64_t remote_id,
                                    uint64_t length, uint64_t iters, uint64_t *lat_ns);
/* The same loop of contiguous reads (remote -> mr_id), rotating through the regions alike. */
AFS_API int32_t afs_bench_read(afs_engine *eng, uint64_t mr_id, uint64_t remote_id,
                               uint64_t length, uint32_t window, uint64_t iters,
                               uint64_t *elapsed_ns);
AFS_API int32_t afs_bench_paged(afs_engine *eng, uint64_t mr_id, uint64_t remote_id,
                                uint64_t page_len, uint64_t count, const int64_t *src_idx,
                                const int64_t *dst_idx, uint32_t window, uint64_t iters,
                                uint64_t *elapsed_ns);

#endif
