"""The C shim as Python's ctypes sees it, once afabric._native has applied its table.

This stub documents the ABI of ``shim/afabric_shim.h`` in Python terms: one signature per
entry of ``afabric._native.FUNCTIONS`` (same names, same parameter count and order), with
the Python values ctypes accepts for each C parameter and what it returns:

- ``uint32_t`` / ``int32_t`` / ``uint64_t`` / ``int64_t`` -> ``int`` (ctypes truncates
  silently, so afabric checks ranges before calling);
- ``const uint8_t *`` / ``const char *`` in-buffers (argtype ``c_char_p``) -> ``bytes``;
- ``char *`` out-buffers -> a ``ctypes.Array[c_char]`` (``create_string_buffer``): never
  ``bytes``, which C must not write into;
- ``T *`` (argtype ``POINTER(T)``) -> ``ctypes.byref(t)``, ``t`` itself, a pointer or an
  array of ``T``;
- ``afs_engine *`` -> :class:`afabric._native.EngineHandle` only (its own type, so no other
  pointer can be passed for it: ctypes rejects it at run time, mypy before);
- ``void *`` (argtype ``c_void_p``) -> an address as ``int``, an array or a ``byref``;
- ``const char *`` results (restype ``c_char_p``) -> ``bytes | None``.

There is no ``afabric_shim`` module at run time: ``afabric._native`` imports
:class:`ShimLib` under ``TYPE_CHECKING`` only and casts its loaded ``ctypes.CDLL`` to it,
so every call into the shim is checked by ``mypy --strict``.
tests/test_stubs.py keeps this file, ``FUNCTIONS`` and the header in step.
"""

from ctypes import (
    Array,
    _CArgObject,
    _CVoidPLike,
    _Pointer,
    c_char,
    c_char_p,
    c_int32,
    c_uint8,
    c_uint32,
    c_uint64,
)
from typing import TypeAlias, TypeVar

from afabric._native import Completion, Config, DescInfo, EngineFacts, EngineHandle, NicStats, OpTimingStruct

_T = TypeVar("_T")

# What ctypes accepts for a `POINTER(T)` argtype (a `T` itself: ctypes passes its address,
# cheaper than a byref object per call).
_Ref: TypeAlias = _T | _Pointer[_T] | Array[_T] | _CArgObject

