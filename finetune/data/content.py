"""What a local dataset holds: a digest of its bytes, the key both caches of its rows go by.

`datasets` keys the Arrow tables it parses a local file into by the file's path and modification
time, and so did the tokenized-data cache: a file rewritten with other rows and its old mtime put
back (`touch -d`, a copy tool that keeps times, a checkout) was served stale. The rows are now
keyed by a SHA-256 streamed over the file's bytes. Hashing a large file on every run costs seconds,
so the digest is stored beside the parsed tables under the file's (size, mtime, ctime, inode) stamp
and reused while the stamp holds; any write changes the ctime, which no tool can set back, so the
stamp is only the way to find a digest again, never the key itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from datasets.config import HF_DATASETS_CACHE

# under datasets' own cache: the parsed tables of each content, and the stored digests
SOURCES_DIR = "finetune-sources"
DIGESTS_DIR = "digests"
CHUNK = 1 << 20


def sources_cache() -> Path:
    """Where `datasets` keeps the tables parsed from local files, one folder per content."""
    return Path(HF_DATASETS_CACHE) / SOURCES_DIR


def digest(path: Path) -> str:
    """The SHA-256 of a data file, or of every visible file of a directory with its relative name."""
    if path.is_file():
        return file_digest(path)
    hasher = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))):
        hasher.update(f"{file.relative_to(path).as_posix()}\0{file_digest(file)}\n".encode())
    return hasher.hexdigest()


def file_digest(path: Path) -> str:
    """The SHA-256 of `path`'s bytes: the stored one while the file's stamp is unchanged, else
    streamed from the file and stored (best effort: an unwritable cache only costs the fast path)."""
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    record = sources_cache() / DIGESTS_DIR / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.json"
    try:
        stored = json.loads(record.read_text())
        if stored["stamp"] == stamp:
            return stored["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            hasher.update(chunk)
    _store(record, {"stamp": stamp, "sha256": hasher.hexdigest()})
    return hasher.hexdigest()


def _store(record: Path, value: dict) -> None:
    partial = record.with_name(f"{record.name}.tmp-{os.getpid()}")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(value))
        os.replace(partial, record)
    except OSError:
        partial.unlink(missing_ok=True)


def _hidden(relative: Path) -> bool:
    return any(part.startswith((".", "_")) for part in relative.parts)
