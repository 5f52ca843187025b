"""Tar shards, the way datasets such as WebDataset's are stored: thousands of inputs in
each tar, read with one GET instead of one per input.

A job (or shard) whose message says `tar` lists tars; each regular-file member of each,
in order, is one of its inputs. At admission each tar is copied here whole, one GET
streamed to this machine's disk, and its headers are read from the copy; the fetchers
then read each member from the copy (`LocalPart`), so a member costs no request of its
own. The copies go with the job's other local files when it is settled.

A tar that is missing, unreadable, over `--max-tar-bytes`, cut short or not a tar (a
compressed one included), or that holds a member name twice, makes the message poison,
named; a member over `--max-input-bytes` is that member's error, as an object over it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from worker.jobs.inputs import unreadable_is_poison
from worker.jobs.message import PoisonMessage, TarMembers
from worker.ports import BlobStore, LocalPart, S3Location


class Member(NamedTuple):
    row: int  # its tar's place among the inputs listed (the job's, or a shard's)
    name: str
    part: LocalPart  # its bytes, in the local copy of its tar


class TarCopies:
    """One job's local copies of its tars, in `directory` (made as they are copied)."""

    def __init__(self, directory: Path, blobs: BlobStore, max_tar_bytes: int, max_members: int):
        self.directory = directory
        self._blobs = blobs
        self._max_tar_bytes = max_tar_bytes
        self._max_members = max_members

    def members(self, tars: list[str], spec: TarMembers) -> list[Member]:
        """Every member of `tars` that is an input, in order, once each tar is copied."""
        members: list[Member] = []
        for row, uri in enumerate(tars):
            path = self._copy(uri, row)
            members += _listed(path, uri, row, spec.member_suffix or "")
            if len(members) > self._max_members:
                raise PoisonMessage(f"more than {self._max_members} inputs, over the limit")
        return members

    def _copy(self, uri: str, row: int) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{row:06d}.tar"
        chunks = self._blobs.chunks(S3Location.parse(uri), self._max_tar_bytes)
        with (
            unreadable_is_poison(f"tar {uri}"),
            contextlib.closing(chunks),
            open(path, "wb") as copy,
        ):
            for chunk in chunks:
                copy.write(chunk)
        return path

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _listed(path: Path, uri: str, row: int, suffix: str) -> Iterator[Member]:
    """The members of the tar copied to `path` whose names end `suffix`, in order."""
    size = path.stat().st_size
    names: set[str] = set()
    try:
        with tarfile.open(path, mode="r:") as archive:
            for entry in archive:
                if not entry.isfile() or not entry.name.endswith(suffix):
                    continue
                if entry.offset_data + entry.size > size:
                    raise PoisonMessage(f"tar {uri} is cut short in member {entry.name}")
                if entry.name in names:
                    raise PoisonMessage(f"tar {uri} holds member {entry.name} twice")
                names.add(entry.name)
                yield Member(
                    row, entry.name, LocalPart(os.fspath(path), entry.offset_data, entry.size)
                )
    except (tarfile.TarError, EOFError) as error:
        raise PoisonMessage(f"tar {uri} is not a tar this worker reads: {error}") from error
