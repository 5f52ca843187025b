"""A JSON-lines table's record batches, each line parsed on its own.

A sender's lines need not agree on the types of their fields: an id that is a number
on one line and a string on the next, a text that is a number, a field the job does not
read that appears only late in the file. (pyarrow's reader fixes each field's type from
the file's first block, and any later line of another type failed the whole job.) So
each line is parsed with orjson, and of it only the columns the job reads are kept:

- a value that is a string stays one, and a missing value or a null is a null;
- any other value of a text column keeps its JSON type beside it (`JSON_TEXT`), so that
  the row is its item's error naming it ("its value is a number, not text");
- any other value of another column (an id, a URI) is its JSON text (`1`, `true`).

A line that is not a JSON object (or not UTF-8, which JSON is) is the table's fault,
named by its row, as a CSV's broken quoting is. Blank lines are no rows, and a byte
order mark before the first line is no matter.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import orjson
import pyarrow as pa

from worker.datasets.texts import JSON_TEXT, json_kind
from worker.message import PoisonMessage

BATCH_ROWS = 2**16  # at most, and at most `batch_bytes` of lines
BOM = b"\xef\xbb\xbf"
ONE_A_LINE = "JSON lines hold an object a line (a .json key is read as JSON lines)"


def json_lines_batches(
    stream: io.BufferedReader[Any],
    where: str,
    columns: list[str],
    *,
    text_column: str | None,
    batch_bytes: int,
) -> Iterator[pa.RecordBatch]:
    """The record batches of the JSON lines `stream` (the table `where`), of `columns`
    (each once), `text_column` among them as `JSON_TEXT`; a line over `batch_bytes` is
    poison, and so is a column that no line of the first batch has."""
    columns = list(dict.fromkeys(columns))
    rows_before = 0
    ended = False
    while not ended:
        values, read, ended = _lines(stream, where, columns, rows_before, batch_bytes)
        if not read:
            continue
        if rows_before == 0:
            missing = [name for name in columns if all(value is _MISSING for value in values[name])]
            if missing:
                raise PoisonMessage(f"table {where} has no column {missing[0]!r}")
        arrays = [
            _text_column(values[name]) if name == text_column else _column(values[name])
            for name in columns
        ]
        yield pa.RecordBatch.from_arrays(arrays, names=columns)
        rows_before += read


_MISSING = object()


def _lines(
    stream: io.BufferedReader[Any],
    where: str,
    columns: list[str],
    rows_before: int,
    batch_bytes: int,
) -> tuple[dict[str, list[Any]], int, bool]:
    """The next batch's values of each column, the rows read (blank lines are none), and
    whether the stream has ended."""
    values: dict[str, list[Any]] = {name: [] for name in columns}
    rows = taken = 0
    while rows < BATCH_ROWS and taken < batch_bytes:
        line = stream.readline(batch_bytes + 1)
        if not line:
            return values, rows, True
        if rows_before == taken == 0:
            line = line.removeprefix(BOM)
        taken += len(line)
        if len(line) > batch_bytes:
            raise PoisonMessage(
                f"table {where} row {rows_before + rows + 1} is over {batch_bytes} bytes"
            )
        if not line.strip():
            continue
        rows += 1
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            raise PoisonMessage(
                f"table {where} row {rows_before + rows} is not JSON ({error}): {ONE_A_LINE}"
            ) from error
        if not isinstance(record, dict):
            raise PoisonMessage(
                f"table {where} row {rows_before + rows} is not a JSON object: {ONE_A_LINE}"
            )
        for name in columns:
            values[name].append(record.get(name, _MISSING))
    return values, rows, False


def _column(values: list[Any]) -> pa.Array:
    return pa.array(
        [
            None
            if value is _MISSING or value is None
            else value
            if isinstance(value, str)
            else orjson.dumps(value).decode()
            for value in values
        ],
        pa.string(),
    )


def _text_column(values: list[Any]) -> pa.Array:
    texts = [value if isinstance(value, str) else None for value in values]
    kinds = [
        None if value is _MISSING or value is None or isinstance(value, str) else json_kind(value)
        for value in values
    ]
    return pa.StructArray.from_arrays(
        [pa.array(texts, pa.string()), pa.array(kinds, pa.string())], fields=list(JSON_TEXT)
    )
