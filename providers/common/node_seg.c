/* The shared-memory segment of a node-local domain (nvlink, cma): see node_seg.h. */
#include "node_seg.h"

#include "afabric_provider.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MB_DIR "/dev/shm/"
/* "<pid><tag><token>", the tag ":afabric-nvl-" (mb_kind): the "<pid>:" convention of
 * libfabric's shm files, so tools (and the test suite's leak check) tell a live process's
 * files from a dead one's */

/* The layout tests/test_cma_mailbox.py writes into (it maps segments to corrupt them). */
_Static_assert(offsetof(mb_header, closed) == 24 && offsetof(mb_header, ring_bytes) == 36 &&
                   offsetof(mb_header, ring_off) == 48 && offsetof(mb_header, lock) == 64 &&
                   offsetof(mb_header, lock_seq) == 72 && offsetof(mb_header, head) == 80 &&
                   offsetof(mb_header, tail) == 88 && offsetof(mb_header, resets) == 96 &&
                   sizeof(mb_rec) == 16,
               "the mailbox layout the tests mirror");
_Static_assert((MB_RING_BYTES & (MB_RING_BYTES - 1)) == 0 && MB_MAX_MSG + 32 < MB_RING_BYTES,
               "the ring is a power of two and holds the largest message");

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static size_t exports_off(void) { return align_up(sizeof(mb_header), 4096); }
static size_t ring_off(void) { return align_up(exports_off() + MB_EXPORTS * sizeof(mb_export), 4096); }

size_t mb_seg_bytes(const mb_kind *k) { return ring_off() + MB_RING_BYTES + k->extra_bytes; }

uint64_t mb_pidns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

void mb_wake_name(const mb_kind *k, uint64_t token, struct sockaddr_un *sa, socklen_t *len)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    /* abstract namespace: sun_path[0] = 0, nothing left on the file system */
    int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "%s%016llx", k->wake,
                     (unsigned long long)token);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* The token in a segment name "<pid><tag><16 hex digits>", or 0 if it is not one. */
static uint64_t name_token(const char *name, const char *tag)
{
    const char *t = strstr(name, tag);
    if (!t)
        return 0;
    t += strlen(tag);
    if (strlen(t) != 16)
        return 0;
    char *end = NULL;
    uint64_t v = strtoull(t, &end, 16);
    return end && *end == '\0' ? v : 0;
}

/* Map the whole segment of s->fd (s->kind's size): 0, or -1 with err set. */
static int map_seg(mb_seg *s, const char *path, char *err, size_t errlen)
{
    void *p = mmap(NULL, mb_seg_bytes(s->kind), PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "cannot map %s: %s", path, strerror(errno));
        return -1;
    }
    s->hdr = p;
    s->map_len = mb_seg_bytes(s->kind);
    s->exports = (mb_export *)((uint8_t *)p + exports_off());
    s->ring = (uint8_t *)p + ring_off();
    s->ring_bytes = MB_RING_BYTES;
    s->extra = s->ring + MB_RING_BYTES;
    return 0;
}

int mb_create(mb_seg *s, const mb_kind *k, uint64_t token, char *err, size_t errlen)
{
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->kind = k;
    snprintf(s->name, sizeof s->name, "%d%s%016llx", (int)getpid(), k->tag,
             (unsigned long long)token);
    char path[MB_NAME_LEN + 16], tmp[MB_NAME_LEN + 24];
    snprintf(path, sizeof path, MB_DIR "%s", s->name);
    /* made under a name mb_reap() ignores, locked, then renamed: a reaper never sees it
     * unlocked */
    snprintf(tmp, sizeof tmp, MB_DIR ".%s.new", s->name);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %s: %s", tmp, strerror(errno));
        s->name[0] = '\0'; /* not ours: never unlink it */
        return -1;
    }
    s->fd = fd;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || ftruncate(fd, (off_t)mb_seg_bytes(k)) != 0 ||
        rename(tmp, path) != 0) {
        snprintf(err, errlen, "cannot lock, size or name %s: %s", path, strerror(errno));
        (void)unlink(tmp);
        goto out_fail;
    }
    if (map_seg(s, path, err, errlen) != 0)
        goto out_fail;
    mb_header *h = s->hdr;
    s->token = token;
    s->pid = (int32_t)getpid();
    s->pidns = mb_pidns();
    h->version = MB_VERSION;
    h->pid = s->pid;
    h->token = token;
    h->nexports = MB_EXPORTS;
    h->ring_bytes = MB_RING_BYTES;
    h->exports_off = exports_off();
    h->ring_off = ring_off();
    h->pidns = s->pidns;
    h->owner_va = (uint64_t)(uintptr_t)h;
    atomic_store(&h->lock, 0);
    atomic_store(&h->head, 0);
    atomic_store(&h->tail, 0);
    atomic_thread_fence(memory_order_release);
    h->magic = k->magic; /* last: a peer attaching early sees no magic and retries/fails */
    return 0;
