//! Compressed cross-node sums under hybrid sharding, in process: two
//! emulated nodes of two over `shm`. Every node adds every node's
//! dequantised partial sums in node order (its own included), so the
//! replicas hold the same bits; each sum lies within the format's bound of
//! the exact one; with error feedback, what the ranks got over several
//! minibatches plus the residuals the ranks still hold equals the exact
//! sum to f32 rounding, and without it it does not; the bytes read across
//! nodes are the quantised copies' (scales included), about 0.28 of the
//! f32 sum's in int8 with blocks of 32.

use std::collections::BTreeMap;
use std::sync::Arc;

use odc_kernels::cpu::quant::{Format, Spec};
use odc_kernels::DType;

use super::{config, run_on_nodes, run_per_rank};
use crate::protocol::compress::{Compress, QuantCopy, Scope};
use crate::{bytes_of, BucketSpec, Engine, EngineConfig, Sharding};

const WORLD: usize = 4;
const LOCAL: usize = 2;
const NUMEL: usize = 2501;
const MINIBATCHES: u64 = 4;

/// Element `i` of rank `r`'s gradient in microbatch `m` of minibatch `k`:
/// not exact in int8, magnitudes from 0.01 to 7, a different mix per node.
fn grad(r: usize, k: u64, m: u64, i: usize) -> f32 {
    let x = ((i * 31 + r * 17 + k as usize * 7 + m as usize * 5) % 97) as f32;
    (x - 48.0) / 7.0 + 0.01 * (i % 11) as f32
}

fn micros(r: usize, k: u64) -> u64 {
    1 + (r as u64 + k) % 3
}

/// The exact (f64) sum of every rank's pushes of minibatch `k` into
/// bucket element `i` (factor 0.5).
fn exact(k: u64, i: usize) -> f64 {
    (0..WORLD)
        .flat_map(|r| (0..micros(r, k)).map(move |m| (r, m)))
        .map(|(r, m)| 0.5 * f64::from(grad(r, k, m, i)))
        .sum()
}

fn hybrid(sharding: Sharding, push: Option<(Spec, bool)>, key: &str) -> EngineConfig {
    EngineConfig {
        sharding,
        transport: crate::TransportKind::Shm,
        compress: push.map(|(spec, feedback)| Compress {
            push: Some(spec),
            gather: None,
            feedback,
            scope: Scope::CrossNode,
        }),
        ..config(key)
    }
}

/// What one rank saw: the bucket elements of its summed gradient (its
/// shard under hybrid, its piece under hybrid-zero) and, per minibatch,
/// their values; its residual over its whole shard (error feedback); the
/// bytes its cross-node sums read.
#[derive(Clone, Debug, Default)]
struct Seen {
    elements: Vec<usize>,
    sums: Vec<Vec<f32>>,
    /// Shard element -> bucket element, for the residual.
    shard: Vec<usize>,
    residual: Option<Vec<f32>>,
    summed: u64,
    copy: Option<QuantCopy>,
}

fn train(cfg: EngineConfig) -> Vec<Seen> {
    train_steps(cfg, 1)
}

/// [`train`] with `per_step` minibatches per optimizer step: the sums are
/// read and zeroed only after every `per_step`-th finish (the minibatches
/// between continue them, as an elastic rerun or several minibatches per
/// step do); `sums` holds one entry per step.
fn train_steps(cfg: EngineConfig, per_step: u64) -> Vec<Seen> {
    run_per_rank(WORLD, LOCAL, cfg, move |e: Engine| {
        let rank = e.rank();
        e.register(&[BucketSpec::new("g", NUMEL, DType::F32)])
            .unwrap();
        let h = e.host().unwrap();
        let id = e.bucket_id("g").unwrap();
        let lay = e.bucket(id).unwrap().clone();
        let (l, n) = (rank % LOCAL, rank / LOCAL);
        let piece = if lay.blocks() > 1 { n } else { 0 };
        let bl = lay.block_len();
        let mut seen = Seen {
            elements: (0..bl).map(|j| lay.global_of(l, piece * bl + j)).collect(),
            shard: (0..lay.shard_len()).map(|s| lay.global_of(l, s)).collect(),
            ..Seen::default()
        };
        for k in 0..MINIBATCHES {
            for m in 0..micros(rank, k) {
                let g: Vec<f32> = (0..NUMEL).map(|i| grad(rank, k, m, i)).collect();
                h.scatter_accumulate(id, bytes_of(&g), DType::F32, 0.5)
                    .unwrap();
            }
            h.finish_minibatch(k).unwrap();
            if (k + 1) % per_step != 0 {
                continue;
            }
            let mut got = vec![0f32; bl];
            h.read_grad_shard(id, &mut got).unwrap();
            seen.sums.push(got);
            h.zero_grads().unwrap();
        }
        // Every replica read this rank's last copies before it looks.
        h.wait_partials_read().unwrap();
        let reg = e.core().reg.get().unwrap();
        if let Some(q) = &reg.qsum {
            let st = q.state.lock().unwrap();
            seen.residual = st
                .feedback
                .as_ref()
                .and_then(|fb| fb.residual(0))
                .map(<[f32]>::to_vec);
            seen.copy = Some(q.copies[piece]);
        }
        seen.summed = e.bytes_across_nodes().unwrap().unwrap().summed;
        seen
    })
}

