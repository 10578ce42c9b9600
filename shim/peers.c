/*
 * Peer liveness: which process owns an engine, and watching the processes of same-host peers.
 *
 * A "peer" is an engine this one resolved (an Address it was given, or the owner of a
 * descriptor it imported): one entry in eng->peers, so the state here is bounded by that
 * table (one pidfd and one record per resolved same-host peer, freed when it goes down).
 *
 * Every address carries its owner's process: a host id (the kernel's boot id and the pid
 * namespace, hashed), its pid and its start time (codec.c, the "L" block). A peer whose host
 * id is ours lives on this host: its process is watched with a pidfd (pidfd_open, Linux
 * 5.3), which becomes readable the moment the process exits, whatever killed it (SIGKILL,
 * a crash, a clean exit). The start time guards against a reused pid: the pidfd is taken
 * first, then /proc/<pid>/stat is read and must show the same start time (a pidfd pins its
 * process, so a match means it is the right one).
 *
 * One thread per engine (started with the first watched peer) sleeps in epoll_wait on those
 * pidfds and an eventfd that stops it. When a peer's process is gone it marks the peer down
 * (api.c then refuses every new operation to it before posting, with AFS_EPEER) and hands
 * the worker an AFS_REQ_PEER request: the worker fails every operation in flight to that
 * peer at once and reports a peer-down record (AFS_C_PEER). Resolving a peer reports it up.
 * The worker never waits for this thread, nor this thread for the worker's provider.
 *
 * A peer that is alive but stopped (SIGSTOP) does not progress: with afs_config.peer_stop_ms
 * the thread also reads each watched process's state from /proc (every peer_stop_ms / 4, at
 * least 10 ms apart) and reports one stopped for peer_stop_ms down the same way, until it
 * runs again (then up: operations to it are accepted again). Off by default.
 *
 * The same thread resolves the engines that said hello to this one (keepalive.c: a peer that
 * resolved us, from an address we have not resolved), so that a goodbye reaches them when
 * this engine closes: the worker hands their addresses over (it cannot resolve them itself,
 * a resolution is a request to the worker), at most LEARN_QUEUE at a time and LEARN_MAX in
 * all (a flood of hellos from made-up addresses costs a bounded table). Such a peer is an
 * ordinary resolved peer from then on (reported up, watched when on this host).
 *
 * The thread starts with the first peer watched or learned (any thread may be first: the
 * pointer is swapped in, and a loser of that race stops its own).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

#define STOP_KEY UINT64_MAX
#define LEARN_KEY (UINT64_MAX - 1)
#define LEARN_QUEUE 64u  /* addresses waiting to be resolved */
#define LEARN_MAX 4096u  /* addresses resolved because they said hello, per engine */

typedef struct afs_learn {
    struct afs_learn *next;
    uint32_t len;
    uint8_t blob[];
} afs_learn;

typedef struct afs_watch {
    uint64_t peer_id;
    int pidfd;
    uint32_t pid;
    uint64_t stopped_since; /* ns, 0: running (peer_stop_ms) */
    bool stopped_down;      /* reported down because stopped */
} afs_watch;

struct afs_live {
    afs_engine *eng;
    int epfd, stop_fd, learn_fd;
    pthread_t thread;
    pthread_mutex_t lock; /* the watch list (callers add, the thread removes); the learn queue */
    afs_watch *w;
    size_t n, cap;
    afs_learn *learn; /* addresses to resolve (worker adds, the thread takes) */
    uint32_t learn_n, learned;
};

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* State (field 3) and start time (field 22) of `pid` from /proc/<pid>/stat; 0 if unreadable. */
static int proc_stat(uint32_t pid, char *state, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return AFS_EIO;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return AFS_EIO;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    unsigned long long st = 0;
    /* after ")": state(3) ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
     * utime stime cutime cstime priority nice threads itrealvalue starttime(22) */
    if (!p || sscanf(p + 1, " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d "
                            "%*d %*d %*d %llu", state, &st) != 2)
        return AFS_EIO;
    *start = st;
    return 0;
}

/* Start time of `pid`, or 0 if it cannot be read. */
static uint64_t proc_start(uint32_t pid)
{
    char state;
    uint64_t start = 0;
    return proc_stat(pid, &state, &start) == 0 ? start : 0;
}

int afs_proc_self(afs_proc_id *out)
{
    memset(out, 0, sizeof(*out));
    char boot[64] = {0};
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return AFS_EIO;
    ssize_t n = read(fd, boot, sizeof(boot) - 1);
    close(fd);
    struct stat ns;
    if (n <= 0 || stat("/proc/self/ns/pid", &ns) != 0)
        return AFS_EIO;
    uint64_t h = fnv1a(0xcbf29ce484222325ull, boot, (size_t)n);
    uint64_t dev = (uint64_t)ns.st_dev, ino = (uint64_t)ns.st_ino;
    h = fnv1a(h, &dev, sizeof(dev));
    h = fnv1a(h, &ino, sizeof(ino));
    out->pid = (uint32_t)getpid();
    out->start = proc_start(out->pid);
    out->host = out->start ? h | 1u : 0; /* never 0 when known */
    return out->host ? 0 : AFS_EIO;
}

