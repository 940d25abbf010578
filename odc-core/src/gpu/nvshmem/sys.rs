//! Raw NVSHMEM host bindings: `#[repr(C)]` types matching NVSHMEM 3.x's
//! headers (`device_host/nvshmem_types.h`,
//! `bootstrap_device_host/nvshmem_uniqueid.h`), constants, and the symbol
//! table of `libnvshmem_host.so.3`, opened with `libloading`.
//!
//! Only host-library symbols appear here. `nvshmem_init*` and
//! `nvshmem_finalize` are header-inline wrappers around `nvshmemi_*`
//! functions that live in the static device library, so a host-only
//! program initializes with [`Lib::nvshmemx_hostlib_init_attr`] and ends
//! with [`Lib::nvshmemx_hostlib_finalize`].
//!
//! The layout test (`odc-core/tests/nvshmem_bindings.rs`) compiles a C
//! program against the wheel's headers and checks every size, offset and
//! constant below.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::gpu::Missing;

/// `CUstream` / `cudaStream_t`: an opaque stream handle.
pub type CUstream = *mut c_void;

/// `UNIQUEID_PADDING`.
pub const UNIQUEID_PADDING: usize = 124;
/// `INIT_ARGS_PADDING`: the reserved bytes of `nvshmemx_init_args_v1`.
pub const INIT_ARGS_PADDING: usize = 96;
/// `UNIQUEID_ARGS_INVALID`.
pub const SCALAR_INVALID: c_int = -1;

/// `NVSHMEMX_INIT_WITH_UNIQUEID` (enum `flags`).
pub const NVSHMEMX_INIT_WITH_UNIQUEID: c_uint = 1 << 3;
/// `NVSHMEM_SIGNAL_SET` (`nvshmemx_signal_op_t`).
pub const NVSHMEM_SIGNAL_SET: c_int = 9;
/// `NVSHMEM_SIGNAL_ADD`.
pub const NVSHMEM_SIGNAL_ADD: c_int = 10;
/// `NVSHMEM_CMP_EQ` (`nvshmemx_cmp_type_t`).
pub const NVSHMEM_CMP_EQ: c_int = 0;
/// `NVSHMEM_CMP_NE`.
pub const NVSHMEM_CMP_NE: c_int = 1;
/// `NVSHMEM_CMP_GT`.
pub const NVSHMEM_CMP_GT: c_int = 2;
/// `NVSHMEM_CMP_LE`.
pub const NVSHMEM_CMP_LE: c_int = 3;
/// `NVSHMEM_CMP_LT`.
pub const NVSHMEM_CMP_LT: c_int = 4;
/// `NVSHMEM_CMP_GE`.
pub const NVSHMEM_CMP_GE: c_int = 5;

/// `nvshmemx_uniqueid_t` (`nvshmemx_uniqueid_v1`): 128 opaque bytes that
/// rank 0 creates and every rank passes to init.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvshmemx_uniqueid_t {
    /// `(1 << 16) + sizeof(nvshmemx_uniqueid_t)`.
    pub version: c_int,
    /// Opaque.
    pub internal: [c_char; UNIQUEID_PADDING],
}

/// `nvshmemx_uniqueid_args_t` (`nvshmemx_uniqueid_args_v1`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvshmemx_uniqueid_args_t {
    /// `(1 << 16) + sizeof(nvshmemx_uniqueid_args_t)`.
    pub version: c_int,
    /// The unique id; must outlive init.
    pub id: *mut nvshmemx_uniqueid_t,
    /// This PE's rank.
    pub myrank: c_int,
    /// Number of PEs.
    pub nranks: c_int,
}

/// `nvshmemx_init_args_v1`: what every NVSHMEM 3 release takes. 3.4
/// knows only this version; 3.7 and later add `nvshmemx_init_args_v2` (a
/// `cuda_device_id` in the first reserved bytes) and still take version 1,
/// where the PE uses the calling thread's current context, which ODC binds
/// before init. The same 128 bytes either way.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvshmemx_init_args_t {
    /// `(1 << 16) + sizeof(nvshmemx_init_args_t)`.
    pub version: c_int,
    /// Unique-id bootstrap arguments.
    pub uid_args: nvshmemx_uniqueid_args_t,
    /// Reserved (zero).
    pub content: [c_char; INIT_ARGS_PADDING],
}

/// `nvshmemx_init_attr_v1` (version 1: see [`nvshmemx_init_args_t`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvshmemx_init_attr_t {
    /// `(1 << 16) + sizeof(nvshmemx_init_attr_t)`.
    pub version: c_int,
    /// `MPI_Comm *` for MPI bootstrap; null here.
    pub mpi_comm: *mut c_void,
    /// Bootstrap arguments.
    pub args: nvshmemx_init_args_t,
}

