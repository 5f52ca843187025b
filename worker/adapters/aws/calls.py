"""Calls to AWS: the one place their errors are classified and retried.

Errors are classified where they are raised (`worker.errors`): throttling, 5xx,
timeouts, resets and short reads become `TransientError` and are retried with backoff
under each call's own budget (`worker.retry`); a missing object is `MissingObject`, a
refused one `AccessDenied`; anything else is raised as botocore gave it. botocore's own
retries are off, so there is one retry policy, not two stacked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

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
from botocore.exceptions import ConnectionError as BotoConnectionError

from worker.errors import AccessDenied, MissingObject, PreconditionFailed, TransientError
from worker.retry import CALL_BACKOFF, call_with_retries

T = TypeVar("T")

CONNECT_TIMEOUT_S = 5
# Longer than SQS's longest long poll (20 s), or a quiet receive would time out.
READ_TIMEOUT_S = 30
LONGEST_CALL_S = CONNECT_TIMEOUT_S + READ_TIMEOUT_S  # one try of a call, at worst

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


def classify_reply(status: int, code: str, message: str, operation: str) -> Exception:
    """What `classify` makes of an error reply that another client read (obstore): the
    same class for the same HTTP status and S3 error code, else the `ClientError`
    botocore would have raised (its code the status where the reply gave none, as
    botocore's)."""
    return classify(
        ClientError(
            {
                "Error": {"Code": code or str(status), "Message": message},
                "ResponseMetadata": {
                    "HTTPStatusCode": status,
                    "HTTPHeaders": {},
                    "RequestId": "",
                    "HostId": "",
                    "RetryAttempts": 0,
                },
            },
            operation,
        )
    )


def retried_call_s(attempts: int) -> float:
    """The longest a call of `attempts` tries can take: each try at its longest
    (`LONGEST_CALL_S`) and the longest backoff before each retry."""
    backoffs_s = sum(CALL_BACKOFF.bound_s(retry) for retry in range(attempts - 1))
    return attempts * LONGEST_CALL_S + backoffs_s


def _classified(call: Callable[[], T]) -> T:
    try:
        return call()
    except Exception as error:
        classified = classify(error)
        if classified is error:
            raise
        raise classified from error


class Retrying:
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


def client_config(max_pool_connections: int = 10) -> Config:
    return Config(
        retries={"mode": "standard", "total_max_attempts": 1},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        max_pool_connections=max_pool_connections,
    )
