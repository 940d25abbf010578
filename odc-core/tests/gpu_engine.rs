//! GPU-only: the engine on the `cuda-ipc` transport, two ranks (threads of
//! this process) sharing device 0; on the `nvshmem` transport, one PE in
//! this process, and two PEs in two child processes where there are two
//! GPUs (NVSHMEM places one PE per GPU). Publish, gather, release, uneven
//! scatter-accumulates (f32 and bf16) and finish over several minibatches,
//! every buffer in device memory and every call on a stream of its rank;
//! the gathered values and the accumulators are checked exactly. Compressed
//! pushes on `cuda-ipc` are checked bit for bit against `emu-ipc`, whose
//! half (and its rounding check) runs without a GPU too.
//!
//! Without a driver or a device it prints what is missing and passes
//! (skips); `scripts/gpu-run.sh` sets `ODC_REQUIRE_GPU=1`, which makes a
//! missing GPU a failure.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use odc_core::gpu::device::{DeviceRegion, Gpu};
use odc_core::{
    bytes_of, BucketId, BucketSpec, DType, Engine, EngineConfig, FileStore, Topology, TransportKind,
};
use odc_kernels::cuda::cudarc::driver::result as cu;

fn gpu_or_skip() -> Option<Arc<Gpu>> {
    common::or_skip("gpu_engine", Gpu::open(0))
}

