"""Mixture-of-experts memory, measured on this CPU: (1) what QLoRA's packed experts hold after loading
and while they load, against transformers' own 4-bit loading (linears only, 16-bit experts); (2) the
planner's per-GPU peak against the fake-tensor simulation of full-width MoE layers (the machinery of
`finetune plan --simulate`, the trainer's own construction). Prints two tables; results go in
bench/RESULTS.md.

    python bench/moe_memory.py            # both; about 10 minutes on 2 cores
    python bench/moe_memory.py --load     # (1) only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# (1) an 8-layer Qwen3-MoE shape: 8 experts of width 2048 on hidden 1024, 768 MiB of bf16 experts
SHAPE = dict(num_hidden_layers=8, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
             intermediate_size=2048, moe_intermediate_size=2048, num_experts=8, num_experts_per_tok=2, vocab_size=1024)

LOAD = """
import json, sys, threading, time
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from finetune.train.experts_4bit import Nf4ExpertsConfig

def anonymous_mib():
    return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) // 1024

peak, done = [0], [False]
def watch():
    while not done[0]:
        peak[0] = max(peak[0], anonymous_mib())
        time.sleep(0.002)

base = anonymous_mib()
watcher = threading.Thread(target=watch)
watcher.start()
config_class = Nf4ExpertsConfig if sys.argv[1] == "experts packed" else BitsAndBytesConfig
config = config_class(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                      bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16, quantization_config=config)
done[0] = True
watcher.join()
print(json.dumps({"after": anonymous_mib() - base, "peak": peak[0] - base}))
"""

# (2) catalog shape, layers, training flags, FSDP2 ranks (1: one device)
SIMULATED = [
    ("qwen3-30b-a3b", 2, dict(method="lora", max_seq_len=4096), 1),
    ("qwen3-30b-a3b", 2, dict(method="lora", max_seq_len=4096, gradient_checkpointing=True), 1),
    ("qwen3-30b-a3b", 2, dict(method="lora", lora_targets="all-linear+experts", max_seq_len=2048), 1),
    ("qwen3-30b-a3b", 2, dict(method="full", precision="bf16-true", max_seq_len=1024), 1),
    ("qwen3-30b-a3b", 4, dict(method="lora", max_seq_len=512), 4),
    ("qwen3-30b-a3b", 4, dict(method="full", precision="bf16-true", max_seq_len=512), 4),
    ("mixtral-8x7b", 2, dict(method="lora", max_seq_len=2048), 1),
    ("mixtral-8x7b", 2, dict(method="lora", lora_targets="all-linear+experts", max_seq_len=1024), 1),
    ("mixtral-8x7b", 4, dict(method="lora", max_seq_len=512), 4),
]


def load_table() -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(tempfile.mkdtemp()) / "moe"
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **SHAPE), dtype=torch.bfloat16)
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "experts" in n) / 2**20
    model.save_pretrained(folder)
    rows = [f"bf16 experts: {experts:.0f} MiB; anonymous memory of the loading process, MiB over its start",
            f"{'loading':<28} {'after':>7} {'peak':>7}"]
    for how in ("experts packed", "linears only (transformers)"):
        done = subprocess.run([sys.executable, "-c", LOAD, how, str(folder)], capture_output=True, text=True,
                              env={"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ}, check=True)
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(f"{how:<28} {measured['after']:>7} {measured['peak']:>7}")
    return "\n".join(rows)


def simulation_table() -> str:
    from finetune.config.options import TrainConfig
    from finetune.config.resolve import Device, Launch, resolve_run
    from finetune.models import catalog
    from finetune.plan import gpus
    from finetune.plan.memory import GIB, estimate
    from finetune.plan.workload import from_run
    from finetune.train.simulate import simulate

    h100 = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True)
    rows = [f"{'shape':<16} {'ranks':>5}  {'flags':<72} {'simulated':>9} {'planned':>8} {'ratio':>6}"]
    for name, layers, flags, ranks in SIMULATED:
        folder = Path(tempfile.mkdtemp())
        (folder / "config.json").write_text(json.dumps(replace(catalog.get(name), num_layers=layers).to_hf_config_dict()))
        config = TrainConfig(model=str(folder), micro_batch_size=1, **flags)
        launch = Launch(world_size=ranks, fsdp=True, fsdp_cpu_ram_efficient_loading=True) if ranks > 1 else Launch()
        run = resolve_run(config, launch, h100)
        simulated = simulate(run).peak_bytes
        planned = estimate(from_run(run, gpus.get("H100"))).allocated
        described = f"{layers} layers " + " ".join(f"{k}={v}" for k, v in flags.items())
        rows.append(f"{name:<16} {ranks:>5}  {described:<72} {simulated / GIB:>9.2f} {planned / GIB:>8.2f} "
                    f"{planned / simulated:>6.3f}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", action="store_true", help="only the loading measurement")
    args = parser.parse_args()
    print(load_table())
    if not args.load:
        print()
        print(simulation_table())


if __name__ == "__main__":
    main()
