"""Tar shards for tests: members written in order, as WebDataset writes them."""

from __future__ import annotations

import io
import tarfile


def tar_of(members: list[tuple[str, bytes]]) -> bytes:
    """A tar holding `members` (name, bytes) in order, and a directory entry first."""
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as archive:
        archive.addfile(_directory("samples"))
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return sink.getvalue()


def _directory(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info
