#!/usr/bin/env bash
# The matched-compute replication in one lease of 4 GPUs (issue 25; bench/results/replication.md): stage 1 (each
# method's rate on problems held out of train), the rates written into the grids (lease/choose_lrs.py), stage 2 (the
# main grid and Table 4's ablations side by side on one Ray cluster), the reports, and the files that come back.
# A command on the GPU machine lasts at most 10 minutes and the chain about 15, so `start` runs it detached (a new
# process session outlives the command), `wait` follows it, `collect` puts at most 8 files of < 16 MiB into $OUT.
#
#   export MODEL_DIR=/tmp/m CLOZEMATH_DATA_DIR=$PWD/shared/data HF_HUB_OFFLINE=1   # the GGUF's folder, the data
#   bash lease/replication_lease.sh start      # returns at once
#   bash lease/replication_lease.sh wait 570   # progress (and, where $OUT is set, `collect`); call again at once,
#                                                # within the machine's 30 s, until "chain: done": read it meanwhile
#   bash lease/replication_lease.sh collect    # the results into $OUT
#
# REPLICATION picks the model: `smollm2` (default; MODEL_DIR the folder of its GGUF) or `qwen` (issue 26: Qwen2.5-
# Coder-1.5B-Instruct from its chunk packages, configs/grids/replication_qwen1.5b.yaml; its rates swept by the same
# stage-1 grid on this model, RATE_LRS the rates; no Table 4; STAGES default 'rates main').
# STAGES (SmolLM2's default 'rates main table4') picks the stages: 'main table4' trains at the rates the grids hold (chosen by
# the lease of 2026-11-27, committed; 14 minutes on 4 x H100 with Figure 3 off, 2026-11-28), 'main' the headline
# alone (bench/results/replication.md has the measured times).
# Needs the project importable by `python3` (PYTHON=...) with its dependencies, and `ray` on PATH. DRY_RUN=1 prints
# the chain's commands instead of running them; MAIN_OVERRIDES adds overrides to the main grid's command.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # for the drivers and, through `ray start`, every Ray worker
source lease/common.sh  # run: a command of the chain, timed (DRY_RUN: printed only)
WORK=${WORK:-/tmp/lease}
PY=${PYTHON:-python3}
STORE="sqlite:///$WORK/mlruns.db"
REPORTS=$WORK/reports
RATE_GRID=configs/grids/replication_matched_lr.yaml   # stage 1 for every model: the model's overrides below
case "${REPLICATION:-smollm2}" in
    smollm2)
        RATE_ARGS=()
        RATE_EXPERIMENT=replication-matched-lr
        MAIN_GRID=configs/grids/replication_matched.yaml
        MAIN_EXPERIMENT=replication-matched
        RATE_GRIDS=("$MAIN_GRID" configs/grids/table4.yaml)
        DEFAULT_STAGES="rates main table4";;
    qwen)
        RATE_EXPERIMENT=replication-qwen1.5b-lr
        RATE_ARGS=(model=qwen2.5-coder-1.5b-instruct "name=$RATE_EXPERIMENT" "tracking.experiment=$RATE_EXPERIMENT"
                   "axes.method=[clozemath,mft,it]" "axes.train.lr=${RATE_LRS:-[1.0e-4,3.0e-4,1.0e-3]}"
                   train.gpu_share=0.33)
        MAIN_GRID=configs/grids/replication_qwen1.5b.yaml
        MAIN_EXPERIMENT=replication-qwen1.5b
        RATE_GRIDS=("$MAIN_GRID")
        DEFAULT_STAGES="rates main";;
    *) echo "REPLICATION=$REPLICATION: not smollm2 or qwen" >&2; exit 2;;
esac
PREDICTIONS_LIMIT=$((15 * 1024 * 1024))  # below what comes back (16 MiB a file)
MAIN_OVERRIDES=${MAIN_OVERRIDES:-}        # e.g. 'axes.train.seed=[0,1,2]' for a shorter lease
RATE_OVERRIDES=${RATE_OVERRIDES:-}        # stage 1's: e.g. 'axes.train.lr=[3.0e-4]'
STAGES=${STAGES:-$DEFAULT_STAGES}         # 'main table4': the rates as the grids hold them (chosen by an earlier lease)
ALL_OVERRIDES=${ALL_OVERRIDES:-}          # every grid's: e.g. a smoke run of the chain on CPU (see below)

