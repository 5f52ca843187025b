"""Decoding JPEGs on the model's device (`--decode gpu`), with a per-input fallback.

Without a GPU, `tests.support.faults:standin_device_decoder` stands in for nvJPEG
(Pillow decodes the whole file, the default preprocessor's device code resizes it), so
what is checked is everything around the decoder: which inputs are left undecoded, the
batch, the bisection, the CPU fallback, each input's own error, and the choice of where
to decode. On a GPU (`make test-gpu`) the decoder tests run with nvJPEG too.
"""

from __future__ import annotations

import importlib.util
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from structlog.testing import capture_logs

from stages.postprocess import top_k
from stages.preprocess import JPEG_END, JPEG_MAGIC, ImagePreprocessor, default_preprocessor
from stages.synthetic import LABELS, samples
from tests.support.faults import (
    StandInDeviceDecoder,
    broken_scan,
    reencoded,
    standin_device_decoder,
)
from tests.support.markers import also_on_gpu
from worker.engine import ItemError
from worker.plugins import PluginError, Undecoded
from worker.plugins.device_decoding import decode_or_defer
from worker.plugins.loading import decodes_on_device, load_device_decoder
from worker.plugins.setups import inference_setup, preprocess_setup
from worker.plugins.staging import resolved

SHAPE = default_preprocessor.output_shape
STANDIN = "tests.support.faults:standin_device_decoder"
DEFAULT = "stages.preprocess:default_preprocessor"
CPU = torch.device("cpu")
TORCHVISION_ABSENT = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None,
    reason="checks what happens where torchvision is not installed",
)


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


# Each test of a device decoder runs with the stand-in on the CPU, and with nvJPEG on a GPU.
DECODERS = also_on_gpu((STANDIN, "cpu"), (DEFAULT, "cuda"))


@pytest.mark.parametrize(("decoder", "device"), DECODERS)
def test_jpegs_decoded_on_the_device_get_the_cpus_answers(decoder: str, device: str) -> None:
    """Decoded whole and resized on the device, the sample JPEGs are within a level of
    Pillow's decode on the CPU, and the default model labels them the same."""
    pairs = _jpegs(300)
    on_cpu = torch.empty((len(pairs), *SHAPE), dtype=torch.uint8)
    for row, (_, data) in zip(on_cpu, pairs, strict=True):
        default_preprocessor(data, row)
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _, data in pairs]
    decoded = load_device_decoder(decoder).decode_on_device(encoded, torch.device(device))
    on_device = torch.stack(decoded).cpu()
    difference = (on_cpu.float() - on_device.float()).abs().mean()
    print(f"{decoder} on {device}: mean difference from Pillow {float(difference):.3f} levels")
    assert difference < 1.0

    classify = inference_setup("stages.model:default_classifier", "cpu", SHAPE).run
    labels = [int(np.argmax(row)) for row in classify(on_device, [None] * len(pairs))]
    labels_on_cpu = [int(np.argmax(row)) for row in classify(on_cpu, [None] * len(pairs))]
    differing = sum(a != b for a, b in zip(labels, labels_on_cpu, strict=True))
    print(f"{differing} of {len(pairs)} labels differ")
    # nvJPEG upsamples chroma and rounds its inverse DCT a little differently from
    # libjpeg: an image on the edge between two labels may land on the other side.
    assert differing <= len(pairs) // 100
    right = sum(LABELS[label] == truth for label, (truth, _) in zip(labels, pairs, strict=True))
    assert right / len(pairs) >= 0.95


# Starts and ends as a JPEG, and holds no image: the preprocessing process would not
# leave it for the device, but a decoder may fail on a file the header check passed.
NO_IMAGE = JPEG_MAGIC + b"\xe0" + bytes(200) + JPEG_END


