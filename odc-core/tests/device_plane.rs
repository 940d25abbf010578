//! The device data path (`*_device` calls) on the `emu-ipc` and `emu-shmem`
//! transports: the protocol `cuda-ipc` and `nvshmem` run, with host memory
//! for device memory and threads for streams that sleep a random while
//! before every operation (and, for `emu-shmem`, puts to another node that
//! arrive only at the stream's next deliver).
//! Every copy, add and stream-sent signal therefore runs after the call
//! that enqueued it returned, in an order only the streams fix; a signal
//! sent ahead of its data would let a peer read stale bytes, and the
//! exactness checks here fail.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use odc_core::plane::emu::EmuStream;
use odc_core::{
    BucketId, BucketSpec, DType, Engine, EngineConfig, Error, FileStore, Topology, TransportKind,
};

fn config(key: &str, transport: TransportKind) -> EngineConfig {
    EngineConfig {
        chunk_bytes: 512,
        timeout: Duration::from_secs(20),
        job_key: key.into(),
        transport,
        ..EngineConfig::default()
    }
}

/// Runs `f(engine)` on `world` thread-ranks of one node.
fn run_ranks<F>(world: usize, key: &str, transport: TransportKind, f: F)
where
    F: Fn(Engine) + Send + Sync + 'static,
{
    run_nodes(world, world, key, transport, f)
}

/// Runs `f(engine)` on `world` thread-ranks, `local_world` per (emulated)
/// node.
fn run_nodes<F>(world: usize, local_world: usize, key: &str, transport: TransportKind, f: F)
where
    F: Fn(Engine) + Send + Sync + 'static,
{
    run_config(world, local_world, config(key, transport), f)
}

/// [`run_nodes`] with every rank's engine built from `cfg`.
fn run_config<F>(world: usize, local_world: usize, cfg: EngineConfig, f: F)
where
    F: Fn(Engine) + Send + Sync + 'static,
{
    common::run_config(world, local_world, cfg, 300, f)
}

fn addr<T>(v: &[T]) -> u64 {
    v.as_ptr() as u64
}

#[test]
fn gather_and_scatter_are_exact_with_asynchronous_streams() {
    run_ranks(3, "dev_exact", TransportKind::EmuIpc, |e| {
        assert_eq!(e.transport_name(), "emu-ipc");
        exact(e)
    });
}

#[test]
fn emu_shmem_on_one_node_is_exact() {
    run_ranks(2, "shmem_one", TransportKind::EmuShmem, |e| {
        assert_eq!(e.transport_name(), "emu-shmem");
        exact(e)
    });
}

/// Two emulated nodes of two ranks: control words over shm within a node
/// and libfabric (tcp, loopback) across; puts to the other node land only
/// at a deliver.
#[cfg(feature = "fabric")]
#[test]
fn emu_shmem_across_nodes_is_exact() {
    run_nodes(4, 2, "shmem_nodes", TransportKind::EmuShmem, |e| {
        assert_eq!(e.transport_name(), "emu-shmem");
        exact(e)
    });
}

/// Node aggregation on the device plane: each rank's chunks for an owner
/// on the other node go to its node-mate with the owner's local rank, whose
/// daemon adds them into a node buffer in device memory on its stream, and
/// that node-mate pushes the node's sum across once at its finish (the
/// versions are announced once per node too). The same uneven, partial
/// pushes as above, and the node cache, checked element for element.
#[cfg(feature = "fabric")]
#[test]
fn emu_shmem_node_sums_across_nodes_are_exact() {
    let cfg = EngineConfig {
        cross_node: odc_core::CrossNode::Node,
        ..config("shmem_sums", TransportKind::EmuShmem)
    };
    run_config(4, 2, cfg, |e| {
        assert_eq!(e.cross_node(), odc_core::CrossNode::Node);
        exact(e)
    });
}

