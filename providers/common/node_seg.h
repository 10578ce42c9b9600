/*
 * The node-local rendezvous of the node-local providers (nvlink: CUDA IPC; cma: cross-memory
 * attach): one shared-memory segment per domain (/dev/shm/<pid><tag><token>, the tag naming
 * the provider: mb_kind), mapped by every peer that resolves the domain's address. It holds
 *  - the export table: one entry per remotely accessible region (the owner's virtual
 *    address range, a generation, what it allows, a provider-specific handle: nvlink's CUDA
 *    IPC handle), read by peers with a seqlock, so a descriptor's key names an entry and
 *    deregistration revokes it at once;
 *  - the mailbox: a ring of records (immediates with an arrival count, SEND payloads)
 *    that writers append under the ring's lock and the owner drains without it.
 *
 * Why a mailbox in host memory rather than SEND over libfabric shm: an immediate must
 * reach the target only after the copy has completed, which only the writer observes (a
 * CUDA event on its stream); it then appends one 16-byte record (one per paged write,
 * carrying the page count, not one per page) - no second transport, no receive buffers to
 * keep posted, no libfabric needed on GPU nodes, and the target counts arrivals straight
 * from memory it already polls.
 *
 * Shared memory is not trusted: any process of the uid can write it, and a peer killed
 * mid-update leaves what it had written. So
 *  - the geometry (where the exports and the ring are, the ring's size) lives in each
 *    process's mb_seg: fixed at create, or checked once at attach, never read back from
 *    the segment;
 *  - the ring's lock is a word holding the holder's domain token, not a pthread mutex (whose
 *    in-segment list pointers and kind bits glibc follows and asserts on): a writer waits for
 *    it at most MB_LOCK_SPIN_NS per call ("try again"), takes it over from a holder that is
 *    gone (mb_live_tokens: a wrong verdict costs two writers in the ring at once, which the
 *    owner's checks catch, never memory outside the ring), and gives up with an error on a
 *    hold that has not moved for MB_STALL_NS;
 *  - the owner keeps its consumer position private and publishes it; it checks the tail
 *    writers publish and every record (kind, length, against the ring's end and the tail)
 *    after copying its header once; a drain takes at most MB_DRAIN_RECORDS records and
 *    MB_DRAIN_BYTES bytes. A ring found corrupt is reset (mb_reset): what was published is
 *    dropped and the ring is empty and usable again;
 *  - a writer checks the positions it reads (tail - head within the ring, 16-aligned) and
 *    writes only inside its private view of the ring. Positions it finds impossible make it
 *    wake the owner (which resets the ring on its next poll) and try again, for up to
 *    MB_REPAIR_NS: only a ring that stays corrupt fails its operations;
 *  - the owner puts back the header's fixed fields (magic, geometry, pid, token) when they
 *    were overwritten (mb_repair), so that peers can still attach.
 *
 * Liveness: the owner holds an exclusive flock on the segment for as long as it lives;
 * a peer that can take a shared lock knows the owner is gone (robust across PID
 * namespaces and PID reuse). An owner that closes its domain first sets `closed` to
 * MB_CLOSED, so that peers can say its engine was closed rather than its process gone.
 * Wakeups: an owner about to sleep sets `sleeping`; a writer
 * that sees it sends one datagram to the owner's abstract unix socket (its wait fd).
 */
#ifndef AFN_NODE_SEG_H
#define AFN_NODE_SEG_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#define MB_VERSION 3u /* 2: the ring's lock is a token word, its positions atomics;
                         3: owner_va */
#define MB_HANDLE_BYTES 64u
#define MB_EXPORTS 16384u
#define MB_RING_BYTES (8u << 20) /* a power of two */
#define MB_MAX_MSG (4u << 20) /* largest SEND payload */
#define MB_MAX_ARRIVALS (1ull << 32) /* per IMM record: a larger count takes several */
#define MB_NAME_LEN 64u
#define MB_CLOSED 0xc105edu /* `closed` once the owner closed: any other value is not believed */

#define MB_LOCK_SPIN_NS 50000ull     /* a writer waits this long per call for a busy lock */
#define MB_PROBE_NS 1000000ull       /* a hold unchanged this long: is its holder alive? */
#define MB_STALL_NS 2000000000ull    /* a live holder's hold unchanged this long: wedged */
#define MB_REPAIR_NS 2000000000ull   /* a ring seen corrupt is given this long to be reset */
#define MB_DRAIN_RECORDS 1024u       /* records the owner takes per poll at most */
#define MB_DRAIN_BYTES (16ull << 20) /* message bytes the owner copies per poll at most */

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
    _Atomic uint32_t closed; /* MB_CLOSED: the owner closed the domain */
    _Atomic uint32_t sleeping;
    uint32_t nexports;
    uint32_t ring_bytes;
    uint64_t exports_off, ring_off;
    uint64_t pidns; /* owner's PID namespace (inode of /proc/self/ns/pid, 0 if unknown) */
    _Atomic uint64_t lock;     /* writers' lock: 0 free, else the holding domain's token */
    _Atomic uint64_t lock_seq; /* times taken: a waiter tells one hold from the next */
    _Atomic uint64_t head;     /* consumer position as the owner last published it (bytes,
                                  monotonically increasing, a multiple of 16) */
    _Atomic uint64_t tail;     /* producer position, published after the record is whole */
    _Atomic uint64_t resets;   /* times the owner found its ring corrupt and reset it */
    uint64_t owner_va; /* where the owner maps this header: a byte a peer may read with
                          process_vm_readv to learn whether the kernel lets it in (cma) */
} mb_header;

