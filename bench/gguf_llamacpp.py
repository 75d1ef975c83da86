"""llama.cpp on an exported GGUF: does it generate what transformers generates?

SmolLM2-135M-Instruct (see bench/gguf_export.py for where it comes from) is written as GGUF per
--types with `finetune.export.gguf.write_gguf`, then run greedily by llama.cpp (through
`llama-cpp-python`, a source build: `pip install llama-cpp-python`) and by transformers on the same
file (`gguf_file=`), from the same prompt token ids, for --new-tokens tokens. Also checks that
llama.cpp tokenizes the rendered chat prompt to the same ids as transformers (the tokenizer
metadata, `tokenizer.ggml.pre` included). Compare f16/bf16: a 135M model's greedy path can flip
on a near tie under q8_0 rounding in one engine and not the other.

    python bench/gguf_llamacpp.py [--types f16 bf16 q8_0] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_export import PROMPT, greedy, load_smollm2_folder


def llama_cpp_greedy(llm, ids: list[int], new_tokens: int) -> list[int]:
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if token == llm.token_eos() or len(out) == new_tokens:
            break
        out.append(token)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["f16", "bf16", "q8_0"])
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install llama-cpp-python (builds llama.cpp from source).")
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.export.gguf import gguf_filename, write_gguf

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, _, tokenizer = load_smollm2_folder()
        text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        print(f"\n| type | llama.cpp tokenizes the prompt alike | same greedy {args.new_tokens} tokens | llama.cpp answer |")
        print("|---|---|---|---|")
        for gguf_type in args.types:
            path = Path(tmp) / gguf_filename(gguf_type)
            write_gguf(hf_dir, path, gguf_type, name="SmolLM2-135M-Instruct")
            llm = Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False)
            same_ids = llm.tokenize(text.encode(), add_bos=False, special=True) == ids[0].tolist()
            theirs = llama_cpp_greedy(llm, ids[0].tolist(), args.new_tokens)
            model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
            ours = greedy(model, ids, args.new_tokens).tolist()
            ours = ours[: ours.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ours else ours
            print(f"| {gguf_type} | {'yes' if same_ids else 'no'} | {'yes' if theirs == ours else 'no'} | "
                  f"{tokenizer.decode(theirs)!r} |")
            path.unlink()


if __name__ == "__main__":
    main()
