"""OpenAI Batch API files: a batch input file read into text items (a line that is no
request served here is its own item's error), and a job's results written back as the
API's output and error files, field for field as its documentation shows them; a
whole job of such a file through the daemon in this process; the client's upload."""

from __future__ import annotations

import base64
import codecs
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from stages.sentences import TOPICS
from stages.text import TOKENIZER
from tests.support.in_process import job_file, run_until_drained
from tests.support.texts import TEXT_PIPELINE, embeddings_request, model_answers
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.client import InvalidJob, Jobs
from worker.datasets.openai_batch import (
    OPENAI_ERRORS_FILE,
    OPENAI_OUTPUT_FILE,
    BatchItem,
    batch_requests,
    write_batch_files,
)
from worker.message import PoisonMessage

FILE = "s3://bkt/requests.jsonl"
# A line of a batch output file, from OpenAI's documentation of the request output
# object (`BatchRequestOutput`) and of the embeddings response (`CreateEmbeddingResponse`).
DOCUMENTED_OUTPUT_LINE = {
    "id": "batch_req_wnaDys",
    "custom_id": "request-2",
    "response": {
        "status_code": 200,
        "request_id": "req_c187b3",
        "body": {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.0023064255, -0.0093]}],
            "model": "text-embedding-3-small",
            "usage": {"prompt_tokens": 8, "total_tokens": 8},
        },
    },
    "error": None,
}
# A line of an error file: a request the endpoint refused is answered as the endpoint
# answers it, an HTTP error in the response and `error` null (openai/openai-openapi#302).
DOCUMENTED_ERROR_LINE = {
    "id": "batch_req_YTpodq",
    "custom_id": "request-5",
    "response": {
        "status_code": 400,
        "request_id": "0538a1cc8f8f8500bbe07250e6aa2b26",
        "body": {
            "error": {
                "message": "This model's maximum context length is 8192 tokens.",
                "type": "invalid_request_error",
                "param": "input",
                "code": None,
            }
        },
    },
    "error": None,
}
# A request that did not run (its batch cancelled, expired): no response, the error's code.
DOCUMENTED_UNRUN_LINE = {
    "id": "batch_req_9PrZwq",
    "custom_id": "request-7",
    "response": None,
    "error": {
        "code": "batch_cancelled",
        "message": "This request was not executed because the batch was cancelled.",
    },
}


def _shape(value: Any) -> Any:
    """What a JSON value is made of, without its values: its fields, its elements' shape."""
    if isinstance(value, dict):
        return sorted((key, _shape(item)) for key, item in value.items())
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def _file(*lines: Any) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def test_each_text_of_each_request_is_an_item_and_a_line_served_nowhere_is_its_own() -> None:
    """A text input is one item, a list one item per text, each named by its line and
    place with the request's options, its custom_id its id; a blank line is skipped,
    and a byte order mark before the first; each line that is no request served here
    is one item with no text, the reason its problem, and no custom_id where it names
    none."""
    lines = _file(
        embeddings_request("one", "the forecast says rain"),
        embeddings_request("two", ["a late train", "fresh bread"], encoding_format="base64"),
        b"",
        b"{not json",
        {"method": "POST", "url": "/v1/embeddings", "body": {"input": "no id"}},
        embeddings_request("one", "again"),
        {**embeddings_request("chat", "hi"), "url": "/v1/chat/completions"},
        {**embeddings_request("get", "hi"), "method": "GET"},
        embeddings_request("ids", [[101, 2009]]),
        embeddings_request("none", []),
        embeddings_request("wide", "x", dimensions=0),
        embeddings_request("float", "y", encoding_format="float", dimensions=64),
    )
    items = list(batch_requests([codecs.BOM_UTF8 + lines[:50], lines[50:]], FILE))
    named = [(str(text), custom_id, text.text) for text, custom_id in items]
    assert named[:3] == [
        (f"{FILE}#line=1&input=0", "one", "the forecast says rain"),
        (f"{FILE}#line=2&input=0&encoding_format=base64", "two", "a late train"),
        (f"{FILE}#line=2&input=1&encoding_format=base64", "two", "fresh bread"),
    ]
    assert named[-1] == (f"{FILE}#line=12&input=0&dimensions=64", "float", "y")
    refused = {str(text): (custom_id, text.problem) for text, custom_id in items[3:-1]}
    assert refused == {
        f"{FILE}#line=4": (None, refused[f"{FILE}#line=4"][1]),
        f"{FILE}#line=5": (None, "its line is not a request with a custom_id of 1 to 512 bytes"),
        f"{FILE}#line=6": ("one", "its custom_id 'one' is an earlier request's too: one each"),
        f"{FILE}#line=7": (
            "chat",
            "its url is '/v1/chat/completions': only /v1/embeddings is served here",
        ),
        f"{FILE}#line=8": ("get", "its method is 'GET': a batch request is a POST"),
        f"{FILE}#line=9": (
            "ids",
            "its input is not a text or a list of texts (token ids are not taken)",
        ),
        f"{FILE}#line=10": ("none", "its input is a list of 0 texts: 1 to 2048 are taken"),
        f"{FILE}#line=11": ("wide", "its dimensions is 0, not a positive integer"),
    }
    assert refused[f"{FILE}#line=4"][1].startswith("its line is not JSON")


