"""`python -m finetune.data.builtin [--out DIR]`: regenerate the builtin tokenizer and dataset."""

import argparse
from pathlib import Path

from finetune.data.builtin import BUILTIN_DIR, write_builtin

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--out", type=Path, default=BUILTIN_DIR, help="Directory to write (default: the package's).")
for path in write_builtin(parser.parse_args().out):
    print(path)
