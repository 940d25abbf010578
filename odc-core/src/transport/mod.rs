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
//! | `put_signal` | memcpy, release store (or max), futex wake | `fi_writemsg` with a 4-byte immediate naming the word; the owner's progress thread counts it, or raises the word to the value in its mailbox | `putmem_signal` |
//! | `bell_wait` | futex on the own mapping | blocking `fi_cq_sread` (drives progress) | `signal_wait_until` |
//!
//! # Choosing a backend
//!
//! One engine may use different backends for different peers
//! ([`create`], [`TransportKind`]):
//!
//! | kind | peers on this node | peers on other nodes |
//! |---|---|---|
//! | `auto` (default) | `shm` | libfabric (`shm+fabric`); one node: `shm` alone |
//! | `shm` | `shm` | — (every rank must share the host) |
//! | `fabric` | libfabric | libfabric |
//! | `mixed` | `shm` | libfabric |
//! | `cuda-ipc`, `emu-ipc` | control `shm`, data [`crate::plane`] | — (one node) |
//! | `nvshmem`, `emu-shmem` | control `shm`, data [`crate::plane`] | control libfabric, data [`crate::plane`] |
//!
//! `mixed` (`mixed::MixedTransport`, feature `fabric`) registers every
//! region with both and sleeps on the `shm` bell, which the fabric progress
//! thread rings too.
//!
//! This module owns the trait and the backend choice; it knows nothing of
//! buckets, versions or landing slots.

use std::fmt;
use std::time::Duration;

use crate::region::{Bell, Endpoint, LocalRegion, RegionDesc, SignalRef};
use crate::topology::Topology;
use crate::{Error, Result};

#[cfg(feature = "fabric")]
pub mod fabric;
#[cfg(feature = "fabric")]
pub mod mixed;
pub mod shm;
mod shm_lock;

pub use crate::wait::PeerStatus;

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
    /// `regions`. Called once for each peer this rank talks to (its shard
    /// group and its replicas), after every region is registered; the other
    /// ranks are never connected, and a call naming one of them is an error.
    fn connect(&self, peer: usize, endpoint: &Endpoint, regions: &[RegionDesc]) -> Result<()>;

    /// Maps ahead the pages of `peer`'s `remote` in `range` (bytes), for
    /// writing or only reading, so that the first gather or push does not
    /// pay a page fault per 4 KiB. Called at registration for what this
    /// rank will touch: never the whole of a peer's control region, whose
    /// landing slots are `2 · G` chunks and of which a client uses its own
    /// two (populating all of them cost every rank `G²` chunks of page
    /// tables). A transport that maps nothing ignores it.
    fn prefault(
        &self,
        _peer: usize,
        _remote: &RegionDesc,
        _range: std::ops::Range<usize>,
        _write: bool,
    ) -> Result<()> {
        Ok(())
    }

    /// Where this process maps `peer`'s `remote` (a peer reached through
    /// shared memory, this rank too), so that node-mates share memory
    /// directly (the node cache); `None` for a peer reached over a network.
    /// The mapping lives as long as the transport.
    fn mapped(&self, _peer: usize, _remote: &RegionDesc) -> Option<std::ptr::NonNull<u8>> {
        None
    }

    /// One-sided read of `dst.len()` bytes at `offset` of `peer`'s `remote`.
    fn get(&self, peer: usize, remote: &RegionDesc, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// One-sided write of the concatenation of `src` at `offset` of `peer`'s
    /// `remote`, then updates the signal word `signal` of the same region so
    /// that a reader who sees the new value (acquire) sees the data; then
    /// rings the peer's bell.
    ///
    /// Signal words only grow, so signals commute and nothing depends on
    /// two of them arriving in the order they were sent:
    /// - with data, the word **counts** the puts into it: `value` must be
    ///   its previous value plus one (a network transport adds one per
    ///   arrived write and carries no value);
    /// - without data (`src` empty, a pure signal), the word is **raised**
    ///   to `value` (it keeps the larger of the two); a network transport
    ///   may use the 8 bytes after the word (its mailbox, see
    ///   [`crate::control::CELL`]) to carry the value.
    ///
    /// One writer sends at most one signal to a word at a time (the call
    /// returns once the signal is delivered).
    fn put_signal(
        &self,
        peer: usize,
        remote: &RegionDesc,
        offset: usize,
        src: &[&[u8]],
        signal: SignalRef,
        value: u64,
    ) -> Result<()>;

    /// A pure signal (see [`put_signal`](Self::put_signal)) of one `value`
    /// into the word `signal` of each target's region, `(peer, region)`: a
    /// version, release or done word to every rank of the shard group. The
    /// default sends them one after the other and stops at the first
    /// failure; a network transport overlaps them (each is a round trip)
    /// and reports a failure once every signal has completed or failed.
    fn put_signals(
        &self,
        targets: &[(usize, RegionDesc)],
        signal: SignalRef,
        value: u64,
    ) -> Result<()> {
        for (peer, desc) in targets {
            self.put_signal(*peer, desc, 0, &[], signal, value)?;
        }
        Ok(())
    }

    /// Runs every operation `ops` yields, with as many in flight at once as
    /// the backend takes, and returns once all of them completed: the
    /// remote reads of a gather, the chunks of a push, the
    /// acknowledgements of a daemon's scan. Each operation means what
    /// [`get`](Self::get) or [`put_signal`](Self::put_signal) means; nothing
    /// orders two of them. `ops` is drawn lazily (a caller may decide the
    /// next operation from state the previous ones changed) and not past
    /// the first failure, which is returned once every posted operation
    /// completed or failed. The default runs them one after the other (a
    /// copy each, for `shm`); a network transport posts them together.
    ///
    /// # Safety
    /// Every pointer an operation carries addresses its `len` bytes
    /// (writable for a get, readable for a put) and stays valid, and
    /// untouched by anyone else, until this returns.
    unsafe fn run_batch(&self, ops: &mut dyn Iterator<Item = Op>) -> Result<()> {
        for op in ops {
            // SAFETY: the caller's contract, passed on.
            unsafe { run_one(self, op)? };
        }
        Ok(())
    }

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

    /// Tells the peers that this rank takes no further part (an elastic
    /// engine's rank that failed on a peer or whose node was dropped, a
    /// rank whose shard server thread panicked), as closing would, while
    /// its memory stays mapped: their liveness probes see it closed, naming
    /// whom it blamed. The default does nothing.
    fn retire(&self) {}

    /// The failure of a thread the transport runs itself (the fabric
    /// progress thread panicked: [`Error::Internal`]): every later call and
    /// wait of the engine fails with it. The default has no such thread.
    fn failure(&self) -> Option<Error> {
        None
    }

    /// Records that the elastic membership rounds dropped `nodes` (a bit
    /// per node) for good. Where a backend lets this node's ranks read it
    /// (`shm+fabric`), their operations on those nodes' ranks that wait on
    /// a network peer (a post to a killed host answers `-FI_EAGAIN` for
    /// seconds) give up as on a reported peer. The default does nothing.
    fn report_dropped(&self, _nodes: u64) {}

    /// Makes every signal from another node that lands in `words` (bytes)
    /// of this rank's `region` wake this node's other ranks too (their
    /// client bells), where node-mates map each other's regions and signals
    /// come from other nodes (`shm+fabric`): node-mates read such words
    /// through [`Transport::mapped`] and sleep on their own bells. Returns
    /// whether it does; the default does not.
    fn wake_node_on(&self, _region: &LocalRegion, _words: std::ops::Range<usize>) -> bool {
        false
    }
}

