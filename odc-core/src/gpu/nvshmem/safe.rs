//! Safe NVSHMEM: an [`Nvshmem`] session per process, [`SymmetricBuffer`]s
//! freed on drop, and a [`HeapPlan`] that sizes the symmetric heap from
//! what the caller will allocate.
//!
//! One file because the session, its buffers and the heap plan share the
//! session's lock and lifetime rules; the last eighty lines are tests.
//!
//! NVSHMEM fixes its symmetric heap at init from `NVSHMEM_SYMMETRIC_SIZE`.
//! ODC registers eagerly and collectively, so it knows every region's size
//! before init: [`Nvshmem::init`] takes the [`HeapPlan`], sets the variable
//! to the plan's size (nobody tunes it by hand) and refuses allocations the
//! plan did not include, with an error that names the numbers.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::result::{self, init, mem, pe, rma, sync};
use super::sys;
use crate::store::{wait_get, Store};
use crate::{Error, Result};

/// The unique id that bootstraps a job: rank 0 creates it, the Store
/// carries its bytes to every rank.
#[derive(Clone, Copy, Debug)]
pub struct UniqueId(sys::nvshmemx_uniqueid_t);

impl UniqueId {
    /// Bytes on the wire (the Store value).
    pub const LEN: usize = std::mem::size_of::<sys::nvshmemx_uniqueid_t>();

    /// A fresh id from NVSHMEM (rank 0).
    pub fn new() -> Result<UniqueId> {
        Ok(UniqueId(init::get_uniqueid()?))
    }

    /// Its bytes, to publish through the Store.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::LEN);
        out.extend_from_slice(&self.0.version.to_ne_bytes());
        out.extend(self.0.internal.iter().map(|&c| c as u8));
        out
    }

    /// An id read back from the Store.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        if bytes.len() != Self::LEN {
            return Err(Error::protocol(
                None,
                format!(
                    "NVSHMEM unique id is {} bytes, expected {}",
                    bytes.len(),
                    Self::LEN
                ),
            ));
        }
        let mut id = sys::nvshmemx_uniqueid_t {
            version: c_int::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            ..Default::default()
        };
        for (dst, &src) in id.internal.iter_mut().zip(&bytes[4..]) {
            *dst = src as _;
        }
        Ok(UniqueId(id))
    }
}

/// Every symmetric allocation a session will make, and the heap that holds
/// them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeapPlan {
    buffers: Vec<usize>,
}

impl HeapPlan {
    /// Alignment of every allocation ([`Nvshmem::alloc`] uses `nvshmem_align`).
    pub const ALIGN: usize = 512;
    /// Heap granularity NVSHMEM maps in (its size is rounded up to this).
    pub const GRANULE: usize = 2 << 20;

    /// A plan for these buffer sizes, in bytes.
    pub fn new(buffers: impl IntoIterator<Item = usize>) -> HeapPlan {
        HeapPlan {
            buffers: buffers.into_iter().collect(),
        }
    }

    /// Adds one buffer.
    pub fn push(&mut self, bytes: usize) {
        self.buffers.push(bytes);
    }

    /// Bytes one buffer takes on the heap.
    pub fn footprint(bytes: usize) -> usize {
        bytes.max(1).next_multiple_of(Self::ALIGN)
    }

    /// Bytes the planned buffers take.
    pub fn used_bytes(&self) -> usize {
        self.buffers.iter().map(|&b| Self::footprint(b)).sum()
    }

    /// `NVSHMEM_SYMMETRIC_SIZE` for this plan: the buffers, aligned,
    /// rounded up to the granule (NVSHMEM adds its own internal reserve on
    /// top of this figure).
    pub fn heap_bytes(&self) -> usize {
        self.used_bytes().max(1).next_multiple_of(Self::GRANULE)
    }
}

/// One process can hold one NVSHMEM session at a time.
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// The session [`Nvshmem::join_shared`] hands to the engines of this process.
static SHARED: Mutex<std::sync::Weak<Nvshmem>> = Mutex::new(std::sync::Weak::new());

/// An initialized NVSHMEM job membership. Dropping it finalizes NVSHMEM.
///
/// Thread safety: initialized with NVSHMEM's default (serialized) support;
/// the session serializes its own stream calls under a lock, so the
/// daemon's and the clients' threads may share it.
#[derive(Debug)]
pub struct Nvshmem {
    rank: usize,
    world: usize,
    plan: HeapPlan,
    heap_bytes: usize,
    /// Bytes handed out so far.
    used: Mutex<usize>,
    /// Held across every NVSHMEM call on a stream (serialized support).
    calls: Mutex<()>,
    /// The device's primary context, retained until after finalize (a
    /// field drops after `Drop::drop` runs).
    _ctx: std::sync::Arc<odc_kernels::cuda::CudaContext>,
}

