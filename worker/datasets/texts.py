"""Inputs that are the data: texts, from a table's `text_column` or a message's `texts`.

A text input is a `TextInput`: a string that names where the text is, with the text
itself beside it. Everything between the listing and the preprocessing process (the
request digest, shard files, checkpoints, a result's `input`) handles an input as the
string that names it, so a text rides that road unchanged; the fetch step, which would
read an object, hands the text on instead (`text_of`), and a text needs no GET.

- a table row's name is the table's URI and its row, from 0 (`s3://b/t.parquet#row=17`);
- an inline text's name is the text itself: the request digest then covers what the
  message says (a sender has its texts at hand, and they are small);
- an OpenAI batch file's text is named by its request's line and its place in the
  request's input (`worker.datasets.openai_batch`).

A value that is no text (a null, a number, a text over `MAX_TEXT_BYTES`) is its item's
error where it is taken (`NotText`), never the message's: a row is an item whatever it
holds. A shard's inputs file carries the texts of its rows (`shard_text_line`), so a
shard's daemon reads its own rows with one GET and never the table.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Self

import pyarrow as pa

# A text longer than this is its item's error: far past any model's longest sequence
# (512 tokens are a few KiB), and every text of a job is held while it runs.
MAX_TEXT_BYTES = 64 * 1024
EMPTY = "its text is empty"
NOT_UTF8 = "its text is not UTF-8"
# A JSON-lines table's text column (`worker.datasets.json_lines`): each row's text, or
# the JSON type of a value that is none (`json_kind`).
JSON_TEXT = pa.struct([("text", pa.string()), ("not_text", pa.string())])


class NotText(ValueError):
    """An input's value that no model can read as text: its item's error."""


class TextInput(str):
    """A text input: as a string, its name (where it is); `text` is what it says, or
    None where the value is no text, with `problem` saying why."""

    __slots__ = ("problem", "text")
    text: str | None
    problem: str | None

    def __new__(cls, name: str, text: str | None, problem: str | None = None) -> Self:
        made = super().__new__(cls, name)
        made.text = text
        made.problem = problem if text is None else None
        return made

    def __reduce__(self) -> tuple[type[TextInput], tuple[str, str | None, str | None]]:
        return type(self), (str(self), self.text, self.problem)


def text_of(listed: TextInput) -> str:
    """The text the model reads; `NotText` if there is none."""
    if listed.text is None:
        raise NotText(listed.problem or "its value is not text")
    if not listed.text:
        raise NotText(EMPTY)
    return listed.text


def inline_texts(texts: list[Any]) -> Iterator[TextInput]:
    """A message's `texts`, each named by itself."""
    for value in texts:
        if isinstance(value, str):
            yield bounded_text(value, value)
        elif value is None:
            yield TextInput(json.dumps(value), None, _problem(None, None))
        else:
            yield TextInput(json.dumps(value), None, _not_json_text(json_kind(value)))


def column_texts(column: pa.Array, table_uri: str, first_row: int) -> list[TextInput]:
    """A table column's texts (rows from `first_row` on), each named by its row: a
    column of text, of bytes (UTF-8 each, as writers that store text as binary leave
    it), or a JSON-lines table's (`JSON_TEXT`); a value over `MAX_TEXT_BYTES` is measured
    and left unread."""
    names = [f"{table_uri}#row={row}" for row in range(first_row, first_row + len(column))]
    not_texts: list[str | None] = [None] * len(column)
    if column.type == JSON_TEXT:
        not_texts = column.field("not_text").to_pylist()
        column = column.field("text")
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    kind = column.type
    textual = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    if not (textual or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        problem = _not_text(str(kind))
        return [TextInput(name, None, problem) for name in names]
    # Imported here, not with the module: a tenth of a second of every stage process,
    # which imports the module and never calls this.
    import pyarrow.compute as pc

    lengths = pc.binary_length(column)
    over = pc.fill_null(pc.greater(lengths, MAX_TEXT_BYTES), False)
    values = _decoded(pc.if_else(over, pa.scalar(None, kind), column), textual)
    sizes = lengths.to_pylist()
    return [
        TextInput(name, None, _not_json_text(not_text))
        if not_text is not None
        else TextInput(name, None, NOT_UTF8)
        if isinstance(value, bytes)
        else TextInput(name, value, _problem(value, size))
        for name, value, size, not_text in zip(names, values, sizes, not_texts, strict=True)
    ]


def _decoded(column: pa.Array, textual: bool) -> list[str | bytes | None]:
    """A column's values as text, but a value that is not UTF-8, left as its bytes (a
    writer that did not check, or a column of bytes)."""
    if textual:
        try:
            return column.to_pylist()  # type: ignore[no-any-return]
        except UnicodeDecodeError:  # one of them is not UTF-8: each on its own
            column = column.cast(pa.large_binary())
    return [None if value is None else _utf8(value) for value in column.to_pylist()]


def _utf8(value: bytes) -> str | bytes:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value


def bounded_text(name: str, text: str) -> TextInput:
    """`text` named `name`, or, over `MAX_TEXT_BYTES`, its size as its problem."""
    size = len(text.encode(errors="replace"))
    return (
        TextInput(name, None, _problem(None, size))
        if size > MAX_TEXT_BYTES
        else TextInput(name, text)
    )


def _problem(value: str | None, size: int | None) -> str | None:
    if value is not None:
        return None
    if size is None:
        return "its value is null, not text"
    return f"its text is {size} bytes, over the limit of {MAX_TEXT_BYTES}"


def _not_text(column_type: str) -> str:
    return f"its column is of type {column_type}, not text"


def _not_json_text(kind: str) -> str:
    return f"its value is {kind}, not text"


def json_kind(value: Any) -> str:
    """A JSON value's type, as a sentence names it ("a number"); not a string's or null's."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "an array" if isinstance(value, list) else "an object"


def shard_text_line(listed: TextInput, input_id: Any) -> bytes:
    """A text input as a line of a shard's inputs file: `[name, id, {"text": ...}]`, or
    `{"problem": ...}` for a value that is no text."""
    value = {"text": listed.text} if listed.text is not None else {"problem": listed.problem}
    return json.dumps([str(listed), input_id, value]).encode() + b"\n"


def text_from_shard_line(name: Any, value: Any) -> TextInput:
    """A shard inputs file's text input (what `shard_text_line` wrote); ValueError if
    the line is not one."""
    if not isinstance(name, str) or not isinstance(value, dict):
        raise ValueError("not [name, id, {text}]")
    text, problem = value.get("text"), value.get("problem")
    if text is None:
        return TextInput(name, None, str(problem))
    if not isinstance(text, str):
        raise ValueError("its text is not a string")
    return bounded_text(name, text)
