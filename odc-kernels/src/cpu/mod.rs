//! CPU kernels: what the server daemon runs to add a landing slot into an
//! accumulator, the casts around it, and the transport's bulk copy
//! ([`copy_bytes`]).
//!
//! Every entry point takes slices (or byte buffers plus a [`DType`]),
//! checks them, and returns [`Error`] instead of panicking. The typed forms
//! (`accumulate`, `cast_typed`) suit Rust callers; the byte forms
//! (`accumulate_bytes`, `cast`) suit the daemon, which learns the dtype
//! from a landing-slot descriptor. Byte buffers must start on an element
//! boundary and hold whole elements.
//!
//! Math: all arithmetic is in f32. An accumulate computes
//! `acc + scale * x` as a multiply then an add (never fused), and rounds
//! once to the accumulator's type, to nearest, ties to even. So
//! `scale == 1.0` is exactly `acc + x`, and every fast path is
//! bit-identical to [`mod@reference`]. NaN and infinity propagate as IEEE 754
//! says; narrowing a NaN keeps it NaN.
//!
//! Speed: the instruction set is picked once per process ([`isa`]). On
//! x86_64 with AVX2 and F16C each kernel is one fused pass over its
//! operands (widen, compute, narrow in registers), so it runs at memory
//! speed for any chunk size and never allocates. Elsewhere a portable
//! loop runs. Kernels are single-threaded: the daemon shares cores with
//! compute and picks its own parallelism.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

use half::{bf16, f16};

use crate::{DType, Element, Error, Result};

pub mod exact;
pub mod quant;
pub mod reference;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// Instruction set the kernels run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Isa {
    /// Portable Rust, one element at a time (the compiler may vectorize).
    Scalar,
    /// x86_64 AVX2 with F16C conversions.
    Avx2,
}

