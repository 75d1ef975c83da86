"""One training run, in two halves: `setup` builds it (config → accelerator → tokenizer, data,
model → optimizer, schedule → prepare → resume), `fit` trains it (eval → loop → save → eval → summary).
The Session setup returns closes what it opened on every path (session.py): `with setup(...) as s:`.

`python -m finetune [flags]` and `accelerate launch [--config_file X.yaml] -m finetune [flags]` land
in `main`, through the CLI (cli/__init__.py), which parses the flags first. The strategy comes from
the launch (see train/accelerator.py); this file is the same for all. Tests and benches build their
runs with `setup` too, so what they check is what a user's run does.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from finetune.checkpoint.checkpointer import Checkpointer
from finetune.checkpoint.progress import Progress
from finetune.config.flags import Command
from finetune.config.objectives import OBJECTIVES
from finetune.config.options import EVERY_OPTION, BatchShape, TrainConfig, planned_epochs
from finetune.config.resolve import Device, Launch, ResolvedRun, resolve_run
from finetune.config.run_folder import ResolvedRecord, RunFolder
from finetune.data import Collator, PreparedData, fit_run_to_data, prepare_data
from finetune.data.collate import PreferenceCollator
from finetune.data.sampler import UpdateSortedSampler, row_lengths
from finetune.train import inventory, loading, log_probs, loop, ranks, skeleton
from finetune.train.metrics import plot_loss_curve
from finetune.train.objectives import build_objective
from finetune.train.optim import build_optimizer, build_scheduler, continue_schedule
from finetune.train.reference import build_reference
from finetune.train.session import Opened, Session
from finetune.train.speedups import apply_speedups, flattens_packed_rows, with_model
from finetune.train.startup import start_accelerator


def main(command: Command) -> int:
    """Plan (--dry-run) or train the run `command` describes; cli.train has parsed it."""
    if command.dry_run:
        return print_dry_run(command)
    train(*resolve(command.config, command.given))
    return 0


def print_dry_run(command: Command) -> int:
    """`--dry-run`: the plan of the run `command` describes, printed on rank 0. Its modules (the
    planner's report, files and search) are imported here, since a run that trains never uses them."""
    from finetune.plan import gpus
    from finetune.train import dry_run

    if command.config.gpu:  # plan for the named GPU, not this machine
        device = dry_run.device_of(gpus.get(command.config.gpu))
        run = resolve_run(command.config, Launch.from_environment(), device, command.given)
    else:
        run, device = resolve(command.config, command.given)
    if run.launch.rank == 0:
        print(dry_run.dry_run_report(run, device, command.json, command.given))
    return 0


def resolve(config: TrainConfig, given: frozenset[str] = EVERY_OPTION) -> tuple[ResolvedRun, Device]:
    """The run this process resolves `config` (with the options the user `given`) to under its
    launcher, and the device it trains on."""
    device = this_device()
    return resolve_run(config, Launch.from_environment(), device, given), device


def this_device() -> Device:
    """The GPU this process will train on (the launcher's LOCAL_RANK), or the CPU."""
    if not torch.cuda.is_available():
        return Device()
    index = int(os.environ.get("LOCAL_RANK", "0"))
    free, total = torch.cuda.mem_get_info(index)
    fp8 = torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 9)  # train/fp8.py's kernels
    return Device(cuda=True, name=torch.cuda.get_device_name(index), bf16=torch.cuda.is_bf16_supported(), fp8=fp8,
                  free_bytes=free, total_bytes=total)


def train(run: ResolvedRun, device: Device) -> dict:
    """Train as `run` says; returns the summary also written to `<output_dir>/summary.json`."""
    with setup(run, device) as session:  # its exit frees the model before the process group goes (Opened.close)
        return fit(session)


def setup(run: ResolvedRun, device: Device) -> Session:
    """Build everything a run trains with, in the order that matters, and resume it if asked:
    fit check → weights on disk → Accelerator → tokenizer, data → model → loader, optimizer, schedule
    → prepare → checkpointer (resume) → run.yaml and what the run will do, printed.

    Use the Session it returns as a context manager: it closes what setup opened (the process group,
    the trackers, the preemption signal handlers) however the block ends. When setup itself fails,
    what it had opened is closed before the error goes on."""
    if device.cuda and run.config.fit_check:  # the planner's memory model, loaded by the runs that check
        from finetune.train import fit_check

        fit_check.check_fit(run, device)  # before any weights load, and before the process group forms
    # before the Accelerator exists: under ZeRO-3 its zero.Init would make building the model a
    # collective, which a rank waiting at a barrier never joins. Random init: every rank writes the
    # same seeded weights and the first atomic rename wins; GGUF: the first rank converts, the
    # others wait on its file lock.
    loading.materialize(run.model, run.config.seed)
    opened = Opened(start_accelerator(run))
    try:
        return build(run, opened)
    except BaseException as error:
        opened.close(error)
        raise


