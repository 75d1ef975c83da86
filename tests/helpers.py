"""Plain helpers the tests share (fixtures are in conftest.py): tiny models shrunk from catalog entries,
test tokenizers, JSONL rows, tiny runs built by `train.setup` and stepped through the real loop, and
launched runs checked like rehearsals. Every test folder imports it as `helpers` (pyproject's
`pythonpath = ["tests"]`)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def reset_accelerate() -> None:
    """Forget Accelerate's process-wide singletons, so the next Accelerator is built from scratch
    (as in a new process)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def tiny_model(name: str = "tiny", seed: int = 0, vocab_size: int = 64, layers: int = 2, hidden: int = 32,
               overrides: dict | None = None):
    """The catalog entry `name` shrunk by `families.shrink` (2 layers of width 32 unless asked otherwise;
    same class, same module names; `overrides`: config fields set on top, a sliding window), seeded:
    rehearse shrinks real models the same way. The one meaning of "tiny model" in the tests;
    `tiny_model_dir` saves one (`--model tiny` itself is the catalog's entry at its own width, 128)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models.catalog import get
    from finetune.models.families import attention_implementation, shrink

    config = shrink(get(name).to_hf_config_dict(), layers, hidden, overrides={"vocab_size": vocab_size, **(overrides or {})})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config),
                                            attn_implementation=attention_implementation(config["model_type"]))


def speed_up(model, config, cuda: bool = False, say=print, fp8_device: bool = False):
    """`train.speedups.apply_speedups` on `model` as a run of `config` would apply them: the run resolved
    on this CPU, or as on a bf16 GPU with `cuda` (nothing runs there: the switches only resolve as on
    one; `fp8_device`: one with float8 matmuls), then told what the built model is (`with_model`)."""
    from finetune.config.resolve import Device, Launch, resolve_run
    from finetune.train.speedups import apply_speedups, with_model

    run = resolve_run(config, Launch(), Device(cuda=cuda, bf16=cuda, fp8=fp8_device))
    return apply_speedups(model, with_model(run, model), say)


def shrunk_config_dir(directory: Path, name: str, layers: int) -> str:
    """A folder holding the catalog shape `name` cut to `layers` decoder layers as a config.json (at full
    width, which `--model` accepts): planner and fake-tensor checks of real shapes in seconds."""
    from dataclasses import replace

    from finetune.models import catalog

    spec = replace(catalog.get(name), num_layers=layers)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(spec.to_hf_config_dict()))
    return str(directory)


def word_tokenizer():
    """A 64-word word-level tokenizer (w1 … w61, then pad and EOS), so checkpoints carry tokenizer
    files like real runs and text rows of words encode to one id a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, 62)} | {"<pad>": 62, "</s>": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def word_rows(lengths: list[int], seed: int = 0) -> list[dict]:
    """One text row of seeded random words (w1 … w61) per length: `word_tokenizer` encodes each word as
    one token and adds EOS, so a row of n words trains on n target tokens."""
    import random

    draw = random.Random(seed)
    return [{"text": " ".join(f"w{draw.randint(1, 61)}" for _ in range(n))} for n in lengths]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BPE_TEXT = ["The capital of France is Paris.", "What is the capital of France?", "Sort digits: 1291 gives 1129.",
            "Multiply 8*5 and answer 40.", "A tiny byte-level tokenizer, trained on a few sentences for tests."]


def bpe_tokenizer():
    """A byte-level BPE tokenizer (the kind Llama 3, SmolLM and Qwen ship) trained on a few sentences,
    with ChatML special tokens and chat template: 300 tokens, the last three special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=297, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(BPE_TEXT, trainer)
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


def bpe_llama_dir(folder: Path, vocab_size: int = 320) -> Path:
    """A tiny random-init Llama (hidden 32, so every matrix fits Q8_0's 32-value blocks) with the BPE
    tokenizer, saved as a Hugging Face folder; its embedding has 20 rows more than the tokenizer's
    300 tokens, as padded vocabularies do. q and k are scaled up (×8) so attention is far from uniform: with
    init-sized weights a wrong rotary layout would hardly show in the logits."""
    import torch

    model = tiny_model(seed=0, vocab_size=vocab_size)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.save_pretrained(folder)
    bpe_tokenizer().save_pretrained(folder)
    return folder


# 61 train rows (3 held out for eval): 3 full micro-batches of 16, then one of 13, an epoch;
# a row of 7 words and EOS has 7 target tokens (every token after the first)
WORD_RUN_ROWS, WORD_RUN_WORDS = 64, 7


def tiny_model_dir(folder: Path, name: str = "tiny", **config) -> Path:
    """`folder` holding `tiny_model(name)` (seed 0; the tiny Llama unless asked; `config` set on its
    config) and the word tokenizer, as a pretrained model would be; kept if it is there already."""
    if not folder.is_dir():
        model = tiny_model(name, seed=0)
        for key, value in config.items():
            setattr(model.config, key, value)
        model.save_pretrained(folder)
        word_tokenizer().save_pretrained(folder)
    return folder


def build_word_run(output_dir: Path, method: str = "full", shape: str = "tiny", **flags):
    """`train.setup` of a tiny run: the model (`shape` shrunk) in `<output_dir>/base_model`, WORD_RUN_ROWS
    rows of WORD_RUN_WORDS words, eval off, lr 1e-3 and LoRA rank 4 unless `flags` say otherwise; resumed
    when `flags` ask for it. A Session, to close (`with`, or conftest's make_run). The checkpoint and
    export tests step it with `train_steps`."""
    from finetune.config.options import TrainConfig
    from finetune.train.run import resolve, setup

    rows = write_jsonl(output_dir.with_name(output_dir.name + "-rows.jsonl"), word_rows([WORD_RUN_WORDS] * WORD_RUN_ROWS))
    defaults = {"model": str(tiny_model_dir(output_dir / "base_model", shape)), "dataset": str(rows), "max_eval_examples": 0,
                "lr": 1e-3, "lora_r": 4, "lora_alpha": 8}
    return setup(*resolve(TrainConfig(output_dir=str(output_dir), method=method, **defaults | flags)))


class LossLog:
    """Stands in for MetricsRecorder in the loop: keeps each update's loss."""

    def __init__(self):
        self.losses: list[float] = []

    def record_step(self, *, loss: float, **_) -> None:
        self.losses.append(loss)


def train_steps(session, n: int, save: bool = True) -> list[float]:
    """n more updates of `session` through `loop.train`; returns their losses. With `save`, the loop
    has the checkpointer (saves every --save-every, RNG restored after a resume); without, no save."""
    from finetune.train import loop

    log = LossLog()
    loop.train(session.accelerator, session.model, session.optimizer, session.scheduler, session.train_loader,
               progress=session.progress, max_steps=session.progress.step + n, max_grad_norm=session.config.max_grad_norm,
               metrics=log, checkpointer=session.checkpointer if save else None, objective=session.objective)
    return log.losses


def preempt_after(optimizer, updates: int) -> None:
    """Send this process SIGUSR1 right after optimizer update `updates`, as Slurm would mid-run."""
    import os
    import signal

    done = []

    def count(*_) -> None:
        done.append(1)
        if len(done) == updates:
            os.kill(os.getpid(), signal.SIGUSR1)

    optimizer.optimizer.register_step_post_hook(count)  # the prepared optimizer's torch optimizer


def weights(session) -> dict:
    return {k: v.detach().clone() for k, v in session.model.state_dict().items()}


# liger-kernel's monkey_patch module, for the `liger_kernel` fixture: one that covers llama and mistral
# (its apply function marks the model), and what one built against another transformers raises on import
LIGER_WORKING = ("def apply_liger_kernel_to_llama(model=None, **kwargs):\n    model.patched_by_liger = True\n"
                 "MODEL_TYPE_TO_APPLY_LIGER_FN = {'llama': apply_liger_kernel_to_llama, 'mistral': apply_liger_kernel_to_llama}\n")
LIGER_BROKEN = "raise ImportError(\"cannot import name 'LlamaFlashAttention2' from 'transformers.models.llama.modeling_llama'\")\n"


def run_printed_launch(plan, folder: Path, env: dict, *flags: str):
    """The launch command `finetune plan` prints for `plan`, with the files it writes (`folder/plan`),
    run as printed under `accelerate launch` but for the model, swapped for `tiny`, and the run,
    shortened to 2 steps of 64 tokens (`flags` added); its output dir is `folder/out`."""
    import os
    import shlex
    import subprocess
    import sys

    from finetune.plan.files import launch_command, write_configs
    from finetune.train.accelerator import free_port

    write_configs(plan, folder / "plan")
    words = shlex.split(launch_command(plan, str(folder / "plan")))
    words[words.index("--model") + 1] = "tiny"
    command = [sys.executable, "-m", "accelerate.commands.launch", *words[2:5], "--main_process_port", str(free_port()),
               *words[5:], "--max-steps", "2", "--max-seq-len", "64", *flags, "--output-dir", str(folder / "out")]
    return subprocess.run(command, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""} | env, capture_output=True, text=True,
                          timeout=900)


def rehearsal_runner(tmp_path_factory, table: dict, *flags: str):
    """name → Rehearsal of `table[name]` = (accelerate config, training flags), run once on first use
    with `--model tiny` and `flags` before its own, shared by the tests of a module."""
    from finetune.config.flags import parse_command
    from finetune.launch import rehearse

    results = {}

    def run(name: str):
        if name not in results:
            accelerate_config, own = table[name]
            command = parse_command(["--model", "tiny", *flags, *own])
            results[name] = rehearse.rehearse(command.config, str(REPO / "accelerate_configs" / accelerate_config),
                                              tmp_path_factory.mktemp(name), steps=3, given=command.given)
        return results[name]

    return run


def retrain(command: list[str], out: Path, steps: int):
    """Run a training command of `steps` updates (a rehearsal's, or one like it) with `--output-dir out`,
    and check what it left there as `finetune rehearse` does; returns the inspection."""
    import subprocess

    from finetune.launch import rehearsal_outcome, rehearse

    done = subprocess.run(command + ["--output-dir", str(out)], env=rehearse.rehearsal_env(),
                          capture_output=True, text=True, timeout=900)
    result = rehearsal_outcome.inspect_run(out, steps, done.stdout + done.stderr)
    assert done.returncode == 0 and result.passed, rehearsal_outcome.format_report(result, steps) + done.stderr[-4000:]
    return result


def make_venv_seeing_these_packages(venv: Path, pip: bool = False) -> None:
    """A venv that sees the packages this interpreter sees, also when this interpreter is itself a venv's
    (--system-site-packages alone would show only the base interpreter's): a .pth file adds them
    after the new venv's own site-packages, so what gets installed there wins. `pip`: its own pip, so
    `pip install` on PATH installs into it."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", *([] if pip else ["--without-pip"]), str(venv)],
                   check=True)
    own = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    seen = [path for path in sys.path if path.endswith("-packages")]  # addsitedir: their own .pth files count too
    (Path(own) / "_outer_site_packages.pth").write_text("".join(f"import site; site.addsitedir({path!r})\n" for path in seen))
