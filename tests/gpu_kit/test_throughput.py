"""bench/gpu_kit/throughput.py and its row table (rows.py) on CPU: every row's command and plan, the
order a GPU answers them in, the selection, rows skipped, not run, run once where two are the same
run, and the summary files. (The rows' processes are stood in for where a GPU would run them.)"""

import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import LIGER_BROKEN, LIGER_WORKING, REPO

KIT = REPO / "bench/gpu_kit"
sys.path.insert(0, str(KIT))

import baselines  # noqa: E402
import memory  # noqa: E402
import rows  # noqa: E402
import throughput  # noqa: E402
from forked import RowRunner  # noqa: E402

from finetune.config.flags import parse_config  # noqa: E402
from finetune.plan.files import train_flags  # noqa: E402


def dry_run(tmp_path: Path, *flags: str) -> list[str]:
    result = subprocess.run([sys.executable, str(KIT / "throughput.py"), "--dry-run", "--work", str(tmp_path), *flags],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_dry_run_lists_every_row_with_its_plan_and_command(tmp_path):
    """Every row on the H200 (no GPU here): three lines each, its command parses as finetune's or
    baselines.py's flags on its shape's checkpoint and rows; a plan row runs the flags `finetune plan`
    prints for its shape (planning those flags gives back the recommended plan's tokens/s)."""
    header, *lines = dry_run(tmp_path)
    assert header.startswith(f"{len(rows.ROWS)} rows on H200")
    args = throughput.parse_args(["--dry-run", "--work", str(tmp_path)])
    assert len(lines) == 3 * len(rows.ROWS)
    for row, (title, plan, command) in zip(rows.ROWS, zip(lines[::3], lines[1::3], lines[2::3])):
        assert title.split()[0] == row.id and row.shape.label in title
        assert throughput.refusal(row, args.gpu_spec, args.work) is None  # the H200 runs every row's flags
        argv = shlex.split(command.removeprefix("      $ python "))
        shape, checkpoint = row.shape, str(tmp_path / "random-init" / row.shape.name)
        if row.program == "finetune":
            Path(checkpoint).mkdir(parents=True, exist_ok=True)  # finetune's flags want a model folder there
            (Path(checkpoint) / "config.json").write_text(json.dumps(shape.spec.to_hf_config_dict()))
            config = parse_config(argv[2:])
            assert (config.model, config.dataset) == (checkpoint, str(throughput.data(shape, args)))
            assert config.packing == (shape.example_len is not None)
            assert (config.method, config.max_seq_len, config.micro_batch_size, config.lora_targets, config.lora_r,
                    config.lora_alpha, config.precision) == (shape.method, shape.seq_len, shape.micro_batch_size,
                                                             shape.lora_targets, 16, 32, "bf16-true")
            expected = throughput.planned(row, args)["planned_tokens_per_second"]
            assert f"planned {expected:,.0f} tok/s" in plan
            if row.plan is not None:
                best = rows.best_plan(shape, row.plan, args.gpu_spec)[0]
                assert expected == pytest.approx(best.speed.tokens_per_second, rel=1e-9)
                assert " ".join(train_flags(best.workload)[2:]) in command
        else:
            parsed = baselines.parse_args(argv[1:])
            assert argv[0] == str(KIT / "baselines.py") and "not planned" in plan
            assert (parsed.program, parsed.liger, str(parsed.checkpoint), parsed.seq_len, parsed.micro_batch_size) == (
                row.program, row.liger, checkpoint, shape.seq_len, shape.micro_batch_size)
            assert shape.lora_targets == "all-linear"  # baselines.py adapts every linear layer, as LoraConfig("all-linear")


def test_first_rows_answer_the_speed_goal_the_anchor_and_the_mixtures_of_experts():
    """What a GPU answers first: finetune's best plan for the 7B shape beside TRL + Liger on it, NeMo
    AutoModel's exact shape (Llama-3.1-8B, LoRA r16 alpha 32 on every linear layer, seq 4096, micro
    batch 2, no recompute) with its published 12,473 tokens/s, then 2-layer cuts of Qwen3-30B-A3B and
    gpt-oss-20b with LoRA on the experts, in bf16 and with 4-bit experts (QLoRA)."""
    best, trl, anchor = rows.FIRST[:3]
    assert best.program == "finetune" and best.plan == () and best.shape == rows.MISTRAL
    assert (trl.program, trl.liger, trl.shape) == ("trl", True, rows.MISTRAL)
    assert anchor.shape == rows.Shape("llama-3.1-8b", None, "lora", "all-linear", 4096, 2)
    assert anchor.plan == ("--no-gradient-checkpointing",) and anchor.published.tokens_per_second == 12_473
    args = throughput.parse_args(["--dry-run", "--gpu", "A100-40GB"])  # where the best plan recomputes layers
    assert "--gradient-checkpointing" not in rows.finetune_flags(anchor, args.gpu_spec)
    assert rows.best_plan(anchor.shape, anchor.plan, args.gpu_spec)[1] is False  # run anyway, "no plan fits" beside it
    assert "--gradient-checkpointing" in rows.finetune_flags(rows.select("llama-best")[0], args.gpu_spec)
    cuts = {(r.shape.model, r.shape.method) for r in rows.FIRST[3:] if r.shape.layers == 2}
    assert cuts == {(m, k) for m in ("qwen3-30b-a3b", "gpt-oss-20b") for k in ("lora", "qlora")}
    assert all(r.shape.lora_targets == "all-linear+experts" for r in rows.FIRST if r.shape.layers)
    assert len({r.id for r in rows.ROWS}) == len(rows.ROWS)


def test_packed_rows_run_the_anchors_shape_with_and_without_sdpas_dense_mask(tmp_path, monkeypatch):
    """anchor-packed and anchor-packed-varlen: the anchor's shape (no recompute) in rows packed with
    shorter examples, under SDPA, whose dense mask the plan counts (each layer's bf16 copy and the KV
    heads repeated for it, and the boolean mask: 5.0 GiB more), and under --attention varlen, which
    builds none."""
    from dataclasses import replace

    args = throughput.parse_args(["--dry-run", "--work", str(tmp_path)])
    sdpa, varlen = rows.select("anchor-packed,anchor-packed-varlen")
    assert sdpa.shape == varlen.shape == replace(rows.LLAMA, example_len=512)
    assert [throughput.workload(row, args).dense_mask for row in (sdpa, varlen)] == [True, False]
    planned = [throughput.planned(row, args)["planned_allocated_gib"] for row in (sdpa, varlen)]
    assert planned[0] - planned[1] == pytest.approx(2 * 4096 * (32 * (2 * 4096 + 2 * 2 * 24 * 128) + 4096) / 2**30, abs=0.02)
    written = []
    monkeypatch.setattr(throughput.memory, "random_checkpoint", lambda *a, **k: written.append(a[0]))
    throughput.prepare(sdpa, args, runner=None, later=set())
    texts = [json.loads(line)["text"] for line in throughput.data(sdpa.shape, args).read_text().splitlines()]
    assert {len(text) for text in texts} == {512 + 16} and len(texts) == memory.DATA_ROWS * 8 and written == ["llama-3.1-8b"]


def test_rows_are_picked_by_id_glob_or_group_in_the_order_given(tmp_path):
    assert rows.select("first") == list(rows.FIRST) and rows.select("all") == list(rows.ROWS)
    picked = [r.id for r in rows.select("anchor,mistral-ckpt-all*,first")]
    assert picked[:5] == ["anchor", "mistral-ckpt-all", "mistral-ckpt-all-liger", "mistral-ckpt-all-liger-fp8",
                          "mistral-ckpt-all-own-loss"]
    assert picked[5:] == [r.id for r in rows.FIRST if r.id != "anchor"]
    with pytest.raises(ValueError, match="'nope' matches no row"):
        rows.select("anchor,nope")
    assert [line.split()[0] for line in dry_run(tmp_path, "--rows", "gpt-oss-*")[1::3]] == ["gpt-oss-lora", "gpt-oss-qlora"]


def test_a_cut_plans_as_its_catalog_shape_with_fewer_layers(tmp_path):
    """The planner reads a cut from a config.json written for it: the same model as the catalog entry
    cut to 2 layers (what the rows' random-init checkpoint holds)."""
    from finetune.config.resolve import Launch, resolve_run
    from finetune.train.dry_run import device_of

    args = throughput.parse_args(["--dry-run", "--work", str(tmp_path)])
    row = rows.select("qwen3-moe-qlora")[0]
    config = parse_config(throughput.finetune_args(row, args, throughput.model_to_plan(row.shape, args), tmp_path / "out"))
    spec = resolve_run(config, Launch(), device_of(args.gpu_spec)).spec
    expected = row.shape.spec
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size, spec.model_type) == (2, expected.hidden_size,
                                                                                     expected.vocab_size, "qwen3_moe")
    assert spec.moe == expected.moe


