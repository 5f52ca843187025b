"""An object's bytes as they stream in: inflated (gzip), as a file to read, or compared."""

from __future__ import annotations

import io
import threading
import zlib
from collections.abc import Generator, Iterable, Iterator
from typing import Any

from worker.message import PoisonMessage
from worker.ports import S3Location

GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib's way of asking for a gzip header
COMPARED_BYTES = 2**20  # two streams compared this much at a time
INFLATED_BYTES = 2**20  # the most a gzip stream yields at once


def unzipped(chunks: Iterator[bytes], location: S3Location) -> Iterator[bytes]:
    """An object's bytes, inflated (`gunzipped`) where its key ends `.gz`."""
    return gunzipped(chunks, location) if location.key.lower().endswith(".gz") else chunks


def gunzipped(chunks: Iterator[bytes], location: S3Location) -> Iterator[bytes]:
    """A gzip file's bytes, inflated as they stream in (its members one after another),
    at most `INFLATED_BYTES` at a time however far a chunk inflates (deflate's 1,032
    to 1); poison if it is not gzip or is cut short. (pyarrow's own gzip stream raises
    the OSError a local disk's failure raises too.)"""
    inflate = zlib.decompressobj(wbits=GZIP_WBITS)
    try:
        for chunk in chunks:
            pending = chunk
            while True:
                inflated = inflate.decompress(pending, INFLATED_BYTES)
                if inflated:
                    yield inflated
                pending = inflate.unconsumed_tail
                if inflate.eof and inflate.unused_data:  # the next member
                    pending = inflate.unused_data
                    inflate = zlib.decompressobj(wbits=GZIP_WBITS)
                elif not pending and len(inflated) < INFLATED_BYTES:
                    break  # the chunk is all in, and all that it inflates to is out
    except zlib.error as error:
        raise PoisonMessage(f"table {location} is not gzip: {error}") from error
    if not inflate.eof:
        raise PoisonMessage(f"table {location} is cut short (its gzip stream does not end)")


class ChunkStream(io.RawIOBase):
    """A file-like reader of an object's pieces as they stream in. It may be read on
    another thread (pyarrow reads ahead on threads of its own, and a buffered reader's
    close does not hold off a read that checked before it): closing waits for a read
    under way and closes the pieces (a generator), and a read after it finds the
    stream closed, touching them no more."""

    def __init__(self, chunks: Iterator[bytes]):
        super().__init__()
        self._chunks = chunks
        self._pending = memoryview(b"")
        self._reading = threading.Lock()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        with self._reading:
            if self.closed:
                raise ValueError("read of a closed stream")
            while not self._pending:
                chunk = next(self._chunks, None)
                if chunk is None:
                    return 0
                self._pending = memoryview(chunk)
            size = min(len(buffer), len(self._pending))
            buffer[:size] = self._pending[:size]
            self._pending = self._pending[size:]
            return size

    def close(self) -> None:
        with self._reading:
            try:
                if isinstance(self._chunks, Generator):
                    self._chunks.close()
            finally:
                super().close()


def same_bytes(first: Iterable[bytes], second: Iterable[bytes]) -> bool:
    """Whether two streams of pieces hold the same bytes, however each is cut; neither
    is read past the first piece where they differ."""
    one, other = (io.BufferedReader(ChunkStream(iter(each))) for each in (first, second))
    while True:
        piece = one.read(COMPARED_BYTES)
        if piece != other.read(COMPARED_BYTES):
            return False
        if not piece:
            return True
