#!/usr/bin/env bash
# The loom model of the landing-slot / signal / acknowledge protocol (odc-core/src/loom_model.rs): builds
# odc-core's unit tests with --cfg loom (and its loom feature, which brings the loom crate) and runs the loom_
# ones; `--no-run` only builds. The cfg is passed to odc-core alone (cargo rustc), so the build reuses the
# dependencies of make cargo-test's: about 20 core-seconds against 113 with RUSTFLAGS="--cfg loom", which
# compiled every crate again in a target folder of its own. The executable is named apart from cargo test's
# (the feature and the extra flag change its hash).
# Unoptimized, since the build is most of the time (the run takes a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
exe=$("$CARGO" rustc -p odc-core --lib --profile test --features loom --locked --message-format=json-render-diagnostics -- --cfg loom |
      python3 -c 'import json, sys
exes = [m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable")]
sys.exit("scripts/loom.sh: cargo built no test executable of odc-core") if not exes else print(exes[-1])')
if [ "${1:-}" = --no-run ]; then
    echo "loom model: $exe"
    exit 0
fi
"$exe" loom
