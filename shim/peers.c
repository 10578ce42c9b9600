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
 * One thread per engine (started with the engine) sleeps in epoll_wait on those pidfds and
 * an eventfd that stops it. When a peer's process is gone it marks the peer down
 * (api.c then refuses every new operation to it before posting, with AFS_EPEER) and hands
 * the worker an AFS_REQ_PEER request: the worker fails every operation in flight to that
 * peer at once and reports a peer-down record (AFS_C_PEER). Resolving a peer reports it up.
 * The worker never waits for this thread, nor this thread for the worker's provider. A
 * provider may fail an operation to a peer before this thread hears of its exit (a SIGKILLed
 * process's sockets close before its pidfd turns readable); the worker then asks /proc
 * itself (worker.c fail_op, procfs.c) and reports the same AFS_EPEER.
 *
 * A peer that is alive but stopped (SIGSTOP) does not progress: with afs_config.peer_stop_ms
 * the thread also reads each watched process's state from /proc (every peer_stop_ms / 4, at
 * least 10 ms apart) and reports one stopped for peer_stop_ms down the same way, until it
 * runs again (then up: operations to it are accepted again). Off by default.
 *
 * The same thread watches the worker itself, once a second: a worker whose loop has not
 * turned for AFS_STUCK_MS while awake is stuck inside its provider (seen: libfabric 1.17
 * shm spinning on the lock of a SIGKILLed peer's shared region, which nothing will ever
 * release). Nothing it holds can complete, so waiting callers would wait forever: the engine
 * is marked stuck (every call then fails with AFS_ESTUCK), the completion fd is made readable
 * and the next drain reports AFS_C_STUCK once (api.c), on which the caller fails everything
 * in flight and closes the engine.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

#define STOP_KEY UINT64_MAX

typedef struct afs_watch {
    uint64_t peer_id;
    int pidfd;
    uint32_t pid;
    uint64_t stopped_since; /* ns, 0: running (peer_stop_ms) */
    bool stopped_down;      /* reported down because stopped */
} afs_watch;

struct afs_live {
    int epfd, stop_fd;
    pthread_t thread;
    bool started;
    pthread_mutex_t lock; /* the watch list: callers add, the thread removes */
    afs_watch *w;
    size_t n, cap;
    uint64_t last_check, seen_beat, seen_since; /* check_worker's, this thread's own */
};

/* The worker learns of a peer going up or down through its queue, like any request. */
static void tell_worker(afs_engine *eng, uint64_t peer_id, int32_t status, uint32_t pid,
                        uint32_t flags)
{
    afs_xfer *x = afs_xfer_new(eng, AFS_REQ_PEER);
    if (!x)
        return; /* out of memory: the down flag still refuses new operations */
    x->peer.peer_id = peer_id;
    x->status = status;
    x->peer.pid = pid;
    x->peer.flags = flags; /* AFS_C_PEER's peer_flags (afs_peer_flags) */
    afs_submit(eng, x);
}

/* Exited: down for good (from running, stopped or silent). Stopped: down until `mark_up`. */
static void mark_down(afs_engine *eng, uint64_t peer_id, uint32_t pid, int32_t why)
{
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    if (p && afs_peer_set_down(p, why))
        tell_worker(eng, peer_id, AFS_EPEER, pid, afs_peer_flags(why, true));
}

static void mark_up(afs_engine *eng, uint64_t peer_id, uint32_t pid)
{
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    if (p && afs_peer_set_up(p, AFS_PEER_STOPPED))
        tell_worker(eng, peer_id, 0, pid, 1u);
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
        if (afs_proc_stat(w->pid, &state, &start) != 0)
            continue; /* exiting: the pidfd says so */
        if (state != 'T' && state != 't') {
            w->stopped_since = 0;
            if (w->stopped_down) {
                w->stopped_down = false;
                mark_up(eng, w->peer_id, w->pid);
            }
        } else if (!w->stopped_since) {
            w->stopped_since = now;
        } else if (!w->stopped_down && now - w->stopped_since >= limit) {
            w->stopped_down = true;
            mark_down(eng, w->peer_id, w->pid, AFS_PEER_STOPPED);
        }
    }
    pthread_mutex_unlock(&l->lock);
}