out_fail:
    mb_detach(s, true);
    s->name[0] = '\0';
    return -1;
}

int mb_attach(mb_seg *s, const mb_kind *k, const char *name, uint64_t token, char *err,
              size_t errlen)
{
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->kind = k;
    if (strlen(name) >= MB_NAME_LEN || !strstr(name, k->tag) || name[0] == '.' ||
        strchr(name, '/')) {
        snprintf(err, errlen, "bad %s segment name in peer address", k->name);
        return -1;
    }
    snprintf(s->name, sizeof s->name, "%s", name);
    char path[MB_NAME_LEN + 16];
    snprintf(path, sizeof path, MB_DIR "%s", name);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "peer segment %s: %s (peer gone, or not on this node)", path,
                 strerror(errno));
        return -1;
    }
    s->fd = fd;
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < mb_seg_bytes(k)) {
        snprintf(err, errlen, "peer segment %s is too small (not a %s domain)", path, k->name);
        goto out_fail;
    }
    if (map_seg(s, path, err, errlen) != 0)
        goto out_fail;
    /* the name says "<pid><tag><token>" too: a pid overwritten in the header must not send
     * our copies into another process */
    char *end = NULL;
    long pid = strtol(name, &end, 10);
    s->pid = end && end != name && pid > 0 && pid <= INT32_MAX ? (int32_t)pid : 0;
    s->token = token;
    mb_header *h = s->hdr;
    if (h->magic != k->magic || h->version != MB_VERSION || h->token != token ||
        name_token(name, k->tag) != token || !s->pid || h->pid != s->pid ||
        h->nexports != MB_EXPORTS || h->ring_bytes != MB_RING_BYTES ||
        h->exports_off != exports_off() || h->ring_off != ring_off()) {
        snprintf(err, errlen, "peer segment %s does not match the address (stale or foreign)",
                 path);
        goto out_fail;
    }
    return 0;
out_fail:
    mb_detach(s, false);
    return -1;
}

void mb_detach(mb_seg *s, bool owner)
{
    if (owner && s->hdr)
        atomic_store(&s->hdr->closed, MB_CLOSED);
    if (owner && s->name[0]) {
        char path[MB_NAME_LEN + 16];
        snprintf(path, sizeof path, MB_DIR "%s", s->name);
        (void)unlink(path);
    }
    if (s->hdr)
        munmap(s->hdr, s->map_len);
    if (s->fd >= 0)
        close(s->fd); /* drops the owner's flock: peers now see it gone */
    s->hdr = NULL;
    s->exports = NULL;
    s->ring = s->extra = NULL;
    s->fd = -1;
    if (owner)
        s->name[0] = '\0';
}

int mb_owner_state(mb_seg *s)
{
    if (!s->hdr)
        return MB_OWNER_GONE;
    /* only the exact word: stray bytes there must not take a live peer for closed */
    if (atomic_load_explicit(&s->hdr->closed, memory_order_acquire) == MB_CLOSED)
        return MB_OWNER_CLOSED;
    if (flock(s->fd, LOCK_SH | LOCK_NB) == 0) { /* nobody holds it exclusively: owner gone */
        (void)flock(s->fd, LOCK_UN);
        return MB_OWNER_GONE;
    }
    return errno == EWOULDBLOCK || errno == EINTR ? MB_OWNER_LIVE : MB_OWNER_GONE;
}

