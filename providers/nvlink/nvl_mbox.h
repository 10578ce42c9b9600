/*
 * The node-local rendezvous of the nvlink provider: one shared-memory segment per domain
 * (/dev/shm/<pid>:afabric-nvl-<token>), mapped by every peer that resolves the domain's
 * address. It holds
 *  - the export table: one entry per remotely writable region (CUDA IPC handle, the
 *    owner's virtual address range, a generation), read by peers with a seqlock, so a
 *    descriptor's key names an entry and deregistration revokes it at once;
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
#ifndef AFNV_MBOX_H
#define AFNV_MBOX_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nvl_cuda.h"

#define MB_MAGIC 0x314c564e31414641ull /* "AFA1NVL1" */
#define MB_VERSION 1u
#define MB_EXPORTS 16384u
#define MB_RING_BYTES (8u << 20)
#define MB_MAX_MSG (4u << 20) /* largest SEND payload */
#define MB_NAME_LEN 64u

enum { MB_REC_PAD = 0, MB_REC_IMM = 1, MB_REC_MSG = 2 };

typedef struct mb_export {
    _Atomic uint64_t gen; /* odd: live; even: free or being rewritten */
    uint64_t base, len;   /* the registered range, owner's virtual addresses */
    uint64_t alloc_base;  /* start of the CUDA allocation holding it (what the handle maps) */
    uint64_t proc_token;  /* owner's afnv_process_token() */
    int32_t pid;
    int32_t device;
    CUipcMemHandle handle;
    uint32_t access; /* AFP_MR_REMOTE | AFP_MR_REMOTE_READ (0, from a build before reads:
                        write only); taken from the padding, the layout is unchanged */
    uint8_t pad[12];
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
} mb_header;

/* A mapped segment: ours (owner) or a peer's. */
typedef struct mb_seg {
    int fd;
    mb_header *hdr;
    size_t map_len;
    char name[MB_NAME_LEN];
} mb_seg;

size_t mb_seg_bytes(void);
/* Create our segment, lock it and initialise it. err gets the reason on failure. */
int mb_create(mb_seg *s, uint64_t token, char *err, size_t errlen);
/* Map a peer's segment by name and check it belongs to `token`. */
int mb_attach(mb_seg *s, const char *name, uint64_t token, char *err, size_t errlen);
void mb_detach(mb_seg *s, bool owner);
/* Whether the owner of a peer segment is still alive (and has not closed). */
bool mb_alive(mb_seg *s);
/* Remove segments of dead owners left in /dev/shm (killed processes cannot clean up). */
void mb_reap(void);

static inline mb_export *mb_exports(mb_header *h)
{
    return (mb_export *)((uint8_t *)h + h->exports_off);
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
