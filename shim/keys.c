/*
 * Remote keys and incarnations.
 *
 * A remote key is a capability: whoever holds it can write into the region. Where the
 * provider lets afabric choose keys (tcp, shm), each key is SipHash-2-4 of (NIC, counter)
 * under a 128-bit secret drawn once per engine and never sent anywhere, so holding one
 * region's descriptor (or the engine's address) tells nothing about another region's key.
 * (They used to be a bijective mix of the incarnation, which the address carries: anyone
 * with the address could compute every key.)
 *
 * An incarnation names one engine instance: its top 52 bits are the wall-clock time of
 * creation in microseconds, the low 12 random. Peers at one NIC address live on one host,
 * so when two incarnations live at the same NIC address the larger one is the restarted
 * engine and the smaller one's descriptors are refused — once the larger one has proved
 * itself there (a keepalive frame from that NIC address stating it: afs_peer_proven in
 * engine.c), never on a claim alone, and never for one dated more than
 * AFS_INCARNATION_AHEAD_US ahead of this host's clock.
 */
#include <time.h>

#include "internal.h"

static inline uint64_t rotl(uint64_t x, int b)
{
    return (x << b) | (x >> (64 - b));
}

#define SIPROUND                                                                               \
    do {                                                                                       \
        v0 += v1;                                                                              \
        v1 = rotl(v1, 13);                                                                     \
        v1 ^= v0;                                                                              \
        v0 = rotl(v0, 32);                                                                     \
        v2 += v3;                                                                              \
        v3 = rotl(v3, 16);                                                                     \
        v3 ^= v2;                                                                              \
        v0 += v3;                                                                              \
        v3 = rotl(v3, 21);                                                                     \
        v3 ^= v0;                                                                              \
        v2 += v1;                                                                              \
        v1 = rotl(v1, 17);                                                                     \
        v1 ^= v2;                                                                              \
        v2 = rotl(v2, 32);                                                                     \
    } while (0)

/* SipHash-2-4 of two 64-bit words (a 16-byte message) under key k. */
static uint64_t siphash_2w(const uint64_t k[2], uint64_t m0, uint64_t m1)
{
    uint64_t v0 = k[0] ^ 0x736f6d6570736575ull, v1 = k[1] ^ 0x646f72616e646f6dull;
    uint64_t v2 = k[0] ^ 0x6c7967656e657261ull, v3 = k[1] ^ 0x7465646279746573ull;
    const uint64_t words[2] = {m0, m1};
    for (int i = 0; i < 2; i++) {
        v3 ^= words[i];
        SIPROUND;
        SIPROUND;
        v0 ^= words[i];
    }
    const uint64_t last = (uint64_t)16 << 56; /* message length in the top byte */
    v3 ^= last;
    SIPROUND;
    SIPROUND;
    v0 ^= last;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

uint64_t afs_mr_key(const uint64_t secret[2], uint32_t nic, uint64_t counter)
{
    return siphash_2w(secret, nic, counter);
}

uint64_t afs_new_incarnation(void)
{
    struct timespec ts;
    uint64_t us = 0;
    if (clock_gettime(CLOCK_REALTIME, &ts) == 0)
        us = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
    return (us << 12) | (afs_random_u64() & 0xffeu) | 1u;
}