/// The largest error of any rank's sum of minibatch `k` against the exact
/// sum, relative to the largest exact sum, and whether any element missed
/// it by more than f32 reordering could (compression is on).
fn worst_error(seen: &[Seen]) -> (f64, bool) {
    let (mut worst, mut peak, mut rounded) = (0f64, 0f64, false);
    for s in seen {
        for (k, sums) in s.sums.iter().enumerate() {
            for (&i, &got) in s.elements.iter().zip(sums) {
                let want = if i < NUMEL { exact(k as u64, i) } else { 0.0 };
                let err = (f64::from(got) - want).abs();
                worst = worst.max(err);
                peak = peak.max(want.abs());
                rounded |= err > 1e-4 * want.abs().max(1.0);
            }
        }
    }
    (worst / peak, rounded)
}

/// The largest gap, relative to the sum (at least 1), between the exact sum
/// over every minibatch and what the ranks got plus the residuals every
/// rank of the replica column still holds for those elements.
fn feedback_gap(seen: &[Seen]) -> f64 {
    let mut held: BTreeMap<usize, f64> = BTreeMap::new();
    for s in seen {
        for (&i, &r) in s.shard.iter().zip(s.residual.as_deref().unwrap_or(&[])) {
            *held.entry(i).or_default() += f64::from(r);
        }
    }
    let mut worst = 0f64;
    for s in seen {
        for (j, &i) in s.elements.iter().enumerate() {
            let got: f64 = s.sums.iter().map(|g| f64::from(g[j])).sum();
            let want: f64 = if i < NUMEL {
                (0..MINIBATCHES).map(|k| exact(k, i)).sum()
            } else {
                0.0
            };
            let gap = (got + held.get(&i).copied().unwrap_or(0.0) - want).abs();
            worst = worst.max(gap / want.abs().max(1.0));
        }
    }
    worst
}

#[test]
fn compressed_hybrid_sums_are_equal_on_every_replica_and_near_the_exact_sum() {
    let int8 = Spec::new(Format::Int8, 32).unwrap();
    let plain = train(hybrid(Sharding::Hybrid, None, "czh_plain"));
    let packed = train(hybrid(Sharding::Hybrid, Some((int8, true)), "czh_int8"));
    let (err_plain, on_plain) = worst_error(&plain);
    let (err, on) = worst_error(&packed);
    eprintln!("hybrid, int8/32 sums: largest error {err:.2e} of the peak (f32: {err_plain:.2e})");
    assert!(!on_plain, "the f32 sums are off by more than rounding");
    assert!(
        on,
        "no sum was rounded: the cross-node sum was not compressed"
    );
    // One int8 rounding of each node's partial sum (plus residual): at most
    // half a step of 1/127 of its block's largest value, per node.
    assert!(err < 2.0 / 127.0, "int8 sums off by {err:.2e} of the peak");
    // The replicas (local rank l on either node) hold the same bits.
    for l in 0..LOCAL {
        let (a, b) = (&packed[l], &packed[l + LOCAL]);
        assert_eq!(a.elements, b.elements);
        for k in 0..MINIBATCHES as usize {
            let same = a.sums[k].iter().zip(&b.sums[k]);
            assert!(
                same.clone().all(|(x, y)| x.to_bits() == y.to_bits()),
                "local rank {l}, minibatch {k}: the replicas' sums differ"
            );
        }
    }
    // Bytes: each rank read the other node's quantised copy of its shard,
    // once a minibatch: scales and codes, against the f32 partial sums.
    for (r, (p, s)) in plain.iter().zip(&packed).enumerate() {
        let copy = s.copy.expect("a compressed engine keeps quantised copies");
        assert_eq!(s.summed, MINIBATCHES * copy.len() as u64, "rank {r}");
        assert_eq!(
            p.summed,
            MINIBATCHES * 4 * p.elements.len() as u64,
            "rank {r}"
        );
        let ratio = s.summed as f64 / p.summed as f64;
        assert!((0.27..0.30).contains(&ratio), "rank {r}: {ratio}");
    }
}

