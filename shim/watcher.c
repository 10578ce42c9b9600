/*
 * Watchers: 64-bit words that a GPU kernel (or any writer) bumps, and the thread that
 * watches them. The thread reports each change it observes to the worker through the
 * submit queue (the worker is the only producer of completion records, and fires the
 * operations armed on the watcher); Python sees the changes as (old, new) records.
 *
 * With CUDA the word is pinned host memory mapped into the device's address space
 * (cuMemHostAlloc PORTABLE|DEVICEMAP): a kernel stores to it over PCIe/C2C and this thread
 * sees the store. libcuda is loaded with dlopen on first use, so nothing links CUDA.
 */
#include <dlfcn.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define WATCH_ALLOC_HOST 1u
#define WATCH_ALLOC_CUDA 2u
#define WATCH_SPIN_NS 200000ull  /* keep spinning this long after a change */
#define WATCH_SLEEP_NS 20000ull  /* then look every 20 us: a GPU store wakes nobody */

/* ---- the CUDA driver API, loaded on demand ---- */
typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_device_get_fn)(int *, int);
typedef int (*cu_ctx_retain_fn)(void **, int);
typedef int (*cu_ctx_release_fn)(int);
typedef int (*cu_ctx_push_fn)(void *);
typedef int (*cu_ctx_pop_fn)(void **);
typedef int (*cu_host_alloc_fn)(void **, size_t, unsigned);
typedef int (*cu_host_devptr_fn)(uint64_t *, void *, unsigned);
typedef int (*cu_free_host_fn)(void *);

typedef struct cuda_api {
    void *lib;
    cu_init_fn init;
    cu_device_get_fn device_get;
    cu_ctx_retain_fn retain;
    cu_ctx_release_fn release;
    cu_ctx_push_fn push;
    cu_ctx_pop_fn pop;
    cu_host_alloc_fn host_alloc;
    cu_host_devptr_fn host_devptr;
    cu_free_host_fn free_host;
} cuda_api;

#define CU_MEMHOSTALLOC_PORTABLE 0x01u
#define CU_MEMHOSTALLOC_DEVICEMAP 0x02u

static int load_cuda(afs_engine *eng, cuda_api **out)
{
    if (eng->cuda) {
        *out = eng->cuda;
        return 0;
    }
    cuda_api *c = calloc(1, sizeof(*c));
    if (!c)
        return afs_fail(AFS_ENOMEM, "watcher: out of memory");
    c->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!c->lib) {
        free(c);
        return afs_fail(AFS_EUNSUPPORTED, "CUDA watcher: cannot load libcuda.so.1 (%s)",
                        dlerror());
    }
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&c->init, "cuInit"},
        {(void **)&c->device_get, "cuDeviceGet"},
        {(void **)&c->retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&c->release, "cuDevicePrimaryCtxRelease_v2"},
        {(void **)&c->push, "cuCtxPushCurrent_v2"},
        {(void **)&c->pop, "cuCtxPopCurrent_v2"},
        {(void **)&c->host_alloc, "cuMemHostAlloc"},
        {(void **)&c->host_devptr, "cuMemHostGetDevicePointer_v2"},
        {(void **)&c->free_host, "cuMemFreeHost"},
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        *syms[i].slot = dlsym(c->lib, syms[i].name);
        if (!*syms[i].slot) {
            dlclose(c->lib);
            free(c);
            return afs_fail(AFS_EUNSUPPORTED, "CUDA watcher: libcuda lacks %s", syms[i].name);
        }
    }
    int rc = c->init(0);
    if (rc != 0) {
        dlclose(c->lib);
        free(c);
        return afs_fail(AFS_EUNSUPPORTED, "CUDA watcher: cuInit failed (CUresult %d)", rc);
    }
    eng->cuda = c;
    *out = c;
    return 0;
}

