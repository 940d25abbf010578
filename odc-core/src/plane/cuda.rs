//! `cuda-ipc`: the device data plane on a CUDA device.
//!
//! [`CudaBackend`] owns, for one device of this process: its primary
//! context and the shareable device memory allocated from it
//! ([`Gpu`], exchanged with peers by [`crate::gpu::ipc::exchange`]), the
//! NVRTC-compiled `accumulate` kernels loaded into that context
//! ([`CudaKernels`]), and the **server stream** the shard server daemon
//! enqueues on (a non-blocking stream it creates and destroys). Every other
//! stream is the caller's (a trainer's `CUstream`), borrowed for one call.
//!
//! Every operation is a driver call that enqueues and returns, made after
//! the context is made current on the calling thread (the daemon's thread,
//! a trainer's thread, whichever calls):
//!
//! | operation | driver call |
//! |---|---|
//! | [`copy`](DeviceOps::copy) | `cuMemcpyDtoDAsync` on the given stream |
//! | [`accumulate_on_server`](DeviceOps::accumulate_on_server) | the `accumulate` kernel (f32 accumulator) on the server stream |
//! | [`zero_on_server`](DeviceOps::zero_on_server) | `cuMemsetD8Async` on the server stream |
//! | [`then`](DeviceOps::then) | `cuLaunchHostFunc` |
//! | [`order`](DeviceOps::order) | `cuEventRecord` + `cuStreamWaitEvent` |
//! | [`synchronize`](DeviceOps::synchronize) | `cuStreamSynchronize` (blocks) |
//! | [`read_to_host`](DeviceOps::read_to_host) | server stream synchronized, then `cuMemcpyDtoH` (blocks) |
//!
//! Without a driver, a device, a driver function or NVRTC,
//! [`CudaBackend::open`] returns [`Error::GpuUnavailable`] naming what is
//! missing; no driver function is called before [`Gpu::open`] has checked
//! that every one this backend uses is exported.

use std::ffi::c_void;
use std::fmt;
use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, OnceLock};

use odc_kernels::cpu::quant::Spec;
use odc_kernels::cuda::quant::CudaQuant;
use odc_kernels::cuda::{CudaKernels, CudaStream};
use odc_kernels::DType;

use super::{DeviceBackend, DeviceOps, HostWork, PackJob, StreamHandle};
use crate::gpu::device::{cuda, Gpu, Stream};
use crate::gpu::Missing;
use crate::{Error, Result};

/// The `cuda-ipc` device backend for one device of this process.
///
/// Shared by the engine's threads (`Arc`): the shard server daemon and the
/// trainer's thread both call it, concurrently. Dropping the last reference
/// waits for the server stream and releases the stream, the kernels and
/// the context: driver calls, so it must not happen inside a host function
/// ([`DeviceOps::then`]).
pub struct CudaBackend {
    // Fields drop in this order: the stream (synchronized in `Drop` first),
    // then the kernels' module, then the context.
    server: Arc<CudaStream>,
    kernels: CudaKernels,
    /// The compressed chunks' kernels, compiled at their first use.
    quant: OnceLock<CudaQuant>,
    quant_init: Mutex<()>,
    gpu: Arc<Gpu>,
}

// `CudaBackend` is `Send + Sync` without an `unsafe impl`: `Gpu` holds a
// cudarc `CudaContext`, `CudaKernels` its module's functions, and the
// server stream a `CudaStream`, all of which cudarc declares `Send + Sync`.
// That is sound for what this backend does with them from several threads
// at once: the CUDA driver API is thread-safe (any thread may enqueue on
// any stream of a context once the context is current on it, which every
// operation ensures first, and the driver serializes work on one stream),
// and the backend keeps no host-side state that changes after `open`: every
// method takes `&self` and only enqueues, waits, or copies into the
// caller's buffer.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CudaBackend>();
};

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("gpu", &self.gpu)
            .field("image", &self.kernels.image())
            .field(
                "server_stream",
                &format_args!("{:#x}", self.server_stream()),
            )
            .finish()
    }
}

/// A failure of the kernels crate as this crate's error: what is missing
/// stays [`Error::GpuUnavailable`], the rest is [`Error::Cuda`] naming
/// `call` (the kernels' message names the driver or NVRTC call).
fn kernels_error(call: &'static str, e: odc_kernels::Error) -> Error {
    match e {
        odc_kernels::Error::GpuUnavailable(missing) => Missing::Cuda(missing).into(),
        other => Error::Cuda {
            call,
            detail: other.to_string(),
        },
    }
}