#[test]
fn error_feedback_keeps_the_compressed_hybrid_sums_exact_over_minibatches() {
    let int8 = Spec::new(Format::Int8, 32).unwrap();
    for sharding in [Sharding::Hybrid, Sharding::HybridZero] {
        for feedback in [true, false] {
            let key = format!("czh_fb_{}_{feedback}", sharding.name());
            let seen = train(hybrid(sharding, Some((int8, feedback)), &key));
            let worst = feedback_gap(&seen);
            let (err, on) = worst_error(&seen);
            eprintln!(
                "{}, feedback {feedback}: gap {worst:.2e}, largest error {err:.2e}",
                sharding.name()
            );
            assert!(on, "{}: nothing compressed", sharding.name());
            if feedback {
                assert!(seen.iter().all(|s| s.residual.is_some()));
                assert!(
                    worst < 2e-5,
                    "{}: got + residual differs from the exact sum by {worst:.2e}",
                    sharding.name()
                );
            } else {
                assert!(
                    worst > 1e-3,
                    "{}: no feedback, yet exact ({worst:.2e})",
                    sharding.name()
                );
            }
        }
    }
}

/// Two minibatches per step (the second continues the first's sums, as an
/// elastic rerun does): each step's sum is quantised twice, and the second
/// quantisation must start from the residual the step began with. What the
/// ranks got per step plus the residuals held still equals the exact sum
/// to f32 rounding, and (hybrid) the replicas' sums are the same bits. (Settling the
/// residual at each quantisation, as a plain push would, carries the first
/// one's error into the second and loses the residual the step began with:
/// a gap of a quantisation step.)
#[test]
fn a_step_over_two_minibatches_quantises_its_sums_from_the_residual_it_began_with() {
    let int8 = Spec::new(Format::Int8, 32).unwrap();
    for sharding in [Sharding::Hybrid, Sharding::HybridZero] {
        let key = format!("czh_cont_{}", sharding.name());
        let seen = train_steps(hybrid(sharding, Some((int8, true)), &key), 2);
        let worst = feedback_gap(&seen);
        eprintln!("{}, 2 minibatches a step: gap {worst:.2e}", sharding.name());
        assert!(seen
            .iter()
            .all(|s| s.sums.len() == MINIBATCHES as usize / 2));
        assert!(
            worst < 2e-5,
            "{}: got + residual differs from the exact sum by {worst:.2e}",
            sharding.name()
        );
        if sharding == Sharding::HybridZero {
            continue; // each replica sums its own piece
        }
        for l in 0..LOCAL {
            let (a, b) = (&seen[l], &seen[l + LOCAL]);
            assert_eq!(a.elements, b.elements);
            for (k, (x, y)) in a.sums.iter().zip(&b.sums).enumerate() {
                assert!(
                    x.iter().zip(y).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{}, local rank {l}, step {k}: the replicas' sums differ",
                    sharding.name()
                );
            }
        }
    }
}

/// Replicas that would add their copies in different formats (one rank
/// with int8 sums, the others f32) are refused at registration, naming
/// both formats, instead of reading each other's bytes as the wrong thing.
#[test]
fn replicas_with_different_sum_formats_refuse_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let int8 = Spec::new(Format::Int8, 32).unwrap();
    let threads: Vec<_> = (0..WORLD)
        .map(|rank| {
            let store = Arc::new(crate::FileStore::new(dir.path()).unwrap());
            std::thread::spawn(move || {
                let push = (rank == 1).then_some((int8, true));
                let cfg = hybrid(Sharding::Hybrid, push, "czh_mix");
                let topo = crate::Topology::new(rank, WORLD, LOCAL).unwrap();
                let e = Engine::new(store, topo, cfg).unwrap();
                e.register(&[BucketSpec::new("g", NUMEL, DType::F32)])
                    .unwrap_err()
                    .to_string()
            })
        })
        .collect();
    for (rank, t) in threads.into_iter().enumerate() {
        let err = t.join().unwrap();
        assert!(
            err.contains("sums across nodes in") && err.contains("int8/32") && err.contains("f32"),
            "rank {rank}: {err}"
        );
    }
}

/// A value of rank `r`'s piece in version `v`, not exact in fp8.
fn param(r: usize, j: usize, v: u64) -> f32 {
    ((j * 37 + r * 11 + v as usize * 5) % 101) as f32 / 7.0 - 7.0
}

