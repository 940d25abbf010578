//! In-process tests: several engines in one process, one thread per rank.
//! Multi-process behaviour (crashes, segment cleanup) lives in `tests/`.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns

use std::sync::Arc;
use std::time::Duration;

use odc_kernels::DType;

mod compress;
mod compress_hybrid;
mod deterministic;
mod node_cache;

use crate::{
    bytes_of, bytes_of_mut, BucketId, BucketSpec, Engine, EngineConfig, Error, FileStore, Topology,
};

pub(super) fn config(key: &str) -> EngineConfig {
    EngineConfig {
        chunk_bytes: 256,
        timeout: Duration::from_secs(10),
        job_key: key.into(),
        ..EngineConfig::default()
    }
}

fn run_ranks<F>(world: usize, key: &str, f: F)
where
    F: Fn(Engine) + Send + Sync + 'static,
{
    run_on_nodes(world, world, config(key), f);
}

/// Runs `f` on `world` engines (one thread each) in nodes of `local` ranks,
/// all with `cfg`.
pub(super) fn run_on_nodes<F>(world: usize, local: usize, cfg: EngineConfig, f: F)
where
    F: Fn(Engine) + Send + Sync + 'static,
{
    let dir = tempfile::tempdir().unwrap();
    let f = Arc::new(f);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let store = Arc::new(FileStore::new(dir.path()).unwrap());
            let (f, cfg) = (Arc::clone(&f), cfg.clone());
            std::thread::spawn(move || {
                let e =
                    Engine::new(store, Topology::new(rank, world, local).unwrap(), cfg).unwrap();
                f(e)
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// [`run_on_nodes`], collecting what `f` returns on each rank, by rank.
pub(super) fn run_per_rank<T, F>(world: usize, local: usize, cfg: EngineConfig, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Engine) -> T + Send + Sync + 'static,
{
    let out = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
    let sink = Arc::clone(&out);
    run_on_nodes(world, local, cfg, move |e: Engine| {
        let rank = e.rank();
        let seen = f(e);
        sink.lock().unwrap().insert(rank, seen);
    });
    let mut by_rank = std::mem::take(&mut *out.lock().unwrap());
    (0..world).map(|r| by_rank.remove(&r).unwrap()).collect()
}

#[test]
fn gather_scatter_three_ranks_threads() {
    run_ranks(3, "unit_gs3", |e| {
        let (rank, world) = (e.rank(), e.world());
        let numel = 1001;
        e.register(&[
            BucketSpec::new("a", numel, DType::F32),
            BucketSpec::new("b", 77, DType::BF16),
        ])
        .unwrap();
        let a = e.bucket_id("a").unwrap();
        let sl = e.bucket(a).unwrap().shard_len();
        for k in 0..5u64 {
            let shard: Vec<f32> = (0..sl)
                .map(|i| ((rank * sl + i) as f32) + 1000.0 * k as f32)
                .collect();
            e.host()
                .unwrap()
                .publish(a, bytes_of(&shard), DType::F32, k)
                .unwrap();
            let mut full = vec![0f32; numel];
            e.host()
                .unwrap()
                .gather(a, k, bytes_of_mut(&mut full), DType::F32)
                .unwrap();
            for (i, x) in full.iter().enumerate() {
                assert_eq!(*x, i as f32 + 1000.0 * k as f32);
            }
            let mut remote = vec![-1f32; numel];
            e.host()
                .unwrap()
                .gather_remote(a, k, bytes_of_mut(&mut remote), DType::F32)
                .unwrap();
            for (i, x) in remote.iter().enumerate() {
                let own = e.bucket(a).unwrap().shard_range(rank).contains(&i);
                assert_eq!(
                    *x,
                    if own {
                        -1.0
                    } else {
                        i as f32 + 1000.0 * k as f32
                    }
                );
            }
            let grads: Vec<f32> = (0..numel).map(|i| (i % 7) as f32 + rank as f32).collect();
            e.host()
                .unwrap()
                .scatter_accumulate(a, bytes_of(&grads), DType::F32, 1.0)
                .unwrap();
            e.host()
                .unwrap()
                .scatter_accumulate(a, bytes_of(&grads), DType::F32, 2.0)
                .unwrap();
            e.host().unwrap().finish_minibatch(k).unwrap();
            let mut g = vec![0f32; sl];
            e.host().unwrap().read_grad_shard(a, &mut g).unwrap();
            for (j, x) in g.iter().enumerate() {
                let i = rank * sl + j;
                let want = if i < numel {
                    3.0 * (0..world).map(|r| (i % 7) as f32 + r as f32).sum::<f32>()
                } else {
                    0.0
                };
                assert_eq!(*x, want, "rank {rank} elem {i}");
            }
            e.host().unwrap().zero_grads().unwrap();
        }
    });
}

#[test]
fn bad_input_is_reported() {
    run_ranks(2, "unit_bad", |e| {
        let shard = vec![0f32; 64];
        // Before registration there is no worker handle to publish with.
        assert!(matches!(e.host(), Err(Error::Protocol { .. })));
        e.register(&[BucketSpec::new("a", 100, DType::F32)])
            .unwrap();
        assert!(matches!(e.bucket_id("nope"), Err(Error::Layout { .. })));
        let a = e.bucket_id("a").unwrap();
        assert!(matches!(
            e.host()
                .unwrap()
                .publish(BucketId(5), bytes_of(&shard), DType::F32, 0),
            Err(Error::Layout { .. })
        ));
        assert!(matches!(
            e.host()
                .unwrap()
                .publish(a, bytes_of(&shard[..3]), DType::F32, 0),
            Err(Error::Layout { .. })
        ));
        assert!(matches!(
            e.host()
                .unwrap()
                .publish(a, bytes_of(&shard), DType::BF16, 0),
            Err(Error::Layout { .. })
        ));
        let mut out = vec![0f32; 99];
        assert!(matches!(
            e.host()
                .unwrap()
                .gather(a, 0, bytes_of_mut(&mut out), DType::F32),
            Err(Error::Layout { .. })
        ));
        let g = vec![0f32; 10];
        assert!(matches!(
            e.host()
                .unwrap()
                .scatter_accumulate_at(a, 120, bytes_of(&g), DType::F32, 1.0),
            Err(Error::Layout { .. })
        ));
        assert!(matches!(
            e.register(&[BucketSpec::new("a", 100, DType::F32)]),
            Err(Error::Protocol { .. })
        ));
    });
}

#[test]
fn mismatched_registration_names_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            let store = Arc::new(FileStore::new(dir.path()).unwrap());
            std::thread::spawn(move || {
                let e = Engine::new(
                    store,
                    Topology::single_node(rank, 2).unwrap(),
                    config("unit_mis"),
                )
                .unwrap();
                let n = if rank == 0 { 10 } else { 11 };
                e.register(&[
                    BucketSpec::new("x", 5, DType::F32),
                    BucketSpec::new("y", n, DType::F32),
                ])
            })
        })
        .collect();
    for t in threads {
        match t.join().unwrap() {
            Err(Error::Registration {
                first_differing_bucket: 1,
                ours,
                theirs,
                ..
            }) => {
                assert!(ours.starts_with("y numel=") && theirs.starts_with("y numel="));
            }
            other => panic!("expected a registration error, got {other:?}"),
        }
    }
}