impl Isa {
    /// Lowercase name: `"scalar"` or `"avx2"`.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
        }
    }

    fn code(self) -> u8 {
        match self {
            Isa::Scalar => 1,
            Isa::Avx2 => 2,
        }
    }

    fn from_code(code: u8) -> Option<Isa> {
        match code {
            1 => Some(Isa::Scalar),
            2 => Some(Isa::Avx2),
            _ => None,
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Name of the environment variable that caps [`isa`]: set it to
/// `scalar` to force the portable path (for comparisons and debugging).
/// It can only lower the level, never enable what the CPU lacks.
pub const ISA_ENV: &str = "ODC_KERNELS_ISA";

/// 0 until the first call to [`isa`], then the chosen level's code.
static ISA: AtomicU8 = AtomicU8::new(0);

/// The instruction set the kernels use in this process.
///
/// Detected on first call (and capped by [`ISA_ENV`]), then cached.
pub fn isa() -> Isa {
    if let Some(isa) = Isa::from_code(ISA.load(Ordering::Relaxed)) {
        return isa;
    }
    let detected = detect();
    let chosen = match std::env::var(ISA_ENV) {
        Ok(cap) if cap.eq_ignore_ascii_case("scalar") => Isa::Scalar,
        _ => detected,
    };
    // Racing first calls compute the same value; any of them may win.
    ISA.store(chosen.code(), Ordering::Relaxed);
    chosen
}

/// The best level this CPU supports, ignoring [`ISA_ENV`].
fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// An [`Isa`] this CPU is known to support. Only [`Level::current`] and
/// [`Level::all`] make one, so the kernels behind it are safe to call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Level(Isa);

impl Level {
    /// The level [`isa`] chose.
    pub(crate) fn current() -> Level {
        Level(isa())
    }

    /// Every level this CPU supports, for tests that compare them.
    #[cfg(test)]
    pub(crate) fn all() -> Vec<Level> {
        let mut levels = vec![Level(Isa::Scalar)];
        if detect() != Isa::Scalar {
            levels.push(Level(detect()));
        }
        levels
    }

    #[cfg(test)]
    pub(crate) fn isa(self) -> Isa {
        self.0
    }

    pub(crate) fn accumulate<A: Element, X: Element>(self, acc: &mut [A], x: &[X], scale: f32) {
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                if A::DTYPE == DType::BF16 && X::DTYPE == DType::BF16 {
                    // bf16 into bf16 has a kernel of its own (no shuffles).
                    let pair = (
                        bytemuck::try_cast_slice_mut::<A, bf16>(acc),
                        bytemuck::try_cast_slice::<X, bf16>(x),
                    );
                    if let (Ok(acc), Ok(x)) = pair {
                        // SAFETY: a Level holding Avx2 exists only where
                        // detect() found AVX2 and F16C.
                        unsafe { x86::accumulate_bf16(acc, x, scale) };
                        return;
                    }
                }
                // SAFETY: as above.
                unsafe { x86::accumulate(acc, x, scale) }
            }
            _ => {
                for (a, &v) in acc.iter_mut().zip(x) {
                    *a = A::from_f32(a.to_f32() + scale * v.to_f32());
                }
            }
        }
    }

    pub(crate) fn cast<S: Element, D: Element>(self, src: &[S], dst: &mut [D]) {
        if S::DTYPE == D::DTYPE {
            // Same type: a copy is exact (and keeps signaling NaNs).
            let n = src.len().min(dst.len());
            bytemuck::cast_slice_mut::<D, u8>(&mut dst[..n])
                .copy_from_slice(bytemuck::cast_slice::<S, u8>(&src[..n]));
            return;
        }
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `accumulate`.
            Isa::Avx2 => unsafe { x86::cast(src, dst) },
            _ => {
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = D::from_f32(s.to_f32());
                }
            }
        }
    }

    /// Copies `len` bytes, streaming past the cache from `stream_min`
    /// bytes on where this level can ([`STREAM_COPY_MIN`] outside tests).
    ///
    /// # Safety
    ///
    /// As [`copy_raw`].
    pub(crate) unsafe fn copy(self, dst: *mut u8, src: *const u8, len: usize, stream_min: usize) {
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the ranges are the caller's guarantee; CPU support as
            // in `accumulate`.
            Isa::Avx2 if len >= stream_min => unsafe { x86::copy_stream(dst, src, len) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 if len >= NEAR_ALIAS_MIN && near_alias(dst as usize, src as usize) => unsafe {
                x86::copy_cached(dst, src, len)
            },
            // SAFETY: the caller's guarantee.
            _ => unsafe { std::ptr::copy_nonoverlapping(src, dst, len) },
        }
    }

    pub(crate) fn scale_in_place(self, x: &mut [f32], s: f32) {
        match self.0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `accumulate`.
            Isa::Avx2 => unsafe { x86::scale_in_place(x, s) },
            _ => x.iter_mut().for_each(|v| *v *= s),
        }
    }
}

/// `acc[i] = round(acc[i] + scale * x[i])` for any pair of element types,
/// computed in f32 and rounded once to `A`.
///
/// Errors with [`Error::LengthMismatch`] unless `acc.len() == x.len()`.
pub fn accumulate<A: Element, X: Element>(acc: &mut [A], x: &[X], scale: f32) -> Result<()> {
    check_len("accumulate", acc.len(), x.len())?;
    Level::current().accumulate(acc, x, scale);
    Ok(())
}

/// `acc[i] += scale * x[i]` into an f32 accumulator, `x` in any dtype.
///
/// The daemon's main kernel. Errors like [`accumulate`].
pub fn accumulate_f32<X: Element>(acc: &mut [f32], x: &[X], scale: f32) -> Result<()> {
    accumulate(acc, x, scale)
}

