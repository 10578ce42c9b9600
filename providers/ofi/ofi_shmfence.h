/* libfabric 1.17's shm: a dead peer's shared region, replaced in this process by a private
 * copy whose lock is free and whose command queue is full, and the response slots of the
 * operations sent to it released (ofi_shmfence.c). */
#ifndef OFI_SHMFENCE_H
#define OFI_SHMFENCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Fences this process's mappings of the region file `path` ("/dev/shm/NAME") of exited
 * process `pid`; returns how many. Safe from any thread, while others call libfabric. */
__attribute__((visibility("hidden"))) int ofi_shm_fence(const char *path, uint32_t pid);

/* After a peer's death: frees this process's own region lock (file `path`) if it stays
 * taken, and the region's command queue unmoved, for UNWEDGE_MS (the dead process was
 * inside its critical section). Returns 1 if it did. Blocks up to that long; any thread. */
__attribute__((visibility("hidden"))) int ofi_shm_unwedge_self(const char *path);

/* This process's whole mapping of the 1.17 region in file `path` ("/dev/shm/NAME"): false
 * if there is none (not mapped yet, or not the layout measured). The address stays valid
 * for the endpoint's lifetime (a fence replaces the mapping in place). */
__attribute__((visibility("hidden"))) bool ofi_shm_region(const char *path, uint8_t **base,
                                                          size_t *len);

/* Whether the region's owner has taken every command queued to it and answered each (its
 * command queue drained, then its lock free: no progress pass in flight). */
__attribute__((visibility("hidden"))) bool ofi_shm_idle(const uint8_t *base, size_t len);

/* Whether the oldest slot of our own region's response queue is still pending; its index. */
__attribute__((visibility("hidden"))) bool ofi_shm_head_pending(const uint8_t *self_base,
                                                                size_t len, uint64_t *rcnt);

/* Completes, with `status` (a negative libfabric error), every operation (or with
 * `oldest_only`, the oldest one) still pending in this process's own region whose context `claim` claims (told whether it went through the
 * bounce buffer, and its size in bytes), calling `released` (if not NULL) for each one it
 * did release: a target may still answer between the two. Call it on the
 * thread that runs libfabric's progress for that endpoint. Returns how many. */
__attribute__((visibility("hidden"))) size_t ofi_shm_release(
    uint8_t *self_base, size_t self_len, bool oldest_only,
    bool (*claim)(void *arg, void *context, bool sar, uint64_t size),
    void (*released)(void *arg, void *context), void *arg, int64_t status);

#endif
