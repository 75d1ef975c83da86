"""Checkpointer on one process: layout and manifest, crash safety, rotation, resume and its refusals.

Multi-process saves, exact resume through the CLI and the kill -9 test are in test_resume_*.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import WORD_RUN_ROWS, WORD_RUN_WORDS, train_steps, weights
from safetensors import safe_open

from finetune.checkpoint import layout
from finetune.config.run_folder import FORMER_MANIFEST_KEY, RESOLVED, ResolvedRecord
from finetune.errors import CheckpointError


def test_layout_and_manifest_written_last(make_run):
    run = make_run(save_every=2)
    train_steps(run, 3)
    folder = run.checkpointer.directory / "step-000002"
    assert sorted(p.name for p in run.checkpointer.directory.iterdir()) == ["step-000002"]
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    assert {f["path"]: f["bytes"] for f in manifest["files"]} == {k: v for k, v in on_disk.items() if k != "manifest.json"}
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl",
            "custom_checkpoint_1.pkl", "hf/config.json", "hf/generation_config.json", "hf/tokenizer.json"} <= set(on_disk)
    # 2 updates of one micro-batch of 16 rows, each row WORD_RUN_WORDS target tokens (its words, then EOS)
    assert (manifest["step"], manifest["batches_in_epoch"], manifest["tokens_seen"]) == (2, 2, 2 * 16 * WORD_RUN_WORDS)
    assert manifest["world_size"] == 1 and manifest["strategy"] == "single" and manifest["model_weights"] == "all"
    assert manifest["identity"]["global_batch_size"] == 16 and manifest["config"]["save_every"] == 2
    trainable = sum(p.numel() for p in run.model.parameters())
    # the run's resolved record, under its one key: --eval-split 0.05 holds 3 rows out, and eval is off
    record = ResolvedRecord.of_manifest(manifest)
    assert RESOLVED in manifest and FORMER_MANIFEST_KEY not in manifest and record == run.resolved
    assert (record.train_examples, record.eval_examples, record.format, record.trainable_parameters) == (
        WORD_RUN_ROWS - 3, 0, "text", trainable)
    assert manifest["base_model"] == str(folder.parents[1] / "base_model")
    assert set(manifest["versions"]) >= {"torch", "accelerate", "transformers", "safetensors"}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == len(list(run.model.parameters()))  # tied lm_head stored once


def test_failed_save_leaves_previous_checkpoint_resumable(make_run):
    run = make_run(save_every=2)
    train_steps(run, 2)
    saved_weights = weights(run)

    def disk_full(models, weights, output_dir):  # after some files exist, like a full disk mid-save
        (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    handle = run.accelerator.register_save_state_pre_hook(disk_full)
    with pytest.raises(CheckpointError, match=r"step-000004 failed on rank 0: \[Errno 28\] No space left on device\. "
                                              r"The newest complete checkpoint is still step-000002; .*--resume auto"):
        train_steps(run, 2)
    handle.remove()
    directory = run.checkpointer.directory
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002", "step-000004.incomplete"]
    assert layout.complete_checkpoints(directory) == [directory / "step-000002"]

    resumed = make_run(save_every=2, resume="auto")
    assert resumed.checkpointer.resumed_from == directory / "step-000002"
    assert resumed.progress.step == 2
    for name, value in weights(resumed).items():
        torch.testing.assert_close(value, saved_weights[name], rtol=0, atol=0)
    train_steps(resumed, 2)  # the next good save publishes step 4 and clears the leftover
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002", "step-000004"]


def damage(path: Path) -> str:
    """Truncate a checkpoint file the way a bad copy would; returns what the manifest check says."""
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:10])
    return f"{path.name} has 10 bytes, the manifest says {size}"


def test_rotation_removes_unfinished_saves_and_old_complete_ones_never_damaged_ones(make_run):
    run = make_run(save_every=1, keep_last=2)
    train_steps(run, 3)
    directory = run.checkpointer.directory
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002", "step-000003"]
    (directory / "step-000009.incomplete").mkdir()  # a crashed save
    problem = damage(directory / "step-000002" / "optimizer.bin")  # no longer complete: may be the only copy of its work
    assert layout.incompleteness(directory / "step-000002") == problem
    train_steps(run, 1)
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002", "step-000003", "step-000004"]

    newest_only = make_run(save_every=1, keep_last=1, resume="auto")
    train_steps(newest_only, 2)
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002", "step-000006"]


def test_resume_auto_names_damaged_checkpoints_and_resumes_from_the_newest_complete_one(make_run, capsys):
    run = make_run(save_every=2)
    train_steps(run, 4)
    directory = run.checkpointer.directory
    problem = damage(directory / "step-000004" / "optimizer.bin")
    (directory / "step-000006.incomplete").mkdir()  # and a save that never finished
    with pytest.raises(CheckpointError, match=f"newest checkpoints in .* are damaged:\n  - step-000004 is damaged: {problem}"):
        make_run(resume=str(directory.parent))  # an output dir: the user names the checkpoint

    resumed = make_run(save_every=2, resume="auto")
    assert resumed.checkpointer.resumed_from == directory / "step-000002"
    printed = capsys.readouterr().out
    assert f"checkpoint step-000004 is damaged, not resuming from it: {problem}" in printed
    assert "ignoring step-000006.incomplete: a save that never finished" in printed
    assert "resuming from step-000002, the newest complete checkpoint; the damaged ones stay as they are" in printed
    train_steps(resumed, 2)  # saves step 4 again: the damaged folder is moved aside, not deleted
    (kept,) = directory.glob("step-000004.damaged-*")
    assert layout.incompleteness(kept) == problem and f"kept it as {kept.name}" in capsys.readouterr().out
    assert layout.complete_checkpoints(directory) == [directory / "step-000002", directory / "step-000004"]


def test_resume_auto_stops_when_checkpoints_exist_but_none_is_complete(make_run, tmp_path):
    train_steps(make_run(save_every=1), 1)
    directory = layout.checkpoints_dir(tmp_path / "out")
    problem = damage(directory / "step-000001" / "optimizer.bin")
    before = sorted((str(p), p.stat().st_size) for p in directory.rglob("*"))
    with pytest.raises(CheckpointError) as error:
        make_run(resume="auto", save_every=1)
    message = str(error.value)
    assert f"holds checkpoints, but none is complete:\n  - step-000001: {problem}" in message
    assert "fix:" in message and f"rm -r {directory / 'step-000001'}" in message and "another --output-dir" in message
    with pytest.raises(CheckpointError, match="already holds checkpoints of an earlier run .newest: step-000001"):
        make_run(save_every=1)  # a fresh run would rotate it away with its first save
    assert sorted((str(p), p.stat().st_size) for p in directory.rglob("*")) == before


def test_auto_resume_picks_newest_complete_and_restores_everything(make_run):
    reference = make_run(save_every=3)
    train_steps(reference, 3)
    expected_losses = train_steps(reference, 3, save=False)
    expected_weights, expected_lr = weights(reference), reference.scheduler.get_last_lr()
    directory = reference.checkpointer.directory
    (directory / "step-000005").mkdir()  # newer but without a manifest: a half-written folder
    (directory / "step-000005" / "model.safetensors").write_bytes(b"x")

    resumed = make_run(save_every=3, resume="auto")
    assert resumed.checkpointer.resumed_from == directory / "step-000003"
    assert (resumed.progress.step, resumed.progress.tokens_seen, resumed.checkpointer.last_saved_step) == (3, 3 * 16 * WORD_RUN_WORDS, 3)
    assert resumed.scheduler.last_epoch == 3
    assert train_steps(resumed, 3, save=False) == expected_losses  # bitwise: weights, Adam moments, RNG
    assert resumed.scheduler.get_last_lr() == expected_lr
    for name, value in weights(resumed).items():
        torch.testing.assert_close(value, expected_weights[name], rtol=0, atol=0)

    explicit = make_run(resume=str(directory / "step-000003"))
    assert explicit.checkpointer.resumed_from == directory / "step-000003"
    with pytest.raises(CheckpointError, match="step-000005 is not a complete checkpoint: no manifest.json"):
        make_run(resume=str(directory / "step-000005"))


def test_resume_auto_without_checkpoints_starts_fresh_and_fresh_run_refuses_old_ones(make_run, tmp_path, capsys):
    unfinished = layout.checkpoints_dir(tmp_path / "out") / "step-000003.incomplete"
    unfinished.mkdir(parents=True)  # a first save that never finished holds no checkpoint
    run = make_run(resume="auto", save_every=1)
    assert run.checkpointer.resumed_from is None and run.progress.step == 0
    assert "ignoring step-000003.incomplete: a save that never finished" in capsys.readouterr().out
    train_steps(run, 1)
    assert not unfinished.exists()
    with pytest.raises(CheckpointError, match="already holds checkpoints of an earlier run .newest: step-000001.*--resume auto"):
        make_run(save_every=1)


def test_resume_with_other_config_lists_every_difference(make_run):
    train_steps(make_run(save_every=1), 1)
    with pytest.raises(CheckpointError) as error:
        make_run(resume="auto", lr=1e-4, global_batch_size=32, micro_batch_size=8, max_steps=99)
    message = str(error.value)
    assert "peak_lr: checkpoint 0.001, this run 0.0001" in message
    assert "global_batch_size: checkpoint 16, this run 32" in message
    assert "micro_batch_size: checkpoint 16, this run 8" in message
    assert "max_steps" not in message  # extending a run is what resuming is for
    assert make_run(resume="auto", max_steps=99, log_every=5).checkpointer.resumed_from is not None


def test_lora_checkpoint_holds_only_adapters(make_run):
    run = make_run(method="lora", save_every=1)
    train_steps(run, 1)
    folder = run.checkpointer.directory / "step-000001"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert keys == trainable and all("lora_" in k for k in keys) and len(keys) == 2 * 7 * 2  # A, B × 7 linears × 2 layers
    assert json.loads((folder / "hf" / "adapter_config.json").read_text())["r"] == 4
    expected = weights(run)

    resumed = make_run(method="lora", resume="auto")
    for name, value in weights(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_preemption_signal_forces_a_save_and_sets_preempted(make_run):
    before = signal.getsignal(signal.SIGUSR1)
    run = make_run(save_every=100)
    train_steps(run, 1)
    assert not run.checkpointer.should_save(1) and not run.checkpointer.preempted
    os.kill(os.getpid(), signal.SIGUSR1)
    assert run.checkpointer.should_save(2) and run.checkpointer.preempted
    run.checkpointer.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_resume_refuses_pickles_that_run_code(make_run, tmp_path):
    train_steps(make_run(save_every=1), 1)
    folder = tmp_path / "out" / "checkpoints" / "step-000001"
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save({"step": Payload()}, folder / "custom_checkpoint_0.pkl")
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        entry["bytes"] = (folder / entry["path"]).stat().st_size
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"custom_checkpoint_0.pkl: posix.system"):
        make_run(resume="auto")
    assert not marker.exists()
