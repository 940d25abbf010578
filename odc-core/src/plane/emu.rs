//! `emu-ipc`: the device data plane in host memory, with streams emulated
//! by host threads.
//!
//! One file for the whole emulation (memory, streams, both planes), which
//! mirrors `cuda.rs` and `nvshmem.rs` piece by piece; about a fifth of it is
//! its tests.
//!
//! Memory is `memfd` files exchanged exactly as `cuda-ipc` exchanges device
//! memory ([`MemfdMemory`], [`crate::gpu::ipc::exchange`]); every stream is
//! a thread that runs its operations in order, each after an optional
//! random sleep of up to `jitter`. Copies, adds and signals therefore run
//! later than the call that enqueued them, and in an order only the stream
//! fixes, which is what a GPU does to them: the engine's device path is
//! tested here with the same asynchrony (`ODC_EMU_JITTER_US`, default 0).
//!
//! Stream handles are small integers naming an [`EmuStream`] in a
//! process-wide table; 0 names no stream.
//!
//! `emu-shmem` ([`EmuShmem`]) is the same plane with NVSHMEM's put
//! semantics towards ranks on other nodes: such a put is staged when the
//! stream reaches it and written to its target only by the stream's next
//! [`Plane::deliver`] (NVSHMEM's quiet). A signal enqueued before that
//! deliver announces bytes that are not there, and the tests see it.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use odc_kernels::cpu::quant::{self, Spec};
use odc_kernels::DType;

use super::{Connect, DataSizes, DeviceBackend, DeviceOps, HostWork, PackJob, Plane, StreamHandle};
use crate::gpu::ipc::MemfdMemory;
use crate::store::Store;
use crate::topology::Topology;
use crate::{Error, Result};

/// Environment variable: the most an emulated stream sleeps before each
/// operation, in microseconds.
pub const JITTER_ENV: &str = "ODC_EMU_JITTER_US";

type Op = Box<dyn FnOnce() -> std::result::Result<(), String> + Send + 'static>;

#[derive(Default)]
struct State {
    queue: VecDeque<Op>,
    enqueued: u64,
    completed: u64,
    error: Option<String>,
    closed: bool,
}

struct Shared {
    id: usize,
    state: Mutex<State>,
    cond: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Ops run outside the lock, so a poisoned lock only means a panic
        // between two plain field updates; the state is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, op: Op) -> Result<u64> {
        let mut s = self.lock();
        if s.closed {
            return Err(Error::Config(format!(
                "emulated stream {} is closed",
                self.id
            )));
        }
        s.queue.push_back(op);
        s.enqueued += 1;
        let n = s.enqueued;
        drop(s);
        self.cond.notify_all();
        Ok(n)
    }

    /// Blocks until `target` operations have completed.
    fn wait_completed(&self, target: u64) {
        let mut s = self.lock();
        while s.completed < target {
            s = self.cond.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

fn table() -> &'static Mutex<HashMap<usize, Arc<Shared>>> {
    static TABLE: OnceLock<Mutex<HashMap<usize, Arc<Shared>>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

fn lookup(handle: StreamHandle) -> Result<Arc<Shared>> {
    table()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&handle)
        .cloned()
        .ok_or_else(|| Error::Config(format!("emu-ipc: no emulated stream {handle}")))
}

/// An emulated stream: a thread running enqueued operations in order. Drop
/// runs what is queued, then stops the thread.
pub struct EmuStream {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for EmuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuStream")
            .field("handle", &self.shared.id)
            .finish()
    }
}

/// A small xorshift generator for the jitter (no dependency, no lock).
fn next_random(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

impl EmuStream {
    /// A new stream whose operations each wait up to `jitter` first.
    pub fn new(jitter: Duration) -> Result<EmuStream> {
        static NEXT: AtomicUsize = AtomicUsize::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(Shared {
            id,
            state: Mutex::new(State::default()),
            cond: Condvar::new(),
        });
        let worker = Arc::clone(&shared);
        let jitter_ns = u64::try_from(jitter.as_nanos()).unwrap_or(u64::MAX);
        let thread = std::thread::Builder::new()
            .name(format!("odc-emu-stream-{id}"))
            .spawn(move || run(&worker, jitter_ns))?;
        table()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::clone(&shared));
        Ok(EmuStream {
            shared,
            thread: Some(thread),
        })
    }

    /// The handle the engine's `*_device` calls take.
    pub fn handle(&self) -> StreamHandle {
        self.shared.id
    }

    /// Enqueues `work` as an operation of this stream (what a kernel
    /// launch is to a CUDA stream: tests produce data on a stream with it).
    pub fn enqueue(&self, work: HostWork) -> Result<()> {
        self.shared.push(Box::new(move || {
            work();
            Ok(())
        }))?;
        Ok(())
    }

    /// Blocks until everything enqueued so far has run; returns the first
    /// error an operation reported, if any.
    pub fn synchronize(&self) -> Result<()> {
        synchronize(&self.shared)
    }
}

