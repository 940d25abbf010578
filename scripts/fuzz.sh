#!/usr/bin/env bash
# Coverage-guided fuzzing of every decoder of bytes a peer, the store or a user's file hands ODC (the targets in
# fuzz/, docs/fuzzing.md), on stable Rust: libFuzzer (the libfuzzer-sys crate) with rustc's SanitizerCoverage
# pass (8-bit counters, PC table, comparison tracing), debug assertions and overflow checks on, no sanitizer
# runtime (those need nightly); the Python targets (fuzz/python/TARGET.py: the rejoin layout's reader) run under
# atheris, libFuzzer for Python, in .venv (PYTHON). Builds the targets, runs each for --seconds, fails on any crash,
# timeout (an input that takes more than --timeout seconds) or out-of-memory, and prints a line per target.
#
#   scripts/fuzz.sh [--seconds S] [--jobs J] [--timeout T] [--record FILE] [--no-build] [TARGET...]
#
#   --seconds S   each target's run (default 25)
#   --jobs J      targets run at once (default 1)
#   --record FILE writes each run's figures into FILE (fuzz/campaigns.json: target, seconds, executions, coverage
#                 (libFuzzer's last edges and features), corpus size, crashes, commit, date, command)
#   --no-build    runs the binaries built last time
#   TARGET...     only these (default: every target, in TARGETS order)
#
# Corpora grow in target/fuzz-corpus/TARGET (seeded from fuzz/corpus/TARGET, which stays as committed); a
# failing input lands in target/fuzz-artifacts/TARGET/ — replay it with
# `target/fuzz-build/<host triple>/fuzz/TARGET FILE`, or commit it to fuzz/regressions/TARGET/ so that
# `cargo test -p odc-fuzz` replays it (a Python target's: `.venv/bin/python fuzz/python/TARGET.py FILE`, and
# odc-py/tests/test_rejoin_layout.py replays its folders). A target with a dictionary (fuzz/dicts/TARGET.dict:
# tokens of its format) mutates with it.
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
TARGETS=(slot_header control_words claims fabric_imm store_values gpu_descriptors pack_input membership node_cache
         node_sums rejoin_layout)
PYTHON=${PYTHON:-.venv/bin/python}
is_python() { [ -f "fuzz/python/$1.py" ]; }
seconds=25 jobs=1 timeout=10 record="" build=1 chosen=()
invocation="scripts/fuzz.sh $*"
niceness=$(nice)
[ "$niceness" = 0 ] || invocation="nice -n $niceness $invocation"
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) seconds=$2; shift 2 ;;
        --jobs) jobs=$2; shift 2 ;;
        --timeout) timeout=$2; shift 2 ;;
        --record) record=$2; shift 2 ;;
        --no-build) build=0; shift ;;
        -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
        -*) echo "scripts/fuzz.sh: unknown option $1" >&2; exit 2 ;;
        *) chosen+=("$1"); shift ;;
    esac
