"""Where rows come from: the builtin dataset, a local file, or a Hub dataset; and the eval split."""

from __future__ import annotations

from pathlib import Path

import datasets

from finetune.data.builtin import BUILTIN_DIR, DATASET_FILE
from finetune.errors import FinetuneError

LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(name: str, split: str = "train") -> datasets.Dataset:
    """The rows of `name`: `builtin`, a local JSON/JSONL/CSV/Parquet file, or a Hub dataset id."""
    if name == "builtin":
        return datasets.load_dataset("json", data_files=str(BUILTIN_DIR / DATASET_FILE), split="train")
    path = Path(name).expanduser()
    if path.suffix.lower() in LOCAL_LOADERS or path.exists():
        if not path.is_file():
            raise FinetuneError(f"Dataset file not found: {path}")
        loader = LOCAL_LOADERS.get(path.suffix.lower())
        if loader is None:
            raise FinetuneError(f"{path}: unsupported file type; use .json, .jsonl, .csv or .parquet")
        try:
            return datasets.load_dataset(loader, data_files=str(path), split="train")
        except Exception as e:  # pyarrow/datasets parse errors: name the file, keep the library's reason
            raise FinetuneError(f"Could not read {path} as {loader}: {str(e).splitlines()[0]}") from e
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, missing, gated: all end the same way for the user
        raise FinetuneError(
            f"Could not load dataset '{name}' split '{split}' ({type(e).__name__}: {str(e).splitlines()[0]}). "
            "If this machine is offline, download it elsewhere and pass a local .jsonl/.parquet file to --dataset."
        ) from e


def split_eval(rows: datasets.Dataset, eval_split: str, dataset: str, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval): `eval_split` is a fraction of train to hold out (e.g. 0.05) or a split name."""
    try:
        fraction = float(eval_split)
    except ValueError:
        if dataset == "builtin" or Path(dataset).suffix.lower() in LOCAL_LOADERS:
            raise FinetuneError(f"--eval-split {eval_split!r}: a local file has one split; give a fraction such as 0.05")
        return rows, load_rows(dataset, eval_split)
    if not 0 < fraction < 1:
        raise FinetuneError(f"--eval-split {eval_split}: a held-out fraction must be between 0 and 1")
    held_out = max(1, round(len(rows) * fraction))
    if held_out >= len(rows):
        raise FinetuneError(f"--eval-split {eval_split} leaves no training rows out of {len(rows)}")
    parts = rows.train_test_split(test_size=held_out, shuffle=True, seed=seed)
    return parts["train"], parts["test"]
