"""The AWS adapters: SQS as a `JobSource`, S3 as a `BlobStore`. Nothing else imports boto3.

Errors are classified here, where they are raised (`worker.errors`): throttling, 5xx,
timeouts, resets and short reads become `TransientError` and are retried with backoff
under each call's own budget (`worker.retry`); a missing object is `MissingObject`, a
refused one `AccessDenied`; anything else is raised as botocore gave it. botocore's own
retries are off, so there is one retry policy, not two stacked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import boto3
import structlog
import urllib3.exceptions
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    CredentialRetrievalError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from worker.errors import (
    AccessDenied,
    MissingObject,
    ObjectTooLarge,
    PreconditionFailed,
    TransientError,
)
from worker.ports import (
    ABSENT,
    JOB_ID_PATTERN,
    MAX_BREAKAGE_CHARS,
    RENEWAL_FAILED,
    SQS_MAX_ENTRIES_PER_BATCH_CALL,
    Notice,
    NoticeKind,
    NoticeSource,
    ObjectReader,
    QueueCounts,
    ReceivedMessage,
    RemoteReader,
    S3Location,
    ScaleInGuard,
    breakage_carried,
)
from worker.retry import CALL_BACKOFF, DEFAULT_AWS_MAX_ATTEMPTS, call_with_retries

if TYPE_CHECKING:
    from mypy_boto3_autoscaling import AutoScalingClient
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef, ObjectIdentifierTypeDef
    from mypy_boto3_sns import SNSClient
    from mypy_boto3_sqs import SQSClient
    from mypy_boto3_sqs.type_defs import MessageTypeDef

T = TypeVar("T")

log = structlog.get_logger()

MAX_REASON_CHARS = 1000
# A file bigger than this is uploaded in parts of this size (S3 takes 5 MiB to 5 GiB).
MULTIPART_PART_BYTES = 64 * 2**20
# A continuation's message attributes (`SqsJobSource.requeue`).
EARLIER_ATTEMPTS_ATTRIBUTE = "worker.earlier-attempts"
FIRST_MESSAGE_ATTRIBUTE = "worker.first-message-id"
HANDED_OVER_FROM_ATTRIBUTE = "worker.handed-over-from"
REPLACED_LEASE_ENDS_ATTRIBUTE = "worker.replaced-lease-ends"
BROKE_WORKERS_ATTRIBUTE = "worker.broke-workers"
BREAKAGE_ATTRIBUTE = "worker.breakage"
IMDS_DEFAULT_ENDPOINT = "http://169.254.169.254"
IMDS_TOKEN_TTL_S = 60
IMDS_TOKEN_MARGIN_S = 10
IMDS_TIMEOUT_S = 2.0
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
SPOT_INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
TARGET_LIFECYCLE_STATE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
REBALANCE_RECOMMENDATION_PATH = "/latest/meta-data/events/recommendations/rebalance"
ECS_AGENT_TIMEOUT_S = 5.0
ASG_NAME_PATH = "/latest/meta-data/tags/instance/aws:autoscaling:groupName"
S3_MAX_KEYS_PER_DELETE = 1000
CONNECT_TIMEOUT_S = 5
# Longer than SQS's longest long poll (20 s), or a quiet receive would time out.
READ_TIMEOUT_S = 30
LONGEST_CALL_S = CONNECT_TIMEOUT_S + READ_TIMEOUT_S  # one try of a call, at worst
STREAM_CHUNK_BYTES = 64 * 1024  # a streamed object's pieces (`chunks`)

MISSING_OBJECT_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
ACCESS_DENIED_CODES = frozenset({"AccessDenied", "Forbidden", "403"})
# botocore's throttling and transient codes (botocore/retries/standard.py), plus expired
# credentials, which the session refreshes before the next try.
TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "PriorRequestNotComplete",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ExpiredToken",
        "ExpiredTokenException",
        "KMS.ThrottlingException",
        "ConditionalRequestConflict",  # a concurrent conditional write: try again
        # The worker's credentials or clock, not the object: the next try may pass.
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "RequestTimeTooSkewed",
        "InvalidToken",
        "TokenRefreshRequired",
    }
)
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
CLASSES_BY_CODE: tuple[tuple[frozenset[str], type[Exception]], ...] = (
    (MISSING_OBJECT_CODES, MissingObject),
    (ACCESS_DENIED_CODES, AccessDenied),
    (frozenset({"PreconditionFailed"}), PreconditionFailed),  # a conditional write, beaten
    (TRANSIENT_CODES, TransientError),
)
TRANSIENT_EXCEPTIONS = (
    BotoConnectionError,  # endpoint unreachable, connect timeout
    HTTPClientError,  # connection closed or reset, read timeout, broken response stream
    IncompleteReadError,  # the body was shorter than its Content-Length
    FlexibleChecksumError,  # the bytes that came are not those S3 holds: a bad transfer
    urllib3.exceptions.HTTPError,
    NoCredentialsError,  # the instance metadata service did not answer in time
    CredentialRetrievalError,
)


def classify(error: Exception) -> Exception:
    """The error to raise in place of `error`: one of `worker.errors`' classes where it
    fits, else `error` itself (permanent)."""
    if isinstance(error, ClientError):
        details = error.response.get("Error", {})
        code = details.get("Code", "")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        message = f"{code or status}: {details.get('Message', '')}"
        for codes, kind in CLASSES_BY_CODE:
            if code in codes:
                return kind(message)
        return TransientError(message) if status in TRANSIENT_STATUSES else error
    if isinstance(error, TRANSIENT_EXCEPTIONS):
        return TransientError(f"{type(error).__name__}: {error}")
    return error


def _classified(call: Callable[[], T]) -> T:
    try:
        return call()
    except Exception as error:
        classified = classify(error)
        if classified is error:
            raise
        raise classified from error


class _Retrying:
    """Runs each call under its own retry budget, with its errors classified."""

    def __init__(self, attempts: int):
        self._attempts = attempts

    def _call(self, call: Callable[[], T], deadline: float | None = None) -> T:
        return call_with_retries(
            lambda: _classified(call),
            self._attempts,
            deadline=deadline,
            longest_try_s=LONGEST_CALL_S,
        )


def _conditions(expect: str | None) -> dict[str, Any]:
    """A write's condition: `ABSENT` if the object must not exist, else its ETag."""
    if expect is None:
        return {}
    return {"IfNoneMatch": "*"} if expect == ABSENT else {"IfMatch": expect}


