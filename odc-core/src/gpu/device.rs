//! CUDA device memory shared between the processes of one node: what the
//! `cuda-ipc` transport is built on.
//!
//! One file because device memory, its export and import and the
//! capability probes share one driver context discipline (bind, then call);
//! the last forty lines are its tests.
//!
//! - [`Gpu`] is one device in this process: its primary context, and what
//!   the driver can do with it ([`Caps`]).
//! - [`DeviceRegion`] is memory this rank owns, zeroed, with the handle a
//!   peer needs to map it ([`Shareable`]): a POSIX file descriptor from
//!   `cuMemCreate` + `cuMemExportToShareableHandle` where the device
//!   supports it, else a legacy `cuIpcGetMemHandle` handle on a
//!   `cuMemAlloc` block.
//! - [`PeerRegion`] is a peer's region mapped into this process
//!   (`cuMemImportFromShareableHandle` + `cuMemMap`, or
//!   `cuIpcOpenMemHandle`), unmapped on drop.
//! - [`HostRegistration`] makes host memory (a peer's `shm` control
//!   segment) addressable by this device, so that a stream can write a
//!   signal word into it after the data (`cuStreamWriteValue64`).
//! - [`Stream`] wraps a caller's `CUstream` with the stream operations a
//!   one-sided put needs (an async copy, a 64-bit value write ordered after
//!   it, and a host callback to ring the owner's bell) and those of the
//!   device data plane (`crate::plane`): zeroing, and ordering one stream
//!   after another with an event ([`Stream::wait_for`]).
//!
//! The descriptor of a `cuMemCreate` region travels to peers through
//! [`fdshare`](super::fdshare); the legacy handle is 64 plain bytes that
//! travel through the Store.
//!
//! Nothing here links CUDA. [`Gpu::open`] first checks, without calling
//! into the driver, that it loads and exports every function this module
//! calls ([`DRIVER_SYMBOLS`]), because cudarc panics on a missing symbol;
//! every failure is then a [`Error::GpuUnavailable`] naming what is
//! missing or an [`Error::Cuda`] naming the call.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use odc_kernels::cuda::cudarc::driver::{result as cu, sys, CudaContext, DriverError};

use super::Missing;
use crate::{Error, Result};

/// Every driver function this module (and the kernels it launches) calls,
/// with those the `cuda-ipc` data plane (`plane::cuda`) adds: the stream it
/// creates through cudarc (`cuStreamCreate`, `cuStreamDestroy_v2`). Checked
/// by [`check_driver`] before the first call. The `_v2` names are the
/// symbols `cuda.h` maps the plain names to.
pub const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemsetD8_v2",
    "cuMemsetD8Async",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyDtoH_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemHostGetDevicePointer_v2",
    "cuStreamWriteValue64_v2",
    "cuLaunchHostFunc",
    "cuStreamSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuStreamWaitEvent",
    "cuEventDestroy_v2",
];

/// The driver library names tried, in order (what cudarc loads).
pub const DRIVER_LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// Checks that the CUDA driver library loads and exports every symbol in
/// [`DRIVER_SYMBOLS`]. Calls nothing in it. Cached per process.
///
/// Errors: [`Missing::Cuda`] (`NoDriver`) when no driver library loads,
/// [`Missing::DriverSymbol`] naming the first absent function (a driver too
/// old for the cuda-ipc transport).
pub fn check_driver() -> std::result::Result<(), Missing> {
    static CHECKED: OnceLock<std::result::Result<(), Missing>> = OnceLock::new();
    CHECKED
        .get_or_init(|| check_symbols(DRIVER_LIBRARIES, DRIVER_SYMBOLS))
        .clone()
}

