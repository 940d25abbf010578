//! Shared code for the perf binaries.
