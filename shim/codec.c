/*
 * Address and descriptor blobs: what peers exchange. Both are decoded defensively: every
 * length is checked against the buffer before it is used, and a CRC-32 trailer rejects
 * truncated or corrupted blobs (forged ones with a valid CRC are stopped by the target's
 * provider, which checks the key and range of every remote access).
 *
 * Address:    "AFA1" u8 nics u8 name_len u16 max_msg u64 incarnation name[name_len]
 *             { u16 len, bytes[len] } x nics   [ "L" u64 host u32 pid u64 start ]   u32 crc
 * Descriptor: "AFD2" u32 addr_len addr[addr_len] u64 base u64 length i32 device u32 nics
 *             u32 access { u64 remote_base, u64 key } x nics   u32 crc
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

int afs_addr_encode(const char *provider, uint64_t incarnation, uint32_t nics, uint32_t max_msg,
                    const uint8_t *const *addrs, const uint32_t *lens, uint8_t *out,
                    uint32_t cap, uint32_t *len)
{
    size_t name_len = strlen(provider);
    if (name_len > AFS_MAX_PROVNAME || nics == 0 || nics > AFS_MAX_NICS)
        return afs_fail(AFS_EINVAL, "address: bad provider name or NIC count");
    wbuf w = {out, cap, 0, false};
    put(&w, AFS_ADDR_MAGIC, 4);
    put_u(&w, nics, 1);
    put_u(&w, name_len, 1);
    put_u(&w, msg_limit_code(max_msg), 2);
    put_u(&w, incarnation, 8);
    put(&w, provider, (uint32_t)name_len);
    for (uint32_t i = 0; i < nics; i++) {
        if (lens[i] > AFP_MAX_ADDR_LEN)
            return afs_fail(AFS_EINVAL, "address: NIC address too long (%u)", lens[i]);
        put_u(&w, lens[i], 2);
        put(&w, addrs[i], lens[i]);
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

static int addr_parse_body(rbuf *r, afs_addr_view *out)
{
    const uint8_t *magic = take(r, 4);
    if (!magic || memcmp(magic, AFS_ADDR_MAGIC, 4) != 0)
        return afs_fail(AFS_EBADDESC, "not an afabric address (bad magic)");
    uint32_t nics = (uint32_t)get_u(r, 1);
    uint32_t name_len = (uint32_t)get_u(r, 1);
    out->max_msg = msg_limit((uint32_t)get_u(r, 2));
    out->incarnation = get_u(r, 8);
    if (r->bad)
        return afs_fail(AFS_EBADDESC, "address truncated");
    if (nics == 0 || nics > AFS_MAX_NICS)
        return afs_fail(AFS_EBADDESC, "address names %u NICs (1..%u allowed)", nics,
                        AFS_MAX_NICS);
    if (name_len == 0 || name_len > AFS_MAX_PROVNAME)
        return afs_fail(AFS_EBADDESC, "address: bad provider name length %u", name_len);
    const uint8_t *name = take(r, name_len);
    if (!name)
        return afs_fail(AFS_EBADDESC, "address truncated");
    memcpy(out->provider, name, name_len);
    out->provider[name_len] = '\0';
    if (strlen(out->provider) != name_len)
        return afs_fail(AFS_EBADDESC, "address: provider name contains NUL");
    out->nics = nics;
    for (uint32_t i = 0; i < nics; i++) {
        uint32_t l = (uint32_t)get_u(r, 2);
        if (r->bad || l == 0 || l > AFP_MAX_ADDR_LEN)
            return afs_fail(AFS_EBADDESC, "address: bad NIC address length");
        out->nic_addr[i] = take(r, l);
        out->nic_addr_len[i] = l;
        if (!out->nic_addr[i])
            return afs_fail(AFS_EBADDESC, "address truncated");
    }
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
                    const uint64_t *key, uint8_t *out, uint32_t cap, uint32_t *len)
{
    wbuf w = {out, cap, 0, false};
    put(&w, AFS_DESC_MAGIC2, 4);
    put_u(&w, addr_len, 4);
    put(&w, addr_blob, addr_len);
    put_u(&w, base, 8);
    put_u(&w, length, 8);
    put_u(&w, (uint32_t)device, 4);
    put_u(&w, nics, 4);
    put_u(&w, access, 4);
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
    bool v2 = magic && memcmp(magic, AFS_DESC_MAGIC2, 4) == 0;
    if (!magic || (!v2 && memcmp(magic, AFS_DESC_MAGIC, 4) != 0))
        return afs_fail(AFS_EBADDESC, "not an afabric descriptor (bad magic)");
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
    if (r.bad)
        return afs_fail(AFS_EBADDESC, "descriptor truncated");
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
    memcpy(out->provider, v.owner.provider, sizeof(out->provider) - 1);
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
