/*
 * Single-process test of libafabric_verbs.so through the provider ABI only, on a real
 * RDMA device (Soft-RoCE rxe0 in the qemu guest of tests/rxe/guest.py):
 *
 *   cc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -Ishim \
 *      tests/native/test_verbs.c -o /tmp/test_verbs -ldl
 *   /tmp/test_verbs path/to/libafabric_verbs.so [device]
 *
 * Not part of the library (it lives in tests/native/, outside build_native.py's sources).
 * Two domains A and B on one
 * device (two rxe devices in one guest cannot reach each other). B drops the first two
 * handshake datagrams it receives (AFABRIC_VERBS_TEST_DROP_HELLOS), so the connection
 * only comes up if A retransmits. Then: 64 shuffled 16 KiB writes with immediates in one
 * post_writes call (chains of 4 per doorbell), verified byte by byte; 100,000 zero-length
 * writes with immediates, all counted at B with no error, and the device's RNR counters
 * (hw_counters/send_rnr_err, rcvd_rnr_err) unchanged: the provider's immediate receive
 * queue never ran dry; SEND/RECV both ways (B's side of the connection was
 * made passively); B's wait fd wakes for a message that arrives after trywait allowed
 * sleeping; a write to an address no peer answers fails with AFP_ETIMEDOUT within the
 * connect timeout; a write with a forged key fails with an error event (no hang); then
 * the target (whose side of the connection the error broke too) writes to the writer and
 * the writer to the target again: both succeed on a rebuilt connection; two fresh
 * domains that write to each other before either polls (crossed handshakes) both land.
 */
#include <dlfcn.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "afabric_provider.h"

#define KIB 1024u
#define NPAGES 64u
#define PAGE (16u * KIB)
#define REGION (NPAGES * PAGE)
#define NIMM 100000u
#define TX_DEPTH 256u
#define RX_DEPTH 16u
#define MSG_LEN 4096u
#define CONNECT_MS 1500u
#define BADKEY_CTX 777u

static const struct afp_ops *ops;
static const char *stage = "start";

#define CHECK(cond, ...)                                                                       \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "FAIL [%s] %s:%d: ", stage, __FILE__, __LINE__);                   \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fprintf(stderr, "\n");                                                             \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

struct side {
    afp_domain *dom;
    const char *name;
    uint64_t imms, imm_sum, writes_done, sends_done, errors, recvs;
    int last_error;
    uint64_t last_error_ctx;
    char last_errtext[AFP_ERRTEXT_LEN];
    char recv_buf[RX_DEPTH][MSG_LEN];
    uint64_t recv_len[RX_DEPTH];
    bool recv_seen[RX_DEPTH];
    void *recv_desc;
};

static void poll_side(struct side *s)
{
    afp_event ev[64];
    uint32_t n = 0;
    int rc = ops->poll(s->dom, ev, 64, &n);
    CHECK(rc == 0 || rc == AFP_EAGAIN, "%s poll: %d %s", s->name, rc, ops->errbuf(s->dom));
    for (uint32_t i = 0; i < n; i++) {
        switch (ev[i].kind) {
        case AFP_EV_IMM:
            s->imms++;
            s->imm_sum += ev[i].imm;
            break;
        case AFP_EV_WRITE_DONE:
            s->writes_done++;
            break;
        case AFP_EV_SEND_DONE:
            s->sends_done++;
            break;
        case AFP_EV_RECV:
            CHECK(ev[i].ctx < RX_DEPTH, "recv ctx %llu", (unsigned long long)ev[i].ctx);
            s->recvs++;
            s->recv_seen[ev[i].ctx] = true;
            s->recv_len[ev[i].ctx] = ev[i].len;
            break;
        case AFP_EV_ERROR:
            s->errors++;
            s->last_error = ev[i].status;
            s->last_error_ctx = ev[i].ctx;
            snprintf(s->last_errtext, sizeof s->last_errtext, "%s", ev[i].errtext);
            break;
        default:
            break;
        }
    }
}

/* A device counter from sysfs (rxe and mlx5 keep RNR counts there); -1 if absent. */
static long long hw_counter(const char *dev, const char *name)
{
    char path[256];
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/1/hw_counters/%s", dev, name);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long long v = -1;
    if (fscanf(f, "%lld", &v) != 1)
        v = -1;
    fclose(f);
    return v;
}

static void poll_both(struct side *a, struct side *b)
{
    poll_side(a);
    poll_side(b);
}

