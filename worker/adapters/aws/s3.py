"""S3: objects as a `BlobStore`, and reads from another process (`RemoteReader`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import boto3
import structlog
from botocore.exceptions import ClientError

from worker.adapters.aws.calls import Retrying, client_config, retried_call_s
from worker.errors import AccessDenied, MissingObject, ObjectTooLarge, PreconditionFailed
from worker.ports import (
    ABSENT,
    ByteRange,
    ObjectHead,
    ObjectReader,
    RemoteReader,
    S3Location,
)
from worker.retry import DEFAULT_AWS_MAX_ATTEMPTS

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef, ObjectIdentifierTypeDef

log = structlog.get_logger()

# A file bigger than this is uploaded in parts of this size (S3 takes 5 MiB to 5 GiB).
MULTIPART_PART_BYTES = 64 * 2**20
S3_MAX_KEYS_PER_DELETE = 1000
# Multipart uploads: each part but the last at least 5 MiB, at most 5 GiB, 10,000 parts.
S3_MIN_PART_BYTES = 5 * 2**20
S3_MAX_PART_BYTES = 5 * 2**30
S3_MAX_PARTS = 10_000
COPY_THREADS = 16  # part copies made at once (S3 takes the parts of an upload in any order)
STREAM_CHUNK_BYTES = 64 * 1024  # a streamed object's pieces (`chunks`)
# The client another process reads inputs with (`remote_reader`): auto is obstore where
# it imports.
InputClient = Literal["auto", "obstore", "boto3"]


def s3_client(max_pool_connections: int) -> S3Client:
    """An S3 client with room for `max_pool_connections` concurrent requests."""
    return boto3.session.Session().client("s3", config=client_config(max_pool_connections))


def _conditions(expect: str | None) -> dict[str, Any]:
    """A write's condition: `ABSENT` if the object must not exist, else its ETag."""
    if expect is None:
        return {}
    return {"IfNoneMatch": "*"} if expect == ABSENT else {"IfMatch": expect}


