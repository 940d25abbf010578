#!/usr/bin/env bash
# ODC's engine primitives against Open MPI on this host, in one run:
# ROUNDS interleaved rounds of mpi_baseline (MPI_Allgather, in and out of
# place; MPI_Reduce_scatter_block), gather_perf and scatter_accumulate_perf,
# then the median busbw per size and the ODC / Open MPI ratios.
#
#   scripts/mpi-baseline.sh [-g 2] [-b 64K] [-e 64M] [-f 4] [-n 20] [-w 5]
#   ROUNDS=5 scripts/mpi-baseline.sh          (default 3 rounds)
#
# Needs Open MPI (Debian: apt-get install openmpi-bin libopenmpi-dev); not
# part of `make test`. Ranks of both run on this host over shared memory:
# Open MPI is pinned to its ob1 messaging layer with the vader shared-memory
# transport (MPI_BTL overrides), ODC runs on its shm transport. The summary
# names both, the Open MPI version and the load average seen in each round.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    echo "mpi-baseline: needs Open MPI's mpicc and mpirun (apt-get install openmpi-bin libopenmpi-dev)" >&2
    exit 2
fi
G=2 B=64K E=64M F=4 N=20 W=5
while (($#)); do
    case "$1" in
    -g) G=$2 ;; -b) B=$2 ;; -e) E=$2 ;; -f) F=$2 ;; -n) N=$2 ;; -w) W=$2 ;;
    *) echo "mpi-baseline: unknown flag $1 (use -g -b -e -f -n -w)" >&2; exit 2 ;;
    esac
    shift 2
done
ROUNDS=${ROUNDS:-3}
MPI_BTL=${MPI_BTL:-self,vader}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build --release -q --locked -p odc-benches
mpicc -O2 -o target/release/mpi_baseline benches/mpi/mpi_baseline.c
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
sweep=(-b "$B" -e "$E" -f "$F" -n "$N" -w "$W")
for r in $(seq "$ROUNDS"); do
    cut -d' ' -f1 /proc/loadavg >>"$out/load.txt"
    echo "[mpi-baseline] round $r/$ROUNDS (load average $(tail -1 "$out/load.txt"))" >&2
    mpirun -np "$G" --oversubscribe --mca pml ob1 --mca btl "$MPI_BTL" target/release/mpi_baseline "${sweep[@]}" >"$out/mpi.$r.txt"
    target/release/gather_perf -g "$G" "${sweep[@]}" -J "$out/gather.$r.json" >/dev/null
    target/release/scatter_accumulate_perf -g "$G" "${sweep[@]}" -J "$out/scatter.$r.json" >/dev/null
done
cut -d' ' -f1 /proc/loadavg >>"$out/load.txt"
version=$(mpirun --version | head -1)
python3 - "$out" "$ROUNDS" "$G" "$version" "$MPI_BTL" <<'PY'
import json, statistics, sys
out, rounds, g, version, btl = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
loads = [float(x) for x in open(f"{out}/load.txt").read().split()]
med = statistics.median
mpi, odc = {}, {}
for r in range(1, rounds + 1):
    for line in open(f"{out}/mpi.{r}.txt"):
        f = line.split()
        if f and not line.startswith("#"):
            # size type | t busbw wrong | t busbw wrong | t busbw wrong
            vals = [x for x in f if x != "|"]
            size = int(vals[0])
            wrong = int(vals[4]) + int(vals[7]) + int(vals[10])
            assert wrong == 0, f"Open MPI gave {wrong} wrong elements at {size} bytes"
            mpi.setdefault(size, []).append((float(vals[3]), float(vals[6]), float(vals[9])))
    g_rows = json.load(open(f"{out}/gather.{r}.json"))["rows"]
    s_rows = {row["size"]: row for row in json.load(open(f"{out}/scatter.{r}.json"))["rows"]}
    for row in g_rows:
        s = s_rows[row["size"]]
        assert row["wrong"] == 0 and s["wrong"] == 0 and row["in_place"]["wrong"] == 0
        odc.setdefault(row["size"], []).append((row["busbw"], row["in_place"]["busbw"], s["busbw"]))
print(f"# ODC engine (shm transport) vs {version} (pml ob1, btl {btl}: shared memory), {g} ranks on one host, "
      f"busbw GB/s, median of {rounds} interleaved rounds, #wrong = 0; load average {min(loads):.1f}-{max(loads):.1f} "
      f"(1 min, sampled before each round and at the end)")
print("| size | MPI Allgather | ODC gather | ratio | MPI Allgather in place | ODC gather in place | ratio "
      "| MPI Reduce_scatter_block | ODC scatter-accumulate | ratio |")
print("|---" * 10 + "|")
for size in sorted(odc):
    if size not in mpi:
        continue
    m = [med(x[i] for x in mpi[size]) for i in range(3)]
    o = [med(x[i] for x in odc[size]) for i in range(3)]
    label = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K"
    cells = [f"{m[i]:.2f} | {o[i]:.2f} | {o[i] / m[i]:.2f}×" for i in range(3)]
    print(f"| {label} | " + " | ".join(cells) + " |")
PY
