/*
 * libfabric 1.17's shm: cutting this process loose from a dead peer's shared region.
 *
 * Each shm endpoint lives in a /dev/shm file that every peer maps. Its header holds a
 * pthread spin lock that a writer to that endpoint takes to queue a command, and that the
 * owner takes to progress its queue. A process SIGKILLed while it holds its own lock (it
 * holds it for the whole of a progress pass, so this happens: `afabric bench p2p`'s target,
 * CI) leaves every writer to it spinning in fi_writemsg for ever: our worker with it, and
 * every other peer's operation behind it. libfabric 2.x queues commands without a lock.
 *
 * When the shim's watch thread sees the peer's process exit (pidfd), ofi_shm_fence replaces
 * this process's mapping of that peer's file with a private copy of its header in which the
 * lock is free and the command count is 0: a writer spinning on the lock gets it, sees no
 * room (1.17 checks `cmd_cnt < 2` under the lock and returns -FI_EAGAIN) and returns; every
 * later post to the dead peer does the same until the shim has failed its operations (peer
 * down). The copy is private, so no other process shares that lock with us any more, and
 * whatever a writer already inside the critical section writes lands in pages of our own.
 * Nothing is done unless the header is the layout measured for 1.17 (below: the dead
 * process's pid, the region's size) and the mapping covers exactly that region.
 *
 * The copy is the file itself mapped copy-on-write (MAP_PRIVATE): the peer's pools stay as
 * they were, so libfabric can still hand back the buffers of operations to it (below).
 *
 * The operations we sent the dead peer leave their response slots in OUR region's response
 * queue pending: 1.17 reads that queue in order and stops at the first pending slot, so
 * every later completion, to any peer, waits behind it. ofi_shm_release (called on our
 * worker, the thread that also runs libfabric's progress, so nothing else touches the queue
 * meanwhile) writes an error status into each pending slot whose operation the caller says
 * went to a dead peer, as the target would have, and libfabric completes it with that error.
 * Slots are identified by their own back-reference (the command's src_data is the slot's
 * offset), for the two protocols 1.17 uses for delivery-complete writes where cross-memory
 * attach works: smr_src_iov (above 4 KiB; status FI_EBUSY until done) and smr_src_sar (up
 * to 4 KiB through one bounce buffer in the target's region; status SAR_FULL until the target
 * takes the data). A bounce-buffer slot can only be completed as taken, so the caller turns
 * the completions of operations to dead peers into errors. Values measured on 1.17.
 *
 * A write its target refuses (a revoked key, a forged descriptor) is dropped by 1.17's target
 * with no status at all: its slot stays pending for ever, with the same effect (measured: the
 * refused write's slot stays pending, the target's queue empty). A slot still pending while
 * its target is idle is such a write: the target's queue drained *and then* its lock free. 1.17
 * takes an RMA command off the queue before it copies and answers, but holds the region's lock
 * over the whole progress pass, so once the lock is free after the queue drained, every command
 * taken was answered and none can come any more (which matters: a released slot is reused, and
 * a late status would complete another operation). A queue drained alone is not enough: a 16
 * MiB copy in progress looks the same (a clean-clone CI run under load failed writes that way).
 * The provider looks when the oldest slot stays pending, and releases it with an error; a
 * bounce-buffer slot only up to 4 KiB (one chunk, taken within its command).
 *
 * The other way round, a *writer* SIGKILLed inside its critical section leaves OUR region's
 * lock taken: every other writer to us spins, and our own progress cannot take it.
 * Nothing records which process holds a spin lock, so after any watched peer's death
 * ofi_shm_unwedge_self looks at our lock: taken at every look for UNWEDGE_MS while the
 * command queue's read and write counts do not move (a live holder lets go within
 * microseconds, and a live system moves the queue), it is the dead process's, and it is
 * freed. The dead writer had not committed the command it was writing (1.17 advances the
 * queue's write count last), so nothing half-written is seen.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ofi_shmfence.h"

/* struct smr_region of libfabric 1.17 (prov/shm/src/smr_util.h), the fields used here:
 * uint8 version, resv; uint16 flags; int pid (4); uint8 cma caps x2, uint32 max_sar_buf
 * (8); void *base_addr (16); pthread_spinlock_t lock (24); ofi_atomic32 signal (28);
 * struct smr_map *map (32); size_t total_size (40); size_t cmd_cnt (48). */
