"""What `--model` is, answered once and without torch: a catalog name (with published weights, a shape
finetune initialises itself, or a GGUF file a package ships), a local folder, a config.json, a .gguf file,
or a Hugging Face id; where its weights load from; and its architecture as the planner counts it."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from finetune.errors import FinetuneError
from finetune.models import catalog, families, gguf_import
from finetune.models.catalog import ModelSpec

# what --model accepts, for errors; `finetune plan` also reads a config.json path
MODEL_FORMS = "a catalog name, a Hugging Face id (org/name), a model directory with config.json, or a .gguf file"
PLAN_MODEL_FORMS = "a catalog name, a Hugging Face id (org/name), a directory with config.json, a config.json path, or a .gguf file"
# config.json fields the planner counts with; each must be a positive integer where present
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim")


SourceKind = Literal["catalog", "random-init", "gguf", "local", "hub"]


@dataclass(frozen=True)
class ModelSource:
    """What `--model` names and where its weights come from, decided once: every place that loads,
    rehearses or describes the model (the model card included) reads this instead of guessing from the
    string again. Its architecture is `architecture_of`'s answer, which a resolved run carries as its
    one `spec` (config/resolve.py)."""

    name: str  # --model as given
    kind: SourceKind  # catalog: published weights on the Hub; random-init: a shape finetune seeds itself;
    # gguf: a .gguf file or a catalog entry shipping one; local: a model directory (or another path);
    # hub: a Hugging Face id (org/name)
    weights: str  # where the weights load from: a local directory or a Hub id
    gguf: Path | None = None  # the GGUF file the weights are dequantised from

    @property
    def written_by_finetune(self) -> bool:
        """The weights folder is finetune's own (a seeded random init, a converted GGUF), written by
        `loading.materialize` on first use."""
        return self.kind in ("random-init", "gguf")

    @property
    def hub_id(self) -> str | None:
        """The Hub repo the weights come from (a GGUF entry: the repo its file was converted from), or
        None for local files: the model card's base_model."""
        entry = catalog.lookup(self.name)
        if entry is not None:
            return entry.hf_id or entry.converted_from
        return self.name if self.kind == "hub" else None


def model_source(model: str, output_dir: str | Path = ".") -> ModelSource:
    """The one answer to "what is --model". Cheap: a stat of a GGUF file, no read; the folders
    finetune writes itself (a random init under `output_dir`, a converted GGUF) are named here and
    written by `loading.materialize`. `model_problem` has already refused names that are none of
    these; a GGUF file that is missing or is not one raises FinetuneError."""
    if Path(model).is_dir():
        return ModelSource(model, "local", model)
    spec = catalog.lookup(model)
    gguf = _gguf_file(model, spec)
    if gguf is not None:
        return ModelSource(model, "gguf", str(gguf_import.cache_entry(gguf)), gguf)
    if spec is not None and spec.random_init:
        return ModelSource(model, "random-init", str((Path(output_dir) / "base_model").resolve()))
    if spec is not None:
        return ModelSource(model, "catalog", spec.hf_id)
    hub = model.count("/") == 1 and not catalog.looks_like_path(model) and not Path(model).exists()
    return ModelSource(model, "hub" if hub else "local", model)


def _gguf_file(model: str, spec: ModelSpec | None) -> Path | None:
    """The GGUF file `model` names: a catalog entry whose weights are a GGUF, or a `.gguf` path
    (checked: it exists and is a GGUF file); None for anything else."""
    if spec is not None and spec.gguf_file is not None:
        if spec.gguf_package is not None:
            return gguf_import.packaged_file(spec.gguf_package, spec.gguf_file, spec.name)
        return Path(spec.gguf_file)
    if not gguf_import.is_gguf(model):
        return None
    path = Path(model).expanduser().resolve()
    gguf_import.check_file(path, model)
    return path


def model_problem(model: str) -> str | None:
    """Why `model` names nothing a run can load (a dataset or a config.json passed by mistake, a
    directory without config.json, a catalog typo), or None when it may load."""
    path = Path(model).expanduser()
    if gguf_import.is_gguf(model) and not path.is_dir():
        try:
            gguf_import.check_file(path, model)
        except FinetuneError as e:
            return f"{e} Expected {MODEL_FORMS}."
        return None
    if path.is_file():
        return f"--model {model}: a file, not a model. Expected {MODEL_FORMS}."
    if path.is_dir():
        try:
            catalog.read_local_config(path, MODEL_FORMS)
        except FinetuneError as e:
            return str(e)
        return None
    if catalog.looks_like_path(model):
        return f"--model {model}: no such directory. Expected {MODEL_FORMS}."
    if catalog.lookup(model) is None and "/" not in model:
        return str(catalog.unknown_model_error(model))
    return None


