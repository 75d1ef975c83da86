"""Drop-in DeepSpeed JSON: every "auto" filled from the run, conflicts named by file, key and flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune import deepspeed_json
from finetune.config import BatchShape, ConfigError, TrainConfig
from finetune.strategies import LAUNCH_DEEPSPEED, resolve_deepspeed

REPO = Path(__file__).resolve().parents[1]

# the shape of the Hugging Face Trainer's documented ZeRO-3 config: everything the trainer owns is "auto"
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0, "cos_min_ratio": "auto",
                                                       "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def run_values(mixed_precision="no", micro=4, accum=2, world=2, hidden=4096, **overrides) -> deepspeed_json.RunValues:
    config = TrainConfig(max_grad_norm=0.5, weight_decay=0.01, warmup_steps=10, max_steps=100, **overrides)
    return deepspeed_json.RunValues.from_config(config, BatchShape(micro, accum, world), mixed_precision,
                                                lr=2e-4, hidden_size=hidden)


def test_all_auto_config_resolves_to_numbers_from_the_run():
    resolved, notes = deepspeed_json.resolve(HF_ZERO3, "zero3.json", run_values(mixed_precision="bf16"))

    assert (resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"],
            resolved["train_batch_size"]) == (4, 2, 16)
    assert resolved["gradient_clipping"] == 0.5
    assert resolved["bf16"] == {"enabled": True}
    assert resolved["fp16"]["enabled"] is False and resolved["fp16"]["initial_scale_power"] == 16
    zero = resolved["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096 * 4096
    assert zero["stage3_prefetch_bucket_size"] == 15099494  # int(0.9 * 4096²), as Accelerate computes it
    assert zero["stage3_param_persistence_threshold"] == 40960
    assert "auto" not in json.dumps(resolved)
    # the loop owns optimizer and schedule: checked, then not handed to DeepSpeed
    assert "optimizer" not in resolved and "scheduler" not in resolved
    assert notes == ["zero3.json: optimizer section checked against finetune's flags; the training loop runs its own optimizer",
                     "zero3.json: scheduler section checked against finetune's flags; the training loop runs its own scheduler"]
    assert HF_ZERO3["train_batch_size"] == "auto"  # the input is not modified


def test_fixed_values_that_match_the_run_are_kept():
    fixed = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16,
             "gradient_clipping": 0.5, "bf16": {"enabled": False}, "zero_optimization": {"stage": 2}}
    resolved, notes = deepspeed_json.resolve(fixed, "mine.json", run_values())
    assert resolved == fixed and notes == []


def test_conflicting_values_are_all_reported_with_file_key_and_flag():
    conflicting = HF_ZERO3 | {"gradient_accumulation_steps": 8, "train_micro_batch_size_per_gpu": 1,
                              "train_batch_size": 64, "gradient_clipping": 1.0}
    with pytest.raises(ConfigError) as error:
        deepspeed_json.resolve(conflicting, "zero3.json", run_values(micro=4, accum=4, world=2))
    assert str(error.value).splitlines()[1:] == [
        "  - zero3.json: gradient_accumulation_steps=8 but --gradient-accumulation-steps 4",
        "  - zero3.json: gradient_clipping=1.0 but --max-grad-norm 0.5",
        "  - zero3.json: train_batch_size=64 but --global-batch-size 32 (micro 4 × accumulation 4 × world 2)",
        "  - zero3.json: train_micro_batch_size_per_gpu=1 but --micro-batch-size 4",
    ]


def test_precision_sections():
    both_auto = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 1}}
    fp16, _ = deepspeed_json.resolve(both_auto, "a.json", run_values(mixed_precision="fp16"))
    assert (fp16["bf16"]["enabled"], fp16["fp16"]["enabled"]) == (False, True)
    fp32, _ = deepspeed_json.resolve(both_auto, "a.json", run_values(mixed_precision="no"))
    assert (fp32["bf16"]["enabled"], fp32["fp16"]["enabled"]) == (False, False)

    fixed_bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match=r"b\.json: bf16\.enabled=true but --mixed-precision resolves to 'no'"):
        deepspeed_json.resolve(fixed_bf16, "b.json", run_values(mixed_precision="no"))
    both_on = {"bf16": {"enabled": True}, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match="c.json: bf16.enabled and fp16.enabled are both true; keep one"):
        deepspeed_json.resolve(both_on, "c.json", run_values(mixed_precision="bf16"))


def test_offload_sections_pass_through_and_are_reported():
    raw = deepspeed_json.load(REPO / "ds_configs" / "zero3_offload.json")
    resolved, _ = deepspeed_json.resolve(raw, "zero3_offload.json", run_values())
    assert deepspeed_json.offload_devices(resolved) == {"optimizer": "cpu", "param": "cpu"}
    assert deepspeed_json.zero_stage(resolved) == 3
    assert resolved["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_auto_we_cannot_fill_and_foreign_optimizer_are_errors():
    raw = {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}, "optimizer": {"type": "Lamb", "params": {}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    with pytest.raises(ConfigError) as error:
        deepspeed_json.resolve(raw, "x.json", run_values(lr_schedule="cosine"))
    assert str(error.value).splitlines()[1:] == [
        '  - x.json: zero_optimization.sub_group_size is "auto" but finetune does not set it; write a value',
        "  - x.json: scheduler.params.warmup_num_steps=5 but --warmup-steps 10",
        "  - x.json: optimizer.type=Lamb but finetune trains with AdamW (--optimizer); remove the optimizer section",
        "  - x.json: scheduler.type=WarmupLR but --lr-schedule cosine; use --lr-schedule constant or remove the scheduler section",
    ]


def test_unknown_hidden_size_leaves_bucket_sizes_to_accelerate():
    resolved, _ = deepspeed_json.resolve(HF_ZERO3, "zero3.json", run_values(hidden=None))
    assert resolved["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert resolved["train_batch_size"] == 16


def test_invalid_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "zero_optimization": {"stage": 3},\n  "train_batch_size": auto\n}\n')
    with pytest.raises(ConfigError, match=r"Invalid JSON in .*broken\.json line 3, column 23: Expecting value"):
        deepspeed_json.load(path)
    (tmp_path / "no_zero.json").write_text('{"train_batch_size": 8}')
    with pytest.raises(ConfigError, match='no_zero.json: no "zero_optimization" section'):
        deepspeed_json.load(tmp_path / "no_zero.json")


@pytest.mark.parametrize("name", ["zero1.json", "zero2.json", "zero2_offload.json", "zero3.json", "zero3_offload.json"])
def test_shipped_configs_resolve_completely(name, tmp_path):
    raw = deepspeed_json.load(REPO / "ds_configs" / name)
    resolved, notes = deepspeed_json.resolve(raw, name, run_values(mixed_precision="bf16", hidden=32))
    deepspeed_json.write(resolved, tmp_path / "resolved.json")
    written = json.loads((tmp_path / "resolved.json").read_text())
    assert written.pop("_comment").startswith("ZeRO")  # the annotation travels with the file
    assert "auto" not in json.dumps(written) and notes == []
    assert written["train_batch_size"] == 16 and written["bf16"]["enabled"] is True
    assert deepspeed_json.zero_stage(written) == int(name[4])


def test_accelerate_launch_without_json_gets_its_autos_filled(monkeypatch, tmp_path):
    """`accelerate launch --use_deepspeed --zero_stage 2`: Accelerate's own config has "auto" batch
    values that it would fill from the dataloader (None for batch samplers, accelerate#841)."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    config = TrainConfig(model="tiny", micro_batch_size=3, global_batch_size=12, max_grad_norm=0.7)
    setup = resolve_deepspeed(config, BatchShape(3, 2, 2), "no")
    assert setup.source == LAUNCH_DEEPSPEED
    assert (setup.config["train_micro_batch_size_per_gpu"], setup.config["gradient_accumulation_steps"],
            setup.config["train_batch_size"], setup.config["gradient_clipping"]) == (3, 2, 12, 0.7)
    assert setup.config["zero_optimization"]["stage"] == 2


def test_deepspeed_flag_and_launch_file(monkeypatch, tmp_path):
    config = TrainConfig(model="tiny", micro_batch_size=2, deepspeed=str(REPO / "ds_configs" / "zero3.json"))
    setup = resolve_deepspeed(config, BatchShape(2, 1, 2), "no")
    assert setup.source.endswith("zero3.json")
    assert setup.config["zero_optimization"]["reduce_bucket_size"] == 128 * 128  # the catalog's tiny: hidden 128

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(REPO / "ds_configs" / "zero1.json"))
    setup = resolve_deepspeed(TrainConfig(micro_batch_size=2), BatchShape(2, 1, 2), "no")
    assert deepspeed_json.zero_stage(setup.config) == 1
    assert resolve_deepspeed(TrainConfig(), BatchShape(2, 1, 1), "no").config["train_batch_size"] == 2
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    assert resolve_deepspeed(TrainConfig(), BatchShape(2, 1, 1), "no") is None
