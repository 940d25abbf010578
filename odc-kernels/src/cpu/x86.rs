//! AVX2 + F16C kernels for x86_64.
//!
//! Owns every x86 intrinsic in the crate. Each kernel is one fused pass:
//! load 16 elements of each operand, widen to f32 in registers, compute,
//! narrow, store — so every byte of input is read once and nothing is
//! staged through memory, whatever the chunk size. Tails shorter than 16
//! elements go through a 16-element stack buffer and the same vector code,
//! so a tail rounds exactly like the body.
//!
//! Arithmetic is a separate multiply and add (no FMA): results are
//! bit-identical to the scalar reference, and `scale == 1.0` is a plain add.
//!
//! Nothing here checks the CPU: callers in [`super`] pass only the level
//! that [`super::isa`] detected.

use std::arch::x86_64::{
    __m128i, __m256, __m256d, __m256i, _mm256_add_epi32, _mm256_add_epi64, _mm256_add_ps,
    _mm256_and_si256, _mm256_andnot_si256, _mm256_blendv_epi8, _mm256_castpd_si256,
    _mm256_castps256_ps128, _mm256_castps_si256, _mm256_castsi256_ps, _mm256_cmp_ps,
    _mm256_cmpeq_epi64, _mm256_cmpgt_epi64, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
    _mm256_cvtps_pd, _mm256_cvtps_ph, _mm256_extractf128_ps, _mm256_loadu_ps, _mm256_loadu_si256,
    _mm256_movemask_ps, _mm256_mul_pd, _mm256_mul_ps, _mm256_or_si256, _mm256_packus_epi32,
    _mm256_permute4x64_epi64, _mm256_set1_epi32, _mm256_set1_epi64x, _mm256_set1_pd,
    _mm256_set1_ps, _mm256_setzero_si256, _mm256_slli_epi32, _mm256_sllv_epi64, _mm256_srli_epi32,
    _mm256_srli_epi64, _mm256_srlv_epi64, _mm256_store_si256, _mm256_storeu_ps,
    _mm256_storeu_si256, _mm256_stream_si256, _mm256_sub_epi64, _mm256_testz_si256,
    _mm256_unpackhi_epi64, _mm256_unpacklo_epi64, _mm256_xor_si256, _mm_loadu_si128, _mm_prefetch,
    _mm_sfence, _mm_shuffle_ps, _mm_storeu_si128, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT,
    _MM_HINT_NTA,
};

use half::{bf16, f16};

/// Elements per vector step: two 256-bit registers of f32.
const STEP: usize = 16;

/// Elements per loop iteration: two steps, to keep two loads in flight per
/// stream without spilling registers.
const UNROLL: usize = 2 * STEP;

/// SIMD loads and stores of 16 elements widened to / narrowed from f32.
///
/// Implemented for the three [`crate::Element`] types only.
pub trait Lanes: bytemuck::Pod {
    /// Loads `STEP` elements at `p` as two vectors of f32.
    ///
    /// # Safety
    ///
    /// `p` must be valid for reading 16 elements (no alignment needed), and
    /// the CPU must support AVX2 and F16C.
    unsafe fn load16(p: *const Self) -> [__m256; 2];

    /// Stores two vectors of f32 as `STEP` elements at `p`, rounding to
    /// nearest, ties to even.
    ///
    /// # Safety
    ///
    /// `p` must be valid for writing 16 elements (no alignment needed), and
    /// the CPU must support AVX2 and F16C.
    unsafe fn store16(p: *mut Self, v: [__m256; 2]);
}

impl Lanes for f32 {
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load16(p: *const f32) -> [__m256; 2] {
        // SAFETY: the caller guarantees 16 readable f32 at `p`.
        unsafe { [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))] }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store16(p: *mut f32, v: [__m256; 2]) {
        // SAFETY: the caller guarantees 16 writable f32 at `p`.
        unsafe {
            _mm256_storeu_ps(p, v[0]);
            _mm256_storeu_ps(p.add(8), v[1]);
        }
    }
}

