//! The formats against definitions written independently here (a nearest
//! search over every fp8 code, round-half-even by hand), every instruction
//! set against the portable path bit for bit, and error feedback's
//! bookkeeping.

use half::bf16;
use proptest::collection::vec;
use proptest::prelude::*;

use super::*;
use crate::cpu::Level;

const BLOCKS: [usize; 3] = [16, 32, 128];
const LENGTHS: [usize; 14] = [0, 1, 7, 15, 16, 17, 31, 32, 33, 127, 128, 129, 1000, 4099];

fn spec(format: Format, block: usize) -> Spec {
    Spec::new(format, block).unwrap_or_else(|e| panic!("{e}"))
}

fn ok<T>(r: Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// Deterministic values with a spread of magnitudes, and some specials.
fn values(n: usize, seed: u32, specials: bool) -> Vec<f32> {
    let special = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MAX,
        -f32::MIN_POSITIVE,
        1e-40,
        3.5,
        -2.5,
    ];
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(7);
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            if specials && i % 11 == 3 {
                special[(state as usize) % special.len()]
            } else {
                // Magnitudes from about 2^-20 to 2^8, both signs.
                let e = 107 + (state >> 24) % 28;
                f32::from_bits((state & 0x807f_ffff) | (e << 23))
            }
        })
        .collect()
}