def _config(max_pool_connections: int = 10) -> Config:
    return Config(
        retries={"mode": "standard", "total_max_attempts": 1},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        max_pool_connections=max_pool_connections,
    )


def sqs_client() -> SQSClient:
    """An SQS client from boto3's usual configuration (AWS_ENDPOINT_URL, region, ...)."""
    return boto3.session.Session().client("sqs", config=_config())


def sns_client() -> SNSClient:
    return boto3.session.Session().client("sns", config=_config())


def autoscaling_client() -> AutoScalingClient:
    return boto3.session.Session().client("autoscaling", config=_config())


def s3_client(max_pool_connections: int) -> S3Client:
    """An S3 client with room for `max_pool_connections` concurrent requests."""
    return boto3.session.Session().client("s3", config=_config(max_pool_connections))


class SqsSender(_Retrying):
    """Sends messages to one queue (job submissions, completion notices)."""

    def __init__(self, client: SQSClient, queue_url: str, attempts: int = DEFAULT_AWS_MAX_ATTEMPTS):
        super().__init__(attempts)
        self._client = client
        self._queue_url = queue_url

    def __call__(self, body: str) -> None:
        self._call(lambda: self._client.send_message(QueueUrl=self._queue_url, MessageBody=body))


class SnsPublisher(_Retrying):
    """Publishes messages to one SNS topic (completion notices, fanned out by SNS)."""

    def __init__(self, client: SNSClient, topic_arn: str, attempts: int = DEFAULT_AWS_MAX_ATTEMPTS):
        super().__init__(attempts)
        self._client = client
        self._topic_arn = topic_arn

    def __call__(self, body: str) -> None:
        self._call(lambda: self._client.publish(TopicArn=self._topic_arn, Message=body))


