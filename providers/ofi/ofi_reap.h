/* /dev/shm files of libfabric 1.17 shm endpoints whose process is gone (ofi_reap.c). */
#ifndef OFI_REAP_H
#define OFI_REAP_H

/* Holds a shared lock on `path` for as long as the returned descriptor stays open (the
 * owner's sign of life, for processes whose pid means nothing here); -1 if it cannot. */
__attribute__((visibility("hidden"))) int ofi_reap_hold(const char *path);

/* Removes the region and wake files of endpoints whose process no longer exists. */
__attribute__((visibility("hidden"))) void ofi_reap_dead(void);

#endif
