/*
 * Writes whose length is read from memory when they start (afs_write_dynlen).
 *
 * A triggered write is armed before the data exists: a GPU kernel fills a send buffer,
 * stores how much it filled into a host-visible word, then bumps the watcher. With a fixed
 * length the write has to carry its whole capacity every time; here the worker reads the
 * word the moment the write fires (after the trigger, so after the kernel's store) and posts
 * only that many bytes. The word lives in a registered host region (so the caller keeps it
 * alive exactly as it keeps the source alive), every range was checked at submit against the
 * maximum, and the length read is clamped into [0, maximum]: a garbage word can shorten or
 * empty the write, never take it outside the regions. This file builds and submits such a
 * write; the worker resolves its length when it starts (afs_dynlen_resolve, worker.c).
 */
#include <string.h>

#include "internal.h"

int32_t afs_write_dynlen(afs_engine *eng, uint64_t mr_id, uint64_t remote_id,
                         uint64_t max_length, uint64_t src_offset, uint64_t dst_offset,
                         int64_t imm, uint64_t len_mr_id, uint64_t len_offset, int64_t len_base,
                         uint64_t len_scale, uint32_t trig_kind, uint64_t trig_a, uint64_t trig_b,
                         uint64_t *xfer_id)
{
    if (!xfer_id)
        return afs_fail(AFS_EINVAL, "write: NULL output");
    int rc = afs_engine_check_open(eng);
    if (rc)
        return rc;
    afs_mr_entry *m = afs_slots_lookup(&eng->mrs, len_mr_id);
    uint64_t addr = 0, size = 0;
    int32_t device = -1;
    if (m) {
        addr = m->addr;
        size = m->len;
        device = m->device;
    }
    if (!m || !afs_slots_still(&eng->mrs, len_mr_id))
        return afs_fail(AFS_ESTALE, "length word: its memory region is not registered with "
                                    "this engine (deregistered, or from another engine)");
    if (device >= 0)
        return afs_fail(AFS_EINVAL, "length word: must be in host memory (the region is on "
                                    "CUDA device %d)", (int)device);
    if (len_offset % 4 || size < 4 || len_offset > size - 4)
        return afs_fail(AFS_ERANGE, "length word at %llu: not a 4-aligned word inside the "
                                    "region of %llu bytes",
                        (unsigned long long)len_offset, (unsigned long long)size);
    afs_xfer *x;
    if ((rc = afs_build_write(eng, mr_id, remote_id, max_length, src_offset, dst_offset, imm,
                              &x)))
        return rc;
    x->rma.dyn_len = true;
    x->rma.dyn_word = (const uint32_t *)(uintptr_t)(addr + len_offset);
    x->rma.dyn_base = len_base;
    x->rma.dyn_scale = len_scale;
    return afs_submit_built(eng, x, trig_kind, trig_a, trig_b, xfer_id);
}
