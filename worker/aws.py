"""The AWS adapters: SQS as a `JobSource`, S3 as a `BlobStore`. Nothing else imports boto3.

Transient errors (throttling, 5xx, connection resets) are retried inside botocore with
its standard retry mode and backoff; what reaches the caller is either permanent or has
outlasted the retries.
"""

from __future__ import annotations

import json
import os
import urllib.request
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from worker.ports import MissingObject, ReceivedMessage, S3Location, ScaleInGuard
from worker.settings import DEFAULT_AWS_MAX_ATTEMPTS, SQS_MAX_ENTRIES_PER_BATCH_CALL

if TYPE_CHECKING:
    from mypy_boto3_autoscaling import AutoScalingClient
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_sqs import SQSClient

MAX_REASON_CHARS = 1000
IMDS_DEFAULT_ENDPOINT = "http://169.254.169.254"
IMDS_TOKEN_TTL_S = 60
IMDS_TIMEOUT_S = 2.0
ECS_AGENT_TIMEOUT_S = 5.0
ASG_NAME_TAG = "aws:autoscaling:groupName"
MISSING_OBJECT_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404"})


def _config(max_attempts: int, max_pool_connections: int = 10) -> Config:
    return Config(
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        max_pool_connections=max_pool_connections,
    )


def sqs_client(max_attempts: int = DEFAULT_AWS_MAX_ATTEMPTS) -> SQSClient:
    """An SQS client from boto3's usual configuration (AWS_ENDPOINT_URL, region, ...)."""
    return boto3.session.Session().client("sqs", config=_config(max_attempts))


def send_message(client: SQSClient, queue_url: str, body: str) -> None:
    client.send_message(QueueUrl=queue_url, MessageBody=body)


def autoscaling_client(max_attempts: int = DEFAULT_AWS_MAX_ATTEMPTS) -> AutoScalingClient:
    return boto3.session.Session().client("autoscaling", config=_config(max_attempts))


def s3_client(max_pool_connections: int, max_attempts: int = DEFAULT_AWS_MAX_ATTEMPTS) -> S3Client:
    """An S3 client with room for `max_pool_connections` concurrent requests."""
    return boto3.session.Session().client("s3", config=_config(max_attempts, max_pool_connections))


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


class ProtectionUnavailable(Exception):
    """The environment offers no way to protect this machine (not EC2 ASG, not ECS)."""


class AsgGuard:
    """EC2 Auto Scaling: SetInstanceProtection on this instance."""

    name = "asg"
    renew_every_s: float | None = None  # protection of an instance does not expire

    def __init__(self, client: AutoScalingClient, instance_id: str, group_name: str):
        self._client = client
        self.instance_id = instance_id
        self.group_name = group_name

    def set_protected(self, protected: bool) -> None:
        self._client.set_instance_protection(
            InstanceIds=[self.instance_id],
            AutoScalingGroupName=self.group_name,
            ProtectedFromScaleIn=protected,
        )


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


def imds_get(path: str, endpoint: str | None = None) -> str:
    """GET an instance metadata path with an IMDSv2 session token (token first)."""
    base = (endpoint or os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or "").rstrip("/")
    base = base or IMDS_DEFAULT_ENDPOINT
    token_request = urllib.request.Request(
        base + "/latest/api/token",
        method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL_S)},
    )
    with urllib.request.urlopen(token_request, timeout=IMDS_TIMEOUT_S) as reply:
        token = reply.read().decode()
    request = urllib.request.Request(base + path, headers={"X-aws-ec2-metadata-token": token})
    with urllib.request.urlopen(request, timeout=IMDS_TIMEOUT_S) as reply:
        return reply.read().decode()  # type: ignore[no-any-return]


def scale_in_guard(
    mode: str, asg_name: str | None, ecs_expires_minutes: int, max_attempts: int
) -> ScaleInGuard | None:
    """The guard for `mode` (auto, asg, ecs, off); None for off.

    `auto` takes ECS when the agent's URI is set, else EC2 Auto Scaling when the instance
    metadata service answers, else off. An explicit mode that cannot work raises
    `ProtectionUnavailable`, so a misconfigured fleet fails at start, not at scale-in.
    """
    if mode == "off":
        return None
    agent_uri = os.environ.get("ECS_AGENT_URI")
    if mode == "ecs" or (mode == "auto" and agent_uri):
        if not agent_uri:
            raise ProtectionUnavailable("--protection ecs, but ECS_AGENT_URI is not set")
        return EcsGuard(agent_uri, ecs_expires_minutes)
    if mode == "auto" and os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return None
    try:
        instance_id = imds_get("/latest/meta-data/instance-id")
        group = asg_name or imds_get(f"/latest/meta-data/tags/instance/{ASG_NAME_TAG}")
    except OSError as error:
        if mode == "auto":
            return None
        raise ProtectionUnavailable(
            f"--protection asg, but the instance metadata service did not say which "
            f"instance and group this is ({error}); is the instance in an Auto Scaling "
            "group with instance metadata tags on, or is --asg-name missing?"
        ) from error
    return AsgGuard(autoscaling_client(max_attempts), instance_id, group)