#define SMR117_PID 4
#define SMR117_BASE 16
#define SMR117_LOCK 24
#define SMR117_SIGNAL 28 /* set by whoever gives the owner work: its progress runs only then */
#define SMR117_TOTAL 40
#define SMR117_CMD_CNT 48
#define SMR117_CMD_QUEUE 64 /* size_t cmd_queue_offset: an ofi_cirque {size, mask, rcnt, wcnt} */
#define SMR117_RESP_QUEUE 72 /* size_t resp_queue_offset: a cirque of struct smr_resp */
#define SMR117_HEADER 80
/* struct smr_resp {uint64 msg_id (our struct smr_tx_entry *); uint64 status}: FI_EBUSY while
 * pending, else the (negative) result. struct smr_tx_entry {struct smr_cmd cmd (256 bytes:
 * msg_id, id, uint32 op, uint16 op_src @20, ..., src_data @32); int64 peer_id; void *context
 * @264}. Measured on 1.17 with tools/repro/shm117_layout_probe.c. */
#define SMR117_STATUS_BUSY 16      /* FI_EBUSY: a cross-memory-attach operation in flight */
#define SMR117_STATUS_SAR_FREE 1025 /* the target has taken the bounce buffer's data */
#define SMR117_STATUS_SAR_FULL 1026 /* data waiting in the bounce buffer */
#define SMR117_TX_OP_SRC 20
#define SMR117_TX_SIZE 24
#define SMR117_TX_SRC_DATA 32
#define SMR117_TX_CONTEXT 264
#define SMR117_SRC_IOV 2
#define SMR117_SRC_SAR 4
#define UNWEDGE_MS 200

/* Every mapping of `path` in this process: start addresses and lengths (at most `max`). */
static size_t find_mappings(const char *path, uintptr_t *start, size_t *len, size_t max)
{
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f)
        return 0;
    size_t n = 0, plen = strlen(path);
    char line[4352];
    while (n < max && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        int name_at = 0;
        if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %n", &lo, &hi, &name_at) != 2 || !name_at)
            continue;
        const char *name = line + name_at;
        if (strncmp(name, path, plen) != 0)
            continue;
        const char *rest = name + plen; /* "\n", or " (deleted)\n" once the file is unlinked */
        if (strcmp(rest, "\n") != 0 && strcmp(rest, " (deleted)\n") != 0)
            continue;
        start[n] = (uintptr_t)lo;
        len[n] = (size_t)(hi - lo);
        n++;
    }
    fclose(f);
    return n;
}

/* What a free spin lock holds in this libc (x86-64 glibc: 1; others: 0). */
static int free_lock_value(void)
{
    pthread_spinlock_t l;
    if (pthread_spin_init(&l, PTHREAD_PROCESS_SHARED) != 0)
        return -1;
    int v = l;
    pthread_spin_destroy(&l);
    return v;
}

/* The cirque at header offset `at` of the region (size, mask, rcnt, wcnt, entries), if it
 * lies inside the region; NULL if not the layout measured. */
static uint64_t *queue_at(const uint8_t *base, size_t len, size_t at)
{
    uint64_t total, qoff;
    memcpy(&total, base + SMR117_TOTAL, sizeof total);
    memcpy(&qoff, base + at, sizeof qoff);
    if (total != len || qoff < SMR117_HEADER || qoff > total - 4 * sizeof(uint64_t) ||
        qoff % sizeof(uint64_t))
        return NULL;
    return (uint64_t *)(uintptr_t)(base + qoff);
}

/* Our own region's response queue, if it is laid out as 1.17's: a power-of-two ring whose
 * slots (two words each) lie inside the region. */
static uint64_t *resp_queue(const uint8_t *self_base, size_t len)
{
    uint64_t *q = queue_at(self_base, len, SMR117_RESP_QUEUE);
    if (!q)
        return NULL;
    uint64_t size = q[0], mask = q[1];
    uint64_t room = len - (uint64_t)((const uint8_t *)q - self_base) - 4 * sizeof(uint64_t);
    if (!size || (size & (size - 1)) || mask != size - 1 || size > room / (2 * sizeof(uint64_t)))
        return NULL;
    return q;
}

