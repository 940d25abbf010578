//! Accumulate and cast kernels.
