//! NVSHMEM host bindings in three layers: [`sys`] (the library's symbol
//! table and `#[repr(C)]` types, loaded lazily), [`result`] (every call a
//! [`Result`](crate::Result), names regrouped) and [`safe`] (an
//! [`Nvshmem`] session and [`SymmetricBuffer`]s freed on drop).
//!
//! The library is PyPI `nvidia-nvshmem-cu12` (`make setup` installs it into
//! the workspace `.venv`); nothing links it, so this builds everywhere and
//! [`is_present`] says whether it loads here.

pub mod result;
pub mod safe;
pub mod sys;

pub use safe::{version, HeapPlan, Nvshmem, SymmetricBuffer, UniqueId};
pub use sys::is_present;