/// `NVSHMEMX_UNIQUEID_INITIALIZER`'s version.
pub const UNIQUEID_VERSION: c_int = (1 << 16) + std::mem::size_of::<nvshmemx_uniqueid_t>() as c_int;
/// `NVSHMEMX_UNIQUEID_ARGS_INITIALIZER`'s version.
pub const UNIQUEID_ARGS_VERSION: c_int =
    (1 << 16) + std::mem::size_of::<nvshmemx_uniqueid_args_t>() as c_int;
/// The version word of `NVSHMEMX_INIT_ARGS_INITIALIZER` (version 1).
pub const INIT_ARGS_VERSION: c_int =
    (1 << 16) + std::mem::size_of::<nvshmemx_init_args_t>() as c_int;
/// The version word of `NVSHMEMX_INIT_ATTR_V1_INITIALIZER` (3.7 and later;
/// 3.4's `NVSHMEMX_INIT_ATTR_INITIALIZER`).
pub const INIT_ATTR_VERSION: c_int =
    (1 << 16) + std::mem::size_of::<nvshmemx_init_attr_t>() as c_int;

impl Default for nvshmemx_uniqueid_t {
    /// `NVSHMEMX_UNIQUEID_INITIALIZER`.
    fn default() -> Self {
        nvshmemx_uniqueid_t {
            version: UNIQUEID_VERSION,
            internal: [0; UNIQUEID_PADDING],
        }
    }
}

impl Default for nvshmemx_init_attr_t {
    /// `NVSHMEMX_INIT_ATTR_V1_INITIALIZER`.
    fn default() -> Self {
        nvshmemx_init_attr_t {
            version: INIT_ATTR_VERSION,
            mpi_comm: std::ptr::null_mut(),
            args: nvshmemx_init_args_t {
                version: INIT_ARGS_VERSION,
                uid_args: nvshmemx_uniqueid_args_t {
                    version: UNIQUEID_ARGS_VERSION,
                    id: std::ptr::null_mut(),
                    myrank: SCALAR_INVALID,
                    nranks: SCALAR_INVALID,
                },
                content: [0; INIT_ARGS_PADDING],
            },
        }
    }
}

/// Environment variable naming `libnvshmem_host.so.3` (or its directory).
pub const NVSHMEM_ENV: &str = "ODC_NVSHMEM_LIB";

/// The host library's soname.
pub const SONAME: &str = "libnvshmem_host.so.3";

macro_rules! symbols {
    ($($name:ident: $ty:ty;)*) => {
        /// The host functions ODC uses, resolved from one library.
        #[derive(Debug)]
        pub struct Lib {
            /// The file opened, or where the system loader found it (`None`
            /// only if neither is known).
            pub path: Option<PathBuf>,
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                pub $name: $ty,
            )*
            // Declared last: dropped after the pointers above (never, in
            // practice: the table lives in a static).
            _lib: libloading::Library,
        }

        /// Every symbol [`Lib`] resolves.
        pub const SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        impl Lib {
            fn resolve(lib: libloading::Library, path: Option<PathBuf>) -> Result<Lib, Missing> {
                $(
                    // SAFETY: the type is the prototype from the NVSHMEM
                    // headers; the pointer is copied out and stays valid
                    // while `lib` (moved into the table) is loaded.
                    let $name: $ty = unsafe {
                        *lib.get::<$ty>(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|e| Missing::NvshmemSymbol {
                                symbol: stringify!($name),
                                library: path.clone().unwrap_or_else(|| PathBuf::from(SONAME)),
                                detail: e.to_string(),
                            })?
                    };
                )*
                Ok(Lib { path, $($name,)* _lib: lib })
            }
        }
    };
}

