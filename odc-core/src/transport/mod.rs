//! The transport contract: three verbs (the OpenSHMEM / NVSHMEM model) plus
//! registration, connection, sleeping and liveness. The engine talks to
//! peers only through this trait; backends live in submodules.
//!
//! Every wait in the engine is on a word in this rank's **own** memory: a
//! peer makes progress visible by `put_signal` into it (data first, then
//! the signal with release order, then it rings the owner's [`Bell`]). That
//! shape maps onto every backend:
//!
//! | verb | `shm` | libfabric | CUDA IPC / NVSHMEM |
//! |---|---|---|---|
//! | `get` | memcpy from the peer's mapping | `fi_read` | `cuMemcpyAsync` / `nvshmem_getmem` |
//! | `put_signal` | memcpy, release store, futex wake | `fi_writedata` / `fi_writemsg` with remote CQ data; the owner's progress thread stores the data word | `putmem_signal` |
//! | `bell_wait` | futex on the own mapping | blocking `fi_cq_sread` (drives progress) | `signal_wait_until` |
//!
//! This module owns the trait and the backend choice; it knows nothing of
//! buckets, versions or landing slots.

use std::fmt;
use std::time::Duration;

use crate::region::{Bell, Endpoint, LocalRegion, RegionDesc, SignalRef};
use crate::Result;

#[cfg(feature = "fabric")]
pub mod fabric;
pub mod shm;

/// What a liveness probe learned about a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerStatus {
    /// Running, as far as the backend can tell.
    Alive,
    /// Its process is gone or it closed its engine.
    Dead {
        /// Its process id (0 when unknown).
        pid: u32,
        /// The rank it blamed for its own failure, if it failed on a peer.
        blamed: Option<usize>,
    },
}

/// A one-sided transport between the ranks of one job.
///
/// Implementations must be `Send + Sync`; the data-path verbs (`get`,
/// `put_signal`, `bell_*`) take no lock and allocate nothing.
pub trait Transport: Send + Sync + fmt::Debug {
    /// Backend name (`"shm"`).
    fn name(&self) -> &'static str;

    /// How peers reach this rank; published through the Store.
    fn endpoint(&self) -> Endpoint;

    /// Registers `len` zeroed bytes as region `id` (unique per rank).
    fn register(&self, id: u32, len: usize) -> Result<LocalRegion>;

    /// Connects to `peer` (possibly this rank) and maps or keys all of its
    /// `regions`. Called once per peer, after every region is registered.
    fn connect(&self, peer: usize, endpoint: &Endpoint, regions: &[RegionDesc]) -> Result<()>;

    /// One-sided read of `dst.len()` bytes at `offset` of `peer`'s `remote`.
    fn get(&self, peer: usize, remote: &RegionDesc, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// One-sided write of the concatenation of `src` at `offset` of `peer`'s
    /// `remote`, then stores `value` into the signal word `signal` of the
    /// same region so that a reader who sees the value (acquire) sees the
    /// data; then rings the peer's bell. `src` may be empty (a pure signal).
    fn put_signal(
        &self,
        peer: usize,
        remote: &RegionDesc,
        offset: usize,
        src: &[&[u8]],
        signal: SignalRef,
        value: u64,
    ) -> Result<()>;

    /// The epoch of this rank's `bell`; read before checking a condition.
    fn bell_epoch(&self, bell: Bell) -> u32;

    /// Sleeps until `bell` moves past `epoch` or `timeout` passes (and
    /// drives the backend's progress, where it needs any).
    fn bell_wait(&self, bell: Bell, epoch: u32, timeout: Duration) -> Result<()>;

    /// Rings this rank's own `bell` (shutdown, local hand-offs).
    fn ring(&self, bell: Bell);

    /// Liveness of `peer`.
    fn peer_status(&self, peer: usize) -> PeerStatus;

    /// Records that this rank failed because of `peer`, so that ranks waiting
    /// on this one can name the root cause.
    fn set_blame(&self, peer: usize);
}

/// Which backend an engine uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TransportKind {
    /// POSIX shared memory between processes on one host.
    #[default]
    Shm,
    /// libfabric one-sided RMA (`tcp`, `verbs`, `efa`), any number of
    /// nodes. Needs the `fabric` cargo feature; an engine built without it
    /// refuses this kind with `Error::Config`.
    Fabric,
}

impl TransportKind {
    /// Parses `"shm"` or `"fabric"`.
    pub fn parse(name: &str) -> Option<TransportKind> {
        match name.trim().to_ascii_lowercase().as_str() {
            "shm" => Some(TransportKind::Shm),
            "fabric" => Some(TransportKind::Fabric),
            _ => None,
        }
    }

    /// Whether this build can create the backend.
    pub fn available(self) -> bool {
        match self {
            TransportKind::Shm => true,
            TransportKind::Fabric => cfg!(feature = "fabric"),
        }
    }
}
