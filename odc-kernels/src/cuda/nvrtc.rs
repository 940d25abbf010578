//! NVRTC: finding the library and compiling [`SOURCE`](super::SOURCE).
//!
//! NVRTC is bound here directly, from the library this module opens, rather
//! than through cudarc's NVRTC layer: cudarc is built for CUDA 12.8 and opens
//! NVRTC only by the sonames of that major (`libnvrtc.so.12` and older), so a
//! machine with CUDA 13's NVRTC alone (`libnvrtc.so.13`, as the GPU test
//! machine's torch 2.11+cu130 brings) could not compile the kernels. The
//! entry points ODC calls have the same prototypes in NVRTC 12 and 13
//! (checked against both headers: only `nvrtcGetNVVM` went and
//! `nvrtcGetTileIR` came, neither used), so one table serves both majors.
//! cudarc's driver layer is unchanged (the driver is backward compatible).
//!
//! Search order, newest major first (CUDA 12's first where the driver is
//! CUDA 12's): `$ODC_NVRTC_LIB` (a file, or a folder holding
//! `libnvrtc.so.13` or `.so.12`); in every Python `site-packages`
//! ([`crate::wheels::site_packages`]: the running interpreter's first) the
//! cu13 wheel layout (`nvidia/cu13/lib/libnvrtc.so.13`) then cu12's
//! (`nvidia/cuda_nvrtc/lib/libnvrtc.so.12`); a system CUDA (`$CUDA_HOME`,
//! `/usr/local/cuda`); then the system loader by soname.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use super::Arch;
use crate::wheels::{self, Layout};
use crate::{Error, Result, Unavailable};

/// Environment variable naming the NVRTC library (or its directory).
pub const NVRTC_ENV: &str = "ODC_NVRTC_LIB";

/// Where NVRTC may live, newest major first.
const LAYOUTS: &[Layout] = &[
    Layout {
        file: "libnvrtc.so.13",
        wheel_dirs: &["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"],
        system_dirs: &[
            "/usr/local/cuda/lib64",
            "/usr/local/cuda-13/lib64",
            "/usr/lib/x86_64-linux-gnu",
        ],
    },
    Layout {
        file: "libnvrtc.so.12",
        wheel_dirs: &["nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"],
        system_dirs: &[
            "/usr/local/cuda/lib64",
            "/usr/local/cuda-12/lib64",
            "/usr/lib/x86_64-linux-gnu",
        ],
    },
];

/// Sonames the system loader is asked for after the files above.
const SONAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// The NVRTC this process compiles with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvrtcInfo {
    /// The file loaded: the path opened, or where the system loader found it
    /// (`None` only if neither is known).
    pub path: Option<PathBuf>,
    /// NVRTC's version, `(major, minor)`.
    pub version: (i32, i32),
}

/// `nvrtcProgram`: an opaque handle.
type Program = *mut c_void;
/// `nvrtcResult`.
type Status = c_int;
const NVRTC_SUCCESS: Status = 0;

macro_rules! symbols {
    ($($field:ident = $name:literal: $ty:ty;)*) => {
        /// The NVRTC entry points ODC calls, resolved from one library.
        struct Api {
            $($field: $ty,)*
            // Kept for the life of the process: the pointers above point into it.
            _lib: libloading::Library,
        }

        impl Api {
            fn resolve(lib: libloading::Library, what: &str) -> std::result::Result<Api, String> {
                $(
                    // SAFETY: the type is the prototype from nvrtc.h (the
                    // same in NVRTC 12 and 13); the pointer is copied out and
                    // stays valid while `lib`, moved into the table, is loaded.
                    let $field: $ty = unsafe {
                        *lib.get::<$ty>(concat!($name, "\0").as_bytes())
                            .map_err(|e| format!("{what} (no {}: {e})", $name))?
                    };
                )*
                Ok(Api { $($field,)* _lib: lib })
            }
        }
    };
}

symbols! {
    version = "nvrtcVersion": unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
    error_string = "nvrtcGetErrorString": unsafe extern "C" fn(Status) -> *const c_char;
    create_program = "nvrtcCreateProgram": unsafe extern "C" fn(
        *mut Program, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char,
    ) -> Status;
    compile_program = "nvrtcCompileProgram": unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
    destroy_program = "nvrtcDestroyProgram": unsafe extern "C" fn(*mut Program) -> Status;
    log_size = "nvrtcGetProgramLogSize": unsafe extern "C" fn(Program, *mut usize) -> Status;
    log = "nvrtcGetProgramLog": unsafe extern "C" fn(Program, *mut c_char) -> Status;
    ptx_size = "nvrtcGetPTXSize": unsafe extern "C" fn(Program, *mut usize) -> Status;
    ptx = "nvrtcGetPTX": unsafe extern "C" fn(Program, *mut c_char) -> Status;
    cubin_size = "nvrtcGetCUBINSize": unsafe extern "C" fn(Program, *mut usize) -> Status;
    cubin = "nvrtcGetCUBIN": unsafe extern "C" fn(Program, *mut c_char) -> Status;
}

