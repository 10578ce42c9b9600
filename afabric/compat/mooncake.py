"""Mooncake's ``TransferEngine`` Python API over afabric.

The class serving frameworks use for prefill/decode KV-cache transfer (SGLang's default
backend, vLLM's MooncakeConnector): the same methods, arguments and return codes as Mooncake's
binding (``mooncake.engine.TransferEngine``), moving data with an :class:`afabric.Engine`.
Install ``compat/mooncake`` to import it as ``from mooncake.engine import TransferEngine``.

Metadata: with ``"P2PHANDSHAKE"`` a segment is named ``host:rpc_port`` and peers ask its
listener for it; with ``http://host:port/metadata`` (Mooncake's HTTP metadata server protocol:
GET, PUT and DELETE of ``?key=``) each agent publishes its segment under
``mooncake/ram/<name>`` and its listener under ``mooncake/rpc_meta/<name>``. Entries are
afabric's own JSON: afabric and Mooncake agents do not talk to each other.

Importing this module starts no thread and loads no library.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import ipaddress
import itertools
import json
import logging
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Sequence
from typing import Any

from .. import _native, errors
from . import _core

__all__ = [
    "ERR_ADDRESS_NOT_REGISTERED",
    "ERR_ADDRESS_OVERLAPPED",
    "ERR_INVALID_ARGUMENT",
    "ERR_METADATA",
    "ERR_SOCKET",
    "P2PHANDSHAKE",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
]

log = logging.getLogger("afabric.compat.mooncake")

P2PHANDSHAKE = "P2PHANDSHAKE"
"""The metadata server name meaning: no server, peers ask each other's listener."""

# Mooncake's return codes (its error.h): what callers compare against.
ERR_INVALID_ARGUMENT = -1
"""A bad argument, and the code of every failed transfer."""
ERR_ADDRESS_NOT_REGISTERED = -3
"""unregister_memory of an address no registration starts at."""
ERR_ADDRESS_OVERLAPPED = -7
"""register_memory of memory overlapping a registered buffer."""
ERR_SOCKET = -102
"""send_probe: the peer's listener did not answer."""
ERR_METADATA = -200
"""send_probe: the peer is not in the metadata (or it could not be read)."""

_DEFAULT_TIMEOUT_S = 30  # MC_TRANSFER_TIMEOUT's default, and its floor is 5 (as Mooncake's)
_HTTP_TIMEOUT_S = 5.0
_TRUE = ("1", "true", "yes", "on")


class TransferOpcode(enum.IntEnum):
    """The direction of ``transfer_sync``, ``batch_transfer_sync`` and ``batch_transfer_async``."""

    Read = 0
    Write = 1


class TransferNotify:
    """A notification: sent with a transfer's data (``transfer_sync(..., notify=)``), received
    by the target's ``get_notifies()`` once the data is in place."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)

    __hash__ = None  # type: ignore[assignment]  # mutable, like Mooncake's


def _split_host(hostname: str) -> tuple[str, int | None]:
    """``host:port``, ``host``, ``[v6]:port`` -> (host, port or None)."""
    h = hostname.strip()
    if h.startswith("["):
        host, _, rest = h[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    host, sep, port = h.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        return host, int(port)
    return h, None


def _bind_address(host: str) -> str | None:
    """The interface address a tcp engine binds for ``host`` (None: loopback, its default)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return None
    return None if ip.is_loopback else str(ip)


def _timeout_s() -> float:
    raw = os.environ.get("MC_TRANSFER_TIMEOUT", "")
    try:
        return float(max(5, int(raw))) if raw.strip() else float(_DEFAULT_TIMEOUT_S)
    except ValueError:
        return float(_DEFAULT_TIMEOUT_S)