/// Four minibatches of gathers and uneven, partial pushes (f32 and bf16),
/// checked element for element.
fn exact(e: Engine) {
    {
        assert!(e.is_device());
        let (rank, world) = (e.rank(), e.world());
        let stream = EmuStream::new(Duration::from_micros(400)).unwrap();
        let s = stream.handle();
        let numel = 1001;
        e.register(&[
            BucketSpec::new("w", numel, DType::F32),
            BucketSpec::new("h", 333, DType::BF16),
        ])
        .unwrap();
        let (w, h) = (BucketId(0), BucketId(1));
        let (sl, hl) = (
            e.bucket(w).unwrap().shard_len(),
            e.bucket(h).unwrap().shard_len(),
        );
        for k in 0..4u64 {
            let shard: Vec<f32> = (0..sl)
                .map(|i| (rank * sl + i) as f32 + 1000.0 * k as f32)
                .collect();
            let hshard: Vec<u16> = (0..hl)
                .map(|i| common::to_bf16((rank * hl + i) as f32))
                .collect();
            let full = vec![0f32; numel];
            let hfull = vec![0u16; world * hl];
            // Uneven microbatches: rank r pushes r + 1 of them, the last one
            // as two partial pushes.
            let grads: Vec<f32> = (0..numel).map(|i| (i % 7) as f32 + rank as f32).collect();
            let hgrads: Vec<u16> = (0..world * hl)
                .map(|i| common::to_bf16((i % 5) as f32))
                .collect();
            // SAFETY: every buffer outlives finish_minibatch_device, which
            // waits for the stream.
            unsafe {
                e.device()
                    .unwrap()
                    .publish(w, addr(&shard), sl * 4, DType::F32, k, s)
                    .unwrap();
                e.device()
                    .unwrap()
                    .publish(h, addr(&hshard), hl * 2, DType::BF16, k, s)
                    .unwrap();
                e.device()
                    .unwrap()
                    .gather(w, k, addr(&full), numel * 4, DType::F32, s, false)
                    .unwrap();
                e.device()
                    .unwrap()
                    .gather(h, k, addr(&hfull), hfull.len() * 2, DType::BF16, s, false)
                    .unwrap();
                e.device().unwrap().release(w, k, s).unwrap();
                e.device().unwrap().release(h, k, s).unwrap();
                for _ in 0..rank {
                    e.device()
                        .unwrap()
                        .scatter_accumulate(w, 0, addr(&grads), numel * 4, DType::F32, 0.5, s)
                        .unwrap();
                }
                let cut = 400;
                e.device()
                    .unwrap()
                    .scatter_accumulate(w, 0, addr(&grads), cut * 4, DType::F32, 0.5, s)
                    .unwrap();
                e.device()
                    .unwrap()
                    .scatter_accumulate(
                        w,
                        cut,
                        addr(&grads) + (cut * 4) as u64,
                        (numel - cut) * 4,
                        DType::F32,
                        0.5,
                        s,
                    )
                    .unwrap();
                e.device()
                    .unwrap()
                    .scatter_accumulate(h, 0, addr(&hgrads), hgrads.len() * 2, DType::BF16, 1.0, s)
                    .unwrap();
            }
            e.device().unwrap().finish_minibatch(k, s).unwrap();
            for (i, x) in full.iter().enumerate() {
                assert_eq!(
                    *x,
                    i as f32 + 1000.0 * k as f32,
                    "rank {rank} k {k} elem {i}"
                );
            }
            for (i, x) in hfull.iter().enumerate() {
                assert_eq!(
                    *x,
                    common::to_bf16(i as f32),
                    "rank {rank} k {k} bf16 elem {i}"
                );
            }
            common::check_grad_sums(&e, (w, numel), h, k);
            e.device().unwrap().zero_grads(s).unwrap();
            stream.synchronize().unwrap();
        }
    }
}