/// `acc[i] = round(acc[i] + scale * x[i])` with `acc` and `x` of one type:
/// computed in f32, rounded to nearest even for bf16 and f16.
///
/// Errors like [`accumulate`].
pub fn accumulate_same<T: Element>(acc: &mut [T], x: &[T], scale: f32) -> Result<()> {
    accumulate(acc, x, scale)
}

/// [`accumulate_f32`] with `x` given as bytes of `x_dtype`, as a landing
/// slot holds it.
///
/// Errors: [`Error::PartialElement`] or [`Error::Misaligned`] for a bad
/// `x_bytes`, [`Error::LengthMismatch`] when element counts differ.
pub fn accumulate_into_f32(
    acc: &mut [f32],
    x_bytes: &[u8],
    x_dtype: DType,
    scale: f32,
) -> Result<()> {
    const OP: &str = "accumulate_into_f32";
    match x_dtype {
        DType::F32 => accumulate(acc, view::<f32>(OP, "source", x_bytes)?, scale),
        DType::BF16 => accumulate(acc, view::<bf16>(OP, "source", x_bytes)?, scale),
        DType::F16 => accumulate(acc, view::<f16>(OP, "source", x_bytes)?, scale),
    }
}

/// [`accumulate_same`] on byte buffers that both hold `dtype`.
///
/// Errors like [`accumulate_bytes`].
pub fn accumulate_same_bytes(
    acc_bytes: &mut [u8],
    x_bytes: &[u8],
    dtype: DType,
    scale: f32,
) -> Result<()> {
    accumulate_bytes(acc_bytes, dtype, x_bytes, dtype, scale)
}

/// [`accumulate`] on byte buffers: `acc_bytes` holds `acc_dtype`,
/// `x_bytes` holds `x_dtype`.
///
/// Errors: [`Error::PartialElement`] or [`Error::Misaligned`] for a bad
/// buffer, [`Error::LengthMismatch`] when element counts differ.
pub fn accumulate_bytes(
    acc_bytes: &mut [u8],
    acc_dtype: DType,
    x_bytes: &[u8],
    x_dtype: DType,
    scale: f32,
) -> Result<()> {
    const OP: &str = "accumulate_bytes";
    match acc_dtype {
        DType::F32 => {
            let acc = view_mut::<f32>(OP, acc_bytes)?;
            accumulate_x(OP, acc, x_bytes, x_dtype, scale)
        }
        DType::BF16 => {
            let acc = view_mut::<bf16>(OP, acc_bytes)?;
            accumulate_x(OP, acc, x_bytes, x_dtype, scale)
        }
        DType::F16 => {
            let acc = view_mut::<f16>(OP, acc_bytes)?;
            accumulate_x(OP, acc, x_bytes, x_dtype, scale)
        }
    }
}

fn accumulate_x<A: Element>(
    op: &'static str,
    acc: &mut [A],
    x_bytes: &[u8],
    x_dtype: DType,
    scale: f32,
) -> Result<()> {
    match x_dtype {
        DType::F32 => accumulate(acc, view::<f32>(op, "source", x_bytes)?, scale),
        DType::BF16 => accumulate(acc, view::<bf16>(op, "source", x_bytes)?, scale),
        DType::F16 => accumulate(acc, view::<f16>(op, "source", x_bytes)?, scale),
    }
}

/// `dst[i] = round(src[i])`, typed. Widening is exact; narrowing rounds to
/// nearest, ties to even, and keeps NaN as NaN; same-type casts copy bits.
///
/// Errors with [`Error::LengthMismatch`] unless the lengths are equal.
pub fn cast_typed<S: Element, D: Element>(src: &[S], dst: &mut [D]) -> Result<()> {
    check_len("cast", dst.len(), src.len())?;
    Level::current().cast(src, dst);
    Ok(())
}

