/*
 * Address and descriptor blobs: what peers exchange. Both are decoded defensively: every
 * length is checked against the buffer before it is used, and a CRC-32 trailer rejects
 * truncated or corrupted blobs (forged ones with a valid CRC are stopped by the target's
 * provider, which checks the key and range of every remote access).
 *
 * Address:    "AFA1" u8 nics u8 name_len u16 max_msg u64 incarnation name[name_len]
 *             { u16 len, bytes[len] } x nics   [ "L" u64 host u32 pid u64 start ]   u32 crc
 * Routed:     "AFA2" u8 transports u8 0 u16 max_msg u64 incarnation
 *             { u8 name_len name[name_len] u8 nics { u16 len, bytes[len] } x nics } x transports
 *             [ "L" u64 host u32 pid u64 start ]   u32 crc
 *             (a routed engine's: its transports in the order it prefers them; at most
 *             AFS_MAX_TRANSPORTS, AFS_ENG_NICS NICs in all)
 * Descriptor: "AFD2" u32 addr_len addr[addr_len] u64 base u64 length i32 device u32 nics
 *             u32 access { u64 remote_base, u64 key } x nics   u32 crc
 *             "AFD3" is the same with a u32 transport mask after `access`: the owner's
 *             transports (bit = index in its address) that hold the region; the keys of
 *             the others are 0 and never used. A routed engine's descriptors are AFD3.
 *             `access`: what peers may do, AFP_MR_REMOTE (write) | AFP_MR_REMOTE_READ (read),
 *             at least one of them. "AFD1" (before reads) is the same without `access`; it
 *             still decodes, with access 0 ("not stated": only the target's provider checks).
 * All integers little-endian. `max_msg` is the largest message the engine receives, so that
 * senders refuse bigger ones before posting (libfabric 1.17's shm wedges on an oversize
 * message): below 32768 it is the size in bytes, else 0x8000 | size / 4096 (rounded down,
 * so never above the real limit); 0 means unknown (no check). The optional "L" block says
 * which process owns the engine (peers.c): a host id (boot id and pid namespace), its pid
 * and its start time, so that a peer on the same host can watch that process (pidfd).
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

typedef struct wbuf {
    uint8_t *p;
    uint32_t cap, len;
    bool overflow;
} wbuf;

static void put(wbuf *w, const void *src, uint32_t n)
{
    if (w->overflow || n > w->cap - w->len) {
        w->overflow = true;
        return;
    }
    memcpy(w->p + w->len, src, n);
    w->len += n;
}

static void put_u(wbuf *w, uint64_t v, uint32_t n)
{
    uint8_t b[8];
    for (uint32_t i = 0; i < n; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    put(w, b, n);
}

typedef struct rbuf {
    const uint8_t *p;
    uint32_t len, pos;
    bool bad;
} rbuf;

static const uint8_t *take(rbuf *r, uint32_t n)
{
    if (r->bad || n > r->len - r->pos) {
        r->bad = true;
        return NULL;
    }
    const uint8_t *at = r->p + r->pos;
    r->pos += n;
    return at;
}

static uint64_t get_u(rbuf *r, uint32_t n)
{
    const uint8_t *b = take(r, n);
    uint64_t v = 0;
    if (!b)
        return 0;
    for (uint32_t i = 0; i < n; i++)
        v |= (uint64_t)b[i] << (8 * i);
    return v;
}

static void put_crc(wbuf *w)
{
    if (!w->overflow)
        put_u(w, afs_crc32(w->p, w->len), 4);
}

static int check_crc(const uint8_t *buf, uint32_t len, const char *what)
{
    if (len < 8)
        return afs_fail(AFS_EBADDESC, "%s truncated: %u bytes", what, len);
    uint32_t want = afs_crc32(buf, len - 4);
    uint32_t got = (uint32_t)buf[len - 4] | (uint32_t)buf[len - 3] << 8 |
                   (uint32_t)buf[len - 2] << 16 | (uint32_t)buf[len - 1] << 24;
    if (want != got)
        return afs_fail(AFS_EBADDESC, "%s corrupted or truncated (checksum mismatch)", what);
    return 0;
}

static uint32_t msg_limit_code(uint32_t max_msg)
{
    if (max_msg < 0x8000u)
        return max_msg;
    uint32_t units = max_msg >> 12;
    return 0x8000u | (units > 0x7fffu ? 0x7fffu : units);
}

static uint32_t msg_limit(uint32_t code)
{
    return code & 0x8000u ? (code & 0x7fffu) << 12 : code;
}

static int put_nics(wbuf *w, uint32_t nics, const uint8_t *const *addrs, const uint32_t *lens)
{
    for (uint32_t i = 0; i < nics; i++) {
        if (lens[i] > AFP_MAX_ADDR_LEN)
            return afs_fail(AFS_EINVAL, "address: NIC address too long (%u)", lens[i]);
        put_u(w, lens[i], 2);
        put(w, addrs[i], lens[i]);
    }
    return 0;
}

int afs_addr_encode(bool routed, uint32_t ntp, const char *const *names, const uint32_t *tp_nics,
                    uint64_t incarnation, uint32_t max_msg, const uint8_t *const *addrs,
                    const uint32_t *lens, uint8_t *out, uint32_t cap, uint32_t *len)
{
    uint32_t total = 0;
    if (ntp == 0 || ntp > AFS_MAX_TRANSPORTS || (!routed && ntp != 1))
        return afs_fail(AFS_EINVAL, "address: bad transport count %u", ntp);
    for (uint32_t t = 0; t < ntp; t++) {
        size_t name_len = strlen(names[t]);
        if (name_len == 0 || name_len > AFS_MAX_PROVNAME || tp_nics[t] == 0 ||
            tp_nics[t] > AFS_MAX_NICS)
            return afs_fail(AFS_EINVAL, "address: bad provider name or NIC count");
        total += tp_nics[t];
    }
    if (total > AFS_ENG_NICS)
        return afs_fail(AFS_EINVAL, "address: %u NICs (at most %u)", total, AFS_ENG_NICS);
    wbuf w = {out, cap, 0, false};
    int rc;
    if (!routed) {
        size_t name_len = strlen(names[0]);
        put(&w, AFS_ADDR_MAGIC, 4);
        put_u(&w, tp_nics[0], 1);
        put_u(&w, name_len, 1);
        put_u(&w, msg_limit_code(max_msg), 2);
        put_u(&w, incarnation, 8);
        put(&w, names[0], (uint32_t)name_len);
        if ((rc = put_nics(&w, tp_nics[0], addrs, lens)))
            return rc;
    } else {
        put(&w, AFS_ADDR_MAGIC2, 4);
        put_u(&w, ntp, 1);
        put_u(&w, 0, 1);
        put_u(&w, msg_limit_code(max_msg), 2);
        put_u(&w, incarnation, 8);
        for (uint32_t t = 0, at = 0; t < ntp; at += tp_nics[t], t++) {
            size_t name_len = strlen(names[t]);
            put_u(&w, name_len, 1);
            put(&w, names[t], (uint32_t)name_len);
            put_u(&w, tp_nics[t], 1);
            if ((rc = put_nics(&w, tp_nics[t], addrs + at, lens + at)))
                return rc;
        }
    }
    afs_proc_id me;
    if (afs_proc_self(&me) == 0) {
        put(&w, "L", 1);
        put_u(&w, me.host, 8);
        put_u(&w, me.pid, 4);
        put_u(&w, me.start, 8);
    }
    put_crc(&w);
    if (w.overflow)
        return afs_fail(AFS_ERANGE, "address does not fit in %u bytes", cap);
    *len = w.len;
    return 0;
}

static int take_name(rbuf *r, uint32_t name_len, char *out)
{
    if (name_len == 0 || name_len > AFS_MAX_PROVNAME)
        return afs_fail(AFS_EBADDESC, "address: bad provider name length %u", name_len);
    const uint8_t *name = take(r, name_len);
    if (!name)
        return afs_fail(AFS_EBADDESC, "address truncated");
    memcpy(out, name, name_len);
    out[name_len] = '\0';
    if (strlen(out) != name_len)
        return afs_fail(AFS_EBADDESC, "address: provider name contains NUL");
    return 0;
}

static int take_nics(rbuf *r, afs_addr_view *out, uint32_t nics)
{
    for (uint32_t i = 0; i < nics; i++) {
        uint32_t l = (uint32_t)get_u(r, 2);
        if (r->bad || l == 0 || l > AFP_MAX_ADDR_LEN)
            return afs_fail(AFS_EBADDESC, "address: bad NIC address length");
        out->nic_addr[out->nics] = take(r, l);
        out->nic_addr_len[out->nics] = l;
        if (!out->nic_addr[out->nics])
            return afs_fail(AFS_EBADDESC, "address truncated");
        out->nics++;
    }
    return 0;
}

/* AFA2's body after the magic: the transports and their NICs. */
static int addr_parse_routed(rbuf *r, afs_addr_view *out)
{
    uint32_t ntp = (uint32_t)get_u(r, 1);
    (void)get_u(r, 1);
    out->max_msg = msg_limit((uint32_t)get_u(r, 2));
    out->incarnation = get_u(r, 8);
    if (r->bad)
        return afs_fail(AFS_EBADDESC, "address truncated");
    if (ntp == 0 || ntp > AFS_MAX_TRANSPORTS)
        return afs_fail(AFS_EBADDESC, "address names %u transports (1..%u allowed)", ntp,
                        AFS_MAX_TRANSPORTS);
    out->routed = true;
    out->ntp = ntp;
    int rc;
    for (uint32_t t = 0; t < ntp; t++) {
        afs_addr_tp *tp = &out->tp[t];
        if ((rc = take_name(r, (uint32_t)get_u(r, 1), tp->name)))
            return rc;
        for (uint32_t u = 0; u < t; u++)
            if (strcmp(out->tp[u].name, tp->name) == 0)
                return afs_fail(AFS_EBADDESC, "address names transport %s twice", tp->name);
        uint32_t nics = (uint32_t)get_u(r, 1);
        if (r->bad)
            return afs_fail(AFS_EBADDESC, "address truncated");
        if (nics == 0 || nics > AFS_MAX_NICS || out->nics + nics > AFS_ENG_NICS)
            return afs_fail(AFS_EBADDESC, "address: transport %s names %u NICs", tp->name,
                            nics);
        tp->first = out->nics;
        tp->nics = nics;
        if ((rc = take_nics(r, out, nics)))
            return rc;
    }
    memcpy(out->provider, out->tp[0].name, sizeof(out->provider));
    return 0;
}

