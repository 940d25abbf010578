#!/usr/bin/env bash
# Idempotent setup of one of the two Python environments make test runs, with the Debian packages and
# odc-py built into it. Fast when everything is already in place.
#
#   scripts/setup.sh           .venv: torch 2.15.0 (the newest supported torch; torchtitan 0.3.0 needs torch
#                              2.12 or newer), the linters, the docs site's tools, the NVRTC / NVSHMEM wheels
#                              the GPU checks load, torchtitan 0.3.0 with the packages it pulls, TRL 1.16.0 and
#                              accelerate 1.15.0 (fsdp-odc[hf])
#   scripts/setup.sh torch211  .venv-torch211: verl 0.9.1's `cpu` extra as verl resolves it (torch 2.11.0,
#                              transformers 5.9.0, accelerate 1.15.0, ...; no TRL: verl 0.9.1 fails beside
#                              TRL 1.x, see requirements-torch211.in), pinned in
#                              scripts/requirements-torch211.txt, plus pytest; the oldest supported torch, and
#                              verl on its own pins
set -euo pipefail
cd "$(dirname "$0")/.."

LEG=${1:-default}
case "$LEG" in
default)
    TORCH_VERSION=2.15.0
    VENV=.venv
    PY_PKGS=("torch==${TORCH_VERSION}" "transformers==5.24.0" "numpy" "pytest" "pytest-timeout" "maturin>=1.7,<2"
        "matplotlib" "nvidia-cuda-nvrtc-cu12" "nvidia-nvshmem-cu12"
        "ruff==0.17.6" "mypy==2.4.1"  # the linters make lint runs, pinned: a new release's rules would fail it
        # make wheel: zig links the extension against glibc 2.28's symbols (the manylinux_2_28 tag torch's own
        # wheels carry) on any build host; auditwheel checks the tag and the libraries the wheel needs.
        "ziglang==0.17.1" "auditwheel==6.8.2"
        "tqdm==4.70.1"  # odc-bench's progress bars (the `bench` extra)
        "atheris==3.0.0")  # make fuzz's Python target (fuzz/python/): libFuzzer for Python; 3.1 has no cp311 wheel
    # What make docs builds the site with (mkdocs --strict; griffe reads the sources, and make lint's docstring
    # check runs on it), pinned for the same reason: a new release's warnings would fail the build.
    PY_PKGS+=("mkdocs==1.6.1" "mkdocs-material==9.8.1" "pymdown-extensions==13.1.2" "mkdocstrings==1.0.8"
        "mkdocstrings-python==2.0.11" "griffe==2.4.1")
    # torchtitan 0.3.0 (fsdp-odc[torchtitan]) and the packages it pulls, pinned as resolved with torch 2.15.0
    # (it does not pin torch). verl is not here: it pins torch 2.11.0 and lives in .venv-torch211.
    PY_PKGS+=("torchtitan==0.3.0" "torch-checkpointing==0.1.1" "spmd-types==0.2.3" "tyro==1.0.17" "einops==0.8.2"
        "datasets==4.7.0" "tensorboard==2.21.0" "wandb==0.31.0" "torchdata==0.11.0")
    # fsdp-odc[hf] (odc.integrations.transformers): TRL and accelerate at the versions it was checked on, and psutil,
    # which accelerate pulls, as resolved with the packages above.
    PY_PKGS+=("trl==1.16.0" "accelerate==1.15.0" "psutil==7.2.2")
    ;;
torch211)
    TORCH_VERSION=2.11.0
    VENV=.venv-torch211
    # Compiled from scripts/requirements-torch211.in (verl[cpu]==0.9.1, pytest, pytest-timeout; the
    # command is in both files' headers).
    PY_PKGS=(-r scripts/requirements-torch211.txt)
    ;;
*)
    echo "usage: scripts/setup.sh [torch211]" >&2
    exit 2
    ;;
esac
# chromium: make docs opens the built site headless and fails on an empty page or a request that fails.
DEB_PKGS=(build-essential pkg-config libfabric-dev iproute2 chromium)

