"""Evaluation in a run (the CLI's training path, in process): off with --max-eval-examples 0, eval
loss by default, greedy exact-match generation bounded by --eval-generate (on for the builtin
dataset, off for other data unless asked), a progress bar, and a summary that reads either way."""

from __future__ import annotations

import json
import re

import pytest

from finetune import cli
from finetune.config.flags import parse_config
from finetune.config.options import TrainConfig
from finetune.config.run_folder import read_metrics
from finetune.errors import ConfigError
from finetune.train import loop, run

SHORT = ["--max-steps", "2", "--micro-batch-size", "4", "--warmup-steps", "1", "--log-every", "1", "--num-samples", "1"]


@pytest.fixture
def arithmetic(tmp_path):
    """40 alpaca rows of the builtin kind: the builtin tokenizer encodes them, and they tokenize in no time."""
    path = tmp_path / "arithmetic.jsonl"
    path.write_text("".join(json.dumps({"instruction": "Add.", "input": f"{i}+{i % 7}", "output": str(i + i % 7)}) + "\n"
                            for i in range(40)))
    return str(path)


@pytest.fixture
def generated(monkeypatch):
    """The prompts each greedy generation pass was asked to answer, as it runs."""
    calls = []
    greedy = loop.greedy_completions

    def counting(model, tokenizer, prompts, *args, **kwargs):
        calls.append(len(prompts))
        return greedy(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(loop, "greedy_completions", counting)
    return calls


def train(tmp_path, *flags: str) -> tuple[dict, list[dict]]:
    assert cli.main([*SHORT, "--output-dir", str(tmp_path / "out"), *flags]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    return summary, read_metrics(tmp_path / "out" / "metrics.jsonl")


def test_max_eval_examples_0_means_no_evaluation(tmp_path, arithmetic, generated, capsys):
    summary, records = train(tmp_path, "--dataset", arithmetic, "--max-eval-examples", "0")
    assert summary["steps"] == 2 and summary["eval_loss_before"] is None and summary["exact_match_after"] is None
    assert [r["step"] for r in records] == [1, 2] and not any("eval_loss" in r for r in records)
    assert generated == []
    printed = capsys.readouterr().out
    assert "eval: off (--max-eval-examples 0)" in printed and "2 optimizer steps; no evaluation" in printed


def test_other_data_gets_eval_loss_and_generates_only_when_asked(tmp_path, arithmetic, generated, capsys):
    summary, records = train(tmp_path, "--dataset", arithmetic, "--eval-split", "0.2")
    assert generated == [] and summary["exact_match_before"] is None and summary["samples"] == []
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 2]
    printed = capsys.readouterr().out
    assert "eval: loss on 8 examples; no generation (--eval-generate N" in printed
    assert re.search(r"eval loss: +\d+%\|", printed)  # the eval progress bar (main process; how far it got
    # before tqdm's next refresh depends on the machine's speed)
    assert "eval loss" in run.format_summary(summary) and "exact match" not in run.format_summary(summary)

    summary, records = train(tmp_path / "generating", "--dataset", arithmetic, "--eval-split", "0.2", "--eval-generate", "3")
    assert generated == [3, 3]  # before and after training, 3 of the 8 eval prompts each
    assert summary["exact_match_before"] is not None and len(summary["samples"]) == 1
    assert [sorted(r) for r in records if "eval_loss" in r] == [["eval_loss", "exact_match", "step"]] * 2
    assert "exact match (greedy)" in run.format_summary(summary)


def test_samples_show_the_answer_before_and_after_training(tmp_path, arithmetic, monkeypatch):
    answers = []  # what each greedy pass returned: before training, then after
    greedy = loop.greedy_completions

    def recording(*args, **kwargs):
        answers.append(greedy(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(loop, "greedy_completions", recording)
    summary, _ = train(tmp_path, "--dataset", arithmetic, "--eval-split", "0.2", "--eval-generate", "2", "--num-samples", "2")
    assert len(answers) == 2 and len(summary["samples"]) == 2
    for index, sample in enumerate(summary["samples"]):
        assert (sample["before"], sample["generated"]) == (answers[0][index], answers[1][index])
    shown = run.format_summary(summary)
    sample = summary["samples"][1]
    assert f"  before:   {sample['before']!r}\n  after:    {sample['generated']!r}\n  expected: {sample['expected']!r}" in shown


def test_generation_defaults_on_for_the_builtin_dataset_only():
    assert run.generated_prompts(TrainConfig(), available=200) == 200
    assert run.generated_prompts(TrainConfig(dataset="my.jsonl"), available=200) == 0
    assert run.generated_prompts(TrainConfig(dataset="my.jsonl", eval_generate=16), available=200) == 16
    assert run.generated_prompts(TrainConfig(eval_generate=500), available=200) == 200


@pytest.mark.parametrize(("flags", "problem"), [
    (["--max-eval-examples", "0", "--eval-every", "5"], "--max-eval-examples 0 turns evaluation off"),
    (["--max-eval-examples", "0", "--eval-generate", "8"], "--max-eval-examples 0 turns evaluation off"),
    (["--eval-generate", "-1"], "--eval-generate must be ≥ 0, got -1"),
    (["--max-eval-examples", "-1"], "--max-eval-examples must be ≥ 0, got -1"),
])
def test_contradictory_eval_flags_are_refused(flags, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_config(flags)
