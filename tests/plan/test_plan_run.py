"""One plan, one run: what `finetune plan` promises is what the trainer builds and runs.

- The contract grid: catalog models × full/LoRA/QLoRA × every strategy (± offload), each built at
  full size on fake tensors through the trainer's own construction (skeleton.build_skeleton,
  optim.build_optimizer): the weights, gradients and optimizer bytes one GPU holds equal the
  planner's terms within 2 %.
- A plan's launch command, parsed as `finetune` parses it under the plan's accelerate config,
  resolves to exactly the plan's workload (strategy, offload, precision, batch, LoRA settings).
- `finetune --dry-run --json` prints the plan contract with the built bytes beside it.
- The fit check and host-RAM limits decide as documented.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import REPO

from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import FinetuneError
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.choose import Request, describe, plan
from finetune.plan.files import launch_command, write_configs
from finetune.plan.memory import GIB, estimate, place_states
from finetune.plan.workload import from_run
from finetune.train.dry_run import build, built_states, run_of_plan
from finetune.train.fit_check import fit_problem

A100 = Device(cuda=True, name="NVIDIA A100-SXM4-80GB", bf16=True)
T4 = Device(cuda=True, name="Tesla T4", bf16=False)
MAIN_MODELS = ("llama-7b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b")
TERMS = ("weights", "gradients", "optimizer")


def deepspeed_file(directory: Path, stage: int, offload: str) -> str:
    zero: dict = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "params":
        zero["offload_param"] = {"device": "cpu"}
    path = directory / f"zero{stage}-{offload}.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return str(path)


def launches(directory: Path, world: int = 8) -> dict[str, Launch]:
    """Every strategy × offload the planner can recommend, as the launcher announces it."""
    return {
        "single": Launch(),
        "ddp": Launch(world_size=world),
        "fsdp": Launch(world_size=world, fsdp=True, fsdp_cpu_ram_efficient_loading=True),
        "fsdp+params offload": Launch(world_size=world, fsdp=True, fsdp_offload_params=True),
        **{f"zero{stage}{'' if offload == 'none' else f'+{offload} offload'}":
           Launch(world_size=world, deepspeed_config_file=deepspeed_file(directory, stage, offload))
           for stage, offloads in ((1, ("none", "optimizer")), (2, ("none", "optimizer")), (3, ("none", "optimizer", "params")))
           for offload in offloads},
    }


def assert_built_equals_planned(config: TrainConfig, device: Device, directory: Path) -> None:
    built = build(resolve_run(config, Launch(), device))  # the construction does not depend on the launch
    for name, launch in launches(directory).items():
        run = resolve_run(config, launch, device)
        workload = from_run(run, gpus.get("A100-80GB"))
        measured, planned = place_states(workload, built_states(run, built)), estimate(workload)
        for term in TERMS:
            got, expected = getattr(measured, term), getattr(planned, term)
            assert got == pytest.approx(expected, rel=0.02, abs=2**20), (
                f"{config.model} {config.method} {run.precision.name} {name} {term}: built {got / GIB:.3f} GiB, "
                f"planned {expected / GIB:.3f} GiB")


# llama-7b in the main suite; the GQA, tied-vocabulary and biased shapes (and 70B) in the slow one
GRID = [pytest.param(model, marks=() if model == "llama-7b" else pytest.mark.slow) for model in MAIN_MODELS]


@pytest.mark.parametrize("model", GRID)
@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_built_model_states_equal_the_plan(model, method, tmp_path):
    assert_built_equals_planned(TrainConfig(model=model, method=method), A100, tmp_path)


@pytest.mark.parametrize(("method", "precision", "device"), [
    ("lora", "bf16-mixed", A100),  # fp32 frozen base under autocast
    ("qlora", "bf16-mixed", A100),  # embeddings, norms and head stay fp32 beside the 4-bit weights
    ("lora", "fp16-true", T4),  # the usual LoRA setup on GPUs without bf16
    ("qlora", "fp16-true", T4),
    ("full", "bf16-true", A100),  # pure bf16: weights, gradients and AdamW states, FSDP2 and ZeRO included
    ("lora", "fp32", A100),
])
def test_built_model_states_equal_the_plan_for_every_precision(method, precision, device, tmp_path):
    config = TrainConfig(model="llama-7b", method=method, precision=precision, optimizer="adamw")
    if (precision, method) == ("bf16-true", "full"):
        built = build(resolve_run(config, Launch(), device))
        for name, launch in launches(tmp_path).items():
            if name.startswith("zero") and "offload" in name:  # DeepSpeed offloads bf16 states only with its CPU Adam
                with pytest.raises(FinetuneError, match="bf16-true full fine-tuning under ZeRO-.* offload is not supported"):
                    resolve_run(config, launch, device)
                continue
            run = resolve_run(config, launch, device)
            workload = from_run(run, gpus.get("A100-80GB"))
            measured, planned = place_states(workload, built_states(run, built)), estimate(workload)
            assert all(getattr(measured, t) == pytest.approx(getattr(planned, t), rel=0.02, abs=2**20) for t in TERMS), name
        return
    assert_built_equals_planned(config, device, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_built_model_states_equal_the_plan_at_70b(method, tmp_path):
    assert_built_equals_planned(TrainConfig(model="llama-2-70b", method=method), A100, tmp_path)


def test_lora_on_the_lm_head_is_planned_as_built(tmp_path):
    config = TrainConfig(model="llama-3.1-8b", method="lora", lora_targets="q_proj,v_proj,lm_head")
    assert_built_equals_planned(config, A100, tmp_path)


def test_8bit_optimizer_states_are_planned_as_built(tmp_path):
    for optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        config = TrainConfig(model="llama-7b", method="lora", optimizer=optimizer)
        run = resolve_run(config, Launch(), A100)
        workload = from_run(run, gpus.get("A100-80GB"))
        assert built_states(run).optimizer == pytest.approx(estimate(workload).optimizer, rel=0.02), optimizer


# ---------------------------------------------------------------- the launch command is the plan


PLANS = {
    "lora DDP": Request(model=catalog.get("llama-7b"), gpu=gpus.get("A100-40GB"), gpus_per_node=2, method="lora", strategy="ddp"),
    "full FSDP2 params offload": Request(model=catalog.get("llama-3.1-8b"), gpu=gpus.get("A100-40GB"), gpus_per_node=2,
                                         method="full", strategy="fsdp", offload="params"),
    "full ZeRO-3 offload, 2 nodes": Request(model=catalog.get("mistral-7b"), gpu=gpus.get("H100"), gpus_per_node=8, nodes=2,
                                            method="full", strategy="zero3", offload="params", micro_batch_size=2,
                                            gradient_accumulation_steps=4),
    "qlora single on a T4": Request(model=catalog.get("llama-7b"), gpu=gpus.get("T4"), gpus_per_node=1, method="qlora",
                                    gradient_checkpointing=True),
    "lora, 7B on an H100, checkpointing some layers": Request(model=catalog.get("mistral-7b"), gpu=gpus.get("H100"),
                                                             gpus_per_node=1, method="lora", seq_len=4096),
    "lora on the head, 8-bit AdamW": Request(model=catalog.get("qwen2.5-7b"), gpu=gpus.get("L40S"), gpus_per_node=4,
                                             method="lora", strategy="zero2", optimizer="adamw-8bit",
                                             lora_targets="q_proj,v_proj,lm_head", lora_r=32),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_launch_command_resolves_to_the_planned_workload(name, tmp_path):
    plans, best = plan(PLANS[name])
    chosen = plans[best]
    write_configs(chosen, tmp_path)
    run = run_of_plan(chosen, tmp_path, tmp_path / "out")
    assert from_run(run, chosen.workload.gpu) == chosen.workload
    assert "--precision " + chosen.workload.precision.name in launch_command(chosen)


def test_dry_run_prints_the_plan_with_what_the_trainer_builds(tmp_path):
    done = subprocess.run([sys.executable, "-m", "finetune", "--dry-run", "--json", "--model", "llama-7b", "--method", "lora",
                           "--gpu", "A100-40GB", "--precision", "bf16-true", "--micro-batch-size", "1",
                           "--max-seq-len", "2048", "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)  # stdout holds only the JSON
    assert data["hardware"]["gpu"] == "A100-40GB" and len(data["plans"]) == 1
    only = data["plans"][0]
    assert (only["method"], only["strategy"], only["precision"], only["micro_batch_size"]) == ("lora", "single", "bf16-true", 1)
    for term in TERMS:
        assert only["built_per_gpu_gib"][term] == pytest.approx(only["memory_per_gpu_gib"][term], rel=0.02, abs=0.001)
    assert not (tmp_path / "out").exists()  # nothing loaded, nothing written


def dry_run_json(*flags: str, env: dict | None = None) -> dict:
    import os

    done = subprocess.run([sys.executable, "-m", "finetune", "--dry-run", "--json", *flags], capture_output=True, text=True,
                          timeout=300, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""} | (env or {}))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("gpu, flags, precision", [
    ("A100-40GB", ("--model", "llama-7b"), "bf16-true"),  # docs/planner.md's example: 12.7 GiB of bf16 weights, not fp32
    ("T4", ("--model", "smollm2-135m"), "fp16-true"),  # no bf16: auto is fp16
    ("T4", ("--model", "smollm2-135m", "--precision", "fp16-true"), "fp16-true"),  # fp16 needs a GPU: the named one
])
def test_dry_run_with_gpu_resolves_every_choice_as_on_that_gpu(gpu, flags, precision):
    data = dry_run_json(*flags, "--method", "lora", "--gpu", gpu, "--micro-batch-size", "1", "--max-seq-len", "512")
    only = data["plans"][0]
    assert data["hardware"]["gpu"] == gpu and only["precision"] == precision
    sixteen_bit_base, fp32_adapters = data["model"]["params"] * 2, only["trainable_params"] * 4  # not an fp32 base
    assert only["built_per_gpu_gib"]["weights"] == pytest.approx((sixteen_bit_base + fp32_adapters) / GIB, rel=0.02)


def test_dry_run_prints_this_runs_command_and_what_writes_its_files(tmp_path, monkeypatch):
    """Under a 2-process FSDP2 launch: the launch line carries every flag given, the plan command it
    names writes the files, and that command line under those files resolves to the dry run's plan."""
    import shlex

    from finetune.cli import main as cli_main
    from finetune.config.flags import parse_command
    from finetune.train.dry_run import device_of

    flags = ["--model", "tiny", "--method", "full", "--gpu", "A100-40GB", "--dataset", str(tmp_path / "my data.jsonl"),
             "--lr", "3e-05", "--max-steps", "7", "--micro-batch-size", "2", "--max-seq-len", "128",
             "--output-dir", str(tmp_path / "out")]
    fsdp = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    only = dry_run_json(*flags, env=fsdp)["plans"][0]
    words = shlex.split(only["launch_command"])
    assert words[:4] == ["accelerate", "launch", "--config_file", "plan/accelerate.yaml"]
    command = parse_command(words[words.index("finetune") + 1:])
    assert command.config == parse_command(flags).config and "--dry-run" not in words

    writer = only["config_files_command"]
    assert writer.endswith("writes plan/accelerate.yaml")
    monkeypatch.chdir(tmp_path)
    assert cli_main(shlex.split(writer.split("`")[1])[1:]) == 0
    launch = Launch.from_accelerate_config(str(tmp_path / "plan" / "accelerate.yaml"), 2)
    run = resolve_run(command.config, launch, device_of(gpus.get("A100-40GB")), command.given)
    w = from_run(run, gpus.get("A100-40GB"))
    assert (w.strategy.name, w.offload, w.precision.name, w.micro_batch_size) == ("fsdp", only["offload"], only["precision"], 2)


