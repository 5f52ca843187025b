"""The parts of `worker` and which may import which, written down once and checked.

The engine is generic (it moves items through stages and knows nothing of jobs, AWS or
plug-ins); the adapters are thin (they make the ports real and know nothing of jobs,
the daemon or pipelines); the plug-ins' contract rests on the engine alone. The job
message is the contract beneath everything job-shaped; the dataset formats read and write
what a message names and know no job's state; one job's life (`jobs`) rests on them, the
fleet's sharding on that, and the job loops and the daemon sit on top; the command line
(`cli`, `demo`, `entry`, `__main__`) wires the adapters in and may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO

KERNEL = {"errors", "ports", "retry"}
MAY_IMPORT = {
    "errors": set(),
    "ports": set(),
    "retry": {"errors"},
    "host": set(),
    "engine": {"errors", "host"},
    "adapters": KERNEL,
    "plugins": {"engine", "errors", "ports"},
    "telemetry": {"errors", "ports"},
    "settings": {"host", "plugins", "ports", "retry"},
    "message": {"ports"},
    "datasets": {"message", "plugins", *KERNEL},
    "jobs": {"datasets", "engine", "message", "plugins", "telemetry", "settings", *KERNEL},
    "sharding": {"datasets", "jobs", "message", *KERNEL},
    "loops": {
        "datasets",
        "engine",
        "jobs",
        "message",
        "plugins",
        "sharding",
        "settings",
        "telemetry",
        *KERNEL,
    },
    "daemon": {
        "datasets",
        "engine",
        "jobs",
        "loops",
        "message",
        "plugins",
        "sharding",
        "settings",
        "telemetry",
        *KERNEL,
    },
    # A producer's side of the jobs' contract (the message, the outputs), over AWS.
    "client": {"adapters", "datasets", "message", *KERNEL},
}
MAX_MODULE_LINES = 550
EDGE = {"cli", "demo", "entry", "__main__", "__init__"}  # the application: wires everything


def _part(module: str) -> str:
    """`worker.jobs.ledger` -> `jobs`; `worker.settings` -> `settings`."""
    return module.split(".")[1] if "." in module else "__init__"


def test_no_module_outgrows_a_reading() -> None:
    """A module of 550 lines or more mixes parts that want a module each."""
    long = {
        str(path.relative_to(REPO)): lines
        for path in sorted((REPO / "worker").rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) >= MAX_MODULE_LINES
    }
    assert not long, long


def _imports(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "worker":
                modules += [f"worker.{alias.name}" for alias in node.names]
            else:
                modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
    return [module for module in modules if module.startswith("worker.")]


def test_each_part_imports_only_the_parts_beneath_it() -> None:
    sources = sorted((REPO / "worker").rglob("*.py"))
    parts_seen = set()
    broken = []
    for path in sources:
        relative = path.relative_to(REPO).with_suffix("")
        part = _part(".".join(relative.parts))
        parts_seen.add(part)
        if part in EDGE:
            continue
        assert part in MAY_IMPORT, f"{relative}: part {part!r} has no import rule"
        for module in _imports(path):
            imported = _part(module)
            if imported not in (part, "__version__") and imported not in MAY_IMPORT[part]:
                broken.append(f"{relative} ({part}) imports {module} ({imported})")
    assert not broken, "\n".join(broken)
    assert set(MAY_IMPORT) <= parts_seen, set(MAY_IMPORT) - parts_seen


def test_the_rule_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The check above reads imports as written: an engine module importing the jobs
    part is caught."""
    engine_module = tmp_path / "forbidden.py"
    engine_module.write_text("from worker.jobs.ledger import Job\nfrom worker import errors\n")
    assert [_part(module) for module in _imports(engine_module)] == ["jobs", "errors"]
    assert "jobs" not in MAY_IMPORT["engine"]
