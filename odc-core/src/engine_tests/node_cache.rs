//! The node cache of remote shards, in process: two emulated nodes over
//! `shm` (the cache asked for explicitly; by default it runs where nodes
//! are joined by a network). Exact values, one fetch per node per piece
//! and version with room for every remote shard, eviction with less, and a
//! dead fetcher's claim taken over.

use std::sync::{Arc, Barrier, Mutex};

use odc_kernels::DType;

use super::{config, run_on_nodes};
use crate::protocol::cache;
use crate::{bytes_of, bytes_of_mut, BucketSpec, Engine, NodeCacheStats};

/// Element `i` of bucket `b` at version `k`: exact in f32 and bf16.
fn value(b: usize, i: usize, k: u64) -> f32 {
    ((i * 3 + b * 7 + k as usize * 5) % 97) as f32
}

/// Pieces of remote shards a gather of every bucket reads on a rank of
/// node `node` (6 ranks, nodes of 3): those that reach the output (shards
/// are padded to an alignment, so the last owners' pieces may lie past
/// `numel`).
fn needed(e: &Engine, node: usize) -> u64 {
    let c = e.core().reg.get().unwrap().cache.as_ref().unwrap();
    let mut n = 0;
    for (b, s) in specs().iter().enumerate() {
        let lay = e.bucket(crate::BucketId(b)).unwrap();
        let size = s.dtype.size_bytes();
        let cb = c.layout.buckets[b];
        for owner in (0..6).filter(|o| o / 3 != node) {
            let start = owner * lay.shard_len() * size;
            n += (0..cb.pieces)
                .filter(|j| start + j * cb.piece < s.numel * size)
                .count() as u64;
        }
    }
    n
}

/// Every rank publishes, gathers each bucket `gathers` times (a forward
/// and a backward), checks every element, pushes and finishes, for
/// `minibatches` minibatches; returns its cache counts and the pieces it
/// needs per gather of every bucket.
fn train(e: &Engine, minibatches: u64, gathers: usize) -> (NodeCacheStats, u64) {
    let (rank, specs) = (e.rank(), specs());
    e.register(&specs).unwrap();
    let h = e.host().unwrap();
    for k in 0..minibatches {
        for (b, s) in specs.iter().enumerate() {
            let id = e.bucket_id(&s.name).unwrap();
            let r = e.bucket(id).unwrap().shard_range(rank);
            let shard: Vec<f32> = r.map(|i| value(b, i, k)).collect();
            match s.dtype {
                DType::F32 => h.publish(id, bytes_of(&shard), DType::F32, k).unwrap(),
                _ => {
                    let shard: Vec<half::bf16> =
                        shard.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    h.publish(id, bytes_of(&shard), DType::BF16, k).unwrap()
                }
            }
        }
        for _ in 0..gathers {
            for (b, s) in specs.iter().enumerate() {
                let id = e.bucket_id(&s.name).unwrap();
                let got: Vec<f32> = match s.dtype {
                    DType::F32 => {
                        let mut full = vec![-1f32; s.numel];
                        h.gather(id, k, bytes_of_mut(&mut full), DType::F32)
                            .unwrap();
                        full
                    }
                    _ => {
                        let mut full = vec![half::bf16::from_f32(-1.0); s.numel];
                        h.gather(id, k, bytes_of_mut(&mut full), DType::BF16)
                            .unwrap();
                        full.iter().map(|x| x.to_f32()).collect()
                    }
                };
                for (i, x) in got.iter().enumerate() {
                    assert_eq!(*x, value(b, i, k), "rank {rank} bucket {b} elem {i} v{k}");
                }
            }
        }
        h.finish_minibatch(k).unwrap();
    }
    (
        e.node_cache_stats().expect("a node cache"),
        needed(e, rank / 3),
    )
}