def test_dry_run_of_one_process_needs_no_files():
    import shlex

    from finetune.config.flags import parse_command

    flags = ["--model", "tiny", "--gpu", "T4", "--lr", "0.001", "--max-steps", "3"]
    only = dry_run_json(*flags)["plans"][0]
    words = shlex.split(only["launch_command"])
    assert words[0] == "finetune" and parse_command(words[1:]).config == parse_command(flags).config
    assert only["config_files_command"] is None


# ---------------------------------------------------------------- fit check and host RAM


def test_fit_check_decides_from_free_memory_and_says_what_would_fit():
    request = Request(model=catalog.get("llama-7b"), gpu=gpus.get("A100-40GB"), gpus_per_node=1, method="lora",
                      micro_batch_size=4)
    plans, best = plan(request)
    chosen = plans[best]
    needed = chosen.memory.held(1)
    assert fit_problem(chosen.workload, chosen.memory, int(needed) + 2**30, None) is None
    message = fit_problem(chosen.workload, chosen.memory, int(needed) - 2**30, None)
    assert message.startswith(f"This run will not fit: it needs {needed / GIB:.1f} GiB per GPU")
    assert "--micro-batch-size" in message and "finetune plan --model llama-7b --gpus 1xA100-40GB" in message
    assert "--no-fit-check" in message
    host = fit_problem(chosen.workload, chosen.memory, int(needed) + 2**30, host_free_bytes=2**30)
    assert "GiB of host RAM per node" in host