static int cuda_alloc(afs_engine *eng, afs_watcher *w, int32_t device)
{
    cuda_api *c = NULL;
    int rc = load_cuda(eng, &c);
    if (rc)
        return rc;
    int dev = 0;
    void *ctx = NULL, *popped = NULL, *host = NULL;
    int cr;
    if ((cr = c->device_get(&dev, device)) != 0)
        return afs_fail(AFS_EINVAL, "CUDA watcher: no device %d (CUresult %d)", device, cr);
    if ((cr = c->retain(&ctx, dev)) != 0)
        return afs_fail(AFS_EIO, "CUDA watcher: cannot retain device %d's context (%d)", device,
                        cr);
    if ((cr = c->push(ctx)) != 0) {
        rc = afs_fail(AFS_EIO, "CUDA watcher: cuCtxPushCurrent failed (%d)", cr);
        goto out_release;
    }
    cr = c->host_alloc(&host, 64, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    if (cr != 0) {
        rc = afs_fail(AFS_ENOMEM, "CUDA watcher: cuMemHostAlloc failed (%d)", cr);
        goto out_pop;
    }
    uint64_t dptr = 0;
    if ((cr = c->host_devptr(&dptr, host, 0)) != 0) {
        rc = afs_fail(AFS_EIO, "CUDA watcher: cuMemHostGetDevicePointer failed (%d)", cr);
        c->free_host(host);
        goto out_pop;
    }
    memset(host, 0, 64);
    w->word = host;
    w->device_ptr = dptr;
    w->device = device;
    w->alloc = WATCH_ALLOC_CUDA;
    c->pop(&popped);
    return 0; /* the primary context stays retained while the word lives */
out_pop:
    c->pop(&popped);
out_release:
    c->release(dev);
    return rc;
}

static void watcher_free_word(afs_engine *eng, afs_watcher *w)
{
    if (w->alloc == WATCH_ALLOC_HOST) {
        free((void *)w->word);
    } else if (w->alloc == WATCH_ALLOC_CUDA && eng->cuda) {
        cuda_api *c = eng->cuda;
        int dev = 0;
        void *ctx = NULL, *popped = NULL;
        if (c->device_get(&dev, w->device) == 0 && c->retain(&ctx, dev) == 0) {
            if (c->push(ctx) == 0) {
                c->free_host((void *)w->word);
                c->pop(&popped);
            }
            c->release(dev); /* this retain */
            c->release(dev); /* the one taken when the word was made */
        }
    }
    w->word = NULL;
    w->alloc = 0;
}

int32_t afs_watcher_create(afs_engine *eng, int32_t device, uint64_t *watcher_id,
                           uint64_t *host_ptr, uint64_t *device_ptr)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    if (!watcher_id || !host_ptr || !device_ptr)
        return afs_fail(AFS_EINVAL, "watcher: NULL output");
    uint32_t index;
    afs_watcher *w;
    if ((rc = afs_slots_alloc(&eng->watchers, &index, (void **)&w)))
        return rc;
    if (device >= 0) {
        rc = cuda_alloc(eng, w, device);
    } else {
        w->word = aligned_alloc(64, 64); /* a cache line of its own */
        if (!w->word)
            rc = afs_fail(AFS_ENOMEM, "watcher: out of memory");
        else {
            memset((void *)w->word, 0, 64);
            w->alloc = WATCH_ALLOC_HOST;
            w->device = -1;
        }
    }
    if (rc) {
        afs_slots_release(&eng->watchers, index);
        return rc;
    }
    w->last = 0;
    w->current = 0;
    *watcher_id = afs_slots_publish(&eng->watchers, index);
    *host_ptr = (uint64_t)(uintptr_t)w->word;
    *device_ptr = w->device_ptr;
    if (!eng->watch_started) {
        if (pthread_create(&eng->watch_thread, NULL, afs_watch_main, eng) != 0) {
            afs_watcher_destroy(eng, *watcher_id);
            return afs_fail(AFS_ENOMEM, "cannot start the watcher thread");
        }
        eng->watch_started = true;
    }
    return 0;
}

