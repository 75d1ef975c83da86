"""The shipped example datasets (examples/smarthome, and its preference pairs in examples/smarthome-preference):
exactly what their generator writes, in the formats finetune reads, with held-out requests that never appear in train."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO

from finetune.data.formats import check_rows, detect_format
from finetune.data.preference import check_preference_rows
from finetune.data.sources import load_splits

SMARTHOME = REPO / "examples" / "smarthome"
PAIRS = REPO / "examples" / "smarthome-preference"


def test_smarthome_files_are_what_the_seeded_generator_writes(tmp_path):
    subprocess.run([sys.executable, str(SMARTHOME / "make_data.py"), "--out", str(tmp_path / "chat"),
                    "--preference-out", str(tmp_path / "pairs")], check=True, capture_output=True)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "chat" / name).read_bytes() == (SMARTHOME / name).read_bytes(), name
        assert (tmp_path / "pairs" / name).read_bytes() == (PAIRS / name).read_bytes(), name


def test_smarthome_pairs_prefer_each_chats_answer_over_its_typical_mistake():
    splits = load_splits(str(SMARTHOME))
    for name, rows in load_splits(str(PAIRS)).items():
        check_preference_rows(rows, "preference", str(PAIRS))
        assert [row["prompt"] + row["chosen"] for row in rows] == splits[name]["messages"]  # the same chats, in order
        for row in rows:
            chosen, rejected = (json.loads(row[side][0]["content"]) for side in ("chosen", "rejected"))
            assert chosen["tool"] == rejected["tool"] and chosen["arguments"] != rejected["arguments"]
            if chosen["tool"] == "start_timer":  # the mistake SmolLM2 makes after the supervised stage: minutes
                assert rejected["arguments"]["seconds"] * 60 == chosen["arguments"]["seconds"]


def test_smarthome_is_chat_data_with_unseen_held_out_requests():
    splits = load_splits(str(SMARTHOME))
    assert {name: len(rows) for name, rows in splits.items()} == {"train": 400, "test": 50}
    for rows in splits.values():
        assert detect_format(rows.column_names, str(SMARTHOME)) == "chat"
        check_rows(rows, "chat", str(SMARTHOME))
    requests = {name: {row["messages"][1]["content"] for row in rows} for name, rows in splits.items()}
    assert len(requests["test"]) == 50 and not requests["test"] & requests["train"]
    for row in splits["test"]:
        call = json.loads(row["messages"][-1]["content"])
        assert sorted(call) == ["arguments", "tool"] and call["arguments"]