def build(run: ResolvedRun, opened: Opened) -> Session:
    """setup's steps from the Accelerator on (see `setup`); what it opens goes on `opened`."""
    config, accelerator = run.config, opened.accelerator
    if accelerator.is_main_process:
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    # tokenizer and data (the main process of each node writes caches first, the others reuse them)
    with ranks.main_process_first(accelerator):  # an error on any rank stops every rank
        tokenizer = loading.load_tokenizer(run.model.weights, config.trust_remote_code)
        data = prepare_data(config, tokenizer)
    fit_run_to_data(data, tokenizer, {option.replace("_", "-"): getattr(config, option) for option in
                                      ("micro_batch_size", "global_batch_size") if option in run.given})
    set_seed(config.seed)  # identical initial weights on every rank (FSDP keeps each rank's own)
    with ranks.together(accelerator):
        model = loading.load_model(run, accelerator.device)
    if config.packing:
        skeleton.check_packing_support(model)
    run = with_model(run, model)
    model = apply_speedups(model, run, accelerator.print)
    collators = build_collators(run, model, tokenizer)

    train_loader = train_dataloader(data.train, run.batch, config, collators[0])
    run = run.with_max_steps(max_steps_of(config, run.batch, len(data.train)))
    optimizer = build_optimizer(config, model, run.peak_lr, fused=run.switches.fused_adamw)
    scheduler = build_scheduler(config, optimizer, run.max_steps)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress, scheduler)
    # before a resume loads the checkpoint: a precomputed reference reads the weights as they loaded
    objective = build_objective(config, build_reference(run, accelerator, model, data, collators))

    resolved = resolved_record(run, accelerator.unwrap_model(model), data)
    checkpointer = opened.checkpointer = Checkpointer(accelerator, run, model, resolved=resolved, tokenizer=tokenizer)
    resume(checkpointer, scheduler, progress, run.max_steps)
    announce(run, accelerator, data, resolved, accelerator.unwrap_model(model))
    evaluate = build_evaluation(config, accelerator, model, tokenizer, data, collators[1], run.batch.micro_batch_size,
                                objective)
    return Session(run, accelerator, model, tokenizer, data, collators[0], train_loader, optimizer, scheduler, progress,
                   checkpointer, evaluate, resolved, opened, objective)


def build_collators(run: ResolvedRun, model: torch.nn.Module, tokenizer) -> tuple:
    """The train and eval collators: one Collator for supervised rows; for preference rows one
    PreferenceCollator per split (each receives its split's precomputed reference, if any), and the
    model's forward learns to return sequence log-probabilities (train/log_probs.py)."""
    if not OBJECTIVES[run.config.objective].preference:
        collator = Collator(tokenizer, context_parallel=run.parallelism.cp, flatten=flattens_packed_rows(model))
        return collator, collator
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    log_probs.install(base, log_probs.form_of(run))
    return PreferenceCollator(tokenizer), PreferenceCollator(tokenizer)


def train_dataloader(rows, batch: BatchShape, config: TrainConfig, collator: Collator) -> DataLoader:
    """Uniformly random updates whose micro-batches are grouped by length (data/sampler.py), or
    uniformly random micro-batches with --no-group-by-length or --packing (packed rows are all one length)."""
    if config.group_by_length and not config.packing:
        sampler = UpdateSortedSampler(row_lengths(rows), batch.global_batch_size, config.seed)
        return DataLoader(rows, batch_size=batch.micro_batch_size, sampler=sampler, collate_fn=collator)
    return DataLoader(rows, batch_size=batch.micro_batch_size, shuffle=True, collate_fn=collator)