class SqsJobSource(_Retrying):
    """Job messages from one SQS queue, with an optional dead-letter queue."""

    def __init__(
        self,
        client: SQSClient,
        queue_url: str,
        dlq_url: str | None,
        attempts: int = DEFAULT_AWS_MAX_ATTEMPTS,
    ):
        super().__init__(attempts)
        self._client = client
        self._queue_url = queue_url
        self._dlq_url = dlq_url

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        reply = self._call(
            lambda: self._client.receive_message(
                QueueUrl=self._queue_url,
                MaxNumberOfMessages=max_messages,
                WaitTimeSeconds=wait_s,
                VisibilityTimeout=visibility_timeout_s,
                MessageSystemAttributeNames=["ApproximateReceiveCount"],
                MessageAttributeNames=[
                    EARLIER_ATTEMPTS_ATTRIBUTE,
                    FIRST_MESSAGE_ATTRIBUTE,
                    HANDED_OVER_FROM_ATTRIBUTE,
                    REPLACED_LEASE_ENDS_ATTRIBUTE,
                    BROKE_WORKERS_ATTRIBUTE,
                    BREAKAGE_ATTRIBUTE,
                ],
            )
        )
        return [_received(message) for message in reply.get("Messages", [])]

    def ack(self, receipt_handle: str) -> None:
        self._call(
            lambda: self._client.delete_message(
                QueueUrl=self._queue_url, ReceiptHandle=receipt_handle
            )
        )

    def release(self, receipt_handle: str, delay_s: int = 0) -> None:
        self._call(
            lambda: self._client.change_message_visibility(
                QueueUrl=self._queue_url, ReceiptHandle=receipt_handle, VisibilityTimeout=delay_s
            )
        )

    def requeue(
        self,
        message: ReceivedMessage,
        *,
        delay_s: int = 0,
        lease_ends: float | None = None,
        breakage: str | None = None,
    ) -> None:
        attributes: Any = {
            EARLIER_ATTEMPTS_ATTRIBUTE: {"DataType": "Number", "StringValue": str(message.attempt)},
            FIRST_MESSAGE_ATTRIBUTE: {"DataType": "String", "StringValue": message.job_message_id},
            HANDED_OVER_FROM_ATTRIBUTE: {"DataType": "String", "StringValue": message.message_id},
        }
        broke_workers, cause = breakage_carried(message, breakage)
        if broke_workers:
            attributes[BROKE_WORKERS_ATTRIBUTE] = {
                "DataType": "Number",
                "StringValue": str(broke_workers),
            }
            attributes[BREAKAGE_ATTRIBUTE] = {"DataType": "String", "StringValue": cause or "-"}
        if lease_ends is not None:
            attributes[REPLACED_LEASE_ENDS_ATTRIBUTE] = {
                "DataType": "Number",
                "StringValue": f"{lease_ends:.3f}",
            }
        self._call(
            lambda: self._client.send_message(
                QueueUrl=self._queue_url,
                MessageBody=message.body,
                MessageAttributes=attributes,
                DelaySeconds=delay_s,
            )
        )

    def extend(
        self, receipt_handles: list[str], visibility_timeout_s: int, within_s: float | None = None
    ) -> dict[str, str]:
        """Every chunk of ten is tried, whatever became of the others, within `within_s`
        (no try starts after it, and a retry only if it can end before it): a chunk whose
        call failed, or that no time was left for, has each of its handles reported
        `RENEWAL_FAILED`."""
        deadline = None if within_s is None else time.monotonic() + within_s
        failures: dict[str, str] = {}
        for start in range(0, len(receipt_handles), SQS_MAX_ENTRIES_PER_BATCH_CALL):
            chunk = receipt_handles[start : start + SQS_MAX_ENTRIES_PER_BATCH_CALL]
            entries: Any = [
                {"Id": str(n), "ReceiptHandle": handle, "VisibilityTimeout": visibility_timeout_s}
                for n, handle in enumerate(chunk)
            ]
            call = functools.partial(
                self._client.change_message_visibility_batch,
                QueueUrl=self._queue_url,
                Entries=entries,
            )
            try:
                reply = self._call(call, deadline)
            except Exception as error:
                log.warning("lease_renewal_failed", leases=len(chunk), error=repr(error))
                failures.update(dict.fromkeys(chunk, RENEWAL_FAILED))
                continue
            # A batch call succeeds as a whole even when entries fail: check each one
            # (bbc/sqs-consumer#193).
            for failure in reply.get("Failed", []):
                failures[chunk[int(failure["Id"])]] = failure.get("Code", "Unknown")
        return failures

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        dlq_url = self._dlq_url
        if dlq_url is None:
            return False
        attributes: Any = {
            "reason": {"DataType": "String", "StringValue": reason[:MAX_REASON_CHARS]},
            "source_message_id": {"DataType": "String", "StringValue": message.message_id},
        }
        self._call(
            lambda: self._client.send_message(
                QueueUrl=dlq_url, MessageBody=message.body or " ", MessageAttributes=attributes
            )
        )
        return True

    def counts(self) -> QueueCounts:
        names: Any = [
            "ApproximateNumberOfMessages",
            "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed",
        ]
        reply = self._call(
            lambda: self._client.get_queue_attributes(
                QueueUrl=self._queue_url, AttributeNames=names
            )
        )
        attributes = reply["Attributes"]
        return QueueCounts(*(int(attributes.get(name, 0)) for name in names))