class S3BlobStore(Retrying):
    """Objects in S3."""

    def __init__(
        self,
        client: S3Client,
        attempts: int = DEFAULT_AWS_MAX_ATTEMPTS,
        *,
        client_from_environment: bool = False,
        part_bytes: int = MULTIPART_PART_BYTES,
        input_client: InputClient = "boto3",
    ):
        super().__init__(attempts)
        self._client = client
        self._client_from_environment = client_from_environment
        self._part_bytes = part_bytes
        self._input_client = input_client

    @classmethod
    def from_environment(
        cls, connections: int, attempts: int, input_client: InputClient = "auto"
    ) -> S3BlobStore:
        """A store whose client follows boto3's usual configuration, as the client that
        another process makes for itself will (`remote_reader`, with `input_client`)."""
        return cls(
            s3_client(connections),
            attempts,
            client_from_environment=True,
            input_client=input_client,
        )

    def remote_reader(self) -> RemoteReader | None:
        """Reads with a client of the reading process's own, made from the environment as
        this store's was (obstore's or boto3's, `_reads_with_obstore`); None for a store
        given some other client (a test's)."""
        if not self._client_from_environment:
            return None
        attempts = self._attempts
        if self._reads_with_obstore():
            from worker.adapters.aws.obstore_reads import open_obstore_reader

            opener, module = open_obstore_reader, open_obstore_reader.__module__
        else:
            opener, module = open_s3_reader, __name__
        return RemoteReader(
            functools.partial(opener, attempts), retried_call_s(attempts), imports=(module,)
        )

    def _reads_with_obstore(self) -> bool:
        """Whether other processes read with obstore: asked to (`input_client`), or auto
        and obstore imports; `PlatformUnavailable` if asked to and it does not."""
        if self._input_client == "boto3":
            log.info("inputs_read_with", client="boto3", why="input_client=boto3")
            return False
        try:
            import worker.adapters.aws.obstore_reads  # noqa: F401 (obstore imports)
        except ImportError as error:
            if self._input_client == "obstore":
                from worker.adapters.aws.platform import PlatformUnavailable

                raise PlatformUnavailable(f"input_client=obstore: {error}") from error
            log.warning("inputs_read_with", client="boto3", why=f"obstore does not import: {error}")
            return False
        log.info("inputs_read_with", client="obstore", why=f"input_client={self._input_client}")
        return True

    def get(
        self,
        location: S3Location,
        max_bytes: int | None = None,
        byte_range: ByteRange | None = None,
        *,
        expect: str | None = None,
    ) -> bytes:
        if byte_range is not None and byte_range[1] == 0:
            return b""  # no Range header asks for nothing

        def read() -> bytes:
            # Inside the retried call: a reset or a short read mid-body is as transient
            # as a failed request (botocore checks the length read against the size
            # S3 gave when the body is read whole).
            body, size = self._opened(location, max_bytes, byte_range, if_match=expect)
            with contextlib.closing(body):
                if max_bytes is None or size is not None:
                    return body.read()  # type: ignore[no-any-return]
                data: bytes = body.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise ObjectTooLarge(None, max_bytes)
            return data

        return self._call(read)

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Generator[bytes]:
        # The request is retried; a reset mid-body is the caller's (transient) error.
        body, _ = self._call(lambda: self._opened(location, max_bytes, if_match=expect))
        with contextlib.closing(body):
            read = 0
            for chunk in body.iter_chunks(STREAM_CHUNK_BYTES):
                read += len(chunk)
                if read > max_bytes:
                    raise ObjectTooLarge(None, max_bytes)
                yield chunk

    def _opened(
        self,
        location: S3Location,
        max_bytes: int | None,
        byte_range: ByteRange | None = None,
        if_match: str | None = None,
    ) -> tuple[Any, int | None]:
        """The object's body (of `byte_range`), unread, and its size if S3 gave it;
        `ObjectTooLarge` if that is over `max_bytes` (the body's connection is closed,
        not drained)."""
        conditions: dict[str, Any] = {} if if_match is None else {"IfMatch": if_match}
        if byte_range is not None:
            first, size = byte_range
            conditions["Range"] = f"bytes={first}-{first + size - 1}"
        reply = self._client.get_object(Bucket=location.bucket, Key=location.key, **conditions)
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
        multipart upload, read a part at a time."""
        if path.stat().st_size <= self._part_bytes:
            return self.put(location, path.read_bytes(), content_type, expect=expect)

        def write(upload: _Upload) -> None:
            with path.open("rb") as file:
                while chunk := file.read(self._part_bytes):
                    upload.add(chunk)

        return self._multipart(location, content_type, expect, write)

    def compose(
        self,
        location: S3Location,
        sources: list[tuple[S3Location, int]],
        content_type: str,
        *,
        expect: str | None = None,
    ) -> str:
        """A source big enough to be a part of its own (S3's minimum, 5 MiB, except the
        last) that starts a part is copied by S3 (UploadPartCopy); the others are read
        and uploaded in parts of `part_bytes`. Sources that fit in one part in all are
        one write."""
        if sum(size for _, size in sources) <= self._part_bytes:
            data = b"".join(self.get(source, size) for source, size in sources)
            return self.put(location, data, content_type, expect=expect)
        copies_fit = len(sources) <= S3_MAX_PARTS

        def write(upload: _Upload) -> None:
            pending = bytearray()
            for source, size in sources:
                if copies_fit and not pending and S3_MIN_PART_BYTES <= size <= S3_MAX_PART_BYTES:
                    upload.copy(source)
                    continue
                for chunk in self.chunks(source, size):
                    pending += chunk
                    if len(pending) >= self._part_bytes:
                        upload.add(bytes(pending[: self._part_bytes]))
                        del pending[: self._part_bytes]
            if pending or not upload.count:
                upload.add(bytes(pending))

        return self._multipart(location, content_type, expect, write)

    def _multipart(
        self,
        location: S3Location,
        content_type: str,
        expect: str | None,
        write: Callable[[_Upload], None],
    ) -> str:
        """A multipart upload whose parts `write` adds; it appears (on `expect`'s
        condition) only when it is completed, and is aborted if it is not."""
        bucket, key = location.bucket, location.key
        created = self._call(
            lambda: self._client.create_multipart_upload(
                Bucket=bucket, Key=key, ContentType=content_type
            )
        )
        completed = False
        with ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="copy") as copying:
            upload = _Upload(self._client, self._call, location, created["UploadId"], copying)
            try:
                write(upload)
                parts = upload.parts()

                def complete() -> str:
                    nonlocal completed
                    reply = self._client.complete_multipart_upload(
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload.upload_id,
                        MultipartUpload={"Parts": parts},
                        **_conditions(expect),
                    )
                    completed = True
                    return reply["ETag"]

                return self._written(location, expect, upload.etag(parts), complete)
            finally:
                # Not completed: failed, or refused on its condition (even where the
                # object holds these bytes already). Copies still going end first.
                if not completed:
                    copying.shutdown(wait=True, cancel_futures=True)
                    self._abort(location, upload.upload_id)

    def _abort(self, location: S3Location, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(
                Bucket=location.bucket, Key=location.key, UploadId=upload_id
            )
        except Exception as error:  # the bucket's lifecycle rule cleans up after it
            log.warning("multipart_abort_failed", location=str(location), error=repr(error))

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

    def head(self, location: S3Location) -> ObjectHead:
        def asked() -> Any:
            return self._client.head_object(Bucket=location.bucket, Key=location.key)

        try:
            reply = self._call(asked)
        except (AccessDenied, ClientError) as error:
            # A HEAD's error has no body, so it is named by its status alone: an expired
            # token (400) or the worker's clock (403), for now, read as a request or an
            # object refused for good. A GET of its first byte says which, by its code.
            if isinstance(error, ClientError) and error.response["Error"]["Code"] != "400":
                raise
            try:
                self.get(location, byte_range=(0, 1))
            except ClientError:  # unnamed by its class (an empty object's range): the HEAD's
                raise error from None
            # The GET answered: the refusal has passed (credentials rotated between the
            # two) or the store refuses HEADs alone; a second HEAD says which.
            reply = self._call(asked)
        return ObjectHead(reply["ETag"], reply["ContentLength"])

    def _etag(self, location: S3Location) -> str | None:
        try:
            return self.head(location).etag
        except MissingObject:
            return None

    def objects_under(self, prefix: S3Location) -> dict[str, str]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=prefix.bucket, Prefix=prefix.key, Delimiter="/"
        )
        listed: dict[str, str] = {}
        for page in self._call(lambda: tuple(pages)):
            for entry in page.get("Contents", []):
                listed[entry["Key"][len(prefix.key) :]] = entry["ETag"]
        return listed

    def keys_under(self, prefix: S3Location) -> Iterator[str]:
        continuation: dict[str, str] = {}
        while True:
            page = self._call(
                functools.partial(
                    self._client.list_objects_v2,
                    Bucket=prefix.bucket,
                    Prefix=prefix.key,
                    **continuation,  # type: ignore[arg-type]
                )
            )
            yield from (entry["Key"] for entry in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return
            continuation = {"ContinuationToken": page["NextContinuationToken"]}

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


class _Upload:
    """The parts of one multipart upload, numbered as they are added: data is sent at
    once, copies are made by S3 side by side (`COPY_THREADS` at a time)."""

    def __init__(
        self,
        client: S3Client,
        call: Callable[[Callable[[], Any]], Any],
        location: S3Location,
        upload_id: str,
        copying: ThreadPoolExecutor,
    ):
        self._client = client
        self._call = call
        self._location = location
        self.upload_id = upload_id
        self._copying = copying
        self._etags: dict[int, str | Future[str]] = {}

    @property
    def count(self) -> int:
        return len(self._etags)

    def add(self, data: bytes) -> None:
        number = self.count + 1
        reply = self._call(self._part(self._client.upload_part, number, Body=data))
        self._etags[number] = reply["ETag"]

    def copy(self, source: S3Location) -> None:
        number = self.count + 1
        origin = {"Bucket": source.bucket, "Key": source.key}
        part = self._part(self._client.upload_part_copy, number, CopySource=origin)
        self._etags[number] = self._copying.submit(
            lambda: self._call(part)["CopyPartResult"]["ETag"]
        )

    def _part(self, method: Callable[..., Any], number: int, **fields: Any) -> Callable[[], Any]:
        return functools.partial(
            method,
            Bucket=self._location.bucket,
            Key=self._location.key,
            UploadId=self.upload_id,
            PartNumber=number,
            **fields,
        )

    def parts(self) -> list[CompletedPartTypeDef]:
        """Every part, in order, once each is sent (raises the first that failed)."""
        return [
            {"PartNumber": number, "ETag": etag if isinstance(etag, str) else etag.result()}
            for number, etag in sorted(self._etags.items())
        ]

    def etag(self, parts: list[CompletedPartTypeDef]) -> str:
        """The ETag S3 gives the completed upload (where part ETags are MD5s: not under
        SSE-KMS, where a lost answer's retry is then taken as fenced)."""
        digests = []
        for part in parts:
            try:
                digests.append(bytes.fromhex(part["ETag"].strip('"')))
            except ValueError:  # not an MD5: the completed ETag will not be foreseen
                digests.append(part["ETag"].encode())
        joined = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
        return f'"{joined}-{len(parts)}"'


def open_s3_reader(attempts: int, connections: int) -> ObjectReader:
    """`S3BlobStore.get` with a client of this process's own, for `connections` reads at
    once (`RemoteReader.open`)."""
    return S3BlobStore(s3_client(connections), attempts).get