impl Drop for EmuStream {
    fn drop(&mut self) {
        table()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.shared.id);
        self.shared.lock().closed = true;
        self.shared.cond.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(shared: &Shared, jitter_ns: u64) {
    static SEED: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    let mut rng = SEED.fetch_add(0x6a09_e667_f3bc_c909, Ordering::Relaxed) | 1;
    loop {
        let op = {
            let mut s = shared.lock();
            loop {
                if let Some(op) = s.queue.pop_front() {
                    break op;
                }
                if s.closed {
                    return;
                }
                s = shared.cond.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        };
        if jitter_ns > 0 {
            std::thread::sleep(Duration::from_nanos(next_random(&mut rng) % jitter_ns));
        }
        let result = std::panic::catch_unwind(AssertUnwindSafe(op))
            .unwrap_or_else(|_| Err("an operation panicked".to_owned()));
        let mut s = shared.lock();
        if let Err(e) = result {
            s.error.get_or_insert(e);
        }
        s.completed += 1;
        drop(s);
        shared.cond.notify_all();
    }
}

fn synchronize(shared: &Shared) -> Result<()> {
    let target = shared.lock().enqueued;
    shared.wait_completed(target);
    match shared.lock().error.clone() {
        None => Ok(()),
        Some(e) => Err(Error::protocol(
            None,
            format!("emulated stream {}: {e}", shared.id),
        )),
    }
}

/// The emulated backend: `memfd` memory and a server stream.
#[derive(Debug)]
pub struct EmuBackend {
    memory: MemfdMemory,
    server: EmuStream,
}

impl EmuBackend {
    /// A backend whose server stream waits up to `jitter` before each
    /// operation.
    pub fn new(jitter: Duration) -> Result<Arc<EmuBackend>> {
        Ok(Arc::new(EmuBackend {
            memory: MemfdMemory,
            server: EmuStream::new(jitter)?,
        }))
    }

    /// The jitter [`JITTER_ENV`] asks for (zero when unset).
    ///
    /// Errors: [`Error::Config`] for a value that is not a whole number.
    pub fn jitter_from_env() -> Result<Duration> {
        match std::env::var(JITTER_ENV) {
            Err(_) => Ok(Duration::ZERO),
            Ok(v) => v
                .trim()
                .parse::<u64>()
                .map(Duration::from_micros)
                .map_err(|_| {
                    Error::Config(format!(
                        "{JITTER_ENV}={v:?}: expected a whole number of microseconds"
                    ))
                }),
        }
    }
}

impl DeviceBackend for EmuBackend {
    type Memory = MemfdMemory;

    fn memory(&self) -> &MemfdMemory {
        &self.memory
    }
}

impl DeviceOps for EmuBackend {
    fn name(&self) -> &'static str {
        "emu-ipc"
    }

    fn server_stream(&self) -> StreamHandle {
        self.server.handle()
    }

    unsafe fn copy(&self, stream: StreamHandle, dst: u64, src: u64, len: usize) -> Result<()> {
        lookup(stream)?.push(Box::new(move || {
            // SAFETY: the caller vouched that both ranges stay valid until
            // the copy has run; backend regions never overlap.
            unsafe { odc_kernels::cpu::copy_raw(dst as *mut u8, src as *const u8, len) };
            Ok(())
        }))?;
        Ok(())
    }

    unsafe fn accumulate_on_server(
        &self,
        acc: u64,
        x: u64,
        x_dtype: DType,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        self.server.shared.push(Box::new(move || {
            // SAFETY: the caller vouched for `n` f32s at `acc` and `n`
            // elements at `x`, valid until this has run and not overlapping.
            let (acc, x) = unsafe {
                (
                    std::slice::from_raw_parts_mut(acc as *mut f32, n),
                    std::slice::from_raw_parts(x as *const u8, n * x_dtype.size_bytes()),
                )
            };
            odc_kernels::cpu::accumulate_into_f32(acc, x, x_dtype, scale).map_err(|e| e.to_string())
        }))?;
        Ok(())
    }

    unsafe fn pack_on_server(&self, job: PackJob) -> Result<()> {
        self.server.shared.push(Box::new(move || {
            let PackJob { spec, n, .. } = job;
            // SAFETY: the caller vouched for every range of `job`, valid
            // until this has run and not overlapping.
            let (src, values, chunk) = unsafe {
                (
                    std::slice::from_raw_parts(
                        job.src as *const u8,
                        n * job.src_dtype.size_bytes(),
                    ),
                    std::slice::from_raw_parts_mut(job.values as *mut f32, n),
                    std::slice::from_raw_parts_mut(job.chunk as *mut u8, spec.chunk_bytes(n)),
                )
            };
            let kernel = |e: odc_kernels::Error| e.to_string();
            match job.scale {
                Some(factor) => {
                    values.fill(0.0);
                    odc_kernels::cpu::accumulate_into_f32(values, src, job.src_dtype, factor)
                        .map_err(kernel)?;
                }
                None => odc_kernels::cpu::cast(
                    src,
                    job.src_dtype,
                    crate::bytes_of_mut(values),
                    DType::F32,
                )
                .map_err(kernel)?,
            }
            match job.residual {
                Some(r) => {
                    // SAFETY: as above.
                    let r = unsafe { std::slice::from_raw_parts_mut(r as *mut f32, n) };
                    quant::feedback_quantise_chunk(spec, r, values, chunk).map_err(kernel)
                }
                None => quant::quantise_chunk(spec, values, chunk).map_err(kernel),
            }
        }))?;
        Ok(())
    }

    unsafe fn dequantise_on_server(
        &self,
        chunk: u64,
        spec: Spec,
        len: usize,
        take: usize,
        dst: u64,
        dst_dtype: DType,
    ) -> Result<()> {
        self.server.shared.push(Box::new(move || {
            // SAFETY: the caller vouched for the chunk's bytes at `chunk` and
            // `take` elements at `dst`, valid until this has run.
            let (chunk, out) = unsafe {
                (
                    std::slice::from_raw_parts(chunk as *const u8, spec.chunk_bytes(len)),
                    std::slice::from_raw_parts_mut(dst as *mut u8, take * dst_dtype.size_bytes()),
                )
            };
            quant::dequantise_chunk_into(spec, len, chunk, out, dst_dtype)
                .map_err(|e| e.to_string())
        }))?;
        Ok(())
    }

    unsafe fn dequantise_accumulate_on_server(
        &self,
        acc: u64,
        chunk: u64,
        spec: Spec,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        self.server.shared.push(Box::new(move || {
            // SAFETY: the caller vouched for `n` f32s at `acc` and the
            // chunk's bytes at `chunk`, valid until this has run.
            let (acc, chunk) = unsafe {
                (
                    std::slice::from_raw_parts_mut(acc as *mut f32, n),
                    std::slice::from_raw_parts(chunk as *const u8, spec.chunk_bytes(n)),
                )
            };
            quant::dequantise_accumulate_chunk(spec, chunk, acc, scale).map_err(|e| e.to_string())
        }))?;
        Ok(())
    }

    unsafe fn zero_on_server(&self, dst: u64, len: usize) -> Result<()> {
        self.server.shared.push(Box::new(move || {
            // SAFETY: the caller vouched for `len` writable bytes at `dst`.
            unsafe { std::ptr::write_bytes(dst as *mut u8, 0, len) };
            Ok(())
        }))?;
        Ok(())
    }

    fn then(&self, stream: StreamHandle, work: HostWork) -> Result<()> {
        lookup(stream)?.push(Box::new(move || {
            work();
            Ok(())
        }))?;
        Ok(())
    }

    fn order(&self, waiter: StreamHandle, after: StreamHandle) -> Result<()> {
        let after = lookup(after)?;
        let target = after.lock().enqueued;
        lookup(waiter)?.push(Box::new(move || {
            after.wait_completed(target);
            Ok(())
        }))?;
        Ok(())
    }

    fn synchronize(&self, stream: StreamHandle) -> Result<()> {
        synchronize(&*lookup(stream)?)
    }

    unsafe fn read_to_host(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.server.synchronize()?;
        // SAFETY: the caller vouched for `dst.len()` readable bytes at
        // `src`; the server stream has run everything that writes them.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

/// The `emu-shmem` backend: [`EmuBackend`]'s memory and streams, every
/// rank of the shard group mapped (all run on this machine), and puts to
/// ranks on other nodes of the topology delayed until a deliver.
#[derive(Debug)]
pub struct EmuShmem {
    emu: Arc<EmuBackend>,
    /// Which ranks share this rank's node.
    topo: Topology,
}

impl EmuShmem {
    /// A backend for this rank of `topo`, whose streams wait up to
    /// `jitter` before each operation.
    pub fn new(topo: Topology, jitter: Duration) -> Result<Arc<EmuShmem>> {
        Ok(Arc::new(EmuShmem {
            emu: EmuBackend::new(jitter)?,
            topo,
        }))
    }
}

impl Connect for Arc<EmuShmem> {
    fn name(&self) -> &'static str {
        "emu-shmem"
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
        let mapped = self
            .emu
            .connect(store, prefix, job_key, rank, group, sizes, timeout)?;
        Ok(Box::new(ShmemPlane {
            mapped,
            topo: self.topo,
            pending: Mutex::new(HashMap::new()),
        }))
    }
}

/// Bytes this process's `emu-shmem` planes read from ranks on other nodes
/// (`get_params`) and wrote to them (delivered puts): what would cross the
/// network under `nvshmem`.
static CROSS_NODE: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// `(read, written)`: the bytes every `emu-shmem` plane of this process
/// moved across emulated nodes so far (a test's measure of the network
/// traffic; one count for the whole process).
pub fn cross_node_bytes() -> (u64, u64) {
    (
        CROSS_NODE[0].load(Ordering::Relaxed),
        CROSS_NODE[1].load(Ordering::Relaxed),
    )
}

/// A put to another node, staged and not yet delivered.
struct Staged {
    rank: usize,
    offset: usize,
    bytes: Box<[u8]>,
}

/// [`EmuShmem`]'s plane.
struct ShmemPlane {
    /// Every rank's regions, mapped.
    mapped: Box<dyn Plane>,
    topo: Topology,
    /// Per stream, the puts to other nodes enqueued since its last deliver.
    pending: Mutex<HashMap<StreamHandle, Vec<Staged>>>,
}

impl std::fmt::Debug for ShmemPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmemPlane")
            .field("mapped", &self.mapped)
            .field("node", &self.topo.node_of(self.topo.rank()))
            .finish()
    }
}

