"""What a daemon runs between fetching an input and writing its result: the pipeline
spec. One model is the `--model`, `--preprocess` and `--postprocess` flags; a chain of
models is a TOML file given with `--pipeline`:

    name = "shape-boards"                       # the chain's name in job.json and results
    preprocess = "stages.boards:board_decoder"  # bytes -> uint8 image
    postprocess = "stages.boards:objects"       # the whole input's parts -> result fields

    [[steps]]                                   # a detector over the whole image
    model = "stages.boards:tile_finder"
    batch_size = 32

    [[steps]]                                   # one crop per thing it found
    fan_out = "stages.boards:found_tiles"
    max_parts = 4

    [[steps]]                                   # a classifier over each crop
    model = "stages.model:default_classifier"
    batch_size = 64

Each model runs in processes of its own (one per device) with its own batch size; the
fan-out runs in CPU processes between them. The postprocessor of a chain is given, for
each input, the list of its parts' `(about, output)` pairs, in part order.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Precision = Literal["float32", "bfloat16"]
DecodePlacement = Literal["auto", "cpu", "gpu"]


def devices(value: str) -> str:
    """`auto`, or torch devices, comma-separated (one inference process each)."""
    named = [device.strip() for device in value.split(",")]
    if value != "auto" and not all(re.fullmatch(r"[a-z]+(:\d+)?", d) for d in named):
        raise ValueError(
            f"{value!r}: give auto, or torch devices (cpu, cuda, cuda:1), comma-separated"
        )
    return ",".join(named)


class ModelStep(BaseModel):
    """A model: a `module:factory`, a .pt2 archive or a TorchScript file, taking a uint8
    NCHW batch of what the step before it wrote (the decoded image, or crops)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    name: str | None = Field(default=None, description="the model's name in job.json")
    version: str | None = Field(default=None, description="the model's version")
    batch_size: int = Field(default=64, ge=1, le=4096)
    device: str | None = Field(default=None, description="default: --device")
    precision: Precision | None = Field(default=None, description="default: --precision")
    channels_last: bool | None = Field(default=None, description="default: --channels-last")

    @field_validator("device")
    @classmethod
    def _devices(cls, value: str | None) -> str | None:
        return None if value is None else devices(value)


class FanOutStep(BaseModel):
    """Cuts each input into parts for the next model: `module:object`, called as
    `fan_out(image, found, outs) -> abouts` with the image the model before it read,
    that model's output for it, and up to `max_parts` uint8 slots of its `output_shape`
    to write the parts into; it returns what each part is about (a box, say)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fan_out: str
    max_parts: int = Field(default=8, ge=1, le=1024)
    workers: int = Field(default=1, ge=1, le=256)


FAN_OUT_STAGE = "fan-out"
Step = Annotated[ModelStep | FanOutStep, Field(union_mode="left_to_right")]


class PipelineSpec(BaseModel):
    """The preprocess step (decoding), the models (with a fan-out between two of them)
    and the postprocess step. `name` and `version` name a chain in job.json and results.jsonl
    (a single model goes by its own)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    version: str | None = None
    preprocess: str
    postprocess: str
    steps: list[Step] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _from_file(cls, data: Any) -> Any:
        """A path reads the TOML file it names."""
        if not isinstance(data, str | Path):
            return data
        try:
            with open(data, "rb") as file:
                return tomllib.load(file)
        except OSError as error:
            raise ValueError(f"cannot read the pipeline spec {data}: {error}") from error
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"the pipeline spec {data} is not TOML: {error}") from error

    @model_validator(mode="after")
    def _shape(self) -> PipelineSpec:
        kinds = ["model" if isinstance(step, ModelStep) else "fan_out" for step in self.steps]
        if kinds not in (["model"], ["model", "fan_out", "model"]):
            raise ValueError(
                f"steps are {' -> '.join(kinds)}: a pipeline is one model, or a model, a "
                "fan-out and a model (a model reads what the step before it wrote: the "
                "preprocessed image, or the fan-out's parts)"
            )
        if len(self.steps) > 1 and not self.name:
            raise ValueError("a chain of models needs a name (it names the results)")
        return self

    @property
    def models(self) -> list[ModelStep]:
        return [step for step in self.steps if isinstance(step, ModelStep)]

    @property
    def fan_out(self) -> FanOutStep | None:
        return next((step for step in self.steps if isinstance(step, FanOutStep)), None)

    def model_stage_names(self) -> list[str]:
        """Each model's stage name in logs, metrics and the timeline, in order:
        `inference` for the one model, `inference-1`, `inference-2` in a chain."""
        count = len(self.models)
        return ["inference"] if count == 1 else [f"inference-{n}" for n in range(1, count + 1)]
