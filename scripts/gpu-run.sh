#!/usr/bin/env bash
# ODC's GPU run, on the GPU test machine as it is: its own python3 (torch, pytest), no Rust toolchain, no
# network, the tree and a bundle made here by `make gpu-bundle` carried beside it.
#
#   scripts/gpu-run.sh BUNDLE        e.g. `timeout 420 bash scripts/gpu-run.sh .gpu-bundle`
#
# In order: the bundle is checked against the tree (its source hash); the fsdp-odc wheel is installed with pip
# --no-index --target into a scratch folder; what loads is probed (NVRTC, NVSHMEM, the CUDA driver and
# device: which file, which version); the checks that need no device run (the odc.fsdp private state of
# this torch, NVRTC compiling every kernel, NVSHMEM's symbols and layouts); then, with a GPU, the Rust GPU
# test executables (one test thread each, a timeout each) and the Python GPU tests (cuda-ipc between two
# processes on the one GPU, FSDP2 on CUDA parameters against one process, the "odc" backend on CUDA
# tensors), every one required to find its device (ODC_REQUIRE_GPU=1: a GPU test that cannot find its
# device fails).
#
# Then the single-GPU figures, each against a device-to-device copy measured in the same run (the machine
# has one GPU, so no NCCL baseline): the accumulate kernels against the copy-bound limit (gpu_kernels_perf),
# cuda-ipc gathers and scatter-accumulate between two processes on the GPU and the 64 KiB gather latency
# (python -m odc.bench.gpu); and, on its host cores, the rollout weights' trainer stall with readers reading
# against without (scripts/weights-stall.py, both in one run).
#
# Writes into $OUT (default out/gpu-run): summary.txt (one line per step, the figures and the verdict),
# probe.json, tests.log (every step's output), figures-kernels.json, figures-ipc.json,
# figures-weights-stall.json. Exit codes: 0 every step passed; 1 a step failed; 2 usage; 3 no GPU here
# (everything before the first device call passed: what a machine without a GPU can check); 4 the bundle is
# stale or incomplete, or make test's unoptimized rehearsal bundle on a GPU; 5 a library or a package the run
# needs is missing.
# PYTHON (default python3) is the interpreter whose torch and wheels are used; STEP_TIMEOUT (default 240)
# bounds each step in seconds.
set -uo pipefail
cd "$(dirname "$0")/.."

BUNDLE=${1:-}
if [ -z "$BUNDLE" ] || [ ! -d "$BUNDLE" ]; then
    echo "usage: scripts/gpu-run.sh BUNDLE  (a folder made by make gpu-bundle)" >&2
    exit 2
fi
BUNDLE=$(cd "$BUNDLE" && pwd)
OUT=${OUT:-out/gpu-run}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
SUMMARY="$OUT/summary.txt"
LOG="$OUT/tests.log"
: >"$SUMMARY"
: >"$LOG"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failed=0
skipped=0
start=$(date +%s)
# say, finish and step (one summary line per step and per skipped test): scripts/gpu-steps.sh.
. scripts/gpu-steps.sh

# --- the bundle and the tree ----------------------------------------------------------------------------
if [ ! -f "$BUNDLE/MANIFEST" ]; then
    say "the bundle $BUNDLE has no MANIFEST: make it with make gpu-bundle"
    finish 4 "stale bundle"
fi
want=$(awk '$1 == "source" {print $2}' "$BUNDLE/MANIFEST")
have=$(scripts/source-hash.sh)
if [ "$want" != "$have" ]; then
    say "the bundle was built from other sources than this tree (MANIFEST source $want, tree $have): make gpu-bundle again"
    finish 4 "stale bundle"
fi
say "bundle: $(awk '$1 == "commit" {$1 = ""; print}' "$BUNDLE/MANIFEST" | sed 's/^ //'), source $have"
while read -r kind name size; do
    [ "$kind" = file ] || continue
    if [ ! -f "$BUNDLE/$name" ] || [ "$(stat -c %s "$BUNDLE/$name")" != "$size" ]; then
        say "the bundle lacks $name or it has another size than its MANIFEST says"
        finish 4 "incomplete bundle"
    fi
done <"$BUNDLE/MANIFEST"

# --- the machine's python, the wheel --------------------------------------------------------------------
if ! command -v "$PYTHON" >/dev/null; then
    say "no $PYTHON here"
    finish 5 "missing python"
