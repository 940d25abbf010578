//! Rough shm timings: two ranks as threads of one process (the data path is
//! the same as between processes). Prints gather and scatter-accumulate
//! algbw/busbw for a 64 MiB f32 bucket and the latency of a 64 KiB gather.
//!
//! `cargo run -p odc-core --release --example shm_perf [world] [MiB] [chunk KiB]`

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use odc_core::{
    bytes_of, bytes_of_mut, BucketSpec, DType, Engine, EngineConfig, FileStore, Topology,
};

fn main() -> odc_core::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let world = args.first().copied().unwrap_or(2);
    let mib = args.get(1).copied().unwrap_or(64);
    let chunk_kib = args.get(2).copied().unwrap_or(1024);
    let dir = tempfile::tempdir()?;
    let barrier = Arc::new(Barrier::new(world));
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let store = FileStore::new(dir.path());
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || -> odc_core::Result<()> {
                let config = EngineConfig {
                    timeout: Duration::from_secs(60),
                    chunk_bytes: chunk_kib << 10,
                    job_key: format!("perf{}", std::process::id()),
                    ..EngineConfig::default()
                };
                let engine = Engine::new(Arc::new(store?), Topology::single_node(rank, world)?, config)?;
                let numel = mib * (1 << 20) / 4;
                let small = (64 << 10) / 4;
                engine.register(&[BucketSpec::new("big", numel, DType::F32), BucketSpec::new("small", small, DType::F32)])?;
                let (big, sm) = (engine.bucket_id("big")?, engine.bucket_id("small")?);
                for b in [big, sm] {
                    let shard = vec![1.0f32; engine.bucket(b)?.shard_len()];
                    engine.host()?.publish(b, bytes_of(&shard), DType::F32, 0)?;
                }
                let mut out = vec![0f32; numel];
                let mut out_small = vec![0f32; small];
                let busbw = |secs: f64| {
                    let alg = (numel * 4) as f64 / secs / 1e9;
                    (alg, alg * (world - 1) as f64 / world as f64)
                };
                // Gather.
                engine.host()?.gather(big, 0, bytes_of_mut(&mut out), DType::F32)?;
                barrier.wait();
                let iters = 20;
                let t = Instant::now();
                for _ in 0..iters {
                    engine.host()?.gather(big, 0, bytes_of_mut(&mut out), DType::F32)?;
                }
                let g = t.elapsed().as_secs_f64() / iters as f64;
                // 64 KiB gather latency.
                barrier.wait();
                let n = 2000;
                let t = Instant::now();
                for _ in 0..n {
                    engine.host()?.gather(sm, 0, bytes_of_mut(&mut out_small), DType::F32)?;
                }
                let lat = t.elapsed().as_secs_f64() / n as f64;
                // Scatter-accumulate (+ finish, which waits for the last acks).
                let grads = vec![1.0f32; numel];
                engine.host()?.scatter_accumulate(big, bytes_of(&grads), DType::F32, 1.0)?;
                engine.host()?.finish_minibatch(0)?;
                barrier.wait();
                let t = Instant::now();
                for k in 1..=iters as u64 {
                    engine.host()?.scatter_accumulate(big, bytes_of(&grads), DType::F32, 1.0)?;
                    engine.host()?.finish_minibatch(k)?;
                }
                let s = t.elapsed().as_secs_f64() / iters as f64;
                barrier.wait();
                let (ga, gb) = busbw(g);
                let (sa, sb) = busbw(s);
                println!(
                    "rank {rank}: gather {mib} MiB {:.2} ms algbw {ga:.2} busbw {gb:.2} GB/s | \
                     scatter-accumulate {:.2} ms algbw {sa:.2} busbw {sb:.2} GB/s | 64 KiB gather {:.2} us",
                    g * 1e3,
                    s * 1e3,
                    lat * 1e6
                );
                Ok(())
            })
        })
        .collect();
    for t in threads {
        match t.join() {
            Ok(r) => r?,
            Err(_) => eprintln!("a rank panicked"),
        }
    }
    Ok(())
}
