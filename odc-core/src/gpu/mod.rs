//! GPU support for the GPU transports (cuda-ipc, nvshmem): what is present
//! on this machine ([`probe`]), device memory shared between the processes
//! of a node ([`device`]), passing their file descriptors between ranks
//! ([`fdshare`]), exchanging every rank's regions ([`ipc`]) and the NVSHMEM
//! bindings ([`nvshmem`]).
//!
//! Everything loads at run time, so the crate builds and its tests run on
//! machines without a GPU; there every entry point returns
//! [`Error::GpuUnavailable`] with a
//! [`Missing`] that names what is absent. This module owns no transport:
//! it knows nothing of buckets, regions or the Store.

use std::path::PathBuf;

pub use odc_kernels::cuda::DeviceInfo;
pub use odc_kernels::Unavailable;

use crate::{Error, Result};

pub mod device;
// Uses the shm transport's helpers, which loom builds leave out.
#[cfg(not(loom))]
pub mod fdshare;
#[cfg(not(loom))]
pub mod ipc;
pub mod nvshmem;

pub use crate::error::Missing;

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// The device, driver and NVRTC.
    pub cuda: DeviceInfo,
    /// NVSHMEM's version, `(major, minor, patch)`.
    pub nvshmem_version: (i32, i32, i32),
    /// The NVSHMEM library opened (`None`: found by the system loader).
    pub nvshmem_path: Option<PathBuf>,
}

/// Checks device 0 can run the GPU transports: driver, device, NVRTC, then
/// NVSHMEM. Never panics.
///
/// Errors: [`Error::GpuUnavailable`] naming the first thing missing.
pub fn probe() -> Result<GpuInfo> {
    probe_device(0)
}

/// [`probe`] for device `ordinal`.
pub fn probe_device(ordinal: usize) -> Result<GpuInfo> {
    let cuda = match odc_kernels::cuda::probe_device(ordinal) {
        Ok(info) => info,
        Err(odc_kernels::Error::GpuUnavailable(missing)) => {
            return Err(Missing::Cuda(missing).into())
        }
        Err(other) => {
            return Err(Error::Cuda {
                call: "probe",
                detail: other.to_string(),
            })
        }
    };
    let lib = nvshmem::sys::lib()?;
    Ok(GpuInfo {
        cuda,
        nvshmem_version: nvshmem::version()?,
        nvshmem_path: lib.path.clone(),
    })
}
