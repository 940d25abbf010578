//! Compressed pushes and gathers across nodes, in process: two emulated
//! nodes of 3 over `shm` with node sums. The owner's sums lie within the
//! format's error bound of the exact sums; with error feedback, what the
//! owners accumulated over several minibatches plus the residuals the
//! pushers still hold equals the exact sum to f32 rounding; the bytes
//! handed to other nodes are the formula's, scales and headers included;
//! a compressed gather returns, for every shard it reads compressed, the
//! reference dequantisation of that version's quantised shard bit for bit,
//! and every other shard exactly; settings that cannot keep their promise
//! with compression are refused by name.

use std::collections::BTreeMap;
use std::sync::Arc;

use odc_kernels::cpu::quant::{Format, Spec};
use odc_kernels::DType;

use super::{config, run_per_rank};
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
    run_per_rank(WORLD, LOCAL, cfg, move |e: Engine| {
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
        seen
    })
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
        check_within_bound(format, &seen);
    }
}

/// Asserts that minibatch 0's sums in `seen` lie within `format`'s bound
/// of the exact sums (one quantisation of the other node's sum), and that
/// the error is real (not orders of magnitude under the bound).
fn check_within_bound(format: Format, seen: &[Seen]) {
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
    gather.sharding = crate::Sharding::HybridZero;
    if let Some(c) = gather.compress.as_mut() {
        c.gather = Some(Spec::new(Format::Fp8E4m3, 32).unwrap());
        c.scope = Scope::All;
    }
    let msg = refused(gather);
    assert!(
        msg.contains("gather") && msg.contains("hybrid-zero") && msg.contains("all"),
        "{msg}"
    );
    let det = refused(EngineConfig {
        deterministic: true,
        ..gathering(Scope::CrossNode, None, "cz_gdet")
    });
    assert!(det.contains("deterministic"), "{det}");
    // Under hybrid sharding no gather crosses nodes (hybrid-zero's piece
    // copies do: compressed, engine_tests::compress_hybrid).
    let msg = refused(EngineConfig {
        sharding: crate::Sharding::Hybrid,
        ..gathering(Scope::CrossNode, None, "cz_hyb")
    });
    assert!(
        msg.contains("cross-node")
            && msg.contains("\"hybrid\"")
            && msg.contains("nothing would be"),
        "{msg}"
    );
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

// ---- compressed gathers ------------------------------------------------------

const GATHER_NUMEL: [usize; 2] = [3001, 77];

/// Element `i` of bucket `b` at version `v`: not exact in fp8 or int8,
/// different at every version (a copy left from an earlier version reads
/// differently), magnitudes from 0.003 to 8.
fn param(b: usize, i: usize, v: u64) -> f32 {
    let x = ((i * 37 + b * 5 + v as usize * 11) % 101) as f32;
    (x - 50.0) / 7.0 + 0.01 * (i % 13) as f32 + 0.003 * (v + 1) as f32
}

/// A bucket of f32 and one of bf16 (dequantised into bf16).
fn gather_specs() -> Vec<BucketSpec> {
    vec![
        BucketSpec::new("a", GATHER_NUMEL[0], DType::F32),
        BucketSpec::new("b", GATHER_NUMEL[1], DType::BF16),
    ]
}

/// Node sums over `shm`, a node cache of `cache` bytes (`None`: none), fp8
/// gathers with blocks of 32 in `scope`, and `push` for pushes.
fn gathering(scope: Scope, cache: Option<usize>, key: &str) -> EngineConfig {
    EngineConfig {
        node_cache: cache,
        compress: Some(Compress {
            push: None,
            gather: Some(Spec::new(Format::Fp8E4m3, 32).unwrap()),
            feedback: true,
            scope,
        }),
        ..node_sums(key)
    }
}

/// What one rank gathered: per version and bucket the full bucket as f32
/// bits (bf16 widened), the bytes it read from and pushed to other nodes,
/// and its cache counts.
#[derive(Clone, Debug, Default)]
struct Gathered {
    full: Vec<[Vec<u32>; 2]>,
    read_across: u64,
    sent_across: u64,
    fetched: u64,
}

/// Every rank publishes `versions` versions of both buckets, gathers each
/// twice (a forward and a backward: the second from the node cache where
/// there is one), pushes a gradient of bucket "a" and finishes; returns
/// what each rank gathered, by rank.
fn gather_run(cfg: EngineConfig, versions: u64) -> Vec<Gathered> {
    run_per_rank(WORLD, LOCAL, cfg, move |e: Engine| {
        let rank = e.rank();
        e.register(&gather_specs()).unwrap();
        let h = e.host().unwrap();
        let mut seen = Gathered::default();
        for v in 0..versions {
            for (b, s) in gather_specs().iter().enumerate() {
                let id = e.bucket_id(&s.name).unwrap();
                let r = e.bucket(id).unwrap().shard_range(rank);
                let shard: Vec<f32> = r
                    .map(|i| if i < s.numel { param(b, i, v) } else { 0.0 })
                    .collect();
                match s.dtype {
                    DType::F32 => h.publish(id, bytes_of(&shard), DType::F32, v).unwrap(),
                    _ => {
                        let shard: Vec<half::bf16> =
                            shard.iter().map(|&x| half::bf16::from_f32(x)).collect();
                        h.publish(id, bytes_of(&shard), DType::BF16, v).unwrap()
                    }
                }
            }
            let mut got: [Vec<u32>; 2] = Default::default();
            for pass in 0..2 {
                for (b, s) in gather_specs().iter().enumerate() {
                    let id = e.bucket_id(&s.name).unwrap();
                    let bits: Vec<u32> = match s.dtype {
                        DType::F32 => {
                            let mut full = vec![f32::NAN; s.numel];
                            h.gather(id, v, crate::bytes_of_mut(&mut full), DType::F32)
                                .unwrap();
                            full.iter().map(|x| x.to_bits()).collect()
                        }
                        _ => {
                            let mut full = vec![half::bf16::NAN; s.numel];
                            h.gather(id, v, crate::bytes_of_mut(&mut full), DType::BF16)
                                .unwrap();
                            full.iter().map(|x| x.to_f32().to_bits()).collect()
                        }
                    };
                    if pass == 0 {
                        got[b] = bits;
                    } else {
                        assert_eq!(
                            got[b], bits,
                            "rank {rank}: the second gather of v{v} differs"
                        );
                    }
                }
            }
            seen.full.push(got);
            let a = e.bucket_id("a").unwrap();
            let g: Vec<f32> = (0..GATHER_NUMEL[0]).map(|i| grad(rank, v, 0, i)).collect();
            h.scatter_accumulate(a, bytes_of(&g), DType::F32, 0.5)
                .unwrap();
            h.finish_minibatch(v).unwrap();
            h.zero_grads().unwrap();
        }
        let across = e.bytes_across_nodes().unwrap().unwrap();
        seen.read_across = across.gathered;
        seen.sent_across = across.pushed;
        seen.fetched = e.node_cache_stats().map_or(0, |s| s.fetched);
        seen
    })
}

/// Owner `o`'s shard of bucket `b` at version `v` as its owner holds it
/// (f32, or bf16 widened), `shard_len` elements.
fn shard_of(b: usize, o: usize, v: u64, shard_len: usize) -> Vec<f32> {
    (o * shard_len..(o + 1) * shard_len)
        .map(|i| {
            let x = if i < GATHER_NUMEL[b] {
                param(b, i, v)
            } else {
                0.0
            };
            match b {
                0 => x,
                _ => half::bf16::from_f32(x).to_f32(),
            }
        })
        .collect()
}

/// The reference (scalar kernels) dequantisation of the whole shard
/// quantised as one chunk, in bucket `b`'s dtype, widened to f32 bits.
fn reference(spec: Spec, b: usize, shard: &[f32]) -> Vec<u32> {
    use odc_kernels::cpu::quant::reference;
    let n = shard.len();
    let mut payload = vec![0f32; spec.payload_bytes(n).div_ceil(4)];
    let payload = &mut crate::bytes_of_mut(&mut payload)[..spec.payload_bytes(n)];
    let mut scales = vec![0f32; spec.scales(n)];
    reference::quantise(spec, shard, payload, &mut scales).unwrap();
    match b {
        0 => {
            let mut out = vec![0f32; n];
            reference::dequantise(spec, payload, &scales, &mut out).unwrap();
            out.iter().map(|x| x.to_bits()).collect()
        }
        _ => {
            let mut out = vec![half::bf16::ZERO; n];
            reference::dequantise(spec, payload, &scales, &mut out).unwrap();
            out.iter().map(|x| x.to_f32().to_bits()).collect()
        }
    }
}

/// Checks every gathered element against its version: owners `compressed`
/// says read compressed (by reader and owner) equal the reference
/// dequantisation bit for bit, the others the shard exactly. Returns how
/// many elements of each kind were checked, and how many of the
/// compressed ones differ from the shard (the copy is really lossy).
fn check_gathered(
    seen: &[Gathered],
    spec: Spec,
    compressed: impl Fn(usize, usize) -> bool,
) -> (usize, usize, usize) {
    let (mut quantised, mut exact, mut lossy) = (0, 0, 0);
    let shard_len = |b: usize| {
        let l = crate::layout::BucketLayout::blocked(gather_specs()[b].clone(), WORLD, 1).unwrap();
        l.shard_len()
    };
    for (v, _) in seen[0].full.iter().enumerate() {
        let v = v as u64;
        for (b, &numel) in GATHER_NUMEL.iter().enumerate() {
            let sl = shard_len(b);
            for o in 0..WORLD {
                let shard = shard_of(b, o, v, sl);
                let want_q = reference(spec, b, &shard);
                for (r, s) in seen.iter().enumerate() {
                    let got = &s.full[v as usize][b];
                    for j in 0..sl {
                        let i = o * sl + j;
                        if i >= numel {
                            break;
                        }
                        let exact_bits = shard[j].to_bits();
                        if compressed(r, o) {
                            assert_eq!(
                                got[i],
                                want_q[j],
                                "rank {r}, v{v}, bucket {b}, owner {o}, element {i}: {} against \
                                 the reference {} (shard {})",
                                f32::from_bits(got[i]),
                                f32::from_bits(want_q[j]),
                                shard[j]
                            );
                            quantised += 1;
                            lossy += usize::from(got[i] != exact_bits);
                        } else {
                            assert_eq!(
                                got[i], exact_bits,
                                "rank {r}, v{v}, bucket {b}, owner {o}, element {i}: not the \
                                 shard's own value"
                            );
                            exact += 1;
                        }
                    }
                }
            }
        }
    }
    (quantised, exact, lossy)
}

#[test]
fn compressed_gathers_are_the_reference_dequantisation_of_their_version() {
    let spec = Spec::new(Format::Fp8E4m3, 32).unwrap();
    let across = |r: usize, o: usize| r / LOCAL != o / LOCAL;
    // The node cache with room for every piece, one with room for 5 (it
    // evicts), and none (direct reads across nodes).
    let mut fetches = Vec::new();
    for (cache, key) in [
        (Some(1 << 20), "cg_cache"),
        (Some(5 * 256), "cg_evict"),
        (None, "cg_direct"),
    ] {
        let seen = gather_run(gathering(Scope::CrossNode, cache, key), 3);
        let (q, x, lossy) = check_gathered(&seen, spec, across);
        let fetched: u64 = seen.iter().map(|s| s.fetched).sum();
        eprintln!(
            "{key}: {q} elements compressed (of which {lossy} lossy), {x} exact; {fetched} \
             pieces fetched"
        );
        assert!(q > 0 && x > 0 && lossy * 2 > q, "{key}: {q} {x} {lossy}");
        fetches.push(fetched);
    }
    // Room for 5 of the 12 pieces a node needs: evicted pieces are fetched
    // again for the second gather.
    assert!(
        fetches[1] > fetches[0] && fetches[0] > 0 && fetches[2] == 0,
        "{fetches:?}"
    );
    // Every other rank's shard compressed (node-mates' too); the own one
    // exact.
    let seen = gather_run(gathering(Scope::All, None, "cg_all"), 2);
    let (q, x, _) = check_gathered(&seen, spec, |r, o| r != o);
    assert_eq!(q, 5 * x);
}

#[test]
fn int8_and_bf16_gathers_are_the_reference_dequantisation_too() {
    for (format, key) in [(Format::Int8, "cg_int8"), (Format::Bf16, "cg_bf16")] {
        let spec = Spec::new(format, 32).unwrap();
        let mut cfg = gathering(Scope::CrossNode, Some(1 << 20), key);
        if let Some(c) = cfg.compress.as_mut() {
            c.gather = Some(spec);
        }
        let seen = gather_run(cfg, 2);
        let (q, _, lossy) = check_gathered(&seen, spec, |r, o| r / LOCAL != o / LOCAL);
        eprintln!("{format}: {q} elements compressed, {lossy} lossy");
        assert!(lossy > 0, "{format}");
    }
}

/// Bytes both nodes' fetches of one version of bucket `b` read from the
/// other node: each needed piece of every owner once, by the node it is
/// remote to (`q`: runs of the quantised copy, else f32/bf16 pieces of at
/// most `piece` bytes).
fn gather_bytes(b: usize, shard_len: usize, q: Option<QuantCopy>, piece: usize) -> u64 {
    let spec = &gather_specs()[b];
    let size = spec.dtype.size_bytes();
    let mut bytes = 0;
    for o in 0..WORLD {
        let first = o * shard_len;
        match q {
            Some(q) => {
                for j in (0..q.runs()).filter(|&j| first + q.elems(j).start < spec.numel) {
                    bytes += q.bytes(j);
                }
            }
            None => {
                let shard = shard_len * size;
                let per = piece.min(shard.next_multiple_of(64));
                for j in
                    (0..shard.div_ceil(per)).filter(|&j| first * size + j * per < spec.numel * size)
                {
                    bytes += per.min(shard - j * per);
                }
            }
        }
    }
    bytes as u64
}

use crate::protocol::compress::QuantCopy;

#[test]
fn fp8_gathers_and_int8_pushes_cross_at_most_030_of_the_f32_bytes() {
    let versions = 3;
    let plain = gather_run(
        EngineConfig {
            node_cache: Some(1 << 20),
            ..node_sums("cg_plain")
        },
        versions,
    );
    let fp8 = Spec::new(Format::Fp8E4m3, 32).unwrap();
    let int8 = Spec::new(Format::Int8, 32).unwrap();
    let mut cfg = gathering(Scope::CrossNode, Some(1 << 20), "cg_packed");
    if let Some(c) = cfg.compress.as_mut() {
        c.push = Some(int8);
    }
    let packed = gather_run(cfg, versions);
    let slot = config("x").chunk_bytes;
    let total = |s: &[Gathered], f: fn(&Gathered) -> u64| s.iter().map(f).sum::<u64>();
    // Formula: per node and version each needed piece of the other node's
    // shards once; per rank and version one shard of node sums pushed.
    let mut want_plain = 0;
    let mut want_packed = 0;
    for (b, spec) in gather_specs().iter().enumerate() {
        let l = crate::layout::BucketLayout::blocked(spec.clone(), WORLD, 1).unwrap();
        let q = QuantCopy::new(fp8, slot, l.shard_len());
        want_plain += versions * gather_bytes(b, l.shard_len(), None, slot);
        want_packed += versions * gather_bytes(b, l.shard_len(), Some(q), slot);
    }
    assert_eq!(total(&plain, |s| s.read_across), want_plain, "f32 gathers");
    assert_eq!(
        total(&packed, |s| s.read_across),
        want_packed,
        "fp8 gathers"
    );
    let shard = crate::layout::BucketLayout::blocked(gather_specs()[0].clone(), WORLD, 1)
        .unwrap()
        .shard_len();
    let pushes = |spec| WORLD as u64 * versions * push_bytes(shard, slot, spec);
    assert_eq!(total(&plain, |s| s.sent_across), pushes(None), "f32 pushes");
    assert_eq!(
        total(&packed, |s| s.sent_across),
        pushes(Some(int8)),
        "int8 pushes"
    );
    let across = |s: &[Gathered]| total(s, |g| g.read_across + g.sent_across) as f64;
    let ratio = across(&packed) / across(&plain);
    let gathers =
        total(&packed, |s| s.read_across) as f64 / total(&plain, |s| s.read_across) as f64;
    let formula = (want_packed + pushes(Some(int8))) as f64 / (want_plain + pushes(None)) as f64;
    eprintln!(
        "fp8/32 gathers + int8/32 pushes: {ratio:.3} of the f32 bytes across nodes (gathers \
         {gathers:.3}; formula with scales and headers {formula:.3})"
    );
    assert!(ratio <= 0.30, "{ratio}");
    assert!(
        (ratio / formula - 1.0).abs() <= 0.02,
        "{ratio} against {formula}"
    );
}

/// `cfg` on `emu-shmem`: `nvshmem`'s device data path, in process.
fn on_device_plane(cfg: EngineConfig) -> EngineConfig {
    EngineConfig {
        transport: crate::TransportKind::EmuShmem,
        ..cfg
    }
}

/// [`train`] on the device plane: `emu-shmem` (what `nvshmem` does across
/// nodes, in process), each gradient pushed from (emulated) device memory
/// on a stream, the residuals read from the engine's device buffers.
#[cfg(feature = "fabric")]
fn train_device(cfg: EngineConfig, minibatches: u64) -> Vec<Seen> {
    let cfg = on_device_plane(cfg);
    run_per_rank(WORLD, LOCAL, cfg, move |e: Engine| {
        let rank = e.rank();
        let stream =
            crate::plane::emu::EmuStream::new(std::time::Duration::from_micros(50)).unwrap();
        let s = stream.handle();
        e.register(&[BucketSpec::new("a", NUMEL, DType::F32)])
            .unwrap();
        let d = e.device().unwrap();
        let id = e.bucket_id("a").unwrap();
        let shard_len = e.bucket(id).unwrap().shard_len();
        let mut seen = Seen {
            shard_len,
            ..Seen::default()
        };
        for k in 0..minibatches {
            // Every gradient stays alive until the stream ran its pushes.
            let grads: Vec<Vec<f32>> = (0..micros(rank, k))
                .map(|m| (0..NUMEL).map(|i| grad(rank, k, m, i)).collect())
                .collect();
            for g in &grads {
                // SAFETY: `g` outlives the finish below, which waits for
                // the stream.
                unsafe {
                    d.scatter_accumulate(id, 0, g.as_ptr() as u64, NUMEL * 4, DType::F32, 0.5, s)
                        .unwrap();
                }
            }
            d.finish_minibatch(k, s).unwrap();
            let mut got = vec![0f32; shard_len];
            d.read_grad_shard(id, &mut got).unwrap();
            seen.shards.push(got);
            d.zero_grads(s).unwrap();
            stream.synchronize().unwrap();
        }
        let reg = e.core().reg.get().unwrap();
        let plane = reg.plane.as_deref().unwrap();
        if let Some(pack) = &reg.device_pack {
            for o in 0..WORLD {
                let Some(at) = pack.residual(reg.accum_off[0], &reg.buckets[0], o, 0) else {
                    continue;
                };
                let mut r = vec![0f32; shard_len];
                // SAFETY: the residual of owner `o`'s shard lies in this
                // rank's landing region (`DevicePack`).
                unsafe {
                    plane
                        .ops()
                        .read_to_host(
                            plane.local_landing() + at as u64,
                            crate::bytes_of_mut(&mut r),
                        )
                        .unwrap()
                };
                if r.iter().any(|&x| x != 0.0) {
                    seen.residuals.insert(o, r);
                }
            }
        }
        seen.sent_across = e.core().push.lock().unwrap().sent_across;
        seen
    })
}

/// The device plane's compressed node sums (packed and added by the
/// daemon's stream, as a GPU's kernels do) keep the host's promises: within
/// the format's bound after one minibatch, nothing lost over minibatches
/// with error feedback (the residuals in device memory make up what the
/// owners lack), and the bytes the host engine hands to other nodes.
#[cfg(feature = "fabric")]
#[test]
fn device_engines_compress_node_sums_as_the_host_does() {
    for (format, key) in [(Format::Int8, "czd_int8"), (Format::Fp8E4m3, "czd_fp8")] {
        let spec = Spec::new(format, 32).unwrap();
        let seen = train_device(compressing(spec, false, key), 1);
        check_within_bound(format, &seen);
        assert!(
            seen.iter().all(|s| s.residuals.is_empty()),
            "no feedback, no residual"
        );
    }
    let spec = Spec::new(Format::Int8, 32).unwrap();
    let host = train(compressing(spec, true, "czd_host"), MINIBATCHES);
    let device = train_device(compressing(spec, true, "czd_fb"), MINIBATCHES);
    let worst = feedback_gap(&device);
    eprintln!("device, feedback: largest relative gap {worst:.2e}");
    assert!(
        device.iter().all(|s| !s.residuals.is_empty()),
        "every rank aggregates for owners on the other node and keeps residuals"
    );
    assert!(
        worst < 2e-5,
        "pushed + residual differs from the exact sum by {worst}"
    );
    let without = feedback_gap(&train_device(
        compressing(spec, false, "czd_nofb"),
        MINIBATCHES,
    ));
    assert!(
        without > 1e-3,
        "no feedback, yet the sums are exact ({without})"
    );
    for (r, (h, d)) in host.iter().zip(&device).enumerate() {
        assert_eq!(h.sent_across, d.sent_across, "rank {r}: bytes across nodes");
        assert_eq!(
            h.residuals.keys().collect::<Vec<_>>(),
            d.residuals.keys().collect::<Vec<_>>(),
            "rank {r}: the owners it keeps residuals for"
        );
    }
}

/// [`gather_run`] on the device plane (`emu-shmem`: `nvshmem`'s path in
/// process): the publishes, gathers and pushes enqueued on a stream, the
/// quantised copies made and read runs dequantised by the daemon's stream.
#[cfg(feature = "fabric")]
fn gather_run_device(cfg: EngineConfig, versions: u64) -> Vec<Gathered> {
    let cfg = on_device_plane(cfg);
    run_per_rank(WORLD, LOCAL, cfg, move |e: Engine| {
        let rank = e.rank();
        let stream =
            crate::plane::emu::EmuStream::new(std::time::Duration::from_micros(50)).unwrap();
        let s = stream.handle();
        e.register(&gather_specs()).unwrap();
        let d = e.device().unwrap();
        let mut seen = Gathered::default();
        for v in 0..versions {
            // Every buffer lives until the finish below ran the stream.
            let mut shards = Vec::new();
            for (b, spec) in gather_specs().iter().enumerate() {
                let id = e.bucket_id(&spec.name).unwrap();
                let r = e.bucket(id).unwrap().shard_range(rank);
                let shard: Vec<f32> = r
                    .map(|i| if i < spec.numel { param(b, i, v) } else { 0.0 })
                    .collect();
                let bytes: Vec<u8> = match spec.dtype {
                    DType::F32 => bytes_of(&shard).to_vec(),
                    _ => shard
                        .iter()
                        .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_ne_bytes())
                        .collect(),
                };
                shards.push(bytes);
                let src = shards[b].as_ptr() as u64;
                // SAFETY: `shards` outlives the finish below.
                unsafe {
                    d.publish(id, src, shards[b].len(), spec.dtype, v, s)
                        .unwrap()
                };
            }
            let mut outs: Vec<Vec<Vec<u32>>> = vec![Vec::new(); 2];
            for out in &mut outs {
                for spec in &gather_specs() {
                    let id = e.bucket_id(&spec.name).unwrap();
                    let words = (spec.numel * spec.dtype.size_bytes()).div_ceil(4);
                    out.push(vec![u32::MAX; words]);
                    let buf = out.last_mut().unwrap();
                    let bytes = spec.numel * spec.dtype.size_bytes();
                    // SAFETY: `outs` outlives the finish below.
                    unsafe {
                        d.gather(id, v, buf.as_mut_ptr() as u64, bytes, spec.dtype, s, false)
                            .unwrap()
                    };
                }
            }
            // What the stream's next work (a forward) reads of the first
            // pass's outputs: the gathered values, dequantised before it.
            let snaps: Vec<Arc<std::sync::Mutex<Vec<u32>>>> = (outs[0].iter())
                .map(|buf| {
                    let (ptr, len) = (buf.as_ptr() as usize, buf.len());
                    let snap = Arc::new(std::sync::Mutex::new(Vec::new()));
                    let sink = Arc::clone(&snap);
                    stream
                        .enqueue(Box::new(move || {
                            // SAFETY: `outs` outlives the finish below,
                            // which waits for this.
                            let words =
                                unsafe { std::slice::from_raw_parts(ptr as *const u32, len) };
                            *sink.lock().unwrap() = words.to_vec();
                        }))
                        .unwrap();
                    snap
                })
                .collect();
            for spec in &gather_specs() {
                d.release(e.bucket_id(&spec.name).unwrap(), v, s).unwrap();
            }
            let a = e.bucket_id("a").unwrap();
            let g: Vec<f32> = (0..GATHER_NUMEL[0]).map(|i| grad(rank, v, 0, i)).collect();
            // SAFETY: `g` outlives the finish below.
            unsafe {
                d.scatter_accumulate(a, 0, g.as_ptr() as u64, g.len() * 4, DType::F32, 0.5, s)
                    .unwrap()
            };
            d.finish_minibatch(v, s).unwrap();
            d.zero_grads(s).unwrap();
            stream.synchronize().unwrap();
            let widened = |b: usize, words: &[u32]| -> Vec<u32> {
                let n = GATHER_NUMEL[b];
                match b {
                    0 => words[..n].to_vec(),
                    _ => words
                        .iter()
                        .flat_map(|w| w.to_ne_bytes())
                        .collect::<Vec<u8>>()
                        .chunks_exact(2)
                        .take(n)
                        .map(|c| {
                            let h = half::bf16::from_bits(u16::from_ne_bytes([c[0], c[1]]));
                            h.to_f32().to_bits()
                        })
                        .collect(),
                }
            };
            for (b, snap) in snaps.iter().enumerate() {
                assert!(
                    *snap.lock().unwrap() == outs[0][b],
                    "rank {rank}, v{v}, bucket {b}: the stream's next work read the output before \
                     the gather had written it"
                );
            }
            let got: [Vec<u32>; 2] = [widened(0, &outs[0][0]), widened(1, &outs[0][1])];
            for b in 0..2 {
                assert_eq!(
                    got[b],
                    widened(b, &outs[1][b]),
                    "rank {rank}: the second gather of v{v} differs"
                );
            }
            seen.full.push(got);
        }
        seen.fetched = e.node_cache_stats().map_or(0, |s| s.fetched);
        seen
    })
}

