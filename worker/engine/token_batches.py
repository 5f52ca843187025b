"""Batches sized in tokens (issue 40): which of the ready items a model's batch takes
when its size is a budget of padded tokens, not a count of items.

Each item has a size (its tokens: `TokenBudget.size_of` reads it from the item's
value, which its preprocessor wrote), and a batch is padded to one of a few fixed
lengths (`bucket_lengths`), the smallest that holds its longest item, so a compiled
model meets a few shapes. A batch takes the items of one length only, as many as fit
the budget of rows x length (and at most the stage's batch size of rows), chosen
among the first `window` items ready (those taken ahead first, then oldest first):

1. an urgent item (`Item.urgent`) seen beside background ones (a small job's texts
   beside a giant job's shard) has its length's batch taken at once, however few it
   holds: that length's urgent items first, its background texts filling it: it passes
   the full batches of the background, as it passes them in an item-count batch and in
   every queue (the channel shows urgent items first, its lane ahead, but the batch
   does not count on it);
2. else an item that has waited `max_wait_s` has its length's batch taken at once,
   however few it holds: nothing waits for company longer than an item-count batch
   would;
3. else a length with a full batch of items ready, the one whose first item comes
   first;
4. else, when the window is full (no item behind it can be seen), the length whose
   items hold the most tokens, rather than the device waiting for the oldest to be due;
5. else none yet: asked again when more come, or when the oldest is due.

Urgent items alone (every job's but a shard's, when no shard runs) are chosen among
by the rules after the first, as any: being ahead of nothing, nothing is to pass.

Order within a job is not kept here: results regroup by index downstream, as they do
across devices.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from worker.engine.items import Item

# Lengths a batch is padded to: four steps per doubling (16, 20, 24, 28, 32, 40, ...,
# 448, 512: 21 shapes to 512), multiples of 8 from 32 on (the tensor cores' tiles). On
# lengths drawn lognormally between 5 and 512, a batch of one length holds about 92% real
# tokens, where multiples of 64 (8 shapes) held 74-86% and multiples of 16 (32) 92-96%.
STEPS_PER_DOUBLING = 4
SHORTEST_LENGTH = 16

# The ready items a batch is chosen among, in batches of the stage's size: items of
# lengths less common than others fill a batch from a window this deep.
WINDOW_BATCHES = 4


def bucket_lengths(longest: int) -> tuple[int, ...]:
    """The lengths batches are padded to, up to and including `longest` (the model's
    longest sequence, the slot's length)."""
    lengths, doubling = [], SHORTEST_LENGTH
    while doubling < longest:
        step = doubling // STEPS_PER_DOUBLING
        lengths += [doubling + step * n for n in range(STEPS_PER_DOUBLING)]
        doubling *= 2
    return (*sorted(length for length in set(lengths) if length < longest), longest)


def bucket_of(size: int, lengths: Sequence[int]) -> int:
    """The smallest of `lengths` that holds `size` (the longest if none does)."""
    position = bisect.bisect_left(lengths, size)
    return lengths[min(position, len(lengths) - 1)]


@dataclass(frozen=True)
class TokenBudget:
    """How a stage sizes its batches in tokens: at most `max_tokens` padded tokens
    (rows x length, at least one row), each padded to one of `lengths`; `size_of` is an
    item's tokens, read from its value."""

    max_tokens: int
    lengths: tuple[int, ...]
    size_of: Callable[[Any], int]

    def length_of(self, item: Item) -> int:
        """The length the item is padded to (an item that failed already: the
        shortest, it only passes through)."""
        if item.padded_length is None:
            size = 0 if item.error is not None else self.size_of(item.value)
            item.padded_length = bucket_of(size, self.lengths)
        return item.padded_length

    def rows(self, length: int, max_rows: int) -> int:
        return max(1, min(max_rows, self.max_tokens // length))

    def chooser(
        self, max_rows: int, max_wait_s: float
    ) -> Callable[[Sequence[Item], Sequence[float], float], list[int] | float]:
        """What a channel asks which of its first `window(max_rows)` entries to take
        (`Channel.get_chosen`), for batches of at most `max_rows` rows."""
        window = self.window(max_rows)

        def choose(
            items: Sequence[Item], arrived: Sequence[float], now: float
        ) -> list[int] | float:
            lengths = [item.padded_length or self.length_of(item) for item in items]
            return choose_batch(
                lengths,
                arrived,
                now,
                rows=lambda length: self.rows(length, max_rows),
                max_wait_s=max_wait_s,
                window_full=len(items) >= window,
                urgent=[item.urgent for item in items],
            )

        return choose

    @staticmethod
    def window(max_rows: int) -> int:
        return WINDOW_BATCHES * max_rows


def choose_batch(
    lengths: Sequence[int],
    arrived: Sequence[float],
    now: float,
    *,
    rows: Callable[[int], int],
    max_wait_s: float,
    window_full: bool,
    urgent: Sequence[bool] = (),
) -> list[int] | float:
    """Which of the ready items (their padded `lengths`, in the order they go, when
    each `arrived`, and whether each is `urgent`: none if not given) a batch takes now,
    by their positions, in that order; or, if none yet, the seconds until the first is
    due (the module's docstring says which)."""
    if not lengths:
        return max_wait_s
    by_length: dict[int, list[int]] = {}
    for position, length in enumerate(lengths):
        by_length.setdefault(length, []).append(position)
    if any(urgent) and not all(urgent):  # the first urgent's length, urgent first
        length = lengths[urgent.index(True)]
        urgent_first = sorted(by_length[length], key=lambda position: not urgent[position])
        return sorted(urgent_first[: rows(length)])
    if now - min(arrived) >= max_wait_s:  # the first due, in the order they go
        due = next(position for position, at in enumerate(arrived) if now - at >= max_wait_s)
        length = lengths[due]
        return by_length[length][: rows(length)]
    full = [group for length, group in by_length.items() if len(group) >= rows(length)]
    if full:
        group = min(full, key=lambda positions: positions[0])
        return group[: rows(lengths[group[0]])]
    if window_full:
        length = max(by_length, key=lambda length: length * len(by_length[length]))
        return by_length[length][: rows(length)]
    return max(0.0, min(arrived) + max_wait_s - now)
