//! Every kernel, on every instruction set this CPU has, against
//! [`mod@reference`]; the reference conversions against `half`; and the
//! argument checks of the byte-level entry points.

use half::{bf16, f16};
use proptest::collection::vec;
use proptest::prelude::*;

use super::*;

/// Where NaN payloads are checked too: on x86_64 every path is known to
/// produce the reference's exact bits. Elsewhere the portable path uses the
/// platform's conversions, which IEEE 754 lets differ in NaN payload.
const EXACT_NAN: bool = cfg!(target_arch = "x86_64");

/// Both NaN with the same sign: for comparisons with `half`, which quiets
/// NaNs that a bf16 bit shift keeps.
fn both_nan_or_equal(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits()
        || (a.is_nan() && b.is_nan() && a.is_sign_negative() == b.is_sign_negative())
}

fn same<T: Element>(a: T, b: T) -> bool {
    let (fa, fb) = (reference::to_f32(a), reference::to_f32(b));
    bytemuck::bytes_of(&a) == bytemuck::bytes_of(&b) || (!EXACT_NAN && both_nan_or_equal(fa, fb))
}

fn assert_same<T: Element>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            same(g, w),
            "{what}: element {i} of {}: got {g:?}, want {w:?}",
            got.len()
        );
    }
}

/// Elements of `T` from raw bit patterns (the low 16 bits for half types),
/// so NaN, infinity, subnormals and signed zeros all occur.
fn from_bits<T: Element>(bits: &[u32]) -> Vec<T> {
    match T::DTYPE {
        DType::F32 => bytemuck::cast_slice::<u32, T>(bits).to_vec(),
        DType::BF16 | DType::F16 => {
            let low: Vec<u16> = bits.iter().map(|&b| b as u16).collect();
            bytemuck::cast_slice::<u16, T>(&low).to_vec()
        }
    }
}

/// Elements of `T` holding small integers: sums of these are exact.
fn integers<T: Element>(bits: &[u32]) -> Vec<T> {
    bits.iter()
        .map(|&b| T::from_f32((b % 201) as f32 - 100.0))
        .collect()
}

fn values<T: Element>(bits: &[u32], raw: bool) -> Vec<T> {
    if raw {
        from_bits(bits)
    } else {
        integers(bits)
    }
}

fn check_accumulate<A: Element, X: Element>(
    acc_bits: &[u32],
    x_bits: &[u32],
    scale: f32,
    raw: bool,
) {
    let acc0: Vec<A> = values(acc_bits, raw);
    let x: Vec<X> = values(x_bits, raw);
    let mut want = acc0.clone();
    reference::accumulate(&mut want, &x, scale).unwrap();
    for level in Level::all() {
        let mut got = acc0.clone();
        level.accumulate(&mut got, &x, scale);
        let what = format!(
            "accumulate {}+={} x{scale} on {}",
            A::DTYPE,
            X::DTYPE,
            level.isa()
        );
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            if same(g, w) {
                continue;
            }
            // Which payload an operation on two NaNs keeps is unspecified
            // (IEEE 754 6.2.3), and a compiler may commute `a + s·x`: there
            // only NaN-ness is checked. One NaN operand propagates exactly.
            let nans = [
                reference::to_f32(acc0[i]).is_nan(),
                scale.is_nan(),
                reference::to_f32(x[i]).is_nan(),
            ]
            .iter()
            .filter(|&&n| n)
            .count();
            assert!(
                nans >= 2 && reference::to_f32(g).is_nan() && reference::to_f32(w).is_nan(),
                "{what}: element {i} of {}: got {g:?}, want {w:?}",
                got.len()
            );
        }
    }
}

fn check_cast<S: Element, D: Element>(bits: &[u32]) {
    let src: Vec<S> = from_bits(bits);
    let mut want = vec![D::zeroed(); src.len()];
    reference::cast(&src, &mut want).unwrap();
    for level in Level::all() {
        let mut got = vec![D::zeroed(); src.len()];
        level.cast(&src, &mut got);
        assert_same(
            &got,
            &want,
            &format!("cast {}->{} on {}", S::DTYPE, D::DTYPE, level.isa()),
        );
    }
}

