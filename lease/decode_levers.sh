#!/usr/bin/env bash
# Issue 49 item 1's speed levers on one H200 (device tool, kind nvidia-h200), in ONE call: our decoder
# (bench/eval_throughput.py --sides ours) with each lever of a model loaded for inference (clozemath/model/speed.py:
# off, fused q/k/v and gate/up products, liger-kernel's RMSNorm/RoPE/SwiGLU, both), back to back in one process per
# model and batch (`--levers off,fused,liger,both`: copies of one loaded model, each warmed on the first batch, then
# timed; every lever row says its tokens' agreement with the plain model's), on the Llama-3.2-1B shape (random
# weights) and Qwen2.5-Coder-1.5B-Instruct (the chunk files in /tmp/qwen), fine-tuned `P<SEP>` prompts, 256 new tokens:
#
#   bash lease/decode_levers.sh          # on the device, from the repository root; tables and log under $OUT
#
# Steps, most wanted first (each skipped when less than its estimate is left of BUDGET, default 540 s):
#   1. 1B shape, batch 64: greedy, beam-5 and CoT k=9 over the first 64 problems (one batch each)        ~ 90 s
#   2. Qwen 1.5B, the same (its first load parses the GGUF file once: ~1 min more)                       ~150 s
#   3. 1B shape, batch auto (512 rows): greedy over the first 512 problems (one batch)                   ~ 50 s
#   4. Qwen 1.5B, the same                                                                                ~ 60 s
#   5. the levers' GPU tests on tiny-llama (tests/test_decode_gpu.py -k levers)                           ~ 60 s
# Estimated from bench/results/decode_flex_h200_2026-12-02/ (one H200, the engine as merged): a pass of the 1B shape
# takes 64 / 80.4 = 0.8 s greedy at batch 64, 512 / 240 = 2.1 s at auto, 64 / 22.5 = 2.8 s for beam-5 and for CoT;
# each lever runs the first batch twice (its warm-up, then the timed pass: here the same batch), the first lever also
# compiles the attention for the run's shapes (warm-ups of 5-12 s there), and a process starts in ~20 s (imports, the
# model built or read, three copies). Qwen's step: ~1.4x the 1B shape's (28 layers against 16, 1.25x the bytes).
# Steps 1-4 ~5.8 minutes with Qwen's first parse, ~4.8 without; BUDGET cuts the rest.
#
# Needs, on the machine: /tmp/site (the site bundle, liger-kernel 0.8.5 in it), Qwen's chunk files in /tmp/qwen and
# the data in /tmp/data, all from `python3 bench/ship_model.py receive` (bench/ship_model.py's calls), and the
# Llama-3.2 tokenizer of the 1B shape: .gpu/lease49/whl/ (lease/vllm_lease.sh's header says how it is made; carried).
# DRY_RUN=1 prints the steps' commands and runs none (CPU-checked: tests/test_lease_levers.py); QWEN_CHUNKS, DATA,
# LEVERS, RES and OUT override /tmp/qwen, /tmp/data, off,fused,liger,both, $OUT/tables and $OUT.
set -uo pipefail
OUT=${OUT:?where results go} QWEN_CHUNKS=${QWEN_CHUNKS:-/tmp/qwen} DATA=${DATA:-${CLOZEMATH_DATA_DIR:-/tmp/data}}
RES=${RES:-$OUT/tables} LEVERS=${LEVERS:-off,fused,liger,both}
LEASE=.gpu/lease49
source lease/common.sh  # qwen_config, lease_wheels
[ -f "$DATA/gsm8k/test.jsonl" ] || { echo "no $DATA/gsm8k/test.jsonl: ship the data first (or set DATA)" >&2; exit 2; }
mkdir -p "$RES"
QWEN=$RES/qwen.yaml
qwen_config "$QWEN"
lease_wheels "$LEASE"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 CLOZEMATH_DATA_DIR=$DATA
LOG=$OUT/log.txt
START=$(date +%s) BUDGET=${BUDGET:-540}
# a command, not a function: `step` runs it under `timeout`, which cannot run a shell function
ours=(env PYTHONPATH=/tmp/site:$PWD python3 bench/eval_throughput.py --data "$DATA/gsm8k" --sides ours --levers "$LEVERS")
if [ -z "${DRY_RUN:-}" ]; then
  { nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used --format=csv
    PYTHONPATH=/tmp/site python3 -c "import torch, transformers, liger_kernel, importlib.metadata as m
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__,
      'liger-kernel', m.version('liger-kernel'))"
    git log --oneline -1; } 2>&1 | tee -a "$LOG"
fi

step 1b-64 60 "${ours[@]}" --model llama-3.2-1b-random --batch-size 64 --limit 64 --schemes greedy,beam,cot \
  --out "$RES/levers_1b_64.md"
step qwen-64 100 "${ours[@]}" --model "$QWEN" --batch-size 64 --limit 64 --schemes greedy,beam,cot \
  --out "$RES/levers_qwen_64.md"
step 1b-auto 40 "${ours[@]}" --model llama-3.2-1b-random --batch-size auto --limit 512 --schemes greedy \
  --out "$RES/levers_1b_auto.md"
step qwen-auto 50 "${ours[@]}" --model "$QWEN" --batch-size auto --limit 512 --schemes greedy \
  --out "$RES/levers_qwen_auto.md"
step gpu-tests 60 env PYTHONPATH=/tmp/site:$PWD CLOZEMATH_GPU_MODEL=tiny-llama python3 -m pytest -p no:cacheprovider \
  -q -o addopts='' tests/test_decode_gpu.py -k levers
[ -n "${DRY_RUN:-}" ] && exit 0
echo "=== done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
grep -h "^| \(greedy\|beam\|cot\) " "$RES"/levers_*.md | tee -a "$LOG"
