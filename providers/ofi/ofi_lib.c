/*
 * Loading libfabric at run time (see ofi_lib.h for why).
 *
 * Symbol versions: libfabric keeps old ABIs alive with versioned symbols, and a plain
 * dlsym() returns the library's *default* version, which for a newer libfabric (2.x:
 * fi_getinfo@@FABRIC_1.9) expects a newer `struct fi_info` layout than the headers we
 * were compiled against. dlvsym() with the versions those headers bind to (what `ld`
 * would have recorded had we linked -lfabric) gives us the compatible entry points.
 * These are the versions of the Debian libfabric 1.17 headers; update them together
 * with the headers.
 */
#include "ofi_lib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define OFI_LIB_DEFAULT "libfabric.so.1"
#define OFI_LIB_ENV "AFABRIC_LIBFABRIC"

#define OFI_VER_GETINFO "FABRIC_1.3" /* fi_getinfo, fi_freeinfo, fi_dupinfo */
#define OFI_VER_FABRIC "FABRIC_1.1"
#define OFI_VER_STRERROR "FABRIC_1.0"

/* The only process-wide mutable state of the provider: written once under g_once,
 * read-only afterwards. The library is never dlclose'd (its providers may have started
 * threads, and other domains may still be using it). */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct ofi_lib g_lib;
static const struct ofi_lib *g_lib_ok;
static char g_why[512];

static void *lib_sym(void *handle, const char *name, const char *version)
{
    void *sym = dlvsym(handle, name, version);
    if (!sym) /* an unversioned build of libfabric: only one version exists */
        sym = dlsym(handle, name);
    return sym;
}

static void lib_load(void)
{
    const char *path = getenv(OFI_LIB_ENV);
    if (!path || !*path)
        path = OFI_LIB_DEFAULT;

    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        snprintf(g_why, sizeof g_why, "cannot load libfabric (%s): %s", path, dlerror());
        return;
    }

    /* Casting dlsym's void * to a function pointer is what POSIX requires to work. */
#define OFI_LOAD(field, name, version)                                                      \
    do {                                                                                   \
        void *sym_ = lib_sym(handle, name, version);                                       \
        if (!sym_) {                                                                       \
            snprintf(g_why, sizeof g_why, "libfabric (%s) lacks %s@%s", path, name,        \
                     version);                                                             \
            return; /* keep the handle: unloading a half-used libfabric gains nothing */  \
        }                                                                                  \
        g_lib.field = (__typeof__(g_lib.field))sym_;                                       \
    } while (0)

    OFI_LOAD(getinfo, "fi_getinfo", OFI_VER_GETINFO);
    OFI_LOAD(freeinfo, "fi_freeinfo", OFI_VER_GETINFO);
    OFI_LOAD(dupinfo, "fi_dupinfo", OFI_VER_GETINFO);
    OFI_LOAD(fabric, "fi_fabric", OFI_VER_FABRIC);
    OFI_LOAD(strerror, "fi_strerror", OFI_VER_STRERROR);
#undef OFI_LOAD
    g_lib_ok = &g_lib;
}

const struct ofi_lib *ofi_lib_get(const char **why)
{
    pthread_once(&g_once, lib_load);
    if (!g_lib_ok && why)
        *why = g_why;
    return g_lib_ok;
}
