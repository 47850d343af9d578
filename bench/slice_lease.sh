#!/usr/bin/env bash
# Issue 46's slices on one GPU machine (bench/slices_qwen1.5b.yaml, bench/slices.py): each slice is a grid run of its
# own, with its folder, store and report under $WORK/<slice>; the slices named run one after another on one Ray
# cluster, detached from the call that starts them (a call lasts at most 10 minutes, a session 30). They share one
# data cache ($WORK/cache), the later slices' sets prepared while the first one trains, and each slice's report is
# written while the next one starts.
#
#   python3 bench/ship_model.py receive                 # once a session, over ~25 calls: packages, data, model
#   bash bench/slice_lease.sh start rates-1 rates-2      # returns at once (SESSION_S=N: the device seconds the
#                                                        # session has for the chain; a slice whose estimate passes
#                                                        # what is left is skipped, not cut: bench/slices.py estimate)
#   bash bench/slice_lease.sh wait 480                   # progress, and (with $OUT set) collects; call again at
#                                                        # once, within the machine's 30 s, until "chain: done"
#                                                        # (on a fresh machine it says so at once, exit 3; a
#                                                        # chain whose process died: "chain: stopped", exit 4)
#   bash bench/slice_lease.sh collect                    # into $OUT: <slice>.tar.gz a slice, chain.log, gpu.csv.gz
#
# Resuming: a slice whose trials the committed trials.json files (the plan's `results`) all finish is skipped; one
# partly finished runs only what is left (`bench/slices.py describe`). `collect` reports a slice still running from a
# snapshot of its store, so the trials it finished come back too. `python bench/slices.py unpack <slice>.tar.gz ...`
# puts each tarball's report/ and consoles under `results`/<slice>/ (a second part of one slice under <slice>-2/),
# predictions compact; commit them: the next machine then leaves those trials out.
# Each tarball holds report/ (tables.md, summary.md, trials.json, steps.json.gz, predictions.jsonl.gz: every answer
# with its grading rule and finish reason, with the generations when they fit, else compact), the slice's consoles
# (driver.log, report.log, the grid's driver and workers logs) and its MLflow store (mlruns.db.gz).
#
# Needs the project importable by `python3` (PYTHON=...) with its dependencies, `ray` on PATH, CLOZEMATH_DATA_DIR
# and HF_HUB_OFFLINE=1. MODEL_CHUNKS: the folder of the model's chunk files (bench/ship_model.py; empty: the
# installed chunk packages). DRY_RUN=1 prints the chain's commands instead of running them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # for the drivers and, through `ray start`, every Ray worker
source lease/common.sh  # run: a command of the chain, timed (DRY_RUN: printed only)
WORK=${WORK:-/tmp/lease}
PY=${PYTHON:-python3}
PLAN=${PLAN:-bench/slices_qwen1.5b.yaml}
MODEL_CHUNKS=${MODEL_CHUNKS-/tmp/qwen}
STARTUP_S=${STARTUP_S:-300}               # a driver failing sooner is started once more (it resumes its grid)
RAY_PORT=${RAY_PORT:-6379}                # RAY_CPUS: the head's CPUs (default: Ray's count of the machine's)
RAY_START_ARGS=${RAY_START_ARGS:-}        # more of `ray start`'s options (a shared machine: other ports; and
                                          # RAY_STOP=0 there, then stop the head's processes by their ids)
FILE_LIMIT=$((15 * 1024 * 1024))          # below what comes back (16 MiB a file)
REPORTS=()                                # the slices' reports, written in the background

driver() {  # clozemath run ARGS..., started once more if it fails within STARTUP_S
    local started=$SECONDS
    run "$PY" -m clozemath_cli run "$@" && return 0
    [ $((SECONDS - started)) -lt "$STARTUP_S" ] || return 1
    echo "chain: the driver failed $((SECONDS - started)) s after it started; starting it once more"
    run "$PY" -m clozemath_cli run "$@"
}

