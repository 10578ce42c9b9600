/*
 * The two things the shim does to process-wide state, both on purpose.
 *
 * 1. The soft limit on open files is raised to the hard limit when an engine is made, as
 *    servers do: every peer connection of a socket provider is a descriptor, and 1,024
 *    (the usual soft default) is used up by a thousand idle connections.
 *
 * 2. Keeping the application's signal dispositions while a provider library loads.
 *
 * Debian's libfabric 1.17 links libpsm_infinipath, whose constructor installs handlers
 * for SIGABRT, SIGBUS, SIGILL, SIGSEGV and SIGTERM (measured: SigCgt 0x2 -> 0x446a after
 * dlopen("libfabric.so.1")). They replace the application's own: a Python SIGTERM handler
 * no longer runs (the process exits 1 instead), and every abort or crash leaves a
 * `<prog>.80s-<pid>,<host>.btr` backtrace file in the working directory. Providers may
 * also install handlers when they initialise (fi_getinfo, fi_fabric, ...), not only when
 * they are loaded. So every call that can load or initialise a provider library (loading
 * the plugin, list_nics, open) runs between afs_sigkeep_begin and afs_sigkeep_end, which
 * puts back exactly the dispositions that changed in between and leaves the others alone.
 *
 * The one process-wide object is the mutex: dispositions are process-wide, and two
 * engines created at once on two threads must not save each other's half-loaded state.
 * An application thread changing a disposition *while* a provider loads loses that change
 * if the provider changed the same signal (docs/limitations.md).
 */
#include <signal.h>
#include <string.h>
#include <sys/resource.h>

#include "internal.h"

void afs_raise_fd_limit(void)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur >= r.rlim_max)
        return;
    r.rlim_cur = r.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &r) != 0)
        return; /* (a seccomp'd sandbox): the old limit stays, nothing else depends on it */
}

static pthread_mutex_t g_sig_lock = PTHREAD_MUTEX_INITIALIZER;

static bool same_action(const struct sigaction *a, const struct sigaction *b)
{
    if (a->sa_handler != b->sa_handler || a->sa_flags != b->sa_flags)
        return false;
    for (int sig = 1; sig < NSIG; sig++)
        if (sigismember(&a->sa_mask, sig) != sigismember(&b->sa_mask, sig))
            return false;
    return true;
}

void afs_sigkeep_begin(afs_sigkeep *k)
{
    int rc = pthread_mutex_lock(&g_sig_lock);
    k->locked = rc == 0; /* cannot fail for a default mutex; if it did, still save */
    for (int sig = 1; sig < NSIG; sig++)
        k->saved[sig] = sigaction(sig, NULL, &k->act[sig]) == 0; /* glibc's own: EINVAL */
}

void afs_sigkeep_end(afs_sigkeep *k)
{
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction now;
        if (!k->saved[sig] || sigaction(sig, NULL, &now) != 0 || same_action(&now, &k->act[sig]))
            continue;
        if (sigaction(sig, &k->act[sig], NULL) != 0)
            continue; /* cannot happen for a disposition just read back; nothing else to do */
    }
    if (k->locked)
        (void)pthread_mutex_unlock(&g_sig_lock);
    k->locked = false;
}