has() {  # whether STAGES names stage $1
    [[ " $STAGES " == *" $1 "* ]]
}

grid() {  # clozemath run GRID [OVERRIDE...] on the lease's store and model
    local config=$1; shift
    local MODEL_PATH=()  # SmolLM2's GGUF folder; Qwen comes from its installed chunk packages
    [ "${REPLICATION:-smollm2}" != smollm2 ] || MODEL_PATH=("model.path=${MODEL_DIR:?set MODEL_DIR to the folder of the SmolLM2 GGUF}")
    run "$PY" -m clozemath_cli run "$config" "${MODEL_PATH[@]}" "train.output_dir=$WORK/runs" "tracking.uri=$STORE" \
        $ALL_OVERRIDES "$@"
}

# A grid driver that fails within STARTUP_S seconds is started once more (it resumes what it had begun): nobody is
# there to restart it, and the 2026-11-27 and 11-28 leases each lost Table 4's driver at its start, to store races.
STARTUP_S=${STARTUP_S:-300}

grid_driver() {  # grid CONFIG [OVERRIDE...], started once more if it fails within STARTUP_S
    local started=$SECONDS
    grid "$@" && return 0
    [ $((SECONDS - started)) -lt $STARTUP_S ] || return 1
    echo "chain: $1 failed $((SECONDS - started)) s after it started; starting it once more"
    grid "$@"
}

report() {
    run "$PY" -m clozemath_cli report --tracking-uri "$STORE" "$@"
}

export_report() {  # a report that exports its trials' predictions: full, or compact when that is too big to come back
    local out=$1; shift
    report "$@" --out "$out" --export-predictions full
    if [ -z "${DRY_RUN:-}" ] && [ "$(stat -c %s "$out/predictions.jsonl.gz" 2>/dev/null || echo 0)" -gt "$PREDICTIONS_LIMIT" ]; then
        report "$@" --out "$out" --export-predictions compact
    fi
}

