//! Exact, order-independent accumulation: what the daemon runs in
//! deterministic mode.
//!
//! A float sum depends on the order of its terms, and the order in which
//! gradient chunks reach an owner depends on timing (and, with work
//! stealing, on which rank ran which microbatch). So in deterministic mode
//! every contribution `scale · x` is turned into a fixed-point integer on
//! its own, and the integers are added. Integer addition is associative
//! and commutative, so the sum, and the f32 read out of it, are the same
//! bits whatever the order.
//!
//! The format: an `i128` per element counting units of 2^-[`FRAC_BITS`]
//! (2^-72 ≈ 2.1e-22). A contribution is the exact product of `x` and
//! `scale` (an f32 product fits an f64's mantissa), rounded once to that
//! unit, to nearest, ties to even; it must be smaller in magnitude than
//! 2^[`LIMIT_LOG2`] (2^39 ≈ 5.5e11), else [`Error::OutOfRange`]. With that
//! bound 2^16 contributions per element cannot overflow the `i128`.
//! [`drain_exact`] reads the sum out as the f32 nearest to it (one
//! rounding), which is at least as accurate as an f32 sum of the same
//! terms.
//!
//! Infinities and NaNs cannot be counted: they go into the f32 beside the
//! integer (the accumulator the engine keeps anyway), as IEEE adds them.
//! Sums of infinities and NaNs do not depend on order (+∞ with −∞ or any
//! NaN gives NaN), and [`drain_exact`] writes every NaN as the one quiet
//! NaN, so the bits do not depend on which NaN came first. A loss scaler
//! that looks for infinities finds them where it would in an f32 sum.

use half::{bf16, f16};

use super::{check_len, view};
use crate::{DType, Element, Error, Result};

/// Fraction bits of the fixed-point accumulator: one unit is 2^-72.
pub const FRAC_BITS: u32 = 72;

/// Every finite contribution must be smaller in magnitude than 2^39.
pub const LIMIT_LOG2: i32 = 39;

/// Bytes per element of the fixed-point accumulator.
pub const BYTES_PER_ELEMENT: usize = 16;

/// The f64 exponent bias plus the 52 explicit mantissa bits.
const F64_SHIFT: i32 = 1075;

/// `fixed[i] += round(scale · x[i] · 2^72)` for finite contributions,
/// `spill[i] += scale · x[i]` (f32) for infinite or NaN ones; `x` given as
/// bytes of `x_dtype`, as a landing slot holds it.
///
/// Errors: [`Error::LengthMismatch`] unless the three lengths agree,
/// [`Error::PartialElement`] or [`Error::Misaligned`] for bad bytes, and
/// [`Error::OutOfRange`] for the first contribution of magnitude 2^39 or
/// more (the elements before it are added, the rest are not).
pub fn accumulate_exact(
    fixed: &mut [i128],
    spill: &mut [f32],
    x_bytes: &[u8],
    x_dtype: DType,
    scale: f32,
) -> Result<()> {
    const OP: &str = "accumulate_exact";
    match x_dtype {
        DType::F32 => add(OP, fixed, spill, view::<f32>(OP, "source", x_bytes)?, scale),
        DType::BF16 => add(
            OP,
            fixed,
            spill,
            view::<bf16>(OP, "source", x_bytes)?,
            scale,
        ),
        DType::F16 => add(OP, fixed, spill, view::<f16>(OP, "source", x_bytes)?, scale),
    }
}

fn add<X: Element>(
    op: &'static str,
    fixed: &mut [i128],
    spill: &mut [f32],
    x: &[X],
    scale: f32,
) -> Result<()> {
    check_len(op, fixed.len(), x.len())?;
    check_len(op, spill.len(), x.len())?;
    let scale = f64::from(scale);
    for (i, ((f, s), &x)) in fixed.iter_mut().zip(spill.iter_mut()).zip(x).enumerate() {
        // Exact: both factors have at most 24 significant bits.
        let v = f64::from(x.to_f32()) * scale;
        match to_fixed(v) {
            Fixed::Units(u) => *f = f.wrapping_add(u),
            Fixed::NonFinite => *s += v as f32,
            Fixed::TooLarge => {
                return Err(Error::OutOfRange {
                    op,
                    index: i,
                    value: v,
                })
            }
        }
    }
    Ok(())
}

/// `out[i] = out[i] + sum_i` rounded to f32, where `sum_i` is `fixed[i]`
/// read as a number (the f32 nearest to it); then `fixed[i] = 0`. `out`
/// holds what [`accumulate_exact`] spilled (zero, or an infinity or NaN,
/// which the sum does not change); every NaN comes out as `f32::NAN`.
///
/// Errors with [`Error::LengthMismatch`] unless the lengths agree.
pub fn drain_exact(fixed: &mut [i128], out: &mut [f32]) -> Result<()> {
    check_len("drain_exact", out.len(), fixed.len())?;
    for (f, o) in fixed.iter_mut().zip(out.iter_mut()) {
        let sum = *o + from_fixed(*f);
        *o = if sum.is_nan() { f32::NAN } else { sum };
        *f = 0;
    }
    Ok(())
}