#[test]
fn the_own_slice_waits_for_the_callers_stream() {
    // The caller's stream writes the gradient late (a copy after a long
    // sleep); the daemon must add what that copy wrote, not what was there
    // when scatter_accumulate_device was called.
    run_ranks(2, "dev_own", TransportKind::EmuIpc, |e| {
        let stream = EmuStream::new(Duration::from_millis(3)).unwrap();
        let s = stream.handle();
        e.register(&[BucketSpec::new("w", 256, DType::F32)])
            .unwrap();
        let w = BucketId(0);
        let sl = e.bucket(w).unwrap().shard_len();
        let shard = vec![0f32; sl];
        let late = vec![2.0f32; 256];
        let grads = vec![0f32; 256];
        // SAFETY: buffers outlive the finish below.
        unsafe {
            e.device()
                .unwrap()
                .publish(w, addr(&shard), sl * 4, DType::F32, 0, s)
                .unwrap();
            e.device()
                .unwrap()
                .gather(w, 0, addr(&grads), 256 * 4, DType::F32, s, false)
                .unwrap();
            // "Produce" the gradient on the stream, as a kernel would: a
            // copy of 2.0s over it that runs only after the stream's sleeps.
            let (d, src) = (addr(&grads) as usize, addr(&late) as usize);
            stream
                .enqueue(Box::new(move || {
                    std::ptr::copy_nonoverlapping(src as *const u8, d as *mut u8, 256 * 4)
                }))
                .unwrap();
            e.device()
                .unwrap()
                .scatter_accumulate(w, 0, addr(&grads), 256 * 4, DType::F32, 1.0, s)
                .unwrap();
        }
        e.device().unwrap().release(w, 0, s).unwrap();
        e.device().unwrap().finish_minibatch(0, s).unwrap();
        let mut g = vec![0f32; sl];
        e.device().unwrap().read_grad_shard(w, &mut g).unwrap();
        assert!(
            g.iter().all(|&x| x == 4.0),
            "rank {}: {:?}",
            e.rank(),
            &g[..4]
        );
    });
}

#[test]
fn the_engine_hands_out_the_worker_handle_of_its_kind_only() {
    run_ranks(2, "dev_mixed", TransportKind::EmuIpc, |e| {
        e.register(&[BucketSpec::new("w", 100, DType::F32)])
            .unwrap();
        let shard = vec![0f32; e.bucket(BucketId(0)).unwrap().shard_len()];
        // A device engine has no host handle; the error says which to use.
        let err = e.host().unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        assert!(err.to_string().contains("Engine::device"), "{err}");
        // A bad length names the bucket, like the host call.
        let stream = EmuStream::new(Duration::ZERO).unwrap();
        // SAFETY: the call is refused before anything is enqueued.
        let err = unsafe {
            e.device().unwrap().publish(
                BucketId(0),
                addr(&shard),
                12,
                DType::F32,
                0,
                stream.handle(),
            )
        }
        .unwrap_err();
        assert!(err.to_string().contains("shard is 12 bytes"), "{err}");
    });
    run_ranks(2, "dev_host", TransportKind::Shm, |e| {
        e.register(&[BucketSpec::new("w", 100, DType::F32)])
            .unwrap();
        let err = e.device().unwrap_err();
        assert!(err.to_string().contains("Engine::host"), "{err}");
    });
}

#[test]
fn ipc_transports_reach_one_node_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FileStore::new(dir.path()).unwrap());
    let topo = Topology::new(0, 4, 2).unwrap();
    let err = Engine::new(store, topo, config("dev_nodes", TransportKind::EmuIpc)).unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(err.to_string().contains("one node"), "{err}");
    assert!(err.to_string().contains("nvshmem"), "{err}");
}

#[test]
fn hybrid_sharding_across_nodes_is_refused_on_device_transports() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FileStore::new(dir.path()).unwrap());
    let topo = Topology::new(0, 4, 2).unwrap();
    let cfg = EngineConfig {
        sharding: odc_core::Sharding::Hybrid,
        ..config("dev_hybrid", TransportKind::EmuShmem)
    };
    let err = Engine::new(store, topo, cfg).unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(err.to_string().contains("full sharding"), "{err}");
}

