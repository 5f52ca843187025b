"""S3 reads through obstore (Rust's `object_store`): the `ObjectReader` of the
preprocessing processes where `--input-client` picks it (by default, where obstore
imports). A GET costs a third of boto3's CPU there (docs/performance.md, "GETs cheap
enough for 10,000 a second"); boto3 stays for everything else.

It reads as `S3BlobStore.get` does, and what boto3 would: the endpoint, region and
credentials are those of a boto3 client made in the same process (so environment,
`AWS_ENDPOINT_URL`, profiles, an instance profile or an ECS task role all count), the
credentials read from boto3 again every 5 minutes (boto3 refreshes a role's before
they expire). Errors are classified by the same table as boto3's (`classify_reply`, on
the status and S3 error code obstore reports) and retried under the same budget, with
obstore's own retries off. What obstore cannot read as boto3 would goes through boto3,
said in a log line (`input_reads_through_boto3`): a key its paths do not hold as it is
(a leading, trailing or doubled "/", a "." or ".." segment, a control character), a
bucket in another region (boto3 follows S3's redirect), or no credentials at start.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import boto3
import obstore
import structlog
from obstore.exceptions import BaseError as ObstoreError
from obstore.exceptions import UnauthenticatedError
from obstore.store import S3Store

from worker.adapters.aws.calls import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    classify_reply,
    client_config,
    retried_call_s,
)
from worker.adapters.aws.s3 import S3BlobStore
from worker.errors import ObjectTooLarge, TransientError
from worker.ports import ByteRange, ObjectReader, S3Location
from worker.retry import call_with_retries

if TYPE_CHECKING:
    from botocore.credentials import Credentials
    from obstore.store import S3Credential

log = structlog.get_logger()

# obstore asks for credentials again 5 minutes before those it holds expire, so these,
# said to last 10, are read from boto3 every 5 minutes; boto3 refreshes a role's 10 to
# 15 minutes before they expire, so those held here never are.
CREDENTIALS_TTL = timedelta(minutes=10)
MAX_BUCKETS = 64  # buckets with a store (and a pool) of their own: the latest used
# obstore says what failed only in its message: a reply's status and S3 error, or the
# kind of transport failure (reqwest's: connect, request, timeout, interrupted, ...).
_STATUS = re.compile(r"\bstatus(?: code)?: (\d{3})\b")
_CODE = re.compile(r"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_TRANSPORT = re.compile(r"HttpError \{\s*kind: (\w+)")
# S3's answers to a request sent to another region than the bucket's (obstore follows
# no redirect; boto3 does, https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html).
_BARE_REDIRECT = "Received redirect without LOCATION"
REGION_STATUSES = frozenset({301, 307})
REGION_CODES = frozenset(
    {
        "PermanentRedirect",
        "TemporaryRedirect",
        "AuthorizationHeaderMalformed",
        "IllegalLocationConstraintException",
    }
)
# Keys obstore's paths cannot hold as they are: it drops a leading or trailing "/"
# (another object), and refuses "//", "." and ".." segments and ASCII control characters.
_NOT_A_PATH = re.compile(r"^$|^/|/$|//|(?:^|/)\.\.?(?:/|$)|[\x00-\x1f\x7f]")


def open_obstore_reader(attempts: int, connections: int) -> ObjectReader:
    """`S3BlobStore.get` through obstore for `connections` reads at once, with the
    endpoint, region and credentials of a boto3 client made here (`RemoteReader.open`)."""
    session = boto3.session.Session()
    client = session.client("s3", config=client_config(connections))
    through_boto3 = S3BlobStore(client, attempts)
    credentials = session.get_credentials()
    if credentials is None:
        log.warning("input_reads_through_boto3", reason="boto3 found no credentials")
        return through_boto3.get
    region = client.meta.region_name
    return ObstoreReader(
        client.meta.endpoint_url,
        "us-east-1" if region in (None, "aws-global") else region,
        _Credentials(credentials),
        attempts=attempts,
        connections=connections,
        through_boto3=through_boto3,
    ).get


class ObstoreReader:
    """`S3BlobStore.get` through obstore, from many threads at once: a store per bucket,
    each with a pool of `connections`; what obstore cannot read as boto3 would goes to
    `through_boto3`."""

    def __init__(
        self,
        endpoint: str,
        region: str,
        credentials: Callable[[], S3Credential],
        *,
        attempts: int,
        connections: int,
        through_boto3: S3BlobStore,
    ):
        self._attempts = attempts
        self._through_boto3 = through_boto3
        self._elsewhere: set[str] = set()  # buckets in another region
        self._key_told = False
        self._store: Callable[[str], S3Store] = functools.lru_cache(MAX_BUCKETS)(
            functools.partial(
                S3Store,
                endpoint=endpoint,
                region=region,
                credential_provider=credentials,
                retry_config={"max_retries": 0},  # one retry policy: ours
                client_options={
                    "allow_http": endpoint.startswith("http://"),
                    "connect_timeout": timedelta(seconds=CONNECT_TIMEOUT_S),
                    "read_timeout": timedelta(seconds=READ_TIMEOUT_S),
                    # botocore bounds each read, not a whole request (obstore's default
                    # is 30 s); the fetch's own limit is the longest the tries may take.
                    "timeout": timedelta(seconds=retried_call_s(attempts)),
                    "pool_max_idle_per_host": str(connections),
                },
            )
        )

    def get(
        self,
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: ByteRange | None = None,
    ) -> bytes:
        """`S3BlobStore.get`: the object's bytes (of `byte_range`), `ObjectTooLarge`
        unread over `max_bytes`, errors classified and transient ones retried."""
        if byte_range is not None and byte_range[1] == 0:
            return b""  # as S3BlobStore.get: no Range header asks for nothing
        if location.bucket in self._elsewhere or not self._addressable(location):
            return self._through_boto3.get(location, max_bytes, byte_range)
        try:
            return call_with_retries(
                lambda: self._read(location, max_bytes, byte_range), self._attempts
            )
        except _ElsewhereRegion as answer:
            self._elsewhere.add(location.bucket)
            log.warning(
                "input_reads_through_boto3",
                reason="the bucket is in another region than boto3's",
                bucket=location.bucket,
                answer=str(answer),
            )
            return self._through_boto3.get(location, max_bytes, byte_range)

    def _addressable(self, location: S3Location) -> bool:
        if not _NOT_A_PATH.search(location.key):
            return True
        if not self._key_told:  # the first such key, not every one
            self._key_told = True
            log.warning(
                "input_reads_through_boto3",
                reason="a key obstore's paths do not hold as it is",
                location=str(location),
            )
        return False

    def _read(
        self, location: S3Location, max_bytes: int | None, byte_range: ByteRange | None
    ) -> bytes:
        store = self._store(location.bucket)
        try:
            if byte_range is None:
                result = obstore.get(store, location.key)
            else:
                first, size = byte_range
                result = obstore.get(store, location.key, options={"range": (first, first + size)})
            start, end = result.range  # the reply's, before its body is read
            if max_bytes is not None and end - start > max_bytes:
                del result  # dropped unread: its connection is closed, not drained
                raise ObjectTooLarge(end - start, max_bytes)
            return bytes(result.bytes())
        except (ObstoreError, OSError) as error:
            classified = classify_obstore(error)
            if classified is error:
                raise
            raise classified from error


class _ElsewhereRegion(Exception):
    """The bucket answered that it is in another region than the store's."""


