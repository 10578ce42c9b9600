/*
 * afabric provider over libibverbs (RC): ConnectX, and Soft-RoCE (rdma_rxe) in CI.
 *
 * A domain is one device port:
 *   - a protection domain, ONE completion queue for everything (with a completion
 *     channel, whose fd is the wait object for adaptive polling);
 *   - a UD queue pair for connection handshakes;
 *   - two shared receive queues: `srq_msg` holds the shim's receive buffers (SEND/RECV),
 *     `srq_imm` holds zero-length receives that WRITE_WITH_IMM consumes. The provider
 *     keeps srq_imm full itself (reposting as immediates arrive, in chains), so the shim
 *     never sees AFP_CAP_IMM_NEEDS_RECV and a burst of immediates never meets an empty
 *     queue (RNR). RECV and WRITE_WITH_IMM completions both consume posted receives in
 *     order, so they must not draw from the same queue: hence two.
 * Per peer, two RC queue pairs: `qp[VB_QP_MSG]` (SEND, attached to srq_msg) and
 * `qp[VB_QP_WR]` (RDMA WRITE / WRITE_WITH_IMM, attached to srq_imm). They are made on
 * first use through a three-way handshake over UD (see "Handshake" below), with
 * retransmission and a bounded timeout (AFABRIC_VERBS_CONNECT_TIMEOUT_MS, default 5 s)
 * after which the operations waiting for the peer fail with AFP_ETIMEDOUT.
 *
 * Writes to one peer are chained, up to VB_CHAIN work requests per ibv_post_send
 * (one doorbell), as paged writes and scatters produce them. Memory is registered with
 * IBV_ACCESS_RELAXED_ORDERING, an optional access flag that devices without relaxed
 * ordering ignore (the transport contract is unordered anyway); a device or kernel that
 * refuses the flag outright gets registrations without it. CUDA memory goes through
 * ibv_reg_dmabuf_mr when the CUDA driver can export the range as a dma-buf, else plain
 * ibv_reg_mr (nvidia-peermem).
 *
 * The GID index comes from the port's GID table: a RoCE v2 entry with an IPv4-mapped
 * address first, then any RoCE v2 entry, then any non-zero entry
 * (AFABRIC_VERBS_GID_INDEX overrides). Initial PSNs are random.
 *
 * State lives in the domain object; the only process-wide state is the dlopen'ed
 * libibverbs table (vb_lib.c).
 */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "afabric_provider.h"
#include "vb_lib.h"

#define VB_IMM_SIZE 4u
#define VB_CHAIN 4u            /* WRs per doorbell for writes to one peer */
#define VB_POLL_BATCH 32u
#define VB_DEFAULT_DEPTH 256u
#define VB_IMM_DEPTH 4096u     /* zero-length receives kept posted for immediates */
#define VB_IMM_REPOST_BATCH 32u
#define VB_UD_SLOTS 64u        /* handshake receive buffers (and as many send buffers) */
#define VB_UD_SLOT_LEN 256u
#define VB_GRH_LEN 40u
#define VB_QKEY 0x1afab51cu
#define VB_MAX_INLINE 64u
#define VB_HELLO_FIRST_NS 20000000ull   /* first handshake retransmission after 20 ms */
#define VB_HELLO_MAX_NS 500000000ull    /* then doubling up to 0.5 s */
#define VB_CONNECT_TIMEOUT_MS 5000u
#define VB_FAIL_HOLD_NS 1000000000ull   /* a failed handshake fails new posts for 1 s */
#define VB_ASYNC_EVERY 1024u            /* polls between reads of the async event queue */
#define VB_MAGIC 0x41465642u            /* "AFVB" */
#define VB_VERSION 1u

/* wr_id tags: operations are pointers into the op pool (8-byte aligned, tag 0) */
#define VB_TAG_MASK 0x7ull
#define VB_TAG_IMM 1ull
#define VB_TAG_UD_RECV 2ull
#define VB_TAG_UD_SEND 3ull

enum { VB_QP_MSG = 0, VB_QP_WR = 1, VB_NQP = 2 };

enum vb_state {
    VB_IDLE = 0,   /* no queue pairs */
    VB_CONNECTING, /* our QPs exist (INIT or RTS); waiting for the peer */
    VB_READY,      /* both sides are RTR/RTS and know each other */
    VB_FAILED,     /* handshake timed out; posts fail until fail_until */
};

/* A domain's address, as peers receive it (opaque to everyone above us). */
struct vb_addr {
    uint32_t magic;
    uint8_t version;
    uint8_t link_ib;  /* 1: InfiniBand link (route by LID), 0: RoCE (route by GID) */
    uint16_t lid;
    uint32_t ud_qpn;
    uint32_t nonce;   /* random per domain: a new process on a recycled QPN is a new peer */
    uint8_t gid[16];
};

#define VB_HELLO_WANT_REPLY 0x1u
#define VB_HELLO_HAVE_YOURS 0x2u /* sender's QPs are RTR towards the receiver's */

struct vb_hello {
    uint32_t magic;
    uint8_t version;
    uint8_t flags;
    uint8_t mtu; /* enum ibv_mtu of the sender's port */
    uint8_t reserved;
    struct vb_addr from;
    uint32_t to_nonce;
    uint32_t qpn[VB_NQP];
    uint32_t psn[VB_NQP];
    uint32_t gen; /* the sender's queue-pair generation for this peer (1, 2, ...) */
};

struct vb_op {
    uint64_t user_ctx;
    uint32_t kind; /* AFP_EV_WRITE_DONE, AFP_EV_SEND_DONE or AFP_EV_RECV */
    uint32_t peer;
    struct vb_op *next;
};

struct vb_peer {
    struct vb_addr addr;
    enum vb_state state;
    bool in_use;
    bool have_remote;  /* we know the peer's QPNs and PSNs (our QPs are RTS) */
    bool peer_ready;   /* the peer said its QPs are RTR towards ours */
    bool broken;       /* an RC error: reconnect once nothing is outstanding */
    struct ibv_qp *qp[VB_NQP];
    uint32_t psn[VB_NQP];
    uint32_t rqpn[VB_NQP];
    uint32_t gen, rgen; /* our QP generation for this peer, and the one we connected to */
    uint8_t rmtu;
    struct ibv_ah *ah;
    uint32_t outstanding; /* sends and writes in flight on our QPs */
    uint32_t hellos;
    uint64_t next_hello_ns, hello_gap_ns, deadline_ns, fail_until_ns;
};

/* The few CUDA driver calls the dma-buf path needs (no CUDA headers at build time). */
#define CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD 1
#define CU_POINTER_ATTRIBUTE_CONTEXT 1

struct vb_cuda {
    void *handle;
    int (*init)(unsigned flags);
    int (*pointer_get_attribute)(void *data, int attribute, uint64_t ptr);
    int (*ctx_push)(void *ctx);
    int (*ctx_pop)(void **ctx);
    int (*get_handle)(void *handle, uint64_t ptr, size_t size, int type, uint64_t flags);
};

struct afp_domain {
    const struct vb_lib *lib;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    struct ibv_srq *srq_msg, *srq_imm;
    struct ibv_qp *ud;
    struct ibv_mr *ud_mr;
    uint8_t *ud_buf; /* VB_UD_SLOTS receive slots, then VB_UD_SLOTS send slots */
    uint32_t ud_send_free[VB_UD_SLOTS];
    uint32_t ud_send_nfree;

    uint8_t port;
    int gid_index;
    union ibv_gid gid;
    enum ibv_mtu mtu;
    struct vb_addr self;
    uint64_t max_msg_size;
    uint32_t max_inline;
    uint32_t tx_depth, rx_depth, imm_depth, cq_size;
    uint32_t tx_outstanding; /* all RC sends/writes in flight: bounds the CQ */
    uint32_t imm_missing;    /* srq_imm receives consumed and not yet reposted */
    int access;              /* for reg_mr (RELAXED_ORDERING dropped if refused) */
    uint8_t rd_atom;         /* RDMA READs in flight per QP, each way (device limits, <= 16) */
    bool relaxed;
    uint64_t connect_timeout_ns;
    uint32_t drop_hellos;    /* test switch AFABRIC_VERBS_TEST_DROP_HELLOS */
    uint32_t connecting;     /* peers in VB_CONNECTING (timers to run) */

    struct vb_peer *peers;
    uint32_t npeers, peers_cap;

    struct vb_op *pool;
    uint32_t pool_size;
    struct vb_op *free_ops;

    uint32_t polls_since_async;
    bool reconnect_pending;  /* a peer's connection broke on a remote error: rebuild it */
    struct ibv_wc stash[VB_POLL_BATCH]; /* completions read by trywait */
    uint32_t nstash, stash_at;
    uint32_t unacked_events;

    struct vb_cuda *cuda; /* CUDA driver entry points for dma-buf export, loaded on first
                             device registration (NULL: not tried yet or unavailable) */
    bool cuda_tried;

    char dev_name[AFP_NAME_LEN];
    char errbuf[AFP_ERRTEXT_LEN];
};

/* ------------------------------------------------------------------------------------ */
/* Small helpers                                                                         */

