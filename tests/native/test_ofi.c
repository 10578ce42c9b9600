/*
 * Single-process test of libafabric_ofi.so through the provider ABI only.
 *
 *   cc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -Ishim \
 *      tests/native/test_ofi.c -o /tmp/test_ofi -ldl
 *   /tmp/test_ofi tcp|shm [path/to/libafabric_ofi.so]
 *   (AFABRIC_LIBFABRIC=/path/libfabric.so.1 picks another libfabric)
 *
 * Not part of the library (it lives in tests/native/, outside build_native.py's sources).
 * Two domains A and B of
 * one provider in one process: A writes 1 MiB into B's remote-writable region in 16
 * writes with immediates (A's context pool holds 8, so posting runs dry and resumes after
 * polling), one zero-length immediate-only write without local buffer or descriptor, and
 * one SEND; B's wait fd must wake up for a message that arrives after trywait allowed
 * sleeping; a write with a bad key must not hang the test or crash (tcp reports an error
 * event naming the write). Run twice: with the provider's own modes and with
 * AFP_OPEN_FORCE_EFA_MODES, where immediates consume B's receives (only 4 posted at
 * first, the rest once the writes are done: immediates must wait for them), descriptors
 * are always local and keys come from the provider. Both domains are polled all the
 * time: the target must progress its CQ even for one-sided writes, and the first
 * operations to a new peer return EAGAIN for a while.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "afabric_provider.h"

#define MIB (1u << 20)
#define NWRITES 16u
#define CHUNK (MIB / NWRITES)
#define TX_DEPTH 8u
/* How long a refused write may take to show itself (error, completion or a changed byte)
 * before "nothing came" is taken as the answer: libfabric 1.17's shm gives nothing for
 * either refused write below, so this window is all its run waits (it was 3 s: 12 s of
 * each shm run on 1.17, release and ASan alike). The loop polls both domains without
 * pause all along; a write that lands does so within a millisecond here ("all completions
 * in 0.3 ms" for the 1 MiB above, ASan or not), so 1 s is still ~1000 times that. */
#define NO_EVENT_WAIT_S 1.0
#define A_DEPTH 4u
#define EARLY_RECV 4u
#define RX_DEPTH 32u
#define RX_BUF 4096u
#define ZERO_IMM 0xabcdef01u
#define CTX_RECV_BASE 1000u
#define CTX_ZERO 100u
#define CTX_SEND 200u
#define CTX_BADKEY 300u
#define CTX_READ_BASE 2000u
#define MSG "hello over afabric"

static const struct afp_ops *ops;
static const char *stage = "start";
static struct tally *diag_a, *diag_b; /* printed when a test fails */

static void print_tally(const char *who, const struct tally *t);

/* shm names its files /dev/shm/<pid>:...; a test that dies before closing leaves them. */
static void cleanup_shm(void)
{
    char prefix[32];
    int n = snprintf(prefix, sizeof prefix, "%d:", (int)getpid());
    DIR *dir = opendir("/dev/shm");
    if (!dir)
        return;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        if (strncmp(de->d_name, prefix, (size_t)n) == 0) {
            char path[300];
            snprintf(path, sizeof path, "/dev/shm/%s", de->d_name);
            unlink(path);
        }
    }
    closedir(dir);
}

__attribute__((format(printf, 1, 2), noreturn)) static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL [%s]: ", stage);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    if (diag_a)
        print_tally("A", diag_a);
    if (diag_b)
        print_tally("B", diag_b);
    exit(1);
}

#define CHECK(dom, call)                                                                   \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_)                                                                           \
            die("%s -> %d: %s", #call, rc_, (dom) ? ops->errbuf(dom) : "");                \
    } while (0)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rnd64(void)
{
    static uint64_t s;
    if (!s)
        s = (uint64_t)now() * 1000003u ^ (uint64_t)getpid() << 20 ^ 0x9e3779b97f4a7c15u;
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
}

struct tally {
    uint32_t write_done, send_done, recv, imm, errors;
    uint32_t imm_val[NWRITES + 1];
    uint64_t imm_ctx[NWRITES + 1];
    uint64_t recv_ctx, recv_len;
    afp_event last_error;
    uint64_t landed; /* remote writes seen through AFP_EV_ACTIVITY */
    bool wait_fd;    /* the CQ has a wait fd of its own: no busy-progress activity (len 0) expected */
};

