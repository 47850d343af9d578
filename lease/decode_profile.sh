#!/usr/bin/env bash
# Issue 49: our decoder as clozemath now runs it (liger's kernels on: `--levers default`) on Qwen2.5-Coder-1.5B over all
# 1,319 GSM8K test problems (the goal: greedy in <= 5 s), then one profiled pass per scheme (what still stands between
# a step and its bytes), in ONE call on one H200, before anything else uses the card (a slice chain would share it):
#
#   bash lease/decode_profile.sh          # on the device, from the repository root; tables, profiles, log under $OUT
#
# Steps, most wanted first (each skipped when less than its estimate is left of BUDGET, default 540 s):
#   1. greedy, auto batch, 1,319 problems, and its profile (the GGUF's first parse ~1 min)                  ~ 120 s
#   2. beam-5 and CoT k=9, batch 64, the first 128 problems, and their profiles                             ~ 90 s
# Needs /tmp/site (the site bundle: liger-kernel 0.8.5 in it), /tmp/data and /tmp/qwen (`python3 bench/ship_model.py
# receive`). DRY_RUN=1 prints the steps' commands and runs none (CPU-checked: tests/test_lease_levers.py); QWEN_CHUNKS,
# DATA and OUT override /tmp/qwen, /tmp/data and $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?where results go} QWEN_CHUNKS=${QWEN_CHUNKS:-/tmp/qwen} DATA=${DATA:-${CLOZEMATH_DATA_DIR:-/tmp/data}}
source lease/common.sh  # step, qwen_config
[ -f "$DATA/gsm8k/test.jsonl" ] || { echo "no $DATA/gsm8k/test.jsonl: ship the data first (or set DATA)" >&2; exit 2; }
mkdir -p "$OUT/profiles"
QWEN=$OUT/qwen.yaml
qwen_config "$QWEN"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 CLOZEMATH_DATA_DIR=$DATA
LOG=$OUT/log.txt START=$(date +%s) BUDGET=${BUDGET:-540}
# a command, not a function: `step` runs it under `timeout`, which cannot run a shell function
ours=(env PYTHONPATH=/tmp/site:$PWD python3 bench/eval_throughput.py --model "$QWEN" --data "$DATA/gsm8k" --sides ours
      --profile "$OUT/profiles")
[ -z "${DRY_RUN:-}" ] && { nvidia-smi -L; git log --oneline -1; } 2>&1 | tee -a "$LOG"
step greedy-1319 90 "${ours[@]}" --batch-size auto --limit 1319 --schemes greedy --out "$OUT/qwen_greedy_1319.md"
step beam-cot-64 60 "${ours[@]}" --batch-size 64 --limit 128 --schemes beam,cot --out "$OUT/qwen_beam_cot_64.md"
[ -n "${DRY_RUN:-}" ] && exit 0
echo "=== done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
grep -h "^| \(greedy\|beam\|cot\) " "$OUT"/qwen_*.md | tee -a "$LOG"