/// [`cast_typed`] on byte buffers: `src_bytes` holds `src_dtype`,
/// `dst_bytes` receives `dst_dtype`, element for element.
///
/// Errors: [`Error::PartialElement`] or [`Error::Misaligned`] for a bad
/// buffer, [`Error::LengthMismatch`] when element counts differ.
pub fn cast(
    src_bytes: &[u8],
    src_dtype: DType,
    dst_bytes: &mut [u8],
    dst_dtype: DType,
) -> Result<()> {
    match src_dtype {
        DType::F32 => cast_to(
            view::<f32>("cast", "source", src_bytes)?,
            dst_bytes,
            dst_dtype,
        ),
        DType::BF16 => cast_to(
            view::<bf16>("cast", "source", src_bytes)?,
            dst_bytes,
            dst_dtype,
        ),
        DType::F16 => cast_to(
            view::<f16>("cast", "source", src_bytes)?,
            dst_bytes,
            dst_dtype,
        ),
    }
}

fn cast_to<S: Element>(src: &[S], dst_bytes: &mut [u8], dst_dtype: DType) -> Result<()> {
    match dst_dtype {
        DType::F32 => cast_typed(src, view_mut::<f32>("cast", dst_bytes)?),
        DType::BF16 => cast_typed(src, view_mut::<bf16>("cast", dst_bytes)?),
        DType::F16 => cast_typed(src, view_mut::<f16>("cast", dst_bytes)?),
    }
}

/// Whether `dst` lies 1 to 63 bytes past `src` modulo 4 KiB. There glibc's
/// `memcpy` (its `rep movsb` path, taken from a few KiB to about 1 MiB on
/// x86-64 with ERMS) ran 15–20× slower on the development machine's AMD
/// EPYC: 2.1 against 40 GB/s for 128 KiB, from 8 KiB on, for every distance
/// from 1 to 31 bytes (the CPU treats the string copy as overlapping its own
/// stores). A `Vec` of 128 KiB or more starts 16 bytes into a page, so a
/// gather into one from a page-aligned shard fell in it every time.
/// [`Level::copy`] takes its own AVX2 loop there, as fast as `memcpy`
/// elsewhere.
fn near_alias(dst: usize, src: usize) -> bool {
    let distance = dst.wrapping_sub(src) % 4096;
    (1..64).contains(&distance)
}

/// Shorter copies than this stay `memcpy`s even when [`near_alias`]: glibc
/// copies them with vector loops, never `rep movsb`.
const NEAR_ALIAS_MIN: usize = 256;

/// Copies of at least this many bytes stream past the cache (see
/// [`copy_bytes`]); shorter ones are plain copies.
///
/// Half the 32 MiB L3 of the machine it was measured on, where two ranks
/// gathering at once share that cache. There, 16 MiB copies were 1.4×
/// faster streaming (a 32 MiB gather, 2 ranks) and still cost a reader
/// that touches the copy right after only about 10 %; 8 MiB copies were
/// faster cached (a 16 MiB gather in place: 18–21 against 14 GB/s).
pub const STREAM_COPY_MIN: usize = 16 << 20;

/// `dst.copy_from_slice(src)` for bulk data: a gathered shard, a chunk
/// read from a peer's mapping.
///
/// From [`STREAM_COPY_MIN`] bytes on, with AVX2, it writes `dst` with
/// non-temporal stores: the destination is not read first and the copy
/// does not evict the cache, which on memory-bound hosts makes a large
/// copy up to twice as fast as `memcpy` (glibc's own switch to streaming
/// stores, `glibc.cpu.x86_non_temporal_threshold`, was at 240 MiB on the
/// development VM). The copied bytes are then in memory, not in cache.
/// Shorter copies are plain `memcpy`s, except with AVX2 where the
/// destination lies just past the source modulo 4 KiB, which `memcpy`
/// copies 15–20× slower on some CPUs (`near_alias`): those take an AVX2
/// loop through the cache. Every copy under [`ISA_ENV`]` = scalar` is a
/// `memcpy`. Either way every byte is
/// visible to other threads, in order with the caller's later stores,
/// when it returns.
///
/// Errors with [`Error::LengthMismatch`] unless the lengths are equal.
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) -> Result<()> {
    check_len("copy_bytes", dst.len(), src.len())?;
    // SAFETY: two slices of equal length; a `&mut` never aliases a `&`.
    unsafe { Level::current().copy(dst.as_mut_ptr(), src.as_ptr(), src.len(), STREAM_COPY_MIN) };
    Ok(())
}

