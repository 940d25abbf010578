//! `nvshmem`: the device data plane on NVSHMEM's symmetric heap, for GPUs
//! on any number of nodes.
//!
//! [`NvshmemBackend`] is a [`CudaBackend`] (streams, kernels, the daemon's
//! stream) plus an NVSHMEM session that [`Connect::connect`] starts once the
//! registered buckets are known: the shard group's ranks join as PEs (the
//! unique id travels through the Store), and the symmetric heap is sized
//! from the three data regions ([`HeapPlan`](crate::gpu::nvshmem::HeapPlan)), never from a hand-set
//! `NVSHMEM_SYMMETRIC_SIZE`.
//!
//! | plane call | peer NVSHMEM maps (same node, NVLink) | other peers |
//! |---|---|---|
//! | [`get_params`](Plane::get_params) | `cuMemcpyDtoDAsync` from `nvshmem_ptr` | `nvshmemx_getmem_on_stream` |
//! | [`put_landing`](Plane::put_landing) | `cuMemcpyDtoDAsync` to `nvshmem_ptr` | `nvshmemx_putmem_on_stream` |
//! | [`deliver`](Plane::deliver) | nothing | `nvshmemx_quiet_on_stream` |
//!
//! Control words stay host words (`shm` within a node, libfabric across
//! nodes), written by host work on the stream after the data, as for
//! `cuda-ipc` (see [`crate::plane`]).
//!
//! A process holds one NVSHMEM session, whose heap is fixed when it starts:
//! engines created later in the same process (the `odc` backend's second
//! engine) share the first one's session, which must have planned their
//! regions ([`crate::EngineConfig::heap_reserve`], computed with
//! [`crate::Engine::heap_bytes`]); an allocation outside the plan is a
//! [`Error::Config`] naming the numbers.
//!
//! Teardown is collective, as NVSHMEM's is: dropping the plane frees the
//! symmetric buffers (`nvshmem_free`) and finalizes the session, and both
//! wait for every PE.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cuda::CudaBackend;
use super::{Connect, DataSizes, DeviceOps, Plane, StreamHandle};
use crate::gpu::nvshmem::{Nvshmem, SymmetricBuffer};
use crate::store::Store;
use crate::{Error, Result};

/// The `nvshmem` backend before registration: a CUDA device, with the
/// NVSHMEM library checked to be loadable.
#[derive(Debug)]
pub struct NvshmemBackend {
    cuda: Arc<CudaBackend>,
    ordinal: usize,
    /// Heap planned beyond this engine's regions, for later engines of this
    /// process that share its session.
    heap_reserve: usize,
}

impl NvshmemBackend {
    /// Opens device `ordinal` ([`CudaBackend::open`]) after checking the
    /// driver, the device, NVRTC and the NVSHMEM host library. A session this
    /// backend starts plans `heap_reserve` bytes beyond its own regions.
    ///
    /// Errors: [`Error::GpuUnavailable`] naming the first thing missing;
    /// [`Error::Cuda`] when a present driver fails.
    pub fn open(ordinal: usize, heap_reserve: usize) -> Result<Arc<NvshmemBackend>> {
        crate::gpu::probe_device(ordinal)?;
        Ok(Arc::new(NvshmemBackend {
            cuda: CudaBackend::open(ordinal)?,
            ordinal,
            heap_reserve,
        }))
    }
}