fi
wheel=$(ls "$BUNDLE"/fsdp_odc-*.whl 2>/dev/null | head -1)
if ! "$PYTHON" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$WORK/site" "$wheel" \
    >>"$LOG" 2>&1; then
    say "pip could not install $wheel into $WORK/site with $PYTHON (see tests.log)"
    finish 5 "wheel not installed"
fi
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
# The machine python's wheels (NVRTC, NVSHMEM) for the Rust test executables, where odc looks for them itself
# (its site-packages, the user's of pip install --user, every such folder on sys.path): odc's own list.
ODC_SITE_PACKAGES=$(env -u ODC_SITE_PACKAGES "$PYTHON" -c 'import os, odc; print(os.environ.get("ODC_SITE_PACKAGES", ""))' \
    2>>"$LOG")
export ODC_SITE_PACKAGES ODC_REQUIRE_GPU=1 ODC_REQUIRE_NVRTC=1 ODC_REQUIRE_NVSHMEM=1
export PYTHONDONTWRITEBYTECODE=1

# --- what loads (no device call yet) ---------------------------------------------------------------------
if ! "$PYTHON" - "$OUT/probe.json" >>"$LOG" 2>&1 <<'EOF'; then
import json, platform, sys
import torch
import odc
p = odc.probe()
p["python"] = {"version": platform.python_version(), "executable": sys.executable}
p["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
p["odc"] = {"version": odc.__version__, "from": odc.__file__}
json.dump(p, open(sys.argv[1], "w"), indent=1)
EOF
    say "odc does not import with $PYTHON (see tests.log)"
    finish 5 "odc does not import"
fi
"$PYTHON" - "$OUT/probe.json" <<'EOF' | tee -a "$SUMMARY" >&2
import json, sys
p = json.load(open(sys.argv[1]))
for part in ("python", "torch", "odc", "nvrtc", "nvshmem", "cuda"):
    facts = p[part]
    if "error" in facts:
        print(f"[gpu-run] probe   {part}: {facts['error']}")
    else:
        print(f"[gpu-run] probe   {part}: " + ", ".join(f"{k} {v}" for k, v in facts.items() if k != "tried_first"))
EOF
for lib in nvrtc nvshmem; do
    if "$PYTHON" -c "import json,sys; sys.exit('error' not in json.load(open('$OUT/probe.json'))['$lib'])"; then
        say "no $lib library found (the probe's line above says where it looked)"
        finish 5 "missing $lib"
    fi
done

# --- checks that need no device ----------------------------------------------------------------------------
step "odc.fsdp reads this torch's private FSDP2 state" \
    "$PYTHON" -c 'import odc.fsdp._private as p; p.check_fsdp2(); print(p.running_version(), "in", p.TORCH_RANGE)'
step "NVRTC compiles every kernel (cuda_compile)" "$BUNDLE/bin/cuda_compile" --test-threads=1
step "the figures' benchmark imports (odc.bench.gpu)" "$PYTHON" -c 'import odc.bench.gpu'
step "the kernel benchmark starts (gpu_kernels_perf --help)" "$BUNDLE/bin/gpu_kernels_perf" --help
step "NVSHMEM's symbols and layouts (nvshmem_bindings)" "$BUNDLE/bin/nvshmem_bindings" --test-threads=1
# -p no:asyncio: a pytest-asyncio in the python that runs this warns at configure time, and the project's
# filterwarnings = error makes that warning end pytest before it collects anything (as pytest-torch211 does).
step "the Python GPU tests collect (pytest --collect-only)" \
    "$PYTHON" -m pytest -q --collect-only -p no:cacheprovider -p no:asyncio -m gpu -o addopts="--strict-markers" \
    odc-py/tests/test_device.py odc-py/tests/test_backend_device.py
if [ "$failed" -ne 0 ]; then
    finish 1 "a check before the first device call failed"
fi

# --- the device ------------------------------------------------------------------------------------------------
if ! "$PYTHON" -c "import json,sys; sys.exit('error' in json.load(open('$OUT/probe.json'))['cuda'])"; then
    finish 3 "no GPU here: every check before the first device call passed"
fi
# make test's rehearsal bundle (scripts/gpu-bundle.sh --test-build) is unoptimized: the figures it would time are not
# the release build's, so it never runs on a device.
if [ "$(awk '$1 == "profile" {print $2}' "$BUNDLE/MANIFEST")" = test-build ]; then
    say "this bundle is make test's rehearsal bundle (profile test-build, unoptimized): make gpu-bundle builds the one to run"
    finish 4 "rehearsal bundle"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | sed 's/^/[gpu-run] nvidia-smi: /' | tee -a "$SUMMARY" >&2

step "CUDA kernels bit for bit against the CPU (cuda_exact)" "$BUNDLE/bin/cuda_exact" --test-threads=1 --show-output
step "block-scaled quantise / dequantise kernels bit for bit against the CPU (cuda_quant)" "$BUNDLE/bin/cuda_quant" \
    --test-threads=1 --show-output
step "odc-kernels unit tests on the device (cuda::)" "$BUNDLE/bin/odc_kernels-lib" --test-threads=1 --show-output cuda::
step "the driver calls against the headers (cuda_driver_bindings)" "$BUNDLE/bin/cuda_driver_bindings" --test-threads=1 --show-output
step "device memory shared between processes (gpu_device)" "$BUNDLE/bin/gpu_device" --test-threads=1 --show-output
step "the CUDA data plane (gpu_plane)" "$BUNDLE/bin/gpu_plane" --test-threads=1 --show-output
step "engines on the GPU transports (gpu_engine)" "$BUNDLE/bin/gpu_engine" --test-threads=1 --show-output
step "odc-core unit tests on the device (gpu::, plane::)" "$BUNDLE/bin/odc_core-lib" --test-threads=1 --show-output gpu:: plane::cuda plane::nvshmem
step "Python GPU tests (cuda-ipc, FSDP2 on CUDA, the backend on CUDA)" \
    "$PYTHON" -m pytest -q -rs -p no:cacheprovider -p no:asyncio -m gpu -o addopts="--strict-markers -ra" \
    odc-py/tests/test_device.py odc-py/tests/test_backend_device.py

# --- single-GPU figures, each against a device-to-device copy in the same run ----------------------------------
step "figures: the accumulate kernels against the copy (gpu_kernels_perf)" \
    "$BUNDLE/bin/gpu_kernels_perf" -b 16M -e 256M -f 4 -n 20 -w 5 --json "$OUT/figures-kernels.json"
step "figures: cuda-ipc gather, scatter-accumulate, 64 KiB latency against the copy (odc.bench.gpu)" \
    "$PYTHON" -m odc.bench.gpu --json "$OUT/figures-ipc.json"
# The rollout weights' trainer stall with two readers reading continuously, on this machine's spare host cores (the
# 2-core development host cannot measure it: six processes on two cores).
step "figures: the trainer's step with 2 weight readers reading against without (scripts/weights-stall.py)" \
    "$PYTHON" scripts/weights-stall.py --phases 8 --steps 25 --json "$OUT/figures-weights-stall.json"
if [ -f "$OUT/figures-weights-stall.json" ]; then
    "$PYTHON" - "$OUT/figures-weights-stall.json" <<'EOF' | tee -a "$SUMMARY" >&2
import json, sys
d = json.load(open(sys.argv[1]))
ratios = ", ".join(f"rank {r['rank']} {r['ratio']:.3f} ({r['idle_ms']:.2f} / {r['reading_ms']:.2f} ms)" for r in d["ranks"])
print(f"[gpu-run] figure  weights stall, 2 readers reading continuously: step with / without: {ratios}; "
      f"{d['cores']} cores, load average {d['load_before'][0]:.2f} -> {d['load_after'][0]:.2f}")
EOF
fi
for f in figures-kernels figures-ipc; do
    [ -f "$OUT/$f.json" ] || continue
    "$PYTHON" - "$OUT/$f.json" <<'EOF' | tee -a "$SUMMARY" >&2
import json, sys
data = json.load(open(sys.argv[1]))
if isinstance(data, list):  # gpu_kernels_perf
    for r in data:
        ks = ", ".join(f"{k['kernel']} {k['fraction_of_copy_limit']:.2f} of the copy-bound limit" for k in r["kernels"])
        print(f"[gpu-run] figure  {r['bytes'] >> 20} MiB: copy {r['copy_gbs_read_plus_written']:.0f} GB/s "
              f"(read + written); {ks}")
else:
    for v in data["verdicts"]:
        print(f"[gpu-run] figure  {v}")
EOF
done
if [ "$failed" -ne 0 ]; then
    finish 1 "a GPU test or figure failed"
fi
if [ "$skipped" -ne 0 ]; then
    finish 0 "every GPU test that ran passed, $skipped skipped (each named above); figures in summary.txt and figures-*.json"
fi
finish 0 "every GPU test passed, none skipped; figures in summary.txt and figures-*.json"
