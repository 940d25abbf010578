//! The device data plane: where an engine's data lives when it is not host
//! memory, and how bytes move and add there.
//!
//! An engine built with a device transport keeps its **control words**
//! where the host transports keep them (host memory: the `shm` control
//! region, reached over libfabric from other nodes, so every wait is still
//! a host wait and the protocol is the one `loom` checks), and moves its
//! **data** — published shards, landing-slot data, accumulators — into
//! device memory:
//!
//! | transport | data regions | peers reached by |
//! |---|---|---|
//! | `cuda-ipc` (one node) | `cuMemCreate` regions exchanged by [`crate::gpu::ipc::exchange`] | copies into / out of their mappings |
//! | `nvshmem` (any nodes) | the NVSHMEM symmetric heap ([`nvshmem`]) | copies where NVSHMEM maps the peer, else `getmem` / `putmem` + quiet |
//! | `emu-ipc`, `emu-shmem` | `memfd` host memory ([`emu`]) | as `cuda-ipc`; `emu-shmem` delays puts to other nodes until a deliver |
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
//! | scatter-accumulate, peer chunk | put the chunk into the owner's landing slot, then deliver it | slot header and signal |
//! | scatter-accumulate, own slice | the daemon's stream waits for the caller's, adds the slice; the caller's waits for the daemon's | — |
//! | daemon, landing chunk | add the chunk on the daemon's stream | acknowledgement |
//!
//! [`emu`] runs streams as host threads that may sleep before every
//! operation (`jitter`), so the ordering above is tested on every machine:
//! a signal sent from the calling thread instead of the stream would let a
//! peer read bytes that are not there yet, and the exactness tests fail.

use std::fmt;
use std::time::Duration;

use odc_kernels::cpu::quant::Spec;
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
#[cfg(not(loom))]
pub mod nvshmem;

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

    /// Enqueues on the server stream the packing of one compressed chunk
    /// ([`PackJob`]): `scale · src` widened to f32 into `values`, then
    /// quantised into `chunk` (scales, then payload), through the residual
    /// with error feedback. The same arithmetic as the host's push, bit for
    /// bit.
    ///
    /// # Safety
    /// Every address of `job` must be backend memory of the sizes
    /// [`PackJob`] names, valid until the work has run, not overlapping.
    unsafe fn pack_on_server(&self, job: PackJob) -> Result<()>;

    /// Enqueues on the server stream the dequantisation of the first `take`
    /// elements of the compressed chunk of `len` elements at `chunk`
    /// (scales, then payload) into `dst`, `take` elements of `dst_dtype`
    /// (what a compressed gather writes into its output).
    ///
    /// # Safety
    /// `chunk` must address the chunk's `spec.chunk_bytes(len)` bytes and
    /// `dst` `take` writable elements, both valid until the work has run,
    /// not overlapping.
    #[allow(clippy::too_many_arguments)]
    unsafe fn dequantise_on_server(
        &self,
        chunk: u64,
        spec: Spec,
        len: usize,
        take: usize,
        dst: u64,
        dst_dtype: DType,
    ) -> Result<()>;

    /// Enqueues `acc[i] += scale · dequantised[i]` on the server stream for
    /// the `n` elements of the compressed chunk at `chunk` (scales, then
    /// payload, as [`DeviceOps::pack_on_server`] writes it).
    ///
    /// # Safety
    /// `acc` must address `n` writable f32s and `chunk` the chunk's
    /// `spec.chunk_bytes(n)` bytes, both valid until the work has run, not
    /// overlapping.
    unsafe fn dequantise_accumulate_on_server(
        &self,
        acc: u64,
        chunk: u64,
        spec: Spec,
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

/// One compressed chunk to pack on the device ([`DeviceOps::pack_on_server`]).
#[derive(Clone, Copy, Debug)]
pub struct PackJob {
    /// The chunk's format.
    pub spec: Spec,
    /// `n` elements of `src_dtype`: the gradient.
    pub src: u64,
    /// The gradient's dtype.
    pub src_dtype: DType,
    /// `Some(factor)`: the values are `0 + factor · src` (a push's scaled
    /// gradient, as the host's push computes them); `None`: `src` widened
    /// to f32 exactly (a published shard's quantised copy).
    pub scale: Option<f32>,
    /// Elements.
    pub n: usize,
    /// `n` f32 of scratch: the scaled gradient.
    pub values: u64,
    /// With error feedback, `n` f32: this pusher's residual of these
    /// elements, read and rewritten.
    pub residual: Option<u64>,
    /// `spec.chunk_bytes(n)` bytes, 4-aligned: the packed chunk.
    pub chunk: u64,
}

impl PackJob {
    /// The chunk's scales and payload addresses.
    pub fn split(&self) -> (u64, u64) {
        chunk_parts(self.chunk, self.spec, self.n)
    }
}

/// The scales and payload addresses of a compressed chunk of `n` elements
/// at `chunk` (scales, then payload, as `quantise_chunk` lays it out).
pub fn chunk_parts(chunk: u64, spec: Spec, n: usize) -> (u64, u64) {
    (chunk, chunk + (4 * spec.scales(n)) as u64)
}

/// Sizes of the data regions one rank allocates, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataSizes {
    /// Published parameter shards (every bucket's, aligned), then with
    /// compressed gathers their quantised copies and the gathers' staging.
    pub params: usize,
    /// Landing-slot data: two slots of `chunk_bytes` per client, then with
    /// compressed pushes the buffers they are packed in.
    pub landing: usize,
    /// f32 accumulators.
    pub accum: usize,
    /// This rank's share of its node's node-cache slots (0: no node cache;
    /// see [`crate::EngineConfig::node_cache`]), mapped by its node-mates.
    pub cache: usize,
}

