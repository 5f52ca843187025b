"""Loading the model, preprocessor and postprocessor a user names."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stages.model import default_classifier
from stages.postprocess import top_k
from stages.preprocess import default_preprocessor
from stages.synthetic import LABELS, samples
from tests.support.markers import also_on_gpu
from tests.support.stagefns import SizeRecorder
from worker.daemon import stages as daemon_stages
from worker.engine import ItemError, bisection_sizes
from worker.plugins import PluginError, setups
from worker.plugins.encoding import encoded_fields
from worker.plugins.identity import identify
from worker.plugins.loading import load_model, load_postprocessor, load_preprocessor
from worker.plugins.setups import inference_setup, preprocess_setup

SHAPE = default_preprocessor.output_shape


def _batch(count: int) -> tuple[torch.Tensor, list[str]]:
    batch = torch.empty((count, *default_preprocessor.output_shape), dtype=torch.uint8)
    labels = []
    for number, (label, data) in enumerate(samples(count, seed=21)):
        default_preprocessor(data, batch[number])
        labels.append(label)
    return batch, labels


def _save_torchscript(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated in 2.13
        torch.jit.script(default_classifier()).save(str(path))


def _save_export(path: Path) -> None:
    example = (torch.zeros((2, *default_preprocessor.output_shape), dtype=torch.uint8),)
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(default_classifier(), example, dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))


@pytest.mark.parametrize(
    ("name", "save"), [("shapes.pt", _save_torchscript), ("shapes.pt2", _save_export)]
)
def test_model_files_give_the_same_answers_as_the_factory(
    tmp_path: Path, name: str, save: Callable[[Path], None]
) -> None:
    """`--model path.pt` (TorchScript), `--model path.pt2` (torch.export) and
    `--model module:factory` answer alike."""
    path = tmp_path / name
    save(path)
    batch, labels = _batch(16)
    from_file = inference_setup(str(path), "cpu", SHAPE).run(batch, [None] * 16)
    from_factory = inference_setup("stages.model:default_classifier", "cpu", SHAPE).run(
        batch, [None] * 16
    )
    assert np.allclose(np.stack(from_file), np.stack(from_factory), atol=1e-5)
    predicted = [top_k(row, {})["label"] for row in from_file]
    assert sum(p == t for p, t in zip(predicted, labels, strict=True)) >= 15
    assert set(predicted) <= set(LABELS)


def test_a_model_is_identified_by_its_weights_and_named_as_asked(tmp_path: Path) -> None:
    """The digest is the file's sha256, or the state dict's; it changes with any weight
    and not with a fresh load of the same ones. Name and version default to the
    module's attributes, then to the reference and the digest; settings override them."""
    factory = "stages.model:default_classifier"
    shipped = identify(factory, default_classifier(), None, None)
    assert shipped == identify(factory, default_classifier(), None, None)
    assert shipped.name == "shapes-cnn"  # the Classifier's model_name
    assert shipped.version == shipped.digest.removeprefix("sha256:")[:12]
    retrained = default_classifier()
    with torch.no_grad():
        retrained.net.head.bias[0] += 1e-3
    assert identify(factory, retrained, None, None).digest != shipped.digest

    path = tmp_path / "shapes.pt"
    _save_torchscript(path)
    loaded = load_model(str(path), torch.device("cpu"))
    from_file = identify(str(path), loaded, None, None)
    assert from_file.digest == f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    assert from_file.name == "shapes.pt"
    named = identify(str(path), loaded, "resnet50", "2026-11")
    assert (named.name, named.version, named.label) == ("resnet50", "2026-11", "resnet50@2026-11")


def test_the_model_is_warmed_up_at_every_size_bisection_falls_back_to() -> None:
    """Bisecting n items calls the model with halves, rounded both ways, down to 1; the
    set-up runs each of those sizes once and reports them with the model's identity."""
    assert bisection_sizes(64) == [64, 32, 16, 8, 4, 2, 1]
    assert bisection_sizes(48) == [48, 24, 12, 6, 3, 2, 1]
    assert bisection_sizes(5) == [5, 3, 2, 1]
    assert bisection_sizes(1) == [1]
    SizeRecorder.sizes.clear()
    about = inference_setup(
        "tests.support.stagefns:SizeRecorder", "cpu", SHAPE, batch_size=6, model_version="7"
    ).about
    assert SizeRecorder.sizes == [1, 6, 3, 2, 1]  # the probe, then the warm-up
    assert about["warm_up"]["batch_sizes"] == [6, 3, 2, 1]
    assert (
        about["model"]
        == identify("tests.support.stagefns:SizeRecorder", SizeRecorder(), None, "7").as_dict()
    )


