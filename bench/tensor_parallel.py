"""Tensor parallelism's memory per GPU, planned against the trainer's own build: (1) Llama-3.1-8B full
fine-tuning at 32,768 tokens on 4 GPUs as FSDP2 4, FSDP2 2 × TP 2 and TP 4, every layer
checkpointed, each TP layout simulated whole on a fake process group (`finetune plan --simulate`:
the sequence-parallel plan, the chunked loss per vocabulary shard, FSDP2, collectives included);
(2) the published TP runs the planner can pose, planned now beside what they reported. Prints two
tables; results go in bench/RESULTS.md.

    python bench/tensor_parallel.py             # both; about 5 minutes on 2 cores
    python bench/tensor_parallel.py --published # (2) only, in a second
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

SEQ_LEN = 32768
# (tp, --chunked-loss): each layout with the loss the trainer picks for it, and FSDP2 alone with the
# chunked loss too, so the layouts' activations compare like for like
LAYOUTS = [(1, None), (1, True), (2, None), (4, None)]

# (what ran, the request that poses it, the peak it reported in GiB): Qwen2.5-7B at TP 4 on one node
# of 4 A100s; Llama-3.1-70B at FSDP2 32 × TP 8 on 256 H100s, 16 rows of 8,192 tokens per data-parallel
# rank, every layer recomputed
PUBLISHED = [
    ("Qwen2.5-7B full, TP 4, 1 × 32,768 tokens, 4 × A100-80GB",
     dict(model="qwen2.5-7b", gpu="A100-80GB", gpus_per_node=4, method="full", strategy="fsdp", tp=4, seq_len=32768,
          micro_batch_size=1), 50.0),
    ("Llama-3.1-70B full, FSDP2 32 × TP 8, 16 × 8,192 tokens, 256 × H100",
     dict(model="llama-3.1-70b", gpu="H100", gpus_per_node=8, nodes=32, method="full", strategy="fsdp", tp=8, seq_len=8192,
          micro_batch_size=16, gradient_checkpointing=True), 71.9),
]


def layouts_table() -> str:
    from finetune.config.options import TrainConfig
    from finetune.config.resolve import Device, Launch, resolve_run
    from finetune.models import catalog
    from finetune.plan import gpus
    from finetune.plan.memory import GIB, backward_activations
    from finetune.plan.workload import from_run
    from finetune.train.simulate import simulate

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(catalog.get("llama-3.1-8b").to_hf_config_dict()))
    h100 = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True)
    rows = ["activations per GPU at the forward/backward peak, GiB (Llama-3.1-8B full, 32,768 tokens, 4 GPUs)",
            f"{'layout':<16} {'loss':<18} {'planned':>8} {'simulated':>9} {'planned/simulated':>17}"]
    for tp, chunked in LAYOUTS:
        config = TrainConfig(model=str(folder), method="full", micro_batch_size=1, max_seq_len=SEQ_LEN, tp=tp,
                             gradient_checkpointing=True, chunked_loss=chunked)
        run = resolve_run(config, Launch(world_size=4, fsdp=True), h100)
        planned, simulated = backward_activations(from_run(run, gpus.get("H100"))), simulate(run).activations
        rows.append(f"{run.parallelism.label:<16} {run.switches.loss:<18} {planned / GIB:>8.2f} {simulated / GIB:>9.2f} "
                    f"{planned / simulated:>17.3f}")
    return "\n".join(rows)


def published_table() -> str:
    from finetune.models import catalog
    from finetune.plan import gpus
    from finetune.plan.choose import Request, plan
    from finetune.plan.memory import GIB

    rows = [f"{'published run':<66} {'published':>9} {'planned':>8} {'activations':>11}  loss, recomputed layers"]
    for name, fields, published in PUBLISHED:
        request = Request(**fields | {"model": catalog.get(fields["model"]), "gpu": gpus.get(fields["gpu"])})
        (chosen, *_), _ = plan(request)
        w, memory = chosen.workload, chosen.memory
        rows += [f"{name:<66} {published:>9.1f} {memory.reserved / GIB:>8.1f} {memory.activations / GIB:>11.1f}  "
                 f"{w.loss}, {w.recomputed_layers} of {w.model.num_layers}"]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--published", action="store_true", help="only the published runs, planned")
    tables = [published_table] if parser.parse_args().published else [published_table, layouts_table]
    print("\n\n".join(table() for table in tables))


if __name__ == "__main__":
    main()