impl CudaBackend {
    /// Opens device `ordinal` ([`Gpu::open`]: driver, functions, device,
    /// capabilities), compiles and loads the kernels into its primary
    /// context, and creates the server stream (non-blocking).
    ///
    /// Errors: [`Error::GpuUnavailable`] naming what is missing (the driver
    /// library, a driver function, the device, a capability, NVRTC);
    /// [`Error::Cuda`] naming the call when a present driver or NVRTC
    /// fails. Never panics.
    pub fn open(ordinal: usize) -> Result<Arc<CudaBackend>> {
        let gpu = Gpu::open(ordinal)?;
        let kernels = CudaKernels::with_context(Arc::clone(gpu.context()))
            .map_err(|e| kernels_error("kernel load (NVRTC, cuModuleLoadData)", e))?;
        let server = gpu
            .context()
            .new_stream()
            .map_err(|e| cuda("cuStreamCreate", e))?;
        Ok(Arc::new(CudaBackend {
            server,
            kernels,
            quant: OnceLock::new(),
            quant_init: Mutex::new(()),
            gpu,
        }))
    }

    /// The quantise kernels, compiled and loaded at the first call (a
    /// device engine that compresses nothing never compiles them).
    fn quant(&self) -> Result<&CudaQuant> {
        if let Some(q) = self.quant.get() {
            return Ok(q);
        }
        let _one = self
            .quant_init
            .lock()
            .map_err(|_| Error::protocol(None, "loading the quantise kernels panicked"))?;
        if let Some(q) = self.quant.get() {
            return Ok(q);
        }
        let q = CudaQuant::with_kernels(self.kernels.clone())
            .map_err(|e| kernels_error("quantise kernels' load (NVRTC, cuModuleLoadData)", e))?;
        Ok(self.quant.get_or_init(|| q))
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// A raw stream handle as a [`Stream`].
    ///
    /// # Safety
    /// `stream` must be a stream of this device's context (a caller's
    /// `CUstream`, 0 for the legacy default stream, or the server stream)
    /// that stays alive for the call.
    unsafe fn stream(&self, stream: StreamHandle) -> Stream {
        // SAFETY: the caller's contract.
        unsafe { Stream::from_raw(stream) }
    }

    fn server(&self) -> Stream {
        // SAFETY: the server stream belongs to the device's context and
        // lives as long as `self`.
        unsafe { Stream::from_raw(self.server_stream()) }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Work still enqueued on the server stream may launch the kernels
        // whose module drops next: let it finish. Errors leave nothing to
        // do (a failed context has no work left to run).
        if self.gpu.bind().is_ok() {
            let _ = self.server().synchronize();
        }
    }
}

/// Runs a [`HostWork`] boxed by [`CudaBackend::then`]; the driver calls it
/// once, on its own thread, after the work before it on the stream.
///
/// # Safety
/// `data` must come from `Box::into_raw(Box::new(work))` for a
/// `work: HostWork`, and be passed here exactly once.
unsafe extern "C" fn run_host_work(data: *mut c_void) {
    // SAFETY: the caller's contract: the box is ours to reclaim, once.
    let work = unsafe { Box::from_raw(data.cast::<HostWork>()) };
    // A panic must not unwind into the driver's thread (undefined
    // behaviour across `extern "C"`): it is contained here, and reported
    // by the panic hook as usual. What the work would have signalled is
    // then never signalled, which its waiter sees as a timeout.
    if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(work)) {
        // Dropping the payload runs foreign code too.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(payload)));
        // `eprintln!` panics when stderr is closed; a write error is ignored.
        let _ = writeln!(
            std::io::stderr(),
            "odc: a host function enqueued on a CUDA stream panicked; its signal is lost"
        );
    }
}

impl DeviceBackend for CudaBackend {
    type Memory = Arc<Gpu>;

    fn memory(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl DeviceOps for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda-ipc"
    }

    fn server_stream(&self) -> StreamHandle {
        self.server.cu_stream() as StreamHandle
    }

    unsafe fn copy(&self, stream: StreamHandle, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        // SAFETY: the caller's contract: `stream` is a stream of this
        // device (the trait's handles are), both ranges are `len` bytes of
        // device memory that stays valid until the copy has run.
        unsafe { self.stream(stream).copy(dst, src, len) }
    }