static int addr_parse_body(rbuf *r, afs_addr_view *out)
{
    const uint8_t *magic = take(r, 4);
    bool routed = magic && memcmp(magic, AFS_ADDR_MAGIC2, 4) == 0;
    if (!magic || (!routed && memcmp(magic, AFS_ADDR_MAGIC, 4) != 0)) {
        if (magic && memcmp(magic, "AFA", 3) == 0 && magic[3] >= '3' && magic[3] <= '9')
            return afs_fail(AFS_EBADDESC, "afabric address of version %c, which this afabric "
                                          "does not read (it reads 1 and 2)", magic[3]);
        return afs_fail(AFS_EBADDESC, "not an afabric address (bad magic)");
    }
    int rc = routed ? addr_parse_routed(r, out) : 0;
    if (rc)
        return rc;
    if (routed)
        goto owner;
    uint32_t nics = (uint32_t)get_u(r, 1);
    uint32_t name_len = (uint32_t)get_u(r, 1);
    out->max_msg = msg_limit((uint32_t)get_u(r, 2));
    out->incarnation = get_u(r, 8);
    if (r->bad)
        return afs_fail(AFS_EBADDESC, "address truncated");
    if (nics == 0 || nics > AFS_MAX_NICS)
        return afs_fail(AFS_EBADDESC, "address names %u NICs (1..%u allowed)", nics,
                        AFS_MAX_NICS);
    if ((rc = take_name(r, name_len, out->provider)))
        return rc;
    out->ntp = 1;
    memcpy(out->tp[0].name, out->provider, sizeof(out->tp[0].name));
    out->tp[0].first = 0;
    out->tp[0].nics = nics;
    if ((rc = take_nics(r, out, nics)))
        return rc;
owner:
    if (r->pos < r->len && r->p[r->pos] == 'L') { /* the owner process (optional) */
        (void)take(r, 1);
        out->proc.host = get_u(r, 8);
        out->proc.pid = (uint32_t)get_u(r, 4);
        out->proc.start = get_u(r, 8);
        if (r->bad)
            return afs_fail(AFS_EBADDESC, "address truncated");
    }
    return 0;
}