#[test]
fn a_release_on_the_stream_holds_the_owner_until_the_copies_ran() {
    // Versions follow each other with no finish between them: an owner may
    // overwrite its shard as soon as every reader released the previous
    // version. The readers' copies run late (their streams sleep), so a
    // release sent ahead of them would let version v + 1 land in the shard
    // before version v was copied out.
    run_ranks(
        2,
        "dev_release",
        TransportKind::EmuIpc,
        release_holds_the_owner,
    );
}

/// As above, with every reader on the other node.
#[cfg(feature = "fabric")]
#[test]
fn a_release_across_nodes_holds_the_owner_until_the_reads_ran() {
    run_nodes(
        2,
        1,
        "shmem_release",
        TransportKind::EmuShmem,
        release_holds_the_owner,
    );
}

/// The node cache in device memory: 2 emulated nodes of 2 ranks, every
/// remote shard cut into pieces (the landing chunk), three gathers of each
/// version (forward, backward's re-gather, one more) on streams that sleep
/// before every operation. A fill's piece is marked ready by work on the
/// fetcher's stream after its copies, and a node-mate copies it out on its
/// own stream: a mark sent ahead of the bytes would let it copy a slot that
/// holds the previous version, and the checks fail. Each piece of each
/// version crosses to a node once.
#[cfg(feature = "fabric")]
#[test]
fn a_device_node_cache_fetches_each_remote_piece_once_per_node_and_stays_exact() {
    let fetched = Arc::new(std::sync::Mutex::new(vec![(0u64, 0u64); 4]));
    let seen = Arc::clone(&fetched);
    let (numel, versions, gathers) = (4096usize, 4u64, 3usize);
    run_config(
        4,
        2,
        config("dev_cache", TransportKind::EmuShmem),
        move |e| {
            let (rank, world) = (e.rank(), e.world());
            let stream = EmuStream::new(Duration::from_micros(200)).unwrap();
            let s = stream.handle();
            e.register(&[BucketSpec::new("w", numel, DType::F32)])
                .unwrap();
            let w = BucketId(0);
            let sl = e.bucket(w).unwrap().shard_len();
            let stats = e.node_cache_stats().expect("a device node cache");
            // Two remote owners, 4 KiB shards in pieces of the 512-byte chunk.
            assert_eq!(stats.entries, 2 * 8, "rank {rank}");
            assert_eq!(
                stats.slots, stats.entries,
                "rank {rank}: room for every piece"
            );
            for k in 0..versions {
                let shard: Vec<f32> = (0..sl)
                    .map(|i| (rank * sl + i) as f32 + 100_000.0 * k as f32)
                    .collect();
                let outs: Vec<Vec<f32>> = (0..gathers).map(|_| vec![-1f32; numel]).collect();
                // SAFETY: every buffer outlives the finish below, which waits
                // for the stream.
                unsafe {
                    let d = e.device().unwrap();
                    d.publish(w, addr(&shard), sl * 4, DType::F32, k, s)
                        .unwrap();
                    for out in &outs {
                        d.gather(w, k, addr(out), numel * 4, DType::F32, s, false)
                            .unwrap();
                    }
                    d.release(w, k, s).unwrap();
                }
                e.device().unwrap().finish_minibatch(k, s).unwrap();
                for (g, out) in outs.iter().enumerate() {
                    for (i, x) in out.iter().enumerate() {
                        assert_eq!(
                            *x,
                            i as f32 + 100_000.0 * k as f32,
                            "rank {rank} version {k} gather {g} elem {i}"
                        );
                    }
                }
            }
            assert_eq!(world, 4);
            let st = e.node_cache_stats().unwrap();
            assert_eq!((st.direct, st.taken_over), (0, 0), "rank {rank}: {st:?}");
            seen.lock().unwrap()[rank] = (st.fetched, st.hits);
        },
    );
    let f = fetched.lock().unwrap();
    for node in 0..2 {
        let (a, b) = (f[2 * node], f[2 * node + 1]);
        // Every piece of every version fetched once by one of the node's
        // ranks; every other copy of it a hit.
        assert_eq!(a.0 + b.0, 16 * versions, "node {node}: {f:?}");
        let copies = 2 * gathers as u64 * 16 * versions;
        assert_eq!(a.0 + b.0 + a.1 + b.1, copies, "node {node}: {f:?}");
    }
}

