"""`lease/vllm_lease.sh` on a CPU: its arguments, what it refuses before a GPU is touched, and (DRY_RUN) the steps it
would run, in order, for each part and model."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from clozemath.config import ModelConfig
from clozemath.safe_yaml import read_yaml

ROOT = Path(__file__).resolve().parents[1]


def lease(tmp_path: Path, *args: str, vsite: bool = True, chunks: bool = True) -> subprocess.CompletedProcess:
    folders = {name: tmp_path / name for name in ("vsite", "qwen", "res", "out")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    if vsite:
        (folders["vsite"] / "vllm").mkdir(exist_ok=True)
    if chunks:
        (folders["qwen"] / "part1.bin").write_bytes(b"")
    env = {**os.environ, "DRY_RUN": "1", "VSITE": str(folders["vsite"]), "QWEN_CHUNKS": str(folders["qwen"]),
           "RES": str(folders["res"]), "OUT": str(folders["out"]), "CLOZEMATH_DATA_DIR": str(tmp_path / "data")}
    return subprocess.run(["bash", "lease/vllm_lease.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def commands(tmp_path: Path, model: str) -> dict[str, str]:
    """What `ours` and `vllm` stand for in a step: each side in its own process, vLLM's wheels first on its path."""
    data = f"--model {model} --data {tmp_path}/data/gsm8k"
    return {"ours": f"env PYTHONPATH=/tmp/site:{ROOT} python3 bench/eval_throughput.py {data} --sides ours",
            "vllm": f"env PYTHONPATH={tmp_path}/vsite:/tmp/site:{ROOT} python3 bench/vllm_baseline.py {data}"}


def steps(run: subprocess.CompletedProcess) -> list[str]:
    return [line.split(": ", 1)[1] for line in run.stdout.splitlines() if line.startswith("=== ")]


@pytest.mark.parametrize("args", [[], ["sample"], ["--help"]])
def test_a_part_other_than_greedy_or_beam_cot_is_refused_with_the_usage(tmp_path: Path, args: list[str]) -> None:
    run = lease(tmp_path, *args)
    assert run.returncode == 2 and run.stderr.startswith("usage: bash lease/vllm_lease.sh greedy|beam-cot")


def test_without_vllms_wheels_installed_or_qwens_chunks_joined_nothing_runs(tmp_path: Path) -> None:
    run = lease(tmp_path, "greedy", vsite=False)
    assert run.returncode == 2 and "ship bench/vllm_wheels.txt first" in run.stderr and not run.stdout
    run = lease(tmp_path / "without_chunks", "greedy", "qwen", chunks=False)
    assert run.returncode == 2 and "part*.bin: ship the model first" in run.stderr and not run.stdout


def test_greedy_runs_ours_then_vllm_at_batch_64_then_256_on_the_same_512_problems(tmp_path: Path) -> None:
    run = lease(tmp_path, "greedy")
    res = tmp_path / "res"
    ours, vllm = commands(tmp_path, "llama-3.2-1b-random").values()
    assert run.returncode == 0 and steps(run) == [
        f"{ours} --batch-size 64 --limit 512 --schemes greedy --out {res}/ours_llama_3_2_1b_random_greedy_64.md",
        f"{vllm} --batch-size 64 --limit 512 --schemes greedy --out {res}/vllm_llama_3_2_1b_random_greedy_64.md",
        f"{ours} --batch-size 256 --limit 512 --schemes greedy --out {res}/ours_llama_3_2_1b_random_greedy_256.md",
        f"{vllm} --batch-size 256 --limit 512 --schemes greedy --out {res}/vllm_llama_3_2_1b_random_greedy_256.md",
    ]


def test_beam_cot_on_qwen_reads_the_joined_chunks_through_a_config_our_loader_accepts(tmp_path: Path) -> None:
    run = lease(tmp_path, "beam-cot", "qwen")
    res = tmp_path / "res"
    ours, vllm = commands(tmp_path, f"{res}/qwen.yaml").values()
    assert run.returncode == 0 and steps(run) == [
        f"{ours} --batch-size 64 --limit 128 --schemes beam,cot --out {res}/ours_qwen_beam_cot_64.md",
        f"{vllm} --batch-size 64 --limit 128 --schemes beam,cot --out {res}/vllm_qwen_beam_cot_64.md",
    ]
    config = ModelConfig.model_validate(read_yaml(res / "qwen.yaml"))
    assert config.gguf_chunks.packages is None and config.gguf_chunks.files == f"{tmp_path}/qwen/part*.bin"
    assert config.name == "qwen2.5-coder-1.5b-instruct" and config.gguf_chunks.size == 1117320768
