"""The docs hold: what the README and every page under docs/ name exists, the lifecycle
and failure tables say what the ledger does, docs/settings.md is what the settings model
renders, and `make demo` runs as the README says.

After changing a setting, write docs/settings.md again: `python -m tests.test_docs`.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic.fields import FieldInfo

from bench.fleet import build_parser as fleet_bench_parser
from bench.gpu import build_parser as gpu_bench_parser
from bench.tables import build_parser as tables_bench_parser
from bench.texts_fleet import build_parser as texts_fleet_bench_parser
from tests.support.paths import REPO, TEMPLATE
from worker.cli import build_parser
from worker.demo import DEMO_SMALL_JOB_IMAGES, DEMO_SMALL_JOBS, DEMO_TEXT_JOB, LOCAL_AWS_ENV
from worker.jobs.job import TRANSITIONS, JobState
from worker.jobs.ledger import Ledger
from worker.settings import Settings

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SETTINGS_PAGE = REPO / "docs" / "settings.md"
# Paths the pages name that a run creates, not the repository.
GENERATED = ("bench-out/", "demo-out/", "--log-dir/")
TOP_LEVEL = {path.name for path in REPO.iterdir()}
LIFECYCLE_HEADER = "| from | to | method | when |"
FAILURE_HEADER = "| fault | what happens | decided in | proven by |"
# What the failure table's "what happens" says in bold besides the ledger's states.
OUTCOMES_BESIDES_STATES = {"item error", "worker stops"}
NOT_PROVEN_YET = "none yet"
REFERENCE = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+:[A-Za-z_][\w.]*")


def _text(page: Path) -> str:
    return page.read_text()


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _text(page), re.MULTILINE)}


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the table that starts with `header`."""
    lines = text.splitlines()
    start = lines.index(header) + 2  # past the header and its separator
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _unresolved(references: list[str]) -> list[str]:
    """Those of the `package.module:Class.attribute` references that name nothing."""
    missing = []
    for reference in references:
        module, _, path = reference.partition(":")
        try:
            functools.reduce(getattr, path.split("."), importlib.import_module(module))
        except (ImportError, AttributeError):
            missing.append(reference)
    return missing


@functools.cache
def _defined_tests() -> frozenset[str]:
    """Every test function under tests/, wherever it lives (files move; names stay)."""
    names: set[str] = set()
    for module in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return frozenset(names)


@functools.cache
def _commands() -> dict[str, argparse.ArgumentParser]:
    """`python -m worker`'s subcommands, by name."""
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


@functools.cache
def _flags() -> frozenset[str]:
    """The worker's flags, `python -m bench.gpu`'s, `bench.fleet`'s, `bench.tables`' and
    `bench.texts_fleet`'s, and `docker run`'s as the stack uses them."""
    flags = {flag for sub in _commands().values() for flag in sub._option_string_actions}
    flags |= set(gpu_bench_parser()._option_string_actions)
    flags |= set(fleet_bench_parser()._option_string_actions)
    flags |= set(tables_bench_parser()._option_string_actions)
    flags |= set(texts_fleet_bench_parser()._option_string_actions)
    flags |= set(re.findall(r"(?<= )(--[a-z][a-z0-9-]+)(?= )", TEMPLATE.read_text()))
    return frozenset(flags)


each_page = pytest.mark.parametrize("page", PAGES, ids=_name)


def test_the_readme_links_every_page() -> None:
    """A reader finds every page from the front page."""
    readme = _text(REPO / "README.md")
    assert [_name(p) for p in PAGES if f"]({_name(p)})" not in readme] == ["README.md"]


@each_page
def test_every_file_and_link_a_page_names_exists(page: Path) -> None:
    """Paths in backticks (from the repository's root) and link targets (from the page),
    with the heading an anchor names."""
    text = _text(page)
    named = [t for t in _backticked(text) if t.split("/")[0] in TOP_LEVEL]
    missing = [
        path
        for path in named
        if not path.startswith(GENERATED) and not (REPO / path.split("::")[0]).exists()
    ]
    for link in re.findall(r"\]\(((?![a-z]+:)[^)\s]+)\)", text):
        target, _, anchor = link.partition("#")
        linked = (page.parent / target).resolve() if target else page
        if not linked.exists() or (anchor and anchor not in _anchors(linked)):
            missing.append(link)
    assert not missing, missing


@each_page
def test_every_test_a_page_cites_exists(page: Path) -> None:
    """A test cited by name is a test function somewhere under tests/."""
    cited = {name for name in re.findall(r"`(test_\w+)`", _text(page))}
    assert cited <= _defined_tests(), sorted(cited - _defined_tests())


@each_page
def test_every_command_flag_and_reference_a_page_names_exists(page: Path) -> None:
    """`make` targets, `python -m worker` subcommands and other modules, every `--flag`,
    and every `module:attribute` reference."""
    text = _text(page)
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
    assert set(re.findall(r"(?:`|^ +)make ([\w-]+)", text, re.MULTILINE)) <= targets
    assert set(re.findall(r"python -m worker ([a-z]+)", text)) <= set(_commands())
    for module in re.findall(r"python -m ([a-z_]+\.[a-z_.]+)", text):
        assert importlib.util.find_spec(module), module

    commands_shown = [
        line.partition("python -m worker")[2]
        for line in text.replace("\\\n", " ").splitlines()
        if "python -m worker" in line
    ]
    named = " ".join([*_backticked(text), *commands_shown])
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", named))
    assert flags <= _flags(), sorted(flags - _flags())

    unresolved = _unresolved([t for t in _backticked(text) if REFERENCE.fullmatch(t)])
    assert not unresolved, unresolved