/// The e4m3fn value of `code` from the format's definition.
fn fp8_value_by_definition(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((code >> 3) & 0xf);
    let m = f64::from(code & 7);
    if code & 0x7f == 0x7f {
        return f32::NAN;
    }
    let v = if e == 0 {
        m * 2f64.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    (sign * v) as f32
}

/// The nearest finite e4m3fn code to `x` (|x| <= 448), ties to the even
/// code, by searching every code.
fn fp8_nearest(x: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = f64::INFINITY;
    for code in 0u8..=0xff {
        let v = fp8_value_by_definition(code);
        if v.is_nan() || (v == 0.0 && v.is_sign_negative() != x.is_sign_negative()) {
            continue;
        }
        if v != 0.0 && v.is_sign_negative() != x.is_sign_negative() {
            continue;
        }
        let err = (f64::from(v) - f64::from(x)).abs();
        if err < best_err || (err == best_err && code & 1 == 0) {
            best = code;
            best_err = err;
        }
    }
    best
}

fn levels() -> Vec<Level> {
    Level::all()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn fp8_decode_matches_the_definition_for_every_code() {
    for code in 0u8..=0xff {
        let got = fp8_e4m3_to_f32(code);
        let want = fp8_value_by_definition(code);
        if want.is_nan() {
            assert!(got.is_nan(), "{code:#x}");
            assert_eq!(got.is_sign_negative(), code & 0x80 != 0, "{code:#x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{code:#x}: {got} vs {want}");
        }
    }
    assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
    assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
}

#[test]
fn fp8_encode_is_nearest_even_with_subnormals() {
    // Every code value, every midpoint between neighbours (ties), and
    // points just either side of each.
    let mut xs = Vec::new();
    for code in 0u8..0x7f {
        let v = fp8_e4m3_to_f32(code);
        let next = fp8_e4m3_to_f32(code + 1);
        let mid = if next.is_nan() {
            464.0
        } else {
            (v + next) / 2.0
        };
        for x in [
            v,
            mid,
            f32::from_bits(mid.to_bits() - 1),
            f32::from_bits(mid.to_bits() + 1),
        ] {
            xs.push(x);
            xs.push(-x);
        }
    }
    xs.extend(
        values(20_000, 5, false)
            .iter()
            .map(|v| v.clamp(-448.0, 448.0)),
    );
    for &x in &xs {
        if x.abs() > 464.0 {
            continue;
        }
        let got = fp8_e4m3_from_f32(x);
        assert_eq!(got, fp8_nearest(x), "x = {x:e} ({:#x})", x.to_bits());
    }
    // torch's cast: above 464 (rounding past 448), ±inf and NaN give NaN;
    // 464 itself is a tie and goes to the even code, 448.
    assert_eq!(fp8_e4m3_from_f32(464.0), 0x7e);
    for x in [464.00003f32, 470.0, 480.0, 1e6, f32::INFINITY, f32::NAN] {
        assert_eq!(fp8_e4m3_from_f32(x), 0x7f, "{x}");
        assert_eq!(fp8_e4m3_from_f32(-x), 0xff, "-{x}");
    }
    assert_eq!(fp8_e4m3_from_f32(463.99997), 0x7e);
}

#[test]
fn int8_rounds_half_to_even_and_saturates() {
    let s = spec(Format::Int8, 16);
    // amax 127 gives scale 1: codes are the rounded values themselves.
    let x = [
        127.0f32, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.4999998, 126.5, -126.5, 0.0, -0.0, 1e-30, 7.5,
        -7.5, 100.0,
    ];
    let want: [i8; 16] = [127, 0, 2, 2, 0, -2, -2, 3, 126, -126, 0, 0, 0, 8, -8, 100];
    for level in levels() {
        let mut payload = [0u8; 16];
        let mut scales = [0f32; 1];
        ok(quantise_on(level, s, &x, &mut payload, &mut scales));
        assert_eq!(scales[0], 1.0);
        let got: Vec<i8> = payload.iter().map(|&b| b as i8).collect();
        assert_eq!(got, want, "{:?}", level.0);
    }
}

#[test]
fn ties_round_to_even_on_every_level() {
    // Every midpoint between neighbouring fp8 codes (both signs), and every
    // int8 half-integer, with each block's maximum at qmax so the scale is 1.
    let mut fp8_ties = Vec::new();
    for code in 0u8..0x7e {
        let mid = (fp8_e4m3_to_f32(code) + fp8_e4m3_to_f32(code + 1)) / 2.0;
        fp8_ties.extend([mid, -mid]);
    }
    let int8_ties: Vec<f32> = (-127..127).map(|k| k as f32 + 0.5).collect();
    for (format, ties) in [(Format::Fp8E4m3, fp8_ties), (Format::Int8, int8_ties)] {
        let s = spec(format, 16);
        let qmax = format.qmax().unwrap_or(1.0);
        let mut x = Vec::new();
        for chunk in ties.chunks(15) {
            x.push(qmax);
            x.extend_from_slice(chunk);
        }
        let want: Vec<u8> = x
            .iter()
            .map(|&v| match format {
                Format::Fp8E4m3 => fp8_nearest(v),
                _ => (v.round_ties_even() as i8) as u8,
            })
            .collect();
        for level in levels() {
            let mut p = vec![0u8; x.len()];
            let mut sc = vec![0f32; s.scales(x.len())];
            ok(quantise_on(level, s, &x, &mut p, &mut sc));
            assert!(sc.iter().all(|&v| v == 1.0), "{format}");
            for (i, (&g, &w)) in p.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{format} on {:?}: x = {}", level.0, x[i]);
            }
        }
    }
}

#[test]
fn block_maximum_maps_to_the_largest_code() {
    for (format, top, bottom) in [
        (Format::Fp8E4m3, 0x7eu8, 0xfeu8),
        (Format::Int8, 127, (-127i8) as u8),
    ] {
        for block in BLOCKS {
            let s = spec(format, block);
            let mut x = values(3 * block + 5, 9, false);
            // The block maximum, positive in block 0, negative in block 1.
            x[3] = 1000.0;
            x[block + 7] = -1000.0;
            for level in levels() {
                let mut payload = vec![0u8; s.payload_bytes(x.len())];
                let mut scales = vec![0f32; s.scales(x.len())];
                ok(quantise_on(level, s, &x, &mut payload, &mut scales));
                assert_eq!(payload[3], top, "{format} {block}");
                assert_eq!(payload[block + 7], bottom, "{format} {block}");
                assert_eq!(scales[0], 1000.0 / format.qmax().unwrap_or(1.0));
                let mut back = vec![0f32; x.len()];
                ok(dequantise_on(level, s, &payload, &scales, &mut back));
                assert_eq!(back[3], scales[0] * format.qmax().unwrap_or(1.0));
            }
        }
    }
}

#[test]
fn zero_and_tiny_blocks_do_not_divide_by_zero() {
    for format in [Format::Fp8E4m3, Format::Int8] {
        let s = spec(format, 32);
        let mut x = vec![0.0f32; 96];
        x[1] = -0.0;
        // Block 1: tiny values whose amax / qmax is below f32's normal range.
        x[40] = 1e-40;
        x[41] = -3e-41;
        // Block 2: a NaN and an infinity among zeros: finite amax 0.
        x[70] = f32::NAN;
        x[71] = f32::NEG_INFINITY;
        for level in levels() {
            let mut payload = vec![0u8; 96];
            let mut scales = vec![9f32; 3];
            ok(quantise_on(level, s, &x, &mut payload, &mut scales));
            assert_eq!(scales[0], 0.0, "{format}");
            assert_eq!(scales[1], f32::MIN_POSITIVE, "{format}");
            assert_eq!(scales[2], 0.0, "{format}");
            let mut back = vec![0f32; 96];
            ok(dequantise_on(level, s, &payload, &scales, &mut back));
            assert!(back[..32].iter().all(|&v| v == 0.0));
            // At the floor scale, within half a code step of the input.
            for (b, v) in [(back[40], 1e-40f32), (back[41], -3e-41)] {
                assert!(
                    (b - v).abs() <= f32::MIN_POSITIVE / 2.0,
                    "{format}: {b} vs {v}"
                );
            }
            if format == Format::Fp8E4m3 {
                assert!(back[40] > 0.0 && back[41] < 0.0, "{:?}", &back[40..42]);
            }
            assert!(back[70].is_nan() && back[71].is_nan(), "{format}");
            assert!(back[64..70].iter().all(|&v| v == 0.0));
        }
    }
}

#[test]
fn non_finite_elements_travel_as_nan_and_spare_their_neighbours() {
    for format in [Format::Fp8E4m3, Format::Int8] {
        let s = spec(format, 16);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 - 7.0).collect();
        x[2] = f32::INFINITY;
        x[5] = f32::NAN;
        x[9] = f32::NEG_INFINITY;
        for level in levels() {
            let mut payload = [0u8; 16];
            let mut scales = [0f32; 1];
            ok(quantise_on(level, s, &x, &mut payload, &mut scales));
            // The scale comes from the finite values only (amax 8).
            assert_eq!(scales[0], 8.0 / format.qmax().unwrap_or(1.0), "{format}");
            match format {
                Format::Fp8E4m3 => {
                    assert_eq!([payload[2], payload[5], payload[9]], [0x7f, 0x7f, 0xff]);
                }
                _ => assert_eq!([payload[2], payload[5], payload[9]], [0x80; 3]),
            }
            let mut back = [0f32; 16];
            ok(dequantise_on(level, s, &payload, &scales, &mut back));
            for (i, (&b, &v)) in back.iter().zip(&x).enumerate() {
                if v.is_finite() {
                    assert!((b - v).abs() <= 8.0 / 16.0, "{format} {i}: {b} vs {v}");
                } else {
                    assert!(b.is_nan(), "{format} {i}");
                }
            }
        }
    }
    // bf16 keeps infinities.
    let s = spec(Format::Bf16, 16);
    let x = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1.0];
    let mut payload = [0u8; 8];
    ok(quantise(s, &x, &mut payload, &mut []));
    let mut back = [0f32; 4];
    ok(dequantise(s, &payload, &[], &mut back));
    assert_eq!(&back[..2], &[f32::INFINITY, f32::NEG_INFINITY]);
    assert!(back[2].is_nan());
    assert_eq!(back[3], 1.0);
}

