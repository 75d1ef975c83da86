"""`finetune scaling`: the arithmetic and the planner check on their own, then a real 1- and
2-process run on CPU through the command line."""

import json

import pytest
from conftest import REPO

from finetune.plan.gpus import GPUSpec
from finetune.cli import main as cli_main
from finetune.config.options import TrainConfig
from finetune.errors import FinetuneError
from finetune.launch.scaling import main as scaling_main
from finetune.plan.workload import from_run
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.launch.scaling import model_efficiency

CONFIGS = REPO / "accelerate_configs"
CPU = GPUSpec("cpu", 0.0, 0.0, False, "gloo", 0.0, 0.0, 0.0)


@pytest.mark.parametrize("name, strategy", [("ddp.yaml", "ddp"), ("fsdp.yaml", "fsdp"), ("deepspeed_zero2.yaml", "zero2"),
                                            ("deepspeed_zero3_offload.yaml", "zero3"), ("multi_node.yaml", "ddp")])
def test_strategy_comes_from_the_accelerate_config(name, strategy, monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)  # the configs name their DeepSpeed JSON relative to the repository
    run = resolve_run(TrainConfig(), Launch.from_accelerate_config(str(CONFIGS / name), 2), Device())
    assert run.strategy.name == strategy
    assert resolve_run(TrainConfig(), Launch.from_accelerate_config(None, 2), Device()).strategy.name == "ddp"


def test_model_efficiency_from_measured_times():
    """The planner's DDP model: an all-reduce shorter than 70 % of the backward hides, except the
    last bucket; a longer one shows."""
    w = from_run(resolve_run(TrainConfig(), Launch.from_accelerate_config(None, 2), Device()), CPU)
    assert w.strategy.name == "ddp" and w.world_size == 2
    update = 0.4  # s, one process
    hidden = model_efficiency(w, update, all_reduce_seconds=0.001)
    exposed = model_efficiency(w, update, all_reduce_seconds=0.5)
    assert 0.99 < hidden < 1.0  # the tiny model's gradients fit one bucket: the tail is all of it, 1 ms
    assert exposed == pytest.approx(update / (update + 0.5), rel=1e-9)  # one bucket: nothing overlaps


@pytest.mark.parametrize("flags, message", [
    (["--processes", "2,4"], "include 1"),
    (["--processes", "1,x"], "comma-separated integers"),
    (["--processes", "1,2", "--global-batch-size", "32"], "drop --global-batch-size"),
    (["--config_file", "nope.yaml"], "no such file"),
])
def test_bad_requests_are_refused_before_any_run(flags, message):
    with pytest.raises(FinetuneError, match=message):
        scaling_main(flags)


@pytest.mark.slow
def test_one_and_two_cpu_processes(tmp_path, capsys):
    png = tmp_path / "scaling.png"
    assert cli_main(["scaling", "--config_file", str(CONFIGS / "ddp.yaml"), "--processes", "1,2", "--updates", "3",
                     "--warmup-updates", "1", "--json", "--png", str(png), "--workdir", str(tmp_path / "work"),
                     "--micro-batch-size", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    one, two = report["results"]
    assert (one["processes"], two["processes"]) == (1, 2) and report["strategy"] == "ddp"
    assert one["speedup"] == 1.0 and one["efficiency"] == 1.0 and one["all_reduce_seconds"] is None
    assert two["speedup"] == pytest.approx(two["tokens_per_second"] / one["tokens_per_second"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert two["all_reduce_seconds"] > 0 and 0 < two["communication_share"] < 1
    assert 0 < two["model_efficiency"] <= 1
    # weak scaling: each update of the 2-process run trains twice the examples (micro 8 per process)
    logs = [json.loads(line) for line in (tmp_path / "work/processes-2/metrics.jsonl").read_text().splitlines()]
    resolved = (tmp_path / "work/processes-2/run.yaml").read_text()
    assert "global_batch_size: 16" in resolved and "world_size: 2" in resolved
    assert [r["step"] for r in logs if "loss" in r] == [1, 2, 3, 4]
    assert png.stat().st_size > 10_000
