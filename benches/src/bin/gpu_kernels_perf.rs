//! `gpu_kernels_perf`: ODC's CUDA accumulate kernels against the memory-bound
//! limit measured in the same run, on one GPU.
//!
//! For each size, first a device-to-device copy of the accumulator's bytes
//! (`cuMemcpyDtoD` on the stream): its bandwidth, counting the bytes read and
//! written, is the limit. Then `acc += scale * x` for f32 += f32 and
//! f32 += bf16: the kernel reads `acc` and `x` and writes `acc`, so at the
//! copy's bandwidth it would take `(2 * |acc| + |x|) / copy_bw`; the figure
//! is that time over the kernel's (1.0: as fast as a copy moves the same
//! bytes). Times are CUDA events around `-n` back-to-back launches after
//! `-w` warm-up ones; the median of five such batches is reported.
//!
//! Without a GPU it prints what is missing and exits 3 (`ODC_REQUIRE_GPU` is
//! not consulted: a benchmark that cannot run has no figure to give).

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use odc_kernels::cuda::{CudaKernels, CudaSlice, CudaStream};
use odc_kernels::{DType, Error};

const EXAMPLES: &str = "\
Examples:
  gpu_kernels_perf
      16 MiB to 256 MiB accumulators on device 0
  gpu_kernels_perf -b 1M -e 1G -f 2 --json kernels.json
      1 MiB to 1 GiB by 2x, the rows also as JSON

Per size: a device-to-device copy of the accumulator's bytes (its bandwidth,
read + written, is the limit), then acc += scale * x for f32 += f32 and
f32 += bf16 against that limit (1.0: as fast as the copy). Exits 3 without a
GPU.";

#[derive(Parser, Debug)]
#[command(about = "ODC's CUDA accumulate kernels against a device-to-device copy (one GPU)")]
#[command(after_help = EXAMPLES)]
struct Args {
    /// Smallest accumulator size in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "16M", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest accumulator size in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = parse_size)]
    max_bytes: usize,
    /// Size factor between rows.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    step: usize,
    /// Timed launches per batch.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warm-up launches.
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Device ordinal.
    #[arg(short = 'd', long = "device", default_value_t = 0)]
    device: usize,
    /// Write the rows as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|e| format!("{s:?}: {e}"))
}

/// Milliseconds per operation: the median of five batches of `iters`, each
/// timed by CUDA events around back-to-back launches.
fn time_ms(
    stream: &Arc<CudaStream>,
    iters: usize,
    warmup: usize,
    mut op: impl FnMut() -> Result<(), String>,
) -> Result<f64, String> {
    for _ in 0..warmup {
        op()?;
    }
    let timing = Some(odc_kernels::cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut batches = Vec::new();
    for _ in 0..5 {
        let start = stream.record_event(timing).map_err(|e| e.to_string())?;
        for _ in 0..iters {
            op()?;
        }
        let end = stream.record_event(timing).map_err(|e| e.to_string())?;
        let ms = start.elapsed_ms(&end).map_err(|e| e.to_string())?;
        batches.push(f64::from(ms) / iters as f64);
    }
    batches.sort_by(f64::total_cmp);
    Ok(batches[batches.len() / 2])
}

struct Row {
    bytes: usize,
    copy_ms: f64,
    kernels: Vec<(&'static str, f64, f64)>, // (name, ms, fraction of the copy-bound limit)
}

fn run(args: &Args) -> Result<Vec<Row>, String> {
    let k = CudaKernels::new(args.device).map_err(|e| e.to_string())?;
    let stream = k.context().default_stream();
    eprintln!(
        "# {} ({}), {} multiprocessors, driver CUDA {}, NVRTC {:?} from {:?}, image {:?}",
        k.device().name,
        k.device().arch,
        k.device().multiprocessors,
        k.device().driver_version,
        k.device().nvrtc.version,
        k.device().nvrtc.path,
        k.image()
    );
    let mut rows = Vec::new();
    let mut bytes = args.min_bytes.max(4);
    while bytes <= args.max_bytes {
        let n = bytes / 4;
        let alloc = |len: usize| -> Result<CudaSlice<u8>, String> {
            stream.alloc_zeros::<u8>(len).map_err(|e| e.to_string())
        };
        let src = alloc(n * 4)?;
        let mut dst = alloc(n * 4)?;
        let copy_ms = time_ms(&stream, args.iters, args.warmup, || {
            stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| e.to_string())
        })?;
        // The copy reads and writes |acc| bytes: its bandwidth counts both.
        let copy_bw = 2.0 * (n * 4) as f64 / copy_ms;
        let mut acc = alloc(n * 4)?;
        let mut kernels = Vec::new();
        for (name, x_dtype) in [("f32+=f32", DType::F32), ("f32+=bf16", DType::BF16)] {
            let x = alloc(n * x_dtype.size_bytes())?;
            let ms = time_ms(&stream, args.iters, args.warmup, || {
                k.accumulate(&stream, &mut acc, DType::F32, &x, x_dtype, 0.5)
                    .map_err(|e| e.to_string())
            })?;
            let moved = (2 * n * 4 + n * x_dtype.size_bytes()) as f64;
            kernels.push((name, ms, (moved / copy_bw) / ms));
        }
        rows.push(Row {
            bytes,
            copy_ms,
            kernels,
        });
        bytes = bytes.saturating_mul(args.step.max(2));
    }
    Ok(rows)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rows = match run(&args) {
        Ok(rows) => rows,
        Err(e) => {
            let missing = matches!(CudaKernels::new(args.device), Err(Error::GpuUnavailable(_)));
            eprintln!("gpu_kernels_perf: {e}");
            return ExitCode::from(if missing { 3 } else { 1 });
        }
    };
    println!(
        "{:>12} {:>10} {:>12} | {:>10} {:>8} | {:>10} {:>8}",
        "size", "copy us", "copy GB/s", "f32 us", "of limit", "bf16 us", "of limit"
    );
    let mut json = Vec::new();
    for r in &rows {
        let copy_gbs = 2.0 * r.bytes as f64 / (r.copy_ms * 1e6);
        let (f, b) = (r.kernels[0], r.kernels[1]);
        println!(
            "{:>12} {:>10.1} {:>12.1} | {:>10.1} {:>8.3} | {:>10.1} {:>8.3}",
            r.bytes,
            r.copy_ms * 1e3,
            copy_gbs,
            f.1 * 1e3,
            f.2,
            b.1 * 1e3,
            b.2
        );
        json.push(serde_json::json!({
            "bytes": r.bytes,
            "copy_us": r.copy_ms * 1e3,
            "copy_gbs_read_plus_written": copy_gbs,
            "kernels": r.kernels.iter().map(|(name, ms, frac)| serde_json::json!({
                "kernel": name, "us": ms * 1e3, "fraction_of_copy_limit": frac,
            })).collect::<Vec<_>>(),
        }));
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&json).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("gpu_kernels_perf: cannot write {}: {e}", path.display());
            return ExitCode::from(1);
        }
    }
    ExitCode::SUCCESS
}