// SAFETY: the table holds plain function pointers into a library that is
// never unloaded; NVRTC's API is thread-safe for distinct programs (each
// compile here creates and destroys its own).
unsafe impl Send for Api {}
// SAFETY: as above; the table is immutable.
unsafe impl Sync for Api {}

struct Loaded {
    info: NvrtcInfo,
    api: Api,
    // NVRTC's builtins library, opened from NVRTC's own folder: NVRTC opens
    // `libnvrtc-builtins.so.<major>.<minor>` by name when it compiles, and
    // some releases (13.0's wheel) do not look beside themselves for it; once
    // this process has it loaded, the loader resolves that name to it.
    _builtins: Option<libloading::Library>,
}

static NVRTC: OnceLock<std::result::Result<Loaded, Unavailable>> = OnceLock::new();

fn loaded() -> std::result::Result<&'static Loaded, Unavailable> {
    NVRTC.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Loads NVRTC once per process and says which one, or what was tried.
pub fn nvrtc() -> std::result::Result<NvrtcInfo, Unavailable> {
    loaded().map(|l| l.info.clone())
}

/// Whether an NVRTC library can be loaded (and is loaded after this call).
pub fn is_present() -> bool {
    nvrtc().is_ok()
}

/// Every file this process would try, in order, before the system loader
/// (see the module doc): CUDA 13's NVRTC first, unless the driver here is
/// CUDA 12's, which cannot load what NVRTC 13 emits; then CUDA 12's first.
pub fn candidates() -> Vec<PathBuf> {
    if driver_major() == Some(12) {
        let older_first: Vec<Layout> = LAYOUTS.iter().rev().copied().collect();
        return wheels::candidates(NVRTC_ENV, &older_first);
    }
    wheels::candidates(NVRTC_ENV, LAYOUTS)
}

/// The CUDA major version of the driver here, if one is installed.
fn driver_major() -> Option<i32> {
    if !super::driver_is_present() {
        return None;
    }
    let mut version = 0;
    // SAFETY: the driver library is present; cuDriverGetVersion needs no
    // cuInit and writes one int through a valid out-pointer.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    (status == cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS).then_some(version / 1000)
}

fn load() -> std::result::Result<Loaded, Unavailable> {
    let mut tried = Vec::new();
    let files = candidates()
        .into_iter()
        .map(|p| (p.display().to_string(), p, true));
    let mut sonames = SONAMES.to_vec();
    if driver_major() == Some(12) {
        sonames.swap(0, 1); // CUDA 12's NVRTC first under a CUDA 12 driver, as for the files
    }
    let sonames = sonames
        .into_iter()
        .map(|s| (format!("system loader ({s})"), PathBuf::from(s), false));
    for (what, name, is_file) in files.chain(sonames) {
        if is_file && !name.exists() {
            tried.push(format!("{what} (absent)"));
            continue;
        }
        // SAFETY: NVRTC's initializers only set up its own state; the
        // library is kept for the life of the process.
        let api = match unsafe { libloading::Library::new(&name) } {
            Ok(lib) => Api::resolve(lib, &what),
            Err(e) => Err(format!("{what} ({e})")),
        };
        let api = match api {
            Ok(api) => api,
            Err(e) => {
                tried.push(e);
                continue;
            }
        };
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: resolved from a loaded NVRTC; both out-pointers are valid.
        let status = unsafe { (api.version)(&mut major, &mut minor) };
        if status != NVRTC_SUCCESS {
            tried.push(format!("{what} (nvrtcVersion returned {status})"));
            continue;
        }
        let path = if is_file {
            Some(name)
        } else {
            wheels::file_of(api.version as usize)
        };
        let builtins = path
            .as_ref()
            .and_then(|p| p.parent())
            .map(|dir| dir.join(format!("libnvrtc-builtins.so.{major}.{minor}")))
            .filter(|b| b.exists())
            // SAFETY: NVRTC's own builtins library, from NVRTC's folder; its
            // initializers set up only its own state; kept for the process.
            .and_then(|b| unsafe { libloading::Library::new(b) }.ok());
        return Ok(Loaded {
            info: NvrtcInfo {
                path,
                version: (major, minor),
            },
            api,
            _builtins: builtins,
        });
    }
    Err(Unavailable::NoNvrtc { tried })
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

/// An NVRTC program, destroyed on every path out of [`compile`].
struct Owned<'a> {
    api: &'a Api,
    program: Program,
}

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed only here.
        let status = unsafe { (self.api.destroy_program)(&mut self.program) };
        if status != NVRTC_SUCCESS {
            eprintln!(
                "odc-kernels: nvrtcDestroyProgram failed: {}",
                status_text(self.api, status)
            );
        }
    }
}

