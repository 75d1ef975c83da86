"""`finetune rehearse`'s pieces in one process: the shrunk model, the rehearsal config, the launch
command, failure diagnosis from the error that ended a run, what it inspects afterwards, and the
conflicts of the real run it reports before relaxing anything. Rehearsals on 2 CPU processes are
in test_strategies_distributed.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO

from finetune.config.flags import parse_command
from finetune.config.options import TrainConfig, base_lr
from finetune.errors import ConfigError
from finetune.launch import rehearsal_outcome, rehearse


@pytest.mark.parametrize(("model", "model_class", "kv_heads"), [
    ("llama-70b", "LlamaForCausalLM", 1),  # 64 query / 8 key-value heads → still grouped-query
    ("llama-7b", "LlamaForCausalLM", 4),  # multi-head stays multi-head
    ("mistral-7b", "MistralForCausalLM", 1),
    ("qwen2.5-7b", "Qwen2ForCausalLM", 1),
])
def test_shrunk_model_keeps_architecture_class_and_module_names(model, model_class, kv_heads, tmp_path):
    from transformers import AutoModelForCausalLM

    directory = rehearse.write_shrunk_model(TrainConfig(model=model), tmp_path / "m")
    shrunk = AutoModelForCausalLM.from_pretrained(directory)
    assert type(shrunk).__name__ == model_class
    assert set(shrunk._no_split_modules) == {model_class.replace("ForCausalLM", "DecoderLayer")}  # FSDP wraps this
    assert (shrunk.config.num_hidden_layers, shrunk.config.hidden_size, shrunk.config.num_key_value_heads) == (2, 64, kv_heads)
    names = {name.rsplit(".", 1)[-1] for name, _ in shrunk.named_modules()}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= names  # LoRA targets
    if model.startswith("qwen"):
        assert shrunk.model.layers[0].self_attn.q_proj.bias is not None
    assert sum(p.numel() for p in shrunk.parameters()) < 200_000


def test_local_model_directories_shrink_too(tmp_path):
    from transformers import AutoConfig

    local = rehearse.write_shrunk_model(TrainConfig(model="qwen2.5-7b"), tmp_path / "local")
    config = AutoConfig.from_pretrained(rehearse.write_shrunk_model(TrainConfig(model=str(local)), tmp_path / "again"))
    assert (config.model_type, config.num_hidden_layers, len(config.layer_types)) == ("qwen2", 2, 2)


def test_rehearsal_config_keeps_what_decides_the_code_path(tmp_path):
    user = TrainConfig(model="llama-70b", method="qlora", lora_targets="q_proj,v_proj", deepspeed="ds_configs/zero3.json",
                       micro_batch_size=16, global_batch_size=256, max_seq_len=4096, warmup_steps=100)
    run = rehearse.rehearsal_config(user, tmp_path / "model", tmp_path / "run", steps=3, pinned=frozenset())
    assert (run.method, run.lora_targets, run.deepspeed) == ("qlora", "q_proj,v_proj", "ds_configs/zero3.json")
    assert (run.micro_batch_size, run.global_batch_size, run.gradient_accumulation_steps) == (2, 8, None)
    assert (run.max_seq_len, run.max_steps, run.save_every, run.warmup_steps, run.precision) == (64, 3, 3, 1, "fp32")
    assert run.model == str(tmp_path / "model") and run.lr == base_lr(user)
    # a micro batch and accumulation the user gave are rehearsed as given; the global batch follows
    pinned = rehearse.rehearsal_config(TrainConfig(micro_batch_size=4, gradient_accumulation_steps=8), tmp_path / "model",
                                       tmp_path / "run", steps=3, pinned=frozenset(rehearse.PINNABLE))
    assert (pinned.micro_batch_size, pinned.gradient_accumulation_steps, pinned.global_batch_size) == (4, 8, None)


def test_a_plans_partial_checkpointing_stays_partial_on_the_shrunk_model():
    """A plan's --gradient-checkpointing-layers 43 of 80 would be refused by the 2-layer copy: some
    layers stay some (the first), all stay all."""
    assert rehearse.shrunk_checkpointed_layers(43, 80) == 1 == rehearse.SHRUNK_LAYERS - 1
    assert rehearse.shrunk_checkpointed_layers(80, 80) is None and rehearse.shrunk_checkpointed_layers(None, 80) is None


@pytest.mark.parametrize(("text", "says"), [
    ("distributed_type: MULTI_GPU\nnum_processes: [2\n", "expected ',' or ']'"),
    ("distributed_type: MULTI_GPU\nnum_processes: all\n", "num_processes must be a whole number, got 'all'"),
    ("distributed_type: EVERYWHERE\n", "'EVERYWHERE' is not a valid DistributedType"),
    ("num_processes: 2\n", "A `distributed_type` must be specified"),
    ("- a list\n", "not a mapping of settings"),
])
def test_a_malformed_accelerate_config_is_one_error_naming_file_and_setting(tmp_path, text, says):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        rehearse.real_world_size(str(path))
    assert str(raised.value).startswith(f"accelerate config {path}: ") and says in str(raised.value)


def test_accelerate_config_without_num_processes_names_none(tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    assert rehearse.real_world_size(str(path)) is None and rehearse.processes_for(str(path)) == 2


def test_processes_and_launch_command(tmp_path):
    assert rehearse.processes_for(str(REPO / "accelerate_configs" / "single_gpu.yaml")) == 1
    assert rehearse.processes_for(str(REPO / "accelerate_configs" / "fsdp.yaml")) == 2
    with pytest.raises(rehearse.FinetuneError, match="--config_file nope.yaml: no such file"):
        rehearse.processes_for("nope.yaml")
    command = rehearse.launch_command("x.yaml", 2, 29999, tmp_path / "r.yaml", mixed_precision="no")
    assert command[1:] == ["-m", "accelerate.commands.launch", "--config_file", "x.yaml", "--mixed_precision", "no",
                           "--num_processes", "2",
                           "--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                           "--main_process_port", "29999", "--gpu_ids", "all", "--rdzv_backend", "static",
                           "-m", "finetune", "--config", str(tmp_path / "r.yaml")]
    assert "--multi_gpu" in rehearse.launch_command(None, 2, 29999, tmp_path / "r.yaml")  # else accelerate starts 1 process


def test_failures_are_explained_from_the_error_that_ended_the_run():
    log = ("...\n[rank0]: finetune train: error: DeepSpeed config does not match the run:\n"
           "  - zero3.json: gradient_accumulation_steps=8 but --gradient-accumulation-steps 2\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert rehearsal_outcome.explain_failure(log, 1).splitlines() == [
        'The DeepSpeed JSON disagrees with the run\'s flags. Write "auto" for values finetune owns '
        "(batch sizes, accumulation, clipping, precision).",
        "    error: finetune train: error: DeepSpeed config does not match the run:",
        "  - zero3.json: gradient_accumulation_steps=8 but --gradient-accumulation-steps 2",
    ]
    # a word from a printed config (here "nvme_path") must not be taken for the cause
    accelerate_refusal = ('{"offload_param": {"nvme_path": null}}\n[rank1]: ValueError: When using deepspeed_config_file, '
                          "the following accelerate config variables will be ignored: ['mixed_precision']\n")
    assert rehearsal_outcome.explain_failure(accelerate_refusal, 1).startswith("The accelerate config sets values that Accelerate")
    assert rehearsal_outcome.explain_failure("RuntimeError: boom\n", 1) == "The run failed: RuntimeError: boom"
    assert rehearsal_outcome.explain_failure("exitcode  : -9 (pid: 7)\nSignal 9 (SIGKILL) received by PID 7\n", -9).startswith(
        "A process ran out of CPU memory")


def test_a_validation_error_is_kept_whole_with_the_field_it_names():
    """DeepSpeed's pydantic error puts the field on the line after the exception's: keep all of it,
    prefixed by the rank as torchrun writes it, and nothing of the launcher's lines after it."""
    import traceback

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(offload_optimizer={"device": "cpu", "pin_memory": "maybe"})
    except Exception as e:  # noqa: BLE001 - the real message is the input under test
        printed = "".join(traceback.format_exception(e))
    log = "".join(f"[rank1]: {line}\n" for line in printed.splitlines())
    log += "E1125 14:00:00.000 1 torch/distributed/elastic/multiprocessing/api.py] failed (exitcode: 1)\n"
    explained = rehearsal_outcome.explain_failure(log, 1)
    assert "ValidationError: 1 validation error for DeepSpeedZeroConfig" in explained
    assert "offload_optimizer.pin_memory" in explained and "valid boolean" in explained
    assert "exitcode" not in explained and "[rank1]" not in explained.split("\n", 2)[-1]


