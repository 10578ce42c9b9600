/* shm117_source_probe: which sender fi_cq_readfrom names for a message from a peer the
 * receiver never inserted in its AV, once the receiver's CQ ring has gone round (what
 * providers/ofi/ofi.c's open_rx_cq is for).
 *
 *   cc -O1 -o shm117_source_probe shm117_source_probe.c -lfabric
 *   ./shm117_source_probe 200 64   # receiver CQ of 64 slots: B named as A (1.17)
 *   ./shm117_source_probe 10 64    # the ring has not gone round: B named as 0
 *   ./shm117_source_probe 200 1    # a CQ of one slot: B named FI_ADDR_NOTAVAIL (-1)
 *   LD_LIBRARY_PATH=<dir of 2.5.1's libfabric.so.1> ./shm117_source_probe 200 64   # -1
 *
 * The receiver R (FI_SOURCE, its own address at AV index 0 as afabric does) inserts sender
 * A, not sender B; forked children A and B send 8-byte messages, A's first, then B's. R
 * prints the source each completion reports. Measured with 1.17.0 on Debian 12: A's are
 * named 1, and B's 1 too once A's messages used every slot of the ring (0 before): util_cq
 * writes a completion's source into the slot's entry of its source array only when the
 * completion has one (ofi_cq_write_src), and shm reports a sender not in the AV with
 * ofi_cq_write, leaving the slot's old source. An entry that does not fit the ring goes on
 * the overflow list with its own source (FI_ADDR_NOTAVAIL for B); with one slot, every
 * entry does. 2.5.1 writes every entry's source: B is FI_ADDR_NOTAVAIL at any ring size. */
#define _GNU_SOURCE
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#define CK(x) do { int r_ = (int)(x); if (r_) { fprintf(stderr, "%s: %d\n", #x, r_); exit(1); } } while (0)
#define NAME 256
#define SLOTS 64
struct side { struct fi_info *info; struct fid_fabric *f; struct fid_domain *d; struct fid_av *av; struct fid_cq *cq; struct fid_ep *ep; };
static void open_side(struct side *s, int source, size_t cq_size) {
    struct fi_info *h = fi_allocinfo();
    h->ep_attr->type = FI_EP_RDM; h->caps = FI_MSG | (source ? FI_SOURCE : 0);
    h->fabric_attr->prov_name = strdup("shm"); h->mode = FI_CONTEXT | FI_CONTEXT2;
    CK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &s->info));
    CK(fi_fabric(s->info->fabric_attr, &s->f, NULL)); CK(fi_domain(s->f, s->info, &s->d, NULL));
    struct fi_av_attr aa = {.type = FI_AV_TABLE}; CK(fi_av_open(s->d, &aa, &s->av, NULL));
    struct fi_cq_attr ca = {.size = cq_size, .format = FI_CQ_FORMAT_DATA}; CK(fi_cq_open(s->d, &ca, &s->cq, NULL));
    CK(fi_endpoint(s->d, s->info, &s->ep, NULL)); CK(fi_ep_bind(s->ep, &s->av->fid, 0));
    CK(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(s->ep));
}
static void close_side(struct side *s) { /* its /dev/shm file goes with its endpoint */
    fi_close(&s->ep->fid); fi_close(&s->cq->fid); fi_close(&s->av->fid);
    fi_close(&s->d->fid); fi_close(&s->f->fid); fi_freeinfo(s->info);
}
/* A child: sends n messages whose first byte is `who` to R once told to go. */
static void sender(const char *rname, char who, int n, int to_r, int from_r) {
    struct side s = {0}; open_side(&s, 0, SLOTS);
    fi_addr_t fa; if (fi_av_insert(s.av, rname, 1, &fa, 0, NULL) != 1) exit(2);
    char me[NAME] = {0}; size_t ml = sizeof me; CK(fi_getname(&s.ep->fid, me, &ml));
    if (write(to_r, me, sizeof me) != (ssize_t)sizeof me) exit(3);
    char go; if (read(from_r, &go, 1) != 1) exit(3);
    static struct fi_context2 ctx[4096]; char buf[8] = {who}; struct fi_cq_data_entry e;
    for (int i = 0; i < n; i++) {
        ssize_t r;
        while ((r = fi_send(s.ep, buf, sizeof buf, NULL, fa, &ctx[i])) == -FI_EAGAIN) (void)fi_cq_read(s.cq, &e, 1);
        if (r) exit(4);
    }
    for (int done = 0; done < n;) if (fi_cq_read(s.cq, &e, 1) > 0) done++;
    if (write(to_r, "d", 1) != 1) exit(3);
    char end; if (read(from_r, &end, 1) != 1) exit(3); /* R has read all */
    close_side(&s);
    exit(0);
}
int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    int na = argc > 1 ? atoi(argv[1]) : 200, nb = 4;
    size_t cq_size = argc > 2 ? strtoul(argv[2], NULL, 0) : SLOTS;
    if (na < 1 || na > 4000) return 2;
    struct side r = {0}; open_side(&r, 1, cq_size);
    char rname[NAME] = {0}; size_t rl = sizeof rname; CK(fi_getname(&r.ep->fid, rname, &rl));
    fi_addr_t self; if (fi_av_insert(r.av, rname, 1, &self, 0, NULL) != 1) return 1;
    int pa[2], ga[2], pb[2], gb[2];
    if (pipe(pa) || pipe(ga) || pipe(pb) || pipe(gb)) return 1;
    if (!fork()) sender(rname, 'A', na, pa[1], ga[0]);
    if (!fork()) sender(rname, 'B', nb, pb[1], gb[0]);
    char an[NAME], bn[NAME];
    if (read(pa[0], an, NAME) != NAME || read(pb[0], bn, NAME) != NAME) return 1;
    fi_addr_t fa_a; if (fi_av_insert(r.av, an, 1, &fa_a, 0, NULL) != 1) return 1; /* B never */
    printf("libfabric %u.%u, CQ of %zu: self=%lu A=%lu (B not inserted)\n", FI_MAJOR(fi_version()),
           FI_MINOR(fi_version()), cq_size, (unsigned long)self, (unsigned long)fa_a);
    static char bufs[SLOTS][8]; static struct fi_context2 ctx[SLOTS];
    for (int i = 0; i < SLOTS; i++) CK(fi_recv(r.ep, bufs[i], 8, NULL, FI_ADDR_UNSPEC, &ctx[i]));
    if (write(ga[1], "g", 1) != 1) return 1;
    for (int got = 0, told_b = 0; got < na + nb;) {
        if (!told_b && got == na) { if (write(gb[1], "g", 1) != 1) return 1; told_b = 1; }
        struct fi_cq_data_entry e[8]; fi_addr_t from[8];
        ssize_t n = fi_cq_readfrom(r.cq, e, 8, from);
        for (ssize_t i = 0; i < n; i++, got++) {
            int slot = (int)((struct fi_context2 *)e[i].op_context - ctx);
            if (bufs[slot][0] == 'B' || got == 0 || got == na - 1)
                printf("message %d, from %c: named %lld\n", got, bufs[slot][0], (long long)from[i]);
            CK(fi_recv(r.ep, bufs[slot], 8, NULL, FI_ADDR_UNSPEC, &ctx[slot]));
        }
    }
    char d;
    if (read(pa[0], &d, 1) != 1 || read(pb[0], &d, 1) != 1) return 1;
    if (write(ga[1], "e", 1) != 1 || write(gb[1], "e", 1) != 1) return 1;
    while (wait(NULL) > 0) {}
    close_side(&r);
    return 0;
}
