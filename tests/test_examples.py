"""The shipped example dataset (examples/smarthome): exactly what its generator writes, in the chat
format finetune reads, with held-out requests that never appear in train."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO

from finetune.data.formats import check_rows, detect_format
from finetune.data.sources import load_splits

SMARTHOME = REPO / "examples" / "smarthome"


def test_smarthome_files_are_what_the_seeded_generator_writes(tmp_path):
    subprocess.run([sys.executable, str(SMARTHOME / "make_data.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (SMARTHOME / name).read_bytes(), name


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
