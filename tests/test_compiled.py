"""`--compile`: the model compiled at the sizes its warm-up runs, a partial batch padded
up to the nearest (`worker.plugins.compiled`).

On the CPU the model is compiled by inductor for real (this machine's C++ compiler);
on a GPU (`make test-gpu`) each size is also captured in a CUDA graph and replayed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from stages.postprocess import top_k
from stages.preprocess import default_preprocessor
from stages.synthetic import samples
from tests.support.device_models import RowMeans
from tests.support.in_process import draining_settings, job_file, sample_images, send_job
from tests.support.markers import also_on_gpu
from worker.adapters.fakes import InMemoryBlobStore, InMemoryJobSource
from worker.daemon.shutdown import ExitCode
from worker.daemon.wiring import Daemon
from worker.plugins.compiled import CompiledModel, padded_size
from worker.plugins.setups import inference_setup

SHAPE = default_preprocessor.output_shape
ROW_MEANS = "tests.support.device_models:row_means"
DEFAULT = "stages.model:default_classifier"


def _images(count: int) -> torch.Tensor:
    batch = torch.empty((count, *SHAPE), dtype=torch.uint8)
    for row, (_, data) in zip(batch, samples(count, seed=11), strict=True):
        default_preprocessor(data, row)
    return batch


def test_a_batch_runs_at_the_smallest_compiled_size_that_holds_it() -> None:
    """Of the sizes 8, 4, 2 and 1: 3 items run at 4, 5 at 8, 8 at 8; 9 at none (the
    model then runs eagerly, at 9)."""
    sizes = [8, 4, 2, 1]
    assert [padded_size(count, sizes) for count in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert padded_size(9, sizes) is None
    assert padded_size(3, [8, 1]) == 8  # a size out of memory at warm-up is skipped


@pytest.mark.parametrize("device", also_on_gpu("cpu", "cuda"))
def test_a_partial_batch_is_padded_with_zeros_and_the_padding_s_answers_dropped(
    device: str,
) -> None:
    """Compiled at 4, 2 and 1, a batch of 3 runs as one of 4 (the model sees 4 rows),
    and only the 3 rows given come back, each its own; a batch of 6 runs eagerly. On a
    GPU every size is a CUDA graph."""
    on = torch.device(device)
    compiled = CompiledModel(RowMeans().to(on), on, SHAPE, [4, 2, 1])
    report = compiled.compile()
    assert report.out_of_memory == [] and report.seconds > 0
    assert compiled.sizes == [1, 2, 4]
    assert compiled.graphed == (on.type == "cuda")
    batch = torch.stack([torch.full(SHAPE, value, dtype=torch.uint8) for value in (5, 6, 7)])
    with torch.inference_mode():
        answers = compiled(batch.to(on)).cpu()
        larger = compiled(torch.ones((6, *SHAPE), dtype=torch.uint8, device=on)).cpu()
    assert answers.tolist() == [[5.0, 4.0], [6.0, 4.0], [7.0, 4.0]]
    assert larger.tolist() == [[1.0, 6.0]] * 6


@pytest.mark.parametrize("device", also_on_gpu("cpu", "cuda"))
def test_the_compiled_model_answers_as_the_eager_one_in_bfloat16(device: str) -> None:
    """The default model compiled (inductor; on a GPU also replayed from CUDA graphs),
    in bfloat16 and channels-last, gives the eager model's answers within bfloat16's
    rounding, and the same labels, for full and partial batches; its warm-up says it
    was compiled, how long that took, and at which sizes."""
    tuned = {"precision": "bfloat16", "channels_last": True, "batch_size": 8}
    compiled = inference_setup(DEFAULT, device, SHAPE, compile=True, **tuned)
    eager = inference_setup(DEFAULT, device, SHAPE, **tuned)
    warm_up = compiled.about["warm_up"]
    assert warm_up["compiled"] is True and warm_up["batch_sizes"] == [8, 4, 2, 1]
    assert 0 < warm_up["compile_s"] <= warm_up["seconds"]
    assert eager.about["warm_up"]["compiled"] is False
    assert eager.about["warm_up"]["compile_s"] == 0
    for count in (8, 5):
        batch = _images(count)
        fast = np.stack(compiled.run(batch, [None] * count))
        plain = np.stack(eager.run(batch, [None] * count))
        assert fast.shape == plain.shape == (count, 4)
        assert np.allclose(fast, plain, atol=0.02)
        labels = [top_k(row, {})["label"] for row in fast]
        assert labels == [top_k(row, {})["label"] for row in plain]


def test_compile_reaches_the_model_and_model_ready_says_how_long_it_took(tmp_path: Path) -> None:
    """`--compile`: the daemon's model is compiled before the first receive, and
    model_ready's warm-up and job.json's worker say so and how long compiling took.
    Batches of one: a single compile (any larger size adds a dynamic one, seconds more
    of a C++ compiler here)."""
    source, blobs = InMemoryJobSource(), InMemoryBlobStore()
    send_job(source, "one", sample_images(blobs, 2))
    settings = draining_settings(tmp_path, model=ROW_MEANS, batch_size=1, compile=True)
    with capture_logs() as logs:
        assert Daemon(settings, source, blobs).run() is ExitCode.DRAINED
    events = [event["event"] for event in logs]
    assert events.index("model_ready") < events.index("job_received")
    ready = next(event for event in logs if event["event"] == "model_ready")
    assert ready["warm_up"]["compiled"] is True and ready["warm_up"]["compile_s"] > 0
    assert len(job_file(blobs, "one", "results.jsonl")) == 2
    worker = job_file(blobs, "one", "job.json")["worker"]
    assert worker["compile_s"] == round(ready["warm_up"]["compile_s"], 3) > 0
    assert worker["warm_up_s"] >= worker["compile_s"]