    unsafe fn accumulate_on_server(
        &self,
        acc: u64,
        x: u64,
        x_dtype: DType,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // A misaligned element faults the kernel, and a fault is sticky: it
        // ends every later call in the context. Refuse it here instead.
        let f32_size = DType::F32.size_bytes() as u64;
        if acc % f32_size != 0 || x % x_dtype.size_bytes() as u64 != 0 {
            return Err(Error::layout(
                None,
                format!(
                    "accumulate on the device: accumulator at {acc:#x} (f32) or source at \
                     {x:#x} ({x_dtype}) is not aligned to its element size"
                ),
            ));
        }
        self.gpu.bind()?;
        // SAFETY: the caller's contract: `acc` addresses `n` writable f32s
        // and `x` `n` readable `x_dtype` elements of this device, valid until
        // the work has run and not overlapping; both are aligned (checked).
        unsafe {
            self.kernels
                .accumulate_raw(&self.server, acc, DType::F32, x, x_dtype, n, scale)
        }
        .map_err(|e| kernels_error("cuLaunchKernel (accumulate)", e))
    }

    unsafe fn pack_on_server(&self, job: PackJob) -> Result<()> {
        let PackJob { spec, n, .. } = job;
        if n == 0 {
            return Ok(());
        }
        let f32_size = DType::F32.size_bytes() as u64;
        let aligned = [job.values, job.chunk]
            .into_iter()
            .chain(job.residual)
            .all(|a| a % f32_size == 0)
            && job.src % job.src_dtype.size_bytes() as u64 == 0;
        if !aligned {
            return Err(Error::layout(
                None,
                format!("packing a compressed chunk on the device: a misaligned buffer in {job:?}"),
            ));
        }
        self.gpu.bind()?;
        let quant = self.quant()?;
        let (scales, payload) = job.split();
        let launch = |e| kernels_error("cuLaunchKernel (compressed push)", e);
        // SAFETY: the caller's contract: every range of `job` is device
        // memory of this device of the sizes it names, valid until the work
        // has run, not overlapping; all are aligned (checked).
        unsafe {
            // The f32 values: the scaled gradient (0 + factor · x, as the
            // host's push computes it), the shard itself (f32), or the
            // shard widened.
            let values = match (job.scale, job.src_dtype) {
                (Some(factor), _) => {
                    self.server().zero(job.values, n * 4)?;
                    self.kernels
                        .accumulate_raw(
                            &self.server,
                            job.values,
                            DType::F32,
                            job.src,
                            job.src_dtype,
                            n,
                            factor,
                        )
                        .map_err(launch)?;
                    job.values
                }
                (None, DType::F32) => job.src,
                (None, dtype) => {
                    self.kernels
                        .cast_raw(&self.server, job.src, dtype, job.values, DType::F32, n)
                        .map_err(launch)?;
                    job.values
                }
            };
            match job.residual {
                Some(r) => {
                    quant.feedback_quantise_raw(&self.server, spec, r, values, payload, scales, n)
                }
                None => quant.quantise_raw(&self.server, spec, values, payload, scales, n),
            }
        }
        .map_err(launch)
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
        if take == 0 {
            return Ok(());
        }
        if take > len || chunk % 4 != 0 || dst % dst_dtype.size_bytes() as u64 != 0 {
            return Err(Error::layout(
                None,
                format!(
                    "dequantising on the device: {take} of {len} elements, chunk at {chunk:#x}, \
                     output at {dst:#x} ({dst_dtype}): out of range or misaligned"
                ),
            ));
        }
        self.gpu.bind()?;
        let quant = self.quant()?;
        let (scales, payload) = super::chunk_parts(chunk, spec, len);
        // SAFETY: the caller's contract: the chunk's bytes at `chunk` and
        // `take` writable elements at `dst` on this device, valid until the
        // work has run, not overlapping; aligned (checked). The first
        // `take` elements' scales and codes are the prefixes of the chunk's.
        unsafe { quant.dequantise_raw(&self.server, spec, payload, scales, dst, dst_dtype, take) }
            .map_err(|e| kernels_error("cuLaunchKernel (compressed gather)", e))
    }

