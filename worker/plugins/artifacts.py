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
on the host that ran it, a dead download's file with the next start. Of the current
upload it removes only partial files (and a copy of the wrong size): a whole copy there
that nobody holds is another start's, just linked and not yet locked, and as good as its
own. Whoever takes a lock checks that its name still names the file it locked (a start
may remove it between another's open and its lock, and a download link a new one
there), and fetches again if not.
"""

from __future__ import annotations

import contextlib
import errno
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
        _remove_unheld(path, head.size)  # first: another start's copy just linked stays
        if _held(path, head.size):
            log.info("model_cached", location=str(location), etag=head.etag, path=str(path))
            return path
        room = self._room()
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

    def _room(self) -> int:
        """The bytes a copy may take: the space free on the cache's disk, measured on
        the cache's own directory (an upload's may be removed by another start at any
        time, found empty), unless given."""
        if self._room_bytes is not None:
            return self._room_bytes
        self._directory.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(self._directory).free

    def _download(self, location: S3Location, head: ObjectHead, path: Path) -> None:
        """The object's bytes of `head`'s ETag (If-Match: not a newer upload's) into
        `path`, whole or not at all; another start's whole copy there is as good."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
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
            _linked(partial, path)
        finally:  # a stop at start (SIGTERM) too: no partial file stays
            # Unlinked under its lock: a partial file no download holds is never a
            # second name of a copy (a start killed between the link and this is).
            with contextlib.suppress(FileNotFoundError):  # removed by another start
                os.unlink(partial)
            os.close(descriptor)


# What linking says on a file system without hard links (vfat, exFAT, some FUSE ones).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS})


def _linked(partial: str, path: Path) -> None:
    """Link the whole copy `partial` into place as `path`, unless a copy is there.
    A link, never a rename: a file under a copy's name is never replaced, so a start
    that locked it removes the file it locked."""
    try:
        os.link(partial, path)
    except FileExistsError:  # another start's whole copy, as good
        pass
    except OSError as error:
        if error.errno not in _NO_HARD_LINKS:  # a full disk, a quota, a permission
            raise
        raise OSError(
            error.errno,
            f"{error.strerror} on linking a file into place: the cache needs a file system "
            "with hard links and flock between processes (a local disk's)",
        ) from error


def _remove_unheld(path: Path, size: int) -> None:
    """Remove the files of the object whose current copy is `path` (of `size` bytes)
    that no process holds: its other uploads' copies and partial files, with their
    directories then empty, and the current upload's partial files and a copy there of
    the wrong size. What it cannot remove stays, logged: the start goes on."""
    for upload in filter(Path.is_dir, _listed(path.parent.parent)):
        for file in _listed(upload):
            _remove_unless_held(file, keep_bytes=size if file == path else None)
        if upload != path.parent:
            with contextlib.suppress(OSError):  # not empty: a copy in use, a download
                upload.rmdir()


def copy_path(directory: Path, location: S3Location, etag: str) -> Path:
    """Where the cache in `directory` keeps the upload of `location` whose ETag is
    `etag`: beside the object's other uploads, one directory each."""
    name = Path(location.key).name
    return directory / _digest(f"{location.bucket}\n{location.key}") / _digest(etag) / name


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _listed(directory: Path) -> list[Path]:
    """What `directory` holds (nothing if it is gone: not fetched yet, or removed by
    another start; logged if it cannot be read)."""
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []
    except OSError as error:
        log.warning("model_cache_kept", path=str(directory), error=str(error))
        return []


def _held(path: Path, size: int) -> bool:
    """Whether the whole copy (of `size` bytes) at `path` is held now, with a shared
    lock this process keeps: no other start removes it while it lives."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    if _names(path, descriptor) and os.fstat(descriptor).st_size == size:
        return True  # never closed: the lock lasts as long as the process
    os.close(descriptor)
    return False


def _remove_unless_held(file: Path, keep_bytes: int | None) -> None:
    """Remove `file` unless a process holds it (a lock of any kind) or it is a whole
    copy (of `keep_bytes`), as the file that was locked, not another linked there
    since; logged when removed, and when it cannot be (it stays)."""
    try:
        descriptor = os.open(file, os.O_RDONLY)
    except FileNotFoundError:  # removed by another start
        return
    except OSError as error:  # another user's file
        log.warning("model_cache_kept", path=str(file), error=str(error))
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _names(file, descriptor) or os.fstat(descriptor).st_size == keep_bytes:
            return
        os.unlink(file)
        log.info("model_copy_removed", path=str(file))
    except (BlockingIOError, FileNotFoundError):  # held; removed by another start
        return
    except OSError as error:  # a lock the file system does not take (NFS: ENOLCK)
        log.warning("model_cache_kept", path=str(file), error=str(error))
    finally:
        os.close(descriptor)


def _names(path: Path, descriptor: int) -> bool:
    """Whether `path` still names the file open as `descriptor`: another start may have
    removed it since it was opened (leaving it a second name, a dead download's partial
    file, or none), and a download linked another there."""
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except FileNotFoundError:
        return False


def with_local_models(spec: PipelineSpec, cache: ModelCache, setting: str) -> PipelineSpec:
    """`spec` with each model in S3 replaced by its local copy (`setting` named them)."""
    steps = [
        step.model_copy(update={"model": cache.local(step.model, setting)})
        if isinstance(step, ModelStep)
        else step
        for step in spec.steps
    ]
    return spec.model_copy(update={"steps": steps})