class S3BlobStore(_Retrying):
    """Objects in S3."""

    def __init__(
        self,
        client: S3Client,
        attempts: int = DEFAULT_AWS_MAX_ATTEMPTS,
        *,
        client_from_environment: bool = False,
        part_bytes: int = MULTIPART_PART_BYTES,
    ):
        super().__init__(attempts)
        self._client = client
        self._client_from_environment = client_from_environment
        self._part_bytes = part_bytes

    @classmethod
    def from_environment(cls, connections: int, attempts: int) -> S3BlobStore:
        """A store whose client follows boto3's usual configuration, as the client that
        another process makes for itself will (`remote_reader`)."""
        return cls(s3_client(connections), attempts, client_from_environment=True)

    def remote_reader(self) -> RemoteReader | None:
        """Reads with a client of the reading process's own, made from the environment as
        this store's was; None for a store given some other client (a test's)."""
        if not self._client_from_environment:
            return None
        attempts = self._attempts
        backoffs_s = sum(CALL_BACKOFF.bound_s(retry) for retry in range(attempts - 1))
        return RemoteReader(
            functools.partial(open_s3_reader, attempts),
            longest_s=attempts * (CONNECT_TIMEOUT_S + READ_TIMEOUT_S) + backoffs_s,
            imports=(__name__,),
        )

    def get(self, location: S3Location, max_bytes: int | None = None) -> bytes:
        def read() -> bytes:
            # Inside the retried call: a reset or a short read mid-body is as transient
            # as a failed request (botocore checks the length read against the size
            # S3 gave when the body is read whole).
            body, size = self._opened(location, max_bytes)
            with contextlib.closing(body):
                if max_bytes is None or size is not None:
                    return body.read()  # type: ignore[no-any-return]
                data: bytes = body.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise ObjectTooLarge(None, max_bytes)
            return data

        return self._call(read)

    def chunks(self, location: S3Location, max_bytes: int) -> Generator[bytes]:
        # The request is retried; a reset mid-body is the caller's (transient) error.
        body, _ = self._call(lambda: self._opened(location, max_bytes))
        with contextlib.closing(body):
            read = 0
            for chunk in body.iter_chunks(STREAM_CHUNK_BYTES):
                read += len(chunk)
                if read > max_bytes:
                    raise ObjectTooLarge(None, max_bytes)
                yield chunk

    def _opened(self, location: S3Location, max_bytes: int | None) -> tuple[Any, int | None]:
        """The object's body, unread, and its size if S3 gave it; `ObjectTooLarge` if
        that is over `max_bytes` (the body's connection is closed, not drained)."""
        reply = self._client.get_object(Bucket=location.bucket, Key=location.key)
        body, size = reply["Body"], reply.get("ContentLength")
        if max_bytes is not None and size is not None and size > max_bytes:
            body.close()
            raise ObjectTooLarge(size, max_bytes)
        return body, size

    def put(
        self, location: S3Location, data: bytes, content_type: str, *, expect: str | None = None
    ) -> str:
        def write() -> str:
            reply = self._client.put_object(
                Bucket=location.bucket,
                Key=location.key,
                Body=data,
                ContentType=content_type,
                **_conditions(expect),
            )
            return reply["ETag"]

        ours = f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'
        return self._written(location, expect, ours, write)

    def put_file(
        self, location: S3Location, path: Path, content_type: str, *, expect: str | None = None
    ) -> str:
        """`put` of a local file: one that fits in a part is one write; a bigger one is a
        multipart upload, read a part at a time, which appears (on `expect`'s condition)
        only when it is completed, and is aborted if it is not."""
        if path.stat().st_size <= self._part_bytes:
            return self.put(location, path.read_bytes(), content_type, expect=expect)
        bucket, key = location.bucket, location.key
        upload = self._call(
            lambda: self._client.create_multipart_upload(
                Bucket=bucket, Key=key, ContentType=content_type
            )
        )
        upload_id = upload["UploadId"]
        try:
            parts: list[CompletedPartTypeDef] = []
            digests = []
            with path.open("rb") as file:
                while chunk := file.read(self._part_bytes):
                    part = functools.partial(
                        self._client.upload_part,
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=len(parts) + 1,
                        Body=chunk,
                    )
                    parts.append({"PartNumber": len(parts) + 1, "ETag": self._call(part)["ETag"]})
                    digests.append(hashlib.md5(chunk, usedforsecurity=False).digest())

            def complete() -> str:
                reply = self._client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    **_conditions(expect),
                )
                return reply["ETag"]

            joined = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
            return self._written(location, expect, f'"{joined}-{len(parts)}"', complete)
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception as error:  # the bucket's lifecycle rule cleans up after it
                log.warning("multipart_abort_failed", location=str(location), error=repr(error))
            raise

    def _written(
        self, location: S3Location, expect: str | None, ours: str, write: Callable[[], str]
    ) -> str:
        """The new ETag that `write` (on `expect`'s condition) returns."""
        try:
            return self._call(write)
        except MissingObject as missing:
            if expect is None:
                raise
            raise PreconditionFailed(f"{location} was removed: {missing}") from missing
        except PreconditionFailed:
            # A try whose answer was lost (a timeout, a reset) may have written it: then
            # the retry fails its condition against our own write. Same bytes, no fence.
            if self._etag(location) != ours:
                raise
            return ours

    def _etag(self, location: S3Location) -> str | None:
        try:
            reply = self._call(
                lambda: self._client.head_object(Bucket=location.bucket, Key=location.key)
            )
        except MissingObject:
            return None
        return reply["ETag"]

    def objects_under(self, prefix: S3Location) -> dict[str, str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=prefix.bucket, Prefix=prefix.key, Delimiter="/"
        )
        listed: dict[str, str] = {}
        for page in self._call(lambda: tuple(pages)):
            for entry in page.get("Contents", []):
                listed[entry["Key"][len(prefix.key) :]] = entry["ETag"]
        return listed

    def delete(self, locations: list[S3Location]) -> None:
        for bucket in {location.bucket for location in locations}:
            keys: list[ObjectIdentifierTypeDef] = [
                {"Key": loc.key} for loc in locations if loc.bucket == bucket
            ]
            for start in range(0, len(keys), S3_MAX_KEYS_PER_DELETE):
                chunk = keys[start : start + S3_MAX_KEYS_PER_DELETE]
                reply = self._call(
                    functools.partial(
                        self._client.delete_objects,
                        Bucket=bucket,
                        Delete={"Objects": chunk, "Quiet": True},
                    )
                )
                if reply.get("Errors"):
                    failed = reply["Errors"][0]
                    raise RuntimeError(f"{len(reply['Errors'])} not deleted, first: {failed}")


