"""A user's text model in each form `--model` takes: a `torch.export` archive, a
TorchScript file (scripted or traced) and a `module:factory`, each a
sentence-transformers-shaped encoder called with the ids and mask of a text
preprocessor's slots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from stages.text import TOKENIZER, tokens
from tests.support.text_encoders import SAVERS, encoder, encoder_answers, tokenized
from worker.plugins.identity import identify
from worker.plugins.loading import load_model, token_slots
from worker.plugins.setups import inference_setup

TEXTS = ["the forecast says rain", "a late train to the coast", "soup", ""]
FACTORY = "tests.support.text_encoders:encoder"


@pytest.mark.parametrize("form", [*SAVERS, FACTORY])
def test_a_users_text_model_in_each_form_answers_as_the_module_itself(
    tmp_path: Path, form: str
) -> None:
    """Each form, set up as the model's process sets it up (probe, warm-up), answers the
    texts' int32 slots with the module's own embeddings (the archive was exported with
    the int64 ids of a Hugging Face tokenizer: it is fed them cast); it answers a batch
    padded to a shorter length too, as batches sized in tokens are; its identity's
    digest is the file's sha256, or the factory's state dict's."""
    reference = form
    if form in SAVERS:
        reference = str(tmp_path / form)
        SAVERS[form](Path(reference))
    slots = tokenized(TEXTS)
    stage = inference_setup(
        reference, "cpu", tokens.output_shape, batch_size=4, tokens=token_slots(tokens)
    )
    answers = np.stack(stage.run(slots, [None] * len(TEXTS)))
    assert np.allclose(answers, encoder_answers(slots[:, 0], slots[:, 1]), atol=1e-6)
    assert np.allclose(np.linalg.norm(answers[:3], axis=1), 1.0, atol=1e-6)

    short = slots[:, :, :8]
    with torch.inference_mode():
        cut = load_model(reference, torch.device("cpu"))(short[:, 0], short[:, 1]).numpy()
    assert np.allclose(cut, encoder_answers(short[:, 0], short[:, 1]), atol=1e-6)
    assert stage.about["model"] == identify(reference, encoder(), None, None).as_dict()


def test_a_text_fills_its_slot_with_its_ids_then_its_mask_and_zeros_past_them() -> None:
    """`stages.text:tokens` writes a slot a text before left full: the tokenizer's ids
    in row 0, ones in row 1 as far as they go, zeros past them; its notes count them."""
    text = "the forecast says rain"
    ids = Tokenizer.from_file(str(TOKENIZER)).encode(text).ids
    slot = torch.full(tokens.output_shape, 9, dtype=tokens.output_dtype)
    assert tokens(text, slot, {}) == {"truncated": False, "tokens": len(ids)}
    assert slot[0, : len(ids)].tolist() == ids and slot[1, : len(ids)].eq(1).all()
    assert not slot[:, len(ids) :].any()
