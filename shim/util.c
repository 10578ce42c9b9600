/* Clocks, CPUs, randomness and checksums. */
#include <errno.h>
#include <sched.h>
#include <sys/random.h>
#include <time.h>

#include "internal.h"

uint64_t afs_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

bool afs_few_cpus(void)
{
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) < AFS_FEW_CPUS;
}

uint64_t afs_mix64(uint64_t x)
{ /* splitmix64 finaliser */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

uint64_t afs_random_u64(void)
{
    uint64_t v = 0;
    ssize_t n;
    do {
        n = getrandom(&v, sizeof(v), 0);
    } while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof(v)) /* no entropy source: still unique enough per process */
        v = afs_mix64(afs_now_ns() ^ ((uint64_t)(uintptr_t)&v << 16));
    return v;
}

uint32_t afs_crc32(const uint8_t *buf, size_t len)
{ /* bitwise CRC-32 (IEEE); blobs are small and decoded once per peer/descriptor */
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < len; i++) {
        crc ^= buf[i];
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}
