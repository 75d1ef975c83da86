"""Speed switches on CPU: which ones a run turns on where, one line for each that cannot apply, and
each switched path numerically equal to the plain one on a tiny Llama."""

import copy

import pytest
import torch
from helpers import speed_up, tiny_model

from finetune.config.flags import parse_config
from finetune.config.options import TrainConfig
from finetune.config.resolve import Device, Launch, resolve_run
from finetune.errors import ConfigError
from finetune.train.speedups import compile_blocks

GPU = Device(cuda=True, bf16=True)  # runs are resolved as on one, never trained there


def test_flags_parse_with_auto_defaults():
    assert (TrainConfig().liger, TrainConfig().compile, TrainConfig().attention) == (None, None, "auto")
    config = parse_config(["--liger", "--no-compile", "--attention", "flex"])
    assert (config.liger, config.compile, config.attention) == (True, False, "flex")


def test_auto_is_off_on_cpu_and_compilation_and_flex_are_off_until_asked_for():
    cpu = resolve_run(TrainConfig(packing=True), Launch(), Device()).switches
    assert (cpu.liger, cpu.attention, cpu.notes) == (False, "sdpa", ())
    cuda = resolve_run(TrainConfig(packing=True, method="lora"), Launch(), GPU).switches
    assert cuda.attention == "sdpa"  # flex is not measured on a GPU yet
    said = []
    speed_up(tiny_model(), TrainConfig(packing=True, method="lora"), say=said.append)
    assert said[-1] == "speed switches: liger off, chunked loss on, compile off, attention sdpa"  # nor compilation
    assert resolve_run(TrainConfig(attention="flex", packing=True), Launch(), GPU).switches.attention == "flex"


def test_flex_attention_on_cpu_is_refused_before_anything_loads(tmp_path):
    """FlexAttention has no backward on CPU: refused when the run resolves, before any weights load."""
    config = TrainConfig(attention="flex", packing=True, output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError) as refused:
        resolve_run(config, Launch(), Device())
    assert str(refused.value) == ("--attention flex needs a GPU (FlexAttention has no backward on CPU); on CPU use "
                                  "--attention sdpa (or auto).")
    assert resolve_run(config, Launch(), Device(cuda=True, bf16=True)).config.attention == "flex"
    assert not (tmp_path / "out").exists()


def test_compile_time_is_reported_apart_from_training_time(tmp_path):
    """The update that compiles (the first of a --compile run) reports its compile seconds, and its
    tokens/s counts only the rest of its time; later updates add no compile time."""
    from finetune.config.run_folder import read_metrics
    from finetune.train.accelerator import build_accelerator
    from finetune.train.metrics import MetricsRecorder
    from finetune.train.run import resolve

    run, _ = resolve(TrainConfig(output_dir=str(tmp_path)))
    recorder = MetricsRecorder(build_accelerator(run), tmp_path, max_steps=2, log_every=1)
    doubled_sine = torch.compile(lambda x: x.sin() * 2, backend="aot_eager")
    doubled_sine(torch.randn(4))  # compiles: Dynamo's capture and AOTAutograd
    recorder.record_step(step=1, loss=1.0, lr=1e-3, grad_norm=None, tokens=100, seconds=9.0, cpu_seconds=9.0)
    doubled_sine(torch.randn(4))  # cached graph
    recorder.record_step(step=2, loss=1.0, lr=1e-3, grad_norm=None, tokens=100, seconds=1.0, cpu_seconds=1.0)
    first, second = read_metrics(tmp_path / "metrics.jsonl")
    assert 0 < first["compile_seconds"] < 9.0 and second["compile_seconds"] == first["compile_seconds"]
    assert first["tokens_per_second"] == pytest.approx(100 / (9.0 - first["compile_seconds"]))
    assert second["tokens_per_second"] == pytest.approx(100.0) and recorder.compile_seconds == first["compile_seconds"]


