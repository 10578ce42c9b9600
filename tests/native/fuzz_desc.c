/*
 * Fuzz target for the shim's address and descriptor decoders (afs_desc_decode,
 * afs_address_check; format at the top of codec.c). Not library code: it lives in
 * tests/native/, outside build_native.py's source dirs, and everything below also needs
 * -DAFABRIC_FUZZ, so compiling it by accident adds nothing.
 *
 * Standalone (gcc, what tests/test_native.py does): link the shim's sources directly,
 * under ASan + UBSan, and run a deterministic mutation loop over seed blobs:
 *
 *   cc -std=c11 -D_GNU_SOURCE -DAFABRIC_FUZZ -g -O1 -fsanitize=address,undefined \
 *      -fno-omit-frame-pointer -Wall -Wextra -Werror -Ishim <every .c file in shim/> \
 *      -o /tmp/fuzz_desc -ldl -lpthread
 *   /tmp/fuzz_desc [-n ITERATIONS] [-t SECONDS] [-s RNG_SEED] SEED_FILE...
 *
 * Each seed file holds one valid address or descriptor blob (the test writes real ones
 * from tcp and shm engines, plus multi-NIC ones it encodes itself). Every seed must decode
 * (exit 2 otherwise: a wrong seed would make the run worthless). The loop stops after
 * ITERATIONS inputs or SECONDS, whichever comes first, prints a summary and the distinct
 * rejection messages it saw (digits folded to '#'), and exits 0; a violated invariant
 * exits 1, a sanitizer report halts with its own exit code.
 *
 * libFuzzer (clang): add -DAFABRIC_FUZZ_NO_MAIN -fsanitize=fuzzer and drop -n/-t/-s.
 *
 * The blobs carry CRC-32 trailers (a descriptor carries two: its own and the one of the
 * owner address inside it), so random mutations die at the checksum. Every input is
 * therefore decoded twice: as given, and with the outer CRC recomputed; the mutation loop
 * also recomputes the inner address CRC of descriptors half of the time, so that the
 * parsers behind both checksums see corrupted lengths and counts.
 */
#include "afabric_shim.h"

#ifdef AFABRIC_FUZZ

#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_BLOB 4096u
#define MAX_SEEDS 64u
#define MAX_MSGS 96u
#define MSG_LEN 96u

static uint32_t crc_table[256];

