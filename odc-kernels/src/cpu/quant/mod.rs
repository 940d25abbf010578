//! Block-scaled low-precision formats: what a compressed chunk holds, and
//! the host kernels that make and read one.
//!
//! A compressed chunk carries `n` f32 values as a payload of one narrow
//! code per element plus, for the scaled formats, one f32 scale per block
//! of [`Spec::block`] elements (the last block may be short). The owner's
//! daemon needs nothing else to add a chunk into its f32 accumulator
//! ([`dequantise_accumulate`], one pass). This module owns the formats'
//! numerics and the kernels; it knows nothing of buckets, shards or
//! transports (a caller keeps blocks from straddling a shard boundary).
//!
//! # Formats
//!
//! - [`Format::Bf16`]: the top half of each f32, rounded to nearest, ties
//!   to even, as torch's cast; no scales. NaN stays NaN, ±∞ stays ±∞.
//! - [`Format::Fp8E4m3`]: `torch.float8_e4m3fn` codes (max 448, no
//!   infinity, NaN = `S.1111.111`). Per block `scale = amax / 448`, where
//!   `amax` is the largest finite `|x|`; each code is torch's
//!   `float8_e4m3fn` cast of `clamp(x · (1 / scale), -448, 448)`
//!   (round to nearest even, subnormals kept).
//! - [`Format::Int8`]: symmetric, per block `scale = amax / 127`; each code
//!   is `round_half_even(clamp(x · (1 / scale), -127, 127))`.
//!
//! Scale edge cases, the same in every path: a block whose finite values
//! are all zero gets scale 0 and codes 0 (no division by zero); a block
//! whose `amax / qmax` would be below the smallest normal f32 (`amax` under
//! about 5e-36) gets scale `f32::MIN_POSITIVE`, so `1 / scale` stays
//! finite (its codes then use less than the full range; int8 may round
//! them to 0, which error feedback carries to the next push).
//! `1 / scale` is one f32 division, `x · (1 / scale)` one f32 multiply:
//! the NumPy reference in `odc-py/tests/test_compress_formats.py` computes
//! exactly that.
//!
//! # NaN and infinity: carried, as torch's casts carry them
//!
//! A non-finite element does not enter its block's `amax` (so its
//! neighbours keep their precision) and travels as its own code: fp8 `NaN`
//! with the element's sign (`0x7f` / `0xff`; e4m3fn has no infinity), int8 `-128`
//! (a code the clamp to ±127 never makes). Both decode to NaN. So ±∞
//! arrives as NaN in the scaled formats, still non-finite for a loss
//! scaler's `found_inf` check; bf16 keeps ±∞ as ±∞. (torch 2.11's
//! `float8_e4m3fn` cast, c10's `fp8e4m3fn_from_fp32_value`, makes NaN of
//! ±∞; torch 2.15's saturates ±∞ to ±448, which would hide an overflow.
//! For finite values the two agree, and so do these kernels, since every
//! scaled value is clamped to ±448 first.)
//!
//! # Decoding
//!
//! `dequantise(code, scale) = value(code) · scale`, one f32 multiply
//! (`value` is exact: the fp8 value or the integer). Dequantise-accumulate
//! is `acc + factor · (value(code) · scale)`, multiplies then an add, each
//! rounded, never fused: bit for bit a [`dequantise`] to f32 followed by
//! [`super::accumulate_f32`] with `factor`, in one pass.
//!
//! # Chunk layout
//!
//! [`quantise_chunk`] / [`dequantise_accumulate_chunk`] use one byte buffer
//! per chunk: the scales first (`4 · blocks` bytes, native-endian f32), then
//! the payload, so a 4-aligned chunk has aligned scales and an aligned bf16
//! payload ([`Spec::chunk_bytes`]).
//!
//! # Speed
//!
//! AVX2 on x86_64 where [`super::isa`] chose it, bit-identical to the
//! portable path (`x86`); two passes over each block's source (its `amax`,
//! then its codes), the second from cache.

use std::fmt;
use std::str::FromStr;

use half::bf16;

use super::Level;
use crate::{Element, Error, Result};