#[test]
fn every_level_matches_the_portable_path_bit_for_bit() {
    for format in Format::ALL {
        for block in BLOCKS {
            let s = spec(format, block);
            for n in LENGTHS {
                let x = values(n, n as u32 + block as u32, true);
                let mut want_p = vec![0u8; s.payload_bytes(n)];
                let mut want_s = vec![0f32; s.scales(n)];
                // bf16 payloads need 2-byte alignment: build them in u16s.
                let mut p16 = vec![0u16; n];
                let want_p = if format == Format::Bf16 {
                    ok(reference::quantise(
                        s,
                        &x,
                        bytemuck::cast_slice_mut(&mut p16),
                        &mut want_s,
                    ));
                    bytemuck::cast_slice(&p16).to_vec()
                } else {
                    ok(reference::quantise(s, &x, &mut want_p, &mut want_s));
                    want_p
                };
                let acc0 = values(n, 77, false);
                let mut want_acc = acc0.clone();
                ok(reference::dequantise_accumulate(
                    s,
                    &want_p,
                    &want_s,
                    &mut want_acc,
                    0.25,
                ));
                let mut want_f32 = vec![0f32; n];
                ok(reference::dequantise(s, &want_p, &want_s, &mut want_f32));
                let mut want_bf16 = vec![bf16::ZERO; n];
                ok(reference::dequantise(s, &want_p, &want_s, &mut want_bf16));
                for level in levels() {
                    let what = format!("{s} n={n} on {:?}", level.0);
                    let mut p16 = vec![0u16; n];
                    let mut p8 = vec![0u8; s.payload_bytes(n)];
                    let mut sc = vec![0f32; s.scales(n)];
                    let p: &mut [u8] = if format == Format::Bf16 {
                        bytemuck::cast_slice_mut(&mut p16)
                    } else {
                        &mut p8
                    };
                    ok(quantise_on(level, s, &x, p, &mut sc));
                    assert_eq!(p, &want_p[..], "{what}: payload");
                    assert_eq!(bits(&sc), bits(&want_s), "{what}: scales");
                    let mut acc = acc0.clone();
                    ok(dequantise_accumulate_on(level, s, p, &sc, &mut acc, 0.25));
                    assert_eq!(bits(&acc), bits(&want_acc), "{what}: accumulate");
                    let mut out = vec![0f32; n];
                    ok(dequantise_on(level, s, p, &sc, &mut out));
                    assert_eq!(bits(&out), bits(&want_f32), "{what}: dequantise f32");
                    let mut out16 = vec![bf16::ZERO; n];
                    ok(dequantise_on(level, s, p, &sc, &mut out16));
                    let (g, w): (&[u16], &[u16]) = (
                        bytemuck::cast_slice(&out16),
                        bytemuck::cast_slice(&want_bf16),
                    );
                    assert_eq!(g, w, "{what}: dequantise bf16");
                }
            }
        }
    }
}

