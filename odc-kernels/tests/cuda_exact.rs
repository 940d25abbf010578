//! GPU-only: the CUDA kernels against the CPU reference, bit for bit, on a
//! device. Without a driver or a device every test prints what is missing
//! and passes (skips); `scripts/gpu-run.sh` sets `ODC_REQUIRE_GPU=1`,
//! which makes a missing GPU a failure.
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use odc_kernels::cpu::reference;
use odc_kernels::cuda::{CudaKernels, CudaSlice, CudaStream};
use odc_kernels::{DType, Element, Error};
use std::sync::Arc;

fn kernels_or_skip(test: &str) -> Option<(CudaKernels, Arc<CudaStream>)> {
    match CudaKernels::new(0) {
        Ok(k) => {
            let stream = k.context().default_stream();
            eprintln!(
                "{test}: {} ({}), {:?}",
                k.device().name,
                k.device().arch,
                k.image()
            );
            Some((k, stream))
        }
        Err(Error::GpuUnavailable(missing)) => {
            assert!(
                std::env::var_os("ODC_REQUIRE_GPU").is_none(),
                "{test}: ODC_REQUIRE_GPU is set but {missing}"
            );
            eprintln!("SKIPPED {test}: needs a GPU: {missing}");
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

/// Values that exercise every rounding path: ties, subnormals of both
/// half types, overflow, infinities, NaN, signed zeros, plus a ramp.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let specials = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        65504.0,
        65520.0,
        1e-7,
        6e-8,
        3e-8,
        1e-40,
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(0x3f80_8000), // bf16 tie, even
        f32::from_bits(0x3f81_8000), // bf16 tie, odd
        f32::from_bits(0x3f80_1000), // f16 tie
        f32::from_bits(0x3f80_3000),
    ];
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|i| {
            if i % 7 == 0 {
                specials[(i / 7) % specials.len()]
            } else {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                // Mostly ordinary magnitudes, some huge and tiny.
                let e = (state >> 24) % 40;
                let bits = (state & 0x807f_ffff) | ((107 + e) << 23);
                f32::from_bits(bits)
            }
        })
        .collect()
}

fn to_bytes<T: Element>(v: &[f32]) -> Vec<u8> {
    let typed: Vec<T> = v.iter().map(|&x| reference::from_f32::<T>(x)).collect();
    bytemuck::cast_slice(&typed).to_vec()
}

/// Equal bits, or both NaN (the GPU returns the canonical NaN).
fn assert_same<T: Element>(what: &str, got: &[u8], want: &[u8]) {
    let got: &[T] = bytemuck::cast_slice(got);
    let want: &[T] = bytemuck::cast_slice(want);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (gf, wf) = (g.to_f32(), w.to_f32());
        let same = bytemuck::bytes_of(g) == bytemuck::bytes_of(w) || (gf.is_nan() && wf.is_nan());
        assert!(
            same,
            "{what}: element {i}: GPU {g:?} ({gf}), CPU {w:?} ({wf})"
        );
    }
}

fn upload(stream: &Arc<CudaStream>, bytes: &[u8]) -> CudaSlice<u8> {
    match stream.clone_htod(bytes) {
        Ok(s) => s,
        Err(e) => panic!("upload: {e}"),
    }
}

fn download(stream: &Arc<CudaStream>, slice: &CudaSlice<u8>) -> Vec<u8> {
    match stream.clone_dtoh(slice) {
        Ok(v) => v,
        Err(e) => panic!("download: {e}"),
    }
}

fn check_accumulate<A: Element, X: Element>(k: &CudaKernels, stream: &Arc<CudaStream>) {
    // Lengths that hit the vector body only, the tail only, and both; an
    // offset of one element forces the unaligned path.
    for n in [0usize, 1, 7, 8, 1000, 4096 + 5, 1 << 20] {
        for offset in [0usize, 1] {
            for scale in [1.0f32, 0.5, -3.0, 1e-3] {
                let acc0 = values(n + offset, 1);
                let x0 = values(n + offset, 2);
                let acc_bytes = to_bytes::<A>(&acc0);
                let x_bytes = to_bytes::<X>(&x0);
                let mut want: Vec<A> = bytemuck::cast_slice(&acc_bytes).to_vec();
                let xs: Vec<X> = bytemuck::cast_slice(&x_bytes).to_vec();
                reference::accumulate(&mut want[offset..], &xs[offset..], scale)
                    .unwrap_or_else(|e| panic!("{e}"));

                let mut d_acc = upload(stream, &acc_bytes);
                let d_x = upload(stream, &x_bytes);
                let (a0, x0b) = (
                    offset * A::DTYPE.size_bytes(),
                    offset * X::DTYPE.size_bytes(),
                );
                {
                    let mut acc_view = d_acc.slice_mut(a0..);
                    let x_view = d_x.slice(x0b..);
                    k.accumulate(stream, &mut acc_view, A::DTYPE, &x_view, X::DTYPE, scale)
                        .unwrap_or_else(|e| panic!("{e}"));
                }
                let got = download(stream, &d_acc);
                let what = format!(
                    "accumulate {} += {} * {}, n={n} offset={offset}",
                    A::DTYPE,
                    scale,
                    X::DTYPE
                );
                assert_same::<A>(&what, &got, bytemuck::cast_slice(&want));
            }
        }
    }
}

