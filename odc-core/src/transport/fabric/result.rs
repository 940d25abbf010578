//! Thin `Result` layer over [`super::sys`]: every call returns
//! `Result<_, Error::Fabric>` naming the libfabric call and carrying its
//! `fi_strerror` text; C names are regrouped by object (`fi_mr_reg` →
//! `mr::reg`). Pointers stay raw here; ownership lives in [`super::safe`].

use std::ffi::{c_int, c_void, CStr, CString};

use super::sys;
use crate::{Error, Result};

/// `fi_strerror(code)` for a positive fi errno.
pub fn strerror(code: c_int) -> String {
    // SAFETY: fi_strerror returns a static NUL-terminated string for any code.
    unsafe {
        let p = sys::odc_fi_strerror(code);
        if p.is_null() {
            format!("error {code}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Maps a libfabric return value (0 or positive: success; negative: fi
/// errno) to a `Result`.
pub fn check(call: &'static str, ret: c_int) -> Result<c_int> {
    if ret >= 0 {
        Ok(ret)
    } else {
        Err(Error::Fabric {
            call,
            code: -ret,
            detail: strerror(-ret),
        })
    }
}

/// `FI_EAGAIN` as returned (negative).
pub fn eagain() -> c_int {
    // SAFETY: returns a constant.
    -unsafe { sys::odc_fi_eagain() }
}

/// `FI_EAVAIL` as returned (negative).
pub fn eavail() -> c_int {
    // SAFETY: returns a constant.
    -unsafe { sys::odc_fi_eavail() }
}

fn cstring(call: &'static str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Fabric {
        call,
        code: 0,
        detail: format!("{s:?} contains NUL"),
    })
}

/// `fi_getinfo` / `fi_freeinfo` / the attributes the transport reads.
pub mod info {
    use super::*;

    /// `fi_getinfo` for an RDM RMA endpoint bound to `node:service`.
    pub fn get(prov: &str, node: &str, service: &str, mr_mode: u64) -> Result<*mut sys::FiInfo> {
        let (p, n, s) = (
            cstring("fi_getinfo", prov)?,
            cstring("fi_getinfo", node)?,
            cstring("fi_getinfo", service)?,
        );
        let mut out = std::ptr::null_mut();
        // SAFETY: the strings outlive the call; `out` receives a list we own.
        check("fi_getinfo", unsafe {
            sys::odc_fi_getinfo(p.as_ptr(), n.as_ptr(), s.as_ptr(), mr_mode, &mut out)
        })?;
        if out.is_null() {
            return Err(Error::Fabric {
                call: "fi_getinfo",
                code: 0,
                detail: "no provider matched".into(),
            });
        }
        Ok(out)
    }

    /// `fi_freeinfo`.
    ///
    /// # Safety
    /// `info` came from [`get`] and is not used afterwards.
    pub unsafe fn free(info: *mut sys::FiInfo) {
        // SAFETY: per the contract above.
        unsafe { sys::odc_fi_freeinfo(info) }
    }

    /// `domain_attr->mr_mode`, `domain_attr->cq_data_size`,
    /// `tx_attr->iov_limit`, `ep_attr->max_msg_size`, `fabric_attr->prov_name`,
    /// `tx_attr->size`.
    ///
    /// # Safety
    /// `info` is a live info from [`get`].
    pub unsafe fn attrs(info: *const sys::FiInfo) -> (u64, u64, u64, u64, String, u64) {
        // SAFETY: per the contract above; prov_name is NUL-terminated or null.
        unsafe {
            let name = sys::odc_fi_info_prov_name(info);
            let name = if name.is_null() {
                String::new()
            } else {
                CStr::from_ptr(name).to_string_lossy().into_owned()
            };
            (
                sys::odc_fi_info_mr_mode(info),
                sys::odc_fi_info_cq_data_size(info),
                sys::odc_fi_info_iov_limit(info),
                sys::odc_fi_info_max_msg_size(info),
                name,
                sys::odc_fi_info_tx_size(info),
            )
        }
    }
}

/// Opens and closes objects; each function names its libfabric call.
pub mod open {
    use super::*;

    /// `fi_fabric`.
    ///
    /// # Safety
    /// `info` is live.
    pub unsafe fn fabric(info: *mut sys::FiInfo) -> Result<*mut sys::FidFabric> {
        let mut out = std::ptr::null_mut();
        // SAFETY: per the contract above.
        check("fi_fabric", unsafe { sys::odc_fi_fabric(info, &mut out) })?;
        Ok(out)
    }

    /// `fi_domain`.
    ///
    /// # Safety
    /// Both pointers are live.
    pub unsafe fn domain(
        f: *mut sys::FidFabric,
        info: *mut sys::FiInfo,
    ) -> Result<*mut sys::FidDomain> {
        let mut out = std::ptr::null_mut();
        // SAFETY: per the contract above.
        check("fi_domain", unsafe {
            sys::odc_fi_domain(f, info, &mut out)
        })?;
        Ok(out)
    }

    /// `fi_cq_open` (`FI_CQ_FORMAT_DATA`, a wait object for `fi_cq_sread`).
    ///
    /// # Safety
    /// `d` is live.
    pub unsafe fn cq(d: *mut sys::FidDomain, size: usize) -> Result<*mut sys::FidCq> {
        let mut out = std::ptr::null_mut();
        // SAFETY: per the contract above.
        check("fi_cq_open", unsafe {
            sys::odc_fi_cq_open(d, size, &mut out)
        })?;
        Ok(out)
    }

    /// `fi_av_open` (`FI_AV_TABLE`).
    ///
    /// # Safety
    /// `d` is live.
    pub unsafe fn av(d: *mut sys::FidDomain) -> Result<*mut sys::FidAv> {
        let mut out = std::ptr::null_mut();
        // SAFETY: per the contract above.
        check("fi_av_open", unsafe { sys::odc_fi_av_open(d, &mut out) })?;
        Ok(out)
    }

    /// `fi_endpoint`.
    ///
    /// # Safety
    /// Both pointers are live.
    pub unsafe fn endpoint(
        d: *mut sys::FidDomain,
        info: *mut sys::FiInfo,
    ) -> Result<*mut sys::FidEp> {
        let mut out = std::ptr::null_mut();
        // SAFETY: per the contract above.
        check("fi_endpoint", unsafe {
            sys::odc_fi_endpoint(d, info, &mut out)
        })?;
        Ok(out)
    }
}

/// `fi_close` of each object type.
pub mod close {
    use super::*;

    macro_rules! closer {
        ($name:ident, $ty:ty, $f:ident) => {
            /// `fi_close`.
            ///
            /// # Safety
            /// `x` is live, nothing else still uses it, and objects bound to
            /// it were closed first.
            pub unsafe fn $name(x: *mut $ty) -> Result<()> {
                // SAFETY: per the contract above.
                check("fi_close", unsafe { sys::$f(x) }).map(|_| ())
            }
        };
    }
    closer!(fabric, sys::FidFabric, odc_fi_close_fabric);
    closer!(domain, sys::FidDomain, odc_fi_close_domain);
    closer!(cq, sys::FidCq, odc_fi_close_cq);
    closer!(av, sys::FidAv, odc_fi_close_av);
    closer!(ep, sys::FidEp, odc_fi_close_ep);
    closer!(mr, sys::FidMr, odc_fi_close_mr);
}

/// Endpoint calls.
pub mod ep {
    use super::*;

    /// `fi_ep_bind` of the CQ (transmit and receive) and the AV, then
    /// `fi_enable`.
    ///
    /// # Safety
    /// All pointers are live and belong to one domain.
    pub unsafe fn bind_and_enable(
        ep: *mut sys::FidEp,
        cq: *mut sys::FidCq,
        av: *mut sys::FidAv,
    ) -> Result<()> {
        // SAFETY: per the contract above.
        unsafe {
            check("fi_ep_bind(cq)", sys::odc_fi_ep_bind_cq(ep, cq))?;
            check("fi_ep_bind(av)", sys::odc_fi_ep_bind_av(ep, av))?;
            check("fi_enable", sys::odc_fi_enable(ep))?;
        }
        Ok(())
    }

    /// `fi_getname`: the endpoint's address bytes.
    ///
    /// # Safety
    /// `ep` is live and enabled.
    pub unsafe fn getname(ep: *mut sys::FidEp) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: buf has `len` writable bytes.
        check("fi_getname", unsafe {
            sys::odc_fi_getname(ep, buf.as_mut_ptr().cast(), &mut len)
        })?;
        buf.truncate(len.min(256));
        Ok(buf)
    }

    /// `fi_read`. Returns the raw status so callers can retry `-FI_EAGAIN`.
    ///
    /// # Safety
    /// `buf` stays valid for `len` bytes and `ctx` (an `fi_context`) stays
    /// valid until the operation's completion is read from the CQ.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn read(
        ep: *mut sys::FidEp,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> c_int {
        // SAFETY: per the contract above.
        unsafe { sys::odc_fi_read(ep, buf.cast(), len, desc, src, addr, key, ctx) }
    }

    /// `fi_writemsg` of up to 4 buffers with `FI_REMOTE_CQ_DATA`. Returns
    /// the raw status.
    ///
    /// # Safety
    /// Every buffer stays valid and `ctx` stays valid until the completion
    /// is read from the CQ.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn writedata(
        ep: *mut sys::FidEp,
        bufs: &[*mut c_void],
        lens: &[usize],
        descs: &mut [*mut c_void],
        dest: u64,
        addr: u64,
        key: u64,
        data: u64,
        ctx: *mut c_void,
    ) -> c_int {
        // SAFETY: per the contract above; the three slices have equal length.
        unsafe {
            sys::odc_fi_writedata_v(
                ep,
                bufs.as_ptr(),
                lens.as_ptr(),
                descs.as_mut_ptr(),
                bufs.len(),
                dest,
                addr,
                key,
                data,
                ctx,
            )
        }
    }

    /// `fi_cancel` of the operation with context `ctx`.
    ///
    /// # Safety
    /// `ep` is live.
    pub unsafe fn cancel(ep: *mut sys::FidEp, ctx: *mut c_void) -> Result<()> {
        // SAFETY: per the contract above.
        check("fi_cancel", unsafe { sys::odc_fi_cancel(ep, ctx) }).map(|_| ())
    }
}