#[test]
fn dequantise_accumulate_is_dequantise_then_accumulate() {
    for format in [Format::Fp8E4m3, Format::Int8] {
        let s = spec(format, 32);
        let n = 1000;
        let x = values(n, 3, true);
        let mut p = vec![0u8; n];
        let mut sc = vec![0f32; s.scales(n)];
        ok(quantise(s, &x, &mut p, &mut sc));
        let acc0 = values(n, 4, false);
        let mut one_pass = acc0.clone();
        ok(dequantise_accumulate(s, &p, &sc, &mut one_pass, -0.5));
        let mut deq = vec![0f32; n];
        ok(dequantise(s, &p, &sc, &mut deq));
        let mut two_pass = acc0.clone();
        ok(crate::cpu::accumulate_f32(&mut two_pass, &deq, -0.5));
        assert_eq!(bits(&one_pass), bits(&two_pass), "{format}");
    }
}

#[test]
fn round_trip_error_is_within_half_a_step() {
    for block in BLOCKS {
        for format in [Format::Fp8E4m3, Format::Int8] {
            let s = spec(format, block);
            let n = 4099;
            let x = values(n, 11, false);
            let mut p = vec![0u8; n];
            let mut sc = vec![0f32; s.scales(n)];
            ok(quantise(s, &x, &mut p, &mut sc));
            let mut back = vec![0f32; n];
            ok(dequantise(s, &p, &sc, &mut back));
            for (i, (&b, &v)) in back.iter().zip(&x).enumerate() {
                let scale = f64::from(sc[i / block]);
                let err = (f64::from(b) - f64::from(v)).abs();
                let bound = match format {
                    // Half an integer step, plus the rounding of x · (1/scale).
                    Format::Int8 => scale * 0.5 * (1.0 + 1e-5),
                    // Half the step at v's binade (3 mantissa bits), or half
                    // the subnormal step.
                    _ => {
                        let q = f64::from(v).abs() / scale;
                        let step = if q < 2f64.powi(-6) {
                            2f64.powi(-9)
                        } else {
                            2f64.powi(q.log2().floor() as i32 - 3)
                        };
                        scale * step * 0.5 * (1.0 + 1e-5)
                    }
                };
                assert!(
                    err <= bound,
                    "{s} {i}: {v} -> {b} (err {err}, bound {bound})"
                );
            }
        }
    }
}

#[test]
fn bf16_format_is_the_crates_cast() {
    let s = spec(Format::Bf16, 32);
    let x = values(1000, 8, true);
    let mut p16 = vec![0u16; 1000];
    ok(quantise(s, &x, bytemuck::cast_slice_mut(&mut p16), &mut []));
    let mut want = vec![bf16::ZERO; 1000];
    ok(crate::cpu::reference::cast(&x, &mut want));
    let w: &[u16] = bytemuck::cast_slice(&want);
    assert_eq!(&p16[..], w);
    assert_eq!(s.scales(1000), 0);
    assert_eq!(s.chunk_bytes(1000), 2000);
}

