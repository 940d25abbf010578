//! Raw bindings to `shim.c` (libfabric's inline calls as plain functions)
//! and the lazy loader of libfabric itself ([`load`], [`is_present`]).
//! Nothing but `load` is safe to call before `load` succeeded, and nothing
//! here without reading the libfabric man page of the wrapped call.

#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

/// Opaque libfabric objects (only ever behind pointers).
#[repr(C)]
#[derive(Debug)]
pub struct FiInfo {
    _p: [u8; 0],
}
#[repr(C)]
#[derive(Debug)]
pub struct FidFabric {
    _p: [u8; 0],
}
#[repr(C)]
#[derive(Debug)]
pub struct FidDomain {
    _p: [u8; 0],
}
#[repr(C)]
#[derive(Debug)]
pub struct FidCq {
    _p: [u8; 0],
}
#[repr(C)]
#[derive(Debug)]
pub struct FidAv {
    _p: [u8; 0],
}
#[repr(C)]
#[derive(Debug)]
pub struct FidEp {
    _p: [u8; 0],
}
#[repr(C)]
#[derive(Debug)]
pub struct FidMr {
    _p: [u8; 0],
}

/// `struct odc_cq_entry` in shim.c.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CqEntry {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: u64,
    pub data: u64,
}

impl Default for CqEntry {
    fn default() -> CqEntry {
        CqEntry {
            op_context: std::ptr::null_mut(),
            flags: 0,
            len: 0,
            data: 0,
        }
    }
}

/// The dlopen()ed libfabric, once; `Err` says why it could not be loaded.
static LIBRARY: OnceLock<Result<libloading::Library, String>> = OnceLock::new();

/// Library names tried, in order.
pub const LIBRARY_NAMES: [&str; 2] = ["libfabric.so.1", "libfabric.so"];

/// Loads libfabric (once) and hands its exported entry points to the shim.
pub fn load() -> Result<(), String> {
    let lib = LIBRARY.get_or_init(|| {
        let mut errors = Vec::new();
        for name in LIBRARY_NAMES {
            // Some provider dependencies (PSM's libinfinipath) install
            // handlers for fatal signals in their initializers: a crash
            // then exits with status 1 and leaves a `.btr` file in the
            // working directory. Keep the process's own dispositions.
            let saved = SavedSignals::save();
            // SAFETY: loading libfabric runs its (and its providers'
            // dependencies') initializers, which have no preconditions.
            let lib = unsafe { libloading::Library::new(name) };
            saved.restore();
            match lib {
                Ok(lib) => {
                    bind(&lib)?;
                    return Ok(lib);
                }
                Err(e) => errors.push(format!("{name}: {e}")),
            }
        }
        Err(errors.join("; "))
    });
    lib.as_ref().map(|_| ()).map_err(Clone::clone)
}

/// Signal dispositions saved around `dlopen`.
struct SavedSignals {
    actions: Vec<(c_int, libc::sigaction)>,
}

impl SavedSignals {
    fn save() -> SavedSignals {
        let mut actions = Vec::new();
        for sig in 1..32 {
            if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                continue;
            }
            // SAFETY: an all-zero sigaction is a valid out-parameter.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: querying (null new action) changes nothing.
            if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } == 0 {
                actions.push((sig, old));
            }
        }
        SavedSignals { actions }
    }

    fn restore(&self) {
        for (sig, old) in &self.actions {
            // SAFETY: reinstalls exactly the disposition read in `save`.
            unsafe { libc::sigaction(*sig, old, std::ptr::null_mut()) };
        }
    }
}

