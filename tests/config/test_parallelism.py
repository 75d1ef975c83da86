"""Tensor and context parallelism, resolved: --tp/--cp and an accelerate config's parallelism_config
give one layout (dp_replicate × dp_shard × tp × cp = processes), the batch counts data-parallel ranks
only, and every combination that cannot run stops in one message, before any weights load.

The runs themselves (2 processes with --tp 2 equal to 1 process, 4 processes FSDP2 × TP, resume and
export under TP) are in test_strategies_distributed.py and test_resume_strategies.py (slow).
"""

from __future__ import annotations

import pytest
import yaml

from finetune.config.options import TrainConfig
from finetune.config.parallelism import Asked, Parallelism
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import ConfigError

GPU = Device(cuda=True, name="NVIDIA H100 80GB HBM3", bf16=True)
CPU = Device()
COLUMNS = "q_proj,k_proj,v_proj,gate_proj,up_proj"


def resolved(world: int = 2, device: Device = CPU, launch: Launch | None = None, **flags):
    config = TrainConfig(**{"output_dir": "/tmp/finetune-test-parallelism"} | flags)
    return resolve_run(config, launch or Launch(world_size=world), device)


def test_tp_splits_the_world_and_the_batch_counts_data_parallel_ranks_only():
    run = resolved(world=4, tp=2, micro_batch_size=2, global_batch_size=8)
    assert run.parallelism == Parallelism(dp_shard=2, tp=2)
    assert run.strategy.name == "fsdp"  # TP composes with FSDP2 only, whatever the launch
    assert (run.batch.world_size, run.batch.data_parallel_size, run.batch.gradient_accumulation_steps) == (4, 2, 2)
    only_tp = resolved(world=2, tp=2, micro_batch_size=2, global_batch_size=8)
    assert only_tp.parallelism == Parallelism(tp=2) and only_tp.batch.gradient_accumulation_steps == 4
    assert only_tp.batch.ranks_text == "data-parallel 1"


def test_the_launch_parallelism_config_is_read_as_accelerate_passes_and_writes_it(tmp_path):
    environ = {"WORLD_SIZE": "4", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
               "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2",
               "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
               "PARALLELISM_CONFIG_CP_SIZE": "1"}
    from_environment = resolved(launch=Launch.from_environment(environ))
    assert from_environment.parallelism == Parallelism(dp_shard=2, tp=2) and from_environment.config.tp == 2
    # the section `accelerate config` writes when asked for the parallelism config
    written = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 4,
               "fsdp_config": {"fsdp_version": 2},
               "parallelism_config": {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 2,
                                      "parallelism_config_tp_size": 2, "parallelism_config_cp_size": 1}}
    (tmp_path / "tp.yaml").write_text(yaml.safe_dump(written))
    from_file = resolved(launch=Launch.from_accelerate_config(str(tmp_path / "tp.yaml"), 4))
    assert from_file.parallelism == from_environment.parallelism
    with pytest.raises(ConfigError, match="--tp 4 disagrees with the accelerate config's parallelism_config_tp_size 2"):
        resolved(launch=Launch.from_environment(environ), tp=4)
    written["parallelism_config"]["parallelism_config_tp_size"] = "two"
    (tmp_path / "tp.yaml").write_text(yaml.safe_dump(written))
    with pytest.raises(ConfigError, match="parallelism_config.parallelism_config_tp_size must be a whole number"):
        Launch.from_accelerate_config(str(tmp_path / "tp.yaml"), 4)


