//! Owned libfabric objects. Each holds an `Arc` of what it was opened from,
//! so closing follows the dependency order by construction: memory
//! registrations and the endpoint close before the CQ and AV, those before
//! the domain, the domain before the fabric. A close that fails is logged
//! (there is no one to return it to in `Drop`).
//!
//! The domain is opened `FI_THREAD_SAFE`, so every object may be used from
//! any thread; data-path calls take `&self`.

use std::ffi::c_void;
use std::sync::Arc;

use super::result;
use super::sys;
use crate::Result;

fn log_close(what: &str, r: Result<()>) {
    if let Err(e) = r {
        eprintln!("odc: fabric: closing the {what} failed: {e}");
    }
}

macro_rules! thread_safe {
    ($($t:ty),*) => {$(
        // SAFETY: the domain is opened with FI_THREAD_SAFE: libfabric
        // serializes concurrent calls on its objects itself, and the raw
        // pointer is never freed while this owner lives.
        unsafe impl Send for $t {}
        // SAFETY: as above.
        unsafe impl Sync for $t {}
    )*};
}

/// An `fi_info` list head from `fi_getinfo`.
#[derive(Debug)]
pub struct Info {
    ptr: *mut sys::FiInfo,
}

thread_safe!(Info, Fabric, Domain, Cq, Av, Ep, Mr);

/// What the provider granted.
#[derive(Clone, Debug)]
pub struct Granted {
    /// `FI_MR_*` bits the provider requires.
    pub mr_mode: u64,
    /// Bytes of remote CQ data.
    pub cq_data_size: u64,
    /// Local buffers per operation.
    pub iov_limit: u64,
    /// Largest single operation.
    pub max_msg_size: u64,
    /// Provider name (`"tcp;ofi_rxm"`).
    pub provider: String,
    /// Operations the transmit queue holds (`tx_attr->size`): how many a
    /// batch keeps in flight at most.
    pub tx_size: u64,
}

impl Info {
    /// `fi_getinfo` for an RDM RMA endpoint of `provider` bound to
    /// `node:service`, offering to honour `mr_mode`.
    pub fn get(provider: &str, node: &str, service: &str, mr_mode: u64) -> Result<Info> {
        Ok(Info {
            ptr: result::info::get(provider, node, service, mr_mode)?,
        })
    }

    /// What the first matching provider granted.
    pub fn granted(&self) -> Granted {
        // SAFETY: `ptr` is live while `self` is.
        let (mr_mode, cq_data_size, iov_limit, max_msg_size, provider, tx_size) =
            unsafe { result::info::attrs(self.ptr) };
        Granted {
            mr_mode,
            cq_data_size,
            iov_limit,
            max_msg_size,
            provider,
            tx_size,
        }
    }
}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: from fi_getinfo, freed once.
        unsafe { result::info::free(self.ptr) }
    }
}

/// An open fabric.
#[derive(Debug)]
pub struct Fabric {
    ptr: *mut sys::FidFabric,
}

impl Fabric {
    /// `fi_fabric`.
    pub fn open(info: &Info) -> Result<Arc<Fabric>> {
        // SAFETY: info is live.
        let ptr = unsafe { result::open::fabric(info.ptr)? };
        Ok(Arc::new(Fabric { ptr }))
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: the last owner; every domain (which holds an Arc of this)
        // is closed.
        log_close("fabric", unsafe { result::close::fabric(self.ptr) });
    }
}

/// An open domain.
#[derive(Debug)]
pub struct Domain {
    ptr: *mut sys::FidDomain,
    _fabric: Arc<Fabric>,
}

impl Domain {
    /// `fi_domain`.
    pub fn open(fabric: &Arc<Fabric>, info: &Info) -> Result<Arc<Domain>> {
        // SAFETY: both live.
        let ptr = unsafe { result::open::domain(fabric.ptr, info.ptr)? };
        Ok(Arc::new(Domain {
            ptr,
            _fabric: Arc::clone(fabric),
        }))
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: the last owner; CQs, AVs, endpoints and MRs hold an Arc of
        // this, so all are closed.
        log_close("domain", unsafe { result::close::domain(self.ptr) });
    }
}