#[test]
fn chunks_round_trip_and_bad_sizes_are_named() {
    let s = spec(Format::Int8, 32);
    let n = 100;
    let x = values(n, 2, false);
    assert_eq!(s.chunk_bytes(n), 4 * 4 + 100);
    let mut chunk = vec![0u32; s.chunk_bytes(n).div_ceil(4)];
    let bytes: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut chunk)[..s.chunk_bytes(n)];
    ok(quantise_chunk(s, &x, bytes));
    let mut acc = vec![0f32; n];
    ok(dequantise_accumulate_chunk(s, bytes, &mut acc, 1.0));
    let mut p = vec![0u8; n];
    let mut sc = vec![0f32; 4];
    ok(quantise(s, &x, &mut p, &mut sc));
    let mut want = vec![0f32; n];
    ok(dequantise(s, &p, &sc, &mut want));
    assert_eq!(bits(&acc), bits(&want));

    let e = dequantise_accumulate_chunk(s, &bytes[..50], &mut acc, 1.0);
    assert!(
        matches!(&e, Err(Error::InvalidArgument { detail, .. }) if detail.contains("chunk is 50 bytes")),
        "{e:?}"
    );
    let e = quantise(s, &x, &mut p[..99], &mut sc);
    assert!(
        matches!(&e, Err(Error::InvalidArgument { detail, .. }) if detail.contains("payload is 99 bytes")),
        "{e:?}"
    );
    let e = quantise(s, &x, &mut p, &mut sc[..3]);
    assert!(
        matches!(&e, Err(Error::InvalidArgument { detail, .. }) if detail.contains("3 scales")),
        "{e:?}"
    );
    let mut raw = vec![0u8; s.chunk_bytes(n) + 1];
    let start = usize::from(raw.as_ptr() as usize % 4 == 0);
    let e = quantise_chunk(s, &x, &mut raw[start..start + s.chunk_bytes(n)]);
    assert!(matches!(e, Err(Error::Misaligned { .. })), "{e:?}");
}

#[test]
fn specs_and_names() {
    for block in [0usize, 8, 33, MAX_BLOCK + 16] {
        let e = Spec::new(Format::Int8, block);
        assert!(
            matches!(&e, Err(Error::InvalidArgument { detail, .. }) if detail.contains("block size")),
            "{e:?}"
        );
    }
    for f in Format::ALL {
        assert_eq!(f.name().parse::<Format>().ok(), Some(f));
        assert_eq!(Format::from_code(f.code()).ok(), Some(f));
    }
    assert_eq!(
        "float8_e4m3fn".parse::<Format>().ok(),
        Some(Format::Fp8E4m3)
    );
    assert!("int4".parse::<Format>().is_err());
    assert!(Format::from_code(0).is_err());
    assert_eq!(spec(Format::Fp8E4m3, 128).to_string(), "fp8/128");
    assert_eq!(spec(Format::Fp8E4m3, 128).scales(129), 2);
}

#[test]
fn error_feedback_loses_nothing_over_a_run() {
    for format in Format::ALL {
        let s = spec(format, 32);
        let n = 1000;
        let mut fb = ErrorFeedback::new(s);
        ok(fb.register(7, n));
        let mut pushed = vec![0f64; n];
        let mut given = vec![0f64; n];
        // The only loss allowed: the f32 rounding of each grad + residual.
        let mut rounding = vec![0f64; n];
        let mut p16 = vec![0u16; n];
        let mut p8 = vec![0u8; n];
        let mut sc = vec![0f32; s.scales(n)];
        for step in 0..200u32 {
            let g = values(n, step + 1000, false);
            let before = fb.residual(7).map(<[f32]>::to_vec).unwrap_or_default();
            let p: &mut [u8] = if format == Format::Bf16 {
                bytemuck::cast_slice_mut(&mut p16)
            } else {
                &mut p8
            };
            ok(fb.push(7, 0, &g, p, &mut sc));
            let mut deq = vec![0f32; n];
            ok(dequantise(s, p, &sc, &mut deq));
            for i in 0..n {
                pushed[i] += f64::from(deq[i]);
                given[i] += f64::from(g[i]);
                let t = g[i] + before[i];
                rounding[i] += f64::from(t) - (f64::from(g[i]) + f64::from(before[i]));
            }
        }
        let held = fb.residual(7).map(<[f32]>::to_vec).unwrap_or_default();
        for i in 0..n {
            let lhs = pushed[i] + f64::from(held[i]);
            let rhs = given[i] + rounding[i];
            assert!(
                (lhs - rhs).abs() <= 1e-9 * given[i].abs().max(1.0),
                "{format} {i}: pushed + residual {lhs}, grads + f32 rounding {rhs}"
            );
        }
        // And the residual really carries something for the scaled formats.
        if format.scaled() {
            assert!(held.iter().any(|&r| r != 0.0));
        }
    }
}

