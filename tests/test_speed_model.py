"""The speed model against the committed GPU measurements, its monotonic sanity, the calibrated /
extrapolated mark of every plan, and the allocator setting that makes reserved memory what is planned."""

import json
import os
import subprocess
import sys
from dataclasses import astuple, replace

import pytest
from helpers import REPO

from finetune.cli import ALLOCATOR_CONF, main as cli_main, use_expandable_segments
from finetune.models import catalog
from finetune.plan import gpus
from finetune.plan.memory import estimate
from finetune.plan.speed import CALIBRATED_GPUS, CALIBRATION, estimate_speed
from finetune.plan.workload import Workload

sys.path.insert(0, str(REPO / "bench"))
import speed_fit  # noqa: E402

ROWS = speed_fit.read_rows(sorted(speed_fit.MEASURED.glob("*.csv")))
OWN = [r for r in speed_fit.speed_rows(ROWS) if r["framework"] == "finetune"]


def one_gpu(**overrides) -> Workload:
    fields = dict(model=catalog.get("llama-3.2-1b"), gpu=gpus.get("H100-80GB"), gpus_per_node=1, method="lora",
                  strategy="single", offload="none", precision="bf16-true", optimizer="adamw", micro_batch_size=1,
                  seq_len=512, gradient_checkpointing=False)
    return Workload(**(fields | overrides))


def tokens_per_second(**overrides) -> float:
    return estimate_speed(one_gpu(**overrides)).tokens_per_second


def test_the_committed_measurements_cover_models_methods_and_shapes():
    assert len(OWN) >= 8
    assert {r["method"] for r in OWN} == {"full", "lora", "qlora"}
    assert {r["seq_len"] for r in OWN} >= {"512", "2048", "4096"}
    assert all(r["device"] and r["date"] and r["torch"] and r["transformers"] and r["source"] for r in ROWS)


@pytest.mark.parametrize("row", OWN, ids=lambda r: f"{r['model']}-{r['method']}-s{r['seq_len']}-b{r['micro_batch_size']}")
def test_planned_tokens_per_second_within_25_percent_of_every_measured_row(row):
    measured = float(row["tokens_per_second"])
    assert speed_fit.planned(row) == pytest.approx(measured, rel=speed_fit.TOLERANCE)


def test_liger_term_reproduces_the_measured_speedup_pairs():
    pairs = speed_fit.liger_pairs(speed_fit.speed_rows(ROWS))
    assert len(pairs) >= 2
    for off, on in pairs:
        measured = float(on["tokens_per_second"]) / float(off["tokens_per_second"])
        assert speed_fit.planned(on) / speed_fit.planned(off) == pytest.approx(measured, rel=0.05)


def test_refitting_the_committed_measurements_gives_the_committed_coefficients():
    pytest.importorskip("scipy", reason="scipy comes with the test extra: pip install -c constraints.txt -e .[test]")
    refit = speed_fit.fit(speed_fit.speed_rows(ROWS))
    assert astuple(refit) == pytest.approx(astuple(CALIBRATION), rel=0.05)


def test_calibrated_gpus_are_the_measured_devices():
    assert set(CALIBRATED_GPUS) == {r["device"] for r in ROWS}


def test_more_work_per_update_is_slower_per_token():
    assert tokens_per_second(model=replace(catalog.get("llama-3.2-1b"), num_layers=32)) < tokens_per_second()
    assert tokens_per_second(method="qlora") < tokens_per_second() < tokens_per_second(method="full") * 1.5
    assert tokens_per_second(lora_targets="q_proj,v_proj") > tokens_per_second()
    assert tokens_per_second(gradient_checkpointing=True) < tokens_per_second()
    assert tokens_per_second(precision="fp32", method="full", seq_len=4096) < tokens_per_second(method="full", seq_len=4096)


def test_small_shapes_are_launch_bound_and_longer_rows_amortise_it():
    small, large = estimate_speed(one_gpu()), estimate_speed(one_gpu(seq_len=4096, micro_batch_size=4))
    assert small.launch_bound and not large.launch_bound
    assert large.tokens_per_second > 5 * small.tokens_per_second
    # attention grows with the sequence: at a fixed token count, longer rows are slower
    assert tokens_per_second(seq_len=16384, micro_batch_size=1) < tokens_per_second(seq_len=4096, micro_batch_size=4)


def test_compile_helps_launch_bound_shapes_and_liger_gpu_bound_ones():
    assert tokens_per_second(compile=True) > 1.5 * tokens_per_second()
    big = dict(model=catalog.get("mistral-7b"), seq_len=4096, micro_batch_size=2, gradient_checkpointing=True)
    assert tokens_per_second(**big, loss="liger") > 1.1 * tokens_per_second(**big)
    assert estimate(one_gpu(**big, loss="liger")).activations < estimate(one_gpu(**big)).activations


def test_every_plan_says_whether_its_speed_is_calibrated(capsys):
    assert estimate_speed(one_gpu()).calibrated
    assert not estimate_speed(one_gpu(gpu=gpus.get("A100-80GB"))).calibrated
    assert not estimate_speed(one_gpu(compile=True)).calibrated
    assert not estimate_speed(one_gpu(gpus_per_node=2, strategy="ddp")).calibrated
    assert cli_main(["plan", "llama-3.2-1b on 1xH100", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert all(p["speed_calibrated"] is True and p["speed_basis"] == "calibrated on H100-80GB" for p in plans if p["offload"] == "none")
    assert cli_main(["plan", "llama-3.2-1b on 1xA100-80GB"]) == 0
    table = capsys.readouterr().out
    assert "tok/s~ = extrapolated" in table and any(cell.endswith("~") for cell in table.split())


def test_the_fit_check_uses_reserved_memory_with_the_measured_slack():
    slack, _ = speed_fit.reserved_slack(ROWS)
    m = estimate(one_gpu())
    assert m.reserved == pytest.approx(m.allocated * (1 + slack), rel=0.01)
    assert m.device(1) > m.reserved > m.allocated


def test_expandable_segments_are_set_unless_the_user_chose():
    environ = {}
    use_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": ALLOCATOR_CONF}
    for user in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}):
        environ = dict(user)
        use_expandable_segments(environ)
        assert environ == user


@pytest.mark.parametrize("user", [None, "max_split_size_mb:64"])
def test_the_cli_entry_sets_the_allocator_before_torch_loads(user):
    code = ("import os, sys; from finetune.cli import main; main(['plan', 'llama-3.2-1b on 1xH100', '--json']); "
            "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), 'torch' in sys.modules, file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if user:
        env["PYTORCH_CUDA_ALLOC_CONF"] = user
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stderr.split()[-2:] == [user or ALLOCATOR_CONF, "False"]