impl Lanes for bf16 {
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load16(p: *const bf16) -> [__m256; 2] {
        // SAFETY: the caller guarantees 16 readable bf16 (32 bytes) at `p`;
        // each 128-bit load reads 8 of them.
        let (lo, hi) = unsafe { (_mm_loadu_si128(p.cast()), _mm_loadu_si128(p.add(8).cast())) };
        // SAFETY: CPU support is the caller's guarantee.
        unsafe { [widen_bf16(lo), widen_bf16(hi)] }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store16(p: *mut bf16, v: [__m256; 2]) {
        // SAFETY: CPU support is the caller's guarantee.
        let (lo, hi) = unsafe {
            if any_nan(v[0], v[1]) {
                (narrow_bf16_nan(v[0]), narrow_bf16_nan(v[1]))
            } else {
                let shift = |v| _mm256_srli_epi32::<16>(round_bf16(v));
                (shift(v[0]), shift(v[1]))
            }
        };
        // packus works per 128-bit lane: [lo0..3, hi0..3, lo4..7, hi4..7];
        // the permute puts the four 64-bit groups back in order.
        let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi));
        // SAFETY: the caller guarantees 16 writable bf16 (32 bytes) at `p`.
        unsafe { _mm256_storeu_si256(p.cast::<__m256i>(), packed) }
    }
}

impl Lanes for f16 {
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load16(p: *const f16) -> [__m256; 2] {
        // SAFETY: the caller guarantees 16 readable f16 (32 bytes) at `p`;
        // each 128-bit load reads 8 of them.
        unsafe {
            [
                _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())),
            ]
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn store16(p: *mut f16, v: [__m256; 2]) {
        let lo = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v[0]);
        let hi = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v[1]);
        // SAFETY: the caller guarantees 16 writable f16 (32 bytes) at `p`;
        // each 128-bit store writes 8 of them.
        unsafe {
            _mm_storeu_si128(p.cast(), lo);
            _mm_storeu_si128(p.add(8).cast(), hi);
        }
    }
}

/// Eight bf16 (in the low half of a 128-bit register) to eight f32.
///
/// # Safety
///
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_bf16(bits: __m128i) -> __m256 {
    // A bf16 is the top half of an f32: zero-extend and shift left 16.
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)))
}

/// Whether any lane of `a` or `b` is NaN: one compare for 16 lanes, so
/// the common all-finite case skips NaN handling.
///
/// # Safety
///
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn any_nan(a: __m256, b: __m256) -> bool {
    _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(a, b)) != 0
}

/// Eight f32 (none NaN) rounded to nearest, ties to even, at bit 16: the
/// bf16 result is the top half of each lane. Overflow carries into the
/// exponent and gives infinity, as it should.
///
/// # Safety
///
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn round_bf16(v: __m256) -> __m256i {
    let bits = _mm256_castps_si256(v);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
    _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb))
}

/// Eight f32 that may include NaNs to eight bf16 bit patterns (in the low
/// 16 bits of each lane). A NaN keeps its sign and top payload bits and
/// becomes quiet, so it can neither round into an infinity nor carry into
/// the sign.
///
/// # Safety
///
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn narrow_bf16_nan(v: __m256) -> __m256i {
    let bits = _mm256_castps_si256(v);
    // SAFETY: CPU support is the caller's guarantee.
    let rounded = unsafe { round_bf16(v) };
    let quiet_nan = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040_0000));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    _mm256_srli_epi32::<16>(_mm256_blendv_epi8(rounded, quiet_nan, is_nan))
}

/// Runs `step` over `n` elements in blocks of [`STEP`], the last partial
/// block through stack copies of the operands.
macro_rules! for_each_step {
    ($n:expr, |$i:ident| $body:expr) => {{
        let n: usize = $n;
        let mut $i = 0usize;
        while $i + UNROLL <= n {
            $body;
            $i += STEP;
            $body;
            $i += STEP;
        }
        if $i + STEP <= n {
            $body;
            $i += STEP;
        }
        $i
    }};
}

