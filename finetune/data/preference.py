"""Preference rows: how they are detected, checked, and turned into the sequences a preference loss compares.

preference  {"prompt" (optional for conversations), "chosen", "rejected"}   → two sequences per row
labelled    {"prompt", "completion", "label": true/false}                   → one sequence (KTO)

The field names are TRL's. Each of prompt / chosen / rejected / completion is plain text, or a list
of {role, content} messages (conversational): the prompt is rendered by the tokenizer's chat template
with the generation prompt, and an answer is what the template renders after it, up to and
including the answer's last EOS (as data/formats.py does for chats). A conversational row without a
prompt names it implicitly: chosen and rejected are whole conversations that differ only in their
last (assistant) message. Plain text: BOS + prompt, then the answer + EOS.

The prompt is never in the loss (its labels are -100). A sequence is cut at --max-seq-len from its
end, like supervised rows; a pair that is left without an answer token on either side, or with two
identical answers, is dropped. KTO reads labelled rows, or pairs as one desirable and one
undesirable row each (as TRL's `unpair_preference_dataset`); each row also carries a mismatched
sequence, its prompt with the next row's answer in the same batch of rows, from which KTO estimates
the KL term it compares rewards with.
"""

from __future__ import annotations

from collections.abc import Iterable

import datasets

from finetune.config.names import IGNORE_INDEX
from finetune.data.formats import batch_rows, bos_ids, has_target, id_columns, render_chats, token_ids
from finetune.errors import FinetuneError

# format → (required fields, optional fields)
PREFERENCE_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "preference": (("chosen", "rejected"), ("prompt",)),
    "labelled": (("prompt", "completion", "label"), ()),
}
# what each kind of rows may be written as (Objective.rows in config/objectives.py)
FORMATS_OF_ROWS = {"paired": ("preference",), "labelled": ("labelled", "preference")}


def detect_preference_format(columns: Iterable[str], source: str, objective) -> str:
    """The preference format whose required fields are all columns and that `objective` reads; raises
    FinetuneError naming the fields (and, for supervised rows, the objective that reads them)."""
    columns = set(columns)
    allowed = FORMATS_OF_ROWS[objective.rows]
    for fmt in allowed:
        if set(PREFERENCE_FIELDS[fmt][0]) <= columns:
            return fmt
    expected = "; ".join(f"{fmt}: {', '.join(PREFERENCE_FIELDS[fmt][0])}" for fmt in allowed)
    hint = (" These look like supervised rows: train on them with --objective sft, or write pairs."
            if columns & {"instruction", "messages", "conversations", "text"} else "")
    raise FinetuneError(f"{source}, row 0: --objective {objective.name} reads {expected}. Found columns: "
                        f"{', '.join(sorted(columns)) or 'none'}.{hint}")


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in value)