# flags, processes, device → the one line that says what cannot run and how to fix it
REFUSED = {
    "world not a multiple": (dict(tp=2), 3, CPU, "3 process(es) cannot be split into groups of tp 2 × cp 1; launch a "
                             "multiple of 2 processes"),
    "one process": (dict(tp=2), 1, CPU, "1 process(es) cannot be split into groups of tp 2"),
    "heads": (dict(tp=4), 4, CPU, "--tp 4: tiny has 2 key/value heads, which do not split into 4 equal groups"),
    "qlora": (dict(tp=2, method="qlora"), 2, CPU, "--tp 2 with QLoRA: bitsandbytes' 4-bit weights cannot be split"),
    "lora over data-parallel ranks": (dict(tp=2, method="lora", lora_targets=COLUMNS), 4, Device(),
                                      "LoRA with --tp 2 on 4 processes: PEFT adds adapters after transformers"),
    "lora on row-parallel linears": (dict(tp=2, method="lora"), 2, Device(),
                                     f"LoRA with --tp 2 on o_proj, down_proj: PEFT 0.21 cannot adapt row-parallel linears "
                                     f"under transformers' TP; use --lora-targets {COLUMNS}"),
    "tp and cp": (dict(tp=2, cp=2, max_seq_len=64), 4, GPU, "--tp and --cp together"),
    "cp on cpu": (dict(cp=2, max_seq_len=64), 2, CPU, "--cp 2: context parallelism needs CUDA GPUs: torch's ring "
                  "attention (context_parallel) shards only the CUDA SDPA kernels"),
    "cp sequence": (dict(cp=4, max_seq_len=100), 4, GPU, "--max-seq-len 100 is not a multiple of 8; use e.g. 104"),
    "cp packing": (dict(cp=2, max_seq_len=64, packing=True), 2, GPU, "--cp 2 with --packing: ring attention applies only "
                   "the causal mask"),
    "cp attention": (dict(cp=2, max_seq_len=64, attention="flex"), 2, GPU, "--cp 2 with --attention flex: ring attention "
                     "replaces SDPA's kernels only; use --attention sdpa"),
    "deepspeed": (dict(tp=2, deepspeed="ds_configs/zero2.json"), 2, CPU, "--tp 2 runs on FSDP2, not DeepSpeed ZeRO"),
    "mixture of experts": (dict(tp=2, model="tiny-moe"), 2, CPU, "--tp 2 with a mixture of experts (tiny-moe): finetune's "
                           "tensor-parallel layout splits dense layers only"),
}
OFFLOAD = Launch(world_size=2, fsdp=True, fsdp_offload_params=True)


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cannot_run_stops_with_its_fix_before_any_weights_load(name):
    from helpers import REPO

    flags, world, device, message = REFUSED[name]
    if "deepspeed" in flags:
        flags = flags | {"deepspeed": str(REPO / flags["deepspeed"])}
    with pytest.raises(ConfigError) as refused:
        resolved(world=world, device=device, **flags)
    assert message in str(refused.value)


def test_tp_with_fsdp_offload_is_refused():
    with pytest.raises(ConfigError, match="--tp 2 with FSDP params offload: transformers lays out the TP model"):
        resolved(launch=OFFLOAD, tp=2)


def test_replicated_sharding_and_a_wrong_shard_size_are_refused():
    with pytest.raises(ConfigError, match="parallelism_config_dp_replicate_size 2: finetune does not run replicated sharding"):
        resolved(launch=Launch(world_size=4, fsdp=True, parallelism=Asked(dp_replicate=2, tp=2)))
    with pytest.raises(ConfigError, match="parallelism_config_dp_shard_size 4: with 4 processes, tp 2 and cp 1 it must be 2"):
        resolved(launch=Launch(world_size=4, fsdp=True, parallelism=Asked(dp_shard=4, tp=2)))


