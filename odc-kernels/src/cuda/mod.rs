//! CUDA kernels: the [`cpu`](crate::cpu) accumulate and casts for device
//! memory, compiled at run time through NVRTC.
//!
//! The source is [`SOURCE`] (`kernels.cu`, embedded): self-contained, no
//! CUDA header, with the bf16 / f16 conversions written bit by bit as
//! [`cpu::reference`](crate::cpu::reference) defines them, and
//! `acc + scale * x` as `__fmul_rn` then `__fadd_rn` (never an FMA), so a
//! device result is bit-identical to the host one (NaN payloads aside: the
//! GPU returns its canonical NaN where IEEE 754 leaves the payload open).
//!
//! Nothing here links CUDA: cudarc loads the driver and NVRTC on first use.
//! Every entry point first checks they are there and returns
//! [`Error::GpuUnavailable`] naming what is missing ([`Unavailable`]), so
//! this module is safe to call on any machine:
//!
//! - [`compile_ptx`] needs only NVRTC (no driver, no GPU);
//! - [`probe`] reports the driver, the device and NVRTC;
//! - [`CudaKernels`] loads the module on a device and launches one kernel
//!   per landing slot or cast on a caller's stream.
//!
//! This module owns kernels and their launch; it knows nothing of regions,
//! transports or landing-slot descriptors.

use std::fmt;
use std::str::FromStr;

use cudarc::driver::{result as cu, sys as cusys};

use crate::{DType, Error, Result, Unavailable};

mod launch;
pub mod nvrtc;
pub mod quant;

pub use cudarc;
pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut};
pub use launch::{CudaKernels, Image};
pub use nvrtc::{NvrtcInfo, NVRTC_ENV};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Name of the kernel for `acc += scale * x` with these dtypes.
pub const fn accumulate_entry(acc: DType, x: DType) -> &'static str {
    use DType::*;
    match (acc, x) {
        (F32, F32) => "odc_accumulate_f32_f32",
        (F32, BF16) => "odc_accumulate_f32_bf16",
        (F32, F16) => "odc_accumulate_f32_f16",
        (BF16, F32) => "odc_accumulate_bf16_f32",
        (BF16, BF16) => "odc_accumulate_bf16_bf16",
        (BF16, F16) => "odc_accumulate_bf16_f16",
        (F16, F32) => "odc_accumulate_f16_f32",
        (F16, BF16) => "odc_accumulate_f16_bf16",
        (F16, F16) => "odc_accumulate_f16_f16",
    }
}

/// Name of the kernel casting `src` to `dst`, or `None` when they are the
/// same dtype (a same-dtype cast is a byte copy, as on the CPU).
pub const fn cast_entry(src: DType, dst: DType) -> Option<&'static str> {
    use DType::*;
    match (src, dst) {
        (F32, BF16) => Some("odc_cast_f32_to_bf16"),
        (F32, F16) => Some("odc_cast_f32_to_f16"),
        (BF16, F32) => Some("odc_cast_bf16_to_f32"),
        (BF16, F16) => Some("odc_cast_bf16_to_f16"),
        (F16, F32) => Some("odc_cast_f16_to_f32"),
        (F16, BF16) => Some("odc_cast_f16_to_bf16"),
        (F32, F32) | (BF16, BF16) | (F16, F16) => None,
    }
}

/// Every kernel entry point in [`SOURCE`].
pub fn entries() -> Vec<&'static str> {
    let mut out = Vec::new();
    for acc in DType::ALL {
        for x in DType::ALL {
            out.push(accumulate_entry(acc, x));
        }
    }
    for src in DType::ALL {
        for dst in DType::ALL {
            out.extend(cast_entry(src, dst));
        }
    }
    out
}

/// A GPU architecture: compute capability `major.minor` (8.0 is A100, 9.0
/// H100). Parsed from `"sm_90"`, `"compute_90"`, `"90"` or `"9.0"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    /// Compute capability major version.
    pub major: u32,
    /// Compute capability minor version.
    pub minor: u32,
}

impl Arch {
    /// Ampere data center (A100).
    pub const SM80: Arch = Arch { major: 8, minor: 0 };
    /// Hopper (H100, H200).
    pub const SM90: Arch = Arch { major: 9, minor: 0 };

