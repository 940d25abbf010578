//! GPU-only: the `cuda-ipc` device data plane ([`CudaBackend`]) on a device,
//! in one process. Copies on a caller's stream, the accumulate kernel (f32
//! and bf16 sources into f32) and zeroing on the server stream, checked bit
//! for bit against the CPU reference; host functions that run after the
//! copy before them (they see its bytes in registered host memory) and in
//! the order enqueued; one stream made to wait for another.
//!
//! Without a driver or a device every test prints what is missing and
//! passes (skips); `scripts/gpu-run.sh` sets `ODC_REQUIRE_GPU=1`, which
//! makes a missing GPU a failure.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use half::bf16;
use odc_core::plane::cuda::CudaBackend;
use odc_core::plane::{DeviceBackend, DeviceOps, StreamHandle};
use odc_core::{bytes_of, bytes_of_mut, DType, Error};
use odc_kernels::cpu::reference;
use odc_kernels::cuda::cudarc::driver::result as cu;
use odc_kernels::cuda::CudaStream;

fn backend_or_skip(test: &str) -> Option<Arc<CudaBackend>> {
    common::or_skip(test, CudaBackend::open(0))
}

/// A caller's stream (what a trainer's `torch.cuda.current_stream()` is):
/// the cudarc value that owns it, and its raw handle.
fn caller_stream(b: &CudaBackend) -> (Arc<CudaStream>, StreamHandle) {
    let s = b
        .gpu()
        .context()
        .new_stream()
        .unwrap_or_else(|e| panic!("cuStreamCreate: {e:?}"));
    let raw = s.cu_stream() as StreamHandle;
    (s, raw)
}

/// Writes `bytes` at device address `dst`, complete when it returns.
fn upload(b: &CudaBackend, dst: u64, bytes: &[u8]) {
    b.gpu().bind().expect("bind");
    // SAFETY: every caller passes an address of a region of at least
    // `bytes.len()` bytes.
    unsafe { cu::memcpy_htod_sync(dst, bytes) }.expect("cuMemcpyHtoD");
    // A copy from pageable memory may still be in flight on the legacy
    // default stream, which the (non-blocking) streams below do not wait for.
    b.synchronize(0)
        .expect("synchronize the legacy default stream");
}

fn download(b: &CudaBackend, src: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: every caller passes an address of a region of at least `len`
    // bytes.
    unsafe { b.read_to_host(src, &mut out) }.expect("read_to_host");
    out
}

/// Finite f32 values of many magnitudes and both signs, with exact bf16
/// rounding ties among them.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|i| match i % 11 {
            0 => f32::from_bits(0x3f80_8000), // bf16 tie, even
            1 => f32::from_bits(0x3f81_8000), // bf16 tie, odd
            2 => -0.0,
            _ => {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let e = (state >> 24) % 40;
                f32::from_bits((state & 0x807f_ffff) | ((107 + e) << 23))
            }
        })
        .collect()
}

fn assert_same_f32(what: &str, got: &[u8], want: &[f32]) {
    assert_eq!(got.len(), want.len() * 4, "{what}: length");
    for (i, (g, w)) in got.chunks_exact(4).zip(want).enumerate() {
        let g = f32::from_ne_bytes([g[0], g[1], g[2], g[3]]);
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i}: GPU {g:e}, CPU {w:e}"
        );
    }
}

