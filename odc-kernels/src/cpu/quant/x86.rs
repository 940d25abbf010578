//! AVX2 kernels for the block-scaled formats, one block per call: the
//! intrinsics of [`super`] (the crate's other intrinsics live in
//! `cpu::x86`, whose element loads and stores these reuse).
//!
//! Every kernel works in steps of 16 elements; a block's last partial step
//! goes through 16-element stack buffers and the same vector code, so a
//! tail rounds exactly like the body. Each result is bit-identical to the
//! portable path of [`super`]: the same f32 operations in the same order
//! (no FMA), the same integer tricks for fp8.
//!
//! Nothing here checks the CPU: callers pass only the level that
//! [`crate::cpu::isa`] detected.

use std::arch::x86_64::{
    __m128i, __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256,
    _mm256_blendv_epi8, _mm256_blendv_ps, _mm256_castps256_ps128, _mm256_castps_si256,
    _mm256_castsi256_ps, _mm256_castsi256_si128, _mm256_cmpeq_epi32, _mm256_cmpgt_epi32,
    _mm256_cvtepi32_ps, _mm256_cvtepi8_epi32, _mm256_cvtepu8_epi32, _mm256_cvtps_epi32,
    _mm256_extractf128_ps, _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps, _mm256_or_si256,
    _mm256_packs_epi16, _mm256_packs_epi32, _mm256_packus_epi16, _mm256_packus_epi32,
    _mm256_permute4x64_epi64, _mm256_round_ps, _mm256_set1_epi32, _mm256_set1_ps,
    _mm256_setzero_ps, _mm256_slli_epi32, _mm256_srli_epi32, _mm256_sub_epi32, _mm256_xor_si256,
    _mm_cvtss_f32, _mm_loadu_si128, _mm_max_ps, _mm_max_ss, _mm_movehl_ps, _mm_shuffle_ps,
    _mm_srli_si128, _mm_storeu_si128, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
};

use super::{
    block_scale, Format, FP8_DENORM_MAGIC, FP8_E4M3_MAX, FP8_NAN_FROM, FP8_NORMAL_MIN, FP8_REBIAS,
    FP8_SUBNORMAL_STEP, INT8_MAX, INT8_NONFINITE,
};
use crate::cpu::x86::Lanes;
use crate::Element;

/// Elements per vector step: two 256-bit registers of f32.
const STEP: usize = 16;

/// Quantises one block (`x.len() <= block`) into `codes` (as long as `x`)
/// and returns its scale.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C; `codes.len() == x.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn quantise_block(format: Format, x: &[f32], codes: &mut [u8], qmax: f32) -> f32 {
    let n = x.len().min(codes.len());
    let xp = x.as_ptr();
    // Pass 1: the largest finite magnitude.
    let (mut m0, mut m1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + STEP <= n {
        // SAFETY: `i + 16 <= n`: 16 readable f32 at `xp + i`.
        let [v0, v1] = unsafe { f32::load16(xp.add(i)) };
        m0 = _mm256_max_ps(m0, finite_abs(v0));
        m1 = _mm256_max_ps(m1, finite_abs(v1));
        i += STEP;
    }
    let mut amax = hmax(_mm256_max_ps(m0, m1));
    for &v in &x[i..n] {
        let a = v.abs();
        if a.is_finite() {
            amax = amax.max(a);
        }
    }
    let (scale, inv) = block_scale(amax, qmax);
    // Pass 2: the codes, from cache.
    let inv = _mm256_set1_ps(inv);
    let cp = codes.as_mut_ptr();
    let mut i = 0;
    while i + STEP <= n {
        // SAFETY: 16 readable f32 at `xp + i`, 16 writable bytes at `cp + i`.
        unsafe {
            let v = f32::load16(xp.add(i));
            _mm_storeu_si128(cp.add(i).cast(), encode16(format, v, inv));
        }
        i += STEP;
    }
    if i < n {
        let mut buf = [0f32; STEP];
        buf[..n - i].copy_from_slice(&x[i..n]);
        let mut out = [0u8; STEP];
        // SAFETY: both buffers hold 16 elements.
        unsafe {
            let v = f32::load16(buf.as_ptr());
            _mm_storeu_si128(out.as_mut_ptr().cast(), encode16(format, v, inv));
        }
        codes[i..n].copy_from_slice(&out[..n - i]);
    }
    scale
}

