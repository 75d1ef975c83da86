"""Drop-in DeepSpeed JSON: every "auto" filled from the run, conflicts named by file, key and flag."""

from __future__ import annotations

import json

import pytest
from helpers import REPO

from finetune.checkpoint.identity import resume_identity
from finetune.config import deepspeed_json
from finetune.config.flags import parse_command
from finetune.config.options import BatchShape, TrainConfig
from finetune.config.resolve import LAUNCH_DEEPSPEED, Device, Launch, resolve_run
from finetune.errors import ConfigError

A100 = Device(cuda=True, name="NVIDIA A100-SXM4-80GB", bf16=True)

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


def run_values(precision="fp32", micro=4, accum=2, world=2, hidden=4096, **overrides) -> deepspeed_json.RunValues:
    config = TrainConfig(max_grad_norm=0.5, weight_decay=0.01, warmup_steps=10, max_steps=100, **overrides)
    return deepspeed_json.RunValues.from_config(config, BatchShape(micro, accum, world), precision,
                                                lr=2e-4, hidden_size=hidden)


def test_all_auto_config_resolves_to_numbers_from_the_run():
    resolved, notes = deepspeed_json.resolve(HF_ZERO3, "zero3.json", run_values(precision="bf16-mixed"))

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
    assert resolved == fixed | {"fp16": {"enabled": False}} and notes == ["mine.json: no fp16.enabled; filled from the run"]


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
    fp16, _ = deepspeed_json.resolve(both_auto, "a.json", run_values(precision="fp16-mixed"))
    assert (fp16["bf16"]["enabled"], fp16["fp16"]["enabled"]) == (False, True)
    fp32, _ = deepspeed_json.resolve(both_auto, "a.json", run_values(precision="fp32"))
    assert (fp32["bf16"]["enabled"], fp32["fp16"]["enabled"]) == (False, False)

    fixed_bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match=r"b\.json: bf16\.enabled=true but --precision resolves to fp32"):
        deepspeed_json.resolve(fixed_bf16, "b.json", run_values(precision="fp32"))
    both_on = {"bf16": {"enabled": True}, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match="c.json: bf16.enabled and fp16.enabled are both true; keep one"):
        deepspeed_json.resolve(both_on, "c.json", run_values(precision="bf16-mixed"))


def test_pure_bf16_full_fine_tuning_keeps_deepspeeds_master_weights_and_states_in_bf16():
    """bf16-true full fine-tuning fills DeepSpeed's bf16 master-weight keys; other runs leave them out
    (older DeepSpeed versions do not know them), and a file fixing them against the run is refused."""
    keys = ("bf16_master_weights_and_grads", "bf16_optimizer_states")
    section = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}
    pure, notes = deepspeed_json.resolve(section, "a.json", run_values(precision="bf16-true", method="full"))
    assert pure["bf16"] == {"enabled": True, **dict.fromkeys(keys, True)}
    assert any("bf16.bf16_master_weights_and_grads" in note for note in notes)
    for precision, method in (("bf16-mixed", "full"), ("bf16-true", "lora")):
        other, _ = deepspeed_json.resolve(section, "a.json", run_values(precision=precision, method=method))
        assert other["bf16"] == {"enabled": True}, (precision, method)
    fixed = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match=r"b\.json: bf16\.bf16_master_weights_and_grads=true but --precision"):
        deepspeed_json.resolve(fixed, "b.json", run_values(precision="bf16-mixed", method="full"))


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
    resolved, notes = deepspeed_json.resolve(raw, name, run_values(precision="bf16-mixed", hidden=32))
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
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = TrainConfig(model="tiny", micro_batch_size=3, global_batch_size=12, max_grad_norm=0.7)
    run = resolve_run(config, Launch.from_environment(), Device())
    setup = run.deepspeed
    assert setup.source == LAUNCH_DEEPSPEED and run.strategy.name == "zero2"
    assert (setup.config["train_micro_batch_size_per_gpu"], setup.config["gradient_accumulation_steps"],
            setup.config["train_batch_size"], setup.config["gradient_clipping"]) == (3, 2, 12, 0.7)
    assert setup.config["zero_optimization"]["stage"] == 2