def test_a_warm_up_size_out_of_memory_is_noted_and_any_other_failure_stops_the_start() -> None:
    """Out of memory over 8 images: the start goes on (the stage bisects and lowers its
    batch size at run time, as for any batch). A model that raises otherwise on a full
    batch of zeros does not start, and the error says to lower the batch size."""
    about = inference_setup(
        "tests.support.faults:fragile_classifier", "cpu", SHAPE, batch_size=32
    ).about
    assert about["warm_up"]["out_of_memory"] == [32, 16]
    with pytest.raises(
        PluginError, match=r"batch of 2 zeros.*lower the batch size to what it takes \(--batch-size"
    ):
        inference_setup("tests.support.stagefns:one_at_a_time", "cpu", SHAPE, batch_size=2)


@pytest.mark.parametrize("device", also_on_gpu("cpu", "cuda"))
def test_bfloat16_and_channels_last_are_applied_and_keep_the_answers(device: str) -> None:
    """`--precision bfloat16 --channels-last` reach the model (probed), and the default
    model's answers stay those of float32."""
    batch = torch.zeros(2, 3, 8, 8, dtype=torch.uint8)
    probe = inference_setup("tests.support.stagefns:LayoutProbe", device, (3, 8, 8))
    assert np.stack(probe.run(batch, [None] * 2)).tolist() == [[0.0, 0.0, 0.0]] * 2
    tuned = inference_setup(
        "tests.support.stagefns:LayoutProbe",
        device,
        (3, 8, 8),
        precision="bfloat16",
        channels_last=True,
    )
    assert np.stack(tuned.run(batch, [None] * 2)).tolist() == [[1.0, 1.0, 1.0]] * 2
    batch, _ = _batch(16)
    default = "stages.model:default_classifier"
    plain = inference_setup(default, device, SHAPE).run(batch, [None] * 16)
    fast = inference_setup(default, device, SHAPE, precision="bfloat16", channels_last=True).run(
        batch, [None] * 16
    )
    assert [top_k(row, {})["label"] for row in fast] == [top_k(row, {})["label"] for row in plain]
    assert np.allclose(np.stack(fast), np.stack(plain), atol=0.05)


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("stages.model", "module:attribute"),
        ("no_such_module:x", "cannot import"),
        ("stages.model:nope", "no attribute"),
        ("/missing/model.pt", "does not exist"),
        ("stages.postprocess:DEFAULT_TOP_K", "not callable"),
    ],
)
def test_bad_model_references_are_explained(reference: str, message: str) -> None:
    """A model reference that cannot be loaded fails with what is wrong."""
    with pytest.raises(PluginError, match=message):
        inference_setup(reference, "cpu", SHAPE)


def test_a_model_that_fails_on_zeros_does_not_start() -> None:
    """The model's probe is a batch of zeros, run once at start: a model that raises on
    it is broken (or cannot be told from broken), and the daemon says so at start."""
    with pytest.raises(PluginError, match="fails on a batch of zeros"):
        inference_setup("tests.support.faults:broken_classifier", "cpu", SHAPE)
    stage_fn = inference_setup("stages.model:default_classifier", "cpu", SHAPE)
    assert stage_fn.probe is not None
    stage_fn.probe()


def test_a_preprocessor_is_probed_with_its_samples() -> None:
    """The default preprocessor decodes its own JPEG and PNG samples at start (a missing
    codec stops the start); one without samples has no probe."""
    stage_fn = preprocess_setup("stages.preprocess:default_preprocessor")
    assert stage_fn.probe is not None and len(default_preprocessor.samples) == 2
    stage_fn.probe()
    with pytest.raises(PluginError, match="cannot decode its own samples"):
        preprocess_setup("tests.support.faults:codecless_preprocessor")
    assert preprocess_setup("tests.support.faults:faulty_preprocessor").probe is not None


def test_preprocessor_and_postprocessor_are_checked() -> None:
    """The preprocessor must declare its output shape; the postprocessor be callable."""
    assert load_preprocessor("stages.preprocess:default_preprocessor").output_shape == (3, 64, 64)
    with pytest.raises(PluginError, match="output_shape"):
        load_preprocessor("stages.postprocess:top_k")
    with pytest.raises(PluginError, match="not callable"):
        load_postprocessor("stages.postprocess:DEFAULT_TOP_K")


