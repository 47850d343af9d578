"""`bench/reproducibility.py`: its comparison of two adapters (bit for bit, the largest difference and where) and of
two runs' losses, and the benchmark end to end on the tiny model on a CPU (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench import reproducibility as bench
from clozemath.errors import ClozeMathError


def adapter(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / bench.ADAPTER_FILE))
    return folder


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a.lora_A": torch.randn(4, 8, generator=generator), "a.lora_B": torch.zeros(8, 4),
            "rows": torch.randn(2, 8, generator=generator).to(torch.bfloat16)}


def test_adapters_are_compared_bit_for_bit_tensor_by_tensor(tmp_path: Path) -> None:
    same = bench.compare_adapters(adapter(tmp_path / "a", tensors()), adapter(tmp_path / "b", tensors()))
    assert same == bench.AdapterDiff(tensors=3, differing=0, max_abs_diff=0.0, worst=None, max_rel_diff=0.0)

    changed = tensors()
    changed["a.lora_A"][1, 2] = torch.nextafter(changed["a.lora_A"][1, 2], torch.tensor(10.0))  # one float32 step
    changed["a.lora_B"][0, 0] = -0.0  # equal as numbers, not as bits
    changed["rows"][0, 0] += 0.5
    diff = bench.compare_adapters(tmp_path / "a", adapter(tmp_path / "c", changed))
    rows = tensors()["rows"]
    assert (diff.tensors, diff.differing, diff.worst) == (3, 3, "rows")
    assert diff.max_abs_diff == pytest.approx(abs(float(changed["rows"][0, 0]) - float(rows[0, 0])))
    scale = max(float(changed["rows"].abs().max()), float(rows.abs().max()))
    assert diff.max_rel_diff == pytest.approx(diff.max_abs_diff / scale)

    with pytest.raises(ClozeMathError, match="hold different tensors"):
        bench.compare_adapters(tmp_path / "a", adapter(tmp_path / "d", {"other": torch.zeros(1)}))


def test_runs_are_compared_by_their_adapters_and_losses_step_by_step(tmp_path: Path) -> None:
    for name, losses in (("r1", [3.0, 2.0, 1.5]), ("r2", [3.0, 2.0, 1.25])):
        adapter(tmp_path / name / "adapter", tensors())
        (tmp_path / name / "run.json").write_text(json.dumps(
            {"name": name, "loss": losses, "grad_norm": [1.0, 2.0, 3.0], "seconds": 1.0}))
    pair = bench.compare_runs(tmp_path / "r1", tmp_path / "r2")
    assert pair["runs"] == ["r1", "r2"] and pair["adapter"]["differing"] == 0
    assert pair["final_loss"] == [1.5, 1.25] and pair["loss_max_abs_diff"] == 0.25
    assert pair["loss_first_differing_step"] == 3 and pair["grad_norm_first_differing_step"] is None


@pytest.mark.slow
def test_the_benchmark_runs_on_a_cpu(tmp_path: Path) -> None:
    """Four runs of the tiny model, each in a process of its own: the deterministic pair is the same bit for bit."""
    out = tmp_path / "out"
    assert bench.main(["--out", str(out), "--work", str(tmp_path / "work"), "model=tiny-llama", "data.limit=4",
                       "train.max_steps=3", "train.pack_tokens=null", "train.micro_batch_size=2"]) == 0
    result = json.loads((out / "reproducibility.json").read_text())
    (deterministic,), (default,) = result["pairs"]["deterministic"], result["pairs"]["default"]
    assert deterministic["runs"] == ["deterministic-1", "deterministic-2"] and default["runs"] == ["default-1",
                                                                                                  "default-2"]
    assert deterministic["adapter"]["differing"] == 0 and deterministic["adapter"]["tensors"] > 0
    assert deterministic["loss_first_differing_step"] is None and len(set(deterministic["final_loss"])) == 1
    assert result["config"]["steps"] == 3 and result["environment"]["card"].startswith("CPU")
    text = (out / "reproducibility.md").read_text()
    assert f"| deterministic-1 vs deterministic-2 | 0 of {deterministic['adapter']['tensors']} |" in text
    assert "- none" in text  # no operation without a deterministic implementation on a CPU


@pytest.mark.slow
def test_one_mode_alone_runs_only_its_pairs(tmp_path: Path) -> None:
    """`--only default`: two runs without the switch, compared; no deterministic run, so no warned operations."""
    out = tmp_path / "out"
    assert bench.main(["--out", str(out), "--only", "default", "model=tiny-llama", "data.limit=4",
                       "train.max_steps=2", "train.pack_tokens=null", "train.micro_batch_size=2"]) == 0
    result = json.loads((out / "reproducibility.json").read_text())
    assert list(result["pairs"]) == ["default"] and list(result["seconds"]) == ["default"]
    assert result["pairs"]["default"][0]["runs"] == ["default-1", "default-2"] and result["nondeterministic_ops"] == {}
    assert "| default-1 vs default-2 |" in (text := (out / "reproducibility.md").read_text())
    assert "Operations torch warned" not in text  # no deterministic run was asked: not "none"
