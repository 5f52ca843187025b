"""Inputs that are the data (`worker.datasets.texts`): a table's text column and a
message's inline texts, read from the in-memory store; what makes a value its item's
error, and a message poison; a shard's inputs file carrying the texts of its rows."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import pickle
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client import InvalidJob, Jobs
from worker.daemon.stages import fetcher, on_this_machine
from worker.datasets.inputs import Input, InputReader, shard_line
from worker.datasets.texts import MAX_TEXT_BYTES, NOT_UTF8, NotText, TextInput, text_of
from worker.message import SQS_MAX_BODY_BYTES, PoisonMessage, parse_job_message

NO_LIMIT: frozenset[str] = frozenset()


def _read(blobs: InMemoryBlobStore, **source: Any) -> list[Input]:
    spec = parse_job_message(json.dumps({"output": "s3://out/job/", **source}), NO_LIMIT)
    return list(InputReader(blobs, NO_LIMIT, 2**30).inputs(spec))


def _texts(listed: list[Input]) -> list[tuple[str, str | None, Any]]:
    """Each input's name, text (or why it has none) and id."""
    named = []
    for uri, input_id in listed:
        assert isinstance(uri, TextInput)
        named.append((str(uri), uri.text if uri.text is not None else uri.problem, input_id))
    return named


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=2)
    return sink.getvalue()


ROWS = [("a", "the red fox"), ("b", "jumps over"), ("c", "")]


@pytest.mark.parametrize(
    "name", ["texts.parquet", "texts.csv", "texts.jsonl", "texts.jsonl.gz", "part-0.json"]
)
def test_each_row_of_a_table_is_an_input_whose_value_is_its_text(name: str) -> None:
    """Every format gives the same inputs: named by the table's URI and row (from 0), the
    text beside the name, the id as text; an empty text is an input still."""
    blobs = InMemoryBlobStore()
    ids, texts = [row[0] for row in ROWS], [row[1] for row in ROWS]
    if name.endswith(".parquet"):
        data = _parquet(pa.table({"key": ids, "body": texts, "other": [1, 2, 3]}))
    elif name.endswith(".csv"):
        data = b"key,body\n" + b"".join(f'{i},"{t}"\n'.encode() for i, t in ROWS)
    else:
        lines = "".join(json.dumps({"key": i, "body": t, "n": 1}) + "\n" for i, t in ROWS)
        data = gzip.compress(lines.encode()) if name.endswith(".gz") else lines.encode()
    blobs.objects[f"s3://tables/{name}"] = data
    table = {"uri": f"s3://tables/{name}", "text_column": "body", "id_column": "key"}
    listed = _read(blobs, table=table)
    assert _texts(listed) == [
        (f"s3://tables/{name}#row={row}", text, key) for row, (key, text) in enumerate(ROWS)
    ]


def test_a_value_that_is_no_text_is_its_items_error_not_the_tables() -> None:
    """A null, a column of numbers, a text over the limit: each row is still an input,
    whose text is refused where it is taken (`text_of`, the fetch step), with why."""
    blobs = InMemoryBlobStore()
    long = "x" * (MAX_TEXT_BYTES + 1)
    blobs.objects["s3://tables/a.parquet"] = _parquet(
        pa.table({"text": ["fine", None, long], "number": [1, 2, 3]})
    )
    listed = _read(blobs, table={"uri": "s3://tables/a.parquet", "text_column": "text"})
    problems = []
    for uri, _ in listed:
        assert isinstance(uri, TextInput)
        try:
            problems.append(text_of(uri))
        except NotText as error:
            problems.append(str(error))
    assert problems == [
        "fine",
        "its value is null, not text",
        f"its text is {MAX_TEXT_BYTES + 1} bytes, over the limit of {MAX_TEXT_BYTES}",
    ]
    numbers = _read(blobs, table={"uri": "s3://tables/a.parquet", "text_column": "number"})
    assert {uri.problem for uri, _ in numbers} == {"its column is of type int64, not text"}  # type: ignore[attr-defined]
    with pytest.raises(PoisonMessage, match="no column 'body'"):
        _read(blobs, table={"uri": "s3://tables/a.parquet", "text_column": "body"})


