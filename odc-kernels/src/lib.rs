//! Accumulate and cast kernels for ODC.
//!
//! A rank pushes gradient chunks into an owner's landing slot; the owner's
//! server daemon adds `scale · slot` into the bucket's gradient
//! accumulator. This crate is that addition, and the dtype casts around
//! it, for every element type ODC moves: f32, bf16 and f16. It knows
//! nothing about transports, buckets or peers: it sees slices.
//!
//! # Modules
//!
//! - [`dtype`] — [`DType`], the one-byte runtime tag that travels in
//!   shared-memory descriptors, and [`Element`], the typed side
//!   (`f32`, [`half::bf16`], [`half::f16`]).
//! - [`cpu`] — host kernels: accumulate (f32 accumulator with any input,
//!   or same-dtype), cast between every pair of dtypes, scale, zero, and
//!   a bulk copy that streams large copies past the cache. SIMD
//!   (AVX2 + F16C) on x86_64, chosen at run time; a portable path
//!   elsewhere; [`cpu::reference`] holds the scalar definitions they are
//!   tested against. [`cpu::exact`] is deterministic mode's add: every
//!   contribution as a fixed-point integer, so sums do not depend on order.
//!   [`cpu::quant`] holds the block-scaled formats of compressed chunks
//!   (bf16, fp8 e4m3, int8 with f32 block scales), their quantise /
//!   dequantise(-accumulate) kernels and error feedback.
//! - `cuda` — the same kernels for device memory (`kernels.cu`), compiled
//!   at run time through NVRTC and launched through cudarc, so the crate
//!   builds on machines without CUDA; `cuda::probe` names what is missing
//!   (driver, device, NVRTC) as [`Error::GpuUnavailable`]; `cuda::quant`
//!   is the block-scaled formats' kernels (`quant.cu`).
//!
//! # Quick start
//!
//! ```
//! use half::bf16;
//! use odc_kernels::{cpu, DType};
//!
//! // An owner's f32 accumulator and a bf16 chunk a client pushed.
//! let mut acc = vec![1.0f32; 1000];
//! let chunk: Vec<bf16> = (0..1000).map(|i| bf16::from_f32(i as f32)).collect();
//!
//! // Typed: acc[i] += 0.5 * chunk[i].
//! cpu::accumulate_f32(&mut acc, &chunk, 0.5)?;
//! assert_eq!(acc[10], 1.0 + 0.5 * 10.0);
//!
//! // As the daemon sees a landing slot: bytes plus the descriptor's dtype.
//! let slot: &[u8] = bytemuck::cast_slice(&chunk);
//! let dtype: DType = "bfloat16".parse()?;
//! cpu::accumulate_into_f32(&mut acc, slot, dtype, 0.5)?;
//! assert_eq!(acc[10], 11.0);
//!
//! // Publish the accumulator as bf16, rounded to nearest even.
//! let mut out = vec![bf16::ZERO; 1000];
//! cpu::cast_typed(&acc, &mut out)?;
//! assert_eq!(out[10], bf16::from_f32(11.0));
//!
//! // Mismatched lengths are an error, never a panic.
//! assert!(cpu::accumulate_f32(&mut acc[..10], &chunk, 1.0).is_err());
//! # Ok::<(), odc_kernels::Error>(())
//! ```
//!
//! # Numerics
//!
//! All arithmetic is in f32: `acc + scale * x` is a multiply then an add,
//! never fused, rounded once to the accumulator's dtype (to nearest, ties
//! to even). Every fast path is bit-identical to [`cpu::reference`], and
//! `scale == 1.0` is exactly `acc + x`, so integer-valued sums are exact.
//!
//! # Cargo features
//!
//! `cuda` (default): the `cuda` module. It links nothing: the CUDA driver
//! and NVRTC are opened at run time. The CPU instruction set is detected at run time ([`cpu::isa`]); the
//! environment variable [`cpu::ISA_ENV`]` = scalar` forces the portable
//! path.
//!
//! # Thread safety
//!
//! Every kernel is a pure function of its arguments; the borrow checker
//! keeps two threads from writing one accumulator. The detected
//! instruction set is a process-wide atomic, written once. Kernels never
//! spawn threads: the daemon shares its cores with the rank's compute.
//!
//! # Resource cleanup
//!
//! Kernels never allocate; there is nothing to release.

#![warn(missing_docs)]

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
mod error;
pub mod wheels;

pub use dtype::{DType, Element};
pub use error::{Error, Result, Unavailable};
/// The `half` crate, whose `bf16` and `f16` are [`Element`]s.
pub use half;
