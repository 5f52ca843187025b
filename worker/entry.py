"""The daemon's command line as `python -m worker` and `sqs-batch-worker` start it. A
stop signal while the command line's modules import (seconds: torch, pyarrow, boto3)
ends a daemon cleanly, exit 0, as one during the rest of its start-up does
(`worker.cli.main`): it holds nothing yet. So this module imports nothing heavy."""

import os
import signal
import sys


def main() -> None:
    if sys.argv[1:2] == ["run"]:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _stopped_while_importing)
    from worker.cli import main as cli_main  # after the handlers: the long part

    cli_main()


def _stopped_while_importing(_signum: int, _frame: object) -> None:
    os._exit(0)  # nothing to clean up, and no import's `except` may swallow the stop
