"""Compile once per grid: the workers keep torch.compile's artifacts where every later trial finds them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clozemath.plan import load_config
from clozemath.records import compile_cache_folder
from clozemath.train.compilation import COMPILE_CACHE_ENV, use_compile_cache

ROOT = Path(__file__).resolve().parents[1]


def test_the_cache_is_under_the_output_folder_unless_set(tmp_path: Path) -> None:
    config = load_config(ROOT / "configs" / "experiments" / "smoke.yaml", [f"train.output_dir={tmp_path}"])
    assert compile_cache_folder(config) == tmp_path / "compile_cache"
    config.train.compile_cache = str(tmp_path / "shared")
    assert compile_cache_folder(config) == tmp_path / "shared"


def test_a_process_compiles_into_the_folder_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in COMPILE_CACHE_ENV:
        monkeypatch.delenv(variable, raising=False)
    use_compile_cache(tmp_path / "cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    assert (tmp_path / "cache").is_dir()


COMPILE_ONCE = """
import json, sys
from pathlib import Path
from clozemath.train.compilation import use_compile_cache
use_compile_cache(Path(sys.argv[1]))
import torch
from torch._dynamo.utils import counters
compiled = torch.compile(lambda x: torch.sin(x) * 2 + torch.cos(x))
compiled(torch.ones(8))
print(json.dumps(dict(counters["inductor"])))
"""


@pytest.mark.slow
def test_a_second_process_loads_what_the_first_compiled(tmp_path: Path) -> None:
    """Two processes (two trials) compile the same function with one cache folder: the first misses Inductor's
    graph cache and fills it, the second hits it (on CPU, Inductor builds C++; on a GPU, Triton kernels)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    counts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", COMPILE_ONCE, str(tmp_path / "cache")], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=600, check=True)
        counts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = counts
    assert first.get("fxgraph_cache_miss") == 1 and not first.get("fxgraph_cache_hit")
    assert second.get("fxgraph_cache_hit") == 1 and not second.get("fxgraph_cache_miss")
    assert list((tmp_path / "cache" / "inductor").rglob("*"))