done
[ ${#chosen[@]} -gt 0 ] && TARGETS=("${chosen[@]}")

host=$(rustc -vV | sed -n 's/^host: //p')
# A target folder of its own: beside make test's other cargo builds (make test runs this in a lane of its own)
# a shared one would make each wait for the other's lock.
export CARGO_TARGET_DIR=${ODC_FUZZ_TARGET_DIR:-target/fuzz-build}
# With --target, RUSTFLAGS reach only the code built for the target (the fuzz targets and everything they link),
# not build scripts and proc macros.
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares"
bins=$CARGO_TARGET_DIR/$host/fuzz
rust=0
for t in "${TARGETS[@]}"; do is_python "$t" || rust=1; done
if [ $build = 1 ] && [ $rust = 1 ]; then
    started=$(date +%s)
    "$CARGO" build --locked --profile fuzz --target "$host" -p odc-fuzz --features libfuzzer --bins
    echo "fuzz: built the targets in $(( $(date +%s) - started )) s"
fi

out=target/fuzz-runs
mkdir -p "$out"
# The commit the runs test ('+': with changes to tracked files), taken before they start.
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit+="+"
run_one() {  # target: runs it, writes its figures into $out/target.json
    local t=$1 log=$out/$1.log
    local corpus=target/fuzz-corpus/$t artifacts=target/fuzz-artifacts/$t/ scratch=target/fuzz-scratch/$t
    mkdir -p "$corpus" "$artifacts" "$scratch"
    local cmd=("$bins/$t")
    is_python "$t" && cmd=("$PYTHON" "fuzz/python/$t.py")
    cmd+=("$corpus" "fuzz/corpus/$t" -max_total_time="$seconds" -timeout="$timeout"
          -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 -artifact_prefix="$artifacts")
    [ -f "fuzz/dicts/$t.dict" ] && cmd+=(-dict="fuzz/dicts/$t.dict")
    local rc=0 began
    began=$(date +%s)
    ODC_FUZZ_SCRATCH=$scratch "${cmd[@]}" >"$log" 2>&1 || rc=$?
    local took=$(( $(date +%s) - began ))
    stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -1; }
    local execs slowest rss crashes edges features
    execs=$(stat number_of_executed_units) slowest=$(stat slowest_unit_time_sec) rss=$(stat peak_rss_mb)
    crashes=$(find "$artifacts" -type f | wc -l)
    # Coverage as libFuzzer last reported it ("cov: EDGES ft: FEATURES").
    read -r _ edges _ features <<<"$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -1)"
    printf '{"target": "%s", "seconds": %d, "executions": %s, "corpus_size": %d, "crashes": %d, "exit": %d, %s}\n' \
        "$t" "$took" "${execs:-0}" "$(find "$corpus" -type f | wc -l)" "$crashes" "$rc" \
        "\"slowest_input_s\": ${slowest:-0}, \"peak_rss_mb\": ${rss:-0}, \"coverage\": ${edges:-0}, \"features\": ${features:-0}" \
        >"$out/$t.json"
    rm -rf "$scratch"
    if [ "$rc" != 0 ] || [ "$crashes" != 0 ]; then
        echo "fuzz: $t FAILED (exit $rc, $crashes inputs in $artifacts); the end of $log:" >&2
        tail -40 "$log" >&2
        return 1
    fi
}

status=0
pids=()
for t in "${TARGETS[@]}"; do
    if is_python "$t"; then
        "$PYTHON" -c 'import atheris' 2>/dev/null || { echo "fuzz: $t needs atheris in $PYTHON (make setup)" >&2; exit 2; }
    else
        [ -x "$bins/$t" ] || { echo "fuzz: no binary $bins/$t (build first)" >&2; exit 2; }
    fi
    run_one "$t" &
    pids+=($!)
    if [ ${#pids[@]} -ge "$jobs" ]; then
        wait "${pids[0]}" || status=1
        pids=("${pids[@]:1}")
    fi
done
for p in "${pids[@]}"; do wait "$p" || status=1; done

# The figures, one line per target (and into --record).
python3 - "$out" "$seconds" "$record" "$commit" "$invocation" "${TARGETS[@]}" <<'PY'
import datetime, json, sys
out, seconds, record, commit, invocation, targets = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]
rows = [json.load(open(f"{out}/{t}.json")) for t in targets]
for r in rows:
    print(f"fuzz: {r['target']:<16} {r['seconds']:>5} s {r['executions']:>11} executions  cov {r['coverage']:>5}  corpus {r['corpus_size']:>5}  "
          f"crashes {r['crashes']}  slowest input {r['slowest_input_s']} s  peak {r['peak_rss_mb']} MB")
if record:
    try:
        doc = json.load(open(record))
    except FileNotFoundError:
        doc = {"campaigns": []}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    old = {c["target"]: c for c in doc["campaigns"]}
    for r in rows:
        old[r["target"]] = {
            "target": r["target"], "seconds": r["seconds"], "executions": r["executions"],
            "coverage": r["coverage"], "features": r["features"],
            "corpus_size": r["corpus_size"], "crashes": r["crashes"],
            "slowest_input_s": r["slowest_input_s"], "peak_rss_mb": r["peak_rss_mb"],
            "commit": commit, "date": date, "command": invocation,
        }
    order = {t: i for i, t in enumerate(["slot_header", "control_words", "claims", "fabric_imm", "store_values", "gpu_descriptors", "pack_input", "membership", "node_cache", "node_sums", "rejoin_layout"])}
    doc["campaigns"] = sorted(old.values(), key=lambda c: order.get(c["target"], 99))
    with open(record, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"fuzz: figures written to {record} (scripts/fuzz-table.py renders them into docs/fuzzing.md)")
PY
exit $status
