"""A table of texts across the fleet: two daemon subprocesses running the shipped text
model against the moto server split a Parquet table of texts into shards and merge one
ordered Parquet result of embeddings, equal to the model's own answers."""

from __future__ import annotations

import io
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.sentences import TOPICS, sentences
from tests.support.aws import Aws
from tests.support.daemons import StartDaemon, daemon_args
from tests.support.jobs import enqueue_command, job_output, upload
from tests.support.texts import TEXT_MODEL_FLAGS, model_answers

pytestmark = pytest.mark.e2e

TEXT_FLAGS = [*TEXT_MODEL_FLAGS, "--batch-size", "8"]


def test_a_parquet_table_of_texts_runs_across_two_daemons_into_ordered_embeddings(
    aws: Aws, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """60 rows in shards of 20 on two daemons, sent by `worker enqueue --text-column`:
    one Parquet file (the shards' joined), one row of results per text, in table
    order, keyed by its id, each embedding (a float32 fixed-size list) the model's own
    answer within float tolerance and each label its topic. Beside it, two texts sent
    in the message (`enqueue --text`)."""
    stack = aws.stack()
    drawn = list(sentences(60, seed=40))
    texts = [text for _, text in drawn]
    ids = [f"ticket-{row:03d}" for row in range(len(texts))]
    sink = io.BytesIO()
    pq.write_table(pa.table({"ticket": ids, "body": texts}), sink, row_group_size=16)
    table = upload(aws, stack, "tickets.parquet", sink.getvalue())
    output = job_output(stack, "texts")
    columns = ["--text-column", "body", "--id-column", "ticket"]
    sharded = ["--format", "parquet", "--shard-items", "20"]
    inline_output = job_output(stack, "inline")
    for command in (
        enqueue_command(stack.queue_url, "texts", output, "--table", table, *columns, *sharded),
        enqueue_command(stack.queue_url, "inline", inline_output, "--text", texts[0], "--text", ""),
    ):
        subprocess.run(command, env=aws.env, check=True, capture_output=True, timeout=180)
    fleet = [
        start_daemon(daemon_args(stack, tmp_path / str(n), *TEXT_FLAGS), env=aws.env)
        for n in range(2)
    ]
    deadline = time.monotonic() + 180

    def both_done() -> bool:
        merged = any(daemon.events("job_merged") for daemon in fleet)
        return merged and "job.json" in aws.names(inline_output)

    while not both_done():
        assert time.monotonic() < deadline, f"not merged: {aws.names(output)[:20]}"
        time.sleep(0.5)
    for daemon in fleet:  # a daemon stopping finishes what it holds first
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, daemon.stderr[-3000:]

    summary = aws.summary(output)
    assert (summary["status"], summary["shards"]["count"]) == ("succeeded", 3)
    # The shards' files joined into the one file a run of the table alone writes.
    assert [name for name in summary["outputs"] if name.startswith("results/")] == [
        "results/part-000000-0000.parquet"
    ]
    assert [name for name in aws.names(output) if name.startswith("results/")] == [
        "results/part-000000-0000.parquet"
    ]
    results = pq.read_table(io.BytesIO(aws.read(output, "results/part-000000-0000.parquet")))
    assert results.column("id").to_pylist() == ids
    assert results.column("index").to_pylist() == list(range(len(texts)))
    assert results.schema.field("embedding").type == pa.list_(pa.float32(), 64)
    answers = model_answers(texts)
    embeddings = np.array(results.column("embedding").to_pylist(), dtype=np.float32)
    assert np.allclose(embeddings, answers[:, len(TOPICS) :], atol=1e-5)
    assert results.column("label").to_pylist() == [topic for topic, _ in drawn]
    inline = aws.results(inline_output)
    assert [result["input"] for result in inline] == [texts[0], ""]
    assert inline[0]["label"] == drawn[0][0] and "error" in inline[1]
