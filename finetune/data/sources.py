"""Where rows come from (the builtin dataset, a local file or directory, a Hub dataset) and how
the eval rows are chosen (a named split, or a seeded fraction held out of train)."""

from __future__ import annotations

from pathlib import Path

import datasets
from datasets.exceptions import DatasetsError

from finetune.data.builtin import BUILTIN_DIR, DATASET_FILE
from finetune.errors import FinetuneError

LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_splits(name: str) -> datasets.DatasetDict:
    """Every split of `name`: `builtin`, a local JSON/JSONL/CSV/Parquet file (one split, `train`),
    a local directory of such files (splits named by file, e.g. train.jsonl and test.jsonl), or a
    Hugging Face Hub dataset id."""
    path = BUILTIN_DIR / DATASET_FILE if name == "builtin" else Path(name).expanduser()
    if path.is_dir():
        return _load_local(path, str(path))
    if path.suffix.lower() in LOCAL_LOADERS or path.exists():
        if not path.is_file():
            raise FinetuneError(f"Dataset file not found: {path}")
        loader = LOCAL_LOADERS.get(path.suffix.lower())
        if loader is None:
            raise FinetuneError(f"{path}: unsupported file type; use .json, .jsonl, .csv or .parquet")
        return _load_local(loader, str(path), data_files=str(path))
    try:
        return datasets.load_dataset(name)
    except (OSError, ValueError, DatasetsError) as e:  # offline, missing and gated all end here
        raise FinetuneError(
            f"Could not load dataset '{name}' from the Hugging Face Hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}). It is not a local file either. Offline? Save it on a connected "
            "machine (datasets.load_dataset(...).to_json('data.jsonl')) and pass the file, or a directory "
            "of train/test files, to --dataset."
        ) from e


def _load_local(loader: str | Path, shown: str, **kwargs) -> datasets.DatasetDict:
    try:
        return datasets.load_dataset(str(loader), **kwargs)
    except (OSError, ValueError, DatasetsError) as e:  # parse errors: name the file, keep the reason
        reason = e.__cause__ or e
        raise FinetuneError(f"Could not read {shown}: {type(reason).__name__}: {str(reason).splitlines()[0]}") from e


def split_eval(splits: datasets.DatasetDict, eval_split: str, seed: int, source: str) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval). `eval_split` names a split of the dataset, or is a fraction of train held out
    with a shuffle seeded by `seed` (the same rows every run with that seed)."""
    if "train" not in splits:
        raise FinetuneError(f"{source} has no 'train' split; its splits are {', '.join(splits)}")
    train = splits["train"]
    try:
        fraction = float(eval_split)
    except ValueError:
        if eval_split not in splits:
            raise FinetuneError(
                f"--eval-split {eval_split!r}: {source} has splits {', '.join(splits)}. "
                "Name one of them, or give a fraction of train to hold out, e.g. --eval-split 0.05."
            ) from None
        return train, splits[eval_split]
    if not 0 < fraction < 1:
        raise FinetuneError(f"--eval-split {eval_split}: a held-out fraction must be between 0 and 1")
    held_out = max(1, round(len(train) * fraction))
    if held_out >= len(train):
        raise FinetuneError(f"--eval-split {eval_split} of {len(train)} rows leaves no training rows")
    parts = train.train_test_split(test_size=held_out, shuffle=True, seed=seed)
    return parts["train"], parts["test"]
