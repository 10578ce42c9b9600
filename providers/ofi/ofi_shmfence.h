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

/* Completes, with `status` (a negative libfabric error), every operation still pending in
 * this process's own region (file `self_path`) whose context `went_to_dead` claims. Call it
 * on the thread that runs libfabric's progress for that endpoint. Returns how many. */
__attribute__((visibility("hidden"))) size_t ofi_shm_release_dead(
    const char *self_path, bool (*went_to_dead)(void *arg, void *context), void *arg,
    int64_t status);

#endif