impl DataSizes {
    /// The three regions as NVSHMEM symmetric-heap buffers.
    pub fn heap_plan(&self) -> crate::gpu::nvshmem::HeapPlan {
        let mut plan = crate::gpu::nvshmem::HeapPlan::new([self.params, self.landing, self.accum]);
        if self.cache > 0 {
            plan.push(self.cache);
        }
        plan
    }
}

/// Region ids of the data regions (distinct from the control region's):
/// params, landing, accumulators, node-cache slots.
const DATA_REGIONS: [u32; 4] = [1, 3, 2, 4];

/// What the engine uses: this rank's data regions, access to every peer's,
/// and the backend's operations.
///
/// Peers are reached with [`get_params`](Plane::get_params) and
/// [`put_landing`](Plane::put_landing). A put need not have reached its
/// target when the stream passes it (NVSHMEM's puts to another node complete
/// only at a quiet): [`deliver`](Plane::deliver) is what orders the puts
/// before the signal that announces them.
pub trait Plane: Send + Sync + fmt::Debug {
    /// The backend's stream operations.
    fn ops(&self) -> &dyn DeviceOps;
    /// Address of byte 0 of this rank's params region (published shards).
    fn local_params(&self) -> u64;
    /// Address of byte 0 of this rank's landing region.
    fn local_landing(&self) -> u64;
    /// Address of byte 0 of this rank's accumulators.
    fn accum(&self) -> u64;

    /// Enqueues on `stream` a read of `len` bytes at `offset` of `rank`'s
    /// params region into `dst`; when the stream passes it, the bytes are
    /// in `dst`. `rank` is global.
    ///
    /// # Safety
    /// `dst` must address `len` writable bytes of the backend's device,
    /// valid until the read has run; the range of `rank`'s params must not
    /// change until then (the protocol's versions).
    unsafe fn get_params(
        &self,
        stream: StreamHandle,
        dst: u64,
        rank: usize,
        offset: usize,
        len: usize,
    ) -> Result<()>;

    /// Enqueues on `stream` a write of `len` bytes from `src` into `rank`'s
    /// landing region at `offset`. It is complete at `rank` once a later
    /// [`deliver`](Plane::deliver) on `stream` has run.
    ///
    /// # Safety
    /// `src` must address `len` readable bytes of the backend's device,
    /// valid until the write has run; the target range must be free (the
    /// protocol's acknowledgements).
    unsafe fn put_landing(
        &self,
        stream: StreamHandle,
        rank: usize,
        offset: usize,
        src: u64,
        len: usize,
    ) -> Result<()>;

    /// Enqueues on `stream` the completion of every put enqueued on it so
    /// far: work enqueued later runs after they have reached their
    /// targets (`nvshmemx_quiet_on_stream`; nothing for mapped memory).
    fn deliver(&self, stream: StreamHandle) -> Result<()>;

