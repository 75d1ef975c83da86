"""Strategy selection in one process: precision, plugins from the launch environment, the setup printout,
and the rehearsal's model shrinking. Multi-process runs are in test_strategies_distributed.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune import rehearse
from finetune.config import ConfigError, TrainConfig, base_lr
from finetune.strategies import build_accelerator, describe_setup, fsdp_plugin_from_launch, resolve_mixed_precision

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("requested", "cuda", "bf16", "launcher", "expected"), [
    ("auto", False, False, "bf16", "no"),  # CPU: always fp32, whatever the accelerate config says
    ("auto", True, True, None, "bf16"),
    ("auto", True, False, None, "no"),  # pre-Ampere GPU without a launcher choice: fp32, not fp16 by surprise
    ("auto", True, True, "fp16", "fp16"),  # the accelerate config's choice on a GPU
    ("bf16", False, False, "fp16", "bf16"),  # an explicit flag always wins
])
def test_mixed_precision(requested, cuda, bf16, launcher, expected):
    assert resolve_mixed_precision(requested, cuda=cuda, bf16_supported=bf16, launcher=launcher) == expected


def test_single_process_accelerator_without_launcher(tmp_path, capsys):
    config = TrainConfig(micro_batch_size=2, global_batch_size=8, output_dir=str(tmp_path / "out"))
    accelerator, batch = build_accelerator(config)
    assert (batch.micro_batch_size, batch.gradient_accumulation_steps, batch.world_size) == (2, 4, 1)
    assert accelerator.gradient_accumulation_steps == 4 and accelerator.num_processes == 1
    assert accelerator.step_scheduler_with_optimizer is False
    assert accelerator.mixed_precision == "no"
    assert capsys.readouterr().out.splitlines() == [
        "distributed setup:",
        "  strategy: single process on cpu",
        "  world size: 1 process",
        "  precision: fp32",
        "  batch: micro 2 × accumulation 4 × world 1 = global 8",
        "preflight: 1 rank(s) on 1 machine(s) joined; all-reduce ok; package versions equal; output dir writable (0.0 s)",
    ]
    assert not list((tmp_path / "out").iterdir())  # the writability probe cleans up after itself


def test_fsdp1_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="sets fsdp_version 1; finetune runs FSDP2. Set `fsdp_version: 2`"):
        fsdp_plugin_from_launch()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    plugin = fsdp_plugin_from_launch()
    assert plugin.fsdp_version == 2 and plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert fsdp_plugin_from_launch() is None


def test_batch_shape_errors_surface_before_any_process_group(tmp_path):
    config = TrainConfig(micro_batch_size=3, global_batch_size=8, output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--global-batch-size 8 is not a multiple of micro batch 3"):
        build_accelerator(config)


def test_setup_printout_names_deepspeed_source_and_offload():
    from finetune.config import BatchShape
    from finetune.strategies import DeepSpeedSetup

    class StubAccelerator:  # describe_setup only reads these attributes
        distributed_type = __import__("accelerate").utils.DistributedType.DEEPSPEED
        num_processes, mixed_precision = 8, "bf16"
        device = __import__("torch").device("cuda", 0)

        class state:
            class deepspeed_plugin:
                deepspeed_config = {"zero_optimization": {"stage": 3}}

    setup = DeepSpeedSetup("ds_configs/zero3_offload.json",
                           {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                  "offload_param": {"device": "none"}}},
                           ["zero3_offload.json: optimizer section checked against finetune's flags; ..."])
    text = describe_setup(StubAccelerator(), BatchShape(4, 2, 8), setup)
    assert text.splitlines()[1:] == [
        "  strategy: DeepSpeed ZeRO-3 on cuda",
        "  world size: 8 processes",
        "  precision: bf16",
        "  ZeRO stage 3, offload optimizer → cpu",
        "  DeepSpeed config: ds_configs/zero3_offload.json, resolved into deepspeed_config.json",
        "  zero3_offload.json: optimizer section checked against finetune's flags; ...",
        "  batch: micro 4 × accumulation 2 × world 8 = global 64",
    ]


# ---------------------------------------------------------------- rehearsal pieces (no processes)


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
    run = rehearse.rehearsal_config(user, tmp_path / "model", tmp_path / "run", steps=3)
    assert (run.method, run.lora_targets, run.deepspeed) == ("qlora", "q_proj,v_proj", "ds_configs/zero3.json")
    assert (run.micro_batch_size, run.global_batch_size, run.gradient_accumulation_steps) == (2, 8, None)
    assert (run.max_seq_len, run.max_steps, run.save_every, run.warmup_steps) == (64, 3, 3, 1)
    assert run.model == str(tmp_path / "model") and run.lr == base_lr(user)


def test_processes_and_launch_command(tmp_path):
    assert rehearse.processes_for(str(REPO / "accelerate_configs" / "single_gpu.yaml")) == 1
    assert rehearse.processes_for(str(REPO / "accelerate_configs" / "fsdp.yaml")) == 2
    with pytest.raises(rehearse.FinetuneError, match="--config_file nope.yaml: no such file"):
        rehearse.processes_for("nope.yaml")
    command = rehearse.launch_command("x.yaml", 2, 29999, tmp_path / "r.yaml")
    assert command[1:] == ["-m", "accelerate.commands.launch", "--config_file", "x.yaml", "--num_processes", "2",
                           "--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                           "--main_process_port", "29999", "--gpu_ids", "all", "--rdzv_backend", "static",
                           "-m", "finetune", "--config", str(tmp_path / "r.yaml")]
    assert "--multi_gpu" in rehearse.launch_command(None, 2, 29999, tmp_path / "r.yaml")  # else accelerate starts 1 process


def test_failures_are_explained():
    log = ("...\n[rank0]: finetune.config.ConfigError: DeepSpeed config does not match the run:\n"
           "  - zero3.json: gradient_accumulation_steps=8 but --gradient-accumulation-steps 2\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert rehearse.explain_failure(log, 1).splitlines() == [
        'The DeepSpeed JSON disagrees with the run\'s flags (listed above). Write "auto" for values finetune owns '
        "(batch sizes, accumulation, clipping, precision).",
        "    last error: [rank0]: finetune.config.ConfigError: DeepSpeed config does not match the run:",
    ]
    assert rehearse.explain_failure("RuntimeError: boom\n", 1) == "The run failed: RuntimeError: boom"


def test_inspect_run_finds_empty_adapters_and_missing_checkpoints(tmp_path):
    from safetensors.torch import save_file
    import torch

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 4.0 - s, "lr": 0.1}) + "\n" for s in (1, 2)))
    save_file({"lora_A": torch.zeros(0, 4)}, tmp_path / "adapter_model.safetensors")
    result = rehearse.inspect_run(tmp_path, steps=2, log="  strategy: FSDP2 on cpu (gloo)\n")
    assert not result.passed and result.strategy == "FSDP2 on cpu (gloo)" and result.losses == [3.0, 2.0]
    assert result.problems == [
        "adapter_model.safetensors is empty: the sharded model was saved without gathering its weights",
        f"no complete checkpoint under {tmp_path / 'checkpoints'}",
    ]


def test_rehearsal_turns_cluster_batch_sizes_into_auto(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # accelerate configs name their DeepSpeed JSON relative to the launch directory
    planned = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "train_batch_size": 256,
               "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}
    (tmp_path / "ds_config.json").write_text(json.dumps(planned))
    path, notes = rehearse.rehearsal_deepspeed_json(TrainConfig(deepspeed=str(tmp_path / "ds_config.json")), None, tmp_path)
    rehearsed = json.loads(Path(path).read_text())
    assert rehearsed == planned | {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                   "train_batch_size": "auto"}
    assert notes == [f"{tmp_path / 'ds_config.json'}: train_batch_size, train_micro_batch_size_per_gpu, "
                     'gradient_accumulation_steps are fixed for the real cluster; rehearsed as "auto"']
    shipped = str(REPO / "accelerate_configs" / "deepspeed_zero3.yaml")  # all "auto" already: used as is
    assert rehearse.rehearsal_deepspeed_json(TrainConfig(), shipped, tmp_path) == (None, [])
