"""The AWS adapters: SQS as a `JobSource`, S3 as a `BlobStore`. Nothing else imports boto3.

Transient errors (throttling, 5xx, connection resets) are retried inside botocore with
its standard retry mode and backoff; what reaches the caller is either permanent or has
outlasted the retries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from worker.ports import MissingObject, ReceivedMessage, S3Location
from worker.settings import SQS_MAX_ENTRIES_PER_BATCH_CALL

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_sqs import SQSClient

MAX_REASON_CHARS = 1000
MISSING_OBJECT_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404"})


def _config(max_pool_connections: int = 10) -> Config:
    return Config(
        retries={"mode": "standard", "max_attempts": 8},
        max_pool_connections=max_pool_connections,
    )


def sqs_client() -> SQSClient:
    """An SQS client from boto3's usual configuration (AWS_ENDPOINT_URL, region, ...)."""
    return boto3.session.Session().client("sqs", config=_config())


def s3_client(max_pool_connections: int) -> S3Client:
    """An S3 client with room for `max_pool_connections` concurrent requests."""
    return boto3.session.Session().client("s3", config=_config(max_pool_connections))


class SqsJobSource:
    """Job messages from one SQS queue, with an optional dead-letter queue."""

    def __init__(self, client: SQSClient, queue_url: str, dlq_url: str | None):
        self._client = client
        self._queue_url = queue_url
        self._dlq_url = dlq_url

    def receive(
        self, max_messages: int, wait_s: int, visibility_timeout_s: int
    ) -> list[ReceivedMessage]:
        reply = self._client.receive_message(
            QueueUrl=self._queue_url,
            MaxNumberOfMessages=max_messages,
            WaitTimeSeconds=wait_s,
            VisibilityTimeout=visibility_timeout_s,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        )
        return [
            ReceivedMessage(
                message_id=message["MessageId"],
                body=message["Body"],
                receipt_handle=message["ReceiptHandle"],
                receive_count=int(message.get("Attributes", {}).get("ApproximateReceiveCount", 1)),
            )
            for message in reply.get("Messages", [])
        ]

    def ack(self, receipt_handle: str) -> None:
        self._client.delete_message(QueueUrl=self._queue_url, ReceiptHandle=receipt_handle)

    def release(self, receipt_handle: str) -> None:
        self._client.change_message_visibility(
            QueueUrl=self._queue_url, ReceiptHandle=receipt_handle, VisibilityTimeout=0
        )

    def extend(self, receipt_handles: list[str], visibility_timeout_s: int) -> dict[str, str]:
        failures: dict[str, str] = {}
        for start in range(0, len(receipt_handles), SQS_MAX_ENTRIES_PER_BATCH_CALL):
            chunk = receipt_handles[start : start + SQS_MAX_ENTRIES_PER_BATCH_CALL]
            reply = self._client.change_message_visibility_batch(
                QueueUrl=self._queue_url,
                Entries=[
                    {
                        "Id": str(n),
                        "ReceiptHandle": handle,
                        "VisibilityTimeout": visibility_timeout_s,
                    }
                    for n, handle in enumerate(chunk)
                ],
            )
            # A batch call succeeds as a whole even when entries fail: check each one
            # (bbc/sqs-consumer#193).
            for failure in reply.get("Failed", []):
                failures[chunk[int(failure["Id"])]] = failure.get("Code", "Unknown")
        return failures

    def dead_letter(self, message: ReceivedMessage, reason: str) -> bool:
        if self._dlq_url is None:
            return False
        attributes: Any = {
            "reason": {"DataType": "String", "StringValue": reason[:MAX_REASON_CHARS]},
            "source_message_id": {"DataType": "String", "StringValue": message.message_id},
        }
        self._client.send_message(
            QueueUrl=self._dlq_url, MessageBody=message.body or " ", MessageAttributes=attributes
        )
        self.ack(message.receipt_handle)
        return True


class S3BlobStore:
    """Objects in S3."""

    def __init__(self, client: S3Client):
        self._client = client

    def get(self, location: S3Location) -> bytes:
        try:
            reply = self._client.get_object(Bucket=location.bucket, Key=location.key)
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code in MISSING_OBJECT_CODES:
                raise MissingObject(f"{location} does not exist ({code})") from error
            raise
        return reply["Body"].read()

    def put(self, location: S3Location, data: bytes, content_type: str) -> None:
        self._client.put_object(
            Bucket=location.bucket, Key=location.key, Body=data, ContentType=content_type
        )