mod feedback;
pub mod reference;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use feedback::{feedback_quantise, feedback_quantise_chunk, ErrorFeedback};

/// The largest fp8 e4m3fn magnitude (`S.1111.110`).
pub const FP8_E4M3_MAX: f32 = 448.0;

/// The largest int8 code a value quantises to (symmetric range).
pub const INT8_MAX: f32 = 127.0;

/// The int8 code that stands for a non-finite element.
pub const INT8_NONFINITE: i8 = -128;

/// Block sizes must be multiples of this (the vector step).
pub const BLOCK_MULTIPLE: usize = 16;

/// The largest block size.
pub const MAX_BLOCK: usize = 1 << 16;

/// A compressed chunk's element format. The code is the wire value a
/// descriptor carries: never renumber, only append.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum Format {
    /// bfloat16, no scales.
    Bf16 = 1,
    /// fp8 e4m3fn (torch's `float8_e4m3fn`) with one f32 scale per block.
    Fp8E4m3 = 2,
    /// Symmetric int8 with one f32 scale per block.
    Int8 = 3,
}

impl Format {
    /// Every format, in code order.
    pub const ALL: [Format; 3] = [Format::Bf16, Format::Fp8E4m3, Format::Int8];

    /// Lowercase name: `"bf16"`, `"fp8"` or `"int8"`.
    pub const fn name(self) -> &'static str {
        match self {
            Format::Bf16 => "bf16",
            Format::Fp8E4m3 => "fp8",
            Format::Int8 => "int8",
        }
    }

    /// The wire code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The format of a wire code.
    pub fn from_code(code: u8) -> Result<Format> {
        Format::ALL
            .into_iter()
            .find(|f| f.code() == code)
            .ok_or_else(|| Error::InvalidArgument {
                op: "Format::from_code",
                detail: format!(
                    "unknown compressed format code {code}: expected 1 (bf16), 2 (fp8) or 3 (int8)"
                ),
            })
    }

    /// Payload bytes per element.
    pub const fn code_bytes(self) -> usize {
        match self {
            Format::Bf16 => 2,
            Format::Fp8E4m3 | Format::Int8 => 1,
        }
    }

    /// Whether chunks carry block scales.
    pub const fn scaled(self) -> bool {
        !matches!(self, Format::Bf16)
    }

    /// The largest code magnitude a block's `amax` maps to (`None` for bf16).
    pub const fn qmax(self) -> Option<f32> {
        match self {
            Format::Bf16 => None,
            Format::Fp8E4m3 => Some(FP8_E4M3_MAX),
            Format::Int8 => Some(INT8_MAX),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = Error;

    /// `bf16` / `bfloat16`, `fp8` / `fp8_e4m3` / `e4m3` / `float8_e4m3fn`,
    /// `int8`; case-insensitive.
    fn from_str(s: &str) -> Result<Format> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(Format::Bf16),
            "fp8" | "fp8_e4m3" | "e4m3" | "fp8e4m3" | "float8_e4m3fn" => Ok(Format::Fp8E4m3),
            "int8" => Ok(Format::Int8),
            _ => Err(Error::InvalidArgument {
                op: "Format::from_str",
                detail: format!("unknown compressed format {s:?}: expected bf16, fp8 or int8"),
            }),
        }
    }
}

/// A format with its block size: everything that says how `n` values are
/// laid out in a compressed chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Spec {
    format: Format,
    block: usize,
}

impl Spec {
    /// `format` with blocks of `block` elements: a multiple of
    /// [`BLOCK_MULTIPLE`] up to [`MAX_BLOCK`] (checked for bf16 too, which
    /// ignores it), e.g. 32 or 128.
    pub fn new(format: Format, block: usize) -> Result<Spec> {
        if block == 0 || block % BLOCK_MULTIPLE != 0 || block > MAX_BLOCK {
            return Err(Error::InvalidArgument {
                op: "quant::Spec::new",
                detail: format!(
                    "block size {block} for {format}: must be a multiple of {BLOCK_MULTIPLE} \
                     from {BLOCK_MULTIPLE} to {MAX_BLOCK}"
                ),
            });
        }
        Ok(Spec { format, block })
    }

