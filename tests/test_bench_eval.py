"""`bench/eval_throughput.py`: the bytes a decoding pass must read, counted from what it generated, and the benchmark
end to end on a tiny model (every side: ours, our eager side, generate with a dynamic and with a static cache)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import eval_throughput as bench
from clozemath.eval.decoding import CPU_BATCH_SIZE, Generation


def settings(batch_size: int, max_new_tokens: int = 4, num_beams: int = 2) -> bench.Settings:
    return bench.Settings(max_new_tokens, batch_size, num_beams, cot_k=2, stop=(), eos_ids=(0,), pad_id=0, vocab=50)


def test_the_bytes_a_pass_reads_follow_its_batches_and_rows() -> None:
    """Prompts of 3 and 2 tokens, one a batch (longest first). Prompt 0 ended at EOS after 3 tokens: 4 generated
    (the EOS too), 3 steps reading 4 + 5 + 6 = 15 positions; prompt 1 ran to max_new_tokens=2: 1 step reading 3.
    4 steps, 18 positions: 4 x 100 + 18 x 10 = 580 bytes. Beam search (2 beams) doubles each batch's rows, not its
    steps, and its rows share their prompt: 4 steps; prompt 0's 3 positions over 3 steps and each beam's 1 + 2 + 3,
    prompt 1's 2 over 1 step and each beam's 1: 9 + 12 + 2 + 2 = 25 positions, 650 bytes. CoT: each branch a row
    (prompt 0's: 4 and 1 generated; prompt 1's: 2 and 2): 3 + 1 steps, 9 + 6 + 0 + 2 + 1 + 1 = 19 positions."""
    prompts = [[1, 2, 3], [4, 5]]
    greedy = [Generation("abc", [7, 8, 9], "eos"), Generation("de", [5, 6], "length")]
    traffic = bench.traffic_of("greedy", greedy, prompts, settings(batch_size=1, max_new_tokens=2 + 2), 100, 10)
    assert (traffic.steps, traffic.kv_positions, traffic.total_bytes) == (4, 18, 580)
    assert bench.generated_tokens("greedy", greedy, max_new_tokens=4) == 6

    clipped = bench.traffic_of("greedy", greedy, prompts, settings(batch_size=2, max_new_tokens=2), 100, 10)
    # one batch; prompt 0's 4 tokens capped at max_new_tokens=2: both rows live for 1 step (3 + 1 and 2 + 1)
    assert (clipped.steps, clipped.kv_positions) == (1, 7)

    beam = bench.traffic_of("beam", greedy, prompts, settings(batch_size=1), 100, 10)
    assert (beam.steps, beam.kv_positions, beam.total_bytes) == (4, 25, 650)

    cot = [
        Generation("", [], "length", branches=[Generation("abc", [7, 8, 9], "eos"), Generation("", [7], "length")]),
        Generation("", [], "length", branches=[Generation("", [5, 6], "length"), Generation("", [5, 1], "length")]),
    ]
    traffic = bench.traffic_of("cot", cot, prompts, settings(batch_size=1), 100, 10)
    assert (traffic.steps, traffic.kv_positions) == (4, 19)
    assert bench.generated_tokens("cot", cot, max_new_tokens=4) == 4 + 1 + 2 + 2


SIDES = ("ours", "eager", "generate", "generate-static")


def test_the_decoding_benchmark_runs_every_side_on_cpu(tmp_path: Path) -> None:
    """float32 on CPU: every side makes the same tokens as ours. The random tiny model never ends a row early, so
    every batch's rows are all live for all 5 steps after the first token: 3 rows greedy, 3 x 2 beams, 3 x 2
    branches."""
    out, speed = tmp_path / "table.md", tmp_path / "speed.json"
    argv = ["--model", "tiny-llama", "--limit", "3", "--max-new-tokens", "6", "--num-beams", "2", "--cot-k", "2",
            "--out", str(out), "--speed-json", str(speed)]
    assert bench.main(argv) == 0
    lines = out.read_text().splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith(("| greedy", "| beam", "| cot"))]
    assert [(row[0].lstrip("| "), row[1]) for row in rows] == [(s, side) for s in bench.SCHEMES for side in SIDES]
    assert all(row[-1].rstrip(" |") == ("-" if row[1] == "ours" else "100.0%") for row in rows)
    live = {row[0].lstrip("| "): row[6].split("(")[1].split(" x ")[0] for row in rows}
    assert live == {"greedy": "3", "beam": "6", "cot": "6"}
    headlines = json.loads(speed.read_text())
    assert [h["claim"].split(" decoding")[0] for h in headlines] == list(bench.SCHEMES)
    assert all(h["ours"]["name"] == "ours" and h["baseline"]["name"].startswith("generate") for h in headlines)


def test_an_auto_batch_is_ours_choice_for_every_side(tmp_path: Path) -> None:
    """Off a GPU, `decode(batch_size="auto")` takes `cpu_batch_size` prompts a batch (short prompts: `CPU_BATCH_SIZE`):
    generate gets as many."""
    out = tmp_path / "table.md"
    argv = ["--model", "tiny-llama", "--limit", "2", "--max-new-tokens", "3", "--schemes", "greedy", "--sides",
            "ours,generate", "--batch-size", "auto", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| greedy")]
    assert len(rows) == 2 and all(f"batch {CPU_BATCH_SIZE} |" in row for row in rows)


def test_profile_writes_what_one_pass_of_ours_spent_per_scheme(tmp_path: Path) -> None:
    """`--profile DIR`: a summary and a trace per scheme, from one more pass of ours (CPU here: the host's table)."""
    folder = tmp_path / "profiles"
    argv = ["--model", "tiny-llama", "--limit", "2", "--max-new-tokens", "3", "--schemes", "greedy,beam",
            "--num-beams", "2", "--sides", "ours", "--profile", str(folder)]
    assert bench.main(argv) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["beam.trace.json", "beam.txt", "greedy.trace.json",
                                                        "greedy.txt"]
    summary = (folder / "greedy.txt").read_text()
    assert "Self CPU" in summary and "aten::" in summary  # the operations the pass ran, by their time
    assert json.loads((folder / "greedy.trace.json").read_text())["traceEvents"]


def test_levers_run_ours_once_each_on_copies_of_the_loaded_model(tmp_path: Path, capsys) -> None:
    """`--levers off,fused`: a row of ours per lever (float32 on CPU: the fused products' tokens are the plain
    model's), the other sides on the first lever's model; liger's kernels refused off a GPU, in one line."""
    out = tmp_path / "table.md"
    argv = ["--model", "tiny-llama", "--limit", "3", "--max-new-tokens", "4", "--schemes", "greedy,cot", "--cot-k",
            "2", "--sides", "ours,eager", "--levers", "off,fused", "--out", str(out)]
    assert bench.main(argv) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith(("| greedy", "| cot"))]
    assert [(row[0].lstrip("| "), row[1]) for row in rows] == [
        (scheme, side) for scheme in ("greedy", "cot") for side in ("ours", "ours fused", "eager")]
    assert [row[2].endswith("fused q/k/v and gate/up") for row in rows] == [False, True, False] * 2
    assert [row[-1].rstrip(" |") for row in rows] == ["-", "100.0%", "100.0%"] * 2
    assert bench.main(argv[:-6] + ["--levers", "off,liger"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "eval_throughput: error: liger kernels need a GPU (liger-kernel's kernels are Triton's); the model is on cpu")