#define derr(d, ...) afp_errf((d)->errbuf, sizeof (d)->errbuf, __VA_ARGS__)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint32_t random_u32(void)
{
    uint32_t v = 0;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
        struct timespec ts; /* no entropy source: still differs per call and process */
        clock_gettime(CLOCK_MONOTONIC, &ts);
        v = (uint32_t)ts.tv_nsec ^ ((uint32_t)getpid() << 16) ^ (uint32_t)(uintptr_t)&ts;
    }
    return v;
}

static uint32_t env_u32(const char *name, uint32_t dflt)
{
    const char *s = getenv(name);
    if (!s || !*s)
        return dflt;
    char *end = NULL;
    unsigned long v = strtoul(s, &end, 10);
    return end && *end == '\0' && v <= UINT32_MAX ? (uint32_t)v : dflt;
}

/* errno from a failed verbs call -> AFS code */
static int map_errno(int e)
{
    switch (e) {
    case ENOMEM:
        return AFP_ENOMEM;
    case EAGAIN:
        return AFP_EAGAIN;
    case EINVAL:
        return AFP_EINVAL;
    case ENODEV:
    case ENXIO:
        return AFP_ENODEV;
    case EOPNOTSUPP:
    case ENOSYS:
        return AFP_EUNSUPPORTED;
    case EACCES:
    case EPERM:
        return AFP_EKEY;
    default:
        return AFP_EIO;
    }
}

static int fail_errno(afp_domain *d, const char *what, int e)
{
    derr(d, "%s: %s (verbs %s)", what, strerror(e), d->dev_name);
    return map_errno(e);
}

static void gid_str(const uint8_t *gid, char *out, size_t len)
{
    if (!inet_ntop(AF_INET6, gid, out, (socklen_t)len))
        snprintf(out, len, "?");
}

/* A completion status -> AFS code (what the shim turns into a typed Python error). */
static int map_wc(enum ibv_wc_status s)
{
    switch (s) {
    case IBV_WC_SUCCESS:
        return AFP_OK;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_MW_BIND_ERR:
        return AFP_EKEY;
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
        return AFP_ETOOBIG;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
        return AFP_EPEER;
    case IBV_WC_WR_FLUSH_ERR:
        return AFP_EPEER; /* the connection broke under an earlier operation */
    default:
        return AFP_EIO;
    }
}

/* ------------------------------------------------------------------------------------ */
/* Operation contexts                                                                    */

static struct vb_op *op_get(afp_domain *d, uint32_t kind, uint64_t user_ctx, uint32_t peer)
{
    struct vb_op *op = d->free_ops;
    if (!op)
        return NULL;
    d->free_ops = op->next;
    op->user_ctx = user_ctx;
    op->kind = kind;
    op->peer = peer;
    op->next = NULL;
    return op;
}

static void op_put(afp_domain *d, struct vb_op *op)
{
    op->next = d->free_ops;
    d->free_ops = op;
}

/* ------------------------------------------------------------------------------------ */
/* Device, port and GID                                                                  */

/* "mlx5_0" or "mlx5_0:2" (port 2); port 0 = first active port. */
static void parse_nic(const char *nic, char *dev, size_t devlen, uint8_t *port)
{
    *port = 0;
    dev[0] = '\0';
    if (!nic || !*nic)
        return;
    snprintf(dev, devlen, "%s", nic);
    char *colon = strchr(dev, ':');
    if (colon) {
        *colon = '\0';
        unsigned long p = strtoul(colon + 1, NULL, 10);
        *port = p > 0 && p < 255 ? (uint8_t)p : 0;
    }
}

static bool gid_type_is_v2(afp_domain *d, const char *dev, int index)
{
    if (d->lib->query_gid_ex) {
        struct ibv_gid_entry e;
        memset(&e, 0, sizeof e);
        if (d->lib->query_gid_ex(d->ctx, d->port, (uint32_t)index, &e, 0, sizeof e) == 0)
            return e.gid_type == IBV_GID_TYPE_ROCE_V2;
    }
    char path[256], buf[32] = {0};
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/%u/gid_attrs/types/%d", dev,
             d->port, index);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    bool v2 = fgets(buf, sizeof buf, f) && strstr(buf, "v2") != NULL;
    fclose(f);
    return v2;
}

/* Picks the GID index (see the file comment). Returns 0 or an AFS code. */
static int pick_gid(afp_domain *d, const struct ibv_port_attr *pa)
{
    const char *dev = d->dev_name;
    const char *env = getenv("AFABRIC_VERBS_GID_INDEX");
    if (env && *env) {
        int idx = atoi(env);
        if (idx < 0 || idx >= pa->gid_tbl_len ||
            d->lib->query_gid(d->ctx, d->port, idx, &d->gid) != 0) {
            derr(d, "AFABRIC_VERBS_GID_INDEX=%s: no such GID on %s port %u", env, dev, d->port);
            return AFP_ENODEV;
        }
        d->gid_index = idx;
        return 0;
    }
    int best = -1, best_rank = 0;
    for (int i = 0; i < pa->gid_tbl_len && best_rank < 3; i++) {
        union ibv_gid g;
        if (d->lib->query_gid(d->ctx, d->port, i, &g) != 0)
            continue; /* an unpopulated entry (EINVAL) */
        bool zero = true;
        for (int k = 0; k < 16 && zero; k++)
            zero = g.raw[k] == 0;
        if (zero)
            continue;
        bool v4mapped = true;
        for (int k = 0; k < 10 && v4mapped; k++)
            v4mapped = g.raw[k] == 0;
        v4mapped = v4mapped && g.raw[10] == 0xff && g.raw[11] == 0xff;
        int rank = 1;
        if (pa->link_layer != IBV_LINK_LAYER_INFINIBAND && gid_type_is_v2(d, dev, i))
            rank = v4mapped ? 3 : 2;
        if (rank > best_rank) {
            best = i;
            best_rank = rank;
            d->gid = g;
        }
    }
    if (best < 0) {
        derr(d, "%s port %u has no usable GID (no IP address on its netdev?)", dev, d->port);
        return AFP_ENODEV;
    }
    d->gid_index = best;
    return 0;
}

static uint64_t port_speed_bps(const struct ibv_port_attr *pa)
{
    /* active_speed codes (IB spec): per-lane Gb/s x 1e9; width code -> lanes */
    uint64_t lane;
    switch (pa->active_speed) {
    case 1: lane = 2500000000ull; break;
    case 2: lane = 5000000000ull; break;
    case 4: case 8: lane = 10000000000ull; break;
    case 16: lane = 14062500000ull; break;
    case 32: lane = 25781250000ull; break;
    case 64: lane = 53125000000ull; break;
    case 128: lane = 106250000000ull; break;
    default: return 0;
    }
    uint64_t lanes;
    switch (pa->active_width) {
    case 1: lanes = 1; break;
    case 2: lanes = 4; break;
    case 4: lanes = 8; break;
    case 8: lanes = 12; break;
    case 16: lanes = 2; break;
    default: return 0;
    }
    return lane * lanes;
}

static void sysfs_pci_numa(const char *dev, afp_nic_info *out)
{
    char path[256], target[512];
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/device", dev);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n > 0) {
        target[n] = '\0';
        const char *base = strrchr(target, '/');
        base = base ? base + 1 : target;
        if (strchr(base, ':')) /* a PCI function; rxe/siw point at no device */
            snprintf(out->pci, sizeof out->pci, "%.31s", base);
    }
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/device/numa_node", dev);
    FILE *f = fopen(path, "r");
    if (f) {
        int node;
        if (fscanf(f, "%d", &node) == 1 && node >= 0)
            out->numa_node = node;
        fclose(f);
    }
}

/* First active port of an open device (or `want` if it is active); 0 if none. */
static uint8_t active_port(const struct vb_lib *lib, struct ibv_context *ctx, uint8_t nports,
                           uint8_t want, struct ibv_port_attr *pa)
{
    for (uint8_t p = 1; p <= nports; p++) {
        if (want && p != want)
            continue;
        memset(pa, 0, sizeof *pa);
        if (lib->query_port(ctx, p, pa) == 0 && pa->state == IBV_PORT_ACTIVE)
            return p;
    }
    return 0;
}

