//! Helpers shared by the device and GPU test files (each includes this
//! module; not every file uses every helper).

#![allow(dead_code, clippy::unwrap_used)]

use std::fmt::Debug;

use odc_core::{BucketId, Engine, Error};

/// What a GPU test opened, or `None` to skip it when the machine has no
/// GPU: prints why, unless `ODC_REQUIRE_GPU` is set (`scripts/gpu-run.sh`),
/// which makes a missing GPU a failure. Any other error fails the test.
pub fn or_skip<T: Debug>(test: &str, opened: Result<T, Error>) -> Option<T> {
    match opened {
        Ok(t) => {
            eprintln!("{test}: {t:?}");
            Some(t)
        }
        Err(Error::GpuUnavailable(missing)) => {
            assert!(
                std::env::var_os("ODC_REQUIRE_GPU").is_none(),
                "{test}: ODC_REQUIRE_GPU is set but {missing}"
            );
            eprintln!("SKIPPED {test}: needs a GPU: {missing}");
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

/// bf16 bits of `x` (truncated; the tests use values bf16 holds exactly).
pub fn to_bf16(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16
}

/// Checks this rank's accumulators after a minibatch of the exactness
/// tests: f32 bucket `w` (`numel` elements) where rank `r` pushed
/// `(i % 7) + r` at scale 0.5, `r + 1` times; bf16 bucket `h` where every
/// rank pushed `i % 5` once.
pub fn check_grad_sums(e: &Engine, (w, numel): (BucketId, usize), h: BucketId, k: u64) {
    let (rank, world) = (e.rank(), e.world());
    let (sl, hl) = (
        e.bucket(w).unwrap().shard_len(),
        e.bucket(h).unwrap().shard_len(),
    );
    let mut g = vec![0f32; sl];
    e.device().unwrap().read_grad_shard(w, &mut g).unwrap();
    for (j, x) in g.iter().enumerate() {
        let i = rank * sl + j;
        // Rank r pushed r + 1 times with scale 0.5.
        let want: f32 = if i < numel {
            (0..world)
                .map(|r| 0.5 * (r + 1) as f32 * ((i % 7) as f32 + r as f32))
                .sum()
        } else {
            0.0
        };
        assert_eq!(*x, want, "rank {rank} k {k} grad {i}");
    }
    let mut hg = vec![0f32; hl];
    e.device().unwrap().read_grad_shard(h, &mut hg).unwrap();
    for (j, x) in hg.iter().enumerate() {
        let i = rank * hl + j;
        assert_eq!(
            *x,
            world as f32 * (i % 5) as f32,
            "rank {rank} k {k} bf16 grad {i}"
        );
    }
}

/// Runs `f(engine)` on `world` thread-ranks, `local_world` per (emulated)
/// node, each engine built from `cfg`; the emulated streams of the
/// engines' daemons sleep up to `jitter_us` before every operation (read at
/// engine creation, so the same value for every test of a binary).
pub fn run_config<F>(
    world: usize,
    local_world: usize,
    cfg: odc_core::EngineConfig,
    jitter_us: u32,
    f: F,
) where
    F: Fn(Engine) + Send + Sync + 'static,
{
    std::env::set_var("ODC_EMU_JITTER_US", jitter_us.to_string());
    let dir = tempfile::tempdir().unwrap();
    let f = std::sync::Arc::new(f);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let store = std::sync::Arc::new(odc_core::FileStore::new(dir.path()).unwrap());
            let (f, cfg) = (std::sync::Arc::clone(&f), cfg.clone());
            std::thread::spawn(move || {
                let topo = odc_core::Topology::new(rank, world, local_world).unwrap();
                f(Engine::new(store, topo, cfg).unwrap())
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}
