"""Tar shards, the way datasets such as WebDataset's are stored: thousands of inputs in
each tar, read with one GET instead of one per input.

A job (or shard) whose message says `tar` lists tars; each regular-file member of each,
in order, is one of its inputs. At admission each tar is copied here whole, one GET
streamed to this machine's disk (several tars at a time), and its headers are read
from the copy; the fetchers
then read each member from the copy (`LocalPart`), so a member costs no request of its
own. The copies go with the job's other local files when it is settled.

A tar that is missing, unreadable, over `--max-tar-bytes`, cut short or not a tar (a
compressed one included), or that holds a member name twice or one over
`MAX_NAME_BYTES`, makes the message poison, named; a member over `--max-input-bytes` is
that member's error, as an object over it is. What an untrusted tar costs is bounded
before it is paid: its first header is checked as soon as it has arrived (a video named
as a tar is refused after its first chunk, not read whole); each copy claims its tar's
size of one `DiskBudget`, shared by all jobs, before it writes a byte of it; members are
counted as they are listed, and listing stops once the job's tars hold more than
`--shard-items`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import BinaryIO, NamedTuple

from worker.datasets.disk import DiskBudget
from worker.datasets.inputs import unreadable_is_poison
from worker.errors import ObjectTooLarge, PreconditionFailed, TransientError
from worker.message import PoisonMessage, TarMembers
from worker.ports import BlobStore, LocalPart, S3Location

BLOCK = 512  # a tar's headers, and its members' bytes, are in blocks of 512 bytes
ZERO_BLOCK = bytes(BLOCK)
USTAR = b"ustar\0"  # POSIX's magic; GNU's is "ustar  \0", with no name prefix
REGULAR_FILE = (b"0", b"\0", b"7")
PAX_NEXT = (b"x", b"X")  # a pax header for the member after it (X: Solaris's)
PAX_GLOBAL, GNU_LONG_NAME, GNU_LONG_LINK, GNU_SPARSE = b"g", b"L", b"K", b"S"
EXTENDED = (*PAX_NEXT, PAX_GLOBAL, GNU_LONG_NAME, GNU_LONG_LINK)
MAX_EXTENDED_BYTES = 2**20  # an extended header's most, as Go's archive/tar takes
MAX_NAME_BYTES = 4096  # a member's name, in UTF-8: every result line of it carries it


# A job's (or shard's) tars are copied this many at a time: AWS's performance
# guidelines count 85-90 MB/s a connection, so a shard of ten 1 GiB tars copied one
# after another would keep the device waiting two minutes before the first shard a
# daemon runs (the ones after it are copied while the one before runs, `Intake`).
TARS_COPIED_AT_ONCE = 4


class Member(NamedTuple):
    row: int  # its tar's place among the inputs listed (the job's, or a shard's)
    name: str
    part: LocalPart  # its bytes, in the local copy of its tar


class TarCopies:
    """One job's local copies of its tars, in `directory` (made as they are copied),
    their sizes claimed of the daemon's `disk` budget (none: no limit) before they are
    written, and given back by `remove`."""

    def __init__(
        self,
        directory: Path,
        blobs: BlobStore,
        max_tar_bytes: int,
        max_members: int,
        disk: DiskBudget | None = None,
    ):
        self.directory = directory
        self._blobs = blobs
        self._max_tar_bytes = max_tar_bytes
        self._max_members = max_members  # of all its tars: what the job holds at once
        self._members = 0  # listed so far, by the copies' threads together
        self._claim = disk.claim() if disk is not None else None
        self._lock = threading.Lock()  # `remove` comes from whichever thread settles the job
        self._removed = False
        # Set by `remove`, or by a copy that failed: the copies still running stop at
        # their next chunk rather than read whole tars nobody will use.
        self._stop = threading.Event()

    def members(self, tars: list[str], spec: TarMembers) -> list[Member]:
        """Every member of `tars` that is an input, in order, once every tar is copied
        (`TARS_COPIED_AT_ONCE` at a time) and read; what is wrong with a tar, the first
        in order of those that were read, makes the message poison. `NoDiskRoom` if the
        disk budget has no room for them now (and none of them is poison)."""
        suffix = spec.member_suffix or ""
        self._members = 0
        with ThreadPoolExecutor(max(1, min(len(tars), TARS_COPIED_AT_ONCE))) as copying:
            copies = [
                copying.submit(self._copied_members, uri, row, suffix)
                for row, uri in enumerate(tars)
            ]
            wait(copies, return_when=FIRST_EXCEPTION)
            if any(copy.done() and copy.exception() for copy in copies):
                self._stop.set()
                for copy in copies:
                    copy.cancel()  # those not begun
        failures = [copy.exception() for copy in copies if not copy.cancelled()]
        # The first in order of what is wrong with a tar; else of what failed for now
        # (no room on the disk); else of the copies cut short by another's failure.
        failure = min(filter(None, failures), key=_rank, default=None)
        if failure is not None:
            raise failure
        return [member for copy in copies for member in copy.result()]

    def _copied_members(self, uri: str, row: int, suffix: str) -> list[Member]:
        """The members of one tar, once it is copied: for `members`, on its own thread;
        poison as soon as the job's tars hold more than it may hold, before the rest of
        its members are listed."""
        members = []
        for member in _listed(self._copy(uri, row), uri, row, suffix):
            with self._lock:
                self._members += 1
                over = self._members > self._max_members
            if over:
                raise PoisonMessage(
                    f"its tars hold more than {self._max_members} inputs, a shard's most "
                    "(--shard-items): give fewer tars a shard ('shard_items')"
                )
            members.append(member)
        return members

    def _copy(self, uri: str, row: int) -> Path:
        """The tar copied whole to this machine's disk, read as its HEAD found it
        (If-Match), its size claimed of the budget before a byte of it is written: a tar
        over the whole budget costs a HEAD and its first chunk, not a download up to the
        budget. That chunk's first block is checked first: what is not a tar is said so,
        and a tar that ends there claims only that chunk."""
        location = S3Location.parse(uri)
        with unreadable_is_poison(f"tar {uri}"):
            head = self._blobs.head(location)
            if head.size > self._max_tar_bytes:
                raise ObjectTooLarge(head.size, self._max_tar_bytes)
        chunks = self._blobs.chunks(location, head.size, expect=head.etag)
        path = self.directory / f"{row:06d}.tar"
        with self._lock:  # the file is made before `remove` can take the directory away
            if self._removed:  # settled meanwhile (a shutdown): nothing will read it
                raise _Stopped("the job was settled while its tars were copied")
            self.directory.mkdir(exist_ok=True)  # in the daemon's spool, there while it runs
            copy = open(path, "wb")  # noqa: SIM115 (closed below, whatever happens)
        first = b""  # the first header, checked as soon as it is here
        claimed = False
        with (
            unreadable_is_poison(f"tar {uri}"),
            _replaced_is_transient(uri),
            contextlib.closing(chunks),
            copy,
        ):
            for chunk in chunks:
                ends = False
                if len(first) < BLOCK:
                    first += chunk[: BLOCK - len(first)]
                    ends = len(first) == BLOCK and _ends_at_first(first, uri)
                if not claimed:
                    self._claim_room(len(chunk) if ends else head.size, uri)
                    claimed = True
                elif self._stop.is_set():
                    raise _Stopped(f"tar {uri} was not copied whole: the job's copying stopped")
                copy.write(chunk)
                if ends:
                    break  # nothing after its first block is read: not copied either
        return path

    def _claim_room(self, size: int, uri: str) -> None:
        """Claim `size` bytes of the disk budget for a copy; `_Stopped` if the job's
        copying stopped, or it was settled (its claim given back)."""
        if self._stop.is_set():
            raise _Stopped(f"tar {uri} was not copied whole: the job's copying stopped")
        with self._lock:
            if self._removed:
                raise _Stopped(f"tar {uri} was not copied whole: the job was settled")
            if self._claim is not None:
                self._claim.grow(size)

    def remove(self) -> None:
        """Take the copies away, and give their disk back."""
        self._stop.set()
        with self._lock:
            self._removed = True
            shutil.rmtree(self.directory, ignore_errors=True)
            if self._claim is not None:
                self._claim.release()


@contextlib.contextmanager
def _replaced_is_transient(uri: str) -> Iterator[None]:
    """A tar replaced between its HEAD and its read is read again with the job's next
    delivery, its new size claimed: not the tar's fault, nor the worker's."""
    try:
        yield
    except PreconditionFailed as replaced:
        raise TransientError(f"tar {uri} was replaced while it was copied") from replaced


class _Stopped(TransientError):
    """A copy cut short: another tar of the job could not be used, or the job was
    settled meanwhile (a shutdown)."""


def _rank(failure: BaseException) -> tuple[bool, bool]:
    """A tar's failure before one for now, and a copy cut short by another's last."""
    return isinstance(failure, _Stopped), isinstance(failure, TransientError)


def _listed(path: Path, uri: str, row: int, suffix: str) -> Iterator[Member]:
    """The members of the tar copied to `path` whose names end `suffix`, in order."""
    names: set[str] = set()
    local = os.fspath(path)
    with open(path, "rb") as file, _mapped(file) as data:
        for name, offset, size in _entries(data, uri):
            if not name.endswith(suffix):
                continue
            if name in names:
                raise PoisonMessage(f"tar {uri} holds member {name} twice")
            names.add(name)
            yield Member(row, name, LocalPart(local, offset, size, uri))


@contextlib.contextmanager
def _mapped(file: BinaryIO) -> Iterator[bytes | mmap.mmap]:
    """The file's bytes, mapped (read as the headers are, never whole into memory)."""
    if os.fstat(file.fileno()).st_size == 0:
        yield b""  # an empty file cannot be mapped
        return
    with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        yield data