static int vb_list_nics(const afp_open_args *a, afp_nic_info *out, uint32_t max, uint32_t *n,
                        char *err, size_t errlen)
{
    const char *why = NULL;
    if (n)
        *n = 0;
    if (!a || !n || (max && !out)) {
        afp_errf(err, errlen, "list_nics: invalid arguments");
        return AFP_EINVAL;
    }
    const struct vb_lib *lib = vb_lib_get(&why);
    if (!lib) {
        afp_errf(err, errlen, "%s", why);
        return AFP_EPROVIDER;
    }
    char want_dev[AFP_NAME_LEN];
    uint8_t want_port;
    parse_nic(a->nic, want_dev, sizeof want_dev, &want_port);
    int ndev = 0;
    struct ibv_device **list = lib->get_device_list(&ndev);
    if (!list)
        return 0; /* no RDMA subsystem (ENOSYS) or no device: nothing to list */
    uint32_t count = 0;
    for (int i = 0; i < ndev; i++) {
        const char *name = lib->get_device_name(list[i]);
        if (!name || (want_dev[0] && strcmp(name, want_dev) != 0))
            continue;
        struct ibv_context *ctx = lib->open_device(list[i]);
        if (!ctx)
            continue;
        struct ibv_device_attr da;
        struct ibv_port_attr pa;
        uint8_t port = 0;
        if (lib->query_device(ctx, &da) == 0)
            port = active_port(lib, ctx, da.phys_port_cnt, want_port, &pa);
        if (port) {
            if (count < max) {
                afp_nic_info *o = &out[count];
                memset(o, 0, sizeof *o);
                o->numa_node = -1;
                snprintf(o->name, sizeof o->name, "%s", name);
                snprintf(o->fabric, sizeof o->fabric, "%s port %u",
                         pa.link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand" : "RoCE",
                         port);
                snprintf(o->provider, sizeof o->provider, "verbs");
                o->link_speed_bps = port_speed_bps(&pa);
                sysfs_pci_numa(name, o);
            }
            count++;
        }
        (void)lib->close_device(ctx);
    }
    lib->free_device_list(list);
    *n = count;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Receive queues                                                                        */

static int post_imm_recvs(afp_domain *d, uint32_t n)
{
    struct ibv_recv_wr wr[VB_IMM_REPOST_BATCH];
    while (n) {
        uint32_t k = n < VB_IMM_REPOST_BATCH ? n : VB_IMM_REPOST_BATCH;
        for (uint32_t i = 0; i < k; i++) {
            memset(&wr[i], 0, sizeof wr[i]);
            wr[i].wr_id = VB_TAG_IMM;
            wr[i].num_sge = 0; /* WRITE_WITH_IMM: the data goes to the rkey's memory */
            wr[i].next = i + 1 < k ? &wr[i + 1] : NULL;
        }
        struct ibv_recv_wr *bad = NULL;
        int ret = ibv_post_srq_recv(d->srq_imm, wr, &bad);
        if (ret) {
            uint32_t ok = bad ? (uint32_t)(bad - wr) : 0;
            d->imm_missing -= ok < d->imm_missing ? ok : d->imm_missing;
            return fail_errno(d, "ibv_post_srq_recv(immediates)", ret);
        }
        d->imm_missing -= k < d->imm_missing ? k : d->imm_missing;
        n -= k;
    }
    return 0;
}

static int post_ud_recv(afp_domain *d, uint32_t slot)
{
    struct ibv_sge sge = {
        .addr = (uint64_t)(uintptr_t)(d->ud_buf + (size_t)slot * VB_UD_SLOT_LEN),
        .length = VB_UD_SLOT_LEN,
        .lkey = d->ud_mr->lkey,
    };
    struct ibv_recv_wr wr = {.wr_id = ((uint64_t)slot << 3) | VB_TAG_UD_RECV, .sg_list = &sge,
                             .num_sge = 1};
    struct ibv_recv_wr *bad = NULL;
    int ret = ibv_post_recv(d->ud, &wr, &bad);
    return ret ? fail_errno(d, "ibv_post_recv(handshake)", ret) : 0;
}

/* ------------------------------------------------------------------------------------ */
/* Open / close                                                                          */

static void destroy_peer_qps(afp_domain *d, struct vb_peer *p)
{
    for (int q = 0; q < VB_NQP; q++) {
        if (p->qp[q]) {
            int ret = d->lib->destroy_qp(p->qp[q]);
            (void)ret; /* nothing to do about a failing destroy but carry on */
            p->qp[q] = NULL;
        }
    }
    if (p->state == VB_CONNECTING && d->connecting)
        d->connecting--;
    p->have_remote = p->peer_ready = p->broken = false;
    p->state = VB_IDLE;
}

static void vb_close(afp_domain *d)
{
    if (!d)
        return;
    /* Reverse order of creation; teardown continues past failures (nobody could act on
     * them: the domain is going away). */
    for (uint32_t i = 0; i < d->npeers; i++) {
        destroy_peer_qps(d, &d->peers[i]);
        if (d->peers[i].ah)
            (void)d->lib->destroy_ah(d->peers[i].ah);
    }
    if (d->ud)
        (void)d->lib->destroy_qp(d->ud);
    if (d->srq_imm)
        (void)d->lib->destroy_srq(d->srq_imm);
    if (d->srq_msg)
        (void)d->lib->destroy_srq(d->srq_msg);
    if (d->cq) {
        if (d->unacked_events)
            d->lib->ack_cq_events(d->cq, d->unacked_events);
        (void)d->lib->destroy_cq(d->cq);
    }
    if (d->ch)
        (void)d->lib->destroy_comp_channel(d->ch);
    if (d->ud_mr)
        (void)d->lib->dereg_mr(d->ud_mr);
    if (d->pd)
        (void)d->lib->dealloc_pd(d->pd);
    if (d->ctx)
        (void)d->lib->close_device(d->ctx);
    if (d->cuda) {
        dlclose(d->cuda->handle);
        free(d->cuda);
    }
    free(d->ud_buf);
    free(d->peers);
    free(d->pool);
    free(d);
}

static int open_device(afp_domain *d, const afp_open_args *a, struct ibv_port_attr *pa)
{
    char want_dev[AFP_NAME_LEN];
    uint8_t want_port;
    parse_nic(a->nic, want_dev, sizeof want_dev, &want_port);
    int ndev = 0;
    struct ibv_device **list = d->lib->get_device_list(&ndev);
    if (!list) {
        derr(d, "ibv_get_device_list: %s (no RDMA subsystem?)", strerror(errno));
        return AFP_ENODEV;
    }
    for (int i = 0; i < ndev && !d->ctx; i++) {
        const char *name = d->lib->get_device_name(list[i]);
        if (!name || (want_dev[0] && strcmp(name, want_dev) != 0))
            continue;
        struct ibv_context *ctx = d->lib->open_device(list[i]);
        if (!ctx)
            continue;
        struct ibv_device_attr da;
        uint8_t port = 0;
        if (d->lib->query_device(ctx, &da) == 0)
            port = active_port(d->lib, ctx, da.phys_port_cnt, want_port, pa);
        if (!port) {
            (void)d->lib->close_device(ctx);
            continue;
        }
        d->ctx = ctx;
        d->port = port;
        snprintf(d->dev_name, sizeof d->dev_name, "%s", name);
        uint32_t max_wr = da.max_qp_wr > 0 ? (uint32_t)da.max_qp_wr : 1;
        /* READs a QP keeps in flight: both our initiator limit and the responder's (the peer
         * runs the same code on the same kind of device); 16 is ConnectX's, rxe allows 128 */
        int rd = da.max_qp_init_rd_atom < da.max_qp_rd_atom ? da.max_qp_init_rd_atom
                                                            : da.max_qp_rd_atom;
        d->rd_atom = (uint8_t)(rd >= 16 ? 16 : rd > 0 ? rd : 1);
        uint32_t max_srq = da.max_srq_wr > 0 ? (uint32_t)da.max_srq_wr : 1;
        uint32_t max_cqe = da.max_cqe > 0 ? (uint32_t)da.max_cqe : 1;
        if (d->tx_depth > max_wr)
            d->tx_depth = max_wr;
        if (d->rx_depth > max_srq)
            d->rx_depth = max_srq;
        if (d->imm_depth > max_srq)
            d->imm_depth = max_srq;
        /* every RC completion (tx_outstanding <= tx_depth), every posted receive and the
         * handshake slots fit in the CQ at once: it can never overrun */
        uint64_t need = (uint64_t)d->tx_depth + d->rx_depth + d->imm_depth + 2 * VB_UD_SLOTS;
        if (need > max_cqe) {
            uint64_t rest = (uint64_t)d->tx_depth + d->rx_depth + 2 * VB_UD_SLOTS;
            if (rest + 64 > max_cqe) {
                derr(d, "%s: CQ of %u entries cannot hold tx_depth %u + rx_depth %u", name,
                     max_cqe, d->tx_depth, d->rx_depth);
                d->lib->free_device_list(list);
                return AFP_EINVAL;
            }
            d->imm_depth = (uint32_t)(max_cqe - rest);
            need = max_cqe;
        }
        d->cq_size = (uint32_t)need;
    }
    d->lib->free_device_list(list);
    if (!d->ctx) {
        derr(d, "no RDMA device with an active port%s%s", want_dev[0] ? " named " : "",
             want_dev);
        return AFP_ENODEV;
    }
    return 0;
}

static int modify(afp_domain *d, struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask,
                  const char *what)
{
    int ret = d->lib->modify_qp(qp, attr, mask);
    return ret ? fail_errno(d, what, ret) : 0;
}

static int open_ud(afp_domain *d)
{
    struct ibv_qp_init_attr ia = {
        .send_cq = d->cq,
        .recv_cq = d->cq,
        .cap = {.max_send_wr = VB_UD_SLOTS, .max_recv_wr = VB_UD_SLOTS, .max_send_sge = 1,
                .max_recv_sge = 1},
        .qp_type = IBV_QPT_UD,
    };
    d->ud = d->lib->create_qp(d->pd, &ia);
    if (!d->ud)
        return fail_errno(d, "ibv_create_qp(UD)", errno);
    struct ibv_qp_attr at = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = d->port,
                             .qkey = VB_QKEY};
    int rc = modify(d, d->ud, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
                    "UD INIT");
    if (rc)
        return rc;
    memset(&at, 0, sizeof at);
    at.qp_state = IBV_QPS_RTR;
    rc = modify(d, d->ud, &at, IBV_QP_STATE, "UD RTR");
    if (rc)
        return rc;
    memset(&at, 0, sizeof at);
    at.qp_state = IBV_QPS_RTS;
    at.sq_psn = random_u32() & 0xffffff;
    return modify(d, d->ud, &at, IBV_QP_STATE | IBV_QP_SQ_PSN, "UD RTS");
}