class _Http:
    """A client of Mooncake's HTTP metadata server (GET/PUT/DELETE of ``?key=``)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _call(
        self, method: str, key: str, body: bytes | None = None, timeout: float = _HTTP_TIMEOUT_S
    ) -> tuple[int, bytes]:
        full = f"{self.url}?key={urllib.parse.quote(key, safe='')}"
        req = urllib.request.Request(full, data=body, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()
        except (OSError, ValueError) as e:
            raise _core.MetadataError(f"metadata server {self.url}: {e}") from None

    def get(self, key: str) -> bytes | None:
        status, body = self._call("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise _core.MetadataError(f"metadata server {self.url}: GET {key}: HTTP {status}")
        return body

    def put(self, key: str, value: bytes) -> int:
        return self._call("PUT", key, value)[0]

    def delete(self, key: str) -> None:
        with contextlib.suppress(_core.MetadataError):
            self._call("DELETE", key, timeout=2.0)


def _withdraw(http: _Http | None, keys: list[str], pid: int) -> None:
    """Remove an agent's metadata entries (at close, collection or exit; never in a forked
    child, whose parent still serves them)."""
    if http is not None and os.getpid() == pid:
        for key in keys:
            http.delete(key)


def _fetch(http: _Http | None, prefix: str, name: str) -> _core.PeerInfo | None:
    """A segment's current metadata, or None (unknown, unreachable, malformed)."""
    try:
        if http is not None:
            blob = http.get(f"{prefix}ram/{name}")
            return _core.PeerInfo.from_bytes(blob) if blob is not None else None
        host, port = _split_host(name)
        if port is None:
            return None
        return _core.PeerInfo.from_json(_core.request(host, port, {"op": "metadata"}))
    except (_core.MetadataError, errors.AfabricError) as e:
        log.warning("metadata of %s: %s", name, e)
        return None