@pytest.mark.parametrize("name, memory_gib, expected", [
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),  # a CUDA device name: the catalog's name for it
    ("Acme Tensor Card 80", 79.6, "A100-80GB"),  # not in the catalog: a catalog GPU of its size
    ("Acme Tensor Card 72", 72.0, "72GB"),  # no catalog GPU of its size: the card by its memory
])
def test_fit_check_suggests_a_plan_command_that_runs_when_pasted(name, memory_gib, expected, capsys):
    import shlex

    from finetune.cli import main as cli_main
    from finetune.errors import FitError
    from finetune.train.fit_check import check_fit

    device = Device(cuda=True, name=name, bf16=True, free_bytes=2**30, total_bytes=int(memory_gib * GIB))
    run = resolve_run(TrainConfig(model="llama-7b", method="lora"), Launch(), device)
    with pytest.raises(FitError) as stopped:
        check_fit(run, device)
    words = shlex.split(str(stopped.value).split("`")[1])
    assert words[:2] == ["finetune", "plan"] and words[words.index("--gpus") + 1] == f"1x{expected}"
    assert cli_main(words[1:]) == 0
    assert f"on 1× {expected}" in capsys.readouterr().out


def test_host_memory_limits_which_plans_fit_and_which_is_recommended():
    llama70 = catalog.get("llama-2-70b")
    request = Request(model=llama70, gpu=gpus.get("A100-40GB"), gpus_per_node=2, method="full", strategy="fsdp",
                      offload="params")
    plans, best = plan(request)
    assert best is None and not plans[0].fits_host and plans[0].fits_device  # ~1 TB of host RAM on a 288 GiB host
    assert "of host RAM per node" in plans[0].reasons[0] and "(--host-memory)" in plans[0].reasons[0]
    plans, best = plan(replace(request, host_memory_gib=2048))
    assert best == 0 and plans[0].fits

    qlora = Request(model=llama70, gpu=gpus.get("RTX4090"), gpus_per_node=2, method="qlora")
    roomy, roomy_best = plan(replace(qlora, host_memory_gib=1024))
    tight, tight_best = plan(replace(qlora, host_memory_gib=roomy[roomy_best].host_gib - 1))
    if roomy[roomy_best].workload.offload != "none":  # offloading plans need the host RAM they are shown with
        assert tight_best is None or tight[tight_best].workload != roomy[roomy_best].workload
    for p in tight:
        assert p.fits == (p.fits_device and p.host_gib <= roomy[roomy_best].host_gib - 1)