/// `acc[i] = round(acc[i] + scale * x[i])`, computed in f32, for
/// `i < min(acc.len(), x.len())`.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn accumulate<A: Lanes, X: Lanes>(acc: &mut [A], x: &[X], scale: f32) {
    let n = acc.len().min(x.len());
    let s = _mm256_set1_ps(scale);
    let a = acc.as_mut_ptr();
    let xp = x.as_ptr();
    // SAFETY: the loop visits only whole blocks with i + STEP <= n, so both
    // pointers have 16 valid elements at offset i; the CPU check is ours.
    let done = for_each_step!(n, |i| unsafe { accumulate_step(a.add(i), xp.add(i), s) });
    if done < n {
        let mut abuf = [A::zeroed(); STEP];
        let mut xbuf = [X::zeroed(); STEP];
        abuf[..n - done].copy_from_slice(&acc[done..n]);
        xbuf[..n - done].copy_from_slice(&x[done..n]);
        // SAFETY: both buffers hold STEP elements; CPU support is ours.
        unsafe { accumulate_step(abuf.as_mut_ptr(), xbuf.as_ptr(), s) };
        acc[done..n].copy_from_slice(&abuf[..n - done]);
    }
}

/// One block of [`accumulate`].
///
/// # Safety
///
/// `a` must be valid for reading and writing, and `x` for reading, 16
/// elements; the CPU must support AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn accumulate_step<A: Lanes, X: Lanes>(a: *mut A, x: *const X, s: __m256) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let [a0, a1] = A::load16(a);
        let [x0, x1] = X::load16(x);
        let sum = [
            _mm256_add_ps(a0, _mm256_mul_ps(s, x0)),
            _mm256_add_ps(a1, _mm256_mul_ps(s, x1)),
        ];
        A::store16(a, sum);
    }
}

/// `dst[i] = round(src[i])` for `i < min(src.len(), dst.len())`.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn cast<S: Lanes, D: Lanes>(src: &[S], dst: &mut [D]) {
    let n = src.len().min(dst.len());
    let sp = src.as_ptr();
    let dp = dst.as_mut_ptr();
    // SAFETY: whole blocks only (i + STEP <= n); CPU support is ours.
    let done = for_each_step!(n, |i| unsafe {
        D::store16(dp.add(i), S::load16(sp.add(i)))
    });
    if done < n {
        let mut sbuf = [S::zeroed(); STEP];
        let mut dbuf = [D::zeroed(); STEP];
        sbuf[..n - done].copy_from_slice(&src[done..n]);
        // SAFETY: both buffers hold STEP elements; CPU support is ours.
        unsafe { D::store16(dbuf.as_mut_ptr(), S::load16(sbuf.as_ptr())) };
        dst[done..n].copy_from_slice(&dbuf[..n - done]);
    }
}

/// `x[i] *= s`.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn scale_in_place(x: &mut [f32], s: f32) {
    let n = x.len();
    let sv = _mm256_set1_ps(s);
    let p = x.as_mut_ptr();
    // SAFETY: whole blocks only (i + STEP <= n); CPU support is ours.
    let done = for_each_step!(n, |i| unsafe {
        let [v0, v1] = f32::load16(p.add(i));
        f32::store16(p.add(i), [_mm256_mul_ps(v0, sv), _mm256_mul_ps(v1, sv)]);
    });
    for v in &mut x[done..] {
        *v *= s;
    }
}

/// [`accumulate`] for a bf16 accumulator and bf16 input, without shuffles:
/// a 32-bit lane holds two bf16, and masking or shifting it gives the odd
/// and the even element as f32 directly. Both operands and the result use
/// the same split, so element order never has to be restored.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn accumulate_bf16(acc: &mut [bf16], x: &[bf16], scale: f32) {
    let n = acc.len().min(x.len());
    let s = _mm256_set1_ps(scale);
    let a = acc.as_mut_ptr();
    let xp = x.as_ptr();
    // SAFETY: whole blocks only (i + STEP <= n); CPU support is ours.
    let done = for_each_step!(n, |i| unsafe {
        accumulate_bf16_step(a.add(i), xp.add(i), s)
    });
    if done < n {
        let mut abuf = [bf16::ZERO; STEP];
        let mut xbuf = [bf16::ZERO; STEP];
        abuf[..n - done].copy_from_slice(&acc[done..n]);
        xbuf[..n - done].copy_from_slice(&x[done..n]);
        // SAFETY: both buffers hold STEP elements; CPU support is ours.
        unsafe { accumulate_bf16_step(abuf.as_mut_ptr(), xbuf.as_ptr(), s) };
        acc[done..n].copy_from_slice(&abuf[..n - done]);
    }
}

