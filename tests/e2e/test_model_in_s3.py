"""`--model s3://bucket/key.pt2`: a daemon subprocess fetches a user's text model from
the moto server at start and runs a job with it."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.aws import Aws
from tests.support.daemons import daemon_args, run_daemon
from tests.support.jobs import job_output, upload
from tests.support.text_encoders import encoder_answers, save_export, tokenized

pytestmark = pytest.mark.e2e

TEXTS = ["the forecast says rain", "a late train to the coast", "soup"]


def test_a_model_in_s3_is_fetched_at_start_and_answers_a_job(aws: Aws, tmp_path: Path) -> None:
    """A torch.export archive in the stack's bucket: the daemon fetches it into its model
    cache (model-cache under --log-dir by default) before its model's process starts,
    job.json names it by the archive's own sha256 and file name, and the job's
    embeddings are the model's."""
    stack = aws.stack()
    archive = tmp_path / "encoder.pt2"
    save_export(archive)
    model = upload(aws, stack, "models/encoder.pt2", archive.read_bytes())
    output = job_output(stack, "embedded")
    aws.send(
        stack.queue_url,
        {"job_id": "embedded", "texts": TEXTS, "output": output, "format": "parquet"},
    )
    flags = ["--drain", "--model", model]
    text_flags = ["--preprocess", "stages.text:tokens", "--postprocess", "stages.text:embedding"]
    run = run_daemon(aws, daemon_args(stack, tmp_path / "logs", *flags, *text_flags), 120)
    assert run.returncode == 0, run.stderr[-3000:]

    [fetched] = [json.loads(line) for line in run.stdout.splitlines() if '"model_fetched"' in line]
    assert (fetched["location"], fetched["bytes"]) == (model, archive.stat().st_size)
    copy = Path(fetched["path"])
    assert copy.read_bytes() == archive.read_bytes()
    assert copy.is_relative_to(tmp_path / "logs" / "model-cache")  # by default
    summary = aws.summary(output)
    assert summary["status"] == "succeeded"
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert summary["model"] == {
        "name": "encoder.pt2",
        "version": digest[:12],
        "digest": f"sha256:{digest}",
    }
    parts = sorted(name for name in aws.names(output) if name.startswith("results/"))
    results = pa.concat_tables(pq.read_table(io.BytesIO(aws.read(output, p))) for p in parts)
    assert results.column("input").to_pylist() == TEXTS
    embeddings = np.array(results.column("embedding").to_pylist())
    slots = tokenized(TEXTS)
    assert np.allclose(embeddings, encoder_answers(slots[:, 0], slots[:, 1]), atol=1e-5)