# the tie-breaks, spelled out: offload, then the method that changes the model least, then the simpler strategy
LESS_OFFLOAD, LEAST_CHANGE = ("none", "optimizer", "params"), ("full", "lora", "qlora")
SIMPLER = {"single": 0, "ddp": 1, "fsdp": 2, "zero1": 2, "zero2": 2, "zero3": 2}


@pytest.mark.parametrize("model, method, decided_by", [
    ("llama-3.1-8b", "auto", "the method that changes the model least (lora before qlora)"),
    ("llama-7b", "lora", "the simpler strategy (DDP before ZeRO-3)"),
])
def test_ties_within_the_fastest_plans_range_go_to_less_change_then_simpler_and_the_output_says_which(model, method, decided_by):
    plans, best = plan(Request(model=catalog.get(model), gpu=gpus.get("A100-40GB"), gpus_per_node=2, method=method))
    fastest = max((p for p in plans if p.fits), key=lambda p: p.speed.tokens_per_second)
    tied = [p for p in plans if p.fits and p.speed.tokens_per_second >= fastest.speed.low]
    expected = min(tied, key=lambda p: (LESS_OFFLOAD.index(p.workload.offload), LEAST_CHANGE.index(p.workload.method),
                                        SIMPLER[p.workload.strategy.name], p.device_gib))
    assert plans[best] is expected and expected is not fastest
    assert f"tied with the fastest fitting plan ({describe(fastest.workload)}" in plans[best].reasons[-2]
    assert plans[best].reasons[-2].endswith(f"tie-break: {decided_by}")
    assert plans[best].reasons[-1].startswith("speed extrapolated on A100")
    others = [p for p in tied if p is not expected]
    assert others and all("tied on speed with" in p.reasons[-1] and "tie-break:" in p.reasons[-1] for p in others)


