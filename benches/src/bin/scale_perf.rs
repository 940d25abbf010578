//! `scale_perf`: how ODC's costs grow with the number of ranks D, on one
//! host, with engine-level ranks (this binary, no Python) as processes.
//!
//! ```text
//! scale_perf --ranks 2,4,8,16,32,64,128,256 --node-ranks 8 --sharding full [-J out.json]
//! ```
//! For each D the launcher starts D copies of itself, ranks of one job on a
//! [`FileStore`]; nodes of `--node-ranks` ranks are emulated (the topology
//! says so; `shm` carries every byte, as it does whatever the topology says).
//! Each rank measures, in this order:
//!
//! - **registration**: `Engine::new` + `register` of one bucket, timed from a
//!   barrier every rank passed, and the store calls it made (a counting
//!   wrapper around the store: sets, gets, waits, adds and the bytes moved);
//! - **memory** after registration: resident set (anonymous and shared),
//!   virtual size, mappings, open descriptors, and (rank 0, for the whole
//!   job) the bytes `/dev/shm` gained;
//! - **minibatches** of a fixed per-rank workload: publish this rank's
//!   shard, gather the whole bucket, scatter-accumulate a full-bucket
//!   gradient, `finish_minibatch`; wall time and this process's CPU time
//!   per minibatch, and every gathered element and final gradient sum
//!   checked exactly;
//! - **idle**: the process's CPU time (every thread: the daemon is the only
//!   one awake) over `--idle-s` seconds with nothing to do;
//! - **stealing**: rank 0 gets a list of `--steal-items` microbatches per
//!   rank of its shard group (every rank under full sharding, its node
//!   under hybrid), the others none; rank 0 runs its own from the front
//!   (`--steal-work-ms` each) while every other rank of the group steals
//!   from the back until the list is drained: every microbatch must be
//!   claimed exactly once; the phase's time and each steal's round trip;
//! - **a killed rank**: the last rank kills itself (`SIGKILL`) while every
//!   other rank waits for it in `finish_minibatch`; each survivor records
//!   how long after the kill its error came and whether it names the rank.
//!
//! The launcher prints one row per D and, at the end, each figure's growth
//! exponent: the slope of log(figure) against log(D), least squares over
//! the D ≥ 8 points (all points when fewer than three are). On a host with
//! fewer cores than ranks, wall times grow with D / cores however good the
//! engine is; CPU time per rank per minibatch is the figure that shows the
//! engine's own growth.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use odc_benches::{parse_sharding, parse_size, parse_transport, transport_name};
use odc_core::{BucketId, BucketSpec, Engine, EngineConfig, FileStore, Sharding, Store};
use odc_kernels::DType;
use serde::{Deserialize, Serialize};

const EXAMPLES: &str = "\
Examples:
  scale_perf --ranks 2,4,8,16 --no-kill
      shm, full sharding, 2 to 16 ranks, without the killed-rank measurement
  scale_perf --ranks 8,16,32,64 --sharding hybrid-zero -J hz.json
      nodes of 8 (--node-ranks), hybrid-zero sharding, the figures as JSON
  scale_perf --ranks 8,16 --transport mixed
      shm within a node, libfabric across (built with --features fabric)

Each world size D runs D copies of this binary as ranks on one host (nodes of
--node-ranks emulated) and prints one row: registration, memory per rank,
time and CPU per minibatch, the daemon's idle CPU, stealing, and how fast a
killed rank is named.";

