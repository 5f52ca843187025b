"""Two queues as one job source: the jobs users send on one, the shards of the jobs
split across the fleet (and their watches) on the other (`--shard-queue-url`).

SQS delivers a standard queue roughly in the order sent, so on one queue a one-image
job sent after a giant job is planned waits behind all of its shards; and a daemon busy
with a shard cannot read on to find it without taking, and handing back, the shards in
its way. With the shards in a lane of their own, a busy daemon still reads the jobs
lane (`worker.loops.intake`), and the shards wait for daemons with room.

A message is settled on the queue it came from: the receipt handles of the shards
lane carry a prefix that says so, and everything the daemon does with a handle (ack,
release, renew, hand over, dead-letter) goes where the prefix points. What the daemon
sends of its own (shards, watches, duplicates) goes to the shards lane.
"""

from __future__ import annotations

import dataclasses

from worker.ports import JobSource, QueueCounts, ReceivedMessage

SHARDS_LANE = "shards-lane:"  # the receipt handles of messages from the shards lane


class Lanes:
    """A `JobSource` over a jobs queue and a shards queue; `receive` reads the jobs
    queue, `receive_shards` the other."""

    def __init__(self, jobs: JobSource, shards: JobSource):
        self._jobs = jobs
        self._shards = shards

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        return self._jobs.receive(max_messages, wait_s, visibility_timeout_s)

    def receive_shards(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        received = self._shards.receive(max_messages, wait_s, visibility_timeout_s)
        return [
            dataclasses.replace(message, receipt_handle=SHARDS_LANE + message.receipt_handle)
            for message in received
        ]

    def ack(self, receipt_handle: str) -> None:
        source, handle = self._lane(receipt_handle)
        source.ack(handle)

    def release(self, receipt_handle: str, delay_s: int = 0) -> None:
        source, handle = self._lane(receipt_handle)
        source.release(handle, delay_s)

    def requeue(
        self,
        message: ReceivedMessage,
        *,
        delay_s: int = 0,
        lease_ends: float | None = None,
        breakage: str | None = None,
    ) -> None:
        source, message = self._own(message)
        source.requeue(message, delay_s=delay_s, lease_ends=lease_ends, breakage=breakage)

    def extend(
        self, receipt_handles: list[str], visibility_timeout_s: int, within_s: float | None = None
    ) -> dict[str, str]:
        failures: dict[str, str] = {}
        for source, prefix in ((self._jobs, ""), (self._shards, SHARDS_LANE)):
            handles = [h.removeprefix(prefix) for h in receipt_handles if _in(h, prefix)]
            if handles:
                failed = source.extend(handles, visibility_timeout_s, within_s)
                failures |= {prefix + handle: code for handle, code in failed.items()}
        return failures

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        self._shards.send_many(bodies, group, delay_s)

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        source, message = self._own(message)
        return source.dead_letter(message, reason)

    def counts(self) -> QueueCounts:
        jobs, shards = self._jobs.counts(), self._shards.counts()
        return QueueCounts(
            jobs.visible + shards.visible,
            jobs.in_flight + shards.in_flight,
            jobs.delayed + shards.delayed,
        )

    @staticmethod
    def of_shards(message: ReceivedMessage) -> bool:
        """Whether the message came from the shards lane."""
        return message.receipt_handle.startswith(SHARDS_LANE)

    def _lane(self, receipt_handle: str) -> tuple[JobSource, str]:
        if receipt_handle.startswith(SHARDS_LANE):
            return self._shards, receipt_handle.removeprefix(SHARDS_LANE)
        return self._jobs, receipt_handle

    def _own(self, message: ReceivedMessage) -> tuple[JobSource, ReceivedMessage]:
        """The lane a message came from, and the message as that queue gave it."""
        source, handle = self._lane(message.receipt_handle)
        return source, dataclasses.replace(message, receipt_handle=handle)


def _in(receipt_handle: str, prefix: str) -> bool:
    """Whether a handle is of the lane with `prefix` (the jobs lane's is none)."""
    return receipt_handle.startswith(SHARDS_LANE) == bool(prefix)
