/* The allow-list snapshot, private to allow.c (reading it: the worker's and resolving
 * callers' checks) and allow_set.c (making one: afs_allow_peers). See allow.c for what the
 * list can and cannot stop. */
#ifndef AFABRIC_ALLOW_H
#define AFABRIC_ALLOW_H

#include "internal.h"

/* Never a provider's handle, nor a source it reports (AFP_SRC_*). */
#define AFS_NO_HANDLE 0xfffffffffffffffdull

struct afs_allow {
    uint32_t n;
    uint64_t *fi_addr[AFS_ENG_NICS]; /* per NIC: the peers' handles, sorted (AFS_NO_HANDLE:
                                        a peer its transport does not reach) */
    uint8_t **blob;                  /* the addresses as given (matched exactly) */
    uint32_t *blob_len;
    bool accept_unknown; /* AFS_ALLOW_UNKNOWN: deliver what has no known sender */
};

#endif
