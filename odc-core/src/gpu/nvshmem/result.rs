//! Thin NVSHMEM layer: every call returns [`Result`], C names regrouped
//! (`nvshmemx_getmem_on_stream` → [`rma::get_on_stream`]). Status codes
//! and null pointers become [`Error::Nvshmem`]; a missing library becomes
//! [`Error::GpuUnavailable`].

use std::ffi::{c_int, c_void};

use super::sys::{self, CUstream, Lib};
use crate::{Error, Result};

fn lib() -> Result<&'static Lib> {
    Ok(sys::lib()?)
}

fn check(call: &'static str, status: c_int) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(Error::Nvshmem {
            call,
            detail: format!("returned status {status}"),
        })
    }
}

/// NVSHMEM's version, `(major, minor, patch)`. Safe before init.
pub fn version() -> Result<(i32, i32, i32)> {
    let lib = lib()?;
    let (mut a, mut b, mut c) = (0, 0, 0);
    // SAFETY: three valid out-pointers; the call reads only constants.
    unsafe { (lib.nvshmemx_vendor_get_version_info)(&mut a, &mut b, &mut c) };
    Ok((a, b, c))
}

/// Initialization and teardown.
pub mod init {
    use super::*;

    /// `nvshmemx_get_uniqueid`: a fresh id (rank 0 makes it, every rank
    /// uses it).
    pub fn get_uniqueid() -> Result<sys::nvshmemx_uniqueid_t> {
        let lib = lib()?;
        let mut id = sys::nvshmemx_uniqueid_t::default();
        // SAFETY: `id` is a valid, initialized uniqueid the call fills.
        check("nvshmemx_get_uniqueid", unsafe {
            (lib.nvshmemx_get_uniqueid)(&mut id)
        })?;
        Ok(id)
    }

    /// `nvshmemx_set_attr_uniqueid_args`: points `attr` at `id` for `rank`
    /// of `nranks`.
    ///
    /// # Safety
    ///
    /// `attr` keeps a pointer to `id`: `id` must outlive every use of
    /// `attr` (the init call).
    pub unsafe fn set_attr_uniqueid_args(
        rank: c_int,
        nranks: c_int,
        id: &sys::nvshmemx_uniqueid_t,
        attr: &mut sys::nvshmemx_init_attr_t,
    ) -> Result<()> {
        let lib = lib()?;
        // SAFETY: both pointers are valid for the call; the caller keeps
        // `id` alive for as long as `attr` is used.
        check("nvshmemx_set_attr_uniqueid_args", unsafe {
            (lib.nvshmemx_set_attr_uniqueid_args)(rank, nranks, id, attr)
        })
    }

    /// `nvshmemx_hostlib_init_attr`: collective over every PE of the id.
    ///
    /// # Safety
    ///
    /// The current thread's CUDA context must be the device's; `attr`'s
    /// unique id must be alive; call once per process, paired with
    /// [`hostlib_finalize`].
    pub unsafe fn hostlib_init_attr(
        flags: u32,
        attr: &mut sys::nvshmemx_init_attr_t,
    ) -> Result<()> {
        let lib = lib()?;
        // SAFETY: the caller upholds NVSHMEM's init preconditions.
        check("nvshmemx_hostlib_init_attr", unsafe {
            (lib.nvshmemx_hostlib_init_attr)(flags, attr)
        })
    }

    /// `nvshmemx_hostlib_finalize`.
    ///
    /// # Safety
    ///
    /// After a successful [`hostlib_init_attr`], once, with no symmetric
    /// allocation still in use.
    pub unsafe fn hostlib_finalize() -> Result<()> {
        let lib = lib()?;
        // SAFETY: the caller pairs it with init.
        unsafe { (lib.nvshmemx_hostlib_finalize)() };
        Ok(())
    }

    /// `nvshmemx_init_status`: nonzero once initialized.
    pub fn status() -> Result<c_int> {
        let lib = lib()?;
        // SAFETY: a pure query, valid before and after init.
        Ok(unsafe { (lib.nvshmemx_init_status)() })
    }
}

/// Processing elements.
pub mod pe {
    use super::*;

    /// `nvshmem_my_pe`. Valid after init.
    pub fn my() -> Result<c_int> {
        let lib = lib()?;
        // SAFETY: a query; NVSHMEM returns -1 before init.
        Ok(unsafe { (lib.nvshmem_my_pe)() })
    }

    /// `nvshmem_n_pes`. Valid after init.
    pub fn count() -> Result<c_int> {
        let lib = lib()?;
        // SAFETY: as above.
        Ok(unsafe { (lib.nvshmem_n_pes)() })
    }
}

/// The symmetric heap.
pub mod mem {
    use super::*;

