"""Where checkpoints live and when one is complete: names, manifest, finding the newest."""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetune.errors import FinetuneError

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
HF_DIR = "hf"  # model config, generation config, tokenizer (and adapter config): what export needs besides weights
INCOMPLETE = ".incomplete"
STEP_DIR = re.compile(r"^step-(\d+)$")
FORMAT_VERSION = 1


class CheckpointError(FinetuneError):
    """A checkpoint that cannot be resumed or exported; the message says why and what to do."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def read_manifest(checkpoint: Path) -> dict:
    """The checkpoint's manifest; raises CheckpointError if the folder is not a complete checkpoint."""
    problem = incompleteness(checkpoint)
    if problem:
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint: {problem}.")
    return json.loads((checkpoint / MANIFEST).read_text())


def incompleteness(checkpoint: Path) -> str | None:
    """Why `checkpoint` is not complete (no manifest, a file missing or of the wrong size), or None."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish)"
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable {MANIFEST} ({e})"
    for entry in manifest.get("files", []):
        path = checkpoint / entry["path"]
        if not path.is_file():
            return f"{entry['path']} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{entry['path']} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
    return None


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete `step-N` folders in `directory`, oldest first."""
    found = []
    for path in directory.glob("step-*") if directory.is_dir() else ():
        match = STEP_DIR.match(path.name)
        if match and path.is_dir() and incompleteness(path) is None:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def find_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a checkpoint folder, else the newest complete checkpoint of the output
    dir `path`. Raises CheckpointError (saying what was found instead) when there is none."""
    path = Path(path)
    if (path / MANIFEST).is_file() or STEP_DIR.match(path.name):
        read_manifest(path)
        return path
    candidates = complete_checkpoints(checkpoints_dir(path))
    if not candidates:
        raise CheckpointError(
            f"No complete checkpoint in {path}: expected {checkpoints_dir(path)}/step-NNNNNN/{MANIFEST}, "
            "or a checkpoint folder itself."
        )
    return candidates[-1]