/// A device node cache keeps every remote shard (nothing is evicted on a
/// stream): an explicit bound below that is refused by name with the bytes
/// needed; the default bound keeps no cache then; `Engine::data_sizes`
/// counts the device share.
#[test]
fn a_device_node_cache_too_small_for_the_remote_shards_is_refused_by_name() {
    let specs = [BucketSpec::new("w", 4096, DType::F32)];
    let topo = Topology::new(0, 4, 2).unwrap();
    let cfg = |node_cache| EngineConfig {
        node_cache,
        ..config("dev_cache_small", TransportKind::EmuShmem)
    };
    // 2 remote shards of 4 KiB per node: 8 KiB, half of it on each rank.
    let sizes = Engine::data_sizes(&specs, &topo, &cfg(None)).unwrap();
    assert_eq!(sizes.cache, 4096);
    assert_eq!(
        Engine::data_sizes(&specs, &topo, &cfg(Some(0)))
            .unwrap()
            .cache,
        0
    );
    assert_eq!(
        Engine::data_sizes(&specs, &topo, &cfg(Some(8192)))
            .unwrap()
            .cache,
        4096
    );
    let err = Engine::data_sizes(&specs, &topo, &cfg(Some(8191))).unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    for needle in [
        "node_cache=8191",
        "8192 bytes per node",
        "ODC_NODE_CACHE_MB=1",
    ] {
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
    // One node: no remote shard, no cache.
    let one = Topology::new(0, 2, 2).unwrap();
    assert_eq!(
        Engine::data_sizes(&specs, &one, &cfg(None)).unwrap().cache,
        0
    );
}

fn release_holds_the_owner(e: Engine) {
    {
        let rank = e.rank();
        let stream = EmuStream::new(Duration::from_millis(1)).unwrap();
        let s = stream.handle();
        e.register(&[BucketSpec::new("w", 4096, DType::F32)])
            .unwrap();
        let w = BucketId(0);
        let sl = e.bucket(w).unwrap().shard_len();
        let versions = 12u64;
        let shards: Vec<Vec<f32>> = (0..versions)
            .map(|v| {
                (0..sl)
                    .map(|i| (v * 100_000) as f32 + (rank * sl + i) as f32)
                    .collect()
            })
            .collect();
        let outs: Vec<Vec<f32>> = (0..versions).map(|_| vec![0f32; 4096]).collect();
        for v in 0..versions {
            let (shard, out) = (&shards[v as usize], &outs[v as usize]);
            // SAFETY: all buffers outlive the synchronize below.
            unsafe {
                e.device()
                    .unwrap()
                    .publish(w, addr(shard), sl * 4, DType::F32, v, s)
                    .unwrap();
                e.device()
                    .unwrap()
                    .gather(w, v, addr(out), 4096 * 4, DType::F32, s, false)
                    .unwrap();
            }
            e.device().unwrap().release(w, v, s).unwrap();
        }
        e.device().unwrap().finish_minibatch(0, s).unwrap();
        for (v, out) in outs.iter().enumerate() {
            for (i, x) in out.iter().enumerate() {
                assert_eq!(
                    *x,
                    (v * 100_000) as f32 + i as f32,
                    "rank {rank} version {v} elem {i}"
                );
            }
        }
    }
}

#[test]
fn cuda_ipc_without_a_gpu_names_what_is_missing() {
    if odc_kernels::cuda::driver_is_present() {
        eprintln!("SKIPPED: a CUDA driver is present here (scripts/gpu-run.sh runs cuda-ipc)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FileStore::new(dir.path()).unwrap());
    let topo = Topology::single_node(0, 2).unwrap();
    let err = Engine::new(store, topo, config("dev_nogpu", TransportKind::CudaIpc)).unwrap_err();
    assert!(matches!(err, Error::GpuUnavailable(_)), "{err:?}");
    assert!(err.to_string().contains("libcuda"), "{err}");
    assert_eq!(
        TransportKind::parse("cuda-ipc"),
        Some(TransportKind::CudaIpc)
    );
    assert_eq!(TransportKind::parse("EMU-IPC"), Some(TransportKind::EmuIpc));
    assert_eq!(
        TransportKind::parse("nvshmem"),
        Some(TransportKind::Nvshmem)
    );
    assert_eq!(
        TransportKind::parse("emu_shmem"),
        Some(TransportKind::EmuShmem)
    );
    let err = Engine::new(
        Arc::new(FileStore::new(dir.path()).unwrap()),
        Topology::single_node(0, 2).unwrap(),
        config("dev_nogpu_shmem", TransportKind::Nvshmem),
    )
    .unwrap_err();
    assert!(matches!(err, Error::GpuUnavailable(_)), "{err:?}");
    assert!(TransportKind::CudaIpc.is_device() && !TransportKind::Shm.is_device());
}

/// Compressed gathers on `emu-ipc` (fp8 blocks of 32, scope all, 2 ranks):
/// each version's quantised copy is written before the version is
/// announced, and read before it is dequantised. The daemons' streams (which
/// quantise and dequantise) sleep up to 3 ms before each operation while
/// the callers' streams do not, so a copy announced before the daemon wrote
/// it would be read stale (the last version's, or zeros): far outside fp8's
/// rounding of these values, which change by a whole factor per version.
#[test]
fn compressed_copies_are_written_before_their_version_is_announced() {
    use odc_core::protocol::compress::{Compress, Scope};
    use odc_kernels::cpu::quant::{Format, Spec};
    let cfg = EngineConfig {
        compress: Some(Compress {
            push: None,
            gather: Some(Spec::new(Format::Fp8E4m3, 32).unwrap()),
            feedback: true,
            scope: Scope::All,
        }),
        ..config("dp_cz_order", TransportKind::EmuIpc)
    };
    let numel = 4096;
    common::run_config(2, 2, cfg, 3000, move |e| {
        let rank = e.rank();
        let stream = EmuStream::new(Duration::ZERO).unwrap();
        let s = stream.handle();
        e.register(&[BucketSpec::new("w", numel, DType::F32)])
            .unwrap();
        let w = BucketId(0);
        let sl = e.bucket(w).unwrap().shard_len();
        let d = e.device().unwrap();
        for k in 0..4u64 {
            let value = |i: usize| (i % 97) as f32 * (k + 1) as f32 + 1.0;
            let shard: Vec<f32> = (0..sl).map(|j| value(rank * sl + j)).collect();
            let out = vec![0f32; numel];
            // SAFETY: both buffers outlive the finish below, which waits for
            // the stream.
            unsafe {
                d.publish(w, shard.as_ptr() as u64, sl * 4, DType::F32, k, s)
                    .unwrap();
                d.gather(w, k, out.as_ptr() as u64, numel * 4, DType::F32, s, false)
                    .unwrap();
                d.release(w, k, s).unwrap();
            }
            d.finish_minibatch(k, s).unwrap();
            for (i, &x) in out.iter().enumerate() {
                let want = value(i);
                assert!(
                    (x - want).abs() <= want.abs() / 16.0,
                    "rank {rank} v{k} element {i}: {x}, want {want}"
                );
            }
            stream.synchronize().unwrap();
        }
    });
}
