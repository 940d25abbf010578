//! [`CudaKernels`]: the compiled module on one device, and its launches.

use std::sync::Arc;

use cudarc::driver::{
    result as cu, CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg,
};

use super::nvrtc::{self, Output};
use super::{accumulate_entry, cast_entry, cuda_error, probe_device, Arch, DeviceInfo, SOURCE};
use crate::{DType, Error, Result};

/// Threads per block: eight warps, enough to hide load latency with a
/// grid of a few blocks per multiprocessor.
const THREADS: u32 = 256;

/// Resident blocks per multiprocessor the grid is capped at; grid-stride
/// loops cover the rest, so one launch serves any chunk size.
const BLOCKS_PER_SM: u32 = 8;

/// How the module reached the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Image {
    /// Machine code for the device's own architecture.
    Cubin(Arch),
    /// PTX for an older virtual architecture, JIT-compiled by the driver
    /// (when NVRTC cannot target the device directly).
    Ptx(Arch),
}

/// The kernels loaded on one device: `accumulate` and `cast` on device
/// memory, launched asynchronously on a caller's stream.
///
/// Build one per device and share it (`Send + Sync`); launches take `&self`.
/// The module is unloaded when the last clone of its functions drops.
#[derive(Clone, Debug)]
pub struct CudaKernels {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
    image: Image,
    /// Indexed `acc.as_u8() * 3 + x.as_u8()`.
    accumulate: Vec<CudaFunction>,
    /// Indexed `src.as_u8() * 3 + dst.as_u8()`; `None` on the diagonal.
    cast: Vec<Option<CudaFunction>>,
    max_blocks: u32,
}

