"""Buckets of a test's own on the moto server, for the readers' tests."""

from __future__ import annotations

import uuid

from tests.support.aws import Aws


def bucket_with(aws: Aws, objects: dict[str, bytes]) -> str:
    """A new bucket on the moto server holding `objects` (key: bytes); its name."""
    bucket = f"r-{uuid.uuid4().hex[:12]}"
    aws.s3.create_bucket(Bucket=bucket)
    for key, data in objects.items():
        aws.s3.put_object(Bucket=bucket, Key=key, Body=data)
    return bucket
