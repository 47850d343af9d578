"""bench/scaling.py's table, from the store a real run wrote (the 1B shape on 1 and 2 H200s, 2026-11-28): what each
cell says is read back from the store's own rows here, with sqlite, not through the bench's MLflow client."""

from __future__ import annotations

import gzip
import shutil
import sqlite3
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import scaling  # noqa: E402
from clozemath.plan import load_plan  # noqa: E402

STORE = ROOT / "bench" / "results" / "scaling_h200_2026-11-28" / "mlruns.db.gz"
LAYOUTS = {"1xZeRO-2": 1, "2xZeRO-2": 2, "2xZeRO-3": 2, "4xZeRO-2": 4}  # the last never ran: "not finished"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scaling") / "mlruns.db"
    with gzip.open(STORE) as packed, path.open("wb") as out:
        shutil.copyfileobj(packed, out)
    return path


def logged_rates(store: Path) -> dict[str, list[float]]:
    """Each trial's `train/tokens_per_s`, in step order, straight from the store's tables."""
    db = sqlite3.connect(store)
    trials = dict(db.execute("select run_uuid, value from tags where key = 'trial'"))
    rates: dict[str, list[float]] = {}
    for run, value in db.execute(
        "select run_uuid, value from metrics where key = 'train/tokens_per_s' order by run_uuid, step"
    ):
        rates.setdefault(trials[run], []).append(value)
    return rates


def test_the_table_reads_each_trial_steady_rate_per_gpu_and_scaling(store: Path) -> None:
    overrides = ["axes.model=[llama-3.2-1b-random]", f"axes.layout=[{','.join(LAYOUTS)}]",
                 f"tracking.uri=sqlite:///{store}"]
    table = scaling.table(load_plan(scaling.GRID, overrides), "NVIDIA H200")
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| llama-3.2-1b-random")]
    assert len(rows) == len(LAYOUTS)
    rates = logged_rates(store)
    single = None
    for (layout, workers), cells in zip(LAYOUTS.items(), rows):
        cells = [cell.strip() for cell in cells]
        assert cells[1] == str(workers)
        name = f"scaling/model=llama-3.2-1b-random,layout={layout}"
        if name not in rates:
            assert cells[4] == "not finished"
            continue
        logged = rates[name]
        steady = statistics.median(logged[2:-1])  # not the compiling first step, the second, or the checkpoint's last
        assert steady != statistics.median(logged)  # the window matters on this run's steps
        per_gpu = steady / workers
        single = per_gpu if layout == "1xZeRO-2" else single
        assert cells[4] == f"{steady:,.0f}"
        assert cells[5] == f"{per_gpu:,.0f}"
        assert 0.0 < float(cells[6].rstrip("%")) < 100.0  # MFU
        assert cells[7] == f"{per_gpu / single:.0%}"


def test_a_trial_of_read_weights_counts_the_flops_of_its_own_shape() -> None:
    """SmolLM2's weights are read, not made: its FLOPs come from the throughput table's shape of it (135M parameters,
    ~0.6 GFLOP a token), not from transformers' default Llama (a 7B: ~28 GFLOP), which put its MFU at 141% (H200,
    2026-11-28)."""
    plan = load_plan(scaling.GRID, ["axes.model=[smollm2-135m]", "axes.layout=[1xZeRO-2]", "data.limit=20"])
    config = plan.experiments[0]
    flops = scaling.real_token_flops(config, scaling.Throughput(plan.root))
    frozen_layer_weights = 30 * (4 * 576 * 576 * 2 // 3 + 3 * 576 * 1536)  # q, o whole; k, v a third; the MLP
    assert 4 * frozen_layer_weights < flops < 2e9
    with pytest.raises(ValueError, match="no random_init"):
        scaling.meta_shape(config.model, 49152)
