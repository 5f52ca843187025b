"""A million texts across the fleet (issue 40's "done when"): a Parquet table of texts,
one job naming it, daemons as processes of their own with the shipped text model
against one moto server, and one ordered Parquet result of embeddings checked row by row
against the model's own answers.

    python -m bench.texts_fleet --rows 1000000 --daemons 3   # make bench-texts

The table's texts are one to ten generated sentences (`stages.sentences`: 7 to 64
tokens, a median of 15, under 1% cut at the model's 64), each row with an id. The job
is sent with a shard size that gives each daemon several shards; its results are read
back as one table (the parts job.json names, in order) and must hold every row once,
in table order, keyed by its id, each embedding within `TOLERANCE` of what
`stages.text:text_model` answers for the text tokenized by `stages.text:tokens` in this
process (both float32 on the CPU).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.fleet import DAEMON_FLAGS, running_daemons, sent_until_done, shard_lane
from bench.processes import moto_stack
from stages.sentences import TOPICS, sentences
from stages.text import text_model, tokens

ROWS = 1_000_000
DAEMONS = 3
SHARDS_PER_DAEMON = 8  # enough that the last shards to finish leave little idle
SEED = 40
MOST_SENTENCES = 10
ID_COLUMN = "id"
TEXT_COLUMN = "text"
ROW_GROUP_ROWS = 65_536
BATCH_ROWS = 1024
# Off: on the CPU this model's batches cost little beside each row's host work, and a
# budget (batches of one length each) gained nothing measurable here: a million rows at
# 3,904 and 3,984 rows/s with 16,384 tokens, 3,725 and 4,700 without (performance.md).
MAX_BATCH_TOKENS = 0
TEXT_FLAGS = (
    *("--preprocess", "stages.text:tokens", "--model", "stages.text:text_model"),
    *("--postprocess", "stages.text:labelled", "--batch-size", str(BATCH_ROWS)),
)
REFERENCE_BATCH_ROWS = 4096
TOLERANCE = 1e-5  # float32 on the CPU: the same sums in another batch's order
TIMEOUT_S = 3600.0


class ResultsMismatch(AssertionError):
    """The fleet's results are not the table's rows, in order, with the model's answers."""


def texts_table(rows: int, seed: int = SEED) -> pa.Table:
    """`rows` texts, each of one to `MOST_SENTENCES` sentences (most of one or two),
    keyed by an id of their row."""
    rng = random.Random(seed)
    drawn = (text for _, text in sentences(rows * MOST_SENTENCES, seed))
    texts = [
        ". ".join(next(drawn) for _ in range(min(MOST_SENTENCES, 1 + int(rng.expovariate(0.6)))))
        for _ in range(rows)
    ]
    return pa.table({ID_COLUMN: [f"text-{row:07d}" for row in range(rows)], TEXT_COLUMN: texts})


def model_embeddings(texts: list[str]) -> np.ndarray:
    """`stages.text:text_model`'s embedding of each text, tokenized as the daemon's
    preprocessor does, run in batches of `REFERENCE_BATCH_ROWS`."""
    model = text_model()
    answers = [
        model_batch(model, texts[start : start + REFERENCE_BATCH_ROWS])
        for start in range(0, len(texts), REFERENCE_BATCH_ROWS)
    ]
    return np.concatenate(answers) if answers else np.zeros((0, 0), np.float32)


def model_batch(model: torch.nn.Module, texts: list[str]) -> np.ndarray:
    """The embeddings of one batch of texts (the model's row less the topics')."""
    slots = torch.zeros((len(texts), *tokens.output_shape), dtype=tokens.output_dtype)
    for text, slot in zip(texts, slots, strict=True):
        tokens(text, slot, {})
    with torch.inference_mode():
        answers = model(slots[:, 0], slots[:, 1])
    return answers[:, len(TOPICS) :].numpy()  # type: ignore[no-any-return]


