"""The tokenized-data cache: a second preparation reads what the first wrote instead of tokenizing,
gives the same data, and every ingredient of the fingerprint (rows, tokenizer, options, our code,
library versions) makes a new entry; tokenizing in several processes gives the same data; a
2-process run tokenizes once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import datasets
import pytest
from helpers import REPO, write_jsonl

import finetune.data
from finetune import cli
from finetune.config.options import TrainConfig
from finetune.data import cache, prepare_data, tokenize_processes
from finetune.errors import FinetuneError

ROWS = [{"instruction": "Add.", "input": f"{a}+{b}", "output": str(a + b)} for a in range(4) for b in range(4)]


@pytest.fixture
def encoded_rows(monkeypatch) -> list[int]:
    """How many rows each later `encode` call tokenizes: empty when nothing was tokenized."""
    calls = []
    encode = finetune.data.encode

    def counting_encode(rows, *args, **kwargs):
        calls.append(len(rows))
        return encode(rows, *args, **kwargs)

    monkeypatch.setattr(finetune.data, "encode", counting_encode)
    return calls


def contents(data) -> tuple:
    return data.format, data.train.to_list(), data.eval.to_list(), data.eval_prompts


def entries(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir())


def test_second_preparation_reads_the_cache_instead_of_tokenizing(tmp_path, tokenizer, encoded_rows):
    config = TrainConfig(dataset=str(write_jsonl(tmp_path / "a.jsonl", ROWS)), eval_split="0.25",
                         data_cache=str(tmp_path / "cache"), packing=True)
    first = prepare_data(config, tokenizer)
    assert not first.reused and sum(encoded_rows) == len(ROWS) and first.origin.startswith("tokenized into")
    encoded_rows.clear()
    second = prepare_data(config, tokenizer)
    assert second.reused and encoded_rows == [] and second.origin == f"reused from {first.cache_entry}"
    assert entries(tmp_path / "cache") == [first.cache_entry.name] == [second.cache_entry.name]
    # read back memory-mapped from the entry, identical to what tokenizing in memory gives
    assert all(Path(f["filename"]).is_relative_to(first.cache_entry) for f in second.train.cache_files)
    assert second.train.cache_files and contents(second) == contents(first)
    in_memory = prepare_data(replace(config, data_cache="none"), tokenizer)
    assert in_memory.cache_entry is None and contents(in_memory) == contents(second)
    assert sum(encoded_rows) == len(ROWS)


def _change_rows(config, tokenizer, tmp_path, monkeypatch):
    path = Path(config.dataset)
    text = path.read_text()
    before = path.stat()
    path.write_text(text.replace('"output": "0"', '"output": "9"'))  # same size, different rows
    assert len(path.read_text()) == len(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the old modification time
    return config, tokenizer


def _change_vocabulary(config, tokenizer, tmp_path, monkeypatch):
    tokenizer.add_tokens(["Add."])
    return config, tokenizer


def _change_chat_template(config, tokenizer, tmp_path, monkeypatch):
    tokenizer.chat_template = tokenizer.chat_template.replace("capitalize", "upper")
    return config, tokenizer


def _change_code(config, tokenizer, tmp_path, monkeypatch):
    copy = tmp_path / "package"
    shutil.copytree(Path(cache.__file__).parent, copy, ignore=shutil.ignore_patterns("builtin", "__pycache__"))
    with open(copy / "packing.py", "a") as source:
        source.write("\n# an edit\n")
    monkeypatch.setattr(cache, "__file__", str(copy / "cache.py"))
    return config, tokenizer


def _change_library(config, tokenizer, tmp_path, monkeypatch):
    installed = cache.version
    monkeypatch.setattr(cache, "version", lambda name: "0.0.0" if name == "tokenizers" else installed(name))
    return config, tokenizer


OPTION_CHANGES = {"dataset": None, "format": "alpaca", "train_on_prompt": True, "max_seq_len": 128, "packing": True,
                  "eval_split": "0.5", "max_eval_examples": 2, "seed": 1}
INGREDIENTS = {"rows": _change_rows, "vocabulary": _change_vocabulary, "chat template": _change_chat_template,
               "code": _change_code, "library": _change_library}


@pytest.mark.parametrize("ingredient", [*INGREDIENTS, *OPTION_CHANGES])
def test_each_ingredient_of_the_fingerprint_makes_a_new_entry(tmp_path, tokenizer, monkeypatch, encoded_rows, ingredient):
    path = write_jsonl(tmp_path / "a.jsonl", ROWS)
    config = TrainConfig(dataset=str(path), eval_split="0.25", data_cache=str(tmp_path / "cache"))
    first = prepare_data(config, tokenizer)
    if ingredient in INGREDIENTS:
        config, tokenizer = INGREDIENTS[ingredient](config, tokenizer, tmp_path, monkeypatch)
    elif ingredient == "dataset":  # the same rows under another name
        config = replace(config, dataset=str(shutil.copy(path, tmp_path / "b.jsonl")))
    else:
        config = replace(config, **{ingredient: OPTION_CHANGES[ingredient]})
    encoded_rows.clear()
    second = prepare_data(config, tokenizer)
    assert not second.reused and encoded_rows and second.cache_entry != first.cache_entry
    assert entries(tmp_path / "cache") == sorted([first.cache_entry.name, second.cache_entry.name])


def test_the_fingerprint_covers_every_option_the_data_layer_reads():
    read = set()
    for source in Path(cache.__file__).parent.glob("*.py"):
        read |= set(re.findall(r"(?<!finetune\.)\bconfig\.(\w+)", source.read_text()))  # not the config/ package
    where_not_what = {"data_cache", "dataset_num_proc"}  # where the result is kept and how fast it is made
    assert read - where_not_what <= set(cache.DATA_OPTIONS) and "max_seq_len" in read
    assert set(cache.DATA_OPTIONS) <= {f.name for f in fields(TrainConfig)}


def test_several_tokenizing_processes_give_the_same_data(tmp_path, tokenizer, monkeypatch):
    config = TrainConfig(dataset=str(write_jsonl(tmp_path / "a.jsonl", ROWS)), data_cache="none", packing=True, max_seq_len=128)
    alone = prepare_data(replace(config, dataset_num_proc=1), tokenizer)
    encode, pids = finetune.data.encode, tmp_path / "pids"

    def encode_and_log_pid(rows, *args, **kwargs):  # runs in the worker processes: log to a file
        with open(pids, "a") as log:
            log.write(f"{os.getpid()}\n")
        return encode(rows, *args, **kwargs)

    monkeypatch.setattr(finetune.data, "encode", encode_and_log_pid)
    split = prepare_data(replace(config, dataset_num_proc=2), tokenizer)
    workers = set(pids.read_text().split())
    assert len(workers) >= 2 and str(os.getpid()) not in workers  # a pool for train, another for eval
    assert contents(split) == contents(alone)
    affinity = len(os.sched_getaffinity(0))
    assert [tokenize_processes(None, rows) for rows in (100, 19_999, 40_000, 10**9)] == [1, 1, min(2, affinity), affinity]
    assert tokenize_processes(3, 100) == 3


def test_a_process_that_loses_the_race_to_publish_keeps_the_winners_entry(tmp_path, tokenizer):
    config = TrainConfig(dataset=str(write_jsonl(tmp_path / "a.jsonl", ROWS)), data_cache="none", eval_split="0.5")
    ours = prepare_data(replace(config, max_eval_examples=4), tokenizer)
    theirs = prepare_data(config, tokenizer)
    entry = tmp_path / "entry"
    cache.write(entry, datasets.DatasetDict(train=theirs.train, eval=theirs.eval), {"by": "them"})
    cache.write(entry, datasets.DatasetDict(train=ours.train, eval=ours.eval), {"by": "us"})
    tables, meta = cache.read(entry)
    assert meta == {"by": "them"} and len(tables["eval"]) == 8
    assert entries(tmp_path) == ["a.jsonl", "entry"]  # our partial copy is gone


def test_a_damaged_entry_is_named_with_the_fix(tmp_path, tokenizer):
    config = TrainConfig(dataset=str(write_jsonl(tmp_path / "a.jsonl", ROWS)), data_cache=str(tmp_path / "cache"))
    entry = prepare_data(config, tokenizer).cache_entry
    for arrow in entry.rglob("*.arrow"):
        arrow.unlink()
    with pytest.raises(FinetuneError, match=f"cache entry {entry} is unreadable.*delete it and run again"):
        prepare_data(config, tokenizer)


def test_cache_location_and_unwritable_cache(tmp_path, tokenizer, monkeypatch):
    monkeypatch.delenv(cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root(None) == tmp_path / "xdg" / "finetune" / "data"
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "env"))
    assert cache.cache_root(None) == tmp_path / "env" and cache.cache_root("~/here") == Path.home() / "here"
    assert cache.cache_root("none") is None
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(FinetuneError, match=r"Could not write tokenized data to .*file/cache.*--data-cache none"):
        rows = write_jsonl(tmp_path / "a.jsonl", ROWS)
        prepare_data(TrainConfig(dataset=str(rows), data_cache=str(tmp_path / "file" / "cache")), tokenizer)


@pytest.mark.slow  # a training run: ~15 s here
def test_prepare_command_fills_the_cache_that_the_training_run_reads(tmp_path, capsys, encoded_rows):
    flags = ["--dataset", str(write_jsonl(tmp_path / "a.jsonl", ROWS)), "--eval-split", "0.25",
             "--data-cache", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "run")]
    assert cli.main(["prepare", *flags]) == 0
    [entry] = entries(tmp_path / "cache")
    assert f"12 train / 4 eval examples (alpaca), tokenized into {tmp_path / 'cache' / entry}\n" in capsys.readouterr().out
    encoded_rows.clear()
    assert cli.main([*flags, "--max-steps", "1", "--num-samples", "0", "--no-save-final"]) == 0
    assert encoded_rows == [] and f"reused from {tmp_path / 'cache' / entry}" in capsys.readouterr().out
    assert cli.main(["prepare", *flags, "--data-cache", "none"]) == 2
    assert "drop --data-cache none" in capsys.readouterr().err


def prepare(*flags: str) -> str:
    """`finetune prepare` as a user runs it; its one line of output."""
    result = subprocess.run([sys.executable, "-m", "finetune", "prepare", *flags], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_rows_rewritten_under_their_old_modification_time_are_tokenized_again(tmp_path):
    """The cache follows the file's bytes: other rows with the size and mtime put back are new data
    (datasets' own tables of the file included), and touching a file without changing it is not."""
    path = write_jsonl(tmp_path / "a.jsonl", ROWS)
    flags = ["--dataset", str(path), "--eval-split", "0.25", "--data-cache", str(tmp_path / "cache")]
    assert "12 train / 4 eval examples (alpaca), tokenized into" in prepare(*flags)
    before = path.stat()
    write_jsonl(path, ROWS * 5)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    assert "60 train / 20 eval examples (alpaca), tokenized into" in prepare(*flags)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # same bytes, another time
    assert "60 train / 20 eval examples (alpaca), reused from" in prepare(*flags)
    assert len(entries(tmp_path / "cache")) == 2


COUNTING_RUN = """
import os, sys
import finetune.data
from finetune.cli import main  # what `accelerate launch -m finetune` runs

encode = finetune.data.encode

def counting_encode(rows, *args, **kwargs):
    with open(os.environ["ENCODED_ROWS"], "a") as log:
        log.write(f"rank {os.environ['RANK']} encoded {len(rows)}\\n")
    return encode(rows, *args, **kwargs)

finetune.data.encode = counting_encode
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_two_process_run_tokenizes_once(tmp_path):
    """Rank 0 tokenizes while rank 1 waits, then rank 1 reads rank 0's entry."""
    script = tmp_path / "counting_run.py"
    script.write_text(COUNTING_RUN)
    log = tmp_path / "encoded_rows.log"
    env = {**os.environ, "ENCODED_ROWS": str(log), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs/ddp.yaml"),
               "--num_processes", "2", "--main_process_port", "0", str(script), "--max-steps", "1",
               "--micro-batch-size", "2", "--max-eval-examples", "4", "--num-samples", "0", "--no-save-final",
               "--data-cache", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "run")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = log.read_text().splitlines()
    assert {line.split(" encoded ")[0] for line in lines} == {"rank 0"}
    assert sum(int(line.split(" encoded ")[1]) for line in lines) == 4000 - 200 + 4  # builtin train + eval rows
    [entry] = entries(tmp_path / "cache")
    assert f"tokenized into {tmp_path / 'cache' / entry}" in done.stdout
