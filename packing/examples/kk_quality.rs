//! Partition quality and speed of plain largest differencing, refined
//! Karmarkar–Karp and greedy LPT on LongAlign-like lognormal lengths.
//!
//! `cargo run --release -p odc-packing --example kk_quality`
//!
//! Quality is `max part sum / lower bound`, the bound being
//! `max(mean part sum, largest item)`; 1.0 is optimal.

use std::time::Instant;

use odc_packing::kk::{largest_differencing, lower_bound, max_part_sum};
use odc_packing::{karmarkar_karp, lpt, synthetic, CostModel, Result};

fn main() -> Result<()> {
    let cost = CostModel::default();
    println!(
        "{:>6} {:>4} {:>6} {:>5} {:>9} {:>9} {:>9} {:>10} {:>10}",
        "n", "k", "n/k", "equal", "plain", "refined", "lpt", "plain ms", "refined ms"
    );
    for (n, k, equal) in [
        (64, 8, false),
        (128, 16, false),
        (256, 64, false),
        (512, 64, false),
        (512, 64, true),
        (256, 32, true),
        (4096, 64, false),
        (65_536, 64, false),
        (65_536, 64, true),
    ] {
        let trials = if n >= 65_536 { 3 } else { 20 };
        let (mut plain_q, mut refined_q, mut lpt_q) = (0.0_f64, 0.0_f64, 0.0_f64);
        let (mut plain_t, mut refined_t) = (0.0, 0.0);
        for seed in 0..trials {
            let spec = format!("lognormal:n={n},median=10000,sigma=1.0,max=65536,seed={seed}");
            let w: Vec<f64> = synthetic(&spec)?.iter().map(|&s| cost.cost(s)).collect();
            let lb = lower_bound(&w, k);
            let t = Instant::now();
            let plain = largest_differencing(&w, k, equal)?;
            plain_t += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let refined = karmarkar_karp(&w, k, equal)?;
            refined_t += t.elapsed().as_secs_f64();
            plain_q = plain_q.max(max_part_sum(&w, &plain) / lb);
            refined_q = refined_q.max(max_part_sum(&w, &refined) / lb);
            lpt_q = lpt_q.max(max_part_sum(&w, &lpt(&w, k)?) / lb);
        }
        println!(
            "{n:>6} {k:>4} {:>6} {equal:>5} {plain_q:>9.4} {refined_q:>9.4} {lpt_q:>9.4} {:>10.2} {:>10.2}",
            n / k,
            1e3 * plain_t / trials as f64,
            1e3 * refined_t / trials as f64,
        );
    }
    println!("(worst max/lower-bound over seeds; lpt ignores equal sizes)");
    Ok(())
}