/* A mapped segment: ours (owner) or a peer's. Everything below hdr is this process's own
 * memory. */
typedef struct mb_seg {
    int fd;
    mb_header *hdr;
    size_t map_len;
    char name[MB_NAME_LEN];
    const mb_kind *kind;
    /* geometry, fixed at create or attach */
    mb_export *exports;
    uint8_t *ring;
    uint64_t ring_bytes;
    uint8_t *extra;
    /* the owner's token and pid (a peer's: from the segment's name, checked against the
     * header once at attach) */
    uint64_t token;
    int32_t pid;
    /* owner: its consumer position, arrivals delivered of the IMM record there, and its
     * PID namespace as written in the header (mb_repair) */
    uint64_t head, imm_done;
    uint64_t pidns;
    /* writer: the peer's lock as last seen busy, since when, when its holder was probed;
     * since when its ring has looked corrupt (0: it does not) */
    uint64_t lock_seen, lock_seq_seen, lock_since_ns, lock_probe_ns;
    uint64_t bad_since_ns;
} mb_seg;

/* How a peer segment's owner is (mb_owner_state). */
enum { MB_OWNER_LIVE = 0, MB_OWNER_CLOSED = 1, MB_OWNER_GONE = 2 };

size_t mb_seg_bytes(const mb_kind *k);
/* Create our segment, lock it and initialise it. err gets the reason on failure. */
int mb_create(mb_seg *s, const mb_kind *k, uint64_t token, char *err, size_t errlen);
/* Map a peer's segment by name and check it belongs to `token` (and the pid in its name)
 * and has our geometry. */
int mb_attach(mb_seg *s, const mb_kind *k, const char *name, uint64_t token, char *err,
              size_t errlen);
void mb_detach(mb_seg *s, bool owner);
/* Whether the owner of a peer segment is still alive, closed its domain, or is gone. */
int mb_owner_state(mb_seg *s);
/* Remove segments of dead owners left in /dev/shm (killed processes cannot clean up). */
void mb_reap(const mb_kind *k);
/* Tokens of the live domains of kind k on this node (their segment's flock is held, and
 * its owner's process, where it is in our PID namespace, has not exited: a forked child
 * keeps the flock of a dead parent's segment): up to max stored in out; returns how many
 * there are (more than max: the rest unknown). */
uint32_t mb_live_tokens(const mb_kind *k, uint64_t *out, uint32_t max);
/* Has process `pid` (of our PID namespace) exited: no such process, or a zombie? A pid of
 * 0 or less names none. */
bool mb_pid_gone(int32_t pid);
/* Is `token` (its bits under `mask`) among the n live tokens? (n > max: unknown, so yes) */
bool mb_token_listed(const uint64_t *live, uint32_t n, uint32_t max, uint64_t token,
                     uint64_t mask);
/* Our PID namespace (inode of /proc/self/ns/pid), 0 if unknown. */
uint64_t mb_pidns(void);
/* Abstract unix socket name of a domain's wakeups. */
void mb_wake_name(const mb_kind *k, uint64_t token, struct sockaddr_un *sa, socklen_t *len);

static inline mb_export *mb_exports(const mb_seg *s) { return s->exports; }

/* The provider's own shared memory after the ring (mb_kind.extra_bytes). */
static inline uint8_t *mb_extra(const mb_seg *s) { return s->extra; }

/* Writer: append a record to a peer's ring as domain `me` (its token; payload may be NULL
 * when len is 0). 0; -EAGAIN: the ring is full or its lock busy (try again); -ESTALE: its
 * positions are impossible, wake the owner (it resets the ring) and try again; -EINVAL: an
 * oversize payload; -EBADMSG: the positions have been impossible for MB_REPAIR_NS
 * (corrupt); -EDEADLK: a live domain has held its lock for MB_STALL_NS. `why` gets the text
 * of the last two. */
int mb_push(mb_seg *s, uint64_t me, uint32_t kind, uint32_t imm, uint64_t arg,
            const void *payload, uint64_t len, char *why, size_t whylen);

/* Owner: a record of our ring, checked; its header fields are copies. */
typedef struct mb_view {
    uint32_t kind, imm;
    uint64_t arg;           /* IMM: arrivals (1..MB_MAX_ARRIVALS); MSG: payload bytes */
    const uint8_t *payload; /* MSG: arg bytes inside the ring */
    uint64_t bytes;         /* the record's size in the ring */
} mb_view;

/* Owner: the published tail, or UINT64_MAX with `why` set if it is no position the ring
 * can have (then mb_reset). */
uint64_t mb_tail(mb_seg *s, char *why, size_t whylen);
/* Owner: the record at our head, up to `tail` (from mb_tail), padding skipped: 1 with *v
 * filled, 0 when none is left, -1 when the ring is corrupt (`why` says how). */
int mb_next(mb_seg *s, uint64_t tail, mb_view *v, char *why, size_t whylen);
/* Owner: the record mb_next gave is consumed (published with mb_publish_head). */
void mb_pop(mb_seg *s, const mb_view *v);
/* Owner: tells writers how far we have read (also repairs a head overwritten in the
 * segment). */
void mb_publish_head(mb_seg *s);
/* Owner: our ring is corrupt: forget every record published so far (our head moves to the
 * tail, or a tail that is no position of the ring is put back to our head), count it in
 * the header's `resets`. Returns the bytes dropped. */
uint64_t mb_reset(mb_seg *s, uint64_t tail);
/* Owner: rewrites the header's fixed fields that differ from what mb_create wrote, and
 * `closed` (we are open). Returns whether any did. */
bool mb_repair(mb_seg *s);

#endif