impl Nvshmem {
    /// Joins the job `id` as `rank` of `world` on CUDA device `device`,
    /// with a symmetric heap sized for `plan`. Collective: every rank calls
    /// it with the same id and plan. Sets `NVSHMEM_SYMMETRIC_SIZE`, so call
    /// it before threads that read the environment start.
    ///
    /// Errors: [`Error::GpuUnavailable`] naming what is missing (checked
    /// before NVSHMEM is touched), [`Error::Config`] for a second session
    /// or bad ranks, [`Error::Nvshmem`] when init fails.
    pub fn init(
        id: &UniqueId,
        rank: usize,
        world: usize,
        device: usize,
        plan: HeapPlan,
    ) -> Result<Nvshmem> {
        if world == 0 || rank >= world {
            return Err(Error::Config(format!(
                "NVSHMEM rank {rank} of world {world}"
            )));
        }
        // Driver, device and NVRTC first, then the NVSHMEM library itself.
        let info = crate::gpu::probe_device(device)?;
        let (rank_c, world_c) = match (c_int::try_from(rank), c_int::try_from(world)) {
            (Ok(r), Ok(w)) => (r, w),
            _ => return Err(Error::Config(format!("NVSHMEM world {world} too large"))),
        };
        if ACTIVE.swap(true, Ordering::AcqRel) {
            return Err(Error::Config(
                "an NVSHMEM session is already active in this process".into(),
            ));
        }
        let heap_bytes = plan.heap_bytes();
        std::env::set_var("NVSHMEM_SYMMETRIC_SIZE", heap_bytes.to_string());
        let started = (|| {
            // NVSHMEM binds to the calling thread's current context.
            let ctx = odc_kernels::cuda::CudaContext::new(info.cuda.ordinal)
                .and_then(|ctx| ctx.bind_to_thread().map(|()| ctx))
                .map_err(|e| Error::Cuda {
                    call: "cuDevicePrimaryCtxRetain",
                    detail: e.to_string(),
                })?;
            let mut attr = sys::nvshmemx_init_attr_t::default();
            // SAFETY: `id` outlives `attr`, which dies at the end of this
            // closure, after init.
            unsafe { init::set_attr_uniqueid_args(rank_c, world_c, &id.0, &mut attr)? };
            // Version-1 arguments (every NVSHMEM 3 takes them): the PE uses
            // the context bound above, `device`'s primary context.
            // SAFETY: the device's context is current; one session per
            // process (ACTIVE); finalized in Drop.
            unsafe { init::hostlib_init_attr(sys::NVSHMEMX_INIT_WITH_UNIQUEID, &mut attr)? };
            Ok::<_, Error>(ctx)
        })();
        let ctx = match started {
            Ok(ctx) => ctx,
            Err(e) => {
                ACTIVE.store(false, Ordering::Release);
                return Err(e);
            }
        };
        // From here on, dropping the session finalizes NVSHMEM.
        let session = Nvshmem {
            rank,
            world,
            plan,
            heap_bytes,
            used: Mutex::new(0),
            calls: Mutex::new(()),
            _ctx: ctx,
        };
        let (me, n) = (pe::my()?, pe::count()?);
        if me != rank_c || n != world_c {
            return Err(Error::Config(format!(
                "NVSHMEM placed this process as PE {me} of {n}, expected rank {rank} of {world}"
            )));
        }
        Ok(session)
    }

    /// [`Nvshmem::init`] with the unique id exchanged through `store`
    /// under `key`: rank 0 creates it and publishes its bytes, every other
    /// rank waits for them until `deadline`. The device is probed first, so
    /// a machine without a GPU fails with [`Error::GpuUnavailable`] before
    /// anything is published or awaited.
    ///
    /// Errors: as [`Nvshmem::init`]; a Store error naming `key` when rank 0
    /// never publishes; [`Error::Protocol`] for a malformed id.
    pub fn join(
        store: &dyn Store,
        key: &str,
        rank: usize,
        world: usize,
        device: usize,
        plan: HeapPlan,
        deadline: std::time::Instant,
    ) -> Result<Nvshmem> {
        if world == 0 || rank >= world {
            return Err(Error::Config(format!(
                "NVSHMEM rank {rank} of world {world}"
            )));
        }
        crate::gpu::probe_device(device)?;
        let id = if rank == 0 {
            let id = UniqueId::new()?;
            store.set(key, &id.to_bytes())?;
            id
        } else {
            UniqueId::from_bytes(&wait_get(store, key, deadline)?)?
        };
        Nvshmem::init(&id, rank, world, device, plan)
    }