/// Command-line flags.
#[derive(Debug, Clone, Parser)]
#[command(about = "How ODC's registration, memory, daemon and failure detection grow with D")]
#[command(after_help = EXAMPLES)]
struct Args {
    /// World sizes to run, in order (each at least 2).
    #[arg(
        long = "ranks",
        value_delimiter = ',',
        default_value = "2,4,8,16,32,64"
    )]
    ranks: Vec<usize>,
    /// Ranks per emulated node (a world smaller than this is one node).
    #[arg(long = "node-ranks", default_value_t = 8)]
    node_ranks: usize,
    /// Transport: shm (every rank, whatever the nodes), mixed (shm within a
    /// node, libfabric between; needs the `fabric` feature) or fabric.
    #[arg(long = "transport", default_value = "shm", value_parser = parse_transport)]
    transport: odc_core::TransportKind,
    /// Sharding: full, hybrid or hybrid-zero.
    #[arg(long = "sharding", default_value = "full", value_parser = parse_sharding)]
    sharding: Sharding,
    /// Bytes of the one f32 bucket (the per-rank workload: each minibatch
    /// gathers it and pushes a gradient of it).
    #[arg(long = "bucket-bytes", default_value = "1M", value_parser = parse_size)]
    bucket_bytes: u64,
    /// Landing-slot size: small, so that 2 · D slots per rank fit here.
    #[arg(long = "chunk-bytes", default_value = "16K", value_parser = parse_size)]
    chunk_bytes: u64,
    /// Minibatches timed per world size.
    #[arg(long = "minibatches", default_value_t = 5)]
    minibatches: u64,
    /// Seconds of idleness over which the daemon's CPU time is measured.
    #[arg(long = "idle-s", default_value_t = 10.0)]
    idle_s: f64,
    /// Skip the killed-rank measurement.
    #[arg(long = "no-kill")]
    no_kill: bool,
    /// Microbatches of rank 0's list per rank of its shard group (the
    /// stealing phase; 0 skips it).
    #[arg(long = "steal-items", default_value_t = 4)]
    steal_items: u64,
    /// Emulated run time of each microbatch rank 0 claims for itself (ms).
    #[arg(long = "steal-work-ms", default_value_t = 1.0)]
    steal_work_ms: f64,
    /// Seconds any wait on a peer may take (the engine's deadline).
    #[arg(long = "timeout", default_value_t = 120)]
    timeout_s: u64,
    /// Write every world size's figures as JSON to this file.
    #[arg(short = 'J', long = "json")]
    json: Option<PathBuf>,
    /// Internal: this process is rank N of a launched job.
    #[arg(long = "rank", hide = true)]
    rank: Option<usize>,
    /// Internal: the world size of that job.
    #[arg(long = "world", hide = true)]
    world: Option<usize>,
    /// Internal: the job directory made by the launcher.
    #[arg(long = "job-dir", hide = true)]
    job_dir: Option<PathBuf>,
}

impl Args {
    fn validate(&self) -> Result<(), String> {
        if self.ranks.is_empty() || self.ranks.iter().any(|&d| d < 2) {
            return Err(format!(
                "--ranks {:?}: every world size must be at least 2",
                self.ranks
            ));
        }
        if self.node_ranks == 0 {
            return Err("--node-ranks 0: need at least one rank per node".into());
        }
        for &d in &self.ranks {
            let g = self.local(d);
            if d % g != 0 {
                return Err(format!(
                    "--ranks {d} does not split into nodes of {g} (--node-ranks)"
                ));
            }
        }
        if self.bucket_bytes < 4 || self.minibatches == 0 {
            return Err("--bucket-bytes must hold one f32 and --minibatches be at least 1".into());
        }
        if !self.transport.available() {
            return Err(format!(
                "--transport {}: this build lacks it (build odc-benches with --features fabric)",
                transport_name(self.transport)
            ));
        }
        Ok(())
    }

    /// Ranks per node in a world of `d`.
    fn local(&self, d: usize) -> usize {
        self.node_ranks.min(d)
    }
}

/// A store that counts what goes through it.
struct Counting {
    inner: FileStore,
    ops: [AtomicU64; 4],
    bytes: AtomicU64,
}

impl Counting {
    fn snapshot(&self) -> StoreOps {
        let n = |i: usize| self.ops[i].load(Ordering::Relaxed);
        StoreOps {
            sets: n(0),
            gets: n(1),
            waits: n(2),
            adds: n(3),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}

impl Store for Counting {
    fn set(&self, key: &str, value: &[u8]) -> odc_core::Result<()> {
        self.ops[0].fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(value.len() as u64, Ordering::Relaxed);
        self.inner.set(key, value)
    }
    fn get(&self, key: &str) -> odc_core::Result<Option<Vec<u8>>> {
        self.ops[1].fetch_add(1, Ordering::Relaxed);
        let v = self.inner.get(key)?;
        let len = v.as_ref().map_or(0, Vec::len) as u64;
        self.bytes.fetch_add(len, Ordering::Relaxed);
        Ok(v)
    }
    fn wait(&self, keys: &[&str], deadline: Instant) -> odc_core::Result<()> {
        self.ops[2].fetch_add(1, Ordering::Relaxed);
        self.inner.wait(keys, deadline)
    }
    fn add(&self, key: &str, delta: i64) -> odc_core::Result<i64> {
        self.ops[3].fetch_add(1, Ordering::Relaxed);
        self.inner.add(key, delta)
    }
    /// Counted with the adds (a read-modify-write, as `add` is).
    fn compare_set(
        &self,
        key: &str,
        want: Option<&[u8]>,
        value: &[u8],
    ) -> odc_core::Result<Vec<u8>> {
        self.ops[3].fetch_add(1, Ordering::Relaxed);
        self.inner.compare_set(key, want, value)
    }
    /// One request, as torch's `multi_get` is (the file store reads the
    /// keys one by one).
    fn multi_get(&self, keys: &[&str]) -> odc_core::Result<Vec<Vec<u8>>> {
        self.ops[1].fetch_add(1, Ordering::Relaxed);
        let v = self.inner.multi_get(keys)?;
        let len: usize = v.iter().map(Vec::len).sum();
        self.bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(v)
    }
}

/// Store calls one rank made to register.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct StoreOps {
    sets: u64,
    gets: u64,
    waits: u64,
    adds: u64,
    bytes: u64,
}

impl StoreOps {
    fn calls(&self) -> u64 {
        self.sets + self.gets + self.waits + self.adds
    }
}

/// What `/proc` says about this process's memory.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct Memory {
    rss_kib: u64,
    rss_anon_kib: u64,
    rss_shmem_kib: u64,
    vm_size_kib: u64,
    mappings: u64,
    fds: u64,
}

