//! NVRTC: finding the library and compiling [`SOURCE`](super::SOURCE).
//!
//! cudarc opens NVRTC by soname through the system loader, which does not
//! look inside a Python virtual environment, where `make setup` installs it
//! (PyPI `nvidia-cuda-nvrtc-cu12`). So before cudarc's first NVRTC call this
//! module opens the library by path: the loader then resolves cudarc's
//! `dlopen("libnvrtc.so.12")` to the already-loaded object, by soname.
//! Search order: `$ODC_NVRTC_LIB` (a file, or a directory holding
//! `libnvrtc.so.12`), `$VIRTUAL_ENV`, the workspace's `.venv`, then the
//! system loader.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::nvrtc::{result, sys};

use super::Arch;
use crate::{Error, Result, Unavailable};

/// Environment variable naming the NVRTC library (or its directory).
pub const NVRTC_ENV: &str = "ODC_NVRTC_LIB";

/// The soname cudarc (built for CUDA 12) looks for.
const SONAME: &str = "libnvrtc.so.12";

/// The NVRTC this process compiles with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvrtcInfo {
    /// The file opened, or `None` when the system loader found it.
    pub path: Option<PathBuf>,
    /// NVRTC's version, `(major, minor)`.
    pub version: (i32, i32),
}

#[derive(Debug)]
struct Loaded {
    info: NvrtcInfo,
    // Kept open for the life of the process: cudarc's handle resolves to it.
    _lib: Option<libloading::Library>,
}

static NVRTC: OnceLock<std::result::Result<Loaded, Unavailable>> = OnceLock::new();

/// Loads NVRTC once per process and says which one, or what was tried.
pub fn nvrtc() -> std::result::Result<NvrtcInfo, Unavailable> {
    match NVRTC.get_or_init(load) {
        Ok(loaded) => Ok(loaded.info.clone()),
        Err(e) => Err(e.clone()),
    }
}

/// Whether an NVRTC library can be loaded (and is loaded after this call).
pub fn is_present() -> bool {
    nvrtc().is_ok()
}

/// Every file this process would try, in order, before the system loader
/// (see [`crate::wheels::candidates`]).
pub fn candidates() -> Vec<PathBuf> {
    crate::wheels::candidates(NVRTC_ENV, "nvidia/cuda_nvrtc/lib", SONAME)
}

fn load() -> std::result::Result<Loaded, Unavailable> {
    let mut tried = Vec::new();
    let mut lib = None;
    let mut path = None;
    for candidate in candidates() {
        if !candidate.exists() {
            tried.push(format!("{} (absent)", candidate.display()));
            continue;
        }
        // SAFETY: NVRTC's initializers only set up its own state; the
        // handle is kept for the life of the process, so nothing it hands
        // out outlives it.
        match unsafe { libloading::Library::new(&candidate) } {
            Ok(l) => {
                lib = Some(l);
                path = Some(candidate);
                break;
            }
            Err(e) => tried.push(format!("{} ({e})", candidate.display())),
        }
    }
    // SAFETY: probes cudarc's candidate names with dlopen and closes them;
    // this only checks the library can be found, it calls nothing in it.
    if !unsafe { sys::is_culib_present() } {
        tried.push(format!("system loader ({SONAME}, libnvrtc.so: not found)"));
        return Err(Unavailable::NoNvrtc { tried });
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present (checked above), so cudarc resolves
    // the symbol; both out-pointers are valid for the call.
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if status != sys::nvrtcResult::NVRTC_SUCCESS {
        tried.push(format!("nvrtcVersion returned {status:?}"));
        return Err(Unavailable::NoNvrtc { tried });
    }
    Ok(Loaded {
        info: NvrtcInfo {
            path,
            version: (major, minor),
        },
        _lib: lib,
    })
}

/// What to ask NVRTC for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Output {
    /// Virtual-architecture PTX (`compute_XY`), JIT-compiled by the driver.
    Ptx,
    /// Real-architecture machine code (`sm_XY`): loads on any driver that
    /// knows the GPU, however old, unlike PTX from a newer NVRTC.
    Cubin,
}

/// The options every compilation uses: exact f32 arithmetic (no FMA
/// contraction, no flush to zero, IEEE division and square root).
pub(crate) fn options(arch: Arch, output: Output) -> Vec<String> {
    let target = match output {
        Output::Ptx => arch.compute(),
        Output::Cubin => arch.sm(),
    };
    vec![
        format!("--gpu-architecture={target}"),
        "-default-device".to_owned(),
        "--std=c++17".to_owned(),
        "--fmad=false".to_owned(),
        "--ftz=false".to_owned(),
        "--prec-div=true".to_owned(),
        "--prec-sqrt=true".to_owned(),
    ]
}

/// Destroys an NVRTC program on every path out of [`compile`].
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program`, destroyed only here.
        if let Err(e) = unsafe { result::destroy_program(self.0) } {
            eprintln!("odc-kernels: nvrtcDestroyProgram failed: {e:?}");
        }
    }
}

/// Compiles `source` for `arch`; returns PTX text (NUL-terminated by NVRTC,
/// trimmed here) or CUBIN bytes.
pub(crate) fn compile(source: &str, arch: Arch, output: Output) -> Result<Vec<u8>> {
    nvrtc()?;
    let target = match output {
        Output::Ptx => arch.compute(),
        Output::Cubin => arch.sm(),
    };
    let fail = |call: &'static str, detail: String| Error::Nvrtc {
        call,
        arch: target.clone(),
        detail,
    };
    let src = CString::new(source).map_err(|e| fail("nvrtcCreateProgram", e.to_string()))?;
    let program = result::create_program(&src, Some(c"odc_kernels.cu"))
        .map_err(|e| fail("nvrtcCreateProgram", format!("{e:?}")))?;
    let program = Program(program);
    let opts = options(arch, output);
    // SAFETY: `program` is live until `Program` drops at the end of this
    // function; `src` outlives it.
    if let Err(e) = unsafe { result::compile_program(program.0, &opts) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(program.0) }
            .map(|raw| c_chars_to_string(&raw))
            .unwrap_or_else(|e| format!("<no log: {e:?}>"));
        return Err(fail(
            "nvrtcCompileProgram",
            format!("{e:?} with options {opts:?}:\n{log}"),
        ));
    }
    match output {
        Output::Ptx => {
            // SAFETY: as above; the program compiled.
            let raw = unsafe { result::get_ptx(program.0) }
                .map_err(|e| fail("nvrtcGetPTX", format!("{e:?}")))?;
            Ok(c_chars_to_string(&raw).into_bytes())
        }
        Output::Cubin => {
            let mut size = 0usize;
            // SAFETY: as above; `size` is a valid out-pointer.
            let status = unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) };
            status
                .result()
                .map_err(|e| fail("nvrtcGetCUBINSize", format!("{e:?}")))?;
            let mut bytes = vec![0u8; size];
            // SAFETY: `bytes` holds the `size` bytes NVRTC said it writes.
            let status =
                unsafe { sys::nvrtcGetCUBIN(program.0, bytes.as_mut_ptr().cast::<c_char>()) };
            status
                .result()
                .map_err(|e| fail("nvrtcGetCUBIN", format!("{e:?}")))?;
            Ok(bytes)
        }
    }
}

/// NVRTC's NUL-terminated text as a `String` (lossy: logs may hold any byte).
fn c_chars_to_string(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}