    /// The element format.
    pub fn format(self) -> Format {
        self.format
    }

    /// Elements per scale block.
    pub fn block(self) -> usize {
        self.block
    }

    /// Scales a chunk of `n` elements carries: `ceil(n / block)`, or 0 for
    /// bf16.
    pub fn scales(self, n: usize) -> usize {
        if self.format.scaled() {
            n.div_ceil(self.block)
        } else {
            0
        }
    }

    /// Payload bytes of `n` elements.
    pub fn payload_bytes(self, n: usize) -> usize {
        n * self.format.code_bytes()
    }

    /// Bytes of a whole chunk of `n` elements: scales, then payload.
    pub fn chunk_bytes(self, n: usize) -> usize {
        4 * self.scales(n) + self.payload_bytes(n)
    }

    /// Checks `payload` and `scales` for `n` elements, naming the operation.
    fn check(self, op: &'static str, n: usize, payload: usize, scales: usize) -> Result<()> {
        if payload != self.payload_bytes(n) {
            return Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "payload is {payload} bytes; {n} elements of {} need {}",
                    self.format,
                    self.payload_bytes(n)
                ),
            });
        }
        if scales != self.scales(n) {
            return Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "{scales} scales given; {n} elements of {} in blocks of {} need {}",
                    self.format,
                    self.block,
                    self.scales(n)
                ),
            });
        }
        Ok(())
    }
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.format.scaled() {
            write!(f, "{}/{}", self.format, self.block)
        } else {
            f.write_str(self.format.name())
        }
    }
}

// ---- scalar definitions -----------------------------------------------------

/// torch 2.11's `float8_e4m3fn` cast of one f32 (c10's
/// `fp8e4m3fn_from_fp32_value`): round to nearest even, subnormals kept;
/// magnitudes above 464 (which round past 448; 464 itself is a tie and
/// goes to 448), ±∞ and NaN give NaN with the input's sign. Not
/// saturating: [`quantise`] clamps before it.
pub fn fp8_e4m3_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7fff_ffff;
    let code = if abs >= FP8_NAN_FROM {
        0x7f
    } else if abs < FP8_NORMAL_MIN {
        // Below 2^-6: adding 2^14 rounds (f32, to nearest even) at the
        // subnormal step 2^-9, and the mantissa's low bits are the code.
        let sum = f32::from_bits(abs) + f32::from_bits(FP8_DENORM_MAGIC);
        (sum.to_bits() - FP8_DENORM_MAGIC) as u8
    } else {
        let odd = (abs >> 20) & 1;
        (abs.wrapping_add(FP8_REBIAS).wrapping_add(odd) >> 20) as u8
    };
    code | sign
}

