"""The shape of :meth:`Engine.stats` (typed, so ``mypy --strict`` checks every key read)."""

from __future__ import annotations

from typing import TypedDict


class NicStats(TypedDict):
    """Counters of one NIC of the group (the shim's ``afs_nic_stats``, plus ``outstanding``)."""

    writes: int  # write work requests posted
    write_bytes: int  # bytes they carried
    reads: int  # read work requests posted (``completions`` counts them too)
    read_bytes: int  # bytes they asked for
    sends: int
    recvs: int
    imms: int  # immediates that arrived
    errors: int  # failed work requests, receives included (e.g. an oversize message)
    retries: int  # posts the provider answered with "try again"
    landed: int  # remote writes seen landing here (where the provider counts them)
    completions: int  # write, read and send work requests completed (with or without error)
    rejected: int  # messages/immediates dropped: sender not on the allow-list
    rejected_unknown: int  # dropped while a list is set: the provider cannot name the sender
    imms_dropped: int  # immediates of a new value dropped: the table held max_imm_values
    ctrl_sent: int  # the shim's own frames posted (hellos, heartbeats, answers, goodbyes): not in sends
    ctrl_received: int  # ... received: not in recvs
    outstanding: int  # work requests still with the provider: the NIC's queue depth
    transport: str  # the transport (provider) this NIC belongs to


class MessageStats(TypedDict):
    """The received-message queue and the large-message machinery (docs/guide/messages.md)."""

    messages_queued: int  # received, not yet taken with recv() (held back ones included)
    messages_held_back: int  # found the queue at max_queued_messages
    messages_dropped: int  # ... and were dropped (queue_overflow "drop")
    backpressure: bool  # receive buffers withheld from the provider now
    messages_by_tag: dict[int, int]  # queued messages per tag (tags with none left out)
    messages_forged: int  # dropped: their header names another sender than the provider
    messages_malformed: int  # dropped: not an afabric frame
    messages_expired: int  # large messages dropped: their sender went quiet for op_timeout
    messages_refused: int  # large messages refused: over max_queued_bytes
    large_in_progress: int  # large messages being received (memory reserved)
    large_bytes_arrived: int  # bytes of them that arrived so far
    large_waiting: int  # large messages announced, waiting for room (their senders wait)
    bytes_reserved: int  # memory held for large messages: in progress and queued
    max_queued_bytes: int
    max_queued_messages: int


class EngineStats(MessageStats):
    """What :meth:`Engine.stats` returns."""

    provider: str
    fabric_provider: str
    transports: list[str]  # the engine's transports, in the order it prefers them
    ops_in_flight: int
    buffers_held: int
    max_imm_values: int
    loop_polled: int  # times the loop's own look at the completion ring found completions
    loop_woken: int  # ... and times the event fd woke the loop with completions to take
    worker_naps: int  # times the worker slept (adaptive polling): what arrives next waits for it
    nics: list[NicStats]
