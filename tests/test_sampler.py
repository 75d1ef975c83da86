"""Length-grouped batches (the default for unpacked SFT): less padding than uniformly random
batches, every row once per epoch, an order fixed by seed and epoch, the longest batch first, and the
same rows per update however the global batch is split into micro-batches and ranks."""

import random

import datasets
import torch
from torch.utils.data import DataLoader

from finetune.config.options import BatchShape, TrainConfig
from finetune.data.sampler import LengthGroupedSampler, row_lengths
from finetune.train.run import train_dataloader

RNG = random.Random(0)
LENGTHS = [RNG.randint(8, 200) for _ in range(400)]


def padded_tokens(order: list[int], batch: int) -> int:
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    return sum(max(LENGTHS[i] for i in b) * len(b) - sum(LENGTHS[i] for i in b) for b in batches)


def test_grouped_batches_pad_far_less_than_random_ones_and_cover_every_row_once():
    grouped = list(LengthGroupedSampler(LENGTHS, group_size=8, seed=0))
    shuffled = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(0)).tolist()
    assert sorted(grouped) == list(range(len(LENGTHS)))
    assert padded_tokens(grouped, 8) < 0.2 * padded_tokens(shuffled, 8)
    assert LENGTHS[grouped[0]] == max(LENGTHS)  # a run that cannot fit fails in its first update


def test_the_order_is_fixed_by_seed_and_epoch():
    sampler = LengthGroupedSampler(LENGTHS, group_size=8, seed=0)
    first = list(sampler)
    assert list(LengthGroupedSampler(LENGTHS, group_size=8, seed=0)) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_every_split_of_the_global_batch_gives_each_update_the_same_rows():
    """micro 8 × accumulation 1, micro 2 × accumulation 4 and 2 ranks × micro 2 × accumulation 2
    (rank r takes every other micro-batch, as Accelerate shards a loader): the same 8 rows per update."""
    rows = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in LENGTHS], "index": list(range(len(LENGTHS)))})
    assert row_lengths(rows) == LENGTHS
    assert row_lengths(rows.select([5, 0])) == [LENGTHS[5], LENGTHS[0]]  # a view's rows, not its table's

    def updates(batch: BatchShape) -> list[set[int]]:
        loader = train_dataloader(rows, batch, TrainConfig(seed=3), collate_fn_indices)
        micro_batches = [indices for indices in loader]
        per_update = batch.gradient_accumulation_steps * batch.world_size
        return [set().union(*micro_batches[i:i + per_update]) for i in range(0, len(micro_batches) - per_update + 1, per_update)]

    one = updates(BatchShape(8, 1, 1))
    assert one == updates(BatchShape(2, 4, 1)) == updates(BatchShape(2, 2, 2)) and len(one) == 50


def collate_fn_indices(rows: list[dict]) -> set[int]:
    return {row["index"] for row in rows}


def test_packing_and_the_flag_keep_uniformly_random_batches():
    rows = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in LENGTHS]})
    for config in (TrainConfig(group_by_length=False), TrainConfig(packing=True)):
        loader = train_dataloader(rows, BatchShape(8, 1, 1), config, lambda batch: batch)
        assert not isinstance(loader.sampler, LengthGroupedSampler)
    grouped = train_dataloader(rows, BatchShape(8, 1, 1), TrainConfig(), lambda batch: batch)
    assert isinstance(grouped.sampler, LengthGroupedSampler) and isinstance(grouped, DataLoader)
