//! Raising the classes of `odc.errors` from Rust.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

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

/// The `odc.errors` class of each engine error variant: one class per variant.
fn class_name(e: &odc_core::Error) -> &'static str {
    use odc_core::Error as E;
    match e {
        E::PeerTimeout { .. } => "PeerTimeout",
        E::PeerDied { .. } => "PeerDied",
        E::Registration { .. } => "RegistrationError",
        E::Layout { .. } => "LayoutError",
        E::Protocol { .. } => "ProtocolError",
        E::Malformed { .. } => "MalformedError",
        E::Config(_) => "ConfigError",
        E::Transport { .. } => "TransportError",
        E::Store { .. } => "StoreError",
        E::ShmSpace { .. } => "ShmSpaceError",
        E::GpuUnavailable(_) => "GpuUnavailable",
        E::Cuda { .. } => "CudaError",
        E::Nvshmem { .. } => "NvshmemError",
        E::Fabric { .. } => "FabricError",
        E::Dropped { .. } => "NodeDropped",
        E::Io(_) => "OdcOSError",
        E::Internal { .. } => "InternalError",
        // `odc_core::Error` is non-exhaustive: a variant added there and not
        // yet here still raises an `OdcError`, with its message.
        _ => "OdcError",
    }
}

/// Maps an engine error one-to-one to its Python class; peer errors carry
/// the peer's rank as `.peer`.
pub(crate) fn core_error(py: Python<'_>, e: odc_core::Error) -> PyErr {
    let message = e.to_string();
    match (class(py, class_name(&e)), e.blamed_peer()) {
        (Ok(cls), Some(peer)) => PyErr::from_type(cls, (message, peer)),
        (Ok(cls), None) => PyErr::from_type(cls, message),
        (Err(err), _) => err,
    }
}

/// One example of every `odc_core::Error` variant, by variant name.
fn examples() -> Vec<(&'static str, odc_core::Error)> {
    use odc_core::Error as E;
    let bucket = Some("b".to_string());
    vec![
        (
            "PeerTimeout",
            E::PeerTimeout {
                peer: 1,
                bucket: bucket.clone(),
                waited_for: "version 0 of the shard".into(),
                after: std::time::Duration::from_secs(1),
            },
        ),
        (
            "PeerDied",
            E::PeerDied {
                peer: 1,
                pid: 0,
                bucket: bucket.clone(),
                waited_for: "its landing slot".into(),
                reported_by: None,
            },
        ),
        (
            "Registration",
            E::Registration {
                peer: 1,
                first_differing_bucket: 0,
                ours: "a 1 f32".into(),
                theirs: "<none>".into(),
            },
        ),
        (
            "Layout",
            E::Layout {
                bucket: bucket.clone(),
                detail: "example".into(),
            },
        ),
        (
            "Protocol",
            E::Protocol {
                bucket,
                detail: "example".into(),
            },
        ),
        (
            "Malformed",
            E::Malformed {
                peer: 1,
                what: "landing-slot header",
                field: "bucket",
                detail: "9 is not registered (3 buckets)".into(),
            },
        ),
        ("Config", E::Config("example".into())),
        (
            "Transport",
            E::Transport {
                op: "get",
                detail: "example".into(),
                source: None,
            },
        ),
        (
            "ShmSpace",
            E::ShmSpace {
                dir: "/dev/shm".into(),
                needed: 2 << 20,
                free: 1 << 20,
                what: "example".into(),
            },
        ),
        (
            "Store",
            E::Store {
                op: "get",
                key: "k".into(),
                detail: "example".into(),
            },
        ),
        (
            "GpuUnavailable",
            E::GpuUnavailable(odc_core::gpu::Missing::NvshmemLibrary { tried: Vec::new() }),
        ),
        (
            "Cuda",
            E::Cuda {
                call: "cuMemCreate",
                detail: "example".into(),
            },
        ),
        (
            "Nvshmem",
            E::Nvshmem {
                call: "nvshmemx_init_attr",
                detail: "example".into(),
            },
        ),
        (
            "Fabric",
            E::Fabric {
                call: "fi_getinfo",
                code: 61,
                detail: "example".into(),
            },
        ),
        ("Io", E::Io(std::io::Error::other("example"))),
        (
            "Dropped",
            E::Dropped {
                node: 1,
                minibatch: 3,
            },
        ),
        (
            "Internal",
            E::Internal {
                rank: 1,
                during: "its shard server thread was adding rank 0's chunk".into(),
                detail: "example".into(),
            },
        ),
    ]
}

/// `{variant: exception}`: every `odc_core::Error` variant raised through
/// [`core_error`], so tests can check the mapping is one-to-one (most
/// variants cannot be provoked on a machine without a GPU).
#[pyfunction]
fn _core_error_examples<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for (variant, e) in examples() {
        out.set_item(variant, core_error(py, e).into_value(py))?;
    }
    Ok(out)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_core_error_examples, m)?)
}
