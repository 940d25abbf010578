# ODC — the commands the README and CI use.
#   make setup          idempotent: Debian packages, .venv (uv, torch 2.15.0), odc-py installed into it
#   make setup-torch211 idempotent: .venv-torch211 (verl 0.9.1's own pins: torch 2.11.0), odc-py installed into it
#   make demo           the main job on one machine
#   make lint           module graph, the environment table, docstrings, fmt, clippy, ruff, mypy (the Python
#                       tools from the venv: make setup)
#   make docs           the docs site in site/ (mkdocs --strict, the Rust crates' cargo doc under site/rust/), opened
#                       in headless Chromium: every warning, broken link, failed request or empty page an error
#   make test           fmt, clippy, cargo tests, pytest on torch 2.15.0 and on torch 2.11.0, the docs, the GPU
#                       rehearsal, the wheel's quickstart in fresh venvs (runs both setups first; the Rust builds
#                       and the docs run beside the Python tests), and the time of each stage
#   make gpu-bundle     .gpu-bundle/: what the GPU test machine runs (scripts/gpu-run.sh), built here
#   make wheel          dist/fsdp_odc-*-cp310-abi3-manylinux_2_28_x86_64.whl, the wheel users install, checked
#   make wheel-test     the wheel in fresh venvs holding only torch (2.11.0, 2.15.0): the README's quickstart as written
#   make fuzz           every fuzz target (fuzz/, docs/fuzzing.md) for FUZZ_SECONDS (20) each; fails on any crash
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
PY := $(VENV)/bin/python
# The second torch leg: the oldest supported torch, with verl on its own pins.
PY211 := .venv-torch211/bin/python
CARGO ?= cargo
# Every interpreter the tests start (a fork server per leg, the examples, console scripts, subprocess checks)
# imports torch. Under PYTHONDONTWRITEBYTECODE=1 (the development machine's environment sets it) nothing
# kept the compiled bytecode and each one compiled torch anew: `import torch` took 7.3 s instead of 3.5 s,
# torchtitan's import 30 s instead of 10 s. make's commands keep it under target/pycache instead, beside
# nothing of the sources or the venvs (only what is imported is compiled, once per venv: compiling every
# package of both venvs up front took 144 s of setup).
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(CURDIR)/target/pycache
export CARGO_TERM_COLOR ?= never
# The libfabric transport builds against the headers of libfabric-dev (make setup installs it).
FEATURES := --features odc-core/fabric,odc-tests/fabric,odc-benches/fabric

.PHONY: help setup setup-torch211 demo test lint lint-rust lint-python docs fmt cargo-test loom rust-builds pytest \
	pytest-torch211 gpu-bundle gpu-rehearse rehearse wheel wheel-test wheel-quickstart fuzz bench clean

help:
	@echo "make setup | demo | test | lint | docs | bench | wheel | wheel-test | gpu-bundle | fuzz | clean"

setup:
	@scripts/setup.sh

setup-torch211: setup
	@scripts/setup.sh torch211

demo: setup
	@mkdir -p out
	@echo "== odc-pack: predicted bubbles, LongAlign-like lengths (lognormal median 10000, sigma 1.0, max 65536), 8 ranks, minibatch size 8 =="
	@$(VENV)/bin/odc-pack --synthetic lognormal:n=4096,median=10000,sigma=1.0,max=65536,seed=0 \
	    --world 8 --minibatch-size 8 --max-tokens 65536 --cost quadratic --compare
	@echo
	@echo "== odc-bench primitives: gloo collectives (TCP loopback) vs ODC (shared memory), 2 ranks =="
	@$(PY) -m odc.bench primitives -g 2 -b 64K -e 16M -f 4 -n 10 -w 2 --in-place --plot out/primitives.png
	@echo
	@echo "== odc-bench train: 2 ranks, REAL COMPUTE (FSDP2, tiny Qwen2), measured vs predicted with a cost model fitted in the run =="
	@$(PY) -m odc.bench train --minibatch-size 4 --minibatches 4 --repeats 1 --plot out/train.png
	@echo
	@echo "== odc-bench imbalance: 4 ranks, EMULATED compute (sleeps), measured vs predicted speedup =="
	@$(PY) -m odc.bench imbalance --world 4 --sweep minibatch-size=2,4,8 --run-seconds 3 --minibatches 4 --plot out/imbalance.png
	@echo
	@echo "plots: out/primitives.png out/train.png out/imbalance.png"