/// Four ranks as two nodes of two (all on this host, over `shm`), hybrid
/// sharding: shards over the node, gradients summed over every rank, with
/// uneven push counts and several minibatches.
#[test]
fn hybrid_two_nodes_sums_every_rank() {
    use crate::Sharding;
    let (world, local) = (4usize, 2usize);
    let numel = 1003;
    let cfg = EngineConfig {
        sharding: Sharding::Hybrid,
        transport: crate::TransportKind::Shm,
        ..config("unit_hybrid")
    };
    run_on_nodes(world, local, cfg, move |e| {
        let rank = e.rank();
        e.register(&[BucketSpec::new("w", numel, DType::F32)])
            .unwrap();
        let w = e.bucket_id("w").unwrap();
        let lay = e.bucket(w).unwrap().clone();
        // Sharded over the node's two ranks, not the world's four.
        assert!(
            lay.shard_len() * local >= numel,
            "sharded over {} ranks",
            numel.div_ceil(lay.shard_len())
        );
        assert!(lay.padded_len() >= numel && lay.padded_len() < numel + 64 * local);
        let me = rank % local;
        let sl = lay.shard_len();
        for k in 0..3u64 {
            // Every replica publishes the same shard content.
            let shard: Vec<f32> = (0..sl).map(|i| (me * sl + i) as f32 + k as f32).collect();
            e.host()
                .unwrap()
                .publish(w, bytes_of(&shard), DType::F32, k)
                .unwrap();
            let mut full = vec![0f32; numel];
            e.host()
                .unwrap()
                .gather(w, k, bytes_of_mut(&mut full), DType::F32)
                .unwrap();
            for (i, x) in full.iter().enumerate() {
                assert_eq!(*x, i as f32 + k as f32, "rank {rank} element {i}");
            }
            // Rank r pushes r + 1 microbatches of (r + 1) * (i + k).
            for _ in 0..=rank {
                let g: Vec<f32> = (0..numel)
                    .map(|i| ((rank + 1) * (i + 1)) as f32 + k as f32)
                    .collect();
                e.host()
                    .unwrap()
                    .scatter_accumulate(w, bytes_of(&g), DType::F32, 1.0)
                    .unwrap();
            }
            e.host().unwrap().finish_minibatch(k).unwrap();
            let mut grad = vec![0f32; sl];
            e.host().unwrap().read_grad_shard(w, &mut grad).unwrap();
            for (j, x) in grad.iter().enumerate() {
                let i = me * sl + j;
                let want = if i < numel {
                    (0..world)
                        .map(|r| ((r + 1) * ((r + 1) * (i + 1)) + (r + 1) * k as usize) as f32)
                        .sum::<f32>()
                } else {
                    0.0
                };
                assert_eq!(*x, want, "rank {rank} minibatch {k} shard element {j}");
            }
            e.host().unwrap().zero_grads().unwrap();
        }
    });
}