def _entries(data: bytes | mmap.mmap, uri: str) -> Iterator[tuple[str, int, int]]:
    """Each regular file of a tar (POSIX ustar and pax, or GNU): its name, where its
    bytes start and how many. Read here rather than with `tarfile`, which parses every
    field of every header in Python and seeks between them: 20 µs a member against 5,
    in the process that feeds the pipeline (docs/performance.md)."""
    offset = 0
    extended: dict[str, str] = {}  # a pax or GNU header's, for the member after it
    while True:
        header = data[offset : offset + BLOCK]
        if len(header) not in (0, BLOCK) or (not header and not offset):
            raise _not_a_tar(uri, "it ends mid-header" if header else "it is empty")
        if not header or header == ZERO_BLOCK:  # the end (two zero blocks, or none)
            return
        _check_header(header, offset, uri)
        kind, start = header[156:157], offset + BLOCK
        size = _number(header[124:136], uri)
        if kind in REGULAR_FILE and "size" in extended:  # over 8 GiB: pax gives it
            size = _number(extended["size"].encode(), uri, base=10)
        _check_entry(header, extended, size, start + size - len(data), uri)
        offset = start + -(-size // BLOCK) * BLOCK
        if kind in PAX_NEXT:
            extended = _pax_records(data[start : start + size])
        elif kind == GNU_LONG_NAME:
            extended = {"path": _text(bytes(data[start : start + size]).rstrip(b"\0"))}
        elif kind in REGULAR_FILE:
            name = _member_name(header, extended, uri)
            if not name.endswith("/"):  # an old writer's directory
                yield name, start, size
            extended = {}
        elif kind not in (PAX_GLOBAL, GNU_LONG_LINK):
            extended = {}  # a directory, a link, a device: not an input


def _check_entry(
    header: bytes | mmap.mmap, extended: dict[str, str], size: int, overrun: int, uri: str
) -> None:
    """Poison if an entry is not read here: cut short (its `size` bytes `overrun` the
    file's end), an extended header too large to hold, a sparse member."""
    kind = header[156:157]
    if overrun > 0:
        raise PoisonMessage(f"tar {uri} is cut short in member {_name(header, extended)}")
    if kind in EXTENDED and size > MAX_EXTENDED_BYTES:
        raise _not_a_tar(uri, f"an extended header of {size} bytes (at most {MAX_EXTENDED_BYTES})")
    if kind == GNU_SPARSE or (extended and any(k.startswith("GNU.sparse.") for k in extended)):
        raise _not_a_tar(uri, f"member {_name(header, extended)} is sparse, not read here")


def _member_name(header: bytes | mmap.mmap, extended: dict[str, str], uri: str) -> str:
    """A regular file's name; poison if it is over `MAX_NAME_BYTES` (a pax or GNU name
    may be up to an extended header's 1 MiB)."""
    name = _name(header, extended)
    size = len(name.encode())
    if size > MAX_NAME_BYTES:
        raise _not_a_tar(uri, f"a member's name of {size} bytes (at most {MAX_NAME_BYTES})")
    return name


def _ends_at_first(header: bytes, uri: str) -> bool:
    """Whether a tar whose first block is `header` ends there (a zero block: no member
    after it is read); poison if that block is no tar header."""
    if header == ZERO_BLOCK:
        return True
    _check_header(header, 0, uri)
    return False


def _check_header(header: bytes | mmap.mmap, offset: int, uri: str) -> None:
    """Poison if the block at `offset` is no tar header (its checksum)."""
    if _checksum(header) != _number(header[148:156], uri):
        raise _not_a_tar(uri, f"the header at byte {offset} is not one (its checksum)")


def _not_a_tar(uri: str, why: str) -> PoisonMessage:
    return PoisonMessage(f"tar {uri} is not a tar this worker reads: {why}")


def _checksum(header: bytes | mmap.mmap) -> int:
    """A header's checksum: the sum of its bytes, its checksum field taken as spaces.
    Its halves are summed by zlib's Adler-32, in C, five times the speed of `sum`: the
    low 16 bits of one are 1 plus the sum of the bytes modulo 65521, which for 256
    bytes (65,280 at most) is their sum."""
    halves = sum(zlib.adler32(header[start : start + 256]) & 0xFFFF for start in (0, 256))
    return halves - 2 - sum(header[148:156]) + 8 * ord(" ")


def _number(field: bytes | mmap.mmap, uri: str, base: int = 8) -> int:
    """A header's numeric field: octal digits, or GNU's base-256 (its first bit set)."""
    if field and field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    digits = bytes(field).strip(b" \0")
    try:
        number = int(digits, base) if digits else 0
    except ValueError:
        raise _not_a_tar(uri, f"a header's number is {digits[:20]!r}") from None
    if number < 0:
        raise _not_a_tar(uri, f"a header's number is {number}")
    return number


def _name(header: bytes | mmap.mmap, extended: dict[str, str]) -> str:
    if "path" in extended:
        return extended["path"]
    name = bytes(header[0:100]).split(b"\0", 1)[0]
    if header[257:263] == USTAR:  # POSIX: a long name's start is in the prefix field
        prefix = bytes(header[345:500]).split(b"\0", 1)[0]
        name = prefix + b"/" + name if prefix else name
    return _text(name)


def _pax_records(block: bytes | mmap.mmap) -> dict[str, str]:
    """A pax extended header's records ("<length> <key>=<value>\\n" each)."""
    records: dict[str, str] = {}
    position, text = 0, bytes(block)
    while position < len(text):
        space = text.find(b" ", position, position + 20)
        if space < 0 or not text[position:space].isdigit() or int(text[position:space]) <= 0:
            break
        end = position + int(text[position:space])
        key, _, value = text[space + 1 : end].rstrip(b"\n").partition(b"=")
        records[_text(key)] = _text(value)
        position = end
    return records


def _text(name: bytes) -> str:
    """A name as text (a result line's JSON holds it): a byte that is not UTF-8 is
    written as its escape (\\xe9), so that two such names stay two."""
    return name.decode(errors="backslashreplace")