fn specs() -> Vec<BucketSpec> {
    vec![
        // 6 ranks: shards of 501 f32 = 2004 bytes, 8 pieces of 256.
        BucketSpec::new("a", 3001, DType::F32),
        // Shards of 13 bf16: one piece each.
        BucketSpec::new("b", 77, DType::BF16),
    ]
}

/// Entries of one node: 3 remote owners × (8 + 1) pieces.
const REMOTE_PIECES: u64 = 3 * (8 + 1);

type Counts = (usize, (NodeCacheStats, u64));

fn run(key: &str, bound: usize, minibatches: u64, gathers: usize) -> Vec<Counts> {
    let cfg = crate::EngineConfig {
        node_cache: Some(bound),
        ..config(key)
    };
    let out = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&out);
    run_on_nodes(6, 3, cfg, move |e| {
        let stats = train(&e, minibatches, gathers);
        sink.lock().unwrap().push((e.rank(), stats));
    });
    let mut v = out.lock().unwrap().clone();
    v.sort_by_key(|(r, _)| *r);
    v
}

#[test]
fn each_remote_piece_crosses_once_per_node_and_serves_every_gather() {
    let (minibatches, gathers) = (3, 2);
    let stats = run("nc_once", 1 << 20, minibatches, gathers);
    for node in 0..2 {
        let mates = &stats[node * 3..node * 3 + 3];
        let sum = |f: fn(&NodeCacheStats) -> u64| mates.iter().map(|(_, (s, _))| f(s)).sum::<u64>();
        let (first, needed) = mates[0].1;
        assert_eq!(first.entries as u64, REMOTE_PIECES);
        assert!(first.slots >= first.entries, "room for every piece");
        assert!(needed > 0 && needed <= REMOTE_PIECES);
        // One fetch per node per needed piece and version...
        assert_eq!(
            sum(|s| s.fetched),
            needed * minibatches,
            "node {node}: {mates:?}"
        );
        // ...and every other read of a piece served from the node.
        let reads = needed * minibatches * gathers as u64 * 3;
        assert_eq!(
            sum(|s| s.hits),
            reads - needed * minibatches,
            "node {node}: {mates:?}"
        );
        assert_eq!(sum(|s| s.direct) + sum(|s| s.taken_over), 0);
    }
}

#[test]
fn a_small_bound_evicts_the_least_recently_used_and_stays_exact() {
    // Three slots of 256 bytes for 27 pieces: most reads miss.
    let stats = run("nc_lru", 3 * 256, 3, 2);
    let node0: u64 = stats[..3]
        .iter()
        .map(|(_, (s, _))| s.fetched + s.direct)
        .sum();
    let (first, needed) = stats[0].1;
    assert_eq!(first.slots, 3);
    assert!(node0 > needed * 3, "evictions refetch: {stats:?}");
}

#[test]
fn a_dead_fetchers_claim_is_taken_over() {
    // Rank 1 (node 0) claims one piece of rank 3's shard of "a" for
    // version 0, then closes its engine without fetching it; rank 0's
    // gather finds the claim's fetcher dead and fetches the piece itself.
    let cfg = crate::EngineConfig {
        node_cache: Some(1 << 20),
        ..config("nc_dead")
    };
    let barrier = Arc::new(Barrier::new(6));
    // The survivors stay until rank 0 gathered (their shards are read).
    let done = Arc::new(Barrier::new(5));
    let out = Arc::new(Mutex::new(None));
    let sink = Arc::clone(&out);
    run_on_nodes(6, 3, cfg, move |e| {
        let rank = e.rank();
        e.register(&specs()).unwrap();
        let h = e.host().unwrap();
        let a = e.bucket_id("a").unwrap();
        let r = e.bucket(a).unwrap().shard_range(rank);
        let shard: Vec<f32> = r.map(|i| value(0, i, 0)).collect();
        h.publish(a, bytes_of(&shard), DType::F32, 0).unwrap();
        let reg = e.core().reg.get().unwrap();
        let c = reg.cache.as_ref().unwrap();
        let entry = c.layout.entry(0, 3, c.node_start, 2);
        if rank == 1 {
            c.entry_word(entry)
                .store(cache::claim(0, entry, 1), crate::sync::Ordering::Release);
        }
        barrier.wait();
        if rank == 1 {
            drop(e);
            barrier.wait();
            return;
        }
        barrier.wait();
        if rank == 0 {
            let mut full = vec![-1f32; 3001];
            h.gather(a, 0, bytes_of_mut(&mut full), DType::F32).unwrap();
            for (i, x) in full.iter().enumerate() {
                assert_eq!(*x, value(0, i, 0), "elem {i}");
            }
            *sink.lock().unwrap() = e.node_cache_stats();
        }
        done.wait();
    });
    let stats = out.lock().unwrap().expect("rank 0's counts");
    assert_eq!(stats.taken_over, 1, "{stats:?}");
}