/// NVRTC's name for `status` (`NVRTC_ERROR_COMPILATION`).
fn status_text(api: &Api, status: Status) -> String {
    // SAFETY: nvrtcGetErrorString returns a static string for any value.
    let text = unsafe { (api.error_string)(status) };
    if text.is_null() {
        return format!("nvrtcResult {status}");
    }
    // SAFETY: non-null, NUL-terminated, static (NVRTC's own table).
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// Reads one of NVRTC's size-then-bytes outputs (log, PTX, CUBIN).
///
/// # Safety
/// `program` must be a live program of `api`; `size` and `get` must be the
/// matching pair of entry points.
unsafe fn read_out(
    api: &Api,
    program: Program,
    size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    get: unsafe extern "C" fn(Program, *mut c_char) -> Status,
) -> std::result::Result<Vec<u8>, String> {
    let mut n = 0usize;
    // SAFETY: the caller's contract; `n` is a valid out-pointer.
    let status = unsafe { size(program, &mut n) };
    if status != NVRTC_SUCCESS {
        return Err(status_text(api, status));
    }
    let mut bytes = vec![0u8; n];
    // SAFETY: `bytes` holds the `n` bytes NVRTC said it writes.
    let status = unsafe { get(program, bytes.as_mut_ptr().cast::<c_char>()) };
    if status != NVRTC_SUCCESS {
        return Err(status_text(api, status));
    }
    Ok(bytes)
}

/// Compiles `source` for `arch`; returns PTX text (NUL-terminated by NVRTC,
/// trimmed here) or CUBIN bytes.
pub(crate) fn compile(source: &str, arch: Arch, output: Output) -> Result<Vec<u8>> {
    let api = &loaded()?.api;
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
    let mut program: Program = std::ptr::null_mut();
    // SAFETY: `program` is a valid out-pointer; `src` and the name are
    // NUL-terminated and outlive the call; no headers (count 0, null arrays).
    let status = unsafe {
        (api.create_program)(
            &mut program,
            src.as_ptr(),
            c"odc_kernels.cu".as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if status != NVRTC_SUCCESS {
        return Err(fail("nvrtcCreateProgram", status_text(api, status)));
    }
    let owned = Owned { api, program };
    let opts = options(arch, output);
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| fail("nvrtcCompileProgram", e.to_string()))?;
    let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    let count =
        c_int::try_from(ptrs.len()).map_err(|e| fail("nvrtcCompileProgram", e.to_string()))?;
    // SAFETY: `owned.program` is live until `owned` drops at the end of this
    // function; `ptrs` points at `c_opts`, which outlive the call.
    let status = unsafe { (api.compile_program)(owned.program, count, ptrs.as_ptr()) };
    if status != NVRTC_SUCCESS {
        // SAFETY: as above; log size and log are a matching pair.
        let log = unsafe { read_out(api, owned.program, api.log_size, api.log) }
            .map(|raw| c_chars_to_string(&raw))
            .unwrap_or_else(|e| format!("<no log: {e}>"));
        return Err(fail(
            "nvrtcCompileProgram",
            format!("{} with options {opts:?}:\n{log}", status_text(api, status)),
        ));
    }
    match output {
        Output::Ptx => {
            // SAFETY: as above; the program compiled.
            let raw = unsafe { read_out(api, owned.program, api.ptx_size, api.ptx) }
                .map_err(|e| fail("nvrtcGetPTX", e))?;
            Ok(c_chars_to_string(&raw).into_bytes())
        }
        // SAFETY: as above; the program compiled.
        Output::Cubin => unsafe { read_out(api, owned.program, api.cubin_size, api.cubin) }
            .map_err(|e| fail("nvrtcGetCUBIN", e)),
    }
}

/// NVRTC's NUL-terminated text as a `String` (lossy: logs may hold any byte).
fn c_chars_to_string(bytes: &[u8]) -> String {
    match CStr::from_bytes_until_nul(bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    }
}
