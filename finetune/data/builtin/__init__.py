"""The embedded default: a char-level tokenizer, an alpaca dataset of small digit and string tasks, and
preference pairs of the same tasks (the right answer chosen, a wrong one rejected), all generated
here so a fresh clone trains offline and visibly learns on CPU, supervised or by preference.

The files live next to this module. `python -m finetune.data.builtin` rewrites them; the output
depends only on this code (fixed seed), so a test checks the shipped bytes against a regeneration.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

BUILTIN_DIR = Path(__file__).parent
DATASET_FILE = "dataset.jsonl"
PREFERENCE_FILE = "preference.jsonl"
NUM_ROWS = 4000
SEED = 1234
PREFERENCE_SEED = 4321  # its own stream: the supervised rows stay as they were

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# newline and printable ASCII: enough for every prompt template and task here (100 tokens with
# the specials, within the `tiny` model's 128-entry embedding)
CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))
# Renders a conversation; each assistant turn ends in EOS so generation stops there.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "### {{ message['role'] | capitalize }}:\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)

Task = Callable[[random.Random], tuple[str, str, str]]  # rng → (instruction, input, output)


def _digits(rng: random.Random, low: int = 3, high: int = 5) -> str:
    return "".join(rng.choices(string.digits, k=rng.randint(low, high)))


def _length(rng: random.Random) -> tuple[str, str, str]:
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 9)))
    return "Length.", word, str(len(word))


def _max_digit(rng: random.Random) -> tuple[str, str, str]:
    digits = _digits(rng)
    return "Largest digit.", digits, max(digits)


def _min_digit(rng: random.Random) -> tuple[str, str, str]:
    digits = _digits(rng)
    return "Smallest digit.", digits, min(digits)


def _add(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return "Add.", f"{a}+{b}", str(a + b)


def _multiply(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return "Multiply.", f"{a}*{b}", str(a * b)


def _parity(rng: random.Random) -> tuple[str, str, str]:
    digit = rng.randint(0, 9)
    return "Odd or even.", str(digit), "odd" if digit % 2 else "even"


def _sort_digits(rng: random.Random) -> tuple[str, str, str]:
    digits = _digits(rng, 3, 4)
    return "Sort digits.", digits, "".join(sorted(digits))


def _copy(rng: random.Random) -> tuple[str, str, str]:
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 5)))
    return "Copy.", word, word


# Measured with the `tiny` model (AdamW lr 1e-3, batch 16, 1000 steps): the digit tasks are
# order-free functions of tokens that appear only in the input, so attention finds them by content
# and they are learnt first; sorting follows; copying needs position-exact attention and stays
# near 0 % in this budget: headroom for longer runs.
TASKS: dict[str, Task] = {
    "length": _length,
    "max_digit": _max_digit,
    "min_digit": _min_digit,
    "add": _add,
    "multiply": _multiply,
    "parity": _parity,
    "sort_digits": _sort_digits,
    "copy": _copy,
}


def generate_rows(num_rows: int = NUM_ROWS, seed: int = SEED) -> list[dict[str, str]]:
    """Alpaca rows cycling through TASKS, inputs drawn from one seeded generator."""
    rng = random.Random(seed)
    tasks = list(TASKS.values())
    rows = []
    for index in range(num_rows):
        instruction, task_input, output = tasks[index % len(tasks)](rng)
        rows.append({"instruction": instruction, "input": task_input, "output": output})
    rng.shuffle(rows)
    return rows


def _other(rng: random.Random, right: str, candidates) -> str:
    return rng.choice([str(c) for c in candidates if str(c) != right])


# task → a wrong answer to (input, right answer): mostly the answer of a neighbouring task, the mistake a
# model that confuses the two makes (a miscount for length, the other word for parity). Measured with the
# `tiny` model, 4 epochs of DPO: answers that a neighbouring task gives are told apart on held-out rows far
# sooner than random wrong values (84 % against 73 % overall, bench/RESULTS.md).
WRONG: dict[str, Callable[[random.Random, str, str], str]] = {
    "length": lambda rng, text, right: _other(rng, right, range(1, 10)),
    "max_digit": lambda rng, text, right: min(text),
    "min_digit": lambda rng, text, right: max(text),
    "add": lambda rng, text, right: _other_result(int(text[0]) * int(text[2]), right),
    "multiply": lambda rng, text, right: _other_result(int(text[0]) + int(text[2]), right),
    "parity": lambda rng, text, right: "even" if right == "odd" else "odd",
    "sort_digits": lambda rng, text, right: text,
    "copy": lambda rng, text, right: _sorted_or_reversed(right),
}


def _other_result(confused: int, right: str) -> str:
    """The other operation's result, or one more where both agree (2+2 and 2*2)."""
    return str(confused) if str(confused) != right else str(confused + 1)


def _sorted_or_reversed(word: str) -> str:
    """The word sorted (confusing copying with sorting), reversed if it is sorted already."""
    return "".join(sorted(word)) if "".join(sorted(word)) != word else word[::-1]


def generate_preference_rows(num_rows: int = NUM_ROWS, seed: int = PREFERENCE_SEED) -> list[dict[str, str]]:
    """prompt / chosen / rejected rows cycling through TASKS: the alpaca prompt of the task, its right
    answer chosen and a wrong one (`WRONG`) rejected. A row whose wrong answer would equal the right
    one (the largest of equal digits, sorting sorted digits, copying "aaa") is drawn again."""
    from finetune.data.formats import alpaca_prompt  # here: this package loads while finetune.data does

    rng = random.Random(seed)
    names = list(TASKS)
    rows = []
    while len(rows) < num_rows:
        name = names[len(rows) % len(names)]
        instruction, task_input, output = TASKS[name](rng)
        wrong = WRONG[name](rng, task_input, output)
        if wrong != output:
            rows.append({"prompt": alpaca_prompt(instruction, task_input), "chosen": output, "rejected": wrong})
    rng.shuffle(rows)
    return rows


def builtin_file(preference: bool) -> str:
    """The file `--dataset builtin` reads: the preference pairs for a preference objective."""
    return PREFERENCE_FILE if preference else DATASET_FILE


def build_tokenizer() -> Tokenizer:
    """One token per character (specials first, so PAD=0, BOS=1, EOS=2, UNK=3); decoding joins
    characters back without spaces. No BOS is added automatically: prompts carry it as text."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json: what AutoTokenizer needs to wrap tokenizer.json as a fast tokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": 512,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_builtin(directory: Path = BUILTIN_DIR) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and the dataset; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": build_tokenizer().to_str(pretty=True) + "\n",
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2) + "\n",
        DATASET_FILE: "".join(json.dumps(row) + "\n" for row in generate_rows()),
        PREFERENCE_FILE: "".join(json.dumps(row) + "\n" for row in generate_preference_rows()),
    }
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8", newline="\n")
    return [directory / name for name in files]
