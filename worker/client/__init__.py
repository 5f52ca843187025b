"""The producer's side of a job: send it, follow it, read its results, cancel it.

    jobs = Jobs.connect(queue_url)
    job = jobs.submit("s3://bucket/results/j1/", manifest="s3://bucket/list.txt")
    summary = job.wait(timeout_s=3600)
    for record in job.lines():
        ...

The message is the daemon's own `JobMessage`, validated as the daemon validates a body
(`parse_job_message`) before it is sent, so the two cannot disagree; the handles are in
`worker.client.handles`. What a job leaves under its output (progress.json, job.json,
rejected.json, results.jsonl or Parquet files under results/, `cancel`) is read as
docs/jobs.md describes it (`worker.client.outputs`), and as untrusted as anything else
in S3: a file that does not say what it should raises `UnreadableOutput`.

Each submit carries a request id of its own, which the job.json (and rejected.json) of
that run echoes: a handle takes only its own run's files for its job's, never those an
earlier run to the same output left, and reads the results job.json names at the ETags
it names them with (`OutputReplaced` if a later run has replaced them since).
"""

from worker.client.handles import (
    CancelRefused,
    InvalidJob,
    Job,
    JobNotFinished,
    JobQueue,
    JobRejected,
    Jobs,
    JobStalled,
    JobStatus,
    Phase,
)
from worker.client.outputs import OutputReplaced, UnreadableOutput

__all__ = [
    "CancelRefused",
    "InvalidJob",
    "Job",
    "JobNotFinished",
    "JobQueue",
    "JobRejected",
    "JobStalled",
    "JobStatus",
    "Jobs",
    "OutputReplaced",
    "Phase",
    "UnreadableOutput",
]