def classify_obstore(error: Exception) -> Exception:
    """The error to raise in place of obstore's `error`, as `calls.classify` would for
    boto3's: by the reply's status and S3 error code where there was a reply (a missing
    key `MissingObject`, a 403 `AccessDenied`, throttling and 5xx `TransientError`, a
    reply that is none of these the `ClientError` botocore would have raised); a
    transport failure (connect, reset, timeout, a short body) or credentials that could
    not be had, `TransientError`; anything else, `error` itself."""
    text = str(error)
    summary = text.partition("\n")[0]
    status, code = _STATUS.search(text), _CODE.search(text)
    if (
        _BARE_REDIRECT in text
        or (status and int(status[1]) in REGION_STATUSES)
        or (code and code[1] in REGION_CODES)
    ):
        return _ElsewhereRegion(summary)
    if status:
        message = _MESSAGE.search(text)
        return classify_reply(
            int(status[1]), code[1] if code else "", message[1] if message else "", "GetObject"
        )
    if transport := _TRANSPORT.search(text):
        return TransientError(f"{transport[1]}: {summary}")
    if isinstance(error, UnauthenticatedError):  # no reply: the credentials were not had
        return TransientError(f"credentials: {summary}")
    return error


class _Credentials:
    """boto3's credentials as obstore asks for them (its `credential_provider`): read
    from boto3 each time, which refreshes a role's itself."""

    def __init__(self, credentials: Credentials):
        self._credentials = credentials

    def __call__(self) -> S3Credential:
        frozen = self._credentials.get_frozen_credentials()
        if frozen.access_key is None or frozen.secret_key is None:  # obstore: not had
            raise ValueError("boto3's credentials have no key")
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(UTC) + CREDENTIALS_TTL,
        }
