"""Training data: rows from a source, checked against their format, split into train and eval,
tokenized with the prompt masked, truncated, optionally packed, cached on disk, and collated into
padded batches.

    data = prepare_data(config, tokenizer)
    DataLoader(data.train, collate_fn=Collator(tokenizer), ...)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import datasets

from finetune.config.objectives import OBJECTIVES
from finetune.config.options import TrainConfig
from finetune.data import cache, preference
from finetune.data.builtin import BUILTIN_DIR, builtin_file
from finetune.data.collate import Collator
from finetune.data.formats import (
    CONVERSATION_KEYS,
    batch_rows,
    check_rows,
    detect_format,
    encode,
    encode_as_training,
    expected_answer,
    has_target,
    id_columns,
    prompt_ids,
)
from finetune.data.packing import pack
from finetune.data.sources import load_splits, source_digest, split_eval
from finetune.errors import FinetuneError

__all__ = ["BUILTIN_DIR", "Collator", "PreparedData", "prepare_data"]

# Rows per tokenizing process when --dataset-num-proc is unset: below this, starting a process and
# shipping it the tokenizer costs more than it saves (bench/data_prep.py).
ROWS_PER_PROCESS = 20_000


@dataclass
class PreparedData:
    # input_ids, labels (-100 where no loss); position_ids too when packed. Preference objectives:
    # the columns of data/preference.py (PAIR_COLUMNS or LABELLED_COLUMNS), eval alike
    train: datasets.Dataset
    eval: datasets.Dataset  # never packed
    # exact-match material, one per eval row with a single answer (none for text):
    # {"prompt_ids": ids generation starts from, exactly as in training; "prompt": their text;
    #  "expected": the answer to compare the greedy completion with}
    eval_prompts: list[dict]
    format: str  # alpaca, chat, sharegpt, text, preference or labelled: as given by --format, or detected from the columns
    cache_entry: Path | None = None  # the cache folder train and eval are read from; None without a cache
    reused: bool = False  # found in the cache, rather than tokenized by this call

    @property
    def origin(self) -> str:
        if self.cache_entry is None:
            return "tokenized in memory (--data-cache none)"
        return f"{'reused from' if self.reused else 'tokenized into'} {self.cache_entry}"


def prepare_data(config: TrainConfig, tokenizer) -> PreparedData:
    """Load `config.dataset`, check every row against its format, hold out the eval rows (at most
    `config.max_eval_examples`), tokenize, and pack train if `config.packing`. Deterministic for a
    given config (the held-out rows depend on `config.seed`). The result is cached (see cache.py):
    a later call with the same rows, tokenizer and options reads it back instead of tokenizing.

    Raises FinetuneError for a missing or unreadable source, an unknown split, a row that does not
    fit the format (naming the row and the fields it has), a tokenizer that cannot render it, or a
    cache directory that cannot be written.
    """
    builtin = builtin_file(OBJECTIVES[config.objective].preference)
    splits = load_splits(config.dataset, builtin)
    root = cache.cache_root(config.data_cache)
    if root is None:
        return _prepare(splits, config, tokenizer)
    entry = root / cache.fingerprint(config, splits, tokenizer, source_digest(config.dataset, builtin))
    reused = cache.exists(entry)
    if not reused:
        data = _prepare(splits, config, tokenizer)
        meta = {"format": data.format, "eval_prompts": data.eval_prompts}
        cache.write(entry, datasets.DatasetDict(train=data.train, eval=data.eval), meta)
    tables, meta = cache.read(entry)
    return PreparedData(train=tables["train"], eval=tables["eval"], eval_prompts=meta["eval_prompts"],
                        format=meta["format"], cache_entry=entry, reused=reused)


def fit_run_to_data(data: PreparedData, tokenizer, batch_sizes: dict[str, int | None]) -> None:
    """Make the tokenizer the run saves encode prompts as this data was encoded (`encode_as_training`),
    and refuse a batch size flag the user gave (name → value, None when unset) of more examples than
    training has: it would silently train on fewer than it says. (A default larger than a tiny data
    set is not the user's claim: the loader then serves what there is.)"""
    encode_as_training(tokenizer, data.format)
    rows = len(data.train)
    for flag, size in batch_sizes.items():
        if size is not None and size > rows:
            raise FinetuneError(f"--{flag} {size:,} is more than the {rows:,} training examples; use --{flag} {rows} or less.")


def _prepare(splits: datasets.DatasetDict, config: TrainConfig, tokenizer) -> PreparedData:
    if OBJECTIVES[config.objective].preference:
        return _prepare_preference(splits, config, tokenizer)
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


def _prepare_preference(splits: datasets.DatasetDict, config: TrainConfig, tokenizer) -> PreparedData:
    """`_prepare` for a preference objective: rows checked, held out, encoded as pairs or labelled rows
    (data/preference.py); exact match compares greedy answers with the chosen ones of the eval pairs."""
    objective = OBJECTIVES[config.objective]
    train_rows, eval_rows = split_eval(splits, config.eval_split, config.seed, config.dataset)
    fmt = preference.detect_preference_format(train_rows.column_names, config.dataset, objective)
    for name, rows in splits.items():
        if name in ("train", config.eval_split):
            preference.check_preference_rows(rows, fmt, config.dataset if name == "train" else f"{config.dataset} (split {name})")
    _check_tokenizer(tokenizer, "chat" if _conversational(train_rows) else fmt)
    eval_rows = eval_rows.select(range(min(len(eval_rows), config.max_eval_examples)))
    eval_prompts = []
    if fmt == "preference":
        for row in eval_rows:
            ids, expected = preference.preference_prompt_ids(row, tokenizer)
            eval_prompts.append({"prompt_ids": ids, "prompt": tokenizer.decode(ids, skip_special_tokens=True),
                                 "expected": expected})
    train, eval_ = (_encode_preference(rows, fmt, objective.rows, tokenizer, config) for rows in (train_rows, eval_rows))
    if len(train) == 0:
        raise FinetuneError(f"{config.dataset}: no training example keeps an answer token on both sides within "
                            f"--max-seq-len {config.max_seq_len}; raise it or shorten the prompts.")
    return PreparedData(train=train, eval=eval_, eval_prompts=eval_prompts, format=fmt)


def _conversational(rows: datasets.Dataset) -> bool:
    first = rows[0] if len(rows) else {}
    return any(isinstance(first.get(name), list) for name in ("chosen", "completion"))


def _encode_preference(rows: datasets.Dataset, fmt: str, kind: str, tokenizer, config: TrainConfig) -> datasets.Dataset:
    """Paired rows as PAIR_COLUMNS, labelled rows (pairs unpaired first, for KTO) as LABELLED_COLUMNS."""
    features = preference.features(kind)
    if len(rows) == 0:
        return datasets.Dataset.from_dict({name: [] for name in features} | {"row": []},
                                          features=datasets.Features({**features, "row": datasets.Value("int64")}))
    if kind == "labelled" and fmt == "preference":
        rows = rows.map(preference.unpaired, batched=True, remove_columns=rows.column_names, keep_in_memory=True)
    encode = preference.encode_pairs if kind == "paired" else preference.encode_labelled
    processes = tokenize_processes(config.dataset_num_proc, len(rows))
    encoded = rows.map(encode, batched=True, remove_columns=rows.column_names, desc=f"tokenizing ({fmt})",
                       keep_in_memory=True, num_proc=processes if processes > 1 else None, features=features,
                       fn_kwargs={"tokenizer": tokenizer, "max_seq_len": config.max_seq_len})
    # each row's index: precomputed reference log-probabilities are found by it (data/collate.PreferenceCollator)
    return encoded.add_column("row", list(range(len(encoded))))


def _check_tokenizer(tokenizer, fmt: str) -> None:
    if tokenizer.eos_token_id is None:
        raise FinetuneError("The tokenizer has no EOS token: responses need one so generation knows where to stop.")
    if fmt in CONVERSATION_KEYS and not tokenizer.chat_template:
        raise FinetuneError(
            "Chat rows are rendered with the tokenizer's chat template, and this tokenizer has none. "
            "Use a chat model's tokenizer, or convert the data to the alpaca format."
        )


def _encode_batch(batch: dict[str, list], fmt: str, tokenizer, train_on_prompt: bool, max_seq_len: int) -> dict:
    """Encode rows, dropping those that truncation left with nothing to learn."""
    encoded = encode(batch_rows(batch), fmt, tokenizer, train_on_prompt, max_seq_len)
    kept = [example for example in encoded if has_target(example["labels"])]
    return {"input_ids": [example["input_ids"] for example in kept], "labels": [example["labels"] for example in kept]}


def tokenize_processes(setting: int | None, rows: int) -> int:
    """--dataset-num-proc, or one process per ROWS_PER_PROCESS rows up to the CPUs this process may use."""
    return setting or max(1, min(len(os.sched_getaffinity(0)), rows // ROWS_PER_PROCESS))


def _tokenize(rows: datasets.Dataset, fmt: str, tokenizer, config: TrainConfig) -> datasets.Dataset:
    features = id_columns("input_ids", "labels")
    if len(rows) == 0:  # eval off (--max-eval-examples 0): `map` would leave a table without columns
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    processes = tokenize_processes(config.dataset_num_proc, len(rows))
    # in memory: the cache (cache.py) is what persists, under a name that covers our code too
    return rows.map(
        _encode_batch, batched=True, remove_columns=rows.column_names, desc=f"tokenizing ({fmt})",
        keep_in_memory=True, num_proc=processes if processes > 1 else None, features=features,
        fn_kwargs={"fmt": fmt, "tokenizer": tokenizer, "train_on_prompt": config.train_on_prompt,
                   "max_seq_len": config.max_seq_len},
    )
