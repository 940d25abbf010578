//! Compressed pushes across nodes, in process: two emulated nodes of 3
//! over `shm` with node sums. The owner's sums lie within the format's
//! error bound of the exact sums; with error feedback, what the owners
//! accumulated over several minibatches plus the residuals the pushers
//! still hold equals the exact sum to f32 rounding; the bytes handed to
//! other nodes are the formula's, scales and headers included; settings
//! that cannot keep their promise with compression are refused by name.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use odc_kernels::cpu::quant::{Format, Spec};
use odc_kernels::DType;

use super::{config, run_on_nodes};
use crate::control::HEADER_BYTES;
use crate::protocol::compress::{Compress, Scope};
use crate::{bytes_of, BucketSpec, Engine, EngineConfig, Error, FileStore, Topology};

const WORLD: usize = 6;
const LOCAL: usize = 3;
const NUMEL: usize = 3001;

/// Element `i` of rank `r`'s gradient in microbatch `m` of minibatch `k`:
/// not exact in any narrow format, magnitudes from 0.01 to 7.
fn grad(r: usize, k: u64, m: u64, i: usize) -> f32 {
    let x = ((i * 37 + r * 11 + k as usize * 5 + m as usize * 3) % 101) as f32;
    (x - 50.0) / 7.0 + 0.01 * (i % 13) as f32
}

fn micros(r: usize, k: u64) -> u64 {
    1 + (r as u64 + k) % 2
}

/// Node sums over `shm` (emulated nodes), nothing compressed.
fn node_sums(key: &str) -> EngineConfig {
    EngineConfig {
        cross_node: crate::CrossNode::Node,
        transport: crate::TransportKind::Shm,
        ..config(key)
    }
}

fn compressing(spec: Spec, feedback: bool, key: &str) -> EngineConfig {
    EngineConfig {
        compress: Some(Compress {
            push: Some(spec),
            gather: None,
            feedback,
            scope: Scope::CrossNode,
        }),
        ..node_sums(key)
    }
}

/// What one rank saw: its gradient shard after each minibatch, the bytes
/// it handed to other nodes, and the residuals it holds (key: owner).
#[derive(Clone, Debug, Default)]
struct Seen {
    shards: Vec<Vec<f32>>,
    sent_across: u64,
    residuals: BTreeMap<usize, Vec<f32>>,
    shard_len: usize,
}

/// Runs `minibatches` minibatches of bucket "a" on every rank with `cfg`;
/// returns what each rank saw, by rank.
fn train(cfg: EngineConfig, minibatches: u64) -> Vec<Seen> {
    let out = Arc::new(Mutex::new(BTreeMap::new()));
    let sink = Arc::clone(&out);
    run_on_nodes(WORLD, LOCAL, cfg, move |e: Engine| {
        let rank = e.rank();
        e.register(&[BucketSpec::new("a", NUMEL, DType::F32)])
            .unwrap();
        let sums = e.core().reg.get().unwrap().sums.is_some();
        assert_eq!(sums, e.core().config.cross_node == crate::CrossNode::Node);
        let h = e.host().unwrap();
        let id = e.bucket_id("a").unwrap();
        let shard_len = e.bucket(id).unwrap().shard_len();
        let mut seen = Seen {
            shard_len,
            ..Seen::default()
        };
        for k in 0..minibatches {
            for m in 0..micros(rank, k) {
                let g: Vec<f32> = (0..NUMEL).map(|i| grad(rank, k, m, i)).collect();
                h.scatter_accumulate(id, bytes_of(&g), DType::F32, 0.5)
                    .unwrap();
            }
            h.finish_minibatch(k).unwrap();
            let mut got = vec![0f32; shard_len];
            h.read_grad_shard(id, &mut got).unwrap();
            seen.shards.push(got);
            h.zero_grads().unwrap();
        }
        let push = e.core().push.lock().unwrap();
        seen.sent_across = push.sent_across;
        if let Some(fb) = push.packer.as_ref().and_then(|p| p.feedback.as_ref()) {
            for o in 0..WORLD {
                if let Some(r) = fb.residual(o) {
                    seen.residuals.insert(o, r.to_vec());
                }
            }
        }
        drop(push);
        sink.lock().unwrap().insert(rank, seen);
    });
    let v = out.lock().unwrap();
    (0..WORLD).map(|r| v[&r].clone()).collect()
}