static int vb_open(const afp_open_args *a, afp_domain **out, char *err, size_t errlen)
{
    const char *why = NULL;
    int rc;
    if (!a || !out) {
        afp_errf(err, errlen, "open: invalid arguments");
        return AFP_EINVAL;
    }
    *out = NULL;
    const struct vb_lib *lib = vb_lib_get(&why);
    if (!lib) {
        afp_errf(err, errlen, "%s", why);
        return AFP_EPROVIDER;
    }
    afp_domain *d = calloc(1, sizeof *d);
    if (!d) {
        afp_errf(err, errlen, "open: out of memory");
        return AFP_ENOMEM;
    }
    d->lib = lib;
    d->tx_depth = a->tx_depth ? a->tx_depth : VB_DEFAULT_DEPTH;
    d->rx_depth = a->rx_depth ? a->rx_depth : VB_DEFAULT_DEPTH;
    d->imm_depth = env_u32("AFABRIC_VERBS_IMM_DEPTH", VB_IMM_DEPTH);
    if (d->imm_depth < 16)
        d->imm_depth = 16;
    d->connect_timeout_ns =
        (uint64_t)env_u32("AFABRIC_VERBS_CONNECT_TIMEOUT_MS", VB_CONNECT_TIMEOUT_MS) * 1000000ull;
    d->drop_hellos = env_u32("AFABRIC_VERBS_TEST_DROP_HELLOS", 0);

    struct ibv_port_attr pa;
    rc = open_device(d, a, &pa);
    if (rc)
        goto out_close;
    rc = pick_gid(d, &pa);
    if (rc)
        goto out_close;
    d->mtu = pa.active_mtu;
    d->max_msg_size = pa.max_msg_sz ? pa.max_msg_sz : (1ull << 30);

    d->pool_size = d->tx_depth + d->rx_depth;
    d->pool = calloc(d->pool_size, sizeof *d->pool);
    d->ud_buf = aligned_alloc(4096, 2 * VB_UD_SLOTS * VB_UD_SLOT_LEN);
    if (!d->pool || !d->ud_buf) {
        derr(d, "open: out of memory");
        rc = AFP_ENOMEM;
        goto out_close;
    }
    for (uint32_t i = d->pool_size; i-- > 0;)
        op_put(d, &d->pool[i]);

    d->pd = lib->alloc_pd(d->ctx);
    if (!d->pd) {
        rc = fail_errno(d, "ibv_alloc_pd", errno);
        goto out_close;
    }
    d->ch = lib->create_comp_channel(d->ctx);
    if (!d->ch) {
        rc = fail_errno(d, "ibv_create_comp_channel", errno);
        goto out_close;
    }
    int fl = fcntl(d->ch->fd, F_GETFL);
    if (fl < 0 || fcntl(d->ch->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        rc = fail_errno(d, "fcntl(completion channel)", errno);
        goto out_close;
    }
    fl = fcntl(d->ctx->async_fd, F_GETFL);
    if (fl < 0 || fcntl(d->ctx->async_fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        rc = fail_errno(d, "fcntl(async events)", errno);
        goto out_close;
    }
    d->cq = lib->create_cq(d->ctx, (int)d->cq_size, d, d->ch, 0);
    if (!d->cq) {
        rc = fail_errno(d, "ibv_create_cq", errno);
        goto out_close;
    }
    struct ibv_srq_init_attr sa = {.attr = {.max_wr = d->rx_depth, .max_sge = 1}};
    d->srq_msg = lib->create_srq(d->pd, &sa);
    if (!d->srq_msg) {
        rc = fail_errno(d, "ibv_create_srq(messages)", errno);
        goto out_close;
    }
    struct ibv_srq_init_attr si = {.attr = {.max_wr = d->imm_depth, .max_sge = 1}};
    d->srq_imm = lib->create_srq(d->pd, &si);
    if (!d->srq_imm) {
        rc = fail_errno(d, "ibv_create_srq(immediates)", errno);
        goto out_close;
    }
    d->imm_missing = d->imm_depth;
    rc = post_imm_recvs(d, d->imm_depth);
    if (rc)
        goto out_close;

    d->ud_mr = lib->reg_mr(d->pd, d->ud_buf, 2 * VB_UD_SLOTS * VB_UD_SLOT_LEN,
                           IBV_ACCESS_LOCAL_WRITE);
    if (!d->ud_mr) {
        rc = fail_errno(d, "ibv_reg_mr(handshake buffers)", errno);
        goto out_close;
    }
    rc = open_ud(d);
    if (rc)
        goto out_close;
    for (uint32_t s = 0; s < VB_UD_SLOTS; s++) {
        rc = post_ud_recv(d, s);
        if (rc)
            goto out_close;
        d->ud_send_free[d->ud_send_nfree++] = s;
    }
    int ret = ibv_req_notify_cq(d->cq, 0);
    if (ret) {
        rc = fail_errno(d, "ibv_req_notify_cq", ret);
        goto out_close;
    }

    /* How much a write or send can carry inline: create_qp reports what it granted. */
    struct ibv_qp_init_attr probe = {
        .send_cq = d->cq, .recv_cq = d->cq, .srq = d->srq_imm, .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = 1, .max_send_sge = 1, .max_inline_data = VB_MAX_INLINE},
    };
    struct ibv_qp *pq = lib->create_qp(d->pd, &probe);
    if (pq) {
        d->max_inline = probe.cap.max_inline_data < VB_MAX_INLINE ? probe.cap.max_inline_data
                                                                   : VB_MAX_INLINE;
        (void)lib->destroy_qp(pq);
    } /* else: no inline data on this device (max_inline stays 0) */

    d->access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING;
    d->relaxed = lib->reg_mr_iova2 != NULL; /* the optional flag needs the iova2 entry */
    if (!d->relaxed)
        d->access &= ~IBV_ACCESS_RELAXED_ORDERING;

    d->self.magic = VB_MAGIC;
    d->self.version = VB_VERSION;
    d->self.link_ib = pa.link_layer == IBV_LINK_LAYER_INFINIBAND;
    d->self.lid = pa.lid;
    d->self.ud_qpn = d->ud->qp_num;
    d->self.nonce = random_u32();
    memcpy(d->self.gid, d->gid.raw, 16);
    *out = d;
    return 0;

out_close:
    afp_errf(err, errlen, "%s", d->errbuf);
    vb_close(d);
    return rc;
}

static const char *vb_errbuf(afp_domain *d)
{
    return d ? d->errbuf : "no domain";
}

static int vb_caps(afp_domain *d, afp_caps *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->provider, sizeof out->provider, "verbs;%.32s:%u gid %d", d->dev_name,
             d->port, d->gid_index);
    bool cuda = false;
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (h) {
        cuda = true;
        dlclose(h);
    }
    out->flags = AFP_CAP_MR_LOCAL | AFP_CAP_VIRT_ADDR | AFP_CAP_PROV_KEY |
                 AFP_CAP_DELIVERY_COMPLETE | (cuda ? AFP_CAP_DEVICE_MEM : 0);
    out->imm_size = VB_IMM_SIZE;
    out->max_msg_size = d->max_msg_size;
    out->inject_size = d->max_inline;
    out->addr_len = (uint32_t)sizeof(struct vb_addr);
    out->wait_fd = d->ch->fd;
    return 0;
}