int afs_addr_parse(const uint8_t *buf, uint32_t len, afs_addr_view *out)
{
    memset(out, 0, sizeof(*out));
    if (!buf)
        return afs_fail(AFS_EINVAL, "address: NULL buffer");
    int rc = check_crc(buf, len, "address");
    if (rc)
        return rc;
    rbuf r = {buf, len - 4, 0, false};
    rc = addr_parse_body(&r, out);
    if (rc)
        return rc;
    if (r.pos != r.len)
        return afs_fail(AFS_EBADDESC, "address has %u trailing bytes", r.len - r.pos);
    return 0;
}

int afs_desc_encode(const uint8_t *addr_blob, uint32_t addr_len, uint64_t base, uint64_t length,
                    int32_t device, uint32_t access, uint32_t nics, const uint64_t *remote_base,
                    const uint64_t *key, bool routed, uint32_t tp_mask, uint8_t *out,
                    uint32_t cap, uint32_t *len)
{
    wbuf w = {out, cap, 0, false};
    put(&w, routed ? AFS_DESC_MAGIC3 : AFS_DESC_MAGIC2, 4);
    put_u(&w, addr_len, 4);
    put(&w, addr_blob, addr_len);
    put_u(&w, base, 8);
    put_u(&w, length, 8);
    put_u(&w, (uint32_t)device, 4);
    put_u(&w, nics, 4);
    put_u(&w, access, 4);
    if (routed)
        put_u(&w, tp_mask, 4);
    for (uint32_t i = 0; i < nics; i++) {
        put_u(&w, remote_base[i], 8);
        put_u(&w, key[i], 8);
    }
    put_crc(&w);
    if (w.overflow)
        return afs_fail(AFS_ERANGE, "descriptor does not fit in %u bytes", cap);
    *len = w.len;
    return 0;
}