chain() {
    mkdir -p "$REPORTS"
    local started=$SECONDS
    if [ -z "${DRY_RUN:-}" ]; then
        nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 5 > "$WORK/gpu.csv" &
        GPU_LOG=$!
    fi
    # One cluster for every driver: its GPUs shared out in trial slots (`train.gpu_share`), whoever asks. The workers
    # inherit this environment (PYTHONPATH, CLOZEMATH_DATA_DIR).
    export RAY_AUTH_MODE=token  # as `ray start` makes the cluster (Ray >= 2.59), for every driver that joins it
    [ -n "${DRY_RUN:-}" ] || ray get-auth-token --generate > /dev/null  # ~/.ray/auth_token, unless there is one
    run ray start --head --port=6379 --num-gpus="$(nvidia-smi -L 2>/dev/null | wc -l)" --disable-usage-stats
    export RAY_ADDRESS=127.0.0.1:6379

    if has rates; then
        echo "chain: stage 1, the rates"
        grid "$RATE_GRID" "${RATE_ARGS[@]}" $RATE_OVERRIDES
        if ! run "$PY" lease/choose_lrs.py --experiment "$RATE_EXPERIMENT" --tracking-uri "$STORE" \
                --grids "${RATE_GRIDS[@]}" --out "$REPORTS/rates.md"; then
            echo "chain: no rates chosen; stopping"; finish "$started"; return
        fi
        cp "${RATE_GRIDS[@]}" "$REPORTS/"  # the grids as they ran, rates written in: to commit
    fi

    echo "chain: stage 2 ($STAGES), the main grid and Table 4's ablations side by side"
    local drivers=()
    if has main; then
        if [ -n "${DRY_RUN:-}" ]; then grid "$MAIN_GRID" $MAIN_OVERRIDES
        else grid_driver "$MAIN_GRID" $MAIN_OVERRIDES > "$WORK/main.log" 2>&1 & drivers+=($!); fi
    fi
    if has table4; then
        if [ -n "${DRY_RUN:-}" ]; then grid configs/grids/table4.yaml
        else grid_driver configs/grids/table4.yaml > "$WORK/table4.log" 2>&1 & drivers+=($!); fi
    fi
    [ ${#drivers[@]} -eq 0 ] || wait "${drivers[@]}"

    echo "chain: the reports"
    local matched=$REPORTS/matched/predictions.jsonl.gz
    if has main; then
        export_report "$REPORTS/matched" --experiment "$MAIN_EXPERIMENT"
        report --experiment "$MAIN_EXPERIMENT" --decoding greedy --out "$REPORTS/matched_greedy" --predictions "$matched"
    fi
    if has table4; then
        export_report "$REPORTS/table4_alone" --experiment replication-table4 --decoding greedy
    fi
    if has main && has table4; then
        report --experiment "$MAIN_EXPERIMENT" --experiment replication-table4 --decoding greedy --out "$REPORTS/table4" \
            --predictions "$matched" --predictions "$REPORTS/table4_alone/predictions.jsonl.gz"
    fi
    if has rates; then
        report --experiment "$RATE_EXPERIMENT" --decoding greedy --out "$REPORTS/matched_lr" \
            --export-predictions compact
    fi
    finish "$started"
}

finish() {
    echo "chain: done in $((SECONDS - $1)) s"
    [ -n "${DRY_RUN:-}" ] || { ray stop > /dev/null 2>&1; kill "${GPU_LOG:-}" 2> /dev/null; }
    touch "$WORK/done"
}

follow() {  # until the chain is done or $1 seconds passed; then where it is
    local until=$((SECONDS + ${1:-570}))
    while [ ! -e "$WORK/done" ] && [ $SECONDS -lt "$until" ]; do sleep 10; done
    tail -n 30 "$WORK/chain.log"
    for log in main table4; do
        [ -e "$WORK/$log.log" ] && { echo "--- $log"; grep -E "trial |finished|failed|error" "$WORK/$log.log" | tail -n 8; }
    done
    if [ -e "$WORK/done" ]; then echo "chain: done"; else echo "chain: running"; fi
    [ -z "${OUT:-}" ] || collect > /dev/null 2>&1  # on the GPU machine: what has finished comes back with every wait
}

collect() {  # at most 8 files, each < 16 MiB; safe to call while the chain runs (what has finished so far)
    local into=${OUT:?set OUT}
    (cd "$WORK" && tar -czf "$into/reports.tar.gz" --exclude='*.jsonl.gz' reports chain.log main.log table4.log \
        gpu.csv runs/*/logs/driver.log)
    (cd "$WORK" && tar -czf "$into/workers_logs.tar.gz" runs/*/logs/workers.log)
    # every finished trial's evaluation files, adapters left out: with the store, the reports can be made elsewhere
    # (extract it at $WORK, where the store says its artifacts are) even when the chain did not reach them
    (cd "$WORK" && tar -czf "$into/eval_artifacts.tar.gz" --exclude='*/artifacts/adapter' mlartifacts 2> /dev/null)
    cp "$REPORTS/matched/predictions.jsonl.gz" "$into/replication_matched_predictions.jsonl.gz" 2> /dev/null  # the stages that ran
    cp "$REPORTS/table4_alone/predictions.jsonl.gz" "$into/replication_table4_predictions.jsonl.gz" 2> /dev/null  # the stages that ran
    cp "$REPORTS/matched_lr/predictions.jsonl.gz" "$into/replication_matched_lr_predictions.jsonl.gz" 2> /dev/null  # the stages that ran
    rm -f "$WORK/snapshot.db"  # the store is in WAL mode and may be written to: a consistent copy in one file
    "$PY" -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" \
        "$WORK/mlruns.db" "$WORK/snapshot.db"
    gzip -c "$WORK/snapshot.db" > "$into/mlruns.db.gz"
    ls -l "$into"
}

case "${1:-}" in
    start)
        mkdir -p "$WORK"
        rm -f "$WORK/done"
        setsid nohup bash "$0" chain > "$WORK/chain.log" 2>&1 < /dev/null &
        echo "chain: started (log $WORK/chain.log)";;
    chain) chain;;
    wait) follow "${2:-570}";;
    collect) collect;;
    *) echo "usage: $0 start | wait [seconds] | collect   (DRY_RUN=1 $0 chain: the commands)" >&2; exit 2;;
esac