impl Connect for Arc<NvshmemBackend> {
    fn name(&self) -> &'static str {
        "nvshmem"
    }

    fn connect(
        &self,
        store: &dyn Store,
        prefix: &str,
        _job_key: &str,
        rank: usize,
        group: &[usize],
        sizes: DataSizes,
        timeout: Duration,
    ) -> Result<Box<dyn Plane>> {
        let me = group.iter().position(|&r| r == rank).ok_or_else(|| {
            Error::Config(format!("rank {rank} is not in its shard group {group:?}"))
        })?;
        let mut plan = sizes.heap_plan();
        if self.heap_reserve > 0 {
            plan.push(self.heap_reserve);
        }
        // The process's session when an earlier engine of this job started
        // one (its plan must hold these regions), else a new one.
        let session = Nvshmem::join_shared(
            store,
            &format!("{prefix}/nvshmem/id"),
            me,
            group.len(),
            self.ordinal,
            plan,
            Instant::now() + timeout,
        )?;
        // Collective, in the same order on every PE.
        let params = session.alloc(sizes.params)?;
        let landing = session.alloc(sizes.landing)?;
        let accum = session.alloc(sizes.accum)?;
        let mapped = |buf: &SymmetricBuffer| {
            (0..group.len())
                .map(|pe| buf.peer_ptr(pe))
                .collect::<Result<Vec<_>>>()
        };
        let (peer_params, peer_landing) = (mapped(&params)?, mapped(&landing)?);
        // The node cache's slots: node-mates copy into and out of each
        // other's shares through NVSHMEM's peer mappings.
        let cache = match sizes.cache {
            0 => None,
            bytes => Some(session.alloc(bytes)?),
        };
        let peer_cache = match &cache {
            Some(buf) => mapped(buf)?,
            None => Vec::new(),
        };
        // Accumulators start at zero; the heap does not promise it.
        // SAFETY: `accum` is this PE's symmetric buffer of `sizes.accum` bytes.
        unsafe { self.cuda.zero_on_server(accum.device_ptr(), sizes.accum)? };
        self.cuda.synchronize(self.cuda.server_stream())?;
        let unmapped = peer_params.iter().chain(&peer_landing).any(Option::is_none);
        Ok(Box::new(NvshmemPlane {
            cuda: Arc::clone(&self.cuda),
            pe_of: pe_of(group),
            peer_params,
            peer_landing,
            unmapped,
            params,
            landing,
            accum,
            peer_cache,
            _cache: cache,
            session,
        }))
    }
}

/// `pe_of[rank]` for the global ranks up to the group's largest.
fn pe_of(group: &[usize]) -> Vec<Option<usize>> {
    let mut out = vec![None; group.iter().max().map_or(0, |&r| r + 1)];
    for (pe, &rank) in group.iter().enumerate() {
        out[rank] = Some(pe);
    }
    out
}

/// The shard group's data regions on the symmetric heap.
struct NvshmemPlane {
    cuda: Arc<CudaBackend>,
    /// The PE of each global rank (`None`: not in the shard group); PE `i`
    /// is the group's `i`-th rank. Looked up on every get and put.
    pe_of: Vec<Option<usize>>,
    /// Load/store addresses of every PE's params / landing region, where
    /// NVSHMEM maps them into this process.
    peer_params: Vec<Option<u64>>,
    peer_landing: Vec<Option<u64>>,
    /// Whether some peer is reached only through NVSHMEM's network path
    /// (then [`Plane::deliver`] has puts to complete).
    unmapped: bool,
    // Fields drop in order: the buffers (collective frees), then the
    // session (collective finalize) once they were its last users.
    params: SymmetricBuffer,
    landing: SymmetricBuffer,
    accum: SymmetricBuffer,
    /// Where each PE's node-cache share is mapped here (empty: no cache).
    peer_cache: Vec<Option<u64>>,
    _cache: Option<SymmetricBuffer>,
    session: Arc<Nvshmem>,
}

impl fmt::Debug for NvshmemPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvshmemPlane")
            .field("pe_of", &self.pe_of)
            .field("pe", &self.session.rank())
            .field("heap_bytes", &self.session.heap_bytes())
            .field("unmapped", &self.unmapped)
            .finish()
    }
}

impl NvshmemPlane {
    /// The PE of global rank `rank`.
    fn pe(&self, rank: usize) -> Result<usize> {
        self.pe_of.get(rank).copied().flatten().ok_or_else(|| {
            Error::protocol(
                None,
                format!("rank {rank} is not in this engine's shard group"),
            )
        })
    }