/// One block of [`accumulate_bf16`].
///
/// # Safety
///
/// `a` must be valid for reading and writing, and `x` for reading, 16
/// elements; the CPU must support AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn accumulate_bf16_step(a: *mut bf16, x: *const bf16, s: __m256) {
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    // SAFETY: the caller guarantees 16 elements (32 bytes) at each pointer.
    let (av, xv) = unsafe {
        (
            _mm256_loadu_si256(a.cast::<__m256i>()),
            _mm256_loadu_si256(x.cast::<__m256i>()),
        )
    };
    let even = |v| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
    let odd = |v| _mm256_castsi256_ps(_mm256_and_si256(v, high));
    let sum_even = _mm256_add_ps(even(av), _mm256_mul_ps(s, even(xv)));
    let sum_odd = _mm256_add_ps(odd(av), _mm256_mul_ps(s, odd(xv)));
    // SAFETY: CPU support is the caller's guarantee.
    let out = unsafe {
        if any_nan(sum_even, sum_odd) {
            let e = narrow_bf16_nan(sum_even);
            let o = narrow_bf16_nan(sum_odd);
            _mm256_or_si256(e, _mm256_slli_epi32::<16>(o))
        } else {
            let e = _mm256_srli_epi32::<16>(round_bf16(sum_even));
            let o = _mm256_and_si256(round_bf16(sum_odd), high);
            _mm256_or_si256(e, o)
        }
    };
    // SAFETY: the caller guarantees 16 writable elements at `a`.
    unsafe { _mm256_storeu_si256(a.cast::<__m256i>(), out) }
}

/// Bytes per iteration of [`copy_stream`] and [`copy_cached`]: four
/// 256-bit registers, two cache lines.
const COPY_BLOCK: usize = 128;

/// How far ahead of its loads [`copy_stream`] prefetches the source. The
/// hardware prefetcher alone left 64 MiB copies 5–10 % slower.
const COPY_PREFETCH: usize = 2048;

/// Copies `len` bytes from `src` to `dst` with non-temporal (streaming)
/// stores: the destination goes to memory without being read first (no
/// read-for-ownership) and without evicting the cache. Ends with an
/// `sfence`, so every byte is globally visible, in program order with the
/// caller's later stores (a release store of a signal included), before
/// this returns.
///
/// The head up to the first 32-byte boundary of `dst` and the tail after
/// the last are plain copies; loads are unaligned. The source is
/// prefetched [`COPY_PREFETCH`] bytes ahead (non-temporal: it is read once).
///
/// # Safety
///
/// `src` must be valid for reading and `dst` for writing `len` bytes, the
/// two ranges must not overlap, and the CPU must support AVX2.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn copy_stream(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { copy_blocks::<true>(dst, src, len) }
}

/// Copies `len` bytes from `src` to `dst` through the cache: unaligned
/// 256-bit loads, aligned stores after a plain head up to the first 32-byte
/// boundary of `dst`, a plain tail. What [`super::Level::copy`] takes where
/// `memcpy` would be slow: a destination 1 to 63 bytes past the source
/// modulo 4 KiB ([`super::near_alias`]).
///
/// # Safety
///
/// `src` must be valid for reading and `dst` for writing `len` bytes, the
/// two ranges must not overlap, and the CPU must support AVX2.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn copy_cached(dst: *mut u8, src: *const u8, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { copy_blocks::<false>(dst, src, len) }
}

