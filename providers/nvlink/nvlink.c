/*
 * afabric provider "nvlink": GPU-to-GPU writes between processes (and engines) of one node,
 * through CUDA IPC, with the transport contract of the other providers.
 *
 *  - Registering device memory exports it: the CUDA IPC handle of the allocation holding it
 *    goes into an entry of this domain's export table (shared memory, nvl_mbox.h); the
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
 * On a machine without CUDA, or with fewer than two GPUs that can reach each other,
 * list_nics/open fail with AFP_ENODEV and say why: the provider is then unavailable.
 *
 * Threading: every call on a domain comes from the shim's worker thread (ABI rule), so
 * the domain needs no lock; only the peer-facing mailbox is shared, under its own mutex.
 */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "afabric_provider.h"
#include "nvl_copy_ptx.h"
#include "nvl_cuda.h"
#include "nvl_mbox.h"

#define NVL_MAX_DEV 16u
#define NVL_STREAMS 4u            /* per source GPU, taken in turn by post calls */
#define NVL_STAGE_BYTES (8u << 20) /* per stream: page indices of paged writes in flight */
#define NVL_BLOCK 256u             /* copy kernel: 8 warps per block, one page per warp */
#define NVL_ADDR_MAGIC 0x314c564eu /* "NVL1" */
#define NVL_LIVENESS_NS 200000ull  /* a peer's flock is probed at most every 200 us */
#define NVL_MAX_WRITE (1ull << 40)

/* ------------------------------------------------------------------------------------ */
/* Types                                                                                 */

typedef struct nvl_addr {
    uint32_t magic;
    uint32_t version;
    uint64_t token;
    uint8_t boot_id[16]; /* same node (kernel boot) as us? */
    char seg[MB_NAME_LEN];
} nvl_addr;

struct afp_mr {
    int32_t device; /* -1: host memory (local source only) */
    uint32_t export_idx;
    bool exported;
    uint64_t addr, len;
};

typedef struct nvl_peer {
    bool used, dead;
    mb_seg seg;
    uint64_t token;
    uint64_t checked_ns;
    struct sockaddr_un wake;
    socklen_t wake_len;
} nvl_peer;

typedef struct nvl_import {
    uint64_t peer, key; /* 0 key: empty slot */
    uint64_t gen_addr;  /* where the entry's generation lives (the peer's mapping) */
    uint64_t base, len; /* owner's registered range */
    int64_t delta;      /* our address = owner's address + delta */
    uint32_t access;    /* what the owner allows: AFP_MR_REMOTE | AFP_MR_REMOTE_READ */
    bool tomb;
} nvl_import;

typedef struct nvl_map { /* an IPC mapping this domain holds a reference to */
    uint64_t peer;
    CUdeviceptr mapped;
} nvl_map;

