/* shm117_layout_probe: what afabric's 1.17 shm workarounds (providers/ofi/ofi_shmfence.c) assume
 * about libfabric 1.17's private shm layout, measured on the machine at hand.
 *
 *   cc -O1 -o /tmp/shm117_layout_probe tools/repro/shm117_layout_probe.c -lfabric
 *   /tmp/shm117_layout_probe 65536          # cross-memory-attach writes (smr_src_iov, op_src 2)
 *   WATCH=1 /tmp/shm117_layout_probe 2048   # one bounce-buffer write (smr_src_sar, op_src 4): the
 *                                 # statuses its response slot takes, unprogressed by us
 *
 * A forked child is the target: it progresses for 300 ms, then stops. The parent makes one
 * delivery-complete write (connecting), waits, makes three more that stay pending, and
 * prints its own region's header words, the response queue (offset at byte 72: size, mask,
 * read and write counts) and, for each pending slot, the send entry's command fields
 * (op_src at byte 20, src_data at 32 = the slot's own offset) and where in the entry the
 * write's context sits (264). Measured with 1.17.0 on Debian 12: as in ofi_shmfence.c;
 * status 16 (FI_EBUSY) while a cross-memory-attach write is pending; a bounce-buffer
 * write's slot goes 1026 (data in the buffer) -> 1025 (taken by the target). */
