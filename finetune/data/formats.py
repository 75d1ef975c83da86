"""The row formats: how each is detected, checked, and turned into (input_ids, labels).

alpaca    {"instruction", "input" (optional), "output"}            → BOS + prompt template, then output + EOS
chat      {"messages": [{"role", "content"}, ...]}                  → the tokenizer's chat template
sharegpt  {"conversations": [{"from", "value"}, ...]}               → mapped to chat (human → user, gpt → assistant)
text      {"text"}                                                  → BOS + text + EOS

Labels are the input ids where the loss is on and -100 where it is off: the prompt (the alpaca
template with instruction and input; every non-assistant turn of a chat) unless --train-on-prompt.
Prompts are tokenized on their own and the response ids appended, so the ids the model learns to
continue are exactly the ids exact-match evaluation starts generation from (`prompt_ids`).

Rows are encoded a batch at a time with one tokenizer call for all the texts of the batch: a call
per text spent most of its time in Python rather than in the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Number

import datasets

from finetune.config.names import IGNORE_INDEX
from finetune.errors import FinetuneError

# format → (required fields, optional fields); detection tries them in this order
FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input",)),
    "chat": (("messages",), ()),
    "sharegpt": (("conversations",), ()),
    "text": (("text",), ()),
}
# conversation formats → (list field, role key, text key)
CONVERSATION_KEYS = {"chat": ("messages", "role", "content"), "sharegpt": ("conversations", "from", "value")}
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def id_columns(*names: str) -> datasets.Features:
    """Encoded columns as lists of int32: ids, labels and positions fit, in half the bytes of the
    int64 that `datasets` would infer."""
    return datasets.Features({name: datasets.List(datasets.Value("int32")) for name in names})


def _expected_fields() -> str:
    return "; ".join(
        f"{fmt}: {', '.join(required)}" + (f" (optional: {', '.join(optional)})" if optional else "")
        for fmt, (required, optional) in FORMAT_FIELDS.items()
    )


def detect_format(columns: Iterable[str], source: str) -> str:
    """The first format whose required fields are all columns; raises FinetuneError otherwise."""
    columns = list(columns)
    for fmt, (required, _) in FORMAT_FIELDS.items():
        if set(required) <= set(columns):
            return fmt
    raise FinetuneError(
        f"{source}, row 0: no format matches the columns. Expected {_expected_fields()}. "
        f"Found columns: {', '.join(columns) or 'none'}. Rename the columns or pass --format."
    )


def _is_scalar_text(value) -> bool:
    """Strings, and numbers (not NaN) that CSV/JSON readers parse out of answers such as "12"."""
    return isinstance(value, str) or (isinstance(value, Number) and not isinstance(value, bool) and value == value)


def _conversation_problem(row: dict, fmt: str) -> str | None:
    field, role, text = CONVERSATION_KEYS[fmt]
    turns = row[field]
    if not isinstance(turns, list) or not turns:
        return f"'{field}' is not a non-empty list"
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(role), str) or not isinstance(turn.get(text), str):
            return f"message {index} is not a {{{role}, {text}}} pair of strings"
        if fmt == "sharegpt" and turn[role] not in SHAREGPT_ROLES:
            return f"message {index} has unknown role '{turn[role]}' (ShareGPT roles: {', '.join(SHAREGPT_ROLES)})"
    assistant = "gpt" if fmt == "sharegpt" else "assistant"
    if not any(turn[role] == assistant for turn in turns):
        return f"no message has role '{assistant}', so there is nothing to learn"
    if turns[0][role] == assistant:
        return f"message 0 has role '{assistant}': a conversation opens with a system or user message for it to answer"
    return None


def _row_problem(row: dict, fmt: str) -> str | None:
    required, optional = FORMAT_FIELDS[fmt]
    for field in required:
        if row.get(field) is None:
            return f"field '{field}' is missing"
    if fmt in CONVERSATION_KEYS:
        return _conversation_problem(row, fmt)
    for field in required + optional:
        if row.get(field) is not None and not _is_scalar_text(row[field]):
            return f"field '{field}' is a {type(row[field]).__name__}, not text"
    return None


def batch_rows(batch: dict[str, list]) -> list[dict]:
    """A batch of columns (how `datasets` hands out rows in bulk, much faster than one by one) as rows."""
    return [dict(zip(batch, values)) for values in zip(*batch.values())]


def check_rows(rows: datasets.Dataset, fmt: str, source: str) -> None:
    """Raise FinetuneError at the first row `fmt` cannot render, naming the row (counting from 0),
    what is wrong, the fields the format expects and the fields that row has."""
    every_row = (row for batch in rows.iter(batch_size=1000) for row in batch_rows(batch))
    for index, row in enumerate(every_row):
        problem = _row_problem(row, fmt)
        if problem:
            required, optional = FORMAT_FIELDS[fmt]
            found = [name for name, value in row.items() if value is not None]
            raise FinetuneError(
                f"{source}, row {index}: {problem}. Format {fmt} expects fields {', '.join(required)}"
                + (f" (optional: {', '.join(optional)})" if optional else "")
                + f"; this row has: {', '.join(found) or 'no fields'}."
            )


def messages(row: dict, fmt: str) -> list[dict]:
    """The {role, content} messages of a chat or ShareGPT row."""
    if fmt == "sharegpt":
        return [{"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]} for turn in row["conversations"]]
    return row["messages"]


def alpaca_prompt(instruction, input_text=None) -> str:
    """The alpaca prompt, compact because every template token costs sequence length (and, for
    the tiny default model, learning speed)."""
    prompt = f"### Instruction:\n{instruction}\n"
    if input_text is not None and str(input_text):
        prompt += f"### Input:\n{input_text}\n"
    return prompt + "### Response:\n"


def token_ids(tokenizer, texts: list) -> list[list[int]]:
    """Token ids of each text, in one tokenizer call."""
    return tokenizer([str(text) for text in texts], add_special_tokens=False)["input_ids"] if texts else []


def bos_ids(tokenizer) -> list[int]:
    """BOS as an id of its own: tokenizers differ in whether they add it, so we always do."""
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def encode_as_training(tokenizer, fmt: str) -> None:
    """Make `tokenizer(text)` encode as training on `fmt` data did, so the tokenizer a run saves (and an
    export copies) turns a prompt into the ids the run generated from: alpaca and text start with BOS
    (see `bos_ids`) and end without EOS; chats were rendered by the chat template, which holds its own
    special tokens, so plain text gets none added (`apply_chat_template` adds none either)."""
    if not hasattr(tokenizer, "update_post_processor"):
        return
    tokenizer.add_bos_token = fmt not in CONVERSATION_KEYS and tokenizer.bos_token_id is not None
    tokenizer.add_eos_token = False
    tokenizer.update_post_processor()


def render_chats(tokenizer, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
    """Each conversation through the chat template, as text; tokenizing that text is what
    `apply_chat_template(tokenize=True)` does."""
    if not conversations:
        return []
    return tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_ids(row: dict, fmt: str, tokenizer) -> list[int] | None:
    """The ids generation starts from for an exact-match check: the alpaca prompt, or a chat up to
    its final assistant turn. None when there is no single answer to compare (text, or a chat that
    does not end with the assistant)."""
    if fmt == "alpaca":
        return bos_ids(tokenizer) + token_ids(tokenizer, [alpaca_prompt(row["instruction"], row.get("input"))])[0]
    if fmt in CONVERSATION_KEYS and messages(row, fmt)[-1]["role"] == "assistant":
        return token_ids(tokenizer, render_chats(tokenizer, [messages(row, fmt)[:-1]], add_generation_prompt=True))[0]
    return None


def expected_answer(row: dict, fmt: str) -> str:
    return str(row["output"]) if fmt == "alpaca" else messages(row, fmt)[-1]["content"]


def _encode_chats(conversations: list[list[dict]], tokenizer, train_on_prompt: bool) -> list[tuple[list[int], list[int]]]:
    """Loss on each assistant turn: the ids between the conversation rendered up to that turn
    with the generation prompt, and rendered through that turn, up to and including its last EOS
    (the end-of-turn token, ChatML's <|im_end|>): what the template renders after it, such as
    ChatML's newline, belongs to the next turn's framing, not the answer. Needs a template that
    renders a conversation prefix by prefix; it is checked on every turn. Each kind of rendering is
    tokenized for the whole batch in one call, and a turn that ends its conversation ends where it does."""

    def tokenized(prefixes: list[list[dict]], add_generation_prompt: bool) -> list[list[int]]:
        return token_ids(tokenizer, render_chats(tokenizer, prefixes, add_generation_prompt))

    whole = tokenized(conversations, add_generation_prompt=False)
    if train_on_prompt:
        return [(input_ids, list(input_ids)) for input_ids in whole]
    turns = [(row, turn) for row, chat in enumerate(conversations) for turn, message in enumerate(chat)
             if message["role"] == "assistant"]
    inner = [(row, turn) for row, turn in turns if turn + 1 < len(conversations[row])]
    before = tokenized([conversations[row][:turn] for row, turn in turns], add_generation_prompt=True)
    through = dict(zip(inner, tokenized([conversations[row][: turn + 1] for row, turn in inner], add_generation_prompt=False)))
    labels = [[IGNORE_INDEX] * len(input_ids) for input_ids in whole]
    eos = tokenizer.eos_token_id
    for (row, turn), start_ids in zip(turns, before):
        input_ids, end_ids = whole[row], through.get((row, turn), whole[row])
        if input_ids[: len(start_ids)] != start_ids or input_ids[: len(end_ids)] != end_ids:
            raise FinetuneError(
                "The tokenizer's chat template renders a conversation differently from its beginning, so "
                "the assistant turns cannot be located for prompt masking. Use --train-on-prompt, or "
                "convert the data to the alpaca format."
            )
        start, end = len(start_ids), len(end_ids)
        answer = input_ids[start:end]
        if eos in answer:
            end = start + len(answer) - answer[::-1].index(eos)
        labels[row][start:end] = input_ids[start:end]
    return list(zip(whole, labels))


def _encode_alpaca(rows: list[dict], tokenizer, train_on_prompt: bool) -> list[tuple[list[int], list[int]]]:
    prompts = [alpaca_prompt(row["instruction"], row.get("input")) for row in rows]
    ids = token_ids(tokenizer, prompts + [row["output"] for row in rows])  # one call: prompts, then outputs
    bos, eos = bos_ids(tokenizer), tokenizer.eos_token_id  # once: each lookup converts a token to its id
    encoded = []
    for template_ids, output_ids in zip(ids[: len(rows)], ids[len(rows) :]):
        prompt, response = bos + template_ids, output_ids + [eos]
        encoded.append((prompt + response, (prompt if train_on_prompt else [IGNORE_INDEX] * len(prompt)) + response))
    return encoded


def encode(rows: list[dict], fmt: str, tokenizer, train_on_prompt: bool, max_seq_len: int) -> list[dict[str, list[int]]]:
    """{input_ids, labels} for each row, truncated to max_seq_len (the end is cut)."""
    if fmt in CONVERSATION_KEYS:
        encoded = _encode_chats([messages(row, fmt) for row in rows], tokenizer, train_on_prompt)
    elif fmt == "alpaca":
        encoded = _encode_alpaca(rows, tokenizer, train_on_prompt)
    else:
        bos, eos = bos_ids(tokenizer), tokenizer.eos_token_id
        encoded = [(bos + ids + [eos], bos + ids + [eos]) for ids in token_ids(tokenizer, [row["text"] for row in rows])]
    return [{"input_ids": input_ids[:max_seq_len], "labels": labels[:max_seq_len]} for input_ids, labels in encoded]


def has_target(labels: list[int]) -> bool:
    """Whether any token is learnt: the first label never is, as nothing precedes it."""
    return labels[1:].count(IGNORE_INDEX) < len(labels) - 1
