"""The GPU validation kit's own logic, on CPU: the scripts parse, wheels are slimmed without breaking
their RECORD, the carry budget counts what travels, memory.py lists its grid with the planner's
predictions, and run.sh installs and stops cleanly where CUDA is first needed."""

import csv
import dataclasses
import math
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from helpers import REPO, make_venv_seeing_these_packages, tiny_model, tiny_model_dir, word_rows, write_jsonl

KIT = REPO / "bench/gpu_kit"
sys.path.insert(0, str(KIT))

import memory  # noqa: E402
import wheels  # noqa: E402
from forked import RowRunner, run_logged  # noqa: E402

from finetune.config.run_folder import read_metrics  # noqa: E402


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `files`."""
    info = f"{name}-{version}.dist-info"
    members = files | {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                       f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    members[f"{info}/RECORD"] = "".join(f"{member},sha256=x,1\n" for member in members) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in members.items():
            archive.writestr(member, text)
    return path


@pytest.mark.parametrize("script", ["run.sh", "wheels.sh"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(KIT / script)]).returncode == 0


def test_slimming_drops_members_and_their_record_lines(tmp_path):
    path = make_wheel(tmp_path, "bitsandbytes", "0.50.2", {
        "bitsandbytes/__init__.py": "", "bitsandbytes/libbitsandbytes_cuda130.so": "x" * 1000,
        "bitsandbytes/libbitsandbytes_cuda121.so": "y" * 1000, "bitsandbytes/libbitsandbytes_rocm64.so": "z" * 1000})
    (rule,) = [w for w in wheels.WHEELS if w.requirement.startswith("bitsandbytes==")]
    assert wheels.slim(path, rule.drop) > 0
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        record = archive.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert "bitsandbytes/libbitsandbytes_cuda130.so" in names and "bitsandbytes/__init__.py" in names
    assert not any("cuda121" in n or "rocm" in n for n in names)
    assert {line.split(",")[0] for line in record.splitlines()} == names
    assert wheels.slim(path, rule.drop) == 0  # nothing left to drop


def test_every_wheel_is_pinned_and_named_like_its_file():
    requirements = [w.requirement for w in wheels.WHEELS]
    assert all("==" in r for r in requirements) and len(set(requirements)) == len(requirements)
    assert {"datasets", "bitsandbytes", "deepspeed", "pyarrow", "trl", "liger-kernel"} <= {r.split("==")[0] for r in requirements}
    assert wheels.distribution(Path("charset_normalizer-3.4.3-cp312-cp312-manylinux2014_x86_64.whl")) == "charset-normalizer"


def test_budget_counts_the_tree_and_the_wheels(tmp_path):
    tree = wheels.tree_bytes()
    assert 0 < tree < wheels.BUDGET_BYTES / 8  # the code and its builtin data: well under a megabyte or two
    (tmp_path / "big.whl").write_bytes(b"\0" * 2**20)
    used, limit = wheels.budget(tmp_path)
    assert used == tree + 2**20 and limit == 64 * 2**20


def test_grid_covers_every_combination_with_base_cases_first():
    rows = memory.grid()
    assert len(rows) == len(set(rows)) == len(memory.MODELS) * 3 * 2 * 2 * 2
    first = rows[: len(memory.MODELS) * len(memory.METHODS)]
    assert {(r.model, r.method) for r in first} == {(m, k) for m in memory.MODELS for k in memory.METHODS}
    assert {(r.seq_len, r.gradient_checkpointing, r.micro_batch_size) for r in first} == {(512, False, 1)}


def test_rows_the_speed_fit_is_least_sure_of_come_first():
    """On an H100, shape families measured there (method, size band, sequence band: a 1B LoRA at
    seq 512, a 7B LoRA at 4k stands for a 3B at 2k) wait until the families never measured have run;
    each group keeps the grid's order."""
    rows = memory.grid()
    ordered = memory.least_sure_first(rows, "H100-80GB")
    assert sorted(ordered, key=rows.index) == rows

    def position(model, method, seq):
        return min(i for i, r in enumerate(ordered) if (r.model, r.method, r.seq_len) == (model, method, seq))

    unsure = [("llama-7b", "lora", 512), ("llama-3.2-1b", "qlora", 2048), ("llama-3.2-3b", "qlora", 512)]
    sure = [("llama-3.2-1b", "lora", 512), ("llama-3.2-3b", "lora", 2048), ("llama-3.1-8b", "qlora", 2048)]
    assert max(position(*row) for row in unsure) < min(position(*row) for row in sure)
    # model code no run behind the fit has trained (Qwen2) leads, even in a family measured on the chip
    qwen_first = min(position("qwen2.5-1.5b", method, seq) for method in ("lora", "qlora") for seq in (512, 2048))
    assert qwen_first < min(position(*row) for row in unsure)
    assert memory.least_sure_first(rows, "H200") == ordered  # an H200 is an H100 chip


