#!/usr/bin/env bash
# Runs `make STAGE` for each stage in turn (make test's stages), stops at the first that fails, and prints
# the time each took at the end, the failed one marked, with the load average; beside each time the CPU the stage's
# own processes used (core-seconds of every process it started, also those its processes left behind, e.g. a
# test's fork server: the stage runs under a subreaper that reaps them, see cpu_run) and, for a stage in the
# foreground, how busy the machine's cores were meanwhile (anything that ran, the background stages included), so
# that what a stage costs and what the cores had left stay visible.
#
#   &STAGE   starts `make STAGE` in the background at the lowest priority (nice 19: it takes the cores the
#            stages in the foreground leave idle, and slows them as little as it can), its output in
#            target/stages/STAGE.log
#   +STAGE   the same at the foreground's priority: a stage that shares the cores with the next ones as an equal
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
# cpu_run FILE CMD...: runs CMD as a child subreaper (PR_SET_CHILD_SUBREAPER), so that every process it
# starts is reaped here, also one orphaned on the way (a fork server outliving the pytest that started it,
# whose test ranks are its children); writes the CPU seconds (user + system) of all of them into FILE and
# exits with CMD's status. A process still running 30 s after CMD ended is named and left running.
CPU_RUN='
import ctypes, os, resource, subprocess, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
rc = subprocess.call(cmd)
deadline = time.monotonic() + 30
while True:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid == 0 and time.monotonic() > deadline:
        left = [p for p in os.listdir("/proc") if p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
        for p in left:
            cmdline = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            print(f"[stages] still running 30 s after {cmd[-1]} ended, left behind: pid {p}: {cmdline}", file=sys.stderr)
        break
    if pid == 0:
        time.sleep(0.05)
u = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(out, "w") as f:
    f.write(f"{u.ru_utime + u.ru_stime:.0f}\n")
sys.exit(rc if rc >= 0 else 128 - rc)
'
cpu_run() {
    python3 -c "$CPU_RUN" "$@"
}
cpu_of() {  # the seconds cpu_run wrote, or ? when it wrote none
    cat "$1" 2>/dev/null || echo "?"
}
busy_note() {  # busy-jiffies-before busy-jiffies-after seconds
    [ "$3" -gt 0 ] || return 0
    local pct=$(( ($2 - $1) * 100 / HZ / CORES / $3 ))
    echo "cores $(( pct > 100 ? 100 : pct )) % busy"
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
    '&'* | '+'*)
        name=${stage#[&+]}
        niceness=19
        [ "${stage:0:1}" = "+" ] && niceness=0
        mkdir -p "$LOGS"
        rm -f "$LOGS/$name.done"
        # Its own process group (job control), so that a failure elsewhere stops all of it; the same session,
        # so that nice applies against the foreground (the kernel's autogroups are per session).
        set -m
        rm -f "$LOGS/$name.cpu"
        { nice -n "$niceness" python3 -c "$CPU_RUN" "$LOGS/$name.cpu" $MAKE --no-print-directory "$name" </dev/null \
              >"$LOGS/$name.log" 2>&1
          echo "$? $(date +%s)" >"$LOGS/$name.done"; } &
        bg_pid[$name]=$!
        set +m
        bg_start[$name]=$t0
        echo "[stages] $name: started beside the next stages (nice $niceness), its output in $LOGS/$name.log"
        continue
        ;;
    '='*)
        name=${stage#=}
        wait "${bg_pid[$name]}"
        unset "bg_pid[$name]"
        echo "[stages] $name: its output"
        cat "$LOGS/$name.log"
        read -r rc t1 <"$LOGS/$name.done" || { rc=1; t1=$(date +%s); }
        note="cpu $(cpu_of "$LOGS/$name.cpu") s; beside the stages above, then waited for $(( $(date +%s) - t0 )) s"
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
    rm -f "$LOGS/$stage.cpu"
    cpu_run "$LOGS/$stage.cpu" $MAKE --no-print-directory "$stage"
    rc=$?
    t=$(( $(date +%s) - t0 ))
    note="cpu $(cpu_of "$LOGS/$stage.cpu") s"
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