/// A completion queue with a wait object.
#[derive(Debug)]
pub struct Cq {
    ptr: *mut sys::FidCq,
    _domain: Arc<Domain>,
}

impl Cq {
    /// `fi_cq_open` with room for `size` entries.
    pub fn open(domain: &Arc<Domain>, size: usize) -> Result<Arc<Cq>> {
        // SAFETY: domain live.
        let ptr = unsafe { result::open::cq(domain.ptr, size)? };
        Ok(Arc::new(Cq {
            ptr,
            _domain: Arc::clone(domain),
        }))
    }

    /// Blocks up to `timeout_ms` for completions: the count, 0 on timeout,
    /// -1 when an error entry waits for [`Cq::readerr`].
    pub fn sread(&self, out: &mut [sys::CqEntry], timeout_ms: i32) -> Result<i32> {
        // SAFETY: live.
        unsafe { result::cq::sread(self.ptr, out, timeout_ms) }
    }

    /// Non-blocking [`Cq::sread`].
    pub fn read(&self, out: &mut [sys::CqEntry]) -> Result<i32> {
        // SAFETY: live.
        unsafe { result::cq::read(self.ptr, out) }
    }

    /// The next error entry: context, fi errno, provider text.
    pub fn readerr(&self) -> Result<(*mut c_void, i32, String)> {
        // SAFETY: live.
        unsafe { result::cq::readerr(self.ptr) }
    }

    /// Wakes a thread blocked in [`Cq::sread`].
    pub fn signal(&self) -> Result<()> {
        // SAFETY: live.
        unsafe { result::cq::signal(self.ptr) }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: the last owner; the endpoint bound to it holds an Arc.
        log_close("completion queue", unsafe { result::close::cq(self.ptr) });
    }
}

/// An address vector (table).
#[derive(Debug)]
pub struct Av {
    ptr: *mut sys::FidAv,
    _domain: Arc<Domain>,
}

impl Av {
    /// `fi_av_open`.
    pub fn open(domain: &Arc<Domain>) -> Result<Arc<Av>> {
        // SAFETY: domain live.
        let ptr = unsafe { result::open::av(domain.ptr)? };
        Ok(Arc::new(Av {
            ptr,
            _domain: Arc::clone(domain),
        }))
    }

    /// Inserts one peer address; returns its `fi_addr_t`.
    pub fn insert(&self, addr: &[u8]) -> Result<u64> {
        // SAFETY: live.
        unsafe { result::av::insert(self.ptr, addr) }
    }
}

impl Drop for Av {
    fn drop(&mut self) {
        // SAFETY: the last owner; the endpoint bound to it holds an Arc.
        log_close("address vector", unsafe { result::close::av(self.ptr) });
    }
}

/// An enabled RDM endpoint bound to one CQ and one AV.
///
/// Closing an endpoint with operations in flight crashed libfabric 1.17;
/// the owner must quiesce (every posted operation completed, CQ drained)
/// before the last `Arc` goes.
#[derive(Debug)]
pub struct Ep {
    ptr: *mut sys::FidEp,
    _cq: Arc<Cq>,
    _av: Arc<Av>,
    _domain: Arc<Domain>,
}

impl Ep {
    /// `fi_endpoint`, `fi_ep_bind` (CQ, AV), `fi_enable`.
    pub fn open(domain: &Arc<Domain>, info: &Info, cq: &Arc<Cq>, av: &Arc<Av>) -> Result<Arc<Ep>> {
        // SAFETY: all live and of one domain.
        let ptr = unsafe { result::open::endpoint(domain.ptr, info.ptr)? };
        let ep = Ep {
            ptr,
            _cq: Arc::clone(cq),
            _av: Arc::clone(av),
            _domain: Arc::clone(domain),
        };
        // SAFETY: all live; on failure `ep` drops and closes the endpoint.
        unsafe { result::ep::bind_and_enable(ep.ptr, cq.ptr, av.ptr)? };
        Ok(Arc::new(ep))
    }