    /// The session of this process when one is active, else a new one
    /// ([`Nvshmem::join`]). A second engine of the same job shares the first
    /// one's session: every process creates its engines in the same order,
    /// so either every rank finds a session or none does. The shared
    /// session's heap is the first engine's plan; allocations outside it
    /// fail in [`Nvshmem::alloc`].
    ///
    /// Errors: as [`Nvshmem::join`]; [`Error::Config`] when the active
    /// session places this process differently (another job's PEs).
    pub fn join_shared(
        store: &dyn Store,
        key: &str,
        rank: usize,
        world: usize,
        device: usize,
        plan: HeapPlan,
        deadline: std::time::Instant,
    ) -> Result<Arc<Nvshmem>> {
        let mut current = SHARED
            .lock()
            .map_err(|_| Error::Config("the NVSHMEM session registry lock is poisoned".into()))?;
        if let Some(session) = current.upgrade() {
            if (session.rank, session.world) != (rank, world) {
                return Err(Error::Config(format!(
                    "this process's NVSHMEM session is PE {} of {}; an engine here needs PE {rank} of \
                     {world} (one NVSHMEM session per process: its engines must span the same ranks)",
                    session.rank, session.world
                )));
            }
            return Ok(session);
        }
        let session = Arc::new(Nvshmem::join(
            store, key, rank, world, device, plan, deadline,
        )?);
        *current = Arc::downgrade(&session);
        Ok(session)
    }

    /// This PE.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of PEs.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The symmetric heap size the session asked NVSHMEM for.
    pub fn heap_bytes(&self) -> usize {
        self.heap_bytes
    }

    /// Allocates `bytes` on the symmetric heap. Collective: every PE
    /// allocates the same sizes in the same order (ODC's registration is).
    ///
    /// Errors: [`Error::Config`] when the allocation is not in the plan the
    /// session was created with (the heap cannot grow), naming requested,
    /// planned and used bytes; [`Error::Nvshmem`] if NVSHMEM refuses.
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<SymmetricBuffer> {
        let footprint = HeapPlan::footprint(bytes);
        let mut used = self
            .used
            .lock()
            .map_err(|_| Error::Config("NVSHMEM heap lock poisoned".into()))?;
        let planned = self.plan.used_bytes();
        if *used + footprint > planned {
            return Err(Error::Config(format!(
                "symmetric heap plan exceeded: {bytes} bytes requested with {} of {planned} planned bytes in use \
                 (heap {} bytes); a process holds one NVSHMEM session, fixed when its first nvshmem engine \
                 starts it: reserve the later engines' regions there (heap_reserve = their heap_bytes)",
                *used, self.heap_bytes
            )));
        }
        // SAFETY: the session is initialized; collective order is the
        // caller's contract, as documented.
        let ptr = unsafe { mem::align(HeapPlan::ALIGN, bytes.max(1))? };
        *used += footprint;
        Ok(SymmetricBuffer {
            session: Arc::clone(self),
            ptr,
            len: bytes,
        })
    }

    /// Whole-job barrier (setup and teardown only).
    pub fn barrier_all(&self) -> Result<()> {
        // SAFETY: initialized; every PE of a session calls it at the same
        // protocol step.
        unsafe { sync::barrier_all() }
    }

    /// Enqueues a whole-job barrier on `stream` (a `CUstream`).
    pub fn barrier_all_on_stream(&self, stream: usize) -> Result<()> {
        let _serial = self.serialize()?;
        // SAFETY: as above; the caller's stream is live for the call.
        unsafe { sync::barrier_all_on_stream(stream as sys::CUstream) }
    }

    /// Enqueues on `stream` (a `CUstream`) a read of `bytes` at `offset`
    /// of `pe`'s copy of `src` into local device memory `dst`; the bytes
    /// are there when the stream passes it.
    ///
    /// # Safety
    ///
    /// `dst` is device memory valid for `bytes` until `stream` passes this
    /// point; no one writes `pe`'s range meanwhile (the protocol's versions).
    pub unsafe fn get_on_stream(
        &self,
        dst: u64,
        src: &SymmetricBuffer,
        offset: usize,
        bytes: usize,
        pe: usize,
        stream: usize,
    ) -> Result<()> {
        let remote = src.range(offset, bytes)?;
        let pe = self.pe(pe)?;
        let _serial = self.serialize()?;
        // SAFETY: `remote` is in a live symmetric buffer; the caller vouches for `dst`.
        unsafe {
            rma::get_on_stream(
                dst as *mut c_void,
                remote,
                bytes,
                pe,
                stream as sys::CUstream,
            )
        }
    }