int afs_desc_parse(const uint8_t *buf, uint32_t len, afs_desc_view *out)
{
    memset(out, 0, sizeof(*out));
    if (!buf)
        return afs_fail(AFS_EINVAL, "descriptor: NULL buffer");
    int rc = check_crc(buf, len, "descriptor");
    if (rc)
        return rc;
    rbuf r = {buf, len - 4, 0, false};
    const uint8_t *magic = take(&r, 4);
    bool v3 = magic && memcmp(magic, AFS_DESC_MAGIC3, 4) == 0;
    bool v2 = v3 || (magic && memcmp(magic, AFS_DESC_MAGIC2, 4) == 0);
    if (!magic || (!v2 && memcmp(magic, AFS_DESC_MAGIC, 4) != 0)) {
        if (magic && memcmp(magic, "AFD", 3) == 0 && magic[3] >= '4' && magic[3] <= '9')
            return afs_fail(AFS_EBADDESC, "afabric descriptor of version %c, which this "
                                          "afabric does not read (it reads 1 to 3)", magic[3]);
        return afs_fail(AFS_EBADDESC, "not an afabric descriptor (bad magic)");
    }
    uint32_t addr_len = (uint32_t)get_u(&r, 4);
    const uint8_t *addr = take(&r, addr_len);
    if (!addr)
        return afs_fail(AFS_EBADDESC, "descriptor truncated (owner address)");
    rc = afs_addr_parse(addr, addr_len, &out->owner);
    if (rc)
        return rc;
    out->addr_blob = addr;
    out->addr_blob_len = addr_len;
    out->base = get_u(&r, 8);
    out->length = get_u(&r, 8);
    out->device = (int32_t)(uint32_t)get_u(&r, 4);
    uint32_t nics = (uint32_t)get_u(&r, 4);
    out->access = v2 ? (uint32_t)get_u(&r, 4) : 0;
    uint32_t all = (1u << out->owner.ntp) - 1u;
    out->tp_mask = v3 ? (uint32_t)get_u(&r, 4) : all;
    if (r.bad)
        return afs_fail(AFS_EBADDESC, "descriptor truncated");
    if (v3 != out->owner.routed)
        return afs_fail(AFS_EBADDESC, "descriptor version %c does not go with its owner's "
                                      "address version %c", magic[3], out->owner.routed ? '2' : '1');
    if (out->tp_mask == 0 || (out->tp_mask & ~all))
        return afs_fail(AFS_EBADDESC, "descriptor: bad transport mask 0x%x", out->tp_mask);
    if (v2 && (out->access == 0 || (out->access & ~(AFP_MR_REMOTE | AFP_MR_REMOTE_READ))))
        return afs_fail(AFS_EBADDESC, "descriptor: bad access 0x%x", out->access);
    if (nics != out->owner.nics)
        return afs_fail(AFS_EBADDESC, "descriptor has %u keys for %u NICs", nics,
                        out->owner.nics);
    for (uint32_t i = 0; i < nics; i++) {
        out->remote_base[i] = get_u(&r, 8);
        out->key[i] = get_u(&r, 8);
    }
    if (r.bad)
        return afs_fail(AFS_EBADDESC, "descriptor truncated (keys)");
    if (r.pos != r.len)
        return afs_fail(AFS_EBADDESC, "descriptor has %u trailing bytes", r.len - r.pos);
    if (out->device < -1)
        return afs_fail(AFS_EBADDESC, "descriptor: bad device %d", out->device);
    if (out->length > UINT64_MAX - out->base)
        return afs_fail(AFS_EBADDESC, "descriptor: region wraps the address space");
    return 0;
}