    /// This endpoint's address.
    pub fn name(&self) -> Result<Vec<u8>> {
        // SAFETY: live and enabled.
        unsafe { result::ep::getname(self.ptr) }
    }

    /// Posts an `fi_read`; returns the raw status (`-FI_EAGAIN` to retry).
    ///
    /// # Safety
    /// `buf..buf+len` and `ctx` stay valid until the completion is read.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_read(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> i32 {
        // SAFETY: per the contract above.
        unsafe { result::ep::read(self.ptr, buf, len, desc, src, addr, key, ctx) }
    }

    /// Posts an `fi_writemsg` with remote CQ data; returns the raw status.
    ///
    /// # Safety
    /// The buffers and `ctx` stay valid until the completion is read.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_writedata(
        &self,
        bufs: &[*mut c_void],
        lens: &[usize],
        descs: &mut [*mut c_void],
        dest: u64,
        addr: u64,
        key: u64,
        data: u64,
        ctx: *mut c_void,
    ) -> i32 {
        // SAFETY: per the contract above.
        unsafe { result::ep::writedata(self.ptr, bufs, lens, descs, dest, addr, key, data, ctx) }
    }

    /// Asks the provider to cancel the operation posted with `ctx`.
    ///
    /// # Safety
    /// `ctx` is the context of an operation posted on this endpoint whose
    /// completion has not been read yet (libfabric looks it up, and its
    /// cancellation completes through the CQ like any other).
    pub unsafe fn cancel(&self, ctx: *mut c_void) -> Result<()> {
        // SAFETY: live endpoint; `ctx` per the contract above.
        unsafe { result::ep::cancel(self.ptr, ctx) }
    }
}

impl Drop for Ep {
    fn drop(&mut self) {
        // SAFETY: the last owner (MRs bound to it hold an Arc); the transport
        // quiesced it before letting go.
        log_close("endpoint", unsafe { result::close::ep(self.ptr) });
    }
}

/// A memory registration.
#[derive(Debug)]
pub struct Mr {
    ptr: *mut sys::FidMr,
    key: u64,
    desc: *mut c_void,
    _ep: Option<Arc<Ep>>,
    _domain: Arc<Domain>,
}

impl Mr {
    /// Registers `len` bytes at `buf` with `key` (ignored under
    /// `FI_MR_PROV_KEY`); binds it to `ep` when given (`FI_MR_ENDPOINT`).
    ///
    /// # Safety
    /// `buf..buf+len` stays valid until the returned `Mr` drops.
    pub unsafe fn register(
        domain: &Arc<Domain>,
        buf: *mut u8,
        len: usize,
        remote: bool,
        key: u64,
        ep: Option<&Arc<Ep>>,
    ) -> Result<Mr> {
        // SAFETY: per the contract above.
        let ptr = unsafe { result::mr::reg(domain.ptr, buf, len, remote, key)? };
        let mut mr = Mr {
            ptr,
            key: 0,
            desc: std::ptr::null_mut(),
            _ep: ep.cloned(),
            _domain: Arc::clone(domain),
        };
        if let Some(ep) = ep {
            // SAFETY: both live; on failure `mr` drops and closes.
            unsafe { result::mr::bind_enable(mr.ptr, ep.ptr)? };
        }
        // SAFETY: live (and enabled where needed).
        let (key, desc) = unsafe { result::mr::key_desc(mr.ptr) };
        mr.key = key;
        mr.desc = desc;
        Ok(mr)
    }

    /// The remote key.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The local descriptor (`fi_mr_desc`), passed with every operation.
    pub fn desc(&self) -> *mut c_void {
        self.desc
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: the last owner; the memory it covers outlives it.
        log_close("memory registration", unsafe {
            result::close::mr(self.ptr)
        });
    }
}