def fit(session: Session) -> dict:
    """Train the built run to its last step (or a preemption), save, evaluate, report; returns the
    summary also written to `<output_dir>/summary.json`."""
    s, config, folder = session, session.config, RunFolder(session.config.output_dir)
    before = s.evaluate() if s.evaluate else {}
    metrics = s.recorder()
    if before:
        metrics.record_eval(s.progress.step, before)
    loop.train(s.accelerator, s.model, s.optimizer, s.scheduler, s.train_loader, progress=s.progress,
               max_steps=s.max_steps, max_grad_norm=config.max_grad_norm, metrics=metrics,
               checkpointer=s.checkpointer, evaluate=s.evaluate, eval_every=config.eval_every,
               router_aux_loss_coef=router_aux_loss_coef(s.accelerator.unwrap_model(s.model)), objective=s.objective)
    if s.checkpointer.preempted:  # saved in the loop; stop here, exit 0
        metrics.close()
        s.accelerator.print(s.checkpointer.preemption_message())
        return {"steps": s.progress.step, "tokens_seen": s.progress.tokens_seen, "preempted": True}
    if config.save_every and s.checkpointer.last_saved_step != s.progress.step:
        s.checkpointer.save(s.progress)
    after = s.evaluate() if s.evaluate else {}
    if after:
        metrics.record_eval(s.progress.step, after)
    metrics.close()

    if config.save_final:
        save_final(s.accelerator, s.model, s.tokenizer, folder.path)
    summary = {
        "steps": s.progress.step, "tokens_seen": s.progress.tokens_seen,
        "eval_loss_before": before.get("eval_loss"), "eval_loss_after": after.get("eval_loss"),
        "exact_match_before": before.get("exact_match"), "exact_match_after": after.get("exact_match"),
        "samples": samples_before_after(before, after)[: config.num_samples],
        "compile_seconds": metrics.compile_seconds,  # --compile: not in any update's tokens/s
    }
    if OBJECTIVES[config.objective].preference:
        summary["objective"] = config.objective
        summary.update({f"{name}_{when}": result.get(name) for name in PREFERENCE_NUMBERS
                        for when, result in (("before", before), ("after", after))})
    if s.accelerator.is_main_process:
        folder.write_summary(summary)
        plot_loss_curve(folder.metrics, folder.loss_curve)
        s.accelerator.print(format_summary(summary))
    return summary


def router_aux_loss_coef(model: torch.nn.Module) -> float:
    """The weight a mixture of experts' forward gives its load-balancing loss: its config's
    router_aux_loss_coef when output_router_logits is set, else 0 (no such loss is added)."""
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    return float(config.router_aux_loss_coef) if getattr(config, "output_router_logits", False) else 0.0


def max_steps_of(config: TrainConfig, batch: BatchShape, train_examples: int) -> int:
    """--max-steps, or the updates of --epochs (whole accumulation windows; see loop.accumulation_windows)."""
    windows_per_epoch = math.ceil(train_examples / (batch.micro_batch_size * batch.data_parallel_size)) // batch.gradient_accumulation_steps
    return config.max_steps or max(1, int(planned_epochs(config) * windows_per_epoch))


def resolved_record(run: ResolvedRun, model: torch.nn.Module, data: PreparedData) -> ResolvedRecord:
    """What the flags resolved to on this launch: written to run.yaml and every checkpoint's manifest."""
    batch = run.batch
    trainable, total = inventory.parameter_counts(model)
    return ResolvedRecord(world_size=batch.world_size, gradient_accumulation_steps=batch.gradient_accumulation_steps,
                          global_batch_size=batch.global_batch_size, max_steps=run.max_steps, peak_lr=run.peak_lr,
                          precision=run.precision.name, strategy=run.strategy.name, format=data.format,
                          train_examples=len(data.train), eval_examples=len(data.eval),
                          trainable_parameters=trainable, total_parameters=total)


def resume(checkpointer: Checkpointer, scheduler, progress: Progress, max_steps: int) -> None:
    """Load the checkpoint --resume names, if any, before anything reads `progress`, and stretch the
    restored LR schedule to this run's --max-steps."""
    resumed = checkpointer.resume()
    if resumed is not None:
        say = checkpointer.accelerator.print
        say(f"resumed from {checkpointer.resumed_from} at step {progress.step}")
        schedule_change = continue_schedule(scheduler, max_steps, progress.step)
        if schedule_change:
            say(schedule_change)


def announce(run: ResolvedRun, accelerator: Accelerator, data: PreparedData, resolved: ResolvedRecord,
             model: torch.nn.Module) -> None:
    """run.yaml, the run's shape printed as nanoGPT prints its derived numbers (what trains, by kind),
    and the trackers."""
    config = run.config
    if accelerator.is_main_process:
        RunFolder(config.output_dir).write_run_yaml(config, resolved)
    say = accelerator.print
    say(f"model {config.model} ({config.method}): {resolved.trainable_parameters:,} trainable of "
        f"{resolved.total_parameters:,} parameters")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    say(inventory.table(inventory.by_kind(model, base.config.model_type)))
    for warning in inventory.lora_warnings(config, base.config.model_type):
        say(warning)
    say(f"data: {len(data.train):,} train / {len(data.eval):,} eval examples ({data.format}, {data.origin}); "
        f"{run.max_steps} optimizer steps at peak lr {run.peak_lr:.2e}")  # the batch shape: start_accelerator's printout
    if config.report_to != "none":
        accelerator.init_trackers("finetune", config={k: v for k, v in config.to_dict().items() if v is not None})


NO_EVAL_REASON = {True: "--max-eval-examples 0", False: "the eval split is empty"}


