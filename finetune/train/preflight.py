"""Preflight: before any weights load, prove the distributed job can work, or fail saying why.

A multi-node job that cannot rendezvous or whose collectives are blocked otherwise hangs until a
30-minute process-group timeout (the most common multi-node complaint in peers' trackers). Every
rank runs the same checks, guarded by one watchdog timer:

1. rendezvous: joining the process group (the watchdog covers `init_process_group`), then each
   rank's (machine rank, local rank) is gathered and must be unique;
2. an all-reduce on the training device returns the right sum;
3. package versions are identical on every rank;
4. the output dir is writable from every rank.

Problems found by the collective checks are raised on every rank as one PreflightError listing
them all. A stage that does not finish within the timeout ends the process with a diagnosis on
stderr: a hang cannot raise, so the watchdog thread exits the process itself.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from finetune.checkpoint.identity import package_versions
from finetune.errors import PreflightError

TIMEOUT_EXIT_CODE = 3



class Watchdog:
    """Ends the process with a diagnosis when the current stage outlives the timeout."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.stage_name, self.advice = "start", ""
        self._deadline = time.monotonic() + timeout_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="finetune-preflight-watchdog", daemon=True)

    def stage(self, name: str, advice: str) -> None:
        """Enter stage `name`; `advice` is what to check if it hangs. Each stage gets the full timeout."""
        self.stage_name, self.advice = name, advice
        self._deadline = time.monotonic() + self.timeout_s

    def _watch(self) -> None:
        while not self._done.wait(timeout=0.2):
            if time.monotonic() > self._deadline:
                sys.stderr.write(
                    f"\nfinetune preflight: error: rank {os.environ.get('RANK', '0')} on {socket.gethostname()} "
                    f"is stuck at '{self.stage_name}' after {self.timeout_s:g} s (--preflight-timeout).\n"
                    f"{self.advice}\n"
                )
                sys.stderr.flush()
                os._exit(TIMEOUT_EXIT_CODE)


@contextmanager
def watchdog(timeout_s: float) -> Iterator[Watchdog]:
    """A running Watchdog for the duration of the block."""
    dog = Watchdog(timeout_s)
    dog._thread.start()
    try:
        yield dog
    finally:
        dog._done.set()
        dog._thread.join()


def rendezvous_advice() -> str:
    """What to check when joining the process group hangs, with this process's view of the job."""
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (
        f"Could not form the process group of WORLD_SIZE={os.environ.get('WORLD_SIZE', '?')} at {address}. Check that:\n"
        "  - every machine started the job, each with its own --machine_rank and the same --num_machines;\n"
        f"  - {address} is the address of machine_rank 0 (main_process_ip / --main_process_ip) and reachable from here;\n"
        "  - the port is open between the machines (firewall, security group) and not used by another job."
    )


def collective_advice(backend: str) -> str:
    return (
        f"The ranks joined but a {backend} collective did not complete: the machines can reach the rendezvous "
        "but not each other's data ports. Check firewalls between all machines; for NCCL run with "
        "NCCL_DEBUG=INFO and set NCCL_SOCKET_IFNAME to the interface that connects them (NCCL_IB_DISABLE=1 "
        "if InfiniBand is misconfigured); make sure every rank reached this point (a crashed rank stalls the rest)."
    )


def probe_output_dir(output_dir: str | Path, rank: int) -> str | None:
    """None if this rank can create and write a file in `output_dir`, else the reason."""
    probe = Path(output_dir) / f".preflight-rank{rank}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def run_checks(accelerator: Accelerator, output_dir: str | Path, dog: Watchdog) -> str:
    """The collective checks, on every rank. Returns a one-line summary; raises PreflightError."""
    started = time.perf_counter()
    world, rank = accelerator.num_processes, accelerator.process_index
    backend = str(getattr(accelerator.state, "backend", None) or "single process")

    dog.stage("all-reduce", collective_advice(backend))
    total = torch.tensor([float(rank + 1)], device=accelerator.device)
    total = accelerator.reduce(total, reduction="sum").item()
    expected = world * (world + 1) / 2

    dog.stage("exchanging rank reports", collective_advice(backend))
    mine = {"rank": rank, "host": socket.gethostname(), "machine_rank": int(os.environ.get("GROUP_RANK", "0")),
            "local_rank": accelerator.local_process_index,
            "versions": package_versions(), "output_dir": probe_output_dir(output_dir, rank)}
    reports = gather_object([mine])  # every rank's report, on every rank

    problems = diagnose(reports, output_dir)
    if total != expected:
        problems.insert(0, f"all-reduce over {world} ranks returned {total:g}, expected {expected:g}: "
                           f"the {backend} backend is broken on this cluster")
    if problems:
        raise PreflightError("preflight failed:\n  - " + "\n  - ".join(problems))
    machines = len({r["machine_rank"] for r in reports})
    return (f"preflight: {world} rank(s) on {machines} machine(s) joined; all-reduce ok; package versions equal; "
            f"output dir writable ({time.perf_counter() - started:.1f} s)")


def diagnose(reports: list[dict], output_dir: str | Path) -> list[str]:
    """Problems visible in the ranks' reports: duplicate placements, version drift, unwritable dirs."""
    problems = []
    seen: dict[tuple[int, int], int] = {}
    for report in reports:
        place = (report["machine_rank"], report["local_rank"])
        if place in seen:
            problems.append(f"ranks {seen[place]} and {report['rank']} (on {report['host']}) both run as machine rank "
                            f"{place[0]}, local rank {place[1]}: two launchers were given the same --machine_rank")
        seen.setdefault(place, report["rank"])
    reference = reports[0]["versions"]
    for report in reports[1:]:
        drift = [f"{name} {version} (rank 0 has {reference.get(name)})"
                 for name, version in report["versions"].items() if reference.get(name) != version]
        if drift:
            problems.append(f"rank {report['rank']} on {report['host']} has different packages: {', '.join(drift)}; "
                            "install the same environment on every machine")
    for report in reports:
        if report["output_dir"] is not None:
            problems.append(f"rank {report['rank']} on {report['host']} cannot write to {output_dir}: "
                            f"{report['output_dir']}")
    return problems
