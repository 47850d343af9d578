#!/usr/bin/env bash
# The GPU tests on Qwen2.5-Coder-1.5B (its chunk files shipped to /tmp/qwen by bench/ship_model.py), in one call,
# beside a slice chain if one runs (correctness only: no timing is read from them), their log into $OUT:
#
#   bash lease/gpu_tests.sh [PYTEST -k EXPRESSION]      # default: every test of tests/test_decode_gpu.py
#
# Needs /tmp/site (the site bundle), /tmp/data and /tmp/qwen (`python3 bench/ship_model.py receive`). Most of their
# time is loading the model (a first load parses the GGUF file, ~1-2 min; later ones read the cache).
set -uo pipefail
cd "$(dirname "$0")/.."
source lease/common.sh  # qwen_config
QWEN_CHUNKS=${QWEN_CHUNKS:-/tmp/qwen} OUT=${OUT:?where the log goes}
qwen_config /tmp/qwen_gpu.yaml
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 CLOZEMATH_DATA_DIR=${CLOZEMATH_DATA_DIR:-/tmp/data}
export CLOZEMATH_GPU_MODEL=/tmp/qwen_gpu.yaml
python3 -m pytest -p no:cacheprovider -q -o addopts='' --tier all --durations=0 tests/test_decode_gpu.py \
    ${1:+-k "$1"} > "$OUT/gpu_tests.log" 2>&1
code=$?
tail -n 40 "$OUT/gpu_tests.log"
exit $code