impl ShmemPlane {
    fn pending(&self) -> Result<std::sync::MutexGuard<'_, HashMap<StreamHandle, Vec<Staged>>>> {
        self.pending
            .lock()
            .map_err(|_| Error::protocol(None, "an emu-shmem put panicked"))
    }
}

impl Plane for ShmemPlane {
    fn ops(&self) -> &dyn DeviceOps {
        self.mapped.ops()
    }
    fn local_params(&self) -> u64 {
        self.mapped.local_params()
    }
    fn local_landing(&self) -> u64 {
        self.mapped.local_landing()
    }
    fn accum(&self) -> u64 {
        self.mapped.accum()
    }

    unsafe fn get_params(
        &self,
        stream: StreamHandle,
        dst: u64,
        rank: usize,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        if !self.topo.is_local(rank) {
            CROSS_NODE[0].fetch_add(len as u64, Ordering::Relaxed);
        }
        // A get is complete when the stream passes it, on any node.
        // SAFETY: the caller's contract, passed on.
        unsafe { self.mapped.get_params(stream, dst, rank, offset, len) }
    }

    unsafe fn put_landing(
        &self,
        stream: StreamHandle,
        rank: usize,
        offset: usize,
        src: u64,
        len: usize,
    ) -> Result<()> {
        if self.topo.is_local(rank) {
            // SAFETY: the caller's contract, passed on.
            return unsafe { self.mapped.put_landing(stream, rank, offset, src, len) };
        }
        let mut bytes = vec![0u8; len].into_boxed_slice();
        let staging = bytes.as_mut_ptr() as u64;
        // SAFETY: `staging` holds `len` bytes, kept in `pending` until the
        // deliver that writes them out has run; the caller vouches for `src`.
        unsafe { self.ops().copy(stream, staging, src, len)? };
        self.pending()?.entry(stream).or_default().push(Staged {
            rank,
            offset,
            bytes,
        });
        Ok(())
    }