fn check_cast<S: Element, D: Element>(k: &CudaKernels, stream: &Arc<CudaStream>) {
    for n in [0usize, 3, 16, 4099, 1 << 20] {
        for offset in [0usize, 1] {
            let src_bytes = to_bytes::<S>(&values(n + offset, 3));
            let src: Vec<S> = bytemuck::cast_slice(&src_bytes).to_vec();
            let mut want = vec![D::default(); n];
            reference::cast(&src[offset..], &mut want).unwrap_or_else(|e| panic!("{e}"));

            let d_src = upload(stream, &src_bytes);
            let mut d_dst = upload(stream, &vec![0u8; n * D::DTYPE.size_bytes()]);
            let src_view = d_src.slice(offset * S::DTYPE.size_bytes()..);
            k.cast(stream, &src_view, S::DTYPE, &mut d_dst, D::DTYPE)
                .unwrap_or_else(|e| panic!("{e}"));
            let got = download(stream, &d_dst);
            let what = format!("cast {} -> {}, n={n} offset={offset}", S::DTYPE, D::DTYPE);
            assert_same::<D>(&what, &got, bytemuck::cast_slice(&want));
        }
    }
}

#[test]
fn accumulate_matches_cpu_reference_bit_for_bit() {
    let Some((k, s)) = kernels_or_skip("accumulate_matches_cpu_reference_bit_for_bit") else {
        return;
    };
    check_accumulate::<f32, f32>(&k, &s);
    check_accumulate::<f32, bf16>(&k, &s);
    check_accumulate::<f32, f16>(&k, &s);
    check_accumulate::<bf16, bf16>(&k, &s);
    check_accumulate::<f16, f16>(&k, &s);
    check_accumulate::<bf16, f32>(&k, &s);
    check_accumulate::<bf16, f16>(&k, &s);
    check_accumulate::<f16, f32>(&k, &s);
    check_accumulate::<f16, bf16>(&k, &s);
}

#[test]
fn cast_matches_cpu_reference_bit_for_bit() {
    let Some((k, s)) = kernels_or_skip("cast_matches_cpu_reference_bit_for_bit") else {
        return;
    };
    check_cast::<f32, bf16>(&k, &s);
    check_cast::<f32, f16>(&k, &s);
    check_cast::<bf16, f32>(&k, &s);
    check_cast::<bf16, f16>(&k, &s);
    check_cast::<f16, f32>(&k, &s);
    check_cast::<f16, bf16>(&k, &s);
    check_cast::<f32, f32>(&k, &s);
    check_cast::<bf16, bf16>(&k, &s);
}

#[test]
fn bad_device_buffers_are_errors() {
    let Some((k, s)) = kernels_or_skip("bad_device_buffers_are_errors") else {
        return;
    };
    let mut acc = upload(&s, &[0u8; 64]);
    let x = upload(&s, &[0u8; 30]);
    assert!(matches!(
        k.accumulate(&s, &mut acc, DType::F32, &x, DType::BF16, 1.0),
        Err(Error::LengthMismatch { .. })
    ));
    let odd = upload(&s, &[0u8; 33]);
    assert!(matches!(
        k.accumulate(&s, &mut acc, DType::F32, &odd, DType::BF16, 1.0),
        Err(Error::PartialElement { .. })
    ));
    let x = upload(&s, &[0u8; 34]);
    let view = x.slice(1..33);
    assert!(matches!(
        k.accumulate(
            &s,
            &mut acc.slice_mut(0..64),
            DType::F32,
            &view,
            DType::BF16,
            1.0
        ),
        Err(Error::Misaligned { .. })
    ));
}
