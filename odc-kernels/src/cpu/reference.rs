//! Scalar reference kernels: the definition the fast paths are tested
//! against.
//!
//! Written for clarity, one element at a time, with the bit-level
//! conversions spelled out here rather than borrowed from `half` or the
//! CPU, so they are an independent statement of what every kernel must
//! compute:
//!
//! - widening (bf16 or f16 to f32) is exact; a NaN stays NaN with its sign
//!   and payload, made quiet for f16 (bf16 widening is a pure bit shift);
//! - narrowing (f32 to bf16 or f16) rounds to nearest, ties to even,
//!   overflows to infinity, produces subnormals where the target has them,
//!   and turns a NaN into a quiet NaN with the same sign and the top bits
//!   of its payload;
//! - `acc + scale * x` is a multiply then an add in f32 (no fused
//!   multiply-add), then one narrowing to the accumulator's type.
//!
//! The checked entry points live in [`super`]; these take the same
//! arguments and reject mismatched lengths the same way.

use half::{bf16, f16};

use super::check_len;
use crate::{Element, Result};

/// Widens a bf16: its bits are the top half of the f32.
pub fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// Narrows to bf16, rounding to nearest, ties to even.
pub fn f32_to_bf16(x: f32) -> bf16 {
    let bits = x.to_bits();
    if x.is_nan() {
        // Keep sign and top payload, set the quiet bit so the payload
        // cannot truncate to zero (which would read as infinity).
        return bf16::from_bits(((bits >> 16) | 0x0040) as u16);
    }
    let lower = bits & 0xffff;
    let mut upper = bits >> 16;
    if lower > 0x8000 || (lower == 0x8000 && upper & 1 == 1) {
        // May carry into the exponent; the largest finite values round
        // to infinity, as they should.
        upper += 1;
    }
    bf16::from_bits(upper as u16)
}

/// Widens an f16 exactly.
pub fn f16_to_f32(x: f16) -> f32 {
    let h = u32::from(x.to_bits());
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = h & 0x3ff;
    let magnitude = match (exp, man) {
        (0, 0) => 0,
        // Subnormal: man * 2^-24, exactly representable in f32.
        (0, _) => (man as f32 * f32::from_bits(0x3380_0000)).to_bits(),
        (0x1f, 0) => 0x7f80_0000,
        (0x1f, _) => 0x7fc0_0000 | (man << 13),
        _ => ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// Narrows to f16, rounding to nearest, ties to even.
pub fn f32_to_f16(x: f32) -> f16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0xff {
        let special = if man == 0 {
            0x7c00
        } else {
            0x7e00 | (man >> 13) as u16
        };
        return f16::from_bits(sign | special);
    }
    let e = exp - 127;
    if e > 15 {
        return f16::from_bits(sign | 0x7c00);
    }
    // Both branches keep `kept` significand bits and round away `shift`
    // bits; a carry out of the significand bumps the exponent (or turns
    // the largest subnormal into the smallest normal, or 65520 into inf).
    let (kept, shift) = if e >= -14 {
        ((((e + 15) as u32) << 23) | man, 13)
    } else if e >= -25 {
        // Subnormal: the value in units of 2^-24 is (1.man) * 2^(e+24).
        (man | 0x80_0000, (-e - 1) as u32)
    } else {
        return f16::from_bits(sign);
    };
    let mut out = kept >> shift;
    let rest = kept & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if rest > half || (rest == half && out & 1 == 1) {
        out += 1;
    }
    f16::from_bits(sign | out as u16)
}

/// Widens any element to f32 with the reference conversions.
pub fn to_f32<T: Element>(x: T) -> f32 {
    let bits = bytemuck::bytes_of(&x);
    match T::DTYPE {
        crate::DType::F32 => f32::from_ne_bytes([bits[0], bits[1], bits[2], bits[3]]),
        crate::DType::BF16 => bf16_to_f32(bf16::from_ne_bytes([bits[0], bits[1]])),
        crate::DType::F16 => f16_to_f32(f16::from_ne_bytes([bits[0], bits[1]])),
    }
}

/// Narrows f32 to any element with the reference conversions.
pub fn from_f32<T: Element>(x: f32) -> T {
    let mut out = T::zeroed();
    let dst = bytemuck::bytes_of_mut(&mut out);
    match T::DTYPE {
        crate::DType::F32 => dst.copy_from_slice(&x.to_ne_bytes()),
        crate::DType::BF16 => dst.copy_from_slice(&f32_to_bf16(x).to_ne_bytes()),
        crate::DType::F16 => dst.copy_from_slice(&f32_to_f16(x).to_ne_bytes()),
    }
    out
}

/// `acc[i] = narrow(widen(acc[i]) + scale * widen(x[i]))`.
pub fn accumulate<A: Element, X: Element>(acc: &mut [A], x: &[X], scale: f32) -> Result<()> {
    check_len("accumulate", acc.len(), x.len())?;
    for (a, &v) in acc.iter_mut().zip(x) {
        *a = from_f32(to_f32(*a) + scale * to_f32(v));
    }
    Ok(())
}

/// `dst[i] = narrow(widen(src[i]))`, or a bit copy when `S` is `D`.
pub fn cast<S: Element, D: Element>(src: &[S], dst: &mut [D]) -> Result<()> {
    check_len("cast", dst.len(), src.len())?;
    if S::DTYPE == D::DTYPE {
        // Same type: copy bits, so even a signaling NaN survives.
        bytemuck::cast_slice_mut::<D, u8>(dst).copy_from_slice(bytemuck::cast_slice::<S, u8>(src));
        return Ok(());
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = from_f32(to_f32(s));
    }
    Ok(())
}

/// `x[i] *= s`.
pub fn scale_in_place(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}

/// Sets every element to +0.
pub fn fill_zero<T: Element>(buf: &mut [T]) {
    for v in buf {
        *v = T::zeroed();
    }
}