def test_deepspeed_flag_and_launch_file(monkeypatch, tmp_path):
    config = TrainConfig(model="tiny", micro_batch_size=2, deepspeed=str(REPO / "ds_configs" / "zero3.json"))
    run = resolve_run(config, Launch(world_size=2), Device())
    assert run.deepspeed.source.endswith("zero3.json") and run.strategy.name == "zero3"
    assert run.deepspeed.config["zero_optimization"]["reduce_bucket_size"] == 128 * 128  # the catalog's tiny: hidden 128

    launch = Launch(world_size=2, deepspeed=True, deepspeed_config_file=str(REPO / "ds_configs" / "zero1.json"))
    run = resolve_run(TrainConfig(micro_batch_size=2), launch, Device())
    assert deepspeed_json.zero_stage(run.deepspeed.config) == 1 and run.strategy.name == "zero1"
    assert resolve_run(TrainConfig(micro_batch_size=2), Launch(deepspeed_config_file=launch.deepspeed_config_file),
                       Device()).deepspeed.config["train_batch_size"] == 2
    assert resolve_run(TrainConfig(), Launch(), Device()).deepspeed is None


# ---------------------------------------------------------------- a minimal file, and HF Trainer files (issue 12)


def test_a_minimal_file_gets_every_key_deepspeed_needs_from_the_run(tmp_path):
    """Without batch keys DeepSpeed refuses to start ("Either train_batch_size or
    train_micro_batch_size_per_gpu needs to be provided"); without gradient_clipping it would not clip."""
    (tmp_path / "minimal.json").write_text('{"zero_optimization": {"stage": 1}}')
    config = TrainConfig(model="tiny", micro_batch_size=3, gradient_accumulation_steps=2, max_grad_norm=0.7,
                         deepspeed=str(tmp_path / "minimal.json"))
    run = resolve_run(config, Launch(world_size=2), A100)
    assert run.deepspeed.config == {
        "zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
        "train_batch_size": 12, "gradient_clipping": 0.7, "bf16": {"enabled": True}, "fp16": {"enabled": False}}
    assert run.strategy.name == "zero1" and run.precision.name == "bf16-mixed"
    assert run.deepspeed.notes == ["minimal.json: no train_micro_batch_size_per_gpu, gradient_accumulation_steps, "
                                   "train_batch_size, gradient_clipping, bf16.enabled, fp16.enabled; filled from the run"]


def test_zero3_files_gather_the_weights_the_final_save_needs(tmp_path):
    """Without stage3_gather_16bit_weights_on_model_save, saving the final model fails after training."""
    def zero3(zero: dict, *flags: str):
        (tmp_path / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3, **zero}}))
        command = parse_command(["--model", "tiny", "--micro-batch-size", "2", "--deepspeed", str(tmp_path / "z3.json"), *flags])
        return resolve_run(command.config, Launch(world_size=2), A100, command.given).deepspeed

    assert zero3({}).config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert "stage3_gather_16bit_weights_on_model_save" in zero3({}).notes[0]
    with pytest.raises(ConfigError, match=r"z3.json: zero_optimization.stage3_gather_16bit_weights_on_model_save=false "
                                          r"but --save-final gathers the ZeRO-3 weights at the end of training; set it true"):
        zero3({"stage3_gather_16bit_weights_on_model_save": False})
    assert zero3({"stage3_gather_16bit_weights_on_model_save": False}, "--no-save-final").config is not None

# a file written for the HF Trainer with its own optimizer and schedule, as users bring them
HF_DECAY = {
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                      "warmup_num_steps": 5, "total_num_steps": 40}},
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
}


def hf_run(tmp_path, raw: dict, flags: list[str]):
    """The run `finetune --deepspeed hf.json FLAGS` resolves to on 2 A100s, through the CLI's own parsing."""
    (tmp_path / "hf.json").write_text(json.dumps(raw))
    command = parse_command(["--model", "tiny", "--deepspeed", str(tmp_path / "hf.json"), *flags])
    return resolve_run(command.config, Launch(world_size=2), A100, command.given)


