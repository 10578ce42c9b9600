/*
 * afabric provider "nvlink": GPU-to-GPU writes between processes (and engines) of one node,
 * through CUDA IPC, with the transport contract of the other providers.
 *
 *  - Registering device memory exports it: the CUDA IPC handle of the allocation holding it
 *    goes into an entry of this domain's export table (shared memory,
 *    ../common/node_seg.h); the
 *    region's key names the entry and its generation, so deregistration revokes at once.
 *  - A peer's address names its segment. On the first write to a (peer, key) the writer
 *    reads the entry, opens the IPC handle (once per process: nvl_cuda.c) and caches the
 *    mapping; within one process the region is written directly.
 *  - Writes are copies issued by the worker thread on this domain's own streams (one set
 *    per source GPU): cuMemcpyAsync for contiguous writes, one launch of a gather/scatter
 *    kernel (nvl_copy.cu) for a whole paged write. Completion: one CUDA event per post
 *    call, queried by poll.
 *  - An immediate is appended to the target's mailbox only once the copy's event has
 *    completed, so the target counts it after the data is in its memory.
 *  - SEND appends the message to the target's mailbox; posted receives take them in order.
 *
 * Every CUDA GPU is a NIC (cuda<N>): peers on the same GPU (colocated processes, MPS) copy
 * device to device on it; peers on another GPU need peer access to it (NVLink or PCIe
 * P2P). Which GPU a region lives on is in its export entry (by PCI location, the same in
 * every process); a region on a GPU this one cannot reach, or that this process does not
 * see, is refused when first imported (AFP_EUNSUPPORTED, saying why), before anything is
 * posted: never a bounce through host memory. On a machine without CUDA list_nics/open
 * fail with AFP_ENODEV and say why: the provider is then unavailable.
 *
 * Threading: every call on a domain comes from the shim's worker thread (ABI rule), so
 * the domain needs no lock; only the peer-facing mailbox is shared, under its own lock
 * (node_seg.h).
 *
 * The CPU side that is not CUDA's (segment, export table, mailbox, peers and their
 * liveness, imports, completions, send/recv, addresses) is ../common/node_core.c, shared
 * with the cma provider.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../common/node_core.h"
#include "afabric_provider.h"
#include "nvl_copy_ptx.h"
#include "nvl_cuda.h"

#define NVL_MAX_DEV 16u
#define NVL_STREAMS 4u            /* per source GPU, taken in turn by post calls */
#define NVL_STAGE_BYTES (8u << 20) /* per stream: page indices of paged writes in flight */
#define NVL_BLOCK 256u             /* copy kernel: 8 warps per block, one page per warp */
#define NVL_ADDR_MAGIC 0x314c564eu /* "NVL1" */
#define NVL_MAX_WRITE (1ull << 40)

/* ------------------------------------------------------------------------------------ */
/* Types                                                                                 */

_Static_assert(sizeof(CUipcMemHandle) == MB_HANDLE_BYTES, "an export entry holds one IPC handle");

static const mb_kind NVL_KIND = {
    .tag = ":afabric-nvl-",
    .wake = "afabric-nvl-",
    .name = "nvlink",
    .magic = 0x314c564e31414641ull, /* "AFA1NVL1" */
    .extra_bytes = 0,
};

struct afp_mr {
    int32_t device; /* -1: host memory (local source only) */
    uint32_t export_idx;
    bool exported;
    uint64_t addr, len;
};

typedef struct nvl_map { /* an IPC mapping this domain holds a reference to */
    uint64_t peer;
    CUdeviceptr mapped;
} nvl_map;

typedef struct nvl_op {
    afn_op o; /* ctx, peer, immediates to deliver once the copy completed, status */
    CUdeviceptr big_dev; /* page indices of an oversized paged write, freed with the batch */
    void *big_host;
} nvl_op;

typedef struct nvl_batch {
    CUevent ev;
    nvl_op *ops;
    uint32_t nops, cap;
    uint64_t stage_end; /* the stream's staging position once this batch is done */
    int dev;            /* the GPU whose context made the event */
    struct nvl_batch *next;
} nvl_batch;

typedef struct nvl_stream {
    CUstream s;
    nvl_batch *open; /* collecting this poll round's copies; its event is recorded at poll */
    nvl_batch *head, *tail; /* in flight, oldest first (a stream completes in order) */
    uint8_t *stage_host;    /* pinned */
    CUdeviceptr stage_dev;
    uint64_t stage_head, stage_tail; /* bytes, monotonically increasing */
} nvl_stream;

typedef struct nvl_dev {
    bool ready; /* its primary context is retained (close releases it) */
    bool ok;    /* and everything below was made */
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    uint32_t sms;
    uint32_t next;
    nvl_stream st[NVL_STREAMS];
    CUevent *free_events; /* events are tied to their context: one pool per GPU */
    uint32_t nfree_events, free_events_cap;
} nvl_dev;

struct afp_domain {
    const struct afnv_cuda *cu;
    int home; /* the GPU named at open: IPC mappings for host sources are made there */
    int ndev;
    int src;       /* the local GPU of the copy being posted (map_export checks against it) */
    bool all_reach; /* every GPU reaches every other: no per-copy check needed */
    bool reach[NVL_MAX_DEV][NVL_MAX_DEV]; /* [a][b]: a's context can copy to/from b's memory */
    uint32_t pci[NVL_MAX_DEV]; /* each GPU's PCI location (gpu_loc), 0 unknown */
    nvl_dev dev[NVL_MAX_DEV];
    afn_core c; /* segment, peers, imports, completions, mailbox: node_core.h */
    nvl_map *maps;
    uint32_t nmaps, maps_cap;

    uint64_t inflight; /* batches open or not yet complete */
    nvl_batch *free_batches;
};

/* ------------------------------------------------------------------------------------ */
/* Errors and small helpers                                                              */

#define DERR(d, code, ...) AFN_ERR(&(d)->c, code, __VA_ARGS__)