def open_s3_reader(attempts: int, connections: int) -> ObjectReader:
    """`S3BlobStore.get` with a client of this process's own, for `connections` reads at
    once (`RemoteReader.open`)."""
    return S3BlobStore(s3_client(connections), attempts).get


def _received(message: MessageTypeDef) -> ReceivedMessage:
    """A received message, with what a continuation carries (`requeue`). Any sender can
    set those attributes: a value that does not parse makes this message poison
    (`attributes_problem`), and none of it is used."""
    received = ReceivedMessage(
        message_id=message["MessageId"],
        body=message["Body"],
        receipt_handle=message["ReceiptHandle"],
        receive_count=int(message.get("Attributes", {}).get("ApproximateReceiveCount", 1)),
    )
    try:
        carried = _carried(dict(message.get("MessageAttributes", {})))
    except ValueError as error:
        return dataclasses.replace(received, attributes_problem=str(error))
    return dataclasses.replace(received, **carried)


# What a continuation's attributes may hold: a count, a message id (it names files, as a
# job id does), an epoch time in seconds, and a cause (only ever logged and quoted).
ATTEMPTS_PATTERN = re.compile(r"[0-9]{1,6}")
MESSAGE_ID_PATTERN = re.compile(JOB_ID_PATTERN)
EPOCH_SECONDS_PATTERN = re.compile(r"[0-9]{1,11}(\.[0-9]{1,6})?")
BREAKAGE_PATTERN = re.compile(f".{{1,{MAX_BREAKAGE_CHARS}}}", re.DOTALL)