/// [`check_driver`] for any list of library names and symbols (tests point
/// it at a library of their own).
pub fn check_symbols(libraries: &[&str], symbols: &[&str]) -> std::result::Result<(), Missing> {
    let mut opened = None;
    for name in libraries {
        // SAFETY: loading the driver library runs its initializers, which
        // are designed to run in any process (cudarc does the same).
        if let Ok(lib) = unsafe { libloading::Library::new(*name) } {
            opened = Some((lib, *name));
            break;
        }
    }
    let Some((lib, name)) = opened else {
        return Err(Missing::Cuda(odc_kernels::Unavailable::NoDriver));
    };
    for &symbol in symbols {
        // SAFETY: the symbol is only looked up, never called or read.
        if let Err(e) = unsafe { lib.get::<*const c_void>(symbol.as_bytes()) } {
            return Err(Missing::DriverSymbol {
                symbol: symbol.to_owned(),
                library: name.to_owned(),
                detail: e.to_string(),
            });
        }
    }
    Ok(())
}

/// A failed driver call as [`Error::Cuda`], with the status's name.
pub(crate) fn cuda(call: &'static str, e: DriverError) -> Error {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    Error::Cuda { call, detail: name }
}

fn check(call: &'static str, status: sys::CUresult) -> Result<()> {
    status.result().map_err(|e| cuda(call, e))
}

/// What the device and driver support, as far as the transports care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// `cuMemCreate` allocations can be exported as POSIX file descriptors
    /// (virtual memory management and the handle type are both supported).
    pub fd_handles: bool,
    /// `cuStreamWriteValue64` works on this device.
    pub stream_write_64: bool,
    /// Allocation granularity of `cuMemCreate` on the device, in bytes.
    pub granularity: usize,
}

/// One CUDA device in this process, in its primary context.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    caps: Caps,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .field("caps", &self.caps)
            .finish()
    }
}

/// Whether a region's memory came from `cuMemCreate` or `cuMemAlloc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Vmm(sys::CUmemGenericAllocationHandle),
    Legacy,
}

