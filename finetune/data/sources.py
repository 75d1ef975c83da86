"""Where rows come from (the builtin dataset, a local file or directory, a Hub dataset) and how
the eval rows are chosen (a named split, or a seeded fraction held out of train)."""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow
from datasets.exceptions import DatasetsError

from finetune.data import content
from finetune.data.builtin import BUILTIN_DIR, DATASET_FILE
from finetune.errors import FinetuneError

LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
NO_ROWS_FIX = "Training needs at least one row per split: check the file was written completely, or pass another --dataset."


def local_source(name: str, builtin: str = DATASET_FILE) -> Path | None:
    """The local file or directory `name` means (`builtin` is the file of this package named `builtin`:
    the supervised rows, or the preference pairs), or None for a Hugging Face Hub dataset id."""
    path = BUILTIN_DIR / builtin if name == "builtin" else Path(name).expanduser()
    return path if path.is_dir() or path.suffix.lower() in LOCAL_LOADERS or path.exists() else None


def source_digest(name: str, builtin: str = DATASET_FILE) -> str | None:
    """The content digest of a local source (see content.py), None for a Hub dataset (its rows follow
    its revision, which `datasets` fingerprints)."""
    path = local_source(name, builtin)
    return content.digest(path) if path is not None and path.exists() else None


def load_splits(name: str, builtin: str = DATASET_FILE) -> datasets.DatasetDict:
    """Every split of `name`: `builtin`, a local JSON/JSONL/CSV/Parquet file (one split, `train`),
    a local directory of such files (splits named by file, e.g. train.jsonl and test.jsonl), or a
    Hugging Face Hub dataset id. A local source is parsed into a cache folder of its content's own,
    so rewritten rows are never read from the tables of the old ones. `builtin`: the file `builtin` means."""
    path = local_source(name, builtin)
    if path is not None and path.is_dir():
        return _load_local(path, str(path), cache_dir=str(content.sources_cache() / content.digest(path)))
    if path is not None:
        if not path.is_file():
            raise FinetuneError(f"Dataset file not found: {path}")
        loader = LOCAL_LOADERS.get(path.suffix.lower())
        if loader is None:
            raise FinetuneError(f"{path}: unsupported file type; use .json, .jsonl, .csv or .parquet")
        return _load_local(loader, str(path), data_files=str(path),
                           cache_dir=str(content.sources_cache() / content.digest(path)))
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
    """The splits of a local file or directory; every split has rows of valid UTF-8 text."""
    try:
        splits = datasets.load_dataset(str(loader), **kwargs)
    except StopIteration:  # datasets' JSON reader meeting a file without one row
        empty = [p.name for p in Path(shown).iterdir() if _is_blank(p)] if Path(shown).is_dir() else []
        raise FinetuneError(f"{shown}: {', '.join(empty) or 'the file'} holds no rows. {NO_ROWS_FIX}") from None
    except (OSError, ValueError, DatasetsError) as e:  # parse errors: name the file, keep the reason
        reason = e.__cause__ or e
        if "corresponds to no data" in str(reason):  # datasets' words for a split of 0 rows
            raise FinetuneError(f"{shown} has no rows (only blank lines, a CSV header or empty objects). {NO_ROWS_FIX}") from e
        raise FinetuneError(f"Could not read {shown}: {type(reason).__name__}: {str(reason).splitlines()[0]}") from e
    for name, split in splits.items():
        if len(split) == 0:
            raise FinetuneError(f"{shown}: split '{name}' has no rows. {NO_ROWS_FIX}")
        _check_utf8(split, shown if len(splits) == 1 else f"{shown} (split {name})")
    return splits


def _is_blank(path: Path) -> bool:
    """A data file with nothing but whitespace (bigger files are taken to hold rows)."""
    return path.suffix.lower() in LOCAL_LOADERS and path.stat().st_size < 2**16 and not path.read_bytes().strip()


def _check_utf8(split: datasets.Dataset, shown: str) -> None:
    """Refuse text that is not UTF-8. pyarrow's JSON and CSV readers keep such bytes as they are, and
    the first read of the row would fail deep inside training instead of here."""
    table = split.data.table
    for column in table.column_names:
        start = 0
        for chunk in table.column(column).chunks:
            try:
                chunk.validate(full=True)
            except pyarrow.ArrowInvalid:
                row = start + next((i for i in range(len(chunk)) if not _decodes(chunk[i])), 0)
                raise FinetuneError(
                    f"{shown}, row {row}: field '{column}' is not UTF-8 text. Save the file as UTF-8, e.g. "
                    "`iconv -f latin1 -t utf-8 in.jsonl > out.jsonl` for Latin-1 data."
                ) from None
            start += len(chunk)


def _decodes(value: pyarrow.Scalar) -> bool:
    try:
        value.as_py()
    except UnicodeDecodeError:
        return False
    return True


def split_eval(splits: datasets.DatasetDict, eval_split: str, seed: int, source: str) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval). `eval_split` names a split of the dataset, or is a fraction of train held out
    with a shuffle seeded by `seed` (the same rows every run with that seed)."""
    if "train" not in splits:
        raise FinetuneError(
            f"{source} has no 'train' split; its splits are {', '.join(splits)}. In a directory, the split is "
            "the file name: put the training rows in train.jsonl (or .json, .csv, .parquet)."
        )
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
