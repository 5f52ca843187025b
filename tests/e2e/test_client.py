"""The producers' client end to end: the README's Python example, as written, sends a
job to a stack on the moto server, follows it while a daemon subprocess drains the
queue, and prints its results."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from stages.synthetic import LABELS
from tests.support.aws import Aws
from tests.support.daemons import daemon_args, run_daemon
from tests.support.jobs import sending
from tests.support.paths import REPO
from worker.demo import upload_samples

pytestmark = pytest.mark.e2e

EXAMPLE_SECTION = "## Sending jobs from Python"


def _readme_example() -> str:
    """The first Python block of the README's section on the client."""
    section = (REPO / "README.md").read_text().partition(EXAMPLE_SECTION)[2]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, f"no Python example under {EXAMPLE_SECTION!r}"
    return match.group(1)


def test_the_readme_python_example_sends_follows_and_reads_a_job(aws: Aws, tmp_path: Path) -> None:
    """Run as written, with the variables it names set, it waits for the job's job.json
    and prints its status, then a line per image, in input order, with its label."""
    stack = aws.stack()
    labels = upload_samples(aws.s3, stack.bucket, 3, seed=41)
    example = tmp_path / "example.py"
    example.write_text(_readme_example())
    env = {**aws.env, "WORKER_QUEUE_URL": stack.queue_url, "WORKER_BUCKET": stack.bucket}
    with sending(aws, stack.queue_url, [sys.executable, str(example)], env) as example_run:
        # One preprocessing process, for three images: one process fewer to start.
        args = daemon_args(stack, tmp_path, "--drain", "--preprocess-workers", "1", dlq=False)
        run = run_daemon(aws, args)
        printed, errors = example_run.communicate(timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert example_run.returncode == 0, errors
    status, *records = printed.splitlines()
    assert status == "succeeded 3"
    assert [record.split()[:2] for record in records] == [
        [str(index), uri] for index, uri in enumerate(sorted(labels))
    ]
    assert all(record.split()[2] in LABELS for record in records)
