"""The three row formats and how each becomes (input_ids, labels) with the prompt masked.

alpaca  {"instruction", "input" (optional), "output"} → prompt template + output + EOS
chat    {"messages": [{"role", "content"}, ...]}     → the tokenizer's chat template; loss on assistant turns
text    {"text"}                                     → BOS + text + EOS; loss on every token

Labels are -100 where the loss is off: the prompt (unless --train-on-prompt), padding, and packed
example boundaries.
"""

from __future__ import annotations

IGNORE_INDEX = -100
FORMAT_COLUMNS = {
    "alpaca": ({"instruction", "output"}, {"input"}),  # required, optional
    "chat": ({"messages"}, set()),
    "text": ({"text"}, set()),
}


def alpaca_prompt(instruction: str, input_text: str | None) -> str:
    """The prompt template of the alpaca format (compact: every token of it costs sequence length)."""
    prompt = f"### Instruction:\n{instruction}\n"
    if input_text:
        prompt += f"### Input:\n{input_text}\n"
    return prompt + "### Response:\n"


def detect_format(columns: list[str]) -> str | None:
    """The format whose required columns are all present, else None."""
    for name, (required, _) in FORMAT_COLUMNS.items():
        if required <= set(columns):
            return name
    return None


def find_bad_row(rows, fmt: str) -> tuple[int, str] | None:
    """(index, reason) of the first row that cannot be rendered in `fmt`, or None."""
    required, _ = FORMAT_COLUMNS[fmt]
    for index, row in enumerate(rows):
        for column in sorted(required):
            if row.get(column) is None or (column != "messages" and not isinstance(row[column], str)):
                return index, f"field '{column}' is {row.get(column)!r}"
        if fmt == "chat":
            messages = row["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
                return index, "'messages' must be a non-empty list of {role, content}"
            if not any(m["role"] == "assistant" for m in messages):
                return index, "'messages' has no assistant turn to learn from"
    return None


def bos_ids(tokenizer) -> list[int]:
    """BOS as its own id: tokenizers differ in whether they add it, so we add it ourselves."""
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Prompt ids exactly as training sees them (also used to prompt generation in evaluation)."""
    return bos_ids(tokenizer) + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def encode_alpaca(row: dict, tokenizer, train_on_prompt: bool) -> dict:
    prompt_ids = encode_prompt(tokenizer, alpaca_prompt(row["instruction"], row.get("input")))
    response_ids = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt_labels = prompt_ids if train_on_prompt else [IGNORE_INDEX] * len(prompt_ids)
    return {"input_ids": prompt_ids + response_ids, "labels": prompt_labels + response_ids}


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                         return_dict=True)["input_ids"]


def encode_chat(row: dict, tokenizer, train_on_prompt: bool) -> dict:
    """Loss on each assistant turn: the tokens the template adds between the conversation up to
    that turn (with the generation prompt) and the conversation including it."""
    messages = row["messages"]
    input_ids = _chat_ids(tokenizer, messages)
    labels = list(input_ids) if train_on_prompt else [IGNORE_INDEX] * len(input_ids)
    if not train_on_prompt:
        for turn, message in enumerate(messages):
            if message["role"] == "assistant":
                start = len(_chat_ids(tokenizer, messages[:turn], add_generation_prompt=True))
                end = len(_chat_ids(tokenizer, messages[:turn + 1]))
                labels[start:end] = input_ids[start:end]
    return {"input_ids": input_ids, "labels": labels}


def encode_text(row: dict, tokenizer, train_on_prompt: bool) -> dict:
    input_ids = bos_ids(tokenizer) + tokenizer(row["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return {"input_ids": input_ids, "labels": list(input_ids)}


ENCODERS = {"alpaca": encode_alpaca, "chat": encode_chat, "text": encode_text}


def generation_prompt(row: dict, fmt: str, tokenizer) -> tuple[list[int], str, str] | None:
    """(prompt ids, prompt text, expected completion) for exact-match evaluation, where the format
    has a single answer to compare: alpaca rows and chats ending in an assistant turn."""
    if fmt == "alpaca":
        text = alpaca_prompt(row["instruction"], row.get("input"))
        return encode_prompt(tokenizer, text), text, row["output"]
    if fmt == "chat" and row["messages"][-1]["role"] == "assistant":
        ids = _chat_ids(tokenizer, row["messages"][:-1], add_generation_prompt=True)
        return ids, tokenizer.decode(ids, skip_special_tokens=True), row["messages"][-1]["content"]
    return None