log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages -------------------------------------------------------
missing=()
for p in "${DEB_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    log "installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- uv and the venv -------------------------------------------------------
UV=$(command -v uv || true)
if [ -z "$UV" ]; then
    UV_HOME="$PWD/.tools"
    if [ ! -x "$UV_HOME/bin/uv" ]; then
        log "installing uv from PyPI into $UV_HOME"
        python3 -m pip install -q --target "$UV_HOME/lib" uv
        mkdir -p "$UV_HOME/bin"
        ln -sf "$UV_HOME/lib/bin/uv" "$UV_HOME/bin/uv"
    fi
    UV="$UV_HOME/bin/uv"
fi

stamp="$VENV/.odc-deps"
want="$(printf '%s\n' "${PY_PKGS[@]}"; [ "$LEG" = default ] || cat scripts/requirements-torch211.txt)"
if [ -x "$VENV/bin/python" ] && { [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; }; then
    log "the packages of $VENV changed: making it anew, so that nothing of the old set stays behind"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$UV" venv -q --python python3 "$VENV"
fi
if [ ! -f "$stamp" ]; then
    log "installing Python packages (torch ${TORCH_VERSION} is large: several minutes on a cold cache)"
    "$UV" pip install -q --python "$VENV/bin/python" "${PY_PKGS[@]}"
    torch_now=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
    [ "$torch_now" = "$TORCH_VERSION" ] || { log "torch is $torch_now, expected $TORCH_VERSION"; exit 1; }
    printf '%s' "$want" >"$stamp"
fi

# --- odc-py ----------------------------------------------------------------
# Rebuild only when a Rust or Python source of the package changed.
src_hash=$(scripts/source-hash.sh)
built="$VENV/.odc-py-built"
# The distribution was named odc before fsdp-odc: a venv that still holds it would hold both (two sets of
# entry points for the one package); it goes, and the package is built in again.
if "$UV" pip show -q --python "$VENV/bin/python" odc 2>/dev/null; then
    log "removing the distribution odc (now fsdp-odc) from $VENV"
    "$UV" pip uninstall -q --python "$VENV/bin/python" odc
    rm -f "$built"
fi
# Editable (the venv imports odc-py/python, the extension built into it), and built exactly as make wheel builds
# the wheel users install (scripts/wheel.sh: release, zig, manylinux_2_28): the tests run the extension users get,
# and make wheel finds it built (one release build of the crates, not two; maturin develop cannot link with zig).
if [ ! -f "$built" ] || [ "$(cat "$built")" != "$src_hash" ]; then
    log "building odc-py into $VENV"
    editable="$PWD/target/editable"
    rm -rf "$editable"
    (cd odc-py && PATH="$PWD/../.venv/bin:$PATH" ../.venv/bin/maturin pep517 build-wheel --editable -q --locked \
        --zig --compatibility manylinux_2_28 -i "$PWD/../$VENV/bin/python" -o "$editable" >/dev/null)
    "$UV" pip install -q --python "$VENV/bin/python" --no-deps --reinstall "$editable"/fsdp_odc-*.whl
    printf '%s' "$src_hash" >"$built"
fi
# TRL beside verl's environment, for the Hugging Face tests on torch 2.11 only (make pytest-torch211 puts it on
# PYTHONPATH for those tests alone): verl 0.9.1 fails whenever TRL 1.x is importable (requirements-torch211.in),
# and TRL's own requirements (accelerate, datasets, transformers) are verl's pins already.
if [ "$LEG" = torch211 ]; then
    trl_pin=$(grep -o '"trl==[^"]*"' odc-py/pyproject.toml | tr -d '"')
    overlay=.venv-torch211-trl
    if [ "$(cat "$overlay/.odc-pin" 2>/dev/null)" != "$trl_pin" ]; then
        log "installing $trl_pin into $overlay (beside $VENV, for its Hugging Face tests)"
        rm -rf "$overlay"
        "$UV" pip install -q --python "$VENV/bin/python" --no-deps --target "$overlay" "$trl_pin"
        printf '%s' "$trl_pin" >"$overlay/.odc-pin"
    fi
fi
log "ready: $VENV"
