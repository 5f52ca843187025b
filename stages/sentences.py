"""Synthetic labelled sentences (four topics) to train and check the shipped text model.

As with the images (`stages.synthetic`), nothing is downloaded: the training script, the
demo and the tests draw their own sentences, and a seed makes every set reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

TOPICS = ("weather", "sport", "food", "travel")

_WORDS = {
    "weather": [
        "rain",
        "snow",
        "wind",
        "storm",
        "sunny",
        "cloudy",
        "cold",
        "warm",
        "forecast",
        "thunder",
        "fog",
        "frost",
        "humid",
        "drizzle",
        "breeze",
        "temperature",
        "degrees",
        "umbrella",
        "showers",
        "heatwave",
    ],
    "sport": [
        "match",
        "goal",
        "team",
        "player",
        "coach",
        "league",
        "score",
        "referee",
        "stadium",
        "season",
        "win",
        "lost",
        "tournament",
        "striker",
        "keeper",
        "penalty",
        "final",
        "champion",
        "training",
        "fans",
    ],
    "food": [
        "bread",
        "soup",
        "cheese",
        "recipe",
        "oven",
        "salad",
        "pasta",
        "spicy",
        "sauce",
        "bake",
        "dinner",
        "kitchen",
        "garlic",
        "dessert",
        "flavour",
        "chef",
        "roast",
        "lunch",
        "butter",
        "tomatoes",
    ],
    "travel": [
        "flight",
        "train",
        "hotel",
        "airport",
        "passport",
        "ticket",
        "luggage",
        "journey",
        "beach",
        "museum",
        "city",
        "tour",
        "border",
        "map",
        "station",
        "booking",
        "holiday",
        "trip",
        "island",
        "cruise",
    ],
}
_FILLERS = [
    "the",
    "a",
    "this",
    "that",
    "today",
    "tomorrow",
    "we",
    "they",
    "was",
    "is",
    "very",
    "quite",
    "some",
    "more",
    "our",
]
_TEMPLATES = (
    "{f} {a} {b} {f} {c}",
    "{f} {a} was {b} and {c}",
    "{a} {f} {b} {f} {f} {c} {d}",
    "why is the {a} so {b} {f}",
    "{f} {f} {a} {b} {c} {d} {e}",
)


def sentences(count: int, seed: int) -> Iterator[tuple[str, str]]:
    """`count` (topic, sentence) pairs, the topics in turn, each sentence drawn from
    its topic's words and the shared fillers."""
    rng = random.Random(seed)
    for number in range(count):
        topic = TOPICS[number % len(TOPICS)]
        words = _WORDS[topic]
        template = rng.choice(_TEMPLATES)
        picks = {name: rng.choice(words) for name in "abcde"}
        while "{f}" in template:
            template = template.replace("{f}", rng.choice(_FILLERS), 1)
        yield topic, template.format(**picks)