/// A contribution in accumulator units, or why it is not one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fixed {
    Units(i128),
    NonFinite,
    TooLarge,
}

/// `v · 2^72` rounded to the nearest integer, ties to even.
fn to_fixed(v: f64) -> Fixed {
    let bits = v.to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i32;
    if exp == 0x7ff {
        return Fixed::NonFinite;
    }
    if exp == 0 {
        // Zero or an f64 subnormal (below 2^-1022): rounds to 0 units.
        return Fixed::Units(0);
    }
    // |v| = mant · 2^(exp - 1075), mant < 2^53.
    if exp - 1023 >= LIMIT_LOG2 {
        return Fixed::TooLarge;
    }
    let mant = u128::from((bits & ((1u64 << 52) - 1)) | (1u64 << 52));
    let shift = exp - F64_SHIFT + FRAC_BITS as i32;
    let units = if shift >= 0 {
        // At most 53 + 38 + 72 - 52 = 111 bits: fits.
        mant << shift
    } else {
        let s = shift.unsigned_abs();
        if s > 54 {
            0 // below half a unit
        } else {
            let whole = mant >> s;
            let rest = mant & ((1u128 << s) - 1);
            let half = 1u128 << (s - 1);
            whole + u128::from(rest > half || (rest == half && whole & 1 == 1))
        }
    };
    // < 2^111, so the cast keeps the value.
    let units = units as i128;
    Fixed::Units(if bits >> 63 == 1 { -units } else { units })
}

