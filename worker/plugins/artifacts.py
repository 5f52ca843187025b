"""Models in S3 (`--model s3://bucket/key.pt2`, as SageMaker takes its model artifacts):
fetched once, at start, by the daemon's main process into a local cache, before the
model's processes start and load the copy as they load any file.

A copy is `<cache>/<sha256 of the bucket, key and ETag>/<the key's file name>`: a
start finds the ETag by a HEAD and reads a copy of that ETag from disk, and fetches an
object uploaded again under the same key (a new ETag) afresh. It is written under a
temporary name and renamed once whole, so a start killed mid-download leaves no file the
cache would take. The model's identity is then the file's digest, as for any file: the
same artifact in S3 or on disk is the same model, with the same name (the key's file
name) and version (`worker.plugins.identity`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import structlog

from worker.errors import (
    AccessDenied,
    CannotStart,
    MissingObject,
    ObjectTooLarge,
    PreconditionFailed,
    TransientError,
)
from worker.plugins.loading import EXPORT_SUFFIX, TORCHSCRIPT_SUFFIXES
from worker.plugins.spec import ModelStep, PipelineSpec
from worker.ports import BlobStore, ObjectHead, S3Location

log = structlog.get_logger()

S3_SCHEME = "s3://"
MODEL_CACHE_DIR = "model-cache"  # under --log-dir, unless --model-cache-dir says where
MODEL_SUFFIXES = (EXPORT_SUFFIX, *TORCHSCRIPT_SUFFIXES)
# A download cut short (a reset mid-body) or an object replaced between its HEAD and its
# GET starts again from the HEAD, this many times in all.
FETCH_TRIES = 3
PARTIAL_PREFIX = ".partial-"  # a download under way, never read as a model


class ModelCache:
    """The local copies of models in S3, in `directory`; an object is fetched only if
    it fits in `room_bytes` (default: the space free on the directory's disk)."""

    def __init__(self, directory: Path, blobs: BlobStore, room_bytes: int | None = None):
        self._directory = directory
        self._blobs = blobs
        self._room_bytes = room_bytes

    def local(self, reference: str, setting: str) -> str:
        """The model file to load for `reference` (which `setting` named): for an S3
        object the path of its copy, fetched if need be; any other reference itself.
        `CannotStart`, naming the setting, if the object cannot be had."""
        if not reference.startswith(S3_SCHEME):
            return reference
        try:
            location = S3Location.parse(reference)
        except ValueError as error:
            raise CannotStart(f"{error} ({setting})") from None
        if not location.key.endswith(MODEL_SUFFIXES):
            raise CannotStart(
                f"{reference} ({setting}): a model in S3 is a torch.export archive "
                f"({EXPORT_SUFFIX}) or a TorchScript file ({', '.join(TORCHSCRIPT_SUFFIXES)})"
            )
        try:
            return str(self._fetched(location))
        except ObjectTooLarge as error:
            raise CannotStart(
                f"cannot fetch the model {reference} ({setting}): it is {error.size} bytes, "
                f"and {self._directory} (--model-cache-dir) has room for {error.limit}"
            ) from None
        except (MissingObject, AccessDenied, TransientError) as error:
            raise CannotStart(f"cannot fetch the model {reference} ({setting}): {error}") from None
        except OSError as error:
            raise CannotStart(
                f"cannot keep the model {reference} in {self._directory} (--model-cache-dir): "
                f"{error.strerror or error}"
            ) from None

    def _fetched(self, location: S3Location) -> Path:
        """The copy of the object's current ETag, downloaded unless it is here."""
        tries_left = FETCH_TRIES
        while True:
            try:
                return self._fetched_once(location)
            except (PreconditionFailed, TransientError) as error:
                tries_left -= 1
                if not tries_left:
                    raise TransientError(f"{FETCH_TRIES} tries, the last: {error}") from error
                log.warning("model_fetch_retried", location=str(location), error=str(error))

    def _fetched_once(self, location: S3Location) -> Path:
        head = self._blobs.head(location)
        path = self._path(location, head)
        if path.is_file() and path.stat().st_size == head.size:
            log.info("model_cached", location=str(location), etag=head.etag, path=str(path))
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        room = shutil.disk_usage(path.parent).free if self._room_bytes is None else self._room_bytes
        if head.size > room:
            raise ObjectTooLarge(head.size, room)
        started = time.monotonic()
        self._download(location, head, path)
        log.info(
            "model_fetched",
            location=str(location),
            etag=head.etag,
            bytes=head.size,
            seconds=round(time.monotonic() - started, 3),
            path=str(path),
        )
        return path

    def _path(self, location: S3Location, head: ObjectHead) -> Path:
        named = f"{location.bucket}\n{location.key}\n{head.etag}".encode()
        return self._directory / hashlib.sha256(named).hexdigest() / Path(location.key).name

    def _download(self, location: S3Location, head: ObjectHead, path: Path) -> None:
        """The object's bytes of `head`'s ETag (If-Match: not a newer upload's) into
        `path`, whole or not at all."""
        with tempfile.NamedTemporaryFile(
            dir=path.parent, prefix=PARTIAL_PREFIX, delete=False
        ) as partial:
            try:
                written = 0
                for chunk in self._blobs.chunks(location, head.size, expect=head.etag):
                    written += partial.write(chunk)
                if written != head.size:
                    raise TransientError(f"read {written} of its {head.size} bytes")
                partial.flush()
                os.fsync(partial.fileno())
            except BaseException:  # a stop at start (SIGTERM) too: no partial file stays
                os.unlink(partial.name)
                raise
        os.replace(partial.name, path)


def with_local_models(spec: PipelineSpec, cache: ModelCache, setting: str) -> PipelineSpec:
    """`spec` with each model in S3 replaced by its local copy (`setting` named them)."""
    steps = [
        step.model_copy(update={"model": cache.local(step.model, setting)})
        if isinstance(step, ModelStep)
        else step
        for step in spec.steps
    ]
    return spec.model_copy(update={"steps": steps})