#[test]
fn cuda_plane_copy_accumulate_zero_match_the_cpu() {
    let Some(b) = backend_or_skip("cuda_plane_copy_accumulate_zero_match_the_cpu") else {
        return;
    };
    assert_eq!(b.name(), "cuda-ipc");
    let gpu = b.memory();
    let n = (1 << 20) + 5;
    let acc = gpu.alloc(n * 4).expect("alloc acc");
    let staging = gpu.alloc(n * 4).expect("alloc staging");
    let x32 = gpu.alloc(n * 4).expect("alloc x f32");
    let x16 = gpu.alloc(n * 2).expect("alloc x bf16");

    let acc0 = values(n, 1);
    let xs32 = values(n, 2);
    let xs16: Vec<bf16> = values(n, 3).into_iter().map(bf16::from_f32).collect();
    upload(&b, acc.ptr(), bytes_of(&acc0));

    // The sources reach their regions by plane copies on a caller's stream;
    // the server stream waits for it before adding them.
    let (_owner, stream) = caller_stream(&b);
    upload(&b, staging.ptr(), bytes_of(&xs32));
    // SAFETY: both regions hold n f32s.
    unsafe { b.copy(stream, x32.ptr(), staging.ptr(), n * 4) }.expect("copy f32");
    // The staging region is rewritten only after that copy has run.
    b.synchronize(stream).expect("synchronize caller stream");
    upload(&b, staging.ptr(), bytes_of(&xs16));
    // SAFETY: both regions hold at least n bf16s.
    unsafe { b.copy(stream, x16.ptr(), staging.ptr(), n * 2) }.expect("copy bf16");
    b.order(b.server_stream(), stream).expect("order");

    let mut want = acc0.clone();
    reference::accumulate(&mut want, &xs32, 0.5).expect("cpu f32");
    reference::accumulate(&mut want, &xs16, -3.0).expect("cpu bf16");
    // One element in: no 16-byte alignment, the kernel's unaligned path.
    reference::accumulate(&mut want[1..], &xs16[1..], 1e-3).expect("cpu bf16, offset");
    // SAFETY: `acc` holds n f32s, `x32` n f32s, `x16` n bf16s; they stay
    // allocated until the test ends and do not overlap.
    unsafe {
        b.accumulate_on_server(acc.ptr(), x32.ptr(), DType::F32, n, 0.5)
            .expect("accumulate f32");
        b.accumulate_on_server(acc.ptr(), x16.ptr(), DType::BF16, n, -3.0)
            .expect("accumulate bf16");
        b.accumulate_on_server(acc.ptr() + 4, x16.ptr() + 2, DType::BF16, n - 1, 1e-3)
            .expect("accumulate bf16, offset");
    }
    // read_to_host waits for the server stream itself.
    let got = download(&b, acc.ptr(), n * 4);
    assert_same_f32("acc += 0.5 x32 - 3 x16 + 1e-3 x16[1..]", &got, &want);

    // A misaligned source is refused before any launch.
    // SAFETY: refused before anything is enqueued.
    let e = unsafe { b.accumulate_on_server(acc.ptr(), x16.ptr() + 1, DType::BF16, 4, 1.0) };
    assert!(matches!(e, Err(Error::Layout { .. })), "{e:?}");

    // Zero a range inside the accumulators; its neighbours keep their value.
    // SAFETY: elements 1..n-1 of `acc`.
    unsafe { b.zero_on_server(acc.ptr() + 4, (n - 2) * 4) }.expect("zero");
    for w in &mut want[1..n - 1] {
        *w = 0.0;
    }
    let got = download(&b, acc.ptr(), n * 4);
    assert_same_f32("after zeroing elements 1..n-1", &got, &want);
    b.synchronize(b.server_stream())
        .expect("synchronize server");
}

