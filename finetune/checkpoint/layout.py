"""Where checkpoints live and when one is complete: step-N names, the manifest, finding the newest.
The file names they share with the rest of a run's folder are config/run_folder.py's."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config.run_folder import MANIFEST, RunFolder
from finetune.errors import CheckpointError

INCOMPLETE = ".incomplete"
STEP_DIR = re.compile(r"^step-(\d+)$")
FORMAT_VERSION = 2  # 2: the resolved record under run_folder.RESOLVED (1: under run_folder.FORMER_MANIFEST_KEY)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return RunFolder(output_dir).checkpoints


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


@dataclass
class Inventory:
    """What a checkpoints folder holds, each list oldest first."""

    complete: list[Path] = field(default_factory=list)
    damaged: list[tuple[Path, str]] = field(default_factory=list)  # step-N folders that fail the manifest check, and why
    unfinished: list[Path] = field(default_factory=list)  # *.incomplete: saves that never finished (crash, kill, full disk)


def step_of(checkpoint: Path) -> int:
    """N of a `step-N` folder."""
    return int(STEP_DIR.match(checkpoint.name).group(1))


def take_inventory(directory: Path) -> Inventory:
    """Sort the `step-N` folders of `directory` into complete and damaged, and list unfinished saves."""
    found = Inventory()
    if not directory.is_dir():
        return found
    for path in sorted((p for p in directory.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=step_of):
        problem = incompleteness(path)
        if problem is None:
            found.complete.append(path)
        else:
            found.damaged.append((path, problem))
    found.unfinished = sorted(p for p in directory.iterdir() if p.name.endswith(INCOMPLETE))
    return found


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete `step-N` folders in `directory`, oldest first."""
    return take_inventory(directory).complete


def find_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a checkpoint folder, else the newest complete checkpoint of the output
    dir `path`. Raises CheckpointError (saying what was found instead) when there is none, or when a
    newer one is damaged: only `--resume auto` passes over damaged checkpoints, and it says so."""
    path = Path(path)
    if (path / MANIFEST).is_file() or STEP_DIR.match(path.name):
        read_manifest(path)
        return path
    found = take_inventory(checkpoints_dir(path))
    damaged = "".join(f"\n  - {checkpoint.name} is damaged: {problem}" for checkpoint, problem in found.damaged)
    if not found.complete:
        raise CheckpointError(
            f"No complete checkpoint in {path}: expected {checkpoints_dir(path)}/step-NNNNNN/{MANIFEST}, "
            f"or a checkpoint folder itself.{damaged}"
        )
    newest = found.complete[-1]
    if found.damaged and step_of(found.damaged[-1][0]) > step_of(newest):
        raise CheckpointError(
            f"The newest checkpoints in {path} are damaged:{damaged}\nName the checkpoint to use instead "
            f"(the newest complete one is {newest}), or fix or delete the damaged ones."
        )
    return newest
