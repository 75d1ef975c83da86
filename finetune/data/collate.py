"""Batches of variable-length rows: right padding, padded labels ignored by the loss."""

from __future__ import annotations

import torch

from finetune.data.formats import IGNORE_INDEX


class Collator:
    """list of {input_ids, labels[, position_ids]} → padded tensors.

    Unpacked rows get an `attention_mask`. Packed rows get `position_ids` instead (see packing.py);
    their padding continues the positions, forming one more masked-out "example".
    """

    def __init__(self, tokenizer):
        self.pad_token_id = tokenizer.pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(row["input_ids"]) for row in rows)

        def padded(key: str, fill: int) -> torch.Tensor:
            return torch.tensor([row[key] + [fill] * (width - len(row[key])) for row in rows])

        batch = {"input_ids": padded("input_ids", self.pad_token_id), "labels": padded("labels", IGNORE_INDEX)}
        if "position_ids" in rows[0]:
            batch["position_ids"] = torch.tensor([row["position_ids"] + list(range(width - len(row["position_ids"])))
                                                  for row in rows])
        else:
            batch["attention_mask"] = torch.tensor([[1] * len(row["input_ids"]) + [0] * (width - len(row["input_ids"]))
                                                    for row in rows])
        return batch
