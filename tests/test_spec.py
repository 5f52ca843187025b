"""Pipeline specs: one model from the flags, or a chain of models from a TOML file."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.support.paths import REPO
from worker.plugins import PluginError
from worker.plugins.identity import ModelIdentity, pipeline_identity
from worker.plugins.loading import load_fan_out
from worker.plugins.spec import FanOutStep, ModelStep, PipelineSpec
from worker.settings import Settings

BOARDS = REPO / "stages" / "boards.toml"
QUEUE = "https://sqs/q"


def test_the_shipped_chain_reads_as_a_model_a_fan_out_and_a_model() -> None:
    spec = Settings(queue_url=QUEUE, pipeline=str(BOARDS)).pipeline_spec()
    assert (spec.name, spec.version) == ("shape-boards", "1")
    assert spec.model_stage_names() == ["inference-1", "inference-2"]
    assert [model.batch_size for model in spec.models] == [32, 64]
    assert spec.fan_out == FanOutStep(fan_out="stages.boards:found_tiles", max_parts=4)
    assert load_fan_out(spec.fan_out.fan_out).output_shape == (3, 64, 64)


def test_without_a_spec_the_flags_are_the_one_model() -> None:
    spec = Settings(queue_url=QUEUE, batch_size=8, model_version="2").pipeline_spec()
    (step,) = spec.steps
    assert isinstance(step, ModelStep)
    assert (step.model, step.batch_size, step.version) == (
        "stages.model:default_classifier",
        8,
        "2",
    )
    assert spec.model_stage_names() == ["inference"] and spec.fan_out is None


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return str(path)


HEAD = 'name = "chain"\npreprocess = "p:p"\npostprocess = "q:q"\n'
MODEL = '[[steps]]\nmodel = "m:m"\n'
FAN_OUT = '[[steps]]\nfan_out = "f:f"\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEAD + FAN_OUT, "steps are fan_out: a pipeline is one model, or a model, a fan-out"),
        (HEAD + MODEL + MODEL, "steps are model -> model"),
        (HEAD + MODEL + FAN_OUT, "steps are model -> fan_out:"),
        (HEAD.replace('name = "chain"\n', "") + MODEL + FAN_OUT + MODEL, "needs a name"),
        (HEAD + MODEL + "batch_sise = 3\n", "batch_sise"),
        (HEAD + MODEL.replace('"m:m"', '"m:m"\nbatch_size = 0'), "greater than or equal to 1"),
        (HEAD + MODEL.replace('"m:m"', '"m:m"\ndevice = "gpu 0"'), "give auto, or torch devices"),
        (HEAD + "[[steps]\n", "is not TOML"),
    ],
)
def test_a_bad_spec_is_refused_with_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(queue_url=QUEUE, pipeline=_write(tmp_path, text))


def test_a_spec_and_the_flags_it_replaces_are_not_both_given(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="cannot read the pipeline spec"):
        Settings(queue_url=QUEUE, pipeline=str(tmp_path / "missing.toml"))
    with pytest.raises(ValidationError, match="set batch_size, model in its steps instead"):
        Settings(queue_url=QUEUE, pipeline=str(BOARDS), model="x:y", batch_size=4)


def test_a_fan_out_must_say_the_shape_of_its_parts() -> None:
    with pytest.raises(PluginError, match="with an output_shape"):
        load_fan_out("stages.boards:objects")


def test_a_chains_identity_changes_with_any_model_and_with_how_it_cuts() -> None:
    """One model is known by its own identity; a chain by its name, its version (else
    its digest's first digits) and a digest over its models and the steps around them."""
    spec = PipelineSpec.model_validate(str(BOARDS))
    finder = ModelIdentity("tile-finder", "a", "sha256:1")
    classifier = ModelIdentity("shapes-cnn", "b", "sha256:2")
    chain = pipeline_identity(spec, [finder, classifier])
    assert (chain.name, chain.version, chain.steps) == ("shape-boards", "1", (finder, classifier))
    assert chain.as_dict()["steps"] == [finder.as_dict(), classifier.as_dict()]
    retrained = pipeline_identity(spec, [finder, ModelIdentity("shapes-cnn", "b", "sha256:3")])
    fan_out = spec.steps[1]
    assert isinstance(fan_out, FanOutStep)
    fewer_parts = spec.model_copy(
        update={
            "steps": [spec.steps[0], fan_out.model_copy(update={"max_parts": 2}), spec.steps[2]]
        }
    )
    digests = {
        chain.digest,
        retrained.digest,
        pipeline_identity(fewer_parts, [finder, classifier]).digest,
    }
    assert len(digests) == 3
    unversioned = spec.model_copy(update={"version": None})
    assert pipeline_identity(unversioned, [finder, classifier]).version == chain.digest[7:19]
    single = Settings(queue_url=QUEUE).pipeline_spec()
    assert pipeline_identity(single, [classifier]) is classifier
