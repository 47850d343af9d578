"""`lease/decode_levers.sh` on a CPU: what it refuses before a GPU is touched, and (DRY_RUN) its steps in order: every
lever in one process per model and batch, Qwen read from the shipped chunk files through a config our loader takes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from clozemath.config import ModelConfig
from clozemath.safe_yaml import read_yaml

ROOT = Path(__file__).resolve().parents[1]


def lease(tmp_path: Path, chunks: bool = True, data: bool = True,
          script: str = "lease/decode_levers.sh") -> subprocess.CompletedProcess:
    for folder in ("qwen", "out", "data/gsm8k"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    if chunks:
        (tmp_path / "qwen" / "part1.bin").write_bytes(b"")
    if data:
        (tmp_path / "data" / "gsm8k" / "test.jsonl").write_text("")
    env = {**os.environ, "DRY_RUN": "1", "QWEN_CHUNKS": str(tmp_path / "qwen"), "DATA": str(tmp_path / "data"),
           "OUT": str(tmp_path / "out")}
    env.pop("RES", None)
    return subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True)


def test_without_qwens_chunks_or_the_data_nothing_runs(tmp_path: Path) -> None:
    run = lease(tmp_path, chunks=False)
    assert run.returncode == 2 and "part*.bin: ship the model first" in run.stderr and not run.stdout
    run = lease(tmp_path / "without_data", data=False)
    assert run.returncode == 2 and "gsm8k/test.jsonl: ship the data first" in run.stderr and not run.stdout


def test_each_model_and_batch_runs_every_lever_in_one_process_most_wanted_first(tmp_path: Path) -> None:
    run = lease(tmp_path)
    tables = tmp_path / "out" / "tables"
    qwen = tables / "qwen.yaml"
    steps = [line.split(": ", 1)[1] for line in run.stdout.splitlines() if line.startswith("=== ")]
    ours = (f"env PYTHONPATH=/tmp/site:{ROOT} python3 bench/eval_throughput.py --data {tmp_path}/data/gsm8k"
            " --sides ours --levers off,fused,liger,both")
    at_64 = "--batch-size 64 --limit 64 --schemes greedy,beam,cot"
    auto = "--batch-size auto --limit 512 --schemes greedy"
    assert run.returncode == 0 and steps[:4] == [
        f"{ours} --model llama-3.2-1b-random {at_64} --out {tables}/levers_1b_64.md",
        f"{ours} --model {qwen} {at_64} --out {tables}/levers_qwen_64.md",
        f"{ours} --model llama-3.2-1b-random {auto} --out {tables}/levers_1b_auto.md",
        f"{ours} --model {qwen} {auto} --out {tables}/levers_qwen_auto.md",
    ]
    assert "tests/test_decode_gpu.py -k levers" in steps[4] and len(steps) == 5
    config = ModelConfig.model_validate(read_yaml(qwen))
    assert config.gguf_chunks.packages is None and config.gguf_chunks.files == f"{tmp_path}/qwen/part*.bin"
    assert config.name == "qwen2.5-coder-1.5b-instruct" and config.gguf_chunks.size == 1117320768
    script = (ROOT / "lease" / "decode_levers.sh").read_text()
    assert '--levers "$LEVERS"' in script and "LEVERS=${LEVERS:-off,fused,liger,both}" in script


def test_the_profile_lease_runs_qwen_as_clozemath_decodes_on_all_of_gsm8k_then_beam_and_cot(tmp_path: Path) -> None:
    """`lease/decode_profile.sh` (DRY_RUN): the default levers (no `--levers`: what clozemath gives a model it loads
    for inference), all 1,319 test problems greedy at the auto batch, then beam and CoT; every step profiled."""
    run = lease(tmp_path, script="lease/decode_profile.sh")
    out = tmp_path / "out"
    ours = (f"env PYTHONPATH=/tmp/site:{ROOT} python3 bench/eval_throughput.py --model {out}/qwen.yaml"
            f" --data {tmp_path}/data/gsm8k --sides ours --profile {out}/profiles")
    steps = [line.split(": ", 1)[1] for line in run.stdout.splitlines() if line.startswith("=== ")]
    assert run.returncode == 0 and steps == [
        f"{ours} --batch-size auto --limit 1319 --schemes greedy --out {out}/qwen_greedy_1319.md",
        f"{ours} --batch-size 64 --limit 128 --schemes beam,cot --out {out}/qwen_beam_cot_64.md",
    ]
    assert ModelConfig.model_validate(read_yaml(out / "qwen.yaml")).gguf_chunks.files == f"{tmp_path}/qwen/part*.bin"