/// Compressed gathers on the device plane: every element read compressed
/// is the reference dequantisation of its version bit for bit, every other
/// one the shard exactly, through the device node cache and without it, f32
/// and bf16 buckets; an f16 bucket is refused by name.
#[cfg(feature = "fabric")]
#[test]
fn device_engines_gather_compressed_copies_as_the_host_does() {
    let spec = Spec::new(Format::Fp8E4m3, 32).unwrap();
    let across = |r: usize, o: usize| r / LOCAL != o / LOCAL;
    for (cache, key) in [(Some(1 << 20), "cgd_cache"), (Some(0), "cgd_direct")] {
        let seen = gather_run_device(gathering(Scope::CrossNode, cache, key), 3);
        let (q, x, lossy) = check_gathered(&seen, spec, across);
        let fetched: u64 = seen.iter().map(|s| s.fetched).sum();
        eprintln!("{key}: {q} compressed ({lossy} lossy), {x} exact; {fetched} pieces fetched");
        assert!(q > 0 && x > 0 && lossy * 2 > q, "{key}: {q} {x} {lossy}");
        assert_eq!(fetched > 0, cache != Some(0), "{key}");
    }
    let seen = gather_run_device(gathering(Scope::All, None, "cgd_all"), 2);
    let (q, x, _) = check_gathered(&seen, spec, |r, o| r != o);
    assert_eq!(q, 5 * x);
    // An f16 bucket: the device dequantises into f32 and bf16 only.
    let cfg = on_device_plane(gathering(Scope::CrossNode, None, "cgd_f16"));
    let refused = run_per_rank(WORLD, LOCAL, cfg, |e: Engine| {
        e.register(&[BucketSpec::new("h", 4096, DType::F16)])
            .unwrap_err()
            .to_string()
    });
    for msg in &refused {
        assert!(
            msg.contains("\"h\"") || msg.contains("h:") || msg.contains(" h "),
            "{msg}"
        );
        assert!(msg.contains("f16") && msg.contains("device"), "{msg}");
    }
}