static void crc_init(void)
{ /* CRC-32 IEEE (zlib.crc32), table-driven: independent of the shim's own afs_crc32 */
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1u) ? 0xedb88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32_ieee(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++)
        c = crc_table[(c ^ p[i]) & 0xffu] ^ (c >> 8);
    return ~c;
}

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void wr(uint8_t *p, uint64_t v, uint32_t width)
{
    for (uint32_t i = 0; i < width; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Recompute the trailer of blob[0..n): what a forger (or a bug that corrupts a blob after
 * encoding it) would produce. */
static void fix_crc(uint8_t *p, size_t n)
{
    if (n >= 8)
        wr(p + n - 4, crc32_ieee(p, n - 4), 4);
}

static bool is_desc(const uint8_t *p, size_t n)
{
    return n >= 8 && (memcmp(p, "AFD1", 4) == 0 || memcmp(p, "AFD2", 4) == 0);
}

/* The owner address inside a descriptor ("AFD1"/"AFD2" u32 addr_len addr[addr_len] ...). */
static void fix_inner_crc(uint8_t *p, size_t n)
{
    if (!is_desc(p, n))
        return;
    uint32_t alen = rd32(p + 4);
    if (alen >= 8 && alen <= n - 8)
        fix_crc(p + 8, alen);
}

/* ---- statistics ---------------------------------------------------------------------- */

static struct {
    uint64_t inputs, past_crc, desc_ok, addr_ok;
} stats;

struct msg {
    char text[MSG_LEN];
    uint64_t count;
};
static struct msg msgs[MAX_MSGS];
static uint32_t nmsgs;

static void note_rejection(void)
{
    char key[MSG_LEN];
    const char *e = afs_last_error();
    size_t k = 0;
    for (size_t i = 0; e[i] && k + 1 < sizeof key; i++) {
        if (e[i] >= '0' && e[i] <= '9') {
            if (k == 0 || key[k - 1] != '#')
                key[k++] = '#';
        } else {
            key[k++] = e[i];
        }
    }
    key[k] = '\0';
    for (uint32_t i = 0; i < nmsgs; i++) {
        if (strcmp(msgs[i].text, key) == 0) {
            msgs[i].count++;
            return;
        }
    }
    if (nmsgs < MAX_MSGS) {
        memcpy(msgs[nmsgs].text, key, k + 1);
        msgs[nmsgs++].count = 1;
    }
}

__attribute__((noreturn)) static void violated(const char *what, const uint8_t *p, size_t n)
{
    fprintf(stderr, "fuzz_desc: INVARIANT VIOLATED: %s; input (%zu bytes):", what, n);
    for (size_t i = 0; i < n; i++)
        fprintf(stderr, "%s%02x", i % 32 ? "" : "\n  ", p[i]);
    fputc('\n', stderr);
    exit(1);
}

/* ---- the target -------------------------------------------------------------------- */

/* Decode p[0..n) both ways; check what a successful decode promises. */
static void check_one(const uint8_t *p, size_t n)
{
    uint32_t len = (uint32_t)n;
    stats.inputs++;
    if (n >= 8 && crc32_ieee(p, n - 4) == rd32(p + n - 4))
        stats.past_crc++;

    afs_desc_info info;
    memset(&info, 0xa5, sizeof info);
    int32_t rc = afs_desc_decode(p, len, &info);
    if (rc == 0) {
        stats.desc_ok++;
        if (info.nics < 1 || info.nics > 8)
            violated("decoded descriptor with NIC count outside 1..8", p, n);
        if (memchr(info.provider, '\0', sizeof info.provider) == NULL || info.provider[0] == '\0')
            violated("decoded descriptor with an unterminated or empty provider name", p, n);
        if (info.device < -1)
            violated("decoded descriptor with device < -1", p, n);
        if (info.length > UINT64_MAX - info.base)
            violated("decoded descriptor whose region wraps the address space", p, n);
        /* its owner address must decode on its own, to the same owner */
        uint32_t alen = rd32(p + 4);
        uint64_t inc = 0;
        uint32_t nics = 0;
        if (alen > n - 8 || afs_address_check(p + 8, alen, &inc, &nics) != 0)
            violated("descriptor decoded but its owner address does not", p, n);
        if (inc != info.incarnation || nics != info.nics)
            violated("descriptor and its owner address disagree", p, n);
    } else {
        if (rc >= 0)
            violated("afs_desc_decode failed with a non-negative code", p, n);
        note_rejection();
    }

    uint64_t inc = 0;
    uint32_t nics = 0;
    rc = afs_address_check(p, len, &inc, &nics);
    if (rc == 0) {
        stats.addr_ok++;
        if (nics < 1 || nics > 8)
            violated("decoded address with NIC count outside 1..8", p, n);
        if (afs_address_check(p, len, NULL, NULL) != 0) /* outputs are optional */
            violated("address decodes with outputs but not without", p, n);
    } else {
        if (rc >= 0)
            violated("afs_address_check failed with a non-negative code", p, n);
        note_rejection();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > MAX_BLOB)
        return 0;
    check_one(data, size);
    if (size >= 8) { /* again with the outer checksum made right: the parser behind it */
        uint8_t *fixed = malloc(size); /* exactly sized: ASan sees any over-read */
        if (!fixed)
            return 0;
        memcpy(fixed, data, size);
        fix_crc(fixed, size);
        check_one(fixed, size);
        free(fixed);
    }
    return 0;
}

#ifndef AFABRIC_FUZZ_NO_MAIN

/* ---- standalone driver: seeds, mutations, a bounded deterministic loop -------------- */

static uint64_t rng_state;

static uint64_t rnd(void)
{ /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}

static uint32_t below(uint32_t n) { return n ? (uint32_t)(rnd() % n) : 0; }

struct blob {
    uint8_t *p;
    size_t n;
    uint32_t fields[48]; /* offsets of length/count fields (structure-aware corruption) */
    uint32_t field_width[48];
    uint32_t nfields;
};

static struct blob seeds[MAX_SEEDS];
static uint32_t nseeds;

static void add_field(struct blob *b, uint32_t off, uint32_t width)
{
    if (b->nfields < 48 && off + width <= b->n) {
        b->fields[b->nfields] = off;
        b->field_width[b->nfields++] = width;
    }
}

/* Record where an address's counts and lengths sit (base: its offset in the blob). */
static void map_address(struct blob *b, uint32_t base, uint32_t alen)
{
    const uint8_t *a = b->p + base;
    if (alen < 20 || memcmp(a, "AFA1", 4) != 0)
        return;
    add_field(b, base + 4, 1); /* nics */
    add_field(b, base + 5, 1); /* name_len */
    add_field(b, base + 6, 2); /* reserved */
    uint32_t nics = a[4], off = 16u + a[5];
    for (uint32_t i = 0; i < nics && off + 2 <= alen; i++) {
        add_field(b, base + off, 2); /* NIC address length */
        off += 2u + ((uint32_t)a[off] | (uint32_t)a[off + 1] << 8);
    }
    add_field(b, base + alen - 4, 4); /* crc */
}

static void map_fields(struct blob *b)
{
    if (is_desc(b->p, b->n)) {
        uint32_t alen = rd32(b->p + 4);
        add_field(b, 4, 4); /* addr_len */
        if (alen <= b->n - 8) {
            map_address(b, 8, alen);
            uint32_t off = 8 + alen;
            add_field(b, off, 8);      /* base */
            add_field(b, off + 8, 8);  /* length */
            add_field(b, off + 16, 4); /* device */
            add_field(b, off + 20, 4); /* nics */
        }
        add_field(b, (uint32_t)b->n - 4, 4);
    } else {
        map_address(b, 0, (uint32_t)b->n);
    }
}

static void add_seed(const uint8_t *p, size_t n, const char *what)
{
    if (nseeds == MAX_SEEDS)
        return;
    struct blob *b = &seeds[nseeds++];
    b->p = malloc(n);
    if (!b->p) {
        fprintf(stderr, "fuzz_desc: out of memory\n");
        exit(2);
    }
    memcpy(b->p, p, n);
    b->n = n;
    b->nfields = 0;
    map_fields(b);
    afs_desc_info info;
    bool ok = is_desc(p, n) ? afs_desc_decode(p, (uint32_t)n, &info) == 0
                            : afs_address_check(p, (uint32_t)n, NULL, NULL) == 0;
    if (!ok) {
        fprintf(stderr, "fuzz_desc: seed %s does not decode: %s\n", what, afs_last_error());
        exit(2);
    }
    if (crc32_ieee(p, n - 4) != rd32(p + n - 4)) {
        fprintf(stderr, "fuzz_desc: seed %s: this program's CRC-32 disagrees with the blob's\n",
                what);
        exit(2);
    }
}

static void load_seed(const char *path)
{
    uint8_t buf[MAX_BLOB];
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(2);
    }
    size_t n = fread(buf, 1, sizeof buf, f);
    bool more = fgetc(f) != EOF;
    fclose(f);
    if (n < 8 || more) {
        fprintf(stderr, "fuzz_desc: seed %s: %zu bytes (8..%u expected)\n", path, n, MAX_BLOB);
        exit(2);
    }
    add_seed(buf, n, path);
    if (is_desc(buf, n)) { /* its owner address is a seed for afs_address_check too */
        uint32_t alen = rd32(buf + 4);
        if (alen <= n - 8)
            add_seed(buf + 8, alen, path);
    }
}

static const uint64_t interesting[] = {
    0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 31, 32, 33, 127, 128, 129, 255, 256, 0x7fff, 0x8000,
    0xffff, 0x10000, 0x7fffffff, 0x80000000u, 0xfffffffcu, 0xffffffffu, UINT64_MAX,
    UINT64_MAX - 1, (uint64_t)INT64_MAX,
};
#define NINTERESTING (sizeof interesting / sizeof interesting[0])

/* One mutation of w[0..*n) (capacity MAX_BLOB), guided by the seed's field map. */
static void mutate(uint8_t *w, size_t *n, const struct blob *seed)
{
    size_t len = *n;
    switch (below(9)) {
    case 0: /* truncate */
        len = below((uint32_t)len + 1);
        break;
    case 1: { /* extend with random bytes or a copy of its own tail */
        uint32_t add = 1 + below(64);
        if (len + add > MAX_BLOB)
            break;
        bool copy = len > 0 && below(2);
        for (uint32_t i = 0; i < add; i++)
            w[len + i] = copy ? w[below((uint32_t)len)] : (uint8_t)rnd();
        len += add;
        break;
    }
    case 2: /* flip one bit */
        if (len)
            w[below((uint32_t)len)] ^= (uint8_t)(1u << below(8));
        break;
    case 3: /* overwrite a byte */
        if (len)
            w[below((uint32_t)len)] = (uint8_t)rnd();
        break;
    case 4:
    case 5: { /* corrupt a length/count field (of the seed's layout) with a telling value */
        if (!seed->nfields)
            break;
        uint32_t f = below(seed->nfields), off = seed->fields[f], width = seed->field_width[f];
        if (off + width > len)
            break;
        uint64_t v = interesting[below(NINTERESTING)];
        if (below(3) == 0) { /* off by a little from what is there */
            uint64_t cur = 0;
            for (uint32_t i = 0; i < width; i++)
                cur |= (uint64_t)w[off + i] << (8 * i);
            v = cur + (uint64_t)(int64_t)((int32_t)below(9) - 4);
        }
        wr(w + off, v, width);
        break;
    }
    case 6: { /* an interesting value anywhere */
        uint32_t width = 1u << below(4);
        if (len < width)
            break;
        wr(w + below((uint32_t)(len - width + 1)), interesting[below(NINTERESTING)], width);
        break;
    }
    case 7: { /* delete or duplicate a chunk (shifts every field behind it) */
        if (len < 2)
            break;
        uint32_t at = below((uint32_t)len), cnt = 1 + below(16);
        if (at + cnt > len)
            cnt = (uint32_t)len - at;
        if (below(2)) {
            memmove(w + at, w + at + cnt, len - at - cnt);
            len -= cnt;
        } else if (len + cnt <= MAX_BLOB) {
            memmove(w + at + cnt, w + at, len - at);
            len += cnt;
        }
        break;
    }
    case 8: { /* splice in part of another seed */
        const struct blob *o = &seeds[below(nseeds)];
        uint32_t from = below((uint32_t)o->n), at = below((uint32_t)len + 1);
        uint32_t cnt = below((uint32_t)(o->n - from) + 1);
        if (at + cnt > MAX_BLOB)
            break;
        memcpy(w + at, o->p + from, cnt);
        if (at + cnt > len)
            len = at + cnt;
        break;
    }
    }
    *n = len;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_msgs(const void *a, const void *b)
{
    uint64_t x = ((const struct msg *)a)->count, y = ((const struct msg *)b)->count;
    return x < y ? 1 : x > y ? -1 : 0;
}

int main(int argc, char **argv)
{
    uint64_t iterations = 200000;
    double seconds = 60.0;
    uint64_t rng_seed = 0x5eed;
    int opt;
    while ((opt = getopt(argc, argv, "n:t:s:")) != -1) {
        switch (opt) {
        case 'n':
            iterations = strtoull(optarg, NULL, 0);
            break;
        case 't':
            seconds = strtod(optarg, NULL);
            break;
        case 's':
            rng_seed = strtoull(optarg, NULL, 0);
            break;
        default:
            fprintf(stderr, "usage: %s [-n ITERATIONS] [-t SECONDS] [-s RNG_SEED] SEED_FILE...\n",
                    argv[0]);
            return 2;
        }
    }
    if (optind >= argc) {
        fprintf(stderr, "fuzz_desc: no seed files\n");
        return 2;
    }
    crc_init();
    for (int i = optind; i < argc; i++)
        load_seed(argv[i]);
    rng_state = rng_seed ? rng_seed : 1;

    /* the edges no mutation reaches */
    afs_desc_info info;
    if (afs_desc_decode(NULL, 0, &info) >= 0 || afs_address_check(NULL, 0, NULL, NULL) >= 0 ||
        afs_desc_decode(seeds[0].p, (uint32_t)seeds[0].n, NULL) >= 0)
        violated("a NULL buffer or output was accepted", NULL, 0);
    for (uint32_t s = 0; s < nseeds; s++) /* every seed, as is */
        LLVMFuzzerTestOneInput(seeds[s].p, seeds[s].n);

    static uint8_t work[MAX_BLOB];
    double t0 = now_s(), deadline = t0 + seconds;
    uint64_t it = 0;
    for (; it < iterations; it++) {
        if ((it & 1023) == 0 && now_s() > deadline)
            break;
        const struct blob *seed = &seeds[below(nseeds)];
        size_t n = seed->n;
        memcpy(work, seed->p, n);
        uint32_t rounds = 1 + below(4);
        for (uint32_t r = 0; r < rounds; r++)
            mutate(work, &n, seed);
        if (below(2))
            fix_inner_crc(work, n);
        uint8_t *input = malloc(n ? n : 1); /* exactly sized (n = 0: a 1-byte block) */
        if (!input) {
            fprintf(stderr, "fuzz_desc: out of memory\n");
            return 2;
        }
        memcpy(input, work, n);
        LLVMFuzzerTestOneInput(input, n);
        free(input);
    }
    double dt = now_s() - t0;

    printf("fuzz_desc: %llu iterations in %.2f s (%u seeds, rng seed %llu)\n",
           (unsigned long long)it, dt, nseeds, (unsigned long long)rng_seed);
    printf("inputs=%llu past_crc=%llu desc_ok=%llu addr_ok=%llu distinct_rejections=%u\n",
           (unsigned long long)stats.inputs, (unsigned long long)stats.past_crc,
           (unsigned long long)stats.desc_ok, (unsigned long long)stats.addr_ok, nmsgs);
    qsort(msgs, nmsgs, sizeof msgs[0], cmp_msgs);
    for (uint32_t i = 0; i < nmsgs; i++)
        printf("  %10llu  %s\n", (unsigned long long)msgs[i].count, msgs[i].text);
    for (uint32_t s = 0; s < nseeds; s++)
        free(seeds[s].p);
    return 0;
}

#endif /* AFABRIC_FUZZ_NO_MAIN */
#endif /* AFABRIC_FUZZ */
