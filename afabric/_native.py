"""The one module that owns ctypes: finds, loads and checks the C shim.

Everything else in afabric calls the typed functions below. Each foreign function gets
its signature from one table applied at load time; each handle kind has its own opaque
pointer type so ctypes rejects mix-ups; every return code passes one checker that turns
it into a typed exception from :mod:`afabric.errors`.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from . import errors

# Everything afabric_shim.h declares (constants, EngineHandle, the structures, FUNCTIONS),
# with afp_nic_info and the AFP_CAP_*/AFP_MR_* flags it passes through from
# afabric_provider.h, is generated into _native_decl.py by `python -m afabric._gen_shim` and
# re-exported from here; do not declare it again.
from ._native_decl import *  # noqa: F403
from ._native_decl import (
    ABI_VERSION,
    ALLOW_ON,
    ALLOW_UNKNOWN,
    C_DONE,
    C_HELLO,
    C_NOTICE,
    C_PEER,
    C_RECV,
    C_STUCK,
    C_WATCH,
    CFG_FORCE_EFA_MODES,
    CFG_TIMING,
    FUNCTIONS,
    NO_IMM,
    OP_GATHER,
    OP_READ,
    OP_READ_PAGED,
    OP_SCATTER,
    OP_WRITE,
    OP_WRITE_DYNLEN,
    OP_WRITE_PAGED,
    POLL_ADAPTIVE,
    POLL_SPIN,
    REACH_HOST,
    REACH_NETWORK,
    REACH_NODE,
    TAKE_NONE,
    TRIG_NONE,
    Completion,
    Config,
    DescInfo,
    EngineFacts,
    EngineHandle,
    NicInfoStruct,
    NicStats,
    OpTimingStruct,
    Request,
    TransportCfg,
    TransportInfo,
    WorkerStats,
)

if TYPE_CHECKING:
    import numpy.typing as npt

    # typings/afabric_shim.pyi: the shim's functions as typed callables (no run-time module).
    from afabric_shim import ShimLib

SHIM_NAME = "libafabric_shim.so"
NO_TRIGGER = (0, 0, 0)

# write()'s (and read()'s) fields, op to imm, packed into the request in one call (seven
# ctypes field stores cost twice as much); drain()'s look at a record: id, status, kind,
# data, len, slot, release_later in one call (a ctypes record and its attributes: twice).
_WRITE_FIELDS = struct.Struct("<IQQQQQq")
_RECORD_HEAD = struct.Struct("<QiIQQII")


def copy_to_address(address: int, data: bytes, length: int) -> None:
    """Copy the first ``length`` bytes of ``data`` to a raw address of this process (the
    compatibility layers' byte-buffer calls, which name memory by address)."""
    ctypes.memmove(address, data, length)


def bytes_at(address: int, length: int) -> bytes:
    """``length`` bytes read from a raw address of this process."""
    return ctypes.string_at(address, length)


def _check_layouts() -> None:
    """The packed forms above against the generated structures (a header change that moved
    a field must fail here, not write the wrong word)."""
    want = {
        Request: (("op", 4), ("mr_id", 8), ("remote_id", 16), ("length", 24), ("src_offset", 32),
                  ("dst_offset", 40), ("imm", 48)),
        Completion: (("id", 0), ("status", 8), ("kind", 12), ("data", 16), ("len", 24), ("slot", 32),
                     ("release_later", 36)),
    }  # fmt: skip
    for struct_type, fields in want.items():
        got = tuple((name, getattr(struct_type, name).offset) for name, _ in fields)
        if got != fields:
            raise ImportError(f"afabric: {struct_type.__name__} layout {got}, packed as {fields}")
    if _WRITE_FIELDS.size != 52 or _RECORD_HEAD.size != 40:
        raise ImportError("afabric: packed request or record size changed")


_check_layouts()


@dataclass(frozen=True)
class NicInfo:
    """One NIC (libfabric domain) as a provider library reports it."""

    name: str
    fabric: str
    provider: str
    pci: str
    link_speed_bps: int
    numa_node: int
    lib_version: str = ""  # the library under the provider ("1.17.0" for libfabric); "" unknown


def _lib_version(v: int) -> str:
    """afp_nic_info.lib_version (AFP_LIB_VERSION) as "major.minor.patch"; "" for 0."""
    return f"{v >> 16}.{(v >> 8) & 0xFF}.{v & 0xFF}" if v else ""


class Shim:
    """The loaded shim library with its checked functions."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.lib = lib
        self.path = path
        for name, (restype, argtypes) in FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        # From here on every call goes through the signatures of typings/afabric_shim.pyi.
        self.f = cast("ShimLib", lib)
        self.hot = HotCalls(lib)
        self.codes: dict[int, tuple[str, str]] = {}
        code = ctypes.c_int32()
        name_p = ctypes.c_char_p()
        text_p = ctypes.c_char_p()
        for i in range(self.f.afs_error_count()):
            self.f.afs_error_info(i, ctypes.byref(code), ctypes.byref(name_p), ctypes.byref(text_p))
            self.codes[code.value] = ((name_p.value or b"").decode(), (text_p.value or b"").decode())

    def check(self, rc: int, what: str, provider: str = "") -> None:
        """Raise the typed error for a negative return code, with the shim's detail."""
        if rc == 0:
            return
        detail = (self.f.afs_last_error() or b"").decode(errors="replace")
        name, text = self.codes.get(rc, (f"E{rc}", "unknown error code"))
        raise errors.from_code(name, rc, what, detail or text, provider)

    def error_name(self, rc: int) -> str:
        return self.codes.get(rc, (f"E{rc}", ""))[0]


class HotCalls:
    """The per-operation calls again, their pointer parameters declared as c_void_p: the
    loop's thread passes addresses made once, which ctypes takes as they are, where a
    POINTER(T) parameter converts its argument on every call (afs_poll, 2-core machine:
    1.15 -> 0.5 µs). New function objects (``lib[name]``): the declared signatures of
    ``Shim.f`` stay for every other caller."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, u32 = ctypes.c_void_p, ctypes.c_uint32
        self.submit = self._fn(lib, "afs_submit_req", [EngineHandle, vp, vp])
        self.drain = self._fn(lib, "afs_drain", [EngineHandle, vp, u32, vp])
        self.poll = self._fn(lib, "afs_poll", [EngineHandle, vp, u32, vp])
        self.submit_take = self._fn(lib, "afs_submit_take", [EngineHandle, vp, vp, u32])

    @staticmethod
    def _fn(lib: ctypes.CDLL, name: str, argtypes: list[type]) -> Callable[..., int]:
        fn = lib[name]
        fn.restype = ctypes.c_int32
        fn.argtypes = argtypes
        return cast("Callable[..., int]", fn)


_lock = threading.Lock()
_shim: Shim | None = None


def _candidates() -> list[tuple[str, str]]:
    """Places to look for the shim, in order, each with where the path came from."""
    out: list[tuple[str, str]] = []
    env = os.environ.get("AFABRIC_SHIM")
    if env:
        out.append((env, "AFABRIC_SHIM"))
    try:
        pkg = resources.files("afabric").joinpath("_lib").joinpath(SHIM_NAME)
        out.append((str(pkg), "this package's own copy"))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - broken install
        pass
    return out


def _source_tree_note() -> str:
    """When this ``afabric`` is a source checkout's package directory (beside shim/ and
    build_native.py) that was never built in place, what happened and what to do: the
    current directory (``python -m``, ``-c``, a script beside the checkout's package) or
    PYTHONPATH put the checkout before the installed package on sys.path. "" otherwise."""
    pkg = Path(__file__).resolve().parent
    root = pkg.parent
    if not ((root / "shim" / "afabric_shim.h").is_file() and (root / "build_native.py").is_file()):
        return ""
    installed = ""
    for entry in sys.path:
        other = Path(entry or ".").resolve() / "afabric"
        if other != pkg and (other / "__init__.py").is_file():
            installed = f", not the installed package in {other.parent}"
            break
    return (
        f"afabric is imported from the source tree {root}{installed} (the current directory or "
        f"PYTHONPATH puts the checkout first on sys.path), and the source tree has no compiled "
        f"shim: run from another directory, or build it in place with `pip install -e {root}`"
    )


def shim() -> Shim:
    """Load the shim once (thread-safe); raise ShimLoadError listing every place tried."""
    global _shim
    if _shim is not None:
        return _shim
    with _lock:
        if _shim is not None:
            return _shim
        tried: list[str] = []
        for path, origin in _candidates():
            if not Path(path).is_file():
                tried.append(f"{path} ({origin}): not found")
                continue
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            except OSError as e:
                tried.append(f"{path} ({origin}): {e}")
                continue
            if not hasattr(lib, "afs_abi_version"):
                tried.append(f"{path} ({origin}): not an afabric shim (no afs_abi_version)")
                continue
            version = int(ctypes.CFUNCTYPE(ctypes.c_uint32)(("afs_abi_version", lib))())
            if version != ABI_VERSION:
                tried.append(f"{path} ({origin}): ABI version {version}, need {ABI_VERSION}")
                continue
            missing = [n for n in FUNCTIONS if not hasattr(lib, n)]
            if missing:
                tried.append(f"{path} ({origin}): lacks {', '.join(missing)}")
                continue
            _shim = Shim(lib, path)
            return _shim
        note = _source_tree_note()
        raise errors.ShimLoadError(
            "cannot load the afabric shim"
            + (f": {note}" if note else "")
            + "; looked in:\n  "
            + "\n  ".join(tried or ["(nowhere)"])
            + ("" if note else "\nreinstall afabric (`pip install .` compiles it) or set AFABRIC_SHIM")
        )


def _cstr(s: str | None) -> bytes | None:
    return s.encode() if s is not None else None


def make_config(
    *,
    library: str,
    provider_name: str,
    fabric_provider: str,
    nics: str | Sequence[str] | int | None = None,
    bind_addr: str | None = None,
    cpu: int = -1,
    spin: bool = False,
    spin_us: int = 50,
    max_msg_size: int = 65536,
    rx_depth: int = 128,
    tx_depth: int = 256,
    op_timeout: float = 20.0,
    force_efa_modes: bool = False,
    timing: bool = False,
    max_imm_values: int = 65536,
) -> Config:
    cfg = Config()
    cfg.size = ctypes.sizeof(Config)
    cfg.flags = (CFG_FORCE_EFA_MODES if force_efa_modes else 0) | (CFG_TIMING if timing else 0)
    cfg.provider_lib = _cstr(library)
    cfg.provider_name = _cstr(provider_name)
    cfg.fabric_provider = _cstr(fabric_provider)
    if isinstance(nics, int):
        cfg.nics = nics
    elif nics is not None:
        names = [nics] if isinstance(nics, str) else list(nics)
        if not names or any(not n or "," in n for n in names):
            raise errors.InvalidArgument(f"bad NIC names {names!r}")
        cfg.nic = _cstr(",".join(names))
    cfg.bind_addr = _cstr(bind_addr)
    cfg.cpu = cpu
    cfg.poll_mode = POLL_SPIN if spin else POLL_ADAPTIVE
    cfg.spin_us = spin_us
    cfg.max_msg_size = max_msg_size
    cfg.rx_depth = rx_depth
    cfg.tx_depth = tx_depth
    cfg.op_timeout_ns = int(op_timeout * 1e9) if op_timeout > 0 else 0
    cfg.max_imm_values = max_imm_values
    return cfg


# What a provider can reach, narrowest first (the shim's AFS_REACH_*).
REACHES = {"host": REACH_HOST, "node": REACH_NODE, "network": REACH_NETWORK}


@dataclass(frozen=True)
class TransportFacts:
    """One transport of an engine (afs_engine_transport)."""

    name: str
    provider: str
    first_nic: int
    nics: int
    caps: int
    reach: str
    max_write_size: int


TransportRow = tuple[str, str, str, str | None, str | None, str, int]
TransportArray = ctypes.Array[TransportCfg]


def make_transports(transports: Sequence[TransportRow]) -> TransportArray:
    """The afs_transport_cfg array of a routed engine: (library, name, fabric provider, NIC
    names or None, bind address or None, reach, NIC count or 0) each, in the order the
    engine prefers them."""
    arr = (TransportCfg * len(transports))()
    for i, (lib, name, fabric, nic, bind, reach, nics) in enumerate(transports):
        t = arr[i]
        t.provider_lib, t.provider_name, t.fabric_provider = _cstr(lib), _cstr(name), _cstr(fabric)
        t.nic, t.bind_addr = _cstr(nic), _cstr(bind)
        t.nics = nics
        t.reach = REACHES[reach]
    return arr


def probe(cfg: Config) -> tuple[str, list[NicInfo]]:
    """NICs the provider library sees (raises the provider's error when it sees none)."""
    s = shim()
    max_nics = 64
    arr = (NicInfoStruct * max_nics)()
    count = ctypes.c_uint32()
    name = ctypes.create_string_buffer(64)
    rc = s.f.afs_provider_probe(ctypes.byref(cfg), arr, max_nics, ctypes.byref(count), name, 64)
    prov = (cfg.provider_name or b"").decode()
    s.check(rc, f"probing provider {prov}", prov)
    nics = [
        NicInfo(
            name=n.name.decode(errors="replace"),
            fabric=n.fabric.decode(errors="replace"),
            provider=n.provider.decode(errors="replace"),
            pci=n.pci.decode(errors="replace"),
            link_speed_bps=int(n.link_speed_bps),
            numa_node=int(n.numa_node),
            lib_version=_lib_version(int(n.lib_version)),
        )
        for n in arr[: min(count.value, max_nics)]
    ]
    return name.value.decode(errors="replace"), nics


def decode_descriptor(blob: bytes) -> DescInfo:
    s = shim()
    info = DescInfo()
    s.check(s.f.afs_desc_decode(blob, len(blob), ctypes.byref(info)), "decoding descriptor")
    return info


def check_address(blob: bytes) -> tuple[int, int]:
    s = shim()
    inc = ctypes.c_uint64()
    nics = ctypes.c_uint32()
    s.check(s.f.afs_address_check(blob, len(blob), ctypes.byref(inc), ctypes.byref(nics)), "decoding address")
    return inc.value, nics.value


def read_u64(address: int) -> int:
    """The 64-bit word at `address` (a watcher's word; aligned, so the load is atomic)."""
    return int(ctypes.c_uint64.from_address(address).value)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ cost 1 µs per completion
class Event:
    """One drained completion record, already converted to Python objects (read-only by
    convention)."""

    kind: int
    id: int
    status: int
    payload: bytes | None  # RECV: the message (id: its sender's peer handle or SRC_*)
    text: str | None  # DONE with an error: the provider's/shim's error text
    release_later: bool  # DONE of a failed op whose buffers the provider still holds
    first_post_ns: int = 0  # DONE: when its first work request was posted (0: none)
    watch_old: int = 0  # WATCH: the value before
    watch_new: int = 0  # WATCH: the value seen
    total: int = 0  # NOTICE: how many were dropped so far
    peer_pid: int = 0  # PEER: its process id (0: unknown)
    peer_flags: int = 0  # PEER: 1 its process is watched, | 2 down because stopped
    slot: int = -1  # RECV whose receive buffer the caller keeps (release_recv it later); -1: released


class NativeEngine:
    """An `afs_engine *` with one method per shim call; all ctypes stays in this module."""

    DRAIN_BATCH = 256
    _RECORD_SIZE = ctypes.sizeof(Completion)
    COLUMNS_FROM = 16  # drain(): below this many records, per-record checks cost less than numpy's

    def __init__(
        self, cfg: Config, provider: str, transports: TransportArray | None = None
    ) -> None:
        """``transports``: make_transports()'s array for a routed engine, else None."""
        self._s = shim()
        self.provider = provider
        h = EngineHandle()
        if transports is None:
            rc = self._s.f.afs_engine_create(ctypes.byref(cfg), ctypes.byref(h))
        else:
            rc = self._s.f.afs_engine_create_routed(
                ctypes.byref(cfg), transports, len(transports), ctypes.byref(h)
            )
        self._s.check(rc, "creating engine", provider)
        self._h: EngineHandle | None = h
        # Every call has its own result word (ctypes releases the GIL during the call: a
        # shared one handed one thread's operation id to another). The ring is the loop
        # thread's: Engine lets no other thread reach drain().
        self._ring = (Completion * self.DRAIN_BATCH)()
        # The same records as numpy columns: drain() reads a batch of plain successes (most
        # of them) as one column of ids instead of one Event per record.
        self._cols = np.ctypeslib.as_array(self._ring)
        # ...and as bytes, for struct's look at one record (_records)
        self._ring_bytes = memoryview((ctypes.c_char * ctypes.sizeof(self._ring)).from_buffer(self._ring))
        self._count = ctypes.c_uint32()
        # write()'s result word for the creating thread only (Engine's loop thread): it
        # reads it right after its own call, with no Python of another thread in between
        self._owner = threading.get_ident()
        self._out = ctypes.c_uint64()
        # ...and its request struct (see _request); _armed: its trigger is set
        self._req = Request()
        self._req.size = ctypes.sizeof(Request)
        self._trig = self._req.trigger  # a view into self._req (no copy)
        self._armed = False
        f, hot = self._s.f, self._s.hot
        self._submit = f.afs_submit_req
        self._pending = f.afs_pending
        self._pending_wait = f.afs_pending_wait
        # the loop thread's calls take these addresses (HotCalls); self keeps what they name
        self._submit_hot, self._drain_hot, self._poll_hot = hot.submit, hot.drain, hot.poll
        self._submit_take_hot = hot.submit_take
        self._req_p = ctypes.c_void_p(ctypes.addressof(self._req))
        self._out_p = ctypes.c_void_p(ctypes.addressof(self._out))
        self._ring_p = ctypes.c_void_p(ctypes.addressof(self._ring))
        self._count_p = ctypes.c_void_p(ctypes.addressof(self._count))
        self._batch = ctypes.c_uint32(self.DRAIN_BATCH)

    @property
    def open(self) -> bool:
        return self._h is not None

    def _handle(self) -> EngineHandle:
        if self._h is None:
            raise errors.EngineClosed("engine is closed")
        return self._h

    def destroy(self) -> None:
        h, self._h = self._h, None
        if h is not None:
            self._s.check(self._s.f.afs_engine_destroy(h), "closing engine", self.provider)

    def facts(self) -> EngineFacts:
        out = EngineFacts()
        rc = self._s.f.afs_engine_info(self._handle(), ctypes.byref(out))
        self._s.check(rc, "engine info", self.provider)
        return out

    def timings(self) -> tuple[list[tuple[int, ...]], int]:
        """Timing records drained now (field tuples in OpTimingStruct order), and how many
        were dropped because they were not drained in time."""
        batch = 4096
        arr = (OpTimingStruct * batch)()
        n, dropped = ctypes.c_uint32(), ctypes.c_uint64()
        out: list[tuple[int, ...]] = []
        while True:
            rc = self._s.f.afs_timing_drain(
                self._handle(), arr, batch, ctypes.byref(n), ctypes.byref(dropped)
            )
            self._s.check(rc, "draining timings", self.provider)
            out.extend(tuple(int(getattr(r, f[0])) for f in OpTimingStruct._fields_) for r in arr[: n.value])
            if n.value < batch:
                return out, dropped.value

    def stats(self, nic: int) -> dict[str, int]:
        out = NicStats()
        rc = self._s.f.afs_engine_stats(self._handle(), nic, ctypes.byref(out))
        self._s.check(rc, "engine stats", self.provider)
        counts = {field[0]: int(getattr(out, field[0])) for field in NicStats._fields_}
        # work requests still with the provider: this NIC's queue depth right now
        counts["outstanding"] = counts["writes"] + counts["reads"] + counts["sends"] - counts["completions"]
        return counts

    def worker_naps(self) -> int:
        """How often the engine's worker has slept (afs_engine_worker_stats)."""
        out = WorkerStats()
        rc = self._s.f.afs_engine_worker_stats(self._handle(), ctypes.byref(out))
        self._s.check(rc, "worker stats", self.provider)
        return int(out.naps)

    def address(self) -> bytes:
        buf = (ctypes.c_uint8 * 2048)()
        n = ctypes.c_uint32()
        rc = self._s.f.afs_engine_address(self._handle(), buf, 2048, ctypes.byref(n))
        self._s.check(rc, "engine address", self.provider)
        return bytes(buf[: n.value])

    def register(self, address: int, length: int, flags: int, device: int) -> tuple[int, bytes]:
        buf = (ctypes.c_uint8 * 4096)()
        n = ctypes.c_uint32()
        mr_id = ctypes.c_uint64()
        rc = self._s.f.afs_mr_register(
            self._handle(), address, length, flags, device, ctypes.byref(mr_id), buf, 4096, ctypes.byref(n)
        )
        self._s.check(rc, f"registering {length} bytes", self.provider)
        return mr_id.value, bytes(buf[: n.value])

    def deregister(self, mr_id: int) -> None:
        self._s.check(self._s.f.afs_mr_deregister(self._handle(), mr_id), "deregistering", self.provider)

    def import_descriptor(self, blob: bytes) -> int:
        out = ctypes.c_uint64()
        rc = self._s.f.afs_remote_import(self._handle(), blob, len(blob), out)
        self._s.check(rc, "importing remote descriptor", self.provider)
        return out.value

    def release_remote(self, remote_id: int) -> None:
        rc = self._s.f.afs_remote_release(self._handle(), remote_id)
        self._s.check(rc, "releasing descriptor", self.provider)

    def allow_peers(self, addresses: list[bytes] | None, accept_unknown: bool = False) -> None:
        """Install the allow-list (None: every peer)."""
        blobs = addresses or []
        lens = (ctypes.c_uint32 * max(1, len(blobs)))(*[len(b) for b in blobs])
        flags = 0 if addresses is None else ALLOW_ON | (ALLOW_UNKNOWN if accept_unknown else 0)
        rc = self._s.f.afs_allow_peers(self._handle(), b"".join(blobs), lens, len(blobs), flags)
        self._s.check(rc, "setting the allow-list", self.provider)

    def resolve_peer(self, address: bytes) -> int:
        out = ctypes.c_uint64()
        rc = self._s.f.afs_peer_resolve(self._handle(), address, len(address), out)
        self._s.check(rc, "resolving peer", self.provider)
        return out.value

    def peer_handle(self, peer_id: int) -> int:
        """The provider's handle of a resolved peer (what RECV events carry as ``id``)."""
        out = ctypes.c_uint64()
        rc = self._s.f.afs_peer_handle(self._handle(), peer_id, out)
        self._s.check(rc, "peer handle", self.provider)
        return out.value

    def peer_source(self, peer_id: int, src: int) -> bool:
        """Whether a RECV event's ``id`` names this peer (on any of its transports)."""
        out = ctypes.c_uint32()
        rc = self._s.f.afs_peer_source(self._handle(), peer_id, src, out)
        self._s.check(rc, "peer source", self.provider)
        return bool(out.value)

    def peer_route(self, peer_id: int, device: int) -> tuple[int, str]:
        """(transport index, why faster ones do not reach it) for host (device < 0) or CUDA
        memory to a resolved peer."""
        out = ctypes.c_uint32()
        why = ctypes.create_string_buffer(512)
        rc = self._s.f.afs_peer_route(self._handle(), peer_id, device, out, why, len(why))
        self._s.check(rc, "route", self.provider)
        return int(out.value), why.value.decode(errors="replace")

    def transport(self, index: int) -> TransportFacts:
        """What transport ``index`` of this engine is."""
        info = TransportInfo()
        rc = self._s.f.afs_engine_transport(self._handle(), index, ctypes.byref(info))
        self._s.check(rc, "transport", self.provider)
        reach = {v: k for k, v in REACHES.items()}.get(int(info.reach), "network")
        return TransportFacts(
            info.name.decode(errors="replace"), info.provider.decode(errors="replace"),
            int(info.first_nic), int(info.nics), int(info.caps), reach, int(info.max_write_size),
        )

    # ---- the submit path: one afs_request per operation (afs_submit_req) ----

    def _request(self) -> tuple[Request, ctypes.c_uint64]:
        """The request struct and result word of this call. The loop's thread (the one that
        made this engine: Engine lets only it submit) reuses its own; any other thread gets
        fresh ones (ctypes releases the GIL during the call: nothing shared across threads).
        Fields an op does not name are left as they were: the shim ignores them."""
        if threading.get_ident() == self._owner:
            return self._req, self._out
        req = Request()
        req.size = ctypes.sizeof(Request)
        return req, ctypes.c_uint64()

    def _submit_req(self, what: str, req: Request, out: ctypes.c_uint64, trig: tuple[int, int, int]) -> int:
        h = self._h
        if h is None:
            raise errors.EngineClosed("engine is closed")
        t = req.trigger
        t.kind, t.source, t.threshold = trig
        if req is self._req:
            self._armed = trig[0] != TRIG_NONE
            rc = self._submit_hot(h, self._req_p, self._out_p)
        else:
            rc = self._submit(h, req, out)
        if rc:
            self._s.check(rc, what, self.provider)
        return out.value

    def write(
        self,
        what: str,
        mr_id: int,
        remote_id: int,
        length: int,
        src: int,
        dst: int,
        imm: int,
        trig: tuple[int, int, int] = NO_TRIGGER,
    ) -> int:
        # the hot path (docs/internals/architecture.md): _request and _submit_req inlined;
        # the owner's request keeps trigger.kind 0 unless the call before was triggered
        h = self._h
        if h is None:
            raise errors.EngineClosed("engine is closed")
        if threading.get_ident() != self._owner:
            req, out = self._request()
            _WRITE_FIELDS.pack_into(req, 4, OP_WRITE, mr_id, remote_id, length, src, dst, imm)
            if trig is not NO_TRIGGER:
                t = req.trigger
                t.kind, t.source, t.threshold = trig
            rc = self._submit(h, req, out)
            if rc:
                self._s.check(rc, what, self.provider)
            return out.value
        _WRITE_FIELDS.pack_into(self._req, 4, OP_WRITE, mr_id, remote_id, length, src, dst, imm)
        if trig is not NO_TRIGGER or self._armed:
            t = self._trig
            t.kind, t.source, t.threshold = trig
            self._armed = trig[0] != TRIG_NONE
        rc = self._submit_hot(h, self._req_p, self._out_p)
        if rc:
            self._s.check(rc, what, self.provider)
        return self._out.value

    def take(
        self, what: str, op: int, mr_id: int, remote_id: int, length: int, src: int, dst: int,
        imm: int, max_ns: int,
    ) -> tuple[int, int]:  # fmt: skip
        """A plain write or read (``op``: OP_WRITE, OP_READ) awaited alone: submitted, then
        looked for up to ``max_ns`` (afs_submit_take; the owner's thread, no trigger armed,
        ``max_ns`` >= 0, else only submitted). Returns (operation id, TAKEN when its
        completion, a plain success, was consumed here: nothing of it reaches drain(); else
        TAKE_NONE or TAKE_OTHER, and the operation completes through drain() as any other)."""
        h = self._h
        if h is None:
            raise errors.EngineClosed("engine is closed")
        if threading.get_ident() != self._owner or self._armed:
            req, out = self._request()
            _WRITE_FIELDS.pack_into(req, 4, op, mr_id, remote_id, length, src, dst, imm)
            return self._submit_req(what, req, out, NO_TRIGGER), TAKE_NONE
        _WRITE_FIELDS.pack_into(self._req, 4, op, mr_id, remote_id, length, src, dst, imm)
        if max_ns < 0:
            rc, took = self._submit_hot(h, self._req_p, self._out_p), TAKE_NONE
        else:
            rc = took = self._submit_take_hot(h, self._req_p, self._out_p, max_ns)
        if rc < 0:
            self._s.check(rc, what, self.provider)
        return self._out.value, took

    def write_dynlen(
        self,
        what: str,
        mr_id: int,
        remote_id: int,
        max_length: int,
        src: int,
        dst: int,
        imm: int,
        length_word: tuple[int, int, int, int],
        trig: tuple[int, int, int] = NO_TRIGGER,
    ) -> int:
        """A write whose length the shim reads when it starts: ``length_word`` is (region id,
        byte offset, base, scale) of a u32 ``n``; length = clamp(base + scale*n, 0, max)."""
        req, out = self._request()
        req.op = OP_WRITE_DYNLEN
        req.mr_id, req.remote_id, req.length = mr_id, remote_id, max_length
        req.src_offset, req.dst_offset, req.imm = src, dst, imm
        req.len_mr_id, req.len_offset, req.len_base, req.len_scale = length_word
        return self._submit_req(what, req, out, trig)

    def _paged(
        self, req: Request, op: int, mr_id: int, remote_id: int, page_len: int,
        src_idx: npt.NDArray[np.int64], src_stride: int, src_offset: int,
        dst_idx: npt.NDArray[np.int64], dst_stride: int, dst_offset: int, imm: int,
    ) -> None:  # fmt: skip
        req.op, req.mr_id, req.remote_id, req.length = op, mr_id, remote_id, page_len
        req.count = int(src_idx.shape[0])
        req.src_idx, req.src_stride, req.src_offset = src_idx.ctypes.data, src_stride, src_offset
        req.dst_idx, req.dst_stride, req.dst_offset = dst_idx.ctypes.data, dst_stride, dst_offset
        req.imm = imm

    def write_paged(
        self,
        what: str,
        mr_id: int,
        remote_id: int,
        page_len: int,
        src_idx: npt.NDArray[np.int64],
        src_stride: int,
        src_offset: int,
        dst_idx: npt.NDArray[np.int64],
        dst_stride: int,
        dst_offset: int,
        imm: int,
        trig: tuple[int, int, int] = NO_TRIGGER,
    ) -> int:
        req, out = self._request()
        self._paged(
            req, OP_WRITE_PAGED, mr_id, remote_id, page_len, src_idx, src_stride, src_offset,
            dst_idx, dst_stride, dst_offset, imm,
        )  # fmt: skip
        return self._submit_req(what, req, out, trig)

    def _targets(
        self, req: Request, op: int, mr_id: int, remote_ids: npt.NDArray[np.uint64],
        lengths: npt.NDArray[np.uint64] | None, src_offsets: npt.NDArray[np.uint64] | None,
        dst_offsets: npt.NDArray[np.uint64] | None, imm: int,
    ) -> None:  # fmt: skip
        req.op, req.mr_id, req.count = op, mr_id, int(remote_ids.shape[0])
        req.remote_ids = remote_ids.ctypes.data
        req.lengths = 0 if lengths is None else lengths.ctypes.data
        req.src_offsets = 0 if src_offsets is None else src_offsets.ctypes.data
        req.dst_offsets = 0 if dst_offsets is None else dst_offsets.ctypes.data
        req.imm = imm

    def scatter(
        self,
        what: str,
        mr_id: int,
        remote_ids: npt.NDArray[np.uint64],
        lengths: npt.NDArray[np.uint64] | None,
        src_offsets: npt.NDArray[np.uint64] | None,
        dst_offsets: npt.NDArray[np.uint64] | None,
        imm: int,
        trig: tuple[int, int, int] = NO_TRIGGER,
    ) -> int:
        """One write per target (lengths None: zero-length writes, a barrier)."""
        req, out = self._request()
        self._targets(req, OP_SCATTER, mr_id, remote_ids, lengths, src_offsets, dst_offsets, imm)
        return self._submit_req(what, req, out, trig)

    def read(
        self, what: str, mr_id: int, remote_id: int, length: int, src: int, dst: int,
        trig: tuple[int, int, int] = NO_TRIGGER,
    ) -> int:  # fmt: skip
        """One-sided read: ``length`` bytes from ``src`` of the remote region to ``dst`` of mr."""
        req, out = self._request()
        _WRITE_FIELDS.pack_into(req, 4, OP_READ, mr_id, remote_id, length, src, dst, NO_IMM)
        return self._submit_req(what, req, out, trig)

    def read_paged(
        self, what: str, mr_id: int, remote_id: int, page_len: int,
        src_idx: npt.NDArray[np.int64], src_stride: int, src_offset: int,
        dst_idx: npt.NDArray[np.int64], dst_stride: int, dst_offset: int,
        trig: tuple[int, int, int] = NO_TRIGGER,
    ) -> int:  # fmt: skip
        """Remote page ``src_idx[i]`` to local page ``dst_idx[i]``."""
        req, out = self._request()
        self._paged(
            req, OP_READ_PAGED, mr_id, remote_id, page_len, src_idx, src_stride, src_offset,
            dst_idx, dst_stride, dst_offset, NO_IMM,
        )  # fmt: skip
        return self._submit_req(what, req, out, trig)

    def gather(
        self, what: str, mr_id: int, remote_ids: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64],
        src_offsets: npt.NDArray[np.uint64], dst_offsets: npt.NDArray[np.uint64],
        trig: tuple[int, int, int] = NO_TRIGGER,
    ) -> int:  # fmt: skip
        """One read per source (src offsets in the remote regions, dst offsets in mr)."""
        req, out = self._request()
        self._targets(req, OP_GATHER, mr_id, remote_ids, lengths, src_offsets, dst_offsets, NO_IMM)
        return self._submit_req(what, req, out, trig)

    def watcher_create(self, device: int) -> tuple[int, int, int]:
        """(watcher id, host address of the word, device address or 0)."""
        wid, host, dev = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        rc = self._s.f.afs_watcher_create(
            self._handle(), device, ctypes.byref(wid), ctypes.byref(host), ctypes.byref(dev)
        )
        self._s.check(rc, "creating watcher", self.provider)
        return wid.value, host.value, dev.value

    def watcher_destroy(self, watcher_id: int) -> None:
        self._s.check(
            self._s.f.afs_watcher_destroy(self._handle(), watcher_id), "closing watcher", self.provider
        )

    def watcher_add(self, watcher_id: int, delta: int) -> int:
        # any thread may bump a watcher
        value = ctypes.c_uint64()
        rc = self._s.f.afs_watcher_add(self._handle(), watcher_id, delta, ctypes.byref(value))
        self._s.check(rc, "bumping watcher", self.provider)
        return value.value

    def watcher_store(self, watcher_id: int, value: int) -> int:
        """Store `value` into the watcher's word; returns the clock (``time.monotonic_ns()``'s)
        read in C just before the store (`afabric bench trigger`'s writer)."""
        if type(value) is not int or not 0 <= value < 1 << 64:
            raise errors.InvalidArgument(f"a watcher's word takes a u64, got {value!r}")
        stamp = ctypes.c_uint64()
        rc = self._s.f.afs_watcher_store(self._handle(), watcher_id, value, ctypes.byref(stamp))
        self._s.check(rc, "storing into watcher", self.provider)
        return stamp.value

    def send(self, what: str, peer_id: int, data: bytes) -> int:
        out = ctypes.c_uint64()
        rc = self._s.f.afs_send(self._handle(), peer_id, data, len(data), out)
        if rc:
            self._s.check(rc, what, self.provider)
        return out.value

    def expect_imm(self, imm: int, count: int) -> int:
        out = ctypes.c_uint64()
        rc = self._s.f.afs_expect_imm(self._handle(), imm, count, out)
        if rc:
            self._s.check(rc, f"expect_imm({imm}, {count})", self.provider)
        return out.value

    def cancel(self, op_id: int) -> None:
        if self._h is not None:
            self._s.check(self._s.f.afs_cancel(self._h, op_id), "cancel", self.provider)

    def imm_return(self, imm: int, count: int) -> None:
        if self._h is not None:
            self._s.check(self._s.f.afs_imm_return(self._h, imm, count), "imm_return", self.provider)

    def release_recv(self, slots: list[int]) -> None:
        """Gives kept receive buffers (Event.slot) back to the provider."""
        arr = (ctypes.c_uint32 * len(slots))(*slots)
        rc = self._s.f.afs_recv_release(self._handle(), arr, len(slots))
        self._s.check(rc, "releasing receive buffers", self.provider)

    def pending_wait(self, max_ns: int) -> int:
        """Records a drain would return now, looking for up to ``max_ns`` (spinning in C, the
        GIL released) until there is one: a cheap look for a loop that polls (it asks the
        worker not to signal the event fd, as ``drain(poll=True)`` does)."""
        h = self._h
        return 0 if h is None else self._pending_wait(h, max_ns)

    def drain(
        self, room: Callable[[], int] | None = None, plain: list[int] | None = None, poll: bool = False
    ) -> list[Event]:
        """Every completion ready now (one ctypes call per 256 records). Receive buffers
        go back to the provider at once, except those of messages beyond the first
        ``room()`` (asked at the first message; None: no limit): their events carry the
        slot, for release_recv. With ``plain``, successful DONE records with nothing
        attached (the common case) go into it as operation ids, no Event made (per-operation
        cost, docs/internals/architecture.md); everything else comes back as Events.
        ``poll``: the caller looks again soon, so the worker is asked not to signal the event
        fd (afs_poll); the caller's last look must be a plain drain. The loop's thread only
        (Engine: the ring and its count are that thread's)."""
        h = self._h
        if h is None:
            raise errors.EngineClosed("engine is closed")
        fn = self._poll_hot if poll else self._drain_hot
        out: list[Event] = []
        release: list[int] = []
        left: list[int | None] = [None] if room is None else []
        ring, batch, count = self._ring_p, self._batch, self._count
        while True:
            rc = fn(h, ring, batch, self._count_p)
            if rc:
                self._s.check(rc, "draining completions", self.provider)
            n = count.value
            if n == 0:
                break
            if plain is not None and self._all_plain(n):
                plain += self._cols["id"][:n].tolist()
            else:
                self._records(n, room, left, plain, out, release)
            if n < self.DRAIN_BATCH:
                break
        if release:
            arr = (ctypes.c_uint32 * len(release))(*release)
            rc = self._s.f.afs_recv_release(h, arr, len(release))
            self._s.check(rc, "releasing receive buffers", self.provider)
        return out

    def _all_plain(self, n: int) -> bool:
        """Whether the ring's first ``n`` records are all plain successes: one look per
        column (numpy), worth it from COLUMNS_FROM records on."""
        if n < self.COLUMNS_FROM:
            return False
        b = self._cols[:n]
        attached = b["status"].any() or b["data"].any() or b["release_later"].any()
        return not (attached or (b["kind"] != C_DONE).any())

    def _records(
        self,
        n: int,
        room: Callable[[], int] | None,
        left: list[int | None],
        plain: list[int] | None,
        out: list[Event],
        release: list[int],
    ) -> None:
        """drain()'s record-by-record pass over the ring's first ``n``. ``left`` holds what
        is left of the room for messages once a message asked for it (None: no limit)."""
        ring, head, size = self._ring, _RECORD_HEAD.unpack_from, self._RECORD_SIZE
        for i in range(n):
            rid, status, kind, data, length, slot, later = head(self._ring_bytes, i * size)
            if kind == C_DONE and plain is not None and not (status or data or later):
                plain.append(rid)
            elif kind == C_RECV:
                if not left:
                    left.append(room() if room is not None else None)
                room_left = left[0]
                keep = room_left is not None and room_left <= 0
                payload = ctypes.string_at(data, length)
                out.append(Event(kind, rid, 0, payload, None, False, slot=slot if keep else -1))
                if not keep:
                    release.append(slot)
                if room_left is not None:
                    left[0] = room_left - 1
            elif kind in (C_DONE, C_STUCK):
                text = None
                if data:
                    text = ctypes.string_at(data).decode(errors="replace")
                    self._s.f.afs_text_free(data)
                out.append(Event(kind, rid, status, None, text, bool(later), ring[i].first_post_ns))
            else:
                out.append(self._other_event(ring[i]))

    def _other_event(self, c: Completion) -> Event:
        """Records other than RECV and DONE. PEER: payload the peer's address, its pid (0:
        unknown) and flags (1: its process is watched; 2: down because stopped); the shim's
        copy of the address is freed here."""
        kind = c.kind
        if kind == C_WATCH:
            return Event(kind, c.id, 0, None, None, False, 0, c.watch_old, c.watch_new)
        if kind == C_NOTICE:
            return Event(kind, c.id, 0, None, None, False, total=c.total)
        if kind in (C_PEER, C_HELLO):
            blob = ctypes.string_at(c.data, c.len) if c.data else b""
            if c.data:
                self._s.f.afs_text_free(c.data)
            pid, flags = c.peer_pid, c.peer_flags
            return Event(kind, c.id, c.status, blob, None, False, peer_pid=pid, peer_flags=flags)
        return Event(kind, c.id, c.status, None, None, False)

    def bench_write(self, mr_id: int, remote_id: int, length: int, window: int, iters: int) -> int:
        ns = ctypes.c_uint64()
        h = self._handle()
        rc = self._s.f.afs_bench_write(h, mr_id, remote_id, length, window, iters, ctypes.byref(ns))
        self._s.check(rc, "raw benchmark", self.provider)
        return ns.value

    def bench_write_lat(self, mr_id: int, remote_id: int, length: int, iters: int) -> npt.NDArray[np.uint64]:
        """The raw C loop of writes one at a time: each one's ns from submission to completion."""
        out = np.zeros(iters, dtype=np.uint64)
        h = self._handle()
        rc = self._s.f.afs_bench_write_lat(
            h, mr_id, remote_id, length, iters, out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
        )
        self._s.check(rc, "raw benchmark", self.provider)
        return out

    def bench_read(self, mr_id: int, remote_id: int, length: int, window: int, iters: int) -> int:
        """The raw C loop of contiguous reads (elapsed ns), as bench_write."""
        ns = ctypes.c_uint64()
        h = self._handle()
        rc = self._s.f.afs_bench_read(h, mr_id, remote_id, length, window, iters, ctypes.byref(ns))
        self._s.check(rc, "raw benchmark", self.provider)
        return ns.value

    def bench_paged(
        self,
        mr_id: int,
        remote_id: int,
        page_len: int,
        src_idx: npt.NDArray[np.int64],
        dst_idx: npt.NDArray[np.int64],
        window: int,
        iters: int,
    ) -> int:
        ns = ctypes.c_uint64()
        rc = self._s.f.afs_bench_paged(
            self._handle(), mr_id, remote_id, page_len, int(src_idx.shape[0]),
            src_idx.ctypes.data, dst_idx.ctypes.data, window, iters, ctypes.byref(ns),
        )  # fmt: skip
        self._s.check(rc, "raw paged benchmark", self.provider)
        return ns.value

    def error(self, status: int, what: str, text: str | None) -> errors.AfabricError:
        name, generic = self._s.codes.get(status, (f"E{status}", "unknown error code"))
        return errors.from_code(name, status, what, text or generic, self.provider)