/// What the owners hold after each of two minibatches in which every rank
/// pushes [`grad`] of minibatch `k` (one microbatch), except that in
/// minibatch 0 rank 3 (node 1) pushes +inf at element `bad` (in rank 0's
/// shard, so it crosses to node 0 in a compressed node sum). On the device
/// plane (`emu-shmem`) when `device`.
fn run_with_an_inf(cfg: EngineConfig, bad: usize, device: bool) -> Vec<Vec<Vec<f32>>> {
    let cfg = if device { on_device_plane(cfg) } else { cfg };
    run_per_rank(WORLD, LOCAL, cfg, move |e: Engine| {
        let rank = e.rank();
        e.register(&[BucketSpec::new("a", NUMEL, DType::F32)])
            .unwrap();
        let id = e.bucket_id("a").unwrap();
        let shard_len = e.bucket(id).unwrap().shard_len();
        let stream = device.then(|| {
            crate::plane::emu::EmuStream::new(std::time::Duration::from_micros(20)).unwrap()
        });
        let mut seen = Vec::new();
        for k in 0..2u64 {
            let mut g: Vec<f32> = (0..NUMEL).map(|i| grad(rank, k, 0, i)).collect();
            if k == 0 && rank == 3 {
                g[bad] = f32::INFINITY;
            }
            let mut got = vec![0f32; shard_len];
            match &stream {
                Some(st) => {
                    let (d, s) = (e.device().unwrap(), st.handle());
                    // SAFETY: `g` outlives the finish, which waits for the
                    // stream.
                    unsafe {
                        d.scatter_accumulate(
                            id,
                            0,
                            g.as_ptr() as u64,
                            NUMEL * 4,
                            DType::F32,
                            0.5,
                            s,
                        )
                        .unwrap()
                    };
                    d.finish_minibatch(k, s).unwrap();
                    d.read_grad_shard(id, &mut got).unwrap();
                    d.zero_grads(s).unwrap();
                    st.synchronize().unwrap();
                }
                None => {
                    let h = e.host().unwrap();
                    h.scatter_accumulate(id, bytes_of(&g), DType::F32, 0.5)
                        .unwrap();
                    h.finish_minibatch(k).unwrap();
                    h.read_grad_shard(id, &mut got).unwrap();
                    h.zero_grads().unwrap();
                }
            }
            seen.push(got);
        }
        seen
    })
}

