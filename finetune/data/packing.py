"""Packing: several examples per row, with position ids restarting at 0 for each example.

With `position_ids` and no `attention_mask`, transformers' mask builder (masking_utils) derives
a block-diagonal causal mask from the position resets, so no token attends across examples. The
first label of every example is masked: it would otherwise be predicted from the previous example.
"""

from __future__ import annotations

from finetune.data.formats import IGNORE_INDEX


def pack(examples: list[dict], max_seq_len: int) -> list[dict]:
    """Greedy first-fit in order: append each example to the current row while it fits."""
    rows, current = [], {"input_ids": [], "labels": [], "position_ids": []}
    for example in examples:
        length = len(example["input_ids"])
        if current["input_ids"] and len(current["input_ids"]) + length > max_seq_len:
            rows.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += example["input_ids"]
        current["labels"] += [IGNORE_INDEX] + example["labels"][1:]
        current["position_ids"] += list(range(length))
    if current["input_ids"]:
        rows.append(current)
    return rows
