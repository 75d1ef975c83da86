"""Free-text queries ("llama-70b qlora on 2×RTX 4090, seq 4096") → planner request fields, and
model names / config.json paths → ModelSpec, without torch or network.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from finetune.catalog import gpus as gpu_catalog
from finetune.catalog import models as model_catalog
from finetune.catalog.models import ModelSpec
from finetune.errors import FinetuneError
from finetune.planner.workload import PRECISIONS

# config.json model_types whose decoder layer has the Llama layout the planner counts.
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite"}


def _flexible(key: str) -> str:
    """Regex matching a squashed name with optional spaces, dashes, dots or underscores between characters."""
    return r"[\s\-_.]*".join(re.escape(ch) for ch in key)


def _longest_match(text: str, keys: dict[str, str]) -> tuple[str, re.Match] | None:
    """The catalog name whose spelling matches the longest span of `text` as a whole word."""
    best = None
    for key, name in keys.items():
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
    """'2×A100 40GB', '8xH100', '1xRTX4090', '4x L40S', 'H200' → (catalog GPU name, count).

    Raises FinetuneError naming close catalog GPUs when none is recognised.
    """
    found = find_gpus(text.lower())
    if found is None:
        gpu_catalog.get(re.sub(r"^\s*\d+\s*[x×*]\s*", "", text))  # raises with close names
        raise FinetuneError(f"Cannot read GPUs from {text!r}: write e.g. 2xA100-40GB")
    return found


def find_gpus(text: str) -> tuple[str, int] | None:
    text = re.sub(r"(\d)\s*[x×*]\s*(?=[a-z0-9])", r"\1 x ", text.lower())
    hit = _longest_match(text, gpu_catalog.spellings())
    if hit is None:
        for bare, sizes in gpu_catalog.AMBIGUOUS.items():
            if re.search(rf"(?<![a-z0-9]){bare}(?![a-z0-9])", text):
                raise FinetuneError(f"'{bare.upper()}' comes in several sizes: say which, e.g. {' or '.join(sizes)}.")
        size = re.search(r"(?<![a-z0-9])(\d+)\s*gb?(?![a-z0-9])", text)
        if size:
            same = [g.name for g in gpu_catalog.GPUS.values() if abs(g.memory_gib - int(size.group(1))) <= 1.5]
            hint = f": {', '.join(same)}" if same else ""
            raise FinetuneError(f"Which {size.group(1)} GB GPU? Name it{hint} (e.g. 2x{same[0] if same else 'A100-40GB'}).")
        return None
    name, match = hit
    before = re.search(r"(\d+)\s*(?:x\s*)?$", text[: match.start()])
    after = re.match(r"\s*x\s*(\d+)", text[match.end():])
    count = int(before.group(1)) if before else int(after.group(1)) if after else 1
    if count < 1:
        raise FinetuneError(f"GPU count must be ≥ 1 in {text!r}")
    return name, count


def parse_query(text: str) -> dict:
    """Request fields found in a free-text query; flags given on the command line override them.

    Raises FinetuneError for text that names no GPU and no model, or a model the catalog lacks.
    """
    fields: dict = {}
    low = text.lower()
    gpus = find_gpus(low)
    if gpus:
        fields["gpu"], fields["gpus_per_node"] = gpus
    else:
        counted = re.search(r"(?<![a-z0-9])\d+\s*[x×*]\s*([a-z][a-z0-9\-]*)", low)
        if counted:
            gpu_catalog.get(counted.group(1))  # raises with close GPU names
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
    offload = re.search(r"(optimizer|param(?:eter)?s?)[\s\-_]*offload|offload(?:ing)?[\s\-_]*(?:the[\s\-_]*)?(optimizer|param(?:eter)?s?)", low)
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


def resolve_model(name: str) -> ModelSpec:
    """A catalog name, a Hub id (catalog, or config.json in the local Hugging Face cache), a local
    directory or a config.json path → ModelSpec. Never downloads.
    """
    spec = model_catalog.lookup(name)
    if spec is not None:
        return spec
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return spec_from_config(json.loads(path.read_text()), name)
    if "/" in name and not name.startswith((".", "/")):
        cached = _hub_cache_config(name)
        if cached is not None:
            return spec_from_config(json.loads(cached.read_text()), name)
        raise FinetuneError(
            f"'{name}' is not in the catalog and its config.json is not in the local Hugging Face cache. "
            f"Fetch just that file (huggingface-cli download {name} config.json) and pass its path to --model."
        )
    return model_catalog.get(name)  # raises with close names


def _hub_cache_config(repo_id: str) -> Path | None:
    home = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub")
    snapshots = home / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
    return found[-1] if found else None


def spec_from_config(config: dict, name: str) -> ModelSpec:
    """ModelSpec from a transformers config.json of a Llama-like decoder.

    Raises FinetuneError for mixture-of-experts or non-Llama layouts the planner cannot count.
    """
    model_type = config.get("model_type", "?")
    if any(key in config for key in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise FinetuneError(f"{name}: mixture-of-experts models ({model_type}) are not supported by the planner.")
    if model_type not in LLAMA_LIKE:
        raise FinetuneError(f"{name}: model_type {model_type!r} is not supported; the planner knows {', '.join(sorted(LLAMA_LIKE))}.")
    try:
        heads = config["num_attention_heads"]
        return ModelSpec(
            name=name, hf_id=name if "/" in name and not Path(name).exists() else None, model_type=model_type,
            num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads, intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"], tie_word_embeddings=config.get("tie_word_embeddings", model_type.startswith("gemma")),
            max_position_embeddings=config.get("max_position_embeddings", 4096), head_dim=config.get("head_dim"),
            attention_bias=config.get("attention_bias", model_type == "qwen2"), linear_bias=config.get("mlp_bias", False),
            source=f"{name} (config.json)",
        )
    except KeyError as e:
        raise FinetuneError(f"{name}: config.json lacks {e.args[0]!r}, which the planner needs.") from e
