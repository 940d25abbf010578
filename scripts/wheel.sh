#!/usr/bin/env bash
# Builds the fsdp-odc wheel users install (`make wheel`), into OUT (default dist/):
#   fsdp_odc-<version>-cp310-abi3-manylinux_2_28_x86_64.whl
# abi3: one wheel for CPython 3.10 and newer. manylinux_2_28, the tag torch's own wheels carry: it installs on
# glibc 2.28 and newer (RHEL 8, Ubuntu 20.04, Debian 11 onwards). The build host's glibc (2.36 here) would tag
# the wheel with its own version, which older systems refuse; zig (PyPI's ziglang, maturin --zig) links against
# glibc 2.28's symbols on any host instead, no container needed, and compiles the libfabric shim with the same
# C library headers. The release profile as it is: symbols and line tables stay in (a panic's backtrace names
# functions, files and lines); about 5 MB.
#
# Then checks what it built: `auditwheel show` must find the wheel consistent with manylinux_2_28, and the
# extension may need nothing from the system beyond glibc's own libraries: libfabric, the CUDA driver, NVRTC
# and NVSHMEM are opened with dlopen() when first used, so the wheel imports where none of them exists.
#
# The build has its own target folder (cargo's target/x86_64-unknown-linux-gnu: maturin names the target for
# zig), so it does not undo make setup's build of the same crates in target/release.
# Usage: scripts/wheel.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-dist}
TAG=manylinux_2_28
ARCH=$(uname -m)
# What a manylinux wheel may take from the system and this one does: glibc and its parts.
GLIBC_LIBS=" libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 ld-linux-x86-64.so.2 "

log() { printf '[wheel] %s\n' "$*" >&2; }
fail() {
    log "FAILED: $*"
    exit 1
}

for tool in maturin auditwheel; do
    [ -x ".venv/bin/$tool" ] || fail ".venv/bin/$tool is missing: run make setup"
done
.venv/bin/python -c 'import ziglang' 2>/dev/null || fail "zig (PyPI's ziglang) is not in .venv: run make setup"

mkdir -p "$OUT"
rm -f "$OUT"/fsdp_odc-*.whl
log "building the fsdp-odc wheel (abi3, $TAG, linked with zig) into $OUT"
PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin build --release --locked --zig --compatibility "$TAG" -q \
    -m odc-py/Cargo.toml -o "$OUT" >&2
shopt -s nullglob
wheels=("$OUT"/fsdp_odc-*-cp310-abi3-"${TAG}_${ARCH}".whl)
shopt -u nullglob
[ "${#wheels[@]}" -eq 1 ] || fail "expected one fsdp_odc-*-cp310-abi3-${TAG}_${ARCH}.whl in $OUT, found: $(ls "$OUT")"
wheel=${wheels[0]}

report=$(.venv/bin/auditwheel show "$wheel")
printf '%s\n' "$report" | sed 's/^/    /' >&2
# auditwheel wraps its lines: read the report as one line.
flat=$(printf '%s' "$report" | tr -s ' \n' '  ')
case "$flat" in
*"consistent with the following platform tag: \"${TAG}_${ARCH}\""*) ;;
*) fail "auditwheel does not find $wheel consistent with ${TAG}_${ARCH}" ;;
esac

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
.venv/bin/python -m zipfile -e "$wheel" "$scratch"
so=$(find "$scratch" -name '_odc*.so')
[ -n "$so" ] || fail "$wheel holds no odc/_odc*.so"
needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
for lib in $needed; do
    case "$GLIBC_LIBS" in
    *" $lib "*) ;;
    *) fail "the extension needs $lib from the system (allowed: glibc's own libraries,$GLIBC_LIBS)" ;;
    esac
done
log "ok: $wheel ($(stat -c %s "$wheel") bytes); the extension needs $(echo $needed | sed 's/ /, /g')"
