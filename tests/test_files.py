"""Output folders replaced whole or not at all: the run's adapter, copied out of Ray Train's last checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from clozemath.files import copy_folder_atomic


def folder_with(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def contents(path: Path) -> dict[str, str]:
    return {file.name: file.read_text() for file in sorted(path.iterdir())}


@pytest.fixture
def adapters(tmp_path: Path) -> tuple[Path, Path]:
    """A new adapter (in a checkpoint) and the run folder's earlier one."""
    new = folder_with(tmp_path / "checkpoint" / "adapter",
                      {"adapter_config.json": "new", "adapter_model.safetensors": "new"})
    folder_with(tmp_path / "run" / "adapter", {"adapter_config.json": "old", "adapter_model.safetensors": "old"})
    return new, tmp_path / "run" / "adapter"


def test_the_copy_replaces_the_folder_and_leaves_nothing_beside(adapters: tuple[Path, Path], tmp_path: Path) -> None:
    new, target = adapters
    copy_folder_atomic(new, target)
    assert contents(target) == contents(new)
    assert [p.name for p in target.parent.iterdir()] == ["adapter"]
    copy_folder_atomic(new, tmp_path / "fresh" / "adapter")  # no earlier folder
    assert contents(tmp_path / "fresh" / "adapter") == contents(new)


def test_an_earlier_adapter_survives_a_copy_that_fails_midway(adapters: tuple[Path, Path]) -> None:
    new, target = adapters
    (new / "tokenizer.json").symlink_to(new / "gone")  # unreadable: copied after the others, then the copy fails
    with pytest.raises(shutil.Error, match="tokenizer.json"):
        copy_folder_atomic(new, target)
    assert contents(target) == {"adapter_config.json": "old", "adapter_model.safetensors": "old"}
    assert [p.name for p in target.parent.iterdir()] == ["adapter"]  # the partial copy is gone


def test_an_earlier_adapter_is_put_back_when_the_new_one_cannot_be_renamed_in(
    adapters: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    new, target = adapters
    rename = os.rename

    def refuse_the_new_one(source: str | Path, destination: str | Path) -> None:
        if Path(destination) == target and not Path(source).name.endswith(".old"):
            raise OSError(5, "Input/output error")
        rename(source, destination)

    monkeypatch.setattr(os, "rename", refuse_the_new_one)
    with pytest.raises(OSError, match="Input/output error"):
        copy_folder_atomic(new, target)
    assert contents(target) == {"adapter_config.json": "old", "adapter_model.safetensors": "old"}
    assert [p.name for p in target.parent.iterdir()] == ["adapter"]