/* AFS_C_PEER's peer_flags for a peer down for `why` (0: up). */
static uint32_t flags_of(int32_t why, bool watched)
{
    uint32_t f = watched ? 1u : 0u;
    if (why == AFS_PEER_STOPPED)
        f |= 2u;
    else if (why == AFS_PEER_CLOSED)
        f |= 4u;
    else if (why == AFS_PEER_SILENT)
        f |= 8u;
    return f;
}

int32_t afs_peer_flags_why(uint32_t peer_flags)
{
    if (peer_flags & 2u)
        return AFS_PEER_STOPPED;
    if (peer_flags & 4u)
        return AFS_PEER_CLOSED;
    if (peer_flags & 8u)
        return AFS_PEER_SILENT;
    return AFS_PEER_EXITED;
}

const char *afs_peer_down_text(int32_t why)
{
    switch (why) {
    case AFS_PEER_STOPPED:
        return "its process is stopped";
    case AFS_PEER_CLOSED:
        return "its engine was closed (it said goodbye)";
    case AFS_PEER_SILENT:
        return "it is silent (heartbeats unanswered)";
    default:
        return "its process has exited";
    }
}

/* The worker learns of a peer going up or down through its queue, like any request. */
static void tell_worker(afs_engine *eng, uint64_t peer_id, int32_t status, uint32_t pid,
                        uint32_t flags)
{
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_PEER);
    if (!x)
        return; /* out of memory: the down flag still refuses new operations */
    x->target_id = peer_id;
    x->status = status;
    x->count = pid;
    x->imm = flags; /* AFS_C_PEER's peer_flags */
    afs_submit(eng, x);
}

/* Exited, closed: down for good (from any state but those). Stopped: down until it runs
 * again. Silent: from running only (a stopped one is reported so already), until it answers. */
static void mark_down(afs_engine *eng, uint64_t peer_id, uint32_t pid, int32_t why, bool watched)
{
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    if (!p)
        return;
    int32_t was = atomic_load(&p->down);
    while (was != AFS_PEER_EXITED && was != AFS_PEER_CLOSED && was != why &&
           (why != AFS_PEER_SILENT || was == 0)) {
        if (atomic_compare_exchange_weak(&p->down, &was, why)) {
            tell_worker(eng, peer_id, AFS_EPEER, pid, flags_of(why, watched));
            return;
        }
    }
}

static void mark_up(afs_engine *eng, uint64_t peer_id, uint32_t pid, int32_t from, bool watched)
{
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    int32_t was = from;
    if (p && atomic_compare_exchange_strong(&p->down, &was, 0))
        tell_worker(eng, peer_id, 0, pid, flags_of(0, watched));
}

/* The pid a peer's address names (0: unknown), and whether its process is watched. */
static uint32_t who_is(afs_engine *eng, uint64_t peer_id, bool *watched)
{
    *watched = false;
    afs_live *l = atomic_load(&eng->live);
    if (l) {
        pthread_mutex_lock(&l->lock);
        for (size_t k = 0; k < l->n && !*watched; k++)
            *watched = l->w[k].peer_id == peer_id;
        pthread_mutex_unlock(&l->lock);
    }
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    afs_addr_view v;
    if (!p || afs_addr_parse(p->addr, p->addr_len, &v) != 0)
        return 0;
    return v.proc.pid;
}

void afs_peer_down(afs_engine *eng, uint64_t peer_id, int32_t why)
{
    bool watched;
    uint32_t pid = who_is(eng, peer_id, &watched);
    mark_down(eng, peer_id, pid, why, watched);
}

void afs_peer_up(afs_engine *eng, uint64_t peer_id, int32_t from)
{
    bool watched;
    uint32_t pid = who_is(eng, peer_id, &watched);
    mark_up(eng, peer_id, pid, from, watched);
}

/* peer_stop_ms: every watched peer's state, read from /proc. One stopped (T: SIGSTOP, or t:
 * stopped by a tracer) for that long is down until it runs again. */
