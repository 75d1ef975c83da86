"""The data layer: builtin files, formats and their detection, prompt masking, truncation, eval
splits, packing (including that packed examples do not attend to each other), collation, and the
errors a user sees for bad data."""

from __future__ import annotations

import json
import re

import datasets
import pytest
import torch
from helpers import tiny_model, write_jsonl
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from finetune.config.names import IGNORE_INDEX
from finetune.config.options import TrainConfig
from finetune.data import BUILTIN_DIR, Collator, prepare_data
from finetune.data.builtin import CHARACTERS, DATASET_FILE, NUM_ROWS, TASKS, write_builtin
from finetune.data.formats import alpaca_prompt
from finetune.errors import FinetuneError
from finetune.models.catalog import get

ALPACA_ROWS = [
    {"instruction": "Add.", "input": "2+3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "hi there"},
    {"instruction": "Copy.", "input": "abc", "output": "abc"},
    {"instruction": "Add.", "input": "4+4", "output": "8"},
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "and 4+4?"},
    {"role": "assistant", "content": "8"},
]


def prepare(tokenizer, dataset, **overrides):
    """prepare_data on `dataset`, holding out half its rows for eval unless `overrides` say otherwise."""
    return prepare_data(TrainConfig(dataset=str(dataset), **{"eval_split": "0.5"} | overrides), tokenizer)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- builtin tokenizer and dataset


def test_regenerating_the_builtin_files_gives_identical_bytes(tmp_path):
    for written in write_builtin(tmp_path):
        assert written.read_bytes() == (BUILTIN_DIR / written.name).read_bytes(), written.name


def test_builtin_tokenizer_is_char_level_and_round_trips(tokenizer):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert len(tokenizer) == 4 + len(CHARACTERS) <= get("tiny").vocab_size
    encoded = ids(tokenizer, CHARACTERS)
    assert len(encoded) == len(CHARACTERS) and len(set(encoded)) == len(CHARACTERS)
    assert tokenizer.decode(encoded) == CHARACTERS
    assert ids(tokenizer, "a</s>é") == [ids(tokenizer, "a")[0], tokenizer.eos_token_id, tokenizer.unk_token_id]


def test_builtin_dataset_rows_are_balanced_correct_and_short(tokenizer):
    rows = [json.loads(line) for line in (BUILTIN_DIR / DATASET_FILE).read_text().splitlines()]
    assert len(rows) == NUM_ROWS
    by_instruction = {}
    for row in rows:
        by_instruction.setdefault(row["instruction"], []).append(row)
    assert sorted(map(len, by_instruction.values())) == [NUM_ROWS // len(TASKS)] * len(TASKS)
    for row in by_instruction["Add."]:
        assert int(row["output"]) == sum(map(int, row["input"].split("+")))
    for row in by_instruction["Sort digits."]:
        assert row["output"] == "".join(sorted(row["input"]))
    longest = max(len(ids(tokenizer, alpaca_prompt(r["instruction"], r["input"]) + r["output"])) for r in rows)
    assert longest + 2 <= 80  # + BOS and EOS: short sequences keep CPU training fast


# ---------------------------------------------------------------- formats and masking


def test_alpaca_masks_exactly_the_prompt(tokenizer, tmp_path):
    data = prepare(tokenizer, write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS))
    assert data.format == "alpaca"
    rows = {tokenizer.decode(row["input_ids"]): row for row in list(data.train) + list(data.eval)}
    prompt = [tokenizer.bos_token_id] + ids(tokenizer, "### Instruction:\nAdd.\n### Input:\n2+3\n### Response:\n")
    response = ids(tokenizer, "5") + [tokenizer.eos_token_id]
    row = rows[tokenizer.decode(prompt + response)]
    assert row["input_ids"] == prompt + response
    assert row["labels"] == [IGNORE_INDEX] * len(prompt) + response
    assert "<s>### Instruction:\nSay hi.\n### Response:\nhi there</s>" in rows  # empty input: no Input section


def test_train_on_prompt_labels_every_token(tokenizer, tmp_path):
    data = prepare(tokenizer, write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS), train_on_prompt=True)
    assert all(row["labels"] == row["input_ids"] for row in data.train)


