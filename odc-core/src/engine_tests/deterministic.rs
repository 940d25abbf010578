//! Deterministic accumulation: final gradient shards are the same bits
//! whatever rank (on whatever node) pushes which microbatch, in what order
//! they arrive, and over how many minibatches between two zeroings.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns

use std::sync::{Arc, Mutex};
use std::time::Duration;

use odc_kernels::DType;

use super::{config, run_on_nodes};
use crate::{bytes_of, BucketSpec, EngineConfig, Error, Sharding, TransportKind};

const NUMEL: usize = 1003;
const MICROBATCHES: usize = 11;

/// Microbatch `m`'s gradient: values over 24 binades and both signs, so
/// that f32 sums of them depend on order.
fn gradient(m: usize) -> Vec<f32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ (m as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
    (0..NUMEL)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let mant = 1.0 + (s >> 41) as f32 / (1u64 << 23) as f32;
            let exp = ((s >> 20) % 24) as i32 - 12;
            if s & 1 == 1 {
                -mant * (exp as f32).exp2()
            } else {
                mant * (exp as f32).exp2()
            }
        })
        .collect()
}

/// The rank that runs microbatch `m` in round `round`: a rank of node
/// `(m + round) % nodes`, so that from round to round a microbatch moves
/// between nodes (hybrid sharding: the cross-node sum is exact too) and
/// between the ranks of a node.
fn runner(m: usize, round: usize, world: usize, local: usize) -> usize {
    let nodes = world / local;
    let node = (m + round) % nodes;
    node * local + (m / nodes + round) % local
}

/// One run: `world` ranks over `sharding`; in minibatch `k`, microbatch
/// `m` goes to rank `runner(m, trial + k, ..)`, and ranks push their
/// microbatches in an order and with delays that depend on `trial`.
/// Minibatches 0 and 1 run every microbatch; minibatch 2 runs two thirds
/// of them and is finished without a zeroing, and minibatch 3 runs the
/// rest (a rerun continuing the sums). Returns every rank's gradient shard
/// after minibatches 0, 1 and 3.
fn run(trial: usize, world: usize, local: usize, sharding: Sharding) -> Vec<Vec<Vec<u32>>> {
    let cfg = EngineConfig {
        deterministic: true,
        sharding,
        transport: TransportKind::Shm,
        ..config(&format!("unit_det_{trial}_{world}_{}", sharding.name()))
    };
    let out = Arc::new(Mutex::new(vec![Vec::new(); world]));
    let sink = Arc::clone(&out);
    run_on_nodes(world, local, cfg, move |e| {
        let rank = e.rank();
        e.register(&[BucketSpec::new("w", NUMEL, DType::F32)])
            .unwrap();
        let w = e.bucket_id("w").unwrap();
        let host = e.host().unwrap();
        let mut mine = Vec::new();
        let piece = e.bucket(w).unwrap().block_len();
        for k in 0..4u64 {
            // A push of minibatch k follows the gather of version k, which
            // follows every owner's zeroing after minibatch k - 1.
            let shard = vec![0f32; piece];
            host.publish(w, bytes_of(&shard), DType::F32, k).unwrap();
            let mut full = vec![0f32; NUMEL];
            host.gather(w, k, crate::bytes_of_mut(&mut full), DType::F32)
                .unwrap();
            let mut todo: Vec<usize> = (0..MICROBATCHES)
                .filter(|&m| runner(m, trial + k as usize, world, local) == rank)
                .filter(|&m| match k {
                    2 => m % 3 != 0,
                    3 => m % 3 == 0,
                    _ => true,
                })
                .collect();
            if (trial + rank) % 2 == 1 {
                todo.reverse();
            }
            for m in todo {
                // Stagger the ranks differently in every trial.
                std::thread::sleep(Duration::from_micros(
                    ((m * 7 + rank * 13 + trial * 29) % 5) as u64 * 300,
                ));
                host.scatter_accumulate(w, bytes_of(&gradient(m)), DType::F32, 0.5)
                    .unwrap();
            }
            host.finish_minibatch(k).unwrap();
            if k == 2 {
                continue; // no zeroing: minibatch 3 continues the sums
            }
            let mut g = vec![0f32; piece];
            host.read_grad_shard(w, &mut g).unwrap();
            mine.push(g.iter().map(|x| x.to_bits()).collect());
            host.zero_grads().unwrap();
        }
        sink.lock().unwrap()[rank] = mine;
    });
    let got = out.lock().unwrap().clone();
    got
}

