"""`lease/gpu_tests.sh` on a CPU: without Qwen's chunk files it refuses at once; with them it runs the GPU tests on a
config our loader takes (here each skips: no CUDA) and leaves their log in $OUT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_tests(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "QWEN_CHUNKS": str(tmp_path / "qwen"), "OUT": str(tmp_path / "out"),
           "CUDA_VISIBLE_DEVICES": "", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # our python3
    return subprocess.run(["bash", "lease/gpu_tests.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_without_the_chunk_files_nothing_runs_and_with_them_the_tests_log_into_out(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    refused = gpu_tests(tmp_path)
    assert refused.returncode == 2 and "part*.bin: ship the model first" in refused.stderr
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "part1.bin").write_bytes(b"")
    ran = gpu_tests(tmp_path, "worker_trained")
    log = (tmp_path / "out" / "gpu_tests.log").read_text()
    assert ran.returncode == 0, log[-2000:]
    assert "1 skipped" in log and "deselected" in log