report() {  # report EXPERIMENT STORE DECODING OUT: the slice's report, its predictions full or, too big, compact
    local experiment=$1 store=$2 decoding=$3 out=$4
    local args=(-m clozemath_cli report --experiment "$experiment" --tracking-uri "$store" --decoding "$decoding"
                --out "$out")
    run "$PY" "${args[@]}" --export-predictions full
    local size
    size=$(stat -c %s "$out/predictions.jsonl.gz" 2> /dev/null || echo 0)
    if [ -z "${DRY_RUN:-}" ] && [ "$size" -gt $((FILE_LIMIT / 2)) ]; then  # half a tarball: the store, logs beside
        run "$PY" "${args[@]}" --export-predictions compact
    fi
}

MODEL=()  # the model's chunk files instead of its packages, for every driver
[ -z "$MODEL_CHUNKS" ] || MODEL=(model.gguf_chunks.packages=null "model.gguf_chunks.files=$MODEL_CHUNKS/part*.bin")

describe() {  # describe SLICE: GRID, EXPERIMENT, DECODING, TODO, OVERRIDES, RERUN and ESTIMATE_S of it (bench/slices.py)
    local info line
    GRID="" EXPERIMENT="" DECODING=beam TODO="" OVERRIDES=() RERUN="" ESTIMATE_S=""
    info=$("$PY" bench/slices.py --plan "$PLAN" describe "$1") || return 1
    while IFS= read -r line; do
        case $line in
            grid=*) GRID=${line#grid=};;
            experiment=*) EXPERIMENT=${line#experiment=};;
            decoding=*) DECODING=${line#decoding=};;
            todo=*) TODO=${line#todo=};;
            override=*) OVERRIDES+=("${line#override=}");;
            rerun=*) RERUN=${line#rerun=};;
            estimate_s=*) ESTIMATE_S=${line#estimate_s=};;
        esac
    done <<< "$info"
}

slice_folder() {  # slice_folder SLICE: its folder, its run's data cache the chain's one (<slice>/runs/cache ->
    # $WORK/cache), so that a slice's driver reads the sets an earlier slice or `warm` prepared (2026-12-03: 55 s of
    # Ray Data at a slice's start, the card idle, where its sets were another slice's or could have been made before)
    mkdir -p "$WORK/cache" "$WORK/$1/runs"
    [ -e "$WORK/$1/runs/cache" ] || ln -s "$WORK/cache" "$WORK/$1/runs/cache"
}

warm() {  # warm SLICE...: the first one left to run has its model read into this machine's caches (`clozemath warm`)
    # while its driver starts and prepares data: otherwise its first training worker parses the GGUF file then, the
    # card idle (2026-12-03: 100 s from the workers' start to their first step on a fresh machine, the parse among it);
    # then the later ones have their training sets prepared into the chain's cache while the first one trains
    local name first=1
    for name in "$@"; do
        describe "$name" && [ "$TODO" != 0 ] || continue
        if [ -n "$first" ]; then
            run "$PY" -m clozemath_cli warm "$GRID" "${MODEL[@]}" "${OVERRIDES[@]}"
            first=""
        else
            slice_folder "$name"
            run "$PY" -m clozemath_cli warm --data --no-models "$GRID" "${MODEL[@]}" \
                "train.output_dir=$WORK/$name/runs" "${OVERRIDES[@]}"
        fi
    done
}