    unsafe fn dequantise_accumulate_on_server(
        &self,
        acc: u64,
        chunk: u64,
        spec: Spec,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if acc % 4 != 0 || chunk % 4 != 0 {
            return Err(Error::layout(
                None,
                format!(
                    "adding a compressed chunk on the device: accumulator at {acc:#x} or chunk at \
                     {chunk:#x} is not 4-aligned"
                ),
            ));
        }
        self.gpu.bind()?;
        let quant = self.quant()?;
        let (scales, payload) = super::chunk_parts(chunk, spec, n);
        // SAFETY: the caller's contract: `acc` addresses `n` writable f32s
        // and `chunk` the chunk's bytes on this device, valid until the work
        // has run, not overlapping; both aligned (checked).
        unsafe {
            quant.dequantise_accumulate_raw(&self.server, spec, payload, scales, acc, n, scale)
        }
        .map_err(|e| kernels_error("cuLaunchKernel (compressed chunk add)", e))
    }

    unsafe fn zero_on_server(&self, dst: u64, len: usize) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the caller's contract: `dst` addresses `len` writable
        // bytes valid until the work has run.
        unsafe { self.server().zero(dst, len) }
    }

    fn then(&self, stream: StreamHandle, work: HostWork) -> Result<()> {
        self.gpu.bind()?;
        let data = Box::into_raw(Box::new(work)).cast::<c_void>();
        // SAFETY: `stream` is a stream of this device (the trait's handles
        // are); `run_host_work` calls no CUDA (the work must not call the
        // backend, the trait's contract) and reclaims `data`, which stays
        // valid until then because only it frees it.
        let launched = unsafe { self.stream(stream).then_host(run_host_work, data) };
        if launched.is_err() {
            // Not enqueued: the driver will never call `run_host_work`, so
            // the box is still ours.
            // SAFETY: from `Box::into_raw` above, reclaimed once.
            drop(unsafe { Box::from_raw(data.cast::<HostWork>()) });
        }
        launched
    }

    fn order(&self, waiter: StreamHandle, after: StreamHandle) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: both are streams of this device (the trait's handles are)
        // and alive for the call.
        let (waiter, after) = unsafe { (self.stream(waiter), self.stream(after)) };
        waiter.wait_for(&after)
    }

    fn synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: a stream of this device (the trait's handles are).
        unsafe { self.stream(stream) }.synchronize()
    }

    unsafe fn read_to_host(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.gpu.bind()?;
        self.server().synchronize()?;
        // SAFETY: the caller's contract: `src` addresses `dst.len()`
        // readable bytes of this device's memory.
        unsafe { self.gpu.copy_to_host(src, dst) }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn without_a_driver_open_is_gpu_unavailable_naming_libcuda() {
        if odc_kernels::cuda::driver_is_present() {
            eprintln!("SKIPPED: a CUDA driver is present here");
            return;
        }
        match CudaBackend::open(0) {
            Err(e @ Error::GpuUnavailable(_)) => {
                let s = e.to_string();
                assert!(s.contains("libcuda"), "{s}");
            }
            other => panic!("expected GpuUnavailable, got {other:?}"),
        }
    }

    fn boxed(work: HostWork) -> *mut c_void {
        Box::into_raw(Box::new(work)).cast()
    }

    #[test]
    fn the_trampoline_runs_the_work_once_and_frees_it() {
        static RAN: AtomicUsize = AtomicUsize::new(0);
        let owned = Arc::new(());
        let held = Arc::clone(&owned);
        let data = boxed(Box::new(move || {
            let _held = held;
            RAN.fetch_add(1, Ordering::SeqCst);
        }));
        // SAFETY: `data` is a boxed HostWork, passed once.
        unsafe { run_host_work(data) };
        assert_eq!(RAN.load(Ordering::SeqCst), 1);
        assert_eq!(Arc::strong_count(&owned), 1, "the work's captures leaked");
    }

    #[test]
    fn a_panicking_work_does_not_unwind_out_of_the_trampoline() {
        let owned = Arc::new(());
        let held = Arc::clone(&owned);
        let data = boxed(Box::new(move || {
            let _held = held;
            panic!("host work panics (expected by this test)");
        }));
        // SAFETY: as above. Were the panic to escape, this test would fail
        // (or abort at the `extern "C"` boundary).
        unsafe { run_host_work(data) };
        assert_eq!(Arc::strong_count(&owned), 1, "the work's captures leaked");
    }
}