def test_a_json_lines_tables_rows_need_not_agree_on_their_types() -> None:
    """Each line of a JSON-lines table is read on its own, and only its text and id:
    a text that is a number, an array or an object is its row's error naming its type,
    an id of any type is its JSON text, a field only later lines have is no matter, and
    blank lines are none; a line that is no JSON object, and a column no line has, are
    the table's fault, named."""
    blobs = InMemoryBlobStore()
    lines = [
        {"id": 1, "body": "a"},
        {"id": "x", "body": 5},
        {"id": 2.5, "body": None, "extra": {"deep": [1]}},
        {"id": True, "body": ["l"]},
        {"body": "no id"},
        {"id": None, "body": {"k": 1}, "late": "only here"},
    ]
    data = "".join(json.dumps(line) + "\n\n" for line in lines).encode()
    # A byte order mark, and more blank lines than a batch's bytes, before the rows.
    blobs.objects["s3://tables/t.jsonl"] = b"\xef\xbb\xbf" + b" \n" * 2**20 + data
    table = {"uri": "s3://tables/t.jsonl", "text_column": "body", "id_column": "id"}
    assert _texts(_read(blobs, table=table)) == [
        ("s3://tables/t.jsonl#row=0", "a", "1"),
        ("s3://tables/t.jsonl#row=1", "its value is a number, not text", "x"),
        ("s3://tables/t.jsonl#row=2", "its value is null, not text", "2.5"),
        ("s3://tables/t.jsonl#row=3", "its value is an array, not text", "true"),
        ("s3://tables/t.jsonl#row=4", "no id", None),
        ("s3://tables/t.jsonl#row=5", "its value is an object, not text", None),
    ]
    with pytest.raises(PoisonMessage, match="no column 'title'"):
        _read(blobs, table={**table, "text_column": "title"})
    for bad, why in (
        (b"{not json", "row 2 is not JSON"),
        (b"[1, 2]", "row 2 is not a JSON object"),
    ):
        blobs.objects["s3://tables/t.jsonl"] = b'{"body": "a"}\n' + bad + b"\n"
        with pytest.raises(PoisonMessage, match=why):
            _read(blobs, table=table)


def _string_column(values: list[bytes]) -> pa.Array:
    """A column of text holding `values` as they are, UTF-8 or not (as a writer that
    does not check leaves them)."""
    offsets = pa.array([0, *itertools.accumulate(map(len, values))], pa.int32())
    return pa.Array.from_buffers(
        pa.string(), len(values), [None, offsets.buffers()[1], pa.py_buffer(b"".join(values))]
    )


def test_a_text_that_is_not_utf8_is_its_rows_error_and_an_id_the_tables() -> None:
    """A value of the text column that is not UTF-8, in a CSV, in a Parquet column of
    text whose writer did not check, or of bytes (as writers that store text as binary
    leave it, the others read as text), is its row's error; an id that is not UTF-8
    makes the table poison, named, not a job tried again and again."""
    blobs = InMemoryBlobStore()
    blobs.objects["s3://tables/t.csv"] = b"key,body\nk0,caf\xe9\nk1,fine\n"
    blobs.objects["s3://tables/t.parquet"] = _parquet(
        pa.table(
            {
                "body": _string_column([b"caf\xe9", b"fine"]),
                "raw": pa.array([b"caf\xc3\xa9", b"\xff"], pa.binary()),
                "key": _string_column([b"k0", b"k\xe9"]),
            }
        )
    )
    for uri, column, expected in (
        ("s3://tables/t.csv", "body", [NOT_UTF8, "fine"]),
        ("s3://tables/t.parquet", "body", [NOT_UTF8, "fine"]),
        ("s3://tables/t.parquet", "raw", ["café", NOT_UTF8]),
    ):
        listed = _read(blobs, table={"uri": uri, "text_column": column})
        assert [text for _, text, _ in _texts(listed)] == expected
    with pytest.raises(PoisonMessage, match="id column key"):
        _read(
            blobs, table={"uri": "s3://tables/t.parquet", "text_column": "body", "id_column": "key"}
        )


