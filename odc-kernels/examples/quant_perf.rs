//! Throughput of the block-scaled format kernels on this host, against a
//! plain copy of the same f32 bytes in the same run.
//!
//! ```text
//! cargo run --release -p odc-kernels --example quant_perf -- [MiB] [reps]
//! ODC_KERNELS_ISA=scalar cargo run --release -p odc-kernels --example quant_perf
//! ```
//!
//! Each row: the median time of `reps` runs over a buffer of `MiB` MiB of
//! f32 (default 32, 15 reps), as GB/s of f32 elements processed (10^9
//! bytes of f32 input per second) and as the time relative to the copy.

use std::time::{Duration, Instant};

use odc_kernels::cpu::{self, quant};
use odc_kernels::half::bf16;

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn time(reps: usize, mut f: impl FnMut()) -> Duration {
    f(); // warm: page faults and caches
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .collect(),
    )
}

fn main() -> odc_kernels::Result<()> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(32);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(15);
    let n = mib << 18; // f32 elements in `mib` MiB
    let bytes = (n * 4) as f64;
    let src: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618_034).sin() * 1e-3)
        .collect();
    let src_bytes: &[u8] = bytemuck::cast_slice(&src);
    let mut copy_dst = vec![0u8; n * 4];
    println!(
        "{mib} MiB of f32 ({n} elements), isa {}, median of {reps}",
        cpu::isa()
    );
    println!(
        "{:<44} {:>10} {:>9} {:>8}",
        "kernel", "time_ms", "GB/s", "x_copy"
    );
    let copy = time(reps, || {
        cpu::copy_bytes(&mut copy_dst, src_bytes).unwrap_or_else(|e| panic!("{e}"))
    });
    let row = |name: &str, t: Duration| {
        println!(
            "{name:<44} {:>10.3} {:>9.2} {:>8.2}",
            t.as_secs_f64() * 1e3,
            bytes / t.as_secs_f64() / 1e9,
            t.as_secs_f64() / copy.as_secs_f64()
        );
    };
    row("copy f32 bytes (cpu::copy_bytes)", copy);
    for (name, block) in [
        ("fp8", 32usize),
        ("fp8", 128),
        ("int8", 32),
        ("int8", 128),
        ("bf16", 32),
    ] {
        let spec = quant::Spec::new(name.parse()?, block)?;
        let mut payload16 = vec![0u16; n];
        let mut payload8 = vec![0u8; n];
        let mut scales = vec![0f32; spec.scales(n)];
        let payload: &mut [u8] = if spec.format().scaled() {
            &mut payload8
        } else {
            bytemuck::cast_slice_mut(&mut payload16)
        };
        let t = time(reps, || {
            quant::quantise(spec, &src, payload, &mut scales).unwrap_or_else(|e| panic!("{e}"))
        });
        row(&format!("quantise {spec}"), t);
        let mut acc = vec![0f32; n];
        let t = time(reps, || {
            quant::dequantise_accumulate(spec, payload, &scales, &mut acc, 0.5)
                .unwrap_or_else(|e| panic!("{e}"))
        });
        row(&format!("dequantise_accumulate {spec} into f32"), t);
        let t = time(reps, || {
            quant::dequantise(spec, payload, &scales, &mut acc).unwrap_or_else(|e| panic!("{e}"))
        });
        row(&format!("dequantise {spec} to f32"), t);
        let mut out16 = vec![bf16::ZERO; n];
        let t = time(reps, || {
            quant::dequantise(spec, payload, &scales, &mut out16).unwrap_or_else(|e| panic!("{e}"))
        });
        row(&format!("dequantise {spec} to bf16"), t);
    }
    let mut acc = vec![0f32; n];
    let t = time(reps, || {
        cpu::accumulate_f32(&mut acc, &src, 0.5).unwrap_or_else(|e| panic!("{e}"))
    });
    row("accumulate f32 into f32 (uncompressed)", t);
    Ok(())
}