def test_the_lifecycle_is_written_once_and_is_the_ledgers() -> None:
    """docs/jobs.md's table of moves is exactly `TRANSITIONS`, each by a `Ledger`
    method, and no other page has such a table."""
    assert [_name(p) for p in PAGES if LIFECYCLE_HEADER in _text(p)] == ["docs/jobs.md"]
    moves = set()
    for before, after, method, _when in _table(_text(REPO / "docs/jobs.md"), LIFECYCLE_HEADER):
        assert callable(getattr(Ledger, method.strip("`"))), method
        for state in before.split(","):
            moves.add((JobState(state.strip(" `")), JobState(after.strip("`"))))
    assert moves == {(state, after) for state, nexts in TRANSITIONS.items() for after in nexts}


def test_the_failure_table_names_real_states_code_and_tests() -> None:
    """One failure table, in docs/failures.md: each row's outcome is one of the ledger's
    states (or an item's error, or the worker stopping), every settled state is some
    fault's outcome, and what decides it and the tests that prove it exist."""
    assert [_name(p) for p in PAGES if FAILURE_HEADER in _text(p)] == ["docs/failures.md"]
    outcomes: set[str] = set()
    references: list[str] = []
    tests: set[str] = set()
    for fault, happens, decided_in, proven_by in _table(
        _text(REPO / "docs/failures.md"), FAILURE_HEADER
    ):
        named = set(re.findall(r"\*\*([^*]+)\*\*", happens))
        deciders = re.findall(r"`([^`]+)`", decided_in)
        provers = set(re.findall(r"`(test_\w+)`", proven_by))
        assert named and deciders and (provers or proven_by == NOT_PROVEN_YET), fault
        assert all(REFERENCE.fullmatch(r) for r in deciders), deciders
        outcomes, references, tests = outcomes | named, references + deciders, tests | provers
    assert not _unresolved(references), _unresolved(references)
    assert tests <= _defined_tests(), sorted(tests - _defined_tests())
    states = {str(state) for state in JobState}
    assert outcomes <= states | OUTCOMES_BESIDES_STATES, outcomes - states
    settled = states - {str(state) for state in TRANSITIONS}  # no move out of them
    assert settled <= outcomes, settled - outcomes


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value: Any = field.default
    if value is None:
        return "—"
    if isinstance(value, frozenset):
        value = ",".join(sorted(value)) or "any"
    return f"`{value}`"


def render_settings() -> str:
    """docs/settings.md, from the settings model."""
    prefix = Settings.model_config.get("env_prefix", "")
    lines = [
        "# Settings",
        "",
        "<!-- Written by `python -m tests.test_docs` from `worker/settings.py`:"
        " edit the descriptions there. -->",
        "",
        "Every setting is a flag of `python -m worker run` and an environment variable; a",
        "flag wins over the environment, which wins over the default. They are validated",
        "once at start-up (for example, the heartbeat interval must be at most half the",
        "visibility timeout, the receive batch 1 to 10, the long-poll wait at most 20 s) and a",
        "bad one exits 2 naming the flag. `run --help` lists them too.",
        "",
        "| flag | environment | default | what it does |",
        "| --- | --- | --- | --- |",
    ]
    for name, field in Settings.model_fields.items():
        flag, env = "--" + name.replace("_", "-"), f"{prefix}{name.upper()}"
        lines.append(f"| `{flag}` | `{env}` | {_default(field)} | {field.description} |")
    return "\n".join(lines) + "\n"


def test_the_settings_page_is_what_the_settings_render() -> None:
    """docs/settings.md is never edited by hand: it is the settings model, rendered."""
    assert SETTINGS_PAGE.read_text() == render_settings(), (
        "docs/settings.md is out of date: write it again with `python -m tests.test_docs`"
    )


@pytest.mark.e2e
def test_make_demo_runs_end_to_end(tmp_path: Path) -> None:
    """`make demo`'s command with the fewest images: a moto server of its own, seven
    image jobs and a text job, each succeeded and copied out, the default model and
    the text model right on nearly all."""
    out = tmp_path / "demo-out"
    demo = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--out", str(out), "--images", "61"],
        check=False,
        cwd=REPO,
        env={**os.environ, **LOCAL_AWS_ENV},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    rows = {
        line.split()[0]: line.split()
        for line in demo.stdout.splitlines()
        if line.split() and line.split()[0] in {*DEMO_SMALL_JOBS, "large", DEMO_TEXT_JOB}
    }
    assert set(rows) == {*DEMO_SMALL_JOBS, "large", DEMO_TEXT_JOB}
    for job, (_, status, _items, failed, correct, *_) in rows.items():
        assert (status, failed) == ("succeeded", "0"), job
        assert float(correct.rstrip("%")) >= 90, job
        for name in ("results.jsonl", "job.log", "job.json"):
            assert (out / "results" / job / name).is_file()
    assert DEMO_SMALL_JOB_IMAGES == 61 and rows["large"][2] == "61"


if __name__ == "__main__":
    SETTINGS_PAGE.write_text(render_settings())
    print(f"wrote {SETTINGS_PAGE.relative_to(REPO)}")
