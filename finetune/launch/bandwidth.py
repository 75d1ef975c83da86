"""All-reduce bandwidth, measured the way nccl-tests report it.

`algbw` is bytes ÷ time of one all-reduce; `busbw` = algbw × 2(n−1)/n, the rate each rank's link
actually carries in a ring all-reduce, comparable across world sizes and with a link's rated
bandwidth. The slowest rank sets the time. Used by `finetune doctor` (is the link as fast as it
should be?) and `finetune scaling` (how long does one update's gradient all-reduce take?).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class AllReduceTiming:
    processes: int
    backend: str
    bytes: int
    seconds: float  # one all-reduce, slowest rank, mean over the timed iterations

    @property
    def algbw_gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def busbw_gb_per_s(self) -> float:
        return self.algbw_gb_per_s * 2 * (self.processes - 1) / self.processes

    def to_dict(self) -> dict:
        return asdict(self) | {"algbw_gb_per_s": round(self.algbw_gb_per_s, 3), "busbw_gb_per_s": round(self.busbw_gb_per_s, 3)}


def time_all_reduce(nbytes: int, device: torch.device, iterations: int = 5, warmup: int = 2) -> AllReduceTiming:
    """Time an fp32 all-reduce of `nbytes` in the current process group (every rank must call it)."""
    buffer = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(buffer)
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(buffer)
    _synchronize(device)
    slowest = torch.tensor([(time.perf_counter() - started) / iterations], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return AllReduceTiming(dist.get_world_size(), dist.get_backend(), buffer.numel() * 4, slowest.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spawn_all_reduce(processes: int, sizes: list[int], backend: str, timeout_s: float = 120.0) -> list[AllReduceTiming]:
    """Start `processes` local workers (nccl: one per GPU; gloo: CPU processes), time an all-reduce
    of each size and return rank 0's timings."""
    from finetune.train.accelerator import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(processes, free_port(), sizes, backend, timeout_s, queue), nprocs=processes,
                       join=True, start_method="spawn")
    return [AllReduceTiming(**timing) for timing in queue.get()]


def _worker(rank: int, processes: int, port: int, sizes: list[int], backend: str, timeout_s: float, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=processes, timeout=timedelta(seconds=timeout_s))
    try:
        timings = [time_all_reduce(size, device) for size in sizes]
        if rank == 0:
            queue.put([asdict(t) for t in timings])
    finally:
        dist.destroy_process_group()
