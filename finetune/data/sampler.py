"""Which rows share a micro-batch: random, but of similar lengths, so a batch pads little.

Batches are padded to their longest row, so uniformly random batches of rows whose lengths vary
spend part of every forward and backward on padding. The rows are shuffled, cut into megabatches
of up to 50 global batches, and sorted by length within each (transformers'
`get_length_grouped_indices`, the Trainer's `group_by_length`): batches stay random in content
and order, and each one's rows are close in length. The batch holding the longest row comes first,
so a run that will not fit fails in its first update.

The order depends only on the seed, the epoch and `group_size`, the global batch (one update's
rows): a resumed run replays it exactly (`set_epoch`, Accelerate's `skip_first_batches`), and every
split of the same global batch into micro-batches, accumulation and ranks (DDP, FSDP, ZeRO) gives
each update the same rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices


class LengthGroupedSampler(Sampler[int]):
    def __init__(self, lengths: Sequence[int], group_size: int, seed: int):
        self.lengths = list(lengths)
        self.group_size = group_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # Accelerate's data loader calls it each epoch
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.group_size, generator=generator))

    def __len__(self) -> int:
        return len(self.lengths)


def row_lengths(rows) -> list[int]:
    """Tokens per row of a tokenized `datasets.Dataset` (a `select`ed view included), read from its
    Arrow column without materialising the ids in Python."""
    import pyarrow.compute as pc

    return pc.list_value_length(rows.with_format("arrow")["input_ids"]).to_pylist()
