"""Models in S3 (`worker.plugins.artifacts`): fetched once into the local cache, read
from it again while their ETag holds, fetched anew under a new one, written whole or not
at all, the copies and partial files no process holds removed, and refused at start,
naming the setting, when they cannot be had.

A daemon's hold on its copy is a lock on an open file, which lasts as long as its
process: here, a `ModelCache` is a daemon still running, and a daemon gone is one
whose files are written by hand (`copy_path`), as no process holds them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from tests.support.text_encoders import save_script
from worker.adapters.fakes import InMemoryBlobStore
from worker.errors import AccessDenied, CannotStart, TransientError
from worker.plugins import artifacts
from worker.plugins.artifacts import PARTIAL_PREFIX, ModelCache, copy_path
from worker.plugins.identity import ModelIdentity, identify
from worker.plugins.loading import load_model
from worker.ports import ObjectHead, S3Location

MODEL = "s3://bkt/models/encoder.pt"
LOCATION = S3Location.parse(MODEL)


def _identity(path: str) -> ModelIdentity:
    return identify(path, load_model(path, torch.device("cpu")), None, None)


@pytest.fixture
def encoder_bytes(tmp_path: Path) -> bytes:
    """A TorchScript text encoder's file."""
    path = tmp_path / "built" / "encoder.pt"
    path.parent.mkdir()
    save_script(path)
    return path.read_bytes()


def test_a_model_in_s3_is_fetched_once_and_is_the_same_model_as_its_file_on_disk(
    tmp_path: Path, encoder_bytes: bytes
) -> None:
    """The first start GETs it; the next finds the copy of that ETag and reads it from
    disk. The copy keeps the key's file name, so its identity (name, version, digest)
    is that of the same file given by its path; other references are left as given."""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = encoder_bytes
    first = ModelCache(tmp_path / "cache", blobs).local(MODEL, "--model")
    again = ModelCache(tmp_path / "cache", blobs).local(MODEL, "--model")
    assert first == again and Path(first).read_bytes() == encoder_bytes
    assert blobs.reads[MODEL] == 1
    on_disk = tmp_path / "encoder.pt"
    on_disk.write_bytes(encoder_bytes)
    assert _identity(first) == _identity(str(on_disk))
    assert _identity(first).digest == f"sha256:{hashlib.sha256(encoder_bytes).hexdigest()}"
    cache = ModelCache(tmp_path / "cache", blobs)
    for reference in ("stages.text:text_model", str(on_disk)):
        assert cache.local(reference, "--model") == reference


def test_an_object_uploaded_again_under_its_key_is_fetched_anew(tmp_path: Path) -> None:
    """A new ETag is a new copy, read by the next start; the old one stays for a daemon
    still running it."""
    blobs = InMemoryBlobStore()
    cache = ModelCache(tmp_path, blobs)
    blobs.objects[MODEL] = b"version one"
    old = cache.local(MODEL, "--model")
    blobs.put(S3Location.parse(MODEL), b"version two", "application/octet-stream")
    new = cache.local(MODEL, "--model")
    assert new != old and Path(new).name == Path(old).name == "encoder.pt"
    assert (Path(old).read_bytes(), Path(new).read_bytes()) == (b"version one", b"version two")
    assert blobs.reads[MODEL] == 2


def _left_by_a_daemon_gone(cache: Path, etag: str, name: str, location: S3Location) -> Path:
    """A file of `location`'s upload `etag` in the cache that no process holds."""
    path = copy_path(cache, location, etag).with_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"left")
    return path


def _files(directory: Path) -> set[Path]:
    return {path for path in directory.rglob("*") if path.is_file()}


