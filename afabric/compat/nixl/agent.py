"""``nixlAgent``: NIXL's agent (the object its pybind bindings wrap) over an afabric endpoint.

Backends: ``"UCX"`` and ``"LIBFABRIC"`` are two names for the one afabric transport (the
provider :func:`afabric.compat._core.choose_provider` picks: ``auto``, or
``$AFABRIC_COMPAT_PROVIDER``); agents created with either reach each other. The first one
an agent creates opens its :class:`~afabric.compat._core.Endpoint` (engine, notification
receiver, metadata listener); a second shares it. ``"POSIX"`` answers ``queryMem`` only.
Any other name is ``nixlNotFoundError``.

Every method may be called from any thread. Nothing here runs on the endpoint's loop
thread except the listener handlers, which only queue what they received (a queue drained
by the agent's next call): a handler must never wait for a lock that a caller holds while
it waits for the loop.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ... import Address, errors
from .. import _core
from .descs import _DescList, nixlRegDList, nixlXferDList
from .enums import nixl_mem_t, nixl_thread_sync_t, nixl_xfer_op_t
from .status import fail, nixl_status_t
from .xfer import XferRequest, nixlXferTelemetry

log = logging.getLogger("afabric.compat.nixl")

NIXL_INIT_AGENT = ""
"""The agent name ``prepXferDlist`` takes for the initiator's own (local) side."""
DEFAULT_COMM_PORT = 8888
"""The metadata listener's port unless the config names another (0: any free port)."""
TRANSPORTS = ("UCX", "LIBFABRIC")
"""Backend names that mean afabric's transport."""
STORAGE = ("POSIX",)
"""Backend names served without the transport (``queryMem`` only)."""
DEFAULT_OP_TIMEOUT = 20.0
"""Seconds without progress before a transfer fails (backend parameter ``op_timeout``)."""
_TRUE = {"y", "yes", "on", "1", "true", "enable"}
_FALSE = {"n", "no", "off", "0", "false", "disable"}
_NOTIF_MAGIC = b"NX"
_S = nixl_status_t
_handles = itertools.count(0x10000, 0x10)  # every handle of the process is distinct


class nixlAgentConfig:
    """NIXL's per-agent settings (the bindings' struct, with its positional constructors)."""

    def __init__(
        self,
        useProgThread: bool = False,
        useListenThread: bool = False,
        listenPort: int = DEFAULT_COMM_PORT,
        syncMode: int = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT,
        num_workers: int = 1,
        pthrDelay: int = 0,
        lthrDelay: int = 100000,
        captureTelemetry: bool = False,
        etcdWatchTimeout: int = 5000000,
    ) -> None:
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = syncMode
        self.num_workers = num_workers
        self.pthrDelay = pthrDelay
        self.lthrDelay = lthrDelay
        self.captureTelemetry = captureTelemetry
        self.etcdWatchTimeout = etcdWatchTimeout


@dataclass
class _Backend:
    kind: str  # "UCX", "LIBFABRIC", "POSIX"
    handle: int
    params: dict[str, str]

    @property
    def mems(self) -> list[str]:
        return _plugin_mems(self.kind)


@dataclass
class _Region:
    """One of this agent's registrations, as NIXL described it."""

    mem: int
    dev: int
    length: int
    meta: bytes


@dataclass
class _Remote:
    """A remote agent whose metadata was loaded."""

    info: _core.PeerInfo
    generation: int


@dataclass
class _Prepped:
    """A descriptor list prepared by ``prepXferDlist``: local (agent "") or another agent's."""

    agent: str
    mem: int
    rows: npt.NDArray[np.int64]  # (addr, len, dev) per descriptor


def _plugin_mems(kind: str) -> list[str]:
    return ["FILE_SEG"] if kind in STORAGE else ["DRAM_SEG", "VRAM_SEG"]


def _plugin_params(kind: str) -> dict[str, str]:
    return {} if kind in STORAGE else {"op_timeout": str(DEFAULT_OP_TIMEOUT)}


def _telemetry_wanted(capture: bool) -> bool:
    """NIXL_TELEMETRY_ENABLE decides when set; else the config's captureTelemetry."""
    value = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if value is None:
        return bool(capture)
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() not in _FALSE:
        log.warning("NIXL_TELEMETRY_ENABLE=%r is neither yes nor no: telemetry stays off", value)
    return False


def _bytes_of(msg: Any, what: str) -> bytes:
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise TypeError(f"{what} must be bytes or str, got {type(msg).__name__}")


def _notif_frame(sender: str, msg: bytes) -> bytes:
    name = sender.encode()
    return _NOTIF_MAGIC + len(name).to_bytes(2, "little") + name + msg


def _notif_parse(payload: bytes) -> tuple[str, bytes] | None:
    if len(payload) < 4 or payload[:2] != _NOTIF_MAGIC:
        return None
    n = int.from_bytes(payload[2:4], "little")
    if len(payload) < 4 + n:
        return None
    try:
        return payload[4 : 4 + n].decode(), payload[4 + n :]
    except UnicodeDecodeError:
        return None


def _rows(descs: _DescList) -> npt.NDArray[np.int64]:
    cols = descs.columns()
    if len(cols) and int(cols[:, :2].max()) >= 1 << 63:
        fail(_S.NIXL_ERR_INVALID_PARAM, "an address or length is beyond 2**63")
    return cols.astype(np.int64)


