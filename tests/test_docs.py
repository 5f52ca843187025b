"""The README holds: what it names exists, and `make demo` runs as it says."""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import build_parser as gpu_bench_parser
from tests.conftest import REPO
from worker.cli import build_parser
from worker.demo import DEMO_SMALL_JOB_IMAGES, DEMO_SMALL_JOBS, LOCAL_AWS_ENV

README = (REPO / "README.md").read_text()
# Paths the README names that a run creates, not the repository.
GENERATED = ("bench-out/", "demo-out/", "--log-dir/")
TOP_LEVEL = {path.name for path in REPO.iterdir()}


def _backticked() -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", README))


def test_every_file_the_readme_names_exists() -> None:
    """Paths in backticks and link targets, within the repository."""
    named = {token for token in _backticked() if token.split("/")[0] in TOP_LEVEL}
    named |= set(re.findall(r"\]\(((?!https?:)[^)#]+)\)", README))
    assert len(named) > 20
    missing = [
        path
        for path in named
        if not path.startswith(GENERATED) and not (REPO / path.split("::")[0]).exists()
    ]
    assert not missing


def test_every_test_the_readme_cites_exists() -> None:
    """The failure table cites a test for each row: each is a test function."""
    defined = set()
    for module in (REPO / "tests").glob("test_*.py"):
        tree = ast.parse(module.read_text())
        defined |= {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    cited = {name for name in re.findall(r"`(test_\w+)", README)}
    assert len(cited) > 10
    assert cited <= defined, cited - defined


def test_every_command_flag_and_reference_the_readme_names_exists() -> None:
    """`make` targets, `python -m worker` subcommands and modules, every `--flag` (the
    worker's own, `python -m bench.gpu`'s, or `docker run`'s as infra/worker.yaml uses
    them) and every
    `module:attribute` reference."""
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    assert set(re.findall(r"`make ([\w-]+)`", README)) <= targets

    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command in re.findall(r"python -m worker ([a-z]+)", README):
        assert command in commands.choices, command
    for module in re.findall(r"python -m ([a-z_]+\.[a-z_.]+)", README):
        assert importlib.util.find_spec(module), module

    flags = {flag for sub in commands.choices.values() for flag in sub._option_string_actions}
    flags |= set(gpu_bench_parser()._option_string_actions)
    template = (REPO / "infra" / "worker.yaml").read_text()
    commands_shown = [
        line.partition("python -m worker")[2]
        for line in README.replace("\\\n", " ").splitlines()
        if "python -m worker" in line
    ]
    named = " ".join([*_backticked(), *commands_shown])
    for flag in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", named)):
        assert flag in flags or f" {flag} " in template, flag

    references = {t for t in _backticked() if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+:\w+", t)}
    assert references
    for reference in references:
        module, _, attribute = reference.partition(":")
        assert hasattr(importlib.import_module(module), attribute), reference


@pytest.mark.e2e
def test_make_demo_runs_end_to_end(tmp_path: Path) -> None:
    """`make demo`'s command with the fewest images: a moto server of its own, seven
    jobs, each succeeded and copied out, the default model right on nearly all."""
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
        if line.split() and line.split()[0] in {*DEMO_SMALL_JOBS, "large"}
    }
    assert set(rows) == {*DEMO_SMALL_JOBS, "large"}
    for job, (_, status, _items, failed, correct, *_) in rows.items():
        assert (status, failed) == ("succeeded", "0"), job
        assert float(correct.rstrip("%")) >= 90, job
        for name in ("results.jsonl", "job.log", "job.json"):
            assert (out / "results" / job / name).is_file()
    assert DEMO_SMALL_JOB_IMAGES == 61 and rows["large"][2] == "61"