    /// Enqueues on `stream` a write of `bytes` from local device memory
    /// `src` into `pe`'s `dst` at `offset`. It is complete at `pe` after a
    /// later [`quiet_on_stream`](Self::quiet_on_stream).
    ///
    /// # Safety
    ///
    /// `src` is device memory valid for `bytes` until `stream` passes this
    /// point; nobody reads or writes the target range meanwhile.
    pub unsafe fn put_on_stream(
        &self,
        dst: &SymmetricBuffer,
        offset: usize,
        src: u64,
        bytes: usize,
        pe: usize,
        stream: usize,
    ) -> Result<()> {
        let remote = dst.range(offset, bytes)?;
        let pe = self.pe(pe)?;
        let _serial = self.serialize()?;
        // SAFETY: `remote` lies in a live symmetric buffer; the caller
        // vouches for `src`.
        unsafe {
            rma::put_on_stream(
                remote.cast_mut(),
                src as *const c_void,
                bytes,
                pe,
                stream as sys::CUstream,
            )
        }
    }

    /// Enqueues a write of `bytes` from local device memory `src` into
    /// `pe`'s `dst` at `offset`, then sets `pe`'s `signal` word (at
    /// `signal_offset` of `signals`) to `value`, after the data.
    ///
    /// # Safety
    ///
    /// `src` is device memory valid for `bytes` until `stream` passes this
    /// point.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn put_signal_on_stream(
        &self,
        dst: &SymmetricBuffer,
        offset: usize,
        src: u64,
        bytes: usize,
        signals: &SymmetricBuffer,
        signal_offset: usize,
        value: u64,
        pe: usize,
        stream: usize,
    ) -> Result<()> {
        let remote = dst.range(offset, bytes)?;
        let sig = signals.signal(signal_offset)?;
        let pe = self.pe(pe)?;
        let _serial = self.serialize()?;
        // SAFETY: both remote addresses lie in live symmetric buffers; the
        // caller vouches for `src`.
        unsafe {
            rma::put_signal_on_stream(
                remote.cast_mut(),
                src as *const c_void,
                bytes,
                sig,
                value,
                sys::NVSHMEM_SIGNAL_SET,
                pe,
                stream as sys::CUstream,
            )
        }
    }

    /// Enqueues on `stream` the completion of this PE's puts issued on it
    /// so far: later work on `stream` runs after they reached their targets.
    pub fn quiet_on_stream(&self, stream: usize) -> Result<()> {
        let _serial = self.serialize()?;
        // SAFETY: initialized; the caller's stream is live for the call.
        unsafe { rma::quiet_on_stream(stream as sys::CUstream) }
    }

    /// Makes `stream` wait until this PE's signal word (at `signal_offset`
    /// of `signals`) is at least `value`.
    pub fn signal_wait_until_on_stream(
        &self,
        signals: &SymmetricBuffer,
        signal_offset: usize,
        value: u64,
        stream: usize,
    ) -> Result<()> {
        let sig = signals.signal(signal_offset)?;
        let _serial = self.serialize()?;
        // SAFETY: `sig` is an aligned word of a live symmetric buffer.
        unsafe {
            rma::signal_wait_until_on_stream(
                sig,
                sys::NVSHMEM_CMP_GE,
                value,
                stream as sys::CUstream,
            )
        }
    }

    fn serialize(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        self.calls
            .lock()
            .map_err(|_| Error::Config("an NVSHMEM call panicked".into()))
    }

    fn pe(&self, pe: usize) -> Result<c_int> {
        if pe < self.world {
            Ok(pe as c_int)
        } else {
            Err(Error::Config(format!(
                "PE {pe} out of range for world {}",
                self.world
            )))
        }
    }
}

impl Drop for Nvshmem {
    fn drop(&mut self) {
        // SAFETY: a session exists only after a successful init, and
        // every SymmetricBuffer borrows the session, so all are freed.
        if let Err(e) = unsafe { init::hostlib_finalize() } {
            eprintln!("odc: NVSHMEM finalize failed: {e}");
        }
        ACTIVE.store(false, Ordering::Release);
    }
}