class TransferEngine:
    """Mooncake's transfer engine: ``initialize`` it, register memory, move bytes between raw
    addresses of this process and a peer's.

    Every method is thread-safe and blocks (the GIL released while it waits). Methods return
    Mooncake's codes: 0 for success, a negative code for failure; batch ids are non-zero, 0
    meaning the submission failed. ``get_engine`` (Mooncake Store) is not provided.
    """

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._ep: _core.Endpoint | None = None
        self._http: _Http | None = None
        self._name = ""
        self._names: set[str] = set()  # what this agent answers to as a segment name
        self._prefix = "mooncake/"
        self._lock = threading.Lock()
        self._batches: dict[int, _core.Transfer] = {}
        self._ids = itertools.count(1)
        self._managed: dict[int, Any] = {}  # managed buffer address -> its memory
        self._order: list[int] = []  # segment bases in registration order
        self._withdrawal: weakref.finalize[Any, Any] | None = None

    # ---- set-up ----

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Start the engine: ``metadata_server`` is ``"P2PHANDSHAKE"`` or
        ``http://host:port/metadata``; ``protocol`` is ``"tcp"``, ``"rdma"``, ``"efa"`` or
        ``"nvlink"`` (``MC_FORCE_TCP`` and ``AFABRIC_COMPAT_PROVIDER`` override it). 0 or -1."""
        server = metadata_server.strip()
        if "://" in server or server == P2PHANDSHAKE:
            return self.initialize_ext(local_hostname, server, protocol, device_name, "")
        return self.initialize_ext(local_hostname, server, protocol, device_name, "etcd")

    def initialize_ext(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, metadata_type: str
    ) -> int:
        """``initialize`` with the metadata server's type apart (``"http"``, or ``"p2p"``)."""
        if self._ep is not None:
            log.error("initialize: this TransferEngine is initialized already")
            return -1
        server = metadata_server.strip()
        if server != P2PHANDSHAKE and "://" not in server:
            server = f"{metadata_type}://{server}" if metadata_type not in ("", "p2p") else P2PHANDSHAKE
        if server != P2PHANDSHAKE and not server.startswith(("http://", "https://")):
            scheme = server.partition("://")[0]
            log.error(
                "initialize: metadata server %r: afabric.compat.mooncake supports P2PHANDSHAKE and "
                "http://host:port/metadata, not %s",
                metadata_server,
                scheme,
            )
            return -1
        host, _ = _split_host(local_hostname)
        ep = self._open(local_hostname, protocol, device_name)
        if ep is None:
            return -1
        assert ep.listener is not None
        if server == P2PHANDSHAKE:
            self._name = f"{host}:{ep.listener[1]}" if ":" not in host else f"[{host}]:{ep.listener[1]}"
        else:
            self._name = local_hostname
            self._http = _Http(server)
            if not self._claim(ep):
                ep.close()
                self._http = None
                return -1
        self._names = {self._name, local_hostname}
        self._ep = ep  # collected with this object: its finalizer closes it
        if self._http is not None:
            keys = [self._key("ram"), self._key("rpc_meta")]
            self._withdrawal = weakref.finalize(self, _withdraw, self._http, keys, os.getpid())
            if self._publish() != 0:
                self.close()
                return -1
        log.info("initialized %s: provider %s, listener %s", self._name, ep.provider, ep.listener)
        return 0

    def _open(self, local_hostname: str, protocol: str, device_name: str) -> _core.Endpoint | None:
        """The agent's endpoint: its provider from ``protocol``, its listener on the host of
        ``local_hostname`` (on its port only with ``MC_LEGACY_RPC_PORT_BINDING``)."""
        try:
            force_tcp = os.environ.get("MC_FORCE_TCP", "").lower() in _TRUE
            provider = _core.choose_provider(protocol, force_tcp=force_tcp)
        except errors.InvalidArgument as e:
            log.error("initialize: %s", e)
            return None
        host, port = _split_host(local_hostname)
        listen_port = port if port is not None and os.environ.get("MC_LEGACY_RPC_PORT_BINDING") else 0
        nics = [d for d in device_name.split(",") if d.strip()] if device_name else []
        cluster = os.environ.get("MC_METADATA_CLUSTER_ID", "").strip("/")
        self._prefix = f"mooncake/{cluster}/" if cluster else "mooncake/"
        try:
            ep = _core.Endpoint(
                local_hostname,
                provider,
                op_timeout=_timeout_s(),
                bind=_bind_address(host) if provider == "tcp" else None,
                nics=nics if provider not in ("tcp", "cma") else None,
                listen=(host, listen_port),
            )
        except (errors.AfabricError, OSError) as e:
            log.error("initialize: %s", e)
            return None
        return ep

    def _key(self, kind: str) -> str:
        return f"{self._prefix}{kind}/{self._name}"

    def _claim(self, ep: _core.Endpoint) -> bool:
        """Publish this agent's listener under its name, refusing a name a live agent holds
        (the server refuses a second ``rpc_meta`` entry; one whose listener is gone is stale)."""
        assert self._http is not None and ep.listener is not None
        entry = json.dumps({"ip_or_host_name": ep.listener[0], "rpc_port": ep.listener[1]}).encode()
        try:
            for _ in range(2):
                status = self._http.put(self._key("rpc_meta"), entry)
                if status == 200:
                    return True
                old = self._http.get(self._key("rpc_meta"))
                if old is not None and self._alive(old):
                    log.error("initialize: segment name %s is taken by a live agent", self._name)
                    return False
                self._http.delete(self._key("rpc_meta"))
        except _core.MetadataError as e:
            log.error("initialize: %s", e)
            return False
        log.error("initialize: the metadata server refused this agent's entry (HTTP %s)", status)
        return False

    @staticmethod
    def _alive(entry: bytes) -> bool:
        try:
            d = json.loads(entry)
            _core.request(str(d["ip_or_host_name"]), int(d["rpc_port"]), {"op": "probe"}, timeout=2.0)
        except (ValueError, TypeError, KeyError, _core.MetadataError):
            return False
        return True

    def _publish(self) -> int:
        """Put this agent's segments where peers look (HTTP mode; its listener answers anyway)."""
        ep = self._ep
        if self._http is None or ep is None:
            return 0
        try:
            status = self._http.put(self._key("ram"), ep.info().to_bytes())
        except _core.MetadataError as e:
            log.error("publishing %s: %s", self._name, e)
            return ERR_METADATA
        return 0 if status == 200 else ERR_METADATA

    def close(self) -> None:
        """Withdraw this agent's metadata and close its engine and listener (also done when it
        is collected or the process exits)."""
        if self._withdrawal is not None:
            self._withdrawal()
        ep, self._ep = self._ep, None
        if ep is not None:
            ep.close()

    def get_rpc_port(self) -> int:
        """The port of this agent's listener (with P2PHANDSHAKE, part of its segment name)."""
        ep = self._ep
        return ep.listener[1] if ep is not None and ep.listener is not None else -1

    def get_engine(self) -> Any:
        """Not provided: Mooncake Store's inner engine is out of afabric.compat's scope."""
        raise NotImplementedError(
            "get_engine() hands out the inner engine for Mooncake Store, which afabric.compat.mooncake "
            "does not provide (Mooncake Store is out of scope); use the transfer methods"
        )

    def get_engine_ptr(self) -> int:
        """Not provided (see :meth:`get_engine`)."""
        raise NotImplementedError(
            "get_engine_ptr() points at Mooncake's inner engine, which afabric.compat.mooncake does "
            "not provide (Mooncake Store is out of scope)"
        )

    def get_local_topology(self, device_name: str | None = None) -> str:
        """The NICs this agent's provider sees, by NUMA node, as Mooncake's topology JSON
        (``{"cpu:N": {"preferred_hca": [...], "avail_hca": [...]}}``); ``"{}"`` if none."""
        from .. import registry

        try:
            if self._ep is not None:
                provider = self._ep.provider
            else:
                provider = registry.resolve(_core.choose_provider("rdma"))[0].name
            nics = registry.probe(provider).nics
        except errors.AfabricError:
            return "{}"
        wanted = {d.strip() for d in (device_name or "").split(",") if d.strip()}
        nics = [n for n in nics if not wanted or n.name in wanted]
        nodes = sorted({max(n.numa_node, 0) for n in nics})
        topo = {
            f"cpu:{node}": {
                "preferred_hca": [n.name for n in nics if max(n.numa_node, 0) == node],
                "avail_hca": [n.name for n in nics if max(n.numa_node, 0) != node],
            }
            for node in nodes
        }
        return json.dumps(topo)

    # ---- memory ----

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register ``capacity`` bytes at ``buffer_addr`` for peers to write and read.
        ``location`` ``"cuda:N"`` is device memory; anything else host memory. 0, or
        ERR_ADDRESS_OVERLAPPED, ERR_INVALID_ARGUMENT."""
        rc = self._register(buffer_addr, capacity, location)
        if rc == 0:
            rc = self._publish()
        return rc

    def _register(self, addr: int, capacity: int, location: str) -> int:
        ep = self._ep
        if ep is None:
            log.error("register_memory: not initialized")
            return ERR_INVALID_ARGUMENT
        device = -1
        if isinstance(location, str) and location.startswith("cuda:") and location[5:].isdigit():
            device = int(location[5:])
        try:
            ep.register(int(addr), int(capacity), device)
        except _core.AddressOverlap as e:
            log.error("register_memory: %s", e)
            return ERR_ADDRESS_OVERLAPPED
        except (errors.AfabricError, TypeError, ValueError) as e:
            log.error("register_memory: %s", e)
            return ERR_INVALID_ARGUMENT
        with self._lock:
            self._order.append(int(addr))
            self._first_changed(ep)
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        """Deregister the buffer registered at ``buffer_addr``: 0 or ERR_ADDRESS_NOT_REGISTERED."""
        rc = self._unregister(buffer_addr)
        if rc == 0:
            rc = self._publish()
        return rc

    def _unregister(self, addr: int) -> int:
        ep = self._ep
        if ep is None:
            return ERR_INVALID_ARGUMENT
        try:
            ep.deregister(int(addr))
        except _core.UnknownAddress:
            return ERR_ADDRESS_NOT_REGISTERED
        except (errors.AfabricError, TypeError, ValueError) as e:
            log.error("unregister_memory: %s", e)
            return ERR_INVALID_ARGUMENT
        with self._lock:
            with contextlib.suppress(ValueError):
                self._order.remove(int(addr))
            self._first_changed(ep)
        return 0

    def _first_changed(self, ep: _core.Endpoint) -> None:
        """Peers' get_first_buffer_address reads this (Mooncake's first buffer is the first
        registered, not the lowest address)."""
        ep.set_extra({"first_buffer": self._order[0]} if self._order else {})

    def batch_register_memory(
        self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = "*"
    ) -> int:
        """``register_memory`` for each pair; the first failure's code (those before it stay)."""
        if len(buffer_addresses) != len(capacities):
            return ERR_INVALID_ARGUMENT
        rc = 0
        for addr, cap in zip(buffer_addresses, capacities, strict=True):
            rc = self._register(addr, cap, location)
            if rc:
                break
        published = self._publish()
        return rc or published

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """``unregister_memory`` for each; the first failure's code (the rest still go)."""
        rc = 0
        for addr in buffer_addresses:
            r = self._unregister(addr)
            rc = rc or r
        published = self._publish()
        return rc or published

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocate and register ``length`` bytes of host memory (zeroed, 2 MiB-aligned): its
        address, or 0."""
        from ..hostmem import host_buffer

        if self._ep is None or type(length) is not int or length <= 0:
            return 0
        try:
            mem = host_buffer(length)
        except errors.AfabricError as e:
            log.error("allocate_managed_buffer: %s", e)
            return 0
        addr = int(mem.ctypes.data)
        if self.register_memory(addr, length) != 0:
            return 0
        with self._lock:
            self._managed[addr] = mem
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Deregister and free a buffer from ``allocate_managed_buffer``: 0, or
        ERR_INVALID_ARGUMENT for an address it did not return."""
        with self._lock:
            mem = self._managed.pop(buffer_addr, None)
        if mem is None:
            return ERR_INVALID_ARGUMENT
        rc = self.unregister_memory(buffer_addr)
        del mem  # freed once deregistered (the engine held it until then)
        return rc

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The first buffer ``segment_name`` registered (this agent's, or a peer's as its
        metadata says now); 0 if none or unknown."""
        if self._ep is None:
            return 0
        if segment_name in self._names:
            with self._lock:
                return self._order[0] if self._order else 0
        info = self._fetch(segment_name)
        if info is None:
            return 0
        self._remember(segment_name, info)
        first = info.extra.get("first_buffer")
        return int(first) if type(first) is int else 0

    @staticmethod
    def write_bytes_to_buffer(dest_address: int, src_ptr: bytes | str, length: int) -> int:
        """Copy ``length`` bytes of ``src_ptr`` to raw address ``dest_address``: 0, or
        ERR_INVALID_ARGUMENT where ``src_ptr`` is shorter than ``length``."""
        data = src_ptr.encode() if isinstance(src_ptr, str) else bytes(src_ptr)
        if type(length) is not int or not 0 <= length <= len(data) or not dest_address:
            return ERR_INVALID_ARGUMENT
        _native.copy_to_address(dest_address, data, length)
        return 0

    @staticmethod
    def read_bytes_from_buffer(source_address: int, length: int) -> bytes:
        """``length`` bytes from raw address ``source_address``."""
        return _native.bytes_at(source_address, length)

    # ---- peers ----

    def _fetch(self, name: str) -> _core.PeerInfo | None:
        return _fetch(self._http, self._prefix, name)

    def _remember(self, name: str, info: _core.PeerInfo) -> None:
        ep = self._ep
        if ep is None:
            return
        try:
            if ep.peer(name) is None:
                # (not a method of self: the peer table must not keep this agent alive)
                ep.add_peer(name, info, refresh=functools.partial(_fetch, self._http, self._prefix, name))
            else:
                ep.update_peer(name, info)
        except errors.AfabricError as e:
            log.warning("metadata of %s: %s", name, e)

    def _open_segment(self, name: str) -> bool:
        ep = self._ep
        if ep is None:
            log.error("transfer: not initialized")
            return False
        if ep.peer(name) is not None:
            return True
        info = self._fetch(name)
        if info is None:
            log.error("transfer: segment %s is not in the metadata", name)
            return False
        self._remember(name, info)
        return ep.peer(name) is not None

    def _start(
        self,
        op: str,
        target: str,
        buffers: Any,
        peer_addresses: Any,
        lengths: Any,
        notify: bytes | None = None,
    ) -> _core.Transfer | None:
        if not isinstance(target, str) or not self._open_segment(target):
            return None
        assert self._ep is not None
        try:
            return self._ep.start(op, target, buffers, peer_addresses, lengths, notify)  # type: ignore[arg-type]
        except (errors.AfabricError, TypeError, ValueError) as e:
            log.error("%s to %s: %s", op, target, e)
            return None

    def _finish(self, t: _core.Transfer | None, target: str) -> int:
        if t is None:
            return ERR_INVALID_ARGUMENT
        if t.wait():
            return 0
        self._failed(t, target)
        return ERR_INVALID_ARGUMENT

    def _failed(self, t: _core.Transfer, target: str) -> None:
        """A failed transfer: forget the segment, so the next call reads its metadata anew
        (the peer may have restarted elsewhere)."""
        log.error("transfer with %s failed: %s", target, t.error)
        if self._ep is not None:
            self._ep.remove_peer(target)

    @staticmethod
    def _encode_notify(notify: TransferNotify | None) -> bytes | None:
        if notify is None:
            return None
        return json.dumps([str(notify.name), str(notify.msg)]).encode()

    # ---- transfers ----

    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Write ``length`` bytes from ``buffer`` to the peer's ``peer_buffer_address``: 0 or -1."""
        return self._finish(
            self._start("write", target_hostname, [buffer], [peer_buffer_address], [length]), target_hostname
        )

    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Read ``length`` bytes from the peer's ``peer_buffer_address`` into ``buffer``: 0 or -1."""
        return self._finish(
            self._start("read", target_hostname, [buffer], [peer_buffer_address], [length]), target_hostname
        )

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Write every ``(buffers[i], peer_buffer_addresses[i], lengths[i])``: 0 or -1."""
        return self._finish(
            self._start("write", target_hostname, buffers, peer_buffer_addresses, lengths), target_hostname
        )

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Read every ``(peer_buffer_addresses[i] -> buffers[i], lengths[i])``: 0 or -1."""
        return self._finish(
            self._start("read", target_hostname, buffers, peer_buffer_addresses, lengths), target_hostname
        )

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: int,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """One write or read; with ``notify``, the target's ``get_notifies`` returns it once the
        data is in place. 0 or -1."""
        return self.batch_transfer_sync(
            target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify, transport_hint
        )

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """A batch of writes or reads, then ``notify`` (see :meth:`transfer_sync`): 0 or -1."""
        op = "write" if int(opcode) == TransferOpcode.Write else "read"
        t = self._start(
            op, target_hostname, buffers, peer_buffer_addresses, lengths, self._encode_notify(notify)
        )
        return self._finish(t, target_hostname)

    def _submit(self, t: _core.Transfer | None) -> int:
        if t is None:
            return 0
        with self._lock:
            batch_id = next(self._ids)
            self._batches[batch_id] = t
        return batch_id

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Start a batch of writes: its batch id, or 0 if it could not be submitted."""
        return self._submit(self._start("write", target_hostname, buffers, peer_buffer_addresses, lengths))

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Start a batch of reads: its batch id, or 0."""
        return self._submit(self._start("read", target_hostname, buffers, peer_buffer_addresses, lengths))

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
        transport_hint: str = "",
    ) -> int:
        """Start a batch of writes or reads: its batch id, or 0."""
        op = "write" if int(opcode) == TransferOpcode.Write else "read"
        return self._submit(self._start(op, target_hostname, buffers, peer_buffer_addresses, lengths))

    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Start one write: its batch id (for ``transfer_check_status``), or 0."""
        return self._submit(self._start("write", target_hostname, [buffer], [peer_buffer_address], [length]))

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for every batch: 0 if all succeeded, -1 if one failed, timed out or is unknown.
        The ids are spent either way."""
        with self._lock:
            found = [(b, self._batches.pop(b, None)) for b in batch_ids]
        rc = 0
        for b, t in found:
            if t is None:
                log.error("get_batch_transfer_status: unknown batch id %s", b)
                rc = ERR_INVALID_ARGUMENT
            elif not t.wait():
                log.error("batch %s failed: %s", b, t.error)
                rc = ERR_INVALID_ARGUMENT
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 still in flight, -1 failed (or unknown id), -2 timed out. Done and failed
        spend the id."""
        with self._lock:
            t = self._batches.get(batch_id)
        if t is None:
            return ERR_INVALID_ARGUMENT
        state = t.poll()
        if state == "pending":
            return 0
        with self._lock:
            self._batches.pop(batch_id, None)
        if state == "done":
            return 1
        return -2 if isinstance(t.error, _core.TransferTimeout) else -1

    def get_notifies(self) -> list[TransferNotify]:
        """Notifications received since the last call (each after its transfer's data)."""
        ep = self._ep
        if ep is None:
            return []
        out = []
        for note in ep.take_notifications():
            try:
                name, msg = json.loads(note.payload)
            except (ValueError, TypeError, UnicodeDecodeError):
                log.warning("dropped a malformed notification of %d bytes", len(note.payload))
                continue
            out.append(TransferNotify(str(name), str(msg)))
        return out

    def send_probe(self, peer_server_name: str) -> int:
        """0 if the peer's listener answers; ERR_METADATA if the peer is not in the metadata,
        ERR_SOCKET if its listener does not answer."""
        if self._ep is None:
            return ERR_INVALID_ARGUMENT
        try:
            if self._http is not None:
                entry = self._http.get(f"{self._prefix}rpc_meta/{peer_server_name}")
                if entry is None:
                    return ERR_METADATA
                d = json.loads(entry)
                host, port = str(d["ip_or_host_name"]), int(d["rpc_port"])
            else:
                host, p = _split_host(peer_server_name)
                if p is None:
                    return ERR_METADATA
                port = p
        except (_core.MetadataError, ValueError, TypeError, KeyError):
            return ERR_METADATA
        try:
            _core.request(host, port, {"op": "probe"}, timeout=_HTTP_TIMEOUT_S)
        except _core.MetadataError:
            return ERR_SOCKET
        return 0

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Read the segment's metadata now, so the first transfer does not: 0, or -1."""
        return 0 if self._open_segment(segment_name) else ERR_INVALID_ARGUMENT
