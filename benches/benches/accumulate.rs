//! Accumulate throughput against a memcpy of the same bytes, in one run.
//!
//! Sizes are bytes of the pushed chunk `x` (a landing slot's payload): the
//! daemon sees 64 KiB – 4 MiB chunks; 16 and 64 MiB show the memory-bound
//! regime. GB/s counts bytes of `x` (10⁹ B/s), so a kernel at the memcpy
//! ratio 1.0 drains a landing slot as fast as it could copy it out.
//!
//! `copy_bytes` is the transport's bulk copy: a plain memcpy below
//! `cpu::STREAM_COPY_MIN` (so 1.0 there), streaming stores from it on.
//!
//! `int8 push` / `fp8 push` are a compressed push's packing: error
//! feedback's quantisation of `x` (f32) with blocks of 32 (add the
//! residual, quantise, keep what was lost); `int8 deq+=` the owner's add of
//! such a chunk into f32, `fp8 deq` a compressed gather's dequantisation
//! into f32 (GB/s of the f32 side in all four).
//!
//! After criterion's report, `cargo bench` prints a table with the ratio of
//! each kernel to memcpy, measured here in the same process.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use half::{bf16, f16};
use odc_kernels::cpu;
use odc_kernels::cpu::quant::{self, ErrorFeedback, Format, Spec};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const SIZES: [(usize, &str); 4] = [
    (64 * KIB, "64KiB"),
    (MIB, "1MiB"),
    (16 * MIB, "16MiB"),
    (64 * MIB, "64MiB"),
];

/// One benchmarked operation, owning its buffers.
enum Op {
    Memcpy {
        src: Vec<u8>,
        dst: Vec<u8>,
    },
    CopyBytes {
        src: Vec<u8>,
        dst: Vec<u8>,
    },
    F32F32 {
        acc: Vec<f32>,
        x: Vec<f32>,
    },
    F32Bf16 {
        acc: Vec<f32>,
        x: Vec<bf16>,
    },
    F32F16 {
        acc: Vec<f32>,
        x: Vec<f16>,
    },
    Bf16Bf16 {
        acc: Vec<bf16>,
        x: Vec<bf16>,
    },
    /// Deterministic mode: the exact accumulator (and its f32 spill).
    Exact {
        fixed: Vec<i128>,
        spill: Vec<f32>,
        x: Vec<u8>,
    },
    /// An exact add, then the read-out of the sum (finish's drain).
    ExactDrain {
        fixed: Vec<i128>,
        out: Vec<f32>,
        x: Vec<u8>,
    },
    /// Error feedback's push of `x` into a chunk (scales, then codes).
    Push {
        feedback: ErrorFeedback,
        x: Vec<f32>,
        chunk: Vec<u32>,
    },
    /// A chunk added into f32 (`factor` 1.0 and -1.0 in turn: the
    /// accumulator stays bounded), or dequantised into it.
    Dequantise {
        spec: Spec,
        chunk: Vec<u32>,
        out: Vec<f32>,
        add: bool,
        factor: f32,
    },
}

fn spec(format: Format) -> Spec {
    Spec::new(format, 32).expect("blocks of 32")
}

/// `x` quantised into a chunk (u32s: 4-aligned for its scales).
fn chunk_of(spec: Spec, x: &[f32]) -> Vec<u32> {
    let mut chunk = vec![0u32; spec.chunk_bytes(x.len()).div_ceil(4)];
    let bytes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut chunk)[..spec.chunk_bytes(x.len())];
    quant::quantise_chunk(spec, x, bytes).expect("a chunk of the right size");
    chunk
}

const NAMES: [&str; 12] = [
    "memcpy",
    "copy_bytes",
    "f32+=f32",
    "f32+=bf16",
    "f32+=f16",
    "bf16+=bf16",
    "exact+=f32",
    "exact+drain",
    "int8 push",
    "fp8 push",
    "int8 deq+=",
    "fp8 deq",
];

/// Small integers: no subnormals (which would trap to microcode) and no
/// overflow however many times a bench repeats.
fn values<T>(n: usize, f: impl Fn(f32) -> T) -> Vec<T> {
    (0..n).map(|i| f((i % 61) as f32 - 30.0)).collect()
}

