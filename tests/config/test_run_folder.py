"""config/run_folder.py: the run folder's names in one module, the ResolvedRecord through run.yaml and a
manifest and back, the metrics reader. No torch: these are the readers' own terms."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from finetune.config import run_folder
from finetune.config.flags import parse_config
from finetune.config.options import TrainConfig
from finetune.config.run_folder import ResolvedRecord, RunFolder, read_metrics
from finetune.errors import FinetuneError

PACKAGE = Path(run_folder.__file__).parents[1]
RECORD = ResolvedRecord(world_size=2, gradient_accumulation_steps=4, global_batch_size=16, max_steps=30, peak_lr=2e-4,
                        precision="bf16-mixed", strategy="ddp", format="chat", train_examples=950, eval_examples=50,
                        trainable_parameters=1_000, total_parameters=9_000)


def test_run_yaml_holds_the_options_and_the_record_under_one_key(tmp_path):
    config = TrainConfig(method="lora", lr=3e-4, max_steps=30, output_dir=str(tmp_path))
    folder = RunFolder(tmp_path)
    assert folder.write_run_yaml(config, RECORD) == tmp_path / "run.yaml"
    written = yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert set(written) - set(config.to_dict()) == {"resolved"}
    assert list(written["resolved"]) == [f.name for f in dataclasses.fields(ResolvedRecord)]
    options, record = folder.read_run_yaml()
    assert record == RECORD and options == config.to_dict()
    assert parse_config(["--config", str(folder.run_yaml)]) == config  # loads back as options, the record left out


def test_a_manifest_record_is_read_under_either_key_and_typed():
    assert ResolvedRecord.of_manifest({"resolved": RECORD.to_dict()}) == RECORD
    assert ResolvedRecord.of_manifest({"run": RECORD.to_dict()}) == RECORD  # format_version 1
    assert ResolvedRecord.of_manifest({"step": 3}) == ResolvedRecord()  # a bare manifest: every field None
    newer = ResolvedRecord.of_manifest({"resolved": {"precision": "fp32", "kept_by_a_newer_version": 1}})
    assert newer == ResolvedRecord(precision="fp32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        newer.precision = "bf16-mixed"


def test_a_folder_without_a_finished_run_reads_empty(tmp_path):
    folder = RunFolder(tmp_path)
    assert folder.read_summary() == {} and folder.read_metrics() == []
    assert RunFolder.of_checkpoint(tmp_path / "checkpoints" / "step-000002").path == tmp_path
    folder.write_summary({"steps": 2})
    assert folder.read_summary() == {"steps": 2}
    with pytest.raises(OSError):
        folder.read_run_yaml()


def test_metrics_rows_leave_out_a_last_line_cut_short_and_name_a_broken_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 1, "eval_loss": 2.4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "lo')  # killed while writing
    assert read_metrics(path) == rows == RunFolder(tmp_path).read_metrics()
    path.write_text(json.dumps(rows[0]) + "\n{broken\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(FinetuneError, match=r"metrics.jsonl, line 2: not a JSON row"):
        read_metrics(path)


def test_no_other_module_names_a_file_of_the_run_folder():
    """The folder's file names are string constants of run_folder.py alone (checkpoints/ and hf/ aside:
    those words also name a Kubernetes volume and an export's staging folder)."""
    names = run_folder.RUN_FILES | {run_folder.MANIFEST}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "run_folder.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}")
    assert not found, "use config/run_folder.py's names:\n" + "\n".join(found)