/// The f32 value of an fp8 e4m3fn code: exact; NaN (quiet, with the code's
/// sign) for `0x7f` and `0xff`. Never forms a subnormal f32, so it holds
/// with denormals flushed.
pub fn fp8_e4m3_to_f32(code: u8) -> f32 {
    let sign = u32::from(code & 0x80) << 24;
    let abs = u32::from(code & 0x7f);
    let magnitude = if abs == 0x7f {
        f32::from_bits(0x7fc0_0000)
    } else if abs < 8 {
        // Subnormal: mantissa · 2^-9.
        abs as f32 * FP8_SUBNORMAL_STEP
    } else {
        f32::from_bits((abs << 20) + (120 << 23))
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

/// The f32 value of an int8 code; NaN for [`INT8_NONFINITE`].
pub fn int8_to_f32(code: i8) -> f32 {
    if code == INT8_NONFINITE {
        f32::NAN
    } else {
        f32::from(code)
    }
}

/// `|x|` bits from which torch's cast gives NaN outright: 480 (0x43f00000);
/// values above 464 round up to it.
const FP8_NAN_FROM: u32 = 1087 << 20;
/// 2^-6, the smallest normal e4m3 value, as f32 bits.
const FP8_NORMAL_MIN: u32 = 121 << 23;
/// 2^14 as f32 bits: the magic addend of the subnormal rounding.
const FP8_DENORM_MAGIC: u32 = 141 << 23;
/// Rebiases the exponent from f32 (127) to e4m3 (7) and adds the rounding
/// bias below bit 20.
const FP8_REBIAS: u32 = ((7u32.wrapping_sub(127)) << 23).wrapping_add(0x7_ffff);
/// 2^-9, the e4m3 subnormal step.
const FP8_SUBNORMAL_STEP: f32 = 1.0 / 512.0;

/// A block's scale and its reciprocal from its largest finite magnitude.
pub fn block_scale(amax: f32, qmax: f32) -> (f32, f32) {
    if amax == 0.0 {
        return (0.0, 0.0);
    }
    let scale = (amax / qmax).max(f32::MIN_POSITIVE);
    (scale, 1.0 / scale)
}

/// The largest finite `|x|` (0 if none).
fn amax_scalar(x: &[f32]) -> f32 {
    x.iter()
        .map(|v| v.abs())
        .filter(|a| a.is_finite())
        .fold(0.0, f32::max)
}

/// One element's code (as the low byte) given its block's reciprocal scale.
/// Scaled formats only: bf16 has no blocks and never comes here.
fn encode(format: Format, x: f32, inv: f32) -> u8 {
    match format {
        Format::Fp8E4m3 if x.is_finite() => {
            fp8_e4m3_from_f32((x * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
        }
        Format::Fp8E4m3 => 0x7f | ((x.to_bits() >> 24) & 0x80) as u8,
        Format::Int8 if x.is_finite() => {
            (x * inv).clamp(-INT8_MAX, INT8_MAX).round_ties_even() as i8 as u8
        }
        Format::Int8 | Format::Bf16 => INT8_NONFINITE as u8,
    }
}

/// One code's value (before its scale); scaled formats only, as [`encode`].
fn decode(format: Format, code: u8) -> f32 {
    match format {
        Format::Fp8E4m3 => fp8_e4m3_to_f32(code),
        Format::Int8 | Format::Bf16 => int8_to_f32(code as i8),
    }
}

// ---- checked, dispatched entry points ---------------------------------------

/// Quantises `src` into `payload` (`spec.payload_bytes(src.len())` bytes)
/// and `scales` (`spec.scales(src.len())` of them).
///
/// Errors: [`Error::InvalidArgument`] naming the buffer whose size is wrong;
/// [`Error::Misaligned`] for a bf16 payload on an odd address.
pub fn quantise(spec: Spec, src: &[f32], payload: &mut [u8], scales: &mut [f32]) -> Result<()> {
    quantise_on(Level::current(), spec, src, payload, scales)
}

/// `dst[i] = round(value(code[i]) · scale[i / block])`, to f32 or (rounded
/// to nearest even) bf16 / f16: a gathered shard read from a compressed
/// copy.
///
/// Errors like [`quantise`], `dst.len()` giving the element count.
pub fn dequantise<D: Element>(
    spec: Spec,
    payload: &[u8],
    scales: &[f32],
    dst: &mut [D],
) -> Result<()> {
    dequantise_on(Level::current(), spec, payload, scales, dst)
}

/// `acc[i] += factor · (value(code[i]) · scale[i / block])` in one pass:
/// what the owner's daemon runs on a landed compressed chunk.
///
/// Errors like [`quantise`], `acc.len()` giving the element count.
pub fn dequantise_accumulate(
    spec: Spec,
    payload: &[u8],
    scales: &[f32],
    acc: &mut [f32],
    factor: f32,
) -> Result<()> {
    dequantise_accumulate_on(Level::current(), spec, payload, scales, acc, factor)
}

/// [`quantise`] into one chunk buffer of `spec.chunk_bytes(src.len())`
/// bytes: scales, then payload (see the module doc).
///
/// Errors: [`Error::InvalidArgument`] for a chunk of the wrong size,
/// [`Error::Misaligned`] for one not 4-aligned where it carries scales.
pub fn quantise_chunk(spec: Spec, src: &[f32], chunk: &mut [u8]) -> Result<()> {
    let (scales, payload) = split_chunk_mut("quantise_chunk", spec, src.len(), chunk)?;
    quantise(spec, src, payload, scales)
}

/// [`dequantise_accumulate`] from one chunk buffer as [`quantise_chunk`]
/// wrote it, for `acc.len()` elements.
///
/// Errors like [`quantise_chunk`].
pub fn dequantise_accumulate_chunk(
    spec: Spec,
    chunk: &[u8],
    acc: &mut [f32],
    factor: f32,
) -> Result<()> {
    let (scales, payload) = split_chunk_op("dequantise_accumulate_chunk", spec, acc.len(), chunk)?;
    dequantise_accumulate(spec, payload, scales, acc, factor)
}

/// Dequantises the first elements of a chunk of `len` elements (laid out
/// as [`quantise_chunk`] writes it) into `dst`, bytes of `dtype`: as many
/// elements as `dst` holds, at most `len` (a gather's output may end inside
/// the chunk's last run).
///
/// Errors like [`quantise_chunk`]; [`Error::PartialElement`] or
/// [`Error::Misaligned`] for a bad `dst`, [`Error::InvalidArgument`] for
/// more than `len` elements.
pub fn dequantise_chunk_into(
    spec: Spec,
    len: usize,
    chunk: &[u8],
    dst: &mut [u8],
    dtype: crate::DType,
) -> Result<()> {
    const OP: &str = "dequantise_chunk_into";
    let take = dst.len() / dtype.size_bytes();
    if take > len {
        return Err(Error::InvalidArgument {
            op: OP,
            detail: format!("{take} elements out of a chunk of {len}"),
        });
    }
    let (scales, payload) = split_chunk_op(OP, spec, len, chunk)?;
    let (scales, payload) = (
        &scales[..spec.scales(take)],
        &payload[..spec.payload_bytes(take)],
    );
    match dtype {
        crate::DType::F32 => dequantise(spec, payload, scales, super::view_mut::<f32>(OP, dst)?),
        crate::DType::BF16 => dequantise(spec, payload, scales, super::view_mut::<bf16>(OP, dst)?),
        crate::DType::F16 => dequantise(
            spec,
            payload,
            scales,
            super::view_mut::<half::f16>(OP, dst)?,
        ),
    }
}

/// The scales and payload of a chunk of `n` elements.
///
/// Errors like [`quantise_chunk`].
pub fn split_chunk(spec: Spec, n: usize, chunk: &[u8]) -> Result<(&[f32], &[u8])> {
    split_chunk_op("split_chunk", spec, n, chunk)
}

pub(crate) fn split_chunk_op<'a>(
    op: &'static str,
    spec: Spec,
    n: usize,
    chunk: &'a [u8],
) -> Result<(&'a [f32], &'a [u8])> {
    check_chunk(op, spec, n, chunk)?;
    let (scales, payload) = chunk.split_at(4 * spec.scales(n));
    let scales = if scales.is_empty() {
        &[][..]
    } else {
        bytemuck::try_cast_slice(scales).map_err(|_| misaligned(op, "chunk", chunk.as_ptr()))?
    };
    Ok((scales, payload))
}

pub(crate) fn split_chunk_mut<'a>(
    op: &'static str,
    spec: Spec,
    n: usize,
    chunk: &'a mut [u8],
) -> Result<(&'a mut [f32], &'a mut [u8])> {
    check_chunk(op, spec, n, chunk)?;
    let ptr = chunk.as_ptr();
    let (scales, payload) = chunk.split_at_mut(4 * spec.scales(n));
    let scales = if scales.is_empty() {
        &mut [][..]
    } else {
        bytemuck::try_cast_slice_mut(scales).map_err(|_| misaligned(op, "chunk", ptr))?
    };
    Ok((scales, payload))
}

fn check_chunk(op: &'static str, spec: Spec, n: usize, chunk: &[u8]) -> Result<()> {
    if chunk.len() == spec.chunk_bytes(n) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        op,
        detail: format!(
            "chunk is {} bytes; {n} elements of {spec} need {}",
            chunk.len(),
            spec.chunk_bytes(n)
        ),
    })
}

