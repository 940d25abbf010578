//! Runs one rank of a named test scenario. Configured by environment:
//!
//! - `ODC_RANK`, `ODC_WORLD`, `ODC_STORE_DIR`, `ODC_SCENARIO`, `ODC_JOB_KEY`
//!   (set by the harness), `ODC_TIMEOUT_S` (read by the engine);
//! - `ODC_DTYPE` (param dtype, default f32), `ODC_GRAD_DTYPE` (default the
//!   param dtype), `ODC_NUMELS` (bucket sizes, comma separated),
//!   `ODC_MINIBATCHES`, `ODC_MICRO` (microbatches per rank, comma separated,
//!   default 1 each), `ODC_CHUNK` (landing-slot bytes), `ODC_JITTER`;
//! - `ODC_TRANSPORT` (`shm`, the default, `fabric`, `mixed` or `auto`; also
//!   `--transport <kind>` on the command line), `ODC_LOCAL_WORLD` (ranks
//!   per node, default the world: ranks `[n*G, (n+1)*G)` form node `n`);
//! - faults: `ODC_CRASH_RANK`, `ODC_CRASH_AT` (`after_register`,
//!   `before_finish`, `before_publish`), `ODC_CRASH_MINIBATCH`,
//!   `ODC_STALL=1` (the crash rank sleeps `ODC_STALL_S` instead of aborting),
//!   `ODC_BAD_RANK` (registers a different bucket list).
//!
//! Prints `ERROR kind=<variant> peer=<rank> msg=<message>` on an engine
//! error. Exit codes: 0 passed, 2 unexpected engine error, 3 failed check,
//! 10 engine error with `ODC_EXPECT_ERROR=1`.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use half::{bf16, f16};
use odc_core::{
    BucketId, BucketSpec, DType, Engine, EngineConfig, Error, FileStore, Topology, TransportKind,
};

fn env<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn env_flag(name: &str) -> bool {
    matches!(
        std::env::var(name).as_deref(),
        Ok("1") | Ok("true") | Ok("yes")
    )
}

fn env_list(name: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_default()
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// A failed check: the scenario's own assertion.
struct Check(String);

enum Failure {
    Engine(Error),
    Check(Check),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Engine(e)
    }
}

impl From<Check> for Failure {
    fn from(c: Check) -> Failure {
        Failure::Check(c)
    }
}

macro_rules! check {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(Check(format!($($fmt)*)).into());
        }
    };
}

fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}

