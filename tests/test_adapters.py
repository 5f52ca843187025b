"""The same contract for the SQS/S3 adapters (against moto) and the in-memory fakes; and
for the two readers the preprocessing processes read inputs with (boto3's and
obstore's), against moto's server over HTTP and a fault proxy in front of it."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from tests.support.aws import Aws
from tests.support.buckets import bucket_with
from tests.support.daemons import free_port
from tests.support.faultproxy import Fault, FaultProxy
from worker.adapters.aws.calls import client_config
from worker.adapters.aws.obstore_reads import open_obstore_reader
from worker.adapters.aws.s3 import InputClient, S3BlobStore, open_s3_reader
from worker.adapters.aws.sqs import SqsJobSource, _received
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.demo import LOCAL_AWS_ENV
from worker.errors import (
    AccessDenied,
    MissingObject,
    ObjectTooLarge,
    PreconditionFailed,
    TransientError,
)
from worker.ports import ABSENT, ObjectHead, ObjectReader, S3Location


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
    """`get` with a byte range (a tar member's, `worker.datasets.tars`) reads those bytes
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
    """Objects read back as written, and a HEAD gives the ETag the write gave and the
    size; a missing key is `MissingObject` to both."""
    _, blobs, _ = parts
    location = S3Location.parse("s3://bkt/a/b.bin")
    etag = blobs.put(location, b"\x00\x01", "application/octet-stream")
    assert blobs.get(location) == b"\x00\x01"
    assert blobs.head(location) == ObjectHead(etag, 2)
    for read in (blobs.get, blobs.head):
        with pytest.raises(MissingObject):
            read(S3Location.parse("s3://bkt/nope"))


def test_conditional_writes_listing_and_delete(parts: tuple[Any, Any, Any]) -> None:
    """A write on condition of absence, or of the ETag seen, fails once another writer
    was first, and so does a ranged read on condition of the ETag seen; a listing names
    the objects directly under a prefix with their ETags."""
    _, blobs, _ = parts
    out = S3Location.parse("s3://bkt/out/")
    results = S3Location.parse("s3://bkt/out/results.jsonl")
    first = blobs.put(results, b"ours", "text/plain", expect=ABSENT)
    with pytest.raises(PreconditionFailed):
        blobs.put(results, b"theirs", "text/plain", expect=ABSENT)
    second = blobs.put(results, b"ours, again", "text/plain", expect=first)
    with pytest.raises(PreconditionFailed):
        blobs.put(results, b"stale", "text/plain", expect=first)
    assert blobs.get(results, byte_range=(6, 5), expect=second) == b"again"
    with pytest.raises(PreconditionFailed):
        blobs.get(results, byte_range=(0, 4), expect=first)
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


@pytest.mark.parametrize(
    ("input_client", "module"),
    [("boto3", "worker.adapters.aws.s3"), ("obstore", "worker.adapters.aws.obstore_reads")],
)
def test_another_process_reads_the_store_with_a_client_of_its_own(
    aws: Aws, monkeypatch: pytest.MonkeyPatch, input_client: InputClient, module: str
) -> None:
    """What the preprocessing processes do: a fresh process opens the store's reader
    (boto3's or obstore's, as the store's `input_client` says), made from the
    environment as the store's client was, and reads through the moto server; a missing
    object is still `MissingObject` there. A store given a client of someone else's
    making has no such reader."""
    for name, value in aws.env.items():
        monkeypatch.setenv(name, value)
    stack = aws.stack()
    aws.s3.put_object(Bucket=stack.bucket, Key="in/a", Body=b"bytes of a")
    store = S3BlobStore.from_environment(connections=2, attempts=2, input_client=input_client)
    reader = store.remote_reader()
    assert reader is not None and reader.longest_s > 2 * 30
    assert reader.imports == (module,)
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


# The readers the preprocessing processes open (`RemoteReader.open`), each made from the
# environment as a process of the daemon's makes it: the same contract for both.
READERS: dict[str, Callable[[int, int], ObjectReader]] = {
    "boto3": open_s3_reader,
    "obstore": open_obstore_reader,
}
ATTEMPTS = 3


@pytest.fixture(params=sorted(READERS))
def open_reader(
    request: pytest.FixtureRequest, aws: Aws, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str], ObjectReader]:
    """`open_reader(endpoint)`: the reader, opened with `ATTEMPTS` tries a read, for 16
    reads at once, with the moto server's credentials and `endpoint` (the server's, or
    a proxy's in front of it) in its environment."""
    for name, value in LOCAL_AWS_ENV.items():
        monkeypatch.setenv(name, value)

    def open_at(endpoint: str) -> ObjectReader:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        return READERS[request.param](ATTEMPTS, 16)

    return open_at


