/* The shared-memory segment of a node-local domain (nvlink, cma): see node_seg.h. */
#include "node_seg.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MB_DIR "/dev/shm/"
/* "<pid><tag><token>", the tag ":afabric-nvl-" (mb_kind): the "<pid>:" convention of
 * libfabric's shm files, so tools (and the test suite's leak check) tell a live process's
 * files from a dead one's */

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

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
    pthread_mutexattr_t ma;
    bool ma_init = false;
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
    if (pthread_mutexattr_init(&ma) != 0) {
        snprintf(err, errlen, "pthread_mutexattr_init failed");
        goto out_fail;
    }
    ma_init = true;
    if (pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED) != 0 ||
        pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST) != 0 ||
        pthread_mutex_init(&h->lock, &ma) != 0) {
        snprintf(err, errlen, "cannot make a process-shared robust mutex");
        goto out_fail;
    }
    pthread_mutexattr_destroy(&ma);
    h->version = MB_VERSION;
    h->pid = (int32_t)getpid();
    h->token = token;
    h->nexports = MB_EXPORTS;
    h->ring_bytes = MB_RING_BYTES;
    h->exports_off = exports_off();
    h->ring_off = ring_off();
    h->pidns = mb_pidns();
    atomic_store(&h->tail_pub, 0);
    atomic_thread_fence(memory_order_release);
    h->magic = k->magic; /* last: a peer attaching early sees no magic and retries/fails */
    return 0;
out_fail:
    if (ma_init)
        pthread_mutexattr_destroy(&ma);
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
    mb_header *h = s->hdr;
    if (h->magic != k->magic || h->version != MB_VERSION || h->token != token ||
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
        atomic_store(&s->hdr->closed, 1);
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
    s->fd = -1;
    if (owner)
        s->name[0] = '\0';
}

bool mb_alive(mb_seg *s)
{
    if (!s->hdr || atomic_load_explicit(&s->hdr->closed, memory_order_acquire))
        return false;
    if (flock(s->fd, LOCK_SH | LOCK_NB) == 0) { /* nobody holds it exclusively: owner gone */
        (void)flock(s->fd, LOCK_UN);
        return false;
    }
    return errno == EWOULDBLOCK || errno == EINTR;
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

static void lock_ring(mb_header *h)
{
    int rc = pthread_mutex_lock(&h->lock);
    if (rc == EOWNERDEAD) /* a writer died holding it: records are published whole, so the
                             ring is consistent (tail moves only after a full record) */
        pthread_mutex_consistent(&h->lock);
}

void mb_lock(mb_header *h) { lock_ring(h); }
void mb_unlock(mb_header *h) { pthread_mutex_unlock(&h->lock); }

static uint8_t *ring(mb_header *h) { return (uint8_t *)h + h->ring_off; }

int mb_push(mb_header *h, uint32_t kind, uint32_t imm, uint64_t arg, const void *payload,
            uint64_t len)
{
    if (len > MB_MAX_MSG)
        return -EINVAL;
    uint64_t need = sizeof(mb_rec) + align_up((size_t)len, 16);
    lock_ring(h);
    uint64_t cap = h->ring_bytes;
    uint64_t off = h->tail % cap;
    uint64_t room_to_end = cap - off;
    uint64_t total = need <= room_to_end ? need : need + room_to_end;
    if (h->tail - h->head + total > cap) {
        pthread_mutex_unlock(&h->lock);
        return -EAGAIN;
    }
    if (need > room_to_end) { /* pad to the end, start over at 0 */
        mb_rec *pad = (mb_rec *)(ring(h) + off);
        pad->kind = MB_REC_PAD;
        pad->arg = room_to_end;
        h->tail += room_to_end;
        off = 0;
    }
    mb_rec *r = (mb_rec *)(ring(h) + off);
    r->kind = kind;
    r->imm = imm;
    r->arg = arg;
    if (len)
        memcpy(r + 1, payload, len);
    h->tail += need;
    atomic_store_explicit(&h->tail_pub, h->tail, memory_order_release);
    pthread_mutex_unlock(&h->lock);
    return 0;
}

mb_rec *mb_peek(mb_header *h)
{
    while (h->head != h->tail) {
        mb_rec *r = (mb_rec *)(ring(h) + h->head % h->ring_bytes);
        if (r->kind != MB_REC_PAD)
            return r;
        h->head += r->arg;
    }
    return NULL;
}

void mb_pop(mb_header *h)
{
    mb_rec *r = (mb_rec *)(ring(h) + h->head % h->ring_bytes);
    uint64_t len = r->kind == MB_REC_MSG ? r->arg : 0;
    h->head += sizeof(mb_rec) + align_up((size_t)len, 16);
}