    fn deliver(&self, stream: StreamHandle) -> Result<()> {
        let staged = self.pending()?.remove(&stream).unwrap_or_default();
        if staged.is_empty() {
            return Ok(());
        }
        for s in &staged {
            CROSS_NODE[1].fetch_add(s.bytes.len() as u64, Ordering::Relaxed);
            // SAFETY: the staging bytes stay alive until the work below
            // (enqueued after this copy) has run; the target slot is the
            // one the caller's put named, still reserved for it.
            unsafe {
                self.mapped.put_landing(
                    stream,
                    s.rank,
                    s.offset,
                    s.bytes.as_ptr() as u64,
                    s.bytes.len(),
                )?
            };
        }
        self.ops().then(stream, Box::new(move || drop(staged)))
    }

    fn node_cache(&self, rank: usize) -> Result<u64> {
        if !self.topo.is_local(rank) {
            return Err(Error::protocol(
                None,
                format!("rank {rank} is on another node: its node cache is not mapped here"),
            ));
        }
        self.mapped.node_cache(rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn operations_run_in_order_and_after_the_call() {
        let b = EmuBackend::new(Duration::from_micros(200)).unwrap();
        let s = EmuStream::new(Duration::from_micros(200)).unwrap();
        let src: Vec<u8> = (0..=255).collect();
        let mut dst = vec![0u8; 256];
        let seen = Arc::new(Mutex::new(Vec::new()));
        for i in 0..8u8 {
            let seen = Arc::clone(&seen);
            b.then(s.handle(), Box::new(move || seen.lock().unwrap().push(i)))
                .unwrap();
        }
        // SAFETY: both buffers outlive the synchronize below.
        unsafe {
            b.copy(
                s.handle(),
                dst.as_mut_ptr() as u64,
                src.as_ptr() as u64,
                256,
            )
            .unwrap()
        };
        let copied = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&copied);
        let (d, n) = (dst.as_ptr() as u64, dst.len());
        b.then(
            s.handle(),
            Box::new(move || {
                // SAFETY: `dst` lives until synchronize returns.
                let v = unsafe { std::slice::from_raw_parts(d as *const u8, n) };
                flag.store(v[255] == 255, Ordering::SeqCst);
            }),
        )
        .unwrap();
        s.synchronize().unwrap();
        assert_eq!(*seen.lock().unwrap(), (0..8).collect::<Vec<u8>>());
        assert!(copied.load(Ordering::SeqCst), "work after a copy saw it");
        assert_eq!(dst, src);
    }

    #[test]
    fn order_makes_one_stream_wait_for_another() {
        let b = EmuBackend::new(Duration::ZERO).unwrap();
        let (a, w) = (
            EmuStream::new(Duration::from_millis(2)).unwrap(),
            EmuStream::new(Duration::ZERO).unwrap(),
        );
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..5 {
            let log = Arc::clone(&log);
            b.then(a.handle(), Box::new(move || log.lock().unwrap().push(i)))
                .unwrap();
        }
        b.order(w.handle(), a.handle()).unwrap();
        let l = Arc::clone(&log);
        b.then(w.handle(), Box::new(move || l.lock().unwrap().push(99)))
            .unwrap();
        w.synchronize().unwrap();
        assert_eq!(*log.lock().unwrap(), vec![0, 1, 2, 3, 4, 99]);
    }

    #[test]
    fn server_adds_and_zeroes_and_reports_bad_input() {
        let b = EmuBackend::new(Duration::from_micros(50)).unwrap();
        let mut acc = vec![1.0f32; 100];
        let x: Vec<f32> = (0..100).map(|i| i as f32).collect();
        // SAFETY: the buffers outlive read_to_host, which drains the stream.
        unsafe {
            b.accumulate_on_server(
                acc.as_mut_ptr() as u64,
                x.as_ptr() as u64,
                DType::F32,
                100,
                2.0,
            )
            .unwrap();
            let mut out = vec![0u8; 400];
            b.read_to_host(acc.as_ptr() as u64, &mut out).unwrap();
            let got: Vec<f32> = out
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(
                got,
                (0..100).map(|i| 1.0 + 2.0 * i as f32).collect::<Vec<_>>()
            );
            b.zero_on_server(acc.as_mut_ptr() as u64, 400).unwrap();
            b.read_to_host(acc.as_ptr() as u64, &mut out).unwrap();
            assert!(out.iter().all(|&v| v == 0));
            // A misaligned f32 source is reported, not a crash.
            let bytes = vec![0u8; 404];
            b.accumulate_on_server(
                acc.as_mut_ptr() as u64,
                bytes.as_ptr() as u64 + 1,
                DType::F32,
                100,
                1.0,
            )
            .unwrap();
            let e = b.synchronize(b.server_stream()).unwrap_err().to_string();
            assert!(e.contains("emulated stream"), "{e}");
        }
    }

    #[test]
    fn unknown_streams_and_bad_jitter_are_named() {
        let b = EmuBackend::new(Duration::ZERO).unwrap();
        let e = b.then(0, Box::new(|| {})).unwrap_err().to_string();
        assert!(e.contains("no emulated stream 0"), "{e}");
        assert!(b.synchronize(123_456_789).is_err());
    }
}
