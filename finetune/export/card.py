"""The `README.md` every export writes: a Hugging Face model card (YAML front matter + body) built
from what the run recorded — its options and ResolvedRecord (a checkpoint's manifest, or run.yaml
beside a final model), steps and tokens trained, and the eval rows of metrics.jsonl — all read
through config/run_folder.py, so writing a card loads no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import finetune
from finetune.config.run_folder import MANIFEST, MODEL_CARD, ResolvedRecord, RunFolder
from finetune.errors import FinetuneError
from finetune.models import catalog
from finetune.models.catalog import looks_like_path
from finetune.models.gguf_import import file_type as gguf_file_type
from finetune.models.source import ModelSource, model_source

TEMPLATE = Path(__file__).with_name("model_card_template.md")  # shipped as package data (pyproject.toml)
# licenses of catalogued base models, by Hub id prefix (the model pages' `license:` fields)
LICENSES = {
    "meta-llama/Llama-2-": "llama2",
    "meta-llama/Llama-3.1-": "llama3.1",
    "meta-llama/Llama-3.2-": "llama3.2",
    "mistralai/Mistral-7B-v0.1": "apache-2.0",
    "Qwen/Qwen2.5-72B": "other",  # the Qwen license; its smaller siblings are Apache-2.0
    "Qwen/Qwen2.5-": "apache-2.0",
    "HuggingFaceTB/SmolLM2-": "apache-2.0",
}
METHOD_NAMES = {"full": "Full fine-tuning", "lora": "LoRA", "qlora": "QLoRA (LoRA on a 4-bit NF4 base)"}
EVAL_METRICS = {"eval_loss": "eval loss", "exact_match": "exact match (greedy)"}
# the run options a card shows; "?" where a record lacks one (a manifest written by another version)
CARD_OPTIONS = ("model", "method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "dataset", "format",
                "micro_batch_size", "max_seq_len", "packing", "lr", "lr_schedule", "warmup_steps", "optimizer",
                "precision", "seed")


@dataclass(frozen=True)
class RunRecord:
    """What a run recorded about the training behind an export."""

    config: dict  # TrainConfig.to_dict()
    resolved: ResolvedRecord  # global batch, max steps, peak lr, precision, strategy, examples
    step: int
    tokens_seen: int | None
    evals: list[dict]  # metrics.jsonl rows holding eval metrics, up to `step`


def read_run_record(trained) -> RunRecord:
    """The record of `trained` (an export.trained.Trained): a checkpoint's manifest, or the finished run's
    run.yaml and summary; eval rows from the output dir's metrics."""
    if trained.is_checkpoint:
        manifest = json.loads((trained.path / MANIFEST).read_text())
        config, resolved = manifest["config"], ResolvedRecord.of_manifest(manifest)
        step, tokens = manifest["step"], manifest.get("tokens_seen")
        folder = RunFolder.of_checkpoint(trained.path)
    else:
        folder = RunFolder(trained.path)
        config, resolved = folder.read_run_yaml()
        summary = folder.read_summary()
        step, tokens = summary.get("steps", resolved.max_steps or 0), summary.get("tokens_seen")
    evals = [r for r in folder.read_metrics() if any(k in r for k in EVAL_METRICS) and r["step"] <= step]
    return RunRecord(config=config, resolved=resolved, step=step, tokens_seen=tokens, evals=evals)


def _model_source(config: dict) -> ModelSource | None:
    """What the run's --model was (see models.source), or None when it can no longer be told (a GGUF
    file moved away since training, the package that shipped it uninstalled)."""
    try:
        return model_source(str(config["model"]), config.get("output_dir") or ".")
    except FinetuneError:
        return None


def license_of(hub_id: str | None) -> str | None:
    return next((lic for prefix, lic in LICENSES.items() if hub_id and hub_id.startswith(prefix)), None)