def test_what_fits_on_two_a100s_no_longer_quantizes_and_shards_a_1b_model(capsys):
    """Issue 30: QLoRA FSDP2 won llama-3.2-1b's tie on memory alone; within the likely range the plan
    that keeps the base unquantized wins."""
    plans, best = plan(Request(model=catalog.get("llama-3.2-1b"), gpu=gpus.get("A100-40GB"), gpus_per_node=2))
    chosen = plans[best].workload
    assert chosen.method != "qlora"
    qlora_fsdp = next(p for p in plans if p.workload.method == "qlora" and p.workload.strategy.name == "fsdp")
    assert qlora_fsdp.fits and "tie-break: the method that changes the model least" in qlora_fsdp.reasons[-1]
    from finetune.cli import main as cli_main

    assert cli_main(["plan", "what fits on 2×A100 40GB", "--tokens", "1e9"]) == 0
    line = next(text for text in capsys.readouterr().out.splitlines() if "llama-3.2-1b" in text)
    assert describe(chosen) in line and "tok/s (likely " in line and ") h $" in line


# ---------------------------------------------------------------- plan → write-config → rehearse (2 CPU processes)


REHEARSED_PLANS = {  # the three shapes the planner writes: a plain launch, FSDP2, and DeepSpeed with offload
    "lora DDP": (Request(model=catalog.get("llama-7b"), gpu=gpus.get("A100-40GB"), gpus_per_node=2, method="lora",
                         strategy="ddp"), "DDP on cpu, 2 process(es)"),
    "qlora FSDP2": (Request(model=catalog.get("llama-2-70b"), gpu=gpus.get("A100-80GB"), gpus_per_node=2,
                            method="qlora", strategy="fsdp"), "FSDP2 on cpu, 2 process(es)"),
    "full ZeRO-3 offload": (Request(model=catalog.get("llama-3.1-8b"), gpu=gpus.get("A100-40GB"), gpus_per_node=2,
                                    method="full", strategy="zero3", offload="params"), "ZeRO-3 on cpu, 2 process(es)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REHEARSED_PLANS))
def test_written_plan_rehearses_on_cpu(name, tmp_path):
    from finetune.config.flags import parse_config
    from finetune.launch import rehearsal_outcome, rehearse
    from finetune.plan.files import train_flags

    request, strategy = REHEARSED_PLANS[name]
    plans, best = plan(request)
    write_configs(plans[best], tmp_path / "plan")
    # the plan's own training flags, as `finetune rehearse` takes them beside the written config
    config = parse_config(train_flags(plans[best].workload))
    result = rehearse.rehearse(config, str(tmp_path / "plan" / "accelerate.yaml"), tmp_path / "rehearsal", steps=2)
    assert result.passed, rehearsal_outcome.format_report(result, 2) + "\n" + result.log[-3000:]
    assert result.strategy == strategy and len(result.losses) == 2


@pytest.mark.slow
def test_printed_deepspeed_launch_command_runs_as_printed(tmp_path):
    """The command `finetune plan` prints for a ZeRO plan, with only the model swapped for `tiny` and
    the run shortened, trains under `accelerate launch` (it crashed before on a mixed_precision key
    that Accelerate refuses beside a DeepSpeed file)."""
    from helpers import run_printed_launch

    plans, best = plan(replace(PLANS["lora DDP"], strategy="zero2"))
    # its --precision bf16-true runs on CPU too (autocast bf16)
    done = run_printed_launch(plans[best], tmp_path, {"DS_ACCELERATOR": "cpu"}, "--max-eval-examples", "8")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "strategy: ZeRO-2 on cpu (gloo)" in done.stdout and "precision: bf16-true" in done.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 2


# every shipped launch config of one machine (multi_node.yaml names 2 machines)
SHIPPED_LAUNCHES = sorted(p.name for p in (REPO / "accelerate_configs").glob("*.yaml") if p.name != "multi_node.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("launch", SHIPPED_LAUNCHES)
def test_dry_run_json_is_pure_json_under_every_shipped_launcher(tmp_path, launch):
    """`--dry-run --json` under `accelerate launch` of each shipped config, with --verbose: stdout is
    one JSON document (rank 0's), parsed whole; the libraries' logs, DeepSpeed's included, are on
    stderr. DS_ACCELERATOR=cpu keeps the launcher process itself (not finetune's) from logging
    DeepSpeed's accelerator detection to stdout on a machine without a GPU."""
    import os

    from finetune.train.accelerator import free_port

    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{launch}",
               "--main_process_port", str(free_port()), "-m", "finetune", "--model", "tiny", "--dry-run", "--json",
               "--verbose", "--gpu", "A100-40GB", "--output-dir", str(tmp_path / "out")]
    env = os.environ | {"ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert len(report["plans"]) == 1 and "memory_per_gpu_gib" in report["plans"][0]


# ---------------------------------------------------------------- the command line


def plan_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune", "plan", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_json_stdout_holds_only_json_and_messages_go_to_stderr(tmp_path):
    done = plan_cli("--model", "llama-7b", "--gpus", "2xA100-40GB", "--json", "--write-config", str(tmp_path / "plan"))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["hardware"]["host_memory_gib_per_node"] == 288.0  # 2 × 144 GiB: a p4d's share per GPU
    assert f"wrote {tmp_path / 'plan' / 'accelerate.yaml'}" in done.stderr


def test_what_fits_uses_tokens_png_and_write_config(tmp_path):
    done = plan_cli("what fits on 2×A100 40GB", "--tokens", "1e9", "--png", str(tmp_path / "fits.png"),
                    "--write-config", str(tmp_path / "plans"))
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith("llama-7b"))
    assert " h $" in line  # hours and cost for 1e9 tokens
    assert (tmp_path / "fits.png").stat().st_size > 10_000
    written = sorted(p.name for p in (tmp_path / "plans").iterdir())
    assert "llama-7b" in written and (tmp_path / "plans" / "llama-7b" / "accelerate.yaml").is_file()
    assert "llama-2-70b" not in written or (tmp_path / "plans" / "llama-2-70b" / "accelerate.yaml").is_file()


@pytest.mark.slow
def test_dry_run_of_the_printed_launch_command_reports_the_planned_memory(tmp_path):
    """The planner's launch command, run with --dry-run under `accelerate launch` (2 processes on
    this CPU machine, planned for the GPUs of the plan): the same per-GPU memory as the plan."""
    import os
    import shlex

    from finetune.train.accelerator import free_port

    planned = json.loads(plan_cli("--model", "llama-7b", "--gpus", "2xA100-40GB", "--method", "lora", "--strategy", "ddp",
                                  "--json", "--write-config", str(tmp_path / "plan")).stdout)
    best = planned["plans"][planned["recommended"]]
    words = shlex.split(best["launch_command"])
    command = [sys.executable, "-m", "accelerate.commands.launch", *words[2:4], "--main_process_port", str(free_port()),
               *words[4:], "--dry-run", "--json", "--gpu", "A100-40GB", "--output-dir", str(tmp_path / "out")]
    env = os.environ | {"ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    dry = json.loads(done.stdout)  # rank 0 prints the plan; other ranks print nothing
    only = dry["plans"][0]
    assert (only["strategy"], only["method"], only["micro_batch_size"]) == ("ddp", "lora", best["micro_batch_size"])
    for term in ("weights", "gradients", "optimizer", "activations", "buffers", "device"):
        assert only["memory_per_gpu_gib"][term] == best["memory_per_gpu_gib"][term], term
    for term in TERMS:
        assert only["built_per_gpu_gib"][term] == pytest.approx(best["memory_per_gpu_gib"][term], rel=0.02, abs=0.001)


def test_a_plan_failing_only_on_host_ram_names_host_ram_with_both_numbers():
    args = ("--model", "llama-2-70b", "--gpus", "2xA100-40GB", "--method", "full", "--strategy", "fsdp", "--offload", "params")
    data = json.loads(plan_cli(*args, "--json").stdout)
    only, limit = data["plans"][0], data["hardware"]["host_memory_gib_per_node"]
    assert only["fits_device"] and not only["fits_host"] and only["host_memory_gib"] > limit
    text = plan_cli(*args).stdout
    row = next(line for line in text.splitlines() if line.lstrip().startswith("full"))
    assert "NO (host RAM)" in row
    closest = text.split("Closest:")[1].splitlines()[1]
    assert f"needs {only['host_memory_gib']:.0f} GiB of host RAM per node" in closest and f"> {limit:.0f} GiB available" in closest
    assert "fits:" not in closest and "per node" in text.split("Closest:")[1].splitlines()[2]  # the advice is about host RAM
