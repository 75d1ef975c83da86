"""Which rows share a micro-batch: each update's rows are uniformly random, ordered by length inside it.

Batches are padded to their longest row, so when an update is split into several micro-batches
(gradient accumulation, or ranks) a uniformly random split pads every micro-batch to a long row.
Here the rows are shuffled exactly as without grouping (the permutation Accelerate's seedable
sampler draws for the same seed and epoch), cut into global batches (one update's rows), and each
global batch is sorted longest first, so its micro-batches are close in length.

Which rows an update sees is therefore the same as with uniformly random batches: the loss is
token-weighted over the whole update (train/loop.py), so the update's gradient is the same up to the
order of floating-point sums, and what the model learns cannot change. Grouping across updates (the
Trainer's `group_by_length`: megabatches of 50 updates sorted by length) pads less, but makes each
update one length class; on the embedded default, where length nearly determines the task, that
cuts what the model learns (held-out exact match: bench/quality.py, results in bench/RESULTS.md). With micro-batch = global batch (one
process, no accumulation) nothing is saved and nothing changes.

The order depends only on the seed, the epoch and `group_size`: a resumed run replays it exactly
(`set_epoch`, Accelerate's `skip_first_batches`), and every split of the same global batch into
micro-batches, accumulation and ranks gives each update the same rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


class UpdateSortedSampler(Sampler[int]):
    """Not a `RandomSampler` subclass on purpose: Accelerate would replace it by its own."""

    def __init__(self, lengths: Sequence[int], group_size: int, seed: int):
        self.lengths = list(lengths)
        self.group_size = group_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # Accelerate's data loader calls it each epoch
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)  # as SeedableRandomSampler seeds
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        for start in range(0, len(order), self.group_size):
            yield from sorted(order[start:start + self.group_size], key=lambda row: -self.lengths[row])

    def __len__(self) -> int:
        return len(self.lengths)


def row_lengths(rows) -> list[int]:
    """Tokens per row of a tokenized `datasets.Dataset` (a `select`ed view included), read from its
    Arrow columns without materialising the ids in Python: a preference pair's longer sequence, which
    its micro-batch is padded to."""
    import pyarrow.compute as pc

    table = rows.with_format("arrow")
    columns = [name for name in table.column_names if name.endswith("input_ids")]
    lengths = [pc.list_value_length(table[name]) for name in columns]
    longest = lengths[0]
    for other in lengths[1:]:
        longest = pc.max_element_wise(longest, other)
    return longest.to_pylist()