static void check_stopped(afs_engine *eng, afs_live *l, uint64_t now)
{
    uint64_t limit = (uint64_t)eng->cfg.peer_stop_ms * 1000000ull;
    pthread_mutex_lock(&l->lock);
    for (size_t k = 0; k < l->n; k++) {
        afs_watch *w = &l->w[k];
        char state = 'R';
        uint64_t start;
        if (proc_stat(w->pid, &state, &start) != 0)
            continue; /* exiting: the pidfd says so */
        if (state != 'T' && state != 't') {
            w->stopped_since = 0;
            if (w->stopped_down) {
                w->stopped_down = false;
                mark_up(eng, w->peer_id, w->pid, AFS_PEER_STOPPED, true);
            }
        } else if (!w->stopped_since) {
            w->stopped_since = now;
        } else if (!w->stopped_down && now - w->stopped_since >= limit) {
            w->stopped_down = true;
            mark_down(eng, w->peer_id, w->pid, AFS_PEER_STOPPED, true);
        }
    }
    pthread_mutex_unlock(&l->lock);
}

/* Resolves the addresses the worker handed over (keepalive.c: engines that said hello). */
static void learn_all(afs_engine *eng, afs_live *l)
{
    uint64_t junk;
    ssize_t r = read(l->learn_fd, &junk, sizeof(junk));
    (void)r; /* EAGAIN: already drained; the queue says what there is */
    pthread_mutex_lock(&l->lock);
    afs_learn *q = l->learn;
    l->learn = NULL;
    l->learn_n = 0;
    pthread_mutex_unlock(&l->lock);
    while (q) {
        afs_learn *next = q->next;
        afs_addr_view v;
        uint64_t id;
        /* a bad, foreign, restarted or unlisted address is just not learned */
        if (afs_addr_parse(q->blob, q->len, &v) == 0 &&
            afs_allow_check_addr(eng, &v, q->blob, q->len) == 0 &&
            afs_find_or_resolve_peer(eng, &v, q->blob, q->len, &id) == 0) {
            afs_peer_entry *p = afs_slots_lookup(&eng->peers, id);
            if (p && !(atomic_fetch_or(&p->ka, AFS_KA_KNOWS_US) & AFS_KA_KNOWS_US)) {
                pthread_mutex_lock(&l->lock);
                l->learned++;
                pthread_mutex_unlock(&l->lock);
            }
        }
        afs_clear_error();
        free(q);
        q = next;
    }
}

static void *live_main(void *arg)
{
    afs_live *l = arg;
    afs_engine *eng = l->eng;
    struct epoll_event ev[16];
    /* with peer_stop_ms, states are read 4 times per period (at most every 10 ms) */
    uint32_t tick_ms = eng->cfg.peer_stop_ms / 4 < 10 ? 10 : eng->cfg.peer_stop_ms / 4;
    uint64_t next_tick = 0;
    for (;;) {
        int timeout = -1;
        if (eng->cfg.peer_stop_ms) {
            uint64_t now = afs_now_ns();
            if (now >= next_tick) {
                check_stopped(eng, l, now);
                next_tick = now + (uint64_t)tick_ms * 1000000ull;
            }
            timeout = (int)((next_tick - now + 999999ull) / 1000000ull);
        }
        int n = epoll_wait(l->epfd, ev, 16, timeout);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return NULL;
        for (int i = 0; i < n; i++) {
            uint64_t key = ev[i].data.u64;
            if (key == STOP_KEY)
                return NULL;
            if (key == LEARN_KEY) {
                learn_all(eng, l);
                continue;
            }
            uint32_t pid = 0;
            pthread_mutex_lock(&l->lock);
            for (size_t k = 0; k < l->n; k++) {
                if (l->w[k].peer_id != key)
                    continue;
                pid = l->w[k].pid;
                (void)epoll_ctl(l->epfd, EPOLL_CTL_DEL, l->w[k].pidfd, NULL);
                close(l->w[k].pidfd);
                l->w[k] = l->w[--l->n];
                break;
            }
            pthread_mutex_unlock(&l->lock);
            if (pid)
                mark_down(eng, key, pid, AFS_PEER_EXITED, true);
        }
    }
}

static void live_free(afs_live *l)
{
    while (l->learn) {
        afs_learn *next = l->learn->next;
        free(l->learn);
        l->learn = next;
    }
    for (size_t k = 0; k < l->n; k++)
        close(l->w[k].pidfd);
    free(l->w);
    pthread_mutex_destroy(&l->lock);
    close(l->learn_fd);
    close(l->stop_fd);
    close(l->epfd);
    free(l);
}

static void live_stop(afs_live *l)
{
    uint64_t one = 1;
    ssize_t w = write(l->stop_fd, &one, sizeof(one));
    (void)w;
    pthread_join(l->thread, NULL);
    live_free(l);
}