def test_inspect_run_finds_empty_adapters_and_missing_checkpoints(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 4.0 - s, "lr": 0.1}) + "\n" for s in (1, 2)))
    save_file({"lora_A": torch.zeros(0, 4)}, tmp_path / "adapter_model.safetensors")
    result = rehearsal_outcome.inspect_run(tmp_path, steps=2, log="")
    assert not result.passed and result.strategy == "did not start training" and result.losses == [3.0, 2.0]
    assert result.problems == [
        "adapter_model.safetensors is empty: the sharded model was saved without gathering its weights",
        f"no complete checkpoint under {tmp_path / 'checkpoints'}",
    ]


def test_inspect_run_reads_an_old_folder_as_the_same_folder_today(format_1_run, bpe_lora_run):
    """The rehearsal reads checkpoints through checkpoint/layout.py and metrics through run_folder.py,
    whichever key the manifests keep the resolved record under."""
    old, new = (rehearsal_outcome.inspect_run(folder, steps=1, log="") for folder in (format_1_run, bpe_lora_run / "run"))
    assert old.passed and old.problems == [] and old.strategy == "single device on cpu, 1 process(es)"
    assert old.saved[-1] == "checkpoints/step-000004" and len(old.losses) == 1
    assert (old.strategy, old.losses, old.lrs, old.saved) == (new.strategy, new.losses, new.lrs, new.saved)