/// Node aggregation (`cross_node = "node"`) over shm, two emulated nodes of
/// 3: uneven microbatch counts (node 1 idle in minibatch 1, rank 0 idle in
/// minibatch 2), every rank's final gradient shard exact, and a fast
/// node-mate's pushes of the next minibatch held until its aggregator's
/// buffers are open for it.
#[test]
fn node_sums_equal_every_rank_pushing_for_itself() {
    let cfg = crate::EngineConfig {
        cross_node: crate::CrossNode::Node,
        ..config("ns_sums")
    };
    // Microbatches of rank r in minibatch k.
    fn micros(r: usize, k: u64) -> u64 {
        match k {
            1 if r >= 3 => 0,
            2 if r == 0 => 0,
            _ => 1 + (r as u64 + k) % 3,
        }
    }
    fn grad(r: usize, m: u64, i: usize) -> f32 {
        ((r * 13 + m as usize * 7 + i) % 23) as f32
    }
    run_on_nodes(6, 3, cfg, |e| {
        let rank = e.rank();
        e.register(&[
            BucketSpec::new("a", 3001, DType::F32),
            BucketSpec::new("b", 77, DType::BF16),
        ])
        .unwrap();
        let reg = e.core().reg.get().unwrap();
        assert!(reg.sums.is_some(), "node aggregation is on");
        let h = e.host().unwrap();
        for k in 0..4u64 {
            for (bi, name) in ["a", "b"].iter().enumerate() {
                let id = e.bucket_id(name).unwrap();
                let lay = e.bucket(id).unwrap().clone();
                let n = lay.spec().numel;
                for m in 0..micros(rank, k) {
                    let g: Vec<f32> = (0..n).map(|i| grad(rank, m, i + bi)).collect();
                    if bi == 0 {
                        h.scatter_accumulate(id, bytes_of(&g), DType::F32, 1.0)
                            .unwrap();
                    } else {
                        let g: Vec<half::bf16> =
                            g.iter().map(|&x| half::bf16::from_f32(x)).collect();
                        h.scatter_accumulate(id, bytes_of(&g), DType::BF16, 0.5)
                            .unwrap();
                    }
                }
            }
            h.finish_minibatch(k).unwrap();
            for (bi, name) in ["a", "b"].iter().enumerate() {
                let id = e.bucket_id(name).unwrap();
                let lay = e.bucket(id).unwrap().clone();
                let mut got = vec![0f32; lay.shard_len()];
                h.read_grad_shard(id, &mut got).unwrap();
                for (j, x) in got.iter().enumerate() {
                    let i = rank * lay.shard_len() + j;
                    let want: f32 = if i < lay.spec().numel {
                        let scale = if bi == 0 { 1.0 } else { 0.5 };
                        (0..6)
                            .flat_map(|r| (0..micros(r, k)).map(move |m| (r, m)))
                            .map(|(r, m)| scale * grad(r, m, i + bi))
                            .sum()
                    } else {
                        0.0
                    };
                    assert_eq!(*x, want, "rank {rank} minibatch {k} bucket {name} elem {i}");
                }
            }
            h.zero_grads().unwrap();
        }
    });
}