def test_a_line_longer_than_any_request_makes_the_file_poison() -> None:
    """A line over the bound is not read into memory: the file is refused, its line named."""
    with pytest.raises(PoisonMessage, match="OpenAI batch line 1 is over"):
        list(batch_requests([b"x" * (4 * 2**20 + 1)], FILE))


def _written(tmp_path: Path, items: list[BatchItem], rows: np.ndarray) -> tuple[list[Any], ...]:
    np.save(tmp_path / "embedding.npy", rows)
    arrays = {"embedding.npy": tmp_path / "embedding.npy"}
    output, errors = write_batch_files(items, arrays, tmp_path, "0123456789abcdef")
    assert (output.name, errors.name) == (OPENAI_OUTPUT_FILE, OPENAI_ERRORS_FILE)
    return tuple(
        [json.loads(line) for line in path.read_bytes().splitlines()] for path in (output, errors)
    )


def _result(index: int, tokens: int) -> dict[str, Any]:
    return {
        "index": index,
        "input": "...",
        "embedding": {"array": "embedding.npy", "row": index},
        "tokens": tokens,
        "model": "topics-text@0a1b2c3d4e5f",
    }


def _failed(message: str) -> dict[str, Any]:
    return {"index": 0, "input": "...", "error": {"type": "NotText", "message": message}}


def test_the_output_and_error_files_are_the_apis_field_for_field(tmp_path: Path) -> None:
    """Requests in file order: a request whose texts all have embeddings is an output
    line shaped as OpenAI's (its data in the input's order, float32 values or their
    little-endian bytes in base64, its tokens counted); one with a text's error, a line
    refused, a dimension the model does not give and a request a cancelled job never
    ran are error lines shaped as OpenAI's; ids are stable for the run."""
    rows = np.random.default_rng(3).standard_normal((7, 4)).astype(np.float32)
    items = [
        BatchItem(f"{FILE}#line=1&input=0", "one", _result(0, 5)),
        BatchItem(f"{FILE}#line=2&input=0&encoding_format=base64", "two", _result(1, 3)),
        BatchItem(f"{FILE}#line=2&input=1&encoding_format=base64", "two", _result(2, 4)),
        BatchItem(f"{FILE}#line=3&input=0", "three", _result(3, 2)),
        BatchItem(f"{FILE}#line=3&input=1", "three", _failed("its text is empty")),
        BatchItem(f"{FILE}#line=4", None, _failed("its line is not JSON: ...")),
        BatchItem(f"{FILE}#line=5&input=0&dimensions=8", "five", _result(4, 1)),
        BatchItem(f"{FILE}#line=6&input=0&dimensions=4", "six", _result(5, 1)),
        BatchItem(f"{FILE}#line=7&input=0", "seven", None),
    ]
    output, errors = _written(tmp_path, items, rows)

    assert [line["custom_id"] for line in output] == ["one", "two", "six"]
    documented_base64 = json.loads(json.dumps(DOCUMENTED_OUTPUT_LINE))
    documented_base64["response"]["body"]["data"][0]["embedding"] = "AAAAAA=="
    shapes = [_shape(line) for line in output]
    assert shapes == [_shape(DOCUMENTED_OUTPUT_LINE), _shape(documented_base64), shapes[0]]
    one = output[0]["response"]["body"]
    assert np.array_equal(np.array(one["data"][0]["embedding"], np.float32), rows[0])
    assert (one["model"], one["usage"]) == (
        "topics-text@0a1b2c3d4e5f",
        {"prompt_tokens": 5, "total_tokens": 5},
    )
    two = output[1]["response"]["body"]
    assert [entry["index"] for entry in two["data"]] == [0, 1]
    decoded = [np.frombuffer(base64.b64decode(e["embedding"]), "<f4") for e in two["data"]]
    assert np.array_equal(np.stack(decoded), rows[1:3])
    assert two["usage"] == {"prompt_tokens": 7, "total_tokens": 7}

    assert [line["custom_id"] for line in errors] == ["three", None, "five", "seven"]
    refused = [line for line in errors if line["response"] is not None]
    assert all(_shape(line) == _shape(DOCUMENTED_ERROR_LINE) for line in refused)
    assert [line["response"]["body"]["error"] for line in refused] == [
        {
            "message": "input[1]: its text is empty",
            "type": "invalid_request_error",
            "param": "input",
            "code": None,
        },
        {
            "message": "dimensions 8: this model's embeddings have 4 (they are not cut)",
            "type": "invalid_request_error",
            "param": "dimensions",
            "code": None,
        },
    ]
    unrun = [line for line in errors if line["response"] is None]
    # (the line that names no custom_id has it null)
    assert all(_shape({**line, "custom_id": ""}) == _shape(DOCUMENTED_UNRUN_LINE) for line in unrun)
    assert unrun[0]["error"] == {
        "code": "invalid_request_line",
        "message": "its line is not JSON: ...",
    }
    assert unrun[1]["error"] == DOCUMENTED_UNRUN_LINE["error"]
    ids = [line["id"] for line in output + errors]
    assert len(set(ids)) == len(ids) and all(i.startswith("batch_req_") for i in ids)
    assert _written(tmp_path, items, rows) == (output, errors)


