"""One answer to "what is --model": the kind, where the weights load from, the Hub repo and the GGUF
file, for every form --model takes (no Hub access: nothing here downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.errors import FinetuneError
from finetune.models.source import model_source


def test_each_form_of_model_has_one_kind_and_one_weights_location(tmp_path):
    catalogued = model_source("llama-3.2-1b")
    assert (catalogued.kind, catalogued.weights, catalogued.hub_id) == ("catalog", "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B")
    tiny = model_source("tiny", tmp_path / "out")
    assert (tiny.kind, tiny.weights, tiny.hub_id) == ("random-init", str(tmp_path / "out" / "base_model"), None)
    assert tiny.written_by_finetune and not catalogued.written_by_finetune
    hub = model_source("someone/their-model")
    assert (hub.kind, hub.weights, hub.hub_id) == ("hub", "someone/their-model", "someone/their-model")
    local = model_source(str(tmp_path))
    assert (local.kind, local.weights, local.hub_id) == ("local", str(tmp_path), None)
    assert model_source("./gone/model").kind == "local" and model_source("?").hub_id is None


def test_gguf_files_are_named_with_their_source_repo():
    packaged = model_source("smollm2-135m")
    assert packaged.kind == "gguf" and packaged.gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert packaged.hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct" and Path(packaged.weights).name.startswith("SmolLM2")
    by_path = model_source(str(packaged.gguf))
    assert (by_path.kind, by_path.gguf, by_path.weights, by_path.hub_id) == ("gguf", packaged.gguf, packaged.weights, None)


def test_a_missing_gguf_file_is_one_clear_error(tmp_path):
    with pytest.raises(FinetuneError, match="no such GGUF file"):
        model_source(str(tmp_path / "model.gguf"))
    (tmp_path / "fake.gguf").write_text("not one")
    with pytest.raises(FinetuneError, match="GGUF magic bytes"):
        model_source(str(tmp_path / "fake.gguf"))
