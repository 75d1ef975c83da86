"""Tokenized data on disk, reused by every run and every process that would tokenize the same rows
the same way.

An entry is named by a fingerprint of everything that decides its contents: the rows (a local
source's content digest, a SHA-256 of its bytes (content.py), or for a Hub dataset the fingerprints
`datasets` gives the loaded splits, which follow its revision), the tokenizer (what
`save_pretrained` writes: vocabulary, merges, special tokens, chat template), the data options
(`DATA_OPTIONS`), the source of this package, and the versions of the libraries that render and
tokenize. Changing any of them makes a new entry; nothing is ever updated in place.

Entries are written to a folder of their own and renamed into place, so a reader never sees half an
entry, and several nodes sharing one filesystem may race to write the same entry: the first rename
wins and the others drop their identical copy. Readers memory-map the Arrow files, so the processes
of a node share one copy of the data in the page cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
from importlib.metadata import version
from pathlib import Path

import datasets

from finetune.errors import FinetuneError

CACHE_ENV = "FINETUNE_DATA_CACHE"
# every TrainConfig field the data layer reads (tests/data/test_data_cache.py keeps this list complete)
DATA_OPTIONS = ("dataset", "format", "train_on_prompt", "max_seq_len", "packing", "eval_split", "max_eval_examples", "seed",
                "objective")
LIBRARIES = ("datasets", "jinja2", "tokenizers", "transformers")
META_FILE = "prepared.json"


def cache_root(setting: str | None) -> Path | None:
    """The cache directory for --data-cache: a path, `none` (no cache), or unset: $FINETUNE_DATA_CACHE,
    else $XDG_CACHE_HOME/finetune/data (~/.cache/finetune/data)."""
    setting = setting or os.environ.get(CACHE_ENV)
    if setting:
        return None if setting.lower() == "none" else Path(setting).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "data"


def _digest(*parts: bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little") + part)
    return hasher.hexdigest()


def _tokenizer_digest(tokenizer) -> str:
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        files = sorted(Path(directory).rglob("*"))
        return _digest(*(part for path in files if path.is_file() for part in (path.name.encode(), path.read_bytes())))


def _code_digest() -> str:
    sources = sorted(Path(__file__).parent.glob("*.py"))
    return _digest(*(part for path in sources for part in (path.name.encode(), path.read_bytes())))


def fingerprint(config, splits: datasets.DatasetDict, tokenizer, content: str | None) -> str:
    """The entry name for preparing `splits` with `tokenizer` as `config` says; `content` is the
    digest of a local source's bytes (None for a Hub dataset)."""
    ingredients = {
        "rows": content or {name: split._fingerprint for name, split in splits.items()},
        "tokenizer": _tokenizer_digest(tokenizer),
        "options": {name: getattr(config, name) for name in DATA_OPTIONS},
        "code": _code_digest(),
        "libraries": {name: version(name) for name in LIBRARIES},
    }
    return _digest(json.dumps(ingredients, sort_keys=True).encode())[:20]


def exists(entry: Path) -> bool:
    """Whether `entry` was published: its metadata is written last, before the rename that publishes it."""
    return (entry / META_FILE).is_file()


def read(entry: Path) -> tuple[datasets.DatasetDict, dict]:
    """The tables (memory-mapped) and metadata of a published entry."""
    try:
        return datasets.load_from_disk(str(entry)), json.loads((entry / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise FinetuneError(f"The tokenized-data cache entry {entry} is unreadable ({e}); delete it and run again.") from e


def write(entry: Path, tables: datasets.DatasetDict, meta: dict) -> None:
    """Publish an entry atomically; if another process published it first, keep theirs."""
    partial = entry.with_name(f"{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # an empty table would be saved as 0 shards, which load_from_disk cannot read back
        tables.save_to_disk(str(partial), num_shards={name: 1 for name, table in tables.items() if len(table) == 0})
        (partial / META_FILE).write_text(json.dumps(meta))
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise FinetuneError(
            f"Could not write tokenized data to {entry.parent} ({e.strerror or e}). Point --data-cache "
            f"(or ${CACHE_ENV}) at a writable directory, or pass --data-cache none to keep it in memory."
        ) from e
    try:
        os.replace(partial, entry)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if not exists(entry):
            raise
        # else another node published the same entry first; its contents are the same