fn memory() -> Memory {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let count = |path: &str| std::fs::read_dir(path).map_or(0, |d| d.count() as u64);
    Memory {
        rss_kib: field("VmRSS:"),
        rss_anon_kib: field("RssAnon:"),
        rss_shmem_kib: field("RssShmem:"),
        vm_size_kib: field("VmSize:"),
        mappings: std::fs::read_to_string("/proc/self/maps")
            .map_or(0, |m| m.lines().count() as u64),
        fds: count("/proc/self/fd"),
    }
}

/// CPU time of this process, every thread (user + system).
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Bytes in use on `/dev/shm`.
fn shm_used() -> u64 {
    let path = std::ffi::CString::new("/dev/shm").expect("no NUL");
    // SAFETY: statvfs writes the struct it is given; the path is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    (st.f_blocks - st.f_bfree) * st.f_frsize
}

fn epoch_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// What one rank measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct RankReport {
    rank: usize,
    register_s: f64,
    register_cpu_s: f64,
    store: StoreOps,
    memory: Memory,
    /// Rank 0 only: bytes `/dev/shm` gained for the whole job.
    shm_job_bytes: Option<u64>,
    minibatch_s: Vec<f64>,
    minibatch_cpu_s: f64,
    idle_cpu_s: f64,
    idle_s: f64,
    wrong: u64,
    /// Node cache (full sharding across nodes): pieces this rank fetched
    /// across the network, and pieces it read from the node.
    cache_fetched: u64,
    cache_hits: u64,
    /// Stealing phase: the indices of rank 0's list this rank claimed (its
    /// own claims for rank 0, steals for the others), each steal's round
    /// trip (s), and the phase's time on this rank (s).
    claimed: Vec<u64>,
    steal_rtt_s: Vec<f64>,
    steal_s: f64,
    /// Survivors: seconds from the kill to this rank's error, and the error.
    detect_s: Option<f64>,
    detect_error: Option<String>,
}

/// A barrier on the uncounted store: `n` arrivals at `name`.
fn barrier(store: &FileStore, name: &str, n: usize, deadline: Instant) -> Result<(), String> {
    let arrived = store
        .add(&format!("{name}/n"), 1)
        .map_err(|e| e.to_string())?;
    let done = format!("{name}/done");
    if arrived as usize == n {
        store.set(&done, b"1").map_err(|e| e.to_string())?;
    }
    store
        .wait(&[&done], deadline)
        .map_err(|e| format!("barrier {name}: {e}"))
}

/// Element `i`'s value at version `v` (any owner): small integers, exact.
fn param(i: usize, v: u64) -> f32 {
    ((i * 7 + v as usize) % 61) as f32
}

/// Rank `r`'s gradient at element `i`.
fn grad(r: usize, i: usize) -> f32 {
    ((r * 5 + i) % 31) as f32
}