    /// Address, in this process, of byte 0 of node-mate `rank`'s share of
    /// the node cache's slots ([`DataSizes::cache`]; this rank's own too),
    /// which stream copies read and write directly. An error when `rank`
    /// allocated none or its share is not mapped here.
    fn node_cache(&self, rank: usize) -> Result<u64>;
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
        let mut regions = vec![
            (DATA_REGIONS[0], sizes.params),
            (DATA_REGIONS[1], sizes.landing),
            (DATA_REGIONS[2], sizes.accum),
        ];
        if sizes.cache > 0 {
            regions.push((DATA_REGIONS[3], sizes.cache));
        }
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

impl<B: DeviceBackend> IpcPlane<B> {
    /// `rank`'s region `index`, mapped here.
    fn region(&self, rank: usize, index: usize, what: &str) -> Result<u64> {
        self.regions.addr(self.rank, rank, index).ok_or_else(|| {
            crate::Error::protocol(None, format!("rank {rank} has no mapped {what} region"))
        })
    }
}

impl<B: DeviceBackend> Plane for IpcPlane<B> {
    fn ops(&self) -> &dyn DeviceOps {
        self.backend.as_ref()
    }
    fn local_params(&self) -> u64 {
        B::Memory::region_addr(&self.regions.local[0])
    }
    fn local_landing(&self) -> u64 {
        B::Memory::region_addr(&self.regions.local[1])
    }
    fn accum(&self) -> u64 {
        B::Memory::region_addr(&self.regions.local[2])
    }

    unsafe fn get_params(
        &self,
        stream: StreamHandle,
        dst: u64,
        rank: usize,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let src = self.region(rank, 0, "params")? + offset as u64;
        // SAFETY: `src` lies in `rank`'s params region, mapped here; the
        // caller vouches for `dst` and for the range staying unchanged.
        unsafe { self.backend.copy(stream, dst, src, len) }
    }

    unsafe fn put_landing(
        &self,
        stream: StreamHandle,
        rank: usize,
        offset: usize,
        src: u64,
        len: usize,
    ) -> Result<()> {
        let dst = self.region(rank, 1, "landing")? + offset as u64;
        // SAFETY: `dst` lies in `rank`'s landing region, mapped here; the
        // caller vouches for `src` and for the range being free.
        unsafe { self.backend.copy(stream, dst, src, len) }
    }

    fn deliver(&self, _stream: StreamHandle) -> Result<()> {
        // A copy into mapped memory is complete when the stream passes it.
        Ok(())
    }

    fn node_cache(&self, rank: usize) -> Result<u64> {
        self.region(rank, 3, "node cache")
    }
}

/// The device backend `kind` needs, or `None` for a host transport.
/// `ordinal` picks the CUDA device (default: the local rank);
/// `heap_reserve` is `nvshmem`'s symmetric heap planned for later engines
/// ([`crate::EngineConfig::heap_reserve`]).
///
/// Errors: for `cuda-ipc` without a usable GPU, [`crate::Error::GpuUnavailable`]
/// naming what is missing (driver, device, NVRTC, a driver function).
pub fn create(
    kind: TransportKind,
    topo: &Topology,
    ordinal: Option<usize>,
    heap_reserve: usize,
) -> Result<Option<Box<dyn Connect>>> {
    match kind {
        TransportKind::EmuIpc => {
            let backend = emu::EmuBackend::new(emu::EmuBackend::jitter_from_env()?)?;
            Ok(Some(Box::new(backend)))
        }
        TransportKind::EmuShmem => {
            let jitter = emu::EmuBackend::jitter_from_env()?;
            Ok(Some(Box::new(emu::EmuShmem::new(*topo, jitter)?)))
        }
        TransportKind::CudaIpc => {
            let ordinal = ordinal.unwrap_or_else(|| topo.local_rank_of(topo.rank()));
            Ok(Some(Box::new(cuda::CudaBackend::open(ordinal)?)))
        }
        TransportKind::Nvshmem => {
            let ordinal = ordinal.unwrap_or_else(|| topo.local_rank_of(topo.rank()));
            Ok(Some(Box::new(nvshmem::NvshmemBackend::open(
                ordinal,
                heap_reserve,
            )?)))
        }
        _ => Ok(None),
    }
}