/* The provider's part in a peer's exit (afp_ops.peer_exited): e.g. libfabric 1.17's shm
 * lets go of a lock the dead process held, on which the worker may be spinning. */
static void tell_provider(afs_engine *eng, uint64_t peer_id, uint32_t pid)
{
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    if (!p)
        return;
    for (uint32_t k = 0; k < eng->nnics; k++)
        if ((p->tp_mask & (1u << eng->nics[k].tp)) && AFP_HAS_OP(eng->nics[k].ops, peer_exited))
            eng->nics[k].ops->peer_exited(eng->nics[k].dom, p->addr + p->nic_off[k],
                                          p->nic_len[k], pid);
}

#define WORKER_CHECK_MS 1000

/* Whether a watched peer's process is stopped (SIGSTOP, a tracer): a worker waiting on what
 * that process holds (1.17 shm: its region's lock) comes back when it runs again, so it is
 * not declared stuck meanwhile (Engine(peer_stop_timeout=) reports such a peer down). */
static bool a_peer_is_stopped(afs_live *l)
{
    bool stopped = false;
    pthread_mutex_lock(&l->lock);
    for (size_t k = 0; k < l->n && !stopped; k++) {
        char state = 'R';
        uint64_t start;
        stopped = afs_proc_stat(l->w[k].pid, &state, &start) == 0 && (state == 'T' || state == 't');
    }
    pthread_mutex_unlock(&l->lock);
    return stopped;
}

/* Marks the engine stuck when its worker has been awake in one turn of its loop for
 * AFS_STUCK_MS (see the top of this file), as this thread saw it: checks at most 2 s apart
 * all along, so that a process that was itself stopped (SIGSTOP, a debugger, a frozen VM)
 * is not taken for a stuck worker when it runs again. */
static void check_worker(afs_engine *eng, afs_live *l, uint64_t now)
{
    uint64_t beat = atomic_load(&eng->beat_ns);
    bool gap = now - l->last_check > 2 * WORKER_CHECK_MS * 1000000ull;
    l->last_check = now;
    if (atomic_load(&eng->stuck))
        return;
    if (gap || !beat || beat != l->seen_beat || atomic_load(&eng->worker_sleeping)) {
        l->seen_beat = beat; /* the loop turned (or we cannot tell): watch from now */
        l->seen_since = now;
        return;
    }
    if (now - l->seen_since < (uint64_t)AFS_STUCK_MS * 1000000ull || a_peer_is_stopped(l))
        return;
    bool shm = strncmp(eng->provider_full, "shm", 3) == 0;
    snprintf(eng->stuck_text, sizeof(eng->stuck_text),
             "the engine's worker has been inside provider %s for %.1f s and will not come "
             "back%s; nothing in flight will complete: close this engine",
             eng->provider_full, (double)(now - beat) / 1e9,
             shm ? " (libfabric 1.17 shm: a same-host peer died holding its shared region's lock)"
                 : "");
    atomic_store_explicit(&eng->stuck, 1, memory_order_release);
    uint64_t one = 1;
    ssize_t w = write(eng->ring.event_fd, &one, sizeof(one)); /* the caller drains, sees it */
    (void)w; /* EAGAIN: the counter is huge, the fd readable anyway */
}

