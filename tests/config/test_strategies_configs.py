"""The shipped accelerate_configs/ and ds_configs/: each is loaded, annotated, and agrees with what the
planner emits for the same strategy (so `finetune plan --write-config` and the shipped files run the
same way). Training with each of them is in test_strategies_distributed.py."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import REPO

from finetune.config import deepspeed_json
from finetune.config.options import BatchShape, TrainConfig
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.choose import Request, plan
from finetune.plan.files import accelerate_config, deepspeed_config

ACCELERATE_CONFIGS = ["single_gpu", "ddp", "fsdp", "fsdp_offload", "fsdp_qlora", "deepspeed_zero1", "deepspeed_zero2",
                      "deepspeed_zero3", "deepspeed_zero3_offload", "multi_node"]
DS_CONFIGS = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
# shipped file → the planner request for the same strategy
PLANNER_EQUIVALENT = {
    "single_gpu": dict(method="lora", strategy="single", offload="none"),
    "ddp": dict(method="lora", strategy="ddp", offload="none"),
    "fsdp": dict(method="full", strategy="fsdp", offload="none"),
    "fsdp_offload": dict(method="full", strategy="fsdp", offload="params"),
    "fsdp_qlora": dict(method="qlora", strategy="fsdp", offload="none"),
    "deepspeed_zero1": dict(method="full", strategy="zero1", offload="none"),
    "deepspeed_zero2": dict(method="full", strategy="zero2", offload="none"),
    "deepspeed_zero3": dict(method="full", strategy="zero3", offload="none"),
    "deepspeed_zero3_offload": dict(method="full", strategy="zero3", offload="params"),
}


def load_accelerate_config(name: str) -> tuple[dict, str]:
    text = (REPO / "accelerate_configs" / f"{name}.yaml").read_text()
    return yaml.safe_load(text), text


def planned(name: str) -> dict:
    gpus_per_node = 1 if name == "single_gpu" else 8
    request = Request(model=catalog.get("llama-7b"), gpu=gpus.get("H100"), gpus_per_node=gpus_per_node, micro_batch_size=1,
                      precision="bf16-mixed", **PLANNER_EQUIVALENT[name])
    plans, best = plan(request)
    return plans[best]


def test_exactly_the_documented_files_ship():
    assert sorted(p.stem for p in (REPO / "accelerate_configs").glob("*.yaml")) == sorted(ACCELERATE_CONFIGS)
    assert sorted(p.stem for p in (REPO / "ds_configs").glob("*.json")) == sorted(DS_CONFIGS)


@pytest.mark.parametrize("name", ACCELERATE_CONFIGS)
def test_accelerate_config_is_annotated_and_loads(name):
    config, text = load_accelerate_config(name)
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any(line.startswith("# For:") for line in header) and any("accelerate launch --config_file" in line for line in header)
    assert any(line.startswith("# Change:") for line in header)
    assert config["distributed_type"] in {"NO", "MULTI_GPU", "FSDP", "DEEPSPEED"}
    if config["distributed_type"] == "FSDP":
        assert config["fsdp_config"]["fsdp_version"] == 2
        assert "fsdp_transformer_layer_cls_to_wrap" not in config["fsdp_config"]  # found from the model
    if config["distributed_type"] == "DEEPSPEED":
        ds_file = REPO / config["deepspeed_config"]["deepspeed_config_file"]
        assert ds_file.is_file()  # relative to the repository root, where the README launches from


@pytest.mark.parametrize("name", list(PLANNER_EQUIVALENT))
def test_accelerate_config_agrees_with_the_planner(name):
    shipped, _ = load_accelerate_config(name)
    emitted = accelerate_config(planned(name))
    for key in ("distributed_type", "main_training_function", "use_cpu"):
        assert shipped.get(key, emitted[key]) == emitted[key], key
    assert "mixed_precision" not in shipped and "mixed_precision" not in emitted  # --precision decides it
    if "fsdp_config" in emitted:
        assert shipped["fsdp_config"] == emitted["fsdp_config"]
    if "deepspeed_config" in emitted:
        assert shipped["deepspeed_config"]["zero3_init_flag"] == emitted["deepspeed_config"]["zero3_init_flag"]


@pytest.mark.parametrize("name", [n for n in PLANNER_EQUIVALENT if n.startswith("deepspeed")])
def test_ds_config_agrees_with_the_planner_after_resolution(name):
    """The shipped JSON resolved for the plan's batch equals the planner's JSON on every ZeRO setting
    that changes memory or behaviour, and the planner's own JSON passes our conflict checks."""
    chosen = planned(name)
    w = chosen.workload
    shipped, _ = load_accelerate_config(name)
    config = TrainConfig(micro_batch_size=w.micro_batch_size, gradient_accumulation_steps=w.gradient_accumulation_steps)
    run = deepspeed_json.RunValues.from_config(config, BatchShape(w.micro_batch_size, w.gradient_accumulation_steps,
                                                                  w.world_size), w.precision.name, 1e-4, w.model.hidden_size)
    ours, _ = deepspeed_json.resolve(deepspeed_json.load(REPO / shipped["deepspeed_config"]["deepspeed_config_file"]),
                                     name, run)
    theirs, _ = deepspeed_json.resolve(deepspeed_config(chosen), "ds_config.json", run)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping", "bf16"):
        assert ours[key] == theirs[key], key
    behaviour = ("stage", "stage3_gather_16bit_weights_on_model_save", "overlap_comm", "contiguous_gradients")
    assert {k: ours["zero_optimization"].get(k) for k in behaviour} == {k: theirs["zero_optimization"].get(k) for k in behaviour}
    assert deepspeed_json.offload_devices(ours) == deepspeed_json.offload_devices(theirs)


@pytest.mark.parametrize("name", DS_CONFIGS)
def test_ds_config_is_annotated_and_leaves_owned_values_to_finetune(name):
    raw = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    assert raw["_comment"].startswith("ZeRO-")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert raw[key] == "auto", key
    assert raw["bf16"]["enabled"] == raw["fp16"]["enabled"] == "auto"