macro_rules! for_all_pairs {
    ($f:ident, $($arg:expr),*) => {{
        $f::<f32, f32>($($arg),*);
        $f::<f32, bf16>($($arg),*);
        $f::<f32, f16>($($arg),*);
        $f::<bf16, f32>($($arg),*);
        $f::<bf16, bf16>($($arg),*);
        $f::<bf16, f16>($($arg),*);
        $f::<f16, f32>($($arg),*);
        $f::<f16, bf16>($($arg),*);
        $f::<f16, f16>($($arg),*);
    }};
}

fn scales() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(1.0f32),
        Just(-1.0),
        Just(0.5),
        Just(0.0),
        -4.0f32..4.0,
        any::<u32>().prop_map(f32::from_bits),
    ]
}

/// Two operands of one random length in 0..10_000, plus a scale and
/// whether to use raw bit patterns or small integers.
fn operands() -> impl Strategy<Value = (Vec<u32>, Vec<u32>, f32, bool)> {
    (0usize..10_000).prop_flat_map(|n| {
        (
            vec(any::<u32>(), n),
            vec(any::<u32>(), n),
            scales(),
            any::<bool>(),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn accumulate_matches_reference((acc, x, scale, raw) in operands()) {
        for_all_pairs!(check_accumulate, &acc, &x, scale, raw);
    }

    #[test]
    fn cast_matches_reference(bits in vec(any::<u32>(), 0..10_000)) {
        for_all_pairs!(check_cast, &bits);
    }

    #[test]
    fn scale_matches_reference(bits in vec(any::<u32>(), 0..10_000), s in scales()) {
        let x0: Vec<f32> = from_bits(&bits);
        let mut want = x0.clone();
        reference::scale_in_place(&mut want, s);
        for level in Level::all() {
            let mut got = x0.clone();
            level.scale_in_place(&mut got, s);
            let what = format!("scale by {s} on {}", level.isa());
            for (i, ((g, w), x)) in got.iter().zip(&want).zip(&x0).enumerate() {
                // Both operands NaN: which payload survives is unspecified
                // (IEEE 754 6.2.3) and a compiler may commute the product,
                // as in `check_accumulate`: NaN-ness is checked. One NaN
                // operand propagates bit for bit.
                let ok = if s.is_nan() && x.is_nan() {
                    g.is_nan() && w.is_nan()
                } else {
                    same(*g, *w)
                };
                assert!(ok, "{what}: element {i} of {}: got {g:?}, want {w:?}", got.len());
            }
        }
    }

    #[test]
    fn copy_levels_agree(
        bytes in vec(any::<u8>(), 0..20_000),
        src_off in 0usize..64,
        dst_off in 0usize..64,
    ) {
        let src_off = src_off.min(bytes.len());
        let len = bytes.len() - src_off;
        for level in Level::all() {
            check_copy(level, &bytes, src_off, dst_off, len, 0);
        }
    }

    #[test]
    fn bf16_narrowing_matches_half(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        prop_assert!(same(reference::f32_to_bf16(x), bf16::from_f32(x)), "{x:e} ({bits:#x})");
    }

    #[test]
    fn f16_narrowing_matches_half(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        prop_assert!(same(reference::f32_to_f16(x), f16::from_f32(x)), "{x:e} ({bits:#x})");
    }

    #[test]
    fn byte_entry_points_match_typed((acc, x, scale, _raw) in operands()) {
        let acc0: Vec<f32> = from_bits(&acc);
        let xs: Vec<bf16> = from_bits(&x);
        let mut want = acc0.clone();
        accumulate_f32(&mut want, &xs, scale).unwrap();
        let mut got = acc0.clone();
        accumulate_into_f32(&mut got, bytemuck::cast_slice(&xs), DType::BF16, scale).unwrap();
        assert_same(&got, &want, "accumulate_into_f32");

        let mut want = xs.clone();
        accumulate_same(&mut want, &xs, scale).unwrap();
        let mut got = xs.clone();
        accumulate_same_bytes(bytemuck::cast_slice_mut(&mut got), bytemuck::cast_slice(&xs), DType::BF16, scale).unwrap();
        assert_same(&got, &want, "accumulate_same_bytes");
    }
}

#[test]
fn every_short_length_and_tail() {
    for n in 0..=100u32 {
        let a: Vec<u32> = (0..n)
            .map(|i| i.wrapping_mul(2_654_435_761u32) ^ 0x3f80_1234)
            .collect();
        let b: Vec<u32> = (0..n)
            .map(|i| i.wrapping_mul(40_503u32).wrapping_add(0x4000_0000))
            .collect();
        for_all_pairs!(check_accumulate, &a, &b, 0.75, true);
        for_all_pairs!(check_accumulate, &a, &b, 1.0, false);
        for_all_pairs!(check_cast, &a);
    }
}

/// Copies `src[src_off..src_off + len]` to `dst_off` of a buffer filled
/// with a guard byte through `level`, streaming from `stream_min` bytes on,
/// and checks the copy and that no byte around it changed.
fn check_copy(
    level: Level,
    src: &[u8],
    src_off: usize,
    dst_off: usize,
    len: usize,
    stream_min: usize,
) {
    const GUARD: u8 = 0xa5;
    let mut dst = vec![GUARD; dst_off + len + 64];
    let from = &src[src_off..src_off + len];
    // SAFETY: both ranges are in bounds of distinct buffers.
    unsafe {
        level.copy(
            dst.as_mut_ptr().add(dst_off),
            from.as_ptr(),
            len,
            stream_min,
        )
    };
    let what = format!(
        "copy of {len} bytes on {}, offsets {src_off}/{dst_off}",
        level.isa()
    );
    assert!(
        dst[..dst_off].iter().all(|&b| b == GUARD),
        "{what}: head guard"
    );
    assert!(dst[dst_off..dst_off + len] == *from, "{what}: data");
    assert!(
        dst[dst_off + len..].iter().all(|&b| b == GUARD),
        "{what}: tail guard"
    );
}

#[test]
fn copy_every_short_length_and_alignment() {
    // 0..=300 bytes covers an empty copy, copies shorter than one vector,
    // and heads, 128-byte blocks and tails of every length, at every
    // source and destination offset within a 32-byte vector.
    let src: Vec<u8> = (0..400u32)
        .map(|i| (i.wrapping_mul(151) >> 2) as u8)
        .collect();
    for level in Level::all() {
        for len in 0..=300 {
            for src_off in 0..32 {
                for dst_off in [0, 1, 7, 8, 15, 16, 17, 31] {
                    check_copy(level, &src, src_off, dst_off, len, 0);
                }
            }
        }
    }
}

#[test]
fn copy_near_alias_distances_exactly() {
    // A destination 0 to 80 bytes past the source modulo 4 KiB, on both
    // sides of near_alias's window and of NEAR_ALIAS_MIN, short and long
    // lengths with odd heads and tails: the AVX2 detour where it applies,
    // memcpy elsewhere, the same bytes either way.
    let src: Vec<u8> = (0..3 * 4096 + 300u32)
        .map(|i| (i.wrapping_mul(97) >> 3) as u8)
        .collect();
    let base = src.as_ptr() as usize % 4096;
    for level in Level::all() {
        for len in [255, 256, 257, 300, 4097, 2 * 4096 + 45] {
            for distance in (0..=80).chain([4095, 4032]) {
                // `check_copy` puts the destination at dst_off into a fresh
                // buffer; aim it at `distance` past the source modulo 4 KiB
                // by choosing the source offset instead.
                let mut dst = vec![0u8; len + 4096];
                let dst_at = dst.as_mut_ptr() as usize % 4096;
                let src_off = (dst_at + 4096 * 2 - base - distance) % 4096;
                let from = &src[src_off..src_off + len];
                // SAFETY: both ranges are in bounds of distinct buffers.
                unsafe { level.copy(dst.as_mut_ptr(), from.as_ptr(), len, usize::MAX) };
                assert_eq!(
                    (dst.as_ptr() as usize).wrapping_sub(from.as_ptr() as usize) % 4096,
                    distance
                );
                assert!(
                    dst[..len] == *from && dst[len..].iter().all(|&b| b == 0),
                    "copy of {len} bytes on {} at distance {distance}",
                    level.isa()
                );
            }
        }
    }
    assert!(near_alias(17, 1) && near_alias(4096 + 63, 0));
    assert!(!near_alias(4097, 1) && !near_alias(64, 0) && !near_alias(1, 17));
}

#[test]
fn copy_bytes_streams_large_copies_exactly() {
    // Just above the threshold, odd length, odd offsets: the public entry
    // point on its streaming path (on AVX2 machines).
    let len = STREAM_COPY_MIN + 4097;
    let src: Vec<u8> = (0..len + 3).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; len + 5];
    copy_bytes(&mut dst[5..], &src[3..]).unwrap();
    assert!(dst[5..] == src[3..]);
    assert!(dst[..5].iter().all(|&b| b == 0));
    for level in Level::all() {
        check_copy(level, &src, 1, 3, len - 4, STREAM_COPY_MIN);
    }
}

#[test]
fn every_half_bit_pattern_widens_like_half() {
    for bits in 0..=u16::MAX {
        let b = bf16::from_bits(bits);
        // half quiets NaNs; ours (and torch's) is a pure shift.
        assert!(
            both_nan_or_equal(reference::bf16_to_f32(b), b.to_f32()),
            "bf16 {bits:#x}"
        );
        assert_eq!(
            reference::bf16_to_f32(b).to_bits(),
            Element::to_f32(b).to_bits()
        );
        let h = f16::from_bits(bits);
        assert!(
            both_nan_or_equal(reference::f16_to_f32(h), h.to_f32()),
            "f16 {bits:#x}"
        );
    }
}

#[test]
fn every_half_bit_pattern_casts_like_reference() {
    let bits: Vec<u32> = (0..=u32::from(u16::MAX)).collect();
    for_all_pairs!(check_cast, &bits);
}

#[test]
fn narrowing_edge_cases() {
    let bf = |x: f32| reference::f32_to_bf16(x).to_bits();
    // Ties go to even; anything above the tie rounds up.
    assert_eq!(bf(f32::from_bits(0x3f80_8000)), 0x3f80);
    assert_eq!(bf(f32::from_bits(0x3f81_8000)), 0x3f82);
    assert_eq!(bf(f32::from_bits(0x3f80_8001)), 0x3f81);
    // The largest f32 rounds to infinity; infinities and zeros stay.
    assert_eq!(bf(f32::MAX), 0x7f80);
    assert_eq!(bf(f32::NEG_INFINITY), 0xff80);
    assert_eq!(bf(-0.0), 0x8000);
    // f32 subnormals stay subnormal in bf16 (same exponent range).
    assert_eq!(bf(f32::from_bits(0x0001_0000)), 0x0001);
    // A NaN whose payload lives only in the low bits stays NaN.
    assert!(reference::f32_to_bf16(f32::from_bits(0x7f80_0001)).is_nan());
    assert!(reference::f32_to_bf16(f32::from_bits(0xff80_0001)).is_sign_negative());

    let h = |x: f32| reference::f32_to_f16(x).to_bits();
    assert_eq!(h(65504.0), 0x7bff);
    assert_eq!(h(65519.0), 0x7bff);
    assert_eq!(h(65520.0), 0x7c00);
    assert_eq!(h(1e-8), 0x0000);
    assert_eq!(h(f32::from_bits(0x3380_0000)), 0x0001); // 2^-24, smallest subnormal
    assert_eq!(h(f32::from_bits(0x3300_0000)), 0x0000); // 2^-25 ties to even: 0
    assert_eq!(h(f32::from_bits(0x3300_0001)), 0x0001);
    assert_eq!(h(f32::from_bits(0x387f_e000)), 0x0400); // largest subnormal rounds up to normal
    assert_eq!(h(f32::MIN_POSITIVE / 2.0), 0x0000);
    assert!(reference::f32_to_f16(f32::from_bits(0x7f80_0001)).is_nan());
    assert_eq!(h(f32::NEG_INFINITY), 0xfc00);

    // The fast paths agree on all of these.
    let edges: Vec<u32> = [
        0x3f80_8000u32,
        0x3f81_8000,
        0x3f80_8001,
        0x7f7f_ffff,
        0xff80_0000,
        0x8000_0000,
        0x0001_0000,
        0x7f80_0001,
        0xff80_0001,
        0x7fc0_0000,
        0x477f_e000,
        0x477f_efff,
        0x477f_f000,
        0x3380_0000,
        0x3300_0000,
        0x3300_0001,
        0x387f_e000,
        0x0040_0000,
    ]
    .to_vec();
    check_cast::<f32, bf16>(&edges);
    check_cast::<f32, f16>(&edges);
}

#[test]
fn unit_scale_is_plain_add_and_integers_are_exact() {
    let n = 4099;
    let x: Vec<f32> = (0..n).map(|i| (i % 97) as f32 - 48.0).collect();
    let mut acc: Vec<f32> = (0..n).map(|i| (i % 13) as f32).collect();
    let want: Vec<f32> = acc.iter().zip(&x).map(|(a, b)| a + b).collect();
    accumulate_f32(&mut acc, &x, 1.0).unwrap();
    assert_eq!(acc, want);

    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut acc = vec![0.0f32; n];
    for _ in 0..8 {
        accumulate_f32(&mut acc, &xb, 1.0).unwrap();
    }
    let want: Vec<f32> = x.iter().map(|v| 8.0 * v).collect();
    assert_eq!(acc, want);
}

#[test]
fn scale_and_zero() {
    let mut x: Vec<f32> = (0..1001).map(|i| i as f32).collect();
    scale_in_place(&mut x, 0.25);
    assert_eq!(x[1000], 250.0);
    fill_zero(&mut x);
    assert!(x.iter().all(|v| v.to_bits() == 0));
    let mut h = vec![bf16::ONE; 33];
    fill_zero(&mut h);
    assert!(h.iter().all(|v| v.to_bits() == 0));
    let mut r = vec![f16::ONE; 33];
    reference::fill_zero(&mut r);
    assert!(r.iter().all(|v| v.to_bits() == 0));
}

#[test]
fn cast_bytes_covers_every_pair() {
    let src: Vec<f32> = (0..257).map(|i| i as f32 * 0.37 - 40.0).collect();
    for from in DType::ALL {
        for to in DType::ALL {
            // Through `from` first, so each pair sees in-range values.
            let mut src_bytes = vec![0u32; src.len()];
            let src_bytes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut src_bytes)
                [..src.len() * from.size_bytes()];
            cast(bytemuck::cast_slice(&src), DType::F32, src_bytes, from).unwrap();
            let mut dst = vec![0u32; src.len()];
            let dst_bytes =
                &mut bytemuck::cast_slice_mut::<u32, u8>(&mut dst)[..src.len() * to.size_bytes()];
            cast(src_bytes, from, dst_bytes, to).unwrap();
            let mut back = vec![0.0f32; src.len()];
            cast(
                dst_bytes,
                to,
                bytemuck::cast_slice_mut(&mut back),
                DType::F32,
            )
            .unwrap();
            for (i, (&b, &s)) in back.iter().zip(&src).enumerate() {
                let tol = if from == DType::F32 && to == DType::F32 {
                    0.0
                } else {
                    s.abs() / 64.0
                };
                assert!((b - s).abs() <= tol, "{from}->{to} element {i}: {b} vs {s}");
            }
        }
    }
}

#[test]
fn bad_arguments_are_errors() {
    let mut acc = vec![0.0f32; 8];
    let x = vec![bf16::ONE; 9];
    assert!(matches!(
        accumulate_f32(&mut acc, &x, 1.0),
        Err(Error::LengthMismatch {
            op: "accumulate",
            dst: 8,
            src: 9
        })
    ));
    assert!(matches!(
        accumulate_same(&mut acc, &[1.0; 7], 1.0),
        Err(Error::LengthMismatch { .. })
    ));
    let mut out = vec![f16::ZERO; 3];
    assert!(matches!(
        cast_typed(&acc, &mut out),
        Err(Error::LengthMismatch {
            op: "cast",
            dst: 3,
            src: 8
        })
    ));
    assert!(reference::accumulate(&mut acc, &x, 1.0).is_err());
    assert!(reference::cast(&acc, &mut out).is_err());

    // Aligned storage, then views that break the rules on purpose.
    let storage = vec![0u32; 16];
    let bytes: &[u8] = bytemuck::cast_slice(&storage);
    assert!(matches!(
        accumulate_into_f32(&mut acc, &bytes[1..33], DType::F32, 1.0),
        Err(Error::Misaligned {
            align: 4,
            dtype: DType::F32,
            ..
        })
    ));
    assert!(matches!(
        accumulate_into_f32(&mut acc, &bytes[1..17], DType::BF16, 1.0),
        Err(Error::Misaligned {
            align: 2,
            dtype: DType::BF16,
            what: "source",
            ..
        })
    ));
    assert!(matches!(
        accumulate_into_f32(&mut acc, &bytes[..31], DType::F32, 1.0),
        Err(Error::PartialElement { len: 31, .. })
    ));
    assert!(matches!(
        accumulate_into_f32(&mut acc, &bytes[..18], DType::F16, 1.0),
        Err(Error::LengthMismatch { dst: 8, src: 9, .. })
    ));
    accumulate_into_f32(&mut acc, &bytes[..16], DType::F16, 1.0).unwrap();
    accumulate_into_f32(&mut acc, &bytes[2..18], DType::BF16, 1.0).unwrap();

    let mut dst = vec![0u32; 16];
    let dst_bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut dst);
    assert!(matches!(
        cast(&bytes[..16], DType::BF16, &mut dst_bytes[2..34], DType::F32),
        Err(Error::Misaligned {
            what: "destination",
            ..
        })
    ));
    assert!(matches!(
        cast(&bytes[..16], DType::BF16, &mut dst_bytes[..15], DType::F16),
        Err(Error::PartialElement {
            what: "destination",
            ..
        })
    ));
    assert!(matches!(
        accumulate_bytes(
            &mut dst_bytes[1..17],
            DType::BF16,
            &bytes[..16],
            DType::BF16,
            1.0
        ),
        Err(Error::Misaligned { .. })
    ));
    assert!(matches!(
        accumulate_same_bytes(&mut dst_bytes[..16], &bytes[..32], DType::F16, 1.0),
        Err(Error::LengthMismatch {
            dst: 8,
            src: 16,
            ..
        })
    ));

    // Empty buffers are fine wherever they point.
    let mut empty: Vec<f32> = Vec::new();
    accumulate_into_f32(&mut empty, &[], DType::F32, 1.0).unwrap();
    accumulate_into_f32(&mut empty, &bytes[1..1], DType::F32, 1.0).unwrap();
    cast(&[], DType::F16, &mut [], DType::F32).unwrap();
    accumulate_same_bytes(&mut [], &[], DType::BF16, 2.0).unwrap();

    // Errors say what went wrong.
    let msg = accumulate_into_f32(&mut acc, &bytes[..31], DType::F32, 1.0)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("31 bytes") && msg.contains("f32"), "{msg}");
}

#[test]
fn copy_length_mismatch_is_an_error() {
    let mut dst = vec![0u8; 8];
    assert!(matches!(
        copy_bytes(&mut dst, &[1u8; 9]),
        Err(Error::LengthMismatch {
            op: "copy_bytes",
            dst: 8,
            src: 9
        })
    ));
    assert!(dst.iter().all(|&b| b == 0));
    copy_bytes(&mut [], &[]).unwrap();
}

#[test]
fn isa_is_cached_and_named() {
    let first = isa();
    assert_eq!(isa(), first);
    assert!(!first.name().is_empty());
    assert_eq!(first.to_string(), first.name());
}
