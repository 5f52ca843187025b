"""What a hostile sender sends (the review of 2026-11-26, H4 and H5), made in
milliseconds however large it reads: a gzipped or Parquet table of megabyte-long
URIs, a tar of very many empty members."""

from __future__ import annotations

import gzip
import io
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq


def megabyte_uri(bucket: str) -> str:
    """A URI of 1,000,000 characters, about a thousandth of that gzipped."""
    prefix = f"s3://{bucket}/"
    return prefix + "a" * (10**6 - len(prefix))


def gzipped_rows(header: str, row: str, rows: int) -> bytes:
    """A gzipped CSV of `header` and `rows` copies of `row`: a gzip member each, the same
    as one stream to a reader, the row compressed once."""
    return gzip.compress(f"{header}\n".encode()) + gzip.compress(f"{row}\n".encode()) * rows


def tar_of_empty_members(count: int) -> bytes:
    """A tar of `count` empty members (a header each), numbered, without `tarfile`'s pace."""
    header = bytearray(tarfile.TarInfo("00000000.jpg").tobuf(tarfile.USTAR_FORMAT))
    blocks = io.BytesIO()
    for number in range(count):
        header[0:8] = b"%08d" % number
        header[148:156] = b" " * 8
        header[148:156] = b"%06o\0 " % sum(header)
        blocks.write(header)
    blocks.write(bytes(1024))  # the end: two zero blocks
    return blocks.getvalue()


def parquet_rows(column: str, value: str, rows: int) -> bytes:
    """A Parquet table of `rows` copies of `value` in `column`: dictionary-encoded, the
    value is stored once, so a file of about its size holds `rows` times it."""
    values = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([value]))
    sink = io.BytesIO()
    pq.write_table(pa.table({column: values}), sink)
    return sink.getvalue()