def _carried(attributes: dict[str, Any]) -> dict[str, Any]:
    def value(name: str, pattern: re.Pattern[str], what: str) -> str | None:
        attribute = attributes.get(name)
        if attribute is None:
            return None
        text = attribute.get("StringValue")
        if not isinstance(text, str) or not pattern.fullmatch(text):
            raise ValueError(f"message attribute {name} is not {what}: {str(text)[:80]!r}")
        return text

    earlier = value(EARLIER_ATTEMPTS_ATTRIBUTE, ATTEMPTS_PATTERN, "a count of attempts")
    first = value(FIRST_MESSAGE_ATTRIBUTE, MESSAGE_ID_PATTERN, "a message id")
    handed_over_from = value(HANDED_OVER_FROM_ATTRIBUTE, MESSAGE_ID_PATTERN, "a message id")
    lease_ends = value(REPLACED_LEASE_ENDS_ATTRIBUTE, EPOCH_SECONDS_PATTERN, "a time")
    broke_workers = value(BROKE_WORKERS_ATTRIBUTE, ATTEMPTS_PATTERN, "a count of workers")
    breakage = value(BREAKAGE_ATTRIBUTE, BREAKAGE_PATTERN, "a cause")
    return {
        "earlier_attempts": int(earlier or 0),
        "first_message_id": first or "",
        "handed_over_from": handed_over_from or "",
        "replaced_lease_ends": float(lease_ends) if lease_ends else None,
        "broke_workers": int(broke_workers or 0),
        "breakage": breakage or "",
    }


class PlatformUnavailable(Exception):
    """The machine lacks what the settings ask of it (scale-in protection outside an
    Auto Scaling group or ECS, interruption notices without instance metadata)."""


class AsgGuard(_Retrying):
    """EC2 Auto Scaling: SetInstanceProtection on this instance."""

    name = "asg"
    renew_every_s: float | None = None  # protection of an instance does not expire

    def __init__(
        self,
        client: AutoScalingClient,
        instance_id: str,
        group_name: str,
        attempts: int = DEFAULT_AWS_MAX_ATTEMPTS,
    ):
        super().__init__(attempts)
        self._client = client
        self.instance_id = instance_id
        self.group_name = group_name

    def set_protected(self, protected: bool) -> None:
        self._call(
            lambda: self._client.set_instance_protection(
                InstanceIds=[self.instance_id],
                AutoScalingGroupName=self.group_name,
                ProtectedFromScaleIn=protected,
            )
        )

    def take_out_of_service(self) -> str:
        self._call(
            lambda: self._client.set_instance_health(
                InstanceId=self.instance_id,
                HealthStatus="Unhealthy",
                ShouldRespectGracePeriod=False,
            )
        )
        return f"instance {self.instance_id} set Unhealthy: its Auto Scaling group replaces it"