/// `dst[i] = round(value(codes[i]) · scale)` for one block.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dequantise_block<D: Element>(
    format: Format,
    codes: &[u8],
    scale: f32,
    dst: &mut [D],
) {
    let n = codes.len().min(dst.len());
    let s = _mm256_set1_ps(scale);
    let (cp, dp) = (codes.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i + STEP <= n {
        // SAFETY: 16 readable codes at `cp + i`, 16 writable `D` at `dp + i`.
        unsafe {
            let [v0, v1] = decode16(format, cp.add(i));
            D::store16(dp.add(i), [_mm256_mul_ps(v0, s), _mm256_mul_ps(v1, s)]);
        }
        i += STEP;
    }
    if i < n {
        let mut cbuf = [0u8; STEP];
        cbuf[..n - i].copy_from_slice(&codes[i..n]);
        let mut dbuf = [D::zeroed(); STEP];
        // SAFETY: both buffers hold 16 elements.
        unsafe {
            let [v0, v1] = decode16(format, cbuf.as_ptr());
            D::store16(
                dbuf.as_mut_ptr(),
                [_mm256_mul_ps(v0, s), _mm256_mul_ps(v1, s)],
            );
        }
        dst[i..n].copy_from_slice(&dbuf[..n - i]);
    }
}

/// `acc[i] += factor · (value(codes[i]) · scale)` for one block.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn dequantise_accumulate_block(
    format: Format,
    codes: &[u8],
    scale: f32,
    acc: &mut [f32],
    factor: f32,
) {
    let n = codes.len().min(acc.len());
    let (s, f) = (_mm256_set1_ps(scale), _mm256_set1_ps(factor));
    let (cp, ap) = (codes.as_ptr(), acc.as_mut_ptr());
    let mut i = 0;
    while i + STEP <= n {
        // SAFETY: 16 readable codes at `cp + i`, 16 f32 at `ap + i`.
        unsafe { accumulate_step(format, cp.add(i), ap.add(i), s, f) };
        i += STEP;
    }
    if i < n {
        let mut cbuf = [0u8; STEP];
        cbuf[..n - i].copy_from_slice(&codes[i..n]);
        let mut abuf = [0f32; STEP];
        abuf[..n - i].copy_from_slice(&acc[i..n]);
        // SAFETY: both buffers hold 16 elements.
        unsafe { accumulate_step(format, cbuf.as_ptr(), abuf.as_mut_ptr(), s, f) };
        acc[i..n].copy_from_slice(&abuf[..n - i]);
    }
}

/// One step of [`dequantise_accumulate_block`].
///
/// # Safety
///
/// 16 readable bytes at `c`, 16 readable and writable f32 at `a`; AVX2.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn accumulate_step(format: Format, c: *const u8, a: *mut f32, s: __m256, f: __m256) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let [v0, v1] = decode16(format, c);
        let [a0, a1] = f32::load16(a);
        f32::store16(
            a,
            [
                _mm256_add_ps(a0, _mm256_mul_ps(f, _mm256_mul_ps(v0, s))),
                _mm256_add_ps(a1, _mm256_mul_ps(f, _mm256_mul_ps(v1, s))),
            ],
        );
    }
}

/// `|v|` where finite, else 0.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn finite_abs(v: __m256) -> __m256 {
    let abs = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fff_ffff));
    // Signed compare is right: both sides are below 2^31.
    let finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f80_0000), abs);
    _mm256_castsi256_ps(_mm256_and_si256(abs, finite))
}

/// The largest lane (none is NaN).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
    _mm_cvtss_f32(m)
}

/// Where `x` is ±∞ or NaN: all ones.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn non_finite(x: __m256) -> __m256i {
    let abs = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fff_ffff));
    _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f7f_ffff))
}

/// Sixteen codes (bytes) of `x · inv`, in element order.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn encode16(format: Format, x: [__m256; 2], inv: __m256) -> __m128i {
    match format {
        Format::Fp8E4m3 => {
            let a = fp8_codes(x[0], inv);
            let b = fp8_codes(x[1], inv);
            // Codes are 0..=255: unsigned packs keep them. Each pack works
            // per 128-bit lane; the permutes restore element order.
            let words = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
            let bytes = _mm256_packus_epi16(words, words);
            _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b00_00_10_00>(bytes))
        }
        Format::Int8 | Format::Bf16 => {
            // Bf16 never comes here (it has no blocks); int8 codes are
            // -128..=127, which signed packs keep.
            let a = int8_codes(x[0], inv);
            let b = int8_codes(x[1], inv);
            let words = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
            let bytes = _mm256_packs_epi16(words, words);
            _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b00_00_10_00>(bytes))
        }
    }
}