static void print_tally(const char *who, const struct tally *t)
{
    fprintf(stderr, "  %s: write_done=%u send_done=%u recv=%u imm=%u errors=%u\n", who,
            t->write_done, t->send_done, t->recv, t->imm, t->errors);
}

static void drain(afp_domain *d, struct tally *t, bool errors_ok)
{
    afp_event ev[8]; /* small on purpose: poll must stop at max and lose nothing */
    uint32_t n = 0;
    CHECK(d, ops->poll(d, ev, 8, &n));
    for (uint32_t i = 0; i < n; i++) {
        const afp_event *e = &ev[i];
        if (e->status && e->kind != AFP_EV_ERROR)
            die("event kind %u with status %d", e->kind, e->status);
        switch (e->kind) {
        case AFP_EV_WRITE_DONE:
            t->write_done++;
            break;
        case AFP_EV_SEND_DONE:
            if (e->ctx != CTX_SEND)
                die("send done with ctx %llu", (unsigned long long)e->ctx);
            t->send_done++;
            break;
        case AFP_EV_RECV:
            t->recv++;
            t->recv_ctx = e->ctx;
            t->recv_len = e->len;
            break;
        case AFP_EV_IMM:
            if (t->imm > NWRITES)
                die("too many immediates (imm %#x)", e->imm);
            t->imm_val[t->imm] = e->imm;
            t->imm_ctx[t->imm] = e->ctx;
            t->imm++;
            break;
        case AFP_EV_ERROR:
            if (!errors_ok)
                die("error event: op %u ctx %llu status %d: %s", e->op,
                    (unsigned long long)e->ctx, e->status, e->errtext);
            t->errors++;
            t->last_error = *e;
            break;
        case AFP_EV_ACTIVITY: /* remote writes landed (FI_RMA_EVENT counter), or len 0: a
                                 progress call moved data (only without a wait fd) */
            if (e->len == 0 && t->wait_fd)
                die("activity event counting nothing on a CQ with a wait fd");
            t->landed += e->len;
            break;
        default:
            die("unknown event kind %u", e->kind);
        }
    }
}

struct side {
    afp_domain *d;
    afp_caps caps;
    uint64_t peer;
    struct tally t;
};

static void poll_both(struct side *a, struct side *b, bool errors_ok)
{
    drain(a->d, &a->t, errors_ok);
    drain(b->d, &b->t, errors_ok);
}

static void deadline_check(double deadline, const char *what)
{
    if (now() > deadline)
        die("timed out waiting for %s", what);
}

static void print_caps(const char *who, const afp_caps *c)
{
    printf("  %s: provider=%s flags=%#x%s%s%s%s%s%s imm=%u max_msg=%llu inject=%llu "
           "addr_len=%u wait_fd=%d\n",
           who, c->provider, c->flags, c->flags & AFP_CAP_IMM_NEEDS_RECV ? " IMM_NEEDS_RECV" : "",
           c->flags & AFP_CAP_DEVICE_MEM ? " DEVICE_MEM" : "",
           c->flags & AFP_CAP_MR_LOCAL ? " MR_LOCAL" : "",
           c->flags & AFP_CAP_VIRT_ADDR ? " VIRT_ADDR" : "",
           c->flags & AFP_CAP_PROV_KEY ? " PROV_KEY" : "",
           c->flags & AFP_CAP_DELIVERY_COMPLETE ? " DELIVERY_COMPLETE" : "", c->imm_size,
           (unsigned long long)c->max_msg_size, (unsigned long long)c->inject_size,
           c->addr_len, c->wait_fd);
}

static void open_side(const char *prov, uint32_t flags, struct side *s, const char *who,
                      uint32_t tx_depth, uint32_t rx_depth)
{
    char err[AFP_ERRTEXT_LEN] = "";
    afp_open_args args = {
        .fabric_provider = prov,
        .flags = flags,
        .rx_depth = rx_depth,
        .tx_depth = tx_depth,
    };
    int rc = ops->open(&args, &s->d, err, sizeof err);
    if (rc)
        die("open %s: %d: %s", who, rc, err);
    CHECK(s->d, ops->caps(s->d, &s->caps));
    print_caps(who, &s->caps);
    /* shm's completion queue has no wait fd: the one it reports is the wake-up socket the ofi
     * provider adds (ofi_wake.c), and progress calls that move data still count as activity */
    s->t.wait_fd = s->caps.wait_fd >= 0 && strcmp(s->caps.provider, "shm") != 0;
}