/// Address vector calls.
pub mod av {
    use super::*;

    /// `fi_av_insert` of one address.
    ///
    /// # Safety
    /// `av` is live.
    pub unsafe fn insert(av: *mut sys::FidAv, addr: &[u8]) -> Result<u64> {
        let mut out = u64::MAX;
        // SAFETY: addr is a complete address of the AV's format.
        let n = check("fi_av_insert", unsafe {
            sys::odc_fi_av_insert(av, addr.as_ptr().cast(), &mut out)
        })?;
        if n != 1 {
            return Err(Error::Fabric {
                call: "fi_av_insert",
                code: 0,
                detail: format!("inserted {n} of 1 addresses"),
            });
        }
        Ok(out)
    }
}

/// Memory registration calls.
pub mod mr {
    use super::*;

    /// `fi_mr_reg` with remote (or only local) access.
    ///
    /// # Safety
    /// `buf` stays valid for `len` bytes until the MR is closed.
    pub unsafe fn reg(
        d: *mut sys::FidDomain,
        buf: *mut u8,
        len: usize,
        remote: bool,
        key: u64,
    ) -> Result<*mut sys::FidMr> {
        let mut out = std::ptr::null_mut();
        // SAFETY: per the contract above.
        unsafe {
            let access = if remote {
                sys::odc_fi_access_remote()
            } else {
                sys::odc_fi_access_local()
            };
            check(
                "fi_mr_reg",
                sys::odc_fi_mr_reg(d, buf.cast(), len, access, key, &mut out),
            )?;
        }
        Ok(out)
    }