fn misaligned(op: &'static str, what: &'static str, ptr: *const u8) -> Error {
    Error::Misaligned {
        op,
        what,
        addr: ptr as usize,
        align: 4,
        dtype: crate::DType::F32,
    }
}

fn bf16_view<'a>(op: &'static str, payload: &'a [u8]) -> Result<&'a [bf16]> {
    super::view::<bf16>(op, "payload", payload)
}

fn bf16_view_mut<'a>(op: &'static str, payload: &'a mut [u8]) -> Result<&'a mut [bf16]> {
    let ptr = payload.as_ptr();
    if payload.is_empty() {
        return Ok(&mut []);
    }
    bytemuck::try_cast_slice_mut(payload).map_err(|_| Error::Misaligned {
        op,
        what: "payload",
        addr: ptr as usize,
        align: 2,
        dtype: crate::DType::BF16,
    })
}

pub(crate) fn quantise_on(
    level: Level,
    spec: Spec,
    src: &[f32],
    payload: &mut [u8],
    scales: &mut [f32],
) -> Result<()> {
    const OP: &str = "quantise";
    spec.check(OP, src.len(), payload.len(), scales.len())?;
    let Some(qmax) = spec.format.qmax() else {
        level.cast(src, bf16_view_mut(OP, payload)?);
        return Ok(());
    };
    for ((x, codes), s) in src
        .chunks(spec.block)
        .zip(payload.chunks_mut(spec.block))
        .zip(scales.iter_mut())
    {
        match level.0 {
            #[cfg(target_arch = "x86_64")]
            super::Isa::Avx2 => {
                // SAFETY: a Level holding Avx2 exists only where the CPU has
                // AVX2 and F16C; `codes` is as long as `x` (checked above).
                *s = unsafe { x86::quantise_block(spec.format, x, codes, qmax) };
            }
            _ => {
                let (scale, inv) = block_scale(amax_scalar(x), qmax);
                *s = scale;
                for (c, &v) in codes.iter_mut().zip(x) {
                    *c = encode(spec.format, v, inv);
                }
            }
        }
    }
    Ok(())
}