def test_without_cuda_every_row_is_listed_as_skipped(tmp_path):
    """No row is dropped: without CUDA each is listed with why in throughput.csv and .md, no checkpoint
    is written, and the exit code says no finetune row could run."""
    args = throughput.parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--logs", str(tmp_path / "logs")])
    args.cuda, args.header = False, "header"
    assert throughput.run_rows(args) == 1
    written = list(csv.DictReader((args.out / "throughput.csv").open()))
    assert [r["row"] for r in written] == [row.id for row in rows.ROWS]
    assert {r["status"] for r in written} == {"skipped: no CUDA device"}
    table = (args.out / "throughput.md").read_text().splitlines()
    assert table[0] == "header" and len(table) == 4 + len(rows.ROWS) and "| anchor |" in table[4 + 2]
    assert not (args.work / "random-init").exists()


def stand_in(started: list, seconds: float = 42.0, status: str = "timeout"):
    """A RowRunner.run that records what each row's process would run and with which allocator."""
    def run(self, python_args, log, timeout_s):
        program = "finetune" if python_args[:2] == ["-m", "finetune"] else Path(python_args[0]).name
        started.append((program, os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
        log.write_text("")
        return {"status": status, "seconds": seconds}
    return run


@pytest.mark.parametrize("deadline, status, code", [(300, "not run: time (the deadline stopped it after 42 s)", 0),
                                                     (None, "timeout", 1)])
def test_a_row_the_deadline_stops_is_not_run_and_every_row_gets_finetunes_allocator(deadline, status, code, tmp_path,
                                                                                     monkeypatch):
    """Rows whose process the deadline stops are "not run", not failures (exit 0); a row that outlives its
    own --row-timeout is a failure (exit 1). Every row's process, TRL's too, starts with the allocator
    finetune sets for itself; a row whose run is another's (the plan chose what the anchor pins) waits
    for that row's outcome instead of running again. Each row's log is kept."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    started = []
    monkeypatch.setattr(throughput, "skip_reason", lambda row, cuda: None)
    monkeypatch.setattr(RowRunner, "run", stand_in(started))
    monkeypatch.setattr(memory, "random_checkpoint", lambda *args, **kwargs: None)
    args = throughput.parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--gpu", "H200",
                                  "--rows", "mistral-best,mistral-trl-liger,anchor,llama-best",
                                  *(["--deadline", str(time.time() + deadline)] if deadline else [])])
    args.cuda, args.header = True, "header"
    assert throughput.run_rows(args) == code
    written = {r["row"]: r for r in csv.DictReader((args.out / "throughput.csv").open())}
    assert [written[name]["status"] for name in ("mistral-best", "mistral-trl-liger", "anchor")] == [status] * 3
    assert written["llama-best"]["status"] == f"{status} (as anchor)"
    assert [program for program, _ in started] == ["finetune", "baselines.py", "finetune"]
    assert {allocator for _, allocator in started} == {r["allocator"] for r in written.values()} == {"expandable_segments:True"}
    assert sorted(p.name for p in args.out.glob("throughput-*.log")) == [
        "throughput-anchor.log", "throughput-mistral-best.log", "throughput-mistral-trl-liger.log"]


def test_rows_are_skipped_for_missing_or_broken_packages_only(monkeypatch, liger_kernel):
    installed = {"trl"}  # and liger-kernel, as the fixture installs it
    find_spec = throughput.importlib.util.find_spec
    monkeypatch.setattr(throughput.importlib.util, "find_spec",
                        lambda name, *rest: find_spec(name, *rest) if name in installed or name.startswith("liger") else None)
    liger_kernel(LIGER_BROKEN)
    reasons = {row.id: throughput.skip_reason(row, cuda=True) for row in rows.ROWS}
    skipped = {name for name, reason in reasons.items() if reason}
    assert skipped == {row.id for row in rows.ROWS if row.liger} and "mistral-trl-liger" in skipped
    assert all(reasons[name].startswith("liger-kernel 0.8.5 does not import: ImportError") for name in skipped)
    installed.clear()
    liger_kernel(LIGER_WORKING)
    reasons = {row.id: throughput.skip_reason(row, cuda=True) for row in rows.ROWS}
    assert {name for name, reason in reasons.items() if reason} == {row.id for row in rows.ROWS if row.program == "trl"}


def test_summary_lines_and_markdown_set_measured_beside_planned_and_published():
    anchor = {"row": "anchor", "flags": "llama-3.1-8b lora s4096 b2, finetune plan", "status": "ok", "tokens_per_second": 12812.4,
              "planned_tokens_per_second": 11057.0, "planned_low": 9264, "planned_high": 13196, "published_tokens_per_second": 12473,
              "allocated_gib": 71.456, "planned_allocated_gib": 69.7, "reserved_gib": 72.6, "seconds": 31.2, "compile_seconds": 0.0}
    trl = {"row": "mistral-trl", "flags": "mistral-7b lora s4096 b2, trl", "status": "skipped: trl is not installed",
           "planned_tokens_per_second": None}
    assert throughput.table_line(anchor) == (f"{'anchor':<28}    12,812    11,057  71.46 (planned 69.70) GiB allocated, "
                                             "72.60 reserved, 31 s")
    assert throughput.table_line(trl) == f"{'mistral-trl':<28}         –         –  skipped: trl is not installed"
    table = throughput.markdown([anchor, trl], "header").splitlines()
    assert table[4] == ("| anchor | llama-3.1-8b lora s4096 b2, finetune plan | 12,812 | 11,057 (9,264–13,196) | 1.16 | 12,473 | "
                        "71.46 / 69.70 | 72.60 | ok |")
    assert table[5] == "| mistral-trl | mistral-7b lora s4096 b2, trl | – | – | – |  | – | – | skipped: trl is not installed |"


def test_a_cut_checkpoint_keeps_the_catalog_width_with_fewer_layers(tmp_path):
    """memory.random_checkpoint with `layers` (on CPU here: on the GPU where there is one)."""
    folder = memory.random_checkpoint("tiny", tmp_path, timeout_s=300, layers=1)
    config = json.loads((folder / "config.json").read_text())
    assert folder.name == "tiny-1-layers" and config["num_hidden_layers"] == 1
    assert config["hidden_size"] == rows.Shape("tiny").spec.hidden_size and (folder / "model.safetensors").is_file()


def test_short_of_disk_the_checkpoints_no_later_row_needs_make_room(tmp_path, monkeypatch):
    args = throughput.parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path), "--gpu", "H200"])
    for name in ("mistral-7b", "gpt-oss-20b-2-layers", "llama-3.1-8b"):
        (tmp_path / "random-init" / name).mkdir(parents=True)
    calls = []

    def write(model, cache, timeout_s, runner, layers):
        calls.append(sorted(p.name for p in cache.iterdir()))
        if len(calls) == 1:
            raise OSError(f"16 GiB of disk needed for the random-init {model} in {cache}")

    monkeypatch.setattr(memory, "random_checkpoint", write)
    throughput.prepare(rows.select("anchor")[0], args, RowRunner(fork=False), later={"mistral-7b"})
    assert calls == [["gpt-oss-20b-2-layers", "llama-3.1-8b", "mistral-7b"], ["llama-3.1-8b", "mistral-7b"]]
    monkeypatch.setattr(memory, "random_checkpoint", lambda *a: (_ for _ in ()).throw(OSError("16 GiB of disk needed")))
    with pytest.raises(OSError, match="of disk needed"):  # nothing left that no later row needs
        throughput.prepare(rows.select("anchor")[0], args, RowRunner(fork=False), later={"mistral-7b"})


def test_fp8_rows_plan_the_float8_base_beside_their_bf16_twins_and_are_refused_where_it_cannot_run(tmp_path):
    """`--fp8` rows (LoRA's frozen base in float8 matmuls) plan a float8 copy of every frozen linear weight
    beside their twins without it (one byte per weight: 6.5 GiB at Mistral-7B, 7 at Llama-3.1-8B); on a
    GPU without float8 matmuls the planner refuses them, and the row is listed as skipped in its words."""
    args = throughput.parse_args(["--dry-run", "--work", str(tmp_path)])
    for fp8, bf16 in (("anchor-fp8", "anchor"), ("mistral-ckpt-all-liger-fp8", "mistral-ckpt-all-liger"),
                      ("mistral-best-fp8", "mistral-best"), ("anchor-fp8-compile", "anchor-compile")):
        (with_fp8,), (without,) = rows.select(fp8), rows.select(bf16)
        assert throughput.workload(with_fp8, args).fp8 and not throughput.workload(without, args).fp8
        assert "--fp8" in throughput.python_args(with_fp8, args) and "--fp8" not in throughput.python_args(without, args)
        more = throughput.planned(with_fp8, args)["planned_allocated_gib"] - throughput.planned(without, args)["planned_allocated_gib"]
        assert 6.4 < more < 7.5, (fp8, more)
    a100 = throughput.parse_args(["--dry-run", "--work", str(tmp_path), "--gpu", "A100-80GB"])
    refused = {row.id: throughput.refusal(row, a100.gpu_spec, a100.work) for row in rows.ROWS}
    assert {name for name, why in refused.items() if why} == {row.id for row in rows.ROWS if "--fp8" in (*row.flags, *(row.plan or ()))}
    assert all("compute capability 8.9" in why for why in refused.values() if why)
    assert throughput.planned(rows.select("anchor-fp8")[0], a100)["planned_tokens_per_second"] is None
