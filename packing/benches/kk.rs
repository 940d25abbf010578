//! Karmarkar–Karp (with refinement) over LongAlign-like lognormal weights.
//!
//! `cargo bench -p odc-packing --bench kk -- --quick`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use odc_packing::{karmarkar_karp, synthetic, CostModel};

fn weights(n: usize) -> Vec<f64> {
    let spec = format!("lognormal:n={n},median=10000,sigma=1.0,max=65536,seed=0");
    let cost = CostModel::default();
    synthetic(&spec)
        .map(|l| l.iter().map(|&s| cost.cost(s)).collect())
        .unwrap_or_default()
}

fn kk(c: &mut Criterion) {
    let mut group = c.benchmark_group("kk");
    for n in [256, 4096, 65_536] {
        let w = weights(n);
        for k in [8, 64] {
            group.bench_with_input(BenchmarkId::new(format!("unequal/k={k}"), n), &w, |b, w| {
                b.iter(|| karmarkar_karp(black_box(w), k, false))
            });
        }
    }
    let w = weights(4096);
    for k in [8, 64] {
        group.bench_with_input(
            BenchmarkId::new(format!("equal/k={k}"), 4096),
            &w,
            |b, w| b.iter(|| karmarkar_karp(black_box(w), k, true)),
        );
    }
    group.finish();
}

criterion_group!(benches, kk);
criterion_main!(benches);