# ruff and mypy come from the venv (make setup installs them at pinned versions). The first clippy checks every
# target with the libfabric transport; the second, what `cargo build` gives a user without libfabric-dev (the
# library and the benchmark binaries without features: the workspace's odc-py switches odc-core's fabric on).
# `make lint` runs the two halves at once: mypy (one core for about 75 s from a cold cache: it reads torch's
# sources) beside clippy, each half's output together.
lint:
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint-python lint-rust

lint-rust:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked $(FEATURES) -- -D warnings
	$(CARGO) clippy -p odc-core -p odc-benches --locked -- -D warnings

lint-python:
	@test -x $(VENV)/bin/ruff && test -x $(VENV)/bin/mypy || \
	    { echo "make lint: $(VENV)/bin/ruff or $(VENV)/bin/mypy is missing; run make setup first" >&2; exit 1; }
	python3 scripts/module-graph.py
	python3 scripts/env-check.py
	$(PY) scripts/docstring-check.py
	python3 scripts/fuzz-table.py --check
	cd odc-py && $(abspath $(VENV))/bin/ruff check python tests ../examples ../scripts
	cd odc-py && $(abspath $(VENV))/bin/mypy python

# The docs site (mkdocs.yml; docs/development.md says what each step checks): the pages with every warning an
# error (a broken link or anchor, a reference mkdocstrings cannot resolve; the configuration, errors and benchmark
# tables rendered by scripts/docs_hooks.py from the code and the committed JSON), the public Rust crates' cargo doc
# (missing docs and broken doc links are errors) copied to site/rust/, the README's measured results against the
# same JSON, and the built pages opened in headless Chromium (scripts/docs-check.py). NO_MKDOCS_2_WARNING: the
# theme's banner about its successor, printed on every build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict  # not --quiet: it hides the warnings --strict counts
	rm -rf target/doc  # only these crates' pages (an earlier cargo doc may have left others)
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --lib --locked -p odc-core -p odc-kernels -p odc-packing \
	    --features odc-core/fabric
	rm -rf site/rust && cp -r target/doc site/rust
	$(PY) scripts/docs_hooks.py --check-readme
	$(PY) scripts/docs-check.py

cargo-test:
	$(CARGO) test --workspace --locked $(FEATURES)

# The loom model of the landing-slot / signal / acknowledge protocol: odc-core's unit tests built with --cfg loom
# for that crate alone, on the dependencies cargo-test built (scripts/loom.sh).
loom:
	@scripts/loom.sh

# What make test compiles beside the Python tests (scripts/stages.sh runs it at the lowest priority while the
# Python stages use the cores; those wait on processes a good part of the time): clippy, the test executables
# of cargo-test and loom, and the GPU bundle with the wheel (dist/). cargo-test, loom, rehearse and
# wheel-quickstart then run what it built. The rehearsal's bundle takes its executables from that test build
# (--test-build: unoptimized, never run on a device; a release build of them in a target folder of its own cost
# 157 core-seconds here, which the wheel's release build of the same crates already spends once).
rust-builds: setup
	@$(MAKE) --no-print-directory lint-rust
	$(CARGO) test --workspace --locked $(FEATURES) --no-run
	@scripts/loom.sh --no-run
	@CARGO_TEST_FEATURES="$(FEATURES)" scripts/gpu-bundle.sh --test-build .gpu-bundle

# TORCHINDUCTOR_COMPILE_THREADS=1: the torch.compile tests' ranks compile in their own process. By default each
# rank starts inductor's pool of compile workers (fresh interpreters importing torch) for a handful of kernels:
# test_fsdp_compile.py took 48.6 s against 38.1 s on the 2-core machine. The compiled code is the same.
INDUCTOR_ENV := TORCHINDUCTOR_COMPILE_THREADS=1

pytest:
	$(INDUCTOR_ENV) ODC_REQUIRE_HF=1 $(PY) -m pytest --durations=15 odc-py/tests

