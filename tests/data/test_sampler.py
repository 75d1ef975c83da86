"""Length-grouped micro-batches (the default for unpacked SFT): each update gets exactly the rows it
would get from uniformly random batches, so what the model learns cannot change; inside the update,
micro-batches of similar lengths pad less. Every row once per epoch, an order fixed by seed and epoch,
the same rows per update however the global batch is split into micro-batches and ranks."""

import random
from collections import Counter

import datasets
import pytest
import torch
from helpers import train_steps, word_rows, write_jsonl

from finetune.config.options import BatchShape, TrainConfig
from finetune.data.sampler import UpdateSortedSampler, row_lengths
from finetune.train.run import train_dataloader

RNG = random.Random(0)
LENGTHS = [RNG.randint(8, 200) for _ in range(400)]


def padded_tokens(order: list[int], batch: int) -> int:
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    return sum(max(LENGTHS[i] for i in b) * len(b) - sum(LENGTHS[i] for i in b) for b in batches)


def test_each_update_holds_the_uniformly_shuffled_rows_sorted_longest_first():
    """The permutation is torch.randperm with the generator seeded seed + epoch, as Accelerate's
    SeedableRandomSampler draws it for unsorted batches (compared through `prepare` below)."""
    sampler = UpdateSortedSampler(LENGTHS, group_size=16, seed=3)
    sampler.set_epoch(2)
    grouped = list(sampler)
    shuffled = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(5)).tolist()
    assert sorted(grouped) == list(range(len(LENGTHS)))
    for start in range(0, len(LENGTHS), 16):
        update = grouped[start:start + 16]
        assert set(update) == set(shuffled[start:start + 16])
        assert [LENGTHS[i] for i in update] == sorted((LENGTHS[i] for i in update), reverse=True)
    # micro-batches of 4 inside updates of 16 pad less than the same updates split at random
    assert padded_tokens(grouped, 4) < 0.6 * padded_tokens(shuffled, 4)


def test_the_order_is_fixed_by_seed_and_epoch():
    sampler = UpdateSortedSampler(LENGTHS, group_size=8, seed=0)
    first = list(sampler)
    assert list(UpdateSortedSampler(LENGTHS, group_size=8, seed=0)) == first
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
        assert not isinstance(loader.sampler, UpdateSortedSampler)
    grouped = train_dataloader(rows, BatchShape(8, 1, 1), TrainConfig(), lambda batch: batch)
    assert isinstance(grouped.sampler, UpdateSortedSampler)


def update_rows(session) -> tuple[list[Counter], int]:
    """The rows (as token tuples) of each update of the prepared loader's first epoch, and its padding."""
    micro_batches = list(session.train_loader)
    per_update = session.accelerator.gradient_accumulation_steps
    updates, padding = [], 0
    for start in range(0, len(micro_batches), per_update):
        rows = Counter()
        for batch in micro_batches[start:start + per_update]:
            mask = batch["attention_mask"].bool()
            padding += int((~mask).sum())
            rows.update(tuple(ids[m].tolist()) for ids, m in zip(batch["input_ids"], mask))
        updates.append(rows)
    return updates, padding


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_run_learns_the_same_with_and_without_grouping(make_run, tmp_path, method):
    """Through `train.setup` (the prepared loader, Accelerate's seedable sampler for the ungrouped run):
    the same rows in every update, less padding, and the same losses and weights after 6 updates,
    micro 2 × accumulation 4 over rows of 2 to 30 words."""
    draw = random.Random(1)
    rows = write_jsonl(tmp_path / "varied.jsonl", word_rows([draw.randint(2, 30) for _ in range(64)]))
    flags = {"dataset": str(rows), "micro_batch_size": 2, "global_batch_size": 8, "method": method, "seed": 7}
    grouped, plain = make_run(**flags), make_run(**flags | {"group_by_length": False})
    (grouped_updates, grouped_padding), (plain_updates, plain_padding) = update_rows(grouped), update_rows(plain)
    assert grouped_updates == plain_updates and len(grouped_updates) == 8
    assert grouped_padding < 0.5 * plain_padding
    assert train_steps(grouped, 6, save=False) == pytest.approx(train_steps(plain, 6, save=False), rel=1e-5)
    for (name, a), b in zip(grouped.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