def resolve_model(name: str) -> ModelSpec:
    """A catalog name, a Hub id (catalog, or config.json in the local Hugging Face cache), a local
    directory, a config.json path or a GGUF file (its metadata) → ModelSpec. Never downloads.
    """
    spec = catalog.lookup(name)
    if spec is not None:
        return spec
    path = Path(name).expanduser()
    if gguf_import.is_gguf(name) and not path.is_dir():
        gguf_import.check_file(path, name)
        return replace(spec_from_config(gguf_import.hf_config(path), name), gguf_file=str(path.resolve()))
    if path.exists():
        return spec_from_config(catalog.read_local_config(path, PLAN_MODEL_FORMS), name)
    if catalog.looks_like_path(name):
        raise FinetuneError(f"--model {name}: no such file or directory. Expected {PLAN_MODEL_FORMS}.")
    if "/" in name:
        cached = _hub_cache_config(name)
        if cached is not None:
            return spec_from_config(json.loads(cached.read_text()), name)
        raise FinetuneError(
            f"'{name}' is not in the catalog and its config.json is not in the local Hugging Face cache. "
            f"Fetch just that file: `hf download {name} config.json` puts it in the cache, where the planner "
            "looks; offline, copy a config.json here and pass its path to --model."
        )
    return catalog.get(name)  # raises with close names


def _hub_cache_config(repo_id: str) -> Path | None:
    """The cached config.json of the Hub repo's main revision (huggingface_hub knows the cache's
    layout and which snapshot `main` points at), or None. Imported here: `finetune plan` for catalog
    models never needs it."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found) if isinstance(found, str) else None


def spec_from_config(config: dict, name: str) -> ModelSpec:
    """ModelSpec from a transformers config.json of a family finetune knows (models/families.py);
    Gemma 3's language model is read from its text_config, and its vision tower counted apart.

    Raises FinetuneError for an unknown model_type, and for missing or non-positive sizes.
    """
    model_type = config.get("model_type", "?")
    fam = families.get(model_type, name)
    text = families.language_config(config)
    _check_sizes(text, name)
    try:
        heads = text["num_attention_heads"]
        return ModelSpec(
            name=name, hf_id=name if "/" in name and not Path(name).exists() else None, model_type=model_type,
            num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"], num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads, intermediate_size=text["intermediate_size"],
            vocab_size=text["vocab_size"], tie_word_embeddings=text.get("tie_word_embeddings", fam.tied),
            max_position_embeddings=text.get("max_position_embeddings", 4096),
            head_dim=None if fam.mla else text.get("head_dim"), linear_bias=text.get("mlp_bias", False),
            norms_per_layer=fam.norms_per_layer, **families.bias_fields(text, fam), **families.moe_fields(text, fam),
            **(families.mla_fields(text) if fam.mla else {}), tower_params=families.tower_params(config, text["hidden_size"]),
            quantized=(config.get("quantization_config") or {}).get("quant_method"), source=f"{name} (config.json)",
            sliding_window=text.get("sliding_window", fam.sliding_default) if fam.sliding else None,
        )
    except KeyError as e:
        raise FinetuneError(f"{name}: config.json lacks {e.args[0]!r}, which the planner needs.") from e


def _check_sizes(config: dict, name: str) -> None:
    wrong = [f"{key}={config[key]!r}" for key in SIZE_FIELDS
             if config.get(key) is not None and (type(config[key]) is not int or config[key] < 1)]
    if wrong:
        raise FinetuneError(f"{name}: config.json sizes must be positive integers, got {', '.join(wrong)}.")


def model_hidden_size(model: str) -> int | None:
    """Hidden size (of the language model) from a local config.json, without loading weights; None for Hub ids."""
    config_file = Path(model) / "config.json"
    if config_file.is_file():
        return families.language_config(json.loads(config_file.read_text())).get("hidden_size")
    return None


def architecture_of(model: str) -> ModelSpec | None:
    """The planner's ModelSpec of a local model, a GGUF file or a Hub id whose config.json is cached; None when
    it cannot be read without a download or the planner cannot count that architecture."""
    try:
        return resolve_model(model)
    except FinetuneError:
        return None