/// `push_chunk` is `push` laid out as a chunk (scales, then payload), bit
/// for bit, residual included; a chunk of the wrong size leaves the
/// residual as it was.
#[test]
fn error_feedback_into_a_chunk_is_push_laid_out_as_a_chunk() {
    for format in Format::ALL {
        let s = spec(format, 32);
        let n = 300;
        let (mut a, mut b) = (ErrorFeedback::new(s), ErrorFeedback::new(s));
        ok(a.register(1, n));
        ok(b.register(1, n));
        let mut chunk = vec![0u32; s.chunk_bytes(n).div_ceil(4)];
        for step in 0..3u32 {
            let g = values(n, step + 77, false);
            let mut p16 = vec![0u16; n];
            let mut p8 = vec![0u8; n];
            let mut sc = vec![0f32; s.scales(n)];
            let p: &mut [u8] = if format == Format::Bf16 {
                bytemuck::cast_slice_mut(&mut p16)
            } else {
                &mut p8
            };
            ok(a.push(1, 0, &g, p, &mut sc));
            let bytes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut chunk)[..s.chunk_bytes(n)];
            ok(b.push_chunk(1, 0, &g, bytes));
            let mut want = bytemuck::cast_slice::<f32, u8>(&sc).to_vec();
            want.extend_from_slice(p);
            assert_eq!(bytes, &want[..], "{format}, step {step}");
            assert_eq!(a.residual(1), b.residual(1), "{format}, step {step}");
        }
        let kept = b.residual(1).map(<[f32]>::to_vec);
        let short = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut chunk)[..s.chunk_bytes(n) - 1];
        assert!(
            b.push_chunk(1, 0, &values(n, 5, false), short).is_err(),
            "{format}"
        );
        assert_eq!(b.residual(1).map(<[f32]>::to_vec), kept, "{format}");
    }
}

/// A push split in two (`fold` into the sum, plain `quantise_chunk`,
/// `settle_chunk`) gives what one `push` gives, codes and residual bit for
/// bit, non-finite elements included; quantising a grown sum again before
/// settling starts from the residual the sum began with (what a push of
/// the grown sum would do), where two pushes would not; a range outside
/// the bucket is refused and changes nothing.
#[test]
fn a_push_split_into_fold_and_settle_is_one_push() {
    for format in Format::ALL {
        let s = spec(format, 32);
        let (n, off) = (300, 40);
        let (mut one, mut two) = (ErrorFeedback::new(s), ErrorFeedback::new(s));
        ok(one.register(2, n + off));
        ok(two.register(2, n + off));
        let bytes = s.chunk_bytes(n);
        let mut a = vec![0u32; bytes.div_ceil(4)];
        let mut b = a.clone();
        for step in 0..4u32 {
            let mut g = values(n, step + 31, step == 2);
            if step == 1 {
                g[9] = f32::INFINITY;
            }
            let want = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut a)[..bytes];
            ok(one.push_chunk(2, off, &g, want));
            let mut sum = g.clone();
            ok(two.fold(2, off, &mut sum));
            assert!(
                two.residual(2).unwrap().iter().all(|&r| r == 0.0),
                "{format}: folded"
            );
            let got = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut b)[..bytes];
            ok(quantise_chunk(s, &sum, got));
            ok(two.settle_chunk(2, off, &sum, got));
            assert_eq!(got, want, "{format}, step {step}: codes");
            let (r1, r2) = (one.residual(2).unwrap(), two.residual(2).unwrap());
            assert!(
                r1.iter().zip(r2).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{format}, step {step}: residuals"
            );
            if step == 1 {
                assert_eq!(
                    r2[off + 9],
                    0.0,
                    "{format}: an infinite element leaves a zero residual"
                );
            }
        }
        // A sum quantised, grown, quantised again and then settled: what
        // was sent last plus the residual is the grown sum plus the
        // residual it started from, to f32 rounding. Two pushes instead
        // carry the first one's error into the second and lose the
        // residual started from.
        let (g, more) = (values(n, 91, false), values(n, 92, false));
        let r0 = two.residual(2).unwrap()[off..].to_vec();
        let mut sum = g.clone();
        ok(two.fold(2, off, &mut sum));
        let got = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut b)[..bytes];
        ok(quantise_chunk(s, &sum, got));
        for (x, y) in sum.iter_mut().zip(&more) {
            *x += y;
        }
        ok(quantise_chunk(s, &sum, got));
        ok(two.settle_chunk(2, off, &sum, got));
        let gap = |fb: &ErrorFeedback, chunk: &[u8]| {
            let mut sent = vec![0f32; n];
            ok(dequantise_accumulate_chunk(s, chunk, &mut sent, 1.0));
            let held = &fb.residual(2).unwrap()[off..];
            (0..n)
                .map(|i| {
                    let want = f64::from(g[i]) + f64::from(more[i]) + f64::from(r0[i]);
                    (f64::from(sent[i]) + f64::from(held[i]) - want).abs()
                })
                .fold(0f64, f64::max)
        };
        let peak = g.iter().chain(&more).fold(0f32, |m, x| m.max(x.abs()));
        let split = gap(&two, got);
        assert!(
            split <= 1e-6 * f64::from(peak),
            "{format}: split gap {split:e}"
        );
        let mut twice = one.clone();
        let grown: Vec<f32> = g.iter().zip(&more).map(|(x, y)| x + y).collect();
        let w = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut a)[..bytes];
        ok(twice.push_chunk(2, off, &g, w));
        ok(twice.push_chunk(2, off, &grown, w));
        let pushed = gap(&twice, w);
        assert!(
            pushed > 100.0 * split.max(1e-7),
            "{format}: two pushes {pushed:e}, split {split:e}"
        );
        // Out of range: refused, nothing changed.
        let (kept, mut acc) = (two.residual(2).map(<[f32]>::to_vec), g.clone());
        assert!(two.fold(2, off + 1, &mut acc).is_err(), "{format}");
        assert!(two.fold(3, 0, &mut acc).is_err(), "{format}");
        assert_eq!(acc, g, "{format}");
        assert!(two.settle_chunk(2, off + 1, &sum, got).is_err(), "{format}");
        assert!(
            two.settle_chunk(2, off, &sum, &got[..bytes - 1]).is_err(),
            "{format}"
        );
        assert_eq!(two.residual(2).map(<[f32]>::to_vec), kept, "{format}");
    }
}