static int live_start(afs_engine *eng, afs_live **out)
{
    afs_live *l = calloc(1, sizeof(*l));
    if (!l)
        return AFS_ENOMEM;
    l->eng = eng;
    l->epfd = epoll_create1(EPOLL_CLOEXEC);
    l->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    l->learn_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event e = {.events = EPOLLIN, .data.u64 = STOP_KEY};
    struct epoll_event le = {.events = EPOLLIN, .data.u64 = LEARN_KEY};
    if (l->epfd < 0 || l->stop_fd < 0 || l->learn_fd < 0 ||
        epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->stop_fd, &e) != 0 ||
        epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->learn_fd, &le) != 0)
        goto out_fds;
    if (pthread_mutex_init(&l->lock, NULL) != 0)
        goto out_fds;
    if (pthread_create(&l->thread, NULL, live_main, l) != 0)
        goto out_mutex;
    *out = l;
    return 0;

out_mutex:
    pthread_mutex_destroy(&l->lock);
out_fds:
    if (l->learn_fd >= 0)
        close(l->learn_fd);
    if (l->stop_fd >= 0)
        close(l->stop_fd);
    if (l->epfd >= 0)
        close(l->epfd);
    free(l);
    return AFS_EIO;
}

/* The engine's peers thread, started by whoever needs it first (callers under peer_lock,
 * or the worker): NULL if it cannot be started. */
static afs_live *live_get(afs_engine *eng)
{
    afs_live *l = atomic_load(&eng->live), *mine = NULL;
    if (l || atomic_load(&eng->closed) || live_start(eng, &mine) != 0)
        return l;
    if (atomic_compare_exchange_strong(&eng->live, &l, mine))
        return mine;
    live_stop(mine); /* another thread was first: l is its thread */
    return l;
}

void afs_live_learn(afs_engine *eng, const uint8_t *blob, uint32_t len)
{
    afs_live *l = live_get(eng);
    afs_learn *q = l ? malloc(sizeof(*q) + len) : NULL;
    if (!q)
        return;
    q->len = len;
    memcpy(q->blob, blob, len);
    bool queued = false;
    pthread_mutex_lock(&l->lock);
    bool dup = false;
    for (afs_learn *o = l->learn; o && !dup; o = o->next) /* hellos until it is resolved */
        dup = o->len == len && memcmp(o->blob, blob, len) == 0;
    if (!dup && l->learn_n < LEARN_QUEUE && l->learned + l->learn_n < LEARN_MAX) {
        q->next = l->learn;
        l->learn = q;
        l->learn_n++;
        queued = true;
    }
    pthread_mutex_unlock(&l->lock);
    if (!queued) {
        free(q);
        return;
    }
    uint64_t one = 1;
    ssize_t w = write(l->learn_fd, &one, sizeof(one));
    (void)w; /* EAGAIN: the counter is saturated, the fd readable anyway */
}

/* Starts watching a same-host peer's process: 1 watched, 0 not (another host, unknown,
 * this process, or no pidfd to be had), -1 its process is already gone. */
static int watch(afs_engine *eng, uint64_t peer_id, const afs_proc_id *who)
{
    afs_proc_id me;
    if (!who->host || !who->pid || afs_proc_self(&me) != 0 || me.host != who->host ||
        me.pid == who->pid)
        return 0;
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)who->pid, 0);
    if (pidfd < 0)
        return errno == ESRCH ? -1 : 0; /* ENOSYS (kernel < 5.3), EMFILE: unwatched */
    if (proc_start(who->pid) != who->start) { /* gone, and the pid given to another */
        close(pidfd);
        return -1;
    }
    afs_live *l = live_get(eng);
    if (!l) {
        close(pidfd);
        return 0;
    }
    int rc = 1;
    pthread_mutex_lock(&l->lock);
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        afs_watch *w = realloc(l->w, cap * sizeof(*w));
        if (!w) {
            rc = 0;
            goto out_unlock;
        }
        l->w = w;
        l->cap = cap;
    }
    struct epoll_event e = {.events = EPOLLIN, .data.u64 = peer_id};
    if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, pidfd, &e) != 0) {
        rc = 0;
        goto out_unlock;
    }
    l->w[l->n++] = (afs_watch){peer_id, pidfd, who->pid, 0, false};
out_unlock:
    pthread_mutex_unlock(&l->lock);
    if (rc != 1)
        close(pidfd);
    return rc;
}

/* Called once per newly resolved peer (under eng->peer_lock): reports it up and, when it
 * lives on this host, watches its process; one already gone is reported down at once. */
void afs_live_watch(afs_engine *eng, uint64_t peer_id, const afs_proc_id *who)
{
    int w = watch(eng, peer_id, who);
    tell_worker(eng, peer_id, 0, who->pid, w != 0 ? 1u : 0u);
    if (w < 0)
        mark_down(eng, peer_id, who->pid, AFS_PEER_EXITED, false);
}

void afs_live_destroy(afs_engine *eng)
{
    afs_live *l = atomic_exchange(&eng->live, NULL);
    if (l)
        live_stop(l);
}
