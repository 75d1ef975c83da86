"""`finetune scaling`: the arithmetic and the planner check on their own, then a real 1- and
2-process run on CPU through the command line."""

import json

import pytest
from helpers import REPO

from finetune.cli import main as cli_main
from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import FinetuneError
from finetune.launch.scaling import MAX_SPREAD, Measurement, Timing, format_table, model_efficiency, rows_of
from finetune.launch.scaling import main as scaling_main
from finetune.plan.gpus import GPUSpec
from finetune.plan.workload import from_run

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


def timings(*tokens_per_second: float, processes: int = 1, cpu_share: float = 1.0) -> list[Timing]:
    """Synthetic launches: 1,000 tokens per update, 10 s of wall time each."""
    return [Timing(rate, 1000 / rate, 10.0, 10.0 * processes * cpu_share) for rate in tokens_per_second]


def test_medians_spread_and_cpu_share_of_repeated_launches():
    m = Measurement.of(2, timings(1000, 1400, 1100, processes=2, cpu_share=0.5), all_reduce_seconds=0.1)
    assert m.tokens_per_second == 1100 and m.seconds_per_update == pytest.approx(1000 / 1100)
    assert m.spread == pytest.approx(400 / 1100) and m.cpu_share == pytest.approx(0.5)
    assert Measurement.of(1, timings(1000), None).spread is None


def test_quiet_repeats_with_efficiency_below_one_are_a_result():
    rows = rows_of([Measurement.of(1, timings(1000, 1010, 995), None),
                    Measurement.of(2, timings(1800, 1790, 1820, processes=2), 0.05)], {2: 0.9})
    assert [r.untrusted for r in rows] == [(), ()]
    assert rows[1].efficiency == pytest.approx(1800 / 2 / 1000) and rows[1].model_efficiency == 0.9
    text = format_table(rows, "title")
    assert "untrusted" not in text and "not trustworthy" not in text and "90.0%" in text


def test_impossible_efficiency_and_noisy_repeats_are_flagged_not_reported():
    """The issue's shared machine: 1,170 vs 2,198 tokens/s for one process, efficiencies 1.65 and 3.00."""
    one = Measurement.of(1, timings(1170, 2198, 1200), None)
    two = Measurement.of(2, timings(3900, 3950, 3860, processes=2), 0.05)
    rows = rows_of([one, two], {2: 0.95})
    assert rows[1].efficiency > 1
    assert rows[1].untrusted[0].startswith(f"efficiency {rows[1].efficiency:.0%} > 100 %: impossible")
    assert any(d.startswith("the 1-process baseline tokens/s varied 86% between repeats") for d in rows[1].untrusted)
    assert rows[0].untrusted == (f"tokens/s varied 86% between repeats (> {MAX_SPREAD:.0%}): the machine was busy with "
                                 "other work",)
    text = format_table(rows, "title")
    assert f"{rows[1].efficiency:.1%}" not in text and text.count("untrusted") == 4  # speedup and efficiency, both rows
    assert "not trustworthy, 2 process(es): efficiency" in text


def test_a_single_repeat_cannot_be_judged():
    rows = rows_of([Measurement.of(1, timings(1000), None), Measurement.of(2, timings(1900, processes=2), 0.05)], {})
    assert all("ran once" in " ".join(r.untrusted) for r in rows)


@pytest.mark.slow
def test_one_and_two_cpu_processes(tmp_path, capsys):
    png = tmp_path / "scaling.png"
    assert cli_main(["scaling", "--config_file", str(CONFIGS / "ddp.yaml"), "--processes", "1,2", "--updates", "3",
                     "--warmup-updates", "1", "--repeats", "2", "--json", "--png", str(png), "--workdir", str(tmp_path / "work"),
                     "--micro-batch-size", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    one, two = report["results"]
    assert (one["processes"], two["processes"]) == (1, 2) and report["strategy"] == "ddp"
    assert one["speedup"] == 1.0 and one["efficiency"] == 1.0 and one["all_reduce_seconds"] is None
    assert two["speedup"] == pytest.approx(two["tokens_per_second"] / one["tokens_per_second"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert two["all_reduce_seconds"] > 0 and 0 < two["communication_share"] < 1
    assert 0 < two["model_efficiency"] <= 1
    assert two["spread"] is not None and 0 < two["cpu_share"] and report["repeats"] == 2
    assert (two["efficiency"] > 1 or two["spread"] > report["max_spread"]) <= bool(two["untrusted"])
    assert (tmp_path / "work/processes-2-repeat-1/metrics.jsonl").is_file()
    # weak scaling: each update of the 2-process run trains twice the examples (micro 8 per process)
    logs = [json.loads(line) for line in (tmp_path / "work/processes-2/metrics.jsonl").read_text().splitlines()]
    resolved = (tmp_path / "work/processes-2/run.yaml").read_text()
    assert "global_batch_size: 16" in resolved and "world_size: 2" in resolved
    assert [r["step"] for r in logs if "loss" in r] == [1, 2, 3, 4]
    assert png.stat().st_size > 10_000