/// Gradient-like values: magnitudes from 2^-24 to 2^-1, both signs (what
/// the exact accumulator converts; small integers would take its easy path).
fn grads(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let m = 1.0 + (i.wrapping_mul(2_654_435_761) % 8_388_608) as f32 / 8_388_608.0;
            let e = (i % 24) as i32 - 24;
            let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
            sign * m * (e as f32).exp2()
        })
        .collect()
}

impl Op {
    fn new(name: &str, x_bytes: usize) -> Op {
        match name {
            "memcpy" => Op::Memcpy {
                src: vec![7u8; x_bytes],
                dst: vec![1u8; x_bytes],
            },
            "copy_bytes" => Op::CopyBytes {
                src: vec![7u8; x_bytes],
                dst: vec![1u8; x_bytes],
            },
            "f32+=f32" => Op::F32F32 {
                acc: values(x_bytes / 4, |v| v),
                x: values(x_bytes / 4, |v| v),
            },
            "f32+=bf16" => Op::F32Bf16 {
                acc: values(x_bytes / 2, |v| v),
                x: values(x_bytes / 2, bf16::from_f32),
            },
            "f32+=f16" => Op::F32F16 {
                acc: values(x_bytes / 2, |v| v),
                x: values(x_bytes / 2, f16::from_f32),
            },
            "exact+=f32" => Op::Exact {
                fixed: vec![0; x_bytes / 4],
                spill: vec![0.0; x_bytes / 4],
                x: bytemuck::cast_slice(&grads(x_bytes / 4)).to_vec(),
            },
            "exact+drain" => Op::ExactDrain {
                fixed: vec![0; x_bytes / 4],
                out: vec![0.0; x_bytes / 4],
                x: bytemuck::cast_slice(&grads(x_bytes / 4)).to_vec(),
            },
            "int8 push" | "fp8 push" => {
                let spec = spec(if name == "int8 push" {
                    Format::Int8
                } else {
                    Format::Fp8E4m3
                });
                let x = grads(x_bytes / 4);
                let mut feedback = ErrorFeedback::new(spec);
                feedback.register(0, x.len()).expect("a new bucket");
                Op::Push {
                    feedback,
                    chunk: chunk_of(spec, &x),
                    x,
                }
            }
            "int8 deq+=" | "fp8 deq" => {
                let add = name == "int8 deq+=";
                let spec = spec(if add { Format::Int8 } else { Format::Fp8E4m3 });
                let x = grads(x_bytes / 4);
                Op::Dequantise {
                    spec,
                    chunk: chunk_of(spec, &x),
                    out: vec![0.0; x.len()],
                    add,
                    factor: 1.0,
                }
            }
            _ => Op::Bf16Bf16 {
                acc: values(x_bytes / 2, bf16::from_f32),
                x: values(x_bytes / 2, bf16::from_f32),
            },
        }
    }

    fn run(&mut self) {
        let ok = match self {
            Op::Memcpy { src, dst } => {
                dst.copy_from_slice(src);
                Ok(())
            }
            Op::CopyBytes { src, dst } => cpu::copy_bytes(dst, src),
            // A scale of 1.0 keeps accumulators finite across repetitions.
            Op::F32F32 { acc, x } => cpu::accumulate_f32(acc, x, 1.0),
            Op::F32Bf16 { acc, x } => cpu::accumulate_f32(acc, x, 1.0),
            Op::F32F16 { acc, x } => cpu::accumulate_f32(acc, x, 1.0),
            Op::Bf16Bf16 { acc, x } => cpu::accumulate_same(acc, x, 1.0),
            Op::Exact { fixed, spill, x } => {
                cpu::exact::accumulate_exact(fixed, spill, x, odc_kernels::DType::F32, 0.25)
            }
            Op::ExactDrain { fixed, out, x } => {
                cpu::exact::accumulate_exact(fixed, out, x, odc_kernels::DType::F32, 0.25)
                    .and_then(|()| cpu::exact::read_exact(fixed, out))
            }
            Op::Push { feedback, x, chunk } => {
                let bytes = feedback.spec().chunk_bytes(x.len());
                let chunk = &mut bytemuck::cast_slice_mut::<u32, u8>(chunk)[..bytes];
                feedback.push_chunk(0, 0, x, chunk)
            }
            Op::Dequantise {
                spec,
                chunk,
                out,
                add,
                factor,
            } => {
                let n = out.len();
                let chunk = &bytemuck::cast_slice::<u32, u8>(chunk)[..spec.chunk_bytes(n)];
                if *add {
                    *factor = -*factor;
                    quant::dequantise_accumulate_chunk(*spec, chunk, out, *factor)
                } else {
                    let dst = bytemuck::cast_slice_mut::<f32, u8>(out);
                    quant::dequantise_chunk_into(*spec, n, chunk, dst, odc_kernels::DType::F32)
                }
            }
        };
        black_box(ok.is_ok());
        black_box(self);
    }

