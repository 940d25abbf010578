//! The block-scaled quantise / dequantise kernels (`quant.cu`): here, that
//! they compile through NVRTC for every architecture ODC targets with every
//! entry point, exact rounding (no FMA, correctly rounded division and
//! multiplies) and warp shuffles; on a GPU, that they match the host
//! kernels bit for bit (NaN payloads aside).
//!
//! Without NVRTC the compile tests skip, saying so (`ODC_REQUIRE_NVRTC=1`
//! makes that a failure); without a GPU the device tests skip
//! (`ODC_REQUIRE_GPU=1` makes that a failure), as in `cuda_compile.rs` and
//! `cuda_exact.rs`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::bf16;
use odc_kernels::cpu::quant::{self, Format, Spec};
use odc_kernels::cuda::quant::{compile_quant_cubin, compile_quant_ptx, quant_entries, CudaQuant};
use odc_kernels::cuda::{self, CudaSlice, CudaStream};
use odc_kernels::{DType, Error};

fn nvrtc_or_skip(test: &str) -> bool {
    match cuda::nvrtc::nvrtc() {
        Ok(_) => true,
        Err(missing) => {
            assert!(
                std::env::var_os("ODC_REQUIRE_NVRTC").is_none(),
                "{test}: ODC_REQUIRE_NVRTC is set but {missing}"
            );
            eprintln!("SKIPPED {test}: {missing}");
            false
        }
    }
}

#[test]
fn quant_kernels_compile_to_ptx_for_sm80_and_sm90() {
    if !nvrtc_or_skip("quant_kernels_compile_to_ptx_for_sm80_and_sm90") {
        return;
    }
    for (arch, target) in [("compute_80", "sm_80"), ("sm_90", "sm_90")] {
        let ptx = compile_quant_ptx(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(ptx.target(), Some(target), "{arch}");
        let entries = ptx.entries();
        let want = quant_entries();
        for name in &want {
            assert!(
                entries.contains(&name.as_str()),
                "{arch}: no .entry {name} in {entries:?}"
            );
        }
        assert_eq!(entries.len(), want.len(), "{arch}: {entries:?}");
        let text = ptx.text();
        assert!(!text.contains("fma."), "{arch}: PTX contains an FMA");
        for op in [
            "mul.rn.f32",
            "add.rn.f32",
            "div.rn.f32",
            "shfl.sync",
            "cvt.rni.s32.f32",
        ] {
            assert!(text.contains(op), "{arch}: no {op} in the PTX");
        }
        // No approximate division or flush to zero anywhere.
        assert!(!text.contains("div.approx"), "{arch}");
        assert!(!text.contains(".ftz."), "{arch}");
    }
}

#[test]
fn quant_kernels_compile_to_cubin() {
    if !nvrtc_or_skip("quant_kernels_compile_to_cubin") {
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        let cubin = compile_quant_cubin(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: not an ELF image");
    }
}

#[test]
fn quant_kernels_without_a_device_are_a_typed_error() {
    match CudaQuant::new(4096) {
        Err(Error::GpuUnavailable(_)) => {}
        other => panic!("device 4096: {other:?}"),
    }
}

// ---- on a GPU ----------------------------------------------------------------

fn quant_or_skip(test: &str) -> Option<(CudaQuant, Arc<CudaStream>)> {
    match CudaQuant::new(0) {
        Ok(q) => {
            let stream = q.context().default_stream();
            eprintln!("{test}: {} ({:?})", q.device().name, q.image());
            Some((q, stream))
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

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(3);
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            match i % 97 {
                5 => f32::NAN,
                9 => f32::INFINITY,
                13 => -0.0,
                _ => f32::from_bits((state & 0x807f_ffff) | ((105 + (state >> 24) % 30) << 23)),
            }
        })
        .collect()
}

fn upload(stream: &Arc<CudaStream>, bytes: &[u8]) -> CudaSlice<u8> {
    stream
        .clone_htod(bytes)
        .unwrap_or_else(|e| panic!("upload: {e}"))
}

fn download(stream: &Arc<CudaStream>, slice: &CudaSlice<u8>) -> Vec<u8> {
    stream
        .clone_dtoh(slice)
        .unwrap_or_else(|e| panic!("download: {e}"))
}

/// Equal f32 bits, or both NaN.
fn same_f32(what: &str, got: &[u8], want: &[f32]) {
    let got: &[f32] = bytemuck::cast_slice(got);
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: GPU {g}, CPU {w}"
        );
    }
}

