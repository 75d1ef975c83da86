"""What the chunked loss saves, and what it costs on this machine.

    python bench/chunked_loss.py

Memory: the per-GPU peak of two training micro-steps simulated on fake tensors (`finetune plan
--simulate`'s MemTracker, the trainer's own model and optimizer) for catalog shapes cut to 2 decoder
layers (the loss's share does not depend on the depth), with the model's own loss and with the
chunked loss, beside the planner's estimate of each. Time: seconds per forward + backward on this
CPU, median of --repeats, for a 2-layer cut of SmolLM2-135M (vocabulary 49,152) at micro batch 4 ×
seq 512, in fp32, with both losses (the same model and batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.models import catalog, chunked_loss
from finetune.plan import gpus
from finetune.plan.memory import GIB, estimate
from finetune.plan.workload import from_run
from finetune.train.simulate import simulate

H100 = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True)
# (catalog shape, method, seq, micro batch)
CASES = (("mistral-7b", "lora", 4096, 2), ("mistral-7b", "lora", 4096, 4), ("llama-3.1-8b", "lora", 2048, 4),
         ("qwen2.5-7b", "lora", 2048, 2), ("llama-3.2-1b", "full", 2048, 4))


def peaks(shape: str, method: str, seq: int, micro: int, chunked: bool, folder: Path) -> tuple[float, float]:
    """(simulated, planned) peak GiB per GPU of the 2-layer cut."""
    (folder / "config.json").write_text(json.dumps(replace(catalog.get(shape), num_layers=2).to_hf_config_dict()))
    config = TrainConfig(model=str(folder), method=method, max_seq_len=seq, micro_batch_size=micro, chunked_loss=chunked)
    run = resolve_run(config, Launch(), H100)
    return simulate(run).peak_bytes / GIB, estimate(from_run(run, gpus.get("H100"))).allocated / GIB


def seconds_per_step(chunked: bool, repeats: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = replace(catalog.get("smollm2-135m"), num_layers=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec.to_hf_config_dict()), attn_implementation="sdpa")
    if chunked:
        chunked_loss.install(model)
    ids = torch.randint(0, spec.vocab_size, (4, 512), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats + 1):  # the first is warm-up
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| shape (2-layer cut) | method | seq × micro batch | peak GiB, model's own loss (simulated / planned) | "
          "peak GiB, chunked loss (simulated / planned) | saved |\n|---|---|---|---|---|---|")
    for shape, method, seq, micro in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            own = peaks(shape, method, seq, micro, False, Path(tmp))
            chunked = peaks(shape, method, seq, micro, True, Path(tmp))
        print(f"| {shape} | {method} | {seq} × {micro} | {own[0]:.2f} / {own[1]:.2f} | {chunked[0]:.2f} / {chunked[1]:.2f} | "
              f"{own[0] - chunked[0]:.2f} GiB |")
    own, chunked = seconds_per_step(False, args.repeats), seconds_per_step(True, args.repeats)
    print(f"\nCPU, SmolLM2-135M 2-layer cut, 4 × 512 tokens, fp32, forward + backward: model's own loss {own:.2f} s, "
          f"chunked {chunked:.2f} s ({chunked / own:.2f}×)")


if __name__ == "__main__":
    main()