/// A push over many tiles (lengths around the tile, blocks that do and do
/// not divide it, non-finite elements) is the untiled arithmetic bit for
/// bit: add, quantise, subtract the dequantised, zero the non-finite.
#[test]
fn a_push_is_the_untiled_arithmetic_over_any_length() {
    for format in Format::ALL {
        for block in [16, 32, 48, 4096, 6144, MAX_BLOCK] {
            let s = spec(format, block);
            for n in [1, 4095, 4096, 4097, 3 * 4096 + 37, 70_001] {
                let g = values(n, (n + block) as u32, true);
                let r0 = values(n, 7 + n as u32, false);
                let (mut want_r, mut want_p, mut want_s) = (
                    r0.clone(),
                    vec![0u8; s.payload_bytes(n)],
                    vec![0f32; s.scales(n)],
                );
                ok(crate::cpu::accumulate(&mut want_r, &g, 1.0));
                ok(quantise(s, &want_r, &mut want_p, &mut want_s));
                ok(dequantise_accumulate(
                    s,
                    &want_p,
                    &want_s,
                    &mut want_r,
                    -1.0,
                ));
                want_r
                    .iter_mut()
                    .filter(|r| !r.is_finite())
                    .for_each(|r| *r = 0.0);
                let (mut r, mut p, mut sc) = (
                    r0.clone(),
                    vec![0u8; s.payload_bytes(n)],
                    vec![0f32; s.scales(n)],
                );
                ok(feedback_quantise(s, &mut r, &g, &mut p, &mut sc));
                let what = format!("{format}, block {block}, {n} elements");
                assert_eq!(p, want_p, "{what}: codes");
                assert!(
                    sc.iter()
                        .zip(&want_s)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: scales"
                );
                assert!(
                    r.iter()
                        .zip(&want_r)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: residual"
                );
            }
        }
    }
}