/* Post all n writes, polling both sides whenever the provider says "again". */
static void post_all(struct side *a, struct side *b, afp_write *wr, uint32_t n, double limit_s)
{
    double t0 = now_s();
    uint32_t at = 0;
    while (at < n) {
        uint32_t posted = 0;
        int rc = ops->post_writes(a->dom, wr + at, n - at, &posted);
        at += posted;
        CHECK(rc == 0 || rc == AFP_EAGAIN, "post_writes: %d %s", rc, ops->errbuf(a->dom));
        if (rc == AFP_EAGAIN || posted == 0)
            poll_both(a, b);
        CHECK(now_s() - t0 < limit_s, "posting %u writes took over %.0f s (%u posted)", n,
              limit_s, at);
    }
}

static void wait_for(struct side *a, struct side *b, const uint64_t *counter, uint64_t want,
                     double limit_s)
{
    double t0 = now_s();
    while (*counter < want) {
        poll_both(a, b);
        CHECK(a->errors == 0 && b->errors == 0, "error event: %s%s", a->last_errtext,
              b->last_errtext);
        CHECK(now_s() - t0 < limit_s, "waited %.0f s: %llu of %llu", limit_s,
              (unsigned long long)*counter, (unsigned long long)want);
    }
}

int main(int argc, char **argv)
{
    const char *lib = argc > 1 ? argv[1] : "libafabric_verbs.so";
    const char *dev = argc > 2 ? argv[2] : NULL;
    char err[AFP_ERRTEXT_LEN] = "";
    setvbuf(stdout, NULL, _IONBF, 0);

    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    CHECK(h, "dlopen %s: %s", lib, dlerror());
    afp_get_ops_fn get = (afp_get_ops_fn)dlsym(h, "afp_get_ops");
    CHECK(get, "no afp_get_ops");
    ops = get();
    CHECK(ops->major == AFP_ABI_MAJOR && strcmp(ops->name, "verbs") == 0, "bad table");

    stage = "list_nics";
    afp_open_args args = {.nic = dev, .rx_depth = RX_DEPTH, .tx_depth = TX_DEPTH};
    afp_nic_info nics[8];
    uint32_t nn = 0;
    int rc = ops->list_nics(&args, nics, 8, &nn, err, sizeof err);
    CHECK(rc == 0 && nn >= 1, "list_nics: rc %d, %u NICs: %s", rc, nn, err);
    printf("NIC %s (%s), %llu bit/s\n", nics[0].name, nics[0].fabric,
           (unsigned long long)nics[0].link_speed_bps);

    stage = "open";
    char timeout_ms[16];
    snprintf(timeout_ms, sizeof timeout_ms, "%u", CONNECT_MS);
    setenv("AFABRIC_VERBS_CONNECT_TIMEOUT_MS", timeout_ms, 1);
    static struct side A = {.name = "A"}, B = {.name = "B"};
    rc = ops->open(&args, &A.dom, err, sizeof err);
    CHECK(rc == 0, "open A: %d %s", rc, err);
    setenv("AFABRIC_VERBS_TEST_DROP_HELLOS", "2", 1);
    rc = ops->open(&args, &B.dom, err, sizeof err);
    unsetenv("AFABRIC_VERBS_TEST_DROP_HELLOS");
    CHECK(rc == 0, "open B: %d %s", rc, err);
    afp_caps caps;
    CHECK(ops->caps(A.dom, &caps) == 0, "caps");
    printf("provider %s, flags 0x%x, max_msg %llu, inline %llu\n", caps.provider, caps.flags,
           (unsigned long long)caps.max_msg_size, (unsigned long long)caps.inject_size);
    CHECK(!(caps.flags & AFP_CAP_IMM_NEEDS_RECV), "immediates must not need the shim's receives");
    CHECK(caps.wait_fd >= 0, "no wait fd");

    uint8_t addr_a[AFP_MAX_ADDR_LEN], addr_b[AFP_MAX_ADDR_LEN];
    size_t la = sizeof addr_a, lb = sizeof addr_b;
    CHECK(ops->address(A.dom, addr_a, &la) == 0 && ops->address(B.dom, addr_b, &lb) == 0,
          "address");
    uint64_t a_to_b, b_to_a;
    CHECK(ops->resolve(A.dom, addr_b, lb, &a_to_b) == 0, "resolve B: %s", ops->errbuf(A.dom));
    CHECK(ops->resolve(B.dom, addr_a, la, &b_to_a) == 0, "resolve A: %s", ops->errbuf(B.dom));
    uint8_t junk[8] = {1, 2, 3};
    uint64_t dummy;
    CHECK(ops->resolve(A.dom, junk, sizeof junk, &dummy) == AFP_EBADDESC, "junk address taken");

    stage = "register";
    uint8_t *src = aligned_alloc(4096, REGION), *dst = aligned_alloc(4096, REGION);
    CHECK(src && dst, "alloc");
    for (uint32_t i = 0; i < REGION; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    memset(dst, 0, REGION);
    afp_mr *mr_src, *mr_dst, *mr_rb, *mr_sb;
    void *d_src, *d_dst, *d_sb;
    uint64_t k_src, k_dst, k_rb, k_sb, base_src, base_dst, base_rb, base_sb;
    CHECK(ops->reg_mr(A.dom, src, REGION, 0, -1, 1, &mr_src, &d_src, &k_src, &base_src) == 0,
          "reg src: %s", ops->errbuf(A.dom));
    CHECK(ops->reg_mr(B.dom, dst, REGION, AFP_MR_REMOTE, -1, 2, &mr_dst, &d_dst, &k_dst,
                      &base_dst) == 0,
          "reg dst: %s", ops->errbuf(B.dom));
    CHECK(base_dst == (uint64_t)(uintptr_t)dst, "remote base is not the virtual address");
    CHECK(ops->reg_mr(B.dom, B.recv_buf, sizeof B.recv_buf, 0, -1, 3, &mr_rb, &B.recv_desc, &k_rb,
                      &base_rb) == 0,
          "reg B recv: %s", ops->errbuf(B.dom));
    static char send_buf[MSG_LEN];
    CHECK(ops->reg_mr(A.dom, send_buf, sizeof send_buf, 0, -1, 4, &mr_sb, &d_sb, &k_sb,
                      &base_sb) == 0,
          "reg send: %s", ops->errbuf(A.dom));
    for (uint32_t i = 0; i < RX_DEPTH; i++)
        CHECK(ops->post_recv(B.dom, B.recv_buf[i], MSG_LEN, B.recv_desc, i) == 0, "post_recv");

    stage = "paged writes (handshake with 2 lost datagrams)";
    afp_write wr[NPAGES];
    uint32_t perm[NPAGES];
    for (uint32_t i = 0; i < NPAGES; i++)
        perm[i] = i;
    srand(7);
    for (uint32_t i = NPAGES - 1; i > 0; i--) {
        uint32_t j = (uint32_t)rand() % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    uint64_t want_sum = 0;
    for (uint32_t i = 0; i < NPAGES; i++) {
        wr[i] = (afp_write){.local_addr = src + (size_t)i * PAGE, .local_desc = d_src,
                            .length = PAGE, .peer = a_to_b,
                            .remote_addr = base_dst + (uint64_t)perm[i] * PAGE,
                            .remote_key = k_dst, .ctx = 1000 + i, .imm = 0x1000 + i,
                            .has_imm = 1};
        want_sum += 0x1000 + i;
    }
    double t0 = now_s();
    post_all(&A, &B, wr, NPAGES, 10);
    wait_for(&A, &B, &B.imms, NPAGES, 20);
    wait_for(&A, &B, &A.writes_done, NPAGES, 20);
    printf("connect + %u x %u KiB writes: %.3f s\n", NPAGES, PAGE / KIB, now_s() - t0);
    CHECK(B.imm_sum == want_sum, "immediate values wrong");
    for (uint32_t i = 0; i < NPAGES; i++)
        CHECK(memcmp(dst + (size_t)perm[i] * PAGE, src + (size_t)i * PAGE, PAGE) == 0,
              "page %u landed wrong", i);

    stage = "100000 immediates";
    B.imms = B.imm_sum = 0;
    A.writes_done = 0;
    static afp_write zw[NIMM];
    uint64_t zsum = 0;
    for (uint32_t i = 0; i < NIMM; i++) {
        zw[i] = (afp_write){.length = 0, .peer = a_to_b, .remote_addr = base_dst,
                            .remote_key = k_dst, .ctx = i, .imm = i * 7u, .has_imm = 1};
        zsum += (uint64_t)i * 7u;
    }
    long long rnr_sent = hw_counter(nics[0].name, "send_rnr_err");
    long long rnr_rcvd = hw_counter(nics[0].name, "rcvd_rnr_err");
    t0 = now_s();
    post_all(&A, &B, zw, NIMM, 120);
    wait_for(&A, &B, &B.imms, NIMM, 120);
    wait_for(&A, &B, &A.writes_done, NIMM, 120);
    double dt = now_s() - t0;
    printf("%u immediates: %.2f s (%.0f/s), no error\n", NIMM, dt, NIMM / dt);
    CHECK(B.imms == NIMM && B.imm_sum == zsum, "immediates: %llu counted",
          (unsigned long long)B.imms);
    long long rnr_sent2 = hw_counter(nics[0].name, "send_rnr_err");
    long long rnr_rcvd2 = hw_counter(nics[0].name, "rcvd_rnr_err");
    if (rnr_sent >= 0 && rnr_rcvd >= 0) {
        printf("RNR NAKs during the burst: sent %lld, received %lld\n", rnr_sent2 - rnr_sent,
               rnr_rcvd2 - rnr_rcvd);
        CHECK(rnr_sent2 == rnr_sent && rnr_rcvd2 == rnr_rcvd, "the immediate queue ran dry");
    }

    stage = "send/recv";
    strcpy(send_buf, "hello over verbs");
    CHECK(ops->post_send(A.dom, a_to_b, send_buf, strlen(send_buf) + 1, d_sb, 55) == 0,
          "post_send A: %s", ops->errbuf(A.dom));
    wait_for(&A, &B, &B.recvs, 1, 10);
    wait_for(&A, &B, &A.sends_done, 1, 10);
    bool found = false;
    for (uint32_t i = 0; i < RX_DEPTH; i++)
        if (B.recv_seen[i]) {
            found = strcmp(B.recv_buf[i], "hello over verbs") == 0 &&
                    B.recv_len[i] == strlen(send_buf) + 1;
            B.recv_seen[i] = false;
            CHECK(ops->post_recv(B.dom, B.recv_buf[i], MSG_LEN, B.recv_desc, i) == 0, "repost");
        }
    CHECK(found, "message content wrong");
    /* B -> A: B's queue pairs were made passively; A has no receive posted yet, so the
     * message waits (RNR retry) until it has one */
    static char a_rbuf[MSG_LEN];
    afp_mr *mr_ar;
    void *d_ar;
    uint64_t k_ar, b_ar;
    CHECK(ops->reg_mr(A.dom, a_rbuf, sizeof a_rbuf, 0, -1, 5, &mr_ar, &d_ar, &k_ar, &b_ar) == 0,
          "reg");
    static char b_sbuf[64] = "and back";
    afp_mr *mr_bs;
    void *d_bs;
    uint64_t k_bs, b_bs;
    CHECK(ops->reg_mr(B.dom, b_sbuf, sizeof b_sbuf, 0, -1, 6, &mr_bs, &d_bs, &k_bs, &b_bs) == 0,
          "reg");
    CHECK(ops->post_send(B.dom, b_to_a, b_sbuf, 9, d_bs, 66) == 0, "post_send B: %s",
          ops->errbuf(B.dom));
    for (int i = 0; i < 50; i++)
        poll_both(&A, &B);
    CHECK(ops->post_recv(A.dom, a_rbuf, MSG_LEN, d_ar, 0) == 0, "post_recv A");
    wait_for(&A, &B, &A.recvs, 1, 10);
    CHECK(strcmp(a_rbuf, "and back") == 0, "B -> A message wrong");

    stage = "wait fd";
    afp_caps cb;
    CHECK(ops->caps(B.dom, &cb) == 0, "caps B");
    for (int i = 0; i < 100; i++)
        poll_both(&A, &B);
    int tw = AFP_EAGAIN;
    for (int i = 0; i < 1000 && tw == AFP_EAGAIN; i++) {
        poll_side(&B);
        tw = ops->trywait(B.dom);
    }
    CHECK(tw == 0, "trywait never allowed sleeping");
    uint64_t recvs_before = B.recvs;
    CHECK(ops->post_send(A.dom, a_to_b, send_buf, 8, d_sb, 56) == 0, "post_send");
    struct pollfd pfd = {.fd = cb.wait_fd, .events = POLLIN};
    double tw0 = now_s();
    int pr = 0;
    while (pr == 0 && now_s() - tw0 < 5) {
        poll_side(&A); /* A must progress its send; B sleeps */
        pr = poll(&pfd, 1, 10);
    }
    CHECK(pr == 1, "B's wait fd did not wake up for an arriving message");
    wait_for(&A, &B, &B.recvs, recvs_before + 1, 10);

    stage = "peer that never answers";
    uint8_t ghost[AFP_MAX_ADDR_LEN];
    memcpy(ghost, addr_a, la);
    ghost[12] ^= 0x5a; /* another nonce: A ignores handshakes meant for someone else */
    uint64_t b_to_ghost;
    CHECK(ops->resolve(B.dom, ghost, la, &b_to_ghost) == 0, "resolve ghost");
    afp_write gw = {.local_addr = dst, .local_desc = d_dst, .length = 64, .peer = b_to_ghost,
                    .remote_addr = 4096, .remote_key = 1, .ctx = 9};
    t0 = now_s();
    for (;;) {
        uint32_t posted = 0;
        rc = ops->post_writes(B.dom, &gw, 1, &posted);
        CHECK(posted == 0, "a write to nobody was posted");
        if (rc != AFP_EAGAIN)
            break;
        poll_both(&A, &B);
        CHECK(now_s() - t0 < CONNECT_MS / 1000.0 + 5, "no failure after %.1f s", now_s() - t0);
    }
    dt = now_s() - t0;
    printf("never-answering peer: rc %d after %.2f s: %s\n", rc, dt, ops->errbuf(B.dom));
    CHECK(rc == AFP_ETIMEDOUT, "expected AFP_ETIMEDOUT, got %d", rc);
    CHECK(dt >= CONNECT_MS / 1000.0 * 0.9, "failed too early (%.2f s)", dt);

    stage = "forged key";
    afp_write bad = {.local_addr = src, .local_desc = d_src, .length = 4096, .peer = a_to_b,
                     .remote_addr = base_dst, .remote_key = k_dst ^ 0x00ff0000u,
                     .ctx = BADKEY_CTX};
    A.writes_done = 0;
    post_all(&A, &B, &bad, 1, 10);
    t0 = now_s();
    while (A.errors == 0) {
        poll_both(&A, &B);
        CHECK(now_s() - t0 < 30, "no error event for a write with a forged key");
    }
    printf("forged key: status %d: %s\n", A.last_error, A.last_errtext);
    CHECK(A.last_error_ctx == BADKEY_CTX && A.last_error != 0, "error event names ctx %llu",
          (unsigned long long)A.last_error_ctx);
    A.errors = 0;
    B.errors = 0;
    B.imms = 0;
    /* B's side first: its write queue pair went to the error state with A's */
    static uint8_t a_land[PAGE];
    afp_mr *mr_land;
    void *d_land;
    uint64_t k_land, b_land;
    CHECK(ops->reg_mr(A.dom, a_land, sizeof a_land, AFP_MR_REMOTE, -1, 7, &mr_land, &d_land,
                      &k_land, &b_land) == 0,
          "reg A landing");
    afp_write back = {.local_addr = dst, .local_desc = d_dst, .length = PAGE, .peer = b_to_a,
                      .remote_addr = b_land, .remote_key = k_land, .ctx = 2, .imm = 6,
                      .has_imm = 1};
    uint64_t a_imms = A.imms;
    for (int i = 0; i < 200; i++) /* time for B to hear of it (an async event) */
        poll_both(&A, &B);
    t0 = now_s();
    unsigned tries = 1;
    uint32_t bposted = 0;
    while ((rc = ops->post_writes(B.dom, &back, 1, &bposted)) == AFP_EAGAIN && !bposted) {
        poll_both(&A, &B);
        tries++;
        CHECK(now_s() - t0 < 20, "B could not write to A after the key error");
    }
    CHECK(rc == 0 && bposted == 1, "B's write after the key error: %d %s", rc,
          ops->errbuf(B.dom));
    wait_for(&A, &B, &A.imms, a_imms + 1, 20);
    CHECK(memcmp(a_land, dst, PAGE) == 0, "B -> A write after the key error landed wrong");
    printf("target's write after the key error: posted after %u tries\n", tries);
    memset(dst, 0, PAGE);
    afp_write good = {.local_addr = src, .local_desc = d_src, .length = PAGE, .peer = a_to_b,
                      .remote_addr = base_dst, .remote_key = k_dst, .ctx = 1, .imm = 5,
                      .has_imm = 1};
    post_all(&A, &B, &good, 1, 20);
    wait_for(&A, &B, &B.imms, 1, 20);
    CHECK(memcmp(dst, src, PAGE) == 0, "write after reconnection landed wrong");
    printf("reconnected after the key error\n");

    stage = "simultaneous connect";
    /* C and D (fresh domains) write to each other before either has polled: both
     * handshakes cross on the wire and must settle into one connection each way. */
    static struct side C = {.name = "C"}, D = {.name = "D"};
    CHECK(ops->open(&args, &C.dom, err, sizeof err) == 0, "open C: %s", err);
    CHECK(ops->open(&args, &D.dom, err, sizeof err) == 0, "open D: %s", err);
    uint8_t addr_c[AFP_MAX_ADDR_LEN], addr_d[AFP_MAX_ADDR_LEN];
    size_t lc = sizeof addr_c, ld = sizeof addr_d;
    CHECK(ops->address(C.dom, addr_c, &lc) == 0 && ops->address(D.dom, addr_d, &ld) == 0,
          "address");
    uint64_t c_to_d, d_to_c;
    CHECK(ops->resolve(C.dom, addr_d, ld, &c_to_d) == 0 &&
              ops->resolve(D.dom, addr_c, lc, &d_to_c) == 0,
          "resolve");
    static uint8_t cbuf[PAGE], dbuf[PAGE];
    afp_mr *mr_c, *mr_d;
    void *d_c, *d_d;
    uint64_t k_c, k_d, b_c, b_d;
    CHECK(ops->reg_mr(C.dom, cbuf, PAGE, AFP_MR_REMOTE, -1, 8, &mr_c, &d_c, &k_c, &b_c) == 0 &&
              ops->reg_mr(D.dom, dbuf, PAGE, AFP_MR_REMOTE, -1, 9, &mr_d, &d_d, &k_d, &b_d) == 0,
          "reg C/D");
    memset(cbuf, 0xc, PAGE / 2);
    memset(dbuf + PAGE / 2, 0xd, PAGE / 2);
    afp_write cw = {.local_addr = cbuf, .local_desc = d_c, .length = PAGE / 2, .peer = c_to_d,
                    .remote_addr = b_d, .remote_key = k_d, .ctx = 1, .imm = 0xc, .has_imm = 1};
    afp_write dw = {.local_addr = dbuf + PAGE / 2, .local_desc = d_d, .length = PAGE / 2,
                    .peer = d_to_c, .remote_addr = b_c + PAGE / 2, .remote_key = k_c, .ctx = 2,
                    .imm = 0xd, .has_imm = 1};
    uint32_t cp = 0, dp = 0;
    t0 = now_s();
    while (cp + dp < 2) {
        uint32_t k = 0;
        if (!cp) {
            rc = ops->post_writes(C.dom, &cw, 1, &k);
            CHECK(rc == 0 || rc == AFP_EAGAIN, "C post: %d %s", rc, ops->errbuf(C.dom));
            cp += k;
        }
        if (!dp) {
            k = 0;
            rc = ops->post_writes(D.dom, &dw, 1, &k);
            CHECK(rc == 0 || rc == AFP_EAGAIN, "D post: %d %s", rc, ops->errbuf(D.dom));
            dp += k;
        }
        poll_both(&C, &D);
        CHECK(now_s() - t0 < 20, "crossed handshakes never settled");
    }
    wait_for(&C, &D, &D.imms, 1, 20);
    wait_for(&C, &D, &C.imms, 1, 20);
    for (uint32_t i = 0; i < PAGE; i++)
        CHECK(cbuf[i] == (i < PAGE / 2 ? 0xc : 0xd) && dbuf[i] == cbuf[i],
              "crossed writes landed wrong at byte %u", i);
    printf("simultaneous connect: both writes landed (%.3f s)\n", now_s() - t0);
    CHECK(ops->dereg_mr(C.dom, mr_c) == 0 && ops->dereg_mr(D.dom, mr_d) == 0, "dereg C/D");
    ops->close(C.dom);
    ops->close(D.dom);

    stage = "close";
    CHECK(ops->dereg_mr(A.dom, mr_src) == 0 && ops->dereg_mr(B.dom, mr_dst) == 0 &&
              ops->dereg_mr(B.dom, mr_rb) == 0 && ops->dereg_mr(A.dom, mr_sb) == 0 &&
              ops->dereg_mr(A.dom, mr_ar) == 0 && ops->dereg_mr(B.dom, mr_bs) == 0 &&
              ops->dereg_mr(A.dom, mr_land) == 0,
          "dereg");
    ops->close(A.dom);
    ops->close(B.dom);
    free(src);
    free(dst);
    printf("test_verbs: OK\n");
    return 0;
}
