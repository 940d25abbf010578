# The steps of scripts/gpu-run.sh (sourced by it; a test sources it alone): one summary line per step, with
# its time and outcome, and one per test that skipped in it, so a verdict never hides a skip.
# Uses SUMMARY, LOG and WORK (files and a scratch folder), STEP_TIMEOUT (seconds) and start (the run's start,
# in seconds); sets failed=1 when a step fails and counts the skipped tests in skipped.
# shellcheck shell=bash

say() { printf '[gpu-run] %s\n' "$*" | tee -a "$SUMMARY" >&2; }
finish() {
    say "verdict: $2 (exit $1) after $(($(date +%s) - start)) s"
    exit "$1"
}
# step NAME CMD...: runs CMD with its output in tests.log; one summary line with the time and the outcome, and
# one per test that skipped (a Rust test prints a SKIPPED line and passes, pytest -rs a "SKIPPED [n]" line).
step() {
    local name=$1 t0 rc line
    shift
    t0=$(date +%s)
    printf '\n===== %s: %s\n' "$name" "$*" >>"$LOG"
    timeout --kill-after=10 "$STEP_TIMEOUT" "$@" >"$WORK/step.log" 2>&1
    rc=$?
    cat "$WORK/step.log" >>"$LOG"
    while IFS= read -r line; do
        say "skipped $name: $line"
        skipped=$((skipped + 1))
    done < <(grep '^SKIPPED' "$WORK/step.log" | sort -u)
    if [ "$rc" -eq 0 ]; then
        say "ok      $name ($(($(date +%s) - t0)) s)"
    else
        [ "$rc" -eq 124 ] && rc="timeout after ${STEP_TIMEOUT} s"
        say "FAILED  $name ($(($(date +%s) - t0)) s, exit $rc): see tests.log"
        failed=1
    fi
}
