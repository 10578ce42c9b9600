"""Where an operation's microseconds went: the stages the shim stamps when an engine is
created with ``timing=True`` (application call -> enqueue -> worker pickup -> first work
request posted -> last posted -> completion, the events the paper instruments)."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = {2: "write", 3: "paged", 4: "send", 8: "scatter", 18: "read", 19: "paged read", 24: "gather"}
STAGES = ("queued", "to_first_post", "posting", "in_flight", "total")


@dataclass(frozen=True)
class OpTiming:
    """One completed operation; times are CLOCK_MONOTONIC ns (``time.monotonic_ns()``),
    0 where a stage was never reached (an operation that failed before posting). For an
    operation triggered by a watcher, ``t_pickup`` is when the change that fired it was seen
    (``to_first_post``: from there to its first work request)."""

    id: int
    kind: str
    status: int
    work_requests: int
    t_enqueue: int
    t_pickup: int
    t_first_post: int
    t_last_post: int
    t_complete: int

    @classmethod
    def from_record(cls, rec: tuple[int, ...]) -> OpTiming:
        """A record as the shim's timing ring holds it.

        Args:
            rec: the record's fields in ``afs_timing`` order.

        Returns:
            The timing.
        """
        op_id, kind, status, wrs, *stamps = rec
        return cls(op_id, KINDS.get(kind, str(kind)), status, wrs, *stamps)

    def stages_ns(self) -> dict[str, int]:
        """How long each stage took.

        Returns:
            ns by stage: ``queued`` (in the submit queue), ``to_first_post`` (pickup to first
            work request), ``posting`` (first to last), ``in_flight`` (last post to completion)
            and ``total`` (enqueue to completion).
        """
        return {
            "queued": self.t_pickup - self.t_enqueue,
            "to_first_post": self.t_first_post - self.t_pickup if self.t_first_post else 0,
            "posting": self.t_last_post - self.t_first_post if self.t_last_post else 0,
            "in_flight": self.t_complete - self.t_last_post if self.t_last_post else 0,
            "total": self.t_complete - self.t_enqueue,
        }