    /// `nvshmem_align(align, bytes)`: collective; every PE must call it
    /// with the same arguments in the same order.
    ///
    /// # Safety
    ///
    /// After init; collective ordering as above.
    pub unsafe fn align(align: usize, bytes: usize) -> Result<*mut c_void> {
        let lib = lib()?;
        // SAFETY: the caller upholds the collective contract.
        let ptr = unsafe { (lib.nvshmem_align)(align, bytes) };
        if ptr.is_null() {
            return Err(Error::Nvshmem {
                call: "nvshmem_align",
                detail: format!("returned null for {bytes} bytes aligned to {align}"),
            });
        }
        Ok(ptr)
    }

    /// `nvshmem_free`: collective.
    ///
    /// # Safety
    ///
    /// `ptr` came from [`align`], is freed once, and no stream still uses it.
    pub unsafe fn free(ptr: *mut c_void) -> Result<()> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        unsafe { (lib.nvshmem_free)(ptr) };
        Ok(())
    }

    /// `nvshmem_ptr`: a load/store address of `pe`'s copy of `ptr`, or
    /// `None` when `pe` is not reachable by loads (another node).
    ///
    /// # Safety
    ///
    /// `ptr` is a symmetric address.
    pub unsafe fn peer_ptr(ptr: *const c_void, pe: c_int) -> Result<Option<*mut c_void>> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        let p = unsafe { (lib.nvshmem_ptr)(ptr, pe) };
        Ok((!p.is_null()).then_some(p))
    }
}

/// One-sided operations enqueued on a CUDA stream.
pub mod rma {
    use super::*;

    /// `nvshmemx_getmem_on_stream`: `bytes` from `pe`'s `src` into `dst`.
    ///
    /// # Safety
    ///
    /// `src` is symmetric, `dst` local device memory, both valid for
    /// `bytes` until the stream passes this point.
    pub unsafe fn get_on_stream(
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
        pe: c_int,
        stream: CUstream,
    ) -> Result<()> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        unsafe { (lib.nvshmemx_getmem_on_stream)(dst, src, bytes, pe, stream) };
        Ok(())
    }

    /// `nvshmemx_putmem_on_stream`: `bytes` from local `src` into `pe`'s
    /// `dst`; complete at `pe` after a later quiet on the stream.
    ///
    /// # Safety
    ///
    /// `dst` is symmetric, `src` valid for `bytes` until the stream passes
    /// this point.
    pub unsafe fn put_on_stream(
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
        pe: c_int,
        stream: CUstream,
    ) -> Result<()> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        unsafe { (lib.nvshmemx_putmem_on_stream)(dst, src, bytes, pe, stream) };
        Ok(())
    }

    /// `nvshmemx_putmem_signal_on_stream`: `bytes` into `pe`'s `dst`, then
    /// `sig_op` (set or add) of `signal` on `pe`'s `sig_addr`, ordered
    /// after the data.
    ///
    /// # Safety
    ///
    /// `dst` and `sig_addr` are symmetric, `src` valid for `bytes` until
    /// the stream passes this point.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn put_signal_on_stream(
        dst: *mut c_void,
        src: *const c_void,
        bytes: usize,
        sig_addr: *mut u64,
        signal: u64,
        sig_op: c_int,
        pe: c_int,
        stream: CUstream,
    ) -> Result<()> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        unsafe {
            (lib.nvshmemx_putmem_signal_on_stream)(
                dst, src, bytes, sig_addr, signal, sig_op, pe, stream,
            )
        };
        Ok(())
    }

    /// `nvshmemx_signal_wait_until_on_stream`: the stream waits until the
    /// local `sig_addr` compares `cmp` against `value`.
    ///
    /// # Safety
    ///
    /// `sig_addr` is a symmetric signal word of this PE.
    pub unsafe fn signal_wait_until_on_stream(
        sig_addr: *mut u64,
        cmp: c_int,
        value: u64,
        stream: CUstream,
    ) -> Result<()> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        unsafe { (lib.nvshmemx_signal_wait_until_on_stream)(sig_addr, cmp, value, stream) };
        Ok(())
    }

    /// `nvshmemx_quiet_on_stream`: completes this PE's outstanding puts.
    ///
    /// # Safety
    ///
    /// After init; `stream` is live.
    pub unsafe fn quiet_on_stream(stream: CUstream) -> Result<()> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        unsafe { (lib.nvshmemx_quiet_on_stream)(stream) };
        Ok(())
    }
}

/// Whole-job synchronization (setup and teardown only: ODC's data path has
/// no barrier).
pub mod sync {
    use super::*;

    /// `nvshmem_barrier_all`.
    ///
    /// # Safety
    ///
    /// After init; every PE calls it.
    pub unsafe fn barrier_all() -> Result<()> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        unsafe { (lib.nvshmem_barrier_all)() };
        Ok(())
    }

    /// `nvshmemx_barrier_all_on_stream`.
    ///
    /// # Safety
    ///
    /// As [`barrier_all`]; `stream` is live.
    pub unsafe fn barrier_all_on_stream(stream: CUstream) -> Result<()> {
        let lib = lib()?;
        // SAFETY: as the caller vouches.
        unsafe { (lib.nvshmemx_barrier_all_on_stream)(stream) };
        Ok(())
    }
}