@pytest.mark.parametrize(("decoder", "device"), DECODERS)
def test_an_input_the_device_rejects_is_decoded_on_the_cpu_and_one_neither_can_fails_alone(
    decoder: str, device: str
) -> None:
    """In a batch of a PNG (decoded before), good JPEGs, a progressive JPEG (the
    stand-in refuses it, nvJPEG decodes it) and a file that only looks like a JPEG
    (nothing decodes it): the device call is bisected, the inputs it fails on are
    decoded on the CPU, the one that is no image gets the error the CPU gives it, and
    every other input the model's answer on the CPU-decoded image."""
    jpegs = [data for _, data in _jpegs(12)]
    inputs = [
        next(data for _, data in samples(20, 5) if data[:4] == b"\x89PNG"),
        jpegs[0],
        reencoded(jpegs[1], progressive=True),
        NO_IMAGE,
        jpegs[3],
    ]
    batch = torch.zeros((len(inputs), *SHAPE), dtype=torch.uint8)
    preprocessor = load_device_decoder(decoder)
    values = [
        (decode_or_defer(preprocessor, data, row), {})
        for data, row in zip(inputs[:3], batch, strict=False)
    ]
    batch[3].view(-1)[: len(NO_IMAGE)] = torch.frombuffer(bytearray(NO_IMAGE), dtype=torch.uint8)
    values.append((Undecoded(len(NO_IMAGE)), {}))
    values.append((decode_or_defer(preprocessor, inputs[4], batch[4]), {}))
    assert [isinstance(payload, Undecoded) for payload, _ in values] == [0, 1, 1, 1, 1]

    stage_fn = inference_setup(
        "stages.model:default_classifier",
        device,
        SHAPE,
        postprocess="stages.postprocess:top_k",
        decoder=decoder,
    )
    with capture_logs() as logs:
        outputs = resolved(stage_fn.run(batch, values))  # as its finish step waits for them
    error, on_cpu_error = outputs[3], _cpu_error(inputs[3])
    assert (error.type, error.stage) == (on_cpu_error.type, "preprocess")
    assert error.message.startswith("cannot identify image file")  # then an object's address
    refused = 2 if decoder == STANDIN else 1
    assert [event for event in logs if event["event"] == "decoded_on_cpu"] == [
        {"event": "decoded_on_cpu", "inputs": refused, "of": 4, "log_level": "warning"}
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
        preprocess_setup("tests.support.faults:faulty_preprocessor", defer_to_device=True)


@pytest.mark.parametrize(
    ("placement", "preprocess", "devices", "chained", "decided"),
    [
        ("cpu", STANDIN, ["cuda:0"], False, (False, "--decode cpu")),
        ("gpu", STANDIN, ["cpu"], False, (True, "--decode gpu")),
        ("auto", STANDIN, ["cuda:0", "cuda:1"], False, (True, "every model device is a GPU")),
        ("auto", STANDIN, ["cuda:0", "cpu"], False, (False, "does not run on a GPU")),
        ("auto", STANDIN, ["cuda:0"], True, (False, "fan-out reads each decoded image")),
        (
            "auto",
            "tests.support.faults:faulty_preprocessor",
            ["cuda:0"],
            False,
            (False, "no decode_on"),
        ),
        pytest.param(
            "auto", DEFAULT, ["cuda:0"], False, (False, "torchvision"), marks=TORCHVISION_ABSENT
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
        pytest.param(DEFAULT, False, "torchvision", marks=TORCHVISION_ABSENT),
        ("tests.support.faults:faulty_preprocessor", False, "does not decode on a device"),
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
    RGB-coded (Adobe transform 0), truncated ones and ones whose scan names a component
    the frame lacks (nvJPEG pictures both without a word), other formats, unreadable
    headers and images over the pixel limit do not."""
    (_, jpeg), *_ = _jpegs(4)
    preprocessor = ImagePreprocessor(max_pixels=160 * 160)
    assert preprocessor.device_decodable(jpeg)
    assert not preprocessor.device_decodable(jpeg[: len(jpeg) * 3 // 4])  # truncated
    assert not preprocessor.device_decodable(jpeg + b"trailing")
    assert not preprocessor.device_decodable(broken_scan(jpeg))  # nvJPEG pictures it
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
