/*
 * The libibverbs entry points the verbs provider calls as real functions, loaded once
 * with dlopen so that one build of the provider runs (and reports "no libibverbs") on
 * machines without rdma-core. The data path (ibv_post_send, ibv_post_recv,
 * ibv_post_srq_recv, ibv_poll_cq, ibv_req_notify_cq) is static inline in verbs.h and
 * goes through the device context's ops table, so it needs nothing from here.
 */
#ifndef AFABRIC_VB_LIB_H
#define AFABRIC_VB_LIB_H

#include <stddef.h>
#include <stdint.h>

/* Our own declarations (vb_verbs.h), not rdma-core's: no -dev package needed to build.
 * tests/test_build.py builds the provider both ways and compares the machine code: for that
 * build only it names rdma-core's header in AFABRIC_VB_SYSTEM_VERBS_H (the header itself, as
 * in -DAFABRIC_VB_SYSTEM_VERBS_H='<infiniband/verbs.h>'); no other build includes it. */
#ifdef AFABRIC_VB_SYSTEM_VERBS_H
#include AFABRIC_VB_SYSTEM_VERBS_H
#else
#include "vb_verbs.h"
#endif

struct vb_lib {
    struct ibv_device **(*get_device_list)(int *num);
    void (*free_device_list)(struct ibv_device **list);
    const char *(*get_device_name)(struct ibv_device *dev);
    struct ibv_context *(*open_device)(struct ibv_device *dev);
    int (*close_device)(struct ibv_context *ctx);
    int (*query_device)(struct ibv_context *ctx, struct ibv_device_attr *attr);
    int (*query_port)(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr);
    int (*query_gid)(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid);
    /* optional (rdma-core >= 32): NULL when absent, the GID type then comes from sysfs */
    int (*query_gid_ex)(struct ibv_context *ctx, uint32_t port, uint32_t index,
                        struct ibv_gid_entry *entry, uint32_t flags, size_t entry_size);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *ctx);
    int (*dealloc_pd)(struct ibv_pd *pd);
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *ctx);
    int (*destroy_comp_channel)(struct ibv_comp_channel *ch);
    struct ibv_cq *(*create_cq)(struct ibv_context *ctx, int cqe, void *cq_context,
                                struct ibv_comp_channel *ch, int comp_vector);
    int (*destroy_cq)(struct ibv_cq *cq);
    int (*get_cq_event)(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_context);
    void (*ack_cq_events)(struct ibv_cq *cq, unsigned int n);
    struct ibv_srq *(*create_srq)(struct ibv_pd *pd, struct ibv_srq_init_attr *attr);
    int (*destroy_srq)(struct ibv_srq *srq);
    struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
    int (*query_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask,
                    struct ibv_qp_init_attr *init);
    int (*destroy_qp)(struct ibv_qp *qp);
    struct ibv_ah *(*create_ah)(struct ibv_pd *pd, struct ibv_ah_attr *attr);
    int (*destroy_ah)(struct ibv_ah *ah);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t len, int access);
    /* optional: rdma-core >= 29 (iova2, optional access flags), >= 34 (dma-buf) */
    struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova,
                                   unsigned int access);
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *pd, uint64_t offset, size_t len,
                                    uint64_t iova, int fd, int access);
    int (*dereg_mr)(struct ibv_mr *mr);
    const char *(*wc_status_str)(enum ibv_wc_status status);
    int (*get_async_event)(struct ibv_context *ctx, struct ibv_async_event *event);
    void (*ack_async_event)(struct ibv_async_event *event);
};

/* The process-wide table, loaded on first call (pthread_once). NULL when libibverbs or
 * one of its required symbols is missing; *why then points at a static message. */
__attribute__((visibility("hidden"))) const struct vb_lib *vb_lib_get(const char **why);

#endif
