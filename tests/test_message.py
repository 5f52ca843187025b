"""The job message schema and the poison rules."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import pytest

from worker.message import PoisonMessage, at_most, manifest_uris, parse_job_message

NO_LIMIT: frozenset[str] = frozenset()


def body(**fields: object) -> str:
    return json.dumps({"inputs": ["s3://inputs/a.jpg"], "output": "s3://outputs/r/", **fields})


def test_valid_message_parses() -> None:
    """A message with inputs and an output parses, params included."""
    message = parse_job_message(body(job_id="cats-1", params={"top_k": 2}), NO_LIMIT)
    assert message.job_id == "cats-1" and message.params == {"top_k": 2}
    assert str(message.output_location("job.json")) == "s3://outputs/r/job.json"


def test_output_without_trailing_slash_is_a_prefix() -> None:
    """'s3://outputs/r' and 's3://outputs/r/' name the same output folder."""
    message = parse_job_message(body(output="s3://outputs/r"), NO_LIMIT)
    assert str(message.output_location("results.jsonl")) == "s3://outputs/r/results.jsonl"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("not json", "not UTF-8 JSON"),
        (b"\xff\xfe{}", "not UTF-8 JSON"),
        (json.dumps({"output": "s3://outputs/r/"}), "exactly one of"),
        (
            json.dumps(
                {
                    "inputs": ["s3://inputs/a"],
                    "manifest": "s3://inputs/m",
                    "output": "s3://outputs/r/",
                }
            ),
            "exactly one of",
        ),
        (body(job_id="../../etc/passwd"), "job_id"),
        (body(extra=1), "extra"),
        (body(inputs=[]), "inputs"),
        (body(inputs=["http://x/y"]), "inputs.0"),
        (json.dumps({"inputs": ["s3://inputs/a"]}), "output"),
        (json.dumps([1, 2]), "body"),
        (body(params={"array_dtype": "int8"}), "params.array_dtype is one of 'float32', 'float16'"),
    ],
)
def test_poison_messages_say_why(raw: str | bytes, reason: str) -> None:
    """Each broken message is rejected with a reason naming what is wrong."""
    with pytest.raises(PoisonMessage, match=reason):
        parse_job_message(raw, NO_LIMIT)


def test_bucket_outside_allow_list_is_poison() -> None:
    """With an allow-list, a message naming another bucket is rejected."""
    with pytest.raises(PoisonMessage, match="not allowed: elsewhere"):
        parse_job_message(body(output="s3://elsewhere/r/"), frozenset({"inputs", "outputs"}))
    parse_job_message(body(), frozenset({"inputs", "outputs"}))


def _pieces(text: bytes) -> Iterator[bytes]:
    """`text` in pieces of 3 bytes, as a stream may come: lines split between them."""
    for start in range(0, len(text), 3):
        yield text[start : start + 3]


def test_manifest_rules() -> None:
    """A manifest lists URIs, skipping blanks and comments; empty, oversized or
    malformed manifests are poison."""
    assert list(
        at_most(manifest_uris(_pieces(b"s3://inputs/a\n\n# note\ns3://inputs/b\n"), NO_LIMIT), 10)
    ) == [
        "s3://inputs/a",
        "s3://inputs/b",
    ]
    with pytest.raises(PoisonMessage, match="no inputs"):
        list(at_most(manifest_uris(_pieces(b"\n# nothing\n"), NO_LIMIT), 10))
    with pytest.raises(PoisonMessage, match="line 2"):
        list(at_most(manifest_uris(_pieces(b"s3://inputs/a\nnot-a-uri\n"), NO_LIMIT), 10))
    with pytest.raises(PoisonMessage, match="line 2 is not UTF-8"):
        list(at_most(manifest_uris(_pieces(b"s3://inputs/a\n\xff\n"), NO_LIMIT), 10))
    with pytest.raises(PoisonMessage, match="not allowed"):
        list(at_most(manifest_uris(_pieces(b"s3://secret/a\n"), frozenset({"inputs"})), 10))


def test_a_manifest_over_its_item_limit_is_read_no_further() -> None:
    """The item limit stops the read at the first line past it: lines after it are
    never taken from the stream."""
    taken: list[int] = []

    def endless() -> Iterator[bytes]:
        for number in itertools.count():
            taken.append(number)
            yield f"s3://inputs/{number}\n".encode()

    with pytest.raises(PoisonMessage, match="more than 3 inputs, over the limit"):
        list(at_most(manifest_uris(endless(), NO_LIMIT), 3))
    assert len(taken) == 4


def test_a_manifest_line_longer_than_any_uri_is_refused_as_it_is_read() -> None:
    """A line over 2,048 bytes can be no input's URI: the manifest is refused when the
    stream has given that much of it, however long the line would go on, and in time
    that does not grow with its square (a 64 MiB line once took minutes)."""
    pieces: list[int] = []

    def one_line() -> Iterator[bytes]:
        for number in itertools.count():
            pieces.append(number)
            yield b"x" * 65536

    with pytest.raises(PoisonMessage, match="manifest line 1 is over 2048 bytes"):
        list(at_most(manifest_uris(one_line(), NO_LIMIT), 10))
    assert pieces == [0]
    long_last = b"s3://inputs/a\n" + b"y" * 3000
    with pytest.raises(PoisonMessage, match="manifest line 2 is over 2048 bytes"):
        list(at_most(manifest_uris(_pieces(long_last), NO_LIMIT), 10))
    lines = b"".join(b"s3://inputs/%d\r\n" % number for number in range(50_000))
    started = time.perf_counter()
    assert len(list(at_most(manifest_uris([lines], NO_LIMIT), 50_000))) == 50_000
    assert time.perf_counter() - started < 5
