//! The block-scaled formats of [`cpu::quant`](crate::cpu::quant) on device
//! memory: [`QUANT_SOURCE`] (`quant.cu`), compiled through NVRTC as a
//! program of its own, and [`CudaQuant`], its launches.
//!
//! The kernels compute what the host kernels compute, bit for bit (NaN
//! payloads aside): the same scale rule, the same fp8 rounding trick, the
//! same multiplies and adds, each explicitly rounded and never fused. The
//! bf16 format needs no kernel of its own: it is [`CudaKernels`]'s cast
//! and accumulate, which [`CudaQuant`] calls for it.
//!
//! Like the rest of [`crate::cuda`], nothing here links CUDA, and
//! [`compile_quant_ptx`] needs only NVRTC (no driver, no GPU). Checked
//! three ways: NVRTC compiles the source for sm_80 and sm_90 with exact
//! rounding (`tests/cuda_quant.rs`); the source built as C++ for the host,
//! warps emulated by threads, matches the host kernels bit for bit
//! (`tests/cuda_quant_host.rs`); and on a GPU the device itself does
//! (`tests/cuda_quant.rs`, run by `scripts/gpu-run.sh`).

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::launch::{check_aligned, check_stream_context, elements, load_module};
use super::nvrtc::{self, Output};
use super::{cuda_error, probe_device, Arch, CudaKernels, DeviceInfo, Image, Ptx};
use crate::cpu::quant::{Format, Spec};
use crate::{DType, Error, Result};

/// The CUDA C source of the quantise / dequantise kernels.
pub const QUANT_SOURCE: &str = include_str!("quant.cu");

/// Threads per block: eight warps, so eight scale blocks at a time per
/// thread block (every kernel gives a scale block to a warp).
const THREADS: u32 = 256;

/// Resident blocks per multiprocessor the grid is capped at.
const BLOCKS_PER_SM: u32 = 8;

/// Every kernel entry point in [`QUANT_SOURCE`].
pub fn quant_entries() -> Vec<String> {
    let mut out = Vec::new();
    for f in ["fp8", "int8"] {
        out.push(format!("odc_quantise_{f}"));
        out.push(format!("odc_dequantise_accumulate_{f}"));
        out.push(format!("odc_dequantise_{f}_to_f32"));
        out.push(format!("odc_dequantise_{f}_to_bf16"));
    }
    out.push("odc_zero_non_finite".to_owned());
    out
}