def test_a_reader_reads_objects_and_ranges_and_says_which_are_missing(
    open_reader: Callable[[str], ObjectReader], aws: Aws
) -> None:
    """Either reader, over HTTP: an object whole, a range of it (a range past its end
    cut at the end, an empty one nothing), `MissingObject` for a missing key and for a
    missing bucket."""
    bucket = bucket_with(aws, {"in/a": b"0123456789"})
    get = open_reader(aws.endpoint)
    location = S3Location(bucket, "in/a")
    assert get(location) == b"0123456789"
    assert get(location, None, (3, 4)) == b"3456"
    assert get(location, None, (8, 20)) == b"89"
    assert get(location, None, (9, 0)) == b""
    with pytest.raises(MissingObject, match="NoSuchKey"):
        get(S3Location(bucket, "in/missing"))
    with pytest.raises(MissingObject, match="NoSuchBucket"):
        get(S3Location("no-such-bucket-here", "in/a"))


def test_a_reader_refuses_what_is_over_its_limit(
    open_reader: Callable[[str], ObjectReader], aws: Aws
) -> None:
    """Either reader: an object (or range) up to `max_bytes` is read, a larger one is
    `ObjectTooLarge` with its size and the limit, which crosses processes whole."""
    bucket = bucket_with(aws, {"in/a": b"0123456789"})
    get = open_reader(aws.endpoint)
    location = S3Location(bucket, "in/a")
    assert get(location, 10) == b"0123456789"
    with pytest.raises(ObjectTooLarge, match="too large: 10 bytes, limit 9") as raised:
        get(location, 9)
    assert pickle.loads(pickle.dumps(raised.value)).size == 10
    assert get(location, 4, (3, 4)) == b"3456"
    with pytest.raises(ObjectTooLarge, match="too large: 4 bytes, limit 3"):
        get(location, 3, (3, 4))