def test_chat_learns_only_assistant_turns(tokenizer, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"messages": CHAT}])
    write_jsonl(tmp_path / "test.jsonl", [{"messages": CHAT}])
    data = prepare(tokenizer, tmp_path, eval_split="test")
    assert data.format == "chat"
    [row] = data.train
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    learnt = [token for token, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]
    assert tokenizer.decode(learnt) == "5</s>8</s>"
    [example] = data.eval_prompts
    assert example["expected"] == "8"
    assert example["prompt_ids"] == tokenizer.apply_chat_template(CHAT[:4], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert example["prompt"].endswith("### User:\nand 4+4?\n### Assistant:\n")


def test_sharegpt_is_detected_and_encoded_as_the_same_chat(tokenizer, tmp_path):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    conversations = [{"from": roles[m["role"]], "value": m["content"]} for m in CHAT]
    for name, row in (("sharegpt", {"conversations": conversations}), ("chat", {"messages": CHAT})):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "train.jsonl", [row])
        write_jsonl(tmp_path / name / "test.jsonl", [row])
    sharegpt = prepare(tokenizer, tmp_path / "sharegpt", eval_split="test")
    chat = prepare(tokenizer, tmp_path / "chat", eval_split="test")
    assert (sharegpt.format, chat.format) == ("sharegpt", "chat")
    assert sharegpt.train.to_list() == chat.train.to_list() and sharegpt.eval.to_list() == chat.eval.to_list()
    assert sharegpt.eval_prompts == chat.eval_prompts and sharegpt.eval_prompts[0]["expected"] == "8"


def test_text_learns_every_token_and_has_no_exact_match_prompts(tokenizer, tmp_path):
    data = prepare(tokenizer, write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}, {"text": "bye"}]))
    [row] = data.train
    assert data.format == "text" and data.eval_prompts == []
    assert row["labels"] == row["input_ids"]
    assert tokenizer.decode(row["input_ids"]) in {"<s>hello</s>", "<s>bye</s>"}


def test_csv_and_parquet_load_with_numeric_answers(tokenizer, tmp_path):
    csv = tmp_path / "a.csv"
    csv.write_text("instruction,input,output\nAdd.,2+3,5\nAdd.,4+4,8\nAdd.,1+1,2\nAdd.,0+1,1\n")
    data = prepare(tokenizer, csv)  # the output column is read as integers
    texts = sorted(tokenizer.decode(row["input_ids"]) for row in list(data.train) + list(data.eval))
    assert texts[0] == "<s>### Instruction:\nAdd.\n### Input:\n0+1\n### Response:\n1</s>" and len(texts) == 4
    assert all(isinstance(example["expected"], str) for example in data.eval_prompts)
    parquet = tmp_path / "a.parquet"
    datasets.Dataset.from_list(ALPACA_ROWS).to_parquet(str(parquet))
    assert prepare(tokenizer, parquet).format == "alpaca"


def test_forced_format_must_match_the_columns(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS)
    with pytest.raises(FinetuneError, match=r"row 0: field 'text' is missing.*expects fields text.*has: instruction, input, output"):
        prepare(tokenizer, path, format="text")


# ---------------------------------------------------------------- errors the user sees


def test_row_missing_a_field_is_named_with_its_fields(tokenizer, tmp_path):
    rows = ALPACA_ROWS[:2] + [{"instruction": "Add.", "input": "1+1"}] + ALPACA_ROWS[2:]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(FinetuneError) as error:
        prepare(tokenizer, path)
    message = str(error.value)
    assert str(path) in message and "row 2" in message and "field 'output' is missing" in message
    assert "expects fields instruction, output (optional: input)" in message and "this row has: instruction, input." in message


