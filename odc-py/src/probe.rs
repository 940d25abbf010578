//! `odc._odc.probe()`: what GPU support this process finds, part by part,
//! and where each library was loaded from (`odc.probe()` in Python).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use odc_core::gpu::nvshmem;
use odc_kernels::cuda;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(probe, m)?)
}

/// Each part on its own, so that a machine without a GPU still says which
/// NVRTC and NVSHMEM it would use: `{"nvrtc": {...}, "nvshmem": {...},
/// "cuda": {...}}`, each either the facts or `{"error": "..."}`.
#[pyfunction]
fn probe(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    let part = PyDict::new(py);
    match cuda::nvrtc::nvrtc() {
        Ok(info) => {
            part.set_item("path", info.path.map(|p| p.display().to_string()))?;
            part.set_item("version", format!("{}.{}", info.version.0, info.version.1))?;
        }
        Err(e) => part.set_item("error", e.to_string())?,
    }
    part.set_item(
        "tried_first",
        cuda::nvrtc::candidates()
            .iter()
            .take(8)
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>(),
    )?;
    out.set_item("nvrtc", part)?;
    let part = PyDict::new(py);
    match nvshmem::sys::lib() {
        Ok(lib) => {
            part.set_item("path", lib.path.as_ref().map(|p| p.display().to_string()))?;
            match nvshmem::version() {
                Ok((a, b, c)) => part.set_item("version", format!("{a}.{b}.{c}"))?,
                Err(e) => part.set_item("error", e.to_string())?,
            }
        }
        Err(e) => part.set_item("error", e.to_string())?,
    }
    out.set_item("nvshmem", part)?;
    let part = PyDict::new(py);
    match py.detach(cuda::probe) {
        Ok(info) => {
            part.set_item("device", info.name)?;
            part.set_item("arch", info.arch.to_string())?;
            part.set_item("multiprocessors", info.multiprocessors)?;
            part.set_item("total_mem", info.total_mem)?;
            part.set_item("device_count", info.device_count)?;
            part.set_item(
                "driver_cuda_version",
                format!(
                    "{}.{}",
                    info.driver_version / 1000,
                    (info.driver_version % 1000) / 10
                ),
            )?;
        }
        Err(e) => part.set_item("error", e.to_string())?,
    }
    out.set_item("cuda", part)?;
    Ok(out)
}
