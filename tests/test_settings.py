"""Settings: validated at start-up, from flags, environment and defaults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.support.paths import REPO
from worker.cli import build_parser, settings_from_flags
from worker.plugins import loading
from worker.plugins.loading import inference_devices
from worker.settings import Settings


def test_defaults_are_valid() -> None:
    """Only the queue URL is required."""
    settings = Settings(queue_url="https://sqs/q")
    assert (
        settings.batch_size == 64
        and settings.heartbeat_interval_seconds * 2 <= settings.visibility_timeout_seconds
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"heartbeat_interval_seconds": 40, "visibility_timeout_seconds": 60}, "at most half"),
        ({"receive_batch": 11}, "less than or equal to 10"),
        ({"receive_batch": 0}, "greater than or equal to 1"),
        ({"receive_wait_seconds": 21}, "less than or equal to 20"),
        ({"visibility_timeout_seconds": 43201}, "less than or equal to 43200"),
        ({"batch_size": 0}, "greater than or equal to 1"),
        ({"no_such_setting": 1}, "Extra inputs"),
    ],
)
def test_bad_settings_are_refused(fields: dict[str, object], message: str) -> None:
    """Lease geometry and SQS limits are checked once, with a readable message."""
    with pytest.raises(ValidationError, match=message):
        Settings(queue_url="q", **fields)  # type: ignore[arg-type]


def test_flags_beat_environment_beat_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag overrides its environment variable, which overrides the default."""
    monkeypatch.setenv("WORKER_QUEUE_URL", "from-env")
    monkeypatch.setenv("WORKER_BATCH_SIZE", "8")
    monkeypatch.setenv("WORKER_ALLOWED_BUCKETS", "a, b")
    args = build_parser().parse_args(["run", "--batch-size", "16", "--drain"])
    settings = settings_from_flags(args)
    assert (settings.queue_url, settings.batch_size, settings.drain) == ("from-env", 16, True)
    assert settings.allowed_buckets == frozenset({"a", "b"})
    assert settings.max_jobs == Settings.model_fields["max_jobs"].default


def test_cli_reports_invalid_settings_and_exits_2() -> None:
    """`run` with a bad setting names the flag and exits 2 before touching AWS."""
    result = subprocess.run(
        [sys.executable, "-m", "worker", "run", "--queue-url", "q", "--receive-batch", "50"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 2
    assert "--receive-batch" in result.stderr and "less than or equal to 10" in result.stderr


def test_help_lists_every_setting_with_its_environment_variable() -> None:
    """`run --help` documents each setting, its default and its variable."""
    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in text
        assert f"WORKER_{name.upper()}" in text


def test_fifo_queues_are_refused_at_start() -> None:
    """A FIFO queue (or DLQ) is refused with the reason, not half-supported: message
    groups would block behind jobs that finish out of order or are released with delays."""
    for fields in ({"queue_url": "q.fifo"}, {"queue_url": "q", "dlq_url": "dead.fifo"}):
        with pytest.raises(ValidationError, match="FIFO queues are not supported"):
            Settings(**fields)


def test_the_grace_period_is_derived_from_the_stop_timeout_and_checked_against_it() -> None:
    """Between SIGTERM and SIGKILL the daemon needs its grace, its shutdown's tail (a
    long poll's wait, at least 10 s) and 10 s to exit: the grace defaults to what is
    left, and one that does not fit is refused rather than cut short by SIGKILL."""
    assert Settings(queue_url="q", stop_timeout_seconds=120).grace_seconds == 90
    short_polls = Settings(queue_url="q", stop_timeout_seconds=60, receive_wait_seconds=5)
    assert short_polls.grace_seconds == 40
    assert Settings(queue_url="q", stop_timeout_seconds=60, grace_seconds=30).grace_seconds == 30
    with pytest.raises(ValidationError, match="does not fit in stop_timeout_seconds"):
        Settings(queue_url="q", stop_timeout_seconds=60, grace_seconds=31)
    assert Settings(queue_url="q").grace_seconds == 90  # no stop timeout known


def test_devices_are_a_list_of_torch_devices_or_auto() -> None:
    """One inference process per device named; a malformed list is refused at start."""
    assert Settings(queue_url="q", device="cuda:0, cuda:2").device == "cuda:0,cuda:2"
    assert inference_devices("cpu,cpu") == ["cpu", "cpu"]
    with pytest.raises(ValidationError, match="comma-separated"):
        Settings(queue_url="q", device="gpu 0")


@pytest.mark.parametrize("sign", [None, "proc/0000:01:00.0", "dev/nvidia0", "dev/dxg", "dev/kfd"])
def test_auto_devices_ask_torch_wherever_there_is_a_sign_of_a_gpu(
    sign: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--device auto` imports torch to count GPUs where the host shows any sign of one
    (the NVIDIA driver's list, NVIDIA's device files, WSL2's /dev/dxg, ROCm's /dev/kfd),
    and is the CPU without importing it where there is none."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()  # no GPU of its own
    if sign is not None:
        (tmp_path / sign).touch()
    monkeypatch.setattr(loading, "NVIDIA_GPUS", tmp_path / "proc")
    monkeypatch.setattr(loading, "DEVICE_FILES", tmp_path / "dev")
    asked: list[str] = []

    def two_gpus() -> int:
        asked.append("torch")
        return 2

    monkeypatch.setattr(loading, "visible_gpus", two_gpus)
    if sign is None:
        assert (inference_devices("auto"), asked) == (["cpu"], [])
    else:
        assert (inference_devices("auto"), asked) == (["cuda:0", "cuda:1"], ["torch"])