int32_t afs_desc_decode(const uint8_t *buf, uint32_t len, afs_desc_info *out)
{
    afs_desc_view v;
    if (!out)
        return afs_fail(AFS_EINVAL, "descriptor: NULL output");
    int rc = afs_desc_parse(buf, len, &v);
    if (rc)
        return rc;
    memset(out, 0, sizeof(*out));
    out->incarnation = v.owner.incarnation;
    out->base = v.base;
    out->length = v.length;
    out->device = v.device;
    out->nics = v.owner.nics;
    out->access = v.access;
    /* the owner's transports that hold the region, "cma+tcp" */
    size_t at = 0;
    for (uint32_t t = 0; t < v.owner.ntp && at < sizeof(out->provider); t++) {
        if (!(v.tp_mask & (1u << t)))
            continue;
        int n = snprintf(out->provider + at, sizeof(out->provider) - at, "%s%s", at ? "+" : "",
                         v.owner.tp[t].name);
        if (n < 0)
            break;
        at += (size_t)n;
    }
    return 0;
}

int32_t afs_address_check(const uint8_t *buf, uint32_t len, uint64_t *incarnation,
                          uint32_t *nics)
{
    afs_addr_view v;
    int rc = afs_addr_parse(buf, len, &v);
    if (rc)
        return rc;
    if (incarnation)
        *incarnation = v.incarnation;
    if (nics)
        *nics = v.nics;
    return 0;
}