def test_dry_run_lists_rows_with_the_planners_predictions(tmp_path):
    result = subprocess.run([sys.executable, str(KIT / "memory.py"), "--dry-run", "--gpu", "A100-40GB", "--limit", "4",
                             "--methods", "full,qlora", "--models", "llama-3.2-1b,llama-7b", "--out", str(tmp_path),
                             "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader((tmp_path / "memory.csv").open()))
    # least sure first: LLaMA-Factory measured a 7B QLoRA at 1k tokens on the A100, so that row waits
    assert [(r["model"], r["method"], r["seq_len"]) for r in rows] == [
        ("llama-3.2-1b", "full", "512"), ("llama-3.2-1b", "qlora", "512"), ("llama-7b", "full", "512"),
        ("llama-3.2-1b", "full", "2048")]
    status = {(r["model"], r["method"]): r["status"] for r in rows}
    assert status[("llama-3.2-1b", "qlora")] == "dry run"
    assert status[("llama-7b", "full")].startswith("skipped: predicted")  # ~16 B/parameter > 40 GB
    assert all(float(r["predicted_allocated_gib"]) > 0 and float(r["predicted_tokens_per_second"]) > 0 for r in rows)
    (example,) = [line for line in result.stdout.splitlines() if line.startswith("each row runs, e.g.: python -m finetune")]
    assert "--method full --precision bf16-mixed --micro-batch-size 1" in example and "--max-seq-len 512" in example
    table = (tmp_path / "memory.md").read_text()
    assert "A100-40GB (catalog, dry run)" in table and table.count("\n| llama") == 4
    assert not (tmp_path / "work/random-init").exists()  # a dry run writes no checkpoint


def test_layout_rows_list_tp_and_cp_beside_fsdp_alone_with_the_planners_predictions(tmp_path):
    """bench/gpu_kit/layouts.py on CPU: every TP/CP row follows FSDP2 alone on the same GPUs, with the
    plan of its exact launch; rows needing more GPUs than there are are listed, not run."""
    import layouts

    def listed(gpus: int) -> list[dict]:
        out = tmp_path / f"{gpus}gpu"
        result = subprocess.run([sys.executable, str(KIT / "layouts.py"), "--dry-run", "--gpus", str(gpus), "--out", str(out),
                                 "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return list(csv.DictReader((out / "layouts.csv").open()))

    rows = listed(8)
    assert len(rows) == len(layouts.ROWS) and {r["status"] for r in rows} == {"dry run"}
    for plain, layout in zip(rows[::2], rows[1::2]):
        assert (plain["tp"], plain["cp"]) == ("1", "1") and layout["tp"] != layout["cp"]
        assert (plain["model"], plain["seq_len"], plain["gpus"]) == (layout["model"], layout["seq_len"], layout["gpus"])
        assert float(layout["predicted_allocated_gib"]) > 0 and float(layout["predicted_tokens_per_second"]) > 0
    assert any(r["cp"] == "8" and float(r["predicted_allocated_gib"]) < float(p["predicted_allocated_gib"])
               for p, r in zip(rows[::2], rows[1::2]))  # CP holds less of a long row than FSDP2 alone
    command = layouts.ROWS[1].command("/ckpt", "/data.jsonl", "/out", 0)
    assert command[command.index("--num_processes") + 1] == "2" and command[-2:] == ["--tp", "2"]
    assert {r["status"] for r in listed(1)} == {f"not run: needs {r.gpus} GPUs, 1 here" for r in layouts.ROWS}


def test_rows_run_the_trainer_with_the_planned_precision(tmp_path):
    row = memory.Row("llama-7b", "qlora", 2048, True, 4)
    flags = row.train_flags("/ckpt", "/data.jsonl", "/out")
    assert flags[flags.index("--precision") + 1] == "bf16-true" and "--gradient-checkpointing" in flags
    assert flags[flags.index("--max-seq-len") + 1] == "2048" and "--no-save-final" in flags
    data = memory.write_text_data(tmp_path / "data.jsonl", 512)
    assert all(len(line) > 512 for line in data.read_text().splitlines())


@pytest.mark.slow
def test_run_sh_installs_and_stops_before_cuda(tmp_path):
    """run.sh in a throwaway venv on this CPU machine: installs a wheel the venv lacks, keeps an
    installed one, installs the project without dependencies, then stops at the CUDA check (exit 3)."""
    venv, shipped, out = tmp_path / "venv", tmp_path / "wheels", tmp_path / "out"
    make_venv_seeing_these_packages(venv)
    shipped.mkdir()
    make_wheel(shipped, "gpukit_probe", "1.0", {"gpukit_probe/__init__.py": "VERSION = '1.0'\n"})
    make_wheel(shipped, "tqdm", "0.0.1", {"tqdm/__init__.py": ""})  # already installed: must be kept
    env = os.environ | {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "OUT": str(out), "KIT_WHEELS": str(shipped),
                        "KIT_WORK": str(tmp_path / "work")}
    result = subprocess.run(["bash", str(KIT / "run.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert [p.name for p in out.iterdir()] == ["logs.tar.gz"], result.stdout[-3000:]  # every log in one file
    with tarfile.open(out / "logs.tar.gz") as archive:
        logs = {Path(m.name).name: archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}
    assert set(logs) == {"run.log", "environment.txt", "pip-check.txt"}
    log = logs["run.log"]
    assert result.returncode == 3, log[-3000:]
    assert "installed 1 wheel(s): gpukit-probe" in log and "already installed, kept: tqdm" in log
    assert "no CUDA device: stopping before the GPU steps" in log and "pytest -m gpu" not in log
    assert "torch" in logs["environment.txt"]
    python = str(venv / "bin/python")
    check = "import gpukit_probe, tqdm, finetune; print(gpukit_probe.VERSION, tqdm.__version__ != '0.0.1', finetune.__file__)"
    printed = subprocess.run([python, "-c", check], capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert printed[:2] == ["1.0", "True"] and printed[2] == str(REPO / "finetune/__init__.py")


def test_time_guard_lists_rows_it_cannot_finish_without_running_or_predicting(tmp_path):
    rows = memory.grid(["llama-3.2-1b"], ["lora"])[:3]
    results = memory.run_grid(rows, "H100-80GB", 79.6, tmp_path, deadline=time.time() + 5, dry_run=False, runner=RowRunner())
    assert [r["status"] for r in results] == ["not run: time"] * 3
    assert not any("predicted_allocated_gib" in r for r in results) and not (tmp_path / "runs").exists()


def row_flags(model: Path, data: Path, output_dir: Path, *extra: str) -> list[str]:
    """A grid row's kind of flags, at a size CPU trains in a second."""
    return ["--model", str(model), "--dataset", str(data), "--format", "text", "--method", "lora", "--precision", "fp32",
            "--micro-batch-size", "2", "--max-seq-len", "32", "--max-steps", "3", "--log-every", "1", "--eval-split", "0.1",
            "--max-eval-examples", "1", "--no-save-final", "--num-samples", "0", "--output-dir", str(output_dir), *extra]


def test_forked_rows_train_and_fail_like_their_own_processes(tmp_path):
    """Rows forked from the preloaded server: each trains and writes its metrics and log; a row with a
    bad flag reports finetune's one-line error and exit code; a script runs as `python script.py`
    would; one past its time prints its Python stack into its log and is killed."""
    model, data = tiny_model_dir(tmp_path / "model"), write_jsonl(tmp_path / "data.jsonl", word_rows([12] * 32))
    runner = RowRunner()
    for name in ("first", "second"):
        out = tmp_path / name
        out.mkdir()
        assert runner.run(["-m", "finetune", *row_flags(model, data, out)], out / "run.log", timeout_s=120)["status"] == "ok"
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3]
        assert "eval loss" in (out / "run.log").read_text()
    bad = tmp_path / "bad"
    bad.mkdir()
    failed = runner.run(["-m", "finetune", *row_flags(model, data, bad, "--micro-batch-size", "0")], bad / "run.log", timeout_s=120)
    assert failed["status"] == "exit 2" and failed["error"] == "finetune train: error: Invalid configuration:"
    assert "--micro-batch-size must be ≥ 1" in (bad / "run.log").read_text()
    code = runner.run(["-c", "import sys; print('args', sys.argv[1:])", "a", "b"], tmp_path / "code.log", timeout_s=60)
    assert code["status"] == "ok" and "args ['a', 'b']" in (tmp_path / "code.log").read_text()
    script = tmp_path / "script.py"
    script.write_text("import sys; print('script', __name__, sys.argv[1:], sys.path[0])\n")
    ran = runner.run([str(script), "a"], tmp_path / "script.log", timeout_s=60)
    assert ran["status"] == "ok" and f"script __main__ ['a'] {tmp_path}" in (tmp_path / "script.log").read_text()
    slow = tmp_path / "slow"
    slow.mkdir()
    assert runner.run(["-m", "finetune", *row_flags(model, data, slow, "--max-steps", "100000")], slow / "run.log",
                      timeout_s=2)["status"] == "timeout"
    assert "(most recent call first)" in (slow / "run.log").read_text()


def test_a_subprocess_row_past_its_time_prints_its_stack(tmp_path):
    result = run_logged([sys.executable, "-c", "import time\ndef waiting(): time.sleep(60)\nwaiting()"], tmp_path / "run.log", 2)
    assert result["status"] == "timeout" and result["seconds"] < 30
    assert "(most recent call first)" in (tmp_path / "run.log").read_text() and "waiting" in (tmp_path / "run.log").read_text()


def test_a_row_that_cannot_use_cuda_after_fork_runs_as_a_subprocess(tmp_path, monkeypatch):
    """Should the server have initialised CUDA after all, the row is run again as `python -m finetune`
    and so are the rest."""
    def cuda_broken_by_fork(self, python_args, log, timeout_s):
        log.write_text("RuntimeError: CUDA error: initialization error\n")
        return {"status": "exit 1", "seconds": 1.0}

    monkeypatch.setattr(RowRunner, "run_forked", cuda_broken_by_fork)
    runner = RowRunner()
    # refused by finetune itself, in its own process
    result = runner.run(["-m", "finetune", "--micro-batch-size", "0"], tmp_path / "run.log", timeout_s=60)
    assert not runner.fork and result["status"] == "exit 2"
    log = (tmp_path / "run.log").read_text()
    assert "--micro-batch-size must be ≥ 1" in log and "CUDA" not in log


def test_results_table_and_csv_compare_measured_with_planned(tmp_path):
    row = {**dataclasses.asdict(memory.Row("llama-3.2-1b", "lora", 512, False, 1)), "precision": "bf16-true"}
    ok = row | {"status": "ok", "allocated_gib": 4.0, "reserved_gib": 5.0, "tokens_per_second": 60000.0, "seconds": 30.0,
                "predicted_allocated_gib": 4.4, "predicted_reserved_gib": 4.5, "predicted_device_gib": 5.0,
                "predicted_tokens_per_second": 77397.4}
    late = row | {"micro_batch_size": 4, "status": "not run: time"}
    memory.write_results([ok, late], tmp_path, "header")
    table = (tmp_path / "memory.md").read_text().splitlines()
    assert table[4] == ("| llama-3.2-1b | lora | bf16-true | 512 | 1 | no | 4.00 / 4.40 | +10.0% | 5.00 / 4.50 | "
                        "60,000 / 77,397 | ok |")
    assert table[5].endswith("| – | – | not run: time |")
    written = list(csv.DictReader((tmp_path / "memory.csv").open()))
    assert (written[0]["allocated_error"], written[0]["reserved_error"]) == ("0.1", "-0.1")
    assert written[1]["predicted_allocated_gib"] == ""


@pytest.fixture
def text_rows(tmp_path):
    """memory.py's text rows of 32 tokens, encoded by the builtin tokenizer the random-init checkpoints carry."""
    import baselines

    from finetune.data import BUILTIN_DIR
    from finetune.train.loading import load_tokenizer

    tokenizer = load_tokenizer(str(BUILTIN_DIR), trust_remote_code=False)
    return tokenizer, baselines.token_rows(tokenizer, memory.write_text_data(tmp_path / "data-32.jsonl", 32), 32)


def test_baselines_read_finetunes_rows_of_exactly_seq_len(text_rows, tmp_path):
    import baselines

    tokenizer, rows = text_rows
    assert len(rows) == memory.DATA_ROWS and {len(r["input_ids"]) for r in rows} == {32}
    assert all(r["labels"] == r["input_ids"] and r["input_ids"][0] == tokenizer.bos_token_id for r in rows)
    with pytest.raises(ValueError, match="are not 64 tokens"):
        baselines.token_rows(tokenizer, tmp_path / "data-32.jsonl", 64)


def test_peft_loop_trains_lora_with_fused_adamw(text_rows):
    """The bare loop on CPU, on a 2-layer Llama: only LoRA trains, checkpointing is on, AdamW is
    fused, every update is timed and moves the adapters. (Its CUDA run is not tested here.)"""
    import baselines
    import torch

    tokenizer, rows = text_rows
    model, optimizer = baselines.peft_loop(tiny_model("llama-3.2-1b", vocab_size=len(tokenizer)))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert optimizer.defaults["fused"] is True and model.base_model.model.is_gradient_checkpointing
    plain, _ = baselines.peft_loop(tiny_model("llama-3.2-1b", vocab_size=len(tokenizer)), checkpointing=False)
    assert not plain.base_model.model.is_gradient_checkpointing
    lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
    assert not lora_b.any()  # PEFT starts B at zero
    seconds, losses = baselines.train_loop(model, optimizer, rows, micro_batch_size=2, steps=3)
    assert len(seconds) == len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert lora_b.any()
    measured = baselines.summary(seconds, 2 * 32, losses)
    assert measured["tokens_per_second"] == pytest.approx((64 / seconds[1] + 64 / seconds[2]) / 2)  # per update, after the first


def test_sft_config_of_each_trl_row(monkeypatch, tmp_path):
    """The SFTConfig each TRL row runs with, built without a GPU (transformers is told bf16 is
    available, as on the H100): micro batch, no accumulation, bf16, non-reentrant checkpointing,
    fused AdamW, whole rows of --seq-len, and use_liger_kernel per row."""
    import baselines
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    for liger in (False, True):
        config = baselines.sft_config(tmp_path, micro_batch_size=4, steps=6, seq_len=4096, liger=liger)
        assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.max_steps) == (4, 1, 6)
        assert config.bf16 and not config.fp16 and config.gradient_checkpointing
        assert config.gradient_checkpointing_kwargs == {"use_reentrant": False} and config.optim == "adamw_torch_fused"
        assert (config.max_length, config.packing, config.padding_free, config.use_liger_kernel) == (4096, False, False, liger)
        assert (config.save_strategy, config.eval_strategy, config.max_grad_norm) == ("no", "no", 1.0)
    without = baselines.sft_config(tmp_path, micro_batch_size=2, steps=6, seq_len=4096, liger=True, checkpointing=False)
    assert not without.gradient_checkpointing  # the anchor's shape: no recompute
    assert not baselines.parse_args(["trl", "--checkpoint", "c", "--data", "d", "--seq-len", "8", "--micro-batch-size", "1",
                                     "--steps", "2", "--no-gradient-checkpointing", "--result", "r"]).gradient_checkpointing


def test_sft_trainer_trains_the_pretokenized_rows_unchanged(monkeypatch, text_rows, tmp_path):
    """SFTTrainer keeps finetune's ids and labels (no retokenizing, truncating or packing) and the
    clock times every update: 2 updates of a 2-layer Llama on CPU (bf16 off: this CPU run checks the
    data path, not the speed)."""
    import baselines
    import transformers.training_args

    tokenizer, rows = text_rows
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    config = dataclasses.replace(baselines.sft_config(tmp_path, 2, 2, 32, liger=False), bf16=False, use_cpu=True)
    trainer = baselines.sft_trainer(tiny_model("llama-3.2-1b", vocab_size=len(tokenizer)), tokenizer, rows, config)
    assert trainer.train_dataset.to_list() == rows
    clock = baselines.UpdateClock()
    trainer.add_callback(clock)
    trainer.train()
    assert len(clock.seconds) == 2 and [r["num_tokens"] for r in trainer.state.log_history if "loss" in r] == [64, 128]


def kit_rows(tmp_path: Path, script: str, *flags: str) -> list[dict]:
    """bench/gpu_kit/<script>.py run with `flags` (in its own process: it sets the allocator before
    torch loads), its <script>.csv read back. One intra-op thread: on a loaded 2-core machine torch's
    spinning worker threads made a tiny cut's micro-batch take 0.2–4.4 s instead of 25–55 ms, and the
    4-layer cut time less than the 2-layer one."""
    done = subprocess.run([sys.executable, str(KIT / f"{script}.py"), "--out", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work"), *flags], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return list(csv.DictReader((tmp_path / f"out/{script}.csv").open()))


def test_defaults_dry_run_plans_every_case_for_the_gpu_lent_now(tmp_path):
    """The cases in their order (the model's own loss and the chunked loss, fused and foreach AdamW,
    then Liger), each planned for the H200 (no GPU here): the chunked loss and Liger plan less than
    the model's own loss, and foreach AdamW a step scratch that fused has not."""
    rows = kit_rows(tmp_path, "defaults", "--dry-run")
    assert "on H200" in (tmp_path / "out/defaults.md").read_text().splitlines()[0]
    assert [(r["shape"], r["method"], r["variant"]) for r in rows][:4] == [
        ("mistral-7b", "lora", "transformers"), ("mistral-7b", "lora", "finetune-chunked"),
        ("mistral-7b", "qlora", "transformers"), ("mistral-7b", "qlora", "finetune-chunked")]
    assert [r["variant"] for r in rows][-4:] == ["liger"] * 4 and {r["status"] for r in rows} == {"dry run"}
    planned = {(r["shape"], r["method"], r["variant"]): float(r["planned_gib"]) for r in rows}
    for shape in ("mistral-7b", "llama-3.1-8b"):
        for method in ("lora", "qlora"):
            own = planned[(shape, method, "transformers")]
            assert planned[(shape, method, "liger")] <= planned[(shape, method, "finetune-chunked")] < own
        step = {r["variant"]: float(r["planned_step_gib"]) for r in rows if (r["shape"], r["method"]) == (shape, "full")}
        assert step["fused"] == 0 < step["foreach"]


def test_defaults_run_on_cpu_through_the_trainers_own_pieces(tmp_path):
    """The GPU check's own code on this CPU, on a 2-layer cut of the catalog's tiny model in fp32: the
    chunked loss gives the model's own loss and LoRA gradients (LoRA and QLoRA), fused and foreach
    AdamW the same loss, Liger's cases are skipped with the run's one line, and the allocator says
    there is no CUDA device. (Peak memory is CUDA's only: not measured here.)"""
    rows = kit_rows(tmp_path, "defaults", "--shapes", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--precision", "fp32",
                         "--full-precision", "fp32", "--steps", "2")
    by_case = {(r["method"], r["variant"]): r for r in rows}
    assert by_case[("allocator", "set before torch loads (finetune's entry)")]["notes"].startswith("no CUDA device")
    for method in ("lora", "qlora"):
        own, chunked = by_case[(method, "transformers")], by_case[(method, "finetune-chunked")]
        assert own["status"] == chunked["status"] == "ok" and float(own["ms_per_update"]) > 0
        assert abs(float(chunked["loss_vs_own"])) < 1e-5 and 0 < float(chunked["grads_vs_own"]) < 1e-4
        assert by_case[(method, "liger")]["status"] == "skipped: running without Liger (Liger's Triton kernels need a CUDA GPU)"
    fused, foreach = by_case[("full", "fused")], by_case[("full", "foreach")]
    assert fused["status"] == foreach["status"] == "ok" and fused["loss"] == foreach["loss"]
    assert float(fused["planned_step_gib"]) == 0 < float(foreach["planned_step_gib"])


def test_speed_terms_dry_run_plans_each_term_per_layer_and_for_the_rest(tmp_path):
    """The shapes the speed model misses most come first, then the two anchors; every case has a
    per-layer and a rest row planned for the H200, the per-layer kernels counted, LoRA issuing more
    per layer than full fine-tuning (its adapters), the rest launching no decoder-layer kernels."""
    rows = kit_rows(tmp_path, "speed_terms", "--dry-run")
    assert "on H200" in (tmp_path / "out/speed_terms.md").read_text().splitlines()[0]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    assert cases[0].startswith("qwen2.5-1.5b lora") and cases[-1] == "mistral-7b lora s4096 b2 ckpt" and len(cases) == 6
    assert [r["part"] for r in rows] == ["per layer", "rest"] * 6 and {r["status"] for r in rows} == {"dry run"}
    layer = {r["case"]: r for r in rows if r["part"] == "per layer"}
    for r in layer.values():
        assert float(r["planned_kernels"]) > 0 and float(r["planned_busy_ms"]) > float(r["planned_matmul_ms"]) > 0
    assert float(layer["qwen2.5-1.5b lora s2048 b1"]["planned_host_ms"]) > float(layer["qwen2.5-1.5b full s2048 b1"]["planned_host_ms"])
    assert float(layer["qwen2.5-7b qlora s2048 b2"]["planned_dequant_ms"]) > 0
    assert all(float(r["planned_kernels"]) == 0 for r in rows if r["part"] == "rest")


def test_speed_terms_run_on_cpu_and_take_the_cuts_difference(tmp_path):
    """The same code on this CPU (tiny shape): both cuts train, the per-layer and rest rows hold the
    host and wall clocks, the GPU's columns stay empty without CUDA. (Their sign is not checked: on a
    loaded 2-core machine the difference of two tiny cuts' clocks is noise; `parts` is tested below.)"""
    rows = kit_rows(tmp_path, "speed_terms", "--cases", "tiny:lora:32:2,tiny:full:32:1", "--warmup", "1", "--steps", "2")
    assert [(r["case"], r["part"], r["status"]) for r in rows] == [
        ("tiny lora s32 b2", "per layer", "ok"), ("tiny lora s32 b2", "rest", "ok"),
        ("tiny full s32 b1", "per layer", "ok"), ("tiny full s32 b1", "rest", "ok")]
    for r in rows:
        assert r["measured_host_ms"] and r["measured_wall_ms"] and r["planned_host_ms"] and not r["measured_busy_ms"]
    assert all(math.isfinite(float(r[f"measured_{clock}_ms"])) for r in rows for clock in ("host", "wall"))


def test_speed_terms_sort_kernels_into_the_models_terms(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the import sets the allocator: undone after the test
        monkeypatch.delenv(name, raising=False)
    import speed_terms

    trace = {"traceEvents": [
        {"cat": "kernel", "name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "dur": 300},
        {"cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "dur": 100},
        {"cat": "kernel", "name": "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "dur": 200},
        {"cat": "kernel", "name": "void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(...)", "dur": 40},
        {"cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4, ...>", "dur": 60},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 999},
    ]}
    times = speed_terms.kernel_times(trace, micro_batches=2)
    assert times == pytest.approx({"matmul_ms": 0.2, "attention_ms": 0.1, "dequant_ms": 0.02, "other_ms": 0.03,
                                   "busy_ms": 0.35, "kernels": 2.5})
    assert speed_terms.parts({"host_ms": 30.0}, {"host_ms": 14.0}) == {"per layer": {"host_ms": 8.0}, "rest": {"host_ms": -2.0}}


def test_speed_terms_cases_are_picked_by_spec_or_glob_over_the_defaults(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the import sets the allocator: undone after the test
        monkeypatch.delenv(name, raising=False)
    import speed_terms

    assert speed_terms.chosen_cases("mistral-*,*:qlora:*,tiny:lora:32:2,qwen2.5-7b*") == [
        "mistral-7b:lora:4096:2:ckpt", "qwen2.5-7b:qlora:2048:2", "tiny:lora:32:2"]
    with pytest.raises(ValueError, match="'gemma-\\*' matches no default case"):
        speed_terms.chosen_cases("gemma-*")
    assert [c.label for c in speed_terms.parse_args(["--cases", "llama-*"]).cases] == ["llama-3.2-3b lora s1024 b1",
                                                                                        "llama-3.2-1b lora s512 b1"]


def test_memory_rows_are_picked_by_glob_over_their_labels(tmp_path):
    picked = "qwen2.5-1.5b-qlora-*-b?-ckpt,*-full-s512-b4-no-ckpt"
    result = subprocess.run([sys.executable, str(KIT / "memory.py"), "--dry-run", "--rows", picked, "--models", "qwen2.5-1.5b,llama-3.2-1b",
                             "--out", str(tmp_path), "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    labels = {memory.Row(r["model"], r["method"], int(r["seq_len"]), r["gradient_checkpointing"] == "True",
                         int(r["micro_batch_size"])).label for r in csv.DictReader((tmp_path / "memory.csv").open())}
    assert labels == {"qwen2.5-1.5b-qlora-s2048-b4-ckpt", "qwen2.5-1.5b-qlora-s2048-b1-ckpt", "qwen2.5-1.5b-qlora-s512-b1-ckpt",
                      "qwen2.5-1.5b-qlora-s512-b4-ckpt", "qwen2.5-1.5b-full-s512-b4-no-ckpt", "llama-3.2-1b-full-s512-b4-no-ckpt"}
    failed = subprocess.run([sys.executable, str(KIT / "memory.py"), "--dry-run", "--rows", "nothing-*", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2 and "--rows 'nothing-*' matches no row of the grid" in failed.stderr


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu_kit.test_gpu" name="test_tiny_trains_on_cuda[full]" time="6.21" />
<testcase classname="tests.gpu_kit.test_gpu" name="test_resume_on_cuda_repeats_the_uninterrupted_losses" time="9.5">
<failure message="AssertionError: assert [3, 4] == [3]&#10;more">trace</failure></testcase>
<testcase classname="tests.gpu_kit.test_gpu" name="test_zero2_offload_in_one_process" time="0.01">
<skipped type="pytest.skip" message="not run: the kit's time for the GPU tests ran out first (KIT_TEST_SECONDS)">x</skipped>
</testcase></testsuite></testsuites>"""


def test_gpu_tests_summary_from_pytests_report_or_from_its_log(tmp_path):
    """gpu-tests.md and .csv: one line per test from the JUnit XML; where pytest was killed before
    writing it, from its -v log, the test it was in named as not finished."""
    import gpu_tests

    (tmp_path / "report.xml").write_text(JUNIT)
    gpu_tests.main(["--xml", str(tmp_path / "report.xml"), "--log", str(tmp_path / "none.log"), "--out", str(tmp_path / "a")])
    rows = list(csv.DictReader((tmp_path / "a/gpu-tests.csv").open()))
    assert [(r["outcome"], r["seconds"]) for r in rows] == [("passed", "6.2"), ("failed", "9.5"), ("skipped", "0.0")]
    assert rows[1]["detail"] == "AssertionError: assert [3, 4] == [3]" and rows[2]["detail"].startswith("not run: the kit's time")
    summary = (tmp_path / "a/gpu-tests.md").read_text()
    assert summary.startswith("`pytest -m gpu tests/gpu_kit/test_gpu.py`: 1 passed, 1 failed, 1 skipped; 16 s")
    (tmp_path / "gpu.log").write_text("collected 11 items\n\ntests/gpu_kit/test_gpu.py::test_tiny_trains_on_cuda[full] PASSED [  9%]\n"
                                      "tests/gpu_kit/test_gpu.py::test_fsdp2_in_one_process FAILED [ 18%]\n"
                                      "tests/gpu_kit/test_gpu.py::test_resume_on_cuda_repeats_the_uninterrupted_losses ")
    gpu_tests.main(["--xml", str(tmp_path / "none.xml"), "--log", str(tmp_path / "gpu.log"), "--out", str(tmp_path / "b")])
    rows = list(csv.DictReader((tmp_path / "b/gpu-tests.csv").open()))
    assert [(r["test"], r["outcome"]) for r in rows] == [
        ("test_tiny_trains_on_cuda[full]", "passed"), ("test_fsdp2_in_one_process", "failed"),
        ("test_resume_on_cuda_repeats_the_uninterrupted_losses", "not finished")]