# a DeepSpeed JSON written for an 8-GPU cluster, and the accelerate config it is launched with
CLUSTER_JSON = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "train_batch_size": 256,
                "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100, "total_num_steps": 1000}}}


def cluster(tmp_path, ds_json: dict, num_processes: int | None = 8) -> str:
    (tmp_path / "cluster.json").write_text(json.dumps(ds_json))
    lines = ["distributed_type: DEEPSPEED", "deepspeed_config:", f"  deepspeed_config_file: {tmp_path / 'cluster.json'}"]
    lines += [f"num_processes: {num_processes}"] if num_processes else []
    (tmp_path / "cluster.yaml").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "cluster.yaml")


def test_rehearsal_reports_a_conflict_of_the_real_run_that_2_cpu_processes_would_hide(tmp_path):
    """Issue 12: accumulation 8 in the file against --gradient-accumulation-steps 4 fails on the GPUs
    whatever the world size, so rehearsal must fail too (and does, before starting anything)."""
    command = parse_command(["--model", "tiny", "--micro-batch-size", "4", "--gradient-accumulation-steps", "4"])
    result = rehearse.rehearse(command.config, cluster(tmp_path, CLUSTER_JSON), tmp_path / "w", given=command.given)
    assert not result.passed and result.strategy == "did not start training"
    assert result.problems[0].splitlines() == [
        "the real run would stop before training: DeepSpeed config does not match the run:",
        "  - cluster.json: gradient_accumulation_steps=8 but --gradient-accumulation-steps 4",
        "  - cluster.json: train_batch_size=256 but --global-batch-size 128 (micro 4 × accumulation 4 × world 8)",
    ]
    assert not (tmp_path / "w").exists()  # nothing was rehearsed


@pytest.mark.parametrize(("flags", "relaxed"), [
    # micro and accumulation pinned by flags: only what depends on world size and rehearsal length is relaxed
    (["--micro-batch-size", "4", "--gradient-accumulation-steps", "8"],
     "train_batch_size (real run 256, rehearsal 64), bf16.enabled (real run true, rehearsal false), "
     "scheduler.params.warmup_num_steps (real run 100, rehearsal 1), scheduler.params.total_num_steps (real run 1000, "
     "rehearsal 3)"),
    # accumulation derived from the global batch and the world size: the rehearsal's own
    (["--micro-batch-size", "4", "--global-batch-size", "256"],
     "gradient_accumulation_steps (real run 8, rehearsal 1), train_batch_size (real run 256, rehearsal 8), "
     "bf16.enabled (real run true, rehearsal false), scheduler.params.warmup_num_steps (real run 100, rehearsal 1), "
     "scheduler.params.total_num_steps (real run 1000, rehearsal 3)"),
])
def test_rehearsal_relaxes_only_what_it_runs_differently_from_the_real_run(flags, relaxed, tmp_path):
    command = parse_command(["--model", "tiny", *flags])
    accelerate_config = cluster(tmp_path, CLUSTER_JSON)
    real = rehearse.real_run(command.config, accelerate_config, command.given)
    assert (real.world_size, real.batch.global_batch_size, real.strategy.name, real.precision.name) == (8, 256, "zero3", "bf16-mixed")
    assert (real.config.lr_schedule, real.config.warmup_steps, real.config.max_steps) == ("cosine", 100, 1000)  # adopted
    pinned = frozenset(rehearse.PINNABLE) & command.given
    rehearsal = rehearse.rehearsal_config(real.config, tmp_path / "m", tmp_path / "r", 3, pinned=pinned)
    path, notes = rehearse.rehearsal_deepspeed_json(real, rehearsal, 2, tmp_path)
    assert notes == [f'cluster.json: rehearsed as "auto" where the rehearsal runs another value than the real run: {relaxed}']
    rehearsed = json.loads(Path(path).read_text())
    assert rehearsed["zero_optimization"] == {"stage": 3} and rehearsed["gradient_clipping"] == 1.0
    kept = [key for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if key not in relaxed]
    assert all(rehearsed[key] == CLUSTER_JSON[key] for key in kept)
    assert rehearse.describe_real_run(real, accelerate_config) == (
        f"conflicts checked against the real run: ZeRO-3, 8 processes (num_processes of {accelerate_config}), "
        "bf16-mixed, micro 4 × accumulation 8 × world 8 = global 256")


def test_rehearsal_uses_a_file_with_nothing_fixed_as_is(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # accelerate configs name their DeepSpeed JSON relative to the launch directory
    shipped = str(REPO / "accelerate_configs" / "deepspeed_zero3.yaml")  # all "auto" already
    real = rehearse.real_run(TrainConfig(), shipped, frozenset())
    rehearsal = rehearse.rehearsal_config(real.config, tmp_path / "m", tmp_path / "r", 3, pinned=frozenset())
    assert rehearse.rehearsal_deepspeed_json(real, rehearsal, 2, tmp_path) == (None, [])
    assert real.world_size == 2 and real.strategy.name == "zero3"
