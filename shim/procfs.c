/*
 * What /proc says of a process: who this one is (afs_proc_self, carried in every address),
 * and, for a peer's process named by its pid and start time, its state and whether it is
 * gone or on its way out.
 *
 * peers.c watches same-host peers with pidfds; the worker asks afs_proc_gone when an
 * operation to one of them fails before that watch has spoken: a SIGKILLed process's
 * sockets are closed inside its exit (exit_files), before it becomes a zombie and its pidfd
 * readable, so tcp;ofi_rxm can fail what was in flight to it (ECANCELED) first. By then the
 * kernel has set PF_EXITING on it, which /proc/<pid>/stat shows (field 9).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define PROC_PF_EXITING 0x4u /* include/linux/sched.h: getting shut down */

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* State (field 3), flags (field 9) and start time (field 22) of `pid`. */
static int proc_fields(uint32_t pid, char *state, uint64_t *flags, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return AFS_EIO;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    int err = n < 0 ? errno : ESRCH; /* nothing to read: reaped between open and read */
    close(fd);
    if (n <= 0) {
        errno = err; /* afs_proc_gone tells a reaped process from a failure of ours */
        return AFS_EIO;
    }
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    unsigned long long fl = 0, st = 0;
    /* after ")": state(3) ppid pgrp session tty tpgid flags(9) minflt cminflt majflt cmajflt
     * utime stime cutime cstime priority nice threads itrealvalue starttime(22) */
    if (!p || sscanf(p + 1, " %c %*d %*d %*d %*d %*d %llu %*u %*u %*u %*u %*u %*u %*d %*d %*d "
                            "%*d %*d %*d %llu", state, &fl, &st) != 3) {
        errno = EINVAL;
        return AFS_EIO;
    }
    *flags = fl;
    *start = st;
    return 0;
}

int afs_proc_stat(uint32_t pid, char *state, uint64_t *start)
{
    uint64_t flags;
    return proc_fields(pid, state, &flags, start);
}

uint64_t afs_proc_start(uint32_t pid)
{
    char state;
    uint64_t start = 0;
    return afs_proc_stat(pid, &state, &start) == 0 ? start : 0;
}

const char *afs_proc_gone(uint32_t pid, uint64_t start)
{
    char state = 0;
    uint64_t flags = 0, now_start = 0;
    errno = 0;
    if (proc_fields(pid, &state, &flags, &now_start) != 0)
        /* reaped; any other failure (EMFILE, ENOMEM) says nothing about the peer */
        return errno == ENOENT || errno == ESRCH ? "no longer in /proc" : NULL;
    if (now_start != start)
        return "its pid names another process now";
    if (state == 'Z' || state == 'X' || state == 'x')
        return "a zombie";
    return flags & PROC_PF_EXITING ? "exiting" : NULL;
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
    out->start = afs_proc_start(out->pid);
    out->host = out->start ? h | 1u : 0; /* never 0 when known */
    return out->host ? 0 : AFS_EIO;
}
