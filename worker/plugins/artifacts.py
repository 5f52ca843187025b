"""Models in S3 (`--model s3://bucket/key.pt2`, as SageMaker takes its model artifacts):
fetched once, at start, by the daemon's main process into a local cache, before the
model's processes start and load the copy as they load any file.

A copy is `<cache>/<sha256 of the bucket and key>/<sha256 of the ETag>/<the key's file
name>`: a start finds the ETag by a HEAD and reads a copy of that ETag from disk, and
fetches an object uploaded again under the same key (a new ETag) afresh. It is written
under a temporary name and linked into place once whole, so a start killed mid-download
leaves no file the cache would take. The model's identity is then the file's digest, as
for any file: the same artifact in S3 or on disk is the same model, with the same name
(the key's file name) and version (`worker.plugins.identity`).

The cache keeps what is in use, and only that, of each object it is asked for. A daemon
holds a shared lock (`flock`) on the copy it runs from the start on, never let go: the
kernel lets go when its process ends, however it ends, and until then a model process
replaced later loads the file again. A download holds an exclusive lock on its partial
file. Each start, once the HEAD has said which upload is current, removes the files of
the object's other uploads and the partial files that no process holds, before it
fetches (so their room counts): the copy of a redeployed model goes with the last daemon
on the host that ran it, a dead download's file with the next start. Whoever takes a
lock checks that the file is still there under its name (a start may remove it between
another's open and its lock), and fetches again if not.
"""

from __future__ import annotations

import contextlib
import fcntl
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
        path = copy_path(self._directory, location, head.etag)
        held = _held(path, head.size)
        self._remove_unheld(path.parent.parent)
        if held:
            log.info("model_cached", location=str(location), etag=head.etag, path=str(path))
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        room = shutil.disk_usage(path.parent).free if self._room_bytes is None else self._room_bytes
        if head.size > room:
            raise ObjectTooLarge(head.size, room)
        started = time.monotonic()
        self._download(location, head, path)
        if not _held(path, head.size):
            raise TransientError("its copy was removed by another start as it was fetched")
        log.info(
            "model_fetched",
            location=str(location),
            etag=head.etag,
            bytes=head.size,
            seconds=round(time.monotonic() - started, 3),
            path=str(path),
        )
        return path

    def _download(self, location: S3Location, head: ObjectHead, path: Path) -> None:
        """The object's bytes of `head`'s ETag (If-Match: not a newer upload's) into
        `path`, whole or not at all; another start's whole copy there is as good."""
        try:
            descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=PARTIAL_PREFIX)
        except FileNotFoundError:  # another start removed the directory, found empty
            raise TransientError("its directory was removed by another start") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)  # a download under way, not a dead one
            if not os.fstat(descriptor).st_nlink:
                raise TransientError("its partial file was removed by another start")
            with os.fdopen(descriptor, "wb", closefd=False) as out:
                written = 0
                for chunk in self._blobs.chunks(location, head.size, expect=head.etag):
                    written += out.write(chunk)
                if written != head.size:
                    raise TransientError(f"read {written} of its {head.size} bytes")
            os.fsync(descriptor)
            # A link, never a rename, puts it in place: a file under a copy's name is
            # never replaced, so a start that locked it removes the file it locked.
            with contextlib.suppress(FileExistsError):
                os.link(partial, path)
        finally:  # a stop at start (SIGTERM) too: no partial file stays
            os.close(descriptor)
            with contextlib.suppress(FileNotFoundError):  # removed by another start
                os.unlink(partial)

    def _remove_unheld(self, directory: Path) -> None:
        """Remove the files under `directory` (an object's: its uploads' copies and
        partial files) that no process holds, and the uploads' directories then empty.
        The start goes on if it cannot (what it could not remove stays)."""
        try:
            uploads = [path for path in directory.glob("*") if path.is_dir()]
            for upload in uploads:
                for file in list(upload.iterdir()):
                    if _removed_unless_held(file):
                        log.info("model_copy_removed", path=str(file))
                with contextlib.suppress(OSError):  # not empty: a copy in use, a download
                    upload.rmdir()
        except OSError as error:
            log.warning("model_cache_kept", directory=str(directory), error=str(error))


def copy_path(directory: Path, location: S3Location, etag: str) -> Path:
    """Where the cache in `directory` keeps the upload of `location` whose ETag is
    `etag`: beside the object's other uploads, one directory each."""
    name = Path(location.key).name
    return directory / _digest(f"{location.bucket}\n{location.key}") / _digest(etag) / name


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _held(path: Path, size: int) -> bool:
    """Whether the whole copy (of `size` bytes) at `path` is held now, with a shared
    lock this process keeps: no other start removes it while it lives."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    found = os.fstat(descriptor)
    if found.st_nlink and found.st_size == size:
        return True  # never closed: the lock lasts as long as the process
    os.close(descriptor)
    return False


def _removed_unless_held(file: Path) -> bool:
    """Remove `file` unless a process holds it (a lock of any kind), as the file that
    was locked, not another linked there since."""
    try:
        descriptor = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not os.path.samestat(os.fstat(descriptor), os.stat(file)):
            return False
        os.unlink(file)
    except (BlockingIOError, FileNotFoundError):  # held; removed by another start
        return False
    finally:
        os.close(descriptor)
    return True


def with_local_models(spec: PipelineSpec, cache: ModelCache, setting: str) -> PipelineSpec:
    """`spec` with each model in S3 replaced by its local copy (`setting` named them)."""
    steps = [
        step.model_copy(update={"model": cache.local(step.model, setting)})
        if isinstance(step, ModelStep)
        else step
        for step in spec.steps
    ]
    return spec.model_copy(update={"steps": steps})
