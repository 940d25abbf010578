#!/usr/bin/env bash
# Prints one hash of the sources the native code and the odc package are built from (Rust, Python, the
# kernels, the manifests): what make setup rebuilds odc-py on, and what a GPU bundle is checked against
# (scripts/gpu-bundle.sh writes it, scripts/gpu-run.sh compares it with the tree it runs in).
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C
find odc-py odc-core odc-kernels packing Cargo.toml Cargo.lock -type f \
    \( -name '*.rs' -o -name '*.py' -o -name '*.pyi' -o -name '*.toml' -o -name '*.lock' -o -name '*.c' \
    -o -name '*.cu' -o -name 'py.typed' \) -not -path '*/target/*' -not -path '*/__pycache__/*' -print0 \
    | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
