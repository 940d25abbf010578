//! The CUDA kernels as far as a machine without a GPU can check them: they
//! compile through NVRTC for every architecture ODC targets, the PTX has
//! every entry point and no fused multiply-add, and asking for a device
//! here is a typed error, never a panic.
//!
//! NVRTC comes from `make setup` (PyPI `nvidia-cuda-nvrtc` for CUDA 13 and
//! `nvidia-cuda-nvrtc-cu12` in the workspace `.venv`); without it these
//! tests skip, saying so. Set `ODC_REQUIRE_NVRTC=1` to make its absence a
//! failure instead (scripts/gpu-run.sh does).
#![cfg(feature = "cuda")]

use odc_kernels::cuda::{self, Arch};
use odc_kernels::{Error, Unavailable};

/// NVRTC's info, or `None` after printing why the test skips.
fn nvrtc_or_skip(test: &str) -> Option<cuda::NvrtcInfo> {
    match cuda::nvrtc::nvrtc() {
        Ok(info) => Some(info),
        Err(missing) => {
            assert!(
                std::env::var_os("ODC_REQUIRE_NVRTC").is_none(),
                "{test}: ODC_REQUIRE_NVRTC is set but {missing}"
            );
            eprintln!("SKIPPED {test}: {missing}");
            None
        }
    }
}

#[test]
fn every_kernel_compiles_to_ptx_for_sm80_and_sm90() {
    let Some(info) = nvrtc_or_skip("every_kernel_compiles_to_ptx_for_sm80_and_sm90") else {
        return;
    };
    eprintln!("NVRTC {:?} from {:?}", info.version, info.path);
    for (arch, target) in [("compute_80", "sm_80"), ("sm_90", "sm_90")] {
        let ptx = match cuda::compile_ptx(arch) {
            Ok(ptx) => ptx,
            Err(e) => panic!("{arch}: {e}"),
        };
        assert_eq!(ptx.target(), Some(target), "{arch}");
        assert_eq!(ptx.arch(), arch.parse::<Arch>().ok().unwrap_or(Arch::SM80));
        let entries = ptx.entries();
        for name in cuda::entries() {
            assert!(
                entries.contains(&name),
                "{arch}: no .entry {name} in {entries:?}"
            );
        }
        assert_eq!(entries.len(), cuda::entries().len(), "{arch}: {entries:?}");
        let text = ptx.text();
        // Multiply then add, each rounded: never contracted into an FMA.
        assert!(!text.contains("fma."), "{arch}: PTX contains an FMA");
        assert!(
            text.contains("mul.rn.f32") && text.contains("add.rn.f32"),
            "{arch}"
        );
        // Aligned operands move 16 bytes per load.
        assert!(
            text.contains("ld.global.v4."),
            "{arch}: no 16-byte vector loads"
        );
    }
}

#[test]
fn kernels_compile_to_cubin() {
    if nvrtc_or_skip("kernels_compile_to_cubin").is_none() {
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        let cubin = match cuda::compile_cubin(arch) {
            Ok(c) => c,
            Err(e) => panic!("{arch}: {e}"),
        };
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: not an ELF image");
    }
}

#[test]
fn unknown_architecture_is_an_error() {
    assert!(matches!(
        cuda::compile_ptx("gfx942"),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn nvrtc_is_found_in_the_workspace_venv() {
    // `make setup` installs the wheel; the lookup must find it without any
    // environment variable or loader path.
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = manifest.parent().unwrap_or(manifest).join(".venv");
    let expected = cuda::nvrtc::candidates()
        .into_iter()
        .find(|p| p.starts_with(&venv) && p.exists());
    let Some(expected) = expected else {
        eprintln!("SKIPPED nvrtc_is_found_in_the_workspace_venv: no NVRTC wheel in {venv:?}");
        return;
    };
    if [
        cuda::NVRTC_ENV,
        "VIRTUAL_ENV",
        odc_kernels::wheels::SITE_ENV,
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
    {
        eprintln!("SKIPPED nvrtc_is_found_in_the_workspace_venv: overridden by the environment");
        return;
    }
    let info = cuda::nvrtc::nvrtc();
    assert!(
        matches!(&info, Ok(i) if i.path.as_ref() == Some(&expected)),
        "{info:?}, expected {expected:?}"
    );
}

/// The point of `probe`: on any machine, a value or a typed reason.
#[test]
fn probe_names_what_is_missing_and_never_panics() {
    match cuda::probe() {
        Ok(info) => eprintln!("GPU present: {info:?}"),
        Err(Error::GpuUnavailable(missing)) => {
            let msg = missing.to_string();
            match &missing {
                Unavailable::NoDriver => {
                    assert!(!cuda::driver_is_present());
                    assert!(msg.contains("libcuda"), "{msg}");
                }
                Unavailable::NoDevice { reason } => assert!(!reason.is_empty()),
                Unavailable::NoNvrtc { tried } => assert!(!tried.is_empty()),
                other => panic!("unexpected {other:?}"),
            }
            eprintln!("no GPU here, as probe says: {msg}");
        }
        Err(other) => panic!("probe failed with an untyped error: {other}"),
    }
}

#[test]
fn kernels_without_a_device_are_a_typed_error() {
    match cuda::CudaKernels::new(0) {
        Ok(k) => eprintln!("GPU present: kernels loaded as {:?}", k.image()),
        Err(Error::GpuUnavailable(missing)) => eprintln!("CudaKernels::new(0): {missing}"),
        Err(other) => panic!("untyped error: {other}"),
    }
    // An ordinal no machine has is always a device error (or no driver).
    match cuda::CudaKernels::new(4096) {
        Err(Error::GpuUnavailable(Unavailable::NoDriver | Unavailable::NoDevice { .. })) => {}
        other => panic!("device 4096: {other:?}"),
    }
}