def test_context_parallel_batches_are_causal_slices_with_labels_shifted_already(tokenizer):
    import torch

    from finetune.config.names import IGNORE_INDEX
    from finetune.data.collate import Collator

    rows = [{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    batch = Collator(tokenizer, context_parallel=2)(rows)
    assert "attention_mask" not in batch  # right padding under the causal mask alone is exact
    assert batch["input_ids"].shape == (2, 4)  # padded to 2 chunks per rank
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    assert batch["shift_labels"].tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX], [9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    plain = Collator(tokenizer)(rows)
    assert torch.equal(plain["input_ids"][:, :3], batch["input_ids"][:, :3]) and "shift_labels" not in plain


def test_a_mixture_of_experts_under_tp_is_refused_naming_what_shards_its_experts_instead():
    from finetune.config.parallelism import experts_refusal

    reason = experts_refusal("qwen3-30b-a3b", 4)
    assert reason.startswith("--tp 4 with a mixture of experts (qwen3-30b-a3b): ")
    assert "use FSDP2 without --tp (accelerate_configs/fsdp.yaml" in reason and "DeepSpeed ZeRO-3" in reason
    with pytest.raises(ConfigError) as refused:
        resolved(world=2, tp=2, model="tiny-moe")
    assert experts_refusal("tiny-moe", 2) in str(refused.value)  # the trainer stops with the same sentence


def test_under_tp_the_loss_runs_per_vocabulary_shard_and_liger_stays_off():
    from finetune.config.names import STRATEGIES
    from finetune.config.switches import TP_HEAD, resolve_switches

    assert resolved(world=2, tp=2).switches.loss == "finetune-chunked"  # on by default under TP, full fine-tuning too
    assert resolved(world=2, tp=2, method="lora", lora_targets=COLUMNS).switches.chunked_loss
    assert resolved(world=2).switches.loss == "transformers"  # full fine-tuning elsewhere keeps the model's own
    assert resolved(world=2, tp=2, chunked_loss=False).switches.loss == "transformers"  # asked off: the head gathers
    # Liger would read one vocabulary shard as the whole head
    liger = resolve_switches(liger=True, chunked_loss=None, optimizer="adamw", method="full", lora_targets="all-linear",
                             cuda=True, strategy=STRATEGIES["fsdp"], model_type="llama", assume_liger=True, tp=2)
    assert liger.loss == "finetune-chunked" and liger.notes == (f"running without Liger ({TP_HEAD})",)


# ---------------------------------------------------------------- the planner


def workload(**fields):
    from finetune.models import catalog
    from finetune.plan import gpus
    from finetune.plan.workload import Workload

    base = dict(model=catalog.get("llama-3.1-70b"), gpu=gpus.get("H100"), gpus_per_node=8, method="full", strategy="fsdp",
                offload="none", precision="bf16-mixed", optimizer="adamw", micro_batch_size=1, seq_len=4096,
                gradient_checkpointing=True, loss="transformers")
    return Workload(**base | fields)


def test_tp_divides_every_linear_the_vocabulary_and_the_residual_stream_but_the_gathered_rows():
    from finetune.plan.memory import estimate, layer_activation_bytes
    from finetune.plan.parallel import rank_params
    from finetune.plan.params import count_params

    spec = workload().model
    whole, sliced = count_params(spec), rank_params(workload(tp=8))
    assert sliced.layer_linear_weights * 8 == whole.layer_linear_weights  # q/k/v, o, gate/up/down: 1/8 each
    assert sliced.head * 8 == whole.head and sliced.embedding * 8 == whole.embedding  # both by vocabulary rows
    assert sliced.final_norm == whole.final_norm
    # 8 GPUs as TP 8 (FSDP2 has nothing left to shard over) or as FSDP2 8: the same fp32 weights per GPU,
    # but for the norms, which every TP rank holds whole
    assert workload(tp=8).sharding_ranks == 1 and workload(tp=2).sharding_ranks == 4
    norms = whole.final_norm + spec.num_layers * spec.norms_per_layer * spec.hidden_size
    assert estimate(workload(tp=8)).weights == estimate(workload()).weights + 4 * norms * (1 - 1 / 8)
    # a TP rank saves 1/tp of everything a layer saves (its norms on a sequence shard, its heads and MLP
    # width) but the inputs of q/k/v and gate/up, whole rows gathered: bf16 under FSDP2's mixed precision
    gathered = 2 * spec.hidden_size * 2
    one = layer_activation_bytes(workload())
    for tp in (2, 4, 8):
        assert layer_activation_bytes(workload(tp=tp)) == pytest.approx((one - gathered) / tp + gathered, rel=1e-9)


def test_a_tp_plans_activations_fall_with_the_tp_degree():
    """Llama-3.1-8B full fine-tuning at 32,768 tokens on 4 GPUs, every layer recomputed: at TP 4 at most
    half of FSDP2's activations per GPU, whether FSDP2 keeps the model's own logits (its default) or
    runs the chunked loss too. bench/tensor_parallel.py measures the built model's (--simulate)."""
    from finetune.models import catalog
    from finetune.plan.memory import backward_activations

    def activations(tp: int, loss: str) -> float:
        return backward_activations(workload(model=catalog.get("llama-3.1-8b"), gpus_per_node=4, tp=tp, seq_len=32768,
                                             loss=loss))

    under_tp = [activations(tp, "finetune-chunked") for tp in (1, 2, 4)]
    assert under_tp[0] > under_tp[1] > under_tp[2]
    assert under_tp[2] <= 0.5 * under_tp[0] and under_tp[2] <= 0.5 * activations(1, "transformers")


def test_cp_divides_each_rows_activations_and_adds_the_ring():
    from finetune.plan.memory import estimate
    from finetune.plan.speed import model_parallel_collectives

    long = dict(method="lora", precision="bf16-true", seq_len=65536, gpus_per_node=8)
    split, whole = estimate(workload(cp=4, micro_batch_size=4, **long)), estimate(workload(micro_batch_size=1, **long))
    assert split.activations == pytest.approx(whole.activations)  # 4 rows over 4 ranks hold what one row holds alone
    assert split.weights == pytest.approx(whole.weights)  # FSDP shards over data-parallel × CP: 8 GPUs either way
    (ring,) = model_parallel_collectives(workload(cp=4, **long))
    # per layer: the keys and values all-gathered in the forward, the recomputed forward and the backward,
    # and the gradients' cp sends
    assert "ring" in ring.what and ring.launches == (3 + 4) * 80


def test_tp_sends_its_all_reduces_bytes_as_all_gathers_and_reduce_scatters():
    from finetune.plan.speed import model_parallel_collectives

    w = workload(tp=4, gpus_per_node=8, loss="finetune-chunked")
    (collective,) = model_parallel_collectives(w)
    spec, share = w.model, w.recompute_share
    hidden = w.tokens_per_micro_batch * spec.hidden_size * 2  # a micro-batch's hidden states in bf16
    all_reduces = spec.num_layers * (4 + 2 * share) * 2 * (4 - 1) / 4 * hidden  # what the layers sent as all-reduces
    pairs = 4 * (4 - 1) / 4 * hidden  # the embedding's and the loss's all-gather / reduce-scatter, forward and backward
    assert "all-gather / reduce-scatter" in collective.what
    assert collective.wire_bytes == pytest.approx(all_reduces + pairs)
    assert collective.launches > 2 * spec.num_layers * (4 + 2 * share)  # twice the calls: one for each half


def test_tp_all_reduces_are_exposed_and_slow_over_pcie_or_nodes():
    from finetune.plan import gpus
    from finetune.plan.parallel import reasons
    from finetune.plan.speed import estimate_speed

    nvlink = estimate_speed(workload(tp=8))
    assert nvlink.exposed_comm_s_per_token > estimate_speed(workload()).exposed_comm_s_per_token
    pcie = workload(tp=4, gpu=gpus.get("L40S"), gpus_per_node=8, model=workload().model)
    assert "PCIe inside one node (slow: keep TP and CP groups on NVLink)" in reasons(pcie)[0]
    across = workload(cp=16, gpus_per_node=8, nodes=2, seq_len=131072, method="lora", precision="bf16-true")
    assert "the network between nodes (slow" in reasons(across)[0]


def test_a_70b_lora_at_128k_tokens_on_two_nodes_of_8_h100_is_planned_with_cp(tmp_path):
    import shlex

    from finetune.models import catalog
    from finetune.plan import gpus
    from finetune.plan.choose import Request, plan
    from finetune.plan.report import plan_dict, table

    request = Request(model=catalog.get("llama-3.1-70b"), gpu=gpus.get("H100"), gpus_per_node=8, nodes=2, method="lora",
                      seq_len=131072)
    plans, best = plan(request)
    assert best is not None
    chosen = plans[best]
    assert chosen.fits and chosen.workload.cp > 1 and chosen.workload.tp == 1
    assert not any(p.fits for p in plans if p.workload.model_parallel == 1)  # nothing fits without it
    data = plan_dict(chosen, None, "plan")
    assert (data["tp"], data["cp"], data["data_parallel"]) == (1, chosen.workload.cp, 16 // chosen.workload.cp)
    words = shlex.split(data["launch_command"])
    assert words[words.index("--cp") + 1] == str(chosen.workload.cp) and "--tp" not in words
    assert any("context parallel over" in reason for reason in chosen.reasons)
    header = table(request, plans, best, "plan").splitlines()[3].split()
    assert header[3:5] == ["tp", "cp"]


def test_layouts_are_shown_only_where_they_fit_when_nothing_else_does_or_are_faster():
    from finetune.models import catalog
    from finetune.plan import gpus
    from finetune.plan.choose import Request, plan

    small, _ = plan(Request(model=catalog.get("llama-7b"), gpu=gpus.get("A100-80GB"), gpus_per_node=8, method="full"))
    assert all(p.workload.model_parallel == 1 for p in small)  # FSDP2 fits and is faster: TP stays out
    fixed, best = plan(Request(model=catalog.get("llama-7b"), gpu=gpus.get("A100-80GB"), gpus_per_node=8, method="full",
                               strategy="fsdp", tp=4))
    assert best is not None and [p.workload.tp for p in fixed] == [4]
    refused, _ = plan(Request(model=catalog.get("llama-7b"), gpu=gpus.get("A100-80GB"), gpus_per_node=8, method="qlora", tp=2))
    assert refused == []  # the trainer cannot split 4-bit weights: no such plan
    experts, _ = plan(Request(model=catalog.get("mixtral-8x7b"), gpu=gpus.get("H100"), gpus_per_node=8, method="full", tp=2))
    assert experts == []  # nor lay out a mixture of experts for TP


LAYOUT_PLANS = {  # (request fields, the layout it must plan)
    "full FSDP2 + TP 2": (dict(model="llama-7b", gpu="A100-80GB", gpus_per_node=2, method="full", strategy="fsdp", tp=2), (2, 1)),
    "lora FSDP2 + CP, 2 nodes": (dict(model="llama-3.1-70b", gpu="H100", gpus_per_node=8, nodes=2, method="lora",
                                      seq_len=131072), None),
}


def layout_plan(name: str):
    from finetune.models import catalog
    from finetune.plan import gpus
    from finetune.plan.choose import Request, plan

    fields, _ = LAYOUT_PLANS[name]
    request = Request(**fields | {"model": catalog.get(fields["model"]), "gpu": gpus.get(fields["gpu"])})
    plans, best = plan(request)
    return plans[best]


@pytest.mark.parametrize("name", list(LAYOUT_PLANS))
def test_a_layout_plans_files_and_command_resolve_to_its_workload(name, tmp_path):
    from finetune.plan.files import write_configs
    from finetune.plan.workload import from_run
    from finetune.train.dry_run import run_of_plan

    chosen = layout_plan(name)
    expected = LAYOUT_PLANS[name][1]
    assert (chosen.workload.tp, chosen.workload.cp) == expected if expected else chosen.workload.cp > 1
    write_configs(chosen, tmp_path)
    run = run_of_plan(chosen, tmp_path, tmp_path / "out")
    assert from_run(run, chosen.workload.gpu) == chosen.workload
    assert run.parallelism.model_parallel == chosen.workload.model_parallel


@pytest.mark.slow
def test_a_tp_plans_printed_launch_command_runs_as_printed(tmp_path):
    """The command `finetune plan` prints for a TP plan, and the files it writes, with only the model
    swapped for `tiny` and the run shortened, train 2 CPU processes under `accelerate launch`."""
    import json

    from helpers import run_printed_launch

    done = run_printed_launch(layout_plan("full FSDP2 + TP 2"), tmp_path, {"ACCELERATE_USE_CPU": "1"},
                              "--max-eval-examples", "0")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "strategy: FSDP2 on cpu (gloo)" in done.stdout and "layout: TP 2 (tp 2, cp 1, dp_shard 1)" in done.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize("layout", [dict(tp=2), dict(cp=2)])
def test_simulate_runs_a_tp_layout_whole_and_one_rank_of_a_cp_layout(layout, tmp_path):
    """--simulate builds a TP layout as the trainer does (sequence-parallel plan, chunked loss per
    vocabulary shard, FSDP2 over the data-parallel ranks) on a fake process group, and runs one CP
    rank's share; the analytic terms agree."""
    import json
    from dataclasses import replace

    from finetune.models import catalog
    from finetune.plan import gpus
    from finetune.plan.memory import GIB, backward_activations, estimate
    from finetune.plan.workload import from_run
    from finetune.train.simulate import simulate

    spec = replace(catalog.get("llama-7b"), num_layers=4)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(spec.to_hf_config_dict()))
    config = TrainConfig(model=str(tmp_path / "model"), max_seq_len=1024, output_dir=str(tmp_path / "out"), **layout)
    run = resolve_run(config, Launch(world_size=4, fsdp=True), GPU)
    w = from_run(run, gpus.get("H100"))
    simulated, planned = simulate(run), estimate(w)
    assert simulated.terms["weights"] == pytest.approx(planned.weights, rel=0.02, abs=0.01 * GIB)
    assert simulated.terms["activations"] == pytest.approx(planned.activations, rel=0.10)
    assert simulated.activations == pytest.approx(backward_activations(w), rel=0.10)


def test_the_chunked_loss_takes_a_context_parallel_batch_as_the_models_own_loss_does(tokenizer):
    """Under CP each rank's slice of a row comes with its labels shifted already (data/collate.py):
    the chunked loss, which keeps LoRA runs free of full-vocabulary logits, reads them as transformers does."""
    import torch
    from helpers import tiny_model

    from finetune.data.collate import Collator
    from finetune.train import chunked_loss

    rows = [{"input_ids": list(range(3, 12)), "labels": [-100] * 3 + list(range(6, 12))},
            {"input_ids": list(range(20, 26)), "labels": list(range(20, 26))}]
    batch = Collator(tokenizer, context_parallel=2)(rows)
    model = tiny_model(vocab_size=64)
    own = model(**batch, num_items_in_batch=torch.tensor(13)).loss
    chunked_loss.install(model)
    chunked = model(**batch, num_items_in_batch=torch.tensor(13)).loss
    torch.testing.assert_close(chunked, own)
    sliced = {k: v[:, :4].contiguous() for k, v in batch.items()}  # one CP rank's slice: the last position's target is the next slice's
    assert sliced["shift_labels"][0, -1] == batch["labels"][0, 4]
    torch.testing.assert_close(model(**sliced, num_items_in_batch=torch.tensor(13)).loss,
                               tiny_model(vocab_size=64)(**sliced, num_items_in_batch=torch.tensor(13)).loss)