/* Posts all writes, polling both sides whenever the provider or the pool says EAGAIN. */
static void post_all(struct side *a, struct side *b, const afp_write *w, uint32_t n,
                     bool errors_ok)
{
    uint32_t done = 0, eagain = 0;
    double deadline = now() + 20;
    while (done < n) {
        uint32_t posted = 0;
        int rc = ops->post_writes(a->d, w + done, n - done, &posted);
        done += posted;
        if (rc == AFP_EAGAIN) {
            eagain++;
            poll_both(a, b, errors_ok);
            deadline_check(deadline, "posting writes");
        } else if (rc) {
            die("post_writes -> %d: %s", rc, ops->errbuf(a->d));
        }
    }
    printf("  posted %u writes (%u EAGAIN retries)\n", n, eagain);
}

static void run(const char *prov, uint32_t flags)
{
    struct side A = {0}, B = {0};
    bool force = flags & AFP_OPEN_FORCE_EFA_MODES;
    printf("%s, %s:\n", prov, force ? "FORCE_EFA_MODES" : "native modes");
    diag_a = &A.t;
    diag_b = &B.t;

    stage = "open";
    /* A's context pool (tx + rx = 8) is smaller than the batch of 17 writes */
    open_side(prov, flags, &A, "A", A_DEPTH, A_DEPTH);
    open_side(prov, flags, &B, "B", TX_DEPTH, RX_DEPTH);
    if (A.caps.imm_size != 4)
        die("imm_size %u", A.caps.imm_size);
    if (force && (B.caps.flags & (AFP_CAP_IMM_NEEDS_RECV | AFP_CAP_MR_LOCAL | AFP_CAP_PROV_KEY)) !=
                     (AFP_CAP_IMM_NEEDS_RECV | AFP_CAP_MR_LOCAL | AFP_CAP_PROV_KEY))
        die("forced modes not reported: %#x", B.caps.flags);
    bool needs_recv = B.caps.flags & AFP_CAP_IMM_NEEDS_RECV;

    stage = "address";
    uint8_t addr_a[AFP_MAX_ADDR_LEN], addr_b[AFP_MAX_ADDR_LEN];
    size_t len_a = sizeof addr_a, len_b = sizeof addr_b;
    CHECK(A.d, ops->address(A.d, addr_a, &len_a));
    CHECK(B.d, ops->address(B.d, addr_b, &len_b));
    if (len_a != A.caps.addr_len || len_b != B.caps.addr_len)
        die("address length %zu/%zu vs caps %u/%u", len_a, len_b, A.caps.addr_len,
            B.caps.addr_len);
    uint64_t bad_peer;
    /* Lengths legitimately differ between peers (shm names grow with the pid and the
     * endpoint counter), so only empty and over-long addresses are refused here; the
     * shim's checksummed address blob is what catches truncation. */
    if (ops->resolve(A.d, addr_b, 0, &bad_peer) != AFP_EBADDESC)
        die("resolve accepted an empty address");
    if (ops->resolve(A.d, addr_b, AFP_MAX_ADDR_LEN + 1, &bad_peer) != AFP_EBADDESC)
        die("resolve accepted an over-long address");
    CHECK(A.d, ops->resolve(A.d, addr_b, len_b, &A.peer));
    CHECK(B.d, ops->resolve(B.d, addr_a, len_a, &B.peer));

    stage = "register";
    uint8_t *src = aligned_alloc(4096, MIB), *dst = aligned_alloc(4096, MIB);
    uint8_t *rxb = aligned_alloc(4096, RX_DEPTH * RX_BUF);
    if (!src || !dst || !rxb)
        die("out of memory");
    for (uint32_t i = 0; i < MIB; i++)
        src[i] = (uint8_t)(i * 7u + i / 4096u + 1u);
    memset(dst, 0, MIB);
    afp_mr *mr_src, *mr_dst, *mr_rx;
    void *desc_src, *desc_dst, *desc_rx;
    uint64_t rkey_src, rkey_dst, rkey_rx, base_src, base_dst, base_rx;
    uint64_t key_src = rnd64(), key_dst = rnd64(), key_rx = rnd64();
    CHECK(A.d, ops->reg_mr(A.d, src, MIB, 0, -1, key_src, &mr_src, &desc_src, &rkey_src,
                           &base_src));
    CHECK(B.d, ops->reg_mr(B.d, dst, MIB, AFP_MR_REMOTE, -1, key_dst, &mr_dst, &desc_dst,
                           &rkey_dst, &base_dst));
    CHECK(B.d, ops->reg_mr(B.d, rxb, RX_DEPTH * RX_BUF, 0, -1, key_rx, &mr_rx, &desc_rx,
                           &rkey_rx, &base_rx));
    if ((B.caps.flags & AFP_CAP_MR_LOCAL) && (!desc_src || !desc_dst || !desc_rx))
        die("MR_LOCAL but no local descriptor");
    if ((B.caps.flags & AFP_CAP_PROV_KEY) && rkey_dst == key_dst)
        die("PROV_KEY but the requested key came back");
    if (!(B.caps.flags & AFP_CAP_PROV_KEY) && rkey_dst != key_dst)
        die("requested key %#llx not used (got %#llx)", (unsigned long long)key_dst,
            (unsigned long long)rkey_dst);
    if (((B.caps.flags & AFP_CAP_VIRT_ADDR) != 0) != (base_dst == (uint64_t)(uintptr_t)dst))
        die("remote_base %#llx does not match VIRT_ADDR", (unsigned long long)base_dst);
    uint32_t dev_flags = B.caps.flags & AFP_CAP_DEVICE_MEM;
    if (!dev_flags) {
        afp_mr *m;
        void *ld;
        uint64_t rk, rb;
        if (ops->reg_mr(B.d, dst, MIB, AFP_MR_DEVICE, 0, 1, &m, &ld, &rk, &rb) !=
            AFP_EUNSUPPORTED)
            die("device registration without DEVICE_MEM did not say EUNSUPPORTED");
    }

    /* Receives on B: one for the message (and one for the wake-up test), and with
     * IMM_NEEDS_RECV one per immediate; of those only EARLY_RECV are posted before the
     * writes, so immediates must wait for receives (as on EFA, where the sender retries). */
    stage = "post_recv";
    uint32_t nrecv = needs_recv ? NWRITES + 1 + 2 + 2 : 3;
    uint32_t early = needs_recv ? EARLY_RECV : nrecv;
    for (uint32_t i = 0; i < early; i++)
        CHECK(B.d, ops->post_recv(B.d, rxb + i * RX_BUF, RX_BUF, desc_rx, CTX_RECV_BASE + i));

    stage = "writes";
    afp_write w[NWRITES + 1];
    for (uint32_t i = 0; i < NWRITES; i++) {
        w[i] = (afp_write){
            .local_addr = src + i * CHUNK,
            .local_desc = desc_src,
            .length = CHUNK,
            .peer = A.peer,
            .remote_addr = base_dst + i * CHUNK,
            .remote_key = rkey_dst,
            .ctx = i + 1,
            .imm = 0x100u + i,
            .has_imm = 1,
        };
    }
    /* immediate only: no local buffer or descriptor, but a valid remote address and key */
    w[NWRITES] = (afp_write){
        .peer = A.peer,
        .remote_addr = base_dst,
        .remote_key = rkey_dst,
        .ctx = CTX_ZERO,
        .imm = ZERO_IMM,
        .has_imm = 1,
    };
    double t0 = now();
    post_all(&A, &B, w, NWRITES + 1, false);

    stage = "send";
    double deadline = now() + 20;
    for (;;) {
        int rc = ops->post_send(A.d, A.peer, MSG, sizeof MSG, NULL, CTX_SEND);
        if (rc == 0)
            break;
        if (rc != AFP_EAGAIN)
            die("post_send -> %d: %s", rc, ops->errbuf(A.d));
        poll_both(&A, &B, false);
        deadline_check(deadline, "posting the send");
    }

    if (early < nrecv) {
        stage = "late receives";
        while (A.t.write_done < NWRITES + 1) {
            poll_both(&A, &B, false);
            deadline_check(deadline, "write completions");
        }
        for (int i = 0; i < 100; i++) /* let anything still in flight arrive */
            poll_both(&A, &B, false);
        if (B.t.imm + B.t.recv > early)
            die("%u immediates and %u messages with only %u receives posted", B.t.imm,
                B.t.recv, early);
        printf("  %u immediates delivered with %u receives posted; posting %u more\n", B.t.imm,
               early, nrecv - early);
        for (uint32_t i = early; i < nrecv; i++)
            CHECK(B.d, ops->post_recv(B.d, rxb + i * RX_BUF, RX_BUF, desc_rx, CTX_RECV_BASE + i));
    }

    stage = "completions";
    while (A.t.write_done < NWRITES + 1 || A.t.send_done < 1 || B.t.imm < NWRITES + 1 ||
           B.t.recv < 1) {
        poll_both(&A, &B, false);
        deadline_check(deadline, "completions");
    }
    printf("  all completions in %.1f ms\n", (now() - t0) * 1e3);

    stage = "verify";
    if (memcmp(src, dst, MIB) != 0)
        die("payload differs");
    bool seen[NWRITES + 1] = {false};
    bool ctx_seen[RX_DEPTH] = {false};
    for (uint32_t i = 0; i < B.t.imm; i++) {
        uint32_t v = B.t.imm_val[i];
        uint32_t k = v == ZERO_IMM ? NWRITES : v - 0x100u;
        if (k > NWRITES || seen[k])
            die("unexpected or repeated immediate %#x", v);
        seen[k] = true;
        uint64_t c = B.t.imm_ctx[i];
        if (!needs_recv && c != 0)
            die("immediate %#x with ctx %llu without IMM_NEEDS_RECV", v, (unsigned long long)c);
        if (needs_recv) {
            if (c < CTX_RECV_BASE || c >= CTX_RECV_BASE + nrecv || ctx_seen[c - CTX_RECV_BASE])
                die("immediate %#x consumed receive ctx %llu (bad or twice)", v,
                    (unsigned long long)c);
            ctx_seen[c - CTX_RECV_BASE] = true;
        }
    }
    uint64_t rc_ctx = B.t.recv_ctx;
    if (rc_ctx < CTX_RECV_BASE || rc_ctx >= CTX_RECV_BASE + nrecv ||
        ctx_seen[rc_ctx - CTX_RECV_BASE])
        die("message in receive ctx %llu (bad or also used by an immediate)",
            (unsigned long long)rc_ctx);
    if (B.t.recv_len != sizeof MSG || memcmp(rxb + (rc_ctx - CTX_RECV_BASE) * RX_BUF, MSG,
                                             sizeof MSG) != 0)
        die("message of %llu bytes differs", (unsigned long long)B.t.recv_len);
    printf("  verified: 1 MiB payload, %u immediates%s, message in receive %llu\n", B.t.imm,
           needs_recv ? " (each consumed a distinct receive)" : " (ctx 0)",
           (unsigned long long)rc_ctx);

    /* Nothing is pending now: trywait may allow sleeping (0) or say poll again. */
    int twa = ops->trywait(A.d), twb = ops->trywait(B.d);
    if ((twa != 0 && twa != AFP_EAGAIN) || (twb != 0 && twb != AFP_EAGAIN))
        die("trywait -> %d/%d", twa, twb);
    if (A.caps.wait_fd < 0 && twa != AFP_EAGAIN)
        die("trywait without a wait fd must say EAGAIN");
    printf("  trywait A=%d B=%d\n", twa, twb);

    /* Adaptive polling: once trywait allows B to sleep, a message arriving must make
     * B's wait fd readable. A keeps being progressed (one thread plays both sides). */
    if (B.caps.wait_fd >= 0) {
        stage = "wait fd";
        deadline = now() + 10;
        while (ops->trywait(B.d) != 0) {
            drain(B.d, &B.t, false);
            deadline_check(deadline, "trywait to allow sleeping");
        }
        uint32_t recv_before = B.t.recv, sends_before = A.t.send_done;
        for (;;) {
            int rc = ops->post_send(A.d, A.peer, MSG, sizeof MSG, NULL, CTX_SEND);
            if (rc == 0)
                break;
            if (rc != AFP_EAGAIN)
                die("post_send -> %d: %s", rc, ops->errbuf(A.d));
            drain(A.d, &A.t, false);
            deadline_check(deadline, "posting the wake-up send");
        }
        bool woke = false;
        while (!woke) {
            drain(A.d, &A.t, false);
            struct pollfd pfd = {.fd = B.caps.wait_fd, .events = POLLIN};
            woke = poll(&pfd, 1, 10) > 0;
            deadline_check(deadline, "the wait fd to become readable");
        }
        while (B.t.recv == recv_before || A.t.send_done == sends_before) {
            poll_both(&A, &B, false);
            deadline_check(deadline, "the wake-up message");
        }
        printf("  wait fd woke up for a message after trywait allowed sleeping\n");
    }

    /* One-sided reads (post_reads, ABI minor 4): B's payload, registered a second time with
     * AFP_MR_REMOTE_READ, read back into a local buffer of A in chunks; each read completes
     * as AFP_EV_WRITE_DONE with its ctx. (Before any refused access: 1.17 shm stalls after.) */
    stage = "reads";
    if (!AFP_HAS_OP(ops, post_reads))
        die("no post_reads in the table");
    uint8_t *back = aligned_alloc(4096, MIB);
    if (!back)
        die("out of memory");
    memset(back, 0, MIB);
    afp_mr *mr_rd, *mr_back;
    void *desc_rd, *desc_back;
    uint64_t rkey_rd, base_rd, rkey_back, base_back;
    CHECK(B.d, ops->reg_mr(B.d, dst, MIB, AFP_MR_REMOTE_READ, -1, rnd64(), &mr_rd, &desc_rd,
                           &rkey_rd, &base_rd));
    CHECK(A.d, ops->reg_mr(A.d, back, MIB, 0, -1, rnd64(), &mr_back, &desc_back, &rkey_back,
                           &base_back));
    afp_write rd[NWRITES];
    for (uint32_t i = 0; i < NWRITES; i++)
        rd[i] = (afp_write){.local_addr = back + i * CHUNK, .local_desc = desc_back,
                            .length = CHUNK, .peer = A.peer, .remote_addr = base_rd + i * CHUNK,
                            .remote_key = rkey_rd, .ctx = CTX_READ_BASE + i};
    uint32_t reads_before = A.t.write_done, nread = 0;
    deadline = now() + 20;
    while (nread < NWRITES) {
        uint32_t posted = 0;
        int rc = ops->post_reads(A.d, rd + nread, NWRITES - nread, &posted);
        nread += posted;
        if (rc && rc != AFP_EAGAIN)
            die("post_reads -> %d: %s", rc, ops->errbuf(A.d));
        if (rc)
            poll_both(&A, &B, false);
        deadline_check(deadline, "posting reads");
    }
    while (A.t.write_done < reads_before + NWRITES) {
        poll_both(&A, &B, false);
        deadline_check(deadline, "read completions");
    }
    if (memcmp(back, src, MIB) != 0)
        die("read-back payload differs");
    printf("  %u reads of %u KiB: byte-exact\n", NWRITES, CHUNK / 1024);
    CHECK(B.d, ops->dereg_mr(B.d, mr_rd));
    CHECK(A.d, ops->dereg_mr(A.d, mr_back));
    free(back);

    /* A write with a wrong key: an error event naming the write where the initiator
     * learns of it (tcp); shm checks keys only at the target, so its initiator sees
     * success (transmit-complete) or nothing at all (delivery-complete). Never a crash. */
    stage = "bad key";
    afp_write bad = w[0];
    bad.remote_key = rkey_dst ^ 0x5a5a5a5aULL;
    bad.ctx = CTX_BADKEY;
    bad.has_imm = 0;
    uint32_t done_bk = A.t.write_done;
    post_all(&A, &B, &bad, 1, true);
    deadline = now() + NO_EVENT_WAIT_S;
    while (A.t.errors == 0 && A.t.write_done == done_bk && now() < deadline)
        poll_both(&A, &B, true);
    if (A.t.errors) {
        printf("  bad key -> error op=%u ctx=%llu status=%d: %s\n", A.t.last_error.op,
               (unsigned long long)A.t.last_error.ctx, A.t.last_error.status,
               A.t.last_error.errtext);
        if (A.t.last_error.ctx != CTX_BADKEY || A.t.last_error.op != AFP_EV_WRITE_DONE)
            die("error event does not name the failed write");
    } else {
        printf("  bad key -> %s at the initiator\n",
               A.t.write_done > done_bk ? "success (key not checked there)"
                                            : "no completion within the wait");
    }
    if (B.t.errors)
        printf("  bad key -> target error event op=%u status=%d: %s\n", B.t.last_error.op,
               B.t.last_error.status, B.t.last_error.errtext);

    /* A region registered without AFP_MR_REMOTE is local-only at the provider itself: a
     * write carrying its very key and address is refused (an error, or dropped) and the
     * region stays as it was. */
    stage = "local-only";
    uint8_t *loc = aligned_alloc(4096, 4096);
    if (!loc)
        die("out of memory");
    memset(loc, 0x5a, 4096);
    afp_mr *mr_loc;
    void *desc_loc;
    uint64_t rkey_loc, base_loc;
    CHECK(B.d, ops->reg_mr(B.d, loc, 4096, 0, -1, rnd64(), &mr_loc, &desc_loc, &rkey_loc,
                           &base_loc));
    afp_write lw = w[0];
    lw.length = 4096;
    lw.remote_addr = base_loc;
    lw.remote_key = rkey_loc;
    lw.ctx = CTX_BADKEY;
    lw.has_imm = 0;
    uint32_t errors_before = A.t.errors, done_before = A.t.write_done;
    post_all(&A, &B, &lw, 1, true);
    deadline = now() + NO_EVENT_WAIT_S;
    while (A.t.errors == errors_before && A.t.write_done == done_before && now() < deadline)
        poll_both(&A, &B, true);
    for (uint32_t i = 0; i < 4096; i++)
        if (loc[i] != 0x5a)
            die("a remote write changed byte %u of a local-only region", i);
    printf("  local-only region: write %s, region unchanged\n",
           A.t.errors != errors_before      ? "refused with an error"
           : A.t.write_done != done_before ? "reported done (not checked at the initiator)"
                                            : "never completed");
    CHECK(B.d, ops->dereg_mr(B.d, mr_loc));
    free(loc);

    stage = "teardown";
    CHECK(A.d, ops->forget(A.d, A.peer));
    CHECK(B.d, ops->forget(B.d, B.peer));
    CHECK(A.d, ops->dereg_mr(A.d, mr_src));
    CHECK(B.d, ops->dereg_mr(B.d, mr_dst));
    CHECK(B.d, ops->dereg_mr(B.d, mr_rx));
    ops->close(A.d);
    ops->close(B.d);
    diag_a = diag_b = NULL;
    free(src);
    free(dst);
    free(rxb);
    printf("  ok\n");
}