impl Gpu {
    /// Opens device `ordinal`: checks the driver ([`check_driver`]), that
    /// the device exists, and that it can run a one-sided put
    /// (`cuStreamWriteValue64`); retains its primary context.
    ///
    /// Errors: [`Error::GpuUnavailable`] naming what is missing (driver,
    /// symbol, device, capability), [`Error::Cuda`] when a present driver
    /// fails.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        check_driver()?;
        cu::init().map_err(|e| {
            Missing::Cuda(odc_kernels::Unavailable::NoDevice {
                reason: format!("cuInit: {e:?}"),
            })
        })?;
        let count = cu::device::get_count().map_err(|e| cuda("cuDeviceGetCount", e))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(Missing::Cuda(odc_kernels::Unavailable::NoDevice {
                reason: format!("device {ordinal} requested, the driver sees {count}"),
            })
            .into());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda("cuDevicePrimaryCtxRetain", e))?;
        let dev = ctx.cu_device();
        let attr = |a: sys::CUdevice_attribute| {
            // SAFETY: `dev` is a valid device of an initialized driver.
            unsafe { cu::device::get_attribute(dev, a) }
                .map_err(|e| cuda("cuDeviceGetAttribute", e))
        };
        use sys::CUdevice_attribute as A;
        let vmm = attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0;
        let fd = attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)? != 0;
        let stream_write_64 = attr(A::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)? != 0;
        if !stream_write_64 {
            return Err(Missing::DeviceCapability {
                ordinal,
                what: "64-bit stream memory operations (cuStreamWriteValue64)".into(),
            }
            .into());
        }
        let mut caps = Caps {
            fd_handles: vmm && fd,
            stream_write_64,
            granularity: 1,
        };
        if caps.fd_handles {
            let prop = alloc_prop(ordinal);
            let mut granularity = 0usize;
            ctx.bind_to_thread()
                .map_err(|e| cuda("cuCtxSetCurrent", e))?;
            // SAFETY: valid out-pointer and property struct.
            check("cuMemGetAllocationGranularity", unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut granularity,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            })?;
            caps.granularity = granularity.max(1);
        }
        Ok(Arc::new(Gpu { ctx, caps }))
    }

    /// The device's ordinal in this process.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// What the device supports.
    pub fn caps(&self) -> Caps {
        self.caps
    }

    /// The primary context (for kernels and streams on this device).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the device's primary context current on the calling thread.
    ///
    /// [`Stream`] operations run in the calling thread's current context:
    /// call this first on a thread that has not used the device yet (every
    /// method of [`Gpu`] does it itself).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda("cuCtxSetCurrent", e))
    }

    /// Copies `dst.len()` bytes at device address `src` into host memory;
    /// returns once they are there. Synchronous with respect to the legacy
    /// default stream only: work on a non-blocking stream that writes `src`
    /// must be waited for first ([`Stream::synchronize`]).
    ///
    /// # Safety
    /// `src` must address `dst.len()` readable bytes of device memory (or
    /// mapped peer memory) of this device's context.
    pub unsafe fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` is `dst.len()` writable host bytes borrowed for the
        // call (the copy is complete when it returns); the caller vouches
        // for `src`.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    /// Allocates `len` zeroed bytes of device memory that peers on this
    /// node can map: `cuMemCreate` with a file-descriptor handle where the
    /// device supports it, else `cuMemAlloc` with a legacy IPC handle.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceRegion> {
        self.bind()?;
        let len = len.max(1);
        let (ptr, size, kind) = if self.caps.fd_handles {
            let size = len.div_ceil(self.caps.granularity) * self.caps.granularity;
            let prop = alloc_prop(self.ordinal());
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: valid out-pointer and property struct; `size` is a
            // multiple of the granularity.
            check("cuMemCreate", unsafe {
                sys::cuMemCreate(&mut handle, size, &prop, 0)
            })?;
            match self.map(handle, size) {
                Ok(ptr) => (ptr, size, Kind::Vmm(handle)),
                Err(e) => {
                    // SAFETY: the handle is ours and mapped nowhere.
                    unsafe { sys::cuMemRelease(handle) };
                    return Err(e);
                }
            }
        } else {
            let mut ptr = 0;
            // SAFETY: valid out-pointer.
            check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
            (ptr, len, Kind::Legacy)
        };
        let region = DeviceRegion {
            gpu: Arc::clone(self),
            ptr,
            len,
            size,
            kind,
        };
        // SAFETY: `ptr` is `size` bytes of device memory we own.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, 0, size) })?;
        Ok(region)
    }

    /// Reserves an address range for `handle`, maps it and grants this
    /// device read/write access. Unwinds on failure.
    fn map(&self, handle: sys::CUmemGenericAllocationHandle, size: usize) -> Result<u64> {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; size is a multiple of the granularity.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
        })?;
        // SAFETY: the range was just reserved for `size` bytes.
        if let Err(e) = check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        }) {
            // SAFETY: reserved above, mapped nowhere.
            unsafe { sys::cuMemAddressFree(ptr, size) };
            return Err(e);
        }
        let access = sys::CUmemAccessDesc {
            location: location(self.ordinal()),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one valid descriptor.
        if let Err(e) = check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size, &access, 1)
        }) {
            // SAFETY: mapped and reserved above.
            unsafe {
                sys::cuMemUnmap(ptr, size);
                sys::cuMemAddressFree(ptr, size);
            }
            return Err(e);
        }
        Ok(ptr)
    }

    /// Maps a peer's region described by `shareable` (of `size` bytes, as
    /// the owner's [`DeviceRegion::size`] says) into this process.
    ///
    /// Errors: [`Error::Cuda`] naming the call (a peer on a device this one
    /// cannot reach peer-to-peer fails in `cuMemSetAccess` or
    /// `cuIpcOpenMemHandle`).
    pub fn import(self: &Arc<Self>, shareable: Shareable, size: usize) -> Result<PeerRegion> {
        self.bind()?;
        match shareable {
            Shareable::Fd(fd) => {
                use std::os::fd::AsRawFd;
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: a POSIX fd handle is passed as the descriptor's
                // value in the pointer argument; the driver dups what it
                // needs, so `fd` may be closed afterwards (it is, on drop).
                check("cuMemImportFromShareableHandle", unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut handle,
                        fd.as_raw_fd() as usize as *mut c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                })?;
                match self.map(handle, size) {
                    Ok(ptr) => Ok(PeerRegion {
                        gpu: Arc::clone(self),
                        ptr,
                        size,
                        kind: Kind::Vmm(handle),
                    }),
                    Err(e) => {
                        // SAFETY: imported above, mapped nowhere.
                        unsafe { sys::cuMemRelease(handle) };
                        Err(e)
                    }
                }
            }
            Shareable::Legacy(bytes) => {
                let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
                for (d, s) in handle.reserved.iter_mut().zip(bytes) {
                    *d = s as _;
                }
                let mut ptr = 0;
                // SAFETY: valid out-pointer; the handle names memory of a
                // live process (or the call fails).
                check("cuIpcOpenMemHandle", unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        handle,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                })?;
                Ok(PeerRegion {
                    gpu: Arc::clone(self),
                    ptr,
                    size,
                    kind: Kind::Legacy,
                })
            }
        }
    }

    /// Makes `len` bytes of host memory at `ptr` (page aligned, e.g. an
    /// `mmap`ed shm segment) addressable by this device until the
    /// registration drops.
    ///
    /// # Safety
    /// The memory must stay mapped until the returned value is dropped.
    pub unsafe fn register_host(
        self: &Arc<Self>,
        ptr: *mut u8,
        len: usize,
    ) -> Result<HostRegistration> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller keeps the memory mapped while registered.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, flags)
        })?;
        let mut dev = 0;
        // SAFETY: `ptr` was registered with DEVICEMAP just above.
        if let Err(e) = check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr.cast(), 0)
        }) {
            // SAFETY: registered above.
            unsafe { sys::cuMemHostUnregister(ptr.cast()) };
            return Err(e);
        }
        Ok(HostRegistration {
            gpu: Arc::clone(self),
            host: ptr as usize,
            device: dev,
            len,
        })
    }
}

fn location(ordinal: usize) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as c_int,
    }
}

fn alloc_prop(ordinal: usize) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// How a peer maps a [`DeviceRegion`].
#[derive(Debug)]
pub enum Shareable {
    /// A `cuMemCreate` allocation as a POSIX file descriptor (passed to
    /// peers with [`fdshare`](super::fdshare)).
    Fd(OwnedFd),
    /// A legacy `cuIpcGetMemHandle` handle: 64 bytes, sent through the Store.
    Legacy([u8; 64]),
}

/// Device memory this rank owns and peers may map; freed on drop (peers
/// must have unmapped it first: the engine's setup barrier orders that).
pub struct DeviceRegion {
    gpu: Arc<Gpu>,
    ptr: u64,
    len: usize,
    size: usize,
    kind: Kind,
}

impl fmt::Debug for DeviceRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceRegion")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("size", &self.size)
            .field("kind", &self.kind)
            .finish()
    }
}

impl DeviceRegion {
    /// Device address of byte 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: at least one byte is allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated (`len` rounded up to the granularity): what a peer
    /// passes to [`Gpu::import`].
    pub fn size(&self) -> usize {
        self.size
    }

    /// A handle a peer can map the region with: a fresh file descriptor
    /// (each call exports a new one) or the legacy IPC handle.
    pub fn export(&self) -> Result<Shareable> {
        self.gpu.bind()?;
        match self.kind {
            Kind::Vmm(handle) => {
                let mut fd: c_int = -1;
                // SAFETY: a POSIX fd handle is written as an int.
                check("cuMemExportToShareableHandle", unsafe {
                    sys::cuMemExportToShareableHandle(
                        (&mut fd as *mut c_int).cast(),
                        handle,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0,
                    )
                })?;
                if fd < 0 {
                    return Err(Error::Cuda {
                        call: "cuMemExportToShareableHandle",
                        detail: format!("returned descriptor {fd}"),
                    });
                }
                // SAFETY: the driver handed us a fresh descriptor we own.
                Ok(Shareable::Fd(unsafe { OwnedFd::from_raw_fd(fd) }))
            }
            Kind::Legacy => {
                let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
                // SAFETY: valid out-pointer; `ptr` is a cuMemAlloc base.
                check("cuIpcGetMemHandle", unsafe {
                    sys::cuIpcGetMemHandle(&mut handle, self.ptr)
                })?;
                let mut bytes = [0u8; 64];
                for (d, s) in bytes.iter_mut().zip(handle.reserved) {
                    *d = s as u8;
                }
                Ok(Shareable::Legacy(bytes))
            }
        }
    }
}

/// Unmaps and releases a `cuMemCreate` mapping, or ends a legacy one with
/// `legacy` (`cuMemFree` for an owner, `cuIpcCloseMemHandle` for a peer).
/// Errors leave nothing to do (the process keeps the memory), so they are
/// ignored.
///
/// # Safety
/// Nothing may use the memory afterwards; called once per mapping.
unsafe fn release(
    gpu: &Gpu,
    ptr: u64,
    size: usize,
    kind: Kind,
    legacy: unsafe fn(sys::CUdeviceptr) -> sys::CUresult,
) {
    if gpu.bind().is_err() {
        return;
    }
    // SAFETY: the caller's contract; `ptr`, `size` and `kind` describe one
    // live mapping.
    unsafe {
        match kind {
            Kind::Vmm(handle) => {
                sys::cuMemUnmap(ptr, size);
                sys::cuMemAddressFree(ptr, size);
                sys::cuMemRelease(handle);
            }
            Kind::Legacy => {
                legacy(ptr);
            }
        }
    }
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        // SAFETY: this region owns the allocation; nothing of ours uses it
        // after drop.
        unsafe { release(&self.gpu, self.ptr, self.size, self.kind, sys::cuMemFree_v2) }
    }
}

/// A peer's region mapped into this process; unmapped on drop.
pub struct PeerRegion {
    gpu: Arc<Gpu>,
    ptr: u64,
    size: usize,
    kind: Kind,
}

impl fmt::Debug for PeerRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerRegion")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("kind", &self.kind)
            .finish()
    }
}

impl PeerRegion {
    /// Device address of byte 0 in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Mapped bytes.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Drop for PeerRegion {
    fn drop(&mut self) {
        // SAFETY: this value owns the mapping of the peer's memory.
        unsafe {
            release(
                &self.gpu,
                self.ptr,
                self.size,
                self.kind,
                sys::cuIpcCloseMemHandle,
            )
        }
    }
}

/// Host memory registered with a device; unregistered on drop.
pub struct HostRegistration {
    gpu: Arc<Gpu>,
    host: usize,
    device: u64,
    len: usize,
}

impl fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistration")
            .field("host", &format_args!("{:#x}", self.host))
            .field("device", &format_args!("{:#x}", self.device))
            .field("len", &self.len)
            .finish()
    }
}

impl HostRegistration {
    /// The device address of host byte `offset`, or `None` out of range.
    pub fn device_addr(&self, offset: usize) -> Option<u64> {
        (offset < self.len).then(|| self.device + offset as u64)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.gpu.bind().is_err() {
            return;
        }
        // SAFETY: registered in `register_host`; the caller kept it mapped.
        unsafe { sys::cuMemHostUnregister(self.host as *mut c_void) };
    }
}

/// A caller's CUDA stream (a `CUstream` from torch's
/// `torch.cuda.current_stream().cuda_stream`), with the operations of a
/// one-sided put and of the device data plane. Every operation is enqueued
/// and returns before it runs, unless it says otherwise, and runs in the
/// calling thread's current context ([`Gpu::bind`]).
#[derive(Clone, Copy, Debug)]
pub struct Stream {
    raw: sys::CUstream,
}

// SAFETY: a CUstream handle may be used from any thread of the process.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serializes work on a stream.
unsafe impl Sync for Stream {}

/// A host function run after the work before it on a stream.
pub type HostFn = unsafe extern "C" fn(*mut c_void);

impl Stream {
    /// Wraps a raw stream handle (0 is the legacy default stream).
    ///
    /// # Safety
    /// `raw` must be a stream of the device's context that outlives every
    /// use of the value.
    pub unsafe fn from_raw(raw: usize) -> Stream {
        Stream {
            raw: raw as sys::CUstream,
        }
    }

    /// The raw handle.
    pub fn raw(&self) -> usize {
        self.raw as usize
    }

    /// Enqueues a copy of `len` bytes from device address `src` to `dst`.
    ///
    /// # Safety
    /// Both ranges must be device memory (or mapped peer memory) of `len`
    /// bytes that stays mapped until the copy has run.
    pub unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.raw)
        })
    }

    /// Enqueues setting `len` bytes at device address `dst` to zero.
    ///
    /// # Safety
    /// `dst` must address `len` writable bytes of device memory (or mapped
    /// peer memory) that stays mapped until the work has run.
    pub unsafe fn zero(&self, dst: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst, 0, len, self.raw)
        })
    }

    /// Makes this stream wait, before any work enqueued on it later, until
    /// the work enqueued on `other` so far has completed; returns at once.
    ///
    /// An event (without timing) is recorded on `other`, this stream is made
    /// to wait for it, and the event is destroyed at once: the driver keeps
    /// what the wait needs until it has completed. A stream waiting for
    /// itself is already ordered, and nothing is enqueued.
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        if self.raw == other.raw {
            return Ok(());
        }
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(
                &mut event,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        })?;
        // SAFETY: `event` was just created in the current context; both
        // streams are valid (constructor contract).
        let r = check("cuEventRecord", unsafe {
            sys::cuEventRecord(event, other.raw)
        })
        .and_then(|()| {
            // SAFETY: as above; the event has been recorded.
            check("cuStreamWaitEvent", unsafe {
                sys::cuStreamWaitEvent(
                    self.raw,
                    event,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT as u32,
                )
            })
        });
        // SAFETY: created above and used by no one else; destroying an
        // event a wait is enqueued on is legal (its resources are released
        // once the wait has completed).
        let destroyed = check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event) });
        r.and(destroyed)
    }

    /// Enqueues the store of `value` into the 8-byte word at device address
    /// `addr`, after a memory barrier that makes the writes enqueued before
    /// it visible first (the default of `cuStreamWriteValue64`): the
    /// "signal after data" of a `put_signal`.
    ///
    /// # Safety
    /// `addr` must be an 8-aligned device address (e.g. of a
    /// [`HostRegistration`]) that stays valid until the write has run.
    pub unsafe fn write_value(&self, addr: u64, value: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuStreamWriteValue64", unsafe {
            sys::cuStreamWriteValue64_v2(
                self.raw,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })
    }

    /// Enqueues `f(data)` on a driver thread once the work before it has
    /// run (the owner's bell rings after the signal word is written).
    ///
    /// # Safety
    /// `f` must not call CUDA, and `data` must be valid until it has run.
    pub unsafe fn then_host(&self, f: HostFn, data: *mut c_void) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuLaunchHostFunc", unsafe {
            sys::cuLaunchHostFunc(self.raw, Some(f), data)
        })
    }

    /// Blocks until every operation enqueued so far has run.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a valid stream (constructor contract).
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_open_names_what_is_missing() {
        if odc_kernels::cuda::driver_is_present() {
            eprintln!("SKIPPED: a CUDA driver is present here");
            return;
        }
        match Gpu::open(0) {
            Err(Error::GpuUnavailable(Missing::Cuda(odc_kernels::Unavailable::NoDriver))) => {}
            other => panic!("expected NoDriver, got {other:?}"),
        }
        let e = Gpu::open(0).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("libcuda"), "{e}");
    }

    #[test]
    fn a_missing_symbol_is_named() {
        // libc is always there and has no CUDA function.
        let r = check_symbols(&["libc.so.6"], &["malloc", "cuMemCreate"]);
        match r {
            Err(Missing::DriverSymbol {
                symbol, library, ..
            }) => {
                assert_eq!(symbol, "cuMemCreate");
                assert_eq!(library, "libc.so.6");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(check_symbols(&["libc.so.6"], &["malloc", "free"]), Ok(()));
        assert_eq!(
            check_symbols(&["libodc-no-such-library.so"], &["x"]),
            Err(Missing::Cuda(odc_kernels::Unavailable::NoDriver))
        );
    }

    #[test]
    fn symbols_are_distinct() {
        let mut s = DRIVER_SYMBOLS.to_vec();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), DRIVER_SYMBOLS.len());
    }
}
