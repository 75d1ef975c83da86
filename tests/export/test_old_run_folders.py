"""A run folder whose checkpoint manifests keep the resolved record under their former key (format 1,
`format_1_run`) exports as the same folder in today's format does: same weights, same model card,
the record's numbers read through config/run_folder.py."""

from __future__ import annotations

import json

import pytest

from finetune.config.run_folder import FORMER_MANIFEST_KEY, RESOLVED, ResolvedRecord, RunFolder
from finetune.export.card import read_run_record
from finetune.export.safetensors import export
from finetune.export.trained import find_trained


def test_the_old_folder_is_the_old_format(format_1_run, bpe_lora_run):
    """What the other tests compare: each old manifest holds the record under "run" only, and it is
    today's record of the same checkpoint."""
    for old in sorted(format_1_run.glob("checkpoints/step-*/manifest.json")):
        new = bpe_lora_run / "run" / old.relative_to(format_1_run)
        old_manifest, new_manifest = json.loads(old.read_text()), json.loads(new.read_text())
        assert (RESOLVED, FORMER_MANIFEST_KEY) == ("resolved", "run") and old_manifest["format_version"] == 1
        assert "run" in old_manifest and "resolved" not in old_manifest and "run" not in new_manifest
        assert ResolvedRecord.of_manifest(old_manifest) == ResolvedRecord.of_manifest(new_manifest)
        assert ResolvedRecord.of_manifest(old_manifest).train_examples == 32


@pytest.mark.parametrize("source", ["", "checkpoints/step-000002"], ids=["final model", "checkpoint"])
def test_an_old_folder_exports_with_the_same_weights_and_card(format_1_run, bpe_lora_run, tmp_path, source):
    exported = {}
    for name, folder in (("old", format_1_run), ("new", bpe_lora_run / "run")):
        trained = find_trained(folder / source)
        assert trained.precision == "fp32" and trained.method == "lora"
        record = read_run_record(trained)
        assert record.resolved.max_steps == 4 and record.resolved.train_examples == 32
        exported[name] = export(folder / source, tmp_path / name / "adapter")  # the same title
    files = {name: sorted(p.name for p in out.iterdir()) for name, out in exported.items()}
    assert files["old"] == files["new"] and "adapter_model.safetensors" in files["old"]
    for file in files["old"]:
        assert (exported["old"] / file).read_bytes() == (exported["new"] / file).read_bytes(), file
    card = (exported["old"] / "README.md").read_text()
    assert "(chat; 32 train / 8 eval examples)" in card  # the record's numbers, not "?"
    assert ("| optimizer steps | 2 of 4 |" if source else "| optimizer steps | 4 of 4 |") in card


def test_the_new_layout_reads_back_what_the_run_wrote(bpe_lora_run):
    """Today's run.yaml and manifest hold the same record, under the one key."""
    folder = RunFolder(bpe_lora_run / "run")
    config, record = folder.read_run_yaml()
    manifest = json.loads((folder.checkpoints / "step-000004" / "manifest.json").read_text())
    assert record == ResolvedRecord.of_manifest(manifest) and manifest["format_version"] == 2
    assert (record.precision, record.strategy, record.world_size, record.max_steps) == ("fp32", "single", 1, 4)
    assert config["method"] == "lora" and RESOLVED not in config
    assert folder.read_summary()["steps"] == 4 and [r["step"] for r in folder.read_metrics()] == [0, 4, 4]
