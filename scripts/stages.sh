#!/usr/bin/env bash
# Runs `make STAGE` for each stage in turn (make test's stages), stops at the first that fails, and prints
# the time each took at the end, the failed one marked, with the load average.
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
declare -a rows
status=0
start=$(date +%s)
for stage in "$@"; do
    t0=$(date +%s)
    $MAKE --no-print-directory "$stage"
    rc=$?
    t=$(( $(date +%s) - t0 ))
    if [ "$rc" -ne 0 ]; then
        rows+=("$(printf '%-18s %6d s  FAILED (exit %d)' "$stage" "$t" "$rc")")
        status=$rc
        break
    fi
    rows+=("$(printf '%-18s %6d s' "$stage" "$t")")
done
echo
echo "== make test: time per stage (load average now: $(cut -d' ' -f1-3 /proc/loadavg)) =="
for r in "${rows[@]}"; do
    echo "$r"
done
printf '%-18s %6d s\n' "total" "$(( $(date +%s) - start ))"
exit "$status"
