"""Free-text queries ("llama-70b qlora on 2×RTX 4090, seq 4096") → planner request fields, without torch
or network (what a model name means is models/source.py's answer)."""

from __future__ import annotations

import re

from finetune.config.names import PRECISIONS
from finetune.errors import FinetuneError
from finetune.models import catalog as model_catalog
from finetune.plan import gpus as gpu_catalog


def _flexible(key: str) -> str:
    """Regex matching a squashed name with optional spaces, dashes, dots or underscores between characters."""
    return r"[\s\-_.]*".join(re.escape(ch) for ch in key)


def _longest_match(text: str, keys: dict[str, str]) -> tuple[str, re.Match] | None:
    """The catalog name whose spelling matches the longest span of `text` as a whole word."""
    best = None
    compact = re.sub(r"[\s\-_.]", "", text)  # a spelling matches only where its letters are there in a row
    for key, name in keys.items():
        if key not in compact:
            continue
        for match in re.finditer(rf"(?<![a-z0-9]){_flexible(key)}(?![a-z0-9])", text):
            if best is None or len(match.group()) > len(best[1].group()):
                best = (name, match)
    return best


def _model_spellings() -> dict[str, str]:
    table = {}
    for name, spec in model_catalog.MODELS.items():
        for spelling in (name, spec.hf_id or ""):
            if spelling:
                table[gpu_catalog.squash(spelling.split("/")[-1])] = name
    for alias, name in model_catalog.ALIASES.items():
        table[gpu_catalog.squash(alias)] = name
    return table


def parse_gpus(text: str) -> tuple[str, int]:
    """'2×A100 40GB', '8xH100', '1xRTX4090', '4x L40S', 'H200', '2x48GB' → (GPU name, count): a catalog
    name, or a card given by its memory ('48GB', gpus.by_memory).

    Raises FinetuneError naming close catalog GPUs when none is recognised.
    """
    found = find_gpus(text)
    if found is None:
        gpu_catalog.get(re.sub(r"^\s*\d+\s*[x×*]\s*", "", text))  # raises with close names
        raise FinetuneError(f"Cannot read GPUs from {text!r}: write e.g. 2xA100-40GB")
    return found


def find_gpus(text: str) -> tuple[str, int] | None:
    """(GPU name, count) named in `text`, or None when it names no GPU. A size with no GPU name
    ('2x48GB', 'on 2× 24 GB') is a card given by its memory.

    Raises FinetuneError for a GPU-like word the catalog lacks ('2xA1000'), with close names, for a
    bare name that fits several entries ('A100'), and for a size no card has ('2x0GB').
    """
    original = text
    text = re.sub(r"(\d)\s*[x×*]\s*(?=[a-z0-9])", r"\1 x ", text.lower())
    hit = _longest_match(text, gpu_catalog.spellings())
    if hit is None:
        for bare, sizes in gpu_catalog.AMBIGUOUS.items():
            if re.search(rf"(?<![a-z0-9]){bare}(?![a-z0-9])", text):
                raise FinetuneError(f"'{bare.upper()}' comes in several sizes: say which, e.g. {' or '.join(sizes)}.")
        size = re.search(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)\s*gi?b?(?![a-z0-9])", text)
        word = _gpu_like_word(original)
        if word:
            gpu_catalog.get(word, float(size.group(1)) if size else None)  # raises with close names
        if size is None:
            return None
        if gpu_catalog.memory_size(size.group()) is None:
            low, high = gpu_catalog.MEMORY_ONLY_GIB
            raise FinetuneError(f"No GPU has {size.group(1)} GB: give a card's memory in GiB from {low:g} to {high:g} "
                                "(e.g. 2x48GB), or name the card (e.g. 2xA100-40GB).")
        hit = gpu_catalog.by_memory(float(size.group(1))).name, size
    name, match = hit
    before = re.search(r"(\d+)\s*(?:x\s*)?$", text[: match.start()])
    after = re.match(r"\s*x\s*(\d+)", text[match.end():])
    count = int(before.group(1)) if before else int(after.group(1)) if after else 1
    if count < 1:
        raise FinetuneError(f"GPU count must be ≥ 1 in {text!r}")
    return name, count