slice_run() {  # slice_run SLICE SECONDS_LEFT: what is left of it, as a grid run in $WORK/<slice>, then its report
    local name=$1 left=$2 dir=$WORK/$1
    describe "$name" || { echo "chain: $name: not described"; return 1; }
    local grid=$GRID experiment=$EXPERIMENT decoding=$DECODING todo=$TODO overrides=("${OVERRIDES[@]}")
    if [ "$todo" = 0 ]; then
        echo "chain: $name: every trial is finished in the committed results; skipped"
        return 0
    fi
    if [ -n "$left" ] && [ -n "$ESTIMATE_S" ] && [ "$ESTIMATE_S" -gt "$left" ]; then  # cut by the session's end, its
        # unfinished trials would be lost: the next session runs it whole
        echo "chain: $name: skipped: its estimate, $ESTIMATE_S s, is more than the session's $left s left"
        return 0
    fi
    [ -n "$left" ] && [ -z "$ESTIMATE_S" ] && echo "chain: $name: no estimate (bench/slices.py estimate); run anyway"
    [ -z "$RERUN" ] || echo "chain: $name: runs $RERUN again (finished, but inside what is left)"
    echo "chain: slice $name: $todo trial(s) of $grid"
    slice_folder "$name"
    rm -f "$dir/done" "$dir/driven"
    local model=("${MODEL[@]}") store="sqlite:///$dir/mlruns.db"
    echo "$experiment $decoding" > "$dir/experiment"  # for collect's report of a slice still running
    if [ -n "${DRY_RUN:-}" ]; then
        driver "$grid" "${model[@]}" "train.output_dir=$dir/runs" "tracking.uri=$store" "${overrides[@]}"
    else
        driver "$grid" "${model[@]}" "train.output_dir=$dir/runs" "tracking.uri=$store" "${overrides[@]}" \
            > "$dir/driver.log" 2>&1
        echo "chain: slice $name: driver exit $? ($(grep -c 'finished' "$dir/driver.log") 'finished' lines)"
    fi
    touch "$dir/driven"
    if [ -n "${DRY_RUN:-}" ]; then
        slice_report "$dir" "$experiment" "$store" "$decoding"
        cat "$dir/report.log"
        return 0
    fi
    # the report beside the next slice's start (30 s of CPU, the card idle, when it came first)
    { slice_report "$dir" "$experiment" "$store" "$decoding"; echo "chain: slice $name: reported"; } &
    REPORTS+=($!)
}

slice_report() {  # slice_report DIR EXPERIMENT STORE DECODING: a slice's report once its driver is done, then `done`
    report "$2" "$3" "$4" "$1/report" > "$1/report.log" 2>&1
    touch "$1/done"
}