#[test]
fn feedback_on_caller_memory_is_error_feedback_push() {
    for format in Format::ALL {
        let s = spec(format, 32);
        let n = 300;
        let mut fb = ErrorFeedback::new(s);
        ok(fb.register(4, n));
        let mut residual = vec![0f32; n];
        let mut chunk = vec![0u32; s.chunk_bytes(n).div_ceil(4)];
        let mut want = chunk.clone();
        for step in 0..3u32 {
            let mut g = values(n, step + 11, false);
            g[7] = f32::INFINITY;
            let got = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut chunk)[..s.chunk_bytes(n)];
            ok(feedback_quantise_chunk(s, &mut residual, &g, got));
            let w = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut want)[..s.chunk_bytes(n)];
            ok(fb.push_chunk(4, 0, &g, w));
            assert_eq!(got, w, "{format}, step {step}");
            assert_eq!(Some(&residual[..]), fb.residual(4), "{format}, step {step}");
            assert_eq!(
                residual[7], 0.0,
                "{format}: an infinite element leaves a zero residual"
            );
        }
        // A residual of another length is refused and left as it was.
        let kept = residual.clone();
        let bytes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut chunk)[..s.chunk_bytes(n - 1)];
        let e = feedback_quantise_chunk(s, &mut residual, &values(n - 1, 3, false), bytes);
        assert!(e.is_err_and(|e| e.to_string().contains("a residual of 300 elements")));
        assert_eq!(residual, kept, "{format}");
    }
}

#[test]
fn error_feedback_is_deterministic_and_checks_its_arguments() {
    let s = spec(Format::Fp8E4m3, 32);
    let run = || {
        let mut fb = ErrorFeedback::new(s);
        ok(fb.register(0, 300));
        let mut out = Vec::new();
        for step in 0..20 {
            let g = values(100, step, false);
            let mut p = vec![0u8; 100];
            let mut sc = vec![0f32; 4];
            ok(fb.push(0, 100, &g, &mut p, &mut sc));
            out.extend(p);
            out.extend(bytemuck::cast_slice::<f32, u8>(&sc).to_vec());
        }
        (out, fb.residual(0).map(bits))
    };
    assert_eq!(run(), run());

    let mut fb = ErrorFeedback::new(s);
    ok(fb.register(0, 64));
    assert!(fb.register(0, 64).is_ok());
    assert!(matches!(
        fb.register(0, 65),
        Err(Error::InvalidArgument { .. })
    ));
    let g = [1.0f32; 32];
    let (mut p, mut sc) = ([0u8; 32], [0f32; 1]);
    assert!(matches!(
        fb.push(1, 0, &g, &mut p, &mut sc),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        fb.push(0, 40, &g, &mut p, &mut sc),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        fb.push(0, 0, &g, &mut p[..31], &mut sc),
        Err(Error::InvalidArgument { .. })
    ));
    // A failed push leaves the residual as it was.
    assert!(fb.residual(0).is_some_and(|r| r.iter().all(|&v| v == 0.0)));

    // A non-finite element is pushed as NaN and leaves no residual.
    let mut g = values(32, 1, false);
    g[4] = f32::INFINITY;
    g[5] = f32::NAN;
    ok(fb.push(0, 0, &g, &mut p, &mut sc));
    assert_eq!([p[4], p[5]], [0x7f, 0x7f]);
    let r = fb.residual(0).map(<[f32]>::to_vec).unwrap_or_default();
    assert_eq!([r[4], r[5]], [0.0, 0.0]);
    assert!(r.iter().all(|v| v.is_finite()));
    fb.clear();
    assert!(fb.residual(0).is_some_and(|r| r.iter().all(|&v| v == 0.0)));
}

proptest! {
    #[test]
    fn raw_bits_match_the_portable_path(raw in vec(any::<u32>(), 0..300), block_i in 0usize..3) {
        let x: Vec<f32> = raw.iter().map(|&b| f32::from_bits(b)).collect();
        let n = x.len();
        for format in [Format::Fp8E4m3, Format::Int8] {
            let s = spec(format, BLOCKS[block_i]);
            let mut want_p = vec![0u8; n];
            let mut want_s = vec![0f32; s.scales(n)];
            ok(reference::quantise(s, &x, &mut want_p, &mut want_s));
            for level in levels() {
                let mut p = vec![0u8; n];
                let mut sc = vec![0f32; s.scales(n)];
                ok(quantise_on(level, s, &x, &mut p, &mut sc));
                prop_assert_eq!(&p, &want_p);
                prop_assert_eq!(bits(&sc), bits(&want_s));
                let mut acc = vec![1.0f32; n];
                let mut want_acc = vec![1.0f32; n];
                ok(dequantise_accumulate_on(level, s, &p, &sc, &mut acc, 1.0));
                ok(reference::dequantise_accumulate(s, &want_p, &want_s, &mut want_acc, 1.0));
                prop_assert_eq!(bits(&acc), bits(&want_acc));
            }
        }
    }
}