static int vb_address(afp_domain *d, void *buf, size_t *len)
{
    if (*len < sizeof d->self) {
        derr(d, "address: buffer of %zu bytes, need %zu", *len, sizeof d->self);
        *len = sizeof d->self;
        return AFP_EINVAL;
    }
    memcpy(buf, &d->self, sizeof d->self);
    *len = sizeof d->self;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Peers                                                                                 */

static bool same_addr(const struct vb_addr *x, const struct vb_addr *y)
{
    return x->ud_qpn == y->ud_qpn && x->nonce == y->nonce && x->lid == y->lid &&
           memcmp(x->gid, y->gid, 16) == 0;
}

static void fill_ah_attr(afp_domain *d, const struct vb_addr *to, struct ibv_ah_attr *ah)
{
    memset(ah, 0, sizeof *ah);
    ah->port_num = d->port;
    ah->dlid = to->lid;
    if (!to->link_ib || !d->self.link_ib) { /* RoCE: routed by GID only */
        ah->is_global = 1;
        memcpy(ah->grh.dgid.raw, to->gid, 16);
        ah->grh.sgid_index = (uint8_t)d->gid_index;
        ah->grh.hop_limit = 64;
    }
}

/* The peer entry for an address (created if new). Returns its index or -AFS code. */
static int64_t peer_lookup(afp_domain *d, const struct vb_addr *addr)
{
    for (uint32_t i = 0; i < d->npeers; i++)
        if (d->peers[i].in_use && same_addr(&d->peers[i].addr, addr))
            return i;
    if (d->npeers == d->peers_cap) {
        uint32_t cap = d->peers_cap ? d->peers_cap * 2 : 16;
        struct vb_peer *np = realloc(d->peers, cap * sizeof *np);
        if (!np) {
            derr(d, "out of memory for peer table");
            return AFP_ENOMEM;
        }
        d->peers = np;
        d->peers_cap = cap;
    }
    struct vb_peer *p = &d->peers[d->npeers];
    memset(p, 0, sizeof *p);
    p->addr = *addr;
    p->in_use = true;
    struct ibv_ah_attr aa;
    fill_ah_attr(d, addr, &aa);
    p->ah = d->lib->create_ah(d->pd, &aa);
    if (!p->ah) {
        int e = errno;
        char g[64];
        gid_str(addr->gid, g, sizeof g);
        derr(d, "ibv_create_ah to %s: %s", g, strerror(e));
        return map_errno(e) == AFP_EIO ? AFP_EPEER : map_errno(e);
    }
    return d->npeers++;
}

static int vb_resolve(afp_domain *d, const void *addr, size_t len, uint64_t *peer)
{
    struct vb_addr a;
    if (len != sizeof a) {
        derr(d, "resolve: address of %zu bytes, verbs addresses have %zu", len, sizeof a);
        return AFP_EBADDESC;
    }
    memcpy(&a, addr, sizeof a);
    if (a.magic != VB_MAGIC || a.version != VB_VERSION) {
        derr(d, "resolve: not a verbs address (magic %08x, version %u)", a.magic, a.version);
        return AFP_EBADDESC;
    }
    int64_t i = peer_lookup(d, &a);
    if (i < 0)
        return (int)i;
    *peer = (uint64_t)i;
    return 0;
}

static int vb_forget(afp_domain *d, uint64_t peer)
{
    if (peer >= d->npeers || !d->peers[peer].in_use)
        return AFP_EINVAL;
    struct vb_peer *p = &d->peers[peer];
    if (p->outstanding) {
        derr(d, "forget: %u operations still in flight to this peer", p->outstanding);
        return AFP_EBUSY;
    }
    destroy_peer_qps(d, p); /* the entry (and its AH) stays: the peer may come back */
    return 0;
}

static int create_rc(afp_domain *d, struct vb_peer *p)
{
    p->gen++; /* a late datagram of an older generation must not tear this one down */
    for (int q = 0; q < VB_NQP; q++) {
        struct ibv_qp_init_attr ia = {
            .send_cq = d->cq,
            .recv_cq = d->cq,
            .srq = q == VB_QP_MSG ? d->srq_msg : d->srq_imm,
            .cap = {.max_send_wr = d->tx_depth, .max_send_sge = 1,
                    .max_inline_data = d->max_inline},
            .qp_type = IBV_QPT_RC,
        };
        p->qp[q] = d->lib->create_qp(d->pd, &ia);
        if (!p->qp[q])
            return fail_errno(d, "ibv_create_qp(RC)", errno);
        struct ibv_qp_attr at = {
            .qp_state = IBV_QPS_INIT,
            .pkey_index = 0,
            .port_num = d->port,
            .qp_access_flags =
                IBV_ACCESS_LOCAL_WRITE |
                (q == VB_QP_WR ? IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ : 0),
        };
        int rc = modify(d, p->qp[q], &at,
                        IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                        "RC INIT");
        if (rc)
            return rc;
        p->psn[q] = random_u32() & 0xffffff;
    }
    return 0;
}

static int rc_rts(afp_domain *d, struct vb_peer *p)
{
    for (int q = 0; q < VB_NQP; q++) {
        struct ibv_qp_attr at;
        memset(&at, 0, sizeof at);
        at.qp_state = IBV_QPS_RTS;
        at.timeout = 14;  /* 4.096 us * 2^14 = 67 ms per try */
        at.retry_cnt = 7;
        at.rnr_retry = 7; /* retry forever on RNR (srq_imm never runs dry anyway) */
        at.sq_psn = p->psn[q];
        at.max_rd_atomic = d->rd_atom;
        int rc = modify(d, p->qp[q], &at,
                        IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                            IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                        "RC RTS");
        if (rc)
            return rc;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Handshake                                                                             */
/*
 * Three messages over UD, symmetric so that two peers connecting to each other at once
 * need no tie-break:
 *   A -> B  HELLO(WANT_REPLY)              A's QPNs and PSNs
 *   B -> A  HELLO(HAVE_YOURS|WANT_REPLY)   B is RTS towards A (and says so)
 *   A -> B  HELLO(HAVE_YOURS)              A is RTS towards B
 * A side that has operations waiting retransmits its HELLO (20 ms, doubling to 0.5 s)
 * until it has heard HAVE_YOURS, so any lost datagram is made up for; a peer that never
 * answers fails those operations after the connect timeout. A side becomes READY once
 * it is RTS and has heard HAVE_YOURS: only then can its first packet not find the
 * peer's QPs still in INIT.
 */

static int send_hello(afp_domain *d, struct vb_peer *p, uint8_t flags)
{
    if (!d->ud_send_nfree)
        return AFP_EAGAIN; /* all slots in flight: the retransmission timer retries */
    uint32_t slot = d->ud_send_free[--d->ud_send_nfree];
    uint8_t *buf = d->ud_buf + (size_t)(VB_UD_SLOTS + slot) * VB_UD_SLOT_LEN;
    struct vb_hello h;
    memset(&h, 0, sizeof h);
    h.magic = VB_MAGIC;
    h.version = VB_VERSION;
    h.flags = flags;
    h.mtu = (uint8_t)d->mtu;
    h.from = d->self;
    h.to_nonce = p->addr.nonce;
    h.gen = p->gen;
    for (int q = 0; q < VB_NQP; q++) {
        h.qpn[q] = p->qp[q]->qp_num;
        h.psn[q] = p->psn[q];
    }
    memcpy(buf, &h, sizeof h);
    struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)buf, .length = sizeof h,
                          .lkey = d->ud_mr->lkey};
    struct ibv_send_wr wr = {
        .wr_id = ((uint64_t)slot << 3) | VB_TAG_UD_SEND,
        .sg_list = &sge,
        .num_sge = 1,
        .opcode = IBV_WR_SEND,
        .send_flags = IBV_SEND_SIGNALED,
    };
    wr.wr.ud.ah = p->ah;
    wr.wr.ud.remote_qpn = p->addr.ud_qpn;
    wr.wr.ud.remote_qkey = VB_QKEY;
    struct ibv_send_wr *bad = NULL;
    int ret = ibv_post_send(d->ud, &wr, &bad);
    if (ret) {
        d->ud_send_free[d->ud_send_nfree++] = slot;
        return fail_errno(d, "ibv_post_send(handshake)", ret);
    }
    p->hellos++;
    return 0;
}

static void set_connecting(afp_domain *d, struct vb_peer *p, uint64_t now)
{
    if (p->state != VB_CONNECTING)
        d->connecting++;
    p->state = VB_CONNECTING;
    p->deadline_ns = now + d->connect_timeout_ns;
    p->hello_gap_ns = VB_HELLO_FIRST_NS;
    p->next_hello_ns = now + p->hello_gap_ns;
}

static void set_ready(afp_domain *d, struct vb_peer *p)
{
    if (p->state == VB_CONNECTING && d->connecting)
        d->connecting--;
    p->state = VB_READY;
}

/* Makes sure a connection to p is coming: returns 0 when READY, AFP_EAGAIN while it is
 * being made, or an error (handshake timed out, resources). */
static int want_peer(afp_domain *d, struct vb_peer *p)
{
    if (p->state == VB_READY && !p->broken)
        return 0;
    uint64_t now = now_ns();
    if (p->state == VB_FAILED) {
        if (now < p->fail_until_ns) {
            char g[64];
            gid_str(p->addr.gid, g, sizeof g);
            derr(d, "verbs %s: no handshake answer from peer %s (UD QPN %u) within %.1f s; "
                    "peer dead, unreachable or not started",
                 d->dev_name, g, p->addr.ud_qpn, (double)d->connect_timeout_ns / 1e9);
            return AFP_ETIMEDOUT;
        }
        p->state = VB_IDLE; /* try again */
    }
    if (p->broken) {
        if (p->outstanding)
            return AFP_EAGAIN; /* let the flushes drain, then reconnect */
        destroy_peer_qps(d, p);
    }
    if (p->state == VB_IDLE) {
        int rc = create_rc(d, p);
        if (rc) {
            destroy_peer_qps(d, p);
            return rc;
        }
        set_connecting(d, p, now);
        (void)send_hello(d, p, VB_HELLO_WANT_REPLY);
        return AFP_EAGAIN;
    }
    if (p->state == VB_CONNECTING && p->deadline_ns == 0) {
        /* connecting passively (the peer asked first), now with operations waiting */
        p->deadline_ns = now + d->connect_timeout_ns;
        p->next_hello_ns = now;
    }
    return AFP_EAGAIN;
}

/* Retransmissions and timeouts of handshakes with operations waiting. */
static void run_timers(afp_domain *d)
{
    uint64_t now = now_ns();
    for (uint32_t i = 0; i < d->npeers && d->connecting; i++) {
        struct vb_peer *p = &d->peers[i];
        if (p->state != VB_CONNECTING || !p->deadline_ns)
            continue;
        if (now >= p->deadline_ns) {
            destroy_peer_qps(d, p);
            p->state = VB_FAILED;
            p->fail_until_ns = now + VB_FAIL_HOLD_NS;
            continue;
        }
        if (now >= p->next_hello_ns) {
            uint8_t fl = VB_HELLO_WANT_REPLY | (p->have_remote ? VB_HELLO_HAVE_YOURS : 0);
            (void)send_hello(d, p, fl);
            p->hello_gap_ns = p->hello_gap_ns * 2 > VB_HELLO_MAX_NS ? VB_HELLO_MAX_NS
                                                                     : p->hello_gap_ns * 2;
            p->next_hello_ns = now + p->hello_gap_ns;
        }
    }
}

static void on_hello(afp_domain *d, const uint8_t *buf, uint32_t len)
{
    struct vb_hello h;
    if (len < VB_GRH_LEN + sizeof h)
        return;
    memcpy(&h, buf + VB_GRH_LEN, sizeof h);
    if (h.magic != VB_MAGIC || h.version != VB_VERSION || h.to_nonce != d->self.nonce ||
        h.from.magic != VB_MAGIC)
        return; /* not for this incarnation of us */
    if (d->drop_hellos) { /* test switch: lose datagrams so retransmission must work */
        d->drop_hellos--;
        return;
    }
    int64_t i = peer_lookup(d, &h.from);
    if (i < 0)
        return; /* out of memory: the peer retransmits */
    struct vb_peer *p = &d->peers[i];
    if (p->state == VB_FAILED)
        p->state = VB_IDLE;
    if (h.gen < p->rgen)
        return; /* a late retransmission from before the peer's last reconnection */
    if (p->have_remote && h.gen > p->rgen) {
        /* The peer made new QPs (it reconnects after an error): follow it once ours
         * are quiet; until then it retransmits. */
        if (p->outstanding)
            return;
        destroy_peer_qps(d, p);
    }
    if (p->state == VB_IDLE) {
        if (create_rc(d, p)) {
            destroy_peer_qps(d, p);
            return;
        }
        set_connecting(d, p, now_ns());
        p->deadline_ns = 0; /* passive: no timer until operations wait for it */
    }
    if (!p->have_remote) {
        for (int q = 0; q < VB_NQP; q++)
            p->rqpn[q] = h.qpn[q];
        p->rgen = h.gen;
        p->rmtu = h.mtu;
        /* RTR needs the peer's PSN as our receive PSN */
        enum ibv_mtu mtu = p->rmtu && p->rmtu < d->mtu ? (enum ibv_mtu)p->rmtu : d->mtu;
        for (int q = 0; q < VB_NQP; q++) {
            struct ibv_qp_attr at;
            memset(&at, 0, sizeof at);
            at.qp_state = IBV_QPS_RTR;
            at.path_mtu = mtu;
            at.dest_qp_num = h.qpn[q];
            at.rq_psn = h.psn[q];
            at.max_dest_rd_atomic = d->rd_atom;
            at.min_rnr_timer = 12;
            fill_ah_attr(d, &p->addr, &at.ah_attr);
            if (modify(d, p->qp[q], &at,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                       "RC RTR")) {
                destroy_peer_qps(d, p);
                return;
            }
        }
        if (rc_rts(d, p)) {
            destroy_peer_qps(d, p);
            return;
        }
        p->have_remote = true;
    }
    if (h.flags & VB_HELLO_HAVE_YOURS)
        p->peer_ready = true;
    if (h.flags & VB_HELLO_WANT_REPLY)
        (void)send_hello(d, p, VB_HELLO_HAVE_YOURS | (p->peer_ready ? 0 : VB_HELLO_WANT_REPLY));
    if (p->have_remote && p->peer_ready && p->state == VB_CONNECTING)
        set_ready(d, p);
}

/* ------------------------------------------------------------------------------------ */
/* Memory registration                                                                   */

static void cuda_load(afp_domain *d)
{
    if (d->cuda_tried)
        return;
    d->cuda_tried = true;
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!h)
        return;
    struct vb_cuda *c = calloc(1, sizeof *c);
    if (!c) {
        dlclose(h);
        return;
    }
    c->handle = h;
    c->init = (__typeof__(c->init))dlsym(h, "cuInit");
    c->pointer_get_attribute =
        (__typeof__(c->pointer_get_attribute))dlsym(h, "cuPointerGetAttribute");
    c->ctx_push = (__typeof__(c->ctx_push))dlsym(h, "cuCtxPushCurrent_v2");
    c->ctx_pop = (__typeof__(c->ctx_pop))dlsym(h, "cuCtxPopCurrent_v2");
    c->get_handle = (__typeof__(c->get_handle))dlsym(h, "cuMemGetHandleForAddressRange");
    if (!c->init || !c->pointer_get_attribute || !c->ctx_push || !c->ctx_pop ||
        !c->get_handle || c->init(0) != 0) { /* a driver older than 11.7 has no dma-buf */
        dlclose(h);
        free(c);
        return;
    }
    d->cuda = c;
}

