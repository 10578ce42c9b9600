/* fi_setup_bw: libfabric RMA writes between two processes, set up the way afabric's ofi
 * provider sets them up, in fi_rma_bw's loop (one thread per process, spinning on the CQ).
 * Each difference between the two can be switched on and off, to find which one costs.
 *
 *   cc -O2 -o /tmp/fi_setup_bw tools/repro/fi_setup_bw.c -lfabric
 *   /tmp/fi_setup_bw [-p shm] [-S 65536] [-W 64] [-n 20000] [-d 0|1] [-e 0|1] [-f 0|1] [-i 0|1]
 *              [-w 0|1] [-m 0|1] [-r 0|1] [-x 0|1] [-s SLOTS] [-c a,b]
 *
 *   -d  FI_DELIVERY_COMPLETE on every write (afabric: 1; fi_rma_bw: 0, -U gives 1)
 *   -e  FI_RMA_EVENT counter bound to the target's endpoint (afabric: 1)
 *   -f  CQ wait object FI_WAIT_FD (afabric: 1 where the provider takes it; fi_rma_bw: none)
 *   -i  write with an immediate, FI_REMOTE_CQ_DATA (both: 1)
 *   -w  afabric's mr_mode bits in the hints (FI_MR_ENDPOINT | FI_MR_HMEM ...) (afabric: 1)
 *   -m  FI_HMEM in the caps (afabric: 1 when libcuda loads)
 *   -r  FI_READ/FI_REMOTE_READ and FI_MSG caps (afabric: 1)
 *   -x  FI_SOURCE in the caps (afabric: 1 where the provider offers it)
 *   -s  rotate through SLOTS buffers of the size on both sides (afabric bench: its whole
 *       region; fi_rma_bw: 1, one cache-resident buffer)
 *   -c  pin the writer to CPU a and the target to CPU b
 *
 * The parent is the writer, a forked child the target; names and keys go over a pipe.
 * Prints one line: size, window, writes, seconds, GB/s. */
#define _GNU_SOURCE
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *prov = "shm";
static size_t size = 65536;
static int window = 64, iters = 20000, slots = 1;
static int opt_dc = 1, opt_cntr = 1, opt_fd = 1, opt_imm = 1, opt_mrmode = 1, opt_hmem = 0,
           opt_rcaps = 1, opt_source = 0, cpu_w = -1, cpu_t = -1;