static int cuda_fail(afp_domain *d, int code, const char *what, CUresult r)
{
    return DERR(d, code, "%s: %s (CUresult %d) [nvlink]", what, afnv_cuda_errstr(d->cu, r), r);
}

/* ------------------------------------------------------------------------------------ */
/* Devices                                                                               */

static int dev_count(const struct afnv_cuda *cu, int *n, char *err, size_t errlen)
{
    CUresult r = cu->device_get_count(n);
    if (r != CUDA_SUCCESS) {
        afp_errf(err, errlen, "cuDeviceGetCount: %s", afnv_cuda_errstr(cu, r));
        return AFP_ENODEV;
    }
    return 0;
}

/* A GPU's PCI location as one number (domain << 16 | bus << 8 | device): how an export
 * entry names its GPU to processes whose CUDA ordinals may differ. 0: unknown. */
static uint32_t gpu_loc(const struct afnv_cuda *cu, int ordinal)
{
    CUdevice d;
    int dom = 0, bus = 0, devn = 0;
    if (cu->device_get(&d, ordinal) != CUDA_SUCCESS ||
        cu->device_get_attribute(&dom, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, d) != CUDA_SUCCESS ||
        cu->device_get_attribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, d) != CUDA_SUCCESS ||
        cu->device_get_attribute(&devn, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, d) != CUDA_SUCCESS)
        return 0;
    return ((uint32_t)dom & 0xffffu) << 16 | ((uint32_t)bus & 0xffu) << 8 | ((uint32_t)devn & 0xffu);
}

/* Which GPU can copy to/from which: itself always, another by peer access. */
static void map_reach(afp_domain *d)
{
    d->all_reach = true;
    for (int a = 0; a < d->ndev; a++) {
        d->pci[a] = gpu_loc(d->cu, a);
        for (int b = 0; b < d->ndev; b++) {
            int can = 0;
            CUdevice da, db;
            d->reach[a][b] = a == b || (d->cu->device_get(&da, a) == CUDA_SUCCESS &&
                                        d->cu->device_get(&db, b) == CUDA_SUCCESS &&
                                        d->cu->device_can_access_peer(&can, da, db) ==
                                            CUDA_SUCCESS &&
                                        can);
            d->all_reach &= d->reach[a][b];
        }
    }
}

static void fill_nic(const struct afnv_cuda *cu, int ordinal, afp_nic_info *out)
{
    memset(out, 0, sizeof *out);
    out->numa_node = -1;
    snprintf(out->name, sizeof out->name, "cuda%d", ordinal);
    snprintf(out->fabric, sizeof out->fabric, "nvlink");
    snprintf(out->provider, sizeof out->provider, "nvlink;cuda-ipc");
    CUdevice d;
    int dom = 0, bus = 0, devn = 0;
    if (cu->device_get(&d, ordinal) == CUDA_SUCCESS &&
        cu->device_get_attribute(&dom, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, d) == CUDA_SUCCESS &&
        cu->device_get_attribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, d) == CUDA_SUCCESS &&
        cu->device_get_attribute(&devn, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, d) == CUDA_SUCCESS) {
        snprintf(out->pci, sizeof out->pci, "%04x:%02x:%02x.0", (unsigned)dom & 0xffffu,
                 (unsigned)bus & 0xffu, (unsigned)devn & 0xffu);
        char path[96];
        snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/numa_node", out->pci);
        FILE *f = fopen(path, "r");
        if (f) {
            int node = -1;
            if (fscanf(f, "%d", &node) == 1)
                out->numa_node = node;
            fclose(f);
        }
    }
}

static int nvl_list_nics(const afp_open_args *args, afp_nic_info *out, uint32_t max,
                         uint32_t *n, char *err, size_t errlen)
{
    const char *why = NULL;
    const struct afnv_cuda *cu = afnv_cuda_get(&why);
    *n = 0;
    if (!cu) {
        afp_errf(err, errlen, "%s", why);
        return AFP_ENODEV;
    }
    int ndev = 0, rc = dev_count(cu, &ndev, err, errlen);
    if (rc)
        return rc;
    if (ndev < 1) {
        afp_errf(err, errlen, "no CUDA GPU");
        return AFP_ENODEV;
    }
    uint32_t count = 0;
    for (int i = 0; i < ndev && i < (int)NVL_MAX_DEV; i++) {
        afp_nic_info info;
        fill_nic(cu, i, &info);
        if (args && args->nic && *args->nic && strcmp(args->nic, info.name) != 0)
            continue;
        if (count < max)
            out[count] = info;
        count++;
    }
    *n = count;
    if (count == 0) {
        afp_errf(err, errlen, "no CUDA GPU named %s (%d GPU(s): cuda0..cuda%d)", args->nic, ndev,
                 ndev - 1);
        return AFP_ENODEV;
    }
    return 0;
}

static int set_dev(afp_domain *d, int ordinal)
{
    CUresult r = d->cu->ctx_set_current(d->dev[ordinal].ctx);
    return r == CUDA_SUCCESS ? 0 : cuda_fail(d, AFP_EIO, "cuCtxSetCurrent", r);
}

