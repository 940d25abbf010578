//! The device data plane: where an engine's data lives when it is not host
//! memory, and how bytes move and add there.
//!
//! An engine built with a device transport (`cuda-ipc`, or its host
//! emulation `emu-ipc`) keeps its **control words** exactly where the host
//! transports keep them (the `shm` control region, so every wait is still a
//! futex wait and the protocol is the one `loom` checks), and moves its
//! **data** — published shards, landing-slot data, accumulators — into
//! memory of a [`DeviceBackend`]: device memory shared within a node
//! (`cuMemCreate` regions exchanged by [`crate::gpu::ipc::exchange`]), or
//! `memfd` host memory for the emulation.
//!
//! Every data operation is enqueued on a **stream** and returns before it
//! runs. A signal that tells a peer the data is there is enqueued on the same
//! stream after the data ([`DeviceOps::then`], a host function that
//! runs once the work before it has completed), so no signal can overtake
//! the bytes it announces and no thread waits for a copy:
//!
//! | step | stream | then |
//! |---|---|---|
//! | publish | copy the shard into this rank's params region | version signal to every reader |
//! | gather | copy every owner's shard out of its mapping | — (release enqueues its signal) |
//! | release | — | released signal to every owner |
//! | scatter-accumulate, peer chunk | copy the chunk into the owner's landing slot | slot header and signal |
//! | scatter-accumulate, own slice | the daemon's stream waits for the caller's, adds the slice; the caller's waits for the daemon's | — |
//! | daemon, landing chunk | add the chunk on the daemon's stream | acknowledgement |
//!
//! [`emu`] runs streams as host threads that may sleep before every
//! operation (`jitter`), so the ordering above is tested on every machine:
//! a signal sent from the calling thread instead of the stream would let a
//! peer read bytes that are not there yet, and the exactness tests fail.

use std::fmt;
use std::time::Duration;

use odc_kernels::DType;

use crate::gpu::fdshare::SharePolicy;
use crate::gpu::ipc::{exchange, NodeRegions, SharedMemory};
use crate::store::Store;
use crate::topology::Topology;
use crate::transport::TransportKind;
use crate::Result;

#[cfg(not(loom))]
pub mod cuda;
pub mod emu;

/// A stream handle: a `CUstream` for CUDA (what torch's
/// `torch.cuda.current_stream().cuda_stream` returns), an emulated
/// stream's id for [`emu`].
pub type StreamHandle = usize;

/// A host function enqueued on a stream.
pub type HostWork = Box<dyn FnOnce() + Send + 'static>;

/// What a device backend provides: shareable memory ([`DeviceBackend`])
/// and the stream operations the engine runs on it ([`DeviceOps`]).
pub trait DeviceBackend: DeviceOps + 'static {
    /// The memory provider regions are allocated from and exchanged with.
    type Memory: SharedMemory;

    /// The memory provider.
    fn memory(&self) -> &Self::Memory;
}

/// A device backend's stream operations (object safe).
///
/// Addresses are the backend's (device addresses for CUDA); every
/// operation is enqueued on a stream and returns before it runs, unless it
/// says otherwise.
pub trait DeviceOps: Send + Sync + fmt::Debug {
    /// Transport name (`"cuda-ipc"`, `"emu-ipc"`).
    fn name(&self) -> &'static str;

    /// The stream the shard server daemon enqueues on (the backend owns it).
    fn server_stream(&self) -> StreamHandle;

    /// Enqueues a copy of `len` bytes from `src` to `dst` on `stream`.
    ///
    /// # Safety
    /// Both ranges must be backend memory (local or mapped from a peer) of
    /// `len` bytes that stays valid until the copy has run.
    unsafe fn copy(&self, stream: StreamHandle, dst: u64, src: u64, len: usize) -> Result<()>;

    /// Enqueues `acc[i] += scale · x[i]` for `n` elements on the server
    /// stream; `acc` is f32, `x` is `x_dtype`.
    ///
    /// # Safety
    /// `acc` must address `n` writable f32s and `x` `n` readable elements,
    /// both valid until the work has run, not overlapping.
    unsafe fn accumulate_on_server(
        &self,
        acc: u64,
        x: u64,
        x_dtype: DType,
        n: usize,
        scale: f32,
    ) -> Result<()>;

    /// Enqueues zeroing `len` bytes at `dst` on the server stream.
    ///
    /// # Safety
    /// `dst` must address `len` writable bytes valid until the work has run.
    unsafe fn zero_on_server(&self, dst: u64, len: usize) -> Result<()>;

    /// Enqueues `work` to run on the host once everything enqueued on
    /// `stream` before it has completed; work after it waits for it. `work`
    /// must not call the backend.
    fn then(&self, stream: StreamHandle, work: HostWork) -> Result<()>;

    /// Makes `waiter` wait, before any work enqueued on it later, until the
    /// work enqueued on `after` so far has completed (an event recorded on
    /// `after`, waited for by `waiter`). Returns at once.
    fn order(&self, waiter: StreamHandle, after: StreamHandle) -> Result<()>;

    /// Blocks until everything enqueued on `stream` so far has run.
    fn synchronize(&self, stream: StreamHandle) -> Result<()>;