/// An overflowed gradient (a loss scaler's skipped step) pushed compressed
/// with error feedback: its element reaches the owner non-finite, so the
/// owner's inf check finds it, and it leaves a zero residual, so the next
/// minibatch's sums are all finite and within the format's bound (a
/// non-finite residual would poison that element in every later push).
/// On the host and on the device plane.
#[test]
fn an_overflowed_push_reaches_the_owner_non_finite_and_poisons_nothing_after() {
    let spec = Spec::new(Format::Int8, 32).unwrap();
    let bad = 77;
    let mut runs = vec![(false, "cz_inf_host")];
    if cfg!(feature = "fabric") {
        runs.push((true, "cz_inf_device"));
    }
    for (device, key) in runs {
        let seen = run_with_an_inf(compressing(spec, true, key), bad, device);
        let owner = &seen[0];
        assert!(
            !owner[0][bad].is_finite(),
            "{key}: the inf arrived as {}",
            owner[0][bad]
        );
        for (o, s) in seen.iter().enumerate() {
            for (j, &x) in s[0].iter().enumerate() {
                let i = o * s[0].len() + j;
                if i != bad {
                    assert!(x.is_finite(), "{key}: minibatch 0, element {i}: {x}");
                }
            }
            for (j, &x) in s[1].iter().enumerate() {
                let i = o * s[1].len() + j;
                let want: f64 = if i < NUMEL {
                    (0..WORLD).map(|r| 0.5 * f64::from(grad(r, 1, 0, i))).sum()
                } else {
                    0.0
                };
                // This minibatch's rounding and the last one's residual:
                // within two int8 steps of the largest node sum (< 8).
                assert!(
                    (f64::from(x) - want).abs() <= 2.0 * 8.0 / 127.0,
                    "{key}: minibatch 1, element {i}: {x}, exact {want}"
                );
            }
        }
    }
}

