"""The host proxy for peers on other nodes: pre-built triggered operations in the shim.

The proxy owns an :class:`afabric.Engine` on its own event-loop thread (so a caller that
blocks on its CUDA stream never starves it) and pinned, GPU-mapped host regions: per
peer a send and a receive slot for dispatch and for combine (two of each, by call
parity), and two flag words the receive kernels spin on.

Per call (epoch ``s``) it arms, ahead of the kernels, for every proxy peer:
  1. a write of the header, the routes and up to ``max_private_tokens`` rows of the peer's
     send slot into this rank's private slot at the peer, with immediate ``I(s)``, fired by
     the shim when the send kernel bumps the watcher to ``s`` (the kernel does so before any
     of its NVLink stores);
  2. if ``max_private_tokens`` < ``max_tokens``, a second write with the rows past them;
and one write of the epoch into this rank's own flag word, fired by the shim once every
expected arrival of ``I(s)`` was counted (``imm_count``): the receive kernel spins on that
word. Both writes take their length from the slot's token count, which the kernel stores
before the bump (``length_from``): the shim reads it when they fire, so a call moves the
rows its routes need, never the slot's capacity (an empty second phase still delivers its
immediate). Combine arms one write per peer (the partial sums, reusing dispatch's routing:
as many rows as the peer sent tokens, read from the count in its dispatch slot here) and
the same flag write. No Python runs between the kernel's bump and the posts, nor between
the last arrival and the flag.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .. import Engine, LengthFrom, MrDesc
from ..errors import AfabricError, UsageError
from ..triggers import imm_count
from .config import MoeConfig

T = TypeVar("T")
EPOCH_RING = 1 << 16  # epochs a host may run ahead of the GPU (imm values and flag sources)
_DISPATCH, _COMBINE = 0, 1


@dataclass(frozen=True, eq=False)
class HostRegion:
    """Host memory the proxy's engine reads or writes: ``host`` for the CPU, ``dev`` for
    kernels. Pinned and mapped into the GPU for a CUDA rank; a plain numpy buffer
    (``array``) for a rank without a GPU (the proxy's own tests)."""

    host: int
    dev: int
    nbytes: int
    array: np.ndarray[Any, np.dtype[np.uint8]] | None = None


def _region(nbytes: int, device: int | None) -> HostRegion:
    if device is None:
        arr = np.zeros(nbytes, dtype=np.uint8)
        addr = int(arr.__array_interface__["data"][0])
        return HostRegion(addr, addr, nbytes, arr)
    import cupy

    rt = cupy.cuda.runtime
    host = int(rt.hostAlloc(nbytes, 3))  # cudaHostAllocPortable | Mapped
    # with unified addressing (every 64-bit CUDA platform) the GPU sees it at the same
    # address, and the runtime can clear it (the flag words must start below epoch 1)
    dev = int(rt.pointerGetAttributes(host).devicePointer)
    rt.memset(dev, 0, nbytes)
    rt.deviceSynchronize()
    return HostRegion(host, dev, nbytes)


def _free(region: HostRegion) -> None:
    if region.array is None:
        import cupy

        cupy.cuda.runtime.freeHost(region.host)


class Proxy:
    """Engine, regions and armed operations for this rank's proxy peers."""

    def __init__(
        self,
        cfg: MoeConfig,
        rank: int,
        peers: list[int],
        provider: str,
        tag: int,
        device: int | None,
        bind: str | None = None,
    ) -> None:
        self.cfg = cfg
        # the loop thread has its own current CUDA device: never ask it. None: no GPU (tests)
        self.device = device
        self.rank = rank
        self.peers = peers
        self.tag = tag
        n = cfg.world_size
        lay = cfg.slot_layout()
        self.dslot = lay.slot_bytes
        self.cslot = cfg.combine_slot_bytes
        self.phases = 1 if cfg.private_tokens >= cfg.max_tokens else 2
        self.lengths = (lay.private_bytes(cfg.private_tokens), lay.private_bytes(cfg.max_tokens))
        self.row_bytes, self.off_rows = lay.row_bytes, lay.off_rows
        self.out_row_bytes = cfg.hidden * cfg.out_itemsize
        self.last_dispatch = 0  # epoch of the dispatch that combine answers
        self._regions: list[HostRegion] = []
        self.epochs = np.zeros(EPOCH_RING, dtype=np.uint64)  # sources of the flag writes
        self._pending: set[concurrent.futures.Future[None]] = set()
        self._errors: list[BaseException] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="afabric-moe-proxy", daemon=True)
        try:
            self.dsend = self._new_region(2 * n * self.dslot)
            self.drecv = self._new_region(2 * n * self.dslot)
            self.csend = self._new_region(2 * n * self.cslot)
            self.crecv = self._new_region(2 * n * self.cslot)
            self.flags = self._new_region(4096)  # [0]: dispatch epoch, [8]: combine epoch
            self._thread.start()
            self.eng: Engine = self._call(self._open(provider, bind))
        except BaseException:
            self._stop()
            raise

    def _new_region(self, nbytes: int) -> HostRegion:
        region = _region(nbytes, self.device)
        self._regions.append(region)
        return region

    # ---- the loop thread ----

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open(self, provider: str, bind: str | None) -> Engine:
        eng = Engine(provider, name=f"moe-proxy-{self.rank}", bind=bind)
        try:
            reg = eng.register_ptr
            self.mr_dsend = reg(self.dsend.host, self.dsend.nbytes, remote=False)
            self.mr_csend = reg(self.csend.host, self.csend.nbytes, remote=False)
            self.mr_drecv = reg(self.drecv.host, self.drecv.nbytes)
            self.mr_crecv = reg(self.crecv.host, self.crecv.nbytes)
            self.mr_flags = reg(self.flags.host, self.flags.nbytes)
            self.mr_epochs = eng.register(self.epochs, remote=False)
            self.w_dispatch = eng.uvm_watcher(device=self.device)
            self.w_combine = eng.uvm_watcher(device=self.device)
        except BaseException:
            eng.close()
            raise
        return eng

    def descs(self) -> tuple[bytes, ...]:
        """What peers need: this rank's dispatch and combine receive regions and flags."""
        out: list[bytes] = []
        for mr in (self.mr_drecv, self.mr_crecv, self.mr_flags):
            d = mr.descriptor
            assert d is not None
            out.append(bytes(d))
        return tuple(out)

    def connect(self, descs: dict[int, tuple[bytes, ...]]) -> None:
        """Remember each proxy peer's regions (``descs[r]`` as sent by :meth:`descs`)."""
        self.remote: dict[int, tuple[MrDesc, MrDesc]] = {}
        for r in self.peers:
            if len(descs[r]) != 3:
                raise UsageError(f"rank {r} sent {len(descs[r])} proxy descriptors, expected 3")
            self.remote[r] = (MrDesc.from_bytes(descs[r][0]), MrDesc.from_bytes(descs[r][1]))
        own = self.mr_flags.descriptor
        assert own is not None
        self.own_flags: MrDesc = own

    def imm(self, direction: int, epoch: int) -> int:
        return (self.tag << 17) | (direction << 16) | (epoch % EPOCH_RING)

    # ---- per call ----

    def arm_dispatch(self, epoch: int) -> None:
        self.last_dispatch = epoch
        self._submit(self._arm(_DISPATCH, epoch, epoch))

    def arm_combine(self, epoch: int) -> None:
        self._submit(self._arm(_COMBINE, epoch, self.last_dispatch))  # read here, not on the loop

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        self.raise_errors()
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._pending.add(fut)
        fut.add_done_callback(self._reap)

    def _reap(self, fut: concurrent.futures.Future[None]) -> None:
        self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            self._errors.append(fut.exception())  # type: ignore[arg-type]

    def raise_errors(self) -> None:
        if self._errors:
            e = self._errors[0]
            raise AfabricError(f"MoE proxy operation failed: {e}") from e

    async def _arm(self, direction: int, epoch: int, d_epoch: int) -> None:
        eng = self.eng
        parity = epoch & 1
        n = self.cfg.world_size
        imm = self.imm(direction, epoch)
        self.epochs[epoch % EPOCH_RING] = epoch
        when = (self.w_dispatch if direction == _DISPATCH else self.w_combine).reaches(epoch)
        ops: list[Coroutine[Any, Any, None]] = []
        d_parity = d_epoch & 1
        for r in self.peers:
            desc = self.remote[r][direction]
            if direction == _DISPATCH:
                src = (parity * n + r) * self.dslot
                dst = (parity * n + self.rank) * self.dslot
                # header + routes + min(count, P) rows, then max(count - P, 0) rows
                p_rows = self.lengths[0] - self.off_rows
                ops.append(eng.write(
                    self.mr_dsend, desc, self.lengths[0], src, dst, imm=imm, when=when,
                    length_from=LengthFrom(self.mr_dsend, src, self.row_bytes, self.off_rows),
                ))  # fmt: skip
                if self.phases == 2:
                    off = self.lengths[0]
                    ops.append(eng.write(
                        self.mr_dsend, desc, self.lengths[1] - off, src + off, dst + off, imm=imm, when=when,
                        length_from=LengthFrom(self.mr_dsend, src, self.row_bytes, -p_rows),
                    ))  # fmt: skip
            else:
                src = (parity * n + r) * self.cslot
                dst = (parity * n + self.rank) * self.cslot
                count_at = (d_parity * n + r) * self.dslot  # tokens r sent in that dispatch
                ops.append(eng.write(
                    self.mr_csend, desc, self.cslot, src, dst, imm=imm, when=when,
                    length_from=LengthFrom(self.mr_drecv, count_at, self.out_row_bytes),
                ))  # fmt: skip
        arrivals = len(self.peers) * (self.phases if direction == _DISPATCH else 1)
        ops.append(
            eng.write(
                self.mr_epochs, self.own_flags, 8, 8 * (epoch % EPOCH_RING), 8 * direction,
                when=imm_count(imm, arrivals),
            )
        )  # fmt: skip
        await asyncio.gather(*ops)

    def flag_dev(self, direction: int) -> int:
        return self.flags.dev + 8 * direction

    # ---- lifetime ----

    def close(self) -> None:
        """Disarm what is still armed, close the engine, stop the thread, free the memory."""
        if not self._thread.is_alive():
            return
        for fut in list(self._pending):
            fut.cancel()
        try:
            self._call(self.eng.aclose(timeout=5.0), timeout=30.0)
        finally:
            self._stop()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30.0)
        if not self._thread.is_alive():
            self._loop.close()
        regions, self._regions = self._regions, []
        for region in regions:
            _free(region)
