#!/usr/bin/env bash
# Builds and runs ODC's GPU tests where a GPU is present.
#   scripts/gpu-check.sh                 on a machine without a GPU: says so, exits 0
#   scripts/gpu-check.sh --require-gpu   ... exits 1 instead
# With a GPU it runs the odc-kernels and odc-core tests, then the Python device
# tests (odc-py/tests/test_device.py, test_fsdp.py, test_backend_device.py) with
# ODC_REQUIRE_GPU=1 (a GPU test that cannot find its device fails, not skips) and
# ODC_REQUIRE_NVRTC=1 / ODC_REQUIRE_NVSHMEM=1 (the wheels `make setup` installs),
# then `odc-bench primitives` against nccl on every GPU of the machine (one rank
# per GPU, so it needs two; tables in out/gpu-primitives.{json,png}).
set -euo pipefail
cd "$(dirname "$0")/.."

require=0
for arg in "$@"; do
    case "$arg" in
        --require-gpu) require=1 ;;
        -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument $arg" >&2; exit 2 ;;
    esac
done

log() { printf '[gpu-check] %s\n' "$*"; }

# The driver library is what every GPU test needs first; nvidia-smi is a
# convenience for the report, not a requirement.
have_driver() {
    ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' && return 0
    local d
    for d in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }} /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/lib/wsl/lib; do
        [ -e "$d/libcuda.so.1" ] && return 0
    done
    return 1
}
if ! have_driver; then
    log "no GPU here: no CUDA driver library (libcuda.so.1) on this machine; GPU tests not run"
    log "(the CPU-side GPU checks - NVRTC compiles, NVSHMEM symbols and layouts - run under 'make test')"
    exit $((require))
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader | sed 's/^/[gpu-check] GPU: /'
fi

export ODC_REQUIRE_GPU=1 ODC_REQUIRE_NVRTC=1 ODC_REQUIRE_NVSHMEM=1
log "running: cargo test -p odc-kernels -p odc-core (GPU tests required to find a device)"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
set +e
cargo test -p odc-kernels -p odc-core -- --nocapture 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
set -e
log "GPU tests that ran:"
grep -E '^test (accumulate_matches|cast_matches|bad_device_buffers|kernels_without_a_device|probe_|every_symbol|repr_c_types|gpu::|gpu_device_|plane::cuda::|plane::nvshmem::|cuda_plane_|gpu_engine_|driver_calls_match)' "$out" | sed 's/^/[gpu-check]   /' || true
if grep -q '^SKIPPED' "$out"; then
    log "skipped:"
    grep '^SKIPPED' "$out" | sed 's/^/[gpu-check]   /'
fi
if [ "$status" -ne 0 ]; then
    log "FAILED (cargo test exit $status)"
    exit "$status"
fi
# The Python side of cuda-ipc (odc.Engine, odc.fsdp and the "odc" backend on
# CUDA tensors), where the venv exists (make setup).
if [ -x .venv/bin/python ]; then
    log "running: pytest odc-py/tests/test_device.py test_fsdp.py test_backend_device.py (GPU tests required)"
    set +e
    .venv/bin/python -m pytest -q -rs odc-py/tests/test_device.py odc-py/tests/test_fsdp.py \
        odc-py/tests/test_backend_device.py
    status=$?
    set -e
    if [ "$status" -ne 0 ]; then
        log "FAILED (pytest exit $status)"
        exit "$status"
    fi
    # nccl takes one GPU per rank: the baseline needs two GPUs.
    gpus=$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')
    if [ "$gpus" -ge 2 ]; then
        log "running: odc-bench primitives --backend nccl -g $gpus (ODC on cuda-ipc, same GPUs)"
        mkdir -p out
        .venv/bin/python -m odc.bench primitives --backend nccl -g "$gpus" -b 64K -e 256M -d f32,bf16 \
            --in-place --json out/gpu-primitives.json --plot out/gpu-primitives.png
    else
        log "odc-bench primitives against nccl: skipped, $gpus GPU(s) (nccl needs one per rank, so two)"
    fi
else
    log "no .venv: run make setup for the Python GPU tests"
fi
log "ok"
