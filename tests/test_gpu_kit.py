"""The GPU validation kit's own logic, on CPU: the scripts parse, wheels are slimmed without breaking
their RECORD, the carry budget counts what travels, memory.py lists its grid with the planner's
predictions, and run.sh installs and stops cleanly where CUDA is first needed."""

import argparse
import csv
import dataclasses
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from helpers import REPO

KIT = REPO / "bench/gpu"
sys.path.insert(0, str(KIT))

import memory  # noqa: E402
import wheels  # noqa: E402


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
    assert {"datasets", "bitsandbytes", "deepspeed", "pyarrow"} <= {r.split("==")[0] for r in requirements}
    assert wheels.distribution(Path("charset_normalizer-3.4.3-cp312-cp312-manylinux2014_x86_64.whl")) == "charset-normalizer"


def test_budget_counts_the_tree_and_the_wheels(tmp_path):
    tree = wheels.tree_bytes()
    assert 0 < tree < wheels.BUDGET_BYTES / 8  # the code and its builtin data: well under a megabyte or two
    (tmp_path / "big.whl").write_bytes(b"\0" * 2**20)
    used, limit = wheels.budget(tmp_path)
    assert used == tree + 2**20 and limit == 64 * 2**20


def test_grid_covers_every_combination_with_base_cases_first():
    rows = memory.grid()
    assert len(rows) == len(set(rows)) == 4 * 3 * 2 * 2 * 2
    first = rows[: len(memory.MODELS) * len(memory.METHODS)]
    assert {(r.model, r.method) for r in first} == {(m, k) for m in memory.MODELS for k in memory.METHODS}
    assert {(r.seq_len, r.gradient_checkpointing, r.micro_batch_size) for r in first} == {(512, False, 1)}


def test_dry_run_lists_rows_with_the_planners_predictions(tmp_path):
    result = subprocess.run([sys.executable, str(KIT / "memory.py"), "--dry-run", "--gpu", "A100-40GB", "--limit", "4",
                             "--methods", "full,qlora", "--models", "llama-3.2-1b,llama-7b", "--out", str(tmp_path),
                             "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader((tmp_path / "memory.csv").open()))
    assert [(r["model"], r["method"]) for r in rows] == [("llama-3.2-1b", "full"), ("llama-3.2-1b", "qlora"),
                                                         ("llama-7b", "full"), ("llama-7b", "qlora")]
    status = {(r["model"], r["method"]): r["status"] for r in rows}
    assert status[("llama-3.2-1b", "qlora")] == "dry run"
    assert status[("llama-7b", "full")].startswith("skipped: predicted")  # ~16 B/parameter > 40 GB
    assert all(float(r["predicted_allocated_gib"]) > 0 and float(r["predicted_tokens_per_second"]) > 0 for r in rows)
    (example,) = [line for line in result.stdout.splitlines() if line.startswith("each row runs, e.g.: python -m finetune")]
    assert "--method full --precision bf16-mixed --micro-batch-size 1" in example and "--max-seq-len 512" in example
    table = (tmp_path / "memory.md").read_text()
    assert "A100-40GB (catalog, dry run)" in table and table.count("\n| llama") == 4
    assert not (tmp_path / "work/random-init").exists()  # a dry run writes no checkpoint


def test_rows_run_the_trainer_with_the_planned_precision(tmp_path):
    row = memory.Row("llama-7b", "qlora", 2048, True, 4)
    flags = row.train_flags("/ckpt", "/data.jsonl", "/out")
    assert flags[flags.index("--precision") + 1] == "bf16-true" and "--gradient-checkpointing" in flags
    assert flags[flags.index("--max-seq-len") + 1] == "2048" and "--no-save-final" in flags
    data = memory.write_text_data(tmp_path / "data.jsonl", 512)
    assert all(len(line) > 512 for line in data.read_text().splitlines())


def make_venv_seeing_these_packages(venv: Path, pip: bool = False) -> None:
    """A venv that sees the packages this interpreter sees, also when this interpreter is itself a venv's
    (--system-site-packages alone would show only the base interpreter's): a .pth file adds them
    after the new venv's own site-packages, so what gets installed there wins. `pip`: its own pip, so
    `pip install` on PATH installs into it."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", *([] if pip else ["--without-pip"]), str(venv)],
                   check=True)
    own = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    seen = [path for path in sys.path if path.endswith("-packages")]  # addsitedir: their own .pth files count too
    (Path(own) / "_outer_site_packages.pth").write_text("".join(f"import site; site.addsitedir({path!r})\n" for path in seen))


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
    log = (out / "run.log").read_text()
    assert result.returncode == 3, log[-3000:]
    assert "installed 1 wheel(s): gpukit-probe" in log and "already installed, kept: tqdm" in log
    assert "no CUDA device: stopping before the GPU steps" in log and "pytest -m gpu" not in log
    assert "torch" in (out / "environment.txt").read_text()
    python = str(venv / "bin/python")
    check = "import gpukit_probe, tqdm, finetune; print(gpukit_probe.VERSION, tqdm.__version__ != '0.0.1', finetune.__file__)"
    printed = subprocess.run([python, "-c", check], capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert printed[:2] == ["1.0", "True"] and printed[2] == str(REPO / "finetune/__init__.py")


def test_time_guard_lists_rows_it_cannot_finish_without_running_or_predicting(tmp_path):
    rows = memory.grid(["llama-3.2-1b"], ["lora"])[:3]
    results = memory.run_grid(rows, "H100-80GB", 79.6, tmp_path, deadline=time.time() + 5, dry_run=False)
    assert [r["status"] for r in results] == ["not run: time"] * 3
    assert not any("predicted_allocated_gib" in r for r in results) and not (tmp_path / "runs").exists()


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


def test_throughput_dry_run_lists_every_program_with_finetune_planned():
    import throughput

    result = subprocess.run([sys.executable, str(KIT / "throughput.py"), "--dry-run", "--method", "qlora",
                             "--micro-batch-size", "4"], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert "mistral-7b qlora" in lines[0] and "micro batch 4" in lines[0]
    rows = {row.name: row for row in throughput.ROWS}
    assert {row.program for row in rows.values()} == {"finetune", "trl", "peft-loop"}
    for line in lines[1:]:
        name = line[:36].strip()
        row = rows.pop(name)
        if row.program == "finetune":
            args = argparse.Namespace(model="mistral-7b", method="qlora", seq_len=4096, micro_batch_size=4, gpu="H100-80GB")
            assert f"planned {throughput.planned(row, args):,.0f} tok/s" in line
        else:
            assert "not planned" in line
    assert rows == {}
