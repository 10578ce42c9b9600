/*
 * libfabric 1.17's shm has no wait object, and moves a write only when its target's
 * progress runs (the answer a delivery-complete write waits for). So an idle afabric
 * engine on shm woke every millisecond to progress (1,000 wake-ups a second, 1.5-4.5% of a
 * core), and a write to it waited for the next of those wake-ups. Here, as the node-local
 * providers do (providers/common/node_seg.h): beside each endpoint's region a small file
 * holds a `sleeping` word; a worker with nothing in flight and an empty command queue sets
 * it and sleeps on an abstract datagram socket (the domain's wait fd); a writer that posted
 * to it and then sees the word set sends one datagram. Dekker: the sleeper sets the word,
 * then looks at its queue; the writer enqueues (inside libfabric), then looks at the word.
 * A peer without wake-ups (another libfabric program) still gets its writes progressed,
 * only later: the shim's sleep on a wait fd lasts at most 20 ms.
 */
#include "ofi_wake.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define WAKE_MAGIC 0x6166616272696377ull /* "afabricw" */
#define WAKE_BYTES 4096u
#define WAKE_FILE_SUFFIX ":wake"
#define WAKE_SOCK_PREFIX "afabric-ofiw-"
#define SHM_DIR "/dev/shm/"

/* The abstract socket name of the endpoint whose region is `region_path`. */
static int sock_name(const char *region_path, struct sockaddr_un *sa, socklen_t *len)
{
    size_t dir = strlen(SHM_DIR);
    if (strncmp(region_path, SHM_DIR, dir) != 0)
        return -1;
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "%s%s", WAKE_SOCK_PREFIX,
                     region_path + dir);
    if (n < 0 || (size_t)n >= sizeof sa->sun_path - 1)
        return -1;
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
    return 0;
}

static char *file_name(const char *region_path)
{
    size_t n = strlen(region_path) + sizeof WAKE_FILE_SUFFIX;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s%s", region_path, WAKE_FILE_SUFFIX);
    return p;
}

int ofi_wake_open(ofi_wake *w, const char *region_path)
{
    memset(w, 0, sizeof *w);
    w->fd = w->send_fd = -1;
    struct sockaddr_un sa;
    socklen_t sl;
    if (!region_path || sock_name(region_path, &sa, &sl) != 0)
        return -1;
    w->path = file_name(region_path);
    if (!w->path)
        return -1;
    int fd = open(w->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        goto fail;
    void *m = MAP_FAILED;
    if (ftruncate(fd, WAKE_BYTES) == 0)
        m = mmap(NULL, WAKE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    (void)close(fd);
    if (m == MAP_FAILED) {
        (void)unlink(w->path);
        goto fail;
    }
    w->hdr = m;
    atomic_init(&w->hdr->sleeping, 0);
    w->hdr->pid = (uint32_t)getpid();
    w->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    w->send_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (w->fd < 0 || w->send_fd < 0 || bind(w->fd, (struct sockaddr *)&sa, sl) != 0) {
        ofi_wake_close(w);
        return -1;
    }
    atomic_thread_fence(memory_order_release);
    w->hdr->magic = WAKE_MAGIC; /* last: a peer that sees it sees a bound socket */
    return 0;
fail:
    free(w->path);
    w->path = NULL;
    return -1;
}

void ofi_wake_close(ofi_wake *w)
{
    if (w->hdr) {
        atomic_store(&w->hdr->sleeping, 0);
        (void)munmap(w->hdr, WAKE_BYTES);
        w->hdr = NULL;
    }
    if (w->path) {
        (void)unlink(w->path);
        free(w->path);
        w->path = NULL;
    }
    if (w->fd >= 0)
        (void)close(w->fd);
    if (w->send_fd >= 0)
        (void)close(w->send_fd);
    w->fd = w->send_fd = -1;
}

void ofi_wake_sleepy(ofi_wake *w)
{
    atomic_store(&w->hdr->sleeping, 1);
    atomic_thread_fence(memory_order_seq_cst);
}

void ofi_wake_awake(ofi_wake *w)
{
    if (!atomic_load_explicit(&w->hdr->sleeping, memory_order_relaxed))
        return;
    atomic_store(&w->hdr->sleeping, 0);
    char junk[64];
    while (recv(w->fd, junk, sizeof junk, MSG_DONTWAIT) > 0) {
    }
}

void ofi_wake_peer_open(ofi_wake_peer *p, const char *region_path)
{
    if (p->tried)
        return;
    p->tried = true;
    if (!region_path || sock_name(region_path, &p->sa, &p->sa_len) != 0)
        return;
    char *path = file_name(region_path);
    if (!path)
        return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    free(path);
    if (fd < 0)
        return; /* no wake-ups there: another libfabric program, or an older afabric */
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size == (off_t)WAKE_BYTES)
        m = mmap(NULL, WAKE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    (void)close(fd);
    if (m == MAP_FAILED)
        return;
    ofi_wake_hdr *h = m;
    atomic_thread_fence(memory_order_acquire);
    if (h->magic != WAKE_MAGIC) {
        (void)munmap(m, WAKE_BYTES);
        return;
    }
    p->hdr = h;
}

bool ofi_wake_sleeps(const ofi_wake_peer *p)
{
    if (!p->hdr)
        return false;
    atomic_thread_fence(memory_order_seq_cst); /* our post, then its word */
    return atomic_load_explicit(&p->hdr->sleeping, memory_order_relaxed) != 0;
}

void ofi_wake_kick(const ofi_wake *w, const ofi_wake_peer *p)
{
    if (!p->hdr || w->send_fd < 0)
        return;
    char one = 1;
    (void)sendto(w->send_fd, &one, 1, MSG_DONTWAIT, (const struct sockaddr *)&p->sa, p->sa_len);
}

void ofi_wake_peer_close(ofi_wake_peer *p)
{
    if (p->hdr)
        (void)munmap(p->hdr, WAKE_BYTES);
    memset(p, 0, sizeof *p);
}
