//! Registered memory: [`LocalRegion`] (memory this rank registered with its
//! transport, unregistered on drop) and [`RegionDesc`] (the plain-data
//! handle peers use to reach it, exchanged through the Store).
//!
//! This module owns no transport logic; a backend hands a `LocalRegion` an
//! opaque backing object whose `Drop` unmaps and deregisters.

use std::fmt;
use std::ptr::NonNull;

use serde::{Deserialize, Serialize};

use crate::sync::AtomicU64;

/// A remote handle to a registered region: which rank owns it, which of the
/// owner's regions it is, and its length. Plain data (`Copy`), serialized
/// into the Store; the owner's transport endpoint supplies everything else
/// (segment names, keys, addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    /// The rank that registered the region.
    pub owner: u32,
    /// The owner's identifier for it (unique per owner).
    pub id: u32,
    /// Length in bytes.
    pub len: u64,
    /// Backend-specific key (remote key, or 0).
    pub key: u64,
}

/// How a rank's transport is reached; one per rank, exchanged through the
/// Store before any region is connected.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The rank.
    pub rank: usize,
    /// Its process id (liveness checks on one node).
    pub pid: u32,
    /// Its host name.
    pub host: String,
    /// Backend-specific address (empty for `shm`; hex `fi_getname` bytes
    /// for `fabric`).
    pub address: String,
    /// Every region the backend registered, with where peers address it
    /// (`fabric`: remote key and base address; the backend's own status
    /// region included). Empty for `shm`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub regions: Vec<RemoteRegion>,
}

/// How a peer addresses one registered region over a network transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// The owner's region id.
    pub id: u32,
    /// Remote address of byte 0 (0 unless the provider wants virtual
    /// addresses, `FI_MR_VIRT_ADDR`).
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub key: u64,
}

/// Which of a rank's two sleep words a signal wakes: the server daemon's
/// doorbell or the worker-side (client) bell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bell {
    /// Rung after a landing-slot signal: wakes the server daemon.
    Server,
    /// Rung after any other signal (version, release, done, acknowledgement):
    /// wakes worker threads blocked in engine calls.
    Client,
}

/// A 64-bit signal word in the target region of a `put_signal`, and the
/// bell its owner sleeps on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SignalRef {
    /// Byte offset of the word in the region (8-byte aligned).
    pub offset: usize,
    /// Which bell to ring after the word is written.
    pub bell: Bell,
}

/// Memory this rank registered with its transport.
///
/// The memory may be written by peers at any time the protocol allows, so
/// it is exposed only as raw pointers and atomic signal words.
pub struct LocalRegion {
    ptr: NonNull<u8>,
    len: usize,
    desc: RegionDesc,
    _backing: Box<dyn Send + Sync>,
}

// SAFETY: the region is plain memory owned by `_backing` (itself Send +
// Sync); all access goes through raw pointers or atomics whose ordering the
// protocol defines.
unsafe impl Send for LocalRegion {}
// SAFETY: as above.
unsafe impl Sync for LocalRegion {}

impl fmt::Debug for LocalRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalRegion")
            .field("desc", &self.desc)
            .finish_non_exhaustive()
    }
}

impl LocalRegion {
    /// Wraps `len` bytes at `ptr`, kept alive by `backing`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, aligned to
    /// 64 bytes, and stay valid until `backing` is dropped.
    pub unsafe fn new(
        ptr: NonNull<u8>,
        len: usize,
        desc: RegionDesc,
        backing: Box<dyn Send + Sync>,
    ) -> LocalRegion {
        LocalRegion {
            ptr,
            len,
            desc,
            _backing: backing,
        }
    }

    /// The descriptor peers use to reach this region.
    pub fn desc(&self) -> RegionDesc {
        self.desc
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base pointer. Writes through it must follow the protocol.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The 64-bit signal word at `offset`, or `None` when `offset` is out of
    /// range or not 8-byte aligned.
    pub fn signal(&self, offset: usize) -> Option<&AtomicU64> {
        if offset % 8 != 0 || offset.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: in range and aligned (checked above; the base is 64-byte
        // aligned); the memory lives as long as `self`, and every access to
        // signal words is atomic.
        Some(unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() })
    }
}

/// Heap memory that stands in for a registered region (tests, accumulators).
#[derive(Debug)]
pub(crate) struct HeapBlock {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: owns its allocation exclusively; access is through raw pointers.
unsafe impl Send for HeapBlock {}
// SAFETY: as above.
unsafe impl Sync for HeapBlock {}

impl HeapBlock {
    /// A zeroed, 64-byte-aligned block of at least one byte.
    pub(crate) fn zeroed(len: usize) -> std::io::Result<HeapBlock> {
        let layout = std::alloc::Layout::from_size_align(len.max(64), 64)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
        Ok(HeapBlock { ptr, layout })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HeapBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