# Only what depends on torch's version (the tests marked torch_versions) and verl, which must run here, on its
# own pins. verl's requirements bring pytest-asyncio, which warns at start-up about a setting of its own. No
# pytest cache: make test runs this leg beside the other, which keeps it.
# The Hugging Face trainers' tests run apart, with TRL on PYTHONPATH (.venv-torch211-trl, scripts/setup.sh): verl
# fails wherever TRL 1.x is importable.
pytest-torch211:
	$(INDUCTOR_ENV) ODC_REQUIRE_VERL=1 $(PY211) -m pytest -p no:asyncio -p no:cacheprovider \
	    -m "(torch_versions or verl) and not hf" --durations=15 odc-py/tests
	$(INDUCTOR_ENV) ODC_REQUIRE_HF=1 PYTHONPATH=$(CURDIR)/.venv-torch211-trl $(PY211) -m pytest -p no:asyncio \
	    -p no:cacheprovider -m "torch_versions and hf" --durations=5 odc-py/tests

# The GPU test executables and the wheel the GPU test machine runs, and its rehearsal here (scripts/gpu-rehearse.sh:
# as the machine runs it, up to the first device call).
gpu-bundle: setup
	@scripts/gpu-bundle.sh .gpu-bundle

gpu-rehearse: gpu-bundle setup-torch211
	@$(MAKE) --no-print-directory rehearse

# The rehearsal of the bundle as it is (make test builds it in rust-builds).
rehearse:
	@scripts/gpu-rehearse.sh .gpu-bundle

# The fuzz targets, coverage-guided on stable Rust (scripts/fuzz.sh: libFuzzer through libfuzzer-sys, rustc's
# SanitizerCoverage pass, debug assertions and overflow checks on; the C++ compiler comes with make setup's
# build-essential) and, for the Python decoder, under atheris in .venv (make setup): builds them, runs each for
# FUZZ_SECONDS, fails on any crash, hang or out-of-memory.
FUZZ_SECONDS ?= 20
fuzz:
	@scripts/fuzz.sh --seconds $(FUZZ_SECONDS)

# The wheel users install (scripts/wheel.sh: abi3, manylinux_2_28 by linking with zig, auditwheel's check), and
# the test of it as a user meets it (scripts/wheel-test.py: fresh venvs with only torch 2.11.0 or 2.15.0 and the
# wheel, no Rust toolchain on PATH, the README's quickstart blocks run as written).
wheel: setup
	@scripts/wheel.sh dist

wheel-test: wheel
	@$(MAKE) --no-print-directory wheel-quickstart

# The test of the wheel in dist/ as it is (make test builds it in rust-builds).
wheel-quickstart:
	@python3 scripts/wheel-test.py --wheels dist

# The stages, each timed (scripts/stages.sh prints the times at the end, also after a failure). The two pytest
# legs run at once (+pytest-torch211 beside pytest, as equals: each alone left about 40 % of the two cores idle,
# its ranks waiting on each other, on sleeps and on stragglers); the Rust builds (&rust-builds), the Python
# linters (&lint-python: mypy is one core for a minute from a cold cache) and the docs (&docs: mkdocs, cargo doc,
# a headless browser) and the fuzz targets (&fuzz: their instrumented build, about 150 core-seconds from a clean
# clone, then 11 x FUZZ_SECONDS of one core) run beside them at the lowest priority on what the legs leave idle;
# the stages that need them wait for them (=..., a failure stops the run there; the fuzz targets last).
# The rehearsal (one Python process at a time) and the wheel's fresh-venv test (needs the wheel rust-builds
# made; one torchrun of 2 ranks at a time) run at the lowest priority beside the cargo tests, which wait on
# peers, sockets and timeouts more than they compute; nothing runs beside them at their own priority (some
# bound how long a failure takes to be seen).
test:
	@scripts/stages.sh setup '&rust-builds' '&lint-python' '&docs' '&fuzz' setup-torch211 '+pytest-torch211' \
	    pytest '=pytest-torch211' '=lint-python' '=docs' '=rust-builds' '&rehearse' '&wheel-quickstart' cargo-test \
	    loom '=rehearse' '=wheel-quickstart' '=fuzz'

fmt:
	$(CARGO) fmt --all

bench:
	$(CARGO) bench -p odc-packing --bench kk
	$(CARGO) bench -p odc-benches --bench accumulate

clean:
	$(CARGO) clean
	rm -rf dist $(VENV)/.odc-py-built .venv-torch211/.odc-py-built .venv-torch211-trl site
