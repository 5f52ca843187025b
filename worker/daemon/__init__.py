"""The daemon's life: its wiring (`wiring.Daemon`), the one module that assembles the
pipeline's shape (`stages`), the supervisor of its loops, shutdown, scale-in protection,
interruption notices and the host's record of breakages."""

from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon

__all__ = ["Daemon", "ExitCode"]