/// One operation of a batch ([`Transport::run_batch`]): plain data, with
/// raw pointers to the caller's buffers.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// [`Transport::get`] of `len` bytes at `offset` of `peer`'s `remote`
    /// into `dst`.
    Get {
        /// The rank read from.
        peer: usize,
        /// Its region.
        remote: RegionDesc,
        /// Byte offset in the region.
        offset: usize,
        /// Where the bytes go.
        dst: *mut u8,
        /// How many.
        len: usize,
    },
    /// [`Transport::put_signal`] of the concatenation of `parts` (pointer,
    /// length; both empty for a pure signal) at `offset` of `peer`'s
    /// `remote`, then `signal` updated with `value`.
    Put {
        /// The rank written to.
        peer: usize,
        /// Its region.
        remote: RegionDesc,
        /// Byte offset of the data in the region.
        offset: usize,
        /// The data, in up to two pieces (a slot header and a chunk).
        parts: [(*const u8, usize); 2],
        /// The word the put signals.
        signal: SignalRef,
        /// Its value (see [`Transport::put_signal`]).
        value: u64,
    },
}

impl Op {
    /// The rank the operation goes to.
    pub fn peer(&self) -> usize {
        match self {
            Op::Get { peer, .. } | Op::Put { peer, .. } => *peer,
        }
    }
}

/// Runs one operation of a batch with the transport's single verbs.
///
/// # Safety
/// As [`Transport::run_batch`] for `op`.
pub unsafe fn run_one<T: Transport + ?Sized>(t: &T, op: Op) -> Result<()> {
    match op {
        Op::Get {
            peer,
            remote,
            offset,
            dst,
            len,
        } => {
            // SAFETY: the caller vouches for `dst` (`len` writable bytes,
            // not aliased until the batch returns).
            let dst = unsafe { slice_mut(dst, len) };
            t.get(peer, &remote, offset, dst)
        }
        Op::Put {
            peer,
            remote,
            offset,
            parts,
            signal,
            value,
        } => {
            // SAFETY: the caller vouches for both parts (readable).
            let (a, b) = unsafe { (slice(parts[0]), slice(parts[1])) };
            t.put_signal(peer, &remote, offset, &[a, b], signal, value)
        }
    }
}