/// The exact (f64) sum of every rank's pushes of minibatch `k` into
/// element `i`, and the part of it from node `node`.
fn exact(k: u64, i: usize, node: Option<usize>) -> f64 {
    (0..WORLD)
        .filter(|r| node.is_none_or(|n| r / LOCAL == n))
        .flat_map(|r| (0..micros(r, k)).map(move |m| (r, m)))
        .map(|(r, m)| 0.5 * f64::from(grad(r, k, m, i)))
        .sum()
}

#[test]
fn compressed_node_sums_lie_within_the_formats_bound() {
    for (format, key) in [(Format::Int8, "cz_int8"), (Format::Fp8E4m3, "cz_fp8")] {
        let spec = Spec::new(format, 32).unwrap();
        let seen = train(compressing(spec, false, key), 1);
        let mut worst = 0f64;
        for (o, s) in seen.iter().enumerate() {
            let other = 1 - o / LOCAL;
            // Chunks start at the shard's start and hold whole blocks, so
            // block j is elements [32j, 32j + 32) of the shard.
            for (j, block) in s.shards[0].chunks(32).enumerate() {
                let first = o * s.shard_len + 32 * j;
                let remote: Vec<f64> = (first..first + block.len())
                    .map(|i| {
                        if i < NUMEL {
                            exact(0, i, Some(other))
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let amax = remote.iter().fold(0f64, |a, x| a.max(x.abs()));
                for (t, &got) in block.iter().enumerate() {
                    let i = first + t;
                    let want = if i < NUMEL { exact(0, i, None) } else { 0.0 };
                    // int8: half a step of amax / 127; fp8 e4m3: half an
                    // ulp (2^-4 relative) or half the subnormal step.
                    let q = match format {
                        Format::Int8 => amax / 127.0 / 2.0,
                        _ => (remote[t].abs() / 16.0).max(amax / 448.0 / 1024.0),
                    };
                    let bound = q * 1.001 + 1e-5 * want.abs().max(1.0);
                    let err = (f64::from(got) - want).abs();
                    assert!(
                        err <= bound,
                        "{format}: owner {o} element {i}: got {got}, exact {want}, bound {bound}"
                    );
                    worst = worst.max(err / bound);
                }
            }
        }
        eprintln!("{format}/32: largest error {worst:.3} of the bound");
        // The bound is not loose by orders of magnitude: the error is real.
        assert!(worst > 0.05, "{format}: largest error {worst} of the bound");
    }
}

const MINIBATCHES: u64 = 4;

/// The largest gap, relative to the sum (at least 1), between the exact sum
/// of every minibatch's pushes and what the owners accumulated plus the
/// residuals the pushers still hold for them.
fn feedback_gap(seen: &[Seen]) -> f64 {
    let mut worst = 0f64;
    for (o, s) in seen.iter().enumerate() {
        for j in 0..s.shard_len {
            let i = o * s.shard_len + j;
            let accumulated: f64 = s.shards.iter().map(|g| f64::from(g[j])).sum();
            // The residuals for owner `o`'s shard (bucket 0: key `o`),
            // held by the ranks that push to it.
            let held: f64 = seen
                .iter()
                .filter_map(|p| p.residuals.get(&o))
                .map(|r| f64::from(r[j]))
                .sum();
            let want: f64 = if i < NUMEL {
                (0..MINIBATCHES).map(|k| exact(k, i, None)).sum()
            } else {
                0.0
            };
            let err = (accumulated + held - want).abs();
            worst = worst.max(err / want.abs().max(1.0));
        }
    }
    worst
}

#[test]
fn error_feedback_loses_nothing_over_minibatches() {
    let spec = Spec::new(Format::Int8, 32).unwrap();
    for feedback in [true, false] {
        let key = if feedback { "cz_fb" } else { "cz_nofb" };
        let seen = train(compressing(spec, feedback, key), MINIBATCHES);
        let worst = feedback_gap(&seen);
        eprintln!("feedback {feedback}: largest relative gap {worst:.2e}");
        if feedback {
            assert!(
                seen.iter().filter(|s| !s.residuals.is_empty()).count() == WORLD,
                "every rank aggregates for owners on the other node and keeps residuals"
            );
            // f32 rounding of a few dozen additions of magnitudes up to ~40.
            assert!(
                worst < 2e-5,
                "pushed + residual differs from the exact sum by {worst}"
            );
        } else {
            // Without feedback the quantisation error stays in the sums.
            assert!(
                worst > 1e-3,
                "no feedback, yet the sums are exact ({worst})"
            );
        }
    }
}

/// Bytes a push of `elems` elements to one owner hands over: one header per
/// chunk, plus the chunk's data (`spec`: scales and codes; else f32).
fn push_bytes(elems: usize, slot: usize, spec: Option<Spec>) -> u64 {
    let per_chunk = match spec {
        Some(s) => crate::protocol::compress::chunk_elems(s, slot).unwrap(),
        None => slot / 4,
    };
    let mut bytes = 0;
    let mut left = elems;
    while left > 0 {
        let n = left.min(per_chunk);
        bytes += HEADER_BYTES + spec.map_or(n * 4, |s| s.chunk_bytes(n));
        left -= n;
    }
    bytes as u64
}

#[test]
fn bytes_across_nodes_are_the_formulas() {
    let minibatches = 2;
    let plain = train(node_sums("cz_plain"), minibatches);
    let slot = config("x").chunk_bytes;
    for format in [Format::Int8, Format::Fp8E4m3, Format::Bf16] {
        let spec = Spec::new(format, 32).unwrap();
        let key = format!("cz_bytes_{format}");
        let packed = train(compressing(spec, true, &key), minibatches);
        // Each rank pushes its node's sums once per minibatch to the one
        // replica of its local rank on the other node: one shard.
        let shard = plain[0].shard_len;
        for r in 0..WORLD {
            let want = minibatches * push_bytes(shard, slot, Some(spec));
            assert_eq!(packed[r].sent_across, want, "{format}: rank {r}");
            assert_eq!(
                plain[r].sent_across,
                minibatches * push_bytes(shard, slot, None),
                "uncompressed: rank {r}"
            );
        }
        let ratio = packed[0].sent_across as f64 / plain[0].sent_across as f64;
        let data = spec.chunk_bytes(32) as f64 / (32.0 * 4.0);
        eprintln!(
            "{format}/32: {ratio:.3} of the uncompressed bytes across nodes (data alone {data:.3})"
        );
        assert!(ratio < data * 1.6, "{format}: {ratio}");
    }
}

#[test]
fn settings_that_cannot_keep_their_promise_are_refused_by_name() {
    let spec = Spec::new(Format::Int8, 32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let refused = |cfg: EngineConfig| {
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        match Engine::new(store, Topology::new(0, 1, 1).unwrap(), cfg) {
            Err(Error::Config(msg)) => msg,
            other => panic!("expected a ConfigError, got {other:?}"),
        }
    };
    let det = refused(EngineConfig {
        deterministic: true,
        ..compressing(spec, true, "cz_det")
    });
    assert!(
        det.contains("compress") && det.contains("deterministic"),
        "{det}"
    );
    let mut gather = compressing(spec, true, "cz_gather");
    if let Some(c) = gather.compress.as_mut() {
        c.gather = Some(Spec::new(Format::Fp8E4m3, 32).unwrap());
    }
    let msg = refused(gather);
    assert!(msg.contains("gather") && msg.contains("not built"), "{msg}");
}

/// Direct pushes (no node sums), every push compressed (`scope = "all"`):
/// each pusher's chunks carry its factor 0.5 into the values it quantises,
/// and its residuals per owner make up exactly what the owners lack.
#[test]
fn every_push_compressed_with_direct_pushes_loses_nothing() {
    let spec = Spec::new(Format::Fp8E4m3, 64).unwrap();
    let mut cfg = compressing(spec, true, "cz_all");
    cfg.cross_node = crate::CrossNode::Direct;
    if let Some(c) = cfg.compress.as_mut() {
        c.scope = Scope::All;
    }
    let seen = train(cfg, MINIBATCHES);
    let worst = feedback_gap(&seen);
    eprintln!("direct, scope all, fp8/64: largest relative gap {worst:.2e}");
    assert!(
        worst < 2e-5,
        "pushed + residual differs from the exact sum by {worst}"
    );
    // Every rank holds residuals for all five other owners (node-mates too).
    for (r, s) in seen.iter().enumerate() {
        assert_eq!(s.residuals.len(), WORLD - 1, "rank {r}");
    }
}
