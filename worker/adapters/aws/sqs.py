"""SQS: the job queue as a `JobSource`, and a queue to send notices to."""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import TYPE_CHECKING, Any

import boto3
import structlog

from worker.adapters.aws.calls import Retrying, client_config
from worker.errors import MessageRefused, TransientError
from worker.ports import (
    JOB_ID_PATTERN,
    MAX_BREAKAGE_CHARS,
    RENEWAL_FAILED,
    SQS_MAX_ENTRIES_PER_BATCH_CALL,
    QueueCounts,
    ReceivedMessage,
    breakage_carried,
)
from worker.retry import DEFAULT_AWS_MAX_ATTEMPTS

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient
    from mypy_boto3_sqs.type_defs import MessageTypeDef

log = structlog.get_logger()

MAX_REASON_CHARS = 1000
SQS_MAX_BATCH_BYTES = 256 * 1024  # the bodies of one SendMessageBatch, all together
# A continuation's message attributes (`SqsJobSource.requeue`).
EARLIER_ATTEMPTS_ATTRIBUTE = "worker.earlier-attempts"
FIRST_MESSAGE_ATTRIBUTE = "worker.first-message-id"
HANDED_OVER_FROM_ATTRIBUTE = "worker.handed-over-from"
REPLACED_LEASE_ENDS_ATTRIBUTE = "worker.replaced-lease-ends"
BROKE_WORKERS_ATTRIBUTE = "worker.broke-workers"
BREAKAGE_ATTRIBUTE = "worker.breakage"


def sqs_client() -> SQSClient:
    """An SQS client from boto3's usual configuration (AWS_ENDPOINT_URL, region, ...)."""
    return boto3.session.Session().client("sqs", config=client_config())


class SqsSender(Retrying):
    """Sends messages to one queue (job submissions, completion notices)."""

    def __init__(self, client: SQSClient, queue_url: str, attempts: int = DEFAULT_AWS_MAX_ATTEMPTS):
        super().__init__(attempts)
        self._client = client
        self._queue_url = queue_url

    def __call__(self, body: str) -> None:
        self._call(lambda: self._client.send_message(QueueUrl=self._queue_url, MessageBody=body))


class SqsJobSource(Retrying):
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

    def send_many(self, bodies: list[str], group: str, delay_s: int = 0) -> None:
        """Ten to a call, within a call's size; the entries a call failed are sent again
        under the same budget, and any still failing raise."""
        chunk: dict[int, str] = {}
        size = 0
        for number, body in enumerate(bodies):
            length = len(body.encode())
            if chunk and (
                len(chunk) == SQS_MAX_ENTRIES_PER_BATCH_CALL or size + length > SQS_MAX_BATCH_BYTES
            ):
                self._call(functools.partial(self._send_batch, chunk, group, delay_s))
                chunk, size = {}, 0
            chunk[number] = body
            size += length
        if chunk:
            self._call(functools.partial(self._send_batch, chunk, group, delay_s))

    def _send_batch(self, bodies: dict[int, str], group: str, delay_s: int) -> None:
        """Send the entries of `bodies` not sent yet; the sent ones leave it, and a
        failed entry raises: `MessageRefused` where SQS says the sender is at fault (a
        retry would be refused again), else a transient error (the retry sends what is
        left)."""
        entries: Any = [
            {"Id": str(n), "MessageBody": body, "MessageGroupId": group, "DelaySeconds": delay_s}
            for n, body in bodies.items()
        ]
        reply = self._client.send_message_batch(QueueUrl=self._queue_url, Entries=entries)
        for sent in reply.get("Successful", []):
            del bodies[int(sent["Id"])]
        failures = reply.get("Failed", [])
        refused = [failure for failure in failures if failure.get("SenderFault")]
        if refused:
            first = refused[0]
            raise MessageRefused(
                f"{len(refused)} messages refused by SQS: {first.get('Code')}: "
                f"{first.get('Message', '')}"
            )
        if bodies:
            code = failures[0].get("Code") if failures else None
            raise TransientError(f"{len(bodies)} messages not sent: {code}")

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
