"""What checkpointing fewer layers buys: time per step on this CPU against the planner's recompute
share, and the memory each layer costs (simulated on fake tensors against the plan).

    python bench/partial_checkpointing.py [--repeats 5]

Time: seconds per forward + backward of SmolLM2-135M's shape (30 layers, random init, fp32,
LoRA r16 on every linear layer as `finetune` builds it) at micro batch 2 × seq 512, with 0, 8, 15, 23
and all 30 layers checkpointed (`--gradient-checkpointing-layers`), wall and process CPU time,
median (min–max) of --repeats rounds in which the settings alternate (so load on a shared machine
falls on all). Beside it, what the speed model's recompute term predicts: the step grows by the
decoder layers' forward (the LM head and loss are not recomputed) times the share of layers
recomputed; the layers' forward is timed here on its own, as a share of a step with none.

Memory: the per-GPU peak of two micro-steps of Mistral-7B's shape cut to 4 layers, LoRA, seq 4096 ×
micro batch 1, simulated with the trainer's own model (MemTracker), against the planner, for 0-4
layers checkpointed.
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
from transformers import AutoConfig, AutoModelForCausalLM

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.memory import GIB, estimate
from finetune.plan.workload import from_run
from finetune.train.simulate import simulate
from finetune.train.skeleton import prepare_for_training

H100 = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True)
CHECKPOINTED = (0, 8, 15, 23, 30)


def build(checkpointed: int):
    spec = catalog.get("smollm2-135m")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec.to_hf_config_dict()), attn_implementation="sdpa")
    config = TrainConfig(method="lora", gradient_checkpointing=checkpointed > 0,
                         gradient_checkpointing_layers=checkpointed or None)
    return prepare_for_training(model, config)


def step_seconds(repeats: int) -> tuple[dict[int, dict[str, list[float]]], list[float]]:
    """Per setting {"wall" | "cpu": seconds per forward + backward}, and the decoder layers' forward
    alone (CPU time, no grad)."""
    models = {n: build(n) for n in CHECKPOINTED}
    ids = torch.randint(0, 49152, (2, 512), generator=torch.Generator().manual_seed(0))

    def step(model):
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    for model in models.values():
        step(model)  # warm-up
    times = {n: {"wall": [], "cpu": []} for n in models}
    forward = []
    for _ in range(repeats):
        for n, model in models.items():
            wall, cpu = timed(lambda model=model: step(model))
            times[n]["wall"].append(wall)
            times[n]["cpu"].append(cpu)
        with torch.no_grad():
            forward.append(timed(lambda: models[0].get_base_model().model(input_ids=ids))[1])
    return times, forward


def simulated_peaks(folder: Path) -> list[tuple[int, float, float]]:
    """(layers checkpointed, simulated, planned) peak GiB per GPU of the 4-layer Mistral-7B cut."""
    (folder / "config.json").write_text(json.dumps(replace(catalog.get("mistral-7b"), num_layers=4).to_hf_config_dict()))
    rows = []
    for checkpointed in range(5):
        config = TrainConfig(model=str(folder), method="lora", max_seq_len=4096, micro_batch_size=1,
                             gradient_checkpointing=checkpointed > 0, gradient_checkpointing_layers=checkpointed or None)
        run = resolve_run(config, Launch(), H100)
        rows.append((checkpointed, simulate(run).peak_bytes / GIB, estimate(from_run(run, gpus.get("H100"))).allocated / GIB))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times, forward = step_seconds(args.repeats)
    base = statistics.median(times[0]["cpu"])
    forward_share = statistics.median(forward) / base
    print(f"SmolLM2-135M shape, LoRA r16 all-linear, fp32, micro 2 × seq 512, 1 thread; the layers' forward = "
          f"{forward_share:.2f} of a step")
    print("| layers checkpointed | wall s | CPU s | CPU time ÷ none | predicted (1 + layers' forward × n/30) |")
    print("|---|---|---|---|---|")
    for n in CHECKPOINTED:
        ratio = statistics.median(times[n]["cpu"]) / base
        print(f"| {n} of 30 | {spread(times[n]['wall'])} | {spread(times[n]['cpu'])} | {ratio:.3f} | {1 + forward_share * n / 30:.3f} |")
    with tempfile.TemporaryDirectory() as folder:
        rows = simulated_peaks(Path(folder))
    print("\nMistral-7B shape cut to 4 layers, LoRA, seq 4096 × micro 1: per-GPU peak, GiB")
    print("| layers checkpointed | simulated | planned | planned ÷ simulated |")
    print("|---|---|---|---|")
    for n, simulated, planned in rows:
        print(f"| {n} of 4 | {simulated:.2f} | {planned:.2f} | {planned / simulated:.3f} |")


if __name__ == "__main__":
    main()