/// ZeRO++-style hybrid over `world / local` nodes of `local` ranks (all on
/// this host, over `shm`): each rank publishes only its 1/D piece, gathers
/// the whole bucket from its node, and reads the gradient of its piece
/// summed over every rank; uneven push counts, pushes split at an offset
/// that crosses blocks, several minibatches.
fn hybrid_zero_sums(world: usize, local: usize, key: &'static str) {
    use crate::Sharding;
    let numel = 1003;
    let cfg = EngineConfig {
        sharding: Sharding::HybridZero,
        transport: crate::TransportKind::Shm,
        ..config(key)
    };
    run_on_nodes(world, local, cfg, move |e| {
        let rank = e.rank();
        e.register(&[
            BucketSpec::new("w", numel, DType::F32),
            BucketSpec::new("v", 77, DType::BF16),
        ])
        .unwrap();
        let (w, v) = (e.bucket_id("w").unwrap(), e.bucket_id("v").unwrap());
        let lay = e.bucket(w).unwrap().clone();
        let nodes = world / local;
        // Node shards of N blocks; block r is rank r's piece.
        assert_eq!(lay.blocks(), nodes);
        assert_eq!(lay.shard_len(), nodes * lay.block_len());
        assert!(lay.block_len() * world >= numel);
        let bl = lay.block_len();
        let host = e.host().unwrap();
        // A shard-sized publish is refused: a rank publishes its piece.
        let err = host
            .publish(w, bytes_of(&vec![0f32; lay.shard_len()]), DType::F32, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("piece"), "{err}");
        for k in 0..3u64 {
            let piece: Vec<f32> = (0..bl).map(|j| (rank * bl + j) as f32 + k as f32).collect();
            host.publish(w, bytes_of(&piece), DType::F32, k).unwrap();
            let vl = e.bucket(v).unwrap().block_len();
            let vp: Vec<half::bf16> = (0..vl)
                .map(|j| half::bf16::from_f32(((rank * vl + j) % 200) as f32))
                .collect();
            host.publish(v, bytes_of(&vp), DType::BF16, k).unwrap();
            let mut full = vec![0f32; numel];
            host.gather(w, k, bytes_of_mut(&mut full), DType::F32)
                .unwrap();
            for (i, x) in full.iter().enumerate() {
                assert_eq!(*x, i as f32 + k as f32, "rank {rank} element {i}");
            }
            let mut vfull = vec![half::bf16::ZERO; 77];
            host.gather(v, k, bytes_of_mut(&mut vfull), DType::BF16)
                .unwrap();
            for (i, x) in vfull.iter().enumerate() {
                assert_eq!(x.to_f32(), (i % 200) as f32, "rank {rank} v element {i}");
            }
            // Rank r pushes r + 1 microbatches; odd ranks in two
            // parts split inside a block.
            for _ in 0..=rank {
                let g: Vec<f32> = (0..lay.padded_len())
                    .map(|i| ((rank + 1) * (i + 1)) as f32 + k as f32)
                    .collect();
                if rank % 2 == 1 {
                    let cut = bl + 5;
                    host.scatter_accumulate_at(w, 0, bytes_of(&g[..cut]), DType::F32, 1.0)
                        .unwrap();
                    host.scatter_accumulate_at(w, cut, bytes_of(&g[cut..]), DType::F32, 1.0)
                        .unwrap();
                } else {
                    host.scatter_accumulate(w, bytes_of(&g[..numel]), DType::F32, 1.0)
                        .unwrap();
                }
            }
            host.finish_minibatch(k).unwrap();
            let mut grad = vec![0f32; bl];
            host.read_grad_shard(w, &mut grad).unwrap();
            for (j, x) in grad.iter().enumerate() {
                let i = rank * bl + j;
                let want: f32 = (0..world)
                    .map(|r| {
                        let g = if i < numel || r % 2 == 1 {
                            ((r + 1) * (i + 1)) as f32 + k as f32
                        } else {
                            0.0
                        };
                        (r + 1) as f32 * g
                    })
                    .sum();
                assert_eq!(*x, want, "rank {rank} minibatch {k} piece element {j}");
            }
            host.zero_grads().unwrap();
        }
    });
}

