"""What the chunked loss saves, and what it costs on this machine.

    python bench/chunked_loss.py

Memory: the per-GPU peak of two training micro-steps simulated on fake tensors (`finetune plan
--simulate`'s MemTracker, the trainer's own model and optimizer) for catalog shapes cut to 2 decoder
layers (the loss's share does not depend on the depth), with the model's own loss and with the
chunked loss, beside the planner's estimate of each. Time: seconds per forward + backward on this
CPU, wall and process CPU time, median (min–max) of --repeats, for a 2-layer cut of SmolLM2-135M
(vocabulary 49,152) at micro batch 4 × seq 512, in fp32, with both losses (the same model and
batch, alternating so that load on a shared machine falls on both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from clock import spread, timed

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.memory import GIB, estimate
from finetune.plan.workload import from_run
from finetune.train import chunked_loss
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


def step_seconds(repeats: int) -> dict[str, dict[str, list[float]]]:
    """{"own" | "chunked": {"wall" | "cpu": seconds per forward + backward}}, the two losses alternating."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = replace(catalog.get("smollm2-135m"), num_layers=2)
    models = {}
    for name in ("own", "chunked"):
        torch.manual_seed(0)
        models[name] = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec.to_hf_config_dict()),
                                                        attn_implementation="sdpa")
    chunked_loss.install(models["chunked"])
    ids = torch.randint(0, spec.vocab_size, (4, 512), generator=torch.Generator().manual_seed(0))
    times = {name: {"wall": [], "cpu": []} for name in models}
    for repeat in range(repeats + 1):  # the first of each is warm-up
        for name, model in models.items():
            wall, cpu = timed(lambda model=model: model(input_ids=ids, labels=ids).loss.backward())
            if repeat:
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)
            model.zero_grad(set_to_none=True)
    return times


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
    times = step_seconds(args.repeats)
    print(f"\nSmolLM2-135M 2-layer cut, 4 × 512 tokens, fp32, forward + backward on this CPU, {args.repeats} repeats:\n"
          "| loss | wall s, median (min–max) | CPU s, median (min–max) |\n|---|---|---|")
    for name, label in (("own", "model's own"), ("chunked", "chunked")):
        print(f"| {label} | {spread(times[name]['wall'])} | {spread(times[name]['cpu'])} |")
    ratio = statistics.median(times["chunked"]["cpu"]) / statistics.median(times["own"]["cpu"])
    print(f"chunked / own, CPU time: {ratio:.2f}×")


if __name__ == "__main__":
    main()