/// Compiles [`QUANT_SOURCE`] to PTX for `arch`. Needs NVRTC only.
///
/// Errors like [`super::compile_ptx`].
pub fn compile_quant_ptx(arch: &str) -> Result<Ptx> {
    let arch: Arch = arch.parse()?;
    let bytes = nvrtc::compile(QUANT_SOURCE, arch, Output::Ptx)?;
    Ok(Ptx {
        arch,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

/// Compiles [`QUANT_SOURCE`] to CUBIN for `arch`. Needs NVRTC only.
pub fn compile_quant_cubin(arch: &str) -> Result<Vec<u8>> {
    nvrtc::compile(QUANT_SOURCE, arch.parse()?, Output::Cubin)
}

/// The scaled formats' kernels of one format.
#[derive(Debug)]
struct Kernels {
    quantise: CudaFunction,
    accumulate: CudaFunction,
    to_f32: CudaFunction,
    to_bf16: CudaFunction,
}

/// The quantise / dequantise kernels loaded on one device, launched
/// asynchronously on a caller's stream; `Send + Sync`, launches take `&self`.
#[derive(Debug)]
pub struct CudaQuant {
    cast: CudaKernels,
    image: Image,
    fp8: Kernels,
    int8: Kernels,
    zero_non_finite: CudaFunction,
    max_blocks: u32,
}

impl CudaQuant {
    /// Compiles the kernels for device `ordinal` and loads them (and
    /// [`CudaKernels`], for bf16) into its primary context.
    ///
    /// Errors like [`CudaKernels::new`].
    pub fn new(ordinal: usize) -> Result<CudaQuant> {
        probe_device(ordinal)?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| cuda_error("cuDevicePrimaryCtxRetain", e))?;
        CudaQuant::with_context(ctx)
    }

    /// [`CudaQuant::new`] into an existing context.
    pub fn with_context(ctx: Arc<CudaContext>) -> Result<CudaQuant> {
        CudaQuant::with_kernels(CudaKernels::with_context(ctx)?)
    }

    /// [`CudaQuant::new`] beside kernels already loaded (bf16's cast and
    /// accumulate are theirs), in their context.
    pub fn with_kernels(cast: CudaKernels) -> Result<CudaQuant> {
        let ctx = Arc::clone(cast.context());
        let info = cast.device().clone();
        let (module, image) = load_module(&ctx, QUANT_SOURCE, &info)?;
        let function = |name: String| {
            module
                .load_function(&name)
                .map_err(|e| cuda_error(format!("cuModuleGetFunction({name})"), e))
        };
        let kernels = |f: &str| -> Result<Kernels> {
            Ok(Kernels {
                quantise: function(format!("odc_quantise_{f}"))?,
                accumulate: function(format!("odc_dequantise_accumulate_{f}"))?,
                to_f32: function(format!("odc_dequantise_{f}_to_f32"))?,
                to_bf16: function(format!("odc_dequantise_{f}_to_bf16"))?,
            })
        };
        Ok(CudaQuant {
            fp8: kernels("fp8")?,
            int8: kernels("int8")?,
            zero_non_finite: function("odc_zero_non_finite".to_owned())?,
            image,
            max_blocks: info.multiprocessors.saturating_mul(BLOCKS_PER_SM),
            cast,
        })
    }

    /// The context the modules live in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.cast.context()
    }

    /// The device, as probed.
    pub fn device(&self) -> &DeviceInfo {
        self.cast.device()
    }

    /// How the quantise module reached the device.
    pub fn image(&self) -> Image {
        self.image
    }

    fn kernels(&self, format: Format) -> Option<&Kernels> {
        match format {
            Format::Fp8E4m3 => Some(&self.fp8),
            Format::Int8 => Some(&self.int8),
            Format::Bf16 => None,
        }
    }

    /// [`cpu::quant::quantise`](crate::cpu::quant::quantise) on device
    /// bytes: `src` holds f32, `payload` receives
    /// `spec.payload_bytes(n)` bytes, `scales` `spec.scales(n)` f32.
    /// Enqueued on `stream`.
    ///
    /// Errors: [`Error::InvalidArgument`] for wrongly sized buffers or a
    /// stream of another context, [`Error::PartialElement`] /
    /// [`Error::Misaligned`] for bad f32 buffers, [`Error::Cuda`] if the
    /// launch fails.
    pub fn quantise<S, P, C>(
        &self,
        stream: &CudaStream,
        spec: Spec,
        src: &S,
        payload: &mut P,
        scales: &mut C,
    ) -> Result<()>
    where
        S: DevicePtr<u8>,
        P: DevicePtrMut<u8>,
        C: DevicePtrMut<u8>,
    {
        const OP: &str = "cuda quantise";
        let n = elements(OP, "source", src.len(), DType::F32)?;
        let nscales = elements(OP, "scales", scales.len(), DType::F32)?;
        check(OP, spec, n, payload.len(), nscales)?;
        self.check_stream(OP, stream)?;
        let (s, _s) = src.device_ptr(stream);
        let (p, _p) = payload.device_ptr_mut(stream);
        let (c, _c) = scales.device_ptr_mut(stream);
        check_aligned(OP, "source", s, DType::F32)?;
        check_aligned(OP, "scales", c, DType::F32)?;
        if !spec.format().scaled() {
            check_aligned(OP, "payload", p, DType::BF16)?;
        }
        // SAFETY: the pointers come from live cudarc allocations of the
        // checked lengths, borrowed until the launch is enqueued; the
        // SyncOnDrop guards order later users after it.
        unsafe { self.quantise_raw(stream, spec, s, p, c, n) }
    }

    /// [`cpu::quant::dequantise_accumulate`](crate::cpu::quant::dequantise_accumulate)
    /// on device bytes (`acc` holds f32). Enqueued on `stream`.
    ///
    /// Errors like [`CudaQuant::quantise`].
    pub fn dequantise_accumulate<P, C, A>(
        &self,
        stream: &CudaStream,
        spec: Spec,
        payload: &P,
        scales: &C,
        acc: &mut A,
        factor: f32,
    ) -> Result<()>
    where
        P: DevicePtr<u8>,
        C: DevicePtr<u8>,
        A: DevicePtrMut<u8>,
    {
        const OP: &str = "cuda dequantise_accumulate";
        let n = elements(OP, "accumulator", acc.len(), DType::F32)?;
        let nscales = elements(OP, "scales", scales.len(), DType::F32)?;
        check(OP, spec, n, payload.len(), nscales)?;
        self.check_stream(OP, stream)?;
        let (p, _p) = payload.device_ptr(stream);
        let (c, _c) = scales.device_ptr(stream);
        let (a, _a) = acc.device_ptr_mut(stream);
        check_aligned(OP, "accumulator", a, DType::F32)?;
        check_aligned(OP, "scales", c, DType::F32)?;
        if !spec.format().scaled() {
            check_aligned(OP, "payload", p, DType::BF16)?;
        }
        // SAFETY: as in `quantise`.
        unsafe { self.dequantise_accumulate_raw(stream, spec, p, c, a, n, factor) }
    }

    /// [`cpu::quant::dequantise`](crate::cpu::quant::dequantise) on device
    /// bytes into `dst` of `dst_dtype` (f32 or bf16). Enqueued on `stream`.
    ///
    /// Errors like [`CudaQuant::quantise`]; [`Error::InvalidArgument`] for
    /// an f16 destination.
    pub fn dequantise<P, C, D>(
        &self,
        stream: &CudaStream,
        spec: Spec,
        payload: &P,
        scales: &C,
        dst: &mut D,
        dst_dtype: DType,
    ) -> Result<()>
    where
        P: DevicePtr<u8>,
        C: DevicePtr<u8>,
        D: DevicePtrMut<u8>,
    {
        const OP: &str = "cuda dequantise";
        if dst.len() % dst_dtype.size_bytes() != 0 {
            return Err(Error::PartialElement {
                op: OP,
                what: "destination",
                len: dst.len(),
                dtype: dst_dtype,
            });
        }
        let n = dst.len() / dst_dtype.size_bytes();
        let nscales = elements(OP, "scales", scales.len(), DType::F32)?;
        check(OP, spec, n, payload.len(), nscales)?;
        self.check_stream(OP, stream)?;
        let (p, _p) = payload.device_ptr(stream);
        let (c, _c) = scales.device_ptr(stream);
        let (d, _d) = dst.device_ptr_mut(stream);
        check_aligned(OP, "destination", d, dst_dtype)?;
        check_aligned(OP, "scales", c, DType::F32)?;
        if !spec.format().scaled() {
            check_aligned(OP, "payload", p, DType::BF16)?;
        }
        // SAFETY: as in `quantise`.
        unsafe { self.dequantise_raw(stream, spec, p, c, d, dst_dtype, n) }
    }

    /// [`CudaQuant::quantise`] on raw device addresses; `n` in elements.
    ///
    /// # Safety
    ///
    /// `src` must address `n` readable f32, `payload` `spec.payload_bytes(n)`
    /// writable bytes (2-aligned for bf16), `scales` `spec.scales(n)`
    /// writable f32, all in this context, not overlapping, and untouched by
    /// other streams until the work enqueued on `stream` completes.
    pub unsafe fn quantise_raw(
        &self,
        stream: &CudaStream,
        spec: Spec,
        src: u64,
        payload: u64,
        scales: u64,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let Some(k) = self.kernels(spec.format()) else {
            // SAFETY: the caller's guarantee, as the cast's contract asks.
            return unsafe {
                self.cast
                    .cast_raw(stream, src, DType::F32, payload, DType::BF16, n)
            };
        };
        let (n64, block) = (n as u64, spec.block() as u32);
        let cfg = self.config(spec, n);
        let mut launch = stream.launch_builder(&k.quantise);
        launch
            .arg(&src)
            .arg(&payload)
            .arg(&scales)
            .arg(&n64)
            .arg(&block);
        // SAFETY: the arguments match (const float*, u8*, float*, u64, u32);
        // the caller vouches for the memory.
        unsafe { launch.launch(cfg) }
            .map_err(|e| cuda_error(format!("launch odc_quantise for {spec}"), e))?;
        Ok(())
    }

    /// [`CudaQuant::dequantise_accumulate`] on raw device addresses.
    ///
    /// # Safety
    ///
    /// As [`CudaQuant::quantise_raw`], with `payload` and `scales` readable
    /// and `acc` `n` readable and writable f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dequantise_accumulate_raw(
        &self,
        stream: &CudaStream,
        spec: Spec,
        payload: u64,
        scales: u64,
        acc: u64,
        n: usize,
        factor: f32,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let Some(k) = self.kernels(spec.format()) else {
            // SAFETY: the caller's guarantee.
            return unsafe {
                self.cast
                    .accumulate_raw(stream, acc, DType::F32, payload, DType::BF16, n, factor)
            };
        };
        let (n64, block) = (n as u64, spec.block() as u32);
        let cfg = self.config(spec, n);
        let mut launch = stream.launch_builder(&k.accumulate);
        launch
            .arg(&acc)
            .arg(&payload)
            .arg(&scales)
            .arg(&n64)
            .arg(&block)
            .arg(&factor);
        // SAFETY: the arguments match (float*, const u8*, const float*, u64,
        // u32, float); the caller vouches for the memory.
        unsafe { launch.launch(cfg) }
            .map_err(|e| cuda_error(format!("launch odc_dequantise_accumulate for {spec}"), e))?;
        Ok(())
    }

    /// [`CudaQuant::dequantise`] on raw device addresses.
    ///
    /// # Safety
    ///
    /// As [`CudaQuant::quantise_raw`], with `payload` and `scales` readable
    /// and `dst` `n` writable elements of `dst_dtype`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dequantise_raw(
        &self,
        stream: &CudaStream,
        spec: Spec,
        payload: u64,
        scales: u64,
        dst: u64,
        dst_dtype: DType,
        n: usize,
    ) -> Result<()> {
        let Some(k) = self.kernels(spec.format()) else {
            // SAFETY: the caller's guarantee.
            return unsafe {
                self.cast
                    .cast_raw(stream, payload, DType::BF16, dst, dst_dtype, n)
            };
        };
        let f = match dst_dtype {
            DType::F32 => &k.to_f32,
            DType::BF16 => &k.to_bf16,
            DType::F16 => {
                return Err(Error::InvalidArgument {
                    op: "cuda dequantise",
                    detail: format!("{spec} dequantises on a device to f32 or bf16, not f16"),
                })
            }
        };
        if n == 0 {
            return Ok(());
        }
        let (n64, block) = (n as u64, spec.block() as u32);
        let cfg = self.config(spec, n);
        let mut launch = stream.launch_builder(f);
        launch
            .arg(&payload)
            .arg(&scales)
            .arg(&dst)
            .arg(&n64)
            .arg(&block);
        // SAFETY: the arguments match (const u8*, const float*, D*, u64, u32);
        // the caller vouches for the memory.
        unsafe { launch.launch(cfg) }
            .map_err(|e| cuda_error(format!("launch odc_dequantise for {spec}"), e))?;
        Ok(())
    }

    /// [`cpu::quant::feedback_quantise`](crate::cpu::quant::feedback_quantise)
    /// on raw device addresses, in four launches on `stream`: `residual +=
    /// grad`, quantise it into `payload` and `scales`, `residual -=` its
    /// dequantisation, and a residual that is not finite zeroed; the same
    /// operations as the host's, so the same bits.
    ///
    /// # Safety
    ///
    /// As [`CudaQuant::quantise_raw`], with `residual` `n` readable and
    /// writable f32 and `grad` `n` readable f32, neither overlapping the
    /// others.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn feedback_quantise_raw(
        &self,
        stream: &CudaStream,
        spec: Spec,
        residual: u64,
        grad: u64,
        payload: u64,
        scales: u64,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract, for each launch; the stream runs
        // them in order.
        unsafe {
            self.cast
                .accumulate_raw(stream, residual, DType::F32, grad, DType::F32, n, 1.0)?;
            self.quantise_raw(stream, spec, residual, payload, scales, n)?;
            self.dequantise_accumulate_raw(stream, spec, payload, scales, residual, n, -1.0)?;
        }
        let n64 = n as u64;
        let blocks = u32::try_from(n.div_ceil(THREADS as usize))
            .unwrap_or(u32::MAX)
            .clamp(1, self.max_blocks.max(1));
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&self.zero_non_finite);
        launch.arg(&residual).arg(&n64);
        // SAFETY: the arguments match (float*, u64); the caller vouches for
        // the memory.
        unsafe { launch.launch(cfg) }.map_err(|e| cuda_error("launch odc_zero_non_finite", e))?;
        Ok(())
    }

    /// One warp per scale block, up to the grid's cap (warps then stride).
    fn config(&self, spec: Spec, n: usize) -> LaunchConfig {
        let blocks = spec.scales(n).div_ceil((THREADS / 32) as usize);
        let blocks = u32::try_from(blocks)
            .unwrap_or(u32::MAX)
            .clamp(1, self.max_blocks.max(1));
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn check_stream(&self, op: &'static str, stream: &CudaStream) -> Result<()> {
        check_stream_context(op, stream, self.context())
    }
}

fn check(op: &'static str, spec: Spec, n: usize, payload: usize, scales: usize) -> Result<()> {
    if payload != spec.payload_bytes(n) || scales != spec.scales(n) {
        return Err(Error::InvalidArgument {
            op,
            detail: format!(
                "{payload} payload bytes and {scales} scales given; {n} elements of {spec} need {} and {}",
                spec.payload_bytes(n),
                spec.scales(n)
            ),
        });
    }
    Ok(())
}