/// A device buffer holding `bytes`.
fn upload(gpu: &Arc<Gpu>, bytes: &[u8]) -> DeviceRegion {
    let r = gpu.alloc(bytes.len().max(1)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: the region holds at least `bytes.len()` bytes.
    unsafe { cu::memcpy_htod_sync(r.ptr(), bytes) }.unwrap();
    r
}

fn download(gpu: &Arc<Gpu>, src: &DeviceRegion, len: usize) -> Vec<u8> {
    gpu.bind().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: the region holds at least `len` bytes.
    unsafe { cu::memcpy_dtoh_sync(&mut out, src.ptr()) }.unwrap();
    out
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn u16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn gpu_engine_cuda_ipc_two_ranks_exact() {
    if gpu_or_skip().is_none() || std::env::var_os(CHILD_PE).is_some() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let world = 2;
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let store = Arc::new(FileStore::new(dir.path()).unwrap());
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    chunk_bytes: 64 << 10,
                    timeout: Duration::from_secs(60),
                    job_key: "gpu_engine".into(),
                    transport: TransportKind::CudaIpc,
                    device: Some(0),
                    ..EngineConfig::default()
                };
                let e =
                    Engine::new(store, Topology::single_node(rank, world).unwrap(), cfg).unwrap();
                assert_eq!(e.transport_name(), "cuda-ipc");
                run_rank(&e, 0);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

fn nvshmem_config(key: &str, device: usize) -> EngineConfig {
    EngineConfig {
        chunk_bytes: 64 << 10,
        timeout: Duration::from_secs(120),
        job_key: key.into(),
        transport: TransportKind::Nvshmem,
        device: Some(device),
        ..EngineConfig::default()
    }
}

#[test]
fn gpu_engine_nvshmem_one_pe_exact() {
    if gpu_or_skip().is_none() {
        return;
    }
    if std::env::var_os(CHILD_PE).is_some() {
        return; // a child of the two-process test runs only that test
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FileStore::new(dir.path()).unwrap());
    let topo = Topology::single_node(0, 1).unwrap();
    // A second engine of this process shares the first one's NVSHMEM
    // session, whose heap the first one planned for it.
    let second = [BucketSpec::new("x", 4096, DType::F32)];
    let cfg2 = EngineConfig {
        store_prefix: "odc2".into(),
        ..nvshmem_config("gpu_nvshmem_1b", 0)
    };
    let cfg = EngineConfig {
        heap_reserve: Engine::heap_bytes(&second, &topo, &cfg2).unwrap(),
        ..nvshmem_config("gpu_nvshmem_1", 0)
    };
    let e = Engine::new(Arc::clone(&store) as _, topo, cfg).unwrap();
    let e2 = Engine::new(Arc::clone(&store) as _, topo, cfg2).unwrap();
    assert_eq!(e.transport_name(), "nvshmem");
    run_rank(&e, 0);
    e2.register(&second).unwrap();
    let gpu = Gpu::open(0).unwrap();
    let stream = gpu.context().new_stream().unwrap();
    let s = stream.cu_stream() as usize;
    let x: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let (d_x, d_out) = (upload(&gpu, bytes_of(&x)), gpu.alloc(4096 * 4).unwrap());
    // SAFETY: the buffers outlive the finish, which waits for the stream.
    unsafe {
        e2.device()
            .unwrap()
            .publish(BucketId(0), d_x.ptr(), 4096 * 4, DType::F32, 0, s)
            .unwrap();
        e2.device()
            .unwrap()
            .gather(BucketId(0), 0, d_out.ptr(), 4096 * 4, DType::F32, s, false)
            .unwrap();
        e2.device()
            .unwrap()
            .scatter_accumulate(BucketId(0), 0, d_x.ptr(), 4096 * 4, DType::F32, 2.0, s)
            .unwrap();
    }
    e2.device().unwrap().release(BucketId(0), 0, s).unwrap();
    e2.device().unwrap().finish_minibatch(0, s).unwrap();
    assert_eq!(floats(&download(&gpu, &d_out, 4096 * 4)), x);
    let mut g = vec![0f32; 4096];
    e2.device()
        .unwrap()
        .read_grad_shard(BucketId(0), &mut g)
        .unwrap();
    assert!(g.iter().zip(&x).all(|(a, b)| *a == 2.0 * b));
    // A third engine finds no room left in the session's heap.
    let e3 = Engine::new(
        store,
        topo,
        EngineConfig {
            store_prefix: "odc3".into(),
            ..nvshmem_config("gpu_nvshmem_1c", 0)
        },
    )
    .unwrap();
    let err = e3.register(&second).unwrap_err();
    assert!(err.to_string().contains("heap plan exceeded"), "{err}");
}

/// Set in the children of [`gpu_engine_nvshmem_two_processes_exact`]: this
/// process's PE, and the Store directory.
const CHILD_PE: &str = "ODC_TEST_NVSHMEM_PE";
const CHILD_STORE: &str = "ODC_TEST_NVSHMEM_STORE";

#[test]
fn gpu_engine_nvshmem_two_processes_exact() {
    let Some(gpu) = gpu_or_skip() else { return };
    if let Some(pe) = std::env::var_os(CHILD_PE) {
        // A child: one PE of the job, on its own GPU.
        let pe: usize = pe.to_str().unwrap().parse().unwrap();
        let store = Arc::new(FileStore::new(std::env::var(CHILD_STORE).unwrap()).unwrap());
        let e = Engine::new(
            store,
            Topology::single_node(pe, 2).unwrap(),
            nvshmem_config("gpu_nvshmem_2", pe),
        )
        .unwrap();
        run_rank(&e, pe);
        return;
    }
    let devices = odc_kernels::cuda::probe_device(0).map_or(0, |i| i.device_count);
    if devices < 2 {
        eprintln!(
            "SKIPPED gpu_engine_nvshmem_two_processes_exact: {devices} GPU(s), needs 2 ({gpu:?})"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|pe| {
            std::process::Command::new(&exe)
                .args([
                    "--exact",
                    "gpu_engine_nvshmem_two_processes_exact",
                    "--nocapture",
                ])
                .env(CHILD_PE, pe.to_string())
                .env(CHILD_STORE, dir.path())
                .spawn()
                .unwrap()
        })
        .collect();
    for (pe, mut c) in children.into_iter().enumerate() {
        let status = c.wait().unwrap();
        assert!(status.success(), "PE {pe}: {status}");
    }
}

fn run_rank(e: &Engine, device: usize) {
    let gpu = Gpu::open(device).unwrap();
    let stream = gpu.context().new_stream().unwrap();
    let s = stream.cu_stream() as usize;
    let (rank, world) = (e.rank(), e.world());
    let numel = 300_001;
    e.register(&[
        BucketSpec::new("w", numel, DType::F32),
        BucketSpec::new("h", 70_001, DType::BF16),
    ])
    .unwrap();
    let (w, h) = (BucketId(0), BucketId(1));
    let (sl, hl) = (
        e.bucket(w).unwrap().shard_len(),
        e.bucket(h).unwrap().shard_len(),
    );
    for k in 0..3u64 {
        let shard: Vec<f32> = (0..sl)
            .map(|i| (rank * sl + i) as f32 + 1000.0 * k as f32)
            .collect();
        let hshard: Vec<u16> = (0..hl)
            .map(|i| common::to_bf16(((rank * hl + i) % 256) as f32))
            .collect();
        let grads: Vec<f32> = (0..numel).map(|i| (i % 7) as f32 + rank as f32).collect();
        let hgrads: Vec<u16> = (0..world * hl)
            .map(|i| common::to_bf16((i % 5) as f32))
            .collect();
        let d_shard = upload(&gpu, bytes_of(&shard));
        let d_hshard = upload(&gpu, &u16_bytes(&hshard));
        let d_grads = upload(&gpu, bytes_of(&grads));
        let d_hgrads = upload(&gpu, &u16_bytes(&hgrads));
        let d_full = gpu.alloc(numel * 4).unwrap();
        let d_hfull = gpu.alloc(world * hl * 2).unwrap();
        // SAFETY: every buffer lives until after finish_minibatch_device,
        // which waits for the stream.
        unsafe {
            e.device()
                .unwrap()
                .publish(w, d_shard.ptr(), sl * 4, DType::F32, k, s)
                .unwrap();
            e.device()
                .unwrap()
                .publish(h, d_hshard.ptr(), hl * 2, DType::BF16, k, s)
                .unwrap();
            e.device()
                .unwrap()
                .gather(w, k, d_full.ptr(), numel * 4, DType::F32, s, false)
                .unwrap();
            e.device()
                .unwrap()
                .gather(h, k, d_hfull.ptr(), world * hl * 2, DType::BF16, s, false)
                .unwrap();
            e.device().unwrap().release(w, k, s).unwrap();
            e.device().unwrap().release(h, k, s).unwrap();
            for _ in 0..=rank {
                e.device()
                    .unwrap()
                    .scatter_accumulate(w, 0, d_grads.ptr(), numel * 4, DType::F32, 0.5, s)
                    .unwrap();
            }
            e.device()
                .unwrap()
                .scatter_accumulate(h, 0, d_hgrads.ptr(), hgrads.len() * 2, DType::BF16, 1.0, s)
                .unwrap();
        }
        e.device().unwrap().finish_minibatch(k, s).unwrap();
        let full = floats(&download(&gpu, &d_full, numel * 4));
        for (i, x) in full.iter().enumerate() {
            assert_eq!(
                *x,
                i as f32 + 1000.0 * k as f32,
                "rank {rank} k {k} elem {i}"
            );
        }
        let hfull = download(&gpu, &d_hfull, world * hl * 2);
        for (i, c) in hfull.chunks(2).enumerate() {
            let got = u16::from_le_bytes([c[0], c[1]]);
            assert_eq!(
                got,
                common::to_bf16((i % 256) as f32),
                "rank {rank} k {k} bf16 elem {i}"
            );
        }
        common::check_grad_sums(e, (w, numel), h, k);
        e.device().unwrap().zero_grads(s).unwrap();
        stream.synchronize().unwrap();
    }
}

/// Compressed pushes and gathers on `cuda-ipc` (int8 pushes with error
/// feedback, fp8 gathers, blocks of 32, every transfer compressed): two
/// ranks, four minibatches of uneven, inexact gradients and new parameter
/// versions (f32 and bf16 buckets), every accumulator and every gathered
/// element equal bit for bit to the same program on `emu-ipc`, whose
/// daemon packs, quantises and dequantises with the host kernels (two
/// ranks: each element sums the owner's own part and one compressed chunk,
/// in either order the same bits).
#[test]
fn gpu_engine_cuda_ipc_compressed_pushes_match_the_host_kernels() {
    if std::env::var_os(CHILD_PE).is_some() {
        return;
    }
    // The emu-ipc half runs anywhere: every transfer compressed within a
    // node.
    let emu = compressed_pushes(TransportKind::EmuIpc, "gpu_cz_emu");
    let exact = |k: u64, at: usize| -> f32 {
        (0..2)
            .map(|r| (1 + (r + k as usize) % 2) as f32 * 0.5 * compressed_grad(r, k, 0, at))
            .sum()
    };
    let sl = emu[0][0].len() - 100_003 - 7_001;
    let (mut rounded, mut worst) = (0, 0f32);
    for (r, seen) in emu.iter().enumerate() {
        for j in (0..sl).filter(|j| r * sl + j < 100_003) {
            let err = (seen[0][j] - exact(0, r * sl + j)).abs();
            rounded += usize::from(err > 0.0);
            worst = worst.max(err);
        }
    }
    // int8/32 of one peer's chunk: half a step of at most 14.4 / 127.
    assert!(
        rounded > 0,
        "nothing was rounded: the pushes were not compressed"
    );
    assert!(worst <= 0.06, "error {worst} beyond int8's bound");
    // fp8/32 gathers: the peer's shard within 2^-4 of each value (and not
    // exact), this rank's own exact.
    for (r, seen) in emu.iter().enumerate() {
        let gathered = &seen[0][sl..sl + 100_003];
        let (mut lossy, mut own_exact) = (0, true);
        for (i, &x) in gathered.iter().enumerate() {
            let want = compressed_param(0, 0, i);
            if i / sl == r {
                own_exact &= x == want;
            } else {
                assert!(
                    (x - want).abs() <= want.abs() / 16.0,
                    "rank {r} elem {i}: {x} {want}"
                );
                lossy += usize::from(x != want);
            }
        }
        assert!(
            own_exact && lossy > 0,
            "rank {r}: own exact {own_exact}, lossy {lossy}"
        );
    }
    if gpu_or_skip().is_none() {
        return;
    }
    let cuda = compressed_pushes(TransportKind::CudaIpc, "gpu_cz_cuda");
    assert_eq!(emu.len(), cuda.len());
    for (rank, (e, c)) in emu.iter().zip(&cuda).enumerate() {
        for (k, (e, c)) in e.iter().zip(c).enumerate() {
            for (i, (x, y)) in e.iter().zip(c).enumerate() {
                assert_eq!(
                    x.to_bits(),
                    y.to_bits(),
                    "rank {rank} minibatch {k} elem {i}: emu {x}, cuda {y}"
                );
            }
        }
    }
}

fn compressed_grad(rank: usize, k: u64, bucket: usize, i: usize) -> f32 {
    ((i * 37 + rank * 11 + k as usize * 5 + bucket * 3) % 101) as f32 / 7.0 - 7.0
}

/// Per rank, per minibatch: the f32 bucket's accumulator.
fn compressed_pushes(transport: TransportKind, key: &'static str) -> Vec<Vec<Vec<f32>>> {
    let dir = tempfile::tempdir().unwrap();
    let world = 2;
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let store = Arc::new(FileStore::new(dir.path()).unwrap());
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    chunk_bytes: 4 << 10,
                    timeout: Duration::from_secs(60),
                    job_key: key.into(),
                    transport,
                    device: (transport == TransportKind::CudaIpc).then_some(0),
                    compress: Some(odc_core::protocol::compress::Compress {
                        push: Some(
                            odc_kernels::cpu::quant::Spec::new(
                                odc_kernels::cpu::quant::Format::Int8,
                                32,
                            )
                            .unwrap(),
                        ),
                        gather: Some(
                            odc_kernels::cpu::quant::Spec::new(
                                odc_kernels::cpu::quant::Format::Fp8E4m3,
                                32,
                            )
                            .unwrap(),
                        ),
                        feedback: true,
                        scope: odc_core::protocol::compress::Scope::All,
                    }),
                    ..EngineConfig::default()
                };
                let e =
                    Engine::new(store, Topology::single_node(rank, world).unwrap(), cfg).unwrap();
                compressed_rank(&e, transport == TransportKind::CudaIpc)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Element `i` of version `k` of bucket `b` (the published shards).
fn compressed_param(k: u64, b: usize, i: usize) -> f32 {
    ((i * 13 + k as usize * 7 + b) % 97) as f32 / 5.0 - 9.0
}

/// A buffer: its bytes (host memory stands for device memory on emu-ipc)
/// and, on a GPU, its device copy.
struct Buf(Vec<u8>, Option<DeviceRegion>);

impl Buf {
    fn new(gpu: Option<&Arc<Gpu>>, bytes: Vec<u8>) -> Buf {
        let dev = gpu.map(|g| upload(g, &bytes));
        Buf(bytes, dev)
    }

    fn ptr(&self) -> u64 {
        self.1
            .as_ref()
            .map_or(self.0.as_ptr() as u64, DeviceRegion::ptr)
    }

    fn fetch(&self, gpu: Option<&Arc<Gpu>>) -> Vec<u8> {
        match (gpu, &self.1) {
            (Some(g), Some(r)) => download(g, r, self.0.len()),
            _ => self.0.clone(),
        }
    }
}

/// Per minibatch: the f32 bucket's accumulator, then both buckets as
/// gathered (the bf16 one widened).
fn compressed_rank(e: &Engine, cuda: bool) -> Vec<Vec<f32>> {
    let rank = e.rank();
    let numel = [100_003, 7_001];
    e.register(&[
        BucketSpec::new("w", numel[0], DType::F32),
        BucketSpec::new("h", numel[1], DType::BF16),
    ])
    .unwrap();
    let (w, h) = (BucketId(0), BucketId(1));
    let sl = [0, 1].map(|b| e.bucket(BucketId(b)).unwrap().shard_len());
    let gpu = cuda.then(|| Gpu::open(0).unwrap());
    let g = gpu.as_ref();
    let emu = (!cuda).then(|| odc_core::plane::emu::EmuStream::new(Duration::ZERO).unwrap());
    let cu_stream = gpu.as_ref().map(|g| g.context().new_stream().unwrap());
    let s = match (&cu_stream, &emu) {
        (Some(c), _) => c.cu_stream() as usize,
        (None, Some(e)) => e.handle(),
        _ => unreachable!(),
    };
    let mut out = Vec::new();
    for k in 0..4u64 {
        let grads: Vec<f32> = (0..numel[0])
            .map(|i| compressed_grad(rank, k, 0, i))
            .collect();
        let hgrads: Vec<u16> = (0..numel[1])
            .map(|i| common::to_bf16(compressed_grad(rank, k, 1, i)))
            .collect();
        let shard: Vec<f32> = (0..sl[0])
            .map(|i| compressed_param(k, 0, rank * sl[0] + i))
            .collect();
        let hshard: Vec<u16> = (0..sl[1])
            .map(|i| common::to_bf16(compressed_param(k, 1, rank * sl[1] + i)))
            .collect();
        let bufs = [
            Buf::new(g, bytes_of(&grads).to_vec()),
            Buf::new(g, u16_bytes(&hgrads)),
            Buf::new(g, bytes_of(&shard).to_vec()),
            Buf::new(g, u16_bytes(&hshard)),
            Buf::new(g, vec![0xff; numel[0] * 4]),
            Buf::new(g, vec![0xff; numel[1] * 2]),
        ];
        let d = e.device().unwrap();
        // SAFETY: the buffers live until after the finish, which waits for
        // the stream.
        unsafe {
            d.publish(w, bufs[2].ptr(), sl[0] * 4, DType::F32, k, s)
                .unwrap();
            d.publish(h, bufs[3].ptr(), sl[1] * 2, DType::BF16, k, s)
                .unwrap();
            d.gather(w, k, bufs[4].ptr(), numel[0] * 4, DType::F32, s, false)
                .unwrap();
            d.gather(h, k, bufs[5].ptr(), numel[1] * 2, DType::BF16, s, false)
                .unwrap();
            d.release(w, k, s).unwrap();
            d.release(h, k, s).unwrap();
            for _ in 0..=(rank + k as usize) % 2 {
                d.scatter_accumulate(w, 0, bufs[0].ptr(), numel[0] * 4, DType::F32, 0.5, s)
                    .unwrap();
            }
            d.scatter_accumulate(h, 0, bufs[1].ptr(), numel[1] * 2, DType::BF16, 1.0, s)
                .unwrap();
        }
        d.finish_minibatch(k, s).unwrap();
        let mut got = vec![0f32; sl[0]];
        d.read_grad_shard(w, &mut got).unwrap();
        got.extend(floats(&bufs[4].fetch(g)));
        got.extend(
            bufs[5]
                .fetch(g)
                .chunks(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)),
        );
        out.push(got);
        d.zero_grads(s).unwrap();
        match (&cu_stream, &emu) {
            (Some(c), _) => c.synchronize().unwrap(),
            (None, Some(e)) => e.synchronize().unwrap(),
            _ => unreachable!(),
        }
        drop(bufs);
    }
    out
}
