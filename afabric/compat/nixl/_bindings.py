"""``nixl._bindings``: the names NIXL's pybind module defines (enums and their values,
status codes, exceptions, descriptor lists, the agent and its config)."""

from __future__ import annotations

from .agent import DEFAULT_COMM_PORT, NIXL_INIT_AGENT, nixlAgent, nixlAgentConfig
from .descs import nixlRegDList, nixlRemoteDList, nixlXferDList
from .enums import nixl_cost_t, nixl_mem_t, nixl_thread_sync_t, nixl_xfer_op_t
from .status import (
    nixl_status_t,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)
from .xfer import nixlXferTelemetry

HAVE_UCX_GPU_DEVICE_API = False
"""No UCX GPU device API here: ``prepMemView`` raises ``nixlNotSupportedError``."""

# the enums' values as module names, as pybind's export_values() gives them
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT
DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG
NIXL_READ = nixl_xfer_op_t.NIXL_READ
NIXL_WRITE = nixl_xfer_op_t.NIXL_WRITE
NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND
NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG
NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED
NIXL_ERR_REMOTE_DISCONNECT = nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT
NIXL_ERR_CANCELED = nixl_status_t.NIXL_ERR_CANCELED
NIXL_ERR_NO_TELEMETRY = nixl_status_t.NIXL_ERR_NO_TELEMETRY

__all__ = [
    "BLK_SEG",
    "DEFAULT_COMM_PORT",
    "DRAM_SEG",
    "FILE_SEG",
    "HAVE_UCX_GPU_DEVICE_API",
    "NIXL_COST_ANALYTICAL_BACKEND",
    "NIXL_ERR_BACKEND",
    "NIXL_ERR_CANCELED",
    "NIXL_ERR_INVALID_PARAM",
    "NIXL_ERR_MISMATCH",
    "NIXL_ERR_NOT_ALLOWED",
    "NIXL_ERR_NOT_FOUND",
    "NIXL_ERR_NOT_POSTED",
    "NIXL_ERR_NOT_SUPPORTED",
    "NIXL_ERR_NO_TELEMETRY",
    "NIXL_ERR_REMOTE_DISCONNECT",
    "NIXL_ERR_REPOST_ACTIVE",
    "NIXL_ERR_UNKNOWN",
    "NIXL_INIT_AGENT",
    "NIXL_IN_PROG",
    "NIXL_READ",
    "NIXL_SUCCESS",
    "NIXL_THREAD_SYNC_DEFAULT",
    "NIXL_THREAD_SYNC_NONE",
    "NIXL_THREAD_SYNC_RW",
    "NIXL_THREAD_SYNC_STRICT",
    "NIXL_WRITE",
    "OBJ_SEG",
    "VRAM_SEG",
    "nixlAgent",
    "nixlAgentConfig",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlInvalidParamError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRegDList",
    "nixlRemoteDList",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlXferDList",
    "nixlXferTelemetry",
    "nixl_cost_t",
    "nixl_mem_t",
    "nixl_status_t",
    "nixl_thread_sync_t",
    "nixl_xfer_op_t",
]
