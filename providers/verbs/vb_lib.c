/*
 * Loading libibverbs at run time (see vb_lib.h for why).
 *
 * libibverbs keeps its pre-1.1 ABI alive with versioned symbols (IBVERBS_1.0); the
 * structs in our headers are the 1.1 ones, so every classic entry point is looked up
 * with dlvsym at IBVERBS_1.1, which is what `ld -libverbs` would have recorded. Newer
 * entry points carry the version that introduced them.
 */
#include "vb_lib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define VB_LIB_DEFAULT "libibverbs.so.1"
#define VB_LIB_ENV "AFABRIC_LIBIBVERBS"

/* Written once under g_once, read-only afterwards; never dlclose'd (the library keeps
 * provider plugins and device contexts that other domains may still use). */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct vb_lib g_lib;
static const struct vb_lib *g_lib_ok;
static char g_why[512];

static void *lib_sym(void *handle, const char *name, const char *version)
{
    void *sym = dlvsym(handle, name, version);
    if (!sym) /* an unversioned build: only one version exists */
        sym = dlsym(handle, name);
    return sym;
}

static void lib_load(void)
{
    const char *path = getenv(VB_LIB_ENV);
    if (!path || !*path)
        path = VB_LIB_DEFAULT;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(g_why, sizeof g_why, "cannot load libibverbs (%s): %s", path, dlerror());
        return;
    }
#define VB_LOAD(field, name, version)                                                        \
    do {                                                                                   \
        void *sym_ = lib_sym(h, name, version);                                            \
        if (!sym_) {                                                                       \
            snprintf(g_why, sizeof g_why, "libibverbs (%s) lacks %s@%s", path, name,       \
                     version);                                                             \
            return;                                                                        \
        }                                                                                  \
        g_lib.field = (__typeof__(g_lib.field))sym_;                                       \
    } while (0)
#define VB_OPT(field, name, version) g_lib.field = (__typeof__(g_lib.field))dlvsym(h, name, version)

    VB_LOAD(get_device_list, "ibv_get_device_list", "IBVERBS_1.1");
    VB_LOAD(free_device_list, "ibv_free_device_list", "IBVERBS_1.1");
    VB_LOAD(get_device_name, "ibv_get_device_name", "IBVERBS_1.1");
    VB_LOAD(open_device, "ibv_open_device", "IBVERBS_1.1");
    VB_LOAD(close_device, "ibv_close_device", "IBVERBS_1.1");
    VB_LOAD(query_device, "ibv_query_device", "IBVERBS_1.1");
    VB_LOAD(query_port, "ibv_query_port", "IBVERBS_1.1");
    VB_LOAD(query_gid, "ibv_query_gid", "IBVERBS_1.1");
    VB_OPT(query_gid_ex, "_ibv_query_gid_ex", "IBVERBS_1.11");
    VB_LOAD(alloc_pd, "ibv_alloc_pd", "IBVERBS_1.1");
    VB_LOAD(dealloc_pd, "ibv_dealloc_pd", "IBVERBS_1.1");
    VB_LOAD(create_comp_channel, "ibv_create_comp_channel", "IBVERBS_1.0");
    VB_LOAD(destroy_comp_channel, "ibv_destroy_comp_channel", "IBVERBS_1.0");
    VB_LOAD(create_cq, "ibv_create_cq", "IBVERBS_1.1");
    VB_LOAD(destroy_cq, "ibv_destroy_cq", "IBVERBS_1.1");
    VB_LOAD(get_cq_event, "ibv_get_cq_event", "IBVERBS_1.1");
    VB_LOAD(ack_cq_events, "ibv_ack_cq_events", "IBVERBS_1.1");
    VB_LOAD(create_srq, "ibv_create_srq", "IBVERBS_1.1");
    VB_LOAD(destroy_srq, "ibv_destroy_srq", "IBVERBS_1.1");
    VB_LOAD(create_qp, "ibv_create_qp", "IBVERBS_1.1");
    VB_LOAD(modify_qp, "ibv_modify_qp", "IBVERBS_1.1");
    VB_LOAD(query_qp, "ibv_query_qp", "IBVERBS_1.1");
    VB_LOAD(destroy_qp, "ibv_destroy_qp", "IBVERBS_1.1");
    VB_LOAD(create_ah, "ibv_create_ah", "IBVERBS_1.1");
    VB_LOAD(destroy_ah, "ibv_destroy_ah", "IBVERBS_1.1");
    VB_LOAD(reg_mr, "ibv_reg_mr", "IBVERBS_1.1");
    VB_OPT(reg_mr_iova2, "ibv_reg_mr_iova2", "IBVERBS_1.8");
    VB_OPT(reg_dmabuf_mr, "ibv_reg_dmabuf_mr", "IBVERBS_1.12");
    VB_LOAD(dereg_mr, "ibv_dereg_mr", "IBVERBS_1.1");
    VB_LOAD(wc_status_str, "ibv_wc_status_str", "IBVERBS_1.1");
    VB_LOAD(get_async_event, "ibv_get_async_event", "IBVERBS_1.1");
    VB_LOAD(ack_async_event, "ibv_ack_async_event", "IBVERBS_1.1");
#undef VB_LOAD
#undef VB_OPT
    g_lib_ok = &g_lib;
}

const struct vb_lib *vb_lib_get(const char **why)
{
    pthread_once(&g_once, lib_load);
    if (!g_lib_ok && why)
        *why = g_why;
    return g_lib_ok;
}