/// Eight fp8 codes (one per 32-bit lane) of `x · inv` clamped to ±448, as
/// [`super::fp8_e4m3_from_f32`] computes them; non-finite `x` gives NaN
/// with `x`'s sign.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn fp8_codes(x: __m256, inv: __m256) -> __m256i {
    let v = _mm256_mul_ps(x, inv);
    let v = _mm256_min_ps(
        _mm256_max_ps(v, _mm256_set1_ps(-FP8_E4M3_MAX)),
        _mm256_set1_ps(FP8_E4M3_MAX),
    );
    let bits = _mm256_castps_si256(v);
    let sign_mask = _mm256_set1_epi32(0x8000_0000_u32 as i32);
    let sign = _mm256_and_si256(bits, sign_mask);
    let abs = _mm256_xor_si256(bits, sign);
    let big = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(FP8_NAN_FROM as i32 - 1));
    let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(FP8_NORMAL_MIN as i32), abs);
    let magic = _mm256_set1_epi32(FP8_DENORM_MAGIC as i32);
    let den = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(
            _mm256_castsi256_ps(abs),
            _mm256_castsi256_ps(magic),
        )),
        magic,
    );
    let odd = _mm256_and_si256(_mm256_srli_epi32::<20>(abs), _mm256_set1_epi32(1));
    let nrm = _mm256_srli_epi32::<20>(_mm256_add_epi32(
        _mm256_add_epi32(abs, _mm256_set1_epi32(FP8_REBIAS as i32)),
        odd,
    ));
    let code = _mm256_blendv_epi8(nrm, den, small);
    let code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), big);
    let code = _mm256_or_si256(code, _mm256_srli_epi32::<24>(sign));
    let x_sign = _mm256_srli_epi32::<24>(_mm256_and_si256(_mm256_castps_si256(x), sign_mask));
    let nan = _mm256_or_si256(_mm256_set1_epi32(0x7f), x_sign);
    _mm256_blendv_epi8(code, nan, non_finite(x))
}

/// Eight int8 codes (one per 32-bit lane) of `x · inv`: clamped to ±127,
/// rounded half to even; [`INT8_NONFINITE`] for non-finite `x`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn int8_codes(x: __m256, inv: __m256) -> __m256i {
    let v = _mm256_mul_ps(x, inv);
    let v = _mm256_min_ps(
        _mm256_max_ps(v, _mm256_set1_ps(-INT8_MAX)),
        _mm256_set1_ps(INT8_MAX),
    );
    let rounded = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
    let code = _mm256_cvtps_epi32(rounded);
    _mm256_blendv_epi8(
        code,
        _mm256_set1_epi32(i32::from(INT8_NONFINITE)),
        non_finite(x),
    )
}

/// The values (before scale) of sixteen codes at `c`.
///
/// # Safety
///
/// 16 readable bytes at `c`; AVX2.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode16(format: Format, c: *const u8) -> [__m256; 2] {
    // SAFETY: the caller guarantees 16 readable bytes.
    let bytes = unsafe { _mm_loadu_si128(c.cast()) };
    let high = _mm_srli_si128::<8>(bytes);
    match format {
        Format::Fp8E4m3 => [
            fp8_values(_mm256_cvtepu8_epi32(bytes)),
            fp8_values(_mm256_cvtepu8_epi32(high)),
        ],
        Format::Int8 | Format::Bf16 => [
            int8_values(_mm256_cvtepi8_epi32(bytes)),
            int8_values(_mm256_cvtepi8_epi32(high)),
        ],
    }
}

/// [`super::fp8_e4m3_to_f32`] of eight codes (one per 32-bit lane).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn fp8_values(c: __m256i) -> __m256 {
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(c, _mm256_set1_epi32(0x80)));
    let abs = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
    let normal = _mm256_castsi256_ps(_mm256_add_epi32(
        _mm256_slli_epi32::<20>(abs),
        _mm256_set1_epi32(120 << 23),
    ));
    let sub = _mm256_mul_ps(_mm256_cvtepi32_ps(abs), _mm256_set1_ps(FP8_SUBNORMAL_STEP));
    let is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), abs);
    let v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
    let is_nan = _mm256_cmpeq_epi32(abs, _mm256_set1_epi32(0x7f));
    let v = _mm256_blendv_ps(
        v,
        _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0_0000)),
        _mm256_castsi256_ps(is_nan),
    );
    _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign))
}

/// [`super::int8_to_f32`] of eight codes (sign-extended, one per lane).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn int8_values(c: __m256i) -> __m256 {
    let v = _mm256_cvtepi32_ps(c);
    let is_nan = _mm256_cmpeq_epi32(c, _mm256_set1_epi32(i32::from(INT8_NONFINITE)));
    _mm256_blendv_ps(
        v,
        _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0_0000)),
        _mm256_castsi256_ps(is_nan),
    )
}
