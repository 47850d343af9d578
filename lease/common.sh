# What the lease scripts share (sourced by lease/*.sh and bench/slice_lease.sh, from the repository's root): `run`, a
# command of a chain printed with its time, then (unless DRY_RUN is set: the command printed only) run, its exit
# status and seconds printed after it; `step`, a step within a budget; `qwen_config` and `lease_wheels`.

run() {  # a command of the chain, timed into its log
    echo "[$(date +%T)] \$ $*"
    if [ -n "${DRY_RUN:-}" ]; then return 0; fi
    local started=$SECONDS
    "$@"
    local code=$?
    echo "[$(date +%T)] exit $code after $((SECONDS - started)) s"
    return $code
}

qwen_config() {  # qwen_config YAML: Qwen2.5-Coder-1.5B's model config, its chunk files in $QWEN_CHUNKS (shipped by
    # bench/ship_model.py) instead of its packages, written to YAML; exits 2 when they are not there
    compgen -G "$QWEN_CHUNKS/part*.bin" > /dev/null ||
        { echo "no $QWEN_CHUNKS/part*.bin: ship the model first" >&2; exit 2; }
    QWEN_CHUNKS=$QWEN_CHUNKS python3 - "$1" <<'PY' || exit 2
import os, sys, yaml
config = yaml.safe_load(open("configs/models/qwen2.5-coder-1.5b-instruct.yaml"))
config["gguf_chunks"].update(packages=None, file=None, files=os.environ["QWEN_CHUNKS"] + "/part*.bin")
yaml.safe_dump(config, open(sys.argv[1], "w"))
PY
}

lease_wheels() {  # lease_wheels DIR: the wheels carried in DIR/whl (those the site bundle lacks) into /tmp/site
    mkdir -p /tmp/site
    if [ -z "${DRY_RUN:-}" ] && compgen -G "$1/whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$1"/whl/*.whl \
            2>&1 | grep -v "already exists"
    fi
}

step() {  # step NAME SECONDS COMMAND...: a lease script's step within its budget ($BUDGET s from $START), skipped
    # when less than SECONDS remain; logged into $LOG, third-party warnings left out; then $AFTER_STEP, if set
    local name=$1 need=$2; shift 2
    local left=$(( BUDGET - ($(date +%s) - START) ))
    if (( left < need )); then echo "=== $name: skipped ($left s left)" | tee -a "$LOG"; return; fi
    echo "=== $name ($(( $(date +%s) - START )) s in, $left s left): $*" | tee -a "$LOG"
    [ -n "${DRY_RUN:-}" ] && return
    timeout "$left" "$@" 2>&1 | grep -v -E "Warning|warn\(|_warn_once|forward_call|^\s*$" | tee -a "$LOG"
    ${AFTER_STEP:-}
}
