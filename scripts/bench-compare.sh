#!/usr/bin/env bash
# scripts/bench-compare.sh [-n RUNS] BASE [HEAD]
#
# What a performance-touching change runs: the release bench binaries of two
# commits (HEAD defaults to the working tree, uncommitted changes included;
# `.` names it too; a folder holding the two binaries, built elsewhere,
# is taken as it is), each built from its own export of the tree into its own
# target folder under target/bench-compare/<commit>/ (kept, so a second
# comparison against the same commit builds nothing), run alternately RUNS
# times (default 5; odd rounds BASE first, even rounds HEAD first) so that
# the machine's load hits both alike:
#
#   gather_perf                 -g 2 -b 64K -e 64M -f 4 -n 20 -w 5  (f32)
#   scatter_accumulate_perf     -g 2 -b 64K -e 64M -f 4 -n 30 -w 5  (f32, bf16)
#
# It prints, per primitive, dtype and size, the median busbw of each side and
# HEAD/BASE (for gather the better of out-of-place and in-place, as %ceil
# takes it), the median 64 KiB latency of each primitive (ratio BASE/HEAD, so
# above 1 is faster here too), gather's 64 MiB at its best (the slowest
# rank's fastest iteration) against the same runs' all-ranks streaming-copy
# ceiling taken the same way, and the load average before and after.
# `spread` is the wider of the two sides' (max - min) / median over the
# runs: a ratio inside it is not a difference the machine showed. A row
# below 0.9 prints a `warning:` line (saying so where its runs spread more
# than 20 %). The JSON of every run stays in
# target/bench-compare/runs-<base>-<head>/.
set -euo pipefail

runs=5
while getopts "n:h" opt; do
    case $opt in
        n) runs=$OPTARG ;;
        *) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 [-n RUNS] BASE [HEAD]" >&2
    exit 2
fi
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "error: -n wants a positive count, got '$runs'" >&2; exit 2; }