#define _GNU_SOURCE
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
#define CK(x) do { int r_ = (int)(x); if (r_) { fprintf(stderr, "%s: %d\n", #x, r_); exit(1);} } while (0)
struct side { struct fi_info *info; struct fid_fabric *f; struct fid_domain *d; struct fid_av *av; struct fid_cq *cq; struct fid_ep *ep; struct fid_mr *mr; char *buf; };
static void open_side(struct side *s, size_t size) {
    struct fi_info *h = fi_allocinfo();
    h->ep_attr->type = FI_EP_RDM; h->caps = FI_RMA | FI_MSG;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    h->tx_attr->op_flags = FI_DELIVERY_COMPLETE; h->fabric_attr->prov_name = strdup("shm");
    h->mode = FI_CONTEXT | FI_CONTEXT2;
    CK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &s->info));
    CK(fi_fabric(s->info->fabric_attr, &s->f, NULL)); CK(fi_domain(s->f, s->info, &s->d, NULL));
    struct fi_av_attr aa = {.type = FI_AV_TABLE}; CK(fi_av_open(s->d, &aa, &s->av, NULL));
    struct fi_cq_attr ca = {.size = 1024, .format = FI_CQ_FORMAT_DATA}; CK(fi_cq_open(s->d, &ca, &s->cq, NULL));
    CK(fi_endpoint(s->d, s->info, &s->ep, NULL)); CK(fi_ep_bind(s->ep, &s->av->fid, 0));
    CK(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(s->ep));
    s->buf = aligned_alloc(4096, size); memset(s->buf, 1, size);
    CK(fi_mr_reg(s->d, s->buf, size, FI_REMOTE_WRITE | FI_WRITE, 0, 0, 0, &s->mr, NULL));
    if (s->info->domain_attr->mr_mode & FI_MR_ENDPOINT) { CK(fi_mr_bind(s->mr, &s->ep->fid, 0)); CK(fi_mr_enable(s->mr)); }
}
struct hello { char name[256]; size_t len; uint64_t key, addr; };
int main(int argc, char **argv) {
    size_t size = argc > 1 ? strtoul(argv[1], 0, 0) : 65536;
    int p[2]; pipe(p);
    pid_t pid = fork();
    if (!pid) { struct side s = {0}; open_side(&s, size); struct hello h = {.len = 256, .key = fi_mr_key(s.mr), .addr = (uint64_t)(uintptr_t)s.buf};
        fi_getname(&s.ep->fid, h.name, &h.len); write(p[1], &h, sizeof h); struct fi_cq_data_entry e; for (int i = 0; i < 300; i++) { fi_cq_read(s.cq, &e, 1); usleep(1000); } pause(); return 0; }
    struct side s = {0}; open_side(&s, size); struct hello h; read(p[0], &h, sizeof h);
    fi_addr_t fa; fi_av_insert(s.av, h.name, 1, &fa, 0, NULL);
    char me[256]; size_t ml = 256; fi_getname(&s.ep->fid, me, &ml);
    printf("me %s peer %s\n", me, h.name);
    static struct fi_context2 ctx[8];
    void *desc = fi_mr_desc(s.mr);
    { /* connect: a first write, progressed until done */
        struct iovec iov = {s.buf, size}; struct fi_rma_iov rma = {h.addr, size, h.key};
        struct fi_msg_rma m = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = fa, .rma_iov = &rma, .rma_iov_count = 1, .context = &ctx[7]};
        int r; while ((r = (int)fi_writemsg(s.ep, &m, FI_COMPLETION | FI_DELIVERY_COMPLETE)) == -FI_EAGAIN) { struct fi_cq_data_entry e; fi_cq_read(s.cq, &e, 1); }
        CK(r); struct fi_cq_data_entry e; while (fi_cq_read(s.cq, &e, 1) != 1) ; printf("first write done\n");
    }
    if (getenv("WATCH")) {
        char path[300]; snprintf(path, sizeof path, "/dev/shm/%s", me + strlen("fi_shm://"));
        FILE *f = fopen("/proc/self/maps", "r"); char line[1024]; unsigned long lo = 0;
        while (fgets(line, sizeof line, f)) if (strstr(line, path)) { sscanf(line, "%lx", &lo); break; }
        uint64_t *q = (uint64_t *)(lo + ((uint64_t *)lo)[9]);
        struct iovec iov = {s.buf, size}; struct fi_rma_iov rma = {h.addr, size, h.key};
        struct fi_msg_rma m = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = fa, .rma_iov = &rma, .rma_iov_count = 1, .context = &ctx[6]};
        uint64_t k = q[3];
        CK(fi_writemsg(s.ep, &m, FI_COMPLETION | FI_DELIVERY_COMPLETE));
        volatile uint64_t *st = &q[4 + 2 * (k & q[1]) + 1];
        uint64_t last = 999999; for (int i = 0; i < 20000000; i++) { uint64_t v = *st; if (v != last) { printf("slot status -> %ld\n", (long)v); last = v; } }
        kill(pid, 9); return 0;
    }
    usleep(500000); /* the target stops progressing */
    for (int i = 0; i < 3; i++) {
        struct iovec iov = {s.buf, size}; struct fi_rma_iov rma = {h.addr, size, h.key};
        struct fi_msg_rma m = {.msg_iov = &iov, .desc = &desc, .iov_count = 1, .addr = fa, .rma_iov = &rma, .rma_iov_count = 1, .context = &ctx[i]};
        int r, tries = 0; while ((r = (int)fi_writemsg(s.ep, &m, FI_COMPLETION | FI_DELIVERY_COMPLETE)) == -FI_EAGAIN && tries++ < 1000) { struct fi_cq_data_entry e; fi_cq_read(s.cq, &e, 1); usleep(100); }
        printf("write %d: %d\n", i, r);
        printf("ctx[%d] = %p\n", i, (void *)&ctx[i]);
    }
    struct fi_cq_data_entry e; for (int i = 0; i < 100; i++) { fi_cq_read(s.cq, &e, 1); usleep(1000); }
    /* find our region: the mapping of /dev/shm/<name after fi_shm://> */
    char path[300]; snprintf(path, sizeof path, "/dev/shm/%s", me + strlen("fi_shm://"));
    FILE *f = fopen("/proc/self/maps", "r"); char line[1024]; unsigned long lo = 0, hi = 0;
    while (fgets(line, sizeof line, f)) if (strstr(line, path)) { sscanf(line, "%lx-%lx", &lo, &hi); break; }
    printf("region %s at %lx len %lu\n", path, lo, hi - lo);
    uint64_t *w = (uint64_t *)lo;
    for (int i = 0; i < 16; i++) printf("  @%3d: %#lx\n", i * 8, w[i]);
    uint64_t roff = w[72 / 8];
    uint64_t *q = (uint64_t *)(lo + roff);
    printf("resp queue @%lu: size %lu mask %lu rcnt %lu wcnt %lu\n", roff, q[0], q[1], q[2], q[3]);
    for (uint64_t k = q[2]; k < q[3]; k++) {
        uint64_t *slot = &q[4 + 2 * (k & q[1])];
        printf(" slot %lu: msg_id %#lx status %ld\n", k, slot[0], (long)slot[1]);
        uint64_t *tx = (uint64_t *)slot[0];
        printf("   hdr: msg_id %#lx id %ld op %u op_src %u size %lu src_data %#lx data %#lx peer_id %ld slotoff %#lx\n", tx[0], (long)tx[1], *(uint32_t *)((char *)tx + 16), *(uint16_t *)((char *)tx + 20), tx[3], tx[4], tx[5], (long)tx[32], (unsigned long)((char *)slot - (char *)lo));
        for (int j = 0; j < 128; j++) for (int c = 0; c < 3; c++) if (tx[j] == (uint64_t)(uintptr_t)&ctx[c]) printf("   ctx[%d] at tx+%d\n", c, j * 8);
    }
    kill(pid, 9); waitpid(pid, 0, 0);
    return 0;
}
