"""A job's merge claim: who merges its shards, until when (`worker.sharding.merging`).

The job's planner opens it, held by none, before plan.json; a merger takes it over on
condition that it is as listed (held by none, run out, or its own from an earlier
delivery of the same message) and renews it before each write of the merge, each
write its own bytes, so that a write retried after its answer was lost is told from
another merger's (`put_once`). The merge that ends removes it, and none writes it again.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from worker.errors import MissingObject, ObjectTooLarge, PreconditionFailed
from worker.jobs.plan import merge_file
from worker.message import JobMessage
from worker.ports import ABSENT, SQS_MAX_DELAY_S, BlobStore, S3Location

# A merge claim lasts this long past its latest renewal (each write of the merge renews
# it; one compose of thousands of parts takes minutes): a merger that died is replaced
# by its message's redelivery at once, and by anyone once its claim has run out.
MERGE_CLAIM_S = SQS_MAX_DELAY_S
MAX_CLAIM_BYTES = 4096
# A cut a claim records is anyone's to write (it lies under the job's output): taken only
# where this worker could join at it without exhausting itself (`_recorded_cut`).
ROW_GROUP_CEILING_BYTES = 2**28  # a join holds about two row groups, decoded
ROW_GROUP_FLOOR_BYTES = 2**16
ROW_GROUPS_A_FILE = 4096  # each indexed in the file's footer, read whole by readers

Cut = tuple[int, int]  # where a Parquet join cuts files and row groups, in bytes


@dataclass(frozen=True)
class MergingElsewhere:
    """Another merger holds the job's claim, until `until` (epoch seconds) unless renewed."""

    until: float


class ClaimLost(Exception):
    """The merge claim is no longer this merger's."""


def open_claim(blobs: BlobStore, spec: JobMessage, digest: str) -> None:
    """Write request `digest`'s merge claim, held by none, as its plan is first written
    (before plan.json: a planner that finds plan.json finds the claim too): mergers
    then only ever take it over as it is (`If-Match`), and once the job's merge
    removes it, none writes it again."""
    note = json.dumps({"merger": None, "until": 0}).encode()
    # Refused: opened by an earlier delivery of the job's message (or a retry of this write).
    with contextlib.suppress(PreconditionFailed):
        blobs.put(merge_file(spec, digest), note, "application/json", expect=ABSENT)


@dataclass(frozen=True)
class NoClaim:
    """The job has no merge claim: its merge removed it, or (a job planned by a worker
    from before claims were opened at planning) none was ever written."""


class Claim:
    """A job's merge claim: `{"merger", "until", "write", "cut"}`, its ETag kept to
    renew it. `cut` is where the job's first merger cut its Parquet join (`own_cut`,
    its --parquet-file-bytes and --parquet-row-group-bytes): a merger that takes the
    claim over cuts as it did, so that a join it finds written is one it would write
    (`Merger._holds`), whatever its own settings (a rollout of other ones)."""

    def __init__(self, blobs: BlobStore, location: S3Location, merger: str, own_cut: Cut):
        self._blobs = blobs
        self._location = location
        self._merger = merger
        self._etag = ABSENT
        self._own_cut = own_cut
        self.cut = own_cut
        self.name = location.key.rsplit("/", 1)[1]

    def take(self, listed: str | None) -> MergingElsewhere | NoClaim | None:
        """Take the claim (`listed`: its ETag as listed, None if there was none), on
        condition that it is as listed: None once it is this merger's; else who holds
        it, until when, or that there is none."""
        if listed is None:
            return NoClaim()
        try:
            fields = json_object(self._blobs.get(self._location, MAX_CLAIM_BYTES))
        except MissingObject:
            return NoClaim()  # the merge it named ended and removed it
        until = fields.get("until")
        ours = fields.get("merger") == self._merger
        self.cut = _recorded_cut(fields.get("cut"), self._own_cut)
        if not ours and isinstance(until, int | float) and until > time.time():
            return MergingElsewhere(float(until))
        # Run out, opened by the planner, not one, or ours from an earlier delivery.
        return self._write_on(listed)

    def take_anew(self) -> MergingElsewhere | None:
        """Write the claim where there is none (a job whose planner opened none)."""
        return self._write_on(ABSENT)

    def _write_on(self, expect: str) -> MergingElsewhere | None:
        try:
            self._write(expect)
        except PreconditionFailed:
            return MergingElsewhere(time.time() + MERGE_CLAIM_S)  # taken meanwhile
        return None

    def renew(self) -> None:
        """Renew the claim on condition that it is still this merger's; `ClaimLost` if
        another took it over."""
        try:
            self._write(self._etag)
        except PreconditionFailed as error:
            raise ClaimLost(f"another merger took the merge over: {error}") from error

    def _write(self, expect: str) -> None:
        # Each write's bytes its own (`write`), so that a try of it found written is told
        # from another merger's claim (`put_once`).
        note = {"merger": self._merger, "until": time.time() + MERGE_CLAIM_S, "cut": self.cut}
        data = json.dumps({**note, "write": uuid.uuid4().hex}).encode()
        self._etag = put_once(self._blobs, self._location, data, expect)


def _recorded_cut(recorded: Any, own: Cut) -> Cut:
    """The cut a claim records (`[file bytes, row group bytes]`), where this worker may
    join at it: row groups of `ROW_GROUP_FLOOR_BYTES` to `ROW_GROUP_CEILING_BYTES` (or
    as small, or as large, as its own), and no more of them a file than
    `ROW_GROUPS_A_FILE` (or its own's). Else its `own`: none recorded (a claim the
    planner opened, or written by a worker from before cuts were), or a forged one."""
    if not isinstance(recorded, list) or len(recorded) != 2:
        return own
    if any(type(value) is not int or value < 1 for value in recorded):
        return own
    file_bytes, row_group_bytes = recorded
    floor = min(own[1], ROW_GROUP_FLOOR_BYTES)
    ceiling = max(own[1], ROW_GROUP_CEILING_BYTES)
    groups = max(own[0] // own[1], ROW_GROUPS_A_FILE)
    if not floor <= row_group_bytes <= ceiling or file_bytes // row_group_bytes > groups:
        return own
    return (file_bytes, row_group_bytes)


def put_once(blobs: BlobStore, location: S3Location, data: bytes, expect: str) -> str:
    """Write `data` (JSON) on `expect`'s condition; its ETag. Refused, it may be a try of
    this same write whose answer was lost, retried by the adapter, which then fails its
    condition against the first try's write (where ETags are not the bytes' MD5s, as
    under SSE-KMS, the adapter cannot tell): if the object holds `data`, the write is
    done, and its ETag is the one listed (listed before it is read: the bytes read are
    that ETag's or later ones', and these are written once). Else `PreconditionFailed`:
    another's write."""
    try:
        return blobs.put(location, data, "application/json", expect=expect)
    except PreconditionFailed:
        etag = blobs.objects_under(location).get("")
        try:
            ours = etag is not None and blobs.get(location, len(data)) == data
        except (MissingObject, ObjectTooLarge):
            ours = False
        if not ours or etag is None:
            raise
        return etag


def json_object(data: bytes) -> dict[str, Any]:
    """A JSON object's fields; none if `data` is not one (anyone may write under an output)."""
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