    /// The virtual architecture name (`compute_90`), PTX's target.
    pub fn compute(self) -> String {
        format!("compute_{}{}", self.major, self.minor)
    }

    /// The real architecture name (`sm_90`), as PTX's `.target` says it.
    pub fn sm(self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.sm())
    }
}

impl FromStr for Arch {
    type Err = Error;

    fn from_str(s: &str) -> Result<Arch> {
        let bad = || Error::InvalidArgument {
            op: "Arch::from_str",
            detail: format!(
                "{s:?} is not a GPU architecture (expected sm_80, compute_90, 90 or 9.0)"
            ),
        };
        let t = s.trim().to_ascii_lowercase();
        let digits = t
            .strip_prefix("sm_")
            .or_else(|| t.strip_prefix("compute_"))
            .unwrap_or(&t);
        let (major, minor) = match digits.split_once('.') {
            Some((a, b)) => (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?),
            None if digits.len() >= 2 && digits.bytes().all(|b| b.is_ascii_digit()) => {
                let (a, b) = digits.split_at(digits.len() - 1);
                (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?)
            }
            None => return Err(bad()),
        };
        if !(3..=20).contains(&major) || minor > 9 {
            return Err(bad());
        }
        Ok(Arch { major, minor })
    }
}

/// Kernels compiled to PTX for one virtual architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ptx {
    arch: Arch,
    text: String,
}

impl Ptx {
    /// The architecture it was compiled for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The PTX assembly.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The `.target` directive's value (`sm_90`).
    pub fn target(&self) -> Option<&str> {
        self.text
            .lines()
            .find_map(|l| l.trim().strip_prefix(".target "))
            .map(|t| t.split([',', ' ']).next().unwrap_or(t).trim())
    }

    /// The names of the `.entry` points (kernels) it defines.
    pub fn entries(&self) -> Vec<&str> {
        self.text
            .lines()
            .filter_map(|l| l.split(".entry ").nth(1))
            .map(|rest| rest.split(['(', ' ']).next().unwrap_or(rest).trim())
            .collect()
    }
}

/// Compiles [`SOURCE`] to PTX for `arch` (`"sm_80"`, `"compute_90"`, ...).
/// Needs NVRTC only: works on machines without a GPU.
///
/// Errors: [`Error::InvalidArgument`] for an unknown architecture,
/// [`Error::GpuUnavailable`] without NVRTC, [`Error::Nvrtc`] when NVRTC
/// rejects the source (with its log).
pub fn compile_ptx(arch: &str) -> Result<Ptx> {
    let arch: Arch = arch.parse()?;
    let bytes = nvrtc::compile(SOURCE, arch, nvrtc::Output::Ptx)?;
    Ok(Ptx {
        arch,
        text: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

/// Compiles [`SOURCE`] to machine code (CUBIN) for `arch`; what
/// [`CudaKernels`] loads. Needs NVRTC only.
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>> {
    nvrtc::compile(SOURCE, arch.parse()?, nvrtc::Output::Cubin)
}

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's ordinal.
    pub ordinal: usize,
    /// Its name (`"NVIDIA H100 80GB HBM3"`).
    pub name: String,
    /// Its architecture.
    pub arch: Arch,
    /// Its memory, in bytes.
    pub total_mem: usize,
    /// Its streaming multiprocessors.
    pub multiprocessors: u32,
    /// Devices the driver sees.
    pub device_count: usize,
    /// The driver's CUDA version, `1000 * major + 10 * minor` (12080).
    pub driver_version: i32,
    /// The NVRTC kernels compile with.
    pub nvrtc: NvrtcInfo,
}

/// Checks, from the bottom up, that device 0 can run the kernels: the
/// driver library, a device, NVRTC. Never panics.
///
/// Errors: [`Error::GpuUnavailable`] naming the first thing missing
/// ([`Unavailable::NoDriver`], [`Unavailable::NoDevice`],
/// [`Unavailable::NoNvrtc`]), [`Error::Cuda`] if a present driver fails.
pub fn probe() -> Result<DeviceInfo> {
    probe_device(0)
}

/// [`probe`] for device `ordinal`.
pub fn probe_device(ordinal: usize) -> Result<DeviceInfo> {
    let (dev, device_count, driver_version) = device(ordinal)?;
    let nvrtc = nvrtc::nvrtc()?;
    let attr = |a: cusys::CUdevice_attribute, what: &str| {
        // SAFETY: `dev` came from cuDeviceGet on an initialized driver.
        unsafe { cu::device::get_attribute(dev, a) }
            .map_err(|e| cuda_error(format!("cuDeviceGetAttribute({what})"), e))
    };
    use cusys::CUdevice_attribute as A;
    let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "major")?;
    let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "minor")?;
    let sms = attr(
        A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        "multiprocessors",
    )?;
    let name = cu::device::get_name(dev).map_err(|e| cuda_error("cuDeviceGetName", e))?;
    // SAFETY: as above.
    let total_mem =
        unsafe { cu::device::total_mem(dev) }.map_err(|e| cuda_error("cuDeviceTotalMem", e))?;
    Ok(DeviceInfo {
        ordinal,
        name,
        arch: Arch {
            major: u32::try_from(major).unwrap_or(0),
            minor: u32::try_from(minor).unwrap_or(0),
        },
        total_mem,
        multiprocessors: u32::try_from(sms).unwrap_or(1).max(1),
        device_count,
        driver_version,
        nvrtc,
    })
}

