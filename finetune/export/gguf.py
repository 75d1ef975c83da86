"""`finetune export RUN --out DIR --format gguf [--gguf-type f16|bf16|q8_0]`: one llama.cpp file.

The run is first exported as a Hugging Face folder (LoRA merged into its base) in a staging folder
beside `--out`; that folder is then written as a single `.gguf` with the `gguf` package's writer,
following llama.cpp's convert_hf_to_gguf.py for the Llama family:
- metadata: `llama.*` architecture numbers, general.name, file type;
- tokenizer: byte-level BPE as `tokenizer.ggml.model = "gpt2"` (tokens, token types, merges,
  special token ids, add-BOS flag and chat template, the last four via `gguf.SpecialVocab`);
- tensors, one at a time (host memory stays near the largest tensor): norms in F32, matrices in
  the chosen type; q_proj/k_proj rows permuted into llama.cpp's rotary layout (transformers'
  GGUF reader undoes it); no `output.weight` when the embeddings are tied.
The staging folder is renamed to `--out` only when complete, so a failed export leaves nothing.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from finetune.errors import GgufExportError
from finetune.export.card import write_model_card
from finetune.export.safetensors import export, new_out_dir
from finetune.export.trained import find_trained
from finetune.models import families

GGUF_TYPES = ("f16", "bf16", "q8_0")
# transformers model_type → llama.cpp architecture, for the families this writer writes (models/families.py);
# Mistral is written as Llama, as llama.cpp does
ARCHITECTURES = {t: f.llama_cpp for t, f in families.FAMILIES.items() if f.gguf_writer}
# tokenizers' pre-tokenizer layouts → llama.cpp's name for the same text split (llama-vocab.cpp)
PRE_TOKENIZERS = {("ByteLevel",): "gpt-2", ("Digits", "ByteLevel"): "smollm"}



def gguf_filename(gguf_type: str) -> str:
    return f"model-{gguf_type}.gguf"


def export_gguf(source: str | Path, out: str | Path, gguf_type: str = "f16") -> Path:
    """Export what `find_trained(source)` finds as `<out>/model-<gguf_type>.gguf` (plus the model card).

    Returns `out`. Raises CheckpointError (GgufExportError for an unsupported architecture or
    tokenizer) before `out` exists; an unsupported tokenizer or full model's architecture before any
    weights are read.
    """
    if gguf_type not in GGUF_TYPES:
        raise GgufExportError(f"--gguf-type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}.")
    if importlib.util.find_spec("gguf") is None:
        raise GgufExportError("--format gguf needs the gguf package: pip install 'finetune[gguf]' (or pip install gguf).")
    out = new_out_dir(out)
    trained = find_trained(source)
    # before the staging export (a LoRA merge loads the whole base); the merged config is checked after
    check_gguf_support(trained.hf_config(), next((p for p in trained.hf_files if p.name == "tokenizer.json"), None))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        hf_dir = export(trained.path, staging / "hf", merge_lora=trained.method != "full")
        check_gguf_support(json.loads((hf_dir / "config.json").read_text()), hf_dir / "tokenizer.json")
        gguf_dir = staging / "gguf"
        gguf_dir.mkdir()
        write_gguf(hf_dir, gguf_dir / gguf_filename(gguf_type), gguf_type, name=out.name)
        write_model_card(trained, gguf_dir, export_format=f"GGUF ({gguf_type})", title=out.name)
        if out.exists():
            out.rmdir()  # empty, checked above
        gguf_dir.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def check_gguf_support(config: dict, tokenizer_file: Path | None) -> None:
    """Raise GgufExportError naming what is supported unless this model config (empty: not known yet)
    and tokenizer have a GGUF form here."""
    problems = []
    model_type = config.get("model_type")
    if config and model_type not in ARCHITECTURES:
        known = families.family(model_type or "")
        converter = (f"; llama.cpp's convert_hf_to_gguf.py writes it as {known.llama_cpp!r} from a safetensors export"
                     if known is not None and known.llama_cpp else "")
        problems.append(f"architecture {model_type!r} (supported: {', '.join(ARCHITECTURES)}{converter})")
    if (config.get("rope_scaling") or {}).get("rope_type", "default") != "default":
        problems.append(f"rope scaling {config['rope_scaling']} (supported: none)")
    if tokenizer_file is None or not tokenizer_file.is_file():
        problems.append("no tokenizer.json (a byte-level BPE tokenizer is needed)")
    else:
        tokenizer = json.loads(tokenizer_file.read_text())
        if not _is_byte_level_bpe(tokenizer):
            problems.append(f"tokenizer model {tokenizer['model']['type']!r} with pre-tokenizer "
                            f"{(tokenizer.get('pre_tokenizer') or {}).get('type')!r} (supported: byte-level BPE, "
                            "as in Llama 3, SmolLM, Qwen and GPT-2 tokenizers)")
    if problems:
        raise GgufExportError("GGUF export cannot write this model: " + "; ".join(problems) + ". Export with "
                              "--format safetensors instead (transformers, vLLM and llama.cpp's "
                              "convert_hf_to_gguf.py read that).")


def _pre_tokenizer_types(tokenizer: dict) -> tuple[str, ...]:
    pre = tokenizer.get("pre_tokenizer") or {}
    return tuple(p["type"] for p in pre.get("pretokenizers", [pre])) if pre else ()


def _is_byte_level_bpe(tokenizer: dict) -> bool:
    return tokenizer["model"]["type"] == "BPE" and "ByteLevel" in _pre_tokenizer_types(tokenizer)


def write_gguf(hf_dir: Path, path: Path, gguf_type: str, name: str) -> None:
    """Write the Hugging Face folder `hf_dir` (a Llama-family model, byte-level BPE tokenizer) as `path`;
    `name` goes in general.name."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    _add_architecture(writer, config, name, gguf_type)
    _add_tokenizer(writer, hf_dir, config["vocab_size"])
    tensors = list(_tensor_plan(hf_dir, config, gguf_type))
    for tensor_name, shape, qtype, _, _ in tensors:
        writer.add_tensor_info(tensor_name, _byte_shape(shape, qtype), np.dtype(np.uint8), _nbytes(shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, qtype, read, permute_heads in tensors:
        data = read().float().numpy()
        if permute_heads:
            data = _permute_for_llama_cpp(data, permute_heads)
        writer.write_tensor_data(_encode(data, qtype))
    writer.close()


def _add_architecture(writer, config: dict, name: str, gguf_type: str) -> None:
    import gguf

    heads = config["num_attention_heads"]
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(writer, hf_dir: Path, vocab_size: int) -> None:
    """Tokens by id padded to the embedding's rows, their llama.cpp types (as convert_hf_to_gguf.py's
    get_vocab_base), what SpecialVocab reads (merges, special ids, chat template), and whether the
    tokenizer adds BOS/EOS."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    if len(by_id) > vocab_size:
        raise GgufExportError(f"{hf_dir}: the tokenizer has {len(by_id)} tokens but the model only {vocab_size} embeddings.")
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    pre = PRE_TOKENIZERS.get(_pre_tokenizer_types(json.loads((hf_dir / "tokenizer.json").read_text())), "default")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=vocab_size)
    # what the tokenizer does, stated explicitly: llama.cpp's default for a missing flag depends on its version
    ids = tokenizer("x")["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id
    special.add_to_gguf(writer, quiet=True)


def _tensor_plan(hf_dir: Path, config: dict, gguf_type: str):
    """(gguf name, shape, ggml type, read(), heads to permute by or 0) per tensor, in file order."""
    import gguf
    from safetensors import safe_open

    files = sorted(hf_dir.glob("model*.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    for file in files:
        with safe_open(str(file), "pt") as f:
            keys = list(f.keys())
        for key in keys:
            if key == "lm_head.weight" and config.get("tie_word_embeddings"):
                continue  # the embedding; llama.cpp reads a missing output.weight as tied
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise GgufExportError(f"{file.name}: tensor {key!r} has no llama.cpp name; this model is not Llama-shaped.")
            with safe_open(str(file), "pt") as f:
                shape = tuple(f.get_slice(key).get_shape())
            permute = heads if key.endswith("q_proj.weight") else kv_heads if key.endswith("k_proj.weight") else 0
            yield name, shape, _ggml_type(shape, gguf_type), _reader(file, key), permute


def _reader(file: Path, key: str):
    def read() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            return f.get_tensor(key)
    return read


def _ggml_type(shape: tuple[int, ...], gguf_type: str):
    """llama.cpp's choice: vectors (norms) stay F32; rows not a multiple of Q8_0's 32-value block fall back to F16."""
    import gguf

    if len(shape) == 1:
        return gguf.GGMLQuantizationType.F32
    if gguf_type == "q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]:
        return gguf.GGMLQuantizationType.F16
    return {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
            "q8_0": gguf.GGMLQuantizationType.Q8_0}[gguf_type]


def _byte_shape(shape, qtype) -> tuple[int, ...]:
    import gguf

    return gguf.quants.quant_shape_to_byte_shape(shape, qtype)


def _nbytes(shape, qtype) -> int:
    return int(np.prod(_byte_shape(shape, qtype)))


def _encode(data: np.ndarray, qtype) -> np.ndarray:
    """float32 values as the bytes of `qtype`."""
    import gguf

    return gguf.quants.quantize(data, qtype).view(np.uint8)


def _permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q_proj/k_proj from Hugging Face's rotary layout (first half, second half of each head)
    to llama.cpp's interleaved pairs: convert_hf_to_gguf.py's LlamaModel.permute."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
