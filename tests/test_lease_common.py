"""`lease/common.sh`'s `step` run for real on a CPU (no DRY_RUN): it runs its command under the budget's `timeout`,
logs its output and skips what would not fit; and no lease script hands `step` a shell function, which `timeout`
cannot run (the 2026-12-02 levers lease lost a call to that: every step "No such file or directory")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def steps(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    body = f"source lease/common.sh; LOG={tmp_path}/log.txt START=$(date +%s) BUDGET=100\n{script}"
    return subprocess.run(["bash", "-c", body], cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})


def test_a_step_runs_its_command_logs_it_and_a_step_past_the_budget_is_skipped(tmp_path: Path) -> None:
    run = steps(tmp_path, 'say=(env WORD=ran sh -c \'echo "$WORD $0"\')\n'
                          'step first 10 "${say[@]}" twice\nstep second 1000 "${say[@]}" never')
    log = (tmp_path / "log.txt").read_text()
    assert run.returncode == 0 and "ran twice" in run.stdout and "ran twice" in log
    assert "=== second: skipped" in log and "never" not in run.stdout.replace("=== second: skipped", "")


def test_no_lease_script_hands_step_a_shell_function() -> None:
    for script in [*ROOT.glob("lease/*.sh"), ROOT / "bench" / "slice_lease.sh"]:
        text = script.read_text()
        functions = set(re.findall(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\(\)\s*\{", text, flags=re.M))
        stepped = re.findall(r"^\s*step\s+\S+\s+\S+\s+(\S+)", text, flags=re.M)
        assert not functions & set(stepped), f"{script.name}: step runs shell function(s) {functions & set(stepped)}"
