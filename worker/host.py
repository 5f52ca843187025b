"""What this host gives the daemon: the cores it may run on. A module of its own, free of
the engine's imports (torch), so that the settings, which a producer's command line
reads, can count them too."""

from __future__ import annotations

import os


def host_cores() -> int:
    """The cores this process may run on: its CPU affinity where the system keeps one
    (Linux, where a container pinned to some of the host's CPUs sees those), else every
    CPU (macOS). A CPU quota (`docker --cpus`, ECS CPU units) is not counted: it limits
    time, not which cores."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
