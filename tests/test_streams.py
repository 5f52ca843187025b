"""Streams of an object's pieces (`worker.datasets.streams`)."""

from __future__ import annotations

import gzip
from collections.abc import Iterator

import pytest

from worker.datasets import streams
from worker.datasets.streams import same_bytes
from worker.message import PoisonMessage
from worker.ports import S3Location


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


def test_a_gzip_stream_inflates_at_most_a_bounded_piece_at_a_time_whatever_its_chunks() -> None:
    """64 MiB of zeros gzipped into a few KiB, then a second member, each cut into chunks
    anywhere: the bytes come back whole and in order, none of the pieces over
    `INFLATED_BYTES` (a sender's small object cannot make one allocation of its ratio);
    cut short, or not gzip, it is poison."""
    location = S3Location("bkt", "texts.jsonl.gz")
    zeros, tail = bytes(64 * 2**20), b'{"text": "after"}\n' * 1000
    packed = gzip.compress(zeros, compresslevel=9) + gzip.compress(tail)
    assert len(packed) < 2**17
    for cut in (len(packed), 4096, 7):
        chunks = (packed[start : start + cut] for start in range(0, len(packed), cut))
        pieces = list(streams.gunzipped(chunks, location))
        assert max(map(len, pieces)) <= streams.INFLATED_BYTES
        assert b"".join(pieces) == zeros + tail
    with pytest.raises(PoisonMessage, match="cut short"):
        list(streams.gunzipped(iter([packed[:-9]]), location))
    with pytest.raises(PoisonMessage, match="not gzip"):
        list(streams.gunzipped(iter([b"plain text"]), location))