#[test]
fn quant_kernels_match_the_host_bit_for_bit() {
    let Some((q, s)) = quant_or_skip("quant_kernels_match_the_host_bit_for_bit") else {
        return;
    };
    for format in Format::ALL {
        for block in [16usize, 32, 128] {
            let spec = Spec::new(format, block).unwrap_or_else(|e| panic!("{e}"));
            for n in [1usize, 31, 32, 33, 4099, 1 << 20] {
                let what = format!("{spec} n={n}");
                let x = values(n, n as u32);
                let mut p16 = vec![0u16; n];
                let mut want_p = vec![0u8; spec.payload_bytes(n)];
                let mut want_s = vec![0f32; spec.scales(n)];
                let want_p: Vec<u8> = if format == Format::Bf16 {
                    quant::quantise(spec, &x, bytemuck::cast_slice_mut(&mut p16), &mut want_s)
                        .unwrap_or_else(|e| panic!("{e}"));
                    bytemuck::cast_slice(&p16).to_vec()
                } else {
                    quant::quantise(spec, &x, &mut want_p, &mut want_s)
                        .unwrap_or_else(|e| panic!("{e}"));
                    want_p
                };

                let d_x = upload(&s, bytemuck::cast_slice(&x));
                let mut d_p = upload(&s, &vec![0u8; want_p.len()]);
                let mut d_s = upload(&s, &vec![0u8; 4 * want_s.len().max(1)]);
                let mut d_s_view = d_s.slice_mut(0..4 * want_s.len());
                q.quantise(&s, spec, &d_x, &mut d_p, &mut d_s_view)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let got_p = download(&s, &d_p);
                let got_s = download(&s, &d_s);
                if format == Format::Bf16 {
                    // NaN payloads may differ: compare as values.
                    let g: &[bf16] = bytemuck::cast_slice(&got_p);
                    let w: &[bf16] = bytemuck::cast_slice(&want_p);
                    for (i, (a, b)) in g.iter().zip(w).enumerate() {
                        assert!(a == b || (a.is_nan() && b.is_nan()), "{what}: payload {i}");
                    }
                } else {
                    assert_eq!(got_p, want_p, "{what}: payload");
                }
                same_f32(
                    &format!("{what}: scales"),
                    &got_s[..4 * want_s.len()],
                    &want_s,
                );

                let acc0 = values(n, 99);
                let mut want_acc = acc0.clone();
                quant::dequantise_accumulate(spec, &want_p, &want_s, &mut want_acc, 0.5)
                    .unwrap_or_else(|e| panic!("{e}"));
                let mut d_acc = upload(&s, bytemuck::cast_slice(&acc0));
                let d_sc = d_s.slice(0..4 * want_s.len());
                q.dequantise_accumulate(&s, spec, &d_p, &d_sc, &mut d_acc, 0.5)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                same_f32(
                    &format!("{what}: accumulate"),
                    &download(&s, &d_acc),
                    &want_acc,
                );

                let mut want_out = vec![0f32; n];
                quant::dequantise(spec, &want_p, &want_s, &mut want_out)
                    .unwrap_or_else(|e| panic!("{e}"));
                let mut d_out = upload(&s, &vec![0u8; 4 * n]);
                q.dequantise(&s, spec, &d_p, &d_sc, &mut d_out, DType::F32)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                same_f32(
                    &format!("{what}: dequantise"),
                    &download(&s, &d_out),
                    &want_out,
                );

                let mut want_b = vec![bf16::ZERO; n];
                quant::dequantise(spec, &want_p, &want_s, &mut want_b)
                    .unwrap_or_else(|e| panic!("{e}"));
                let mut d_b = upload(&s, &vec![0u8; 2 * n]);
                q.dequantise(&s, spec, &d_p, &d_sc, &mut d_b, DType::BF16)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let got_b = download(&s, &d_b);
                let g: &[bf16] = bytemuck::cast_slice(&got_b);
                for (i, (a, b)) in g.iter().zip(&want_b).enumerate() {
                    assert!(a == b || (a.is_nan() && b.is_nan()), "{what}: bf16 {i}");
                }

                // Error feedback's step: residual acc0, gradient x.
                let mut want_r = acc0.clone();
                let (mut fb_p, mut fb_s) = (vec![0u8; want_p.len()], vec![0f32; want_s.len()]);
                quant::feedback_quantise(spec, &mut want_r, &x, &mut fb_p, &mut fb_s)
                    .unwrap_or_else(|e| panic!("{e}"));
                let d_r = upload(&s, bytemuck::cast_slice(&acc0));
                let d_fp = upload(&s, &vec![0u8; want_p.len()]);
                let d_fs = upload(&s, &vec![0u8; 4 * want_s.len().max(1)]);
                {
                    use odc_kernels::cuda::cudarc::driver::DevicePtr;
                    let ((r, _r), (g, _g)) = (d_r.device_ptr(&s), d_x.device_ptr(&s));
                    let ((p, _p), (c, _c)) = (d_fp.device_ptr(&s), d_fs.device_ptr(&s));
                    // SAFETY: four live allocations of the sizes the
                    // format asks for n elements, on this stream.
                    unsafe { q.feedback_quantise_raw(&s, spec, r, g, p, c, n) }
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                same_f32(
                    &format!("{what}: feedback residual"),
                    &download(&s, &d_r),
                    &want_r,
                );
                if format != Format::Bf16 {
                    assert_eq!(download(&s, &d_fp), fb_p, "{what}: feedback payload");
                }
            }
        }
    }
}

#[test]
fn bad_device_buffers_are_errors() {
    let Some((q, s)) = quant_or_skip("bad_device_buffers_are_errors") else {
        return;
    };
    let spec = Spec::new(Format::Int8, 32).unwrap_or_else(|e| panic!("{e}"));
    let x = upload(&s, &[0u8; 4 * 64]);
    let mut p = upload(&s, &[0u8; 63]);
    let mut sc = upload(&s, &[0u8; 8]);
    assert!(matches!(
        q.quantise(&s, spec, &x, &mut p, &mut sc),
        Err(Error::InvalidArgument { .. })
    ));
    let mut d = upload(&s, &[0u8; 128]);
    let p = upload(&s, &[0u8; 64]);
    assert!(matches!(
        q.dequantise(&s, spec, &p, &sc, &mut d, DType::F16),
        Err(Error::InvalidArgument { .. })
    ));
}
