"""Export streams: peak host memory stays near one output shard, not the model size.

A 360 MB (fp32) Llama-shaped checkpoint in FSDP's DCP format and in single-process safetensors
format is exported with 24 MB shards in a fresh process; its peak RSS above the post-import
baseline must stay under 2.5 shards. glibc's malloc keeps freed shard-sized blocks on its heap
(the dynamic mmap threshold grows), which adds up to ~30 MB of fragmentation here; the probe pins
the threshold (MALLOC_MMAP_THRESHOLD_) so the number measures what export holds, not the allocator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

SHARD_BYTES = 24_000_000
PROBE = """
import json, sys
import finetune.export.safetensors, torch.distributed.checkpoint, safetensors.torch, transformers  # imports before the baseline
def rss(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
baseline = rss("VmRSS:")
finetune.export.safetensors.export(sys.argv[1], sys.argv[2], max_shard_size="24MB")  # = SHARD_BYTES
print(json.dumps({"baseline": baseline, "peak": rss("VmHWM:")}))
"""


def llama_state_dict() -> dict[str, torch.Tensor]:
    """Random weights named and shaped as a 24-layer, 512-wide Llama with an 8k vocab (90M params):
    every tensor is smaller than a shard, as in real models with 5 GB shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=24,
                                  num_attention_heads=8, num_key_value_heads=8, vocab_size=8192,
                                  tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    return config, {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def make_checkpoint(folder, config, state_dict, layout: str) -> None:
    """A checkpoint folder as Checkpointer writes it, with just the files export reads."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    if layout == "dcp":  # Accelerate's FSDP layout: {"model": state_dict} in pytorch_model_fsdp_0/
        dcp.save({"model": state_dict}, checkpoint_id=str(folder / "pytorch_model_fsdp_0"), no_dist=True)
    else:
        save_file(state_dict, str(folder / "model.safetensors"))
    config.save_pretrained(folder / "hf")
    files = [{"path": str(p.relative_to(folder)), "bytes": p.stat().st_size} for p in folder.rglob("*") if p.is_file()]
    manifest = {"step": 1, "config": {"method": "full"}, "base_model": None, "identity": {"precision": "fp32"},
                "model_weights": "all", "files": files}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("layout", ["dcp", "safetensors"])
def test_export_peak_memory_is_a_fraction_of_the_model(tmp_path, layout):
    config, state_dict = llama_state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    checkpoint = tmp_path / "checkpoints" / "step-000001"
    make_checkpoint(checkpoint, config, state_dict, layout)
    del state_dict
    result = subprocess.run([sys.executable, "-c", PROBE, str(checkpoint), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    growth = measured["peak"] - measured["baseline"]
    print(f"{layout}: model {model_bytes / 1e6:.0f} MB, export peak RSS +{growth / 1e6:.0f} MB over baseline")
    assert growth < 2.5 * SHARD_BYTES < model_bytes / 5
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) == 17 and max(p.stat().st_size for p in shards) <= SHARD_BYTES + 1000  # + header
