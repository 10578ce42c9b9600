/*
 * afabric provider ABI: the versioned C table a provider library exports.
 *
 * A provider library exports one symbol, `afp_get_ops`, returning a pointer to a
 * static `struct afp_ops`. The table starts with its own size and version; the shim
 * refuses a table whose major version differs from AFP_ABI_MAJOR, and checks an
 * optional operation's offset against `size` before calling it (FI_CHECK_OP style),
 * so a newer shim can load an older provider that lacks trailing operations.
 *
 * Threading: every operation on a domain is called from one thread at a time (the
 * shim's worker for that domain group), except `peer_exited`, called from the shim's watch
 * thread while the worker may be inside any other. `afp_list_nics` may be called from any
 * thread and must not keep state between calls.
 *
 * Return values: 0 on success or a negative AFP_E* code (below). Detail text
 * for a failure goes to the buffer given by `afp_errbuf` (per domain) or, for calls
 * without a domain, to the caller-provided `err` buffer.
 */
#ifndef AFABRIC_PROVIDER_H
#define AFABRIC_PROVIDER_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define AFP_ABI_MAJOR 1u
#define AFP_ABI_MINOR 7u /* 1: AFP_EV_ACTIVITY; 2: post_paged; 3: poll_from; 4: post_reads,
                            AFP_MR_REMOTE_READ; 5: peer_exited; 6: AFP_ACTIVITY_ARRIVED;
                            7: afp_nic_info.lib_version */
#define AFP_ERRTEXT_LEN 256u
#define AFP_NAME_LEN 64u
#define AFP_MAX_ADDR_LEN 128u

/* Return codes. A provider includes this header only; the numbers are the shim's own
 * (AFS_ERROR_TABLE in afabric_shim.h, the one list Python reads), and shim/errors.c fails
 * to compile if a row there has no twin here with the same value. */
enum afp_error {
    AFP_OK = 0,
    AFP_EAGAIN = -1,       /* resource temporarily unavailable, try again */
    AFP_EINVAL = -2,       /* invalid argument */
    AFP_ERANGE = -3,       /* offset or length outside the memory region */
    AFP_ECLOSED = -4,      /* engine is closed */
    AFP_ENOMEM = -5,       /* out of memory */
    AFP_EBADDESC = -6,     /* malformed, truncated or forged descriptor or address */
    AFP_ESTALE = -7,       /* memory region was deregistered */
    AFP_ETOOBIG = -8,      /* message larger than the maximum size */
    AFP_ETIMEDOUT = -9,    /* operation timed out */
    AFP_EPEER = -10,       /* peer unreachable or connection lost */
    AFP_EKEY = -11,        /* remote key rejected */
    AFP_EIO = -12,         /* transport error */
    AFP_EPROVIDER = -13,   /* provider library could not be loaded or is incompatible */
    AFP_EUNSUPPORTED = -14,/* operation not supported by this provider */
    AFP_ECANCELED = -15,   /* operation canceled */
    AFP_EBUSY = -16,       /* resource busy */
    AFP_ENODEV = -17,      /* no usable NIC or domain */
    AFP_EWRONGPROV = -18,  /* descriptor or address belongs to another provider */
    AFP_EREG = -19,        /* memory registration failed */
    AFP_EDENIED = -20,     /* peer is not on the engine's allow-list */
    AFP_ESTUCK = -21,      /* the engine's worker is stuck inside the provider (the shim's own:
                              providers never return it) */
    AFP_EDROPPED = -22,    /* arrivals of an immediate were dropped at the bound (the shim's
                              own: providers never return it) */
};

/* For provider authors: formats an error text into `buf` (a domain's errbuf or a call's
 * `err` buffer); a NULL or empty buffer is ignored. Not part of the table. */
