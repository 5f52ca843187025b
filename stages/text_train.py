"""Train the shipped text model's tokenizer and network on generated sentences, and
write them beside the image models' weights (a few seconds):

    python -m stages.text_train

The texts go through the same preprocessor the daemon uses (`stages.text:tokens`).
"""

from __future__ import annotations

import argparse

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import WordPieceTrainer

from stages.sentences import TOPICS, sentences
from stages.text import MAX_TOKENS, TOKENIZER, WEIGHTS, LabelledEmbedding, TextNet, Tokens

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]  # [PAD] first: id 0 (`stages.text.PAD_ID`)
VOCABULARY = 400


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A small lower-casing WordPiece tokenizer, [CLS] text [SEP], as BERT's."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = WordPieceTrainer(vocab_size=VOCABULARY, special_tokens=SPECIALS)
    tokenizer.train_from_iterator(texts, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tokenizer


def encoded(texts: list[str]) -> torch.Tensor:
    """The texts as the daemon's preprocessor writes them: (n, 2, MAX_TOKENS) int32."""
    preprocessor = Tokens(TOKENIZER, MAX_TOKENS)
    slots = torch.zeros((len(texts), *preprocessor.output_shape), dtype=preprocessor.output_dtype)
    for text, slot in zip(texts, slots, strict=True):
        preprocessor(text, slot, {})
    return slots


def accuracy(net: TextNet, slots: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.inference_mode():
        rows = LabelledEmbedding(net).eval()(slots[:, 0], slots[:, 1])
    return float((rows[:, : len(TOPICS)].argmax(dim=1) == labels).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sentences", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    pairs = list(sentences(args.sentences, args.seed))
    texts = [text for _, text in pairs]
    TOKENIZER.parent.mkdir(parents=True, exist_ok=True)
    train_tokenizer(texts).save(str(TOKENIZER))
    slots = encoded(texts)
    labels = torch.tensor([TOPICS.index(topic) for topic, _ in pairs])
    held_out = list(sentences(500, args.seed + 1000))
    test_slots = encoded([text for _, text in held_out])
    test_labels = torch.tensor([TOPICS.index(topic) for topic, _ in held_out])
    net = TextNet(vocabulary=VOCABULARY)
    optimiser = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for epoch in range(args.epochs):
        net.train()
        for batch in torch.randperm(len(slots)).split(64):
            loss = torch.nn.functional.cross_entropy(
                net(slots[batch, 0], slots[batch, 1]), labels[batch]
            )
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        net.eval()
        print(
            f"epoch {epoch + 1}: loss {loss.item():.3f}, held-out accuracy "
            f"{accuracy(net, test_slots, test_labels):.3f}"
        )
    torch.save(net.state_dict(), WEIGHTS)
    print(f"wrote {WEIGHTS} ({WEIGHTS.stat().st_size} bytes) and {TOKENIZER}")


if __name__ == "__main__":
    main()