class ShimLib:
    """``ctypes.CDLL("libafabric_shim.so")`` after ``afabric._native.FUNCTIONS`` is applied.

    Attributes of a ``CDLL`` are foreign functions, not methods: hence ``staticmethod``.
    """

    # ---- version and the error table ----

    @staticmethod
    def afs_abi_version() -> int:
        """uint32_t afs_abi_version(void): AFS_ABI_VERSION the library was built with."""

    @staticmethod
    def afs_error_count() -> int:
        """int32_t afs_error_count(void): entries in AFS_ERROR_TABLE."""

    @staticmethod
    def afs_error_info(index: int, code: _Ref[c_int32], name: _Ref[c_char_p], text: _Ref[c_char_p]) -> int:
        """Entry ``index`` of AFS_ERROR_TABLE: its code, name ("EINVAL") and text (static)."""

    @staticmethod
    def afs_last_error() -> bytes | None:
        """This thread's detail text of the last failing call (read it right after)."""

    @staticmethod
    def afs_text_free(text: int) -> None:
        """Free the error text of a DONE completion (``afs_completion.data``)."""

    # ---- providers and engines ----

    @staticmethod
    def afs_provider_probe(
        cfg: _Ref[Config],
        nics_out: _CVoidPLike | None,
        max: int,
        count: _Ref[c_uint32],
        name_out: Array[c_char],
        name_len: int,
    ) -> int:
        """NICs the provider library of ``cfg`` sees, as ``NicInfoStruct[max]``, without an engine."""

    @staticmethod
    def afs_engine_create(cfg: _Ref[Config], out: _Ref[EngineHandle]) -> int: ...
    @staticmethod
    def afs_engine_destroy(eng: EngineHandle) -> int: ...
    @staticmethod
    def afs_engine_info(eng: EngineHandle, out: _Ref[EngineFacts]) -> int: ...
    @staticmethod
    def afs_engine_stats(eng: EngineHandle, nic: int, out: _Ref[NicStats]) -> int:
        """Counters of one NIC of the engine's group."""

    @staticmethod
    def afs_engine_address(eng: EngineHandle, buf: _Ref[c_uint8], cap: int, len: _Ref[c_uint32]) -> int:
        """The engine's address bytes (all its NICs) into ``buf[cap]``; ``*len`` = size."""

    # ---- memory, descriptors, peers ----

    @staticmethod
    def afs_mr_register(
        eng: EngineHandle,
        addr: int,
        len: int,
        flags: int,
        device: int,
        mr_id: _Ref[c_uint64],
        desc: _Ref[c_uint8],
        cap: int,
        desc_len: _Ref[c_uint32],
    ) -> int:
        """Register ``[addr, addr+len)`` (MR_REMOTE/MR_DEVICE flags; device -1 = host)."""

    @staticmethod
    def afs_mr_deregister(eng: EngineHandle, mr_id: int) -> int: ...
    @staticmethod
    def afs_desc_decode(buf: bytes, len: int, out: _Ref[DescInfo]) -> int: ...
    @staticmethod
    def afs_address_check(buf: bytes, len: int, incarnation: _Ref[c_uint64], nics: _Ref[c_uint32]) -> int: ...
    @staticmethod
    def afs_remote_import(eng: EngineHandle, desc: bytes, len: int, remote_id: _Ref[c_uint64]) -> int: ...
    @staticmethod
    def afs_remote_release(eng: EngineHandle, remote_id: int) -> int: ...
    @staticmethod
    def afs_peer_resolve(eng: EngineHandle, addr: bytes, len: int, peer_id: _Ref[c_uint64]) -> int: ...
    @staticmethod
    def afs_allow_peers(eng: EngineHandle, blobs: bytes, lens: _Ref[c_uint32], count: int, flags: int) -> int:
        """Only these peers (addresses concatenated in ``blobs``) may be reached or deliver
        messages and immediates (flags ALLOW_ON [| ALLOW_UNKNOWN]); ``flags=0``: every peer."""

    # ---- operations (each one enqueue; the result arrives through afs_drain) ----

    @staticmethod
    def afs_write(
        eng: EngineHandle,
        mr_id: int,
        remote_id: int,
        length: int,
        src_offset: int,
        dst_offset: int,
        imm: int,
        trig_kind: int,
        trig_a: int,
        trig_b: int,
        xfer_id: _Ref[c_uint64],
    ) -> int:
        """One write; ``imm`` = AFS_NO_IMM (-1) for none, else a 32-bit immediate; the
        trigger (AFS_TRIG_NONE = 0: post now) holds it until a watcher value or count."""

    @staticmethod
    def afs_write_dynlen(
        eng: EngineHandle,
        mr_id: int,
        remote_id: int,
        max_length: int,
        src_offset: int,
        dst_offset: int,
        imm: int,
        len_mr_id: int,
        len_offset: int,
        len_base: int,
        len_scale: int,
        trig_kind: int,
        trig_a: int,
        trig_b: int,
        xfer_id: _Ref[c_uint64],
    ) -> int:
        """A write of clamp(len_base + len_scale * n, 0, max_length) bytes, ``n`` the u32 at
        ``len_offset`` of host region ``len_mr_id``, read when the write starts."""

    @staticmethod
    def afs_write_paged(
        eng: EngineHandle,
        mr_id: int,
        remote_id: int,
        page_len: int,
        count: int,
        src_idx: _CVoidPLike | None,
        src_stride: int,
        src_offset: int,
        dst_idx: _CVoidPLike | None,
        dst_stride: int,
        dst_offset: int,
        imm: int,
        trig_kind: int,
        trig_a: int,
        trig_b: int,
        xfer_id: _Ref[c_uint64],
    ) -> int:
        """``count`` pages; ``src_idx``/``dst_idx`` address ``int64_t[count]`` (numpy ``.ctypes.data``)."""

    @staticmethod
    def afs_scatter(
        eng: EngineHandle,
        mr_id: int,
        count: int,
        remote_ids: _CVoidPLike | None,
        lengths: _CVoidPLike | None,
        src_offsets: _CVoidPLike | None,
        dst_offsets: _CVoidPLike | None,
        imm: int,
        trig_kind: int,
        trig_a: int,
        trig_b: int,
        xfer_id: _Ref[c_uint64],
    ) -> int:
        """One write per target (``uint64_t[count]`` arrays); NULL lengths: a barrier."""

    @staticmethod
    def afs_watcher_create(
        eng: EngineHandle,
        device: int,
        watcher_id: _Ref[c_uint64],
        host_ptr: _Ref[c_uint64],
        device_ptr: _Ref[c_uint64],
    ) -> int:
        """A watched 64-bit word (device >= 0: mapped into that CUDA device)."""

    @staticmethod
    def afs_watcher_destroy(eng: EngineHandle, watcher_id: int) -> int: ...
    @staticmethod
    def afs_watcher_add(eng: EngineHandle, watcher_id: int, delta: int, value: _Ref[c_uint64]) -> int: ...

    @staticmethod
    def afs_send(eng: EngineHandle, peer_id: int, buf: bytes, len: int, xfer_id: _Ref[c_uint64]) -> int: ...
    @staticmethod
    def afs_expect_imm(eng: EngineHandle, imm: int, count: int, xfer_id: _Ref[c_uint64]) -> int: ...
    @staticmethod
    def afs_cancel(eng: EngineHandle, xfer_id: int) -> int: ...
    @staticmethod
    def afs_imm_return(eng: EngineHandle, imm: int, count: int) -> int: ...

    # ---- completions ----

    @staticmethod
    def afs_drain(eng: EngineHandle, out: _Ref[Completion], max: int, count: _Ref[c_uint32]) -> int:
        """Up to ``max`` completion records into ``out``; ``*count`` = how many."""

    @staticmethod
    def afs_timing_drain(
        eng: EngineHandle,
        out: _Ref[OpTimingStruct],
        max: int,
        count: _Ref[c_uint32],
        dropped: _Ref[c_uint64],
    ) -> int:
        """Timing records of completed operations (engines created with AFS_CFG_TIMING)."""

    @staticmethod
    def afs_recv_release(eng: EngineHandle, slots: _Ref[c_uint32], count: int) -> int: ...

    # ---- raw benchmark loops (no Python per operation) ----

    @staticmethod
    def afs_bench_write(
        eng: EngineHandle,
        mr_id: int,
        remote_id: int,
        length: int,
        window: int,
        iters: int,
        elapsed_ns: _Ref[c_uint64],
    ) -> int: ...
    @staticmethod
    def afs_bench_paged(
        eng: EngineHandle,
        mr_id: int,
        remote_id: int,
        page_len: int,
        count: int,
        src_idx: _CVoidPLike | None,
        dst_idx: _CVoidPLike | None,
        window: int,
        iters: int,
        elapsed_ns: _Ref[c_uint64],
    ) -> int: ...
