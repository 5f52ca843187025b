"""Retries and error classification at the AWS adapters: transient errors are retried
under each call's own budget, permanent ones are raised at once as what they are."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import FlexibleChecksumError, IncompleteReadError
from botocore.response import StreamingBody
from botocore.stub import Stubber

from worker.adapters.aws import calls
from worker.adapters.aws.s3 import S3BlobStore
from worker.adapters.aws.sqs import SqsJobSource
from worker.engine import ItemError
from worker.errors import AccessDenied, MessageRefused, MissingObject, TransientError
from worker.ports import RENEWAL_FAILED, S3Location
from worker.retry import Backoff, call_with_retries

WHERE = S3Location("bkt", "a.jpg")


def test_backoff_doubles_up_to_its_cap_with_full_jitter() -> None:
    """Each retry's bound doubles from the base to the cap; the delay drawn is below it."""
    backoff = Backoff(base_s=0.1, cap_s=1.0)
    assert [backoff.bound_s(n) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert all(0 <= backoff.delay_s(n) <= backoff.bound_s(n) for n in range(50))


def test_transient_errors_are_retried_until_the_budget_is_spent() -> None:
    """Transient failures are retried after a backoff; a success ends it; after
    `attempts` failures the last error is raised. Anything else is raised at once."""
    slept: list[float] = []
    failures = [TransientError("SlowDown"), TransientError("SlowDown")]

    def flaky() -> str:
        if failures:
            raise failures.pop()
        return "body"

    assert call_with_retries(flaky, attempts=3, sleep=slept.append) == "body"
    assert len(slept) == 2
    with pytest.raises(TransientError):
        call_with_retries(_raise(TransientError("503")), attempts=4, sleep=slept.append)
    assert len(slept) == 2 + 3
    with pytest.raises(MissingObject):
        call_with_retries(_raise(MissingObject("gone")), attempts=4, sleep=slept.append)
    assert len(slept) == 5


def test_no_try_starts_after_its_deadline() -> None:
    """With a `deadline`, a call with no time left is not tried; one that fails with
    too little time left for its backoff and another try raises its own error rather
    than try past it."""
    tries: list[int] = []

    def throttled() -> None:
        tries.append(1)
        raise TransientError("SlowDown")

    with pytest.raises(TransientError, match="no time was left"):
        call_with_retries(throttled, attempts=5, deadline=time.monotonic())
    assert tries == []
    slept: list[float] = []
    backoff = Backoff(base_s=0.01, cap_s=0.01)
    with pytest.raises(TransientError, match="SlowDown"):
        call_with_retries(
            throttled, 5, backoff, slept.append, deadline=time.monotonic() + 10, longest_try_s=20
        )
    assert tries == [1] and slept == []


def _raise(error: Exception) -> Any:
    def call() -> None:
        raise error

    return call


@pytest.fixture
def s3() -> Iterator[tuple[S3BlobStore, Stubber]]:
    client = boto3.session.Session(
        aws_access_key_id="t", aws_secret_access_key="t", region_name="us-east-1"
    ).client("s3", config=calls.client_config())
    with Stubber(client) as stubber:
        yield S3BlobStore(client, attempts=3), stubber


def _error(stubber: Stubber, code: str, status: int) -> None:
    stubber.add_client_error("get_object", code, f"{code} (test)", status)


def _body(data: bytes) -> StreamingBody:
    return StreamingBody(io.BytesIO(data), len(data))


def test_throttling_is_retried_within_the_call(
    s3: tuple[S3BlobStore, Stubber], monkeypatch: pytest.MonkeyPatch
) -> None:
    """503 SlowDown twice, then the object: the caller sees only the object."""
    monkeypatch.setattr(calls, "call_with_retries", _without_sleeping(calls.call_with_retries))
    blobs, stubber = s3
    _error(stubber, "SlowDown", 503)
    _error(stubber, "InternalError", 500)
    stubber.add_response("get_object", {"Body": _body(b"jpeg"), "ContentLength": 4})
    assert blobs.get(WHERE) == b"jpeg"
    stubber.assert_no_pending_responses()


def test_a_throttled_call_that_never_succeeds_is_transient(
    s3: tuple[S3BlobStore, Stubber], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once its budget is spent the error is a `TransientError`: the job is retried
    later, the input is not blamed."""
    monkeypatch.setattr(calls, "call_with_retries", _without_sleeping(calls.call_with_retries))
    blobs, stubber = s3
    for _ in range(3):
        _error(stubber, "SlowDown", 503)
    with pytest.raises(TransientError, match="SlowDown"):
        blobs.get(WHERE)


@pytest.mark.parametrize(
    ("code", "status"),
    [("InvalidAccessKeyId", 403), ("SignatureDoesNotMatch", 403), ("RequestTimeTooSkewed", 403)],
)
def test_the_workers_credentials_or_clock_are_not_the_inputs_fault(
    s3: tuple[S3BlobStore, Stubber], monkeypatch: pytest.MonkeyPatch, code: str, status: int
) -> None:
    """A refusal that names the worker's credentials or clock, not the object, is
    transient: the job is retried later rather than its inputs failed."""
    monkeypatch.setattr(calls, "call_with_retries", _without_sleeping(calls.call_with_retries))
    blobs, stubber = s3
    for _ in range(3):
        _error(stubber, code, status)
    with pytest.raises(TransientError, match=code):
        blobs.get(WHERE)


@pytest.mark.parametrize(
    ("code", "status", "raised"),
    [
        ("NoSuchKey", 404, MissingObject),
        ("NoSuchBucket", 404, MissingObject),
        ("AccessDenied", 403, AccessDenied),
        ("InvalidObjectState", 403, Exception),
    ],
)
def test_permanent_errors_are_raised_at_once_as_what_they_are(
    s3: tuple[S3BlobStore, Stubber], code: str, status: int, raised: type[Exception]
) -> None:
    """A missing or refused object is not retried: it is that input's error."""
    blobs, stubber = s3
    _error(stubber, code, status)
    with pytest.raises(raised) as caught:
        blobs.get(WHERE)
    assert not isinstance(caught.value, TransientError)
    stubber.assert_no_pending_responses()


def test_a_short_read_of_the_body_is_retried(
    s3: tuple[S3BlobStore, Stubber], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body cut short of its Content-Length is as transient as a failed request: the
    whole GET is tried again."""
    monkeypatch.setattr(calls, "call_with_retries", _without_sleeping(calls.call_with_retries))
    blobs, stubber = s3
    stubber.add_response(
        "get_object", {"Body": StreamingBody(io.BytesIO(b"jp"), 4), "ContentLength": 4}
    )
    stubber.add_response("get_object", {"Body": _body(b"jpeg"), "ContentLength": 4})
    assert blobs.get(WHERE) == b"jpeg"
    assert isinstance(
        calls.classify(IncompleteReadError(actual_bytes=2, expected_bytes=4)), TransientError
    )


def _without_sleeping(call: Any) -> Any:
    def retry(fn: Any, attempts: int, **more: Any) -> Any:
        return call(fn, attempts, sleep=lambda _: None, **more)

    return retry


def test_every_chunk_of_a_renewal_is_tried_and_none_outlives_the_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fifteen leases, two calls: the first fails past its retries, and the second is
    still made; each lease of the first is reported failed, not raised. With no time
    left nothing is tried and every lease is reported failed at once."""
    monkeypatch.setattr(calls, "call_with_retries", _without_sleeping(calls.call_with_retries))
    client = boto3.session.Session(
        aws_access_key_id="t", aws_secret_access_key="t", region_name="us-east-1"
    ).client("sqs", config=calls.client_config())
    source = SqsJobSource(client, "https://sqs.us-east-1.amazonaws.com/1/q", None, attempts=2)
    handles = [f"handle-{number}" for number in range(15)]
    with Stubber(client) as stubber:
        for _ in range(2):
            stubber.add_client_error(
                "change_message_visibility_batch", "ServiceUnavailable", "down (test)", 503
            )
        stubber.add_response(
            "change_message_visibility_batch",
            {
                "Successful": [{"Id": str(n)} for n in range(4)],
                "Failed": [{"Id": "4", "SenderFault": True, "Code": "ReceiptHandleIsInvalid"}],
            },
        )
        failures = source.extend(handles, 120, within_s=120)
        stubber.assert_no_pending_responses()
    assert failures == {
        **dict.fromkeys(handles[:10], RENEWAL_FAILED),
        "handle-14": "ReceiptHandleIsInvalid",
    }
    with Stubber(client) as stubber:  # no response queued: a call would fail the test
        assert source.extend(handles, 120, within_s=0) == dict.fromkeys(handles, RENEWAL_FAILED)


def test_a_message_sqs_refuses_for_what_it_holds_is_not_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An entry SQS fails as the sender's fault (characters it does not take) raises
    `MessageRefused` at once, where it was retried as transient; one it fails for its
    own reasons is sent again, alone."""
    monkeypatch.setattr(calls, "call_with_retries", _without_sleeping(calls.call_with_retries))
    client = boto3.session.Session(
        aws_access_key_id="t", aws_secret_access_key="t", region_name="us-east-1"
    ).client("sqs", config=calls.client_config())
    source = SqsJobSource(client, "https://sqs.us-east-1.amazonaws.com/1/q", None, attempts=5)
    refused = {"Id": "1", "SenderFault": True, "Code": "InvalidMessageContents", "Message": "x"}
    with Stubber(client) as stubber:
        stubber.add_response(
            "send_message_batch",
            {
                "Successful": [{"Id": "0", "MessageId": "m", "MD5OfMessageBody": "d"}],
                "Failed": [refused],
            },
        )
        with pytest.raises(MessageRefused, match="InvalidMessageContents"):
            source.send_many(["{}", "{}"], "group")
        stubber.assert_no_pending_responses()
    unlucky = {"Id": "1", "SenderFault": False, "Code": "InternalError"}
    with Stubber(client) as stubber:
        stubber.add_response(
            "send_message_batch",
            {
                "Successful": [{"Id": "0", "MessageId": "m", "MD5OfMessageBody": "d"}],
                "Failed": [unlucky],
            },
        )
        resent = {"Id": "1", "MessageId": "n", "MD5OfMessageBody": "d"}
        stubber.add_response("send_message_batch", {"Successful": [resent], "Failed": []})
        source.send_many(["{}", "{}"], "group")
        stubber.assert_no_pending_responses()


def test_a_checksum_mismatch_and_a_full_host_memory_are_not_the_inputs_fault() -> None:
    """Bytes that do not match S3's checksum are a bad transfer (tried again), and a
    MemoryError on one input is the host's memory, as a GPU out-of-memory is the
    device's: the input is fed again, never failed for it."""
    mismatch = FlexibleChecksumError(error_msg="Expected checksum x did not match y")
    assert isinstance(calls.classify(mismatch), TransientError)
    assert ItemError.from_exception(MemoryError(), "preprocess").transient
    assert not ItemError.from_exception(ValueError("corrupt"), "preprocess").transient