static void list(const char *prov)
{
    afp_nic_info nics[16];
    uint32_t n = 0;
    char err[AFP_ERRTEXT_LEN] = "";
    afp_open_args args = {.fabric_provider = prov};
    int rc = ops->list_nics(&args, nics, 16, &n, err, sizeof err);
    if (rc)
        die("list_nics: %d: %s", rc, err);
    printf("%s: %u NIC(s)\n", prov, n);
    for (uint32_t i = 0; i < n && i < 16; i++)
        printf("  %s fabric=%s provider=%s pci=%s speed=%llu numa=%d\n", nics[i].name,
               nics[i].fabric, nics[i].provider, nics[i].pci,
               (unsigned long long)nics[i].link_speed_bps, nics[i].numa_node);
    if (n == 0)
        die("no NIC for %s", prov);

    /* opening by NIC name must pick that NIC */
    afp_open_args by_name = {.fabric_provider = prov, .nic = nics[0].name, .rx_depth = 4,
                             .tx_depth = 4};
    afp_domain *d = NULL;
    rc = ops->open(&by_name, &d, err, sizeof err);
    if (rc)
        die("open nic %s: %d: %s", nics[0].name, rc, err);
    ops->close(d);
    afp_open_args bogus = {.fabric_provider = prov, .nic = "no-such-nic0"};
    if (ops->open(&bogus, &d, err, sizeof err) != AFP_ENODEV)
        die("open of a missing NIC did not say ENODEV");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s tcp|shm [libafabric_ofi.so]\n", argv[0]);
        return 2;
    }
    atexit(cleanup_shm);
    const char *lib = argc > 2 ? argv[2] : "/tmp/libafabric_ofi.so";
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        die("dlopen %s: %s", lib, dlerror());
    afp_get_ops_fn get = (afp_get_ops_fn)dlsym(h, "afp_get_ops");
    if (!get)
        die("no afp_get_ops in %s", lib);
    ops = get();
    if (ops->major != AFP_ABI_MAJOR || ops->size < sizeof(struct afp_ops))
        die("ABI %u.%u size %u", ops->major, ops->minor, ops->size);

    list(argv[1]);
    run(argv[1], 0);
    run(argv[1], AFP_OPEN_FORCE_EFA_MODES);
    printf("PASS %s\n", argv[1]);
    return 0;
}