def _indices(value: Any, what: str) -> npt.NDArray[np.int64]:
    """makeXferReq's indices: a list of ints or a 1-D integer numpy array (upstream's
    binding converts any such array to uint32 first)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{what} numpy array must be 1D")
        if value.size and value.dtype.kind not in "iu":
            raise ValueError(f"{what} numpy array must hold integers, not {value.dtype}")
        return value.astype(np.int64)
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            raise TypeError(f"{what} must be integers")
        return np.array(value, dtype=np.int64).reshape(len(value))
    raise TypeError(f"{what} must be a list of ints or a numpy array, got {type(value).__name__}")


def _file_info(path: bytes) -> dict[str, str] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return {
        "size": str(st.st_size),
        "mode": str(st.st_mode),
        "type": "dir" if stat.S_ISDIR(st.st_mode) else "file",
    }


class nixlAgent:
    """A NIXL agent: backends, registered memory, remote agents, transfers, notifications.

    Args:
        name: the agent's name, unique among the agents that talk to each other.
        config: a :class:`nixlAgentConfig`.

    Raises:
        ValueError: the name is empty.
    """

    def __init__(self, name: str, config: nixlAgentConfig) -> None:
        if not isinstance(name, str):
            raise TypeError(f"agent name must be str, got {type(name).__name__}")
        if not name:
            raise ValueError("Agent needs a non-empty name")
        self.name = name
        self.config = config
        self._telemetry = _telemetry_wanted(getattr(config, "captureTelemetry", False))
        self._lock = threading.RLock()
        self._endpoint: _core.Endpoint | None = None
        self._closed = False
        self._op_timeout = DEFAULT_OP_TIMEOUT
        self._backends: dict[str, _Backend] = {}
        self._regions: dict[int, _Region] = {}  # by base address
        self._remotes: dict[str, _Remote] = {}
        self._generations = itertools.count(1)
        self._reqs: dict[int, XferRequest] = {}
        self._dlists: dict[int, _Prepped] = {}
        self._inbox: deque[tuple[str, Any]] = deque()  # from the listener's handlers
        self._notifs_out: list[_core.Transfer] = []

    def __repr__(self) -> str:
        return f"nixlAgent({self.name!r}, backends={list(self._backends)})"

    # ---- lifetime ----

    def close(self) -> None:
        """Close the agent's engine and listener (also done when it is collected)."""
        with self._lock:
            ep, self._endpoint = self._endpoint, None
            self._closed = True
        if ep is not None:
            ep.close()

    def _ep(self) -> _core.Endpoint:
        ep = self._endpoint
        if ep is None:
            why = "is closed" if self._closed else "has no UCX/LIBFABRIC backend"
            fail(_S.NIXL_ERR_BACKEND, f"agent {self.name} {why}")
        return ep

    # ---- plugins and backends ----

    def getAvailPlugins(self) -> list[str]:
        return [*TRANSPORTS, *STORAGE]

    def getPluginParams(self, type: str) -> tuple[dict[str, str], list[str]]:
        if type not in (*TRANSPORTS, *STORAGE):
            fail(_S.NIXL_ERR_NOT_FOUND, f"backend {type!r} not found")
        return _plugin_params(type), _plugin_mems(type)

    def getBackendParams(self, backend: int) -> tuple[dict[str, str], list[str]]:
        b = self._backend(backend)
        return dict(b.params), b.mems

    def _backend(self, handle: Any) -> _Backend:
        for b in self._backends.values():
            if b.handle == handle:
                return b
        fail(_S.NIXL_ERR_INVALID_PARAM, f"{handle!r} is not a backend of agent {self.name}")

    def _transport(self, backends: Sequence[int]) -> _Backend:
        """The transport backend a call runs on (the first given, or the agent's)."""
        for h in backends:
            b = self._backend(h)
            if b.kind in TRANSPORTS:
                return b
        if backends:
            fail(_S.NIXL_ERR_NOT_SUPPORTED, "none of the given backends is a UCX/LIBFABRIC transport")
        for b in self._backends.values():
            if b.kind in TRANSPORTS:
                return b
        fail(_S.NIXL_ERR_NOT_FOUND, f"agent {self.name} has no UCX/LIBFABRIC backend")

    def createBackend(self, type: str, initParams: dict[str, str]) -> int:
        """Create a backend; returns its handle.

        Raises:
            nixlNotFoundError: an unknown backend name.
            nixlInvalidParamError: this agent has that backend already, or a bad parameter.
            nixlBackendError: the afabric engine or the listener could not be opened.
        """
        with self._lock:
            if type in self._backends:
                fail(_S.NIXL_ERR_INVALID_PARAM, f"backend already created for type {type!r}")
            if type not in (*TRANSPORTS, *STORAGE):
                fail(_S.NIXL_ERR_NOT_FOUND, f"unsupported backend {type!r}")
            params = {**_plugin_params(type), **{str(k): str(v) for k, v in (initParams or {}).items()}}
            if self._closed:
                fail(_S.NIXL_ERR_BACKEND, f"agent {self.name} is closed")
            if type in TRANSPORTS and self._endpoint is None:
                self._open(params)
            b = _Backend(type, next(_handles), params)
            self._backends[type] = b
            self._publish()
            return b.handle

    def _open(self, params: dict[str, str]) -> None:
        try:
            self._op_timeout = float(params.get("op_timeout", DEFAULT_OP_TIMEOUT))
        except ValueError:
            fail(_S.NIXL_ERR_INVALID_PARAM, f"op_timeout={params['op_timeout']!r} is not a number")
        if not 0 <= self._op_timeout < 1e9:
            fail(_S.NIXL_ERR_INVALID_PARAM, f"op_timeout={self._op_timeout} is not >= 0")
        listen = None
        if getattr(self.config, "useListenThread", False):
            listen = ("0.0.0.0", int(getattr(self.config, "listenPort", DEFAULT_COMM_PORT)))
        try:
            ep = _core.Endpoint(
                self.name, _core.choose_provider(), op_timeout=self._op_timeout, listen=listen
            )
        except (errors.AfabricError, OSError) as e:
            fail(_S.NIXL_ERR_BACKEND, f"cannot open agent {self.name}'s afabric endpoint: {e}")
        ep.serve("nixl_load", self._on_load)
        ep.serve("nixl_invalidate", self._on_invalidate)
        self._endpoint = ep

    # ---- memory ----

    def registerMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> nixl_status_t:
        """Register every descriptor's memory with the transport.

        Raises:
            nixlNotFoundError: no backend of this agent handles this memory type.
            nixlInvalidParamError: a descriptor overlaps one registered already, or is empty.
            nixlBackendError: the provider cannot register it (e.g. GPU memory on tcp).
        """
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"registerMem takes a nixlRegDList, got {type(descs).__name__}")
        mem = descs.getType()
        with self._lock:
            if mem not in (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG):
                if any(b.kind in STORAGE for b in self._backends.values()):
                    fail(
                        _S.NIXL_ERR_NOT_SUPPORTED,
                        f"{mem.name} memory: the POSIX backend here answers queryMem only",
                    )
                fail(_S.NIXL_ERR_NOT_FOUND, f"no available backends for mem type {mem.name}")
            self._transport(backends)
            ep = self._ep()
            done: list[int] = []
            try:
                for (addr, length, dev), meta in zip(descs.columns().tolist(), descs.extras(), strict=True):
                    ep.register(addr, length, dev if mem == nixl_mem_t.VRAM_SEG else -1)
                    done.append(addr)
                    self._regions[addr] = _Region(int(mem), dev, length, meta)
            except (errors.AfabricError, _core.CompatError) as e:
                for addr in done:
                    self._regions.pop(addr, None)
                    ep.deregister(addr)
                self._publish()
                if isinstance(e, (errors.InvalidArgument, _core.AddressOverlap)):
                    fail(_S.NIXL_ERR_INVALID_PARAM, str(e))
                fail(_S.NIXL_ERR_BACKEND, str(e))
            self._publish()
            return _S.NIXL_SUCCESS

    def deregisterMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> nixl_status_t:
        """Deregister memory registered with these descriptors.

        Raises:
            nixlNotFoundError: a descriptor matches no registration (the others are deregistered).
        """
        if not isinstance(descs, nixlRegDList):
            raise TypeError(f"deregisterMem takes a nixlRegDList, got {type(descs).__name__}")
        with self._lock:
            ep = self._ep()
            missing = []
            for addr, length, _dev in descs.columns().tolist():
                r = self._regions.get(addr)
                if r is None or r.length != length:
                    missing.append(addr)
                    continue
                del self._regions[addr]
                try:
                    ep.deregister(addr)
                except (errors.AfabricError, _core.CompatError) as e:
                    log.warning("agent %s: deregistering 0x%x: %s", self.name, addr, e)
            self._publish()
            if missing:
                fail(
                    _S.NIXL_ERR_NOT_FOUND,
                    f"{len(missing)} descriptors match no registration (first 0x{missing[0]:x})",
                )
            return _S.NIXL_SUCCESS

    def queryMem(self, descs: nixlRegDList, backend: int) -> list[dict[str, str] | None]:
        """File information for FILE_SEG descriptors (their meta info is the path): the POSIX
        backend's answer, a dict with ``size`` and ``mode``, or None where the file is missing.

        Raises:
            nixlNotSupportedError: the backend is a transport (it has nothing to query).
        """
        b = self._backend(backend)
        if b.kind not in STORAGE:
            fail(_S.NIXL_ERR_NOT_SUPPORTED, f"backend {b.kind} has no queryMem")
        return [_file_info(meta) for meta in descs.extras()]

    def _publish(self) -> None:
        """What peers learn of this agent beyond the core's fields: its NIXL backends and
        each region's memory type and device."""
        ep = self._endpoint
        if ep is None:
            return
        regions = [[base, r.mem, r.dev] for base, r in sorted(self._regions.items())]
        ep.set_extra({"nixl": {"backends": sorted(self._backends), "regions": regions}})
        ep.add_peer(self.name, ep.info())  # loopback transfers: this agent as its own peer

    # ---- metadata ----

    def getLocalMD(self) -> bytes:
        """This agent's metadata: what ``loadRemoteMD`` of another agent takes.

        Raises:
            nixlInvalidParamError: the agent has no transport backend.
        """
        with self._lock:
            if self._endpoint is None:
                fail(_S.NIXL_ERR_INVALID_PARAM, "no backends support remote operations")
            return self._endpoint.info().to_bytes()

    def getLocalPartialMD(
        self, descs: nixlRegDList, inc_conn_info: bool = False, backends: Sequence[int] = ()
    ) -> bytes:
        """Metadata naming only the registrations holding ``descs`` (none: connection only).

        Raises:
            nixlNotFoundError: a descriptor is inside no registration.
        """
        with self._lock:
            if self._endpoint is None:
                fail(_S.NIXL_ERR_INVALID_PARAM, "no backends support remote operations")
            info = self._endpoint.info()
            wanted: dict[int, _core.Segment] = {}
            table = _core.RegionTable(info.segments)
            for addr, length, _dev in descs.columns().tolist():
                found = table.find(addr, length)
                if found is None:
                    fail(_S.NIXL_ERR_NOT_FOUND, f"descriptor 0x{addr:x}+{length} is not registered")
                wanted[found[0].base] = found[0]
            nixl = dict(info.extra.get("nixl", {}))
            nixl["regions"] = [r for r in nixl.get("regions", []) if r[0] in wanted]
            nixl["partial"] = True
            part = _core.PeerInfo(
                info.name, info.address, tuple(wanted.values()), info.listener, info.provider, {"nixl": nixl}
            )
            return part.to_bytes()

    def loadRemoteMD(self, remote_metadata: bytes) -> bytes:
        """Load another agent's metadata (full or partial); returns its name.

        Raises:
            nixlMismatchError: not metadata.
            nixlInvalidParamError: it is this agent's own.
            nixlBackendError: this agent has no transport, or the other uses another provider.
            nixlNotAllowedError: an agent of that name is loaded with another address.
        """
        try:
            info = _core.PeerInfo.from_bytes(_bytes_of(remote_metadata, "metadata"))
        except _core.MetadataError as e:
            fail(_S.NIXL_ERR_MISMATCH, f"failed to deserialize remote metadata: {e}")
        self._drain()
        with self._lock:
            return self._load(info).encode()

    def _load(self, info: _core.PeerInfo) -> str:
        name = info.name
        if not name:
            fail(_S.NIXL_ERR_MISMATCH, "metadata without an agent name")
        if name == self.name:
            fail(_S.NIXL_ERR_INVALID_PARAM, "remote agent name same as local agent")
        ep = self._ep()
        try:
            theirs = Address.from_bytes(info.address).transports
        except errors.AfabricError as e:
            fail(_S.NIXL_ERR_MISMATCH, f"metadata of {name} has a bad address: {e}")
        if not set(theirs) & set(ep.transports):
            fail(
                _S.NIXL_ERR_BACKEND,
                f"no common backend: agent {name} has afabric transports {', '.join(theirs)}, "
                f"this one {', '.join(ep.transports)}",
            )
        nixl = info.extra.get("nixl") if isinstance(info.extra, dict) else None
        if not isinstance(nixl, dict) or not _regions_ok(nixl.get("regions")):
            fail(_S.NIXL_ERR_MISMATCH, f"metadata of {name} is not a NIXL agent's")
        old = self._remotes.get(name)
        if old is not None and old.info.address != info.address:
            fail(_S.NIXL_ERR_NOT_ALLOWED, f"agent {name} is loaded already with another address")
        if old is not None and nixl.get("partial"):
            info = _merge(old.info, info)
        try:
            if old is None:
                ep.add_peer(name, info)
            else:
                ep.update_peer(name, info)
        except (errors.AfabricError, _core.CompatError) as e:
            fail(_S.NIXL_ERR_MISMATCH, f"metadata of {name}: {e}")
        self._remotes[name] = _Remote(info, old.generation if old is not None else next(self._generations))
        return name

    def invalidateRemoteMD(self, remote_agent: str) -> nixl_status_t:
        """Forget a remote agent (returns a status, as upstream's does, rather than raising)."""
        if remote_agent == self.name:
            return _S.NIXL_ERR_INVALID_PARAM
        self._drain()
        with self._lock:
            return self._forget(remote_agent)

    def _forget(self, name: str) -> nixl_status_t:
        if self._remotes.pop(name, None) is None:
            return _S.NIXL_ERR_NOT_FOUND
        if self._endpoint is not None:
            self._endpoint.remove_peer(name)
        return _S.NIXL_SUCCESS

    def checkRemoteMD(self, remote_name: str, descs: nixlXferDList) -> nixl_status_t:
        """SUCCESS once the agent's metadata (covering ``descs``, if any) is loaded."""
        self._drain()
        with self._lock:
            remote = self._remotes.get(remote_name)
            if remote is None:
                return _S.NIXL_ERR_NOT_FOUND
            if descs.isEmpty():
                return _S.NIXL_SUCCESS
            ok = self._inside(remote.info, int(descs.getType()), _rows(descs)) is None
            return _S.NIXL_SUCCESS if ok else _S.NIXL_ERR_NOT_FOUND

    def sendLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        """Send this agent's metadata to the listener at ``ip_addr:port``.

        Raises:
            nixlNotSupportedError: no address (there is no central metadata server here).
            nixlBackendError: the listener could not be reached or refused it.
        """
        self._send_md(self.getLocalMD(), ip_addr, port)

    def sendLocalPartialMD(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool = False,
        backends: Sequence[int] = (),
        ip_addr: str = "",
        port: int = 0,
        label: str = "",
    ) -> None:
        self._send_md(self.getLocalPartialMD(descs, inc_conn_info, backends), ip_addr, port)

    def _send_md(self, blob: bytes, ip_addr: str, port: int) -> None:
        if not ip_addr:
            fail(_S.NIXL_ERR_NOT_SUPPORTED, "no central metadata server: give the peer's ip_addr and port")
        try:
            _core.request(ip_addr, port or DEFAULT_COMM_PORT, {"op": "nixl_load", "md": blob.hex()})
        except _core.MetadataError as e:
            fail(_S.NIXL_ERR_BACKEND, f"sending metadata to {ip_addr}:{port}: {e}")

    def fetchRemoteMD(self, remote_agent: str, ip_addr: str = "", port: int = 0, label: str = "") -> None:
        """Ask the listener at ``ip_addr:port`` for its agent's metadata and load it.

        Raises:
            nixlNotSupportedError: no address (there is no central metadata server here).
            nixlNotFoundError: the listener could not be reached, or serves another agent.
        """
        if not ip_addr:
            fail(_S.NIXL_ERR_NOT_SUPPORTED, "no central metadata server: give the peer's ip_addr and port")
        try:
            info = _core.PeerInfo.from_json(
                _core.request(ip_addr, port or DEFAULT_COMM_PORT, {"op": "metadata"})
            )
        except _core.MetadataError as e:
            fail(_S.NIXL_ERR_NOT_FOUND, f"fetching {remote_agent}'s metadata from {ip_addr}:{port}: {e}")
        if info.name != remote_agent:
            fail(_S.NIXL_ERR_NOT_FOUND, f"{ip_addr}:{port} serves agent {info.name!r}, not {remote_agent!r}")
        self._drain()
        with self._lock:
            self._load(info)

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        """Tell the listener at ``ip_addr:port`` that its agent should forget this one.

        Raises:
            nixlNotSupportedError: no address.
            nixlBackendError: the listener could not be reached.
        """
        if not ip_addr:
            fail(_S.NIXL_ERR_NOT_SUPPORTED, "no central metadata server: give the peer's ip_addr and port")
        try:
            _core.request(ip_addr, port or DEFAULT_COMM_PORT, {"op": "nixl_invalidate", "name": self.name})
        except _core.MetadataError as e:
            fail(_S.NIXL_ERR_BACKEND, f"invalidating at {ip_addr}:{port}: {e}")

    # Listener handlers: run on the loop thread, so they only queue (see the module's docstring).

    def _on_load(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            info = _core.PeerInfo.from_bytes(bytes.fromhex(req["md"]))
        except (KeyError, TypeError, ValueError, _core.MetadataError) as e:
            return {"error": f"malformed metadata: {e}"}
        self._inbox.append(("load", info))
        return {"ok": True}

    def _on_invalidate(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req.get("name")
        if not isinstance(name, str):
            return {"error": "no agent name"}
        self._inbox.append(("invalidate", name))
        return {"ok": True}

    def _drain(self) -> None:
        """Apply what the listener received since the last call."""
        while self._inbox:
            try:
                what, value = self._inbox.popleft()
            except IndexError:
                return
            with self._lock:
                try:
                    if what == "load":
                        self._load(value)
                    else:
                        self._forget(value)
                except RuntimeError as e:  # a nixl error: the sender's metadata is not loadable
                    log.warning("agent %s: metadata from the listener not loaded: %s", self.name, e)

    def makeConnection(self, remote_agent: str, backends: Sequence[int] = ()) -> nixl_status_t:
        """Check that the remote agent is known (afabric connects on first use).

        Raises:
            nixlNotFoundError: its metadata is not loaded.
        """
        self._drain()
        with self._lock:
            if remote_agent not in self._remotes:
                fail(_S.NIXL_ERR_NOT_FOUND, f"metadata for remote agent {remote_agent!r} not found")
            return _S.NIXL_SUCCESS

    # ---- descriptor checks ----

    def _side(self, agent: str) -> _core.PeerInfo:
        """The published info of this agent (loopback) or of a loaded remote one."""
        if agent == self.name:
            return self._ep().info()
        remote = self._remotes.get(agent)
        if remote is None:
            fail(_S.NIXL_ERR_NOT_FOUND, f"metadata for remote agent {agent!r} not found")
        return remote.info

    @staticmethod
    def _inside(info: _core.PeerInfo, mem: int, rows: npt.NDArray[np.int64]) -> str | None:
        """None if every (addr, len, dev) row lies in one region of ``info`` registered with
        this memory type and device; else why not."""
        if not len(rows):
            return None
        table = _core.RegionTable(info.segments)
        idx, _off, ok = table.find_many(rows[:, 0], rows[:, 1])
        kinds = {r[0]: (r[1], r[2]) for r in info.extra.get("nixl", {}).get("regions", [])}
        seg_mem = np.array([kinds.get(s.base, (-1, -1))[0] for s in table.segments] or [-1], dtype=np.int64)
        seg_dev = np.array([kinds.get(s.base, (-1, -1))[1] for s in table.segments] or [-1], dtype=np.int64)
        ok &= (seg_mem[idx] == mem) & (seg_dev[idx] == rows[:, 2])
        if ok.all():
            return None
        k = int(np.argmin(ok))
        addr, length, dev = (int(v) for v in rows[k])
        kind = nixl_mem_t(mem).name
        where = f"descriptor {k} (0x{addr:x}+{length}, dev {dev})"
        return f"{where} is inside no {kind} registration of {info.name}"

    def _local_info(self) -> _core.PeerInfo:
        return self._ep().info()

    # ---- transfers ----

    def prepXferDlist(self, *args: Any, **kwargs: Any) -> int:
        """``prepXferDlist([agent_name,] descs, backends=[])``: check a descriptor list
        against the local registrations (agent ``""``) or another agent's (or this agent's own
        name: loopback) and keep it for ``makeXferReq``; returns its handle.

        Raises:
            nixlNotFoundError: an unknown agent, or a descriptor inside no registration.
        """
        agent, descs, backends = _prep_args(args, kwargs)
        self._drain()
        with self._lock:
            self._transport(backends)
            rows = _rows(descs)
            info = self._local_info() if agent == NIXL_INIT_AGENT else self._side(agent)
            why = self._inside(info, int(descs.getType()), rows)
            if why is not None:
                fail(_S.NIXL_ERR_NOT_FOUND, why)
            h = next(_handles)
            self._dlists[h] = _Prepped(agent, int(descs.getType()), rows.copy())
            return h

    def releasedDlistH(self, handle: int) -> nixl_status_t:
        with self._lock:
            if self._dlists.pop(handle, None) is None:
                fail(_S.NIXL_ERR_INVALID_PARAM, f"{handle!r} is not a prepared list of agent {self.name}")
            return _S.NIXL_SUCCESS

    def makeXferReq(
        self,
        operation: int,
        local_side: int,
        local_indices: Any,
        remote_side: int,
        remote_indices: Any,
        notif_msg: Any = b"",
        backend: Sequence[int] = (),
        skip_desc_merg: bool = False,
    ) -> int:
        """A transfer between entries of two prepared lists, chosen by index; returns its handle.

        Raises:
            nixlInvalidParamError: unknown handles, sides swapped, index counts that differ or
                are zero, an index out of range, or lengths that differ.
            nixlNotFoundError: the remote agent was removed since.
        """
        op = _op(operation)
        li, ri = _indices(local_indices, "local indices"), _indices(remote_indices, "remote indices")
        notif = _bytes_of(notif_msg, "notif_msg")
        self._drain()
        with self._lock:
            loc, rem = self._dlists.get(local_side), self._dlists.get(remote_side)
            if loc is None or rem is None:
                fail(_S.NIXL_ERR_INVALID_PARAM, "local or remote side handle is unknown")
            if loc.agent != NIXL_INIT_AGENT or rem.agent == NIXL_INIT_AGENT:
                fail(_S.NIXL_ERR_INVALID_PARAM, "invalid sides (local must be local, remote must be remote)")
            if not len(li) or len(li) != len(ri):
                fail(
                    _S.NIXL_ERR_INVALID_PARAM,
                    f"different number of indices for local ({len(li)}), remote ({len(ri)})",
                )
            for idx, side, what in ((li, loc, "local"), (ri, rem, "remote")):
                bad = np.flatnonzero((idx < 0) | (idx >= len(side.rows)))
                if len(bad):
                    fail(
                        _S.NIXL_ERR_INVALID_PARAM,
                        f"{what} index out of range at {int(bad[0])}: {int(idx[bad[0]])}",
                    )
            lrows, rrows = loc.rows[li], rem.rows[ri]
            self._check_lengths(lrows, rrows)
            return self._make(op, rem.agent, lrows, rrows, notif, self._transport(backend))

    def createXferReq(
        self,
        operation: int,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg: Any = b"",
        backend: Sequence[int] = (),
    ) -> int:
        """A transfer between two descriptor lists (pair i: local i, remote i); returns its handle.

        Raises:
            nixlInvalidParamError: lists of different sizes, or pairs of different lengths.
            nixlNotFoundError: an unknown remote agent, or a descriptor inside no registration.
        """
        op = _op(operation)
        if not isinstance(local_descs, nixlXferDList) or not isinstance(remote_descs, nixlXferDList):
            raise TypeError("createXferReq takes two nixlXferDList")
        notif = _bytes_of(notif_msg, "notif_msg")
        if local_descs.descCount() != remote_descs.descCount():
            fail(
                _S.NIXL_ERR_INVALID_PARAM,
                f"different descriptor list sizes (local={local_descs.descCount()}, "
                f"remote={remote_descs.descCount()})",
            )
        lrows, rrows = _rows(local_descs), _rows(remote_descs)
        self._check_lengths(lrows, rrows)
        self._drain()
        with self._lock:
            b = self._transport(backend)
            info = self._side(remote_agent)
            for side, mem, rows in (
                (self._local_info(), local_descs.getType(), lrows),
                (info, remote_descs.getType(), rrows),
            ):
                why = self._inside(side, int(mem), rows)
                if why is not None:
                    fail(_S.NIXL_ERR_NOT_FOUND, why)
            return self._make(op, remote_agent, lrows, rrows, notif, b)

    @staticmethod
    def _check_lengths(lrows: npt.NDArray[np.int64], rrows: npt.NDArray[np.int64]) -> None:
        bad = np.flatnonzero(lrows[:, 1] != rrows[:, 1])
        if len(bad):
            fail(_S.NIXL_ERR_INVALID_PARAM, f"length mismatch at index {int(bad[0])}")

    def _make(
        self, op: nixl_xfer_op_t, remote: str, lrows: npt.NDArray[np.int64], rrows: npt.NDArray[np.int64],
        notif: bytes, backend: _Backend,
    ) -> int:  # fmt: skip
        gen = 0 if remote == self.name else self._remotes[remote].generation
        req = XferRequest(
            op, remote, gen, np.ascontiguousarray(lrows[:, 0]), np.ascontiguousarray(rrows[:, 0]),
            np.ascontiguousarray(lrows[:, 1]), notif or None, backend.handle,
        )  # fmt: skip
        h = next(_handles)
        self._reqs[h] = req
        return h

    def _req(self, handle: Any) -> XferRequest:
        req = self._reqs.get(handle)
        if req is None:
            fail(_S.NIXL_ERR_INVALID_PARAM, f"{handle!r} is not a transfer request of agent {self.name}")
        return req

    def postXferReq(self, reqh: int, notif_msg: Any = b"") -> nixl_status_t:
        """Post (or repost) a transfer; returns NIXL_IN_PROG, or NIXL_SUCCESS if it is done already.

        A non-empty ``notif_msg`` replaces the request's notification from now on.

        Raises:
            nixlRepostActiveError: the request is still in progress.
            nixlNotFoundError: the remote agent was removed or reloaded since the request was
                made, or its memory is no longer registered.
            nixlBackendError: the transport refused it (e.g. the agent is closed).
        """
        notif = _bytes_of(notif_msg, "notif_msg")
        self._drain()
        with self._lock:
            req = self._req(reqh)
            remote = self._remotes.get(req.remote)
            if req.remote != self.name and (remote is None or remote.generation != req.generation):
                fail(
                    _S.NIXL_ERR_NOT_FOUND,
                    f"remote agent {req.remote!r} was invalidated after the request was made",
                )
            if req.active():
                fail(
                    _S.NIXL_ERR_REPOST_ACTIVE, "transfer request is still in progress and cannot be reposted"
                )
            if notif:
                req.notif = notif
            ep = self._ep()
            self._prune_notifs()
        req.begin()
        try:
            transfer = ep.start(
                req.kind,
                req.remote,
                req.local_addrs,
                req.remote_addrs,
                req.lengths,
                notify=_notif_frame(self.name, req.notif) if req.notif is not None else None,
            )
        except (_core.UnknownAddress, _core.UnknownPeer) as e:
            req.failed(_S.NIXL_ERR_NOT_FOUND, e)
            fail(_S.NIXL_ERR_NOT_FOUND, str(e))
        except errors.AfabricError as e:
            req.failed(_S.NIXL_ERR_BACKEND, e)
            fail(_S.NIXL_ERR_BACKEND, str(e))
        req.posted(transfer)
        return req.status

    def getXferStatus(self, reqh: int) -> nixl_status_t:
        """NIXL_IN_PROG or NIXL_SUCCESS.

        Raises:
            nixlNotPostedError: never posted.
            nixlRemoteDisconnectError: the remote agent's process or engine went away, or
                nothing progressed for ``op_timeout`` seconds (the remote agent is forgotten).
            nixlBackendError: the transport failed otherwise (afabric's error text follows).
            nixlCancelledError: it was cancelled.
        """
        with self._lock:
            req = self._req(reqh)
            status = req.refresh()
        if status < 0:
            if status == _S.NIXL_ERR_REMOTE_DISCONNECT and req.remote != self.name:
                with self._lock:
                    remote = self._remotes.get(req.remote)
                    if remote is not None and remote.generation == req.generation:
                        self._forget(req.remote)
            why = f": {type(req.error).__name__}: {req.error}" if req.error is not None else ""
            fail(status, f"transfer to {req.remote}{why}")
        return status

    def getXferTelemetry(self, reqh: int) -> nixlXferTelemetry:
        """Times and sizes of a completed transfer.

        Raises:
            nixlNoTelemetryError: telemetry is off (NIXL_TELEMETRY_ENABLE, captureTelemetry).
            nixlNotPostedError / another error: the transfer did not complete.
        """
        if not self._telemetry:
            fail(_S.NIXL_ERR_NO_TELEMETRY, "cannot return values when telemetry is not enabled")
        req = self._req(reqh)
        if req.status < 0:
            fail(req.status, "transfer is not complete")
        return req.telemetry()

    def queryXferBackend(self, reqh: int) -> int:
        return self._req(reqh).backend

    def estimateXferCost(self, req_handle: int) -> tuple[int, int, int]:
        self._req(req_handle)
        fail(_S.NIXL_ERR_NOT_SUPPORTED, "afabric's transport does not estimate transfer costs")

    def releaseXferReq(self, reqh: int) -> nixl_status_t:
        """Forget a request. One still in flight is cancelled: its operations complete (the
        engine cannot recall them) but its notification is not sent."""
        with self._lock:
            req = self._req(reqh)
            if req.active():
                req.cancel()
            del self._reqs[reqh]
            return _S.NIXL_SUCCESS

    # ---- notifications ----

    def getNotifs(
        self, notif_map: dict[str, list[bytes]], backends: Sequence[int] = ()
    ) -> dict[str, list[bytes]]:
        """Add the notifications received since the last call to ``notif_map`` (sender name ->
        messages, oldest first) and return it.

        Raises:
            nixlBackendError: the agent has no transport backend.
        """
        self._drain()
        ep = self._endpoint
        if ep is None:
            fail(_S.NIXL_ERR_BACKEND, "no backends support notifications")
        for note in ep.take_notifications():
            parsed = _notif_parse(note.payload)
            if parsed is None:
                log.warning("agent %s: a malformed notification was dropped", self.name)
                continue
            notif_map.setdefault(parsed[0], []).append(parsed[1])
        return notif_map

    def genNotif(self, remote_agent: str, msg: Any, backends: Sequence[int] = ()) -> nixl_status_t:
        """Send a notification not tied to a transfer.

        Raises:
            nixlNotFoundError: the remote agent is not known.
            nixlBackendError: the agent has no transport backend.
        """
        payload = _bytes_of(msg, "msg")
        self._drain()
        with self._lock:
            self._transport(backends)
            if remote_agent != self.name and remote_agent not in self._remotes:
                fail(_S.NIXL_ERR_NOT_FOUND, f"no backend could send notifications to agent {remote_agent!r}")
            ep = self._ep()
            self._prune_notifs()
        try:
            t = ep.notify(remote_agent, _notif_frame(self.name, payload))
        except (_core.CompatError, errors.AfabricError) as e:
            fail(_S.NIXL_ERR_BACKEND, str(e))
        with self._lock:
            self._notifs_out.append(t)
        return _S.NIXL_SUCCESS

    def _prune_notifs(self) -> None:
        """Drop sent notifications, saying which failed (genNotif does not wait for them)."""
        keep = []
        for t in self._notifs_out:
            if not t.done():
                keep.append(t)
            elif t.error is not None:
                log.warning("agent %s: a notification was not delivered: %s", self.name, t.error)
        self._notifs_out = keep

    # ---- GPU memory views ----

    def prepMemView(self, dlist: Any, backends: Sequence[int] = ()) -> int:
        fail(_S.NIXL_ERR_NOT_SUPPORTED, "memory views need UCX's GPU device API")

    def releaseMemView(self, mvh: int) -> None:
        fail(_S.NIXL_ERR_NOT_SUPPORTED, "memory views need UCX's GPU device API")

    # ---- for tests and benchmarks ----

    def operations_posted(self) -> int:
        """afabric operations this agent posted for transfers (0 before its first backend)."""
        ep = self._endpoint
        return ep.operations if ep is not None else 0


def _op(value: Any) -> nixl_xfer_op_t:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"operation must be a nixl_xfer_op_t, got {type(value).__name__}")
    try:
        return nixl_xfer_op_t(int(value))
    except ValueError:
        fail(_S.NIXL_ERR_INVALID_PARAM, f"unknown operation {int(value)}")


def _prep_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, nixlXferDList, list[int]]:
    """prepXferDlist's two overloads: (agent_name, descs, backend=[]) and (descs, backend=[])."""
    agent = kwargs.pop("agent_name", None)
    rest = list(args)
    if agent is None and rest and isinstance(rest[0], str):
        agent = rest.pop(0)
    descs = kwargs.pop("descs", None)
    if descs is None and rest:
        descs = rest.pop(0)
    backends = kwargs.pop("backend", kwargs.pop("backends", None))
    if backends is None:
        backends = rest.pop(0) if rest else []
    if rest or kwargs:
        raise TypeError("prepXferDlist takes (agent_name, descs, backend=[]) or (descs, backend=[])")
    if not isinstance(descs, nixlXferDList):
        raise TypeError(f"prepXferDlist takes a nixlXferDList, got {type(descs).__name__}")
    return agent or NIXL_INIT_AGENT, descs, list(backends)


def _regions_ok(regions: Any) -> bool:
    """A peer's published regions: a list of [base, mem type, device] ints."""
    return isinstance(regions, list) and all(
        isinstance(r, list) and len(r) == 3 and all(type(v) is int for v in r) for r in regions
    )


def _merge(old: _core.PeerInfo, new: _core.PeerInfo) -> _core.PeerInfo:
    """Partial metadata adds to what was loaded of an agent (new regions win)."""
    segs = {s.base: s for s in old.segments}
    segs.update({s.base: s for s in new.segments})
    regions = {r[0]: r for r in old.extra.get("nixl", {}).get("regions", [])}
    regions.update({r[0]: r for r in new.extra.get("nixl", {}).get("regions", [])})
    nixl = {**old.extra.get("nixl", {}), "regions": list(regions.values())}
    return _core.PeerInfo(
        new.name,
        new.address,
        tuple(segs.values()),
        new.listener or old.listener,
        new.provider,
        {"nixl": nixl},
    )