@contextlib.contextmanager
def _announcing(size: int) -> Iterator[str]:
    """An endpoint that answers every request with an object of `size` bytes and then
    sends none of them, holding the connection open; yields its URL."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer(connection: socket.socket) -> None:
        with connection:
            connection.recv(65536)
            connection.sendall(
                b'HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nETag: "e"\r\n'
                b"Last-Modified: Thu, 26 Nov 2026 12:00:00 GMT\r\n"
                + f"Content-Length: {size}\r\n\r\n".encode()
            )
            stop.wait(60)

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                connection, _ = server.accept()
                threading.Thread(target=answer, args=(connection,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()


def test_a_reader_refuses_an_object_over_its_limit_without_reading_it(
    open_reader: Callable[[str], ObjectReader],
) -> None:
    """Either reader refuses an object whose reply says it is 1 GiB at once, from the
    reply's headers: the endpoint sends none of its bytes, so a reader that read the body
    would wait for them (30 s, and again on each retry)."""
    with _announcing(2**30) as endpoint:
        get = open_reader(endpoint)
        started = time.monotonic()
        with pytest.raises(ObjectTooLarge, match=f"too large: {2**30} bytes, limit 1000"):
            get(S3Location("bkt", "in/huge.jpg"), 1000)
        assert time.monotonic() - started < 5


def test_a_reader_reads_on_many_threads_at_once(
    open_reader: Callable[[str], ObjectReader], aws: Aws
) -> None:
    """Either reader, shared by 16 threads as a preprocessing process's fetch threads
    share it, reads each of 64 objects as its own bytes."""
    objects = {f"in/{number}": os.urandom(1000 + number) for number in range(64)}
    bucket = bucket_with(aws, objects)
    get = open_reader(aws.endpoint)
    with ThreadPoolExecutor(16) as pool:
        read = list(pool.map(lambda key: get(S3Location(bucket, key)), objects))
    assert read == list(objects.values())


@pytest.mark.parametrize(
    ("answer", "raised", "tries"),
    [
        ((404, "NoSuchKey"), MissingObject, 1),
        ((403, "AccessDenied"), AccessDenied, 1),
        ((503, "SlowDown"), TransientError, ATTEMPTS),
        ((500, "InternalError"), TransientError, ATTEMPTS),
        ((400, "ExpiredToken"), TransientError, ATTEMPTS),
        ((403, "InvalidAccessKeyId"), TransientError, ATTEMPTS),  # the worker's, not the input's
        ((416, "InvalidRange"), ClientError, 1),  # permanent: raised as botocore gives it
    ],
)
def test_a_reader_classifies_an_error_reply_where_it_is_raised(
    open_reader: Callable[[str], ObjectReader],
    aws: Aws,
    answer: tuple[int, str],
    raised: type[Exception],
    tries: int,
) -> None:
    """Either reader makes the same class of each error reply of S3's (through a fault
    proxy that answers every GET with it): a missing key and a refusal at the first
    answer, throttling, 5xx and the worker's own credentials retried `--aws-max-attempts`
    times and then `TransientError`."""
    status, code = answer
    bucket = bucket_with(aws, {"in/a": b"bytes"})
    proxy = FaultProxy(aws.endpoint)
    proxy.add(Fault("error", lambda request: request.method == "GET", status=status, code=code))
    with proxy.serving() as endpoint:
        get = open_reader(endpoint)
        with pytest.raises(raised, match=code):
            get(S3Location(bucket, "in/a"))
    assert proxy.injected["error"] == tries


@pytest.mark.parametrize(
    ("answer", "refused", "data", "raised"),
    [
        ((403, "RequestTimeTooSkewed"), "head and get", b"bytes", TransientError),  # its clock
        ((400, "ExpiredToken"), "head and get", b"bytes", TransientError),  # its token
        ((403, "AccessDenied"), "head and get", b"bytes", AccessDenied),  # the object's
        ((403, "AccessDenied"), "every head", b"bytes", AccessDenied),  # a store refusing HEADs
        ((403, "AccessDenied"), "every head", b"", AccessDenied),  # empty: no first byte
        ((403, "AccessDenied"), "one head", b"bytes", None),  # rotated between HEAD and GET
    ],
)
def test_a_head_refused_is_named_by_a_get_of_the_objects_first_byte(
    aws: Aws, answer: tuple[int, str], refused: str, data: bytes, raised: type[Exception] | None
) -> None:
    """A HEAD's error reply has no body, so botocore names it by its status alone ("403",
    "400"): a refused HEAD is told apart by a GET of one byte, whose reply names the
    code, so that a worker's clock or credentials are retried, not taken for the
    object's refusal (poison) or an unknown error. A GET answered (or an empty object's
    range refused) leads to a second HEAD: a refusal that has passed answers it, one
    for good is the object's."""
    status, code = answer
    bucket = bucket_with(aws, {"in/a": data})
    proxy = FaultProxy(aws.endpoint)
    heads = 1 if refused == "one head" else None
    is_head = lambda request: request.method == "HEAD"  # noqa: E731
    proxy.add(Fault("head", is_head, status=status, code=code, times=heads))
    if refused == "head and get":
        is_get = lambda request: request.method == "GET"  # noqa: E731
        proxy.add(Fault("get", is_get, status=status, code=code))
    with proxy.serving() as endpoint:
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=LOCAL_AWS_ENV["AWS_DEFAULT_REGION"],
            aws_access_key_id=LOCAL_AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=LOCAL_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            config=client_config(),
        )
        store = S3BlobStore(s3, ATTEMPTS)
        if raised is None:
            assert store.head(S3Location(bucket, "in/a")).size == len(data)
        else:
            # A HEAD's refusal is named by its status alone ("403: Forbidden").
            named = code if refused == "head and get" else "403"
            with pytest.raises(raised, match=named):
                store.head(S3Location(bucket, "in/a"))
    assert proxy.injected["head"] >= 1


def test_a_reader_retries_a_slow_down_and_a_reset_and_reads_the_object(
    open_reader: Callable[[str], ObjectReader], aws: Aws
) -> None:
    """Either reader: a 503 SlowDown and then a connection reset with no answer are
    retried, and the third try reads the object."""
    bucket = bucket_with(aws, {"in/a": b"bytes"})
    proxy = FaultProxy(aws.endpoint)
    proxy.add(Fault("slow-down", lambda r: r.method == "GET", times=1, status=503, code="SlowDown"))
    proxy.add(Fault("reset", lambda r: r.method == "GET", times=1, kind="reset"))
    with proxy.serving() as endpoint:
        assert open_reader(endpoint)(S3Location(bucket, "in/a")) == b"bytes"
    assert (proxy.injected["slow-down"], proxy.injected["reset"]) == (1, 1)


def test_a_reader_that_cannot_connect_or_keeps_being_reset_says_it_is_transient(
    open_reader: Callable[[str], ObjectReader], aws: Aws
) -> None:
    """Either reader: an endpoint nothing listens on, or connections reset on every
    try, is `TransientError` once the tries are spent (the surroundings, not the input)."""
    with pytest.raises(TransientError):
        open_reader(f"http://127.0.0.1:{free_port()}")(S3Location("bkt", "in/a"))
    proxy = FaultProxy(aws.endpoint)
    proxy.add(Fault("reset", lambda request: request.method == "GET", kind="reset"))
    with proxy.serving() as endpoint, pytest.raises(TransientError):
        open_reader(endpoint)(S3Location("bkt", "in/a"))
    assert proxy.injected["reset"] == ATTEMPTS