static int load_kernel(afp_domain *d, nvl_dev *v)
{
    char log[1024] = "";
    int opts[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *vals[2] = {log, (void *)(uintptr_t)sizeof log};
    CUresult r = d->cu->module_load_data_ex(&v->mod, afnv_copy_ptx, 2, opts, vals);
    if (r != CUDA_SUCCESS)
        return DERR(d, AFP_EIO, "loading the copy kernel: %s (CUresult %d) %s [nvlink]",
                    afnv_cuda_errstr(d->cu, r), r, log);
    r = d->cu->module_get_function(&v->fn, v->mod, "afnv_paged_copy");
    if (r != CUDA_SUCCESS)
        return cuda_fail(d, AFP_EIO, "cuModuleGetFunction(afnv_paged_copy)", r);
    return 0;
}

/* A GPU's context, streams, staging and kernel, made on first use. Peer access to every
 * other GPU is enabled from it (kernels store into peer memory; copies go peer to peer). */
static int dev_ready(afp_domain *d, int ordinal)
{
    if (ordinal < 0 || ordinal >= d->ndev || ordinal >= (int)NVL_MAX_DEV)
        return DERR(d, AFP_EINVAL, "no CUDA device %d (this process sees %d) [nvlink]", ordinal,
                    d->ndev);
    nvl_dev *v = &d->dev[ordinal];
    if (v->ok)
        return set_dev(d, ordinal);
    if (v->ready)
        return DERR(d, AFP_EIO, "CUDA device %d failed to initialise earlier [nvlink]", ordinal);
    const struct afnv_cuda *cu = d->cu;
    CUresult r;
    int rc;
    if ((r = cu->device_get(&v->dev, ordinal)) != CUDA_SUCCESS)
        return cuda_fail(d, AFP_EINVAL, "cuDeviceGet", r);
    if ((r = cu->primary_ctx_retain(&v->ctx, v->dev)) != CUDA_SUCCESS)
        return cuda_fail(d, AFP_EIO, "cuDevicePrimaryCtxRetain", r);
    v->ready = true; /* from here on close releases what is made */
    if ((rc = set_dev(d, ordinal)))
        return rc;
    int sms = 0;
    if (cu->device_get_attribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, v->dev) !=
            CUDA_SUCCESS ||
        sms <= 0)
        sms = 16;
    v->sms = (uint32_t)sms;
    for (int j = 0; j < d->ndev && j < (int)NVL_MAX_DEV; j++) {
        CUdevice pd;
        CUcontext pctx;
        int can = 0;
        if (j == ordinal || cu->device_get(&pd, j) != CUDA_SUCCESS ||
            cu->device_can_access_peer(&can, v->dev, pd) != CUDA_SUCCESS || !can)
            continue;
        if ((r = cu->primary_ctx_retain(&pctx, pd)) != CUDA_SUCCESS)
            return cuda_fail(d, AFP_EIO, "cuDevicePrimaryCtxRetain (peer)", r);
        r = cu->ctx_enable_peer_access(pctx, 0);
        (void)cu->primary_ctx_release(pd); /* the peer's primary context lives on regardless */
        if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
            return cuda_fail(d, AFP_EIO, "cuCtxEnablePeerAccess", r);
    }
    if ((rc = load_kernel(d, v)))
        return rc;
    for (uint32_t k = 0; k < NVL_STREAMS; k++) {
        nvl_stream *s = &v->st[k];
        if ((r = cu->stream_create(&s->s, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS)
            return cuda_fail(d, AFP_EIO, "cuStreamCreate", r);
        void *host = NULL;
        if ((r = cu->mem_host_alloc(&host, NVL_STAGE_BYTES, CU_MEMHOSTALLOC_PORTABLE)) !=
            CUDA_SUCCESS)
            return cuda_fail(d, AFP_ENOMEM, "cuMemHostAlloc (staging)", r);
        s->stage_host = host;
        if ((r = cu->mem_alloc(&s->stage_dev, NVL_STAGE_BYTES)) != CUDA_SUCCESS)
            return cuda_fail(d, AFP_ENOMEM, "cuMemAlloc (staging)", r);
    }
    v->ok = true;
    return 0;
}

static void dev_release(afp_domain *d, nvl_dev *v)
{
    const struct afnv_cuda *cu = d->cu;
    if (!v->ready)
        return;
    (void)cu->ctx_set_current(v->ctx);
    for (uint32_t k = 0; k < NVL_STREAMS; k++) {
        nvl_stream *s = &v->st[k];
        if (s->s) {
            (void)cu->stream_synchronize(s->s);
            (void)cu->stream_destroy(s->s);
        }
        if (s->stage_host)
            (void)cu->mem_free_host(s->stage_host);
        if (s->stage_dev)
            (void)cu->mem_free(s->stage_dev);
    }
    for (uint32_t i = 0; i < v->nfree_events; i++)
        (void)cu->event_destroy(v->free_events[i]);
    free(v->free_events);
    if (v->mod)
        (void)cu->module_unload(v->mod);
    (void)cu->primary_ctx_release(v->dev);
    memset(v, 0, sizeof *v);
}

/* ------------------------------------------------------------------------------------ */
/* Completions                                                                           */

/* ------------------------------------------------------------------------------------ */
/* Imports: (peer, key) -> our address for the peer's region (node_core.c)              */

static int remember_map(afp_domain *d, uint64_t peer, CUdeviceptr mapped)
{
    nvl_map *m = afn_grow(d->maps, &d->maps_cap, d->nmaps + 1, sizeof *m);
    if (!m)
        return AFP_ENOMEM;
    d->maps = m;
    d->maps[d->nmaps++] = (nvl_map){peer, mapped};
    return 0;
}

/* The copy between GPU `src` (ours) and GPU `tgt` (ours, where the peer's region lives) is
 * possible: the same GPU, or peer access. Else refused, saying why (no host bounce). */
static int reachable(afp_domain *d, int src, int tgt)
{
    if (tgt >= 0 && tgt < d->ndev && d->reach[src][tgt])
        return 0;
    return DERR(d, AFP_EUNSUPPORTED,
                "cuda%d has no peer access to cuda%d, where the remote region lives: nvlink "
                "copies within one GPU or between GPUs with peer access (NVLink, PCIe P2P), "
                "never through host memory [nvlink]",
                src, tgt);
}

/* node_core's afn_map_fn: maps the IPC handle of an entry seen for the first time, once
 * its GPU is known to be reachable from the posting GPU (d->src). */
static int map_export(void *arg, uint64_t peer, const mb_export *e, int64_t *delta)
{
    afp_domain *d = arg;
    bool ours = e->proc_token == afnv_process_token() && e->pid == (int32_t)getpid();
    int tgt = ours ? e->device : -1; /* our own process: the owner's ordinals are ours */
    for (int i = 0; !ours && e->gpu && i < d->ndev; i++)
        if (d->pci[i] == e->gpu)
            tgt = i;
    if (!ours && e->gpu && tgt < 0)
        return DERR(d, AFP_EUNSUPPORTED,
                    "the remote region lives on GPU %04x:%02x:%02x.0, which this process does "
                    "not see (CUDA_VISIBLE_DEVICES?): nvlink copies GPU to GPU only [nvlink]",
                    e->gpu >> 16, (e->gpu >> 8) & 0xffu, e->gpu & 0xffu);
    int rc = (ours || e->gpu) ? reachable(d, d->src, tgt) : 0; /* an entry from an older build
                                                                 names no GPU: the IPC open
                                                                 below decides */
    if (rc)
        return rc;
    if (ours) {
        *delta = 0; /* the owner's addresses are ours */
        return 0;
    }
    CUdeviceptr mapped = 0;
    CUresult cr;
    if (afnv_ipc_open(d->cu, (const CUipcMemHandle *)(const void *)e->handle, &mapped, &cr) != 0)
        return cr ? cuda_fail(d, AFP_EKEY, "cuIpcOpenMemHandle", cr)
                  : DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
    if (remember_map(d, peer, mapped)) {
        afnv_ipc_close(d->cu, mapped);
        return DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
    }
    *delta = (int64_t)(mapped - e->alloc_base);
    return 0;
}

/* Where to write (or, `need` AFP_MR_REMOTE_READ, read) [raddr, +len) of region `key` of
 * `peer`, checked against the owner's export entry (not the descriptor, which a peer could
 * forge): its range and what it allows; and that `dev`, our GPU of the copy, reaches the
 * GPU the region lives on (an import made from another of our GPUs is checked again here,
 * where some pair of GPUs lacks peer access). */
static int translate(afp_domain *d, int dev, uint64_t peer, uint64_t key, uint64_t raddr,
                     uint64_t len, uint32_t need, uint64_t *out)
{
    afn_import *im = NULL;
    d->src = dev;
    int rc = afn_translate(&d->c, peer, key, raddr, len, need, map_export, d, &im);
    if (rc)
        return rc;
    *out = (uint64_t)((int64_t)raddr + im->delta);
    if (d->all_reach || len == 0)
        return 0;
    int ord = -1;
    CUresult r = d->cu->pointer_get_attribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, *out);
    if (r != CUDA_SUCCESS)
        return cuda_fail(d, AFP_EIO, "cuPointerGetAttribute (the remote region's GPU)", r);
    return reachable(d, dev, ord);
}

/* ------------------------------------------------------------------------------------ */
/* Batches: the copies of one post call on one stream, and their event                   */

static nvl_batch *batch_new(afp_domain *d, int dev)
{
    nvl_dev *v = &d->dev[dev];
    nvl_batch *b = d->free_batches;
    if (b) {
        d->free_batches = b->next;
        b->nops = 0;
    } else {
        b = calloc(1, sizeof *b);
        if (!b)
            return NULL;
    }
    b->next = NULL;
    b->ev = NULL;
    b->dev = dev;
    if (v->nfree_events) {
        b->ev = v->free_events[--v->nfree_events];
    } else {
        CUresult r = d->cu->event_create(&b->ev, CU_EVENT_DISABLE_TIMING);
        if (r != CUDA_SUCCESS) {
            cuda_fail(d, AFP_EIO, "cuEventCreate", r);
            b->next = d->free_batches;
            d->free_batches = b;
            return NULL;
        }
    }
    return b;
}

static void batch_free(afp_domain *d, nvl_batch *b)
{
    if (b->ev) {
        nvl_dev *v = &d->dev[b->dev];
        CUevent *e = afn_grow(v->free_events, &v->free_events_cap, v->nfree_events + 1, sizeof *e);
        if (e) {
            v->free_events = e;
            v->free_events[v->nfree_events++] = b->ev;
        } else {
            (void)d->cu->event_destroy(b->ev);
        }
        b->ev = NULL;
    }
    for (uint32_t i = 0; i < b->nops; i++) {
        if (b->ops[i].big_dev)
            (void)d->cu->mem_free(b->ops[i].big_dev);
        if (b->ops[i].big_host)
            (void)d->cu->mem_free_host(b->ops[i].big_host);
    }
    b->nops = 0;
    b->next = d->free_batches;
    d->free_batches = b;
}

static nvl_op *batch_add(nvl_batch *b)
{
    nvl_op *ops = afn_grow(b->ops, &b->cap, b->nops + 1, sizeof *ops);
    if (!ops)
        return NULL;
    b->ops = ops;
    nvl_op *op = &b->ops[b->nops++];
    memset(op, 0, sizeof *op);
    return op;
}

/* The batch collecting copies on stream `s` until the next poll (one event for all of them:
 * an event per write would cost as much as the write for small ones). */
static nvl_batch *open_batch(afp_domain *d, int dev, nvl_stream *s)
{
    if (!s->open) {
        s->open = batch_new(d, dev);
        if (s->open)
            d->inflight++;
    }
    return s->open;
}

/* Record the batch's event on its stream and queue it; on failure every op of it fails. */
static void batch_submit(afp_domain *d, nvl_stream *s, nvl_batch *b)
{
    CUresult r = d->cu->event_record(b->ev, s->s);
    if (r != CUDA_SUCCESS) {
        (void)d->cu->stream_synchronize(s->s); /* the copies must be done before we report */
        for (uint32_t i = 0; i < b->nops; i++)
            if (!b->ops[i].o.status) {
                b->ops[i].o.status = AFP_EIO;
                b->ops[i].o.text = afn_dup_text("cuEventRecord: %s [nvlink]", afnv_cuda_errstr(d->cu, r));
            }
        for (uint32_t i = 0; i < b->nops; i++)
            afn_finish_op(&d->c, &b->ops[i].o);
        s->stage_head = b->stage_end > s->stage_head ? b->stage_end : s->stage_head;
        d->inflight--;
        batch_free(d, b);
        return;
    }
    if (s->tail)
        s->tail->next = b;
    else
        s->head = b;
    s->tail = b;
}

/* Close every open batch: one event record per stream that got copies since the last poll. */
static void flush_batches(afp_domain *d)
{
    for (int k = 0; k < d->ndev && k < (int)NVL_MAX_DEV; k++) {
        nvl_dev *v = &d->dev[k];
        bool current = false;
        for (uint32_t j = 0; v->ok && j < NVL_STREAMS; j++) {
            nvl_stream *s = &v->st[j];
            nvl_batch *b = s->open;
            if (!b)
                continue;
            if (!current) {
                (void)d->cu->ctx_set_current(v->ctx);
                current = true;
            }
            s->open = NULL;
            b->stage_end = s->stage_tail;
            batch_submit(d, s, b);
        }
    }
}

static nvl_stream *pick_stream(afp_domain *d, int dev)
{
    nvl_dev *v = &d->dev[dev];
    nvl_stream *s = &v->st[v->next % NVL_STREAMS];
    v->next++;
    return s;
}

/* ------------------------------------------------------------------------------------ */
/* Posting                                                                               */

static int src_device(afp_domain *d, const struct afp_mr *mr)
{
    return (mr && mr->device >= 0) ? mr->device : d->home;
}

static int nvl_post_writes(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted)
{
    *posted = 0;
    for (uint32_t i = 0; i < n; i++) {
        const afp_write *w = &wr[i];
        int dev = src_device(d, w->local_desc);
        int rc = dev_ready(d, dev);
        if (rc)
            return *posted ? 0 : rc;
        nvl_op op = {{w->ctx, w->peer, w->has_imm ? 1u : 0u, w->imm, 0, NULL}, 0, NULL};
        uint64_t dst = 0;
        int trc = translate(d, dev, w->peer, w->remote_key, w->remote_addr, w->length,
                            AFP_MR_REMOTE, &dst);
        if (trc || w->length == 0) { /* nothing for the GPU: done (or failed) now */
            op.o.status = trc;
            op.o.text = trc ? strdup(d->c.errbuf) : NULL;
            afn_finish_op(&d->c, &op.o);
            (*posted)++;
            continue;
        }
        nvl_stream *s = pick_stream(d, dev);
        nvl_batch *b = open_batch(d, dev, s);
        nvl_op *slot = b ? batch_add(b) : NULL;
        if (!slot)
            return *posted ? 0 : AFP_EAGAIN; /* out of memory for now: the shim retries */
        CUresult r = d->cu->memcpy_async(dst, (CUdeviceptr)(uintptr_t)w->local_addr, w->length,
                                         s->s);
        if (r != CUDA_SUCCESS) {
            b->nops--; /* not in flight: fails now */
            op.o.status = AFP_EIO;
            op.o.text = afn_dup_text("cuMemcpyAsync of %llu bytes: %s [nvlink]",
                               (unsigned long long)w->length, afnv_cuda_errstr(d->cu, r));
            afn_finish_op(&d->c, &op.o);
        } else {
            *slot = op;
        }
        (*posted)++;
    }
    return 0;
}

/* Reads: the write path's copy in the other direction (from the peer's exported memory,
 * mapped here, into the local region), on a stream of the local region's device. */
static int nvl_post_reads(afp_domain *d, const afp_write *rd, uint32_t n, uint32_t *posted)
{
    *posted = 0;
    for (uint32_t i = 0; i < n; i++) {
        const afp_write *w = &rd[i];
        int dev = src_device(d, w->local_desc);
        int rc = dev_ready(d, dev);
        if (rc)
            return *posted ? 0 : rc;
        nvl_op op = {{w->ctx, w->peer, 0u, 0u, 0, NULL}, 0, NULL};
        uint64_t src = 0;
        int trc = translate(d, dev, w->peer, w->remote_key, w->remote_addr, w->length,
                            AFP_MR_REMOTE_READ, &src);
        if (trc || w->length == 0) {
            op.o.status = trc;
            op.o.text = trc ? strdup(d->c.errbuf) : NULL;
            afn_finish_op(&d->c, &op.o);
            (*posted)++;
            continue;
        }
        nvl_stream *s = pick_stream(d, dev);
        nvl_batch *b = open_batch(d, dev, s);
        nvl_op *slot = b ? batch_add(b) : NULL;
        if (!slot)
            return *posted ? 0 : AFP_EAGAIN;
        CUresult r = d->cu->memcpy_async((CUdeviceptr)(uintptr_t)w->local_addr, src, w->length,
                                         s->s);
        if (r != CUDA_SUCCESS) {
            b->nops--;
            op.o.status = AFP_EIO;
            op.o.text = afn_dup_text("cuMemcpyAsync (read) of %llu bytes: %s [nvlink]",
                               (unsigned long long)w->length, afnv_cuda_errstr(d->cu, r));
            afn_finish_op(&d->c, &op.o);
        } else {
            *slot = op;
        }
        (*posted)++;
    }
    return 0;
}

static int64_t max_index(const int64_t *idx, uint64_t n)
{
    int64_t m = 0;
    for (uint64_t i = 0; i < n; i++)
        m = idx[i] > m ? idx[i] : m;
    return m;
}

/* Page indices for the kernel, in the stream's staging ring (or a one-off buffer when the
 * write is larger than half the ring). AFP_EAGAIN: the ring is busy, try again later. */
static int stage_indices(afp_domain *d, nvl_stream *s, nvl_op *op, const afp_paged *p,
                         CUdeviceptr *dev_idx)
{
    uint64_t bytes = 2 * p->count * sizeof(int64_t);
    uint64_t need = (bytes + 255) & ~255ull;
    uint8_t *host;
    CUresult r;
    if (need > NVL_STAGE_BYTES / 2) {
        void *h = NULL;
        if ((r = d->cu->mem_host_alloc(&h, bytes, CU_MEMHOSTALLOC_PORTABLE)) != CUDA_SUCCESS)
            return cuda_fail(d, AFP_ENOMEM, "cuMemHostAlloc (page indices)", r);
        op->big_host = h;
        if ((r = d->cu->mem_alloc(&op->big_dev, bytes)) != CUDA_SUCCESS)
            return cuda_fail(d, AFP_ENOMEM, "cuMemAlloc (page indices)", r);
        host = h;
        *dev_idx = op->big_dev;
    } else {
        uint64_t off = s->stage_tail % NVL_STAGE_BYTES;
        uint64_t skip = off + need > NVL_STAGE_BYTES ? NVL_STAGE_BYTES - off : 0;
        if (s->stage_tail + skip + need - s->stage_head > NVL_STAGE_BYTES)
            return AFP_EAGAIN;
        s->stage_tail += skip;
        off = s->stage_tail % NVL_STAGE_BYTES;
        host = s->stage_host + off;
        *dev_idx = s->stage_dev + off;
        s->stage_tail += need;
    }
    memcpy(host, p->src_idx, p->count * sizeof(int64_t));
    memcpy(host + p->count * sizeof(int64_t), p->dst_idx, p->count * sizeof(int64_t));
    if ((r = d->cu->memcpy_htod_async(*dev_idx, host, bytes, s->s)) != CUDA_SUCCESS)
        return cuda_fail(d, AFP_EIO, "cuMemcpyHtoDAsync (page indices)", r);
    return 0;
}

static int nvl_post_paged(afp_domain *d, const afp_paged *p)
{
    const struct afp_mr *mr = p->local_desc;
    int dev = src_device(d, mr);
    int rc = dev_ready(d, dev);
    if (rc)
        return rc;
    if (p->count == 0)
        return DERR(d, AFP_EINVAL, "paged write of no pages [nvlink]");
    nvl_op op = {{p->ctx, p->peer, p->has_imm ? p->count : 0, p->imm, 0, NULL}, 0, NULL};
    /* the shim checked the pages against the descriptor's length; the owner's export entry
     * is what counts (a descriptor can be forged) */
    uint64_t span = (uint64_t)max_index(p->dst_idx, p->count) * p->dst_stride + p->page_len;
    uint64_t dst = 0;
    int trc = translate(d, dev, p->peer, p->remote_key, p->remote_base + p->dst_offset, span,
                        AFP_MR_REMOTE, &dst);
    if (trc || p->page_len == 0) { /* refused, or only arrivals to deliver */
        op.o.status = trc;
        op.o.text = trc ? strdup(d->c.errbuf) : NULL;
        afn_finish_op(&d->c, &op.o);
        return 0;
    }
    nvl_stream *s = pick_stream(d, dev);
    nvl_batch *b = open_batch(d, dev, s);
    nvl_op *slot = b ? batch_add(b) : NULL;
    if (!slot)
        return AFP_EAGAIN;
    uint64_t src = (uint64_t)(uintptr_t)p->local_base + p->src_offset;
    CUresult r = CUDA_SUCCESS;
    if (mr && mr->device < 0) {
        /* host source (a slow path the kernel cannot serve): the driver stages each page */
        for (uint64_t k = 0; k < p->count && r == CUDA_SUCCESS; k++)
            r = d->cu->memcpy_async(dst + (uint64_t)p->dst_idx[k] * p->dst_stride,
                                    src + (uint64_t)p->src_idx[k] * p->src_stride, p->page_len,
                                    s->s);
    } else {
        CUdeviceptr idx = 0;
        rc = stage_indices(d, s, &op, p, &idx);
        if (rc) {
            b->nops--;
            if (op.big_dev)
                (void)d->cu->mem_free(op.big_dev);
            if (op.big_host)
                (void)d->cu->mem_free_host(op.big_host);
            return rc;
        }
        uint64_t warps_per_block = NVL_BLOCK / 32;
        uint64_t blocks = (p->count + warps_per_block - 1) / warps_per_block;
        uint64_t cap = (uint64_t)d->dev[dev].sms * 8;
        unsigned grid = (unsigned)(blocks < cap ? blocks : cap);
        uint64_t src_stride = p->src_stride, dst_stride = p->dst_stride, page_len = p->page_len;
        uint64_t count = p->count;
        void *params[] = {&src, &src_stride, &dst, &dst_stride, &page_len, &count, &idx};
        r = d->cu->launch_kernel(d->dev[dev].fn, grid, 1, 1, NVL_BLOCK, 1, 1, 0, s->s, params,
                                 NULL);
    }
    if (r != CUDA_SUCCESS) { /* stays in the batch: copies before it may still be running */
        op.o.status = AFP_EIO;
        op.o.text = afn_dup_text("paged copy of %llu pages: %s [nvlink]", (unsigned long long)p->count,
                           afnv_cuda_errstr(d->cu, r));
    }
    *slot = op;
    return 0;
}

static int nvl_post_send(afp_domain *d, uint64_t peer, const void *buf, uint64_t len, void *desc,
                         uint64_t ctx)
{
    (void)desc;
    return afn_post_send(&d->c, peer, buf, len, ctx);
}

static int nvl_post_recv(afp_domain *d, void *buf, uint64_t len, void *desc, uint64_t ctx)
{
    (void)desc;
    return afn_post_recv(&d->c, buf, len, ctx);
}

/* ------------------------------------------------------------------------------------ */
/* Polling                                                                               */

static void reap_streams(afp_domain *d)
{
    for (int k = 0; k < d->ndev && k < (int)NVL_MAX_DEV; k++) {
        nvl_dev *v = &d->dev[k];
        bool busy = false;
        for (uint32_t j = 0; v->ok && j < NVL_STREAMS; j++)
            busy |= v->st[j].head != NULL;
        if (!busy)
            continue;
        (void)d->cu->ctx_set_current(v->ctx); /* the events belong to this context */
        for (uint32_t j = 0; j < NVL_STREAMS; j++) {
            nvl_stream *s = &v->st[j];
            nvl_batch *b;
            while ((b = s->head) != NULL) {
                CUresult r = d->cu->event_query(b->ev);
                if (r == CUDA_ERROR_NOT_READY)
                    break;
                for (uint32_t i = 0; i < b->nops; i++) {
                    nvl_op *op = &b->ops[i];
                    if (r != CUDA_SUCCESS && !op->o.status) {
                        op->o.status = AFP_EIO;
                        op->o.text = afn_dup_text("copy failed: %s (CUresult %d) [nvlink]",
                                            afnv_cuda_errstr(d->cu, r), r);
                    }
                    afn_finish_op(&d->c, &op->o);
                }
                s->head = b->next;
                if (!s->head)
                    s->tail = NULL;
                s->stage_head = b->stage_end > s->stage_head ? b->stage_end : s->stage_head;
                d->inflight--;
                batch_free(d, b);
            }
        }
    }
}

static int nvl_poll(afp_domain *d, afp_event *ev, uint32_t max, uint32_t *n)
{
    *n = 0;
    if (d->inflight) {
        flush_batches(d);
        reap_streams(d);
    }
    uint32_t k = afn_poll_events(&d->c, ev, max);
    if (k == 0 && k < max && (d->inflight || d->c.nheld)) {
        /* Copies still on the GPU signal no fd: say "progressing" so that an adaptive worker
         * keeps polling instead of napping up to a millisecond past their completion. */
        ev[k++] = (afp_event){.kind = AFP_EV_ACTIVITY, .len = 0};
    }
    *n = k;
    return 0;
}

static int nvl_trywait(afp_domain *d)
{
    return afn_trywait(&d->c, d->inflight != 0);
}

/* ------------------------------------------------------------------------------------ */
/* Memory                                                                                */

static int nvl_reg_mr(afp_domain *d, void *addr, uint64_t len, uint32_t flags, int32_t device,
                      uint64_t requested_key, struct afp_mr **out, void **local_desc,
                      uint64_t *rkey, uint64_t *remote_base)
{
    (void)requested_key; /* keys name export entries: the provider picks them */
    const struct afnv_cuda *cu = d->cu;
    CUresult r;
    int rc;
    if (!(flags & AFP_MR_DEVICE)) {
        if (flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ))
            return DERR(d, AFP_EUNSUPPORTED,
                        "nvlink writes into (reads from) CUDA device memory only: host memory "
                        "can be a local source or destination, not a target (use shm for host "
                        "memory)");
        struct afp_mr *m = calloc(1, sizeof *m);
        if (!m)
            return DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
        *m = (struct afp_mr){-1, 0, false, (uint64_t)(uintptr_t)addr, len};
        *out = m;
        *local_desc = m;
        *rkey = 0;
        *remote_base = (uint64_t)(uintptr_t)addr;
        return 0;
    }
    if ((rc = dev_ready(d, device)))
        return rc;
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)addr;
    unsigned mtype = 0;
    int ordinal = -1;
    if ((r = cu->pointer_get_attribute(&mtype, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p)) !=
            CUDA_SUCCESS ||
        mtype != CU_MEMORYTYPE_DEVICE)
        return DERR(d, AFP_EREG, "%p is not CUDA device memory [nvlink]", addr);
    if ((r = cu->pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p)) !=
            CUDA_SUCCESS ||
        ordinal != device)
        return DERR(d, AFP_EREG, "%p lives on CUDA device %d, not %d [nvlink]", addr, ordinal,
                    device);
    CUdeviceptr base = 0;
    size_t size = 0;
    if ((r = cu->mem_get_address_range(&base, &size, p)) != CUDA_SUCCESS)
        return cuda_fail(d, AFP_EREG, "cuMemGetAddressRange", r);
    if (p - base + len > size)
        return DERR(d, AFP_EREG, "[%p, +%llu) runs past its CUDA allocation [nvlink]", addr,
                    (unsigned long long)len);
    struct afp_mr *m = calloc(1, sizeof *m);
    if (!m)
        return DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
    *m = (struct afp_mr){device, 0, false, (uint64_t)p, len};
    *rkey = 0;
    if (flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ)) {
        CUipcMemHandle h;
        if ((r = cu->ipc_get_mem_handle(&h, base)) != CUDA_SUCCESS) {
            free(m);
            return DERR(d, AFP_EREG,
                        "cuIpcGetMemHandle: %s (CUresult %d): the allocation cannot be shared "
                        "through CUDA IPC (cudaMalloc'ed memory can; cuMem/VMM allocations such "
                        "as torch's expandable segments cannot) [nvlink]",
                        afnv_cuda_errstr(cu, r), r);
        }
        uint32_t idx = afn_export_take(&d->c);
        if (idx == UINT32_MAX) {
            free(m);
            return DERR(d, AFP_ENOMEM, "more than %u regions registered [nvlink]", MB_EXPORTS);
        }
        mb_export *e = &mb_exports(&d->c.seg)[idx];
        e->base = (uint64_t)p;
        e->len = len;
        e->alloc_base = base;
        e->proc_token = afnv_process_token();
        e->pid = (int32_t)getpid();
        e->device = device;
        e->gpu = d->pci[device];
        memcpy(e->handle, &h, sizeof h);
        e->access = flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ);
        *rkey = afn_export_publish(&d->c, idx); /* live */
        m->export_idx = idx;
        m->exported = true;
    }
    *out = m;
    *local_desc = m;
    *remote_base = (uint64_t)p;
    return 0;
}

