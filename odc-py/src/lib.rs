//! Python bindings for ODC: the private native module `odc._odc`.
//!
//! The Python package `odc` (in `python/odc/`) is the public face; this crate
//! only converts arguments, releases the GIL around work, and maps every Rust
//! error to the matching class of `odc.errors`.
//!
//! Modules:
//! - [`packing`] — `odc-packing`: plans, Karmarkar–Karp, the `odc-pack` CLI.
//! - [`engine`] — `odc-core`: the worker API (`odc._odc.Engine`) and the
//!   emulated stream of the `emu-ipc` transport (`odc._odc.EmuStream`).
//! - [`probe`] — what GPU support this process finds (`odc._odc.probe`).
//! - [`quant`] — block-scaled formats on host buffers (`odc._odc.quantise`, ...).
//! - [`weights`] — rollout weights: `odc._odc.WeightServer` (a trainer rank's
//!   snapshot slots) and `odc._odc.WeightReader` (a reader outside the group).

#![warn(unsafe_op_in_unsafe_fn)]

use pyo3::prelude::*;

mod engine;
mod errors;
mod packing;
mod probe;
mod quant;
mod weights;

/// The native module `odc._odc`.
#[pymodule]
fn _odc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    packing::register(m)?;
    engine::register(m)?;
    errors::register(m)?;
    probe::register(m)?;
    quant::register(m)?;
    weights::register(m)?;
    Ok(())
}
