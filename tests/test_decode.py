"""Decoding JPEGs on the model's device (`--decode gpu`), with a per-input fallback.

No GPU and no torchvision here: `tests.faults:standin_device_decoder` stands in for
nvJPEG (Pillow decodes the whole file, the default preprocessor's device code resizes
it), so what is checked is everything around the decoder: which inputs are left
undecoded, the batch, the bisection, the CPU fallback, each input's own error, and the
choice of where to decode.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from structlog.testing import capture_logs

from stages.postprocess import top_k
from stages.preprocess import ImagePreprocessor, default_preprocessor
from stages.synthetic import LABELS, samples
from tests.faults import StandInDeviceDecoder, broken_scan, reencoded, standin_device_decoder
from worker.engine import ItemError
from worker.plugins import (
    PluginError,
    Undecoded,
    decode_or_defer,
    decodes_on_device,
    inference_setup,
    preprocess_setup,
)

SHAPE = default_preprocessor.output_shape
STANDIN = "tests.faults:standin_device_decoder"
CPU = torch.device("cpu")


def _jpegs(count: int, seed: int = 5) -> list[tuple[str, bytes]]:
    return [(label, data) for label, data in samples(count, seed) if data[:2] == b"\xff\xd8"]


def _cpu_error(data: bytes) -> ItemError:
    """The error the preprocessing process gives `data` when it decodes it itself."""
    try:
        default_preprocessor(data, torch.empty(SHAPE, dtype=torch.uint8))
    except Exception as error:
        return ItemError.from_exception(error, "preprocess")
    raise AssertionError("the CPU decodes it")


def test_a_jpeg_that_fits_its_slot_is_left_for_the_device_and_anything_else_decoded_here() -> None:
    """A JPEG nvJPEG takes, no larger than one decoded input, is copied into its slot
    undecoded; a PNG, a CMYK JPEG and a JPEG larger than the slot are decoded in the
    preprocessing process as before, and a bad file fails there with the error it
    always had."""
    (_, jpeg), *_ = _jpegs(4)
    slot = torch.zeros(SHAPE, dtype=torch.uint8)
    assert decode_or_defer(standin_device_decoder, jpeg, slot) == Undecoded(len(jpeg))
    assert slot.view(-1)[: len(jpeg)].numpy().tobytes() == jpeg

    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), np.uint8))
    buffer = io.BytesIO()
    noise.save(buffer, format="JPEG", quality=95)
    png = io.BytesIO()
    noise.save(png, format="PNG")
    too_big = buffer.getvalue()
    assert len(too_big) > slot.numel()
    for decoded_here in (too_big, png.getvalue(), reencoded(jpeg, mode="CMYK")):
        expected = torch.empty(SHAPE, dtype=torch.uint8)
        assert decode_or_defer(standin_device_decoder, decoded_here, slot) == default_preprocessor(
            decoded_here, expected
        )
        assert torch.equal(slot, expected)

    not_an_image = b"\xff\xd8\xff" + b"\x00" * 100
    with pytest.raises(Exception) as raised:
        decode_or_defer(standin_device_decoder, not_an_image, slot)
    error = ItemError.from_exception(raised.value, "preprocess")
    assert (error.type, error.stage) == ("UnidentifiedImageError", "preprocess")
    assert error.message.startswith("cannot identify image file")


def test_jpegs_decoded_on_the_device_get_the_cpus_answers() -> None:
    """Decoded whole and resized on the device, the sample JPEGs are within a level of
    Pillow's decode on the CPU, and the default model labels them the same."""
    pairs = _jpegs(300)
    on_cpu = torch.empty((len(pairs), *SHAPE), dtype=torch.uint8)
    for row, (_, data) in zip(on_cpu, pairs, strict=True):
        default_preprocessor(data, row)
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _, data in pairs]
    on_device = torch.stack(standin_device_decoder.decode_on_device(encoded, CPU))
    assert (on_cpu.float() - on_device.float()).abs().mean() < 1.0

    classify = inference_setup("stages.model:default_classifier", "cpu", SHAPE).run
    labels = [int(np.argmax(row)) for row in classify(on_device, [None] * len(pairs))]
    assert labels == [int(np.argmax(row)) for row in classify(on_cpu, [None] * len(pairs))]
    right = sum(LABELS[label] == truth for label, (truth, _) in zip(labels, pairs, strict=True))
    assert right / len(pairs) >= 0.95


def test_an_input_the_device_rejects_is_decoded_on_the_cpu_and_one_neither_can_fails_alone() -> (
    None
):
    """In a batch of a PNG (decoded before), good JPEGs, a progressive JPEG (the device
    refuses it) and one with a broken scan header (nothing decodes it): the device call
    is bisected, the progressive one is decoded on the CPU, the broken one gets the
    error the CPU gives it, as before, and every other input the model's answer on the
    CPU-decoded image."""
    jpegs = [data for _, data in _jpegs(12)]
    inputs = [
        next(data for _, data in samples(20, 5) if data[:4] == b"\x89PNG"),
        jpegs[0],
        reencoded(jpegs[1], progressive=True),
        broken_scan(jpegs[2]),
        jpegs[3],
    ]
    batch = torch.zeros((len(inputs), *SHAPE), dtype=torch.uint8)
    values = [
        (decode_or_defer(standin_device_decoder, data, row), {})
        for data, row in zip(inputs, batch, strict=True)
    ]
    assert [isinstance(payload, Undecoded) for payload, _ in values] == [0, 1, 1, 1, 1]

    stage_fn = inference_setup(
        "stages.model:default_classifier",
        "cpu",
        SHAPE,
        postprocess="stages.postprocess:top_k",
        decoder=STANDIN,
    )
    with capture_logs() as logs:
        outputs = stage_fn.run(batch, values)
    assert outputs[3] == _cpu_error(inputs[3]) and outputs[3].stage == "preprocess"
    assert [event for event in logs if event["event"] == "decoded_on_cpu"] == [
        {"event": "decoded_on_cpu", "inputs": 2, "of": 4, "log_level": "warning"}
    ]

    on_cpu = torch.empty((len(inputs), *SHAPE), dtype=torch.uint8)
    for position in (0, 1, 2, 4):
        default_preprocessor(inputs[position], on_cpu[position])
    plain = inference_setup("stages.model:default_classifier", "cpu", SHAPE).run
    for position, expected in enumerate(plain(on_cpu, [None] * len(inputs))):
        if position != 3:
            assert top_k(outputs[position], {})["label"] == top_k(expected, {})["label"]


