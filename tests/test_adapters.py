"""The same contract for the SQS/S3 adapters (against moto) and the in-memory fakes."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from tests.support.aws import Aws
from worker.adapters.aws.s3 import S3BlobStore
from worker.adapters.aws.sqs import SqsJobSource, _received
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.errors import MissingObject, ObjectTooLarge, PreconditionFailed
from worker.ports import ABSENT, S3Location


@pytest.fixture(params=["moto", "fake"])
def parts(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, Any, Any]]:
    """(job source, blob store, a function that sends a message body)."""
    if request.param == "fake":
        fake = InMemoryJobSource()
        yield fake, InMemoryBlobStore(), fake.send
        return
    for name, value in {
        "AWS_ACCESS_KEY_ID": "t",
        "AWS_SECRET_ACCESS_KEY": "t",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        sqs, s3 = boto3.client("sqs"), boto3.client("s3")
        queue_url = sqs.create_queue(QueueName="jobs")["QueueUrl"]
        dlq_url = sqs.create_queue(QueueName="dead")["QueueUrl"]
        s3.create_bucket(Bucket="bkt")
        source = SqsJobSource(sqs, queue_url, dlq_url)
        source.dlq_url = dlq_url  # type: ignore[attr-defined]
        yield (
            source,
            S3BlobStore(s3),
            lambda body: sqs.send_message(QueueUrl=queue_url, MessageBody=body),
        )


def test_received_message_is_invisible_until_released(parts: tuple[Any, Any, Any]) -> None:
    """A lease hides the message; release makes it visible again at once, counted."""
    source, _, send = parts
    send(json.dumps({"n": 1}))
    [message] = source.receive(10, 0, 30)
    assert message.receive_count == 1 and json.loads(message.body) == {"n": 1}
    assert source.receive(10, 0, 30) == []
    source.release(message.receipt_handle)
    [again] = source.receive(10, 0, 30)
    assert again.message_id == message.message_id and again.receive_count == 2


def test_an_object_over_the_readers_limit_is_refused_unread(
    parts: tuple[Any, Any, Any], tmp_path: Path
) -> None:
    """`get` with `max_bytes` returns an object of up to that size and refuses a larger
    one with its size and the limit; `chunks` streams an object within its own limit;
    the reader another process opens (the fake's files) refuses as `get` does, and the
    error crosses between processes whole."""
    _, blobs, _ = parts
    location = S3Location.parse("s3://bkt/in/object")
    blobs.put(location, b"s3://bkt/a\ns3://bkt/b\n", "text/plain")
    assert blobs.get(location, 22) == b"s3://bkt/a\ns3://bkt/b\n"
    with pytest.raises(ObjectTooLarge, match="too large: 22 bytes, limit 21"):
        blobs.get(location, 21)
    assert b"".join(blobs.chunks(location, 22)) == b"s3://bkt/a\ns3://bkt/b\n"
    with pytest.raises(ObjectTooLarge, match="too large: 22 bytes, limit 10"):
        list(blobs.chunks(location, 10))
    on_disk = InMemoryBlobStore(tmp_path)
    on_disk.put(location, b"12345", "text/plain")
    reader = on_disk.remote_reader()
    assert reader is not None
    get = reader.open(1)
    assert get(location, 5) == b"12345"
    with pytest.raises(ObjectTooLarge, match="too large: 5 bytes, limit 4") as raised:
        get(location, 4)
    copied = pickle.loads(pickle.dumps(raised.value))
    assert (str(copied), copied.size, copied.limit) == (str(raised.value), 5, 4)


def test_a_ranged_get_reads_those_bytes_alone(parts: tuple[Any, Any, Any], tmp_path: Path) -> None:
    """`get` with a byte range (a tar member's, `worker.jobs.tars`) reads those bytes
    alone, the limit applying to them; as does the reader another process opens."""
    _, blobs, _ = parts
    location = S3Location.parse("s3://bkt/in/shard.tar")
    blobs.put(location, b"0123456789", "application/x-tar")
    assert blobs.get(location, 4, (3, 4)) == b"3456"
    assert blobs.get(location, None, (9, 0)) == b""
    with pytest.raises(ObjectTooLarge, match="too large: 4 bytes, limit 3"):
        blobs.get(location, 3, (3, 4))
    on_disk = InMemoryBlobStore(tmp_path)
    on_disk.put(location, b"0123456789", "application/x-tar")
    reader = on_disk.remote_reader()
    assert reader is not None
    assert reader.open(1)(location, 4, (3, 4)) == b"3456"


def test_extend_reports_stale_handles_and_ack_deletes(parts: tuple[Any, Any, Any]) -> None:
    """Renewing a deleted message's handle is reported per entry, not raised."""
    source, _, send = parts
    for n in range(12):
        send(str(n))
    messages = source.receive(10, 0, 30) + source.receive(10, 0, 30)
    assert len(messages) == 12
    handles = [m.receipt_handle for m in messages]
    source.ack(handles[0])
    failures = source.extend(handles, 60)
    assert list(failures) == [handles[0]]


def test_dead_letter_moves_message_with_reason(parts: tuple[Any, Any, Any]) -> None:
    """A dead-lettered message, then acked, leaves the queue."""
    source, _, send = parts
    send("junk")
    [message] = source.receive(1, 0, 30)
    assert source.dead_letter(message, "not JSON")
    source.ack(message.receipt_handle)
    assert source.receive(10, 0, 0) == []
    with pytest.raises(Exception, match="ReceiptHandleIsInvalid"):
        source.release(message.receipt_handle)


def test_blob_round_trip_and_missing_key(parts: tuple[Any, Any, Any]) -> None:
    """Objects read back as written; a missing key is `MissingObject`."""
    _, blobs, _ = parts
    location = S3Location.parse("s3://bkt/a/b.bin")
    blobs.put(location, b"\x00\x01", "application/octet-stream")
    assert blobs.get(location) == b"\x00\x01"
    with pytest.raises(MissingObject):
        blobs.get(S3Location.parse("s3://bkt/nope"))


def test_conditional_writes_listing_and_delete(parts: tuple[Any, Any, Any]) -> None:
    """A write on condition of absence, or of the ETag seen, fails once another writer
    was first; a listing names the objects directly under a prefix with their ETags."""
    _, blobs, _ = parts
    out = S3Location.parse("s3://bkt/out/")
    results = S3Location.parse("s3://bkt/out/results.jsonl")
    first = blobs.put(results, b"ours", "text/plain", expect=ABSENT)
    with pytest.raises(PreconditionFailed):
        blobs.put(results, b"theirs", "text/plain", expect=ABSENT)
    second = blobs.put(results, b"ours, again", "text/plain", expect=first)
    with pytest.raises(PreconditionFailed):
        blobs.put(results, b"stale", "text/plain", expect=first)
    blobs.put(S3Location.parse("s3://bkt/out/deeper/x"), b"", "text/plain")
    assert blobs.objects_under(out) == {"results.jsonl": second}
    blobs.delete([results, S3Location.parse("s3://bkt/out/never-there")])
    assert blobs.objects_under(out) == {}
    with pytest.raises(PreconditionFailed):
        blobs.put(results, b"gone", "text/plain", expect=second)
    if isinstance(blobs, S3BlobStore):
        # A retried write whose first try landed meets its own bytes: not a fence.
        mine = blobs.put(results, b"mine", "text/plain", expect=ABSENT)
        assert blobs.put(results, b"mine", "text/plain", expect=ABSENT) == mine


def test_a_file_bigger_than_a_part_goes_up_in_parts_on_its_condition(
    parts: tuple[Any, Any, Any], tmp_path: Path
) -> None:
    """`put_file` sends a file that fits in a part as one write, a bigger one as a
    multipart upload that appears only when completed, on the write's condition: a
    different file where one is already is refused, and its upload aborted."""
    _, blobs, _ = parts
    if isinstance(blobs, S3BlobStore):
        blobs = S3BlobStore(boto3.client("s3"), part_bytes=5 * 2**20)  # S3's smallest part
    big, other, small = tmp_path / "big.npy", tmp_path / "other.npy", tmp_path / "small.npy"
    big.write_bytes(os.urandom(11 * 2**20))
    other.write_bytes(os.urandom(11 * 2**20))
    small.write_bytes(b"tiny")
    location = S3Location.parse("s3://bkt/out/embedding.npy")
    etag = blobs.put_file(location, big, "application/x-npy", expect=ABSENT)
    assert blobs.get(location) == big.read_bytes()
    assert blobs.objects_under(S3Location.parse("s3://bkt/out/")) == {"embedding.npy": etag}
    with pytest.raises(PreconditionFailed):
        blobs.put_file(location, other, "application/x-npy", expect=ABSENT)
    assert blobs.put_file(location, small, "application/x-npy", expect=etag)
    assert blobs.get(location) == b"tiny"
    if isinstance(blobs, S3BlobStore):
        assert etag.endswith('-3"')  # 5 + 5 + 1 MiB
        assert boto3.client("s3").list_multipart_uploads(Bucket="bkt").get("Uploads", []) == []
        # A retried completion whose first try landed meets its own bytes: not a fence.
        again = S3Location.parse("s3://bkt/out/again.npy")
        etag = blobs.put_file(again, big, "application/x-npy", expect=ABSENT)
        assert blobs.put_file(again, big, "application/x-npy", expect=ABSENT) == etag


def test_compose_joins_objects_in_order_copying_what_s3_can(
    parts: tuple[Any, Any, Any],
) -> None:
    """`compose` writes its sources end to end, on its condition: small ones in one
    write; with parts, sources of a part's size are copied by S3 and the others (a
    small one before a big one, the last) read and sent, and a retry that meets its
    own bytes is not fenced."""
    _, blobs, _ = parts
    if isinstance(blobs, S3BlobStore):
        blobs = S3BlobStore(boto3.client("s3"), part_bytes=5 * 2**20)
    contents = [b"head\n", os.urandom(6 * 2**20), os.urandom(5 * 2**20), b"tail\n"]
    sources = []
    for number, data in enumerate(contents):
        location = S3Location.parse(f"s3://bkt/parts/{number}")
        blobs.put(location, data, "text/plain")
        sources.append((location, len(data)))
    small = S3Location.parse("s3://bkt/out/small")
    blobs.compose(small, [sources[0], sources[3]], "text/plain", expect=ABSENT)
    assert blobs.get(small) == b"head\ntail\n"
    joined = S3Location.parse("s3://bkt/out/joined")
    etag = blobs.compose(joined, sources, "text/plain", expect=ABSENT)
    assert blobs.get(joined) == b"".join(contents)
    with pytest.raises(PreconditionFailed):
        blobs.compose(joined, sources[1:], "text/plain", expect=ABSENT)
    if isinstance(blobs, S3BlobStore):
        assert blobs.compose(joined, sources, "text/plain", expect=ABSENT) == etag
        copied = blobs.compose(
            S3Location.parse("s3://bkt/out/copied"), sources[1:], "text/plain", expect=ABSENT
        )
        assert copied.endswith('-3"')  # two copies, then the streamed tail
        assert boto3.client("s3").list_multipart_uploads(Bucket="bkt").get("Uploads", []) == []


def test_send_many_sends_every_body(parts: tuple[Any, Any, Any]) -> None:
    """A planned job's shards go out, every one of them."""
    source, _, _ = parts
    bodies = [json.dumps({"n": n}) for n in range(23)]
    source.send_many(bodies, "tenant")
    received = []
    while batch := source.receive(10, 0, 30):
        received += [message.body for message in batch]
    assert sorted(received) == sorted(bodies)


class _RecordingSqs:
    """An SQS client that takes every SendMessageBatch and records its entries (moto
    does not refuse a batch over SQS's size)."""

    def __init__(self) -> None:
        self.batches: list[list[dict[str, Any]]] = []

    def send_message_batch(self, QueueUrl: str, Entries: list[dict[str, Any]]) -> Any:
        self.batches.append(Entries)
        return {"Successful": [{"Id": entry["Id"]} for entry in Entries]}


def test_send_many_keeps_each_call_within_sqs_limits() -> None:
    """Ten bodies to a call at most, and no more bytes than a SendMessageBatch takes
    (256 KiB): bodies carrying a job's big params go in smaller calls, all in order."""
    client = _RecordingSqs()
    bodies = [json.dumps({"n": n, "params": "x" * (n % 2) * 100_000}) for n in range(23)]
    SqsJobSource(client, "q", None).send_many(bodies, "tenant")  # type: ignore[arg-type]
    sent = [entry["MessageBody"] for batch in client.batches for entry in batch]
    assert sent == bodies
    assert all(len(batch) <= 10 for batch in client.batches)
    assert all(
        sum(len(entry["MessageBody"]) for entry in batch) <= 256 * 1024 for batch in client.batches
    )
    assert len(client.batches) > 3  # the big ones did not fit ten to a call


def test_a_continuation_carries_the_attempts_the_first_message_and_broken_workers(
    parts: tuple[Any, Any, Any],
) -> None:
    source, _, send = parts
    send("job")
    [first] = source.receive(1, 0, 30)
    source.requeue(first)
    source.ack(first.receipt_handle)
    [second] = source.receive(1, 0, 30)
    assert (second.receive_count, second.attempt) == (1, 2)
    assert second.message_id != first.message_id
    assert second.job_message_id == first.message_id
    source.requeue(second, breakage="stage inference is broken")
    source.ack(second.receipt_handle)
    [third] = source.receive(1, 0, 30)
    assert third.attempt == 3 and third.job_message_id == first.message_id
    assert (third.broke_workers, third.breakage) == (1, "stage inference is broken")
    source.requeue(third)  # handed over, not broken: the count stays
    source.ack(third.receipt_handle)
    [fourth] = source.receive(1, 0, 30)
    assert (fourth.broke_workers, fourth.breakage) == (1, "stage inference is broken")


@pytest.mark.parametrize(
    ("attribute", "value"),
    [
        ("worker.earlier-attempts", "²"),
        ("worker.earlier-attempts", "-1"),
        ("worker.replaced-lease-ends", "soon"),
        ("worker.replaced-lease-ends", "nan"),
        ("worker.first-message-id", "../../x"),
        ("worker.handed-over-from", "a" * 200),
        ("worker.broke-workers", "many"),
        ("worker.breakage", "x" * 501),
    ],
)
def test_continuation_attributes_that_do_not_parse_poison_their_message(
    attribute: str, value: str
) -> None:
    """Any sender can set a continuation's attributes: one that does not parse is kept
    out of the message (which the intake then dead-letters with the reason), and valid
    ones are taken."""

    def message(message_id: str, **attributes: str) -> Any:
        carried = {name: {"DataType": "String", "StringValue": v} for name, v in attributes.items()}
        return {
            "MessageId": message_id,
            "Body": "{}",
            "ReceiptHandle": "h",
            "MessageAttributes": carried,
        }

    received = _received(message("m-1", **{"worker.earlier-attempts": "3", attribute: value}))
    assert received.attributes_problem.startswith(f"message attribute {attribute} is not")
    assert (received.earlier_attempts, received.job_message_id) == (0, "m-1")
    assert received.handed_over_from == "" and received.replaced_lease_ends is None
    valid = _received(
        message(
            "m-2",
            **{
                "worker.earlier-attempts": "3",
                "worker.first-message-id": "m-0",
                "worker.handed-over-from": "m-1",
                "worker.replaced-lease-ends": "1.5",
                "worker.broke-workers": "2",
                "worker.breakage": "stage inference is broken",
            },
        )
    )
    assert (valid.attributes_problem, valid.attempt, valid.job_message_id) == ("", 4, "m-0")
    assert (valid.handed_over_from, valid.replaced_lease_ends) == ("m-1", 1.5)
    assert (valid.broke_workers, valid.breakage) == (2, "stage inference is broken")


def test_fake_leases_run_out_and_renewals_hide_again() -> None:
    """The fake's clock-driven leases, which the speed figures and lease tests rely on."""
    clock = [100.0]
    source = InMemoryJobSource(lambda: clock[0])
    for number in range(3):
        source.send(str(number))
    first = source.receive(2, 0, 30)
    assert [m.body for m in first] == ["0", "1"]
    clock[0] += 31  # both leases ran out; "2" was visible all along
    assert sorted(m.body for m in source.receive(10, 0, 30)) == ["0", "1", "2"]
    clock[0] += 31
    source.extend([first[0].receipt_handle], 30)  # a stale handle: "0" was taken since
    [late] = [m for m in source.receive(10, 0, 30) if m.body == "0"]
    clock[0] += 31
    assert source.extend([late.receipt_handle], 30) == {}  # renewed before anyone took it
    assert sorted(m.body for m in source.receive(10, 0, 30)) == ["1", "2"]
    source.ack(late.receipt_handle)
    clock[0] += 31
    assert sorted(m.body for m in source.receive(10, 0, 30)) == ["1", "2"]


def _read_in_this_process(open_reader: Callable[[int], Any], uris: list[str]) -> list[Any]:
    get = open_reader(2)
    read: list[Any] = []
    for uri in uris:
        try:
            read.append(get(S3Location.parse(uri)))
        except MissingObject as missing:
            read.append(missing)
    return read


def test_another_process_reads_the_store_with_a_client_of_its_own(
    aws: Aws, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the preprocessing processes do: a fresh process opens the store's reader,
    made from the environment as the store's client was, and reads through the moto
    server; a missing object is still `MissingObject` there. A store given a client
    of someone else's making has no such reader."""
    for name, value in aws.env.items():
        monkeypatch.setenv(name, value)
    stack = aws.stack()
    aws.s3.put_object(Bucket=stack.bucket, Key="in/a", Body=b"bytes of a")
    store = S3BlobStore.from_environment(connections=2, attempts=2)
    reader = store.remote_reader()
    assert reader is not None and reader.longest_s > 2 * 30
    uris = [f"s3://{stack.bucket}/in/a", f"s3://{stack.bucket}/in/missing"]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        read, missing = pool.submit(_read_in_this_process, reader.open, uris).result(60)
    assert read == b"bytes of a"
    assert isinstance(missing, MissingObject)
    assert S3BlobStore(aws.s3).remote_reader() is None


def test_keys_under_lists_every_key_under_a_prefix_a_page_at_a_time_in_order(
    parts: tuple[Any, Any, Any],
) -> None:
    """More keys than a page of S3's listing (1,000): each page's continuation is read."""
    _, blobs, _ = parts
    keys = [f"in/{number:05d}.jpg" for number in range(1005)]
    for key in [*keys, "inside/x", "other/y"]:
        blobs.put(S3Location("bkt", key), b"", "text/plain")
    assert list(blobs.keys_under(S3Location.parse("s3://bkt/in/"))) == keys