def test_a_start_removes_the_object_uploads_and_dead_downloads_no_process_holds(
    tmp_path: Path,
) -> None:
    """A model redeployed under its key: the copy of its earlier upload that no daemon
    runs, and the partial files of downloads whose process died (the current upload's
    too), are removed with their directories by the next start, before it fetches; a
    copy of another object is not its to judge, and stays."""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = b"the upload now"
    cache = tmp_path / "cache"
    earlier = _left_by_a_daemon_gone(cache, '"earlier"', "encoder.pt", LOCATION)
    _left_by_a_daemon_gone(cache, '"earlier"', f"{PARTIAL_PREFIX}x", LOCATION)
    _left_by_a_daemon_gone(cache, '"another"', f"{PARTIAL_PREFIX}y", LOCATION)
    current = blobs.head(LOCATION).etag
    _left_by_a_daemon_gone(cache, current, f"{PARTIAL_PREFIX}z", LOCATION)
    other = _left_by_a_daemon_gone(
        cache, '"earlier"', "other.pt", S3Location.parse("s3://bkt/models/other.pt")
    )
    path = Path(ModelCache(cache, blobs).local(MODEL, "--model"))
    assert path.read_bytes() == b"the upload now"
    assert _files(cache) == {path, other}
    assert list(earlier.parent.parent.iterdir()) == [path.parent]


def test_a_copy_a_running_daemon_holds_and_a_download_under_way_stay(tmp_path: Path) -> None:
    """Two daemons on a host share the cache: one runs the first upload when the second
    starts on the next, and a third start's download is under way. Both files stay
    while their processes hold them (a model process replaced later loads the copy
    again); the download's, once its process is gone, goes with the next start."""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = b"version one"
    cache = tmp_path / "cache"
    running = ModelCache(cache, blobs).local(MODEL, "--model")
    downloading = _left_by_a_daemon_gone(cache, '"coming"', f"{PARTIAL_PREFIX}x", LOCATION)
    download = os.open(downloading, os.O_RDONLY)
    fcntl.flock(download, fcntl.LOCK_EX)
    blobs.put(LOCATION, b"version two", "application/octet-stream")
    try:
        started = ModelCache(cache, blobs).local(MODEL, "--model")
        assert _files(cache) == {Path(running), Path(started), downloading}
    finally:
        os.close(download)  # the downloading process died
    assert ModelCache(cache, blobs).local(MODEL, "--model") == started
    assert _files(cache) == {Path(running), Path(started)}
    assert Path(running).read_bytes() == b"version one"
    assert blobs.reads[MODEL] == 2


@pytest.mark.parametrize("second_name", [False, True], ids=["one-name", "a-dead-partial-too"])
def test_a_copy_removed_before_a_start_could_hold_it_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second_name: bool
) -> None:
    """Another start may remove a copy no daemon holds between this start's open and
    its lock: the start sees its file no longer under its name and fetches the object
    again, never running a copy that is not there. The file it locked may live on under
    a second name, the partial file of a start killed between its link and its unlink,
    which the start removes."""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = b"the upload now"
    path = copy_path(tmp_path, LOCATION, blobs.head(LOCATION).etag)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"the upload now")
    if second_name:
        os.link(path, path.with_name(f"{PARTIAL_PREFIX}killed"))
    lock, removals = fcntl.flock, [path]

    def removed_first(descriptor: int, operation: int) -> None:
        if operation == fcntl.LOCK_SH and removals:
            removals.pop().unlink()
        lock(descriptor, operation)

    monkeypatch.setattr(artifacts.fcntl, "flock", removed_first)
    assert ModelCache(tmp_path, blobs).local(MODEL, "--model") == str(path)
    assert path.read_bytes() == b"the upload now"
    assert blobs.reads[MODEL] == 1
    assert _files(tmp_path) == {path}


