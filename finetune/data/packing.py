"""Packing: several examples per row, with position ids restarting at 0 for each example.

Given `position_ids` and no `attention_mask` (and no KV cache: `use_cache=False`, else the check
is skipped), transformers' mask builder (`masking_utils.find_packed_sequence_indices`) turns each
position reset into the start of a new block of a block-diagonal causal mask, so with eager and
SDPA attention no token attends across examples: tests/data/test_data.py checks that the logits equal
unpacked ones. (flash_attention_2 reads the resets only when the batch is a single row.)
The first label of every example is masked: it would otherwise be predicted from the previous
example's last token.
"""

from __future__ import annotations

import datasets

from finetune.config.names import IGNORE_INDEX
from finetune.data.formats import id_columns

PACK_BATCH = 1000  # examples packed together; a row never spans two such batches


def _pack_batch(batch: dict[str, list], max_seq_len: int) -> dict[str, list]:
    """Greedy in order: each example joins the current row if it fits, else starts a new one."""
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for input_ids, labels in zip(batch["input_ids"], batch["labels"]):
        if not rows["input_ids"] or len(rows["input_ids"][-1]) + len(input_ids) > max_seq_len:
            for column in rows.values():
                column.append([])
        rows["input_ids"][-1] += input_ids
        rows["labels"][-1] += [IGNORE_INDEX] + labels[1:]
        rows["position_ids"][-1] += list(range(len(input_ids)))
    return rows


def pack(examples: datasets.Dataset, max_seq_len: int) -> datasets.Dataset:
    """Rows of at most max_seq_len tokens (examples are already truncated to it), order kept."""
    return examples.map(
        _pack_batch, batched=True, batch_size=PACK_BATCH, fn_kwargs={"max_seq_len": max_seq_len},
        remove_columns=examples.column_names, desc="packing", keep_in_memory=True,  # persisted by cache.py
        features=id_columns("input_ids", "labels", "position_ids"),
    )