def test_a_batch_file_runs_into_output_and_error_files_of_the_models_embeddings(
    tmp_path: Path,
) -> None:
    """A batch file through the daemon: each request's embeddings are the model's own
    answers to its texts, in file order; the bad lines are error lines and the job goes
    on; each request's usage counts its texts' tokens; job.json names both files, and
    the job sent again (with Parquet results) replaces them. A file of more texts than
    a shard is refused: one run writes its files."""
    texts = ["the forecast says rain", "a late train", "fresh bread at dawn"]
    blobs = InMemoryBlobStore()
    blobs.objects[FILE] = _file(
        embeddings_request("a", texts[0]),
        {**embeddings_request("chat", "hi"), "url": "/v1/chat/completions"},
        embeddings_request("b", texts[1:]),
        embeddings_request("c", ["", "fine"]),
    )
    written = {}
    for run, results_format in (("first", "jsonl"), ("again", "parquet")):
        source = InMemoryJobSource()
        message = {"job_id": "batch", "request_id": run, "openai_batch": FILE}
        message["format"] = results_format
        source.send(json.dumps({**message, "output": "s3://bkt/out/batch/"}))
        sharded = {"job_id": "sharded", "openai_batch": FILE, "shard_items": 5}
        source.send(json.dumps({**sharded, "output": "s3://bkt/out/sharded/"}))
        run_until_drained(source, blobs, tmp_path / run, **TEXT_PIPELINE)
        rejected = json.loads(blobs.objects["s3://bkt/out/sharded/rejected.json"])
        assert "holds over 5 texts, the shard size" in rejected["reason"]
        summary = job_file(blobs, "batch", "job.json")
        assert (summary["request_id"], summary["items"], summary["failed"]) == (run, 6, 2)
        assert {OPENAI_OUTPUT_FILE, OPENAI_ERRORS_FILE} <= summary["outputs"].keys()
        written[run] = summary["outputs"].keys()
    assert "results/part-000000-0000.parquet" in written["again"]

    output = [
        json.loads(line) for line in job_file(blobs, "batch", OPENAI_OUTPUT_FILE).splitlines()
    ]
    errors = [
        json.loads(line) for line in job_file(blobs, "batch", OPENAI_ERRORS_FILE).splitlines()
    ]
    assert [line["custom_id"] for line in output] == ["a", "b"]
    embeddings = [
        entry["embedding"] for line in output for entry in line["response"]["body"]["data"]
    ]
    assert np.allclose(embeddings, model_answers(texts)[:, len(TOPICS) :], atol=1e-5)
    assert [(line["custom_id"], line["response"]["status_code"]) for line in errors] == [
        ("chat", 400),
        ("c", 400),
    ]
    assert "results.jsonl" in written["first"]
    results = job_file(blobs, "batch", "results.jsonl")  # the first run's (the second's: Parquet)
    assert [line.get("id") for line in results] == ["a", "chat", "b", "b", "c", "c"]
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    counted = [len(tokenizer.encode(text).ids) for text in texts]
    assert [line.get("tokens") for line in results[:4]] == [counted[0], None, *counted[1:]]
    usages = [line["response"]["body"]["usage"] for line in output]
    assert usages == [
        {"prompt_tokens": counted[0], "total_tokens": counted[0]},
        {"prompt_tokens": sum(counted[1:]), "total_tokens": sum(counted[1:])},
    ]


def test_the_client_uploads_a_local_batch_file_only_for_a_job_the_daemon_takes(
    tmp_path: Path,
) -> None:
    """A local file goes under the job's output, then its job is sent naming it; a job
    the daemon would refuse (a bucket outside the allow-list) is `InvalidJob`, with
    nothing uploaded and nothing sent; an s3:// file is named as it is."""
    queue, blobs = InMemoryJobSource(), InMemoryBlobStore()
    jobs = Jobs(queue, blobs, allowed_buckets=frozenset({"bkt"}))
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(_file(embeddings_request("a", "the forecast says rain")))
    with pytest.raises(InvalidJob, match="bucket"):
        jobs.submit_openai_batch(requests, "s3://elsewhere/out/")
    assert (len(queue), blobs.objects) == (0, {})

    jobs.submit_openai_batch(requests, "s3://bkt/out/local/", job_id="local")
    jobs.submit_openai_batch(FILE, "s3://bkt/out/remote/", job_id="remote")
    sent = [json.loads(message.body) for message in queue.receive(10, 0, 30)]
    assert [message["openai_batch"] for message in sent] == [
        "s3://bkt/out/local/openai-requests.jsonl",
        FILE,
    ]
    assert blobs.objects["s3://bkt/out/local/openai-requests.jsonl"] == requests.read_bytes()