int ofi_shm_fence(const char *path, uint32_t pid)
{
    long page = sysconf(_SC_PAGESIZE);
    if (page < SMR117_HEADER)
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0; /* never mapped, or already gone with its mappings */
    uint8_t *copy = malloc((size_t)page);
    struct stat st;
    int fenced = 0;
    if (!copy || fstat(fd, &st) != 0 || pread(fd, copy, (size_t)page, 0) != page)
        goto out;
    int32_t owner;
    uint64_t base, total;
    memcpy(&owner, copy + SMR117_PID, sizeof owner);
    memcpy(&base, copy + SMR117_BASE, sizeof base);
    memcpy(&total, copy + SMR117_TOTAL, sizeof total);
    if ((uint32_t)owner != pid || !base || total != (uint64_t)st.st_size || total < (uint64_t)page)
        goto out; /* not the 1.17 layout, or not that process's region */
    int free_value = free_lock_value();
    if (free_value < 0)
        goto out;
    memcpy(copy + SMR117_LOCK, &free_value, sizeof free_value);
    memset(copy + SMR117_CMD_CNT, 0, sizeof(uint64_t));
    uintptr_t start[4];
    size_t len[4];
    size_t n = find_mappings(path, start, len, 4);
    for (size_t i = 0; i < n; i++) {
        if (len[i] != total)
            continue; /* only whole-region mappings (1.17 maps the region once, whole) */
        void *at = (void *)start[i];
        if (mmap(at, len[i], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0) != at)
            continue;
        memcpy(at, copy, (size_t)page); /* the header as read, lock freed, no room */
        fenced++;
    }
out:
    free(copy);
    close(fd);
    return fenced;
}

int ofi_shm_unwedge_self(const char *path)
{
    _Static_assert(sizeof(pthread_spinlock_t) == sizeof(int), "glibc's spin lock is an int");
    uintptr_t start[4];
    size_t len[4];
    size_t n = find_mappings(path, start, len, 4);
    int free_value = free_lock_value();
    for (size_t i = 0; i < n && free_value >= 0; i++) {
        uint8_t *base = (uint8_t *)start[i];
        int32_t owner;
        memcpy(&owner, base + SMR117_PID, sizeof owner);
        uint64_t *q = queue_at(base, len[i], SMR117_CMD_QUEUE); /* size, mask, rcnt, wcnt */
        if (owner != (int32_t)getpid() || !q)
            continue; /* not our own 1.17 region, whole */
        int *lock = (int *)(void *)(base + SMR117_LOCK);
        uint64_t rcnt = __atomic_load_n(&q[2], __ATOMIC_ACQUIRE);
        uint64_t wcnt = __atomic_load_n(&q[3], __ATOMIC_ACQUIRE);
        bool stuck = true;
        for (int ms = 0; stuck && ms < UNWEDGE_MS; ms++) {
            stuck = __atomic_load_n(lock, __ATOMIC_ACQUIRE) != free_value &&
                    __atomic_load_n(&q[2], __ATOMIC_ACQUIRE) == rcnt &&
                    __atomic_load_n(&q[3], __ATOMIC_ACQUIRE) == wcnt;
            if (stuck)
                usleep(1000);
        }
        if (stuck) {
            __atomic_store_n(lock, free_value, __ATOMIC_RELEASE);
            return 1;
        }
    }
    return 0;
}

/* Reads `len` bytes at `addr` of this process without faulting on a bad address. */
static bool peek(const void *addr, void *out, size_t len)
{
    struct iovec local = {.iov_base = out, .iov_len = len};
    struct iovec remote = {.iov_base = (void *)(uintptr_t)addr, .iov_len = len};
    return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == (ssize_t)len;
}

bool ofi_shm_region(const char *path, uint8_t **base, size_t *len)
{
    uintptr_t start[4];
    size_t lens[4];
    size_t n = find_mappings(path, start, lens, 4);
    for (size_t i = 0; i < n; i++) {
        if (queue_at((const uint8_t *)start[i], lens[i], SMR117_CMD_QUEUE)) {
            *base = (uint8_t *)start[i];
            *len = lens[i];
            return true;
        }
    }
    return false;
}