static int nvl_dereg_mr(afp_domain *d, struct afp_mr *m)
{
    if (!m)
        return 0;
    if (m->exported)
        afn_export_revoke(&d->c, m->export_idx); /* revoked */
    free(m);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Domain                                                                                */

static int parse_nic(const char *nic, int *ordinal)
{
    if (!nic || !*nic) {
        *ordinal = -1;
        return 0;
    }
    char *end = NULL;
    if (strncmp(nic, "cuda", 4) != 0)
        return -1;
    long v = strtol(nic + 4, &end, 10);
    if (!end || *end || end == nic + 4 || v < 0 || v >= (long)NVL_MAX_DEV)
        return -1;
    *ordinal = (int)v;
    return 0;
}

static void nvl_close(afp_domain *d);

static int nvl_open(const afp_open_args *args, afp_domain **out, char *err, size_t errlen)
{
    *out = NULL;
    const char *why = NULL;
    const struct afnv_cuda *cu = afnv_cuda_get(&why);
    if (!cu) {
        afp_errf(err, errlen, "%s", why);
        return AFP_ENODEV;
    }
    int ndev = 0, rc = dev_count(cu, &ndev, err, errlen);
    if (rc)
        return rc;
    int home = -1;
    if (parse_nic(args->nic, &home) != 0) {
        afp_errf(err, errlen, "nvlink NICs are named cuda<N> (got \"%s\")", args->nic);
        return AFP_ENODEV;
    }
    if (home < 0)
        home = 0;
    if (home >= ndev) {
        afp_errf(err, errlen, "no CUDA GPU %s (%d GPU(s))", args->nic ? args->nic : "cuda0", ndev);
        return AFP_ENODEV;
    }
    afp_domain *d = calloc(1, sizeof *d);
    if (!d) {
        afp_errf(err, errlen, "out of memory");
        return AFP_ENOMEM;
    }
    d->cu = cu;
    d->home = home;
    d->ndev = ndev < (int)NVL_MAX_DEV ? ndev : (int)NVL_MAX_DEV;
    map_reach(d);
    uint64_t token = afnv_process_token() ^ (uint64_t)(uintptr_t)d ^ afn_now_ns();
    if ((rc = afn_open(&d->c, &NVL_KIND, NVL_ADDR_MAGIC, token, err, errlen)) != 0)
        goto out_fail;
    if ((rc = dev_ready(d, home))) {
        afp_errf(err, errlen, "%s", d->c.errbuf);
        goto out_fail;
    }
    *out = d;
    return 0;
out_fail:
    nvl_close(d);
    return rc;
}

static void forget_maps(afp_domain *d, uint64_t peer)
{
    uint32_t keep = 0;
    for (uint32_t i = 0; i < d->nmaps; i++) {
        if (peer == 0 || d->maps[i].peer == peer)
            afnv_ipc_close(d->cu, d->maps[i].mapped);
        else
            d->maps[keep++] = d->maps[i];
    }
    d->nmaps = keep;
}

static void sync_all(afp_domain *d)
{
    for (int k = 0; k < d->ndev && k < (int)NVL_MAX_DEV; k++) {
        nvl_dev *v = &d->dev[k];
        if (!v->ready)
            continue;
        (void)d->cu->ctx_set_current(v->ctx);
        for (uint32_t j = 0; j < NVL_STREAMS; j++)
            if (v->st[j].s)
                (void)d->cu->stream_synchronize(v->st[j].s);
    }
}

static void nvl_close(afp_domain *d)
{
    if (!d)
        return;
    flush_batches(d);
    sync_all(d); /* nothing of ours may still be writing into a mapping we close */
    reap_streams(d);
    forget_maps(d, 0);
    for (int k = 0; k < d->ndev && k < (int)NVL_MAX_DEV; k++)
        dev_release(d, &d->dev[k]);
    while (d->free_batches) {
        nvl_batch *b = d->free_batches;
        d->free_batches = b->next;
        free(b->ops);
        free(b);
    }
    afn_close(&d->c);
    free(d->maps);
    free(d);
}

static const char *nvl_errbuf(afp_domain *d)
{
    return d->c.errbuf;
}

static int nvl_caps(afp_domain *d, afp_caps *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->provider, sizeof out->provider, "nvlink;cuda-ipc");
    out->flags = AFP_CAP_DEVICE_MEM | AFP_CAP_VIRT_ADDR | AFP_CAP_PROV_KEY |
                 AFP_CAP_DELIVERY_COMPLETE | AFP_CAP_MR_LOCAL | AFP_CAP_DEVICE_ONLY;
    out->imm_size = 4;
    out->max_msg_size = NVL_MAX_WRITE;
    out->inject_size = 0;
    out->addr_len = sizeof(afn_addr);
    out->wait_fd = d->c.wake_fd;
    return 0;
}