    /// Copies `dst.len()` bytes at `src` into host memory, after everything
    /// enqueued on the server stream has run. Blocks.
    ///
    /// # Safety
    /// `src` must address `dst.len()` readable bytes of backend memory.
    unsafe fn read_to_host(&self, src: u64, dst: &mut [u8]) -> Result<()>;
}

/// Sizes of the data regions one rank allocates, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataSizes {
    /// Published parameter shards (every bucket's, aligned).
    pub params: usize,
    /// Landing-slot data: two slots of `chunk_bytes` per client.
    pub landing: usize,
    /// f32 accumulators.
    pub accum: usize,
}

/// Region ids of the data regions (distinct from the control region's).
const DATA_REGIONS: [u32; 3] = [1, 3, 2];

/// What the engine uses: the data regions of every rank of the shard group,
/// mapped here, and the backend's operations.
pub trait Plane: Send + Sync + fmt::Debug {
    /// The backend's stream operations.
    fn ops(&self) -> &dyn DeviceOps;
    /// Address of byte 0 of `rank`'s params region (`rank` global).
    fn params(&self, rank: usize) -> Option<u64>;
    /// Address of byte 0 of `rank`'s landing region.
    fn landing(&self, rank: usize) -> Option<u64>;
    /// Address of byte 0 of this rank's accumulators.
    fn accum(&self) -> u64;
}

/// A backend before registration: connects the data regions once their
/// sizes are known (object safe, so the engine holds any backend).
pub trait Connect: Send + Sync + fmt::Debug {
    /// Transport name.
    fn name(&self) -> &'static str;

    /// Allocates this rank's data regions, exchanges them with `group`
    /// (global ranks on this node, this one included) through `store`, and
    /// maps every peer's. Collective over `group`.
    #[allow(clippy::too_many_arguments)]
    fn connect(
        &self,
        store: &dyn Store,
        prefix: &str,
        job_key: &str,
        rank: usize,
        group: &[usize],
        sizes: DataSizes,
        timeout: Duration,
    ) -> Result<Box<dyn Plane>>;
}

/// A backend with every rank's data regions mapped.
struct IpcPlane<B: DeviceBackend> {
    backend: std::sync::Arc<B>,
    regions: NodeRegions<B::Memory>,
    rank: usize,
}

impl<B: DeviceBackend> fmt::Debug for IpcPlane<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcPlane")
            .field("backend", &self.backend)
            .field("regions", &self.regions)
            .finish()
    }
}

impl<B: DeviceBackend> Connect for std::sync::Arc<B> {
    fn name(&self) -> &'static str {
        DeviceOps::name(self.as_ref())
    }

    fn connect(
        &self,
        store: &dyn Store,
        prefix: &str,
        job_key: &str,
        rank: usize,
        group: &[usize],
        sizes: DataSizes,
        timeout: Duration,
    ) -> Result<Box<dyn Plane>> {
        let regions = [
            (DATA_REGIONS[0], sizes.params),
            (DATA_REGIONS[1], sizes.landing),
            (DATA_REGIONS[2], sizes.accum),
        ];
        let regions = exchange(
            self.memory(),
            store,
            &format!("{prefix}/data"),
            job_key,
            rank,
            group,
            &regions,
            SharePolicy::from_env()?,
            timeout,
        )?;
        Ok(Box::new(IpcPlane {
            backend: std::sync::Arc::clone(self),
            regions,
            rank,
        }))
    }
}

impl<B: DeviceBackend> Drop for IpcPlane<B> {
    fn drop(&mut self) {
        // Work still queued on the daemon's stream reads and writes these
        // regions: let it finish before they are unmapped.
        if let Err(e) = self.backend.synchronize(self.backend.server_stream()) {
            eprintln!("odc: rank {}: {}: {e}", self.rank, self.backend.name());
        }
    }
}

impl<B: DeviceBackend> Plane for IpcPlane<B> {
    fn ops(&self) -> &dyn DeviceOps {
        self.backend.as_ref()
    }
    fn params(&self, rank: usize) -> Option<u64> {
        self.regions.addr(self.rank, rank, 0)
    }
    fn landing(&self, rank: usize) -> Option<u64> {
        self.regions.addr(self.rank, rank, 1)
    }
    fn accum(&self) -> u64 {
        B::Memory::region_addr(&self.regions.local[2])
    }
}

/// The device backend `kind` needs, or `None` for a host transport.
/// `ordinal` picks the CUDA device (default: the local rank).
///
/// Errors: for `cuda-ipc` without a usable GPU, [`crate::Error::GpuUnavailable`]
/// naming what is missing (driver, device, NVRTC, a driver function).
pub fn create(
    kind: TransportKind,
    topo: &Topology,
    ordinal: Option<usize>,
) -> Result<Option<Box<dyn Connect>>> {
    match kind {
        TransportKind::EmuIpc => {
            let backend = emu::EmuBackend::new(emu::EmuBackend::jitter_from_env()?)?;
            Ok(Some(Box::new(backend)))
        }
        TransportKind::CudaIpc => {
            let ordinal = ordinal.unwrap_or_else(|| topo.local_rank_of(topo.rank()));
            Ok(Some(Box::new(cuda::CudaBackend::open(ordinal)?)))
        }
        _ => Ok(None),
    }
}
