#!/usr/bin/env bash
# Idempotent setup: Debian packages, a uv-built .venv with pinned torch, and odc-py installed into it.
# Fast when everything is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.15.0
VENV=.venv
PY_PKGS=("torch==${TORCH_VERSION}" "transformers==5.24.0" "numpy" "pytest" "pytest-timeout" "maturin>=1.7,<2" "matplotlib" "nvidia-cuda-nvrtc-cu12" "nvidia-nvshmem-cu12"
    "ruff==0.17.6" "mypy==2.4.1")  # the linters make lint runs, pinned: a new release's rules would fail it
# The trainers the integrations are tested against (odc[verl], odc[torchtitan]) and the packages they pull,
# pinned as resolved with torch 2.15.0 (neither asks for another torch). verl 0.9.1 declares
# transformers<5.11; the project keeps transformers 5.24.0, which verl's FSDP engine runs with (the tests
# train through it), so verl itself goes in with --no-deps after its requirements (VERL_DEPS, minus that pin).
TITAN_PKGS=("torchtitan==0.3.0" "torch-checkpointing==0.1.1" "spmd-types==0.2.3" "tyro==1.0.17" "einops==0.8.2"
    "datasets==4.7.0" "tensorboard==2.21.0" "wandb==0.31.0" "torchdata==0.11.0")
VERL_DEPS=("accelerate==1.15.0" "codetiming==1.4.0" "dill==0.4.0" "hydra-core==1.3.8" "pandas==3.1.1"
    "peft==0.21.2" "pyarrow==26.0.1" "pybind11==3.1.0" "pylatexenc==2.11" "ray[default]==2.60.0"
    "tensordict==0.10.0")
NO_DEPS_PKGS=("verl==0.9.1")
DEB_PKGS=(build-essential pkg-config libfabric-dev iproute2)

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
want="$(printf '%s\n' "${PY_PKGS[@]}" "${TITAN_PKGS[@]}" "${VERL_DEPS[@]}" --no-deps "${NO_DEPS_PKGS[@]}")"
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$UV" venv -q --python python3 "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "installing Python packages (torch ${TORCH_VERSION} is large: several minutes on a cold cache)"
    "$UV" pip install -q --python "$VENV/bin/python" "${PY_PKGS[@]}" "${TITAN_PKGS[@]}" "${VERL_DEPS[@]}"
    "$UV" pip install -q --python "$VENV/bin/python" --no-deps "${NO_DEPS_PKGS[@]}"
    torch_now=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
    [ "$torch_now" = "$TORCH_VERSION" ] || { log "torch is $torch_now, expected $TORCH_VERSION"; exit 1; }
    printf '%s' "$want" >"$stamp"
fi

# --- odc-py ----------------------------------------------------------------
# Rebuild only when a Rust or Python source of the package changed.
src_hash=$(find odc-py odc-core odc-kernels packing Cargo.toml Cargo.lock -type f \
    \( -name '*.rs' -o -name '*.py' -o -name '*.pyi' -o -name '*.toml' -o -name '*.lock' -o -name '*.c' -o -name '*.cu' -o -name 'py.typed' \) \
    -not -path '*/target/*' -print0 2>/dev/null | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
built="$VENV/.odc-py-built"
if [ ! -f "$built" ] || [ "$(cat "$built")" != "$src_hash" ]; then
    log "building odc-py into $VENV"
    VIRTUAL_ENV="$PWD/$VENV" PATH="$(dirname "$UV"):$PWD/$VENV/bin:$PATH" \
        "$VENV/bin/maturin" develop --uv --release -q -m odc-py/Cargo.toml
    printf '%s' "$src_hash" >"$built"
fi
log "ready"
