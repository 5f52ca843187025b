"""`python -m bench.texts_fleet`: a table of texts across a fleet of daemons, its
results checked against the model's own answers by a check that fails where they
differ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from bench import texts_fleet as bench_texts
from bench.texts_fleet import ResultsMismatch, check_results, texts_fleet


@pytest.mark.bench
@pytest.mark.e2e
def test_the_texts_fleet_checks_every_row_against_the_models_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 rows in shards of 50 on two daemons: every shard is committed by one of
    them, and the results pass the check; the same results with one embedding
    perturbed, a row missing or two rows swapped fail it."""
    checked: list[tuple[pa.Table, pa.Table]] = []

    def check_and_keep(results: pa.Table, table: pa.Table) -> float:
        checked.append((results, table))
        return check_results(results, table)

    monkeypatch.setattr(bench_texts, "check_results", check_and_keep)
    figures = texts_fleet(tmp_path, rows=300, daemons=2, shard_rows=50)
    # The shards' files joined into the one a run alone writes.
    assert (figures["status"], figures["shards"], figures["result_parts"]) == ("succeeded", 6, 1)
    assert sum(figures["daemon_rows"]) == 300 and sum(figures["daemon_shards"]) == 6
    assert figures["embedding_largest_difference"] <= bench_texts.TOLERANCE
    [(results, table)] = checked

    embeddings = results.column("embedding").combine_chunks()
    values = embeddings.flatten().to_numpy().copy()
    values[17 * embeddings.type.list_size + 3] += 1e-3
    perturbed = pa.FixedSizeListArray.from_arrays(pa.array(values), embeddings.type.list_size)
    index = results.schema.get_field_index("embedding")
    with pytest.raises(ResultsMismatch, match="text-0000017"):
        check_results(results.set_column(index, "embedding", perturbed), table)
    with pytest.raises(ResultsMismatch, match="299 results of 300 rows"):
        check_results(results.slice(1), table)
    order = np.arange(300)
    order[[5, 6]] = [6, 5]
    with pytest.raises(ResultsMismatch, match="indices"):
        check_results(results.take(order), table)
