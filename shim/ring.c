/*
 * Completion ring: the worker produces, the Python thread consumes (one ctypes call
 * drains many records). The worker writes the eventfd only when the consumer said it
 * is about to wait, so a busy stream costs no syscall per completion, and a consumer that
 * polls (afs_poll: its event loop looks again soon) costs none at all; with many operations
 * in flight, only once a few records wait (HOLD_* below).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "internal.h"

/* Signal moderation, as a NIC moderates interrupts. With this many operations in flight a
 * waiting consumer is signalled once HOLD_BATCH records wait, or HOLD_NS after the first
 * (the worker stays awake meanwhile): where completions come one at a time (libfabric 1.17
 * shm: its target copies each write in turn) the event loop was woken for 0.80-0.97 of them,
 * an epoll wait, an eventfd read and a drain each, and on two CPUs that time was the
 * target's. 64 lanes of 8 B / 4 KiB shm writes, 2-core machine: loop CPU per write
 * 5.41-7.19 -> 2.50-2.72 us, wall 7.80-11.45 -> 3.95-4.45 us per write
 * (docs/guide/progress.md). Fewer in flight (an awaited write alone, a
 * few at a time): signalled at once. */
#define HOLD_MIN_INFLIGHT 16u
#define HOLD_BATCH 8u
#define HOLD_NS 20000ull

int afs_ring_init(afs_ring *r, uint32_t capacity)
{
    uint32_t cap = 1024;
    while (cap < capacity && cap < (1u << 24))
        cap <<= 1;
    memset(r, 0, sizeof(*r));
    r->event_fd = -1;
    r->slots = calloc(cap, sizeof(afs_completion));
    if (!r->slots)
        return afs_fail(AFS_ENOMEM, "completion ring: cannot allocate %u records", cap);
    r->mask = cap - 1;
    r->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->event_fd < 0) {
        free(r->slots);
        r->slots = NULL;
        return afs_fail(AFS_EIO, "eventfd: %s", strerror(errno));
    }
    atomic_store(&r->consumer_waiting, 1);
    return 0;
}

void afs_ring_destroy(afs_ring *r)
{
    /* error texts of records never drained */
    uint64_t head = atomic_load(&r->head), tail = atomic_load(&r->tail);
    for (uint64_t i = head; i < tail; i++) {
        afs_completion *c = &r->slots[i & r->mask];
        if ((c->kind == AFS_C_DONE || c->kind == AFS_C_PEER) && c->data)
            free((void *)(uintptr_t)c->data);
    }
    for (size_t i = 0; i < r->overflow_len; i++)
        if ((r->overflow[i].kind == AFS_C_DONE || r->overflow[i].kind == AFS_C_PEER) &&
            r->overflow[i].data)
            free((void *)(uintptr_t)r->overflow[i].data);
    free(r->overflow);
    free(r->slots);
    if (r->event_fd >= 0)
        close(r->event_fd);
    memset(r, 0, sizeof(*r));
    r->event_fd = -1;
}

static bool ring_try_push(afs_ring *r, const afs_completion *c)
{
    uint64_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&r->head, memory_order_acquire);
    if (tail - head > r->mask)
        return false;
    r->slots[tail & r->mask] = *c;
    atomic_store_explicit(&r->tail, tail + 1, memory_order_release);
    r->pushed_since_notify = true;
    return true;
}

static void ring_move_overflow(afs_ring *r)
{
    size_t i = 0;
    while (i < r->overflow_len && ring_try_push(r, &r->overflow[i]))
        i++;
    if (i) {
        memmove(r->overflow, r->overflow + i, (r->overflow_len - i) * sizeof(afs_completion));
        r->overflow_len -= i;
    }
}

void afs_ring_push(afs_ring *r, const afs_completion *c)
{
    if (r->overflow_len == 0 && ring_try_push(r, c))
        return;
    if (r->overflow_len == r->overflow_cap) {
        size_t cap = r->overflow_cap ? r->overflow_cap * 2 : 1024;
        afs_completion *n = realloc(r->overflow, cap * sizeof(*n));
        if (!n) {
            /* Cannot grow: wait for the consumer rather than drop a completion. */
            while (!ring_try_push(r, c)) {
                afs_ring_flush(r, 0, 0);
                usleep(100);
            }
            return;
        }
        r->overflow = n;
        r->overflow_cap = cap;
    }
    r->overflow[r->overflow_len++] = *c;
}

bool afs_ring_flush(afs_ring *r, size_t inflight, uint64_t now)
{
    if (r->overflow_len)
        ring_move_overflow(r);
    if (!r->pushed_since_notify)
        return false;
    if (inflight >= HOLD_MIN_INFLIGHT &&
        atomic_load_explicit(&r->consumer_waiting, memory_order_relaxed)) {
        uint64_t ready = atomic_load_explicit(&r->tail, memory_order_relaxed) -
                         atomic_load_explicit(&r->head, memory_order_acquire);
        if (!r->held_since)
            r->held_since = now;
        if (ready < HOLD_BATCH && now - r->held_since < HOLD_NS)
            return true;
    }
    r->held_since = 0;
    /* seq_cst pairs with the consumer's store of consumer_waiting then re-check */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_exchange(&r->consumer_waiting, 0)) {
        uint64_t one = 1;
        ssize_t n;
        do {
            n = write(r->event_fd, &one, sizeof(one));
        } while (n < 0 && errno == EINTR);
        /* EAGAIN means the counter is already huge: the fd is readable anyway */
    }
    r->pushed_since_notify = false;
    return false;
}

uint64_t afs_ring_pending(afs_ring *r)
{
    atomic_store(&r->consumer_waiting, 0); /* looking again soon: no signal wanted */
    atomic_thread_fence(memory_order_seq_cst);
    return atomic_load_explicit(&r->tail, memory_order_acquire) -
           atomic_load_explicit(&r->head, memory_order_relaxed);
}

uint32_t afs_ring_drain(afs_ring *r, afs_completion *out, uint32_t max, bool poll)
{
    if (poll) {
        /* The consumer keeps looking: the worker need not signal (no syscall either side). */
        atomic_store(&r->consumer_waiting, 0);
    } else {
        /* one read takes the whole count (not EFD_SEMAPHORE): a second would only fail */
        uint64_t junk;
        while (read(r->event_fd, &junk, sizeof(junk)) < 0 && errno == EINTR) {
        }
    }
    uint32_t n = 0;
    for (int pass = 0; pass < 2 && n < max; pass++) {
        uint64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
        uint64_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
        while (head < tail && n < max) {
            out[n++] = r->slots[head & r->mask];
            head++;
        }
        atomic_store_explicit(&r->head, head, memory_order_release);
        if (n == max)
            return n;
        if (poll)
            return n;
        if (pass == 0) {
            /* About to report "empty": ask for a wakeup, then look once more. */
            atomic_store(&r->consumer_waiting, 1);
            atomic_thread_fence(memory_order_seq_cst);
        }
    }
    return n;
}

bool afs_ring_take(afs_ring *r, uint64_t id)
{
    uint64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    if (atomic_load_explicit(&r->tail, memory_order_acquire) != head + 1)
        return false;
    const afs_completion *c = &r->slots[head & r->mask];
    if (c->kind != AFS_C_DONE || c->id != id || c->status || c->data || c->release_later)
        return false;
    atomic_store_explicit(&r->head, head + 1, memory_order_release);
    return true;
}
