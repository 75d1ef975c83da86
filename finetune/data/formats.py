"""The three row formats: how each is detected, checked, and turned into (input_ids, labels).

alpaca  {"instruction", "input" (optional), "output"} → BOS + prompt template, then output + EOS
chat    {"messages": [{"role", "content"}, ...]}     → the tokenizer's chat template
text    {"text"}                                     → BOS + text + EOS

Labels are the input ids where the loss is on and -100 where it is off: the prompt (the alpaca
template with instruction and input; every non-assistant turn of a chat) unless --train-on-prompt.
Prompts are tokenized on their own and the response ids appended, so the ids the model learns to
continue are exactly the ids exact-match evaluation starts generation from (`prompt_ids`).
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Number

from finetune.errors import FinetuneError

IGNORE_INDEX = -100
# format → (required fields, optional fields); detection tries them in this order
FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input",)),
    "chat": (("messages",), ()),
    "text": (("text",), ()),
}


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


def _row_problem(row: dict, fmt: str) -> str | None:
    required, optional = FORMAT_FIELDS[fmt]
    for field in required:
        if row.get(field) is None:
            return f"field '{field}' is missing"
    if fmt != "chat":
        for field in required + optional:
            if row.get(field) is not None and not _is_scalar_text(row[field]):
                return f"field '{field}' is a {type(row[field]).__name__}, not text"
        return None
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' is not a non-empty list"
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return f"message {turn} is not a {{role, content}} pair of strings"
    if not any(message["role"] == "assistant" for message in messages):
        return "no message has role 'assistant', so there is nothing to learn"
    return None


def check_rows(rows, fmt: str, source: str) -> None:
    """Raise FinetuneError at the first row `fmt` cannot render, naming the row (counting from 0),
    what is wrong, the fields the format expects and the fields that row has."""
    for index, row in enumerate(rows):
        problem = _row_problem(row, fmt)
        if problem:
            required, optional = FORMAT_FIELDS[fmt]
            found = [name for name, value in row.items() if value is not None]
            raise FinetuneError(
                f"{source}, row {index}: {problem}. Format {fmt} expects fields {', '.join(required)}"
                + (f" (optional: {', '.join(optional)})" if optional else "")
                + f"; this row has: {', '.join(found) or 'no fields'}."
            )


def alpaca_prompt(instruction, input_text=None) -> str:
    """The alpaca prompt, compact because every template token costs sequence length (and, for
    the tiny default model, learning speed)."""
    prompt = f"### Instruction:\n{instruction}\n"
    if input_text is not None and str(input_text):
        prompt += f"### Input:\n{input_text}\n"
    return prompt + "### Response:\n"


def _ids(tokenizer, text) -> list[int]:
    return tokenizer(str(text), add_special_tokens=False)["input_ids"]


def _bos(tokenizer) -> list[int]:
    """BOS as an id of its own: tokenizers differ in whether they add it, so we always do."""
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    return list(rendered["input_ids"])


def prompt_ids(row: dict, fmt: str, tokenizer) -> list[int] | None:
    """The ids generation starts from for an exact-match check: the alpaca prompt, or a chat up to
    its final assistant turn. None when there is no single answer to compare (text, or a chat that
    does not end with the assistant)."""
    if fmt == "alpaca":
        return _bos(tokenizer) + _ids(tokenizer, alpaca_prompt(row["instruction"], row.get("input")))
    if fmt == "chat" and row["messages"][-1]["role"] == "assistant":
        return _chat_ids(tokenizer, row["messages"][:-1], add_generation_prompt=True)
    return None


def expected_answer(row: dict, fmt: str) -> str:
    return str(row["output"]) if fmt == "alpaca" else row["messages"][-1]["content"]


def _encode_chat(row: dict, tokenizer, train_on_prompt: bool) -> tuple[list[int], list[int]]:
    """Loss on each assistant turn: the ids between the conversation rendered up to that turn
    with the generation prompt, and rendered through that turn. Needs a template that renders a
    conversation prefix by prefix; it is checked on every turn."""
    messages = row["messages"]
    input_ids = _chat_ids(tokenizer, messages)
    if train_on_prompt:
        return input_ids, list(input_ids)
    labels = [IGNORE_INDEX] * len(input_ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _chat_ids(tokenizer, messages[:turn], add_generation_prompt=True)
        through = _chat_ids(tokenizer, messages[: turn + 1])
        if input_ids[: len(before)] != before or input_ids[: len(through)] != through:
            raise FinetuneError(
                "The tokenizer's chat template renders a conversation differently from its beginning, so "
                "the assistant turns cannot be located for prompt masking. Use --train-on-prompt, or "
                "convert the data to the alpaca format."
            )
        labels[len(before) : len(through)] = input_ids[len(before) : len(through)]
    return input_ids, labels


def encode(row: dict, fmt: str, tokenizer, train_on_prompt: bool, max_seq_len: int) -> dict[str, list[int]]:
    """{input_ids, labels} for one row, truncated to max_seq_len (the end is cut)."""
    if fmt == "chat":
        input_ids, labels = _encode_chat(row, tokenizer, train_on_prompt)
    elif fmt == "alpaca":
        prompt = prompt_ids(row, fmt, tokenizer)
        response = _ids(tokenizer, row["output"]) + [tokenizer.eos_token_id]
        input_ids = prompt + response
        labels = (prompt if train_on_prompt else [IGNORE_INDEX] * len(prompt)) + response
    else:
        input_ids = _bos(tokenizer) + _ids(tokenizer, row["text"]) + [tokenizer.eos_token_id]
        labels = list(input_ids)
    return {"input_ids": input_ids[:max_seq_len], "labels": labels[:max_seq_len]}


def has_target(labels: list[int]) -> bool:
    """Whether any token is learnt: the first label never is, as nothing precedes it."""
    return any(label != IGNORE_INDEX for label in labels[1:])
