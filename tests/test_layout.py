"""The parts of `worker` and which may import which, written down once and checked.

The engine is generic (it moves items through stages and knows nothing of jobs, AWS or
plug-ins); the adapters are thin (they make the ports real and know nothing of jobs,
the daemon or pipelines); the plug-ins' contract rests on the engine alone. The job
loops and the daemon sit on top; the command line (`cli`, `demo`, `entry`, `__main__`) wires the
adapters in and may import anything.
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
    "engine": {"errors"},
    "adapters": KERNEL,
    "plugins": {"engine", "errors", "ports"},
    "telemetry": {"errors", "ports"},
    "settings": {"plugins", "ports", "retry"},
    "jobs": {"engine", "plugins", "telemetry", "settings", *KERNEL},
    "daemon": {"engine", "jobs", "plugins", "telemetry", "settings", *KERNEL},
    # A producer's side of the jobs' contract (the message, the outputs), over AWS.
    "client": {"adapters", "jobs", *KERNEL},
}
EDGE = {"cli", "demo", "entry", "__main__", "__init__"}  # the application: wires everything


def _part(module: str) -> str:
    """`worker.jobs.ledger` -> `jobs`; `worker.settings` -> `settings`."""
    return module.split(".")[1] if "." in module else "__init__"


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
