# ODC — the commands the README and CI use.
#   make setup   idempotent: Debian packages, .venv (uv, torch 2.15.0), odc-py installed into it
#   make demo    the main job on one machine
#   make test    fmt, clippy, cargo tests, pytest (runs setup first)
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
PY := $(VENV)/bin/python
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: help setup demo test lint fmt cargo-test loom pytest bench clean

help:
	@echo "make setup | demo | test | lint | bench | clean"

setup:
	@scripts/setup.sh

demo: setup
	@$(CARGO) build --release -q -p odc-packing --bin odc-pack
	@echo "== odc-pack: LongAlign-like lengths (lognormal median 10000, sigma 1.0, max 65536), 8 ranks =="
	@for m in 1 2 4 8; do \
	  echo; echo "-- minibatch size $$m --"; \
	  target/release/odc-pack --synthetic lognormal:n=4096,median=10000,sigma=1.0,max=65536,seed=0 \
	    --world 8 --minibatch-size $$m --max-tokens 65536 --cost quadratic --compare || exit 1; \
	done

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

cargo-test:
	$(CARGO) test --workspace --locked

# The loom model of the landing-slot / signal / acknowledge protocol.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom $(CARGO) test -p odc-core --release --locked --lib loom

pytest:
	$(PY) -m pytest odc-py/tests

test: setup lint cargo-test loom pytest

fmt:
	$(CARGO) fmt --all

bench:
	$(CARGO) bench -p odc-packing --bench kk
	$(CARGO) bench -p odc-kernels --bench accumulate

clean:
	$(CARGO) clean
	rm -rf $(VENV)/.odc-py-built