def test_inline_texts_are_named_by_themselves_and_refused_over_what_sqs_takes() -> None:
    """A message's texts: each is its own name (the request digest covers what the
    message says); a non-string is its item's error; texts SQS could not carry are
    refused, the limit named, before anything is sent."""
    listed = _read(InMemoryBlobStore(), texts=["one", 7, "two"])
    assert _texts(listed) == [
        ("one", "one", None),
        ("7", "its value is a number, not text", None),
        ("two", "two", None),
    ]
    too_many = ["a sentence of some length"] * (SQS_MAX_BODY_BYTES // 20)
    with pytest.raises(PoisonMessage, match=f"over the {SQS_MAX_BODY_BYTES} bytes SQS takes"):
        _read(InMemoryBlobStore(), texts=too_many)
    with pytest.raises(PoisonMessage, match="texts are inputs themselves"):
        _read(InMemoryBlobStore(), texts=["a"], tar={})
    queue = InMemoryJobSource()
    with pytest.raises(InvalidJob, match=f"over the {SQS_MAX_BODY_BYTES} bytes SQS takes"):
        Jobs(queue, InMemoryBlobStore()).submit("s3://out/job/", texts=too_many)
    Jobs(queue, InMemoryBlobStore()).submit("s3://out/job/", texts=["a text"])
    assert len(queue) == 1


def test_a_table_names_its_inputs_by_one_column_only() -> None:
    with pytest.raises(PoisonMessage, match="'uri_column' or its 'text_column'"):
        _read(
            InMemoryBlobStore(),
            table={"uri": "s3://tables/a.csv", "uri_column": "u", "text_column": "t"},
        )


def test_a_shards_inputs_file_carries_its_rows_texts() -> None:
    """A planned shard reads its texts from its own inputs file, never the table; a
    value that was no text stays its item's error there."""
    blobs = InMemoryBlobStore()
    listed = [
        Input(TextInput("s3://tables/a.parquet#row=4", 'a "quoted"\nline'), "k4"),
        Input(TextInput("s3://tables/a.parquet#row=5", None, "its value is null, not text"), "k5"),
        Input("s3://photos/a.jpg", None),
    ]
    blobs.objects["s3://out/job/shard.txt"] = b"".join(map(shard_line, listed))
    read = InputReader(blobs, frozenset({"photos"}), 2**30).shard("s3://out/job/shard.txt", 3)
    assert read == listed
    assert [(uri.text, uri.problem) for uri, _ in read[:2]] == [  # type: ignore[attr-defined]
        ('a "quoted"\nline', None),
        (None, "its value is null, not text"),
    ]


def test_a_text_needs_no_fetch_and_crosses_to_another_process_whole() -> None:
    """The fetch step hands a text on at once (no GET), and the item's value keeps its
    text when pickled to a preprocessing process."""

    def no_get(*_: Any) -> bytes:
        raise AssertionError("a text was fetched")

    text = pickle.loads(pickle.dumps(TextInput("s3://tables/a.csv#row=0", "hello")))
    assert on_this_machine(text)
    assert fetcher(no_get, 10)(text) == "hello"
    with pytest.raises(NotText, match="empty"):
        fetcher(no_get, 10)(TextInput("s3://tables/a.csv#row=1", ""))


def test_a_table_may_be_the_files_under_a_prefix_read_in_key_order() -> None:
    """A Spark table's parts, in key order, each row named by its own file and row; the
    writer's `_SUCCESS` and `.crc` files, and what is under a folder of its own named so
    (an unfinished job's `_temporary/`), are not parts; a part of no known format and an
    output under the prefix are refused."""
    blobs = InMemoryBlobStore()
    for part, texts in (("part-1.parquet", ["c"]), ("part-0.parquet", ["a", "b"])):
        blobs.objects[f"s3://tables/run/{part}"] = _parquet(pa.table({"body": texts}))
    blobs.objects["s3://tables/run/_SUCCESS"] = b""
    blobs.objects["s3://tables/run/.part-0.parquet.crc"] = b"x"
    blobs.objects["s3://tables/run/_temporary/0/task_1/part-2.json"] = b'{"body": "d"}\n'
    listed = _read(blobs, table={"uri": "s3://tables/run/", "text_column": "body"})
    assert [(name, text) for name, text, _ in _texts(listed)] == [
        ("s3://tables/run/part-0.parquet#row=0", "a"),
        ("s3://tables/run/part-0.parquet#row=1", "b"),
        ("s3://tables/run/part-1.parquet#row=0", "c"),
    ]
    blobs.objects["s3://tables/run/notes.txt"] = b"x"
    with pytest.raises(PoisonMessage, match=r"table file s3://tables/run/notes\.txt"):
        _read(blobs, table={"uri": "s3://tables/run/", "text_column": "body"})
    with pytest.raises(PoisonMessage, match="under the table's prefix"):
        parse_job_message(
            json.dumps({"output": "s3://tables/run/out/", "table": {"uri": "s3://tables/run/"}}),
            NO_LIMIT,
        )
