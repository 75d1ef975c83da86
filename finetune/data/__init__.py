"""Training data: rows from a source, rendered in their format, tokenized with the prompt masked,
truncated, optionally packed, and collated into padded batches.

    data = prepare_data(config, tokenizer)   # PreparedData(train, eval, eval_prompts, format)
    DataLoader(data.train, collate_fn=Collator(tokenizer), ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets

from finetune.config import TrainConfig
from finetune.data.builtin import BUILTIN_DIR
from finetune.data.collate import Collator
from finetune.data.formats import ENCODERS, FORMAT_COLUMNS, IGNORE_INDEX, detect_format, find_bad_row, generation_prompt
from finetune.data.packing import pack
from finetune.data.sources import load_rows, split_eval
from finetune.errors import FinetuneError

__all__ = ["BUILTIN_DIR", "Collator", "PreparedData", "prepare_data"]


@dataclass
class PreparedData:
    train: datasets.Dataset  # input_ids, labels (and position_ids when packed)
    eval: datasets.Dataset  # input_ids, labels; never packed
    eval_prompts: list[dict]  # {"prompt_ids", "prompt", "expected"} for exact-match generation
    format: str


def prepare_data(config: TrainConfig, tokenizer) -> PreparedData:
    """Load, check, split, tokenize, truncate and (optionally) pack the run's data.

    Raises FinetuneError naming the dataset, the row and the fields when rows do not fit the format.
    """
    rows = load_rows(config.dataset)
    fmt = resolve_format(rows, config)
    train_rows, eval_rows = split_eval(rows, config.eval_split, config.dataset, config.seed)
    eval_rows = eval_rows.select(range(min(len(eval_rows), config.max_eval_examples)))
    train, eval_ = (tokenize(part, fmt, tokenizer, config) for part in (train_rows, eval_rows))
    if len(train) == 0:
        raise FinetuneError(f"{config.dataset}: no training example has a response token within "
                            f"--max-seq-len {config.max_seq_len}; raise it or shorten the prompts")
    if config.packing:
        train = datasets.Dataset.from_list(pack(list(train), config.max_seq_len))
    prompts = [generation_prompt(row, fmt, tokenizer) for row in eval_rows]
    eval_prompts = [{"prompt_ids": ids, "prompt": text, "expected": expected}
                    for ids, text, expected in filter(None, prompts)]
    return PreparedData(train=train, eval=eval_, eval_prompts=eval_prompts, format=fmt)


def resolve_format(rows: datasets.Dataset, config: TrainConfig) -> str:
    """--format, or the format detected from the columns; every row is checked against it."""
    columns = rows.column_names
    fmt = detect_format(columns) if config.format == "auto" else config.format
    if fmt is None or not FORMAT_COLUMNS[fmt][0] <= set(columns):
        expected = "; ".join(f"{name}: {', '.join(sorted(required))}" for name, (required, _) in FORMAT_COLUMNS.items())
        wanted = f"format {fmt} needs {', '.join(sorted(FORMAT_COLUMNS[fmt][0]))}" if fmt else f"expected columns ({expected})"
        raise FinetuneError(f"{config.dataset}: row 0: {wanted}; found columns: {', '.join(columns)}")
    bad = find_bad_row(rows, fmt)
    if bad is not None:
        raise FinetuneError(f"{config.dataset}: row {bad[0]}: {bad[1]} (format {fmt}; columns found: {', '.join(columns)})")
    return fmt


def tokenize(rows: datasets.Dataset, fmt: str, tokenizer, config: TrainConfig) -> datasets.Dataset:
    """input_ids/labels per row, truncated to --max-seq-len; rows left with no target token dropped."""
    if fmt == "chat" and not tokenizer.chat_template:
        raise FinetuneError(f"{config.dataset}: chat rows need a tokenizer with a chat template; "
                            "this tokenizer has none. Use --format alpaca/text or a chat model's tokenizer.")
    encode = ENCODERS[fmt]

    def encode_row(row: dict) -> dict:
        example = encode(row, tokenizer, config.train_on_prompt)
        return {key: values[: config.max_seq_len] for key, values in example.items()}

    encoded = rows.map(encode_row, remove_columns=rows.column_names, desc=f"tokenizing ({fmt})")
    return encoded.filter(lambda example: any(label != IGNORE_INDEX for label in example["labels"][1:]))