impl CudaKernels {
    /// Compiles the kernels for device `ordinal` and loads them into its
    /// primary context.
    ///
    /// Errors: [`Error::GpuUnavailable`] naming what is missing (driver,
    /// device, NVRTC), [`Error::Nvrtc`] or [`Error::Cuda`] when a present
    /// toolchain fails.
    pub fn new(ordinal: usize) -> Result<CudaKernels> {
        let info = probe_device(ordinal)?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| cuda_error("cuDevicePrimaryCtxRetain", e))?;
        CudaKernels::load(ctx, info)
    }

    /// [`CudaKernels::new`] into an existing context (the one the engine's
    /// streams and regions live in).
    pub fn with_context(ctx: Arc<CudaContext>) -> Result<CudaKernels> {
        let info = probe_device(ctx.ordinal())?;
        CudaKernels::load(ctx, info)
    }

    fn load(ctx: Arc<CudaContext>, info: DeviceInfo) -> Result<CudaKernels> {
        let (module, image) = load_module(&ctx, SOURCE, &info)?;
        let function = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda_error(format!("cuModuleGetFunction({name})"), e))
        };
        let mut accumulate = Vec::with_capacity(9);
        let mut cast = Vec::with_capacity(9);
        for a in DType::ALL {
            for b in DType::ALL {
                accumulate.push(function(accumulate_entry(a, b))?);
                cast.push(cast_entry(a, b).map(function).transpose()?);
            }
        }
        let max_blocks = info.multiprocessors.saturating_mul(BLOCKS_PER_SM);
        Ok(CudaKernels {
            ctx,
            info,
            image,
            accumulate,
            cast,
            max_blocks,
        })
    }

    /// The context the module lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device, as probed.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// Whether the module was loaded as CUBIN or PTX, and for which arch.
    pub fn image(&self) -> Image {
        self.image
    }

    /// `acc[i] = round(acc[i] + scale * x[i])` on device bytes, as
    /// [`cpu::accumulate_bytes`](crate::cpu::accumulate_bytes) on the host:
    /// `acc` holds `acc_dtype`, `x` holds `x_dtype`. Enqueued on `stream`;
    /// returns before it runs.
    ///
    /// Errors: [`Error::PartialElement`], [`Error::Misaligned`] or
    /// [`Error::LengthMismatch`] like the CPU form; [`Error::InvalidArgument`]
    /// for a stream of another context; [`Error::Cuda`] if the launch fails.
    pub fn accumulate<A, X>(
        &self,
        stream: &CudaStream,
        acc: &mut A,
        acc_dtype: DType,
        x: &X,
        x_dtype: DType,
        scale: f32,
    ) -> Result<()>
    where
        A: DevicePtrMut<u8>,
        X: DevicePtr<u8>,
    {
        const OP: &str = "cuda accumulate";
        let n = elements(OP, "destination", acc.len(), acc_dtype)?;
        let m = elements(OP, "source", x.len(), x_dtype)?;
        crate::cpu::check_len(OP, n, m)?;
        self.check_stream(OP, stream)?;
        let (acc_ptr, _acc_sync) = acc.device_ptr_mut(stream);
        let (x_ptr, _x_sync) = x.device_ptr(stream);
        check_aligned(OP, "destination", acc_ptr, acc_dtype)?;
        check_aligned(OP, "source", x_ptr, x_dtype)?;
        // SAFETY: both pointers come from live cudarc allocations of the
        // checked lengths, borrowed until the launch is enqueued; the
        // SyncOnDrop guards order later users of them after it.
        unsafe { self.accumulate_raw(stream, acc_ptr, acc_dtype, x_ptr, x_dtype, n, scale) }
    }

    /// `dst[i] = round(src[i])` on device bytes, as [`cpu::cast`](crate::cpu::cast):
    /// widening is exact, narrowing rounds to nearest even and keeps NaN,
    /// a same-dtype cast copies bytes. Enqueued on `stream`.
    ///
    /// Errors like [`CudaKernels::accumulate`].
    pub fn cast<S, D>(
        &self,
        stream: &CudaStream,
        src: &S,
        src_dtype: DType,
        dst: &mut D,
        dst_dtype: DType,
    ) -> Result<()>
    where
        S: DevicePtr<u8>,
        D: DevicePtrMut<u8>,
    {
        const OP: &str = "cuda cast";
        let n = elements(OP, "destination", dst.len(), dst_dtype)?;
        let m = elements(OP, "source", src.len(), src_dtype)?;
        crate::cpu::check_len(OP, n, m)?;
        self.check_stream(OP, stream)?;
        let (dst_ptr, _dst_sync) = dst.device_ptr_mut(stream);
        let (src_ptr, _src_sync) = src.device_ptr(stream);
        check_aligned(OP, "destination", dst_ptr, dst_dtype)?;
        check_aligned(OP, "source", src_ptr, src_dtype)?;
        // SAFETY: as in `accumulate`.
        unsafe { self.cast_raw(stream, src_ptr, src_dtype, dst_ptr, dst_dtype, n) }
    }

    /// [`CudaKernels::accumulate`] on raw device addresses: what transports
    /// call on memory they registered themselves (symmetric heap, IPC
    /// mappings). `n` is in elements.
    ///
    /// # Safety
    ///
    /// `acc` must address `n` writable elements of `acc_dtype` and `x` `n`
    /// readable elements of `x_dtype`, both in this context (or mapped into
    /// it), each aligned to its element size, not overlapping, and both
    /// must stay allocated and untouched by other streams until the work
    /// enqueued on `stream` completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn accumulate_raw(
        &self,
        stream: &CudaStream,
        acc: u64,
        acc_dtype: DType,
        x: u64,
        x_dtype: DType,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = &self.accumulate[usize::from(acc_dtype.as_u8()) * 3 + usize::from(x_dtype.as_u8())];
        let cfg = self.config(n, pack_width(acc_dtype, x_dtype));
        let n64 = n as u64;
        let mut launch = stream.launch_builder(f);
        launch.arg(&acc).arg(&x).arg(&n64).arg(&scale);
        // SAFETY: the argument list matches the kernel's
        // (A*, const X*, u64, float); the caller vouches for the memory.
        unsafe { launch.launch(cfg) }.map_err(|e| {
            cuda_error(
                format!("launch {}", accumulate_entry(acc_dtype, x_dtype)),
                e,
            )
        })?;
        Ok(())
    }

    /// [`CudaKernels::cast`] on raw device addresses; `n` in elements.
    ///
    /// # Safety
    ///
    /// As [`CudaKernels::accumulate_raw`], with `src` readable and `dst`
    /// writable.
    pub unsafe fn cast_raw(
        &self,
        stream: &CudaStream,
        src: u64,
        src_dtype: DType,
        dst: u64,
        dst_dtype: DType,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let Some(f) =
            &self.cast[usize::from(src_dtype.as_u8()) * 3 + usize::from(dst_dtype.as_u8())]
        else {
            let bytes = n * src_dtype.size_bytes();
            // SAFETY: the caller vouches for both ranges; the copy is
            // enqueued on `stream` like a kernel would be.
            return unsafe { cu::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
                .map_err(|e| cuda_error("cuMemcpyDtoDAsync", e));
        };
        let cfg = self.config(n, pack_width(src_dtype, dst_dtype));
        let n64 = n as u64;
        let mut launch = stream.launch_builder(f);
        launch.arg(&src).arg(&dst).arg(&n64);
        // SAFETY: arguments match (const S*, D*, u64); memory as the caller vouches.
        unsafe { launch.launch(cfg) }.map_err(|e| {
            let name = cast_entry(src_dtype, dst_dtype).unwrap_or("cast");
            cuda_error(format!("launch {name}"), e)
        })?;
        Ok(())
    }

    fn config(&self, n: usize, width: usize) -> LaunchConfig {
        let work = n.div_ceil(width).div_ceil(THREADS as usize);
        let blocks = u32::try_from(work)
            .unwrap_or(u32::MAX)
            .clamp(1, self.max_blocks.max(1));
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn check_stream(&self, op: &'static str, stream: &CudaStream) -> Result<()> {
        check_stream_context(op, stream, &self.ctx)
    }
}

/// Compiles `source` for `info`'s device and loads it into `ctx`: machine
/// code first (PTX from a newer NVRTC than the driver is refused by the
/// JIT, a CUBIN loads on any driver that knows the GPU), PTX for an older
/// virtual architecture where NVRTC cannot target the device.
pub(super) fn load_module(
    ctx: &Arc<CudaContext>,
    source: &str,
    info: &DeviceInfo,
) -> Result<(Arc<CudaModule>, Image)> {
    let (module, image) = match nvrtc::compile(source, info.arch, Output::Cubin) {
        Ok(cubin) => (
            ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)),
            Image::Cubin(info.arch),
        ),
        Err(_) => {
            let arch = info.arch.min(Arch::SM90);
            let ptx = nvrtc::compile(source, arch, Output::Ptx)?;
            let text = String::from_utf8_lossy(&ptx).into_owned();
            (
                ctx.load_module(cudarc::nvrtc::Ptx::from_src(text)),
                Image::Ptx(arch),
            )
        }
    };
    Ok((
        module.map_err(|e| cuda_error("cuModuleLoadData", e))?,
        image,
    ))
}