typedef struct nvl_op {
    uint64_t ctx;
    uint64_t peer;
    uint64_t arrivals; /* immediates to deliver once the copy completed (0: none) */
    uint32_t imm;
    int32_t status;
    char *text;
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

typedef struct nvl_ev { /* a completion waiting to be handed to the shim */
    uint32_t kind, op;
    int32_t status;
    uint32_t imm;
    uint64_t ctx, len;
    char *text;
} nvl_ev;

typedef struct nvl_recv {
    void *buf;
    uint64_t len, ctx;
} nvl_recv;

struct afp_domain {
    const struct afnv_cuda *cu;
    int home; /* the GPU named at open: IPC mappings for host sources are made there */
    int ndev;
    nvl_dev dev[NVL_MAX_DEV];
    uint64_t token;
    uint8_t boot_id[16];
    mb_seg seg;     /* ours */
    int wake_fd;    /* bound to our abstract name: the wait fd */
    int send_fd;    /* for waking peers */
    uint32_t free_exports, next_export; /* export slots: free list through export_next */
    uint32_t *export_next;

    nvl_peer *peers;
    uint32_t npeers, peers_cap;
    nvl_import *imports;
    uint32_t imp_cap, imp_len; /* open addressing, power of two */
    nvl_map *maps;
    uint32_t nmaps, maps_cap;

    uint64_t inflight; /* batches open or not yet complete */
    nvl_op *held;      /* completed copies whose immediate waits for mailbox room */
    uint32_t nheld, held_cap;
    nvl_ev *evq;       /* ring of completions for poll */
    uint32_t evq_head, evq_len, evq_cap;
    nvl_recv *rq;      /* posted receives, FIFO ring */
    uint32_t rq_head, rq_len, rq_cap;
    nvl_batch *free_batches;

    char errbuf[AFP_ERRTEXT_LEN];
};

/* ------------------------------------------------------------------------------------ */
/* Errors and small helpers                                                              */

#define DERR(d, code, ...) (afp_errf((d)->errbuf, sizeof (d)->errbuf, __VA_ARGS__), (code))

static int cuda_fail(afp_domain *d, int code, const char *what, CUresult r)
{
    return DERR(d, code, "%s: %s (CUresult %d) [nvlink]", what, afnv_cuda_errstr(d->cu, r), r);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void read_boot_id(uint8_t out[16])
{
    memset(out, 0, 16);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f)
        return;
    char line[64] = "";
    if (fgets(line, sizeof line, f)) {
        uint32_t n = 0;
        for (char *p = line; *p && n < 32; p++) {
            int v = (*p >= '0' && *p <= '9') ? *p - '0'
                    : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10
                                               : -1;
            if (v < 0)
                continue;
            out[n / 2] |= (uint8_t)(n % 2 ? v : v << 4);
            n++;
        }
    }
    fclose(f);
}

static void wake_name(uint64_t token, struct sockaddr_un *sa, socklen_t *len)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    /* abstract namespace: sun_path[0] = 0, nothing left on the file system */
    int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "afabric-nvl-%016llx",
                     (unsigned long long)token);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static void *grow(void *p, uint32_t *cap, uint32_t need, size_t elem)
{
    if (need <= *cap)
        return p;
    uint32_t c = *cap ? *cap : 16;
    while (c < need)
        c *= 2;
    void *q = realloc(p, (size_t)c * elem);
    if (q)
        *cap = c;
    return q;
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

/* GPUs that reach at least one other GPU by peer access (NVLink or PCIe P2P). */
static int peer_capable(const struct afnv_cuda *cu, int ndev, bool *ok)
{
    int usable = 0;
    for (int i = 0; i < ndev && i < (int)NVL_MAX_DEV; i++) {
        ok[i] = false;
        for (int j = 0; j < ndev; j++) {
            int can = 0;
            CUdevice a, b;
            if (i == j || cu->device_get(&a, i) != CUDA_SUCCESS ||
                cu->device_get(&b, j) != CUDA_SUCCESS)
                continue;
            if (cu->device_can_access_peer(&can, a, b) == CUDA_SUCCESS && can) {
                ok[i] = true;
                break;
            }
        }
        usable += ok[i];
    }
    return usable;
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
    bool ok[NVL_MAX_DEV];
    int usable = peer_capable(cu, ndev, ok);
    if (usable < 2) {
        afp_errf(err, errlen, "nvlink needs two or more CUDA GPUs with peer access; %d GPU(s), %d "
                          "with a peer", ndev, usable);
        return AFP_ENODEV;
    }
    uint32_t count = 0;
    for (int i = 0; i < ndev && i < (int)NVL_MAX_DEV; i++) {
        if (!ok[i])
            continue;
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
        afp_errf(err, errlen, "no CUDA GPU named %s with peer access", args->nic);
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

static void push_ev(afp_domain *d, uint32_t kind, int32_t status, uint64_t ctx, uint32_t imm,
                    uint64_t len, uint32_t op, char *text)
{
    if (d->evq_len == d->evq_cap) {
        uint32_t cap = d->evq_cap ? d->evq_cap * 2 : 256;
        nvl_ev *q = malloc((size_t)cap * sizeof *q);
        if (!q) { /* cannot queue it: the shim's op timeout fails the operation */
            free(text);
            return;
        }
        for (uint32_t i = 0; i < d->evq_len; i++)
            q[i] = d->evq[(d->evq_head + i) % d->evq_cap];
        free(d->evq);
        d->evq = q;
        d->evq_cap = cap;
        d->evq_head = 0;
    }
    nvl_ev *e = &d->evq[(d->evq_head + d->evq_len) % d->evq_cap];
    *e = (nvl_ev){kind, op, status, imm, ctx, len, text};
    d->evq_len++;
}

static char *dup_text(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *dup_text(const char *fmt, ...)
{
    char buf[AFP_ERRTEXT_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return strdup(buf);
}

static void write_failed(afp_domain *d, uint64_t ctx, int status, char *text)
{
    push_ev(d, AFP_EV_ERROR, status, ctx, 0, 0, AFP_EV_WRITE_DONE, text);
}

/* ------------------------------------------------------------------------------------ */
/* Peers                                                                                 */

static nvl_peer *peer_of(afp_domain *d, uint64_t handle)
{
    if (handle == 0 || handle > d->npeers || !d->peers[handle - 1].used)
        return NULL;
    return &d->peers[handle - 1];
}

/* Alive, as far as we can tell at most NVL_LIVENESS_NS ago. */
static bool peer_alive(nvl_peer *p, bool force)
{
    if (p->dead)
        return false;
    uint64_t t = now_ns();
    if (force || t - p->checked_ns > NVL_LIVENESS_NS) {
        p->checked_ns = t;
        if (!mb_alive(&p->seg))
            p->dead = true;
    }
    return !p->dead;
}

static void wake_peer(afp_domain *d, nvl_peer *p)
{
    if (!atomic_load_explicit(&p->seg.hdr->sleeping, memory_order_acquire) || d->send_fd < 0)
        return;
    char one = 1;
    (void)sendto(d->send_fd, &one, 1, MSG_DONTWAIT, (struct sockaddr *)&p->wake, p->wake_len);
}

/* Deliver `arrivals` of an immediate. 0, AFP_EAGAIN (mailbox full) or AFP_EPEER. */
static int deliver_imm(afp_domain *d, uint64_t peer, uint32_t imm, uint64_t arrivals)
{
    nvl_peer *p = peer_of(d, peer);
    if (!p || !peer_alive(p, false))
        return AFP_EPEER;
    int rc = mb_push(p->seg.hdr, MB_REC_IMM, imm, arrivals, NULL, 0);
    if (rc == -EAGAIN)
        return peer_alive(p, true) ? AFP_EAGAIN : AFP_EPEER;
    wake_peer(d, p);
    return 0;
}

static void finish_op(afp_domain *d, nvl_op *op)
{
    if (op->status) {
        write_failed(d, op->ctx, op->status, op->text);
        op->text = NULL;
        return;
    }
    if (op->arrivals) {
        int rc = deliver_imm(d, op->peer, op->imm, op->arrivals);
        if (rc == AFP_EAGAIN) { /* the target is not draining: retry on the next poll */
            nvl_op *h = grow(d->held, &d->held_cap, d->nheld + 1, sizeof *h);
            if (h) {
                d->held = h;
                d->held[d->nheld++] = *op;
                return;
            }
            rc = AFP_ENOMEM;
        }
        if (rc) {
            write_failed(d, op->ctx, rc,
                         dup_text("immediate %u not delivered: %s [nvlink]", op->imm,
                                  rc == AFP_EPEER ? "target process is gone" : "out of memory"));
            return;
        }
    }
    push_ev(d, AFP_EV_WRITE_DONE, 0, op->ctx, 0, 0, 0, NULL);
}

/* ------------------------------------------------------------------------------------ */
/* Imports: (peer, key) -> our address for the peer's region                             */

static uint64_t imp_hash(uint64_t peer, uint64_t key)
{
    uint64_t x = key ^ (peer * 0x9e3779b97f4a7c15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static nvl_import *imp_find(afp_domain *d, uint64_t peer, uint64_t key)
{
    if (!d->imp_cap)
        return NULL;
    uint32_t mask = d->imp_cap - 1;
    for (uint32_t i = (uint32_t)imp_hash(peer, key) & mask, n = 0; n < d->imp_cap;
         i = (i + 1) & mask, n++) {
        nvl_import *e = &d->imports[i];
        if (!e->key && !e->tomb)
            return NULL;
        if (!e->tomb && e->key == key && e->peer == peer)
            return e;
    }
    return NULL;
}

static nvl_import *imp_insert(afp_domain *d, uint64_t peer, uint64_t key)
{
    if ((d->imp_len + 1) * 2 > d->imp_cap) {
        uint32_t cap = d->imp_cap ? d->imp_cap * 2 : 256;
        nvl_import *old = d->imports;
        uint32_t old_cap = d->imp_cap;
        nvl_import *t = calloc(cap, sizeof *t);
        if (!t)
            return NULL;
        d->imports = t;
        d->imp_cap = cap;
        d->imp_len = 0;
        for (uint32_t i = 0; i < old_cap; i++)
            if (old[i].key && !old[i].tomb) {
                nvl_import *e = imp_insert(d, old[i].peer, old[i].key);
                *e = old[i];
            }
        free(old);
    }
    uint32_t mask = d->imp_cap - 1;
    uint32_t i = (uint32_t)imp_hash(peer, key) & mask;
    while (d->imports[i].key && !d->imports[i].tomb)
        i = (i + 1) & mask;
    nvl_import *e = &d->imports[i];
    memset(e, 0, sizeof *e);
    e->peer = peer;
    e->key = key;
    d->imp_len++;
    return e;
}

static void imp_remove(nvl_import *e)
{
    e->tomb = true;
}

static int remember_map(afp_domain *d, uint64_t peer, CUdeviceptr mapped)
{
    nvl_map *m = grow(d->maps, &d->maps_cap, d->nmaps + 1, sizeof *m);
    if (!m)
        return AFP_ENOMEM;
    d->maps = m;
    d->maps[d->nmaps++] = (nvl_map){peer, mapped};
    return 0;
}

/* Copy a live export entry out of the peer's table (seqlock): 0, or AFP_EKEY if the key
 * does not name a live entry. */
static int read_export(nvl_peer *p, uint64_t key, mb_export *out)
{
    uint32_t idx = (uint32_t)(key & 0xffffffffu);
    uint64_t gen = key >> 32;
    if (idx >= p->seg.hdr->nexports || !(gen & 1u))
        return AFP_EKEY;
    mb_export *e = &mb_exports(p->seg.hdr)[idx];
    uint64_t g1 = atomic_load_explicit(&e->gen, memory_order_acquire);
    memcpy((uint8_t *)out + sizeof out->gen, (uint8_t *)e + sizeof e->gen,
           sizeof *e - sizeof e->gen);
    atomic_thread_fence(memory_order_acquire);
    uint64_t g2 = atomic_load_explicit(&e->gen, memory_order_relaxed);
    if (g1 != gen || g2 != gen)
        return AFP_EKEY;
    return 0;
}

/* Where to write (or, `need` AFP_MR_REMOTE_READ, read) [raddr, +len) of region `key` of
 * `peer`, checked against the owner's export entry (not the descriptor, which a peer could
 * forge): its range and what it allows. */
static int translate(afp_domain *d, uint64_t peer, uint64_t key, uint64_t raddr, uint64_t len,
                     uint32_t need, uint64_t *out)
{
    nvl_peer *p = peer_of(d, peer);
    if (!p)
        return DERR(d, AFP_EPEER, "unknown peer handle %llu [nvlink]", (unsigned long long)peer);
    if (!peer_alive(p, false))
        return DERR(d, AFP_EPEER, "peer process %d is gone [nvlink]", p->seg.hdr->pid);
    nvl_import *im = imp_find(d, peer, key);
    if (im && atomic_load_explicit((_Atomic uint64_t *)(uintptr_t)im->gen_addr,
                                   memory_order_acquire) != key >> 32) {
        imp_remove(im); /* deregistered since: refused below */
        im = NULL;
    }
    if (!im) {
        mb_export e;
        if (read_export(p, key, &e))
            return DERR(d, AFP_EKEY, "remote key %016llx is not (or no longer) registered at the "
                                     "target [nvlink]", (unsigned long long)key);
        int64_t delta;
        if (e.proc_token == afnv_process_token() && e.pid == (int32_t)getpid()) {
            delta = 0; /* our own process: the owner's addresses are ours */
        } else {
            CUdeviceptr mapped = 0;
            CUresult cr;
            if (afnv_ipc_open(d->cu, &e.handle, &mapped, &cr) != 0)
                return cr ? cuda_fail(d, AFP_EKEY, "cuIpcOpenMemHandle", cr)
                          : DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
            if (remember_map(d, peer, mapped)) {
                afnv_ipc_close(d->cu, mapped);
                return DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
            }
            delta = (int64_t)(mapped - e.alloc_base);
        }
        im = imp_insert(d, peer, key);
        if (!im)
            return DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
        im->gen_addr = (uint64_t)(uintptr_t)&mb_exports(p->seg.hdr)[key & 0xffffffffu].gen;
        im->base = e.base;
        im->len = e.len;
        im->delta = delta;
        im->access = e.access ? e.access : AFP_MR_REMOTE;
    }
    if (!(im->access & need))
        return DERR(d, AFP_EKEY, "remote region does not allow %s (registered without it) "
                                 "[nvlink]", need == AFP_MR_REMOTE_READ ? "reads" : "writes");
    if (raddr < im->base || len > im->len || raddr - im->base > im->len - len)
        return DERR(d, AFP_EKEY,
                    "remote access [%llx, +%llu) outside the registered region [%llx, +%llu) "
                    "[nvlink]",
                    (unsigned long long)raddr, (unsigned long long)len,
                    (unsigned long long)im->base, (unsigned long long)im->len);
    *out = (uint64_t)((int64_t)raddr + im->delta);
    return 0;
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
        CUevent *e = grow(v->free_events, &v->free_events_cap, v->nfree_events + 1, sizeof *e);
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
    nvl_op *ops = grow(b->ops, &b->cap, b->nops + 1, sizeof *ops);
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
            if (!b->ops[i].status) {
                b->ops[i].status = AFP_EIO;
                b->ops[i].text = dup_text("cuEventRecord: %s [nvlink]", afnv_cuda_errstr(d->cu, r));
            }
        for (uint32_t i = 0; i < b->nops; i++)
            finish_op(d, &b->ops[i]);
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
        nvl_op op = {w->ctx, w->peer, w->has_imm ? 1u : 0u, w->imm, 0, NULL, 0, NULL};
        uint64_t dst = 0;
        int trc = translate(d, w->peer, w->remote_key, w->remote_addr, w->length, AFP_MR_REMOTE,
                            &dst);
        if (trc || w->length == 0) { /* nothing for the GPU: done (or failed) now */
            op.status = trc;
            op.text = trc ? strdup(d->errbuf) : NULL;
            finish_op(d, &op);
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
            op.status = AFP_EIO;
            op.text = dup_text("cuMemcpyAsync of %llu bytes: %s [nvlink]",
                               (unsigned long long)w->length, afnv_cuda_errstr(d->cu, r));
            finish_op(d, &op);
        } else {
            *slot = op;
        }
        (*posted)++;
    }
    return 0;
}

/* Reads: the write path's copy in the other direction (from the peer's exported memory,
 * mapped here, into the local region), on a stream of the local region's device. Written to
 * mirror nvl_post_writes; not run on a GPU machine yet. */
static int nvl_post_reads(afp_domain *d, const afp_write *rd, uint32_t n, uint32_t *posted)
{
    *posted = 0;
    for (uint32_t i = 0; i < n; i++) {
        const afp_write *w = &rd[i];
        int dev = src_device(d, w->local_desc);
        int rc = dev_ready(d, dev);
        if (rc)
            return *posted ? 0 : rc;
        nvl_op op = {w->ctx, w->peer, 0u, 0u, 0, NULL, 0, NULL};
        uint64_t src = 0;
        int trc = translate(d, w->peer, w->remote_key, w->remote_addr, w->length,
                            AFP_MR_REMOTE_READ, &src);
        if (trc || w->length == 0) {
            op.status = trc;
            op.text = trc ? strdup(d->errbuf) : NULL;
            finish_op(d, &op);
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
            op.status = AFP_EIO;
            op.text = dup_text("cuMemcpyAsync (read) of %llu bytes: %s [nvlink]",
                               (unsigned long long)w->length, afnv_cuda_errstr(d->cu, r));
            finish_op(d, &op);
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
    nvl_op op = {p->ctx, p->peer, p->has_imm ? p->count : 0, p->imm, 0, NULL, 0, NULL};
    /* the shim checked the pages against the descriptor's length; the owner's export entry
     * is what counts (a descriptor can be forged) */
    uint64_t span = (uint64_t)max_index(p->dst_idx, p->count) * p->dst_stride + p->page_len;
    uint64_t dst = 0;
    int trc = translate(d, p->peer, p->remote_key, p->remote_base + p->dst_offset, span,
                        AFP_MR_REMOTE, &dst);
    if (trc || p->page_len == 0) { /* refused, or only arrivals to deliver */
        op.status = trc;
        op.text = trc ? strdup(d->errbuf) : NULL;
        finish_op(d, &op);
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
        op.status = AFP_EIO;
        op.text = dup_text("paged copy of %llu pages: %s [nvlink]", (unsigned long long)p->count,
                           afnv_cuda_errstr(d->cu, r));
    }
    *slot = op;
    return 0;
}

static int nvl_post_send(afp_domain *d, uint64_t peer, const void *buf, uint64_t len, void *desc,
                         uint64_t ctx)
{
    (void)desc;
    nvl_peer *p = peer_of(d, peer);
    if (!p || !peer_alive(p, false)) {
        push_ev(d, AFP_EV_ERROR, AFP_EPEER, ctx, 0, 0, AFP_EV_SEND_DONE,
                dup_text("send: peer process is gone [nvlink]"));
        return 0;
    }
    int rc = mb_push(p->seg.hdr, MB_REC_MSG, 0, len, buf, len);
    if (rc == -EAGAIN)
        return peer_alive(p, true) ? AFP_EAGAIN : DERR(d, AFP_EPEER, "peer is gone [nvlink]");
    if (rc == -EINVAL)
        return DERR(d, AFP_ETOOBIG, "message of %llu bytes exceeds nvlink's %u [nvlink]",
                    (unsigned long long)len, MB_MAX_MSG);
    wake_peer(d, p);
    push_ev(d, AFP_EV_SEND_DONE, 0, ctx, 0, len, 0, NULL);
    return 0;
}

static int nvl_post_recv(afp_domain *d, void *buf, uint64_t len, void *desc, uint64_t ctx)
{
    (void)desc;
    if (d->rq_len == d->rq_cap) {
        uint32_t cap = d->rq_cap ? d->rq_cap * 2 : 64;
        nvl_recv *q = malloc((size_t)cap * sizeof *q);
        if (!q)
            return DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
        for (uint32_t i = 0; i < d->rq_len; i++)
            q[i] = d->rq[(d->rq_head + i) % d->rq_cap];
        free(d->rq);
        d->rq = q;
        d->rq_cap = cap;
        d->rq_head = 0;
    }
    d->rq[(d->rq_head + d->rq_len) % d->rq_cap] = (nvl_recv){buf, len, ctx};
    d->rq_len++;
    return 0;
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
                    if (r != CUDA_SUCCESS && !op->status) {
                        op->status = AFP_EIO;
                        op->text = dup_text("copy failed: %s (CUresult %d) [nvlink]",
                                            afnv_cuda_errstr(d->cu, r), r);
                    }
                    finish_op(d, op);
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

static void retry_held(afp_domain *d)
{
    uint32_t n = d->nheld;
    d->nheld = 0;
    for (uint32_t i = 0; i < n; i++) {
        nvl_op op = d->held[i];
        finish_op(d, &op); /* re-holds it if the mailbox is still full */
    }
}

/* Our mailbox: immediates and messages from peers. */
static uint32_t drain_mailbox(afp_domain *d, uint32_t room)
{
    mb_header *h = d->seg.hdr;
    if (atomic_load_explicit(&h->tail_pub, memory_order_acquire) == h->head)
        return 0;
    uint32_t made = 0;
    mb_lock(h);
    mb_rec *r;
    while (made < room && (r = mb_peek(h)) != NULL) {
        if (r->kind == MB_REC_IMM) {
            while (r->arg && made < room) {
                push_ev(d, AFP_EV_IMM, 0, 0, r->imm, 0, 0, NULL);
                r->arg--;
                made++;
            }
            if (r->arg)
                break;
            mb_pop(h);
        } else if (r->kind == MB_REC_MSG) {
            if (!d->rq_len)
                break; /* no receive posted: the message waits (the ring applies backpressure) */
            nvl_recv rv = d->rq[d->rq_head];
            d->rq_head = (d->rq_head + 1) % d->rq_cap;
            d->rq_len--;
            if (r->arg > rv.len) {
                push_ev(d, AFP_EV_ERROR, AFP_ETOOBIG, rv.ctx, 0, r->arg, AFP_EV_RECV,
                        dup_text("message of %llu bytes truncated by a %llu-byte receive [nvlink]",
                                 (unsigned long long)r->arg, (unsigned long long)rv.len));
            } else {
                memcpy(rv.buf, r + 1, r->arg);
                push_ev(d, AFP_EV_RECV, 0, rv.ctx, 0, r->arg, 0, NULL);
            }
            made++;
            mb_pop(h);
        } else {
            mb_pop(h); /* unknown record kind: skip it */
        }
    }
    mb_unlock(h);
    return made;
}

static int nvl_poll(afp_domain *d, afp_event *ev, uint32_t max, uint32_t *n)
{
    *n = 0;
    if (atomic_load_explicit(&d->seg.hdr->sleeping, memory_order_relaxed)) {
        atomic_store(&d->seg.hdr->sleeping, 0);
        char junk[64];
        while (d->wake_fd >= 0 && recv(d->wake_fd, junk, sizeof junk, MSG_DONTWAIT) > 0) {
        }
    }
    if (d->inflight) {
        flush_batches(d);
        reap_streams(d);
    }
    if (d->nheld)
        retry_held(d);
    if (d->evq_len < max)
        drain_mailbox(d, max - d->evq_len);
    uint32_t k = 0;
    while (k < max && d->evq_len) {
        nvl_ev *e = &d->evq[d->evq_head];
        afp_event *o = &ev[k++];
        o->kind = e->kind;
        o->status = e->status;
        o->ctx = e->ctx;
        o->len = e->len;
        o->imm = e->imm;
        o->op = e->op;
        o->errtext[0] = '\0';
        if (e->text) {
            snprintf(o->errtext, sizeof o->errtext, "%s", e->text);
            free(e->text);
        }
        d->evq_head = (d->evq_head + 1) % d->evq_cap;
        d->evq_len--;
    }
    if (k == 0 && k < max && (d->inflight || d->nheld)) {
        /* Copies still on the GPU signal no fd: say "progressing" so that an adaptive worker
         * keeps polling instead of napping up to a millisecond past their completion. */
        ev[k++] = (afp_event){.kind = AFP_EV_ACTIVITY, .len = 0};
    }
    *n = k;
    return 0;
}

static int nvl_trywait(afp_domain *d)
{
    if (d->wake_fd < 0 || d->inflight || d->nheld || d->evq_len)
        return AFP_EAGAIN;
    atomic_store(&d->seg.hdr->sleeping, 1);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load(&d->seg.hdr->tail_pub) != d->seg.hdr->head) {
        atomic_store(&d->seg.hdr->sleeping, 0);
        return AFP_EAGAIN;
    }
    return 0;
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
        if (d->free_exports == UINT32_MAX && d->next_export >= MB_EXPORTS) {
            free(m);
            return DERR(d, AFP_ENOMEM, "more than %u regions registered [nvlink]", MB_EXPORTS);
        }
        uint32_t idx;
        if (d->free_exports != UINT32_MAX) {
            idx = d->free_exports;
            d->free_exports = d->export_next[idx];
        } else {
            idx = d->next_export++;
        }
        mb_export *e = &mb_exports(d->seg.hdr)[idx];
        uint64_t gen = atomic_load(&e->gen); /* even: free */
        e->base = (uint64_t)p;
        e->len = len;
        e->alloc_base = base;
        e->proc_token = afnv_process_token();
        e->pid = (int32_t)getpid();
        e->device = device;
        e->handle = h;
        e->access = flags & (AFP_MR_REMOTE | AFP_MR_REMOTE_READ);
        atomic_store_explicit(&e->gen, gen + 1, memory_order_release); /* live */
        m->export_idx = idx;
        m->exported = true;
        *rkey = ((gen + 1) << 32) | idx;
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
    if (m->exported) {
        mb_export *e = &mb_exports(d->seg.hdr)[m->export_idx];
        atomic_store_explicit(&e->gen, atomic_load(&e->gen) + 1, memory_order_release); /* revoked */
        d->export_next[m->export_idx] = d->free_exports;
        d->free_exports = m->export_idx;
    }
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
    bool ok[NVL_MAX_DEV];
    if (peer_capable(cu, ndev, ok) < 2) {
        afp_errf(err, errlen, "nvlink needs two or more CUDA GPUs with peer access (%d GPU(s))", ndev);
        return AFP_ENODEV;
    }
    int home = -1;
    if (parse_nic(args->nic, &home) != 0) {
        afp_errf(err, errlen, "nvlink NICs are named cuda<N> (got \"%s\")", args->nic);
        return AFP_ENODEV;
    }
    if (home < 0)
        for (home = 0; home < ndev && !ok[home]; home++) {
        }
    if (home >= ndev || home >= (int)NVL_MAX_DEV || !ok[home]) {
        afp_errf(err, errlen, "no CUDA GPU %s with peer access", args->nic ? args->nic : "");
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
    d->wake_fd = d->send_fd = -1;
    d->seg.fd = -1;
    d->free_exports = UINT32_MAX;
    d->token = afnv_process_token() ^ (uint64_t)(uintptr_t)d ^ now_ns();
    d->token = d->token ? d->token : 1;
    read_boot_id(d->boot_id);
    d->export_next = calloc(MB_EXPORTS, sizeof *d->export_next);
    if (!d->export_next) {
        afp_errf(err, errlen, "out of memory");
        rc = AFP_ENOMEM;
        goto out_fail;
    }
    mb_reap(); /* segments of killed processes */
    if (mb_create(&d->seg, d->token, err, errlen) != 0) {
        rc = AFP_EIO;
        goto out_fail;
    }
    /* wakeups: optional (without them the shim naps at most 1 ms between polls) */
    struct sockaddr_un sa;
    socklen_t sl;
    wake_name(d->token, &sa, &sl);
    d->wake_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (d->wake_fd >= 0 && bind(d->wake_fd, (struct sockaddr *)&sa, sl) != 0) {
        close(d->wake_fd);
        d->wake_fd = -1;
    }
    d->send_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if ((rc = dev_ready(d, home))) {
        afp_errf(err, errlen, "%s", d->errbuf);
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
    for (uint32_t i = 0; i < d->npeers; i++)
        if (d->peers[i].used)
            mb_detach(&d->peers[i].seg, false);
    for (int k = 0; k < d->ndev && k < (int)NVL_MAX_DEV; k++)
        dev_release(d, &d->dev[k]);
    while (d->free_batches) {
        nvl_batch *b = d->free_batches;
        d->free_batches = b->next;
        free(b->ops);
        free(b);
    }
    for (uint32_t i = 0; i < d->evq_len; i++)
        free(d->evq[(d->evq_head + i) % d->evq_cap].text);
    for (uint32_t i = 0; i < d->nheld; i++)
        free(d->held[i].text);
    mb_detach(&d->seg, true);
    if (d->wake_fd >= 0)
        close(d->wake_fd);
    if (d->send_fd >= 0)
        close(d->send_fd);
    free(d->evq);
    free(d->rq);
    free(d->held);
    free(d->maps);
    free(d->imports);
    free(d->peers);
    free(d->export_next);
    free(d);
}

static const char *nvl_errbuf(afp_domain *d)
{
    return d->errbuf;
}

static int nvl_caps(afp_domain *d, afp_caps *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->provider, sizeof out->provider, "nvlink;cuda-ipc");
    out->flags = AFP_CAP_DEVICE_MEM | AFP_CAP_VIRT_ADDR | AFP_CAP_PROV_KEY |
                 AFP_CAP_DELIVERY_COMPLETE | AFP_CAP_MR_LOCAL;
    out->imm_size = 4;
    out->max_msg_size = NVL_MAX_WRITE;
    out->inject_size = 0;
    out->addr_len = sizeof(nvl_addr);
    out->wait_fd = d->wake_fd;
    return 0;
}

static int nvl_address(afp_domain *d, void *buf, size_t *len)
{
    if (*len < sizeof(nvl_addr))
        return DERR(d, AFP_ERANGE, "address needs %zu bytes [nvlink]", sizeof(nvl_addr));
    nvl_addr a;
    memset(&a, 0, sizeof a);
    a.magic = NVL_ADDR_MAGIC;
    a.version = MB_VERSION;
    a.token = d->token;
    memcpy(a.boot_id, d->boot_id, sizeof a.boot_id);
    snprintf(a.seg, sizeof a.seg, "%s", d->seg.name);
    memcpy(buf, &a, sizeof a);
    *len = sizeof a;
    return 0;
}

static int nvl_resolve(afp_domain *d, const void *addr, size_t len, uint64_t *peer)
{
    nvl_addr a;
    if (len != sizeof a)
        return DERR(d, AFP_EBADDESC, "not an nvlink address (%zu bytes) [nvlink]", len);
    memcpy(&a, addr, sizeof a);
    if (a.magic != NVL_ADDR_MAGIC || a.version != MB_VERSION || a.seg[MB_NAME_LEN - 1] != '\0')
        return DERR(d, AFP_EBADDESC, "not an nvlink address (bad magic or version) [nvlink]");
    if (memcmp(a.boot_id, d->boot_id, sizeof a.boot_id) != 0)
        return DERR(d, AFP_EPEER, "peer is on another node: nvlink reaches the processes of "
                                  "one node only [nvlink]");
    for (uint32_t i = 0; i < d->npeers; i++)
        if (d->peers[i].used && d->peers[i].token == a.token) {
            *peer = i + 1;
            return 0;
        }
    nvl_peer *ps = grow(d->peers, &d->peers_cap, d->npeers + 1, sizeof *ps);
    if (!ps)
        return DERR(d, AFP_ENOMEM, "out of memory [nvlink]");
    d->peers = ps;
    nvl_peer *p = &d->peers[d->npeers];
    memset(p, 0, sizeof *p);
    if (mb_attach(&p->seg, a.seg, a.token, d->errbuf, sizeof d->errbuf) != 0)
        return AFP_EPEER;
    if (!mb_alive(&p->seg)) {
        mb_detach(&p->seg, false);
        return DERR(d, AFP_EPEER, "peer %s is gone [nvlink]", a.seg);
    }
    p->used = true;
    p->token = a.token;
    p->checked_ns = now_ns();
    wake_name(a.token, &p->wake, &p->wake_len);
    d->npeers++;
    *peer = d->npeers;
    return 0;
}

static int nvl_forget(afp_domain *d, uint64_t peer)
{
    nvl_peer *p = peer_of(d, peer);
    if (!p)
        return DERR(d, AFP_EINVAL, "unknown peer [nvlink]");
    flush_batches(d);
    sync_all(d);
    reap_streams(d);
    for (uint32_t i = 0; i < d->imp_cap; i++)
        if (d->imports[i].peer == peer && d->imports[i].key && !d->imports[i].tomb)
            imp_remove(&d->imports[i]);
    forget_maps(d, peer);
    mb_detach(&p->seg, false);
    p->used = false;
    return 0;
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