def check_results(results: pa.Table, table: pa.Table) -> float:
    """Raise `ResultsMismatch` unless `results` holds each row of `table` once, in its
    order, keyed by its id, with no error and the model's embedding of its text (within
    `TOLERANCE`); the largest difference from the model's answers."""
    ids = table.column(ID_COLUMN).cast(pa.string())
    if results.num_rows != table.num_rows:
        raise ResultsMismatch(f"{results.num_rows} results of {table.num_rows} rows")
    if not np.array_equal(results.column("index").to_numpy(), np.arange(table.num_rows)):
        raise ResultsMismatch("the results' indices are not the rows in order")
    if not results.column(ID_COLUMN).cast(pa.string()).equals(ids):
        raise ResultsMismatch("the results' ids are not the table's, in order")
    if failed := results.num_rows - results.column("error").null_count:
        raise ResultsMismatch(f"{failed} rows failed")
    embeddings = results.column("embedding").combine_chunks()
    got = embeddings.flatten().to_numpy().reshape(results.num_rows, -1)
    expected = model_embeddings(table.column(TEXT_COLUMN).to_pylist())
    differences = np.abs(got - expected).max(axis=1)
    if (wrong := np.flatnonzero(differences > TOLERANCE)).size:
        row = int(wrong[0])
        raise ResultsMismatch(
            f"{wrong.size} embeddings differ from the model's, the first {ids[row]} "
            f"by {differences[row]:.2e}"
        )
    return float(differences.max(initial=0.0))


def texts_fleet(
    work_dir: Path,
    rows: int = ROWS,
    daemons: int = DAEMONS,
    shard_rows: int | None = None,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
) -> dict[str, Any]:
    """One job of a `rows`-row Parquet table of texts on `daemons` daemons, in shards of
    `shard_rows` (by default `SHARDS_PER_DAEMON` a daemon), its results checked
    (`check_results`): its wall time from sent to job.json, rows/s end to end, each
    daemon's shards and rows."""
    shard_rows = shard_rows or -(-rows // (daemons * SHARDS_PER_DAEMON))
    table = texts_table(rows)
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS)
    with moto_stack("texts") as (env, sqs, s3, stack):
        s3.put_object(Bucket=stack.bucket, Key="texts.parquet", Body=sink.getvalue())
        job = {
            "job_id": "texts",
            "table": {
                "uri": f"s3://{stack.bucket}/texts.parquet",
                **{"text_column": TEXT_COLUMN, "id_column": ID_COLUMN},
            },
            "output": f"s3://{stack.bucket}/out/texts/",
            "format": "parquet",
            "shard_items": shard_rows,
        }
        flags = (*TEXT_FLAGS, *DAEMON_FLAGS, *shard_lane(stack))
        flags += ("--max-batch-tokens", str(max_batch_tokens))
        with running_daemons(env, stack, work_dir, daemons, *flags) as fleet:
            wall_s = sent_until_done(sqs, s3, stack, job, fleet=fleet, timeout_s=TIMEOUT_S)
        summary = json.loads(_read(s3, stack.bucket, "out/texts/job.json"))
        parts = [name for name in summary["outputs"] if name.startswith("results/")]
        results = pa.concat_tables(
            pq.read_table(io.BytesIO(_read(s3, stack.bucket, f"out/texts/{part}")))
            for part in parts
        )
    checked_at = time.perf_counter()
    largest_difference = check_results(results, table)
    return {
        "rows": rows,
        "daemons": daemons,
        "shard_rows": shard_rows,
        "shards": summary["shards"]["count"],
        "max_batch_tokens": max_batch_tokens,
        "status": summary["status"],
        "wall_s": wall_s,
        "rows_per_s": rows / wall_s,
        "daemon_rows": [sum(c["items"] for c in daemon.committed) for daemon in fleet],
        "daemon_shards": [len(daemon.committed) for daemon in fleet],
        "result_parts": len(parts),
        "embedding_largest_difference": largest_difference,
        "check_s": time.perf_counter() - checked_at,
    }


def _read(s3: Any, bucket: str, key: str) -> bytes:
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()  # type: ignore[no-any-return]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rows", type=int, default=ROWS, help="the table's rows")
    parser.add_argument("--daemons", type=int, default=DAEMONS, help="daemons in the fleet")
    parser.add_argument(
        "--shard-rows",
        type=int,
        help=f"the job's shard size (default: {SHARDS_PER_DAEMON} shards a daemon)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=MAX_BATCH_TOKENS,
        help="the daemons' token budget a batch (0: batches of --batch-size texts)",
    )
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    return parser


def main() -> None:
    """`python -m bench.texts_fleet [--rows N] [--daemons D]`: the figures, as JSON on
    stdout."""
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        figures = texts_fleet(
            Path(scratch), args.rows, args.daemons, args.shard_rows, args.max_batch_tokens
        )
    report = json.dumps(figures, indent=2)
    if args.out:
        args.out.write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