void mb_reap(const mb_kind *k)
{
    DIR *d = opendir(MB_DIR);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' || !strstr(e->d_name, k->tag))
            continue;
        int fd = openat(dirfd(d), e->d_name, O_RDWR | O_CLOEXEC);
        if (fd < 0)
            continue;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) /* owner dead: nobody else holds it */
            (void)unlinkat(dirfd(d), e->d_name, 0);
        close(fd);
    }
    closedir(d);
}

bool mb_pid_gone(int32_t pid)
{
    if (pid <= 0)
        return true;
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return true;
    char path[48], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return false; /* cannot tell: alive */
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')'); /* "pid (comm) S ...": comm may hold anything */
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

uint32_t mb_live_tokens(const mb_kind *k, uint64_t *out, uint32_t max)
{
    DIR *d = opendir(MB_DIR);
    if (!d)
        return UINT32_MAX; /* cannot tell: everyone counts as alive */
    uint64_t ns = mb_pidns();
    uint32_t n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        uint64_t token = e->d_name[0] == '.' ? 0 : name_token(e->d_name, k->tag);
        if (!token)
            continue;
        int fd = openat(dirfd(d), e->d_name, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        bool live = flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
        mb_header h;
        if (live && pread(fd, &h, sizeof h, 0) == (ssize_t)sizeof h && h.magic == k->magic &&
            ns && h.pidns == ns && mb_pid_gone(h.pid))
            live = false; /* held by a child the dead owner forked: not the owner */
        close(fd); /* drops our shared lock, if we got one */
        if (live) {
            if (n < max)
                out[n] = token;
            n++;
        }
    }
    closedir(d);
    return n;
}

bool mb_token_listed(const uint64_t *live, uint32_t n, uint32_t max, uint64_t token,
                     uint64_t mask)
{
    if (n > max)
        return true;
    for (uint32_t i = 0; i < n; i++)
        if ((live[i] & mask) == (token & mask))
            return true;
    return false;
}

/* ------------------------------------------------------------------------------------ */
/* The ring: writers                                                                     */

/* Take the ring's lock as `me`: 0, -EAGAIN (busy: spun MB_LOCK_SPIN_NS in this call, or on
 * this hold in earlier ones: many immediates retried in one poll spin once), -EDEADLK (a
 * live holder, the same hold for MB_STALL_NS). */
static int take_lock(mb_seg *s, uint64_t me, char *why, size_t whylen)
{
    mb_header *h = s->hdr;
    uint64_t start = now_ns();
    for (uint32_t spin = 0;; spin++) {
        uint64_t v = atomic_load_explicit(&h->lock, memory_order_relaxed);
        if (v == 0) {
            if (atomic_compare_exchange_weak_explicit(&h->lock, &v, me, memory_order_acquire,
                                                      memory_order_relaxed))
                break;
            continue;
        }
        uint64_t seq = atomic_load_explicit(&h->lock_seq, memory_order_relaxed);
        uint64_t t = now_ns();
        if (v != s->lock_seen || seq != s->lock_seq_seen || !s->lock_since_ns) {
            s->lock_seen = v;
            s->lock_seq_seen = seq;
            s->lock_since_ns = t;
        } else if (t - s->lock_since_ns >= MB_PROBE_NS) {
            /* one hold for a while: a holder that is gone (killed mid-append: it published
             * nothing, the tail moves only after a whole record) or a word that names no
             * live domain (stray bytes, our own token) is taken over */
            if (t - s->lock_probe_ns >= MB_PROBE_NS) {
                s->lock_probe_ns = t;
                uint64_t live[256];
                uint32_t n = v == me ? 0 : mb_live_tokens(s->kind, live, 256);
                if (!mb_token_listed(live, n, 256, v, UINT64_MAX)) {
                    if (atomic_compare_exchange_strong_explicit(
                            &h->lock, &v, me, memory_order_acquire, memory_order_relaxed))
                        break;
                    continue;
                }
            }
            if (t - s->lock_since_ns >= MB_STALL_NS) {
                snprintf(why, whylen,
                         "its mailbox's lock has been held by domain %016llx, alive, for %.1f s "
                         "(the holder is stopped, or the segment corrupt)",
                         (unsigned long long)v, (double)(t - s->lock_since_ns) / 1e9);
                return -EDEADLK;
            }
            return -EAGAIN; /* known to be slow: no spinning on it again */
        }
        if (t - start >= MB_LOCK_SPIN_NS || t - s->lock_since_ns >= MB_LOCK_SPIN_NS)
            return -EAGAIN;
        if (spin < 64)
            afp_cpu_relax();
        else
            sched_yield();
    }
    s->lock_since_ns = 0;
    atomic_fetch_add_explicit(&h->lock_seq, 1, memory_order_relaxed);
    return 0;
}