/// The f32 nearest to `units · 2^-72`.
fn from_fixed(units: i128) -> f32 {
    // `as` rounds to nearest, ties to even; scaling by a power of two is
    // exact here (|units| < 2^127 gives at most 2^55, and a non-zero
    // |units| ≥ 1 gives at least 2^-72, both normal f32s).
    (units as f32) * f32::from_bits((127 - FRAC_BITS) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit() -> f64 {
        (-f64::from(FRAC_BITS)).exp2()
    }

    #[test]
    fn conversion_is_exact_where_it_can_be_and_rounds_to_even() {
        assert_eq!(to_fixed(0.0), Fixed::Units(0));
        assert_eq!(to_fixed(-0.0), Fixed::Units(0));
        assert_eq!(to_fixed(1.0), Fixed::Units(1 << 72));
        assert_eq!(to_fixed(-1.5), Fixed::Units(-(3 << 71)));
        assert_eq!(to_fixed(unit()), Fixed::Units(1));
        // Half a unit rounds to even (0), one and a half to 2, a hair
        // above half up.
        assert_eq!(to_fixed(unit() / 2.0), Fixed::Units(0));
        assert_eq!(to_fixed(unit() * 1.5), Fixed::Units(2));
        assert_eq!(to_fixed(unit() * 2.5), Fixed::Units(2));
        assert_eq!(to_fixed(unit() * 0.5000001), Fixed::Units(1));
        assert_eq!(to_fixed(-unit() * 0.5000001), Fixed::Units(-1));
        assert_eq!(to_fixed(1e-300), Fixed::Units(0));
        assert_eq!(to_fixed(f64::MIN_POSITIVE / 2.0), Fixed::Units(0));
        assert_eq!(to_fixed(f64::INFINITY), Fixed::NonFinite);
        assert_eq!(to_fixed(f64::NAN), Fixed::NonFinite);
        let top = f64::from(LIMIT_LOG2).exp2();
        assert_eq!(to_fixed(top), Fixed::TooLarge);
        assert_eq!(to_fixed(-top), Fixed::TooLarge);
        let below = top * (1.0 - f64::EPSILON);
        assert_eq!(
            to_fixed(below),
            Fixed::Units((below * f64::from(FRAC_BITS).exp2()) as i128)
        );
    }

    #[test]
    fn read_out_is_the_nearest_f32() {
        assert_eq!(from_fixed(0), 0.0);
        assert_eq!(from_fixed(1 << 72), 1.0);
        assert_eq!(from_fixed(-(3 << 70)), -0.75);
        assert_eq!(from_fixed(1), unit() as f32);
        // 1 + 2^-24 is a tie between 1 and 1 + 2^-23: even (1).
        assert_eq!(from_fixed((1 << 72) + (1 << 48)), 1.0);
        assert_eq!(from_fixed((1 << 72) + (1 << 48) + 1), 1.0 + f32::EPSILON);
    }

    /// A deterministic stream of awkward f32s: wide exponents, both signs.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let m = (s >> 40) as f32 / (1u64 << 24) as f32;
                let e = ((s >> 8) % 40) as i32 - 30;
                let sign = if s & 1 == 1 { -1.0 } else { 1.0 };
                sign * m * (e as f32).exp2()
            })
            .collect()
    }

    fn sum_in_order(order: &[usize], chunks: &[Vec<f32>], scale: f32) -> Vec<f32> {
        let n = chunks[0].len();
        let (mut fixed, mut out) = (vec![0i128; n], vec![0f32; n]);
        for &c in order {
            let bytes: &[u8] = bytemuck::cast_slice(&chunks[c]);
            accumulate_exact(&mut fixed, &mut out, bytes, DType::F32, scale).unwrap();
        }
        drain_exact(&mut fixed, &mut out).unwrap();
        assert!(fixed.iter().all(|&f| f == 0));
        out
    }

    #[test]
    fn the_sum_is_the_same_bits_in_every_order() {
        let chunks: Vec<Vec<f32>> = (0..6).map(|c| values(257, c)).collect();
        let forward: Vec<usize> = (0..6).collect();
        let reference = sum_in_order(&forward, &chunks, 0.25);
        for order in [[5, 4, 3, 2, 1, 0], [2, 0, 5, 1, 4, 3], [1, 3, 5, 0, 2, 4]] {
            let got = sum_in_order(&order, &chunks, 0.25);
            assert_eq!(
                bytemuck::cast_slice::<f32, u32>(&got),
                bytemuck::cast_slice::<f32, u32>(&reference)
            );
        }
        // An f32 sum of the same terms does depend on order here (so the
        // test above is not vacuous), and is within f32 rounding of ours.
        let f32_sum = |order: &[usize]| -> Vec<f32> {
            let mut acc = vec![0f32; 257];
            for &c in order {
                for (a, x) in acc.iter_mut().zip(&chunks[c]) {
                    *a += 0.25 * x;
                }
            }
            acc
        };
        assert_ne!(f32_sum(&forward), f32_sum(&[5, 4, 3, 2, 1, 0]));
        for (i, (&a, &b)) in f32_sum(&forward).iter().zip(&reference).enumerate() {
            let tol = chunks.iter().map(|c| (0.25 * c[i]).abs()).sum::<f32>() * 1e-6 + 1e-20;
            assert!((a - b).abs() <= tol, "element {i}: f32 {a} exact {b}");
        }
    }

    #[test]
    fn cancellation_is_exact() {
        // An f32 sum loses the 1.0 against 2^30; the integer sum does not.
        let xs = [2f32.powi(30), 1.0, -(2f32.powi(30))];
        let (mut fixed, mut out) = (vec![0i128; 1], vec![0f32; 1]);
        for x in xs {
            accumulate_exact(&mut fixed, &mut out, &x.to_ne_bytes(), DType::F32, 1.0).unwrap();
        }
        drain_exact(&mut fixed, &mut out).unwrap();
        assert_eq!(out[0], 1.0);
    }

    #[test]
    fn every_input_dtype_and_non_finite_values() {
        let (mut fixed, mut out) = (vec![0i128; 4], vec![0f32; 4]);
        let bf: Vec<bf16> = [1.5f32, f32::INFINITY, 2.0, f32::NAN]
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let hf: Vec<f16> = [0.5f32, f32::NEG_INFINITY, 1.0, 3.0]
            .iter()
            .map(|&v| f16::from_f32(v))
            .collect();
        accumulate_exact(
            &mut fixed,
            &mut out,
            bytemuck::cast_slice(&bf),
            DType::BF16,
            2.0,
        )
        .unwrap();
        accumulate_exact(
            &mut fixed,
            &mut out,
            bytemuck::cast_slice(&hf),
            DType::F16,
            1.0,
        )
        .unwrap();
        drain_exact(&mut fixed, &mut out).unwrap();
        assert_eq!(out[0], 3.5);
        // +inf then -inf: NaN, the one quiet NaN.
        assert_eq!(out[1].to_bits(), f32::NAN.to_bits());
        assert_eq!(out[2], 5.0);
        assert_eq!(out[3].to_bits(), f32::NAN.to_bits());
    }

    #[test]
    fn too_large_and_bad_lengths_are_errors() {
        let (mut fixed, mut out) = (vec![0i128; 2], vec![0f32; 2]);
        let x = [1.0f32, 2f32.powi(40)];
        let err = accumulate_exact(
            &mut fixed,
            &mut out,
            bytemuck::cast_slice(&x),
            DType::F32,
            1.0,
        )
        .unwrap_err();
        assert!(matches!(err, Error::OutOfRange { index: 1, .. }), "{err}");
        assert!(err.to_string().contains("2^39"), "{err}");
        let err = accumulate_exact(
            &mut fixed,
            &mut out[..1],
            bytemuck::cast_slice(&x),
            DType::F32,
            1.0,
        )
        .unwrap_err();
        assert!(matches!(err, Error::LengthMismatch { .. }), "{err}");
        assert!(drain_exact(&mut fixed, &mut out[..1]).is_err());
    }
}
