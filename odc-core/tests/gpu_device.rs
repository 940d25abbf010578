//! GPU-only: `odc_core::gpu::device` on a device. A region is allocated,
//! filled, exported and mapped again through its shareable handle, copied on
//! a stream into a second region, and the stream then writes a signal word
//! into registered host memory and runs a host callback, in that order.
//! Without a driver or a device the test prints what is missing and passes
//! (skips); `scripts/gpu-run.sh` sets `ODC_REQUIRE_GPU=1`, which makes a
//! missing GPU a failure.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use odc_core::gpu::device::{Gpu, Shareable, Stream};
use odc_kernels::cuda::cudarc::driver::result as cu;

fn gpu_or_skip(test: &str) -> Option<Arc<Gpu>> {
    common::or_skip(test, Gpu::open(0))
}

static CALLBACK_SAW: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn record_signal(word: *mut c_void) {
    // SAFETY: `word` is the 8-aligned host word the test registered; the
    // stream wrote it before this callback runs.
    let v = unsafe { (*word.cast::<AtomicU64>()).load(Ordering::Acquire) };
    CALLBACK_SAW.store(v, Ordering::Release);
}

#[test]
fn gpu_device_region_export_import_copy_and_signal() {
    let Some(gpu) = gpu_or_skip("gpu_device_region_export_import_copy_and_signal") else {
        return;
    };
    let len = (1 << 20) + 3;
    let src = gpu.alloc(len).expect("alloc src");
    let dst = gpu.alloc(len).expect("alloc dst");
    assert!(src.size() >= len);
    if gpu.caps().fd_handles {
        assert_eq!(src.size() % gpu.caps().granularity, 0);
    }
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
    // Fresh regions are zeroed.
    let mut back = vec![0xffu8; len];
    // SAFETY: `dst` holds `len` bytes of device memory.
    unsafe { cu::memcpy_dtoh_sync(&mut back, dst.ptr()) }.expect("read dst");
    assert!(back.iter().all(|&b| b == 0), "a new region is not zeroed");
    // SAFETY: `src` holds `len` bytes of device memory.
    unsafe { cu::memcpy_htod_sync(src.ptr(), &data) }.expect("fill src");

    // Map src again through its handle, the way a peer does. A legacy IPC
    // handle cannot be opened by the process that made it: read src itself.
    let shareable = src.export().expect("export");
    let (from, _mapping) = match shareable {
        Shareable::Fd(fd) => {
            let peer = gpu.import(Shareable::Fd(fd), src.size()).expect("import");
            (peer.ptr(), Some(peer))
        }
        Shareable::Legacy(bytes) => {
            assert!(bytes.iter().any(|&b| b != 0), "empty legacy handle");
            (src.ptr(), None)
        }
    };

    let mut host = memmap2::MmapMut::map_anon(4096).expect("host page");
    let word_ptr = host.as_mut_ptr();
    // SAFETY: `host` stays mapped until the registration drops (below).
    let reg = unsafe { gpu.register_host(word_ptr, 4096) }.expect("register host");
    let signal = reg.device_addr(64).expect("in range");
    let stream_handle = gpu.context().default_stream();
    // SAFETY: the stream belongs to the device's context and outlives use.
    let stream = unsafe { Stream::from_raw(stream_handle.cu_stream() as usize) };
    // SAFETY: both ranges are `len` bytes of mapped device memory; the word
    // is 8-aligned registered host memory; the callback reads only it.
    unsafe {
        stream.copy(dst.ptr(), from, len).expect("copy");
        stream.write_value(signal, 42).expect("write value");
        stream
            .then_host(record_signal, word_ptr.add(64).cast())
            .expect("host callback");
    }
    stream.synchronize().expect("synchronize");
    // SAFETY: in range and 8-aligned; the stream has finished writing it.
    let word = unsafe { (*word_ptr.add(64).cast::<AtomicU64>()).load(Ordering::Acquire) };
    assert_eq!(word, 42, "signal word not written");
    assert_eq!(
        CALLBACK_SAW.load(Ordering::Acquire),
        42,
        "host callback ran before the signal"
    );
    // SAFETY: `dst` holds `len` bytes of device memory.
    unsafe { cu::memcpy_dtoh_sync(&mut back, dst.ptr()) }.expect("read dst");
    assert!(back == data, "copied data differs");
    drop(reg);
}
