//! The crate's one error type.
//!
//! Kernels fail only on bad arguments: buffers whose lengths disagree, byte
//! buffers that do not hold whole, aligned elements, or a dtype name or code
//! that is not one of ours. No kernel panics on user input.

use crate::DType;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Destination and source hold different numbers of elements.
    #[error("{op}: destination has {dst} elements but source has {src}")]
    LengthMismatch {
        /// The operation that was called (`"accumulate"`, `"cast"`, ...).
        op: &'static str,
        /// Elements in the destination (the accumulator for accumulates).
        dst: usize,
        /// Elements in the source.
        src: usize,
    },

    /// A byte buffer's length is not a multiple of its element size.
    #[error("{op}: {what} is {len} bytes, not a whole number of {dtype} elements")]
    PartialElement {
        /// The operation that was called.
        op: &'static str,
        /// Which buffer: `"source"` or `"destination"`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The dtype it was said to hold.
        dtype: DType,
    },

    /// A byte buffer does not start on an element boundary.
    #[error("{op}: {what} at {addr:#x} is not aligned to {align} bytes as {dtype} requires")]
    Misaligned {
        /// The operation that was called.
        op: &'static str,
        /// Which buffer: `"source"` or `"destination"`.
        what: &'static str,
        /// Its start address.
        addr: usize,
        /// The alignment the dtype needs (its size).
        align: usize,
        /// The dtype it was said to hold.
        dtype: DType,
    },

    /// A contribution too large for the exact (deterministic-mode)
    /// accumulator: `|scale · x|` must be below 2^39.
    #[error(
        "{op}: element {index} contributes {value:e}, beyond the exact accumulator's range \
         (|scale · x| < 2^39 ≈ 5.5e11); deterministic accumulation cannot hold it"
    )]
    OutOfRange {
        /// The operation that was called.
        op: &'static str,
        /// The element's index in the buffer.
        index: usize,
        /// The contribution `scale · x`.
        value: f64,
    },

    /// Two exact accumulators whose sum leaves the `i128` (more than 2^16
    /// contributions near the 2^39 limit added into one element).
    #[error(
        "{op}: element {index}'s exact sum leaves the accumulator's range (more than 2^16 \
         contributions near 2^39 ≈ 5.5e11 in one element); deterministic accumulation cannot hold it"
    )]
    ExactOverflow {
        /// The operation that was called.
        op: &'static str,
        /// The element's index in the buffer.
        index: usize,
    },

    /// A dtype name that none of [`DType`]'s spellings match.
    #[error("unknown dtype {0:?}: expected f32, bf16 or f16 (or float32, bfloat16, float16)")]
    UnknownDTypeName(String),

    /// A dtype code (from a shared-memory descriptor) that is not assigned.
    #[error("unknown dtype code {0}: expected 0 (f32), 1 (bf16) or 2 (f16)")]
    UnknownDTypeCode(u8),

    /// The CUDA kernels cannot run here: no driver, no device or no NVRTC.
    /// Expected on machines without a GPU; callers fall back or skip.
    #[error("CUDA unavailable: {0}")]
    GpuUnavailable(#[from] Unavailable),

    /// NVRTC rejected the kernel source or an option (a bug, or an NVRTC
    /// too old for the requested architecture).
    #[error("NVRTC {call} failed for {arch}: {detail}")]
    Nvrtc {
        /// The NVRTC call (`"nvrtcCompileProgram"`, ...).
        call: &'static str,
        /// The target architecture (`"compute_90"`, `"sm_80"`).
        arch: String,
        /// The NVRTC status and, for compilation, the program log.
        detail: String,
    },

    /// A CUDA driver call failed on a present device.
    #[error("CUDA {call} failed: {detail}")]
    Cuda {
        /// The driver operation (`"cuModuleLoadData"`, `"launch odc_cast_f32_to_bf16"`).
        call: String,
        /// The driver's error name and message.
        detail: String,
    },

    /// An argument the CUDA entry points reject (an unknown architecture).
    #[error("{op}: {detail}")]
    InvalidArgument {
        /// The operation that was called.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
}

/// What is missing for the CUDA kernels to run, from the bottom up.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unavailable {
    /// The system loader finds no CUDA driver library (`libcuda.so.1`):
    /// no NVIDIA driver is installed.
    #[error("no CUDA driver library (libcuda.so / libcuda.so.1) on the loader path: no NVIDIA driver here")]
    NoDriver,

    /// The driver loaded but offers no usable device.
    #[error("no CUDA device: {reason}")]
    NoDevice {
        /// What the driver said (`cuInit: CUDA_ERROR_NO_DEVICE`, an ordinal out of range).
        reason: String,
    },

    /// No NVRTC library (CUDA 13 `libnvrtc.so.13` or CUDA 12 `libnvrtc.so.12`) could be loaded.
    #[error("no NVRTC library (libnvrtc.so.13 or libnvrtc.so.12): tried {}; install the PyPI wheel nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12 into the Python that runs ODC, or set ODC_NVRTC_LIB", .tried.join(", "))]
    NoNvrtc {
        /// Every place tried, in order, each with why it failed.
        tried: Vec<String>,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