/// The bytes of one part of a put.
///
/// # Safety
/// A non-empty part addresses `len` readable bytes valid for `'a`.
pub(crate) unsafe fn slice<'a>((ptr, len): (*const u8, usize)) -> &'a [u8] {
    if len == 0 || ptr.is_null() {
        return &[];
    }
    // SAFETY: per the contract above.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// The destination of a get.
///
/// # Safety
/// A non-empty `dst` addresses `len` writable bytes valid and unaliased for
/// `'a`.
pub(crate) unsafe fn slice_mut<'a>(dst: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 || dst.is_null() {
        return &mut [];
    }
    // SAFETY: per the contract above.
    unsafe { std::slice::from_raw_parts_mut(dst, len) }
}

/// Which backend an engine uses (see the table in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TransportKind {
    /// `Shm` when the topology has one node, else `Mixed`.
    #[default]
    Auto,
    /// POSIX shared memory between processes on one host, whatever the
    /// topology says about nodes.
    Shm,
    /// libfabric one-sided RMA (`tcp`, `verbs`, `efa`) to every peer, any
    /// number of nodes. Needs the `fabric` cargo feature; an engine built
    /// without it refuses this kind with `Error::Config`.
    Fabric,
    /// `shm` to peers on this rank's node, libfabric to the others. Needs
    /// the `fabric` feature.
    Mixed,
    /// One node of GPUs: control words over `shm`, published shards,
    /// landing slots and accumulators in device memory shared with CUDA IPC
    /// ([`crate::plane`]); data moves on the caller's CUDA stream. Needs a
    /// CUDA driver and device; without one, creating the engine is
    /// [`Error::GpuUnavailable`] naming what is missing.
    CudaIpc,
    /// `cuda-ipc`'s data path with host memory for device memory and host
    /// threads for streams ([`crate::plane::emu`]): runs, and tests, the
    /// device path on machines without a GPU.
    EmuIpc,
    /// GPUs on any number of nodes: published shards, landing slots and
    /// accumulators on the NVSHMEM symmetric heap ([`crate::plane::nvshmem`]),
    /// sized from the registered buckets; data moves on the caller's CUDA
    /// stream (`nvshmemx_getmem_on_stream`, `nvshmemx_putmem_on_stream`,
    /// load/store for peers NVSHMEM maps). Control words go over `shm`
    /// within a node and libfabric across nodes (as `mixed`; several nodes
    /// need the `fabric` feature). Without a GPU or the NVSHMEM library,
    /// creating the engine is [`Error::GpuUnavailable`].
    Nvshmem,
    /// `nvshmem`'s data path emulated in host memory ([`crate::plane::emu`]):
    /// a put to a rank on another node reaches it only at the stream's next
    /// `deliver` (NVSHMEM's quiet), so a signal that overtakes its data
    /// fails the tests. For machines without a GPU.
    EmuShmem,
}

impl TransportKind {
    /// Parses `"auto"`, `"shm"`, `"fabric"` or `"mixed"` (also
    /// `"shm+fabric"`), ignoring case and surrounding blanks.
    pub fn parse(name: &str) -> Option<TransportKind> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(TransportKind::Auto),
            "shm" => Some(TransportKind::Shm),
            "fabric" => Some(TransportKind::Fabric),
            "mixed" | "shm+fabric" => Some(TransportKind::Mixed),
            "cuda-ipc" | "cuda_ipc" => Some(TransportKind::CudaIpc),
            "emu-ipc" | "emu_ipc" => Some(TransportKind::EmuIpc),
            "nvshmem" => Some(TransportKind::Nvshmem),
            "emu-shmem" | "emu_shmem" => Some(TransportKind::EmuShmem),
            _ => None,
        }
    }

    /// The kind's name, as [`TransportKind::parse`] reads it (`Mixed` is
    /// `"shm+fabric"`, the name of the transport it creates).
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Shm => "shm",
            TransportKind::Fabric => "fabric",
            TransportKind::Mixed => "shm+fabric",
            TransportKind::CudaIpc => "cuda-ipc",
            TransportKind::EmuIpc => "emu-ipc",
            TransportKind::Nvshmem => "nvshmem",
            TransportKind::EmuShmem => "emu-shmem",
        }
    }

    /// Whether this build can create the backend (`Auto`: at least for a
    /// single node; `CudaIpc`: the code is built, whether a GPU is present
    /// is found at creation).
    pub fn available(self) -> bool {
        match self {
            TransportKind::Auto
            | TransportKind::Shm
            | TransportKind::CudaIpc
            | TransportKind::EmuIpc
            | TransportKind::Nvshmem
            | TransportKind::EmuShmem => true,
            TransportKind::Fabric | TransportKind::Mixed => cfg!(feature = "fabric"),
        }
    }

    /// Whether the data lives in device memory ([`crate::plane`]).
    pub fn is_device(self) -> bool {
        matches!(
            self,
            TransportKind::CudaIpc
                | TransportKind::EmuIpc
                | TransportKind::Nvshmem
                | TransportKind::EmuShmem
        )
    }

    /// What `Auto` resolves to for `topo`; other kinds are themselves.
    pub fn resolve(self, topo: &Topology) -> TransportKind {
        match self {
            TransportKind::Auto if topo.nodes() == 1 => TransportKind::Shm,
            TransportKind::Auto => TransportKind::Mixed,
            other => other,
        }
    }
}