/// The body of [`copy_stream`] (`STREAM`: non-temporal stores, the source
/// prefetched, an `sfence` at the end) and [`copy_cached`] (aligned stores
/// through the cache).
///
/// # Safety
///
/// As [`copy_stream`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn copy_blocks<const STREAM: bool>(dst: *mut u8, src: *const u8, len: usize) {
    let head = dst.align_offset(32).min(len);
    // SAFETY: `head <= len`; the caller guarantees both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut i = head;
    // A macro, not a closure: the stores stay in this function's AVX2 code.
    macro_rules! store {
        ($d:expr, $v:expr) => {
            if STREAM {
                _mm256_stream_si256($d, $v)
            } else {
                _mm256_store_si256($d, $v)
            }
        };
    }
    // SAFETY: every access below is inside `[0, len)` (loop bounds), and
    // `dst + i` is 32-byte aligned from `head` on, as both stores need.
    unsafe {
        while i + COPY_BLOCK <= len {
            if STREAM {
                // A prefetch never faults, so it may point past the end;
                // the address is only computed (wrapping), never
                // dereferenced.
                let ahead = src.wrapping_add(i + COPY_PREFETCH).cast::<i8>();
                _mm_prefetch::<_MM_HINT_NTA>(ahead);
                _mm_prefetch::<_MM_HINT_NTA>(ahead.wrapping_add(64));
            }
            let s = src.add(i).cast::<__m256i>();
            let d = dst.add(i).cast::<__m256i>();
            let v0 = _mm256_loadu_si256(s);
            let v1 = _mm256_loadu_si256(s.add(1));
            let v2 = _mm256_loadu_si256(s.add(2));
            let v3 = _mm256_loadu_si256(s.add(3));
            store!(d, v0);
            store!(d.add(1), v1);
            store!(d.add(2), v2);
            store!(d.add(3), v3);
            i += COPY_BLOCK;
        }
        while i + 32 <= len {
            store!(
                dst.add(i).cast::<__m256i>(),
                _mm256_loadu_si256(src.add(i).cast::<__m256i>())
            );
            i += 32;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
    if STREAM {
        // Streaming stores are weakly ordered: without this fence a later
        // store (the signal a reader waits on) could become visible first.
        _mm_sfence();
    }
}

/// Exact accumulation (deterministic mode, [`super::exact`]): adds
/// `round(scale · x[i] · 2^72)` into `fixed[i]` for the first
/// `x.len() / 16 * 16` elements, in 64-bit integer lanes. The product is
/// exact in f64 and its mantissa is shifted into place, rounding to
/// nearest, ties to even, exactly as the scalar path does. Infinities, NaNs
/// and contributions of 2^39 or more add nothing here; the second return
/// value says whether there were any, for the caller's scalar pass.
///
/// Returns the number of elements added.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C; `fixed.len() >= x.len()`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn accumulate_exact<X: Lanes>(fixed: &mut [i128], x: &[X], scale: f32) -> (usize, bool) {
    let n = x.len() / STEP * STEP;
    let scale = _mm256_set1_pd(f64::from(scale));
    let mut special = _mm256_setzero_si256();
    let (xp, fp) = (x.as_ptr(), fixed.as_mut_ptr());
    for i in (0..n).step_by(STEP) {
        // SAFETY: `i + 16 <= n <= x.len()`.
        let v = unsafe { X::load16(xp.add(i)) };
        let quarters = [
            _mm256_castps256_ps128(v[0]),
            _mm256_extractf128_ps::<1>(v[0]),
            _mm256_castps256_ps128(v[1]),
            _mm256_extractf128_ps::<1>(v[1]),
        ];
        for (q, &four) in quarters.iter().enumerate() {
            // Lanes in the order [0, 2, 1, 3]: the order in which two
            // 256-bit loads of four i128s unpack into low and high words.
            let four = _mm_shuffle_ps::<0b11_01_10_00>(four, four);
            let product = _mm256_mul_pd(_mm256_cvtps_pd(four), scale);
            let (lo, hi, odd) = units4(product);
            special = _mm256_or_si256(special, odd);
            // SAFETY: elements `i + 4q .. i + 4q + 4 <= n <= fixed.len()`,
            // as 4 · 16 bytes.
            unsafe { add4(fp.add(i + 4 * q).cast::<__m256i>(), lo, hi) };
        }
    }
    (n, _mm256_testz_si256(special, special) == 0)
}

