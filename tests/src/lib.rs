//! Multi-process integration tests for ODC live in `tests/tests/`; the rank worker binary in `src/bin/`.