def test_another_start_copy_linked_as_this_one_looked_stays_and_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two starts fetch the same upload: the other links its whole copy just after this
    one looked for it (after this one's removals, which run first). This start's own
    download, as good, finds that copy in place and takes it: a link never replaces a
    copy, and nothing of the other start's is removed. (A whole copy of the current
    upload already there when a start's removals run stays: the cache-hit tests.)"""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = b"the upload now"
    path = copy_path(tmp_path, LOCATION, blobs.head(LOCATION).etag)
    held, others = artifacts._held, [path]

    def linked_after(looked_at: Path, size: int) -> bool:
        found = held(looked_at, size)
        if others:  # the other start's copy, linked into place, not yet locked
            other = others.pop()
            other.parent.mkdir(parents=True)
            other.write_bytes(b"the upload now")
        return found

    monkeypatch.setattr(artifacts, "_held", linked_after)
    with capture_logs() as logs:
        assert ModelCache(tmp_path, blobs).local(MODEL, "--model") == str(path)
    assert [log for log in logs if log["event"] == "model_copy_removed"] == []
    assert _files(tmp_path) == {path}


@pytest.mark.parametrize("racing", ["disk_usage", "mkstemp"])
def test_an_upload_directory_removed_as_its_start_made_it_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, racing: str
) -> None:
    """A start of another upload of the object removes the upload directories it finds
    empty, at any moment: this start's, just made, before it measures the room or
    before it makes its partial file there. The start goes on (tried again from its
    HEAD if need be), never stopping for a directory it made."""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = b"the upload now"
    path = copy_path(tmp_path, LOCATION, blobs.head(LOCATION).etag)
    module = {"disk_usage": artifacts.shutil, "mkstemp": artifacts.tempfile}[racing]
    call, removals = getattr(module, racing), [path.parent]

    def removed_first(*args: Any, **kwargs: Any) -> Any:
        if removals:
            with contextlib.suppress(FileNotFoundError):  # not made yet
                removals.pop().rmdir()
        return call(*args, **kwargs)

    monkeypatch.setattr(module, racing, removed_first)
    assert ModelCache(tmp_path, blobs).local(MODEL, "--model") == str(path)
    assert path.read_bytes() == b"the upload now"