chain() {  # every slice named, in order, on one Ray cluster
    mkdir -p "$WORK"
    local started=$SECONDS
    if [ -z "${DRY_RUN:-}" ]; then
        nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 5 >> "$WORK/gpu.csv" \
            2> /dev/null &
        GPU_LOG=$!
        export RAY_AUTH_MODE=token  # as `ray start` makes the cluster (Ray >= 2.59), for every driver that joins it
        ray get-auth-token --generate > /dev/null  # ~/.ray/auth_token, unless there is one
    fi
    if ! run ray start --head --port="$RAY_PORT" --num-gpus="$(nvidia-smi -L 2>/dev/null | wc -l)" \
            ${RAY_CPUS:+--num-cpus=$RAY_CPUS} $RAY_START_ARGS --disable-usage-stats; then
        echo "chain: ray start failed; stopping"
        finish "$started"
        return 1
    fi
    export RAY_ADDRESS=127.0.0.1:$RAY_PORT
    if [ -n "${DRY_RUN:-}" ]; then
        warm "$@"
    else
        warm "$@" 2>&1 | grep --line-buffered -E '^(\[|warm:|clozemath: error)' &  # into chain.log, warnings aside
    fi
    for name in "$@"; do
        echo "chain: [$(date +%T)] slice $name"
        slice_run "$name" "${SESSION_S:+$((SESSION_S - (SECONDS - started)))}" || echo "chain: slice $name failed"
    done
    [ ${#REPORTS[@]} -eq 0 ] || wait "${REPORTS[@]}"
    finish "$started"
}

finish() {
    echo "chain: done in $((SECONDS - $1)) s"
    [ -n "${DRY_RUN:-}" ] || kill "${GPU_LOG:-}" 2> /dev/null
    # `ray stop` ends every Ray process of the machine: right on the lease's own GPU machine, wrong on a shared one
    [ -n "${DRY_RUN:-}" ] || [ "${RAY_STOP:-1}" = 0 ] || ray stop > /dev/null 2>&1
    touch "$WORK/done"
}

follow() {  # until the chain is done or $1 seconds passed, or at once when no chain runs here; then where it is
    local until=$((SECONDS + ${1:-480})) pid
    if [ ! -e "$WORK/chain.log" ]; then  # a bare machine: waiting would only spend device time
        echo "chain: none on this machine (a fresh one: the machine that ran it went back); start what is left again"
        return 3
    fi
    pid=$(cat "$WORK/chain.pid" 2> /dev/null)
    while [ ! -e "$WORK/done" ] && [ $SECONDS -lt "$until" ]; do
        if [ -n "$pid" ] && ! kill -0 "$pid" 2> /dev/null; then
            echo "chain: its process $pid ended without finishing (killed?); what it finished is collected below"
            break
        fi
        sleep 10
    done
    tail -n 20 "$WORK/chain.log"
    for log in "$WORK"/*/driver.log; do
        [ -e "$log" ] && { echo "--- $log"; grep -E "trial |finished|failed|error" "$log" | tail -n 6; }
    done
    [ -z "${OUT:-}" ] || collect > /dev/null 2>&1  # what has finished comes back with every wait
    if [ -e "$WORK/done" ]; then echo "chain: done"
    elif [ -n "$pid" ] && ! kill -0 "$pid" 2> /dev/null; then echo "chain: stopped"; return 4
    else echo "chain: running"; fi
}

snapshot() {  # a consistent copy of a slice's store, which its grid may be writing to (WAL mode)
    rm -f "$1/snapshot.db"
    "$PY" -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" \
        "$1/mlruns.db" "$1/snapshot.db"
}

collect() {  # into $OUT: a tarball a slice (< 16 MiB), the chain's log and the GPU log; safe while the chain runs
    local into=${OUT:?set OUT} dir name experiment decoding logs
    cp "$WORK/chain.log" "$into/chain.log" 2> /dev/null
    gzip -c "$WORK/gpu.csv" > "$into/gpu.csv.gz" 2> /dev/null
    for dir in "$WORK"/*/; do
        dir=${dir%/}
        name=$(basename "$dir")
        [ -e "$dir/experiment" ] && [ -e "$dir/mlruns.db" ] && snapshot "$dir" || continue
        for _ in $(seq 60); do  # its driver done: its report is being written (< 1 min), into the same folder
            [ -e "$dir/driven" ] && [ ! -e "$dir/done" ] || break
            sleep 2
        done
        if [ ! -e "$dir/driven" ]; then  # still running: what it has finished, reported from the copy
            read -r experiment decoding < "$dir/experiment"
            report "$experiment" "sqlite:///$dir/snapshot.db" "$decoding" "$dir/report" > "$dir/report.log" 2>&1
        fi
        gzip -c "$dir/snapshot.db" > "$dir/mlruns.db.gz"
        mapfile -t logs < <(cd "$dir" && find runs -path '*/logs/*.log' 2> /dev/null)
        (cd "$dir" && tar -czf "$into/$name.tar.gz" --ignore-failed-read report driver.log report.log mlruns.db.gz \
            "${logs[@]}" 2> /dev/null)
        if [ "$(stat -c %s "$into/$name.tar.gz")" -gt "$FILE_LIMIT" ]; then  # the store and the workers' logs stay
            (cd "$dir" && tar -czf "$into/$name.tar.gz" --ignore-failed-read report driver.log report.log 2> /dev/null)
        fi
    done
    ls -l "$into"
}

if [ -n "${SESSION_S:-}" ] && ! [[ $SESSION_S =~ ^[0-9]+$ ]]; then
    echo "slice_lease: SESSION_S=$SESSION_S: not a whole number of seconds" >&2
    exit 2
fi
case "${1:-}" in
    start)
        shift
        [ $# -gt 0 ] || { echo "usage: $0 start SLICE..." >&2; exit 2; }
        mkdir -p "$WORK"
        rm -f "$WORK/done"
        setsid nohup bash "$0" chain "$@" >> "$WORK/chain.log" 2>&1 < /dev/null &
        echo $! > "$WORK/chain.pid"
        echo "chain: started $* (log $WORK/chain.log)";;
    chain) shift; chain "$@";;
    wait) follow "${2:-480}"; exit $?;;
    collect) collect;;
    *) echo "usage: $0 start SLICE... | wait [seconds] | collect   (DRY_RUN=1 $0 chain SLICE...: the commands)" >&2
       exit 2;;
esac