/* The live watcher `watcher_id` of an open engine in *out, else the error. */
static int32_t live_watcher(afs_engine *eng, uint64_t watcher_id, afs_watcher **out)
{
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    *out = afs_slots_lookup(&eng->watchers, watcher_id);
    return *out ? 0 : afs_fail(AFS_ESTALE, "watcher is not live");
}

int32_t afs_watcher_destroy(afs_engine *eng, uint64_t watcher_id)
{
    afs_watcher *w;
    int rc = live_watcher(eng, watcher_id, &w);
    if (rc)
        return rc;
    afs_slots_release(&eng->watchers, (uint32_t)watcher_id);
    /* The word itself is freed at engine close: the watcher thread and kernels may still
     * be reading it, and a released slot is never read again. */
    return 0;
}

int32_t afs_watcher_add(afs_engine *eng, uint64_t watcher_id, uint64_t delta, uint64_t *value)
{
    afs_watcher *w;
    int rc = live_watcher(eng, watcher_id, &w);
    if (rc)
        return rc;
    uint64_t v = atomic_fetch_add(w->word, delta) + delta;
    if (value)
        *value = v;
    return 0;
}

int32_t afs_watcher_store(afs_engine *eng, uint64_t watcher_id, uint64_t value, uint64_t *stamp_ns)
{
    afs_watcher *w;
    int rc = live_watcher(eng, watcher_id, &w);
    if (rc)
        return rc;
    uint64_t t = afs_now_ns();
    atomic_store_explicit(w->word, value, memory_order_release);
    if (stamp_ns)
        *stamp_ns = t;
    return 0;
}

/* Frees every watcher's word (engine close, after both threads stopped). */
void afs_watchers_destroy(afs_engine *eng)
{
    for (uint32_t i = 0; i < eng->watchers.n_alloc; i++) {
        afs_watcher *w = afs_slots_at(&eng->watchers, i);
        if (w && w->word)
            watcher_free_word(eng, w);
    }
    if (eng->cuda) {
        cuda_api *c = eng->cuda;
        dlclose(c->lib);
        free(c);
        eng->cuda = NULL;
    }
}

void *afs_watch_main(void *arg)
{
    afs_engine *eng = arg;
    (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    uint64_t last_change = afs_now_ns();
    while (!atomic_load(&eng->watch_stop)) {
        bool changed = false;
        uint32_t n = eng->watchers.n_alloc;
        for (uint32_t i = 0; i < n; i++) {
            afs_watcher *w = afs_slots_at(&eng->watchers, i);
            if (!w || !(atomic_load_explicit(&w->hdr.gen, memory_order_acquire) & 1u) || !w->word)
                continue;
            uint64_t v = atomic_load_explicit(w->word, memory_order_acquire);
            if (v == w->last)
                continue;
            afs_xfer *x = afs_xfer_new(eng, AFS_REQ_WATCH);
            if (!x)
                break; /* out of memory: report this change on the next pass */
            uint32_t gen = atomic_load(&w->hdr.gen);
            x->watch.watcher_id = ((uint64_t)gen << 32) | i;
            x->watch.old_value = w->last;
            x->watch.new_value = v;
            w->last = v;
            afs_submit(eng, x);
            changed = true;
        }
        uint64_t now = afs_now_ns();
        if (changed)
            last_change = now;
        /* Spin while something is armed on a watcher (its latency is the point of arming)
         * and for a while after each change; otherwise look every WATCH_SLEEP_NS. */
        if (atomic_load(&eng->armed_on_watchers) || now - last_change < WATCH_SPIN_NS) {
            sched_yield();
            continue;
        }
        struct timespec ts = {0, (long)WATCH_SLEEP_NS};
        nanosleep(&ts, NULL);
    }
    return NULL;
}