def test_hf_trainer_optimizer_and_scheduler_are_adopted_where_no_flag_was_given(tmp_path):
    run = hf_run(tmp_path, HF_DECAY, ["--micro-batch-size", "2"])
    c = run.config
    assert (c.lr_schedule, c.min_lr_ratio, c.lr, c.adam_beta1, c.adam_beta2, c.adam_epsilon, c.weight_decay,
            c.warmup_steps, c.max_steps) == ("linear", 0.0, 3e-5, 0.9, 0.999, 1e-6, 0.01, 5, 40)
    assert run.peak_lr == 3e-5
    assert run.deepspeed.notes[0] == (
        "hf.json: adopted where no flag was given: --lr-schedule linear (scheduler.type), --min-lr-ratio 0 "
        "(scheduler.type), --lr 3e-05 (optimizer.params.lr), --adam-beta1 0.9 (optimizer.params.betas), "
        "--adam-beta2 0.999 (optimizer.params.betas), --adam-epsilon 1e-06 (optimizer.params.eps), "
        "--weight-decay 0.01 (optimizer.params.weight_decay), --warmup-steps 5 (scheduler.params.warmup_num_steps), "
        "--max-steps 40 (scheduler.params.total_num_steps)")
    assert "optimizer" not in run.deepspeed.config and "scheduler" not in run.deepspeed.config
    # resume identity and run.yaml read the run's config: a resume without the file's schedule is refused
    identity = resume_identity(run)
    assert (identity["lr_schedule"], identity["adam_beta2"], identity["peak_lr"]) == ("linear", 0.999, 3e-5)


def test_what_the_loop_builds_from_an_adopted_file_is_what_deepspeed_would_run(tmp_path):
    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    from finetune.train.optim import build_optimizer, build_scheduler

    run = hf_run(tmp_path, HF_DECAY, [])
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(run.config, model, run.peak_lr)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-5, (0.9, 0.999), 1e-6, 0.01)
    ours = build_scheduler(run.config, optimizer, run.config.max_steps)
    theirs = WarmupDecayLR(torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=3e-5), total_num_steps=40,
                           warmup_max_lr=3e-5, warmup_num_steps=5, warmup_type="linear")
    theirs.step()  # DeepSpeed's schedule at iteration s ↔ ours for the update after s updates
    lrs = []
    for _ in range(40):
        lrs.append((ours.get_last_lr()[0], theirs.get_last_lr()[0]))
        optimizer.step()
        ours.step()
        theirs.step()
    # after warmup: DeepSpeed's linear decay to 0, value for value (warmup: ours starts at peak/(w+1), theirs at 0)
    assert [a for a, _ in lrs[5:]] == pytest.approx([b for _, b in lrs[5:]], rel=1e-9, abs=1e-15)
    assert lrs[-1][0] == pytest.approx(3e-5 / 35) and lrs[4][0] == pytest.approx(3e-5 * 5 / 6)


def test_a_file_value_against_a_flag_the_user_gave_names_file_key_and_flag(tmp_path, monkeypatch):
    flags = ["--lr-schedule", "cosine", "--lr", "1e-4", "--adam-beta2", "0.95", "--warmup-steps", "5", "--max-steps", "40"]
    with pytest.raises(ConfigError) as error:
        hf_run(tmp_path, HF_DECAY, flags)
    assert str(error.value).splitlines()[1:] == [
        "  - hf.json: optimizer.params.lr=3e-05 but --lr 0.0001",
        '  - hf.json: optimizer.params.betas=[0.9, 0.999] but --adam-beta1/--adam-beta2 0.9 0.95',
        "  - hf.json: scheduler.params.warmup_max_lr=3e-05 but --lr 0.0001",
        "  - hf.json: scheduler.type=WarmupDecayLR but --lr-schedule cosine; use --lr-schedule linear or remove the "
        "scheduler section",
    ]
    # a --config YAML sets options as much as flags do; its defaults written out included
    (tmp_path / "run.yaml").write_text("lr_schedule: linear\nmin_lr_ratio: 0.1\n")
    command = parse_command(["--config", str(tmp_path / "run.yaml"), "--deepspeed", str(tmp_path / "hf.json")])
    assert {"lr_schedule", "min_lr_ratio", "deepspeed"} == command.given
    with pytest.raises(ConfigError, match=r"hf.json: scheduler.type=WarmupDecayLR decays to 0 but --min-lr-ratio 0.1; "
                                          "pass --min-lr-ratio 0 or remove the scheduler section"):
        resolve_run(command.config, Launch(world_size=2), A100, command.given)
    # the flag that agrees with the file: no conflict, and the rest is still adopted
    assert hf_run(tmp_path, HF_DECAY, ["--lr-schedule", "linear", "--adam-beta2", "0.999"]).config.lr == 3e-5


