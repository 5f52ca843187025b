"""OpenAI Batch API files: a job's inputs read from a batch input file of embeddings
requests, and its results written back as that API's output and error files, so that a
batch moves between the hosted API and this fleet with its files untouched.

    {"custom_id": "r1", "method": "POST", "url": "/v1/embeddings",
     "body": {"model": "text-embedding-3-small", "input": ["a text", "another"]}}

Each text of a request's `input` (a string, or a list of strings) is an item: a
`TextInput` named by the file, the request's line (from 1) and the text's place in its
input (`s3://b/requests.jsonl#line=3&input=1`), with the request's `custom_id` as its id.
A request's `encoding_format` and `dimensions` ride in its texts' names too, so they reach
the finish with the items, and count in the job's request digest. A line that is no
request served here (not JSON, no `custom_id`, another url or method, token ids for
`input`) is one item with no text and the reason as its problem: its item's error, never
the job's (`worker.datasets.texts`).

At the finish the items' results are grouped back into their requests, in file order
(`write_batch_files`): a request whose every text has an embedding is a line of the
output file, any other a line of the error file, each line as OpenAI writes it
(`BatchRequestOutput`): `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`. A request the endpoint would refuse is answered as OpenAI answers
it, `response.status_code` 400 with the error in `response.body.error` and `error` null
(what its error files hold: openai/openai-openapi#302); a line with no `custom_id` to
answer, or a request a cancelled job never ran, has `response` null and `error`
`{"code", "message"}`, as OpenAI's requests that did not run do (`batch_cancelled`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.parse
from collections.abc import Iterable, Iterator
from itertools import groupby
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np
import orjson

from worker.datasets.texts import TextInput, bounded_text
from worker.message import lines

OPENAI_OUTPUT_FILE = "openai-output.jsonl"
OPENAI_ERRORS_FILE = "openai-errors.jsonl"
EMBEDDINGS_URL = "/v1/embeddings"
# A request line may hold up to MAX_INPUTS texts; a longer line is no request's (a file
# that holds one is poison, as a table's row over its bound is).
MAX_REQUEST_LINE_BYTES = 4 * 2**20
MAX_INPUTS = 2048  # OpenAI's own bound on an embeddings request's input list
# A custom_id goes into every result line of its texts; OpenAI's are short (64 characters).
MAX_CUSTOM_ID_BYTES = 512
ENCODINGS = ("float", "base64")
EMBEDDING_FIELD = "embedding"  # the result field whose array is a text's embedding
# The error of a line that is no request (no custom_id names it): this worker's own code.
UNREADABLE_LINE = "invalid_request_line"
# What OpenAI answers for a request that never ran because its batch was cancelled.
CANCELLED = {
    "code": "batch_cancelled",
    "message": "This request was not executed because the batch was cancelled.",
}


class RequestText(NamedTuple):
    """An item of a batch file: its text (or the reason it has none) and its request's
    custom_id (None where the line gives none)."""

    text: TextInput
    custom_id: str | None


def batch_requests(chunks: Iterable[bytes], uri: str) -> Iterator[RequestText]:
    """The items of the batch input file at `uri`, as its bytes stream in: each text
    of each request, in order; a line that is no request served here, one item with its
    problem. Blank lines are skipped (their numbers still count); a UTF-8 byte order
    mark before the first (an editor's on Windows) is read past, as JSON's decoder does."""
    seen: set[str] = set()
    for number, line in enumerate(lines(chunks, "OpenAI batch", MAX_REQUEST_LINE_BYTES), 1):
        if line.strip():
            yield from _request_texts(line, f"{uri}#line={number}", seen)


def _request_texts(line: bytes, name: str, seen: set[str]) -> Iterator[RequestText]:
    try:
        request = json.loads(line)
    except ValueError as error:  # not UTF-8 included
        yield RequestText(TextInput(name, None, f"its line is not JSON: {error}"), None)
        return
    custom_id = request.get("custom_id") if isinstance(request, dict) else None
    if not isinstance(custom_id, str) or not 0 < len(custom_id.encode()) <= MAX_CUSTOM_ID_BYTES:
        unnamed = f"its line is not a request with a custom_id of 1 to {MAX_CUSTOM_ID_BYTES} bytes"
        yield RequestText(TextInput(name, None, unnamed), None)
        return
    problem = _refused(request, seen)
    seen.add(custom_id)
    if problem is not None:
        yield RequestText(TextInput(name, None, problem), custom_id)
        return
    body = request["body"]
    texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
    options = {
        option: body[option]
        for option in ("encoding_format", "dimensions")
        if body.get(option) not in (None, "float")
    }
    for place, text in enumerate(texts):
        named = f"{name}&{urllib.parse.urlencode({'input': place, **options})}"
        yield RequestText(bounded_text(named, text), custom_id)


def _refused(request: dict[str, Any], seen: set[str]) -> str | None:
    """Why the embeddings endpoint would refuse a request, or None."""
    if request["custom_id"] in seen:
        return f"its custom_id {request['custom_id']!r} is an earlier request's too: one each"
    if request.get("method") != "POST":
        return f"its method is {request.get('method')!r}: a batch request is a POST"
    if request.get("url") != EMBEDDINGS_URL:
        return f"its url is {request.get('url')!r}: only {EMBEDDINGS_URL} is served here"
    body = request.get("body")
    if not isinstance(body, dict):
        return "its body is not a JSON object"
    return _refused_body(body)


def _refused_body(body: dict[str, Any]) -> str | None:
    texts = body.get("input")
    if isinstance(texts, list) and not 0 < len(texts) <= MAX_INPUTS:
        return f"its input is a list of {len(texts)} texts: 1 to {MAX_INPUTS} are taken"
    if not isinstance(texts, str) and not (
        isinstance(texts, list) and all(isinstance(text, str) for text in texts)
    ):
        return "its input is not a text or a list of texts (token ids are not taken)"
    if body.get("encoding_format", "float") not in ENCODINGS:
        return f"its encoding_format is {body['encoding_format']!r}: float or base64"
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        return f"its dimensions is {dimensions!r}, not a positive integer"
    return None


class _Place(NamedTuple):
    """Where an item is in its batch file, and its request's options (from its name)."""

    line: int
    input: int | None  # None: the item is its line's problem, not a text
    base64: bool
    dimensions: int | None


def _place(name: str) -> _Place:
    fields = dict(urllib.parse.parse_qsl(name.rpartition("#")[2]))
    dimensions = fields.get("dimensions")
    return _Place(
        int(fields["line"]),
        int(fields["input"]) if "input" in fields else None,
        fields.get("encoding_format") == "base64",
        None if dimensions is None else int(dimensions),
    )


class BatchItem(NamedTuple):
    """An item of a finished job, for its batch files: its name, its custom_id, and its
    results line as a record (None where it was not run: its job was cancelled)."""

    name: str
    custom_id: str | None
    record: dict[str, Any] | None


def write_batch_files(
    items: Iterable[BatchItem], arrays: dict[str, Path], directory: Path, batch: str
) -> tuple[Path, Path]:
    """The output file and the error file of a job's items (in input order), written in
    `directory`, each request's line in file order; `arrays` are the job's array files
    by name, `batch` names the job's run (its request digest) in the lines' ids."""
    output, errors = directory / OPENAI_OUTPUT_FILE, directory / OPENAI_ERRORS_FILE
    embeddings = _Embeddings(arrays)
    with output.open("wb") as answered, errors.open("wb") as refused:
        for line, grouped in groupby(items, key=lambda item: _place(item.name).line):
            request = list(grouped)
            ids = _ids(batch, line)
            written = _answer(request, embeddings)
            file: IO[bytes] = answered if written.get("status_code") == 200 else refused
            answer = _output_line(ids, request[0].custom_id, written)
            file.write(orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    return output, errors


def _ids(batch: str, line: int) -> tuple[str, str]:
    """A request's line id and its request id, the same in every run of the same batch."""
    digest = hashlib.sha256(f"{batch}:{line}".encode()).hexdigest()
    return f"batch_req_{digest[:24]}", digest[32:]


def _output_line(
    ids: tuple[str, str], custom_id: str | None, written: dict[str, Any]
) -> dict[str, Any]:
    line_id, request_id = ids
    if "error" in written:
        return {"id": line_id, "custom_id": custom_id, "response": None, "error": written["error"]}
    response = {
        "status_code": written["status_code"],
        "request_id": request_id,
        "body": written["body"],
    }
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": None}


def _answer(request: list[BatchItem], embeddings: _Embeddings) -> dict[str, Any]:
    """A request's answer: a response's status and body, or an error where it has no
    response."""
    records = [item.record for item in request if item.record is not None]
    if len(records) < len(request):
        return {"error": CANCELLED}
    if request[0].custom_id is None:  # no request to answer: the line's problem
        return {"error": {"code": UNREADABLE_LINE, "message": records[0]["error"]["message"]}}
    places = [_place(item.name) for item in request]
    for place, record in zip(places, records, strict=True):
        if "error" in record:
            where = "" if place.input is None else f"input[{place.input}]: "
            param = None if place.input is None else "input"
            return _refusal(400, "invalid_request_error", where + record["error"]["message"], param)
    return _embedded(places, records, embeddings)


def _embedded(
    places: list[_Place], records: list[dict[str, Any]], embeddings: _Embeddings
) -> dict[str, Any]:
    """The answer of a request whose every text has a result: its embeddings."""
    vectors = [vector for vector in map(embeddings.of, records) if vector is not None]
    if len(vectors) < len(records):
        return _refusal(500, "server_error", "the model served here gives no embedding", None)
    asked, width = places[0].dimensions, vectors[0].size
    if asked not in (None, width):
        message = f"dimensions {asked}: this model's embeddings have {width} (they are not cut)"
        return _refusal(400, "invalid_request_error", message, "dimensions")
    data = [
        {"object": "embedding", "index": place.input, "embedding": _encoded(vector, place.base64)}
        for place, vector in zip(places, vectors, strict=True)
    ]
    tokens = sum(map(_tokens, records))
    body = {
        "object": "list",
        "data": data,
        "model": records[0]["model"],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return {"status_code": 200, "body": body}


def _refusal(status: int, kind: str, message: str, param: str | None) -> dict[str, Any]:
    """An HTTP error's answer, as the API's error body has it."""
    error = {"message": message, "type": kind, "param": param, "code": None}
    return {"status_code": status, "body": {"error": error}}


def _tokens(record: dict[str, Any]) -> int:
    """The tokens of a text as its preprocessor counted them (its `tokens` note)."""
    tokens = record.get("tokens")
    return tokens if type(tokens) is int else 0


def _encoded(vector: np.ndarray, as_base64: bool) -> Any:
    """An embedding as OpenAI sends it: float32 values, or their little-endian bytes in
    base64."""
    values = vector.astype("<f4")
    return base64.b64encode(values.tobytes()).decode("ascii") if as_base64 else values


class _Embeddings:
    """The embeddings results lines refer to, read from the job's array files."""

    def __init__(self, arrays: dict[str, Path]):
        self._paths = arrays
        self._open: dict[str, np.ndarray] = {}

    def of(self, record: dict[str, Any]) -> np.ndarray | None:
        reference = record.get(EMBEDDING_FIELD)
        if not isinstance(reference, dict) or reference.get("array") not in self._paths:
            return None
        name = reference["array"]
        if name not in self._open:
            self._open[name] = np.load(self._paths[name], mmap_mode="r")
        return np.asarray(self._open[name][reference["row"]]).reshape(-1)
