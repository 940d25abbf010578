#!/usr/bin/env bash
# Runs `make STAGE` for each stage in turn (make test's stages), stops at the first that fails, and prints
# the time each took at the end, the failed one marked, with the load average; beside each time the CPU the stage's
# own processes used (core-seconds, from the shell's `times` of their process tree) and, for a stage in the
# foreground, how busy the machine's cores were meanwhile (anything that ran, the background stages included), so
# that what a stage costs and what the cores had left stay visible.
#
#   &STAGE   starts `make STAGE` in the background at the lowest priority (nice 19: it takes the cores the
#            stages in the foreground leave idle, and slows them as little as it can), its output in
#            target/stages/STAGE.log
#   =STAGE   waits for that background stage, then prints its output; its failure stops the run here
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
LOGS=target/stages
declare -a rows
declare -A bg_pid bg_start
status=0
start=$(date +%s)

row() {  # name seconds [note]
    rows+=("$(printf '%-18s %6d s%s' "$1" "$2" "${3:+  $3}")")
}

HZ=$(getconf CLK_TCK)
CORES=$(nproc)
busy() {  # the machine's busy jiffies so far (user, nice, system, irq, softirq, steal)
    awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat
}
children_cpu() {  # seconds of user + system CPU in the second line of a `times` output (the children's)
    awk 'NR == 2 {
        s = 0
        for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); s += a[1] * 60 + a[2] }
        printf "%d", s + 0.5
    }' "$1" 2>/dev/null || echo "?"
}
busy_note() {  # busy-jiffies-before busy-jiffies-after seconds
    [ "$3" -gt 0 ] || return 0
    echo "cores $(( ($2 - $1) * 100 / HZ / CORES / $3 )) % busy"
}
busy_start=$(busy)

stop_background() {
    for name in "${!bg_pid[@]}"; do
        kill -TERM -- "-${bg_pid[$name]}" 2>/dev/null
        wait "${bg_pid[$name]}" 2>/dev/null
        row "$name" "$(( $(date +%s) - bg_start[$name] ))" "stopped (a stage before it failed)"
    done
}

for stage in "$@"; do
    t0=$(date +%s)
    case "$stage" in
    '&'*)
        name=${stage#&}
        mkdir -p "$LOGS"
        rm -f "$LOGS/$name.done"
        # Its own process group (job control), so that a failure elsewhere stops all of it; the same session,
        # so that nice applies against the foreground (the kernel's autogroups are per session).
        set -m
        { nice -n 19 $MAKE --no-print-directory "$name" </dev/null >"$LOGS/$name.log" 2>&1
          rc=$?
          times >"$LOGS/$name.times"
          echo "$rc $(date +%s)" >"$LOGS/$name.done"; } &
        bg_pid[$name]=$!
        set +m
        bg_start[$name]=$t0
        echo "[stages] $name: started beside the next stages (nice 19), its output in $LOGS/$name.log"
        continue
        ;;
    '='*)
        name=${stage#=}
        wait "${bg_pid[$name]}"
        unset "bg_pid[$name]"
        echo "[stages] $name: its output"
        cat "$LOGS/$name.log"
        read -r rc t1 <"$LOGS/$name.done" || { rc=1; t1=$(date +%s); }
        note="cpu $(children_cpu "$LOGS/$name.times") s; beside the stages above, then waited for $(( $(date +%s) - t0 )) s"
        if [ "$rc" -ne 0 ]; then
            row "$name" "$(( t1 - bg_start[$name] ))" "FAILED (exit $rc), $note"
            status=$rc
            break
        fi
        row "$name" "$(( t1 - bg_start[$name] ))" "$note"
        continue
        ;;
    esac
    mkdir -p "$LOGS"
    b0=$(busy)
    ( $MAKE --no-print-directory "$stage"; rc=$?; times >"$LOGS/$stage.times"; exit $rc )
    rc=$?
    t=$(( $(date +%s) - t0 ))
    note="cpu $(children_cpu "$LOGS/$stage.times") s"
    cores=$(busy_note "$b0" "$(busy)" "$t")
    note+=${cores:+, $cores}
    if [ "$rc" -ne 0 ]; then
        row "$stage" "$t" "FAILED (exit $rc), $note"
        status=$rc
        break
    fi
    row "$stage" "$t" "$note"
done
stop_background
echo
echo "== make test: time per stage (load average now: $(cut -d' ' -f1-3 /proc/loadavg)) =="
for r in "${rows[@]}"; do
    echo "$r"
done
total=$(( $(date +%s) - start ))
printf '%-18s %6d s  %s\n' "total" "$total" "$(busy_note "$busy_start" "$(busy)" "$total") ($CORES cores)"
exit "$status"