def test_auto_betas_and_eps_are_the_flags_and_a_config_built_in_code_adopts_nothing(tmp_path):
    run = hf_run(tmp_path, HF_ZERO3, ["--micro-batch-size", "2"])  # every optimizer/scheduler value "auto"
    c = run.config
    assert (c.lr_schedule, c.adam_beta1, c.adam_beta2, c.adam_epsilon) == ("cosine", 0.9, 0.95, 1e-8)
    assert run.deepspeed.notes[0] == "hf.json: adopted where no flag was given: --lr-schedule cosine (scheduler.type)"
    assert hf_run(tmp_path, HF_ZERO3, ["--adam-beta2", "0.999"]).config.adam_beta2 == 0.999
    # TrainConfig(...) in code: every value counts as given, so the file's WarmupDecayLR is a conflict
    (tmp_path / "hf.json").write_text(json.dumps(HF_DECAY))
    in_code = TrainConfig(model="tiny", micro_batch_size=2, deepspeed=str(tmp_path / "hf.json"))
    with pytest.raises(ConfigError, match="scheduler.type=WarmupDecayLR but --lr-schedule cosine"):
        resolve_run(in_code, Launch(world_size=2), A100)


@pytest.mark.parametrize(("scheduler", "schedule", "min_lr_ratio"), [
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}}, "constant", 0.1),
    ({"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.05, "total_num_steps": "auto"}}, "cosine", 0.05),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}, "linear", 0.0),
])
def test_each_deepspeed_scheduler_maps_to_a_schedule(scheduler, schedule, min_lr_ratio, tmp_path):
    run = hf_run(tmp_path, {"zero_optimization": {"stage": 2}, "scheduler": scheduler}, ["--micro-batch-size", "2"])
    assert (run.config.lr_schedule, run.config.min_lr_ratio, run.config.max_steps) == (schedule, min_lr_ratio, None)


def test_settings_the_loop_does_not_run_are_refused_not_ignored(tmp_path):
    raw = {"zero_optimization": {"stage": 2},
           "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "lr": "auto", "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "log", "warmup_min_lr": "auto"}}}
    with pytest.raises(ConfigError) as error:
        hf_run(tmp_path, raw, [])
    assert str(error.value).splitlines()[1:] == [
        "  - hf.json: optimizer.params.adam_w_mode=false but finetune's AdamW (decoupled weight decay) runs with true; "
        "write that or remove the key",
        '  - hf.json: scheduler.params.warmup_type="log" but finetune\'s warmup (linear) runs with "linear"; '
        "write that or remove the key",
    ]


def test_the_files_lr_under_lr_scaling_and_its_length_under_epochs_are_conflicts_not_adoptions(tmp_path):
    with pytest.raises(ConfigError) as error:
        hf_run(tmp_path, HF_DECAY, ["--lr-scaling", "linear", "--epochs", "2", "--micro-batch-size", "2"])
    assert str(error.value).splitlines()[1:] == [
        "  - hf.json: optimizer.params.lr=3e-05 but the run's peak LR is 0.00025 (--lr scaled by --lr-scaling "
        'linear); pass --lr-scaling none to take the file\'s LR, or write "auto"',
        "  - hf.json: scheduler.params.warmup_max_lr=3e-05 but the run's peak LR is 0.00025 (--lr scaled by "
        '--lr-scaling linear); pass --lr-scaling none to take the file\'s LR, or write "auto"',
        "  - hf.json: scheduler.params.total_num_steps=40 but --epochs sets the run's length; pass --max-steps "
        'instead, or write "auto"',
    ]
    bad = HF_DECAY | {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}
    with pytest.raises(ConfigError, match=r"hf.json: values adopted from it are invalid\. "
                                          r"Invalid configuration:\n  - --adam-beta2 must be in \[0, 1\), got 1.5"):
        hf_run(tmp_path, bad, [])


