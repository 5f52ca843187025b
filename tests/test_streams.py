"""Streams of an object's pieces (`worker.datasets.streams`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from worker.datasets import streams
from worker.datasets.streams import same_bytes


def test_two_streams_cut_apart_hold_the_same_bytes_or_differ_where_they_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Streams compared a few bytes at a time, however each is cut: equal where their
    bytes are, not where one is longer or a byte differs, and the second not read past
    the first difference."""
    monkeypatch.setattr(streams, "COMPARED_BYTES", 3)
    data = b"abcdefghij"
    assert same_bytes([data[:4], b"", data[4:]], [data[:1], data[1:7], data[7:]])
    assert not same_bytes([data], [data, b"k"])
    assert not same_bytes([data + b"k"], [data])
    read: list[bytes] = []

    def theirs() -> Iterator[bytes]:
        for piece in (b"abX", b"def", b"ghij"):
            read.append(piece)
            yield piece

    assert not same_bytes([data], theirs())
    assert read == [b"abX"]
    assert same_bytes([], [b""])