__attribute__((format(printf, 3, 4))) static inline void afp_errf(char *buf, size_t len,
                                                                  const char *fmt, ...)
{
    if (!buf || !len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
}

/* For provider authors (and the shim): one pause of a spin-wait loop. Not part of the table. */
static inline void afp_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

typedef struct afp_domain afp_domain; /* opaque, owned by the provider */
typedef struct afp_mr afp_mr;         /* opaque, owned by the provider */

/* Options for open and list_nics; strings may be NULL (= provider default). */
typedef struct afp_open_args {
    const char *fabric_provider; /* provider's own name: "tcp", "shm", "efa", "sockets" */
    const char *nic;             /* NIC/domain name; NULL = the first one usable */
    const char *bind_addr;       /* interface address to bind (tcp: "127.0.0.1") */
    uint32_t flags;              /* AFP_OPEN_* */
    uint32_t rx_depth;           /* receives to keep posted (SEND/RECV and, when needed, immediates) */
    uint32_t tx_depth;           /* operations in flight at once */
    uint32_t reserved;
} afp_open_args;

/* Testing hook (afabric.testing.force_efa_modes; tests/native/test_ofi.c), never set in
 * production: behave as if FI_RX_CQ_DATA, FI_MR_LOCAL and FI_MR_PROV_KEY were required.
 * A provider without such modes ignores it. */
#define AFP_OPEN_FORCE_EFA_MODES 0x1u

/* afp_nic_info, AFP_CAP_* and AFP_MR_* reach Python through afabric/_gen_shim.py (by name). */
typedef struct afp_nic_info {
    char name[AFP_NAME_LEN];     /* domain / device name */
    char fabric[AFP_NAME_LEN];   /* fabric name (network) */
    char provider[AFP_NAME_LEN]; /* full provider name as the library reports it */
    char pci[32];                /* PCI address "0000:3b:00.0" or "" */
    uint64_t link_speed_bps;     /* 0 if unknown */
    int32_t numa_node;           /* -1 if unknown */
    uint32_t lib_version;        /* the library under the provider (libfabric for ofi), as
                                    AFP_LIB_VERSION(major, minor, patch); 0 if none or unknown:
                                    `afabric info` shows it (one libfabric per host for shm) */
} afp_nic_info;

#define AFP_LIB_VERSION(major, minor, patch) \
    ((uint32_t)(major) << 16 | (uint32_t)(minor) << 8 | (uint32_t)(patch))

#define AFP_CAP_IMM_NEEDS_RECV 0x1u  /* remote immediates consume posted receives */
#define AFP_CAP_DEVICE_MEM 0x2u      /* CUDA memory can be registered */
#define AFP_CAP_MR_LOCAL 0x4u        /* local descriptors required for local buffers */
#define AFP_CAP_VIRT_ADDR 0x8u       /* remote addresses are virtual addresses */
#define AFP_CAP_PROV_KEY 0x10u       /* the provider chooses keys */
#define AFP_CAP_DELIVERY_COMPLETE 0x20u /* write completion means data is at the target */
/* Remote writes are copied into the target's memory by the target's own progress calls (poll)
 * after their key was checked, possibly over many calls (libfabric tcp, shm): one accepted
 * before dereg_mr can keep landing in later polls. The shim then keeps polling after
 * dereg_mr until remote writes have stopped completing (worker.c, settle_deregs). */
#define AFP_CAP_TARGET_COPIES 0x40u
/* Only device memory can be a remote target (nvlink): host memory registers as a local
 * source or destination only. A routed engine registers host regions here local-only and
 * reaches their owners' host memory through another transport. */
#define AFP_CAP_DEVICE_ONLY 0x80u

typedef struct afp_caps {
    char provider[AFP_NAME_LEN]; /* e.g. "tcp;ofi_rxm" */
    uint32_t flags;              /* AFP_CAP_* */
    uint32_t imm_size;           /* bytes of immediate data (4 for every provider we serve) */
    uint64_t max_msg_size;       /* largest single write or send */
    uint64_t inject_size;
    uint32_t addr_len;           /* length of this domain's address */
    int32_t wait_fd;             /* fd readable when the domain may have events, or -1 */
} afp_caps;

/* One write work request. `ctx` comes back in the completion. The same request describes a
 * read (post_reads): `length` bytes from remote_addr/remote_key at `peer` into local_addr
 * (imm/has_imm unused, always 0). */
typedef struct afp_write {
    void *local_addr;
    void *local_desc; /* from reg_mr (may be NULL for zero-length writes) */
    uint64_t length;
    uint64_t peer;        /* from resolve */
    uint64_t remote_addr; /* already translated by the shim (virtual or offset) */
    uint64_t remote_key;
    uint64_t ctx;
    uint32_t imm;
    uint32_t has_imm;
} afp_write;

/* A whole paged write, for providers that move it in one go (optional `post_paged`): page k
 * copies `page_len` bytes from local_base + src_offset + src_idx[k] * src_stride to
 * remote_base + dst_offset + dst_idx[k] * dst_stride. The index arrays stay valid until the
 * write's completion (one WRITE_DONE/ERROR for all pages, with `ctx`); with has_imm the
 * target counts `count` arrivals of `imm`, after every page has landed. */
typedef struct afp_paged {
    void *local_base;
    void *local_desc;
    uint64_t peer;
    uint64_t remote_base; /* as translated by the shim (virtual or offset) */
    uint64_t remote_key;
    uint64_t page_len;
    uint64_t count;
    const int64_t *src_idx;
    uint64_t src_stride, src_offset;
    const int64_t *dst_idx;
    uint64_t dst_stride, dst_offset;
    uint64_t ctx;
    uint32_t imm;
    uint32_t has_imm;
} afp_paged;

enum afp_event_kind {
    AFP_EV_WRITE_DONE = 1, /* ctx, status (also a read's completion: post_reads) */
    AFP_EV_SEND_DONE = 2,  /* ctx, status */
    AFP_EV_RECV = 3,       /* ctx = the receive's ctx, len, status */
    AFP_EV_IMM = 4,        /* imm; ctx = the receive consumed when IMM_NEEDS_RECV, else 0 */
    AFP_EV_ERROR = 5,      /* ctx of the failed operation (write/send/recv), status, errtext */
    AFP_EV_ACTIVITY = 6    /* len remote writes landed without an event of their own, or 0: data
                              moved for an operation in flight; tells an adaptive worker that
                              it is still making progress (as a target, or mid-transfer) */
};

/* AFP_EV_ACTIVITY's `op` (minor 6; 0 before): how the provider knows that data moved. 0: len
 * writes counted, or with len 0 a progress call that took long (which may only be caches gone
 * cold after a nap: the worker believes it if the next call is slow too). ARRIVED: the
 * provider's wait object was ready before the call and the call drained it: bytes came in and
 * its progress took them (a remote write without an event of its own, where the provider has
 * no write counter), believed at once. */
#define AFP_ACTIVITY_ARRIVED 1u

typedef struct afp_event {
    uint32_t kind;
    int32_t status;      /* 0 or negative AFP_E* code */
    uint64_t ctx;
    uint64_t len;
    uint32_t imm;
    uint32_t op;         /* for AFP_EV_ERROR: the kind of operation that failed (AFP_EV_*) */
    char errtext[AFP_ERRTEXT_LEN]; /* the provider's own error text, for errors */
} afp_event;

/* poll_from's source of an event: the peer handle `resolve` gave for the sender, or one of
 * these: the provider knows the sender is none of the peers resolved on this domain, or it
 * cannot tell who sent it. */
#define AFP_SRC_UNKNOWN UINT64_MAX
#define AFP_SRC_UNRESOLVED (UINT64_MAX - 1)

#define AFP_MR_REMOTE 0x1u /* remote peers may write into the region */
#define AFP_MR_DEVICE 0x2u /* CUDA device memory (device id in `device`) */
/* Remote peers may read the region (minor 4). Without it, a provider must refuse a remote
 * read of the region; a provider built before minor 4 never sees it (the shim refuses to
 * register a readable region with a provider that lacks post_reads). */
#define AFP_MR_REMOTE_READ 0x4u

struct afp_ops {
    uint32_t size;  /* sizeof(struct afp_ops) as the provider was built */
    uint16_t major; /* AFP_ABI_MAJOR */
    uint16_t minor; /* AFP_ABI_MINOR */
    const char *name;

    /* Fill up to `max` NICs usable with `args`; *n gets how many exist. */
    int (*list_nics)(const afp_open_args *args, afp_nic_info *out, uint32_t max, uint32_t *n,
                     char *err, size_t errlen);
    int (*open)(const afp_open_args *args, afp_domain **out, char *err, size_t errlen);
    void (*close)(afp_domain *dom);
    const char *(*errbuf)(afp_domain *dom);
    int (*caps)(afp_domain *dom, afp_caps *out);
    int (*address)(afp_domain *dom, void *buf, size_t *len);

    int (*reg_mr)(afp_domain *dom, void *addr, uint64_t len, uint32_t flags, int32_t device,
                  uint64_t requested_key, afp_mr **mr, void **local_desc, uint64_t *rkey,
                  uint64_t *remote_base);
    int (*dereg_mr)(afp_domain *dom, afp_mr *mr);
    int (*resolve)(afp_domain *dom, const void *addr, size_t len, uint64_t *peer);
    int (*forget)(afp_domain *dom, uint64_t peer);

    /* Post up to n writes; *posted gets how many were accepted (a prefix). Returns 0,
     * AFP_EAGAIN when the queue is full (after posting *posted), or an error. */
    int (*post_writes)(afp_domain *dom, const afp_write *wr, uint32_t n, uint32_t *posted);
    int (*post_send)(afp_domain *dom, uint64_t peer, const void *buf, uint64_t len, void *desc,
                     uint64_t ctx);
    int (*post_recv)(afp_domain *dom, void *buf, uint64_t len, void *desc, uint64_t ctx);
    int (*poll)(afp_domain *dom, afp_event *ev, uint32_t max, uint32_t *n);
    /* Before sleeping on wait_fd: returns 0 if it is safe to sleep, AFP_EAGAIN if events
     * may be pending (poll again first). */
    int (*trywait)(afp_domain *dom);
    /* Optional (minor 2): post a whole paged write as one operation (a provider that can
     * batch pages, e.g. one copy kernel). 0, AFP_EAGAIN (nothing posted) or an error. Used
     * for engines of one NIC; without it the shim posts one write per page. */
    int (*post_paged)(afp_domain *dom, const afp_paged *p);
    /* Optional (minor 3): poll, and for each event set src[i] to the sender of an AFP_EV_RECV
     * or AFP_EV_IMM: a `resolve` handle, AFP_SRC_UNRESOLVED or AFP_SRC_UNKNOWN. Only exact
     * answers may be given (the shim's allow-list trusts them); when unsure, UNKNOWN. */
    int (*poll_from)(afp_domain *dom, afp_event *ev, uint64_t *src, uint32_t max, uint32_t *n);
    /* Optional (minor 4): post up to n one-sided reads (afp_write: remote -> local_addr),
     * as post_writes does; each completes with AFP_EV_WRITE_DONE or AFP_EV_ERROR (op
     * AFP_EV_WRITE_DONE) carrying its ctx. A target's refusal (no AFP_MR_REMOTE_READ, bad
     * key or range) is AFS_EKEY where the provider can tell. Without it, reads are
     * AFS_EUNSUPPORTED. */
    int (*post_reads)(afp_domain *dom, const afp_write *rd, uint32_t n, uint32_t *posted);
    /* Optional (minor 5): the process `pid` behind the peer at `addr` (the address `resolve`
     * was given) has exited; the shim saw it (pidfd) and is about to fail everything to that
     * peer. For a provider whose calls can wait on something that process held (a lock in
     * memory it shared): make them stop waiting. Called from the shim's watch thread, while
     * the worker may be inside any other call on `dom` (even stuck in one): touch only what
     * is safe for that. */
    void (*peer_exited)(afp_domain *dom, const void *addr, size_t len, uint32_t pid);
};

typedef const struct afp_ops *(*afp_get_ops_fn)(void);

#define AFP_HAS_OP(ops, member)                                                                \
    ((ops)->size >= offsetof(struct afp_ops, member) + sizeof((ops)->member) &&              \
     (ops)->member != NULL)

#endif