def test_a_fixed_precision_section_decides_auto_like_the_accelerate_config(tmp_path):
    """A file with `fp16.enabled: true` (and no `--precision`) runs fp16, as the accelerate config's
    mixed_precision would decide it; an explicit bf16 precision against it is refused."""
    from finetune.config.names import PRECISIONS

    fixed = tmp_path / "fp16.json"
    fixed.write_text(json.dumps({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    a100 = Device(cuda=True, name="NVIDIA A100-SXM4-40GB", bf16=True)
    run = resolve_run(TrainConfig(model="tiny", method="lora", deepspeed=str(fixed)), Launch(world_size=2), a100)
    assert run.precision is PRECISIONS["fp16-true"] and run.deepspeed.config["fp16"]["enabled"] is True
    with pytest.raises(ConfigError, match="the launch fixes fp16"):
        resolve_run(TrainConfig(model="tiny", precision="bf16-mixed", deepspeed=str(fixed)), Launch(world_size=2), a100)


FIXED_DROP_IN = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": False},
                 "zero_optimization": {"stage": 2}}


def test_a_drop_in_files_fixed_batch_and_precision_are_the_runs_where_no_flag_was_given(tmp_path):
    """A file that fixes micro batch, accumulation and bf16 off runs so on a bf16 GPU without flags
    (it stopped the run before: "... but --micro-batch-size 16"); a flag the user gave against it
    stays an error naming file, key and flag."""
    from finetune.config.names import PRECISIONS

    run = hf_run(tmp_path, FIXED_DROP_IN, [])
    assert (run.batch.micro_batch_size, run.batch.gradient_accumulation_steps) == (2, 2)
    assert run.precision is PRECISIONS["fp32"] and run.deepspeed.config["bf16"]["enabled"] is False
    assert run.deepspeed.config["train_batch_size"] == 2 * 2 * 2
    assert "--micro-batch-size 2 (train_micro_batch_size_per_gpu)" in run.deepspeed.notes[0]
    with pytest.raises(ConfigError) as error:
        hf_run(tmp_path, FIXED_DROP_IN, ["--micro-batch-size", "4", "--precision", "bf16-mixed"])
    assert "hf.json: train_micro_batch_size_per_gpu=2 but --micro-batch-size 4" in str(error.value)
    assert "hf.json: bf16.enabled=false but --precision resolves to bf16-mixed" in str(error.value)
    assert hf_run(tmp_path, FIXED_DROP_IN, ["--micro-batch-size", "2"]).batch.micro_batch_size == 2  # agreeing flag


def test_a_drop_in_file_with_fixed_values_plans_through_the_cli(tmp_path):
    """The CLI as a user runs it: `--dry-run --json` of that file alone plans micro 2 × accumulation 2
    in fp32; with an explicit flag against it, exit 2 and the file, key and flag."""
    import os
    import subprocess
    import sys

    (tmp_path / "ds.json").write_text(json.dumps(FIXED_DROP_IN))
    base = [sys.executable, "-m", "finetune", "--model", "tiny", "--deepspeed", str(tmp_path / "ds.json"), "--dry-run",
            "--json", "--gpu", "A100-40GB", "--output-dir", str(tmp_path / "out")]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    [only] = json.loads(done.stdout)["plans"]
    assert (only["micro_batch_size"], only["gradient_accumulation_steps"]) == (2, 2), only
    refused = subprocess.run([*base, "--gradient-accumulation-steps", "4"], capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "ds.json: gradient_accumulation_steps=2 but --gradient-accumulation-steps 4" in refused.stderr
