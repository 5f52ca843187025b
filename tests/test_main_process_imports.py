"""The daemon's own process imports no torch for a CPU pipeline of the shipped image
stages: only its stages' processes use it, and importing it cost every daemon's start
1.3 s of CPU (docs/performance.md). (On a host with a GPU it does, to count them and to
see whether inputs can be decoded there: the daemon here runs on the CPU wherever it is.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO
from worker.adapters.aws.obstore_reads import open_obstore_reader
from worker.adapters.aws.s3 import open_s3_reader
from worker.daemon.stages import SET_UP_MODULES
from worker.engine.child_handle import FORKSERVER_PRELOAD
from worker.entry import FORK_SERVER_PRELOAD

# A daemon against the in-memory fakes that runs a job of two images on the CPU and
# drains, in a fresh interpreter: its arenas made, its stages' processes started, their
# set-ups and arenas pickled to them, their answers read, the results written.
DRAIN_A_JOB = """
import json, sys
from pathlib import Path
from tests.support.in_process import job_file, run_until_drained, sample_images, send_job
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource

source, blobs = InMemoryJobSource(), InMemoryBlobStore()
send_job(source, "j", sample_images(blobs, 2))
run_until_drained(source, blobs, Path(sys.argv[1]), device="cpu", decode="cpu")
status = job_file(blobs, "j", "job.json")["status"]
print(json.dumps({"status": status, "torch": "torch" in sys.modules}))
"""


def test_the_daemons_own_process_imports_no_torch_for_a_cpu_pipeline(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", DRAIN_A_JOB, str(tmp_path)],
        cwd=REPO,
        check=False,  # its stderr is the failure's message
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"status": "succeeded", "torch": False}


def test_the_fork_server_started_first_imports_what_every_stage_process_imports() -> None:
    """`worker run` starts the stages' fork server before it imports the rest, with a
    list of its own (importing these would start it later): one it lacks is imported by
    each child, a second of CPU each for the set-ups."""
    every_child = {*FORKSERVER_PRELOAD, *SET_UP_MODULES}
    s3_readers = {open_s3_reader.__module__, open_obstore_reader.__module__}
    assert every_child | s3_readers <= set(FORK_SERVER_PRELOAD)
    # First, the one that turns the server's collector off (imported here, it would turn
    # this process's off): test_engine.py checks what it does.
    assert FORK_SERVER_PRELOAD[0] == FORKSERVER_PRELOAD[0] == "worker.engine.fork_server"