/* CUDA memory as a dma-buf (no nvidia-peermem needed); NULL with *why set if not. The
 * export runs in the memory's own context, pushed on this (worker) thread for the call. */
static struct ibv_mr *reg_dmabuf(afp_domain *d, void *addr, uint64_t len, int access,
                                 const char **why)
{
    cuda_load(d);
    if (!d->lib->reg_dmabuf_mr) {
        *why = "libibverbs has no ibv_reg_dmabuf_mr";
        return NULL;
    }
    struct vb_cuda *c = d->cuda;
    if (!c) {
        *why = "the CUDA driver cannot export dma-bufs (needs CUDA 11.7+)";
        return NULL;
    }
    uint64_t a = (uint64_t)(uintptr_t)addr;
    long ps = sysconf(_SC_PAGESIZE);
    uint64_t page = ps > 0 ? (uint64_t)ps : 4096;
    uint64_t base = a & ~(page - 1), end = (a + len + page - 1) & ~(page - 1);
    void *ctx = NULL, *popped = NULL;
    if (c->pointer_get_attribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, a) != 0 || !ctx ||
        c->ctx_push(ctx) != 0) {
        *why = "not CUDA device memory (cuPointerGetAttribute)";
        return NULL;
    }
    int fd = -1;
    int cr = c->get_handle(&fd, base, end - base, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    (void)c->ctx_pop(&popped);
    if (cr != 0 || fd < 0) {
        *why = "cuMemGetHandleForAddressRange refused the range";
        return NULL;
    }
    struct ibv_mr *mr = d->lib->reg_dmabuf_mr(d->pd, a - base, len, a, fd, access);
    if (!mr && errno == EINVAL && (access & IBV_ACCESS_RELAXED_ORDERING))
        mr = d->lib->reg_dmabuf_mr(d->pd, a - base, len, a, fd,
                                   access & ~IBV_ACCESS_RELAXED_ORDERING);
    int e = errno;
    close(fd); /* the registration holds its own reference */
    if (!mr) {
        errno = e;
        *why = "ibv_reg_dmabuf_mr failed";
    }
    return mr;
}

static struct ibv_mr *reg_plain(afp_domain *d, void *addr, uint64_t len, int access)
{
    if (d->relaxed) {
        struct ibv_mr *mr = d->lib->reg_mr_iova2(d->pd, addr, len, (uint64_t)(uintptr_t)addr,
                                                 (unsigned)access);
        if (mr || errno != EINVAL)
            return mr;
        /* a kernel or device refusing the optional flag: register without it from now */
        d->relaxed = false;
        d->access &= ~IBV_ACCESS_RELAXED_ORDERING;
        access &= ~IBV_ACCESS_RELAXED_ORDERING;
    }
    return d->lib->reg_mr(d->pd, addr, len, access);
}

static int vb_reg_mr(afp_domain *d, void *addr, uint64_t len, uint32_t flags, int32_t device,
                     uint64_t requested_key, afp_mr **out, void **local_desc, uint64_t *rkey,
                     uint64_t *remote_base)
{
    (void)requested_key; /* the device picks keys (AFP_CAP_PROV_KEY) */
    (void)device; /* CUDA memory is exported in the context it belongs to */
    int access = d->access;
    if (flags & AFP_MR_REMOTE)
        access |= IBV_ACCESS_REMOTE_WRITE;
    if (flags & AFP_MR_REMOTE_READ)
        access |= IBV_ACCESS_REMOTE_READ;
    struct ibv_mr *mr = NULL;
    if (len == 0) {
        derr(d, "register: zero-length region");
        return AFP_EINVAL;
    }
    if (flags & AFP_MR_DEVICE) {
        const char *why = "";
        mr = reg_dmabuf(d, addr, len, access, &why);
        if (!mr) {
            mr = reg_plain(d, addr, len, access); /* nvidia-peermem */
            if (!mr) {
                derr(d, "registering CUDA memory on %s: dma-buf path: %s; ibv_reg_mr: %s "
                        "(load nvidia-peermem or use a driver with dma-buf support)",
                     d->dev_name, why, strerror(errno));
                return AFP_EREG;
            }
        }
    } else {
        mr = reg_plain(d, addr, len, access);
        if (!mr) {
            int e = errno;
            derr(d, "ibv_reg_mr of %llu bytes on %s: %s", (unsigned long long)len, d->dev_name,
                 strerror(e));
            return e == ENOMEM ? AFP_ENOMEM : AFP_EREG;
        }
    }
    *out = (afp_mr *)mr;
    *local_desc = mr;
    *rkey = mr->rkey;
    *remote_base = (uint64_t)(uintptr_t)addr; /* iova = virtual address */
    return 0;
}

