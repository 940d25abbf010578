//! What the node rules save across nodes on the device plane, counted by
//! `emu-shmem` itself (every byte its planes read from or wrote to a rank
//! on another emulated node: what `nvshmem` would send over the network),
//! for the same program run four times in this process: the node cache and
//! node sums, then `direct`, then node sums compressed to int8, then fp8
//! gathers as well. A test binary of its own: the count is the process's.

#![cfg(feature = "fabric")]
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use odc_core::plane::emu::{cross_node_bytes, EmuStream};
use odc_core::protocol::compress::{Compress, Scope};
use odc_core::{BucketId, BucketSpec, CrossNode, DType, Engine, EngineConfig, TransportKind};
use odc_kernels::cpu::quant::{Format, Spec};

const WORLD: usize = 4;
const LOCAL: usize = 2;
const NUMEL: usize = 4096;
const VERSIONS: u64 = 3;
const GATHERS: usize = 3;

/// Runs the program on 4 thread-ranks (2 emulated nodes of 2) under `cfg`:
/// per minibatch a publish, `GATHERS` gathers (forward, backward's
/// re-gather, one more) and one push of the whole bucket, checked exactly.
fn run(cfg: EngineConfig) {
    let fp8 = cfg.compress.as_ref().is_some_and(|c| c.gather.is_some());
    // int8 with error feedback: a sum differs from the exact one by this
    // minibatch's residual less the last one's, within a step of the
    // largest node sum (13 / 127).
    let tolerance = if cfg.compress.is_some() { 0.11 } else { 0.0 };
    common::run_config(WORLD, LOCAL, cfg, 100, move |e| program(&e, tolerance, fp8));
}

/// The program; gradient sums are checked to `tolerance` (exactly when 0),
/// gathers exactly, or with `fp8` those of shards on the other node to
/// fp8's rounding (2^-4 of the value).
fn program(e: &Engine, tolerance: f32, fp8: bool) {
    let rank = e.rank();
    let stream = EmuStream::new(Duration::from_micros(100)).unwrap();
    let s = stream.handle();
    e.register(&[BucketSpec::new("w", NUMEL, DType::F32)])
        .unwrap();
    let w = BucketId(0);
    let sl = e.bucket(w).unwrap().shard_len();
    for k in 0..VERSIONS {
        let shard: Vec<f32> = (0..sl).map(|i| (rank * sl + i) as f32 + k as f32).collect();
        let outs: Vec<Vec<f32>> = (0..GATHERS).map(|_| vec![0f32; NUMEL]).collect();
        let grads: Vec<f32> = (0..NUMEL).map(|i| (i % 5) as f32 + rank as f32).collect();
        let d = e.device().unwrap();
        // SAFETY: every buffer outlives the finish below, which waits for
        // the stream.
        unsafe {
            d.publish(w, shard.as_ptr() as u64, sl * 4, DType::F32, k, s)
                .unwrap();
            for out in &outs {
                d.gather(w, k, out.as_ptr() as u64, NUMEL * 4, DType::F32, s, false)
                    .unwrap();
            }
        }
        // What the stream's next work (a forward) reads of the last output:
        // the gathered values, written (or dequantised) before it.
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (sink, last) = (
            std::sync::Arc::clone(&seen),
            outs[GATHERS - 1].as_ptr() as usize,
        );
        stream
            .enqueue(Box::new(move || {
                // SAFETY: `outs` outlives the finish below, which waits for
                // this.
                let got = unsafe { std::slice::from_raw_parts(last as *const f32, NUMEL) };
                *sink.lock().unwrap() = got.to_vec();
            }))
            .unwrap();
        // SAFETY: as above.
        unsafe {
            d.release(w, k, s).unwrap();
            d.scatter_accumulate(w, 0, grads.as_ptr() as u64, NUMEL * 4, DType::F32, 1.0, s)
                .unwrap();
        }
        d.finish_minibatch(k, s).unwrap();
        assert!(
            *seen.lock().unwrap() == outs[GATHERS - 1],
            "rank {rank} version {k}: the stream's next work read the output before the gather \
             had written it"
        );
        for out in &outs {
            for (i, &x) in out.iter().enumerate() {
                let want = i as f32 + k as f32;
                let remote = (i / sl) / LOCAL != rank / LOCAL;
                let bound = if fp8 && remote {
                    want.abs() / 16.0
                } else {
                    0.0
                };
                assert!(
                    (x - want).abs() <= bound,
                    "rank {rank} version {k} element {i}: {x}"
                );
            }
        }
        let mut g = vec![0f32; sl];
        d.read_grad_shard(w, &mut g).unwrap();
        for (i, x) in g.iter().enumerate() {
            let at = rank * sl + i;
            let want: f32 = (0..WORLD).map(|r| (at % 5) as f32 + r as f32).sum();
            assert!(
                (x - want).abs() <= tolerance,
                "rank {rank} version {k} grad {i}: {x}, want {want}"
            );
        }
        d.zero_grads(s).unwrap();
        stream.synchronize().unwrap();
    }
}

