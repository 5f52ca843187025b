"""The AWS adapters, a module per service; nothing else imports boto3.

`calls` classifies and retries every call; `sqs` is the job queue (`JobSource`), `s3`
the object store (`BlobStore`); `sns`, `autoscaling`, `ecs` and `imds` are the rest of
what the daemon asks of AWS; `platform` picks, for the machine it runs on, where
interruption notices come from and which guard holds scale-in protection.
"""

from worker.adapters.aws.platform import PlatformUnavailable, interruption_notices, scale_in_guard
from worker.adapters.aws.s3 import S3BlobStore, s3_client
from worker.adapters.aws.sns import SnsPublisher, sns_client
from worker.adapters.aws.sqs import SqsJobSource, SqsSender, sqs_client

__all__ = [
    "PlatformUnavailable",
    "S3BlobStore",
    "SnsPublisher",
    "SqsJobSource",
    "SqsSender",
    "interruption_notices",
    "s3_client",
    "scale_in_guard",
    "sns_client",
    "sqs_client",
]