@dataclass(frozen=True)
class MisfitDecoder(StandInDeviceDecoder):
    """Decodes on the device, but forgets to resize."""

    def decode_on_device(
        self, encoded: list[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        return self._decode_jpegs(encoded, device)


misfit_decoder = MisfitDecoder()


def test_a_device_decoder_that_fails_its_samples_does_not_start() -> None:
    """The model's process decodes the preprocessor's samples on the device at start:
    one whose images come out the wrong size stops the start there, rather than send
    every input to the CPU fallback unseen."""
    with pytest.raises(PluginError, match=r"cannot decode its own samples on cpu .*not \(3"):
        inference_setup(
            "stages.model:default_classifier",
            "cpu",
            SHAPE,
            decoder="tests.test_decode:misfit_decoder",
        )
    with pytest.raises(PluginError, match="does not decode on a device"):
        preprocess_setup("tests.faults:faulty_preprocessor", defer_to_device=True)


@pytest.mark.parametrize(
    ("placement", "preprocess", "devices", "chained", "decided"),
    [
        ("cpu", STANDIN, ["cuda:0"], False, (False, "--decode cpu")),
        ("gpu", STANDIN, ["cpu"], False, (True, "--decode gpu")),
        ("auto", STANDIN, ["cuda:0", "cuda:1"], False, (True, "every model device is a GPU")),
        ("auto", STANDIN, ["cuda:0", "cpu"], False, (False, "does not run on a GPU")),
        ("auto", STANDIN, ["cuda:0"], True, (False, "fan-out reads each decoded image")),
        ("auto", "tests.faults:faulty_preprocessor", ["cuda:0"], False, (False, "no decode_on")),
        # torchvision does not import with the CPU build of torch.
        (
            "auto",
            "stages.preprocess:default_preprocessor",
            ["cuda:0"],
            False,
            (False, "torchvision"),
        ),
    ],
)
def test_where_inputs_are_decoded_is_decided_at_start(
    placement: Any, preprocess: str, devices: list[str], chained: bool, decided: tuple[bool, str]
) -> None:
    """`auto` decodes on the device only where every model device is a GPU and the
    preprocessor can; `gpu` insists, `cpu` never; the reason is given either way."""
    on_device, why = decodes_on_device(placement, preprocess, devices, chained)
    assert on_device is decided[0] and decided[1] in why


@pytest.mark.parametrize(
    ("preprocess", "chained", "obstacle"),
    [
        ("stages.preprocess:default_preprocessor", False, "torchvision"),
        ("tests.faults:faulty_preprocessor", False, "does not decode on a device"),
        (STANDIN, True, "fan-out"),
    ],
)
def test_decode_gpu_is_refused_at_start_where_it_cannot_be(
    preprocess: str, chained: bool, obstacle: str
) -> None:
    """`--decode gpu` where it cannot be done stops the start, saying why: never a quiet
    fallback to the CPU."""
    with pytest.raises(PluginError, match=f"--decode gpu: .*{obstacle}"):
        decodes_on_device("gpu", preprocess, ["cuda:0"], chained)


def test_the_default_preprocessor_takes_only_jpegs_nvjpeg_decodes() -> None:
    """Whole baseline and progressive RGB and greyscale JPEGs go to the device; CMYK,
    RGB-coded (Adobe transform 0), truncated ones (a decoder may picture them without a
    word), other formats, unreadable headers and images over the pixel limit do not."""
    (_, jpeg), *_ = _jpegs(4)
    preprocessor = ImagePreprocessor(max_pixels=160 * 160)
    assert preprocessor.device_decodable(jpeg)
    assert not preprocessor.device_decodable(jpeg[: len(jpeg) * 3 // 4])  # truncated
    assert not preprocessor.device_decodable(jpeg + b"trailing")
    adobe_rgb = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00"  # APP14, transform 0
    assert not preprocessor.device_decodable(jpeg[:2] + adobe_rgb + jpeg[2:])
    assert preprocessor.device_decodable(reencoded(jpeg, progressive=True))
    assert preprocessor.device_decodable(reencoded(jpeg, mode="L"))
    assert not preprocessor.device_decodable(reencoded(jpeg, mode="CMYK"))
    assert not preprocessor.device_decodable(b"\xff\xd8\xff" + b"\x00" * 100)
    assert not preprocessor.device_decodable(b"\x89PNG\r\n\x1a\n")
    huge = Image.new("RGB", (200, 200))
    buffer = io.BytesIO()
    huge.save(buffer, format="JPEG")
    assert not preprocessor.device_decodable(buffer.getvalue())