/// What every run must give: the exact sum of every microbatch's
/// `0.5 · gradient`, rounded once, whatever the nodes.
fn expected() -> Vec<f32> {
    let (mut fixed, mut sum) = (vec![0i128; NUMEL], vec![0f32; NUMEL]);
    for m in 0..MICROBATCHES {
        let g = gradient(m);
        odc_kernels::cpu::exact::accumulate_exact(
            &mut fixed,
            &mut sum,
            bytes_of(&g),
            DType::F32,
            0.5,
        )
        .unwrap();
    }
    odc_kernels::cpu::exact::read_exact(&fixed, &mut sum).unwrap();
    sum
}

fn same_bits_in_every_run(world: usize, local: usize, sharding: Sharding) {
    let runs: Vec<_> = (0..3).map(|t| run(t, world, local, sharding)).collect();
    for (t, r) in runs.iter().enumerate().skip(1) {
        assert_eq!(
            r,
            &runs[0],
            "run {t} differs from run 0 ({} sharding)",
            sharding.name()
        );
    }
    let per_rank = &runs[0];
    assert!(
        per_rank.iter().all(|k| k[0] == k[1]),
        "two minibatches of the same sum differ"
    );
    assert!(
        per_rank.iter().all(|k| k[0] == k[2]),
        "a sum split over two minibatches without a zeroing differs from one minibatch of it"
    );
    // The bucket as the ranks hold it: every rank's shard (full), node 0's
    // shards (hybrid: every node holds the same), every rank's piece
    // (hybrid-zero: rank r's is block r of the bucket).
    let holders = if sharding == Sharding::Hybrid {
        local
    } else {
        world
    };
    let flat: Vec<u32> = per_rank[..holders]
        .iter()
        .flat_map(|k| k[0].clone())
        .collect();
    for (i, w) in expected().iter().enumerate() {
        assert_eq!(
            flat[i],
            w.to_bits(),
            "element {i}: {} vs {w}",
            f32::from_bits(flat[i])
        );
    }
}

#[test]
fn deterministic_full_sharding_is_the_same_bits_whoever_pushes_in_whatever_order() {
    // Not vacuous: an f32 sum of these microbatches depends on their order.
    let f32_sum = |order: &mut dyn Iterator<Item = usize>| {
        let mut acc = vec![0f32; NUMEL];
        for m in order {
            for (a, x) in acc.iter_mut().zip(gradient(m)) {
                *a += 0.5 * x;
            }
        }
        acc
    };
    assert_ne!(
        f32_sum(&mut (0..MICROBATCHES)),
        f32_sum(&mut (0..MICROBATCHES).rev())
    );
    same_bits_in_every_run(4, 4, Sharding::Full);
}

#[test]
fn deterministic_hybrid_and_hybrid_zero_are_the_same_bits_in_every_run() {
    same_bits_in_every_run(4, 2, Sharding::Hybrid);
    same_bits_in_every_run(4, 2, Sharding::HybridZero);
}

#[test]
fn deterministic_and_plain_ranks_refuse_each_other() {
    // Only rank 1 asks for deterministic accumulation: both refuse.
    let dir = tempfile::tempdir().unwrap();
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            let store = Arc::new(crate::FileStore::new(dir.path()).unwrap());
            std::thread::spawn(move || {
                let cfg = EngineConfig {
                    deterministic: rank == 1,
                    ..config("unit_det_mixed")
                };
                let e = crate::Engine::new(store, crate::Topology::new(rank, 2, 2).unwrap(), cfg)
                    .unwrap();
                e.register(&[BucketSpec::new("w", 10, DType::F32)])
                    .unwrap_err()
            })
        })
        .collect();
    for t in threads {
        let err = t.join().unwrap();
        assert!(err.to_string().contains("deterministic"), "{err}");
    }
}

#[test]
fn a_contribution_beyond_the_exact_range_fails_the_finish() {
    let cfg = EngineConfig {
        deterministic: true,
        ..config("unit_det_range")
    };
    run_on_nodes(2, 2, cfg, |e| {
        e.register(&[BucketSpec::new("w", 100, DType::F32)])
            .unwrap();
        let w = e.bucket_id("w").unwrap();
        let host = e.host().unwrap();
        let mut g = vec![1.0f32; 100];
        g[e.rank() * 64 + 3] = 1e12;
        host.scatter_accumulate(w, bytes_of(&g), DType::F32, 1.0)
            .unwrap();
        let err = host.finish_minibatch(0).unwrap_err();
        assert!(matches!(err, Error::Protocol { .. }), "{err}");
        assert!(
            err.to_string().contains("2^39") && err.to_string().contains("bucket \"w\""),
            "{err}"
        );
    });
}