def model_card(record: RunRecord, export_format: str, title: str) -> str:
    """The card's text: huggingface_hub's ModelCard from the template shipped beside this module
    (YAML front matter in the Hub's model-card format, then a Markdown body)."""
    from huggingface_hub import ModelCard, ModelCardData

    config, resolved = dict.fromkeys(CARD_OPTIONS, "?") | record.config, record.resolved
    source = _model_source(config)
    base = source.hub_id if source is not None else None
    method = config["method"] if config["method"] in METHOD_NAMES else "full"
    gguf = export_format.startswith("GGUF")
    adapter = export_format == "PEFT adapter"
    dataset, hub_dataset = _dataset_name(config["dataset"])
    data = ModelCardData(
        base_model=base, license=license_of(base), pipeline_tag="text-generation",
        library_name="gguf" if gguf else "peft" if adapter else "transformers",
        datasets=[hub_dataset] if hub_dataset else None,
        tags=["finetune", "full-fine-tuning" if method == "full" else method] + (["gguf"] if gguf else []),
    )
    model = _model_name(config["model"], source)
    summary = f"{METHOD_NAMES[method]} of `{base or model}` with finetune {finetune.__version__}, exported as {export_format}."
    rows = {
        "base model": f"`{model}`" + (f" ([{base}](https://huggingface.co/{base}))" if base else ""),
        **({"base weights": _gguf_provenance(source.gguf)} if source is not None and source.gguf is not None else {}),
        "method": METHOD_NAMES[method] + (
            f": r={config['lora_r']}, alpha={config['lora_alpha']}, dropout={config['lora_dropout']}, "
            f"targets {config['lora_targets']}" if method != "full" else ""),
        "data": f"`{dataset}` ({_known(resolved.format, config['format'])}; "
                f"{_count(resolved.train_examples)} train / {_count(resolved.eval_examples)} eval examples)",
        "optimizer steps": f"{record.step:,}" + (f" of {resolved.max_steps:,}" if resolved.max_steps else ""),
        "tokens trained on": _count(record.tokens_seen),
        "batch": (f"micro {config['micro_batch_size']} × accumulation {_known(resolved.gradient_accumulation_steps)}"
                  f" × {_known(resolved.world_size)} processes = {_known(resolved.global_batch_size)} examples"),
        "max sequence length": f"{_count(config['max_seq_len'])} tokens" + (" (packed)" if config["packing"] is True else ""),
        "learning rate": f"{_number(_known(resolved.peak_lr, config['lr']))} peak, {config['lr_schedule']} schedule, "
                         f"{config['warmup_steps']} warmup steps, {config['optimizer']}",
        "precision": _known(resolved.precision, config["precision"]),
        "strategy": _known(resolved.strategy),
        "seed": config["seed"],
    }
    evaluation = _eval_table(record.evals) or ["No evaluation was recorded (the run had --max-eval-examples 0 or no eval split)."]
    card = ModelCard.from_template(data, template_path=str(TEMPLATE), title=title, summary=summary, rows=rows.items(),
                                   evaluation="\n".join(evaluation), usage="\n".join(_usage(gguf, adapter, base)))
    return str(card) + "\n"


def _dataset_name(dataset: str | None) -> tuple[str, str | None]:
    """How the card names the data, and its Hub id if it is one: a Hub dataset as is, a local file by
    its name only (what --push-to-hub uploads must not carry the trainer's directories)."""
    if not dataset or dataset == "?":
        return "?", None
    if dataset.count("/") == 1 and not looks_like_path(dataset) and not Path(dataset).exists():
        return dataset, dataset
    return Path(dataset).name, None


def _model_name(model: str, source: ModelSource | None) -> str:
    """--model as the card shows it: a catalog name or Hub id as given, a local folder or file by its name only."""
    if source is not None and source.kind in ("local", "gguf") and catalog.lookup(model) is None:
        return Path(model).name
    return model


def _gguf_provenance(path: Path) -> str:
    """Which GGUF file the base weights were dequantised from, and the type its weights were stored in."""
    stored = gguf_file_type(path)
    return f"dequantised from {path.name}" + (f" ({stored})" if stored else "")


def _eval_table(evals: list[dict]) -> list[str]:
    """Held-out metrics at the first and the last eval of the run (before and after training)."""
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    lines = [f"On the run's held-out split, at step {first['step']} and step {last['step']}:", "",
             f"| metric | step {first['step']} | step {last['step']} |", "|---|---|---|"]
    for key, label in EVAL_METRICS.items():
        if key in first or key in last:
            lines.append(f"| {label} | {_number(first.get(key))} | {_number(last.get(key))} |")
    return lines


def _usage(gguf: bool, adapter: bool, base: str | None) -> list[str]:
    if gguf:
        return ["```sh", "llama-cli -m model-*.gguf -cnv", "```", "",
                "or in Python: `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`."]
    if adapter:
        return ["```python", "from peft import AutoPeftModelForCausalLM",
                "model = AutoPeftModelForCausalLM.from_pretrained(folder)  # loads the base, then the adapter", "```"]
    return ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "model = AutoModelForCausalLM.from_pretrained(folder)",
            "tokenizer = AutoTokenizer.from_pretrained(folder)", "```"]


def _known(value, otherwise="?"):
    """A record's value, or `otherwise` where the record lacks it (written by another version)."""
    return otherwise if value is None else value


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def _number(value) -> str:
    return "–" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def write_model_card(trained, out: Path, export_format: str, title: str | None = None) -> Path:
    """Write `<out>/README.md` for the export of `trained` (an export.trained.Trained) as `export_format`;
    the title defaults to the folder's name."""
    path = Path(out) / MODEL_CARD
    path.write_text(model_card(read_run_record(trained), export_format, title=title or Path(out).name))
    return path