/// `stream` must belong to `ctx`, the context the kernels were loaded into.
pub(super) fn check_stream_context(
    op: &'static str,
    stream: &CudaStream,
    ctx: &Arc<CudaContext>,
) -> Result<()> {
    if stream.context().cu_ctx() == ctx.cu_ctx() {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            detail: format!(
                "stream belongs to device {}'s context, the kernels to device {}'s",
                stream.context().ordinal(),
                ctx.ordinal()
            ),
        })
    }
}

/// Elements per thread per step, as the kernels compute it: 16 bytes of
/// the wider operand.
fn pack_width(a: DType, b: DType) -> usize {
    16 / a.size_bytes().max(b.size_bytes())
}

pub(super) fn elements(
    op: &'static str,
    what: &'static str,
    bytes: usize,
    dtype: DType,
) -> Result<usize> {
    if bytes % dtype.size_bytes() == 0 {
        Ok(bytes / dtype.size_bytes())
    } else {
        Err(Error::PartialElement {
            op,
            what,
            len: bytes,
            dtype,
        })
    }
}

pub(super) fn check_aligned(
    op: &'static str,
    what: &'static str,
    addr: u64,
    dtype: DType,
) -> Result<()> {
    let align = dtype.size_bytes();
    if addr % align as u64 == 0 {
        Ok(())
    } else {
        Err(Error::Misaligned {
            op,
            what,
            addr: addr as usize,
            align,
            dtype,
        })
    }
}