static int nvl_address(afp_domain *d, void *buf, size_t *len)
{
    return afn_address(&d->c, buf, len);
}

static int nvl_resolve(afp_domain *d, const void *addr, size_t len, uint64_t *peer)
{
    return afn_resolve(&d->c, addr, len, peer);
}

static int nvl_forget(afp_domain *d, uint64_t peer)
{
    if (!afn_peer_of(&d->c, peer))
        return DERR(d, AFP_EINVAL, "unknown peer [nvlink]");
    flush_batches(d);
    sync_all(d);
    reap_streams(d);
    forget_maps(d, peer);
    return afn_forget(&d->c, peer);
}

static const struct afp_ops nvl_ops = {
    .size = sizeof(struct afp_ops),
    .major = AFP_ABI_MAJOR,
    .minor = AFP_ABI_MINOR,
    .name = "nvlink",
    .list_nics = nvl_list_nics,
    .open = nvl_open,
    .close = nvl_close,
    .errbuf = nvl_errbuf,
    .caps = nvl_caps,
    .address = nvl_address,
    .reg_mr = nvl_reg_mr,
    .dereg_mr = nvl_dereg_mr,
    .resolve = nvl_resolve,
    .forget = nvl_forget,
    .post_writes = nvl_post_writes,
    .post_send = nvl_post_send,
    .post_recv = nvl_post_recv,
    .poll = nvl_poll,
    .trywait = nvl_trywait,
    .post_paged = nvl_post_paged,
    .post_reads = nvl_post_reads,
};

__attribute__((visibility("default"))) const struct afp_ops *afp_get_ops(void)
{
    return &nvl_ops;
}