    /// `fi_mr_bind` to the endpoint, then `fi_mr_enable` (`FI_MR_ENDPOINT`).
    ///
    /// # Safety
    /// Both are live.
    pub unsafe fn bind_enable(mr: *mut sys::FidMr, ep: *mut sys::FidEp) -> Result<()> {
        // SAFETY: per the contract above.
        unsafe {
            check("fi_mr_bind", sys::odc_fi_mr_bind_ep(mr, ep))?;
            check("fi_mr_enable", sys::odc_fi_mr_enable(mr))?;
        }
        Ok(())
    }

    /// `fi_mr_key` and `fi_mr_desc`.
    ///
    /// # Safety
    /// `mr` is live.
    pub unsafe fn key_desc(mr: *mut sys::FidMr) -> (u64, *mut c_void) {
        // SAFETY: per the contract above.
        unsafe { (sys::odc_fi_mr_key(mr), sys::odc_fi_mr_desc(mr)) }
    }
}

/// Completion queue calls.
pub mod cq {
    use super::*;

    /// `fi_cq_sread` (`timeout_ms` < 0 blocks): `Ok(n)` entries, `Ok(0)` on
    /// timeout, `Err(-FI_EAVAIL)` passed through as `Ok(-1)`.
    ///
    /// # Safety
    /// `cq` is live.
    pub unsafe fn sread(
        cq: *mut sys::FidCq,
        out: &mut [sys::CqEntry],
        timeout_ms: i32,
    ) -> Result<i32> {
        // SAFETY: `out` has room for out.len() entries.
        let n = unsafe { sys::odc_fi_cq_sread(cq, out.as_mut_ptr(), out.len(), timeout_ms) };
        classify("fi_cq_sread", n)
    }