bool ofi_shm_idle(const uint8_t *base, size_t len)
{
    const uint64_t *q = queue_at(base, len, SMR117_CMD_QUEUE);
    if (!q || __atomic_load_n(&q[2], __ATOMIC_ACQUIRE) != __atomic_load_n(&q[3], __ATOMIC_ACQUIRE))
        return false;
    /* then the lock: a progress pass holds it from taking commands off the queue to the last
     * status it writes, so free after drained means every command taken was answered */
    int free_value = free_lock_value();
    return free_value >= 0 &&
           __atomic_load_n((const int *)(const void *)(base + SMR117_LOCK), __ATOMIC_ACQUIRE) ==
               free_value;
}

static bool pending_status(uint64_t st)
{
    return st == SMR117_STATUS_BUSY || st == SMR117_STATUS_SAR_FULL;
}

bool ofi_shm_head_pending(const uint8_t *self_base, size_t len, uint64_t *rcnt)
{
    const uint64_t *q = resp_queue(self_base, len);
    if (!q || q[2] == q[3])
        return false;
    *rcnt = q[2];
    return pending_status(__atomic_load_n(&q[4 + 2 * (q[2] & q[1]) + 1], __ATOMIC_ACQUIRE));
}

size_t ofi_shm_release(uint8_t *self_base, size_t self_len, bool oldest_only,
                       bool (*claim)(void *arg, void *context, bool sar, uint64_t size),
                       void (*released)(void *arg, void *context), void *arg, int64_t status)
{
    if (*(const int32_t *)(const void *)(self_base + SMR117_PID) != (int32_t)getpid())
        return 0; /* not our own region */
    uint64_t *q = resp_queue(self_base, self_len);
    if (!q)
        return 0;
    uint64_t size = q[0], mask = q[1], rcnt = q[2], wcnt = q[3];
    if (wcnt - rcnt > size)
        return 0; /* not a response queue as 1.17 lays it out */
    size_t n_released = 0;
    for (uint64_t k = rcnt; k != wcnt && (!oldest_only || k == rcnt); k++) {
        uint64_t *slot = &q[4 + 2 * (k & mask)];
        uint64_t st = __atomic_load_n(&slot[1], __ATOMIC_ACQUIRE);
        if (!pending_status(st))
            continue;
        const uint8_t *tx = (const uint8_t *)(uintptr_t)slot[0];
        uint16_t op_src;
        uint64_t src_data, len;
        void *context;
        if (!peek(tx + SMR117_TX_OP_SRC, &op_src, sizeof op_src) ||
            !peek(tx + SMR117_TX_SIZE, &len, sizeof len) ||
            !peek(tx + SMR117_TX_SRC_DATA, &src_data, sizeof src_data) ||
            !peek(tx + SMR117_TX_CONTEXT, &context, sizeof context))
            continue;
        bool iov = op_src == SMR117_SRC_IOV && st == SMR117_STATUS_BUSY;
        bool sar = op_src == SMR117_SRC_SAR && st == SMR117_STATUS_SAR_FULL;
        if (!(iov || sar) || src_data != (uint64_t)((uint8_t *)slot - self_base))
            continue; /* another protocol or state, or not the layout measured */
        if (!claim(arg, context, sar, len))
            continue;
        /* What the target writes when it is done (the status, last), unless it just did. A
         * bounce-buffer operation completes as taken (1.17 has no error for it): the caller
         * reports the completions of the operations it claimed as errors. */
        uint64_t want = iov ? (uint64_t)status : SMR117_STATUS_SAR_FREE;
        if (__atomic_compare_exchange_n(&slot[1], &st, want, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            if (released)
                released(arg, context);
            n_released++;
        }
    }
    if (n_released) /* smr_signal: 1.17's progress skips the queues until it is set */
        __atomic_store_n((int32_t *)(void *)(self_base + SMR117_SIGNAL), 1, __ATOMIC_RELEASE);
    return n_released;
}