    /// NVSHMEM's stream calls need the device's context on this thread.
    fn bind(&self) -> Result<()> {
        self.cuda.gpu().bind()
    }
}

impl Drop for NvshmemPlane {
    fn drop(&mut self) {
        // Work still queued on the daemon's stream reads and writes these
        // buffers: let it finish before they are freed.
        if let Err(e) = self.cuda.synchronize(self.cuda.server_stream()) {
            eprintln!("odc: PE {}: nvshmem: {e}", self.session.rank());
        }
        // The frees and the finalize that follow are NVSHMEM calls: they
        // need the device's context on this (any) thread.
        if let Err(e) = self.bind() {
            eprintln!("odc: PE {}: nvshmem teardown: {e}", self.session.rank());
        }
    }
}

impl Plane for NvshmemPlane {
    fn ops(&self) -> &dyn DeviceOps {
        self.cuda.as_ref()
    }
    fn local_params(&self) -> u64 {
        self.params.device_ptr()
    }
    fn local_landing(&self) -> u64 {
        self.landing.device_ptr()
    }
    fn accum(&self) -> u64 {
        self.accum.device_ptr()
    }

    unsafe fn get_params(
        &self,
        stream: StreamHandle,
        dst: u64,
        rank: usize,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let pe = self.pe(rank)?;
        match self.peer_params[pe] {
            // SAFETY: NVSHMEM maps `pe`'s params here; the caller vouches
            // for `dst` and the range staying unchanged.
            Some(base) => unsafe { self.cuda.copy(stream, dst, base + offset as u64, len) },
            None => {
                self.bind()?;
                // SAFETY: as above; `get_on_stream` checks the range.
                unsafe {
                    self.session
                        .get_on_stream(dst, &self.params, offset, len, pe, stream)
                }
            }
        }
    }

    unsafe fn put_landing(
        &self,
        stream: StreamHandle,
        rank: usize,
        offset: usize,
        src: u64,
        len: usize,
    ) -> Result<()> {
        let pe = self.pe(rank)?;
        match self.peer_landing[pe] {
            // SAFETY: NVSHMEM maps `pe`'s landing region here; the caller
            // vouches for `src` and the slot being free.
            Some(base) => unsafe { self.cuda.copy(stream, base + offset as u64, src, len) },
            None => {
                self.bind()?;
                // SAFETY: as above; `put_on_stream` checks the range.
                unsafe {
                    self.session
                        .put_on_stream(&self.landing, offset, src, len, pe, stream)
                }
            }
        }
    }

    fn deliver(&self, stream: StreamHandle) -> Result<()> {
        if !self.unmapped {
            // Every put was a copy into mapped memory, complete when the
            // stream passes it.
            return Ok(());
        }
        self.bind()?;
        self.session.quiet_on_stream(stream)
    }

    fn node_cache(&self, rank: usize) -> Result<u64> {
        let pe = self.pe(rank)?;
        self.peer_cache.get(pe).copied().flatten().ok_or_else(|| {
            Error::protocol(
                None,
                format!(
                    "rank {rank}'s node cache is not mapped here: NVSHMEM gives no peer mapping \
                     between these GPUs of one node (no NVLink or P2P); run without the node cache \
                     (node_cache=0, ODC_NODE_CACHE_MB=0)"
                ),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pe_of_maps_the_group_in_order() {
        assert_eq!(pe_of(&[0, 1, 2]), [Some(0), Some(1), Some(2)]);
        assert_eq!(pe_of(&[1, 3]), [None, Some(0), None, Some(1)]);
        assert!(pe_of(&[]).is_empty());
    }

    #[test]
    fn without_a_gpu_open_names_what_is_missing() {
        match NvshmemBackend::open(0, 0) {
            Err(Error::GpuUnavailable(missing)) => eprintln!("nvshmem: {missing}"),
            Err(other) => panic!("expected GpuUnavailable, got {other}"),
            Ok(backend) => eprintln!("a GPU is present: {backend:?}"),
        }
    }
}