def test_top_k_rejects_bad_params() -> None:
    """`params.top_k` must be a positive integer."""
    assert len(top_k([0.1, 0.7, 0.2, 0.0], {"top_k": 2})["topk"]) == 2
    with pytest.raises(ValueError, match="top_k"):
        top_k([0.1, 0.9], {"top_k": "2"})


def test_the_model_process_postprocesses_each_output_on_its_own() -> None:
    """Given the postprocessor, the inference function gives each item the encoded
    fields the daemon would have made of its raw output, or, where the postprocessor
    fails on it (one job's bad params), that item's error: the batch's others are whole."""
    batch, _ = _batch(4)
    raw = inference_setup("stages.model:default_classifier", "cpu", SHAPE).run(batch, [None] * 4)
    stage_fn = inference_setup(
        "stages.model:default_classifier", "cpu", SHAPE, postprocess="stages.postprocess:top_k"
    )
    params: list[dict[str, Any]] = [{"top_k": 2}, {"top_k": 0}, {}, {"top_k": 5}]
    values = [(None, p) for p in params]
    assert stage_fn.finish is not None
    encoded = stage_fn.finish(stage_fn.run(batch, values), values)
    for position in (0, 2, 3):
        line = json.loads(b'{"index": 7' + encoded[position] + b"}")
        assert line == {"index": 7, **top_k(raw[position], params[position])}
    error = encoded[1]
    assert isinstance(error, ItemError) and not error.transient
    assert (error.stage, error.type) == ("postprocess", "ValueError") and "top_k" in error.message


def test_encoded_fields_keep_out_of_the_lines_own_fields() -> None:
    """A postprocessor gives a dict whose fields go between `input` and `model`: none of
    results.jsonl's own, and none at all is an empty fragment."""
    assert encoded_fields(lambda output, _: {"sum": sum(output)}, [1, 2], {}) == b',"sum":3'
    assert encoded_fields(lambda *_: {}, None, {}) == b""
    with pytest.raises(ValueError, match="index, model"):
        encoded_fields(lambda *_: {"model": "mine", "index": 3, "ok": 1}, None, {})
    with pytest.raises(TypeError, match="not a dict"):
        encoded_fields(lambda *_: [1], None, {})


def test_a_models_answer_is_its_own_even_as_a_view_of_its_input() -> None:
    """A model may answer with a view of the batch it was given (on the CPU, the reused
    buffer the next batch is gathered into while this one is postprocessed): its rows
    are copied, so the next batch cannot change them."""
    batch, _ = _batch(3)
    rows = inference_setup("tests.support.stagefns:echo_model", "cpu", SHAPE).run(batch, [None] * 3)
    expected = [row.copy() for row in rows]
    batch.fill_(7)
    assert all((row == before).all() for row, before in zip(rows, expected, strict=True))


def test_a_postprocessor_that_fails_on_the_answer_to_zeros_does_not_start() -> None:
    """The postprocessor is tried on the model's answer to a batch of zeros with no
    params at start: one that fails there (a missing library) stops the start, and the
    same check later tells a broken postprocessor from inputs that it fails on."""
    with pytest.raises(PluginError, match="fails on the model's answer to a batch of zeros"):
        inference_setup(
            "stages.model:default_classifier",
            "cpu",
            SHAPE,
            postprocess="tests.support.stagefns:needs_params",
        )
    stage_fn = inference_setup(
        "stages.model:default_classifier", "cpu", SHAPE, postprocess="stages.postprocess:top_k"
    )
    assert stage_fn.finish_probe is not None
    stage_fn.finish_probe()


def test_every_set_up_the_daemon_names_is_one_of_the_set_ups() -> None:
    """The daemon names its stages' set-ups (`set_up("preprocess_setup", ...)`), never
    importing them: a name that is none would fail only as a stage's process starts."""
    calls = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(daemon_stages)))
        if isinstance(node, ast.Call) and len(node.args) >= 2
    ]
    named = {
        call.args[1].value
        for call in calls
        if isinstance(call.args[0], ast.Name)
        and call.args[0].id == daemon_stages.set_up.__name__
        and isinstance(call.args[1], ast.Constant)
    }
    assert named == {"preprocess_setup", "fan_out_setup", "inference_setup"}
    assert all(callable(getattr(setups, name, None)) for name in named)