root=$(git rev-parse --show-toplevel)
cd "$root"
out=$root/target/bench-compare
mkdir -p "$out"
python=${PYTHON:-}
if [[ -z $python ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
bins=(gather_perf scatter_accumulate_perf)

# build REF -> prints the folder holding that side's binaries
build() {
    local ref=$1 name src dir
    if [[ -d $ref && -x $ref/${bins[0]} && -x $ref/${bins[1]} ]]; then
        (cd "$ref" && pwd)
        return
    fi
    if [[ $ref == . ]]; then
        name=worktree
        src=$root
    else
        name=$(git rev-parse --verify --quiet "$ref^{commit}") || {
            echo "error: '$ref' is not a commit here" >&2
            return 1
        }
        src=$out/$name/src
    fi
    dir=$out/$name
    if [[ $name != worktree && -x $dir/bin/${bins[1]} ]]; then
        echo "$dir/bin"
        return
    fi
    mkdir -p "$dir/bin"
    if [[ $name != worktree ]]; then
        rm -rf "$src"
        mkdir -p "$src"
        git archive "$name" | tar -x -C "$src"
    fi
    echo "building ${ref} ($name) ..." >&2
    local args=()
    for b in "${bins[@]}"; do args+=(--bin "$b"); done
    (cd "$src" && CARGO_TARGET_DIR=$dir/target cargo build --release --locked -q -p odc-benches "${args[@]}") >&2
    for b in "${bins[@]}"; do cp "$dir/target/release/$b" "$dir/bin/$b"; done
    echo "$dir/bin"
}

base_ref=$1
head_ref=${2:-.}
base_bin=$(build "$base_ref")
head_bin=$(build "$head_ref")
label() {
    if [[ $1 == . ]]; then
        echo worktree
    elif [[ -d $1 ]]; then
        basename "$(cd "$1" && pwd)"
    else
        git rev-parse --short "$1^{commit}"
    fi
}
base_label=$(label "$base_ref")
head_label=$(label "$head_ref")
[[ $head_label == worktree && -n $(git status --porcelain --untracked-files=no) ]] && head_label="worktree($(git rev-parse --short HEAD)+changes)"
runs_dir=$out/runs-${base_label}-${head_label//[^A-Za-z0-9]/_}
rm -rf "$runs_dir"
mkdir -p "$runs_dir"

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
one_round() { # SIDE BIN ROUND
    local side=$1 bin=$2 round=$3
    "$bin/gather_perf" -g 2 -b 64K -e 64M -f 4 -n 20 -w 5 -J "$runs_dir/gather-f32-$side-$round.json" >/dev/null
    for dt in f32 bf16; do
        "$bin/scatter_accumulate_perf" -g 2 -b 64K -e 64M -f 4 -n 30 -w 5 -d "$dt" \
            -J "$runs_dir/scatter-$dt-$side-$round.json" >/dev/null
    done
}
for ((round = 1; round <= runs; round++)); do
    echo "round $round/$runs" >&2
    if ((round % 2)); then
        one_round base "$base_bin" "$round"
        one_round head "$head_bin" "$round"
    else
        one_round head "$head_bin" "$round"
        one_round base "$base_bin" "$round"
    fi
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

"$python" - "$runs_dir" "$base_label" "$head_label" "$runs" "$load_before" "$load_after" <<'EOF'
import glob, json, os, statistics, sys

runs_dir, base, head, runs, load_before, load_after = sys.argv[1:]
data = {}  # (prim, dtype, size, metric) -> side -> [values]
for path in sorted(glob.glob(os.path.join(runs_dir, "*.json"))):
    prim, dtype, side, _ = os.path.basename(path)[:-5].split("-")
    for row in json.load(open(path))["rows"]:
        busbw = row["busbw"]
        if "in_place" in row:
            busbw = max(busbw, row["in_place"]["busbw"])
        time_us = row["time_us"]
        if "in_place" in row:
            time_us = min(time_us, row["in_place"]["time_us"])
        size = row["size"]
        data.setdefault((prim, dtype, size, "busbw"), {}).setdefault(side, []).append(busbw)
        if size == 65536:
            data.setdefault((prim, dtype, size, "lat"), {}).setdefault(side, []).append(time_us)
        if prim == "gather":
            data.setdefault((prim, dtype, size, "ceil"), {}).setdefault(side, []).append(row["ceiling_busbw"])
            # %ceil's side: the operation at its best, as the ceiling is
            # taken (binaries from before best_busbw: their mean busbw).
            data.setdefault((prim, dtype, size, "best"), {}).setdefault(side, []).append(row.get("best_busbw", busbw))

def fmt_size(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"

med = statistics.median
print(f"# bench-compare: BASE {base}, HEAD {head}, {runs} alternating runs, shm, 2 ranks; medians")
print(f"# load average before {load_before}, after {load_after}")
print(f"{'row':<34} {'BASE':>10} {'HEAD':>10} {'HEAD/BASE':>10} {'spread':>7}")
warnings = []
for key in sorted(data, key=lambda k: (k[3] != "busbw", k[0], k[1], k[2])):
    prim, dtype, size, metric = key
    if metric in ("ceil", "best"):
        continue
    sides = data[key]
    b, h = med(sides["base"]), med(sides["head"])
    if metric == "busbw":
        name = f"{prim} {dtype} {fmt_size(size)} busbw GB/s"
        ratio = h / b
    else:
        name = f"{prim} {dtype} 64 KiB latency us"
        ratio = b / h  # above 1: HEAD is faster
    # The wider of the two sides' (max - min) / median: a ratio inside it
    # is not a difference this machine can show.
    spread = max((max(v) - min(v)) / med(v) for v in (sides["base"], sides["head"]))
    print(f"{name:<34} {b:>10.2f} {h:>10.2f} {ratio:>10.3f} {100 * spread:>6.0f}%")
    if ratio < 0.9:
        noisy = f" (runs spread {100 * spread:.0f}%: rerun with more runs)" if spread > 0.2 else ""
        warnings.append(f"warning: {name}: HEAD at {ratio:.2f} x BASE{noisy}")
key = ("gather", "f32", 64 << 20, "busbw")
if key in data:
    for side, label in (("base", base), ("head", head)):
        got, best = med(data[key][side]), med(data[("gather", "f32", 64 << 20, "best")][side])
        ceil = med(data[("gather", "f32", 64 << 20, "ceil")][side])
        print(f"# gather 64 MiB, {label}: {got:.2f} GB/s (mean), at its best {best:.2f}: {100 * best / ceil:.0f}% of "
              f"its runs' all-ranks copy ceiling ({ceil:.2f}, at its best too)")
for w in warnings:
    print(w)
EOF