    /// `fi_cq_read`, classified like [`sread`].
    ///
    /// # Safety
    /// `cq` is live.
    pub unsafe fn read(cq: *mut sys::FidCq, out: &mut [sys::CqEntry]) -> Result<i32> {
        // SAFETY: `out` has room for out.len() entries.
        let n = unsafe { sys::odc_fi_cq_read(cq, out.as_mut_ptr(), out.len()) };
        classify("fi_cq_read", n)
    }

    fn classify(call: &'static str, n: c_int) -> Result<i32> {
        if n >= 0 {
            Ok(n)
        } else if n == eagain() || n == -libc::ETIMEDOUT || n == -libc::EINTR {
            Ok(0)
        } else if n == eavail() {
            Ok(-1)
        } else {
            check(call, n)
        }
    }

    /// `fi_cq_readerr`: the failed operation's context, fi errno and the
    /// provider's text.
    ///
    /// # Safety
    /// `cq` is live.
    pub unsafe fn readerr(cq: *mut sys::FidCq) -> Result<(*mut c_void, i32, String)> {
        let mut ctx = std::ptr::null_mut();
        let mut err = 0;
        let mut msg = [0 as std::ffi::c_char; 256];
        // SAFETY: msg has 256 writable bytes; the shim NUL-terminates it.
        unsafe {
            check(
                "fi_cq_readerr",
                sys::odc_fi_cq_readerr(cq, &mut ctx, &mut err, msg.as_mut_ptr(), msg.len()),
            )?;
            let text = CStr::from_ptr(msg.as_ptr()).to_string_lossy().into_owned();
            Ok((ctx, err, text))
        }
    }

    /// `fi_cq_signal`: wakes a thread blocked in `fi_cq_sread`.
    ///
    /// # Safety
    /// `cq` is live.
    pub unsafe fn signal(cq: *mut sys::FidCq) -> Result<()> {
        // SAFETY: per the contract above.
        check("fi_cq_signal", unsafe { sys::odc_fi_cq_signal(cq) }).map(|_| ())
    }
}

/// Flag and mode-bit values from the headers.
pub mod consts {
    use super::sys;

    /// `FI_REMOTE_CQ_DATA`.
    pub fn remote_cq_data() -> u64 {
        // SAFETY: returns a constant.
        unsafe { sys::odc_fi_flag_remote_cq_data() }
    }

    /// The `FI_MR_*` bits this transport can honour: LOCAL, VIRT_ADDR,
    /// ALLOCATED, PROV_KEY, ENDPOINT (in that order).
    pub fn mr_bits() -> [u64; 5] {
        // SAFETY: each returns a constant.
        unsafe {
            [
                sys::odc_fi_mr_bit_local(),
                sys::odc_fi_mr_bit_virt_addr(),
                sys::odc_fi_mr_bit_allocated(),
                sys::odc_fi_mr_bit_prov_key(),
                sys::odc_fi_mr_bit_endpoint(),
            ]
        }
    }

    /// `sizeof(struct fi_context)`.
    pub fn context_size() -> usize {
        // SAFETY: returns a constant.
        unsafe { sys::odc_fi_context_size() }
    }
}
