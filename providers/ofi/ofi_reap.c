/*
 * libfabric's shm removes an endpoint's region file (16 MiB in /dev/shm) when the endpoint
 * closes, and ofi_wake.c removes its wake file; a process killed before that (SIGKILL, or
 * a SIGTERM nobody handles) leaves both behind for good. Every 1.17 shm domain opened here
 * first removes those of owners that are gone: files named as unique_shm_name names them,
 * "<pid>:<16 hex digits>:..." (the wake file is the region's name plus ":wake"), whose pid
 * is no process (kill(pid, 0) fails with ESRCH) and whose owner lock is free. The owner
 * holds a shared flock on both files while the endpoint is open (ofi_reap_hold), so a
 * process of another pid namespace sharing /dev/shm, whose pid means nothing here, keeps
 * its files; within one namespace the pid alone decides, which also covers the moment
 * between a file's creation and its owner's lock.
 */
#include "ofi_reap.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/types.h>
#include <unistd.h>

#define SHM_DIR "/dev/shm"
#define NONCE_DIGITS 16

int ofi_reap_hold(const char *path)
{
    if (!path)
        return -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
        (void)close(fd);
        return -1;
    }
    return fd;
}

/* The pid of a name "<pid>:<16 hex digits>:...", or 0 for any other name. */
static pid_t owner_pid(const char *name)
{
    const char *p = name;
    long pid = 0;
    while (*p >= '0' && *p <= '9' && pid < 1L << 30)
        pid = pid * 10 + (*p++ - '0');
    if (p == name || *p != ':' || pid <= 0)
        return 0;
    p++;
    for (int i = 0; i < NONCE_DIGITS; i++, p++) {
        bool hex = (*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f');
        if (!hex)
            return 0;
    }
    return *p == ':' ? (pid_t)pid : 0;
}

void ofi_reap_dead(void)
{
    DIR *d = opendir(SHM_DIR);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        pid_t pid = owner_pid(e->d_name);
        if (!pid || kill(pid, 0) == 0 || errno != ESRCH)
            continue; /* not such a file, or its process exists (EPERM: someone else's) */
        int fd = openat(dirfd(d), e->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0)
            continue;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) /* no owner holds it */
            (void)unlinkat(dirfd(d), e->d_name, 0);
        (void)close(fd);
    }
    (void)closedir(d);
}
