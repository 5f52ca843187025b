"""The daemon's command line as `python -m worker` and `sqs-batch-worker` start it. A
stop signal while the command line's modules import (seconds: torch, pyarrow, boto3)
ends a daemon cleanly, exit 0, as one during the rest of its start-up does
(`worker.cli.main`): it holds nothing yet. So this module imports nothing heavy."""

import gc
import os
import signal
import sys

# What the stage processes' fork server imports before it forks the first: what every
# child runs (`worker.engine.child_handle.FORKSERVER_PRELOAD`), the daemon's set-ups
# (`worker.daemon.stages.SET_UP_MODULES`: each child took a second of CPU importing
# them), and the readers of S3 they fetch with (`S3BlobStore.remote_reader`). Those are
# named here, not imported: importing them would start the server later, and it is
# started first for the seconds torch takes (tests/test_main_process_imports.py checks
# that it names them all).
FORK_SERVER_PRELOAD = (
    "worker.engine.fork_server",  # first: its collector off while it imports the rest
    "torch",
    "worker.engine",
    "worker.engine.child_main",
    "worker.daemon.stages",
    "worker.plugins.setups",
    "worker.adapters.aws.s3",
    "worker.adapters.aws.obstore_reads",
)
# Where the fork server's socket is (a directory of its own in the temporary directory,
# made as it starts): multiprocessing's exit handler removes it, which `exit_at_once`
# skips, so it does that itself.
_FORK_SERVER_DIRECTORY: list[str] = []


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _stopped_while_importing)
        # What the daemon imports and builds as it starts lives as long as it does: no
        # collection walks it meanwhile (270 of them took 0.18 CPU-s), the daemon collects
        # once when it has started, freezes what is left and turns the collector on
        # (`worker.telemetry.pauses.started_heap_frozen`).
        gc.disable()
        if not {"-h", "--help"} & set(sys.argv):
            _start_fork_server()
    from worker.cli import main as cli_main  # after the handlers: the long part

    cli_main()


def _start_fork_server() -> None:
    """Start the fork server of the stage processes now: it imports torch (seconds)
    while this process imports the command line's modules, where it did so after them.
    Its children start with OpenMP's idle threads asleep (`process_context`)."""
    import multiprocessing.forkserver
    import multiprocessing.util

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    multiprocessing.forkserver.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    # Made (and known) before the server's socket is put in it: a stop while the server
    # starts finds it.
    _FORK_SERVER_DIRECTORY.append(multiprocessing.util.get_temp_dir())
    multiprocessing.forkserver.ensure_running()


def exit_at_once(code: int) -> None:
    """Leave now: not joining threads stuck in a call, as the interpreter would, nor
    running its exit handlers, of which one is done here (the removal of the fork
    server's socket directory: each stop left one). Nothing here imports, and nothing
    that fails here keeps it from leaving (it may run in a signal handler, mid-import)."""
    try:
        for directory in _FORK_SERVER_DIRECTORY:
            try:
                for name in os.listdir(directory):
                    os.unlink(os.path.join(directory, name))
                os.rmdir(directory)
            except OSError:  # (gone already, or more put in it): the flushes still come
                pass
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _stopped_while_importing(_signum: int, _frame: object) -> None:
    exit_at_once(0)  # nothing else to clean up, and no import's `except` may swallow it
