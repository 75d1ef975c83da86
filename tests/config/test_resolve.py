"""The resolved run carries what was decided once: one model spec (whatever --model names) and the
speed switches, which every reader takes from it rather than resolving them again."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from helpers import REPO, tiny_model_dir

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, ResolvedRun, resolve_run, run_switches
from finetune.models.source import ModelSource

GPU = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True)  # resolved as on one, never trained there
# where the switches are resolved: a run's, once (resolve.run_switches), and the planner's for plans without a run
RESOLVERS = {"finetune/config/resolve.py": 1, "finetune/plan/choose.py": 1, "finetune/plan/files.py": 1}


def test_a_local_folder_model_fills_the_runs_one_spec(tmp_path):
    folder = tiny_model_dir(tmp_path / "model")  # 2 layers of width 32, vocabulary 64
    run = resolve_run(TrainConfig(model=str(folder), output_dir=str(tmp_path / "out")), Launch(), Device())
    assert (run.spec.model_type, run.spec.num_layers, run.spec.hidden_size, run.spec.vocab_size) == ("llama", 2, 32, 64)
    assert (run.model.kind, run.model.weights) == ("local", str(folder))
    # the run's one spec: its model source says where the weights are, not what shape they have
    assert "spec" not in {field.name for field in dataclasses.fields(ModelSource)}
    assert [field.name for field in dataclasses.fields(ResolvedRun)].count("spec") == 1
    catalogued = resolve_run(TrainConfig(model="llama-3.2-1b"), Launch(), Device())
    assert (catalogued.spec.name, catalogued.spec.num_layers) == ("llama-3.2-1b", 16)


def test_a_run_carries_its_switches_resolved_once_for_its_device():
    config = TrainConfig(model="llama-3.2-1b", method="lora", liger=True)
    gpu, cpu = resolve_run(config, Launch(), GPU), resolve_run(config, Launch(), Device())
    assert gpu.switches == run_switches(gpu.config, gpu.strategy, True, "llama")
    assert cpu.switches == run_switches(cpu.config, cpu.strategy, False, "llama")
    assert (gpu.switches.fused_adamw, cpu.switches.fused_adamw) == (True, False)  # fused AdamW on a GPU only
    assert cpu.switches.notes == ("running without Liger (Liger's Triton kernels need a CUDA GPU)",)
    assert cpu.switches.loss == "finetune-chunked"  # standing in for Liger's fused loss
    full = resolve_run(dataclasses.replace(config, method="full", liger=None), Launch(), Device())
    assert full.switches.loss == "transformers"  # the chunked loss is on by default for LoRA only


def test_the_built_model_changes_the_switches_only_where_it_tells_more():
    run = resolve_run(TrainConfig(method="lora"), Launch(), Device())
    assert run.switches.chunked_loss and run.spec.model_type == "llama"
    assert run.with_loaded_model("llama", None) is run  # nothing new: not resolved again
    quantized = run.with_loaded_model("llama", "its LM head is quantized")
    assert quantized.switches.loss == "transformers" and quantized.config == run.config
    gpt2 = run.with_loaded_model("gpt2", None)  # an architecture read only from the weights
    assert gpt2.switches.loss == "transformers"


def test_no_reader_resolves_the_switches_again():
    """The switches are a field: nothing calls `run.switches(...)`, and `resolve_switches` is called once
    for a run (resolve.run_switches) and by the planner for its plans, nowhere else in finetune/."""
    calls: dict[str, int] = {}
    for path in sorted((REPO / "finetune").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            assert name != "switches", f"{path}:{node.lineno} calls switches(); read the run's field"
            if name == "resolve_switches":
                key = str(Path(path).relative_to(REPO))
                calls[key] = calls.get(key, 0) + 1
    assert calls == RESOLVERS