def test_undetectable_columns_list_what_is_expected_and_found(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+3?", "answer": "5"}] * 4)
    with pytest.raises(FinetuneError, match=r"q\.jsonl, row 0: .*alpaca: instruction, output.*Found columns: question, answer"):
        prepare(tokenizer, path)


def test_chat_row_without_assistant_turn_is_named(tokenizer, tmp_path):
    rows = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(FinetuneError, match=r"row 1: no message has role 'assistant'.*this row has: messages"):
        prepare(tokenizer, write_jsonl(tmp_path / "c.jsonl", rows))


@pytest.mark.parametrize("row, problem", [
    ({"instruction": "Add.", "output": ["5"]}, "row 1: field 'output' is a list, not text"),
    ({"messages": "hi"}, "row 1: 'messages' is not a non-empty list"),
    ({"messages": [{"role": "user"}]}, "row 1: message 0 is not a {role, content} pair of strings"),
])
def test_malformed_values_are_named(tokenizer, tmp_path, row, problem):
    first = {"messages": CHAT} if "messages" in row else ALPACA_ROWS[0]
    with pytest.raises(FinetuneError, match=re.escape(problem)):
        prepare(tokenizer, write_jsonl(tmp_path / "m.jsonl", [first, row]))


@pytest.mark.parametrize("turns, problem", [
    ([{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}],
     "row 1: message 1 has unknown role 'bot' (ShareGPT roles: system, human, gpt)"),
    ([{"from": "human", "value": "hi"}, {"from": "gpt"}], "row 1: message 1 is not a {from, value} pair of strings"),
    ([{"from": "gpt", "value": "hello"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "bye"}],
     "row 1: message 0 has role 'gpt': a conversation opens with a system or user message for it to answer"),
    ([{"from": "human", "value": "hi"}], "row 1: no message has role 'gpt'"),
])
def test_bad_sharegpt_rows_are_named(tokenizer, tmp_path, turns, problem):
    good = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    rows = [{"conversations": good}, {"conversations": turns}]
    with pytest.raises(FinetuneError, match=re.escape(problem) + ".*Format sharegpt expects fields conversations"):
        prepare(tokenizer, write_jsonl(tmp_path / "s.jsonl", rows))


def test_chat_opening_with_the_assistant_is_named(tokenizer, tmp_path):
    rows = [{"messages": CHAT}, {"messages": CHAT[2:]}]
    with pytest.raises(FinetuneError, match="row 1: message 0 has role 'assistant': a conversation opens with"):
        prepare(tokenizer, write_jsonl(tmp_path / "c.jsonl", rows))


def test_chat_needs_a_template_that_renders_prefix_by_prefix(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}] * 2)
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_DIR)
    tokenizer.chat_template = None
    with pytest.raises(FinetuneError, match="this tokenizer has none"):
        prepare(tokenizer, path)
    # marks the last message, so a conversation's beginning renders differently inside it
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(FinetuneError, match="renders a conversation differently.*--train-on-prompt"):
        prepare(tokenizer, path)
    assert len(prepare(tokenizer, path, train_on_prompt=True).train) == 1


def test_missing_unsupported_unreadable_and_offline_sources(tokenizer, tmp_path):
    with pytest.raises(FinetuneError, match="Dataset file not found: .*nope.jsonl"):
        prepare(tokenizer, tmp_path / "nope.jsonl")
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(FinetuneError, match="data.txt: unsupported file type"):
        prepare(tokenizer, tmp_path / "data.txt")
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(FinetuneError, match="Could not read .*broken.jsonl"):
        prepare(tokenizer, tmp_path / "broken.jsonl")
    with pytest.raises(FinetuneError, match="from the Hugging Face Hub.*Offline.*pass the file"):
        prepare(tokenizer, "someone/some-dataset")


# ---------------------------------------------------------------- truncation and eval split


def test_truncation_cuts_the_end_and_drops_examples_left_without_targets(tokenizer, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ALPACA_ROWS)
    write_jsonl(tmp_path / "test.jsonl", ALPACA_ROWS[:1])
    max_seq_len = 1 + len(ids(tokenizer, alpaca_prompt("Say hi."))) + 2  # the shortest prompt + "hi"
    data = prepare(tokenizer, tmp_path, eval_split="test", max_seq_len=max_seq_len)
    [row] = data.train
    assert len(row["input_ids"]) == max_seq_len and tokenizer.decode(row["input_ids"][-2:]) == "hi"
    assert len(data.eval) == 0
    with pytest.raises(FinetuneError, match="no training example keeps a token to learn within --max-seq-len 20"):
        prepare(tokenizer, tmp_path, eval_split="test", max_seq_len=20)


def test_eval_fraction_is_held_out_deterministically(tokenizer):
    first = prepare_data(TrainConfig(eval_split="0.1", max_eval_examples=50, seed=7), tokenizer)
    again = prepare_data(TrainConfig(eval_split="0.1", max_eval_examples=50, seed=7), tokenizer)
    other = prepare_data(TrainConfig(eval_split="0.1", max_eval_examples=50, seed=8), tokenizer)
    assert (len(first.train), len(first.eval), len(first.eval_prompts)) == (NUM_ROWS - 400, 50, 50)
    assert first.train["input_ids"] == again.train["input_ids"] and first.eval_prompts == again.eval_prompts
    assert first.eval_prompts != other.eval_prompts
    held_out = [p["prompt_ids"] + ids(tokenizer, p["expected"]) + [tokenizer.eos_token_id] for p in first.eval_prompts]
    assert first.eval["input_ids"] == held_out  # eval loss and exact match use the same rows