#[test]
fn hybrid_zero_two_nodes_of_two() {
    hybrid_zero_sums(4, 2, "unit_hz22");
}

#[test]
fn hybrid_zero_three_nodes_of_two() {
    hybrid_zero_sums(6, 2, "unit_hz32");
}

/// Work stealing among `counts.len()` ranks over `transport`: every rank
/// runs its own list (slowly when it is long), then steals from the others
/// until every list of the minibatch is drained. Every microbatch of every
/// minibatch must be run exactly once, and the long lists must be stolen
/// from.
fn steal_exactly_once(transport: crate::TransportKind, key: &'static str) {
    use std::collections::HashMap;

    use crate::protocol::claims::Claim;

    let counts: Arc<[u64]> = Arc::from(vec![9u64, 1, 0, 5]);
    let world = counts.len();
    let minibatches = 3u64;
    let dir = tempfile::tempdir().unwrap();
    let done = Arc::new(std::sync::Barrier::new(world));
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let store = Arc::new(FileStore::new(dir.path()).unwrap());
            let counts = Arc::clone(&counts);
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    transport,
                    ..config(key)
                };
                let e =
                    Engine::new(store, Topology::single_node(rank, world).unwrap(), cfg).unwrap();
                e.register(&[BucketSpec::new("w", 64, DType::F32)]).unwrap();
                let host = e.host().unwrap();
                let mut ran = Vec::new(); // (minibatch, owner, index)
                for k in 0..minibatches {
                    while let Claim::Got(i) = host.claim_own(k, counts[rank]).unwrap() {
                        ran.push((k, rank, i));
                        std::thread::sleep(Duration::from_millis(3));
                    }
                    loop {
                        let mut open = false;
                        for v in (0..world).filter(|&v| v != rank) {
                            let w = host.claims_of(v).unwrap();
                            if w.stamp > k + 1 || (w.stamp == k + 1 && w.left(k) == 0) {
                                continue; // drained
                            }
                            open = true;
                            if let Claim::Got(i) = host.steal(v, k).unwrap() {
                                ran.push((k, v, i));
                            }
                        }
                        if !open {
                            break;
                        }
                    }
                }
                done.wait(); // peers may still read this rank's claim word
                ran
            })
        })
        .collect();
    let mut seen: HashMap<(u64, usize, u64), usize> = HashMap::new();
    let mut stolen = 0;
    for (rank, t) in threads.into_iter().enumerate() {
        for (k, owner, i) in t.join().unwrap() {
            *seen.entry((k, owner, i)).or_default() += 1;
            stolen += usize::from(owner != rank);
        }
    }
    for k in 0..minibatches {
        for (owner, &n) in counts.iter().enumerate() {
            for i in 0..n {
                assert_eq!(
                    seen.get(&(k, owner, i)),
                    Some(&1),
                    "minibatch {k} rank {owner} item {i}"
                );
            }
        }
    }
    assert_eq!(seen.len() as u64, minibatches * counts.iter().sum::<u64>());
    assert!(stolen > 0, "nothing was stolen");
}

#[test]
fn steal_exactly_once_over_shm() {
    steal_exactly_once(crate::TransportKind::Shm, "unit_steal_shm");
}

#[cfg(feature = "fabric")]
#[test]
fn steal_exactly_once_over_fabric() {
    steal_exactly_once(crate::TransportKind::Fabric, "unit_steal_fabric");
}

