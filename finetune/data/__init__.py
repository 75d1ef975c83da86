"""Training data: rows from a source, checked against their format, split into train and eval,
tokenized with the prompt masked, truncated, optionally packed, and collated into padded batches.

    data = prepare_data(config, tokenizer)
    DataLoader(data.train, collate_fn=Collator(tokenizer), ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets

from finetune.config import TrainConfig
from finetune.data.builtin import BUILTIN_DIR
from finetune.data.collate import Collator
from finetune.data.formats import check_rows, detect_format, encode, expected_answer, has_target, prompt_ids
from finetune.data.packing import pack
from finetune.data.sources import load_splits, split_eval
from finetune.errors import FinetuneError

__all__ = ["BUILTIN_DIR", "Collator", "PreparedData", "prepare_data"]


@dataclass
class PreparedData:
    train: datasets.Dataset  # input_ids, labels (-100 where no loss); position_ids too when packed
    eval: datasets.Dataset  # input_ids, labels; never packed
    # exact-match material, one per eval row with a single answer (none for text):
    # {"prompt_ids": ids generation starts from, exactly as in training; "prompt": their text;
    #  "expected": the answer to compare the greedy completion with}
    eval_prompts: list[dict]
    format: str  # alpaca, chat or text: as given by --format, or detected from the columns


def prepare_data(config: TrainConfig, tokenizer) -> PreparedData:
    """Load `config.dataset`, check every row against its format, hold out the eval rows (at most
    `config.max_eval_examples`), tokenize, and pack train if `config.packing`. Deterministic for a
    given config (the held-out rows depend on `config.seed`).

    Raises FinetuneError for a missing or unreadable source, an unknown split, a row that does not
    fit the format (naming the row and the fields it has), or a tokenizer that cannot render it.
    """
    splits = load_splits(config.dataset)
    train_rows, eval_rows = split_eval(splits, config.eval_split, config.seed, config.dataset)
    fmt = detect_format(train_rows.column_names, config.dataset) if config.format == "auto" else config.format
    check_rows(splits["train"], fmt, config.dataset)
    if config.eval_split in splits:
        check_rows(splits[config.eval_split], fmt, f"{config.dataset} (split {config.eval_split})")
    _check_tokenizer(tokenizer, fmt)

    eval_rows = eval_rows.select(range(min(len(eval_rows), config.max_eval_examples)))
    train, eval_ = (_tokenize(rows, fmt, tokenizer, config) for rows in (train_rows, eval_rows))
    if len(train) == 0:
        raise FinetuneError(
            f"{config.dataset}: no training example keeps a token to learn within --max-seq-len "
            f"{config.max_seq_len}; raise it or shorten the prompts."
        )
    if config.packing:
        train = pack(train, config.max_seq_len)
    eval_prompts = []
    for row in eval_rows:
        ids = prompt_ids(row, fmt, tokenizer)
        if ids is not None:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            eval_prompts.append({"prompt_ids": ids, "prompt": text, "expected": expected_answer(row, fmt)})
    return PreparedData(train=train, eval=eval_, eval_prompts=eval_prompts, format=fmt)


def _check_tokenizer(tokenizer, fmt: str) -> None:
    if tokenizer.eos_token_id is None:
        raise FinetuneError("The tokenizer has no EOS token: responses need one so generation knows where to stop.")
    if fmt == "chat" and not tokenizer.chat_template:
        raise FinetuneError(
            "Chat rows are rendered with the tokenizer's chat template, and this tokenizer has none. "
            "Use a chat model's tokenizer, or convert the data to the alpaca format."
        )


def _encode_batch(batch: dict[str, list], fmt: str, tokenizer, train_on_prompt: bool, max_seq_len: int) -> dict:
    """Encode rows, dropping those that truncation left with nothing to learn."""
    encoded = [encode(dict(zip(batch, values)), fmt, tokenizer, train_on_prompt, max_seq_len) for values in zip(*batch.values())]
    kept = [example for example in encoded if has_target(example["labels"])]
    return {"input_ids": [example["input_ids"] for example in kept], "labels": [example["labels"] for example in kept]}


def _tokenize(rows: datasets.Dataset, fmt: str, tokenizer, config: TrainConfig) -> datasets.Dataset:
    # in memory: datasets fingerprints module functions by name, so a cache would outlive code changes
    return rows.map(
        _encode_batch, batched=True, remove_columns=rows.column_names, desc=f"tokenizing ({fmt})", keep_in_memory=True,
        fn_kwargs={"fmt": fmt, "tokenizer": tokenizer, "train_on_prompt": config.train_on_prompt,
                   "max_seq_len": config.max_seq_len},
    )
