"""Batches of variable-length rows: right padding, with padded labels ignored by the loss."""

from __future__ import annotations

import torch

from finetune.config.names import IGNORE_INDEX
from finetune.errors import FinetuneError


class Collator:
    """list of {input_ids, labels[, position_ids]} → dict of padded tensors for `model(**batch)`.

    Unpacked rows get an `attention_mask` (1 on tokens, 0 on padding). Packed rows get
    `position_ids` and no `attention_mask`, since a mask would switch off transformers' detection of
    the example boundaries (see packing.py); their padding gets positions 0, 1, … of its own, so it
    is one more example that nothing attends to and that has no loss. With `flatten` (an attention
    kernel that reads the examples' offsets: finetune.config.switches.FLATTENING_ATTENTIONS), packed rows
    come as one row instead (`flattened`).

    Why not transformers' DataCollatorForSeq2Seq for unpacked rows: it pads on the tokenizer's
    `padding_side`, which is "left" for many chat tokenizers, and without position ids a Llama-family
    model then gives every left-padded row shifted positions, so a row's loss would depend on its
    batch mates. This collator pads right for training whatever the tokenizer says (generation does
    not pad: loop.greedy_completions answers one prompt at a time), and serves packed rows too.
    """

    def __init__(self, tokenizer, context_parallel: int = 1, flatten: bool = False):
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_token_id is None:
            raise FinetuneError("The tokenizer has neither a pad nor an EOS token to pad batches with.")
        self.pad_token_id = pad_token_id  # any id works: padding is never attended to nor learnt
        self.context_parallel = context_parallel
        self.flatten = flatten

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor | int]:
        if self.flatten and "position_ids" in rows[0]:
            return flattened(rows)
        width = max(len(row["input_ids"]) for row in rows)
        if self.context_parallel > 1:  # 2 chunks per rank of each row (ring attention's load balance)
            width = -(-width // (2 * self.context_parallel)) * 2 * self.context_parallel
        padding = [width - len(row["input_ids"]) for row in rows]
        batch = {
            "input_ids": [row["input_ids"] + [self.pad_token_id] * pad for row, pad in zip(rows, padding)],
            "labels": [row["labels"] + [IGNORE_INDEX] * pad for row, pad in zip(rows, padding)],
        }
        if "position_ids" in rows[0]:
            batch["position_ids"] = [row["position_ids"] + list(range(pad)) for row, pad in zip(rows, padding)]
        elif self.context_parallel > 1:
            sequence_sharded(batch, width)
        else:
            batch["attention_mask"] = [[1] * len(row["input_ids"]) + [0] * pad for row, pad in zip(rows, padding)]
        return {key: torch.tensor(value) for key, value in batch.items()}


def sequence_sharded(batch: dict, width: int) -> None:
    """What a context-parallel forward needs besides the ids: ring attention applies the causal mask
    alone, which is exact for right-padded rows (no token before the padding attends to it), so no
    attention mask; positions, since each rank holds a slice of every row; and labels shifted
    already (`shift_labels`), since shifting inside a slice would pair a slice's last token with
    nothing."""
    batch["position_ids"] = [list(range(width)) for _ in batch["input_ids"]]
    batch["shift_labels"] = [labels[1:] + [IGNORE_INDEX] for labels in batch["labels"]]


class PreferenceCollator:
    """Batches of preference rows (data/preference.py), each as the sequences one forward reads.

    Pairs: the chosen sequences of the rows, then their rejected ones, in one right-padded batch of
    2 × rows (`input_ids`, `attention_mask`, `labels`), so the policy and the reference each read a
    micro-batch's pairs in one forward. Labelled rows (KTO): the rows' own sequences, `desirable`,
    and their mismatched sequences as `kl_input_ids`, `kl_attention_mask`, `kl_labels`.

    `reference`, once set (train/reference.py precomputes it after the model is prepared, when the
    loaders exist already), holds the reference's log-probabilities of every row of the split by the
    row's index (`row`): each batch then carries them as `reference_logps` (and `reference_kl_logps`),
    in the order of its sequences.
    """

    def __init__(self, tokenizer):
        self.pad = Collator(tokenizer)
        self.reference: dict[str, torch.Tensor] | None = None

    def padded(self, ids: list[list[int]], labels: list[list[int]], prefix: str = "") -> dict[str, torch.Tensor]:
        batch = self.pad([{"input_ids": i, "labels": label} for i, label in zip(ids, labels)])
        return {prefix + key: value for key, value in batch.items()}

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if "chosen_input_ids" in rows[0]:
            batch = self.padded([r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows],
                                [r["chosen_labels"] for r in rows] + [r["rejected_labels"] for r in rows])
            sides = {"reference_logps": ("chosen", "rejected")}
        else:
            batch = self.padded([r["input_ids"] for r in rows], [r["labels"] for r in rows])
            batch.update(self.padded([r["kl_input_ids"] for r in rows], [r["kl_labels"] for r in rows], prefix="kl_"))
            batch["desirable"] = torch.tensor([bool(r["desirable"]) for r in rows])
            sides = {"reference_logps": ("own",), "reference_kl_logps": ("kl",)}
        if self.reference is not None:
            index = torch.tensor([r["row"] for r in rows])
            for key, names in sides.items():
                batch[key] = torch.cat([self.reference[name][index] for name in names])
        return batch


def flattened(rows: list[dict]) -> dict[str, torch.Tensor | int]:
    """Packed rows as one row of their examples, without padding, for attention kernels that take
    each example's offsets: `cu_seq_lens_q` / `_k` (int32: where each example starts, then the total)
    and `max_length_q` / `_k` (the longest example, an int, so no layer asks the GPU for it), the
    keywords transformers hands its attention functions. transformers' flash path finds the examples
    of packed rows from their position ids only when the batch is a single row, so a micro-batch of
    several rows would let examples attend to each other. The loss is a token-weighted sum, so the
    one row trains as the rows do: its only new pairs, a row's last token with the next row's first
    label, predict nothing, since packing masks every example's first label."""
    positions = [position for row in rows for position in row["position_ids"]]
    offsets = [i for i, position in enumerate(positions) if position == 0] + [len(positions)]
    longest = max(end - start for start, end in zip(offsets, offsets[1:]))
    cu_seq_lens = torch.tensor(offsets, dtype=torch.int32)
    return {"input_ids": torch.tensor([[token for row in rows for token in row["input_ids"]]]),
            "labels": torch.tensor([[label for row in rows for label in row["labels"]]]),
            "position_ids": torch.tensor([positions]),
            "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest, "max_length_k": longest}
