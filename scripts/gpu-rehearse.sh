#!/usr/bin/env bash
# Rehearses the GPU run here, the way the GPU test machine will run it, so a lease is never spent on a run
# that could have failed before its first device call:
#   - the tree as it travels (tracked files and untracked ones git does not ignore) and the bundle beside it,
#     at most 64 MiB together, copied into a scratch folder;
#   - scripts/gpu-run.sh there under `env -i` (no cargo on PATH, no VIRTUAL_ENV), without a network
#     (`unshare -n`, loopback only), with .venv-torch211's python (torch 2.11.0+cu130 and CUDA 13's NVRTC
#     and NVSHMEM wheels, as the machine's python3 has) standing in for the machine's python3;
#   - it must pass every step up to the first device call (the Python GPU tests' collection among them, so an
#     import error in one shows here) and then stop with exit code 3 ("no GPU here"),
#     write at most 8 files to $OUT, and the command the device runs must be under 2,000 characters.
# Usage: scripts/gpu-rehearse.sh [BUNDLE] (default .gpu-bundle, made by make gpu-bundle).
set -euo pipefail
cd "$(dirname "$0")/.."

BUNDLE=${1:-.gpu-bundle}
PY=${REHEARSE_PYTHON:-$PWD/.venv-torch211/bin/python}
# The command scripts/gpu-run.sh is launched with on the device (docs/gpu.md shows it).
DEVICE_CMD='set -o pipefail; timeout 420 bash scripts/gpu-run.sh .gpu-bundle 2>&1 | tee $OUT/run.log'
LIMIT=$((64 * 1024 * 1024))

log() { printf '[gpu-rehearse] %s\n' "$*" >&2; }
fail() {
    log "FAILED: $*"
    exit 1
}

[ -f "$BUNDLE/MANIFEST" ] || fail "no bundle in $BUNDLE: run make gpu-bundle"
[ -x "$PY" ] || fail "no $PY: run make setup-torch211"
[ "${#DEVICE_CMD}" -lt 2000 ] || fail "the device command is ${#DEVICE_CMD} characters (the limit is 2,000)"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
tree="$scratch/tree"
mkdir -p "$tree" "$scratch/out"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$tree"
cp -r "$BUNDLE" "$tree/.gpu-bundle"
size=$(du -sb "$tree" | cut -f1)
log "the tree as it travels, with the bundle: $((size / 1024 / 1024)) MiB ($size bytes)"
[ "$size" -le "$LIMIT" ] || fail "$size bytes travel, above the 64 MiB limit"

log "running scripts/gpu-run.sh as the device would (env -i, no cargo, no network, torch 2.11's python)"
set +e
env -i PATH=/usr/bin:/bin HOME="$scratch" LANG=C.UTF-8 PYTHON="$PY" OUT="$scratch/out" \
    unshare -n bash -c 'ip link set lo up 2>/dev/null; cd "$1" && eval "$2"' _ "$tree" "$DEVICE_CMD"
rc=$?
set -e
files=$(find "$scratch/out" -type f | wc -l)
sed 's/^/    /' "$scratch/out/summary.txt" >&2 || true
if [ "$rc" -ne 3 ]; then
    log "tests.log, last lines:"
    tail -40 "$scratch/out/tests.log" | sed 's/^/    /' >&2 || true
    fail "gpu-run.sh exited $rc; without a GPU it must pass every step before the first device call and exit 3"
fi
[ "$files" -le 8 ] || fail "gpu-run.sh wrote $files files to \$OUT (the device brings back 8 at most)"
for must in "ok      odc.fsdp reads" "ok      NVRTC compiles" "ok      NVSHMEM's symbols" "probe   nvrtc: path" \
    "ok      the Python GPU tests collect"; do
    grep -q "$must" "$scratch/out/summary.txt" || fail "the summary lacks '$must'"
done
log "ok: every step before the first device call passed, then 'no GPU here' (exit 3); $files files in \$OUT"
