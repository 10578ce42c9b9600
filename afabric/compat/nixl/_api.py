"""``nixl._api``: NIXL's Python API (``nixl_agent``) over :mod:`._bindings`.

The agent calls ``_bindings.nixlAgent`` through the module, as upstream's does, so code
(and upstream's tests) that replace that name see the calls.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Sequence
from enum import Enum
from typing import Any

import numpy as np

from . import _bindings
from .logging import get_logger

logger = get_logger(__name__)

DEFAULT_COMM_PORT = _bindings.DEFAULT_COMM_PORT
nixl_backend_handle = int

_MEMS = {
    "DRAM": _bindings.DRAM_SEG,
    "VRAM": _bindings.VRAM_SEG,
    "FILE": _bindings.FILE_SEG,
    "BLOCK": _bindings.BLK_SEG,
    "OBJ": _bindings.OBJ_SEG,
    "cpu": _bindings.DRAM_SEG,  # older names, still accepted
    "cuda": _bindings.VRAM_SEG,
}
_OPS = {"WRITE": _bindings.NIXL_WRITE, "READ": _bindings.NIXL_READ}
_STATES = {_bindings.NIXL_SUCCESS: "DONE", _bindings.NIXL_IN_PROG: "PROC"}


class nixl_thread_sync_t(Enum):
    """The agent's locking mode (kept for compatibility: every mode is thread-safe here)."""

    NIXL_THREAD_SYNC_NONE = _bindings.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = _bindings.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = _bindings.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = _bindings.NIXL_THREAD_SYNC_DEFAULT  # the same value as NONE