def test_a_switch_that_cannot_apply_says_so_in_one_line_and_the_run_goes_on():
    said = []
    model = speed_up(tiny_model(), TrainConfig(liger=True), say=said.append)
    assert said[0] == "running without Liger (Liger's Triton kernels need a CUDA GPU)"
    assert said[-1] == "speed switches: liger off, chunked loss on, compile off, attention sdpa"  # standing in for Liger's loss
    assert model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.isfinite()
    chosen = resolve_run(TrainConfig(attention="flash"), Launch(), GPU).switches
    assert chosen.attention == "sdpa" and chosen.notes == ("--attention flash: flash-attn is not installed; using sdpa",)


def loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def test_compiled_blocks_match_eager_loss_and_gradients_and_keep_parameter_names():
    eager = tiny_model()
    compiled = copy.deepcopy(eager)
    # aot_eager: Dynamo's capture and AOTAutograd's joint graph, the parts regional compilation adds
    # around the kernels, in seconds on CPU (Inductor's C++ codegen takes minutes here)
    assert compile_blocks(compiled, backend="aot_eager") == 2
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    (loss, grads), (loss_c, grads_c) = loss_and_grads(eager, ids), loss_and_grads(compiled, ids)
    assert loss_c == pytest.approx(loss.item(), rel=1e-6)
    assert all(torch.allclose(g, h, atol=1e-6) for g, h in zip(grads, grads_c))
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_compiled_lora_blocks_with_partial_checkpointing_match_eager_in_two_graphs_and_evaluate_eager():
    """The fused LoRA path: decoder blocks compiled with their PEFT adapters inside, the first 2 of 4
    checkpointed (transformers checkpoints inside the compiled forward). Loss and adapter gradients
    equal eager's (1e-6); Dynamo builds one graph for the recomputed layers and one for the kept ones,
    with no graph break, however many layers; a second update, an evaluation forward and a generation
    (no_grad, with a KV cache) compile nothing more."""
    from torch._dynamo.utils import counters

    from finetune.train.skeleton import prepare_for_training

    config = TrainConfig(method="lora", gradient_checkpointing=True, gradient_checkpointing_layers=2)
    eager = prepare_for_training(tiny_model(layers=4), config)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    assert compile_blocks(compiled, backend="aot_eager") == 4
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    (loss, grads), (loss_c, grads_c) = loss_and_grads(eager, ids), loss_and_grads(compiled, ids)
    assert loss_c == pytest.approx(loss.item(), rel=1e-6)
    assert all(torch.allclose(g, h, atol=1e-6) for g, h, p in zip(grads, grads_c, eager.parameters()) if p.requires_grad)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    loss_and_grads(compiled, ids)
    compiled.eval()
    with torch.no_grad():
        compiled(input_ids=ids)
        compiled.generate(input_ids=ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.slow
def test_inductor_compiled_blocks_match_eager():
    eager = tiny_model()
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    (loss, grads), (loss_c, grads_c) = loss_and_grads(eager, ids), loss_and_grads(compiled, ids)
    assert loss_c == pytest.approx(loss.item(), rel=1e-5)
    assert all(torch.allclose(g, h, atol=1e-5) for g, h in zip(grads, grads_c))


@pytest.mark.slow  # transformers compiles flex_attention: about a minute on these CPUs
def test_flex_attention_on_packed_rows_matches_each_row_alone():
    plain = tiny_model()
    flex = copy.deepcopy(plain)
    flex.set_attn_implementation("flex_attention")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 64, (1, 7), generator=g), torch.randint(0, 64, (1, 9), generator=g)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    with torch.no_grad():
        packed = flex(input_ids=torch.cat([a, b], 1), position_ids=positions, use_cache=False).logits
        alone = torch.cat([plain(input_ids=a).logits, plain(input_ids=b).logits], 1)
    assert torch.allclose(packed, alone, atol=1e-5)