    /// Bytes of memory traffic per call: reads and writes of both buffers.
    fn traffic(&self, x_bytes: usize) -> usize {
        match self {
            Op::Memcpy { .. } | Op::CopyBytes { .. } => 2 * x_bytes,
            Op::F32F32 { .. } | Op::Bf16Bf16 { .. } => 3 * x_bytes,
            Op::F32Bf16 { .. } | Op::F32F16 { .. } => 5 * x_bytes,
            // x, and the i128 read and written.
            Op::Exact { .. } => 9 * x_bytes,
            // Then the i128 read and zeroed, the f32 read and written.
            Op::ExactDrain { .. } => 19 * x_bytes,
            // x, the residual read and written, codes and scales (36/128).
            Op::Push { .. } => x_bytes * 3 + x_bytes * 9 / 32,
            // Codes and scales; the f32 read and written, or written.
            Op::Dequantise { add: true, .. } => x_bytes * 9 / 32 + 2 * x_bytes,
            Op::Dequantise { add: false, .. } => x_bytes * 9 / 32 + x_bytes,
        }
    }
}

fn criterion_benches(c: &mut Criterion) {
    for (x_bytes, label) in SIZES {
        let mut group = c.benchmark_group(format!("accumulate/{label}"));
        group.throughput(Throughput::Bytes(x_bytes as u64));
        for name in NAMES {
            let mut op = Op::new(name, x_bytes);
            group.bench_function(name, |b| b.iter(|| op.run()));
        }
        group.finish();
    }
}

/// Best seconds per call of each op, timing the ops round-robin for about
/// `budget` so that they all see the same machine: on a shared host the
/// ratio to memcpy stays meaningful even when absolute numbers move.
fn best_secs(ops: &mut [Op], budget: Duration) -> Vec<f64> {
    let mut best = vec![f64::INFINITY; ops.len()];
    ops.iter_mut().for_each(Op::run);
    let start = Instant::now();
    let mut rounds = 0;
    while rounds < 5 || (start.elapsed() < budget && rounds < 10_000) {
        for (op, best) in ops.iter_mut().zip(&mut best) {
            let t = Instant::now();
            op.run();
            *best = best.min(t.elapsed().as_secs_f64());
        }
        rounds += 1;
    }
    best
}

fn ratio_table() {
    println!(
        "\nkernel throughput vs memcpy (GB/s of x, 10^9 B/s, best of interleaved runs; isa = {})",
        cpu::isa()
    );
    println!(
        "{:>6} {:>11} {:>9} {:>8} {:>12}",
        "size", "op", "GB/s", "ratio", "traffic GB/s"
    );
    for (x_bytes, label) in SIZES {
        let mut ops: Vec<Op> = NAMES.iter().map(|name| Op::new(name, x_bytes)).collect();
        let secs = best_secs(&mut ops, Duration::from_millis(1500));
        let memcpy_gbs = x_bytes as f64 / secs[0] / 1e9;
        for ((name, op), secs) in NAMES.iter().zip(&ops).zip(secs) {
            let gbs = x_bytes as f64 / secs / 1e9;
            let traffic = op.traffic(x_bytes) as f64 / secs / 1e9;
            println!(
                "{label:>6} {name:>11} {gbs:>9.2} {:>8.2} {traffic:>12.2}",
                gbs / memcpy_gbs
            );
        }
    }
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(10)
        .configure_from_args();
    criterion_benches(&mut c);
    c.final_summary();
    // Only under `cargo bench`, not when `cargo test` smoke-runs benches.
    // (`cargo bench -p odc-kernels -- none` skips criterion, keeps this.)
    if std::env::args().any(|a| a == "--bench") {
        ratio_table();
    }
}
