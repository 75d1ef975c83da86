"""`finetune doctor`: probe this process's machine, under a launcher exchange every rank's facts
and time an all-reduce, check everything, print the findings (text or JSON)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from datetime import timedelta

import torch

from finetune.launch.bandwidth import AllReduceTiming, spawn_all_reduce, time_all_reduce
from finetune.launch.doctor.checks import Finding, check_bandwidth, check_machine, check_ranks
from finetune.launch.doctor.probe import Machine, probe

# Message sizes of the bandwidth check: large enough for the link, not the latency, to dominate.
ALL_REDUCE_BYTES = {"nccl": (64 * 2**20, 256 * 2**20), "gloo": (4 * 2**20, 16 * 2**20)}
STATUS_ORDER = ("fail", "warn", "info", "ok")


def diagnose(output_dir: str, bandwidth: bool = True, all_reduce_bytes: list[int] | None = None) -> dict:
    """The doctor's report: this machine's facts, every rank's under a launcher, and the findings."""
    mine = probe(output_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    timings: list[AllReduceTiming] = []
    broken: Finding | None = None
    if world > 1:
        machines, timings = _exchange(mine, all_reduce_bytes if bandwidth else [])
        if mine.rank != 0:
            return {}
    else:
        machines = [mine]
        if bandwidth and len(mine.gpus) > 1:
            try:
                timings = spawn_all_reduce(len(mine.gpus), list(all_reduce_bytes or ALL_REDUCE_BYTES["nccl"]), "nccl")
            except Exception as e:  # a broken NCCL setup is a finding, not a crash of the doctor
                reason = str(e).strip().splitlines()[-1]
                broken = Finding("bandwidth", "fail", f"the all-reduce over {len(mine.gpus)} GPUs failed: {reason}",
                                 "rerun with NCCL_DEBUG=INFO; check the NCCL and topology findings")
    findings = merge_findings({m.rank: check_machine(m) for m in machines})
    if world > 1:
        findings += check_ranks(machines)
    if broken is not None:
        findings.append(broken)
    elif timings:
        findings.append(check_bandwidth(timings, mine, nodes=len({m.host for m in machines})))
    elif world == 1:
        findings.append(Finding("bandwidth", "info", "one process: no all-reduce measured",
                                "run under the launcher (`torchrun --nproc_per_node N -m finetune doctor`) to measure it"))
    findings.sort(key=lambda f: STATUS_ORDER.index(f.status))
    return {"ok": not any(f.status == "fail" for f in findings),
            "findings": [asdict(f) for f in findings],
            "machines": [asdict(m) for m in machines],
            "all_reduce": [t.to_dict() for t in timings]}


def _exchange(mine: Machine, all_reduce_bytes: list[int] | None) -> tuple[list[Machine], list[AllReduceTiming]]:
    """Under a launcher: every rank's facts to every rank, then the all-reduce timings."""
    import torch.distributed as dist

    cuda = bool(mine.gpus)
    device = torch.device("cuda", mine.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    try:
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, asdict(mine))
        machines = [Machine(**facts) for facts in reports]
        sizes = ALL_REDUCE_BYTES[dist.get_backend()] if all_reduce_bytes is None else all_reduce_bytes
        timings = [time_all_reduce(size, device) for size in sizes]
    finally:
        dist.destroy_process_group()
    return machines, timings


def merge_findings(per_rank: dict[int, list[Finding]]) -> list[Finding]:
    """One list: findings every rank shares once, the others labelled with their ranks."""
    ranks_of: dict[Finding, list[int]] = {}
    for rank, findings in per_rank.items():
        for finding in findings:
            ranks_of.setdefault(finding, []).append(rank)
    merged = []
    for finding, ranks in ranks_of.items():
        if len(ranks) < len(per_rank):
            finding = Finding(finding.check, finding.status, f"rank {', '.join(map(str, ranks))}: {finding.detail}", finding.fix)
        merged.append(finding)
    return merged


def format_report(report: dict) -> str:
    first = report["machines"][0]
    gpus = len(first["gpus"])
    lines = [f"finetune doctor: {len(report['machines'])} rank(s); {first['host']}: {gpus} GPU(s), "
             f"torch {first['versions'].get('torch')}"]
    for f in report["findings"]:
        lines.append(f"  {f['status']:<5} {f['check']:<18} {f['detail']}")
        if f["fix"]:
            lines.append(f"  {'':<5} {'':<18} fix: {f['fix']}")
    counts = {status: sum(f["status"] == status for f in report["findings"]) for status in ("fail", "warn")}
    lines.append(f"{counts['fail']} failure(s), {counts['warn']} warning(s)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="finetune doctor",
        description="Check GPUs, drivers, interconnect, NCCL settings, /dev/shm, RAM, disk, the default accelerate "
        "config and package versions before a multi-GPU run; under torchrun / accelerate launch every rank reports "
        "and rank 0 compares. Exit code 1 when a check fails.",
    )
    parser.add_argument("--output-dir", default="output", help="where the run will write (free disk is checked there)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the all-reduce bandwidth measurement")
    parser.add_argument("--all-reduce-bytes", type=int, action="append",
                        help="message size of the all-reduce measurement (repeatable; default 64 and 256 MiB on GPUs)")
    args = parser.parse_args(argv)
    report = diagnose(args.output_dir, bandwidth=not args.no_bandwidth, all_reduce_bytes=args.all_reduce_bytes)
    if not report:  # ranks other than 0: rank 0 prints for everyone
        return 0
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1