def test_a_file_that_cannot_be_removed_stays_and_the_others_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first file of an earlier upload that a start tries to remove cannot be
    opened (another user's partial file): it stays, logged, and the start removes the
    others and goes on."""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = b"the upload now"
    left = {
        _left_by_a_daemon_gone(tmp_path, '"earlier"', "encoder.pt", LOCATION),
        _left_by_a_daemon_gone(tmp_path, '"earlier"', f"{PARTIAL_PREFIX}x", LOCATION),
        _left_by_a_daemon_gone(tmp_path, '"another"', f"{PARTIAL_PREFIX}y", LOCATION),
    }
    opened, denied = os.open, []

    def denied_first(file: Any, *args: Any, **kwargs: Any) -> int:
        if Path(file) in left and not denied:
            denied.append(Path(file))
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return opened(file, *args, **kwargs)

    monkeypatch.setattr(artifacts.os, "open", denied_first)
    with capture_logs() as logs:
        path = Path(ModelCache(tmp_path, blobs).local(MODEL, "--model"))
    assert _files(tmp_path) == {path, *denied}
    kept = [log for log in logs if log["event"] == "model_cache_kept"]
    assert [log["path"] for log in kept] == [str(*denied)]


@pytest.mark.parametrize(
    ("code", "names_hard_links"),
    [(errno.EPERM, True), (errno.EOPNOTSUPP, True), (errno.ENOSPC, False)],
)
def test_a_cache_without_hard_links_stops_the_start_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, names_hard_links: bool
) -> None:
    """A copy is linked into place: on a file system without hard links (vfat, exFAT,
    some FUSE ones) the start stops naming --model-cache-dir and what the cache needs,
    leaving no partial file; a link that fails for another reason (a full disk) stops
    it saying that alone."""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = b"the upload now"

    def refused_link(source: Any, target: Any) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(artifacts.os, "link", refused_link)
    with pytest.raises(CannotStart, match="--model-cache-dir") as refused:
        ModelCache(tmp_path, blobs).local(MODEL, "--model")
    assert os.strerror(code) in str(refused.value)
    assert ("hard links" in str(refused.value)) is names_hard_links
    assert _files(tmp_path) == set()


class _CutShort(InMemoryBlobStore):
    """Each GET of an object is reset after its first piece, `cuts` times."""

    def __init__(self, cuts: int) -> None:
        super().__init__(chunk_bytes=4)
        self.cuts = cuts

    def chunks(
        self, location: S3Location, max_bytes: int, *, expect: str | None = None
    ) -> Generator[bytes]:
        pieces = super().chunks(location, max_bytes, expect=expect)
        if self.cuts:
            self.cuts -= 1
            yield next(pieces)
            raise TransientError("connection reset mid-body")
        yield from pieces


def test_a_download_cut_short_leaves_no_file_and_is_tried_again(tmp_path: Path) -> None:
    """A GET reset mid-body is tried again from the HEAD (the third try reads it whole);
    one reset on every try stops the start, leaving no file, partial or otherwise, in
    the cache."""
    blobs = _CutShort(cuts=2)
    blobs.objects[MODEL] = b"twelve bytes"
    assert Path(ModelCache(tmp_path / "kept", blobs).local(MODEL, "--model")).read_bytes() == (
        b"twelve bytes"
    )

    blobs.cuts = 3
    with pytest.raises(CannotStart, match="3 tries, the last: connection reset mid-body"):
        ModelCache(tmp_path / "lost", blobs).local(MODEL, "--model")
    assert [path for path in (tmp_path / "lost").rglob("*") if path.is_file()] == []


class _ReplacedAfterHead(InMemoryBlobStore):
    """Its first HEAD gives the ETag of an upload that has since been replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.stale = True

    def head(self, location: S3Location) -> ObjectHead:
        head = super().head(location)
        if self.stale:
            self.stale = False
            return ObjectHead('"an-earlier-upload"', head.size)
        return head


def test_an_object_replaced_between_its_head_and_its_get_is_fetched_as_it_now_is(
    tmp_path: Path,
) -> None:
    """The GET is If-Match the HEAD's ETag, so a copy never holds another upload's bytes
    under this one's name: the replaced one's GET fails, and the fetch starts again; the
    copy is the current upload's, which the next start reads from disk."""
    blobs = _ReplacedAfterHead()
    blobs.objects[MODEL] = b"the upload now"
    path = ModelCache(tmp_path, blobs).local(MODEL, "--model")
    assert ModelCache(tmp_path, blobs).local(MODEL, "--model") == path
    assert Path(path).read_bytes() == b"the upload now"
    assert blobs.reads[MODEL] == 1
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [Path(path)]


def test_an_object_over_the_room_in_the_cache_is_refused_unread(tmp_path: Path) -> None:
    """Its size, from the HEAD, against the room the cache has (by default the space
    free on its disk): the start stops naming both and --model-cache-dir, no GET made."""
    blobs = InMemoryBlobStore()
    blobs.objects[MODEL] = b"x" * 100
    with pytest.raises(CannotStart) as refused:
        ModelCache(tmp_path, blobs, room_bytes=99).local(MODEL, "--model")
    assert "it is 100 bytes" in str(refused.value) and "has room for 99" in str(refused.value)
    assert "--model-cache-dir" in str(refused.value)
    assert blobs.reads[MODEL] == 0


class _Denied(InMemoryBlobStore):
    def head(self, location: S3Location) -> ObjectHead:
        raise AccessDenied(f"{location}: Forbidden")


@pytest.mark.parametrize(
    ("blobs", "reference", "said"),
    [
        (InMemoryBlobStore(), MODEL, "does not exist"),
        (_Denied(), MODEL, "Forbidden"),
        (InMemoryBlobStore(), "s3://bkt/models/model.tar.gz", "a torch.export archive (.pt2)"),
        (InMemoryBlobStore(), "s3://B/k.pt2", "not an s3://bucket/key URI"),
    ],
    ids=["missing", "denied", "not-a-model-file", "not-a-uri"],
)
def test_a_model_in_s3_that_cannot_be_had_stops_the_start_naming_the_setting(
    tmp_path: Path, blobs: InMemoryBlobStore, reference: str, said: str
) -> None:
    """A missing object (or bucket), one the daemon may not read, a key that is no model
    file, a URI that names no object: `CannotStart` (exit 2) with the reason and the
    setting that named it."""
    with pytest.raises(CannotStart, match="--pipeline") as refused:
        ModelCache(tmp_path, blobs).local(reference, "--pipeline")
    assert said in str(refused.value)
