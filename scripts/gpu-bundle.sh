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
#
#   scripts/gpu-bundle.sh [OUT]                 the bundle the GPU machine runs (make gpu-bundle)
#   scripts/gpu-bundle.sh --test-build [OUT]    make test's rehearsal bundle: the same executables taken from the
#                       workspace's test build (`cargo test --workspace --no-run` with the features in
#                       $CARGO_TEST_FEATURES, which make test has just built: nothing is compiled again), unoptimized;
#                       its MANIFEST says `profile test-build` and scripts/gpu-run.sh refuses to run its device steps
#                       (what it times would not be the release build's figures). The release build of these
#                       sources is the wheel's (the same crates, optimized).
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=release
if [ "${1:-}" = --test-build ]; then
    PROFILE=test-build
    shift
fi
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
KERNELS_TESTS=(cuda_compile cuda_exact cuda_quant)
CORE_TESTS=(gpu_device gpu_engine gpu_plane cuda_driver_bindings nvshmem_bindings)

rm -rf "$OUT"
mkdir -p "$OUT/bin"
if [ "$PROFILE" = release ]; then
    log "building the GPU test executables (release, no debug info, no LTO) in ${TESTS_ENV[0]#*=}"
    args=(test --release --locked --no-run --message-format=json -p odc-kernels -p odc-core --lib)
    for t in "${KERNELS_TESTS[@]}" "${CORE_TESTS[@]}"; do
        args+=(--test "$t")
    done
    env "${TESTS_ENV[@]}" "$CARGO" "${args[@]}" >"$OUT/.cargo.json"
    env "${TESTS_ENV[@]}" "$CARGO" build --release --locked --message-format=json -p odc-benches --bin gpu_kernels_perf \
        >>"$OUT/.cargo.json"
else
    log "taking the GPU test executables from the workspace's test build (unoptimized: a rehearsal bundle)"
    # shellcheck disable=SC2086  # the features are words
    "$CARGO" test --workspace --locked ${CARGO_TEST_FEATURES:-} --no-run --message-format=json >"$OUT/.cargo.json"
fi
python3 - "$OUT" "${KERNELS_TESTS[*]} ${CORE_TESTS[*]}" <<'EOF'
import json, shutil, sys
out, tests = sys.argv[1], set(sys.argv[2].split())
# What the GPU machine runs: the unit tests of odc-kernels and odc-core, the test targets named above, and the
# kernel benchmark's binary (not its unit-test harness).
libs = {"odc_kernels", "odc_core"}
seen = set()
for line in open(f"{out}/.cargo.json"):
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    crate, kind, test = msg["target"]["name"].replace("-", "_"), msg["target"]["kind"], msg["profile"]["test"]
    if test and "lib" in kind and crate in libs:
        name = f"{crate}-lib"
    elif test and "test" in kind and crate in tests:
        name = crate
    elif not test and "bin" in kind and crate == "gpu_kernels_perf":
        name = crate
    else:
        continue
    if name in seen:
        sys.exit(f"two test executables named {name}")
    seen.add(name)
    shutil.copy2(msg["executable"], f"{out}/bin/{name}")
missing = sorted(({f"{c}-lib" for c in libs} | tests | {"gpu_kernels_perf"}) - seen)
if missing:
    sys.exit(f"the build made no executable for {', '.join(missing)}")
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
    echo "profile $PROFILE"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version 2>/dev/null | head -1)"
    (cd "$OUT" && find . -type f ! -name MANIFEST -printf 'file %P %s\n' | sort)
} >"$OUT/MANIFEST"
total=$(find "$OUT" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
log "$(find "$OUT" -type f | wc -l) files, $((total / 1024 / 1024)) MiB ($total bytes) in $OUT"
if [ "$total" -gt "$LIMIT" ]; then
    log "FAILED: the bundle is $total bytes, above the 48 MiB limit ($LIMIT bytes)"
    exit 1
fi
