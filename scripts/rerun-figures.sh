#!/usr/bin/env bash
# Reruns exactly the benchmark files the docs' provenance check refuses, each with the command its JSON names.
#
#   scripts/rerun-figures.sh --list       the files, why each is refused, its command and estimated time; runs nothing
#   scripts/rerun-figures.sh              rerun them all, in the check's order
#   scripts/rerun-figures.sh FILE...      only these (docs/bench/x.json or bench/x.json), if the check refuses them
#   --no-build                            skip make setup and the release build (already built from this commit)
#
# The list is `python3 scripts/docs_hooks.py --stale` (scripts/docs_provenance.py): the files under docs/bench/
# and docs/scale/ whose JSON names no command and commit, a "+dirty" commit, or a provenance added after its run,
# and the files shown first (the README's rows and figure, the front page's figure) whose load average, sampled
# during the run, reached the core count. Each command is the JSON's own, with its --json / -J pointed at the file
# and its --plot at the figure the docs show; a figure drawn from several files (docs/scale.png) is redrawn after.
#
# Run it from a commit, on a quiet machine: it refuses a tree with uncommitted changes (the benchmarks' own output
# under docs/ aside, as the JSON's "+dirty" leaves it aside), builds what the commands run from that commit (make
# setup; the release benchmark binaries when a command names target/release/), and before each run waits up to
# QUIET_WAIT_S seconds (default 300) for the 1-minute load average to fall below the core count. The netns runs
# (scripts/hybrid-bench.py, scripts/cross-node-bench.py) need root. At the end it prints what the check still
# refuses and the steps left: python3 scripts/docs_hooks.py --write-readme (the README's rows), commit, make docs.
set -euo pipefail
cd "$(dirname "$0")/.."

list=false
build=true
only=()
for arg in "$@"; do
    case "$arg" in
        --list) list=true ;;
        --no-build) build=false ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "rerun-figures: unknown option $arg (see --help)" >&2; exit 2 ;;
        *) only+=("${arg#docs/}") ;;
    esac
done

stale=$(python3 scripts/docs_hooks.py --stale)
if ((${#only[@]})); then
    picked=""
    for rel in "${only[@]}"; do
        line=$(awk -F'\t' -v r="$rel" '$1 == r' <<<"$stale")
        if [[ -z "$line" ]]; then
            echo "rerun-figures: docs/$rel is not refused by the provenance check (nothing to rerun)" >&2
            exit 2
        fi
        picked+="$line"$'\n'
    done
    stale="${picked%$'\n'}"
fi
if [[ -z "$stale" ]]; then
    echo "rerun-figures: every benchmark file passes the provenance check; nothing to rerun"
    exit 0
fi

total=$(awk -F'\t' '$2 != "-" {s += $2} END {print int(s / 60 + 0.5)}' <<<"$stale")
count=$(wc -l <<<"$stale")
if $list; then
    python3 scripts/docs_hooks.py --check-provenance >&2 || true
    echo
    echo "rerun-figures: $count file(s), about $total min estimated (the check's list above gives each one's)"
    exit 0
fi

dirty=$(git status --porcelain --untracked-files=no -- ':/' ':(top,exclude)docs/bench' ':(top,exclude)docs/scale' \
    ':(top,exclude,glob)docs/*.png')
if [[ -n "$dirty" ]]; then
    echo "rerun-figures: the tree has uncommitted changes, so every result would say +dirty; commit first:" >&2
    echo "$dirty" >&2
    exit 1
fi

echo "rerun-figures: $count file(s) at commit $(git rev-parse --short=12 HEAD), about $total min estimated"
if $build; then
    make setup
fi
if $build && grep -q $'\ttarget/release/\|\t[A-Z_]*=[^ ]* target/release/' <<<"$stale"; then
    cargo build --release --locked -p odc-benches --features odc-benches/fabric --bins
fi
mkdir -p out
export PATH="$PWD/.venv/bin:$PATH"  # odc-bench, and the scripts' python3 (they import odc)
cores=$(nproc --all)
wait_s=${QUIET_WAIT_S:-300}

quiet() {
    local waited=0 load
    while :; do
        load=$(cut -d' ' -f1 /proc/loadavg)
        if awk -v l="$load" -v c="$cores" 'BEGIN {exit !(l < c)}'; then
            echo "  load average $load on $cores cores"
            return
        fi
        if ((waited >= wait_s)); then
            echo "  load average $load on $cores cores after ${wait_s} s of waiting: running anyway (a file shown" \
                 "first will be refused again)"
            return
        fi
        sleep 10
        waited=$((waited + 10))
    done
}

done_rels=()
failed=()
i=0
while IFS=$'\t' read -r rel est cmd; do
    i=$((i + 1))
    echo
    echo "[$i/$count] docs/$rel (estimated ${est} s)"
    if [[ "$cmd" == "-" ]]; then
        echo "  its JSON names no command with --json/-J: rerun it by hand" >&2
        failed+=("$rel")
        continue
    fi
    quiet
    echo "  \$ $cmd"
    start=$(date +%s)
    rc=0
    bash -c "$cmd" || rc=$?
    if ((rc == 0)); then
        echo "  done in $(($(date +%s) - start)) s"
        done_rels+=("$rel")
    else
        echo "  FAILED after $(($(date +%s) - start)) s (exit $rc)" >&2
        failed+=("$rel")
    fi
done <<<"$stale"

if ((${#done_rels[@]})); then
    while read -r cmd; do
        [[ -z "$cmd" ]] && continue
        echo
        echo "redrawing: \$ $cmd"
        bash -c "$cmd"
    done < <(python3 scripts/docs_hooks.py --redraw "${done_rels[@]}")
fi

echo
if python3 scripts/docs_hooks.py --check-provenance; then
    echo "rerun-figures: every benchmark file passes; now python3 scripts/docs_hooks.py --write-readme, commit" \
         "docs/ and README.md, and make docs"
else
    echo "rerun-figures: ${#done_rels[@]} rerun, ${#failed[@]} failed${failed[*]:+ (${failed[*]})}; the check still" \
         "refuses the files above" >&2
    exit 1
fi