fn bytes_of(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn run_rank(args: &Args, rank: usize, world: usize, job: &Path) -> Result<RankReport, String> {
    let timeout = Duration::from_secs(args.timeout_s.max(1));
    let deadline = || Instant::now() + timeout;
    let sync = FileStore::new(job.join("sync")).map_err(|e| e.to_string())?;
    let store = Arc::new(Counting {
        inner: FileStore::new(job.join("store")).map_err(|e| e.to_string())?,
        ops: Default::default(),
        bytes: AtomicU64::new(0),
    });
    let local = args.local(world);
    let topo = odc_core::Topology::new(rank, world, local).map_err(|e| e.to_string())?;
    let cfg = EngineConfig {
        timeout,
        transport: args.transport,
        sharding: args.sharding,
        chunk_bytes: usize::try_from(args.chunk_bytes).map_err(|e| e.to_string())?,
        job_key: job_key(job),
        ..Default::default()
    };
    let numel = (args.bucket_bytes / 4) as usize;
    let mut report = RankReport {
        rank,
        ..Default::default()
    };

    barrier(&sync, "start", world, deadline())?;
    let (t0, c0) = (Instant::now(), cpu_time());
    let engine =
        Engine::new(Arc::clone(&store) as Arc<dyn Store>, topo, cfg).map_err(|e| e.to_string())?;
    engine
        .register(&[BucketSpec::new("w", numel, DType::F32)])
        .map_err(|e| e.to_string())?;
    report.register_s = t0.elapsed().as_secs_f64();
    report.register_cpu_s = (cpu_time() - c0).as_secs_f64();
    report.store = store.snapshot();
    barrier(&sync, "registered", world, deadline())?;
    report.memory = memory();
    if rank == 0 {
        let before: u64 = std::fs::read_to_string(job.join("shm-before"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        report.shm_job_bytes = Some(shm_used().saturating_sub(before));
    }

    // Which elements this rank publishes, and which its gradient shard holds.
    let id = BucketId(0);
    let lay = engine.bucket(id).map_err(|e| e.to_string())?.clone();
    let own: std::ops::Range<usize> = match args.sharding {
        Sharding::Hybrid => lay.shard_range(rank % local),
        Sharding::HybridZero => rank * lay.block_len()..(rank + 1) * lay.block_len(),
        _ => lay.shard_range(rank),
    };
    let host = engine.host().map_err(|e| e.to_string())?;
    let grads: Vec<f32> = (0..numel).map(|i| grad(rank, i)).collect();
    let mut full = vec![0f32; numel];
    let cpu0 = cpu_time();
    for k in 0..args.minibatches {
        let t = Instant::now();
        let piece: Vec<f32> = own.clone().map(|i| param(i, k)).collect();
        host.publish(id, bytes_of(&piece), DType::F32, k)
            .map_err(|e| e.to_string())?;
        host.gather(id, k, bytemuck::cast_slice_mut(&mut full), DType::F32)
            .map_err(|e| e.to_string())?;
        host.scatter_accumulate(id, bytes_of(&grads), DType::F32, 1.0)
            .map_err(|e| e.to_string())?;
        host.finish_minibatch(k).map_err(|e| e.to_string())?;
        report.minibatch_s.push(t.elapsed().as_secs_f64());
        report.wrong += full
            .iter()
            .enumerate()
            .filter(|&(i, x)| *x != param(i, k))
            .count() as u64;
    }
    report.minibatch_cpu_s = (cpu_time() - cpu0).as_secs_f64() / args.minibatches as f64;
    if let Some(c) = engine.node_cache_stats() {
        report.cache_fetched = c.fetched;
        report.cache_hits = c.hits;
    }
    // Accumulators are never zeroed here: each holds every minibatch's sum.
    let mut acc = vec![0f32; own.len()];
    host.read_grad_shard(id, &mut acc)
        .map_err(|e| e.to_string())?;
    let reps = args.minibatches as f32;
    for (j, x) in acc.iter().enumerate() {
        let i = own.start + j;
        let want = if i < numel {
            reps * (0..world).map(|r| grad(r, i)).sum::<f32>()
        } else {
            0.0
        };
        if *x != want {
            report.wrong += 1;
        }
    }
    barrier(&sync, "trained", world, deadline())?;

    let (cpu_a, t_a) = (cpu_time(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(args.idle_s));
    report.idle_cpu_s = (cpu_time() - cpu_a).as_secs_f64();
    report.idle_s = t_a.elapsed().as_secs_f64();
    barrier(&sync, "idle", world, deadline())?;

    if args.steal_items > 0 {
        steal_phase(args, &host, rank, world, &sync, &mut report)?;
    }

    if !args.no_kill {
        let victim = world - 1;
        // No publish: under hybrid-zero a publish waits for the other
        // nodes' pieces, the victim's among them, before the kill. Every
        // rank pushes minibatch k, the victim too: its push opens its
        // accumulator for k, without which its daemon would hold the
        // others' chunks of k until it started k (it dies before that).
        let k = args.minibatches;
        host.scatter_accumulate(id, bytes_of(&grads), DType::F32, 1.0)
            .map_err(|e| e.to_string())?;
        if rank == victim {
            // Write the report first: this process ends without returning.
            write_report(job, &report)?;
            barrier(&sync, "armed", world, deadline())?;
            // Long enough for every survivor to be waiting in finish.
            std::thread::sleep(Duration::from_millis(300));
            sync.set("killed-at", epoch_ns().to_string().as_bytes())
                .map_err(|e| e.to_string())?;
            // SAFETY: raising a signal at this process; nothing after runs.
            unsafe { libc::raise(libc::SIGKILL) };
            unreachable!("SIGKILL returned");
        }
        barrier(&sync, "armed", world, deadline())?;
        let result = host.finish_minibatch(k);
        let at = epoch_ns();
        let err = match result {
            Ok(()) => {
                return Err(format!(
                    "finish_minibatch({k}) succeeded without rank {victim}"
                ))
            }
            Err(e) => e.to_string(),
        };
        let killed: u128 = sync
            .get("killed-at")
            .ok()
            .flatten()
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| format!("failed before the kill: {err}"))?;
        if at < killed {
            return Err(format!("failed before the kill: {err}"));
        }
        report.detect_s = Some((at - killed) as f64 / 1e9);
        report.detect_error = Some(err);
    }
    Ok(report)
}

/// The stealing phase (see the module docs), on minibatch
/// `--minibatches`: claims are their own protocol, apart from the
/// gradients the killed-rank phase then pushes for that minibatch.
fn steal_phase(
    args: &Args,
    host: &odc_core::Host<'_>,
    rank: usize,
    world: usize,
    sync: &FileStore,
    report: &mut RankReport,
) -> Result<(), String> {
    use odc_core::protocol::claims::Claim;

    let timeout = Duration::from_secs(args.timeout_s.max(1));
    let group = match args.sharding {
        Sharding::Full => world,
        _ => args.local(world),
    };
    let k = args.minibatches;
    let items = args.steal_items * group as u64;
    let count = if rank == 0 { items } else { 0 };
    // Every rank starts minibatch k of its claim word with its first claim
    // before anyone steals (a thief's request before that is answered
    // NotYet).
    let mut claim = host.claim_own(k, count).map_err(|e| e.to_string())?;
    barrier(sync, "steal", world, Instant::now() + timeout)?;
    let t = Instant::now();
    let work = Duration::from_secs_f64(args.steal_work_ms.max(0.0) / 1000.0);
    if rank == 0 {
        while let Claim::Got(i) = claim {
            report.claimed.push(i);
            std::thread::sleep(work);
            claim = host.claim_own(k, count).map_err(|e| e.to_string())?;
        }
    } else if rank < group {
        loop {
            let a = Instant::now();
            let got = host.steal(0, k).map_err(|e| e.to_string())?;
            report.steal_rtt_s.push(a.elapsed().as_secs_f64());
            match got {
                Claim::Got(i) => report.claimed.push(i),
                Claim::Empty => break,
                Claim::NotYet => return Err("rank 0 had not started the stealing minibatch".into()),
            }
        }
    }
    report.steal_s = t.elapsed().as_secs_f64();
    barrier(sync, "stolen", world, Instant::now() + timeout)
}

/// The engine's job key for the ranks of `job` (its segments' name prefix).
fn job_key(job: &Path) -> String {
    let dir = job.file_name().map(|n| n.to_string_lossy().into_owned());
    format!("scale{}", dir.unwrap_or_default()).replace(|c: char| !c.is_ascii_alphanumeric(), "")
}

/// Removes what the killed rank of `job` left in `/dev/shm`, so that the
/// next world size's shared-memory figure starts from an empty baseline.
fn remove_leftovers(job: &Path) {
    let prefix = format!("odc-{}-", job_key(job));
    if let Ok(dir) = std::fs::read_dir("/dev/shm") {
        for e in dir.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

fn write_report(job: &Path, r: &RankReport) -> Result<(), String> {
    let text = serde_json::to_string(r).map_err(|e| e.to_string())?;
    std::fs::write(job.join(format!("rank-{}.json", r.rank)), text).map_err(|e| e.to_string())
}

/// Runs one world of `d` ranks and returns their reports.
fn launch(args: &Args, d: usize) -> Result<Vec<RankReport>, String> {
    let job = tempfile::Builder::new()
        .prefix("odc-scale-")
        .tempdir()
        .map_err(|e| format!("cannot create a job directory: {e}"))?;
    std::fs::write(job.path().join("shm-before"), shm_used().to_string())
        .map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let passthrough: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<Child> = Vec::with_capacity(d);
    for r in 0..d {
        let child = Command::new(&exe)
            .args(&passthrough)
            .args([
                "--rank",
                &r.to_string(),
                "--world",
                &d.to_string(),
                "--job-dir",
            ])
            .arg(job.path())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                kill_all(&mut children);
                return Err(format!("cannot start rank {r} of {d}: {e}"));
            }
        }
    }
    let limit = Duration::from_secs(args.timeout_s.saturating_mul(2))
        + Duration::from_secs_f64(args.idle_s)
        + Duration::from_secs(60);
    let deadline = Instant::now() + limit;
    let mut status = vec![None; d];
    while status.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_none() {
                status[r] = c.try_wait().map_err(|e| e.to_string())?;
            }
        }
        if Instant::now() > deadline {
            kill_all(&mut children);
            return Err(format!(
                "D = {d}: ranks still running after {limit:?}; killed them"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    remove_leftovers(job.path());
    use std::os::unix::process::ExitStatusExt;
    for (r, s) in status.iter().enumerate() {
        let s = s.expect("every rank ended");
        let killed_itself = !args.no_kill && r == d - 1 && s.signal() == Some(libc::SIGKILL);
        if !s.success() && !killed_itself {
            return Err(format!("D = {d}: rank {r} failed ({s})"));
        }
    }
    (0..d)
        .map(|r| {
            let path = job.path().join(format!("rank-{r}.json"));
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("D = {d}: rank {r} wrote no report: {e}"))?;
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
        })
        .collect()
}

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// One world size's figures, from its ranks' reports.
#[derive(Debug, Clone, Serialize)]
struct Point {
    ranks: usize,
    node_ranks: usize,
    /// Slowest rank's registration (s), and the mean rank's CPU time in it.
    register_s: f64,
    register_cpu_s: f64,
    /// Store calls and bytes of one rank (mean over ranks), and of the job.
    store_calls_per_rank: f64,
    store_bytes_per_rank: f64,
    store_calls_total: u64,
    /// Median rank's memory.
    rss_mib: f64,
    rss_shmem_mib: f64,
    vm_size_mib: f64,
    mappings: u64,
    fds: u64,
    /// `/dev/shm` bytes of the job / D.
    shm_mib_per_rank: f64,
    /// Slowest rank's median minibatch (s), and the mean rank's CPU time per minibatch (s).
    minibatch_s: f64,
    minibatch_cpu_s: f64,
    /// Idle CPU per rank, percent of one core: mean and worst rank.
    idle_cpu_pct: f64,
    idle_cpu_pct_max: f64,
    /// Stealing: rank 0's list, how much of it thieves took, how many of
    /// its items were claimed other than exactly once, the slowest rank's
    /// phase (s) and the median steal round trip (ms).
    steal_items: u64,
    stolen: u64,
    steal_wrong: u64,
    steal_s: f64,
    steal_rtt_ms: f64,
    /// Slowest and median survivor's detection (s); how many survivors
    /// named the rank.
    detect_s: Option<f64>,
    detect_p50_s: Option<f64>,
    named: usize,
    survivors: usize,
    wrong: u64,
    /// Node cache: remote pieces fetched and read from the node, per rank
    /// per minibatch (mean).
    cache_fetched: f64,
    cache_hits: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn point(args: &Args, d: usize, reports: &[RankReport]) -> Point {
    let n = reports.len() as f64;
    let mib = |kib: u64| kib as f64 / 1024.0;
    let med_u = |f: fn(&Memory) -> u64| {
        let mut v: Vec<u64> = reports.iter().map(|r| f(&r.memory)).collect();
        v.sort_unstable();
        v[v.len() / 2]
    };
    let idle: Vec<f64> = reports
        .iter()
        .map(|r| 100.0 * r.idle_cpu_s / r.idle_s.max(1e-9))
        .collect();
    let victim = format!("rank {}", d - 1);
    let survivors: Vec<&RankReport> = reports.iter().filter(|r| r.detect_s.is_some()).collect();
    let group = match args.sharding {
        Sharding::Full => d,
        _ => args.local(d),
    };
    let steal_items = if args.steal_items > 0 {
        args.steal_items * group as u64
    } else {
        0
    };
    let mut times_claimed = vec![0u64; steal_items as usize];
    let mut steal_wrong = 0;
    for i in reports.iter().flat_map(|r| &r.claimed) {
        match times_claimed.get_mut(*i as usize) {
            Some(n) => *n += 1,
            None => steal_wrong += 1,
        }
    }
    steal_wrong += times_claimed.iter().filter(|&&n| n != 1).count() as u64;
    Point {
        ranks: d,
        node_ranks: args.local(d),
        register_s: reports.iter().map(|r| r.register_s).fold(0.0, f64::max),
        register_cpu_s: reports.iter().map(|r| r.register_cpu_s).sum::<f64>() / n,
        store_calls_per_rank: reports.iter().map(|r| r.store.calls() as f64).sum::<f64>() / n,
        store_bytes_per_rank: reports.iter().map(|r| r.store.bytes as f64).sum::<f64>() / n,
        store_calls_total: reports.iter().map(|r| r.store.calls()).sum(),
        rss_mib: mib(med_u(|m| m.rss_kib)),
        rss_shmem_mib: mib(med_u(|m| m.rss_shmem_kib)),
        vm_size_mib: mib(med_u(|m| m.vm_size_kib)),
        mappings: med_u(|m| m.mappings),
        fds: med_u(|m| m.fds),
        shm_mib_per_rank: reports
            .iter()
            .find_map(|r| r.shm_job_bytes)
            .map_or(0.0, |b| b as f64 / (1 << 20) as f64 / n),
        minibatch_s: reports
            .iter()
            .map(|r| median(r.minibatch_s.clone()))
            .fold(0.0, f64::max),
        minibatch_cpu_s: reports.iter().map(|r| r.minibatch_cpu_s).sum::<f64>() / n,
        idle_cpu_pct: idle.iter().sum::<f64>() / n,
        idle_cpu_pct_max: idle.iter().copied().fold(0.0, f64::max),
        detect_s: survivors.iter().filter_map(|r| r.detect_s).reduce(f64::max),
        detect_p50_s: (!survivors.is_empty())
            .then(|| median(survivors.iter().filter_map(|r| r.detect_s).collect())),
        named: survivors
            .iter()
            .filter(|r| {
                r.detect_error
                    .as_deref()
                    .is_some_and(|e| e.contains(&victim))
            })
            .count(),
        survivors: survivors.len(),
        steal_items,
        stolen: reports
            .iter()
            .filter(|r| r.rank != 0)
            .map(|r| r.claimed.len() as u64)
            .sum(),
        steal_wrong,
        steal_s: reports.iter().map(|r| r.steal_s).fold(0.0, f64::max),
        steal_rtt_ms: 1e3 * median(reports.iter().flat_map(|r| r.steal_rtt_s.clone()).collect()),
        wrong: reports.iter().map(|r| r.wrong).sum(),
        cache_fetched: reports.iter().map(|r| r.cache_fetched as f64).sum::<f64>()
            / n
            / args.minibatches as f64,
        cache_hits: reports.iter().map(|r| r.cache_hits as f64).sum::<f64>()
            / n
            / args.minibatches as f64,
    }
}

/// Least-squares slope of log y against log x over the points with y > 0.
fn exponent(points: &[(f64, f64)]) -> Option<f64> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .filter(|&&(x, y)| x > 0.0 && y > 0.0)
        .map(|&(x, y)| (x.ln(), y.ln()))
        .collect();
    if pts.len() < 2 {
        return None;
    }
    let n = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

type Figure = (&'static str, fn(&Point) -> f64);

const FIGURES: [Figure; 13] = [
    ("register_s", |p| p.register_s),
    ("register_cpu_s", |p| p.register_cpu_s),
    ("store_calls_per_rank", |p| p.store_calls_per_rank),
    ("store_bytes_per_rank", |p| p.store_bytes_per_rank),
    ("rss_mib", |p| p.rss_mib),
    ("vm_size_mib", |p| p.vm_size_mib),
    ("mappings", |p| p.mappings as f64),
    ("shm_mib_per_rank", |p| p.shm_mib_per_rank),
    ("minibatch_cpu_s", |p| p.minibatch_cpu_s),
    ("idle_cpu_pct", |p| p.idle_cpu_pct),
    ("detect_s", |p| p.detect_s.unwrap_or(0.0)),
    ("steal_s", |p| p.steal_s),
    ("steal_rtt_ms", |p| p.steal_rtt_ms),
];

fn exponents(points: &[Point]) -> BTreeMap<&'static str, Option<f64>> {
    let big: Vec<&Point> = points.iter().filter(|p| p.ranks >= 8).collect();
    let use_pts: Vec<&Point> = if big.len() >= 3 {
        big
    } else {
        points.iter().collect()
    };
    FIGURES
        .iter()
        .map(|(name, f)| {
            let xy: Vec<(f64, f64)> = use_pts.iter().map(|p| (p.ranks as f64, f(p))).collect();
            (*name, exponent(&xy))
        })
        .collect()
}

fn print_header(args: &Args) {
    println!(
        "# scale_perf: transport {}, sharding {}, nodes of {}, bucket {} B, chunk {} B, {} minibatches, idle {} s",
        transport_name(args.transport),
        args.sharding.name(),
        args.node_ranks,
        args.bucket_bytes,
        args.chunk_bytes,
        args.minibatches,
        args.idle_s
    );
    println!(
        "# {:>5} {:>9} {:>9} {:>9} {:>10} {:>8} {:>8} {:>9} {:>6} {:>5} {:>8} {:>9} {:>9} {:>8} {:>11} {:>8} {:>8} {:>9} {:>8} {:>6} {:>6} {:>7} {:>7}",
        "D", "reg s", "reg cpu s", "st calls", "st bytes", "rss MiB", "shm MiB", "virt MiB", "maps", "fds",
        "shm/rk", "mb s", "mb cpu s", "idle %", "stolen", "steal s", "rtt ms", "detect s", "det p50", "named", "wrong",
        "fetch", "hits"
    );
}

fn print_point(p: &Point) {
    println!(
        "  {:>5} {:>9.3} {:>9.4} {:>9.0} {:>10.0} {:>8.1} {:>8.1} {:>9.1} {:>6} {:>5} {:>8.2} {:>9.4} {:>9.4} {:>8.4} {:>11} {:>8.3} {:>8.3} {:>9} {:>8} {:>6} {:>6} {:>7.1} {:>7.1}",
        p.ranks,
        p.register_s,
        p.register_cpu_s,
        p.store_calls_per_rank,
        p.store_bytes_per_rank,
        p.rss_mib,
        p.rss_shmem_mib,
        p.vm_size_mib,
        p.mappings,
        p.fds,
        p.shm_mib_per_rank,
        p.minibatch_s,
        p.minibatch_cpu_s,
        p.idle_cpu_pct,
        format!("{}/{}", p.stolen, p.steal_items),
        p.steal_s,
        p.steal_rtt_ms,
        p.detect_s.map_or("-".into(), |s| format!("{s:.3}")),
        p.detect_p50_s.map_or("-".into(), |s| format!("{s:.3}")),
        format!("{}/{}", p.named, p.survivors),
        p.wrong,
        p.cache_fetched,
        p.cache_hits
    );
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = args.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    if let (Some(rank), Some(world), Some(job)) = (args.rank, args.world, args.job_dir.as_deref()) {
        return match run_rank(&args, rank, world, job).and_then(|r| write_report(job, &r)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rank {rank} of {world}: error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.json.is_some() {
        odc_benches::sample_load(); // the load average while the run lasts, for the JSON's provenance
    }
    print_header(&args);
    let mut points = Vec::new();
    let mut failed = false;
    for &d in &args.ranks {
        match launch(&args, d) {
            Ok(reports) => {
                let p = point(&args, d, &reports);
                print_point(&p);
                if p.wrong > 0 || p.steal_wrong > 0 || (!args.no_kill && p.named != p.survivors) {
                    failed = true;
                }
                points.push(p);
            }
            Err(e) => {
                eprintln!("error: {e}");
                failed = true;
                break;
            }
        }
    }
    let exps = exponents(&points);
    println!("# growth exponent (slope of log figure against log D):");
    for (name, e) in &exps {
        println!(
            "#   {name:<22} {}",
            e.map_or("-".into(), |e| format!("{e:.2}"))
        );
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "bench": "scale_perf",
            "transport": transport_name(args.transport),
            "sharding": args.sharding.name(),
            "node_ranks": args.node_ranks,
            "bucket_bytes": args.bucket_bytes,
            "chunk_bytes": args.chunk_bytes,
            "minibatches": args.minibatches,
            "idle_s": args.idle_s,
            "steal_items": args.steal_items,
            "steal_work_ms": args.steal_work_ms,
            "points": points,
            "exponents": exps,
            "provenance": odc_benches::provenance(),
        });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if failed {
        eprintln!(
            "error: wrong sums, a microbatch not claimed exactly once, a rank not named, or a \
             world that failed (see above)"
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
