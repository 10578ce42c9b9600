/*
 * The node-local rendezvous of the node-local providers (nvlink: CUDA IPC; cma: cross-memory
 * attach): one shared-memory segment per domain (/dev/shm/<pid><tag><token>, the tag naming
 * the provider: mb_kind), mapped by every peer that resolves the domain's address. It holds
 *  - the export table: one entry per remotely accessible region (the owner's virtual
 *    address range, a generation, what it allows, a provider-specific handle: nvlink's CUDA
 *    IPC handle), read by peers with a seqlock, so a descriptor's key names an entry and
 *    deregistration revokes it at once;
 *  - the mailbox: a ring of records (immediates with an arrival count, SEND payloads)
 *    that writers append under a process-shared robust mutex and the owner drains.
 *
 * Why a mailbox in host memory rather than SEND over libfabric shm: an immediate must
 * reach the target only after the copy has completed, which only the writer observes (a
 * CUDA event on its stream); it then appends one 16-byte record (one per paged write,
 * carrying the page count, not one per page) - no second transport, no receive buffers to
 * keep posted, no libfabric needed on GPU nodes, and the target counts arrivals straight
 * from memory it already polls.
 *
 * Liveness: the owner holds an exclusive flock on the segment for as long as it lives;
 * a peer that can take a shared lock knows the owner is gone (robust across PID
 * namespaces and PID reuse). Wakeups: an owner about to sleep sets `sleeping`; a writer
 * that sees it sends one datagram to the owner's abstract unix socket (its wait fd).
 */
#ifndef AFN_NODE_SEG_H
#define AFN_NODE_SEG_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#define MB_VERSION 1u
#define MB_HANDLE_BYTES 64u
#define MB_EXPORTS 16384u
#define MB_RING_BYTES (8u << 20)
#define MB_MAX_MSG (4u << 20) /* largest SEND payload */
#define MB_NAME_LEN 64u

enum { MB_REC_PAD = 0, MB_REC_IMM = 1, MB_REC_MSG = 2 };

/* What distinguishes one provider's segments from another's. `extra_bytes` of
 * provider-owned shared memory follow the ring (mb_extra). */
typedef struct mb_kind {
    const char *tag;    /* in the file name, "<pid><tag><token>": ":afabric-nvl-" */
    const char *wake;   /* abstract socket name prefix: "afabric-nvl-" */
    const char *name;   /* for error texts: "nvlink" */
    uint64_t magic;
    size_t extra_bytes;
} mb_kind;

typedef struct mb_export {
    _Atomic uint64_t gen; /* odd: live; even: free or being rewritten */
    uint64_t base, len;   /* the registered range, owner's virtual addresses */
    uint64_t alloc_base;  /* nvlink: start of the CUDA allocation holding it (what the handle
                             maps) */
    uint64_t proc_token;  /* nvlink: owner's afnv_process_token() */
    int32_t pid;
    int32_t device;
    uint8_t handle[MB_HANDLE_BYTES]; /* provider-specific (nvlink: CUipcMemHandle) */
    uint32_t access; /* AFP_MR_REMOTE | AFP_MR_REMOTE_READ (0, from a build before reads:
                        write only); taken from the padding, the layout is unchanged */
    uint32_t gpu; /* nvlink: the owner's GPU by PCI location (domain << 16 | bus << 8 |
                     device), the same in every process whatever CUDA_VISIBLE_DEVICES says;
                     0: unknown (an older build). From the padding too */
    uint8_t pad[8];
} mb_export;

typedef struct mb_rec {
    uint32_t kind;
    uint32_t imm;
    uint64_t arg; /* IMM: arrivals; MSG: payload bytes (payload follows, padded to 16) */
} mb_rec;

typedef struct mb_header {
    uint64_t magic;
    uint32_t version;
    int32_t pid;
    uint64_t token; /* the domain's token (also in its address) */
    _Atomic uint32_t closed;
    _Atomic uint32_t sleeping;
    uint32_t nexports;
    uint32_t ring_bytes;
    uint64_t exports_off, ring_off;
    pthread_mutex_t lock; /* producers (any process) and the consumer; robust */
    uint64_t head;        /* consumer position (bytes, monotonically increasing) */
    uint64_t tail;        /* producer position */
    _Atomic uint64_t tail_pub; /* tail as last published: lets the owner poll without the lock */
    uint64_t pidns; /* owner's PID namespace (inode of /proc/self/ns/pid, 0 if unknown); at
                       the end: the offsets above do not move */
} mb_header;

/* A mapped segment: ours (owner) or a peer's. */
typedef struct mb_seg {
    int fd;
    mb_header *hdr;
    size_t map_len;
    char name[MB_NAME_LEN];
    const mb_kind *kind;
} mb_seg;

size_t mb_seg_bytes(const mb_kind *k);
/* Create our segment, lock it and initialise it. err gets the reason on failure. */
int mb_create(mb_seg *s, const mb_kind *k, uint64_t token, char *err, size_t errlen);
/* Map a peer's segment by name and check it belongs to `token`. */
int mb_attach(mb_seg *s, const mb_kind *k, const char *name, uint64_t token, char *err,
              size_t errlen);
void mb_detach(mb_seg *s, bool owner);
/* Whether the owner of a peer segment is still alive (and has not closed). */
bool mb_alive(mb_seg *s);
/* Remove segments of dead owners left in /dev/shm (killed processes cannot clean up). */
void mb_reap(const mb_kind *k);
/* Our PID namespace (inode of /proc/self/ns/pid), 0 if unknown. */
uint64_t mb_pidns(void);
/* Abstract unix socket name of a domain's wakeups. */
void mb_wake_name(const mb_kind *k, uint64_t token, struct sockaddr_un *sa, socklen_t *len);

static inline mb_export *mb_exports(mb_header *h)
{
    return (mb_export *)((uint8_t *)h + h->exports_off);
}

/* The provider's own shared memory after the ring (mb_kind.extra_bytes). */
static inline uint8_t *mb_extra(mb_header *h)
{
    return (uint8_t *)h + h->ring_off + h->ring_bytes;
}

/* Append a record (payload may be NULL when len is 0). 0, or -EAGAIN when the ring is
 * full, or -EINVAL for an oversize payload. */
int mb_push(mb_header *h, uint32_t kind, uint32_t imm, uint64_t arg, const void *payload,
            uint64_t len);

/* Consumer: the oldest record or NULL; the ring stays locked between peek and pop/unlock. */
void mb_lock(mb_header *h);
void mb_unlock(mb_header *h);
mb_rec *mb_peek(mb_header *h);
void mb_pop(mb_header *h);

#endif