def _gpu_like_word(text: str) -> str | None:
    """A word of letters and digits counted like GPUs ('2xA1000', '4 x B200') or followed by a memory
    size ('A1000 40GB'), as the user wrote it."""
    name = r"([a-z][a-z0-9\-]*\d[a-z0-9\-]*)"
    found = (re.search(rf"(?<![a-z0-9])\d+\s*[x×*]\s*{name}", text, re.IGNORECASE)
             or re.search(rf"(?<![a-z0-9]){name}\s*\d+\s*gb?(?![a-z0-9])", text, re.IGNORECASE))
    return found.group(1) if found else None


def parse_query(text: str) -> dict:
    """Request fields found in a free-text query; flags given on the command line override them.

    Raises FinetuneError for text that names no GPU and no model, or a model the catalog lacks.
    """
    fields: dict = {}
    low = text.lower()
    gpus = find_gpus(text)
    if gpus:
        fields["gpu"], fields["gpus_per_node"] = gpus
    for token in low.split():
        if "/" in token or token.endswith(".json"):
            fields["model"] = token
    if "model" not in fields:
        hit = _longest_match(low, _model_spellings())
        if hit:
            fields["model"] = hit[0]
        else:
            _reject_unknown_model(low)
    method = re.search(r"(?<![a-z0-9])(q-?lora|lora|full)(?![a-z0-9])", low)
    if method:
        fields["method"] = method.group(1).replace("-", "")
    strategy = re.search(r"(?<![a-z0-9])(ddp|fsdp2?|zero[\s\-_]*(?:stage[\s\-_]*)?([123])|single)(?![a-z0-9])", low)
    if strategy:
        word = strategy.group(1)
        fields["strategy"] = f"zero{strategy.group(2)}" if strategy.group(2) else word.rstrip("2")
    offload = re.search(r"(optimizer|param(?:eter)?s?)[\s\-_]*offload"
                        r"|offload(?:ing)?[\s\-_]*(?:the[\s\-_]*)?(optimizer|param(?:eter)?s?)", low)
    if offload:
        word = offload.group(1) or offload.group(2)
        fields["offload"] = "optimizer" if word == "optimizer" else "params"
    elif re.search(r"\bno[\s\-_]*offload", low):
        fields["offload"] = "none"
    for precision in PRECISIONS:
        if precision in low:
            fields["precision"] = precision
    seq = re.search(r"(?:seq(?:uence)?(?:[\s\-_]*len(?:gth)?)?|context|ctx)\s*[=:]?\s*(\d+)\s*(k?)(?![a-z0-9])", low)
    if seq:
        fields["seq_len"] = int(seq.group(1)) * (1024 if seq.group(2) else 1)
    micro = re.search(r"(?:micro[\s\-_]*batch(?:[\s\-_]*size)?|mbs|batch(?:[\s\-_]*size)?)\s*[=:]?\s*(\d+)", low)
    if micro:
        fields["micro_batch_size"] = int(micro.group(1))
    nodes = re.search(r"(\d+)\s*nodes?\b", low)
    if nodes:
        fields["nodes"] = int(nodes.group(1))
    if re.search(r"\bno[\s\-_]*(?:gradient[\s\-_]*)?checkpointing", low):
        fields["gradient_checkpointing"] = False
    elif re.search(r"checkpointing", low):
        fields["gradient_checkpointing"] = True
    if not fields:
        raise FinetuneError(
            f"Cannot understand the query {text!r}: name GPUs and optionally a model, "
            "e.g. \"llama-70b qlora on 2xRTX4090\" or \"what fits on 2×A100 40GB\"."
        )
    return fields


def _reject_unknown_model(text: str) -> None:
    """A word that reads like a model with a size ('falcon-40b', 'llama 9000b') but is not in the
    catalog is a typo or an unsupported model: say so instead of planning for something else."""
    word = re.search(r"(?<![a-z0-9])([a-z][a-z0-9]*(?:[\-_.][a-z0-9.]+)*[\-_. ]?\d+(?:\.\d+)?b)(?![a-z0-9])", text)
    if word:
        model_catalog.get(word.group(1))  # raises UnknownModelError with close names
