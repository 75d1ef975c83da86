"""The rows bench/gpu_kit/throughput.py measures, one line each, in the order a GPU answers them.

A row is a shape and a program. The shape: a catalog model (whole, or cut to its first N decoder
layers at full width: the real hidden size, heads, experts and vocabulary), the method, what LoRA
adapts, the sequence length and the micro batch (rows of exactly that many tokens, bf16, LoRA r16
alpha 32; or, with `example_len`, rows packed with shorter examples). The program:

- finetune with the flags `finetune plan` prints for the shape on the GPU found (`plan=(...)`: extra
  `finetune plan` flags that pin a choice, such as --no-gradient-checkpointing; `plan=()` leaves every
  choice to the planner), read from the planner when the row runs, never written down here;
- finetune with its own flags (`flags=(...)`), every choice they leave open finetune's default;
- TRL's SFTTrainer or a bare PEFT loop (`program="trl"` / `"peft-loop"`, bench/gpu_kit/baselines.py;
  `flags`: baselines.py's, such as --liger for TRL's use_liger_kernel).

FIRST holds what the next GPU must answer (finetune's best plan beside TRL + Liger, the anchor's
exact shape in bf16 and with the frozen base in float8 matmuls, the mixture-of-experts cuts); REST
the A/B rows (each switch beside its twin without it), the other programs and the compiled rows
(their first update compiles for a minute or more). `--rows`
selects by id (globs too) or by group: `first`, `rest`, `all`.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, replace

from finetune.cli.plan_flags import build_parser, build_request
from finetune.models import catalog
from finetune.models.catalog import ModelSpec
from finetune.plan.choose import Plan, plan
from finetune.plan.files import checkpointing_flags, layout_flags, speed_flags, train_flags
from finetune.plan.gpus import GPUSpec

PROGRAMS = ("finetune", "trl", "peft-loop")


@dataclass(frozen=True)
class Shape:
    """What every program trains in a row: the model (cut to `layers` decoder layers when set), the
    method, LoRA's targets, tokens per row and rows per micro batch."""

    model: str
    layers: int | None = None
    method: str = "lora"
    lora_targets: str = "all-linear"
    seq_len: int = 4096
    micro_batch_size: int = 2
    example_len: int | None = None  # --packing rows of examples of this many characters (+16, a token each)

    @property
    def name(self) -> str:
        """The checkpoint's folder name: the catalog name, or `<name>-<N>-layers` for a cut."""
        return self.model if self.layers is None else f"{self.model}-{self.layers}-layers"

    @property
    def spec(self) -> ModelSpec:
        spec = catalog.get(self.model)
        return spec if self.layers is None else replace(spec, num_layers=self.layers)

    @property
    def label(self) -> str:
        targets = "" if self.lora_targets == "all-linear" else f" {self.lora_targets}"
        packed = "" if self.example_len is None else f" packed {self.example_len}"
        return f"{self.name} {self.method}{targets} s{self.seq_len} b{self.micro_batch_size}{packed}"


@dataclass(frozen=True)
class Published:
    tokens_per_second: float
    source: str


@dataclass(frozen=True)
class Row:
    id: str
    shape: Shape
    program: str = "finetune"
    plan: tuple[str, ...] | None = None  # finetune: `finetune plan` flags; its recommended plan's flags run
    flags: tuple[str, ...] = ()  # finetune's own flags (without `plan`), or baselines.py's
    published: Published | None = None  # a published run of exactly this shape, beside the row

    @property
    def liger(self) -> bool:
        """Liger asked for outright (where it cannot run, the row is skipped rather than run without it)."""
        return "--liger" in (*self.flags, *(self.plan or ()))


MISTRAL = Shape("mistral-7b")
LLAMA = Shape("llama-3.1-8b")
QWEN_MOE = Shape("qwen3-30b-a3b", layers=2, lora_targets="all-linear+experts")
GPT_OSS = Shape("gpt-oss-20b", layers=2, lora_targets="all-linear+experts")
# NVIDIA NeMo AutoModel's fastest published single-GPU LoRA run: Llama-3.1-8B, LoRA r16 alpha 32 on all
# linear layers, seq 4096, micro batch 2 of full-length rows, bf16, no activation recomputation
NEMO = Published(12_473, "NeMo AutoModel, 1× H100, no recompute, FlashAttention 2 + Liger + a Triton LoRA kernel")
PACKED = replace(LLAMA, example_len=512)  # the anchor's shape, about 7 examples a row