fn bind(lib: &libloading::Library) -> Result<(), String> {
    let sym = |name: &[u8]| -> Result<*mut c_void, String> {
        // SAFETY: the symbol is only passed to the shim, which casts it to
        // the prototype in <rdma/fabric.h>.
        unsafe { lib.get::<*mut c_void>(name) }
            .map(|s| *s)
            .map_err(|e| format!("{}: {e}", String::from_utf8_lossy(name)))
    };
    // SAFETY: the five pointers are libfabric's exported functions; the
    // library stays loaded for the life of the process (LIBRARY is static).
    let ret = unsafe {
        odc_fi_bind_library(
            sym(b"fi_getinfo\0")?,
            sym(b"fi_freeinfo\0")?,
            sym(b"fi_dupinfo\0")?,
            sym(b"fi_fabric\0")?,
            sym(b"fi_strerror\0")?,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err("libfabric lacks an entry point".into())
    }
}

/// Whether libfabric can be loaded on this machine.
pub fn is_present() -> bool {
    load().is_ok()
}

extern "C" {
    pub fn odc_fi_bind_library(
        getinfo: *mut c_void,
        freeinfo: *mut c_void,
        dupinfo: *mut c_void,
        fabric: *mut c_void,
        strerror: *mut c_void,
    ) -> c_int;
    pub fn odc_fi_flag_remote_cq_data() -> u64;
    pub fn odc_fi_flag_read() -> u64;
    pub fn odc_fi_flag_write() -> u64;
    pub fn odc_fi_mr_bit_local() -> u64;
    pub fn odc_fi_mr_bit_virt_addr() -> u64;
    pub fn odc_fi_mr_bit_allocated() -> u64;
    pub fn odc_fi_mr_bit_prov_key() -> u64;
    pub fn odc_fi_mr_bit_endpoint() -> u64;
    pub fn odc_fi_context_size() -> usize;
    pub fn odc_fi_eagain() -> c_int;
    pub fn odc_fi_eavail() -> c_int;
    pub fn odc_fi_strerror(err: c_int) -> *const c_char;

    pub fn odc_fi_getinfo(
        prov: *const c_char,
        node: *const c_char,
        service: *const c_char,
        mr_mode: u64,
        out: *mut *mut FiInfo,
    ) -> c_int;
    pub fn odc_fi_freeinfo(info: *mut FiInfo);
    pub fn odc_fi_info_mr_mode(info: *const FiInfo) -> u64;
    pub fn odc_fi_info_cq_data_size(info: *const FiInfo) -> u64;
    pub fn odc_fi_info_iov_limit(info: *const FiInfo) -> u64;
    pub fn odc_fi_info_max_msg_size(info: *const FiInfo) -> u64;
    pub fn odc_fi_info_tx_size(info: *const FiInfo) -> u64;
    pub fn odc_fi_info_prov_name(info: *const FiInfo) -> *const c_char;

    pub fn odc_fi_fabric(info: *mut FiInfo, out: *mut *mut FidFabric) -> c_int;
    pub fn odc_fi_domain(f: *mut FidFabric, info: *mut FiInfo, out: *mut *mut FidDomain) -> c_int;
    pub fn odc_fi_cq_open(d: *mut FidDomain, size: usize, out: *mut *mut FidCq) -> c_int;
    pub fn odc_fi_av_open(d: *mut FidDomain, out: *mut *mut FidAv) -> c_int;
    pub fn odc_fi_endpoint(d: *mut FidDomain, info: *mut FiInfo, out: *mut *mut FidEp) -> c_int;
    pub fn odc_fi_ep_bind_cq(ep: *mut FidEp, cq: *mut FidCq) -> c_int;
    pub fn odc_fi_ep_bind_av(ep: *mut FidEp, av: *mut FidAv) -> c_int;
    pub fn odc_fi_enable(ep: *mut FidEp) -> c_int;
    pub fn odc_fi_getname(ep: *mut FidEp, addr: *mut c_void, len: *mut usize) -> c_int;
    pub fn odc_fi_av_insert(av: *mut FidAv, addr: *const c_void, fi_addr: *mut u64) -> c_int;

    pub fn odc_fi_mr_reg(
        d: *mut FidDomain,
        buf: *mut c_void,
        len: usize,
        access: u64,
        key: u64,
        out: *mut *mut FidMr,
    ) -> c_int;
    pub fn odc_fi_access_remote() -> u64;
    pub fn odc_fi_access_local() -> u64;
    pub fn odc_fi_mr_bind_ep(mr: *mut FidMr, ep: *mut FidEp) -> c_int;
    pub fn odc_fi_mr_enable(mr: *mut FidMr) -> c_int;
    pub fn odc_fi_mr_key(mr: *mut FidMr) -> u64;
    pub fn odc_fi_mr_desc(mr: *mut FidMr) -> *mut c_void;

    pub fn odc_fi_read(
        ep: *mut FidEp,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> c_int;
    pub fn odc_fi_writedata_v(
        ep: *mut FidEp,
        bufs: *const *mut c_void,
        lens: *const usize,
        descs: *mut *mut c_void,
        count: usize,
        dest: u64,
        addr: u64,
        key: u64,
        data: u64,
        ctx: *mut c_void,
    ) -> c_int;
    pub fn odc_fi_cq_sread(
        cq: *mut FidCq,
        out: *mut CqEntry,
        count: usize,
        timeout_ms: c_int,
    ) -> c_int;
    pub fn odc_fi_cq_read(cq: *mut FidCq, out: *mut CqEntry, count: usize) -> c_int;
    pub fn odc_fi_cq_readerr(
        cq: *mut FidCq,
        ctx: *mut *mut c_void,
        err: *mut c_int,
        msg: *mut c_char,
        msg_len: usize,
    ) -> c_int;
    pub fn odc_fi_cq_signal(cq: *mut FidCq) -> c_int;
    pub fn odc_fi_cancel(ep: *mut FidEp, ctx: *mut c_void) -> c_int;

    pub fn odc_fi_close_fabric(x: *mut FidFabric) -> c_int;
    pub fn odc_fi_close_domain(x: *mut FidDomain) -> c_int;
    pub fn odc_fi_close_cq(x: *mut FidCq) -> c_int;
    pub fn odc_fi_close_av(x: *mut FidAv) -> c_int;
    pub fn odc_fi_close_ep(x: *mut FidEp) -> c_int;
    pub fn odc_fi_close_mr(x: *mut FidMr) -> c_int;
}