/// A device engine keeps error feedback's residuals only for the owners it
/// pushes compressed chunks to: with node sums the ranks on other nodes it
/// aggregates for (1 of 6 here), with direct pushes every rank on another
/// node (3), under scope "all" every other rank (5); each a shard's f32s.
#[test]
fn device_residuals_cover_only_the_owners_pushed_compressed() {
    let spec = Spec::new(Format::Int8, 32).unwrap();
    let specs = [BucketSpec::new("a", NUMEL, DType::F32)];
    let topo = Topology::new(0, WORLD, LOCAL).unwrap();
    let shard = crate::layout::BucketLayout::blocked(specs[0].clone(), WORLD, 1)
        .unwrap()
        .shard_len();
    let landing = |cross_node, scope, feedback| {
        let mut cfg = on_device_plane(compressing(spec, feedback, "cz_sizes"));
        cfg.cross_node = cross_node;
        if let Some(c) = cfg.compress.as_mut() {
            c.scope = scope;
        }
        Engine::data_sizes(&specs, &topo, &cfg).unwrap().landing
    };
    for (cross_node, scope, owners) in [
        (crate::CrossNode::Node, Scope::CrossNode, 1),
        (crate::CrossNode::Direct, Scope::CrossNode, WORLD - LOCAL),
        (crate::CrossNode::Direct, Scope::All, WORLD - 1),
    ] {
        let (with, without) = (
            landing(cross_node, scope, true),
            landing(cross_node, scope, false),
        );
        let residuals = 4 * owners * shard;
        assert!(
            with - without >= residuals && with - without < residuals + crate::layout::ALIGN_BYTES,
            "{cross_node:?}, {scope:?}: {} bytes more with feedback, {owners} residuals of {shard}",
            with - without
        );
    }
}