fn decode(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

struct Ctx {
    transport: TransportKind,
    rank: usize,
    world: usize,
    local_world: usize,
    store_dir: String,
}

impl Ctx {
    fn engine(&self) -> Result<Engine, Error> {
        let store = Arc::new(FileStore::new(&self.store_dir)?);
        let mut config = EngineConfig::default();
        config.chunk_bytes = env("ODC_CHUNK", config.chunk_bytes);
        config.transport = self.transport;
        let topo = Topology::new(self.rank, self.world, self.local_world)?;
        Engine::new(store, topo, config)
    }

    fn maybe_crash(&self, at: &str, k: u64) {
        let crash_rank: usize = env("ODC_CRASH_RANK", usize::MAX);
        let crash_at: String = env("ODC_CRASH_AT", String::new());
        let crash_k: u64 = env("ODC_CRASH_MINIBATCH", 0);
        if crash_rank == self.rank && crash_at == at && crash_k == k {
            if env_flag("ODC_STALL") {
                // Alive but stuck: peers must time out naming this rank.
                println!("STALL rank={} at={at} minibatch={k}", self.rank);
                std::thread::sleep(Duration::from_secs(env("ODC_STALL_S", 4)));
                std::process::exit(0);
            }
            println!("CRASH rank={} at={at} minibatch={k}", self.rank);
            std::process::abort();
        }
    }
}

/// Parameter value of element `i` at version `k` (exact in every dtype).
fn param(i: usize, k: u64) -> f32 {
    ((i % 61) as u64 + k % 64) as f32
}

/// Gradient of element `i` pushed by `rank` in microbatch `mb`.
fn grad(i: usize, rank: usize, mb: usize) -> f32 {
    ((i + rank * 3 + mb) % 5 + 1) as f32
}

fn train(ctx: &Ctx) -> Result<(), Failure> {
    let dtype: DType = env("ODC_DTYPE", DType::F32);
    let grad_dtype: DType = env("ODC_GRAD_DTYPE", dtype);
    let numels = {
        let l = env_list("ODC_NUMELS");
        if l.is_empty() {
            vec![1001, 37]
        } else {
            l
        }
    };
    let minibatches: u64 = env("ODC_MINIBATCHES", 2);
    let micro = env_list("ODC_MICRO");
    let micro_of = |r: usize| micro.get(r).copied().unwrap_or(1);
    let jitter: bool = env_flag("ODC_JITTER");

    let engine = ctx.engine()?;
    let specs: Vec<BucketSpec> = numels
        .iter()
        .enumerate()
        .map(|(i, &n)| BucketSpec::new(format!("b{i}"), n, dtype))
        .collect();
    engine.register(&specs)?;
    ctx.maybe_crash("after_register", 0);
    let ids: Vec<BucketId> = specs
        .iter()
        .map(|s| engine.bucket_id(&s.name))
        .collect::<Result<_, _>>()?;

    let publish = |k: u64| -> Result<(), Error> {
        for &b in &ids {
            let l = engine.bucket(b)?;
            let shard: Vec<f32> = l.shard_range(ctx.rank).map(|i| param(i, k)).collect();
            engine
                .host()?
                .publish(b, &encode(&shard, dtype), dtype, k)?;
        }
        Ok(())
    };
    publish(0)?;
    for k in 0..minibatches {
        for mb in 0..micro_of(ctx.rank) {
            for &b in &ids {
                let l = engine.bucket(b)?.clone();
                // Even ranks pass numel elements, odd ranks the padded length.
                let len = if ctx.rank % 2 == 0 {
                    l.numel()
                } else {
                    l.padded_len()
                };
                let mut out = vec![0u8; len * dtype.size_bytes()];
                engine.host()?.gather(b, k, &mut out, dtype)?;
                let got = decode(&out, dtype);
                for (i, &x) in got.iter().enumerate().take(l.numel()) {
                    check!(
                        x == param(i, k),
                        "bucket {} elem {i}: gathered {x}, want {} (version {k})",
                        l.name(),
                        param(i, k)
                    );
                }
                if jitter && (ctx.rank + mb + k as usize) % 3 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let g: Vec<f32> = (0..len)
                    .map(|i| {
                        if i < l.numel() {
                            grad(i, ctx.rank, mb)
                        } else {
                            0.0
                        }
                    })
                    .collect();
                engine
                    .host()?
                    .scatter_accumulate(b, &encode(&g, grad_dtype), grad_dtype, 1.0)?;
            }
        }
        ctx.maybe_crash("before_finish", k);
        engine.host()?.finish_minibatch(k)?;
        for &b in &ids {
            let l = engine.bucket(b)?.clone();
            let mut g = vec![0f32; l.shard_len()];
            engine.host()?.read_grad_shard(b, &mut g)?;
            for (j, &x) in g.iter().enumerate() {
                let i = l.shard_range(ctx.rank).start + j;
                let want: f32 = if i < l.numel() {
                    (0..ctx.world)
                        .map(|r| (0..micro_of(r)).map(|mb| grad(i, r, mb)).sum::<f32>())
                        .sum()
                } else {
                    0.0
                };
                check!(
                    x == want,
                    "bucket {} elem {i} minibatch {k}: grad {x}, want {want}",
                    l.name()
                );
            }
        }
        engine.host()?.zero_grads()?;
        if jitter && ctx.rank == (k as usize) % ctx.world {
            std::thread::sleep(Duration::from_millis(3));
        }
        ctx.maybe_crash("before_publish", k + 1);
        publish(k + 1)?;
    }
    println!("OK rank={} minibatches={minibatches}", ctx.rank);
    Ok(())
}

/// Parameters only: every rank publishes versions 0..N back to back, gated
/// only by its readers' releases, while every rank gathers each version and
/// checks that no shard mixes two versions.
fn publish_gather(ctx: &Ctx) -> Result<(), Failure> {
    let versions: u64 = env("ODC_VERSIONS", 20);
    let numel: usize = env("ODC_NUMEL", 1 << 18);
    let jitter = env_flag("ODC_JITTER");
    let engine = ctx.engine()?;
    engine.register(&[BucketSpec::new("p", numel, DType::F32)])?;
    let b = engine.bucket_id("p")?;
    let l = engine.bucket(b)?.clone();
    let mut out = vec![0u8; numel * 4];
    for v in 0..versions {
        let shard: Vec<f32> = l
            .shard_range(ctx.rank)
            .map(|i| (v * 1000) as f32 + (i % 997) as f32)
            .collect();
        engine
            .host()?
            .publish(b, &encode(&shard, DType::F32), DType::F32, v)?;
        // A slow reader lets its owners race ahead to the next version.
        if jitter && (ctx.rank + v as usize) % 2 == 0 {
            std::thread::sleep(Duration::from_millis(15));
        }
        engine.host()?.gather(b, v, &mut out, DType::F32)?;
        for (i, x) in decode(&out, DType::F32).into_iter().enumerate() {
            let want = (v * 1000) as f32 + (i % 997) as f32;
            check!(
                x == want,
                "version {v} elem {i}: read {x}, want {want} (mixed versions)"
            );
        }
        engine.host()?.release(b, v)?;
    }
    println!("OK rank={} versions={versions}", ctx.rank);
    Ok(())
}

fn bad_input(ctx: &Ctx) -> Result<(), Failure> {
    let engine = ctx.engine()?;
    check!(
        matches!(engine.host().map(|_| ()), Err(Error::Protocol { .. })),
        "a worker handle before register"
    );
    engine.register(&[BucketSpec::new("w", 1000, DType::BF16)])?;
    let b = engine.bucket_id("w")?;
    let l = engine.bucket(b)?.clone();
    let right = vec![0u8; l.shard_bytes()];
    let cases: Vec<(&str, Result<(), Error>)> = vec![
        ("unknown bucket name", engine.bucket_id("nope").map(|_| ())),
        (
            "unknown bucket id",
            engine.host()?.publish(BucketId(7), &right, DType::BF16, 0),
        ),
        (
            "wrong shard size",
            engine
                .host()?
                .publish(b, &right[..right.len() - 2], DType::BF16, 0),
        ),
        (
            "wrong dtype",
            engine.host()?.publish(b, &right, DType::F16, 0),
        ),
        (
            "odd byte count",
            engine
                .host()?
                .scatter_accumulate(b, &[0u8; 3], DType::BF16, 1.0),
        ),
        (
            "wrong gradient size",
            engine
                .host()?
                .scatter_accumulate(b, &vec![0u8; 999 * 2], DType::BF16, 1.0),
        ),
        (
            "offset out of range",
            engine.host()?.scatter_accumulate_at(
                b,
                l.padded_len() - 1,
                &[0u8; 4],
                DType::BF16,
                1.0,
            ),
        ),
        (
            "wrong gather size",
            engine.host()?.gather(b, 0, &mut [0u8; 10], DType::BF16),
        ),
        (
            "wrong gather dtype",
            engine
                .host()?
                .gather(b, 0, &mut vec![0u8; 1000 * 4], DType::F32),
        ),
        (
            "wrong grad buffer",
            engine.host()?.read_grad_shard(b, &mut [0f32; 3]),
        ),
    ];
    for (what, r) in cases {
        match r {
            Err(Error::Layout { detail, .. }) => println!("LAYOUT {what}: {detail}"),
            other => {
                return Err(Check(format!("{what}: expected a layout error, got {other:?}")).into())
            }
        }
    }
    // The engine still works after all that.
    engine.host()?.publish(b, &right, DType::BF16, 0)?;
    check!(
        matches!(
            engine.host()?.publish(b, &right, DType::BF16, 0),
            Err(Error::Protocol { .. })
        ),
        "republishing a version"
    );
    let mut out = vec![0u8; 1000 * 2];
    engine.host()?.gather(b, 0, &mut out, DType::BF16)?;
    engine.host()?.finish_minibatch(0)?;
    println!("OK rank={}", ctx.rank);
    Ok(())
}

fn mismatch(ctx: &Ctx) -> Result<(), Failure> {
    let engine = ctx.engine()?;
    let bad: usize = env("ODC_BAD_RANK", 1);
    let second = if ctx.rank == bad {
        BucketSpec::new("y", 11, DType::BF16)
    } else {
        BucketSpec::new("y", 10, DType::BF16)
    };
    engine.register(&[
        BucketSpec::new("x", 5, DType::F32),
        second,
        BucketSpec::new("z", 5, DType::F32),
    ])?;
    Err(Check("registration succeeded despite a mismatch".into()).into())
}

fn segments(ctx: &Ctx) -> Result<(), Failure> {
    let key: String = env("ODC_JOB_KEY", String::new());
    let pid = std::process::id();
    let mine = |key: &str| -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| {
                        n.starts_with(&format!("odc-{key}-")) && n.contains(&format!("-l{pid}-"))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    {
        let engine = ctx.engine()?;
        engine.register(&[BucketSpec::new("s", 100, DType::F32)])?;
        let segs = mine(&key);
        check!(
            segs.len() == 3,
            "expected 3 segments (bell, control, params), found {segs:?}"
        );
        for s in &segs {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(format!("/dev/shm/{s}"))
                .map(|m| m.permissions().mode() & 0o777)
                .unwrap_or(0);
            check!(mode == 0o600, "segment {s} has mode {mode:o}");
        }
        println!("MODE ok {}", segs.len());
        ctx.maybe_crash("after_register", 0);
        let b = engine.bucket_id("s")?;
        engine.host()?.publish(
            b,
            &vec![0u8; engine.bucket(b)?.shard_bytes()],
            DType::F32,
            0,
        )?;
        engine
            .host()?
            .gather(b, 0, &mut vec![0u8; 400], DType::F32)?;
        engine.host()?.finish_minibatch(0)?;
    }
    let left = mine(&key);
    check!(left.is_empty(), "segments left after drop: {left:?}");
    println!("GONE ok");
    Ok(())
}

/// The transport named by `--transport <kind>` or `ODC_TRANSPORT`.
fn transport_kind() -> Result<TransportKind, String> {
    let args: Vec<String> = std::env::args().collect();
    let flag = args
        .iter()
        .position(|a| a == "--transport")
        .and_then(|i| args.get(i + 1).cloned());
    let name = flag.unwrap_or_else(|| env("ODC_TRANSPORT", String::from("shm")));
    TransportKind::parse(&name).ok_or_else(|| format!("unknown transport {name:?}"))
}

fn main() {
    let transport = match transport_kind() {
        Ok(t) => t,
        Err(msg) => {
            println!("CHECK FAILED: {msg}");
            std::process::exit(3);
        }
    };
    let world = env("ODC_WORLD", 1);
    let ctx = Ctx {
        transport,
        rank: env("ODC_RANK", 0),
        world,
        local_world: env("ODC_LOCAL_WORLD", world),
        store_dir: env("ODC_STORE_DIR", String::from("/tmp/odc-store")),
    };
    let scenario: String = env("ODC_SCENARIO", String::from("train"));
    let result = match scenario.as_str() {
        "train" => train(&ctx),
        "bad_input" => bad_input(&ctx),
        "publish_gather" => publish_gather(&ctx),
        "mismatch" => mismatch(&ctx),
        "segments" => segments(&ctx),
        other => Err(Check(format!("unknown scenario {other:?}")).into()),
    };
    let code = match result {
        Ok(()) => 0,
        Err(Failure::Engine(e)) => {
            let kind = format!("{e:?}");
            let kind = kind.split([' ', '{', '(']).next().unwrap_or("?").to_owned();
            let peer = e.blamed_peer().map_or("none".to_owned(), |p| p.to_string());
            let extra = match &e {
                Error::Registration {
                    first_differing_bucket,
                    ..
                } => format!(" bucket={first_differing_bucket}"),
                _ => String::new(),
            };
            println!("ERROR kind={kind} peer={peer}{extra} msg={e}");
            if env_flag("ODC_EXPECT_ERROR") {
                10
            } else {
                2
            }
        }
        Err(Failure::Check(Check(msg))) => {
            println!("CHECK FAILED rank={}: {msg}", ctx.rank);
            3
        }
    };
    std::process::exit(code);
}
