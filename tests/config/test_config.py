"""Configuration: layering (defaults < YAML < flags), batch arithmetic, LR scaling, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from finetune.config.flags import build_parser, parse_config, save_yaml
from finetune.config.options import TrainConfig, planned_epochs, resolve_batch_shape, scaled_lr
from finetune.errors import ConfigError


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method: lora\nlr: 0.001\nmicro-batch-size: 4\n")
    config = parse_config(["--config", str(path), "--lr", "0.01"])
    assert (config.method, config.lr, config.micro_batch_size, config.lora_r) == ("lora", 0.01, 4, 16)


def test_saved_run_yaml_loads_back_identically(tmp_path):
    config = parse_config(["--method", "qlora", "--packing", "--max-steps", "7"])
    save_yaml(config, tmp_path / "run.yaml")
    assert parse_config(["--config", str(tmp_path / "run.yaml")]) == config


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("method: lora\nlr: [0.1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line 3"):
        parse_config(["--config", str(path)])


def test_yaml_unknown_key_and_wrong_type_are_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown option.*learning_rate"):
        parse_config(["--config", str(path)])
    path.write_text("micro_batch_size: four\n")
    with pytest.raises(ConfigError, match="micro_batch_size.*int"):
        parse_config(["--config", str(path)])


def test_validation_lists_every_problem_at_once():
    with pytest.raises(ConfigError) as error:
        parse_config(["--lr", "-1", "--max-seq-len", "0", "--lora-dropout", "1.5"])
    message = str(error.value)
    assert "--lr" in message and "--max-seq-len" in message and "--lora-dropout" in message


@pytest.mark.parametrize("micro, accum, total, world, expected_accum", [
    (4, None, 32, 2, 4),   # accumulation derived
    (4, 4, 32, 2, 4),      # consistent
    (4, 3, None, 2, 3),    # global derived
    (8, None, None, 1, 1),
])
def test_batch_shape_multiplies_out(micro, accum, total, world, expected_accum):
    config = TrainConfig(micro_batch_size=micro, gradient_accumulation_steps=accum, global_batch_size=total)
    shape = resolve_batch_shape(config, world)
    assert shape.gradient_accumulation_steps == expected_accum
    assert shape.global_batch_size == micro * expected_accum * world


def test_batch_sizes_that_do_not_multiply_out_are_refused_with_a_fix():
    with pytest.raises(ConfigError, match="do not multiply out.*--gradient-accumulation-steps 4"):
        resolve_batch_shape(TrainConfig(micro_batch_size=4, gradient_accumulation_steps=2, global_batch_size=32), 2)
    with pytest.raises(ConfigError, match="not a multiple.*--global-batch-size 32"):
        resolve_batch_shape(TrainConfig(micro_batch_size=4, global_batch_size=30), 2)


def test_lr_scaling_against_base_global_batch():
    config = TrainConfig(lr=1e-4, base_global_batch_size=16)
    assert scaled_lr(config, 64) == 1e-4
    assert scaled_lr(TrainConfig(lr=1e-4, base_global_batch_size=16, lr_scaling="linear"), 64) == pytest.approx(4e-4)
    assert scaled_lr(TrainConfig(lr=1e-4, base_global_batch_size=16, lr_scaling="sqrt"), 64) == pytest.approx(2e-4)


def test_help_lists_every_option_with_its_help_text():
    help_text = build_parser().format_help()
    for flag in ("--micro-batch-size", "--global-batch-size", "--lora-targets", "--train-on-prompt", "--packing",
                 "--lr-scaling", "--precision", "--gradient-checkpointing", "--report-to", "--dry-run", "--fit-check"):
        assert flag in help_text
    assert "Examples per forward pass per process" in help_text


def test_cli_turns_config_errors_into_one_line_not_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "finetune", "--model", "lama-7b", "--output-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Unknown model 'lama-7b'" in result.stderr and "llama-7b" in result.stderr
    assert "Traceback" not in result.stderr


def test_default_lr_depends_on_method_and_catalog_model():
    assert scaled_lr(TrainConfig(model="llama-7b", method="full"), 16) == 2e-5
    assert scaled_lr(TrainConfig(model="llama-7b", method="qlora"), 16) == 2e-4
    assert scaled_lr(TrainConfig(model="tiny"), 16) == 1e-3
    assert scaled_lr(TrainConfig(model="tiny", lr=3e-3), 16) == 3e-3
    assert planned_epochs(TrainConfig(model="tiny")) == 4 and planned_epochs(TrainConfig(model="llama-7b")) == 1
    assert planned_epochs(TrainConfig(model="tiny", epochs=0.5)) == 0.5