def test_eval_split_by_name(tokenizer, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ALPACA_ROWS)
    write_jsonl(tmp_path / "test.jsonl", [{"instruction": "Add.", "input": "9+9", "output": "18"}])
    data = prepare(tokenizer, tmp_path, eval_split="test")
    assert len(data.train) == len(ALPACA_ROWS)
    assert [p["expected"] for p in data.eval_prompts] == ["18"]
    with pytest.raises(FinetuneError, match="--eval-split 'validation': .* has splits train, test"):
        prepare(tokenizer, tmp_path, eval_split="validation")


# ---------------------------------------------------------------- packing and collation


def test_packing_concatenates_examples_with_restarting_positions(tokenizer):
    # with the prompt learnt, each example's first label is its BOS: packing must mask it
    plain = prepare_data(TrainConfig(max_eval_examples=10, train_on_prompt=True), tokenizer)
    packed = prepare_data(TrainConfig(max_eval_examples=10, train_on_prompt=True, packing=True, max_seq_len=200), tokenizer)
    assert packed.eval["input_ids"] == plain.eval["input_ids"]  # eval is never packed
    assert all(len(row["input_ids"]) <= 200 for row in packed.train)
    assert len(packed.train) < len(plain.train) / 2
    flat = [token for row in packed.train for token in row["input_ids"]]
    assert flat == [token for row in plain.train for token in row["input_ids"]]
    starts = [i for row in packed.train for i, position in enumerate(row["position_ids"]) if position == 0]
    assert len(starts) == len(plain.train)
    expected_labels = [label for row in plain.train for label in [IGNORE_INDEX] + row["labels"][1:]]
    assert [label for row in packed.train for label in row["labels"]] == expected_labels


def test_collator_pads_right_and_masks_padding(tokenizer):
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = Collator(tokenizer)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    packed = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 0]},
              {"input_ids": [8], "labels": [-100], "position_ids": [0]}]
    batch = Collator(tokenizer)(packed)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]


def test_collator_flattens_packed_rows_into_one_row_with_the_examples_offsets(tokenizer):
    """For attention kernels that read offsets (--attention varlen, flash): packed rows become one
    row without padding, with int32 offsets and the longest example as an int; unpacked rows
    (evaluation) keep their padding and mask."""
    packed = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 0]},
              {"input_ids": [8, 9, 10, 11], "labels": [-100, 9, -100, 11], "position_ids": [0, 0, 1, 2]}]
    batch = Collator(tokenizer, flatten=True)(packed)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 11]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 0, 0, 1, 2]]
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 2, 3, 4, 7]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 3 and isinstance(batch["max_length_q"], int)
    unpacked = Collator(tokenizer, flatten=True)([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}])
    assert unpacked["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and "cu_seq_lens_q" not in unpacked


@pytest.mark.parametrize("name", ["tiny", "mistral-7b", "qwen2.5-7b"])  # Llama, Mistral, Qwen2 classes
def test_packed_examples_do_not_attend_to_each_other(tokenizer, name):
    """Each packed example's logits equal its logits computed alone: no attention crosses an
    example boundary. The 2nd row is shorter, so its padding is exercised too."""
    model = tiny_model(name, vocab_size=128).eval()
    examples = [ids(tokenizer, text) for text in ("<s>first example", "<s>2nd", "<s>third one", "<s>4")]
    rows = [{"input_ids": first + second, "labels": first + second,
             "position_ids": list(range(len(first))) + list(range(len(second)))}
            for first, second in (examples[:2], examples[2:])]
    batch = Collator(tokenizer)(rows)
    assert batch["input_ids"].shape == (2, len(examples[0]) + len(examples[1]))
    with torch.no_grad():
        packed = model(**{key: value for key, value in batch.items() if key != "labels"}, use_cache=False).logits
        for index, example in enumerate(examples):
            start = 0 if index % 2 == 0 else len(examples[index - 1])
            alone = model(input_ids=torch.tensor([example])).logits[0]
            torch.testing.assert_close(packed[index // 2, start : start + len(example)], alone, atol=1e-5, rtol=1e-5)
        # the check has teeth: without the position resets the second example sees the first
        plain = model(input_ids=batch["input_ids"], use_cache=False).logits
        assert (plain[0, len(examples[0]) :] - packed[0, len(examples[0]) :]).abs().max() > 1e-3
