"""What a rehearsal (rehearse.py) came to: what its run left behind, checked (`inspect_run`); the error
that ended it, found in the log and explained when it is a known cause (`explain_failure`); and the
report printed (`format_report`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from finetune.checkpoint.layout import complete_checkpoints, read_manifest
from finetune.config.names import STRATEGIES
from finetune.config.run_folder import CHECKPOINTS_DIR, RunFolder


@dataclass
class Rehearsal:
    """The outcome of one rehearsal, with what it saw."""

    passed: bool
    strategy: str = "did not start training"
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    output_dir: str = ""
    log: str = ""


# known failure signatures → what they mean (first match wins)
EXPLANATIONS = (
    (r"DeepSpeed config does not match the run", "The DeepSpeed JSON disagrees with the run's flags. "
     'Write "auto" for values finetune owns (batch sizes, accumulation, clipping, precision).'),
    (r"deepspeed_config_file, the following accelerate config variables will be ignored",
     "The accelerate config sets values that Accelerate takes from the DeepSpeed JSON instead: delete them from "
     "the YAML (finetune sets the precision from --precision)."),
    (r"is stuck at '", "A distributed preflight stage timed out (the processes could not talk to each other)."),
    (r"preflight failed", "The distributed preflight found a problem before weights loaded."),
    (r"async_io|libaio|nvme", "NVMe offload needs DeepSpeed's async_io op (libaio) and cannot be rehearsed on this "
     "machine; rehearse with device: cpu offload instead."),
    (r"No module named '?deepspeed", "DeepSpeed is not installed: pip install 'finetune[deepspeed]'."),
    (r"out of memory|SIGKILL|MemoryError", "A process ran out of CPU memory (or was killed)."),
    (r"No such file or directory.*\.json|DeepSpeed config not found", "The DeepSpeed JSON path is resolved from the "
     "directory you launch in; pass it relative to here or absolute."),
)



def inspect_run(run_dir: Path, steps: int, log: str) -> Rehearsal:
    """Read what a rehearsal run left behind and list everything that is missing or wrong."""
    result = Rehearsal(passed=True, output_dir=str(run_dir), log=log)
    folder = RunFolder(run_dir)
    checkpoints = complete_checkpoints(folder.checkpoints)
    if checkpoints:
        manifest = read_manifest(checkpoints[-1])
        result.strategy = f"{STRATEGIES[manifest['strategy']].label} on cpu, {manifest['world_size']} process(es)"
    steps_seen = [r for r in folder.read_metrics() if "loss" in r and "lr" in r]
    result.losses = [r["loss"] for r in steps_seen]
    result.lrs = [r["lr"] for r in steps_seen]
    if len(steps_seen) != steps:
        result.problems.append(f"expected {steps} logged optimizer steps, found {len(steps_seen)} in {folder.metrics}")
    if any(not math.isfinite(loss) for loss in result.losses):
        result.problems.append(f"non-finite loss: {result.losses}")
    weights = sorted(run_dir.glob("*.safetensors"))
    for path in weights:
        tensors, elements = safetensors_content(path)
        result.saved.append(f"{path.name} ({tensors} tensors, {elements:,} values)")
        if elements == 0:
            result.problems.append(f"{path.name} is empty: the sharded model was saved without gathering its weights")
    if not weights:
        result.problems.append(f"no final model (*.safetensors) in {run_dir}")
    if checkpoints:
        result.saved.append(f"{CHECKPOINTS_DIR}/{checkpoints[-1].name}")
    else:
        result.problems.append(f"no complete checkpoint under {folder.checkpoints}")
    result.passed = not result.problems
    return result


def safetensors_content(path: Path) -> tuple[int, int]:
    """(tensor count, total elements) from a safetensors header, without loading the data."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        shapes = [f.get_slice(name).get_shape() for name in f.keys()]
    return len(shapes), sum(math.prod(shape) for shape in shapes)


# the last line of a Python traceback (optionally prefixed by the rank), e.g. "[rank0]: ValueError: ..."
EXCEPTION_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?[\w.]*(?:Error|Exception|Interrupt)\b.*")
LAUNCHER_NOISE = ("ChildFailedError", "torch.distributed.elastic", "CalledProcessError")


def actual_error(log: str) -> str | None:
    """What made the run fail: finetune's own error message (with its indented lines), else the last
    exception a rank raised, else a rank killed by a signal; None if the log shows none of these."""
    ours = re.findall(r"finetune [\w-]+: error: .*(?:\n {2,}.*)*", log)
    if ours:
        return ours[-1].strip()
    lines = log.splitlines()
    raised = [i for i, line in enumerate(lines)
              if EXCEPTION_LINE.match(line) and not any(noise in line for noise in LAUNCHER_NOISE)]
    if raised:
        return with_details(lines, raised[-1])
    killed = re.search(r"Signal (\d+) \((SIG\w+)\)", log)
    return f"a process was killed by {killed.group(2)}" if killed else None


# where an exception's own lines end: a blank line, a new traceback, a launcher's or torch's log line
DETAILS_END = re.compile(r"^\s*$|^Traceback|^[EWI]\d{4} |^\[[EWI] |^\d{4}-\d\d-\d\d|^(W|E)\d+ ")
RANK_PREFIX = re.compile(r"^\s*\[rank\d+\]:\s?")


def with_details(lines: list[str], index: int) -> str:
    """The exception at `lines[index]` with the lines its message goes on over: a pydantic
    ValidationError names the field (`offload_optimizer.pin_memory`) only on the next line."""
    prefix = RANK_PREFIX.match(lines[index])
    kept = [lines[index].strip()]
    for line in lines[index + 1:]:
        if prefix and not line.startswith(prefix.group(0)):
            break
        body = line[prefix.end():] if prefix else line
        if DETAILS_END.match(body) or EXCEPTION_LINE.match(body) or any(noise in body for noise in LAUNCHER_NOISE):
            break
        kept.append("  " + body.strip())
    return "\n".join(kept)


def explain_failure(log: str, returncode: int) -> str:
    """The error that ended the run, with what it means when it is a known cause."""
    error = actual_error(log) or f"exit code {returncode}, no error in the log"
    for pattern, explanation in EXPLANATIONS:
        if re.search(pattern, error):
            return f"{explanation}\n    error: {error}"
    return f"The run failed: {error}"


def format_report(result: Rehearsal, steps: int) -> str:
    verdict = "PASS" if result.passed else "FAIL"
    lines = [f"rehearsal {verdict}: {result.strategy}"]
    if result.losses:
        lines.append(f"  {len(result.losses)}/{steps} steps, loss " + " → ".join(f"{loss:.4f}" for loss in result.losses))
    if result.saved:
        lines.append("  saved: " + "; ".join(result.saved))
    lines += [f"  note: {note}" for note in result.notes]
    lines += [f"  problem: {problem}" for problem in result.problems]
    if result.log:  # empty when the real run's check stopped it before anything ran
        lines.append(f"  output: {result.output_dir} (log: {Path(result.output_dir).parent / 'rehearsal.log'})")
    return "\n".join(lines)
