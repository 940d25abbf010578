#!/usr/bin/env bash
# Builds what ODC's GPU run needs on the GPU test machine, which has no Rust toolchain and no network,
# into .gpu-bundle/ (git-ignored; `make gpu-bundle`):
#   bin/<name>          the Rust GPU test executables of odc-kernels and odc-core and the kernel benchmark
#                       gpu_kernels_perf, release, debug info stripped, named without cargo's hashes
#                       (bin/odc_kernels-lib, bin/gpu_engine, ...)
#   fsdp_odc-*.whl      the fsdp-odc abi3 wheel (Python 3.10+) users install, as make wheel builds it into dist/
#   MANIFEST            the commit, the source hash scripts/gpu-run.sh checks the tree against, every
#                       file's size
# Refuses to finish above 48 MiB (what travels to the machine is at most 64 MiB with the tree).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-.gpu-bundle}
LIMIT=$((48 * 1024 * 1024))
CARGO=${CARGO:-cargo}
export CARGO_TERM_COLOR=never
# The test executables: optimized, without debug information or link-time optimization (their host code only
# drives the device; thin LTO made this build 184 s against 128 s without, cold on the 2-core machine), in a
# target folder of their own so that this profile does not evict the everyday builds.
TESTS_ENV=(CARGO_TARGET_DIR="${GPU_BUNDLE_TARGET:-target/gpu-bundle}" CARGO_PROFILE_RELEASE_DEBUG=0
           CARGO_PROFILE_RELEASE_STRIP=debuginfo CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16)

log() { printf '[gpu-bundle] %s\n' "$*" >&2; }

# The test targets that touch a GPU, NVRTC or NVSHMEM (the rest of the suite runs here, under make test).
KERNELS_TESTS=(cuda_compile cuda_exact)
CORE_TESTS=(gpu_device gpu_engine gpu_plane cuda_driver_bindings nvshmem_bindings)

rm -rf "$OUT"
mkdir -p "$OUT/bin"
log "building the GPU test executables (release, no debug info, no LTO) in ${TESTS_ENV[0]#*=}"
args=(test --release --locked --no-run --message-format=json -p odc-kernels -p odc-core --lib)
for t in "${KERNELS_TESTS[@]}" "${CORE_TESTS[@]}"; do
    args+=(--test "$t")
done
env "${TESTS_ENV[@]}" "$CARGO" "${args[@]}" >"$OUT/.cargo.json"
# The single-GPU kernel figures (the accumulate kernels against a device-to-device copy).
env "${TESTS_ENV[@]}" "$CARGO" build --release --locked --message-format=json -p odc-benches --bin gpu_kernels_perf >>"$OUT/.cargo.json"
python3 - "$OUT" <<'EOF'
import json, shutil, sys
out = sys.argv[1]
seen = set()
for line in open(f"{out}/.cargo.json"):
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    if not msg["profile"]["test"] and msg["target"]["name"] != "gpu_kernels_perf":
        continue
    crate = msg["target"]["name"].replace("-", "_")
    name = f"{crate}-lib" if "lib" in msg["target"]["kind"] else msg["target"]["name"]
    if name in seen:
        sys.exit(f"two test executables named {name}")
    seen.add(name)
    shutil.copy2(msg["executable"], f"{out}/bin/{name}")
print("\n".join(sorted(seen)))
EOF
rm -f "$OUT/.cargo.json"
strip --strip-debug "$OUT"/bin/*

# The wheel users install, the very file: make wheel's (scripts/wheel.sh: manylinux_2_28, checked by auditwheel),
# built into dist/ and copied here.
scripts/wheel.sh dist
cp dist/fsdp_odc-*.whl "$OUT/"

hash=$(scripts/source-hash.sh)
{
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "source $hash"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version 2>/dev/null | head -1)"
    (cd "$OUT" && find . -type f ! -name MANIFEST -printf 'file %P %s\n' | sort)
} >"$OUT/MANIFEST"
total=$(find "$OUT" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
log "$(find "$OUT" -type f | wc -l) files, $((total / 1024 / 1024)) MiB ($total bytes) in $OUT"
if [ "$total" -gt "$LIMIT" ]; then
    log "FAILED: the bundle is $total bytes, above the 48 MiB limit ($LIMIT bytes)"
    exit 1
fi
