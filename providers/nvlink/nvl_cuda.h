/*
 * The CUDA driver API as the nvlink provider uses it, loaded at run time (dlopen of
 * libcuda.so.1, entry points through cuGetProcAddress at a fixed API version so that the
 * versioned symbols (_v2, ...) are the ones these prototypes describe). Nothing links CUDA
 * and no CUDA header is needed to build: the few types and constants are declared here,
 * with the values of cuda.h (CUDA 12/13).
 */
#ifndef AFNV_CUDA_H
#define AFNV_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

#define AFNV_IPC_HANDLE_SIZE 64u
typedef struct {
    char reserved[AFNV_IPC_HANDLE_SIZE];
} CUipcMemHandle;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
#define CU_STREAM_NON_BLOCKING 0x1u
#define CU_EVENT_DISABLE_TIMING 0x2u
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1u
#define CU_MEMHOSTALLOC_PORTABLE 0x1u
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_DEVICE 2u
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_PCI_BUS_ID 33
#define CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID 34
#define CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID 50
#define CU_JIT_ERROR_LOG_BUFFER 5
#define CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES 6

/* The driver entry points used, resolved once per process (afnv_cuda_get). */
struct afnv_cuda {
    CUresult (*init)(unsigned flags);
    CUresult (*get_error_string)(CUresult e, const char **s);
    CUresult (*device_get_count)(int *n);
    CUresult (*device_get)(CUdevice *d, int ordinal);
    CUresult (*device_get_attribute)(int *v, int attr, CUdevice d);
    CUresult (*device_can_access_peer)(int *can, CUdevice d, CUdevice peer);
    CUresult (*primary_ctx_retain)(CUcontext *ctx, CUdevice d);
    CUresult (*primary_ctx_release)(CUdevice d);
    CUresult (*ctx_set_current)(CUcontext ctx);
    CUresult (*ctx_enable_peer_access)(CUcontext peer, unsigned flags);
    CUresult (*stream_create)(CUstream *s, unsigned flags);
    CUresult (*stream_destroy)(CUstream s);
    CUresult (*stream_synchronize)(CUstream s);
    CUresult (*event_create)(CUevent *e, unsigned flags);
    CUresult (*event_destroy)(CUevent e);
    CUresult (*event_record)(CUevent e, CUstream s);
    CUresult (*event_query)(CUevent e);
    CUresult (*memcpy_async)(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
    CUresult (*memcpy_htod_async)(CUdeviceptr dst, const void *src, size_t n, CUstream s);
    CUresult (*mem_alloc)(CUdeviceptr *p, size_t n);
    CUresult (*mem_free)(CUdeviceptr p);
    CUresult (*mem_host_alloc)(void **p, size_t n, unsigned flags);
    CUresult (*mem_free_host)(void *p);
    CUresult (*mem_get_address_range)(CUdeviceptr *base, size_t *size, CUdeviceptr p);
    CUresult (*pointer_get_attribute)(void *data, int attr, CUdeviceptr p);
    CUresult (*ipc_get_mem_handle)(CUipcMemHandle *h, CUdeviceptr p);
    CUresult (*ipc_open_mem_handle)(CUdeviceptr *p, CUipcMemHandle h, unsigned flags);
    CUresult (*ipc_close_mem_handle)(CUdeviceptr p);
    CUresult (*module_load_data_ex)(CUmodule *m, const void *image, unsigned n, int *opts,
                                    void **vals);
    CUresult (*module_unload)(CUmodule m);
    CUresult (*module_get_function)(CUfunction *f, CUmodule m, const char *name);
    CUresult (*launch_kernel)(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, unsigned shmem, CUstream s,
                              void **params, void **extra);
};

/* The process-wide table, loaded and cuInit'ed on first call (pthread_once). NULL when
 * libcuda is missing or unusable; *why then says why (a static message). */
__attribute__((visibility("hidden"))) const struct afnv_cuda *afnv_cuda_get(const char **why);

/* "CUDA_ERROR_...: text" of a CUresult, for messages (never NULL). */
__attribute__((visibility("hidden"))) const char *afnv_cuda_errstr(const struct afnv_cuda *cu,
                                                                   CUresult e);

/* A random 64-bit value fixed for the life of this process: tells "the region is ours"
 * apart from "same pid in another PID namespace". */
__attribute__((visibility("hidden"))) uint64_t afnv_process_token(void);

/*
 * CUDA IPC mappings, shared by every domain of the process: the driver maps one exported
 * allocation once per process (a second cuIpcOpenMemHandle of the same handle fails), so
 * two engines of one process writing into the same peer allocation must share it.
 * Reference counted; the table is the only process-wide mutable state besides the
 * function table, guarded by a mutex and used on control paths only (first write to a
 * region, forgetting a peer, closing).
 */
__attribute__((visibility("hidden"))) int afnv_ipc_open(const struct afnv_cuda *cu,
                                                        const CUipcMemHandle *h,
                                                        CUdeviceptr *mapped, CUresult *cerr);
__attribute__((visibility("hidden"))) void afnv_ipc_close(const struct afnv_cuda *cu,
                                                          CUdeviceptr mapped);

#endif