#[test]
fn cuda_plane_then_runs_after_the_copy_before_it_and_in_order() {
    let Some(b) = backend_or_skip("cuda_plane_then_runs_after_the_copy_before_it_and_in_order")
    else {
        return;
    };
    let gpu = b.memory();
    let len = 32 << 20;
    let src = gpu.alloc(len).expect("alloc src");
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    upload(&b, src.ptr(), &data);

    // The copy lands in registered host memory, where a host function can
    // look at it.
    let mut host = memmap2::MmapMut::map_anon(len).expect("host buffer");
    let host_addr = host.as_mut_ptr() as usize;
    // SAFETY: `host` stays mapped until the registration drops (below).
    let reg = unsafe { gpu.register_host(host.as_mut_ptr(), len) }.expect("register host");
    let dst = reg.device_addr(0).expect("in range");

    let (_owner, stream) = caller_stream(&b);
    let saw_copy = Arc::new(AtomicBool::new(false));
    let order = Arc::new(Mutex::new(Vec::new()));
    let (done_tx, done_rx) = mpsc::channel();
    // SAFETY: `src` holds `len` bytes, `dst` addresses `len` registered
    // host bytes; both outlive the stream's work (synchronized below).
    unsafe { b.copy(stream, dst, src.ptr(), len) }.expect("copy");
    {
        let (saw_copy, order, expected) = (Arc::clone(&saw_copy), Arc::clone(&order), data.clone());
        b.then(
            stream,
            Box::new(move || {
                // SAFETY: the mapping outlives the stream's work; the copy
                // before this function has completed.
                let seen = unsafe { std::slice::from_raw_parts(host_addr as *const u8, len) };
                saw_copy.store(seen == expected.as_slice(), Ordering::SeqCst);
                order.lock().expect("lock").push(1);
            }),
        )
        .expect("then 1");
    }
    for k in 2..=50 {
        let order = Arc::clone(&order);
        b.then(
            stream,
            Box::new(move || order.lock().expect("lock").push(k)),
        )
        .expect("then k");
    }
    let tx = done_tx.clone();
    b.then(
        stream,
        Box::new(move || {
            let _ = tx.send(());
        }),
    )
    .expect("then last");
    // Host functions on the server stream run too.
    b.then(
        b.server_stream(),
        Box::new(move || {
            let _ = done_tx.send(());
        }),
    )
    .expect("then on the server stream");
    for _ in 0..2 {
        done_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a host function never ran");
    }
    b.synchronize(stream).expect("synchronize");
    assert!(
        saw_copy.load(Ordering::SeqCst),
        "the host function ran before the copy it was enqueued after had landed"
    );
    assert_eq!(*order.lock().expect("lock"), (1..=50).collect::<Vec<_>>());
    drop(reg);
    drop(host);
}

#[test]
fn cuda_plane_order_makes_a_stream_wait_for_another() {
    let Some(b) = backend_or_skip("cuda_plane_order_makes_a_stream_wait_for_another") else {
        return;
    };
    let gpu = b.memory();
    // Enough work on the server stream that a copy not ordered after it
    // would start long before it ends.
    let n = 16 << 20;
    let ones = vec![1.0f32; n];
    let x = gpu.alloc(n * 4).expect("alloc x");
    let acc = gpu.alloc(n * 4).expect("alloc acc");
    let out = gpu.alloc(n * 4).expect("alloc out");
    upload(&b, x.ptr(), bytes_of(&ones));
    let rounds = 16;
    // SAFETY: `acc` and `x` hold n f32s each, allocated until the end.
    unsafe {
        b.zero_on_server(acc.ptr(), n * 4).expect("zero");
        for _ in 0..rounds {
            b.accumulate_on_server(acc.ptr(), x.ptr(), DType::F32, n, 1.0)
                .expect("accumulate");
        }
    }
    let (_owner, stream) = caller_stream(&b);
    b.order(stream, stream)
        .expect("a stream ordered after itself");
    b.order(stream, b.server_stream()).expect("order");
    // SAFETY: `out` and `acc` hold n f32s.
    unsafe { b.copy(stream, out.ptr(), acc.ptr(), n * 4) }.expect("copy");
    // Only the caller's stream is waited for: the copy saw every add
    // because the stream waited for the server's, not because of this.
    b.synchronize(stream).expect("synchronize caller stream");
    let mut got = vec![0f32; n];
    b.gpu().bind().expect("bind");
    // SAFETY: `out` holds n f32s; the copy into it has completed.
    unsafe { cu::memcpy_dtoh_sync(bytes_of_mut(&mut got), out.ptr()) }.expect("cuMemcpyDtoH");
    if let Some(i) = got.iter().position(|&v| v != rounds as f32) {
        panic!(
            "element {i} is {} after {rounds} adds of 1: the copy did not wait for the server stream",
            got[i]
        );
    }
}