symbols! {
    nvshmemx_hostlib_init_attr: unsafe extern "C" fn(c_uint, *mut nvshmemx_init_attr_t) -> c_int;
    nvshmemx_hostlib_finalize: unsafe extern "C" fn();
    nvshmemx_init_status: unsafe extern "C" fn() -> c_int;
    nvshmemx_get_uniqueid: unsafe extern "C" fn(*mut nvshmemx_uniqueid_t) -> c_int;
    nvshmemx_set_attr_uniqueid_args:
        unsafe extern "C" fn(c_int, c_int, *const nvshmemx_uniqueid_t, *mut nvshmemx_init_attr_t) -> c_int;
    nvshmemx_vendor_get_version_info: unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int);
    nvshmem_my_pe: unsafe extern "C" fn() -> c_int;
    nvshmem_n_pes: unsafe extern "C" fn() -> c_int;
    nvshmem_malloc: unsafe extern "C" fn(usize) -> *mut c_void;
    nvshmem_align: unsafe extern "C" fn(usize, usize) -> *mut c_void;
    nvshmem_free: unsafe extern "C" fn(*mut c_void);
    nvshmem_ptr: unsafe extern "C" fn(*const c_void, c_int) -> *mut c_void;
    nvshmemx_getmem_on_stream: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, CUstream);
    nvshmemx_putmem_on_stream: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, CUstream);
    nvshmemx_putmem_signal_on_stream:
        unsafe extern "C" fn(*mut c_void, *const c_void, usize, *mut u64, u64, c_int, c_int, CUstream);
    nvshmemx_signal_wait_until_on_stream: unsafe extern "C" fn(*mut u64, c_int, u64, CUstream);
    nvshmemx_quiet_on_stream: unsafe extern "C" fn(CUstream);
    nvshmem_quiet: unsafe extern "C" fn();
    nvshmem_barrier_all: unsafe extern "C" fn();
    nvshmemx_barrier_all_on_stream: unsafe extern "C" fn(CUstream);
}

// SAFETY: the table holds plain function pointers into a library that is
// never unloaded; NVSHMEM's host API is callable from any thread (its
// thread-safety level is NVSHMEM's business, documented on `safe`).
unsafe impl Send for Lib {}
// SAFETY: as above; the table is immutable.
unsafe impl Sync for Lib {}

static LIB: OnceLock<Result<Lib, Missing>> = OnceLock::new();

/// The symbol table, loaded on first call; the same result afterwards.
pub fn lib() -> Result<&'static Lib, Missing> {
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Whether the NVSHMEM host library and every symbol ODC uses load here.
pub fn is_present() -> bool {
    lib().is_ok()
}

/// Where the host library may live: the wheel layout of both CUDA majors
/// (PyPI `nvidia-nvshmem-cu12` and `-cu13` both install
/// `nvidia/nvshmem/lib`), then NVIDIA's Debian packages and `/opt`.
const LAYOUTS: &[odc_kernels::wheels::Layout] = &[odc_kernels::wheels::Layout {
    file: SONAME,
    wheel_dirs: &["nvidia/nvshmem/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"],
    system_dirs: &[
        "/usr/lib/x86_64-linux-gnu/nvshmem/13",
        "/usr/lib/x86_64-linux-gnu/nvshmem/12",
        "/usr/lib/x86_64-linux-gnu",
        "/opt/nvidia/nvshmem/lib",
    ],
}];

/// Files tried, in order, before the system loader: `$ODC_NVSHMEM_LIB`
/// (a file or a directory), then the wheel layouts in every Python
/// `site-packages` ([`odc_kernels::wheels::site_packages`]: the running
/// interpreter's first), then the system folders of `LAYOUTS`.
pub fn candidates() -> Vec<PathBuf> {
    odc_kernels::wheels::candidates(NVSHMEM_ENV, LAYOUTS)
}

/// Where the headers of the library [`candidates`] finds first live
/// (`…/nvidia/nvshmem/include`), for the layout check.
pub fn include_dir() -> Option<PathBuf> {
    candidates()
        .into_iter()
        .filter(|p| p.exists())
        .filter_map(|p| Some(p.parent()?.parent()?.join("include")))
        .find(|inc| inc.join("nvshmem_host.h").exists())
}

fn load() -> Result<Lib, Missing> {
    let mut tried = Vec::new();
    for candidate in candidates() {
        if !candidate.exists() {
            tried.push(format!("{} (absent)", candidate.display()));
            continue;
        }
        // SAFETY: opening runs the library's initializers, which only set
        // up its own state (no device is touched before init).
        match unsafe { libloading::Library::new(&candidate) } {
            Ok(lib) => return Lib::resolve(lib, Some(candidate)),
            Err(e) => tried.push(format!("{} ({e})", candidate.display())),
        }
    }
    // SAFETY: as above, through the system loader's search path.
    match unsafe { libloading::Library::new(SONAME) } {
        Ok(lib) => {
            let lib = Lib::resolve(lib, None)?;
            // Where the system loader found it, for the probe's report.
            let path = odc_kernels::wheels::file_of(lib.nvshmem_my_pe as usize);
            Ok(Lib { path, ..lib })
        }
        Err(e) => {
            tried.push(format!("system loader ({e})"));
            Err(Missing::NvshmemLibrary { tried })
        }
    }
}
