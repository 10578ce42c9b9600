"""NIXL's enumerations: memory types, operations, thread-sync modes, cost methods.

IntEnums, so they compare and hash as the integers upstream's bindings use (``status ==
nixl.NIXL_SUCCESS``, ``agent_config.syncMode == mode.value``).
"""

from __future__ import annotations

from enum import IntEnum


class nixl_mem_t(IntEnum):
    """Where memory lives: host (DRAM), a GPU (VRAM), block, object or file storage."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(IntEnum):
    """A transfer's direction: READ (remote -> local) or WRITE (local -> remote)."""

    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_thread_sync_t(IntEnum):
    """NIXL's locking modes. Accepted and kept; this layer is thread-safe in every mode."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0  # an alias of NONE, as upstream's


class nixl_cost_t(IntEnum):
    """How ``estimateXferCost`` estimated (this layer does not estimate)."""

    NIXL_COST_ANALYTICAL_BACKEND = 0