/// The host transport that carries an engine's control words (and, for a
/// host transport, its data): `Auto` resolved; a device transport's control
/// words stay in host shared memory within a node (every wait a futex wait)
/// and go over libfabric between nodes (`nvshmem`, `emu-shmem`), while
/// [`crate::plane`] moves the data.
fn control_kind(kind: TransportKind, topo: &Topology) -> TransportKind {
    match kind.resolve(topo) {
        TransportKind::CudaIpc | TransportKind::EmuIpc => TransportKind::Shm,
        TransportKind::Nvshmem | TransportKind::EmuShmem if topo.nodes() == 1 => TransportKind::Shm,
        TransportKind::Nvshmem | TransportKind::EmuShmem => TransportKind::Mixed,
        other => other,
    }
}

/// The name ([`Transport::name`]) of the transport that carries the control
/// words of an engine of `kind` on `topo`.
pub(crate) fn control_name(kind: TransportKind, topo: &Topology) -> &'static str {
    match control_kind(kind, topo) {
        TransportKind::Shm => "shm",
        TransportKind::Fabric => "fabric",
        TransportKind::Mixed => "shm+fabric",
        other => other.name(),
    }
}

/// Creates this rank's transport of `kind` for `topo`: `shm` segments are
/// named after `job_key` and `job_id`, and `timeout` bounds every fabric
/// operation. A kind that needs the `fabric` feature in a build without it
/// is an [`Error::Config`] naming the feature.
pub fn create(
    kind: TransportKind,
    topo: Topology,
    job_key: &str,
    job_id: &str,
    timeout: Duration,
) -> Result<Box<dyn Transport>> {
    let (rank, world) = (topo.rank(), topo.world());
    if matches!(kind, TransportKind::CudaIpc | TransportKind::EmuIpc) && topo.nodes() > 1 {
        return Err(Error::Config(format!(
            "the {} transport reaches only the ranks of one node, and this job has {} \
             nodes: use the nvshmem transport for GPUs on several nodes",
            kind.name(),
            topo.nodes()
        )));
    }
    match control_kind(kind, &topo) {
        TransportKind::Shm => Ok(Box::new(shm::ShmTransport::new(
            rank, world, job_key, job_id,
        )?)),
        #[cfg(feature = "fabric")]
        TransportKind::Fabric => Ok(Box::new(fabric::FabricTransport::new(
            rank, world, timeout,
        )?)),
        #[cfg(feature = "fabric")]
        TransportKind::Mixed => Ok(Box::new(mixed::MixedTransport::new(
            topo, job_key, job_id, timeout,
        )?)),
        other => {
            let _ = timeout;
            let why = if kind == TransportKind::Auto || kind.is_device() {
                format!(
                    "{} nodes need the fabric transport between them",
                    topo.nodes()
                )
            } else {
                format!("the {} transport", other.name())
            };
            Err(Error::Config(format!(
                "{why}: odc-core must be built with the `fabric` feature"
            )))
        }
    }
}

/// Every transport gives a waiter what it needs ([`crate::wait`] sits below
/// the transports and knows only this).
impl<T: Transport + ?Sized> crate::wait::Bells for T {
    fn bell_epoch(&self, bell: Bell) -> u32 {
        Transport::bell_epoch(self, bell)
    }

    fn bell_wait(&self, bell: Bell, epoch: u32, timeout: Duration) -> Result<()> {
        Transport::bell_wait(self, bell, epoch, timeout)
    }

    fn peer_status(&self, peer: usize) -> PeerStatus {
        Transport::peer_status(self, peer)
    }

    fn set_blame(&self, peer: usize) {
        Transport::set_blame(self, peer)
    }
}