def _empty(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not value or not value[-1]["content"].strip()


def _answer_problem(row: dict, field: str) -> str | None:
    value = row.get(field)
    if value is None:
        return f"field '{field}' is missing"
    if not isinstance(value, str) and not _is_messages(value):
        return f"field '{field}' is a {type(value).__name__}, neither text nor a list of {{role, content}} messages"
    if _empty(value):
        return f"field '{field}' is empty"
    return None


def _row_problem(row: dict, fmt: str) -> str | None:
    answers = ("chosen", "rejected") if fmt == "preference" else ("completion",)
    for field in answers:
        problem = _answer_problem(row, field)
        if problem:
            return problem
    prompt = row.get("prompt")
    if prompt is None and (fmt == "labelled" or not all(_is_messages(row[f]) for f in answers)):
        return "field 'prompt' is missing (only conversations may leave it out: then it is what chosen and rejected share)"
    if prompt is not None and not isinstance(prompt, str) and not _is_messages(prompt):
        return f"field 'prompt' is a {type(prompt).__name__}, neither text nor a list of {{role, content}} messages"
    kinds = {isinstance(row[f], str) for f in answers} | ({isinstance(prompt, str)} if prompt is not None else set())
    if len(kinds) > 1:
        return "mixes plain text and messages; write prompt and answers the same way"
    if fmt == "labelled" and not isinstance(row["label"], bool):
        return f"field 'label' is {row['label']!r}, not true or false"
    if fmt == "preference" and row["chosen"] == row["rejected"]:
        return "chosen and rejected are identical, so there is no preference to learn"
    if fmt == "preference" and prompt is None:
        return _implicit_prompt_problem(row["chosen"], row["rejected"])
    return None


def _implicit_prompt_problem(chosen: list[dict], rejected: list[dict]) -> str | None:
    if chosen[:-1] != rejected[:-1] or not chosen[:-1]:
        return "without a 'prompt', chosen and rejected must be conversations that differ only in their last message"
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        return "without a 'prompt', the last message of chosen and of rejected must be the assistant's"
    return None


def check_preference_rows(rows: datasets.Dataset, fmt: str, source: str) -> None:
    """Raise FinetuneError at the first row `fmt` cannot render: one line naming the row (counting from
    0), what is wrong and the fields it has."""
    every_row = (row for batch in rows.iter(batch_size=1000) for row in batch_rows(batch))
    for index, row in enumerate(every_row):
        problem = _row_problem(row, fmt)
        if problem:
            found = [name for name, value in row.items() if value is not None]
            raise FinetuneError(f"{source}, row {index}: {problem}. Format {fmt} expects fields "
                                f"{', '.join(PREFERENCE_FIELDS[fmt][0])}; this row has: {', '.join(found) or 'no fields'}.")


def split_prompt(row: dict, answer: str) -> tuple[str | list[dict], str | list[dict]]:
    """(prompt, answer) of a row: an implicit prompt is what a conversation's chosen and rejected share."""
    if row.get("prompt") is not None:
        return row["prompt"], row[answer]
    return row[answer][:-1], row[answer][-1:]


def encode_answers(prompts: list, answers: list, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each prompt followed by its answer, the prompt masked; one tokenizer call
    per kind of text for the whole batch."""
    if not prompts:
        return []
    if isinstance(answers[0], str):
        ids = token_ids(tokenizer, [*prompts, *answers])
        bos, eos = bos_ids(tokenizer), tokenizer.eos_token_id
        return [(bos + p + a + [eos], [IGNORE_INDEX] * (len(bos) + len(p)) + a + [eos])
                for p, a in zip(ids[: len(prompts)], ids[len(prompts):])]
    starts = token_ids(tokenizer, render_chats(tokenizer, prompts, add_generation_prompt=True))
    wholes = token_ids(tokenizer, render_chats(tokenizer, [p + a for p, a in zip(prompts, answers)], add_generation_prompt=False))
    encoded, eos = [], tokenizer.eos_token_id
    for start, whole in zip(starts, wholes):
        if whole[: len(start)] != start:
            raise FinetuneError("The tokenizer's chat template renders a conversation differently from its prompt, so the "
                                "answer cannot be told from the prompt. Write the rows as plain text (prompt, chosen, "
                                "rejected strings) instead.")
        answer = whole[len(start):]
        end = len(whole) - (answer[::-1].index(eos) if eos in answer else 0)
        encoded.append((whole[:end], [IGNORE_INDEX] * len(start) + whole[len(start):end]))
    return encoded


def _truncated(encoded: list[tuple[list[int], list[int]]], max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    return [(ids[:max_seq_len], labels[:max_seq_len]) for ids, labels in encoded]


def encode_pairs(batch: dict[str, list], tokenizer, max_seq_len: int) -> dict[str, list]:
    """Encode a batch of preference rows; drop pairs truncation left without an answer or with two equal ones."""
    rows = batch_rows(batch)
    sides = {}
    for answer in ("chosen", "rejected"):
        prompts, answers = zip(*(split_prompt(row, answer) for row in rows)) if rows else ((), ())
        sides[answer] = _truncated(encode_answers(list(prompts), list(answers), tokenizer), max_seq_len)
    out = {name: [] for name in PAIR_COLUMNS}
    for (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) in zip(sides["chosen"], sides["rejected"]):
        if not (has_target(chosen_labels) and has_target(rejected_labels)) or chosen_ids == rejected_ids:
            continue
        for name, value in zip(PAIR_COLUMNS, (chosen_ids, chosen_labels, rejected_ids, rejected_labels)):
            out[name].append(value)
    return out


def unpaired(batch: dict[str, list]) -> dict[str, list]:
    """Preference rows as labelled rows: the chosen answer desirable, the rejected one not (batched map)."""
    out = {"prompt": [], "completion": [], "label": []}
    for row in batch_rows(batch):
        for answer, label in (("chosen", True), ("rejected", False)):
            prompt, completion = split_prompt(row, answer)
            out["prompt"].append(prompt)
            out["completion"].append(completion)
            out["label"].append(label)
    return out


def encode_labelled(batch: dict[str, list], tokenizer, max_seq_len: int) -> dict[str, list]:
    """Encode a batch of labelled rows, each with its mismatched sequence: its prompt with the answer of
    the next row in the batch (the last row takes the first's)."""
    rows = batch_rows(batch)
    prompts, completions = [row["prompt"] for row in rows], [row["completion"] for row in rows]
    own = _truncated(encode_answers(prompts, completions, tokenizer), max_seq_len)
    mismatched = _truncated(encode_answers(prompts, completions[1:] + completions[:1], tokenizer), max_seq_len)
    out = {name: [] for name in LABELLED_COLUMNS}
    for row, (ids, labels), (kl_ids, kl_labels) in zip(rows, own, mismatched):
        if not (has_target(labels) and has_target(kl_labels)):
            continue
        for name, value in zip(LABELLED_COLUMNS, (ids, labels, kl_ids, kl_labels, int(row["label"]))):
            out[name].append(value)
    return out


PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
LABELLED_COLUMNS = ("input_ids", "labels", "kl_input_ids", "kl_labels", "desirable")


def features(fmt_rows: str) -> datasets.Features:
    """The encoded columns of paired or labelled rows."""
    if fmt_rows == "paired":
        return id_columns(*PAIR_COLUMNS)
    return datasets.Features({**id_columns(*LABELLED_COLUMNS[:4]), "desirable": datasets.Value("int8")})


def preference_prompt_ids(row: dict, tokenizer) -> tuple[list[int], str]:
    """The ids greedy generation starts from for a preference row, and the chosen answer's text: exact
    match against the chosen answer measures what the preference taught."""
    prompt, chosen = split_prompt(row, "chosen")
    if isinstance(prompt, str):
        return bos_ids(tokenizer) + token_ids(tokenizer, [prompt])[0], chosen
    return token_ids(tokenizer, render_chats(tokenizer, [prompt], add_generation_prompt=True))[0], chosen[-1]["content"]
