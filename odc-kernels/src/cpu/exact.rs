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
//! [`read_exact`] reads the sum out as the f32 nearest to it (one
//! rounding), which is at least as accurate as an f32 sum of the same
//! terms, and leaves the sum to go on; [`add_exact`] adds two sums
//! exactly (the cross-node sum of deterministic hybrid sharding).
//!
//! Infinities and NaNs cannot be counted: they go into the f32 beside the
//! integer (the accumulator the engine keeps anyway), as IEEE adds them.
//! Sums of infinities and NaNs do not depend on order (+∞ with −∞ or any
//! NaN gives NaN), and [`read_exact`] writes every NaN as the one quiet
//! NaN, so the bits do not depend on which NaN came first. A loss scaler
//! that looks for infinities finds them where it would in an f32 sum.

use half::{bf16, f16};

use super::{check_len, view, Isa, Level};
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
/// [`Error::OutOfRange`] naming the first contribution of magnitude 2^39 or
/// more (every other contribution is added; those are not).
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
    // One tight pass adds every finite, in-range contribution and only
    // notes whether any other came; a second pass, rare, deals with those.
    let (done, mut other) = match Level::current().0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is only Avx2 where the CPU has AVX2 and F16C;
        // the lengths were checked equal.
        Isa::Avx2 => unsafe { super::x86::accumulate_exact(fixed, x, scale) },
        _ => (0, false),
    };
    let (fixed, x_rest) = (&mut fixed[done..], &x[done..]);
    other |= match pow2_exponent(scale) {
        // The common scales (1, 1/world for a power-of-two world): the
        // product is an exponent shift, all in integers.
        Some(e) => add_units(fixed, x_rest, |x| f32_units(x, e)),
        // Exact: both factors have at most 24 significant bits.
        None => add_units(fixed, x_rest, |x| to_fixed(f64::from(x) * f64::from(scale))),
    };
    if !other {
        return Ok(());
    }
    let mut first_too_large = None;
    for (i, (s, &x)) in spill.iter_mut().zip(x).enumerate() {
        let v = f64::from(x.to_f32()) * f64::from(scale);
        match to_fixed(v) {
            Fixed::Units(_) => {}
            Fixed::NonFinite => *s += v as f32,
            Fixed::TooLarge => {
                first_too_large.get_or_insert(Error::OutOfRange {
                    op,
                    index: i,
                    value: v,
                });
            }
        }
    }
    first_too_large.map_or(Ok(()), Err)
}

/// Adds `units(x[i])` into `fixed[i]` where it is a count of units;
/// returns whether any element was not (left for the caller's second pass).
fn add_units<X: Element>(fixed: &mut [i128], x: &[X], units: impl Fn(f32) -> Fixed) -> bool {
    let mut other = false;
    for (f, &x) in fixed.iter_mut().zip(x) {
        match units(x.to_f32()) {
            Fixed::Units(u) => *f = f.wrapping_add(u),
            _ => other = true,
        }
    }
    other
}

/// `out[i]` = `fixed[i]` read as a number (the f32 nearest to it: one
/// rounding) where `out[i]` is finite; an infinity or NaN in `out[i]` (what
/// [`accumulate_exact`] spilled, which no finite sum changes) stays, every
/// NaN as `f32::NAN`. `fixed` is left as it is, so the sum goes on: more
/// contributions and another read give the exact sum of all of them,
/// rounded once. `out` holds zeros, spills or an earlier read of the same
/// accumulator (finite: replaced).
///
/// Errors with [`Error::LengthMismatch`] unless the lengths agree.
pub fn read_exact(fixed: &[i128], out: &mut [f32]) -> Result<()> {
    check_len("read_exact", out.len(), fixed.len())?;
    for (&f, o) in fixed.iter().zip(out.iter_mut()) {
        *o = if o.is_nan() {
            f32::NAN
        } else if o.is_infinite() {
            *o
        } else {
            from_fixed(f)
        };
    }
    Ok(())
}

