"""SNS: a topic to publish completion notices to."""

from __future__ import annotations

from typing import TYPE_CHECKING

import boto3

from worker.adapters.aws.calls import Retrying, client_config
from worker.retry import DEFAULT_AWS_MAX_ATTEMPTS

if TYPE_CHECKING:
    from mypy_boto3_sns import SNSClient


def sns_client() -> SNSClient:
    return boto3.session.Session().client("sns", config=client_config())


class SnsPublisher(Retrying):
    """Publishes messages to one SNS topic (completion notices, fanned out by SNS)."""

    def __init__(self, client: SNSClient, topic_arn: str, attempts: int = DEFAULT_AWS_MAX_ATTEMPTS):
        super().__init__(attempts)
        self._client = client
        self._topic_arn = topic_arn

    def __call__(self, body: str) -> None:
        self._call(lambda: self._client.publish(TopicArn=self._topic_arn, Message=body))
