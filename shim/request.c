/*
 * afs_submit_req: the one submit entry point Python calls. A size-prefixed afs_request
 * (as the provider ABI's afp_ops: the caller states how much it knows) is copied into a
 * zeroed local of this build's size, checked for what this build cannot honour, and
 * handed to the builder of its op (api.c, dynlen.c), which does every range and handle
 * check before anything reaches the worker.
 */
#include <stddef.h>
#include <string.h>

#include "internal.h"

_Static_assert(sizeof(afs_request) == AFS_REQUEST_MIN_SIZE,
               "afs_request changed: a new field goes at the end, MIN_SIZE stays");
_Static_assert(offsetof(afs_request, trigger) + sizeof(afs_trigger) == sizeof(afs_request),
               "afs_request: the trigger is the last field of ABI 4");

/* A caller built against a newer header may pass a longer request: what this build does not
 * know must be 0 (an option it asks for that would otherwise be silently ignored). */
static int copy_request(const afs_request *req, afs_request *out)
{
    if (!req)
        return afs_fail(AFS_EINVAL, "submit: NULL request");
    uint32_t size = req->size;
    if (size < AFS_REQUEST_MIN_SIZE)
        return afs_fail(AFS_EINVAL, "submit: request of %u bytes, at least %u expected "
                                    "(size must be sizeof(afs_request))",
                        size, AFS_REQUEST_MIN_SIZE);
    const uint8_t *tail = (const uint8_t *)req + sizeof(*out);
    for (uint32_t i = 0; i < size - (uint32_t)sizeof(*out); i++)
        if (tail[i])
            return afs_fail(AFS_EUNSUPPORTED, "submit: the request sets field bytes past %zu, "
                                              "which this shim (ABI %u) does not know",
                            sizeof(*out), AFS_ABI_VERSION);
    memcpy(out, req, sizeof(*out));
    if (out->trigger.reserved)
        return afs_fail(AFS_EINVAL, "submit: trigger.reserved must be 0");
    return 0;
}

static const int64_t *i64s(uint64_t address) { return (const int64_t *)(uintptr_t)address; }
static const uint64_t *u64s(uint64_t address) { return (const uint64_t *)(uintptr_t)address; }

int32_t afs_submit_req(afs_engine *eng, const afs_request *req, uint64_t *xfer_id)
{
    afs_request r;
    int rc = copy_request(req, &r);
    if (rc)
        return rc;
    const afs_trigger *t = &r.trigger;
    if ((r.op == AFS_OP_READ || r.op == AFS_OP_READ_PAGED || r.op == AFS_OP_GATHER) &&
        r.imm != AFS_NO_IMM)
        return afs_fail(AFS_EINVAL, "read: reads carry no immediate (imm must be AFS_NO_IMM)");
    switch (r.op) {
    case AFS_OP_WRITE:
        return afs_write(eng, r.mr_id, r.remote_id, r.length, r.src_offset, r.dst_offset, r.imm,
                         t->kind, t->source, t->threshold, xfer_id);
    case AFS_OP_WRITE_PAGED:
        return afs_write_paged(eng, r.mr_id, r.remote_id, r.length, r.count, i64s(r.src_idx),
                               r.src_stride, r.src_offset, i64s(r.dst_idx), r.dst_stride,
                               r.dst_offset, r.imm, t->kind, t->source, t->threshold, xfer_id);
    case AFS_OP_SCATTER:
        return afs_scatter(eng, r.mr_id, r.count, u64s(r.remote_ids), u64s(r.lengths),
                           u64s(r.src_offsets), u64s(r.dst_offsets), r.imm, t->kind, t->source,
                           t->threshold, xfer_id);
    case AFS_OP_WRITE_DYNLEN:
        return afs_write_dynlen(eng, r.mr_id, r.remote_id, r.length, r.src_offset, r.dst_offset,
                                r.imm, r.len_mr_id, r.len_offset, r.len_base, r.len_scale,
                                t->kind, t->source, t->threshold, xfer_id);
    case AFS_OP_READ:
        return afs_read(eng, r.mr_id, r.remote_id, r.length, r.src_offset, r.dst_offset, t->kind,
                        t->source, t->threshold, xfer_id);
    case AFS_OP_READ_PAGED:
        return afs_read_paged(eng, r.mr_id, r.remote_id, r.length, r.count, i64s(r.src_idx),
                              r.src_stride, r.src_offset, i64s(r.dst_idx), r.dst_stride,
                              r.dst_offset, t->kind, t->source, t->threshold, xfer_id);
    case AFS_OP_GATHER:
        return afs_gather(eng, r.mr_id, r.count, u64s(r.remote_ids), u64s(r.lengths),
                          u64s(r.src_offsets), u64s(r.dst_offsets), t->kind, t->source,
                          t->threshold, xfer_id);
    default:
        return afs_fail(AFS_EINVAL, "submit: unknown op %u", r.op);
    }
}

int32_t afs_submit_take(afs_engine *eng, const afs_request *req, uint64_t *xfer_id,
                        uint32_t max_ns)
{
    int32_t rc = afs_submit_req(eng, req, xfer_id);
    if (rc)
        return rc;
    if (!afs_pending_wait(eng, max_ns))
        return AFS_TAKE_NONE;
    return afs_ring_take(&eng->ring, *xfer_id) ? AFS_TAKEN : AFS_TAKE_OTHER;
}