/// `sum[i] += x[i]`, exactly: adds another accumulator's units (`x` as the
/// little-endian bytes of `i128`s, as a one-sided read of a replica's exact
/// accumulator delivers them, any alignment), and `spill[i] += o[i]` for
/// every infinite or NaN `o[i]` of `other` (that replica's f32 accumulator,
/// which [`accumulate_exact`] spilled into; its finite values, zeros or an
/// earlier [`read_exact`], are skipped). The
/// cross-node sum of deterministic hybrid sharding: every node's exact
/// sum added as integers, so the total is the same bits whichever node ran
/// which contribution.
///
/// Errors: [`Error::LengthMismatch`] unless the lengths agree (16 bytes per
/// element); [`Error::ExactOverflow`] if an element's sum leaves the
/// `i128`.
pub fn add_exact(sum: &mut [i128], spill: &mut [f32], x: &[u8], other: &[f32]) -> Result<()> {
    const OP: &str = "add_exact";
    check_len(OP, x.len(), sum.len() * BYTES_PER_ELEMENT)?;
    check_len(OP, other.len(), sum.len())?;
    check_len(OP, spill.len(), sum.len())?;
    // One pass without an early exit; an overflow (which leaves `sum`
    // wrapped: the caller fails) is reported after it.
    let mut overflow = None;
    for (i, (s, b)) in sum
        .iter_mut()
        .zip(x.chunks_exact(BYTES_PER_ELEMENT))
        .enumerate()
    {
        let mut le = [0u8; BYTES_PER_ELEMENT];
        le.copy_from_slice(b);
        let (v, o) = s.overflowing_add(i128::from_le_bytes(le));
        *s = v;
        if o && overflow.is_none() {
            overflow = Some(i);
        }
    }
    if let Some(index) = overflow {
        return Err(Error::ExactOverflow { op: OP, index });
    }
    for (sp, &o) in spill.iter_mut().zip(other) {
        if !o.is_finite() {
            *sp += o;
        }
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

/// `e` if `scale` is exactly 2^e (a normal f32), else `None`.
fn pow2_exponent(scale: f32) -> Option<i32> {
    let bits = scale.to_bits();
    let biased = ((bits >> 23) & 0xff) as i32;
    (bits & 0x807f_ffff == 0 && biased != 0 && biased != 0xff).then_some(biased - 127)
}

/// `x · 2^e · 2^72` rounded to the nearest integer, ties to even: what
/// [`to_fixed`] gives for the same product, in integers only.
fn f32_units(x: f32, e: i32) -> Fixed {
    let bits = x.to_bits();
    let biased = ((bits >> 23) & 0xff) as i32;
    if biased == 0xff {
        return Fixed::NonFinite;
    }
    let frac = bits & 0x7f_ffff;
    // |x| = mant · 2^(exp - 150), mant < 2^24 (subnormals: exp 1, no
    // implicit bit).
    let (mant, exp) = if biased == 0 {
        (frac, 1)
    } else {
        (frac | 0x80_0000, biased)
    };
    if mant == 0 {
        return Fixed::Units(0);
    }
    if exp - 127 + e >= LIMIT_LOG2 {
        return Fixed::TooLarge;
    }
    Fixed::Units(shifted(
        u128::from(mant),
        exp + e - 150 + FRAC_BITS as i32,
        bits >> 31 == 1,
    ))
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
    Fixed::Units(shifted(
        mant,
        exp - F64_SHIFT + FRAC_BITS as i32,
        bits >> 63 == 1,
    ))
}

/// `±mant · 2^shift` rounded to an integer, ties to even, for `mant < 2^53`
/// and a magnitude below 2^111 (which the callers' range checks give).
fn shifted(mant: u128, shift: i32, negative: bool) -> i128 {
    let units = if shift >= 0 {
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
    if negative {
        -units
    } else {
        units
    }
}

/// The f32 nearest to `units · 2^-72`, ties to even.
fn from_fixed(units: i128) -> f32 {
    const SCALE: f32 = f32::from_bits((127 - FRAC_BITS) << 23); // 2^-72
                                                                // Below 2^-9 (2^63 units): the hardware's i64 conversion rounds to
                                                                // nearest, ties to even, and the scaling is exact.
    if let Ok(small) = i64::try_from(units) {
        return small as f32 * SCALE;
    }
    // Above: the top 63 bits, with every bit shifted out OR-ed into the
    // lowest (a sticky bit, 39 places below the f32's rounding point, so
    // that a tie stays a tie only where it is one), converted by the
    // hardware the same way, then scaled by 2^(shift - 72) exactly.
    let m = units.unsigned_abs();
    let shift = 65 - m.leading_zeros(); // 128 - lz - 63, in 1..=65
    let sticky = u64::from(m & ((1u128 << shift) - 1) != 0);
    let top = ((m >> shift) as u64 | sticky) as f32;
    // 2^(shift - 72), a normal f32 (exponent -71..=-7).
    let pow = f32::from_bits((127 + shift - FRAC_BITS) << 23);
    let v = top * pow;
    if units < 0 {
        -v
    } else {
        v
    }
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
    fn the_integer_path_for_power_of_two_scales_agrees_with_the_f64_one() {
        assert_eq!(pow2_exponent(1.0), Some(0));
        assert_eq!(pow2_exponent(0.25), Some(-2));
        assert_eq!(pow2_exponent(-0.25), None);
        assert_eq!(pow2_exponent(0.3), None);
        assert_eq!(pow2_exponent(0.0), None);
        assert_eq!(pow2_exponent(f32::INFINITY), None);
        let mut xs = values(20_000, 11);
        xs.extend([
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            -f32::from_bits(0x7f_ffff),
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
            2f32.powi(38) * 1.999,
            2f32.powi(-73),
            2f32.powi(-74) * 3.0,
        ]);
        for e in [-12, -3, -1, 0, 1, 5] {
            for &x in &xs {
                let want = to_fixed(f64::from(x) * f64::from(e).exp2());
                assert_eq!(f32_units(x, e), want, "x {x:e} scale 2^{e}");
            }
        }
    }

    #[test]
    fn the_vector_path_adds_what_the_scalar_conversion_gives() {
        // Values over the whole f32 range (both roundings, subnormals,
        // zeros, specials), each scale, several start values of the sums.
        let mut xs = values(4_099, 3);
        let mut s = 99u64;
        for x in xs.iter_mut().step_by(3) {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            *x = f32::from_bits((s >> 32) as u32);
        }
        xs[5] = 0.0;
        xs[6] = -0.0;
        xs[7] = f32::INFINITY;
        xs[40] = 2f32.powi(-60) * 1.5;
        for scale in [1.0f32, 0.25, 0.3, -0.7, 3.0e-5, 1.0e6] {
            let start: Vec<i128> = (0..xs.len() as i128)
                .map(|i| (i - 2000) << 70 | i)
                .collect();
            let (mut fixed, mut spill) = (start.clone(), vec![0f32; xs.len()]);
            let bytes: &[u8] = bytemuck::cast_slice(&xs);
            let _ = accumulate_exact(&mut fixed, &mut spill, bytes, DType::F32, scale);
            for (i, &x) in xs.iter().enumerate() {
                let v = f64::from(x) * f64::from(scale);
                let want = match to_fixed(v) {
                    Fixed::Units(u) => start[i].wrapping_add(u),
                    _ => start[i],
                };
                assert_eq!(fixed[i], want, "element {i}: x {x:e} scale {scale}");
            }
        }
        // bf16 and f16 inputs take the same path after widening.
        let hf: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
        let bf: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
        let widened: [(&[u8], DType, Vec<f32>); 2] = [
            (
                bytemuck::cast_slice(&hf),
                DType::F16,
                hf.iter().map(|v| v.to_f32()).collect(),
            ),
            (
                bytemuck::cast_slice(&bf),
                DType::BF16,
                bf.iter().map(|v| v.to_f32()).collect(),
            ),
        ];
        for (bytes, dtype, wide) in widened {
            let (mut fixed, mut spill) = (vec![0i128; xs.len()], vec![0f32; xs.len()]);
            let _ = accumulate_exact(&mut fixed, &mut spill, bytes, dtype, 0.3);
            for (i, f) in fixed.iter().enumerate() {
                let want = match to_fixed(f64::from(wide[i]) * f64::from(0.3f32)) {
                    Fixed::Units(u) => u,
                    _ => 0,
                };
                assert_eq!(*f, want, "{dtype} element {i}");
            }
        }
    }

    #[test]
    fn read_out_agrees_with_the_float_conversion() {
        // `as f32` on an i128 rounds to nearest, ties to even; scaling by
        // 2^-72 is exact.
        let reference = |u: i128| (u as f32) * (-(FRAC_BITS as f32)).exp2();
        let mut s = 7u64;
        for _ in 0..200_000 {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let bits = (s >> 57) as u32; // 0..=127 significant bits
            let raw =
                (i128::from(s) << 64 | i128::from(s.rotate_left(17))) >> (127 - bits.min(126));
            for u in [raw, -raw, raw | 0xff_ffff, (raw >> 25) << 25 | 1 << 24] {
                assert_eq!(from_fixed(u).to_bits(), reference(u).to_bits(), "units {u}");
            }
        }
        for u in [
            1,
            -1,
            (1 << 24) - 1,
            1 << 24,
            (1 << 25) - 1,
            i128::MAX,
            i128::MIN + 1,
        ] {
            assert_eq!(from_fixed(u).to_bits(), reference(u).to_bits(), "units {u}");
        }
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
        read_exact(&fixed, &mut out).unwrap();
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
    fn a_read_leaves_the_sum_to_go_on_and_two_sums_add_exactly() {
        let chunks: Vec<Vec<f32>> = (0..6).map(|c| values(129, 10 + c)).collect();
        let all = sum_in_order(&[0, 1, 2, 3, 4, 5], &chunks, 0.25);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // One accumulator read after three chunks, then three more and read
        // again: the second read is the sum of all six, rounded once.
        let (mut fixed, mut out) = (vec![0i128; 129], vec![0f32; 129]);
        for c in [0, 1, 2] {
            let b: &[u8] = bytemuck::cast_slice(&chunks[c]);
            accumulate_exact(&mut fixed, &mut out, b, DType::F32, 0.25).unwrap();
        }
        read_exact(&fixed, &mut out).unwrap();
        for c in [3, 4, 5] {
            let b: &[u8] = bytemuck::cast_slice(&chunks[c]);
            accumulate_exact(&mut fixed, &mut out, b, DType::F32, 0.25).unwrap();
        }
        read_exact(&fixed, &mut out).unwrap();
        assert_eq!(bits(&out), bits(&all));
        // Two accumulators over different chunks, added as integers: the
        // same bits as one over all of them, however the chunks were split.
        for split in [[0usize, 2, 4], [5, 1, 3]] {
            let (mut a, mut sa) = (vec![0i128; 129], vec![0f32; 129]);
            let (mut b, mut sb) = (vec![0i128; 129], vec![0f32; 129]);
            for (c, chunk) in chunks.iter().enumerate() {
                let (f, s) = if split.contains(&c) {
                    (&mut a, &mut sa)
                } else {
                    (&mut b, &mut sb)
                };
                let x: &[u8] = bytemuck::cast_slice(chunk);
                accumulate_exact(f, s, x, DType::F32, 0.25).unwrap();
            }
            read_exact(&b, &mut sb).unwrap();
            let (mut spill, b_bytes) = (
                vec![0f32; 129],
                bytemuck::cast_slice::<i128, u8>(&b).to_vec(),
            );
            add_exact(&mut a, &mut spill, &b_bytes, &sb).unwrap();
            read_exact(&a, &mut spill).unwrap();
            assert_eq!(bits(&spill), bits(&all));
        }
    }

    #[test]
    fn a_cross_sum_keeps_the_spills_and_refuses_an_overflow() {
        let (mut sum, mut spill) = (vec![5i128 << 72, 0], vec![0f32; 2]);
        let other: Vec<i128> = vec![1 << 72, 0];
        let x = bytemuck::cast_slice::<i128, u8>(&other).to_vec();
        add_exact(&mut sum, &mut spill, &x, &[1.0, f32::NEG_INFINITY]).unwrap();
        read_exact(&sum, &mut spill).unwrap();
        assert_eq!(spill, [6.0, f32::NEG_INFINITY]);
        let big = bytemuck::cast_slice::<i128, u8>(&[i128::MAX, 0]).to_vec();
        let err = add_exact(&mut sum, &mut spill, &big, &[0.0, 0.0]).unwrap_err();
        assert!(
            matches!(err, Error::ExactOverflow { index: 0, .. }),
            "{err}"
        );
        assert!(add_exact(&mut sum, &mut spill, &big[..16], &[0.0, 0.0]).is_err());
    }

    #[test]
    fn cancellation_is_exact() {
        // An f32 sum loses the 1.0 against 2^30; the integer sum does not.
        let xs = [2f32.powi(30), 1.0, -(2f32.powi(30))];
        let (mut fixed, mut out) = (vec![0i128; 1], vec![0f32; 1]);
        for x in xs {
            accumulate_exact(&mut fixed, &mut out, &x.to_ne_bytes(), DType::F32, 1.0).unwrap();
        }
        read_exact(&fixed, &mut out).unwrap();
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
        read_exact(&fixed, &mut out).unwrap();
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
        assert!(read_exact(&fixed, &mut out[..1]).is_err());
    }
}