static int vb_dereg_mr(afp_domain *d, afp_mr *mr)
{
    int ret = d->lib->dereg_mr((struct ibv_mr *)mr);
    return ret ? fail_errno(d, "ibv_dereg_mr", ret) : 0;
}

/* ------------------------------------------------------------------------------------ */
/* Posting                                                                               */

static struct vb_peer *peer_of(afp_domain *d, uint64_t peer)
{
    if (peer >= d->npeers || !d->peers[peer].in_use) {
        derr(d, "unknown peer handle %llu", (unsigned long long)peer);
        return NULL;
    }
    return &d->peers[peer];
}

/* ibv_post_send refused work for p. If the queue pair is in the error state (the peer's
 * side of a connection broken by the other end, e.g. after it saw a remote access error;
 * rxe refuses posts then, where mlx5 would flush them) the connection is rebuilt and the
 * caller is told to try again; anything else is an error of this operation. */
static int post_failed(afp_domain *d, struct vb_peer *p, struct ibv_qp *qp, int ret,
                       const char *what)
{
    if (ret == ENOMEM)
        return AFP_EAGAIN; /* send queue full */
    struct ibv_qp_attr at;
    struct ibv_qp_init_attr ia;
    memset(&at, 0, sizeof at);
    if (d->lib->query_qp(qp, &at, IBV_QP_STATE, &ia) == 0 && at.qp_state == IBV_QPS_ERR) {
        p->broken = true;
        return AFP_EAGAIN;
    }
    return fail_errno(d, what, ret);
}

/* Writes, or with `read` RDMA READs (remote -> local_addr), chained alike. */
static int post_rdma(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted, bool read)
{
    struct ibv_send_wr sw[VB_CHAIN];
    struct ibv_sge sge[VB_CHAIN];
    struct vb_op *ops[VB_CHAIN];
    uint32_t i = 0;
    int rc = 0;

    while (i < n) {
        struct vb_peer *p = peer_of(d, wr[i].peer);
        if (!p) {
            rc = AFP_EINVAL;
            break;
        }
        rc = want_peer(d, p);
        if (rc)
            break;
        /* a chain: consecutive writes to the same peer, as many as the queues allow */
        uint32_t k = 0;
        while (k < VB_CHAIN && i + k < n && wr[i + k].peer == wr[i].peer &&
               d->tx_outstanding + k < d->tx_depth && p->outstanding + k < d->tx_depth) {
            const afp_write *w = &wr[i + k];
            if (w->length > d->max_msg_size) {
                derr(d, "%s of %llu bytes > %s max %llu", read ? "read" : "write",
                     (unsigned long long)w->length,
                     d->dev_name, (unsigned long long)d->max_msg_size);
                rc = AFP_ETOOBIG;
                break;
            }
            struct vb_op *op = op_get(d, AFP_EV_WRITE_DONE, w->ctx, (uint32_t)w->peer);
            if (!op)
                break;
            ops[k] = op;
            memset(&sw[k], 0, sizeof sw[k]);
            sge[k].addr = (uint64_t)(uintptr_t)w->local_addr;
            sge[k].length = (uint32_t)w->length;
            sge[k].lkey = w->local_desc ? ((struct ibv_mr *)w->local_desc)->lkey : 0;
            sw[k].wr_id = (uint64_t)(uintptr_t)op;
            sw[k].sg_list = &sge[k];
            sw[k].num_sge = w->length ? 1 : 0;
            sw[k].opcode = read          ? IBV_WR_RDMA_READ
                           : w->has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM
                                        : IBV_WR_RDMA_WRITE;
            sw[k].send_flags = IBV_SEND_SIGNALED | (!read && w->length && w->length <= d->max_inline
                                                        ? IBV_SEND_INLINE
                                                        : 0);
            sw[k].imm_data = htonl(w->imm);
            sw[k].wr.rdma.remote_addr = w->remote_addr;
            sw[k].wr.rdma.rkey = (uint32_t)w->remote_key;
            sw[k].next = NULL;
            if (k)
                sw[k - 1].next = &sw[k];
            k++;
        }
        if (k == 0) {
            if (!rc)
                rc = AFP_EAGAIN; /* queues full: the shim polls, then retries */
            break;
        }
        struct ibv_send_wr *bad = NULL;
        int ret = ibv_post_send(p->qp[VB_QP_WR], sw, &bad);
        uint32_t ok = k;
        if (ret) {
            ok = bad ? (uint32_t)(bad - sw) : 0;
            for (uint32_t j = ok; j < k; j++)
                op_put(d, ops[j]);
        }
        p->outstanding += ok;
        d->tx_outstanding += ok;
        i += ok;
        if (ret) {
            rc = post_failed(d, p, p->qp[VB_QP_WR], ret,
                             read ? "ibv_post_send(read)" : "ibv_post_send(write)");
            break;
        }
        if (rc)
            break; /* a too-big write ended the chain */
    }
    *posted = i;
    return rc;
}

static int vb_post_writes(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted)
{
    return post_rdma(d, wr, n, posted, false);
}

static int vb_post_reads(afp_domain *d, const afp_write *wr, uint32_t n, uint32_t *posted)
{
    return post_rdma(d, wr, n, posted, true);
}

static int vb_post_send(afp_domain *d, uint64_t peer, const void *buf, uint64_t len, void *desc,
                        uint64_t ctx)
{
    struct vb_peer *p = peer_of(d, peer);
    if (!p)
        return AFP_EINVAL;
    if (len > d->max_msg_size) {
        derr(d, "send of %llu bytes > %s max %llu", (unsigned long long)len, d->dev_name,
             (unsigned long long)d->max_msg_size);
        return AFP_ETOOBIG;
    }
    int rc = want_peer(d, p);
    if (rc)
        return rc;
    if (d->tx_outstanding >= d->tx_depth || p->outstanding >= d->tx_depth)
        return AFP_EAGAIN;
    struct vb_op *op = op_get(d, AFP_EV_SEND_DONE, ctx, (uint32_t)peer);
    if (!op)
        return AFP_EAGAIN;
    struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)buf, .length = (uint32_t)len,
                          .lkey = desc ? ((struct ibv_mr *)desc)->lkey : 0};
    struct ibv_send_wr wr = {
        .wr_id = (uint64_t)(uintptr_t)op,
        .sg_list = &sge,
        .num_sge = len ? 1 : 0,
        .opcode = IBV_WR_SEND,
        .send_flags = IBV_SEND_SIGNALED | (len && len <= d->max_inline ? IBV_SEND_INLINE : 0),
    };
    struct ibv_send_wr *bad = NULL;
    int ret = ibv_post_send(p->qp[VB_QP_MSG], &wr, &bad);
    if (ret) {
        op_put(d, op);
        return post_failed(d, p, p->qp[VB_QP_MSG], ret, "ibv_post_send(send)");
    }
    p->outstanding++;
    d->tx_outstanding++;
    return 0;
}