static void *live_main(void *arg)
{
    afs_engine *eng = arg;
    afs_live *l = eng->live;
    struct epoll_event ev[16];
    /* with peer_stop_ms, states are read 4 times per period (at most every 10 ms) */
    uint32_t tick_ms = eng->cfg.peer_stop_ms / 4 < 10 ? 10 : eng->cfg.peer_stop_ms / 4;
    uint64_t next_tick = 0, next_check = 0;
    for (;;) {
        uint64_t now = afs_now_ns();
        if (now >= next_check) {
            check_worker(eng, l, now);
            next_check = now + WORKER_CHECK_MS * 1000000ull;
        }
        uint64_t until = next_check;
        if (eng->cfg.peer_stop_ms) {
            if (now >= next_tick) {
                check_stopped(eng, l, now);
                next_tick = now + (uint64_t)tick_ms * 1000000ull;
            }
            until = next_tick < until ? next_tick : until;
        }
        int timeout = (int)((until - now + 999999ull) / 1000000ull);
        int n = epoll_wait(l->epfd, ev, 16, timeout);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return NULL;
        bool stop = false; /* after the exits that came with it: the provider hears of them */
        for (int i = 0; i < n; i++) {
            uint64_t key = ev[i].data.u64;
            if (key == STOP_KEY) {
                stop = true;
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
            if (pid) {
                tell_provider(eng, key, pid);
                mark_down(eng, key, pid, AFS_PEER_EXITED);
            }
        }
        if (stop)
            return NULL;
    }
}

int afs_live_start(afs_engine *eng)
{
    afs_live *l = calloc(1, sizeof(*l));
    if (!l)
        return AFS_ENOMEM;
    l->epfd = epoll_create1(EPOLL_CLOEXEC);
    l->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event e = {.events = EPOLLIN, .data.u64 = STOP_KEY};
    if (l->epfd < 0 || l->stop_fd < 0 || epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->stop_fd, &e) != 0 ||
        pthread_mutex_init(&l->lock, NULL) != 0)
        goto out_fail;
    eng->live = l;
    if (pthread_create(&l->thread, NULL, live_main, eng) != 0) {
        eng->live = NULL;
        pthread_mutex_destroy(&l->lock);
        goto out_fail;
    }
    l->started = true;
    return 0;

out_fail:
    if (l->stop_fd >= 0)
        close(l->stop_fd);
    if (l->epfd >= 0)
        close(l->epfd);
    free(l);
    return AFS_EIO;
}

/* Starts watching a same-host peer's process: 1 watched, 0 not (another host, unknown,
 * this process, or no pidfd to be had), -1 its process is already gone. */
static int watch(afs_engine *eng, uint64_t peer_id, const afs_proc_id *who)
{
    afs_proc_id me;
    if (!who->host || !who->pid || afs_proc_self(&me) != 0 || me.host != who->host)
        return 0;
    if (me.pid == who->pid) { /* this process: the provider sees it close (keepalive.c) */
        afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
        if (p)
            atomic_fetch_or(&p->ka, AFS_KA_SAME_PROCESS);
        return 0;
    }
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)who->pid, 0);
    if (pidfd < 0)
        return errno == ESRCH ? -1 : 0; /* ENOSYS (kernel < 5.3), EMFILE: unwatched */
    if (afs_proc_start(who->pid) != who->start) { /* gone, and the pid given to another */
        close(pidfd);
        return -1;
    }
    if (!eng->live && afs_live_start(eng) != 0) {
        close(pidfd);
        return 0;
    }
    afs_live *l = eng->live;
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
    afs_peer_entry *p = afs_slots_lookup(&eng->peers, peer_id);
    if (p) /* its down/up records say so whoever sends them (keepalive.c's findings too) */
        atomic_fetch_or(&p->ka, AFS_KA_WATCHED);
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
        mark_down(eng, peer_id, who->pid, AFS_PEER_EXITED);
}

void afs_live_stop(afs_engine *eng)
{
    afs_live *l = eng->live;
    if (!l || !l->started)
        return;
    uint64_t one = 1;
    ssize_t w = write(l->stop_fd, &one, sizeof(one));
    (void)w;
    pthread_join(l->thread, NULL);
    l->started = false;
}

void afs_live_sweep(afs_engine *eng)
{
    afs_live *l = eng->live;
    if (!l || l->started)
        return; /* the thread does it */
    for (size_t k = 0; k < l->n;) {
        struct pollfd pfd = {.fd = l->w[k].pidfd, .events = POLLIN};
        if (poll(&pfd, 1, 0) != 1) {
            k++;
            continue;
        }
        tell_provider(eng, l->w[k].peer_id, l->w[k].pid);
        close(l->w[k].pidfd);
        l->w[k] = l->w[--l->n];
    }
}

void afs_live_destroy(afs_engine *eng)
{
    afs_live *l = eng->live;
    if (!l)
        return;
    afs_live_stop(eng);
    for (size_t k = 0; k < l->n; k++)
        close(l->w[k].pidfd);
    free(l->w);
    pthread_mutex_destroy(&l->lock);
    close(l->stop_fd);
    close(l->epfd);
    free(l);
    eng->live = NULL;
}