class EcsGuard:
    """ECS task scale-in protection through the container agent's endpoint."""

    name = "ecs"

    def __init__(self, agent_uri: str, expires_minutes: int):
        self._url = agent_uri.rstrip("/") + "/task-protection/v1/state"
        self._expires_minutes = expires_minutes
        # Renew at half the expiry, so one failed renewal still leaves it on.
        self.renew_every_s: float | None = expires_minutes * 60 / 2

    def set_protected(self, protected: bool) -> None:
        body: dict[str, Any] = {"ProtectionEnabled": protected}
        if protected:
            body["ExpiresInMinutes"] = self._expires_minutes
        request = urllib.request.Request(
            self._url,
            data=json.dumps(body).encode(),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=ECS_AGENT_TIMEOUT_S) as reply:
            answer = json.loads(reply.read() or b"{}")
        if answer.get("failure") or answer.get("error"):
            raise RuntimeError(f"ECS agent refused task protection: {answer}")

    def take_out_of_service(self) -> str:
        return "the task exits, and the ECS service starts another"


class Imds:
    """The instance metadata service, IMDSv2: a session token first, reused until
    shortly before it expires."""

    def __init__(self, endpoint: str | None = None, clock: Callable[[], float] = time.monotonic):
        base = endpoint or os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or ""
        self._base = base.rstrip("/") or IMDS_DEFAULT_ENDPOINT
        self._clock = clock
        self._token = ""
        self._token_until = float("-inf")

    def read(self, path: str) -> str | None:
        """The value at `path`, or None where the service has none (404)."""
        request = urllib.request.Request(
            self._base + path, headers={"X-aws-ec2-metadata-token": self._session_token()}
        )
        try:
            with urllib.request.urlopen(request, timeout=IMDS_TIMEOUT_S) as reply:
                return reply.read().decode()  # type: ignore[no-any-return]
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            if error.code == 401:  # the token expired early (the service restarted)
                self._token_until = float("-inf")
            raise

    def get(self, path: str) -> str:
        """The value at `path`; raises `OSError` where there is none."""
        value = self.read(path)
        if value is None:
            raise FileNotFoundError(f"instance metadata has no {path}")
        return value

    def _session_token(self) -> str:
        if self._clock() < self._token_until:
            return self._token
        request = urllib.request.Request(
            self._base + "/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=IMDS_TIMEOUT_S) as reply:
            self._token = reply.read().decode()
        self._token_until = self._clock() + IMDS_TOKEN_TTL_S - IMDS_TOKEN_MARGIN_S
        return self._token


class ImdsNotices:
    """Interruption notices as EC2 publishes them in instance metadata: a spot
    interruption (with the time the instance goes), an Auto Scaling termination (where a
    lifecycle hook holds the instance until it is told to continue), and a rebalance
    recommendation."""

    def __init__(self, imds: Imds, lifecycle_hook: Callable[[], None] | None = None):
        self._imds = imds
        self._lifecycle_hook = lifecycle_hook

    def poll(self) -> Notice | None:
        action = self._imds.read(SPOT_INSTANCE_ACTION_PATH)
        if action is not None:  # {"action": "terminate" | "stop" | "hibernate", "time": ...}
            return Notice(NoticeKind.TERMINATION, "spot-interruption", _spot_deadline(action))
        if self._imds.read(TARGET_LIFECYCLE_STATE_PATH) == "Terminated":
            return Notice(NoticeKind.TERMINATION, "scale-in", acknowledge=self._lifecycle_hook)
        if self._imds.read(REBALANCE_RECOMMENDATION_PATH) is not None:
            return Notice(NoticeKind.REBALANCE, "rebalance-recommendation")
        return None


def _spot_deadline(action: str) -> float | None:
    """When a spot notice says the instance goes; None (the grace period then) for a
    notice that cannot be read, which is still a notice."""
    try:
        return datetime.fromisoformat(json.loads(action)["time"]).timestamp()
    except (ValueError, KeyError, TypeError) as error:
        log.error("spot_notice_unreadable", notice=action[:200], error=repr(error))
        return None


class LifecycleHook(_Retrying):
    """An Auto Scaling lifecycle hook that holds this instance while it terminates."""

    def __init__(
        self,
        client: AutoScalingClient,
        group_name: str,
        hook_name: str,
        instance_id: str,
        attempts: int = DEFAULT_AWS_MAX_ATTEMPTS,
    ):
        super().__init__(attempts)
        self._client = client
        self._group_name = group_name
        self._hook_name = hook_name
        self._instance_id = instance_id

    def complete(self) -> None:
        """Let the instance go on terminating."""
        self._call(
            lambda: self._client.complete_lifecycle_action(
                AutoScalingGroupName=self._group_name,
                LifecycleHookName=self._hook_name,
                InstanceId=self._instance_id,
                LifecycleActionResult="CONTINUE",
            )
        )


def interruption_notices(
    mode: str, lifecycle_hook: str | None, asg_name: str | None, max_attempts: int
) -> NoticeSource | None:
    """Where interruption notices come from for `mode` (auto, imds, off); None for off.

    `auto` watches instance metadata where it answers (EC2, ECS on EC2), else nothing
    (Fargate, a laptop). `imds`, or a lifecycle hook to complete, that cannot work raises
    `PlatformUnavailable`, so a misconfigured fleet fails at start.
    """
    required = mode == "imds" or lifecycle_hook is not None
    metadata_off = os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true"
    if mode == "off" or (metadata_off and not required):
        return None
    imds = Imds()
    try:
        instance_id = imds.get(INSTANCE_ID_PATH)
        group = (asg_name or imds.get(ASG_NAME_PATH)) if lifecycle_hook else ""
    except OSError as error:
        if not required:
            return None
        raise PlatformUnavailable(
            f"interruption notices need instance metadata, which did not say which instance "
            f"(and group, for --lifecycle-hook-name) this is: {error}"
        ) from error
    if not lifecycle_hook:
        return ImdsNotices(imds)
    hook = LifecycleHook(autoscaling_client(), group, lifecycle_hook, instance_id, max_attempts)
    return ImdsNotices(imds, hook.complete)


def scale_in_guard(
    mode: str, asg_name: str | None, ecs_expires_minutes: int, max_attempts: int
) -> ScaleInGuard | None:
    """The guard for `mode` (auto, asg, ecs, off); None for off.

    `auto` takes ECS when the agent's URI is set, else EC2 Auto Scaling when the instance
    metadata service answers, else off. An explicit mode that cannot work raises
    `PlatformUnavailable`, so a misconfigured fleet fails at start, not at scale-in.
    """
    if mode == "off":
        return None
    agent_uri = os.environ.get("ECS_AGENT_URI")
    if mode == "ecs" or (mode == "auto" and agent_uri):
        if not agent_uri:
            raise PlatformUnavailable("--protection ecs, but ECS_AGENT_URI is not set")
        return EcsGuard(agent_uri, ecs_expires_minutes)
    if mode == "auto" and os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return None
    try:
        imds = Imds()
        instance_id = imds.get(INSTANCE_ID_PATH)
        group = asg_name or imds.get(ASG_NAME_PATH)
    except OSError as error:
        if mode == "auto":
            return None
        raise PlatformUnavailable(
            f"--protection asg, but the instance metadata service did not say which "
            f"instance and group this is ({error}); is the instance in an Auto Scaling "
            "group with instance metadata tags on, or is --asg-name missing?"
        ) from error
    return AsgGuard(autoscaling_client(), instance_id, group, max_attempts)