static void give_lock(mb_seg *s, uint64_t me)
{
    uint64_t v = me; /* not ours any more only if it was taken over: leave it then */
    (void)atomic_compare_exchange_strong_explicit(&s->hdr->lock, &v, 0, memory_order_release,
                                                  memory_order_relaxed);
}

int mb_push(mb_seg *s, uint64_t me, uint32_t kind, uint32_t imm, uint64_t arg,
            const void *payload, uint64_t len, char *why, size_t whylen)
{
    if (len > MB_MAX_MSG)
        return -EINVAL;
    int rc = take_lock(s, me, why, whylen);
    if (rc)
        return rc;
    mb_header *h = s->hdr;
    uint64_t cap = s->ring_bytes;
    uint64_t need = sizeof(mb_rec) + align_up((size_t)len, 16);
    uint64_t head = atomic_load_explicit(&h->head, memory_order_acquire);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
    if ((head | tail) & 15u || tail - head > cap) {
        give_lock(s, me);
        uint64_t t = now_ns();
        if (!s->bad_since_ns)
            s->bad_since_ns = t;
        if (t - s->bad_since_ns < MB_REPAIR_NS)
            return -ESTALE;
        snprintf(why, whylen,
                 "its mailbox is corrupt (head %llu, tail %llu: not positions of a %llu-byte "
                 "ring, for %.1f s)", (unsigned long long)head, (unsigned long long)tail,
                 (unsigned long long)cap, (double)(t - s->bad_since_ns) / 1e9);
        return -EBADMSG;
    }
    s->bad_since_ns = 0;
    uint64_t off = tail & (cap - 1);
    uint64_t room_to_end = cap - off;
    uint64_t total = need <= room_to_end ? need : need + room_to_end;
    if (tail - head + total > cap) {
        give_lock(s, me);
        return -EAGAIN;
    }
    if (need > room_to_end) { /* pad to the end, start over at 0 */
        mb_rec pad = {MB_REC_PAD, 0, room_to_end};
        memcpy(s->ring + off, &pad, sizeof pad);
        off = 0;
    }
    mb_rec r = {kind, imm, arg};
    memcpy(s->ring + off, &r, sizeof r);
    if (len)
        memcpy(s->ring + off + sizeof r, payload, len);
    atomic_store_explicit(&h->tail, tail + total, memory_order_release);
    give_lock(s, me);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* The ring: the owner                                                                   */

uint64_t mb_tail(mb_seg *s, char *why, size_t whylen)
{
    uint64_t tail = atomic_load_explicit(&s->hdr->tail, memory_order_acquire);
    if (tail & 15u || tail - s->head > s->ring_bytes) {
        snprintf(why, whylen, "tail %llu is no position of the ring (head %llu)",
                 (unsigned long long)tail, (unsigned long long)s->head);
        return UINT64_MAX;
    }
    return tail;
}

int mb_next(mb_seg *s, uint64_t tail, mb_view *v, char *why, size_t whylen)
{
    uint64_t cap = s->ring_bytes;
    for (bool padded = false;; padded = true) {
        if (s->head == tail)
            return 0;
        uint64_t avail = tail - s->head; /* a multiple of 16, at most cap (mb_tail) */
        uint64_t off = s->head & (cap - 1);
        mb_rec r; /* copied once: the ring may change under us */
        memcpy(&r, s->ring + off, sizeof r);
        if (r.kind == MB_REC_PAD) {
            /* a writer pads only from a record's start to the ring's end, once per lap */
            if (padded || off == 0 || r.arg != cap - off || r.arg > avail) {
                snprintf(why, whylen, "a padding record of %llu bytes at ring offset %llu "
                                      "(%llu bytes published)",
                         (unsigned long long)r.arg, (unsigned long long)off,
                         (unsigned long long)avail);
                return -1;
            }
            s->head += r.arg;
            s->imm_done = 0;
            continue;
        }
        v->kind = r.kind;
        v->imm = r.imm;
        v->arg = r.arg;
        v->payload = NULL;
        v->bytes = sizeof r;
        if (r.kind == MB_REC_IMM) {
            if (r.arg == 0 || r.arg > MB_MAX_ARRIVALS) {
                snprintf(why, whylen, "an immediate record of %llu arrivals",
                         (unsigned long long)r.arg);
                return -1;
            }
            return 1;
        }
        if (r.kind != MB_REC_MSG) {
            snprintf(why, whylen, "a record of unknown kind %u at ring offset %llu", r.kind,
                     (unsigned long long)off);
            return -1;
        }
        uint64_t bytes = r.arg <= MB_MAX_MSG ? sizeof r + align_up((size_t)r.arg, 16) : 0;
        if (!bytes || bytes > avail || bytes > cap - off) {
            snprintf(why, whylen, "a message record of %llu bytes at ring offset %llu (%llu "
                                  "bytes published, %llu to the ring's end)",
                     (unsigned long long)r.arg, (unsigned long long)off,
                     (unsigned long long)avail, (unsigned long long)(cap - off));
            return -1;
        }
        v->payload = s->ring + off + sizeof r;
        v->bytes = bytes;
        return 1;
    }
}

void mb_pop(mb_seg *s, const mb_view *v)
{
    s->head += v->bytes;
    s->imm_done = 0;
}

void mb_publish_head(mb_seg *s)
{
    if (atomic_load_explicit(&s->hdr->head, memory_order_relaxed) != s->head)
        atomic_store_explicit(&s->hdr->head, s->head, memory_order_release);
}

bool mb_repair(mb_seg *s)
{
    mb_header *h = s->hdr;
    bool bad = h->magic != s->kind->magic || h->version != MB_VERSION || h->pid != s->pid ||
               h->token != s->token || h->nexports != MB_EXPORTS ||
               h->ring_bytes != MB_RING_BYTES || h->exports_off != exports_off() ||
               h->ring_off != ring_off() || h->pidns != s->pidns ||
               h->owner_va != (uint64_t)(uintptr_t)h;
    if (bad) {
        h->version = MB_VERSION;
        h->pid = s->pid;
        h->token = s->token;
        h->nexports = MB_EXPORTS;
        h->ring_bytes = MB_RING_BYTES;
        h->exports_off = exports_off();
        h->ring_off = ring_off();
        h->pidns = s->pidns;
        h->owner_va = (uint64_t)(uintptr_t)h;
        atomic_thread_fence(memory_order_release);
        h->magic = s->kind->magic;
    }
    if (atomic_load_explicit(&h->closed, memory_order_relaxed) != 0) {
        atomic_store(&h->closed, 0);
        bad = true;
    }
    return bad;
}

uint64_t mb_reset(mb_seg *s, uint64_t tail)
{
    mb_header *h = s->hdr;
    uint64_t dropped = 0;
    if (tail != UINT64_MAX && !(tail & 15u) && tail - s->head <= s->ring_bytes) {
        dropped = tail - s->head;
        s->head = tail; /* a writer appending now does so after it: kept */
    } else {
        /* a writer holding the lock read this tail (and refuses it) or a valid one from
         * before the damage (its store then wins, over records still ours: consistent) */
        uint64_t t = atomic_load_explicit(&h->tail, memory_order_relaxed);
        if (t & 15u || t - s->head > s->ring_bytes)
            (void)atomic_compare_exchange_strong(&h->tail, &t, s->head);
    }
    s->imm_done = 0;
    atomic_fetch_add_explicit(&h->resets, 1, memory_order_relaxed);
    mb_publish_head(s);
    return dropped;
}
