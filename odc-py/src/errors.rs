//! Raising the classes of `odc.errors` from Rust.

use pyo3::prelude::*;
use pyo3::types::PyType;

fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    py.import("odc.errors")?
        .getattr(name)?
        .cast_into::<PyType>()
        .map_err(PyErr::from)
}

/// Builds an exception of class `odc.errors.<name>` with `message`.
///
/// The hierarchy is defined in Python (so that input errors can also derive
/// from `ValueError`); if it cannot be imported, that failure is raised
/// instead of hiding the original message.
pub(crate) fn odc_error(py: Python<'_>, name: &str, message: String) -> PyErr {
    match class(py, name) {
        Ok(cls) => PyErr::from_type(cls, message),
        Err(e) => e,
    }
}

/// Maps an engine error one-to-one to its Python class; peer errors carry
/// the peer's rank as `.peer`.
pub(crate) fn core_error(py: Python<'_>, e: odc_core::Error) -> PyErr {
    use odc_core::Error as E;
    let name = match &e {
        E::PeerTimeout { .. } => "PeerTimeout",
        E::PeerDied { .. } => "PeerDied",
        E::Registration { .. } => "RegistrationError",
        E::Layout { .. } => "LayoutError",
        E::Protocol { .. } => "ProtocolError",
        E::Config(_) => "ConfigError",
        E::Transport { .. } | E::Fabric { .. } => "TransportError",
        E::Store { .. } => "StoreError",
        E::Io(_) => "OdcOSError",
        _ => "OdcError",
    };
    let message = e.to_string();
    match (class(py, name), e.blamed_peer()) {
        (Ok(cls), Some(peer)) => PyErr::from_type(cls, (message, peer)),
        (Ok(cls), None) => PyErr::from_type(cls, message),
        (Err(err), _) => err,
    }
}