/// [`copy_bytes`] on raw pointers, for memory no Rust reference may point
/// into (a shared mapping that peers write concurrently).
///
/// # Safety
///
/// `src` must be valid for reading and `dst` for writing `len` bytes for
/// the whole call, and the two ranges must not overlap (as for
/// [`std::ptr::copy_nonoverlapping`]). Nothing else may write either range
/// during the call.
pub unsafe fn copy_raw(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { Level::current().copy(dst, src, len, STREAM_COPY_MIN) }
}

/// [`copy_raw`] that never streams: for bytes read again right after (a
/// landing-slot chunk the owner's daemon adds at once, a published shard).
/// A `memcpy` but where the destination lies just past the source modulo
/// 4 KiB (`near_alias`).
///
/// # Safety
///
/// As [`copy_raw`].
pub unsafe fn copy_raw_cached(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { Level::current().copy(dst, src, len, usize::MAX) }
}

/// `x[i] *= s`: scales an accumulator, e.g. to average over clients.
pub fn scale_in_place(x: &mut [f32], s: f32) {
    Level::current().scale_in_place(x, s);
}

/// Sets every element to +0 (all-zero bits in every dtype): clears an
/// accumulator after the optimizer step.
pub fn fill_zero<T: Element>(buf: &mut [T]) {
    bytemuck::cast_slice_mut::<T, u8>(buf).fill(0);
}

pub(crate) fn check_len(op: &'static str, dst: usize, src: usize) -> Result<()> {
    if dst == src {
        Ok(())
    } else {
        Err(Error::LengthMismatch { op, dst, src })
    }
}

/// Checks that `bytes` holds whole, aligned `T`s and says which rule it
/// breaks if not.
fn check_view<T: Element>(op: &'static str, what: &'static str, bytes: &[u8]) -> Result<()> {
    let dtype = T::DTYPE;
    let size = dtype.size_bytes();
    if bytes.len() % size != 0 {
        return Err(Error::PartialElement {
            op,
            what,
            len: bytes.len(),
            dtype,
        });
    }
    let addr = bytes.as_ptr() as usize;
    if !bytes.is_empty() && addr % size != 0 {
        return Err(Error::Misaligned {
            op,
            what,
            addr,
            align: size,
            dtype,
        });
    }
    Ok(())
}

fn view<'a, T: Element>(op: &'static str, what: &'static str, bytes: &'a [u8]) -> Result<&'a [T]> {
    check_view::<T>(op, what, bytes)?;
    if bytes.is_empty() {
        return Ok(&[]);
    }
    // After check_view this cannot fail; map it anyway rather than panic.
    bytemuck::try_cast_slice(bytes).map_err(|_| misaligned::<T>(op, what, bytes.as_ptr()))
}

pub(crate) fn view_mut<'a, T: Element>(
    op: &'static str,
    bytes: &'a mut [u8],
) -> Result<&'a mut [T]> {
    const WHAT: &str = "destination";
    check_view::<T>(op, WHAT, bytes)?;
    if bytes.is_empty() {
        return Ok(&mut []);
    }
    let ptr = bytes.as_ptr();
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| misaligned::<T>(op, WHAT, ptr))
}

fn misaligned<T: Element>(op: &'static str, what: &'static str, ptr: *const u8) -> Error {
    Error::Misaligned {
        op,
        what,
        addr: ptr as usize,
        align: T::DTYPE.size_bytes(),
        dtype: T::DTYPE,
    }
}