#[test]
fn hybrid_and_full_ranks_refuse_each_other() {
    use crate::Sharding;
    let dir = tempfile::tempdir().unwrap();
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            let store = Arc::new(FileStore::new(dir.path()).unwrap());
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    sharding: if rank == 0 {
                        Sharding::Hybrid
                    } else {
                        Sharding::Full
                    },
                    transport: crate::TransportKind::Shm,
                    ..config("unit_hybrid_mix")
                };
                let e = Engine::new(store, Topology::new(rank, 2, 1).unwrap(), cfg).unwrap();
                let err = e
                    .register(&[BucketSpec::new("w", 10, DType::F32)])
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains("hybrid sharding") && err.contains("full sharding"),
                    "{err}"
                );
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// A survivor that reads from a rank which closed its engine because a
/// third rank died names the third rank (the root cause), not the rank it
/// read from: rank 0 fails because of rank 1 and closes; rank 2's gather
/// then reads rank 0's shard. Over `fabric`, where that read itself fails.
#[cfg(feature = "fabric")]
#[test]
fn a_read_from_a_rank_that_failed_names_the_root_cause() {
    use std::sync::Barrier;

    use crate::transport::PeerStatus;

    let world = 3;
    let dir = tempfile::tempdir().unwrap();
    let published = Arc::new(Barrier::new(world));
    let closed = Arc::new(Barrier::new(world));
    // Ranks 1 and 2 keep their engines until both gathered: one that
    // returned early would close, and the other could read its shard
    // (and name it) before rank 0's.
    let gathered = Arc::new(Barrier::new(world - 1));
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let store = Arc::new(FileStore::new(dir.path()).unwrap());
            let (published, closed) = (Arc::clone(&published), Arc::clone(&closed));
            let gathered = Arc::clone(&gathered);
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    transport: crate::TransportKind::Fabric,
                    timeout: Duration::from_secs(5),
                    ..config("unit_root_cause")
                };
                let e =
                    Engine::new(store, Topology::single_node(rank, world).unwrap(), cfg).unwrap();
                e.register(&[BucketSpec::new("w", 96, DType::F32)]).unwrap();
                let w = e.bucket_id("w").unwrap();
                let shard = vec![rank as f32; e.bucket(w).unwrap().shard_len()];
                e.host()
                    .unwrap()
                    .publish(w, bytes_of(&shard), DType::F32, 0)
                    .unwrap();
                published.wait();
                if rank == 0 {
                    // Fails because of rank 1, as a wait on it would record.
                    e.core().transport.set_blame(1);
                    drop(e);
                    closed.wait();
                    return None;
                }
                closed.wait();
                // Rank 0's close notice is on its way; wait until it is seen.
                let t0 = std::time::Instant::now();
                while e.core().transport.peer_status(0) == PeerStatus::Alive {
                    assert!(
                        t0.elapsed() < Duration::from_secs(5),
                        "rank 0 never seen closed"
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
                let mut full = vec![0f32; 96];
                let out = e
                    .host()
                    .unwrap()
                    .gather(w, 0, bytes_of_mut(&mut full), DType::F32);
                gathered.wait();
                Some(out)
            })
        })
        .collect();
    for (rank, t) in threads.into_iter().enumerate() {
        match t.join().unwrap() {
            None => assert_eq!(rank, 0),
            // Rank 0 blamed rank 1 itself: rank 1 names rank 0.
            Some(Err(Error::PeerDied {
                peer: 0,
                reported_by: None,
                ..
            })) if rank == 1 => {}
            Some(Err(Error::PeerDied {
                peer: 1,
                reported_by: Some(0),
                ..
            })) if rank == 2 => {}
            Some(other) => panic!("rank {rank}: wrong outcome {other:?}"),
        }
    }
}

#[test]
fn landing_memory_per_rank_at_8_64_and_1024_ranks() {
    // What `register` allocates for landing slots (Engine::data_sizes is
    // its plan), with the default 2 MiB chunk and 256 MiB budget.
    let specs = [BucketSpec::new("w", 1 << 20, DType::F32)];
    let cfg = EngineConfig {
        chunk_bytes: 2 << 20,
        landing_budget: crate::control::DEFAULT_LANDING_BUDGET,
        ..EngineConfig::default()
    };
    let landing = |d: usize| {
        let topo = Topology::single_node(0, d).unwrap();
        Engine::data_sizes(&specs, &topo, &cfg).unwrap().landing
    };
    let mib = 1usize << 20;
    assert_eq!(landing(8), 32 * mib); // 2 x 8 x 2 MiB
    assert_eq!(landing(64), 256 * mib); // 2 x 64 x 2 MiB, the budget
    assert_eq!(landing(1024), 256 * mib); // 2 x 1024 x 128 KiB
    let topo = Topology::single_node(0, 4096).unwrap();
    let e = Engine::data_sizes(&specs, &topo, &cfg).unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
}
