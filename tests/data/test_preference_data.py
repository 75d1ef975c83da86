"""Preference rows (data/preference.py): the builtin pairs, text and conversational pairs with the prompt
masked, KTO's labelled rows and their mismatched sequences, one-line errors naming the row, the cache,
and the collator that puts a pair's two sequences in one batch."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import write_jsonl

from finetune.config.names import IGNORE_INDEX
from finetune.config.options import TrainConfig
from finetune.data import BUILTIN_DIR, prepare_data
from finetune.data.builtin import NUM_ROWS, PREFERENCE_FILE, TASKS
from finetune.data.collate import PreferenceCollator
from finetune.errors import FinetuneError

PAIRS = [{"prompt": f"Add {a}+{a}.", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(6)]
CHAT_PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]


def prepare(tokenizer, dataset, objective="dpo", **overrides):
    return prepare_data(TrainConfig(dataset=str(dataset), objective=objective, **{"eval_split": "0.5"} | overrides), tokenizer)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer(tokenizer, input_ids, labels):
    return tokenizer.decode([t for t, label in zip(input_ids, labels) if label != IGNORE_INDEX])


def test_builtin_pairs_prefer_each_tasks_right_answer_over_a_wrong_one():
    rows = [json.loads(line) for line in (BUILTIN_DIR / PREFERENCE_FILE).read_text().splitlines()]
    assert len(rows) == NUM_ROWS
    by_instruction = {}
    for row in rows:
        assert row["chosen"] != row["rejected"]
        by_instruction.setdefault(row["prompt"].split("\n")[1], []).append(row)
    assert sorted(map(len, by_instruction.values())) == [NUM_ROWS // len(TASKS)] * len(TASKS)
    for row in by_instruction["Add."]:
        assert int(row["chosen"]) == sum(map(int, row["prompt"].split("\n")[3].split("+")))
    for row in by_instruction["Sort digits."]:
        assert row["chosen"] == "".join(sorted(row["prompt"].split("\n")[3])) != row["rejected"]


def test_text_pairs_mask_the_prompt_and_end_each_answer_with_eos(tokenizer, tmp_path):
    data = prepare(tokenizer, write_jsonl(tmp_path / "p.jsonl", PAIRS))
    assert data.format == "preference" and len(data.train) == len(data.eval) == 3
    assert sorted(data.train.column_names) == ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "row"]
    row = data.train[0]
    prompt = [tokenizer.bos_token_id] + ids(tokenizer, "Add ")
    assert row["chosen_input_ids"][: len(prompt)] == prompt and row["chosen_labels"][: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    chosen, rejected = (answer(tokenizer, row[f"{side}_input_ids"], row[f"{side}_labels"]) for side in ("chosen", "rejected"))
    assert int(rejected[:-4]) == int(chosen[:-4]) + 1 and chosen.endswith("</s>")
    assert data.train["row"] == [0, 1, 2]
    [first, *_] = data.eval_prompts  # exact match: greedy answers against the chosen ones
    assert first["prompt_ids"][0] == tokenizer.bos_token_id and first["expected"] in {p["chosen"] for p in PAIRS}


def test_conversational_pairs_with_or_without_a_prompt_encode_alike(tokenizer, tmp_path):
    explicit = [{"prompt": CHAT_PROMPT, "chosen": [{"role": "assistant", "content": "5"}],
                 "rejected": [{"role": "assistant", "content": "6"}]}] * 2
    implicit = [{"chosen": CHAT_PROMPT + [{"role": "assistant", "content": "5"}],
                 "rejected": CHAT_PROMPT + [{"role": "assistant", "content": "6"}]}] * 2
    encoded = [prepare(tokenizer, write_jsonl(tmp_path / f"{name}.jsonl", rows)).train[0]
               for name, rows in (("explicit", explicit), ("implicit", implicit))]
    assert {k: v for k, v in encoded[0].items()} == {k: v for k, v in encoded[1].items()}
    row = encoded[0]
    assert tokenizer.decode(row["chosen_input_ids"]) == tokenizer.apply_chat_template(
        CHAT_PROMPT + [{"role": "assistant", "content": "5"}], tokenize=False)
    assert answer(tokenizer, row["chosen_input_ids"], row["chosen_labels"]) == "5</s>"
    assert answer(tokenizer, row["rejected_input_ids"], row["rejected_labels"]) == "6</s>"


@pytest.mark.parametrize("bad, problem", [
    ({"prompt": "p", "rejected": "x"}, "field 'chosen' is missing"),
    ({"prompt": "p", "chosen": "x", "rejected": "  "}, "field 'rejected' is empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "chosen and rejected are identical"),
    ({"chosen": "x", "rejected": "y"}, "field 'prompt' is missing"),
])
def test_a_bad_pair_is_one_line_naming_its_row(tokenizer, tmp_path, bad, problem):
    rows = PAIRS[:3] + [bad] + PAIRS[3:]
    with pytest.raises(FinetuneError) as error:
        prepare(tokenizer, write_jsonl(tmp_path / "p.jsonl", rows))
    message = str(error.value)
    assert "p.jsonl, row 3: " + problem in message and "\n" not in message


def test_conversational_rows_that_cannot_render_are_named(tokenizer, tmp_path):
    """(A file holds one kind of value per field: text and messages do not mix across its rows.)"""
    rows = [{"prompt": "p", "chosen": [{"role": "assistant", "content": "x"}], "rejected": [{"role": "assistant", "content": "y"}]}]
    with pytest.raises(FinetuneError, match=r"row 0: mixes plain text and messages; write prompt and answers the same way"):
        prepare(tokenizer, write_jsonl(tmp_path / "p.jsonl", rows * 2))
    good = {"chosen": CHAT_PROMPT + [{"role": "assistant", "content": "5"}],
            "rejected": CHAT_PROMPT + [{"role": "assistant", "content": "6"}]}
    other_prompt = {**good, "rejected": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}
    with pytest.raises(FinetuneError, match=r"row 1: without a 'prompt', chosen and rejected must be conversations that differ only"):
        prepare(tokenizer, write_jsonl(tmp_path / "c.jsonl", [good, other_prompt, good]))


def test_supervised_rows_given_to_a_preference_objective_say_which_objective_reads_them(tokenizer, tmp_path):
    rows = [{"instruction": "Add.", "input": "2+3", "output": "5"}] * 4
    with pytest.raises(FinetuneError, match="reads preference: chosen, rejected.*look like supervised rows.*--objective sft"):
        prepare(tokenizer, write_jsonl(tmp_path / "a.jsonl", rows))


def test_kto_reads_labelled_rows_with_a_mismatched_sequence_each(tokenizer, tmp_path):
    rows = [{"prompt": f"Q{i}.", "completion": f"A{i}", "label": i % 2 == 0} for i in range(4)]
    data = prepare(tokenizer, write_jsonl(tmp_path / "k.jsonl", rows), objective="kto", eval_split="0.25")
    assert data.format == "labelled"
    for row in data.train:
        prompt = tokenizer.decode(row["input_ids"][1:4])
        own, kl = answer(tokenizer, row["input_ids"], row["labels"]), answer(tokenizer, row["kl_input_ids"], row["kl_labels"])
        assert own == "A" + prompt[1] + "</s>" and bool(row["desirable"]) == (int(prompt[1]) % 2 == 0)
        assert kl != own and tokenizer.decode(row["kl_input_ids"][1:4]) == prompt  # its prompt, another row's answer


def test_kto_unpairs_pairs_into_one_desirable_and_one_undesirable_row(tokenizer, tmp_path):
    data = prepare(tokenizer, write_jsonl(tmp_path / "p.jsonl", PAIRS), objective="kto")
    assert len(data.train) == 2 * 3 and sorted(data.train["desirable"]) == [0, 0, 0, 1, 1, 1]
    assert len(data.eval_prompts) == 3  # the pairs' chosen answers, for exact match


def test_pairs_truncation_leaves_identical_or_without_an_answer_are_dropped(tokenizer, tmp_path):
    rows = [{"prompt": "Same start.", "chosen": "abcdef", "rejected": "abcxyz"}, {"prompt": "Go.", "chosen": "a", "rejected": "b"}]
    data = prepare(tokenizer, write_jsonl(tmp_path / "p.jsonl", rows * 2), eval_split="0.5", max_seq_len=15)
    # BOS + 11 prompt characters + "abc": both answers cut to "abc", so that pair teaches nothing
    kept = [tokenizer.decode(r["chosen_input_ids"]) for r in list(data.train) + list(data.eval)]
    assert kept == ["<s>Go.a</s>"] * 2


def test_the_objective_is_part_of_the_cache_key_and_a_second_preparation_reuses_the_entry(tokenizer, tmp_path):
    dataset = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    first, again = (prepare(tokenizer, dataset, data_cache=str(tmp_path / "cache")) for _ in range(2))
    kto = prepare(tokenizer, dataset, objective="kto", data_cache=str(tmp_path / "cache"))
    assert not first.reused and again.reused and again.cache_entry == first.cache_entry != kto.cache_entry
    assert again.train["chosen_input_ids"] == first.train["chosen_input_ids"]


def test_the_collator_puts_the_chosen_sequences_before_the_rejected_ones_with_their_reference(tokenizer, tmp_path):
    data = prepare(tokenizer, write_jsonl(tmp_path / "p.jsonl", PAIRS))
    collator = PreferenceCollator(tokenizer)
    rows = [data.train[2], data.train[0]]
    batch = collator(rows)
    assert batch["input_ids"].shape[0] == 4 and "reference_logps" not in batch
    for index, (row, side) in enumerate([(rows[0], "chosen"), (rows[1], "chosen"), (rows[0], "rejected"), (rows[1], "rejected")]):
        length = len(row[f"{side}_input_ids"])
        assert batch["input_ids"][index, :length].tolist() == row[f"{side}_input_ids"]
        assert batch["attention_mask"][index].sum() == length
    collator.reference = {"chosen": torch.tensor([-1.0, -2.0, -3.0]), "rejected": torch.tensor([-4.0, -5.0, -6.0])}
    assert collator(rows)["reference_logps"].tolist() == [-3.0, -1.0, -6.0, -4.0]
