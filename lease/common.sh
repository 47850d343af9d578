# What the lease scripts share (sourced by lease/replication_lease.sh and bench/slice_lease.sh, from the repository's
# root): `run`, a command of a chain printed with its time, then (unless DRY_RUN is set: the command printed only)
# run, its exit status and seconds printed after it.

run() {  # a command of the chain, timed into its log
    echo "[$(date +%T)] \$ $*"
    if [ -n "${DRY_RUN:-}" ]; then return 0; fi
    local started=$SECONDS
    "$@"
    local code=$?
    echo "[$(date +%T)] exit $code after $((SECONDS - started)) s"
    return $code
}