class nixl_agent_config:
    """How to make a :class:`nixl_agent`.

    Args:
        enable_prog_thread: accepted (afabric's worker threads always progress transfers).
        enable_listen_thread: open a metadata listener (``send_local_metadata`` /
            ``fetch_remote_metadata`` of other agents reach it).
        listen_port: its port (0: any free port).
        capture_telemetry: record transfer telemetry (``NIXL_TELEMETRY_ENABLE`` overrides).
        num_threads: accepted and passed to the backends as ``num_threads``.
        backends: backends to create: ``"UCX"`` / ``"LIBFABRIC"`` (afabric's transport),
            ``"POSIX"`` (``query_memory`` only).
        sync_mode: a :class:`nixl_thread_sync_t`, or None (STRICT with a listener, else NONE).

    Raises:
        TypeError: ``sync_mode`` is not a ``nixl_thread_sync_t``.
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: Sequence[str] | None = None,
        sync_mode: nixl_thread_sync_t | None = None,
    ) -> None:
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends = list(backends) if backends is not None else ["UCX"]
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (``prep_xfer_dlist``); released by ``release()`` or when collected."""

    __slots__ = ("_agent", "_handle", "_released")

    def __init__(self, agent: Any, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent.releasedDlistH(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self._agent.releasedDlistH(self._handle)
            except Exception:  # noqa: BLE001 - a finalizer must not raise
                logger.debug("releasing prepared list 0x%x at collection failed", self._handle)


class nixl_xfer_handle:
    """A transfer request; released by ``release()`` or when collected (one in flight is
    cancelled: its data may land, its notification is not sent)."""

    __slots__ = ("_agent", "_handle", "_released")

    def __init__(self, agent: Any, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent.releaseXferReq(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self._agent.releaseXferReq(self._handle)
            except Exception:  # noqa: BLE001 - a finalizer must not raise
                logger.debug("releasing transfer 0x%x at collection failed", self._handle)


def _torch_tensor(obj: Any) -> bool:
    """A torch tensor, without importing torch (only code that imported it has tensors)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_row(t: Any) -> tuple[int, int, int, str]:
    """(addr, bytes, device id, mem type) of a contiguous tensor."""
    dev = t.get_device()
    return t.data_ptr(), t.numel() * t.element_size(), max(dev, 0), "DRAM" if dev == -1 else "VRAM"


class nixl_agent:
    """A NIXL agent over afabric.

    Args:
        agent_name: the agent's name (unique among agents that talk to each other).
        nixl_conf: a :class:`nixl_agent_config` (None: the defaults, backend UCX).
        instantiate_all: create every available backend (ignored when ``nixl_conf`` is given).

    Raises:
        ValueError: an empty name.
        nixlBackendError: the afabric endpoint (engine, listener) could not be opened.
    """

    def __init__(
        self, agent_name: str, nixl_conf: nixl_agent_config | None = None, instantiate_all: bool = False
    ) -> None:
        if nixl_conf is not None and instantiate_all:
            logger.warning("instantiate_all is ignored: a config was given")
            instantiate_all = False
        conf = nixl_conf or nixl_agent_config()
        default_sync = (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            if conf.enable_listen
            else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        cfg = _bindings.nixlAgentConfig()
        cfg.useProgThread = conf.enable_pthread
        cfg.useListenThread = conf.enable_listen
        cfg.listenPort = conf.port
        cfg.syncMode = (conf.sync_mode or default_sync).value
        cfg.captureTelemetry = conf.capture_telemetry
        self.agent = _bindings.nixlAgent(agent_name, cfg)
        self.name = agent_name
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list: list[str] = self.agent.getAvailPlugins()
        self.plugin_b_options: dict[str, dict[str, str]] = {}
        self.plugin_mem_types: dict[str, list[str]] = {}
        self.nixl_mems = dict(_MEMS)
        self.nixl_ops = dict(_OPS)
        for name in self.plugin_list if instantiate_all else conf.backends:
            if name not in self.plugin_list:
                logger.warning("Skipping backend %s: no such plugin", name)
                continue
            params = {"num_threads": str(conf.num_threads)} if conf.num_threads > 0 else {}
            self.create_backend(name, params)
        logger.debug("Initialized NIXL agent: %s", agent_name)

    def close(self) -> None:
        """Close the agent's engine and listener now (also done when it is collected)."""
        self.agent.close()

    # ---- plugins and backends ----

    def _plugin(self, name: str) -> bool:
        if name in self.plugin_mem_types:
            return True
        if name not in self.plugin_list:
            return False
        self.plugin_b_options[name], self.plugin_mem_types[name] = self.agent.getPluginParams(name)
        return True

    def get_plugin_list(self) -> list[str]:
        """Backend names this layer knows: UCX, LIBFABRIC, POSIX."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        """Memory types a backend handles ([] for an unknown name)."""
        if not self._plugin(backend):
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        """A backend's parameters and their defaults ({} for an unknown name)."""
        if not self._plugin(backend):
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> list[str]:
        """Memory types a created backend handles ([] if not created)."""
        if backend not in self.backend_mems:
            logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return self.backend_mems.get(backend, [])

    def get_backend_params(self, backend: str) -> dict[str, str]:
        """A created backend's parameters ({} if not created)."""
        if backend not in self.backend_options:
            logger.warning("Backend %s not instantiated to get its parameters.", backend)
        return self.backend_options.get(backend, {})

    def create_backend(self, backend: str, initParams: dict[str, str] | None = None) -> None:
        """Create a backend. Raises nixlNotFoundError for an unknown name."""
        handle = self.agent.createBackend(backend, dict(initParams or {}))
        self.backends[backend] = handle
        self.backend_options[backend], self.backend_mems[backend] = self.agent.getBackendParams(handle)

    def _handles(self, backends: Sequence[str]) -> list[int]:
        return [self.backends[b] for b in backends]

    # ---- memory ----

    def register_memory(
        self, reg_list: Any, mem_type: str | None = None, backends: Sequence[str] = ()
    ) -> Any:
        """Register memory (tensors, (addr, len, dev, meta) tuples with ``mem_type``, an Nx3
        array, or a nixlRegDList); returns the nixlRegDList to deregister it with."""
        descs = self.get_reg_descs(reg_list, mem_type)
        self.agent.registerMem(descs, self._handles(backends))
        return descs

    def deregister_memory(self, dereg_list: Any, backends: Sequence[str] = ()) -> None:
        """Deregister what register_memory returned. Raises nixlNotFoundError for memory not registered."""
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(
        self, reg_list: Any, backend: str, mem_type: str | None = None
    ) -> list[dict[str, str] | None]:
        descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends)}")
        return self.agent.queryMem(descs, self.backends[backend])

    # ---- transfers ----

    def make_connection(self, remote_agent: str, backends: Sequence[str] = ()) -> None:
        """Check the remote agent is known (afabric connects on first use)."""
        self.agent.makeConnection(remote_agent, self._handles(backends))

    def prep_xfer_dlist(
        self, agent_name: str, xfer_list: Any, mem_type: str | None = None, backends: Sequence[str] = ()
    ) -> nixl_prepped_dlist_handle:
        """Prepare a descriptor list: ``""`` / ``"NIXL_INIT_AGENT"`` for the local side, a
        remote agent's name (or this agent's, for loopback) for the remote side."""
        descs = self.get_xfer_descs(xfer_list, mem_type)
        handles = self._handles(backends)
        if agent_name in ("", "NIXL_INIT_AGENT"):
            h = self.agent.prepXferDlist(descs, handles)
        else:
            h = self.agent.prepXferDlist(agent_name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, h)

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Any,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Any,
        notif_msg: bytes = b"",
        backends: Sequence[str] = (),
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A transfer between entries (by index) of two prepared lists. Raises KeyError for an
        operation other than "WRITE" or "READ"."""
        op = self.nixl_ops[operation]
        h = self.agent.makeXferReq(
            op, local_xfer_side._handle, local_indices, remote_xfer_side._handle, remote_indices,
            notif_msg, self._handles(backends), skip_desc_merge,
        )  # fmt: skip
        return nixl_xfer_handle(self.agent, h)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: Sequence[str] = (),
    ) -> nixl_xfer_handle:
        """A transfer between two descriptor lists. Raises KeyError for an operation other
        than "WRITE" or "READ"."""
        op = self.nixl_ops[operation]
        h = self.agent.createXferReq(
            op, local_descs, remote_descs, remote_agent, notif_msg, self._handles(backends)
        )
        return nixl_xfer_handle(self.agent, h)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        """Raises nixlNotSupportedError: afabric's transport does not estimate."""
        duration, margin, method = self.agent.estimateXferCost(req_handle._handle)
        return (
            duration,
            margin,
            "ANALYTICAL_BACKEND" if method == _bindings.NIXL_COST_ANALYTICAL_BACKEND else "UNKNOWN",
        )

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post a transfer (again, once done); "PROC" (in flight) or "DONE"."""
        return _STATES.get(self.agent.postXferReq(handle._handle, notif_msg), "ERR")

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """ "PROC" or "DONE"; a failed transfer raises (nixlRemoteDisconnectError, nixlBackendError)."""
        return _STATES.get(self.agent.getXferStatus(handle._handle), "ERR")

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> Any:
        """A completed transfer's nixlXferTelemetry; nixlNoTelemetryError when telemetry is off."""
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend name a transfer runs on."""
        h = self.agent.queryXferBackend(handle._handle)
        return next(name for name, bh in self.backends.items() if bh == h)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Release a transfer (one in flight is cancelled: no notification)."""
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        """Release a prepared descriptor list."""
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: Sequence[str] | None = None) -> int:
        """Raises nixlNotSupportedError (UCX's GPU device API)."""
        return self.agent.prepMemView(dlist, self._handles(backends or ()))

    def release_mem_view(self, mvh: int) -> None:
        """Raises nixlNotSupportedError (UCX's GPU device API)."""
        self.agent.releaseMemView(mvh)

    # ---- notifications ----

    def get_new_notifs(self, backends: Sequence[str] = ()) -> dict[str, list[bytes]]:
        """Notifications received since the last call: sender name -> messages, oldest first."""
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends: Sequence[str] = ()) -> dict[str, list[bytes]]:
        """Add new notifications to ``self.notifs`` and return it."""
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: str,
        lookup_tag: bytes,
        backends: Sequence[str] = (),
        tag_is_prefix: bool = True,
    ) -> bool:
        """Whether a notification from that agent starting with ``lookup_tag`` (or, with
        ``tag_is_prefix=False``, containing it) arrived; the one found is consumed."""
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        msgs = self.notifs.get(remote_agent_name, [])
        for i, msg in enumerate(msgs):
            if msg.startswith(lookup_tag) if tag_is_prefix else lookup_tag in msg:
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: str | None = None) -> None:
        """Send a notification not tied to a transfer. Raises nixlNotFoundError for an unknown agent."""
        self.agent.genNotif(remote_agent_name, notif_msg, [] if backend is None else [self.backends[backend]])

    # ---- metadata ----

    def get_agent_metadata(self) -> bytes:
        """This agent's metadata, for another agent's add_remote_agent."""
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(
        self, descs: Any, inc_conn_info: bool = False, backends: Sequence[str] = ()
    ) -> bytes:
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load another agent's metadata; returns its name (bytes, as upstream's)."""
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        """Forget a remote agent; its transfers fail with nixlNotFoundError from then on."""
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Push this agent's metadata to the listener at ``ip_addr:port``."""
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(
        self,
        descs: Any,
        inc_conn_info: bool = False,
        backends: Sequence[str] = (),
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        """Push partial metadata (see get_partial_agent_metadata) to the listener at ``ip_addr:port``."""
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr, port, label)

    def fetch_remote_metadata(
        self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        """Fetch the metadata of the agent listening at ``ip_addr:port`` and load it."""
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Tell the agent listening at ``ip_addr:port`` to forget this one."""
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        """Whether the agent's metadata (covering ``descs``, if given) is loaded."""
        if descs is None:
            descs = _bindings.nixlXferDList(_bindings.DRAM_SEG)
        return bool(self.agent.checkRemoteMD(agent, descs) == _bindings.NIXL_SUCCESS)

    # ---- descriptor lists ----

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        """A nixlXferDList from (addr, len, dev) tuples or an Nx3 array (with ``mem_type``),
        a contiguous tensor or a list of them, or a nixlXferDList; None for anything else."""
        return self._descs(descs, mem_type, _bindings.nixlXferDList, 3)

    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        """A nixlRegDList from (addr, len, dev, meta) tuples or an Nx3 array (with
        ``mem_type``), a contiguous tensor or a list of them, or a nixlRegDList; None otherwise."""
        return self._descs(descs, mem_type, _bindings.nixlRegDList, 4)

    def get_remote_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        """A nixlRemoteDList from (addr, len, dev, agent name) tuples with ``mem_type``; None otherwise."""
        if isinstance(descs, _bindings.nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type")
                return None
            if len(descs[0]) != 4:
                logger.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors")
                return None
            return _bindings.nixlRemoteDList(self.nixl_mems[mem_type], list(descs))
        return None

    def _descs(self, descs: Any, mem_type: str | None, cls: Any, width: int) -> Any:
        """A list of class ``cls`` (tuples of ``width``) from any accepted form, or None
        (logged) for a wrong one; an unknown ``mem_type`` raises KeyError."""
        other = _bindings.nixlRegDList if cls is _bindings.nixlXferDList else _bindings.nixlXferDList
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other):
            logger.error("%s given where a %s is needed", type(descs).__name__, cls.__name__)
            return None
        if _torch_tensor(descs):
            return self._tensors([descs], cls, width)
        if isinstance(descs, (list, tuple)) and descs and _torch_tensor(descs[0]):
            return self._tensors(list(descs), cls, width)
        return self._rows(descs, mem_type, cls, width)

    def _rows(self, descs: Any, mem_type: str | None, cls: Any, width: int) -> Any:
        """_descs for tuples or an Nx3 array (they need ``mem_type``)."""
        array = isinstance(descs, np.ndarray)
        rows = array or (isinstance(descs, (list, tuple)) and bool(descs) and isinstance(descs[0], tuple))
        if not rows:
            return None
        if mem_type is None:
            logger.error("Please specify a mem type if not using Tensors")
            return None
        shape_ok = descs.ndim == 2 and descs.shape[1] == 3 if array else len(descs[0]) == width
        if not shape_ok:
            logger.error("a %s needs %s", cls.__name__, "an Nx3 array" if array else f"{width}-tuples")
            return None
        return cls(self.nixl_mems[mem_type], descs if array else list(descs))

    def _tensors(self, tensors: list[Any], cls: Any, width: int) -> Any:
        device = tensors[0].device
        rows = []
        for t in tensors:
            if t.device != device:
                logger.error("tensors on different devices in one descriptor list")
                return None
            if not t.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            rows.append(_tensor_row(t))
        mem = self.nixl_mems[rows[0][3]]
        return cls(mem, [(a, n, d, "")[:width] for a, n, d, _m in rows])

    def get_serialized_descs(self, descs: Any) -> bytes:
        """A descriptor list as bytes (pickle: deserialize only what a trusted peer sent)."""
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        """A descriptor list from get_serialized_descs (pickle: trusted bytes only)."""
        return pickle.loads(serialized_descs)
