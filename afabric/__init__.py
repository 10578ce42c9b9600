"""afabric: asyncio-first point-to-point RDMA for LLM systems.

This module only re-exports; nothing runs at import (no library is loaded until the
first engine is created).
"""

from . import errors
from .address import Address
from .descriptor import MrDesc
from .engine import WORKER_STUCK_S, Engine
from .groups import GatherSource, PeerGroup, ScatterTarget
from .hostmem import host_buffer
from .lengths import LengthFrom
from .memory import MemoryRegion
from .messages import TAG_MAX, Message
from .pages import Pages
from .peers import HEARTBEAT_MISSES, PeerEvent
from .provider import ProviderSpec
from .stats import EngineStats, NicStats
from .timing import OpTiming
from .triggers import Trigger, imm_count
from .watcher import UvmWatcher

__version__ = "0.1.0"

__all__ = [
    "HEARTBEAT_MISSES",
    "TAG_MAX",
    "WORKER_STUCK_S",
    "Address",
    "Engine",
    "EngineStats",
    "GatherSource",
    "LengthFrom",
    "MemoryRegion",
    "Message",
    "MrDesc",
    "NicStats",
    "OpTiming",
    "Pages",
    "PeerEvent",
    "PeerGroup",
    "ProviderSpec",
    "ScatterTarget",
    "Trigger",
    "UvmWatcher",
    "__version__",
    "errors",
    "host_buffer",
    "imm_count",
]