#define CHECK(call)                                                                             \
    do {                                                                                        \
        int ret_ = (int)(call);                                                                 \
        if (ret_) {                                                                             \
            fprintf(stderr, "%s: %s (%d)\n", #call, fi_strerror(-ret_), ret_);                  \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

struct side {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_cntr *cntr;
    struct fid_ep *ep;
    struct fid_mr *mr;
    char *buf;
};

struct hello {
    char name[256];
    size_t name_len;
    uint64_t key, addr;
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void pin(int cpu)
{
    if (cpu < 0)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

static void open_side(struct side *s, int target)
{
    struct fi_info *h = fi_allocinfo();
    h->ep_attr->type = FI_EP_RDM;
    h->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    if (opt_rcaps)
        h->caps |= FI_MSG | FI_SEND | FI_RECV | FI_READ | FI_REMOTE_READ;
    if (opt_hmem)
        h->caps |= FI_HMEM;
    if (opt_cntr)
        h->caps |= FI_RMA_EVENT;
    if (opt_source)
        h->caps |= FI_SOURCE;
    h->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    if (opt_mrmode)
        h->domain_attr->mr_mode |= FI_MR_ENDPOINT | FI_MR_HMEM;
    h->domain_attr->cq_data_size = 4;
    h->domain_attr->threading = FI_THREAD_DOMAIN;
    if (opt_dc)
        h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    h->fabric_attr->prov_name = strdup(prov);
    CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &s->info));
    fi_freeinfo(h);
    if (s->info->mode & FI_RX_CQ_DATA) {
        fprintf(stderr, "provider needs FI_RX_CQ_DATA: not handled here\n");
        exit(1);
    }
    CHECK(fi_fabric(s->info->fabric_attr, &s->fabric, NULL));
    CHECK(fi_domain(s->fabric, s->info, &s->domain, NULL));
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    CHECK(fi_av_open(s->domain, &av_attr, &s->av, NULL));
    struct fi_cq_attr cq_attr = {.size = 2048, .format = FI_CQ_FORMAT_DATA,
                                 .wait_obj = opt_fd ? FI_WAIT_FD : FI_WAIT_NONE};
    if (fi_cq_open(s->domain, &cq_attr, &s->cq, NULL)) {
        cq_attr.wait_obj = FI_WAIT_NONE;
        CHECK(fi_cq_open(s->domain, &cq_attr, &s->cq, NULL));
        if (opt_fd && target)
            fprintf(stderr, "note: %s refused FI_WAIT_FD\n", prov);
    }
    CHECK(fi_endpoint(s->domain, s->info, &s->ep, NULL));
    CHECK(fi_ep_bind(s->ep, &s->av->fid, 0));
    CHECK(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV));
    if (opt_cntr) {
        struct fi_cntr_attr ca = {.events = FI_CNTR_EVENTS_COMP, .wait_obj = FI_WAIT_NONE};
        CHECK(fi_cntr_open(s->domain, &ca, &s->cntr, NULL));
        CHECK(fi_ep_bind(s->ep, &s->cntr->fid, FI_REMOTE_WRITE));
    }
    CHECK(fi_enable(s->ep));
    s->buf = aligned_alloc(4096, size * (size_t)slots);
    memset(s->buf, target ? 0 : 0x5a, size * (size_t)slots);
    uint64_t access = target ? FI_REMOTE_WRITE : FI_WRITE;
    CHECK(fi_mr_reg(s->domain, s->buf, size * (size_t)slots, access, 0, 0, 0, &s->mr, NULL));
    if (s->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        CHECK(fi_mr_bind(s->mr, &s->ep->fid, 0));
        CHECK(fi_mr_enable(s->mr));
    }
}

static int drain(struct side *s)
{
    struct fi_cq_data_entry e[64];
    ssize_t n = fi_cq_read(s->cq, e, 64);
    if (n > 0)
        return (int)n;
    if (n == -FI_EAGAIN)
        return 0;
    struct fi_cq_err_entry err = {0};
    fi_cq_readerr(s->cq, &err, 0);
    fprintf(stderr, "cq error: %s\n", fi_strerror(err.err));
    exit(1);
}

static void target(int wfd, int rfd)
{
    pin(cpu_t);
    struct side s = {0};
    open_side(&s, 1);
    struct hello me = {.name_len = sizeof me.name, .key = fi_mr_key(s.mr),
                       .addr = (uint64_t)(uintptr_t)s.buf};
    CHECK(fi_getname(&s.ep->fid, me.name, &me.name_len));
    if (write(wfd, &me, sizeof me) != sizeof me)
        exit(1);
    /* with an immediate, each write lands as a CQ entry here; without, the counter says */
    int total = iters + window, got = 0;
    while (got < total) {
        got += drain(&s);
        if (!opt_imm && s.cntr)
            got = (int)fi_cntr_read(s.cntr);
    }
    char done;
    if (read(rfd, &done, 1) != 1)
        exit(1);
    exit(0);
}

int main(int argc, char **argv)
{
    int c;
    while ((c = getopt(argc, argv, "p:S:W:n:d:e:f:i:w:m:r:x:s:c:")) != -1) {
        switch (c) {
        case 'p': prov = optarg; break;
        case 'S': size = strtoul(optarg, NULL, 0); break;
        case 'W': window = atoi(optarg); break;
        case 'n': iters = atoi(optarg); break;
        case 'd': opt_dc = atoi(optarg); break;
        case 'e': opt_cntr = atoi(optarg); break;
        case 'f': opt_fd = atoi(optarg); break;
        case 'i': opt_imm = atoi(optarg); break;
        case 'w': opt_mrmode = atoi(optarg); break;
        case 'm': opt_hmem = atoi(optarg); break;
        case 'r': opt_rcaps = atoi(optarg); break;
        case 'x': opt_source = atoi(optarg); break;
        case 's': slots = atoi(optarg) > 0 ? atoi(optarg) : 1; break;
        case 'c': sscanf(optarg, "%d,%d", &cpu_w, &cpu_t); break;
        default: return 2;
        }
    }
    if (!opt_imm && !opt_cntr) {
        fprintf(stderr, "-i 0 needs -e 1 (the target counts writes by its counter)\n");
        return 2;
    }
    int to_w[2], to_t[2];
    if (pipe(to_w) || pipe(to_t))
        return 1;
    pid_t pid = fork();
    if (pid == 0)
        target(to_w[1], to_t[0]);
    pin(cpu_w);
    struct side s = {0};
    open_side(&s, 0);
    struct hello peer;
    if (read(to_w[0], &peer, sizeof peer) != sizeof peer)
        return 1;
    fi_addr_t fa;
    if (fi_av_insert(s.av, peer.name, 1, &fa, 0, NULL) != 1)
        return 1;
    uint64_t flags = FI_COMPLETION | (opt_dc ? FI_DELIVERY_COMPLETE : 0) |
                     (opt_imm ? FI_REMOTE_CQ_DATA : 0);
    void *desc = fi_mr_desc(s.mr);
    struct iovec iov = {.iov_base = s.buf, .iov_len = size};
    struct fi_rma_iov rma = {.addr = peer.addr, .len = size, .key = peer.key};
    char *src0 = s.buf;
    uint64_t dst0 = peer.addr;
    struct fi_msg_rma msg = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = fa,
                             .rma_iov = &rma, .rma_iov_count = 1, .data = 7};
    struct fi_context2 ctx[1024];
    int posted = 0, done = 0, total = iters + window; /* the first window warms up */
    double t0 = 0;
    while (done < total) {
        while (posted < total && posted - done < window) {
            msg.context = &ctx[posted % 1024];
            size_t off = (size_t)(posted % slots) * size;
            iov.iov_base = src0 + off;
            rma.addr = dst0 + off;
            ssize_t ret = fi_writemsg(s.ep, &msg, flags);
            if (ret == -FI_EAGAIN)
                break;
            CHECK(ret);
            posted++;
        }
        int was = done;
        done += drain(&s);
        if (was < window && done >= window)
            t0 = now();
    }
    double dt = now() - t0;
    if (write(to_t[1], "x", 1) != 1)
        return 1;
    waitpid(pid, NULL, 0);
    printf("%s size %zu W %d writes %d %.3f s %.2f GB/s (dc %d cntr %d fd %d imm %d mrmode %d "
           "hmem %d rcaps %d source %d slots %d)\n",
           prov, size, window, iters, dt, (double)size * iters / dt / 1e9, opt_dc, opt_cntr,
           opt_fd, opt_imm, opt_mrmode, opt_hmem, opt_rcaps, opt_source, slots);
    return 0;
}