fn config(key: &str, cross_node: CrossNode, node_cache: Option<usize>) -> EngineConfig {
    EngineConfig {
        chunk_bytes: 512,
        timeout: Duration::from_secs(20),
        job_key: key.into(),
        transport: TransportKind::EmuShmem,
        cross_node,
        node_cache,
        ..EngineConfig::default()
    }
}

#[test]
fn the_node_rules_move_hierarchical_bytes_across_nodes_on_the_device_plane() {
    let shard = (NUMEL / WORLD * 4) as u64;
    let (nodes, remote) = ((WORLD / LOCAL) as u64, (WORLD - LOCAL) as u64);
    let before = cross_node_bytes();
    run(config("bytes_node", CrossNode::Node, None));
    let mid = cross_node_bytes();
    run(config("bytes_direct", CrossNode::Direct, Some(0)));
    let after = cross_node_bytes();
    let int8 = Spec::new(Format::Int8, 32).unwrap();
    run(EngineConfig {
        compress: Some(Compress {
            push: Some(int8),
            gather: None,
            feedback: true,
            scope: Scope::CrossNode,
        }),
        ..config("bytes_int8", CrossNode::Node, None)
    });
    let last = cross_node_bytes();
    let fp8 = Spec::new(Format::Fp8E4m3, 32).unwrap();
    run(EngineConfig {
        compress: Some(Compress {
            push: Some(int8),
            gather: Some(fp8),
            feedback: true,
            scope: Scope::CrossNode,
        }),
        ..config("bytes_fp8_int8", CrossNode::Node, None)
    });
    let end = cross_node_bytes();
    let node = (mid.0 - before.0, mid.1 - before.1);
    let direct = (after.0 - mid.0, after.1 - mid.1);
    let compressed = (last.0 - after.0, last.1 - after.1);
    let both = (end.0 - last.0, end.1 - last.1);
    eprintln!(
        "bytes across nodes (read, written): node rules {node:?}, direct {direct:?}, \
         int8 node sums {compressed:?}, fp8 gathers and int8 node sums {both:?}"
    );
    // Gathers: each remote shard version once per node under the cache;
    // every rank's every gather reads it under direct.
    assert_eq!(node.0, VERSIONS * nodes * remote * shard);
    assert_eq!(
        direct.0,
        VERSIONS * WORLD as u64 * GATHERS as u64 * remote * shard
    );
    // Pushes: each node's sum for each remote owner once under node sums;
    // every rank's chunk for every remote owner under direct.
    assert_eq!(node.1, VERSIONS * nodes * remote * shard);
    assert_eq!(direct.1, VERSIONS * WORLD as u64 * remote * shard);
    // Compressed node sums: the same gathers; each node's sum for each
    // remote owner crosses as int8 chunks of whole blocks (scales
    // included) that fit a 512-byte slot.
    assert_eq!(compressed.0, node.0);
    let per_chunk = 512 / int8.chunk_bytes(32) * 32;
    let elems = NUMEL / WORLD;
    let chunks: u64 = (0..elems)
        .step_by(per_chunk)
        .map(|at| int8.chunk_bytes(per_chunk.min(elems - at)) as u64)
        .sum();
    assert_eq!(compressed.1, VERSIONS * nodes * remote * chunks);
    assert!(
        compressed.1 * 10 < node.1 * 3,
        "{compressed:?} against {node:?}"
    );
    // fp8 gathers: each remote shard's quantised copy (runs of whole
    // blocks that fit a slot, scales included) once per node and version.
    assert_eq!(both.1, compressed.1);
    let per_run = 512 / fp8.chunk_bytes(32) * 32;
    let copy: u64 = (0..elems)
        .step_by(per_run)
        .map(|at| fp8.chunk_bytes(per_run.min(elems - at)) as u64)
        .sum();
    assert_eq!(both.0, VERSIONS * nodes * remote * copy);
    let (all, f32_all) = (both.0 + both.1, node.0 + node.1);
    assert!(all * 100 <= f32_all * 30, "{both:?} against {node:?}");
}