pub(crate) fn dequantise_on<D: Element>(
    level: Level,
    spec: Spec,
    payload: &[u8],
    scales: &[f32],
    dst: &mut [D],
) -> Result<()> {
    const OP: &str = "dequantise";
    spec.check(OP, dst.len(), payload.len(), scales.len())?;
    if !spec.format.scaled() {
        level.cast(bf16_view(OP, payload)?, dst);
        return Ok(());
    }
    for ((codes, d), &scale) in payload
        .chunks(spec.block)
        .zip(dst.chunks_mut(spec.block))
        .zip(scales)
    {
        match level.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `quantise_on`.
            super::Isa::Avx2 => unsafe { x86::dequantise_block(spec.format, codes, scale, d) },
            _ => {
                for (o, &c) in d.iter_mut().zip(codes) {
                    *o = D::from_f32(decode(spec.format, c) * scale);
                }
            }
        }
    }
    Ok(())
}

pub(crate) fn dequantise_accumulate_on(
    level: Level,
    spec: Spec,
    payload: &[u8],
    scales: &[f32],
    acc: &mut [f32],
    factor: f32,
) -> Result<()> {
    const OP: &str = "dequantise_accumulate";
    spec.check(OP, acc.len(), payload.len(), scales.len())?;
    if !spec.format.scaled() {
        level.accumulate(acc, bf16_view(OP, payload)?, factor);
        return Ok(());
    }
    for ((codes, a), &scale) in payload
        .chunks(spec.block)
        .zip(acc.chunks_mut(spec.block))
        .zip(scales)
    {
        match level.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `quantise_on`.
            super::Isa::Avx2 => unsafe {
                x86::dequantise_accumulate_block(spec.format, codes, scale, a, factor)
            },
            _ => {
                for (o, &c) in a.iter_mut().zip(codes) {
                    *o += factor * (decode(spec.format, c) * scale);
                }
            }
        }
    }
    Ok(())
}