static int vb_post_recv(afp_domain *d, void *buf, uint64_t len, void *desc, uint64_t ctx)
{
    struct vb_op *op = op_get(d, AFP_EV_RECV, ctx, UINT32_MAX);
    if (!op)
        return AFP_EAGAIN;
    struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)buf, .length = (uint32_t)len,
                          .lkey = desc ? ((struct ibv_mr *)desc)->lkey : 0};
    struct ibv_recv_wr wr = {.wr_id = (uint64_t)(uintptr_t)op, .sg_list = &sge, .num_sge = 1};
    struct ibv_recv_wr *bad = NULL;
    int ret = ibv_post_srq_recv(d->srq_msg, &wr, &bad);
    if (ret) {
        op_put(d, op);
        return ret == ENOMEM ? AFP_EAGAIN : fail_errno(d, "ibv_post_srq_recv", ret);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Completions                                                                           */

static void wc_error_text(afp_domain *d, const struct ibv_wc *wc, const struct vb_peer *p,
                          afp_event *ev)
{
    char g[64] = "?";
    if (p)
        gid_str(p->addr.gid, g, sizeof g);
    snprintf(ev->errtext, sizeof ev->errtext, "verbs %s: %s (status %d, vendor error 0x%x), "
             "peer %s", d->dev_name, d->lib->wc_status_str(wc->status), (int)wc->status,
             wc->vendor_err, g);
}

/* One work completion -> at most one event; returns whether *ev was filled. */
static bool on_wc(afp_domain *d, const struct ibv_wc *wc, afp_event *ev)
{
    uint64_t tag = wc->wr_id & VB_TAG_MASK;
    memset(ev, 0, sizeof *ev);
    if (tag == VB_TAG_IMM) {
        d->imm_missing++;
        if (wc->status != IBV_WC_SUCCESS)
            return false; /* flushed at teardown */
        ev->kind = AFP_EV_IMM;
        ev->imm = ntohl(wc->imm_data);
        return true;
    }
    if (tag == VB_TAG_UD_RECV) {
        uint32_t slot = (uint32_t)(wc->wr_id >> 3);
        if (wc->status == IBV_WC_SUCCESS)
            on_hello(d, d->ud_buf + (size_t)slot * VB_UD_SLOT_LEN, wc->byte_len);
        (void)post_ud_recv(d, slot); /* failure: one slot fewer; retransmission copes */
        return false;
    }
    if (tag == VB_TAG_UD_SEND) {
        d->ud_send_free[d->ud_send_nfree++] = (uint32_t)(wc->wr_id >> 3);
        return false;
    }
    if (tag != 0 || wc->wr_id == 0)
        return false;
    struct vb_op *op = (struct vb_op *)(uintptr_t)wc->wr_id;
    struct vb_peer *p = op->peer < d->npeers ? &d->peers[op->peer] : NULL;
    ev->ctx = op->user_ctx;
    if (op->kind != AFP_EV_RECV) {
        if (d->tx_outstanding)
            d->tx_outstanding--;
        if (p && p->outstanding)
            p->outstanding--;
    }
    if (wc->status == IBV_WC_SUCCESS) {
        ev->kind = op->kind;
        if (op->kind == AFP_EV_RECV)
            ev->len = wc->byte_len;
    } else {
        ev->kind = AFP_EV_ERROR;
        ev->op = op->kind;
        ev->status = map_wc(wc->status);
        wc_error_text(d, wc, p, ev);
        if (p && op->kind != AFP_EV_RECV) {
            p->broken = true; /* the RC QP is in the error state now */
            /* The peer refused an access: it is alive, and its side of the connection is
             * in the error state too without it knowing (rxe raises no async event for
             * that). Rebuilding the connection now, not on our next operation, tells it
             * before its own next operation is flushed. */
            if (wc->status == IBV_WC_REM_ACCESS_ERR || wc->status == IBV_WC_REM_INV_REQ_ERR ||
                wc->status == IBV_WC_REM_OP_ERR)
                d->reconnect_pending = true;
        }
    }
    op_put(d, op);
    return true;
}

/* Queue pairs the device put in the error state without a completion of ours saying so:
 * the responder side of a connection whose peer made an invalid access (the peer sees a
 * remote access error; we see only this event). Marking the peer broken makes the next
 * operation to it rebuild the connection instead of being flushed. */
static void drain_async(afp_domain *d)
{
    struct ibv_async_event ev;
    d->polls_since_async = 0;
    while (d->lib->get_async_event(d->ctx, &ev) == 0) {
        if (ev.event_type == IBV_EVENT_QP_FATAL || ev.event_type == IBV_EVENT_QP_REQ_ERR ||
            ev.event_type == IBV_EVENT_QP_ACCESS_ERR) {
            for (uint32_t i = 0; i < d->npeers; i++) {
                struct vb_peer *p = &d->peers[i];
                if (p->in_use && (p->qp[VB_QP_MSG] == ev.element.qp ||
                                  p->qp[VB_QP_WR] == ev.element.qp))
                    p->broken = true;
            }
        }
        d->lib->ack_async_event(&ev);
    }
}

static void drain_channel(afp_domain *d)
{
    struct ibv_cq *cq;
    void *cctx;
    while (d->lib->get_cq_event(d->ch, &cq, &cctx) == 0)
        d->unacked_events++;
    if (d->unacked_events >= 64) {
        d->lib->ack_cq_events(d->cq, d->unacked_events);
        d->unacked_events = 0;
    }
}

/* The sender of a receive or immediate completion, as a resolve handle: an RC queue pair is
 * connected to exactly one peer, so its number names the sender (a peer that connected to
 * us unasked has an entry too, which the shim never resolved and so never lists). A scan
 * of the peers, only while the shim asks for sources (its allow-list). */
static uint64_t wc_source(const afp_domain *d, const struct ibv_wc *wc, const afp_event *ev)
{
    int q = ev->kind == AFP_EV_RECV ? VB_QP_MSG : ev->kind == AFP_EV_IMM ? VB_QP_WR : -1;
    for (uint32_t i = 0; q >= 0 && i < d->npeers; i++) {
        const struct vb_peer *p = &d->peers[i];
        if (p->in_use && p->qp[q] && p->qp[q]->qp_num == wc->qp_num)
            return i;
    }
    return AFP_SRC_UNKNOWN; /* e.g. a queue pair replaced since (reconnection) */
}

/* One completion into ev[*got] (and its sender into src[*got], when asked). */
static void take_wc(afp_domain *d, const struct ibv_wc *wc, afp_event *ev, uint64_t *src,
                    uint32_t *got)
{
    if (!on_wc(d, wc, &ev[*got]))
        return;
    if (src)
        src[*got] = wc_source(d, wc, &ev[*got]);
    (*got)++;
}

static int poll_src(afp_domain *d, afp_event *ev, uint64_t *src, uint32_t max, uint32_t *n)
{
    uint32_t got = 0;
    int rc = 0;
    if (d->connecting)
        run_timers(d);
    if (++d->polls_since_async >= VB_ASYNC_EVERY)
        drain_async(d);
    /* completions read by trywait first */
    while (got < max && d->stash_at < d->nstash)
        take_wc(d, &d->stash[d->stash_at++], ev, src, &got);
    if (d->stash_at == d->nstash)
        d->stash_at = d->nstash = 0;
    struct ibv_wc wc[VB_POLL_BATCH];
    while (got < max && d->nstash == 0) {
        /* each completion yields at most one event: read no more than there is room for */
        int want = (int)(max - got < VB_POLL_BATCH ? max - got : VB_POLL_BATCH);
        int k = ibv_poll_cq(d->cq, want, wc);
        if (k < 0) {
            derr(d, "ibv_poll_cq on %s failed (%d)", d->dev_name, k);
            rc = AFP_EIO;
            break;
        }
        for (int j = 0; j < k; j++)
            take_wc(d, &wc[j], ev, src, &got);
        if (k < want)
            break;
    }
    if (d->reconnect_pending) {
        d->reconnect_pending = false;
        for (uint32_t i = 0; i < d->npeers; i++) {
            struct vb_peer *p = &d->peers[i];
            if (!p->in_use || !p->broken || p->state != VB_READY)
                continue;
            if (p->outstanding)
                d->reconnect_pending = true; /* flushes to drain first */
            else
                (void)want_peer(d, p); /* new QPs and a handshake, with its timeout */
        }
    }
    if (d->imm_missing >= VB_IMM_REPOST_BATCH || (d->imm_missing && got < max)) {
        int r = post_imm_recvs(d, d->imm_missing);
        if (r && !rc)
            rc = r;
    }
    *n = got;
    return got ? 0 : rc;
}

static int vb_poll(afp_domain *d, afp_event *ev, uint32_t max, uint32_t *n)
{
    return poll_src(d, ev, NULL, max, n);
}

static int vb_poll_from(afp_domain *d, afp_event *ev, uint64_t *src, uint32_t max, uint32_t *n)
{
    return poll_src(d, ev, src, max, n);
}

/* Whether a handshake has a retransmission timer running (operations wait for it). */
static bool timers_armed(const afp_domain *d)
{
    for (uint32_t i = 0; i < d->npeers && d->connecting; i++)
        if (d->peers[i].state == VB_CONNECTING && d->peers[i].deadline_ns)
            return true;
    return false;
}

static int vb_trywait(afp_domain *d)
{
    if (d->imm_missing || d->nstash || timers_armed(d))
        return AFP_EAGAIN; /* receives to repost, events to hand out, or handshake timers */
    drain_async(d);
    drain_channel(d);
    int ret = ibv_req_notify_cq(d->cq, 0);
    if (ret) {
        fail_errno(d, "ibv_req_notify_cq", ret);
        return AFP_EAGAIN; /* keep polling: spinning is always correct */
    }
    /* a completion that came before the notification was armed raises no event */
    int k = ibv_poll_cq(d->cq, VB_POLL_BATCH, d->stash);
    if (k > 0) {
        d->nstash = (uint32_t)k;
        d->stash_at = 0;
        return AFP_EAGAIN;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */

static const struct afp_ops g_ops = {
    .size = sizeof(struct afp_ops),
    .major = AFP_ABI_MAJOR,
    .minor = AFP_ABI_MINOR,
    .name = "verbs",
    .list_nics = vb_list_nics,
    .open = vb_open,
    .close = vb_close,
    .errbuf = vb_errbuf,
    .caps = vb_caps,
    .address = vb_address,
    .reg_mr = vb_reg_mr,
    .dereg_mr = vb_dereg_mr,
    .resolve = vb_resolve,
    .forget = vb_forget,
    .post_writes = vb_post_writes,
    .post_reads = vb_post_reads,
    .post_send = vb_post_send,
    .post_recv = vb_post_recv,
    .poll = vb_poll,
    .trywait = vb_trywait,
    .poll_from = vb_poll_from,
};

__attribute__((visibility("default"))) const struct afp_ops *afp_get_ops(void)
{
    return &g_ops;
}