/// Hybrid-zero with fp8 gathers: at each publish a rank's replicas on the
/// other node read its piece's fp8 copy, so its node shard holds its own
/// node's pieces exactly and the other node's as the reference
/// dequantisation of their copies (into the bucket's dtype: f32, and bf16
/// for a second bucket), bit for bit, at every version; the bytes read
/// across nodes are the copies'.
#[test]
fn hybrid_zero_copies_the_other_nodes_pieces_quantised() {
    use odc_kernels::cpu::quant;
    use odc_kernels::half::bf16;
    let fp8 = Spec::new(Format::Fp8E4m3, 32).unwrap();
    let cfg = EngineConfig {
        compress: Some(Compress {
            push: None,
            gather: Some(fp8),
            feedback: true,
            scope: Scope::CrossNode,
        }),
        ..hybrid(Sharding::HybridZero, None, "czh_gz")
    };
    let versions = 3u64;
    const SMALL: usize = 77;
    run_on_nodes(WORLD, LOCAL, cfg, move |e: Engine| {
        let rank = e.rank();
        e.register(&[
            BucketSpec::new("g", NUMEL, DType::F32),
            BucketSpec::new("v", SMALL, DType::BF16),
        ])
        .unwrap();
        let h = e.host().unwrap();
        let ids = [e.bucket_id("g").unwrap(), e.bucket_id("v").unwrap()];
        let lays = ids.map(|id| e.bucket(id).unwrap().clone());
        // Piece values as the bucket's dtype holds them (bf16: rounded).
        let piece_of = |b: usize, r: usize, v: u64| -> Vec<f32> {
            let x = (0..lays[b].block_len()).map(|j| param(r, j, v));
            match b {
                0 => x.collect(),
                _ => x.map(|x| bf16::from_f32(x).to_f32()).collect(),
            }
        };
        // The engine's dequantisation into the bucket's dtype, widened.
        let reference = |b: usize, r: usize, v: u64| -> Vec<f32> {
            let (src, bl) = (piece_of(b, r, v), lays[b].block_len());
            let mut codes = vec![0u8; fp8.payload_bytes(bl)];
            let mut scales = vec![0f32; fp8.scales(bl)];
            quant::quantise(fp8, &src, &mut codes, &mut scales).unwrap();
            if b == 0 {
                let mut out = vec![0f32; bl];
                quant::dequantise(fp8, &codes, &scales, &mut out).unwrap();
                return out;
            }
            let mut out = vec![bf16::ZERO; bl];
            quant::dequantise(fp8, &codes, &scales, &mut out).unwrap();
            out.iter().map(|x| x.to_f32()).collect()
        };
        let mut rounded = [false; 2];
        for v in 0..versions {
            for (b, (&id, lay)) in ids.iter().zip(&lays).enumerate() {
                let numel = [NUMEL, SMALL][b];
                let piece = piece_of(b, rank, v);
                let full: Vec<f32> = if b == 0 {
                    h.publish(id, bytes_of(&piece), DType::F32, v).unwrap();
                    let mut full = vec![0f32; numel];
                    h.gather(id, v, crate::bytes_of_mut(&mut full), DType::F32)
                        .unwrap();
                    full
                } else {
                    let piece: Vec<bf16> = piece.iter().map(|&x| bf16::from_f32(x)).collect();
                    h.publish(id, bytes_of(&piece), DType::BF16, v).unwrap();
                    let mut full = vec![bf16::ZERO; numel];
                    h.gather(id, v, crate::bytes_of_mut(&mut full), DType::BF16)
                        .unwrap();
                    full.iter().map(|x| x.to_f32()).collect()
                };
                let bl = lay.block_len();
                let exact: Vec<Vec<f32>> = (0..WORLD).map(|r| piece_of(b, r, v)).collect();
                let copied: Vec<Vec<f32>> = (0..WORLD).map(|r| reference(b, r, v)).collect();
                for (i, &x) in full.iter().enumerate() {
                    let (owner, local) = lay.owner_of(i);
                    let (node, j) = (local / bl, local % bl);
                    let from = node * LOCAL + owner; // the rank that published it
                    let want = if node == rank / LOCAL {
                        exact[from][j]
                    } else {
                        copied[from][j]
                    };
                    assert_eq!(
                        x.to_bits(),
                        want.to_bits(),
                        "rank {rank}, bucket {b}, v{v}, element {i} (rank {from}'s piece)"
                    );
                    rounded[b] |= node != rank / LOCAL && x != exact[from][j];
                }
            }
            h.finish_minibatch(v).unwrap(); // releases version v (nothing pushed)
            h.zero_grads().unwrap();
        }
        assert_eq!(
            rounded, [true; 2],
            "rank {rank}: the other node's pieces arrived exact (not compressed)"
        );
        let copies: usize = (lays.iter())
            .map(|l| QuantCopy::new(fp8, e.core().config.chunk_bytes, l.block_len()).len())
            .sum();
        let across = e.bytes_across_nodes().unwrap().unwrap();
        assert_eq!(across.gathered, versions * copies as u64, "rank {rank}");
    });
}
