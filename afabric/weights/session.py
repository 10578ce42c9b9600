"""A transfer session over torch.distributed: every trainer and inference rank calls
:meth:`WeightTransfer.connect` together, then :meth:`WeightTransfer.update` once per step.

torch.distributed (a gloo group) is the control plane: parameter metadata and descriptors
are gathered with ``all_gather_object``, the plan is built on the first trainer and
broadcast, and every update ends with one all-reduce of each rank's outcome, bounded by
``timeout``. Data moves only through the engine: each training rank runs its part of the
plan (see :mod:`afabric.weights.sender`), the inference ranks do nothing but wait for the
outcome and check the version words.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, UsageError
from .layout import DestTensor, RankLayout
from .meta import SourceParam, source_of
from .plan import Plan, PlanOptions, build_plan
from .progress import ProgressCallback, UpdateProgress
from .receiver import Receiver, WeightUpdateFailed
from .worker import Worker

if TYPE_CHECKING:
    from ..engine import Engine
    from .sender import Sender


@dataclass
class UpdateStats:
    """One update as this rank saw it."""

    version: int
    method: str  # "p2p" or "rank0"
    seconds: float
    bytes_sent: int  # by this rank (0 on inference ranks for p2p)
    bytes_received: int  # into this rank's buffer
    staging_peak: int = 0


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("torch.distributed must be initialised (init_process_group) before connecting")
    return dist


class WeightTransfer:
    """One rank's end of a weight transfer session (a trainer or an inference rank)."""

    engine: Engine
    rank: int
    trainers: list[int]
    inference: list[int]
    role: str
    """"trainer" or "inference"."""
    timeout: float
    progress: bool | None
    plan: Plan
    layouts: list[RankLayout]
    receiver: Receiver | None
    """The inference rank's weights (None on trainers)."""
    sender: Sender | None
    ctrl: Any
    trainer_group: Any
    inference_group: Any
    _ctl: Worker
    _broken: str | None
    _last_version: int
    _sent: int
    _received: int
    _arrivals: int

    def __init__(self) -> None:
        raise UsageError("use `await WeightTransfer.connect(...)`")

    @classmethod
    async def connect(
        cls,
        engine: Engine,
        *,
        trainers: Sequence[int],
        inference: Sequence[int],
        params: Mapping[str, Any] | None = None,
        tensors: Sequence[DestTensor] | None = None,
        options: PlanOptions | None = None,
        staging_bytes: int = 64 << 20,
        device: str | None = None,
        dest_device: str = "cpu",
        timeout: float = 60.0,
        progress: bool | None = None,
    ) -> WeightTransfer:
        """Join the session (collective over every rank of the default process group).

        Args:
            engine: this rank's engine.
            trainers: the training ranks (global ranks).
            inference: the inference ranks (global ranks).
            params: on trainers, name -> DTensor (or a plain tensor held whole).
            tensors: on inference ranks, their ``DestTensor`` s.
            options: how the plan is built.
            staging_bytes: a trainer's staging buffer, the watermark on converted slices in flight.
            device: where trainers slice, fuse and quantise (default: where each parameter
                lives; ``"cuda"`` copies host-resident shards there first).
            dest_device: where an inference rank's buffer lives (registrable with the engine's
                provider).
            timeout: seconds that bound every control step and every update.
            progress: print progress lines to stderr (default: when it is a terminal).

        Returns:
            The session.

        Raises:
            InvalidArgument: a rank is both trainer and inference, lacks its params or
                tensors, or the plan cannot cover the tensors.
        """
        dist = _dist()
        self = object.__new__(cls)
        self.engine = engine
        self.rank = int(dist.get_rank())
        self.trainers = [int(r) for r in trainers]
        self.inference = [int(r) for r in inference]
        world = int(dist.get_world_size())
        if set(self.trainers) & set(self.inference):
            raise InvalidArgument("a rank cannot be both trainer and inference")
        if sorted(self.trainers + self.inference) != list(range(world)):
            raise InvalidArgument(
                f"trainers and inference ranks must be exactly the {world} ranks of the process group"
            )
        self.role = "trainer" if self.rank in self.trainers else "inference"
        if self.role == "trainer" and params is None:
            raise InvalidArgument(f"rank {self.rank} is a trainer: pass params=")
        if self.role == "inference" and tensors is None:
            raise InvalidArgument(f"rank {self.rank} is an inference rank: pass tensors=")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgument("timeout must be a positive number of seconds")
        self.timeout = float(timeout)
        self.progress = progress
        self._ctl = Worker(f"afabric-weights-ctl-{self.rank}")
        self._broken = None
        self._last_version = -1
        self.receiver = None
        self.sender = None
        tmo = timedelta(seconds=self.timeout)
        self.ctrl = await self._control(lambda: dist.new_group(backend="gloo", timeout=tmo), "new_group")
        self.trainer_group = await self._control(
            lambda: dist.new_group(self.trainers, backend="gloo", timeout=tmo), "new_group"
        )
        self.inference_group = await self._control(
            lambda: dist.new_group(self.inference, backend="gloo", timeout=tmo), "new_group"
        )
        peers = await self._exchange(params, tensors, dest_device)
        self.layouts = [RankLayout(peers[r][0], len(self.trainers)) for r in self.inference]
        self.plan = await self._agree_plan(peers["sources"], options)
        self._sent = self.plan.sent_bytes().get(self.rank, 0)
        self._received = self.plan.received_bytes().get(self.rank, 0)
        self._arrivals = self.plan.arrivals(self.rank) if self.rank in self.inference else 0
        if self.role == "trainer":
            from .sender import Sender

            assert params is not None
            self.sender = Sender(
                engine, self.plan, self.rank, params,
                descs=[peers[r][1] for r in self.inference], addresses=[peers[r][2] for r in self.inference],
                imms=[peers[r][3] for r in self.inference], staging_bytes=staging_bytes, device=device,
            )  # fmt: skip
        return self

    async def _exchange(
        self, params: Mapping[str, Any] | None, tensors: Sequence[DestTensor] | None, dest_device: str
    ) -> dict[Any, Any]:
        """Gather every rank's metadata: ``{inference rank: (tensors, descriptor, address,
        immediate)}`` on every rank, and ``"sources"``: every trainer's parameter metadata,
        on the first trainer only (it plans)."""
        dist = _dist()
        world = dist.get_world_size()
        payload: tuple[Any, ...] = ("trainer", self.rank)
        metas: list[SourceParam] = []
        if tensors is not None:
            self.receiver = Receiver(self.engine, list(tensors), len(self.trainers), dest_device)
            desc, addr = bytes(self.receiver.mr.descriptor), bytes(self.engine.address)
            payload = ("inference", self.rank, self.receiver.layout.tensors, desc, addr, self.receiver.imm)
        else:
            assert params is not None
            metas = [source_of(n, t, rank=self.rank) for n, t in params.items()]
        gathered: list[Any] = [None] * world
        await self._control(lambda: dist.all_gather_object(gathered, payload, group=self.ctrl), "gather")
        first = self.trainers[0]
        every: list[Any] | None = [None] * world if self.rank == first else None
        await self._control(
            lambda: dist.gather_object(metas, every, dst=first, group=self.ctrl), "gather parameters"
        )
        out: dict[Any, Any] = {"sources": [m for ms in every or [] for m in ms]}
        for item in gathered:
            if item[0] == "inference":
                out[item[1]] = item[2:]
        return out

    async def _agree_plan(self, metas: list[SourceParam], options: PlanOptions | None) -> Plan:
        """The first trainer builds the plan; every rank gets it (or the reason it failed)."""
        dist = _dist()
        box: list[Any] = [None]
        if self.rank == self.trainers[0]:
            try:
                sources: dict[str, SourceParam] = {}
                for m in metas:
                    seen = sources.setdefault(m.name, m)
                    if seen != m:
                        raise InvalidArgument(f"trainers disagree about {m.name}: {seen} vs {m}")
                plan = build_plan(
                    sources, self.layouts, trainers=self.trainers, inference=self.inference, options=options
                )
                box[0] = plan.to_bytes()
            except InvalidArgument as e:
                box[0] = f"{e}"
        await self._control(
            lambda: dist.broadcast_object_list(box, src=self.trainers[0], group=self.ctrl), "plan broadcast"
        )
        if isinstance(box[0], str):
            raise InvalidArgument(f"planning failed: {box[0]}")
        return Plan.from_bytes(box[0])

    # ---- control plane ----

    async def _control(self, fn: Any, what: str) -> Any:
        """A blocking torch.distributed call on the control thread, bounded by the timeout."""
        try:
            return await asyncio.wait_for(self._ctl.call(fn), self.timeout + 5.0)
        except (asyncio.TimeoutError, RuntimeError, ValueError, OSError) as e:
            self._broken = f"{what} failed: {type(e).__name__}: {e}"
            raise WeightUpdateFailed(
                f"rank {self.rank}: control step '{what}' failed ({type(e).__name__}: {e}); a rank "
                "died or stalled"
            ) from e

    async def _agree(self, ok: bool, version: int) -> bool:
        """Every rank's outcome of this update, combined (all ranks must call)."""
        import torch

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist = _dist()
        await self._control(
            lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.ctrl), f"update {version} outcome"
        )
        return bool(int(flag.item()))

    async def _outcome(self, failure: BaseException | None, version: int) -> bool:
        """:meth:`_agree`, except that when this rank already failed, its own failure is
        what gets reported (the control group often breaks for the same reason)."""
        try:
            return await self._agree(failure is None, version)
        except WeightUpdateFailed:
            if failure is None:
                raise
            return False

    def _check_version(self, version: int) -> None:
        if self._broken is not None:
            raise WeightUpdateFailed(f"rank {self.rank}: the session is broken ({self._broken})")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 < version < 1 << 63:
            raise InvalidArgument(f"version must be an int in 1..2**63-1, got {version!r}")
        if version <= self._last_version:
            raise InvalidArgument(f"version {version} is not newer than {self._last_version}")

    # ---- updates ----

    async def update(self, version: int, *, on_progress: ProgressCallback | None = None) -> UpdateStats:
        """Move the current weights to every inference rank (collective over all ranks).

        Every rank calling it means it is ready: an inference rank must not read its tensors
        until this returns, since they are overwritten in place. Starts with a control-plane
        barrier, so no write lands before every inference rank has entered. Trainers write their
        slices straight into the inference ranks' buffers; inference ranks wait.

        Args:
            version: the version the weights will be whole for (``receiver.version()``).
            on_progress: called with progress as bytes move.

        Returns:
            Timing and byte counts of this rank's part.

        Raises:
            WeightUpdateFailed: on every rank (within ``timeout``) when any rank failed; an
                inference rank then also finds the version words torn.
        """
        self._check_version(version)
        self._last_version = version
        t0 = time.perf_counter()
        await self.barrier()
        sent = 0
        peak = 0
        failure: BaseException | None = None
        if self.sender is not None:
            prog = UpdateProgress(
                f"weights v{version} rank {self.rank}", self._sent,
                show=self.progress, callback=on_progress,
            )  # fmt: skip
            try:
                await asyncio.wait_for(self.sender.run(version, prog), self.timeout)
                sent = prog.done
                peak = self.sender.arena.peak
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                failure = e
            prog.finish()
        elif self.receiver is not None:
            try:
                await self.engine.expect_imm(self.receiver.imm, self._arrivals, timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                failure = e
        all_ok = await self._outcome(failure, version)
        if failure is not None or not all_ok:
            # immediates of the failed update may still arrive: this session cannot count again
            self._broken = f"update {version} failed"
            where = f"failed: {failure}" if failure is not None else "failed on another rank"
            if self.receiver is not None:
                try:
                    self.receiver.check(version)
                except WeightUpdateFailed as torn:
                    where += f"; {torn}"
            raise WeightUpdateFailed(f"rank {self.rank}: update {version} {where}") from failure
        if self.receiver is not None:
            self.receiver.check(version)
        return UpdateStats(version, "p2p", time.perf_counter() - t0, sent, self._received, peak)

    async def update_rank0(self, version: int) -> UpdateStats:
        """The baseline on the same processes and memory: gather, send, scatter.

        Gathers to trainer 0, sends to inference rank 0, which scatters.

        Args:
            version: as in ``update``.

        Returns:
            Timing and byte counts of this rank's part.

        Raises:
            WeightUpdateFailed: when any rank failed.
        """
        from . import rank0

        self._check_version(version)
        self._last_version = version
        t0 = time.perf_counter()
        await self.barrier()
        failure: BaseException | None = None
        sent = received = 0
        try:
            sent, received = await asyncio.wait_for(rank0.run(self, version), self.timeout)
        except WeightUpdateFailed:
            raise
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            failure = e
        all_ok = await self._outcome(failure, version)
        if failure is not None or not all_ok:
            self._broken = f"rank-0 update {version} failed"
            raise WeightUpdateFailed(f"rank {self.rank}: rank-0 update {version} failed: {failure}")
        if self.receiver is not None:
            self.receiver.check(version)
        return UpdateStats(version, "rank0", time.perf_counter() - t0, sent, received)

    async def barrier(self) -> None:
        """All ranks of the session (a control-plane barrier, e.g. to start timing together)."""
        dist = _dist()
        await self._control(lambda: dist.barrier(group=self.ctrl), "barrier")

    def close(self) -> None:
        """Release the staging and destination registrations and the control thread."""
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None and self.receiver.mr.registered and not self.engine.closed:
            self.engine.deregister(self.receiver.mr)
        self._ctl.close()