/// Four f64 products (exact, so every one is `±mant · 2^(exp - 1075)` with
/// `mant < 2^53`) in units of 2^-72, rounded to nearest, ties to even, as
/// two's-complement (low, high) 64-bit words; lanes that are infinite, NaN
/// or 2^39 or more give 0 and are flagged in the third vector.
#[inline]
#[target_feature(enable = "avx2")]
fn units4(product: __m256d) -> (__m256i, __m256i, __m256i) {
    let zero = _mm256_setzero_si256();
    let one = _mm256_set1_epi64x(1);
    let ones = _mm256_set1_epi64x(-1);
    let bits = _mm256_castpd_si256(product);
    let exp = _mm256_and_si256(_mm256_srli_epi64::<52>(bits), _mm256_set1_epi64x(0x7ff));
    // 2^39 is exponent 1023 + 39; infinities and NaNs (2047) are above too.
    let odd = _mm256_cmpgt_epi64(exp, _mm256_set1_epi64x(1023 + 38));
    let nothing = _mm256_or_si256(odd, _mm256_cmpeq_epi64(exp, zero));
    let mant = _mm256_or_si256(
        _mm256_and_si256(bits, _mm256_set1_epi64x((1 << 52) - 1)),
        _mm256_set1_epi64x(1 << 52),
    );
    let mant = _mm256_andnot_si256(nothing, mant);
    // units = mant · 2^shift; shift <= 58, so a left shift fits 111 bits.
    let shift = _mm256_sub_epi64(exp, _mm256_set1_epi64x(1075 - 72));
    let lo_left = _mm256_sllv_epi64(mant, shift);
    // Counts of 64 or more (and negative ones, as unsigned) shift in zeros.
    let hi_left = _mm256_srlv_epi64(mant, _mm256_sub_epi64(_mm256_set1_epi64x(64), shift));
    // A right shift by s rounds; s is capped at 60, where every mant < 2^53
    // rounds to 0 as it must.
    let s = _mm256_sub_epi64(zero, shift);
    let cap = _mm256_set1_epi64x(60);
    let s = _mm256_blendv_epi8(s, cap, _mm256_cmpgt_epi64(s, cap));
    let pow = _mm256_sllv_epi64(one, s);
    let whole = _mm256_srlv_epi64(mant, s);
    let rest = _mm256_and_si256(mant, _mm256_sub_epi64(pow, one));
    let half = _mm256_srli_epi64::<1>(pow);
    let tie_to_odd = _mm256_and_si256(
        _mm256_cmpeq_epi64(rest, half),
        _mm256_cmpeq_epi64(_mm256_and_si256(whole, one), one),
    );
    let up = _mm256_or_si256(_mm256_cmpgt_epi64(rest, half), tie_to_odd);
    let lo_right = _mm256_sub_epi64(whole, up); // up is -1 where it rounds up
    let right = _mm256_cmpgt_epi64(zero, shift);
    let lo = _mm256_blendv_epi8(lo_left, lo_right, right);
    let hi = _mm256_andnot_si256(right, hi_left);
    // Negative products: the two's complement of (lo, hi).
    let negative = _mm256_cmpgt_epi64(zero, bits);
    let neg_lo = _mm256_sub_epi64(zero, lo);
    let borrow = _mm256_xor_si256(_mm256_cmpeq_epi64(lo, zero), ones); // -1 where lo != 0
    let neg_hi = _mm256_add_epi64(_mm256_sub_epi64(zero, hi), borrow);
    (
        _mm256_blendv_epi8(lo, neg_lo, negative),
        _mm256_blendv_epi8(hi, neg_hi, negative),
        odd,
    )
}

/// Adds four 128-bit values, given as low and high words in lane order
/// [0, 2, 1, 3], to the four i128s at `p` (wrapping, as the scalar path).
///
/// # Safety
///
/// `p` must be valid for reading and writing 64 bytes; the CPU must support
/// AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn add4(p: *mut __m256i, lo: __m256i, hi: __m256i) {
    // SAFETY: the caller's guarantee: two unaligned 32-byte loads.
    let (a, b) = unsafe { (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1))) };
    // a = [lo0 hi0 | lo1 hi1], b = [lo2 hi2 | lo3 hi3]: per 128-bit lane,
    // unpack gives lows [lo0 lo2 | lo1 lo3] and highs [hi0 hi2 | hi1 hi3].
    let (acc_lo, acc_hi) = (_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
    let sum_lo = _mm256_add_epi64(acc_lo, lo);
    // Unsigned sum_lo < acc_lo means a carry: compare with the sign flipped.
    let flip = _mm256_set1_epi64x(i64::MIN);
    let carry = _mm256_cmpgt_epi64(
        _mm256_xor_si256(acc_lo, flip),
        _mm256_xor_si256(sum_lo, flip),
    );
    let sum_hi = _mm256_sub_epi64(_mm256_add_epi64(acc_hi, hi), carry); // carry is -1
                                                                        // SAFETY: as above.
    unsafe {
        _mm256_storeu_si256(p, _mm256_unpacklo_epi64(sum_lo, sum_hi));
        _mm256_storeu_si256(p.add(1), _mm256_unpackhi_epi64(sum_lo, sum_hi));
    }
}