FIRST = (
    Row("mistral-best", MISTRAL, plan=()),
    Row("mistral-trl-liger", MISTRAL, "trl", flags=("--liger",)),
    Row("anchor", LLAMA, plan=("--no-gradient-checkpointing",), published=NEMO),
    Row("anchor-fp8", LLAMA, plan=("--no-gradient-checkpointing", "--fp8"), published=NEMO),
    Row("llama-best", LLAMA, plan=()),
    Row("qwen3-moe-lora", QWEN_MOE, plan=()),
    Row("qwen3-moe-qlora", replace(QWEN_MOE, method="qlora"), plan=()),
    Row("gpt-oss-lora", GPT_OSS, plan=()),
    Row("gpt-oss-qlora", replace(GPT_OSS, method="qlora"), plan=()),
)
REST = (
    Row("mistral-ckpt-all", MISTRAL, flags=("--gradient-checkpointing", "--no-liger")),
    Row("mistral-ckpt-all-liger", MISTRAL, flags=("--gradient-checkpointing", "--liger")),
    Row("mistral-ckpt-all-liger-fp8", MISTRAL, flags=("--gradient-checkpointing", "--liger", "--fp8")),
    Row("mistral-ckpt-planned", MISTRAL, plan=("--gradient-checkpointing", "--no-liger")),
    Row("mistral-ckpt-planned-liger", MISTRAL, plan=("--gradient-checkpointing", "--liger")),
    Row("mistral-trl", MISTRAL, "trl"),
    Row("anchor-trl-liger", LLAMA, "trl", flags=("--liger", "--no-gradient-checkpointing")),
    Row("mistral-peft-loop", MISTRAL, "peft-loop"),
    Row("mistral-ckpt-all-own-loss", MISTRAL, flags=("--gradient-checkpointing", "--no-liger", "--no-chunked-loss")),
    Row("mistral-best-fp8", MISTRAL, plan=("--fp8",)),
    Row("mistral-best-compile", MISTRAL, plan=("--compile",)),
    Row("mistral-best-fp8-compile", MISTRAL, plan=("--fp8", "--compile")),
    Row("anchor-compile", LLAMA, plan=("--no-gradient-checkpointing", "--compile"), published=NEMO),
    Row("anchor-fp8-compile", LLAMA, plan=("--no-gradient-checkpointing", "--fp8", "--compile"), published=NEMO),
    Row("anchor-packed", PACKED, flags=("--no-gradient-checkpointing", "--packing")),
    Row("anchor-packed-varlen", PACKED, flags=("--no-gradient-checkpointing", "--packing", "--attention", "varlen")),
)
ROWS = FIRST + REST
GROUPS = {"first": FIRST, "rest": REST, "all": ROWS}


def select(text: str) -> list[Row]:
    """`--rows`: comma-separated ids, globs over ids (`mistral-*`) or groups (first, rest, all), run in
    the order given (a group or glob in the table's order), each row once. Raises ValueError naming
    what matches nothing."""
    chosen: list[Row] = []
    for word in filter(None, (w.strip() for w in text.split(","))):
        found = GROUPS.get(word) or tuple(r for r in ROWS if fnmatch.fnmatchcase(r.id, word))
        if not found:
            raise ValueError(f"--rows {word!r} matches no row; ids: {', '.join(r.id for r in ROWS)}; groups: first, rest, all")
        chosen += [r for r in found if r not in chosen]
    return chosen


@functools.cache
def best_plan(shape: Shape, plan_flags: tuple[str, ...], gpu: GPUSpec) -> tuple[Plan, bool]:
    """(the plan `finetune plan` recommends for the shape on one `gpu` with `plan_flags`, whether it
    fits); where none fits, the closest plan and False."""
    argv = ["--model", shape.model, "--gpus", f"1x{gpu.name}", "--method", shape.method, "--seq-len", str(shape.seq_len),
            "--micro-batch-size", str(shape.micro_batch_size), "--lora-targets", shape.lora_targets, *plan_flags]
    plans, recommended = plan(build_request(build_parser().parse_args(argv), resolve=lambda _: shape.spec))
    return plans[0 if recommended is None else recommended], recommended is not None


def finetune_flags(row: Row, gpu: GPUSpec) -> list[str]:
    """The flags that define a finetune row's run, without its model, data, steps or output: the
    plan's as `finetune plan` prints them, or the shape's and the row's own."""
    if row.plan is not None:
        flags = train_flags(best_plan(row.shape, row.plan, gpu)[0].workload)
        return flags[2:] if flags[0] == "--model" else flags
    shape = row.shape
    return ["--method", shape.method, "--micro-batch-size", str(shape.micro_batch_size), "--gradient-accumulation-steps", "1",
            "--max-seq-len", str(shape.seq_len), "--precision", "bf16-true", "--lora-r", "16",
            "--lora-targets", shape.lora_targets, *row.flags]


def plan_choices(row: Row, gpu: GPUSpec) -> list[str]:
    """What the planner chose for a plan row beyond its shape: layout, checkpointing and speed flags."""
    w = best_plan(row.shape, row.plan, gpu)[0].workload
    return [*layout_flags(w), *checkpointing_flags(w), *speed_flags(w)]
