//! Packing.