def build_evaluation(config: TrainConfig, accelerator, model, tokenizer, data, collator, micro_batch_size: int,
                     objective=None):
    """`evaluate()` for this run, or None when eval is off (--max-eval-examples 0, or no eval rows).

    Eval loss always, and for a preference objective its preference accuracy and reward margin
    (loop.preference_evaluation); greedy exact match only on the first `generated_prompts` prompts,
    because under FSDP/ZeRO-3 every generated token gathers the whole model on every rank.
    """
    if len(data.eval) == 0:
        accelerator.print(f"eval: off ({NO_EVAL_REASON[config.max_eval_examples == 0]})")
        return None
    eval_loader = DataLoader(data.eval, batch_size=micro_batch_size, collate_fn=collator)
    if config.tp * config.cp == 1:  # under TP/CP every rank evaluates every row (see loop.evaluation_loss)
        # prepared on its own, after the model: under DeepSpeed `prepare()` builds the engine
        eval_loader = accelerator.prepare_data_loader(eval_loader)
    prompts = data.eval_prompts[:generated_prompts(config, len(data.eval_prompts))]
    preference = objective is not None and objective.objective.preference
    accelerator.print(f"eval: {'loss, preference accuracy and reward margin' if preference else 'loss'} on "
                      f"{len(data.eval):,} examples; " + (f"greedy exact match on {len(prompts):,} prompts" if prompts else
                                                          "no generation (--eval-generate N adds greedy exact match on N prompts)"))

    def evaluate() -> dict:
        if not preference:
            return loop.evaluate(accelerator, model, eval_loader, tokenizer, prompts, keep_train_mode=config.method == "qlora")
        if config.method != "qlora":
            model.eval()
        result = loop.preference_evaluation(accelerator, model, eval_loader, objective)
        return {**result, **loop.evaluate(accelerator, model, None, tokenizer, prompts, keep_train_mode=config.method == "qlora")}

    return evaluate


def generated_prompts(config: TrainConfig, available: int) -> int:
    """--eval-generate, or when unset: every eval prompt of the builtin supervised dataset (tiny model,
    quick answers), none for other data (a real model's generations cost far more than its eval loss)
    nor for preference objectives (whose held-out numbers are the preference accuracy and margin)."""
    builtin = config.dataset == "builtin" and not OBJECTIVES[config.objective].preference
    wanted = config.eval_generate if config.eval_generate is not None else (available if builtin else 0)
    return min(wanted, available)


def save_final(accelerator, model, tokenizer, output_dir: Path) -> None:
    """The trained model as a Hugging Face folder: full weights, or the PEFT adapter for LoRA/QLoRA.

    `get_state_dict` gathers sharded (FSDP/ZeRO-3) parameters on every rank; passing it explicitly is
    what keeps adapters from being saved empty under sharding.
    """
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    # a model transformers laid out itself (--tp) saves collectively: rank 0 writes, every rank waits
    collective = getattr(unwrapped.config, "distributed_config", None) is not None
    if accelerator.is_main_process or collective:
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True,
                                  is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def samples_before_after(before: dict, after: dict) -> list[dict]:
    """Each eval prompt's greedy answer after training (`generated`) beside the one before (`before`):
    both evaluations ask the same prompts in the same order."""
    return [{**a, "before": b["generated"]} for a, b in zip(after.get("samples", []), before.get("samples", []))]


# what a preference objective's evaluation adds to the summary, before and after training (loop.preference_evaluation)
PREFERENCE_NUMBERS = ("preference_accuracy", "reward_margin")


def format_summary(summary: dict) -> str:
    compiled = f"; {summary['compile_seconds']:.1f} s compiling, apart from tokens/s" if summary["compile_seconds"] else ""
    if summary["eval_loss_before"] is None:
        return f"\n{summary['steps']} optimizer steps; no evaluation{compiled}"
    lines = ["", *([f"{summary['steps']} optimizer steps{compiled}"] if compiled else []), f"{'':24}{'before':>10}{'after':>10}",
             f"{'eval loss':24}{summary['eval_loss_before']:>10.4f}{summary['eval_loss_after']:>10.4f}"]
    if summary.get("preference_accuracy_before") is not None:
        lines += [f"{'preference accuracy':24}{summary['preference_accuracy_before']:>10.1%}"
                  f"{summary['preference_accuracy_after']:>10.1%}",
                  f"{'reward margin':24}{summary['reward_margin_before']:>10.4f}{summary['reward_margin_after']:>10.4f}"]
    if summary["exact_match_before"] is not None:
        lines.append(f"{'exact match (greedy)':24}{summary['exact_match_before']:>10.1%}{summary['exact_match_after']:>10.1%}")
    for sample in summary["samples"]:
        lines += ["", sample["prompt"].rstrip(), f"  before:   {sample['before']!r}",
                  f"  after:    {sample['generated']!r}", f"  expected: {sample['expected']!r}"]
    return "\n".join(lines)
