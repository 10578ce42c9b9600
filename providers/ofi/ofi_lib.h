/*
 * The few libfabric entry points that are real (non-inline) functions, loaded once with
 * dlopen. Everything else in libfabric's API (fi_domain, fi_cq_read, fi_writemsg, ...)
 * is a static inline call through the ops tables of objects that these functions return,
 * so the provider library never links libfabric: the same build works with whichever
 * libfabric the machine has (Debian's, the vendor's under /opt/amazon/efa, a wheel's).
 */
#ifndef AFABRIC_OFI_LIB_H
#define AFABRIC_OFI_LIB_H

#include <stddef.h>
#include <stdint.h>

#include <rdma/fabric.h>

struct ofi_lib {
    int (*getinfo)(uint32_t version, const char *node, const char *service, uint64_t flags,
                   const struct fi_info *hints, struct fi_info **info);
    void (*freeinfo)(struct fi_info *info);
    struct fi_info *(*dupinfo)(const struct fi_info *info); /* dupinfo(NULL) = fi_allocinfo */
    int (*fabric)(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
    const char *(*strerror)(int errnum);
};

/* The process-wide table, loaded on first call (pthread_once). Returns NULL when the
 * library or one of its symbols is missing; *why then points at a static message. */
__attribute__((visibility("hidden"))) const struct ofi_lib *ofi_lib_get(const char **why);

#endif