/// A region of the symmetric heap: the same offset on every PE. Freed
/// (collectively) on drop.
#[derive(Debug)]
pub struct SymmetricBuffer {
    session: Arc<Nvshmem>,
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: the buffer is a device address plus a length; NVSHMEM calls on it
// go through the session, whose serialization the caller provides.
unsafe impl Send for SymmetricBuffer {}
// SAFETY: as above; `&self` methods only compute addresses.
unsafe impl Sync for SymmetricBuffer {}

impl SymmetricBuffer {
    /// Its device address on this PE.
    pub fn device_ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A load/store address of `pe`'s copy (NVLink / same node), or `None`
    /// when `pe` is only reachable through NVSHMEM's network transports.
    pub fn peer_ptr(&self, pe: usize) -> Result<Option<u64>> {
        let pe = self.session.pe(pe)?;
        // SAFETY: `ptr` is a live symmetric address.
        Ok(unsafe { mem::peer_ptr(self.ptr, pe)? }.map(|p| p as u64))
    }

    fn range(&self, offset: usize, bytes: usize) -> Result<*const c_void> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.len => Ok(self.ptr.cast::<u8>().wrapping_add(offset).cast()),
            _ => Err(Error::layout(
                None,
                format!(
                    "{bytes} bytes at offset {offset} overrun a {}-byte symmetric buffer",
                    self.len
                ),
            )),
        }
    }

    fn signal(&self, offset: usize) -> Result<*mut u64> {
        if offset % 8 != 0 {
            return Err(Error::layout(
                None,
                format!("signal word at offset {offset} is not 8-byte aligned"),
            ));
        }
        Ok(self.range(offset, 8)?.cast_mut().cast())
    }
}

impl Drop for SymmetricBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by `Nvshmem::alloc` of a session kept alive by
        // the `Arc` this buffer holds, freed once, here.
        if let Err(e) = unsafe { mem::free(self.ptr) } {
            eprintln!("odc: nvshmem_free of {} bytes failed: {e}", self.len);
        }
        if let Ok(mut used) = self.session.used.lock() {
            *used = used.saturating_sub(HeapPlan::footprint(self.len));
        }
    }
}

/// NVSHMEM's version, when the library loads.
pub fn version() -> Result<(i32, i32, i32)> {
    result::version()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_plan_sizes_from_buffers() {
        let plan = HeapPlan::new([1, 512, 513, 0]);
        assert_eq!(plan.used_bytes(), 512 + 512 + 1024 + 512);
        assert_eq!(plan.heap_bytes(), HeapPlan::GRANULE);
        let big = HeapPlan::new([3 << 20]);
        assert_eq!(big.heap_bytes(), 4 << 20);
        assert_eq!(HeapPlan::default().heap_bytes(), HeapPlan::GRANULE);
    }

    #[test]
    fn unique_id_round_trips_through_bytes() {
        let mut raw = sys::nvshmemx_uniqueid_t::default();
        for (i, c) in raw.internal.iter_mut().enumerate() {
            *c = i as _;
        }
        let id = UniqueId(raw);
        let bytes = id.to_bytes();
        assert_eq!(bytes.len(), UniqueId::LEN);
        let back = UniqueId::from_bytes(&bytes).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back.to_bytes(), bytes);
        assert!(UniqueId::from_bytes(&bytes[1..]).is_err());
    }

    #[test]
    fn init_without_a_gpu_is_a_typed_error() {
        let id = UniqueId(sys::nvshmemx_uniqueid_t::default());
        match Nvshmem::init(&id, 0, 1, 0, HeapPlan::new([1024])) {
            Err(Error::GpuUnavailable(missing)) => eprintln!("NVSHMEM init skipped: {missing}"),
            Err(other) => eprintln!("NVSHMEM init failed: {other}"),
            // A real single-PE job on a GPU machine.
            Ok(session) => assert_eq!((session.rank(), session.world()), (0, 1)),
        }
        assert!(matches!(
            Nvshmem::init(&id, 2, 2, 0, HeapPlan::default()),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn join_without_a_gpu_publishes_and_awaits_nothing() {
        if crate::gpu::probe_device(0).is_ok() {
            // A 2-PE join would wait for a second process.
            eprintln!("SKIPPED: a GPU is present (join is exercised by the GPU tests)");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let store = crate::FileStore::new(dir.path()).expect("store");
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(200);
        for rank in [0, 1] {
            match Nvshmem::join(
                &store,
                "nvshmem/id",
                rank,
                2,
                0,
                HeapPlan::default(),
                deadline,
            ) {
                Err(Error::GpuUnavailable(missing)) => {
                    // Checked before the Store is touched.
                    assert_eq!(store.get("nvshmem/id").ok().flatten(), None, "{missing}");
                }
                other => panic!(
                    "rank {rank}: expected GpuUnavailable, got {:?}",
                    other.err()
                ),
            }
        }
        assert!(matches!(
            Nvshmem::join(&store, "k", 2, 2, 0, HeapPlan::default(), deadline),
            Err(Error::Config(_))
        ));
    }
}
