"""`finetune prepare [training flags]`: tokenize a run's data into the cache, without training.

It takes the training flags (and --config): the model's tokenizer and the data options name the
cache entry, so the training run with the same flags reads it instead of tokenizing. Before a
large job, this tokenizes on one machine with all its CPUs (--dataset-num-proc) instead of keeping
the job's GPUs waiting at a barrier.
"""

from __future__ import annotations

from finetune.config.flags import parse_config
from finetune.data import prepare_data
from finetune.errors import FinetuneError
from finetune.library_logs import quiet_libraries, quiet_transformers_bars
from finetune.models.source import model_source
from finetune.train import loading


def main(argv: list[str]) -> int:
    config = parse_config(argv)
    if not config.verbose:
        quiet_libraries()
        quiet_transformers_bars()
    if config.data_cache is not None and config.data_cache.lower() == "none":
        raise FinetuneError("finetune prepare fills the tokenized-data cache; drop --data-cache none.")
    # the same tokenizer files the training run will load
    source = loading.materialize(model_source(config.model, config.output_dir), config.seed)
    data = prepare_data(config, loading.load_tokenizer(source, config.trust_remote_code))
    print(f"{len(data.train):,} train / {len(data.eval):,} eval examples ({data.format}), {data.origin}")
    return 0