/// Whether the CUDA driver library can be loaded here.
pub fn driver_is_present() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // SAFETY: probes cudarc's candidate names with dlopen and closes them;
    // nothing in the library is called.
    *PRESENT.get_or_init(|| unsafe { cusys::is_culib_present() })
}

/// Initializes the driver and returns device `ordinal`, the device count and
/// the driver version, or what is missing.
pub(crate) fn device(ordinal: usize) -> Result<(cusys::CUdevice, usize, i32)> {
    if !driver_is_present() {
        return Err(Unavailable::NoDriver.into());
    }
    cu::init().map_err(|e| Unavailable::NoDevice {
        reason: format!("cuInit: {}", driver_error_text(e)),
    })?;
    let mut driver_version = 0;
    // SAFETY: the driver is loaded and initialized; the out-pointer is valid.
    unsafe { cusys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(|e| cuda_error("cuDriverGetVersion", e))?;
    let count = cu::device::get_count().map_err(|e| cuda_error("cuDeviceGetCount", e))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(Unavailable::NoDevice {
            reason: format!("device {ordinal} requested, the driver sees {count}"),
        }
        .into());
    }
    let dev = cu::device::get(ordinal as i32).map_err(|e| cuda_error("cuDeviceGet", e))?;
    Ok((dev, count, driver_version))
}

fn driver_error_text(e: cu::DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let msg = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{name} ({msg})")
}

pub(crate) fn cuda_error(call: impl Into<String>, e: cu::DriverError) -> Error {
    Error::Cuda {
        call: call.into(),
        detail: driver_error_text(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_parses_every_spelling() {
        for s in ["sm_90", "compute_90", "90", "9.0", " SM_90 "] {
            assert_eq!(s.parse::<Arch>().ok(), Some(Arch::SM90), "{s}");
        }
        assert_eq!("sm_80".parse::<Arch>().ok(), Some(Arch::SM80));
        assert_eq!(
            "sm_100".parse::<Arch>().ok(),
            Some(Arch {
                major: 10,
                minor: 0
            })
        );
        for s in ["", "sm_", "gfx90a", "9", "x.y"] {
            assert!(
                matches!(s.parse::<Arch>(), Err(Error::InvalidArgument { .. })),
                "{s}"
            );
        }
        assert_eq!(Arch::SM80.compute(), "compute_80");
        assert_eq!(Arch::SM90.to_string(), "sm_90");
    }

    #[test]
    fn entry_names_are_distinct_and_complete() {
        let names = entries();
        assert_eq!(names.len(), 9 + 6);
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        assert!(names.iter().all(|n| n.starts_with("odc_")));
    }

    #[test]
    fn ptx_parsing() {
        let ptx = Ptx {
            arch: Arch::SM90,
            text: ".version 8.8\n.target sm_90\n.visible .entry odc_x(\n.visible .entry odc_y(\n"
                .into(),
        };
        assert_eq!(ptx.target(), Some("sm_90"));
        assert_eq!(ptx.entries(), vec!["odc_x", "odc_y"]);
    }
}
