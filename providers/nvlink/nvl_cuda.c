/*
 * Loading the CUDA driver at run time, and the process-wide IPC mapping table (see
 * nvl_cuda.h for why it is process-wide).
 */
#include "nvl_cuda.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define AFNV_CUDA_API_VERSION 12000 /* the prototypes in nvl_cuda.h are CUDA 12.0's */

typedef CUresult (*get_proc_fn)(const char *sym, void **pfn, int version, uint64_t flags,
                                int *status);

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct afnv_cuda g_cu;
static const struct afnv_cuda *g_cu_ok;
static char g_why[256];
static uint64_t g_token;

typedef struct ipc_map {
    CUipcMemHandle handle;
    CUdeviceptr mapped;
    uint64_t refs;
    struct ipc_map *next;
} ipc_map;

static pthread_mutex_t g_ipc_lock = PTHREAD_MUTEX_INITIALIZER;
static ipc_map *g_ipc;

static uint64_t random_token(void)
{
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &v, sizeof v) != (ssize_t)sizeof v)
            v = 0;
        close(fd);
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    v ^= ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20);
    return v ? v : 1;
}

static void load(void)
{
    g_token = random_token();
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(g_why, sizeof g_why, "cannot load the CUDA driver (libcuda.so.1): %s", dlerror());
        return;
    }
    get_proc_fn gp = NULL;
    *(void **)(&gp) = dlsym(h, "cuGetProcAddress_v2");
    if (!gp) {
        snprintf(g_why, sizeof g_why,
                 "the CUDA driver is older than 12.0 (no cuGetProcAddress_v2); nvlink needs 12+");
        return;
    }
    struct {
        void **slot;
        const char *name;
    } syms[] = {
        {(void **)&g_cu.init, "cuInit"},
        {(void **)&g_cu.get_error_string, "cuGetErrorString"},
        {(void **)&g_cu.device_get_count, "cuDeviceGetCount"},
        {(void **)&g_cu.device_get, "cuDeviceGet"},
        {(void **)&g_cu.device_get_attribute, "cuDeviceGetAttribute"},
        {(void **)&g_cu.device_can_access_peer, "cuDeviceCanAccessPeer"},
        {(void **)&g_cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&g_cu.primary_ctx_release, "cuDevicePrimaryCtxRelease"},
        {(void **)&g_cu.ctx_set_current, "cuCtxSetCurrent"},
        {(void **)&g_cu.ctx_enable_peer_access, "cuCtxEnablePeerAccess"},
        {(void **)&g_cu.stream_create, "cuStreamCreate"},
        {(void **)&g_cu.stream_destroy, "cuStreamDestroy"},
        {(void **)&g_cu.stream_synchronize, "cuStreamSynchronize"},
        {(void **)&g_cu.event_create, "cuEventCreate"},
        {(void **)&g_cu.event_destroy, "cuEventDestroy"},
        {(void **)&g_cu.event_record, "cuEventRecord"},
        {(void **)&g_cu.event_query, "cuEventQuery"},
        {(void **)&g_cu.memcpy_async, "cuMemcpyAsync"},
        {(void **)&g_cu.memcpy_htod_async, "cuMemcpyHtoDAsync"},
        {(void **)&g_cu.mem_alloc, "cuMemAlloc"},
        {(void **)&g_cu.mem_free, "cuMemFree"},
        {(void **)&g_cu.mem_host_alloc, "cuMemHostAlloc"},
        {(void **)&g_cu.mem_free_host, "cuMemFreeHost"},
        {(void **)&g_cu.mem_get_address_range, "cuMemGetAddressRange"},
        {(void **)&g_cu.pointer_get_attribute, "cuPointerGetAttribute"},
        {(void **)&g_cu.ipc_get_mem_handle, "cuIpcGetMemHandle"},
        {(void **)&g_cu.ipc_open_mem_handle, "cuIpcOpenMemHandle"},
        {(void **)&g_cu.ipc_close_mem_handle, "cuIpcCloseMemHandle"},
        {(void **)&g_cu.module_load_data_ex, "cuModuleLoadDataEx"},
        {(void **)&g_cu.module_unload, "cuModuleUnload"},
        {(void **)&g_cu.module_get_function, "cuModuleGetFunction"},
        {(void **)&g_cu.launch_kernel, "cuLaunchKernel"},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        int status = 0;
        CUresult r = gp(syms[i].name, syms[i].slot, AFNV_CUDA_API_VERSION, 0, &status);
        if (r != CUDA_SUCCESS || !*syms[i].slot) {
            snprintf(g_why, sizeof g_why, "the CUDA driver lacks %s (CUresult %d, status %d)",
                     syms[i].name, r, status);
            return;
        }
    }
    CUresult r = g_cu.init(0);
    if (r != CUDA_SUCCESS) {
        snprintf(g_why, sizeof g_why, "cuInit failed: %s", afnv_cuda_errstr(&g_cu, r));
        return;
    }
    /* the library stays loaded: CUDA state outlives any one domain */
    g_cu_ok = &g_cu;
}

const struct afnv_cuda *afnv_cuda_get(const char **why)
{
    pthread_once(&g_once, load);
    if (!g_cu_ok && why)
        *why = g_why;
    return g_cu_ok;
}

uint64_t afnv_process_token(void)
{
    pthread_once(&g_once, load);
    return g_token;
}

const char *afnv_cuda_errstr(const struct afnv_cuda *cu, CUresult e)
{
    const char *s = NULL;
    if (cu && cu->get_error_string && cu->get_error_string(e, &s) == CUDA_SUCCESS && s)
        return s;
    return "unknown CUDA error";
}

int afnv_ipc_open(const struct afnv_cuda *cu, const CUipcMemHandle *h, CUdeviceptr *mapped,
                  CUresult *cerr)
{
    int rc = 0;
    *cerr = CUDA_SUCCESS;
    pthread_mutex_lock(&g_ipc_lock);
    for (ipc_map *m = g_ipc; m; m = m->next) {
        if (memcmp(&m->handle, h, sizeof *h) == 0) {
            m->refs++;
            *mapped = m->mapped;
            goto out_unlock;
        }
    }
    ipc_map *m = calloc(1, sizeof *m);
    if (!m) {
        rc = -1;
        goto out_unlock;
    }
    CUresult r = cu->ipc_open_mem_handle(&m->mapped, *h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (r != CUDA_SUCCESS) {
        *cerr = r;
        free(m);
        rc = -1;
        goto out_unlock;
    }
    m->handle = *h;
    m->refs = 1;
    m->next = g_ipc;
    g_ipc = m;
    *mapped = m->mapped;
out_unlock:
    pthread_mutex_unlock(&g_ipc_lock);
    return rc;
}

void afnv_ipc_close(const struct afnv_cuda *cu, CUdeviceptr mapped)
{
    pthread_mutex_lock(&g_ipc_lock);
    for (ipc_map **pp = &g_ipc; *pp; pp = &(*pp)->next) {
        ipc_map *m = *pp;
        if (m->mapped != mapped)
            continue;
        if (--m->refs == 0) {
            *pp = m->next;
            (void)cu->ipc_close_mem_handle(m->mapped); /* nothing to do about a failure */
            free(m);
        }
        break;
    }
    pthread_mutex_unlock(&g_ipc_lock);
}
