//! Shared harness of the nccl-tests-style perf binaries `gather_perf` and
//! `scatter_accumulate_perf`.
//!
//! One file for the harness both binaries share (launch, rank context,
//! timing, the ceilings, printing and JSON); a quarter of it is its tests.
//!
//! A perf binary started by a user is the **launcher**: it creates a job
//! directory (a [`FileStore`](odc_core::store::FileStore) for the engine's
//! rendezvous) and a shared [`BenchPage`] (barrier, per-rank timings and
//! error counts), then re-executes itself once per rank with `--rank`. Each
//! rank process runs every size; rank 0 prints one row per size as soon as
//! every rank has reported it, and writes the JSON file (`-J`) at the end.
//!
//! Every timed operation is framed like a collective benchmark: all ranks
//! meet at a barrier, time the operation, and meet again; a row's time is
//! the slowest rank's mean. Sizes follow nccl-tests: for gather, `size` is
//! the gathered (output) buffer; for scatter-accumulate, the pushed (input)
//! buffer; `algbw = size / time`, `busbw = algbw · (n − 1) / n`, GB = 10⁹ B.
//! Two baselines come from the same run, in busbw-equivalent GB/s of the
//! bytes one rank moves, each doing the operation's memory work without the
//! engine, in the operation's thread layout:
//!
//! - gather: one thread per rank copies the bytes it would read from its
//!   peers ([`odc_kernels::cpu::copy_bytes`], the shm transport's read:
//!   streaming stores from `STREAM_COPY_MIN` bytes on) out of private memory;
//! - scatter-accumulate ([`CopyAddPipe`]): per rank, the calling thread
//!   copies the bytes it would push chunk by chunk into two slots of the
//!   engine's chunk size (a `memcpy`, as a landing-slot write is) while a
//!   second thread, in the daemon's place, adds each landed chunk fused with
//!   the rank's own slice into an f32 accumulator.
//!
//! `ceiling` is that work done by every rank at once: what the memory
//! system gives when all ranks compete for it, as they do in the
//! operation. `limit` is the same work on rank 0 alone. Both are timed in
//! the same iterations as the operation ([`timed_interleaved`]: every
//! iteration runs the operation, then the ceiling, then the limit, each
//! between barriers), and both are the best they reach: the slowest rank's
//! fastest iteration ([`slowest_best`]), while the operation's time is, as
//! in nccl-tests, the slowest rank's mean. `%ceil` is the operation's busbw
//! against `ceiling`; a row above 100 % is followed by a `# note:` line
//! ([`ceiling_note`]).

#![warn(unsafe_op_in_unsafe_fn)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{CommandFactory, FromArgMatches, Parser};
use memmap2::MmapMut;
use odc_core::sync::EventCount;
use odc_kernels::DType;
use serde::Serialize;

/// Most ranks a perf run may launch.
pub const MAX_RANKS: usize = 64;

/// Command-line flags shared by the perf binaries (nccl-tests spelling).
#[derive(Debug, Clone, Parser)]
pub struct PerfArgs {
    /// Number of local ranks (processes) to launch.
    #[arg(short = 'g', long = "ranks", default_value_t = 2)]
    pub ranks: usize,
    /// Smallest size (bytes; K, M, G suffixes are powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "64K", value_parser = parse_size)]
    pub min_bytes: u64,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    pub max_bytes: u64,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    pub factor: u64,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Warm-up iterations per size (not timed).
    #[arg(short = 'w', long = "warmup_iters", default_value_t = 5)]
    pub warmup: usize,
    /// Element type: f32, bf16 or f16.
    #[arg(short = 'd', long = "datatype", default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Check results (1) or not (0).
    #[arg(short = 'c', long = "check", default_value_t = 1)]
    pub check: u8,
    /// Write the results as JSON to this file.
    #[arg(short = 'J', long = "json")]
    pub json: Option<PathBuf>,
    /// Chunk size of a push (bytes); default: the engine's.
    #[arg(long = "chunk-bytes", value_parser = parse_size)]
    pub chunk_bytes: Option<u64>,
    /// Seconds any wait on a peer may take before the run fails.
    #[arg(long = "timeout", default_value_t = 120)]
    pub timeout_s: u64,
    /// Transport between the ranks: shm, fabric (libfabric over
    /// `ODC_FABRIC_PROVIDER`, default tcp; needs the `fabric` feature),
    /// mixed (shm within a node, fabric between nodes; see
    /// `--ranks-per-node`) or auto.
    #[arg(long = "transport", default_value = "shm", value_parser = parse_transport)]
    pub transport: odc_core::TransportKind,
    /// Sharding: full (every bucket over all ranks) or hybrid (over the
    /// ranks of a node; finish also sums the shards across nodes).
    #[arg(long = "sharding", default_value = "full", value_parser = parse_sharding)]
    pub sharding: odc_core::Sharding,
    /// Deterministic accumulation: the daemon adds into the exact
    /// fixed-point accumulator, and finish reads it out.
    #[arg(long = "deterministic")]
    pub deterministic: bool,
    /// Ranks per node G (ranks are numbered node-major). Default: every
    /// rank on one node, or ranks / namespaces with `--netns`.
    #[arg(long = "local-ranks", visible_alias = "ranks-per-node")]
    pub local_ranks: Option<usize>,
    /// Runs the ranks in existing network namespaces, `NAME=ADDR,...`
    /// (ADDR: the namespace's address libfabric binds); rank r runs in
    /// namespace r / (ranks / namespaces). Needs root.
    #[arg(long = "netns", value_delimiter = ',', value_parser = parse_netns)]
    pub netns: Vec<(String, String)>,
    /// Internal: this process is rank N of a launched job.
    #[arg(long = "rank", hide = true)]
    pub rank: Option<usize>,
    /// Internal: the job directory made by the launcher.
    #[arg(long = "job-dir", hide = true)]
    pub job_dir: Option<PathBuf>,
}

/// What a perf binary's `--help` says beyond the shared flags: what it
/// measures (first) and how to run it (examples, last).
#[derive(Debug, Clone, Copy)]
pub struct PerfHelp {
    /// One line: what the binary measures.
    pub about: &'static str,
    /// The text after the flags: examples with what each does.
    pub examples: &'static str,
}

impl PerfArgs {
    /// Parses the process's arguments as the binary `name`, whose `--help`
    /// gives `help`; exits with clap's message and status 2 on a bad flag.
    pub fn parse_as(name: &'static str, help: PerfHelp) -> Self {
        let matches = Self::command()
            .name(name)
            .bin_name(name)
            .about(help.about)
            .after_help(help.examples)
            .get_matches();
        Self::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }

    /// Checks the flags; the message names the offending one.
    pub fn validate(&self) -> Result<(), String> {
        if self.ranks < 2 || self.ranks > MAX_RANKS {
            return Err(format!(
                "-g {}: need between 2 and {MAX_RANKS} ranks",
                self.ranks
            ));
        }
        if self.min_bytes == 0 || self.min_bytes > self.max_bytes {
            return Err(format!(
                "-b {} -e {}: need 0 < minbytes <= maxbytes",
                self.min_bytes, self.max_bytes
            ));
        }
        if self.factor < 2 {
            return Err(format!(
                "-f {}: the step factor must be at least 2",
                self.factor
            ));
        }
        if self.iters == 0 {
            return Err("-n 0: need at least one timed iteration".into());
        }
        let local = self.local_world();
        if local == 0 || self.ranks % local != 0 {
            return Err(format!(
                "--local-ranks {local} / --netns: {} ranks do not split into nodes of {local}",
                self.ranks
            ));
        }
        if !self.netns.is_empty() && self.ranks % self.netns.len() != 0 {
            return Err(format!(
                "--netns: {} ranks do not split evenly over {} namespaces",
                self.ranks,
                self.netns.len()
            ));
        }
        if !self.transport.available() {
            return Err(format!(
                "--transport {}: this build lacks it (build odc-benches with --features fabric)",
                transport_name(self.transport)
            ));
        }
        Ok(())
    }

    /// Ranks per node.
    pub fn local_world(&self) -> usize {
        match (self.local_ranks, self.netns.len()) {
            (Some(g), _) => g,
            (None, 0) => self.ranks,
            (None, n) => self.ranks / n,
        }
    }

    /// The index of rank `r`'s shard in its shard group.
    pub fn shard_index(&self, r: usize) -> usize {
        match self.sharding {
            odc_core::Sharding::Hybrid => r % self.local_world(),
            _ => r,
        }
    }

    /// The namespace (name, address) rank `r` runs in, if any.
    pub fn netns_of(&self, r: usize) -> Option<&(String, String)> {
        let n = self.netns.len();
        (n > 0).then(|| &self.netns[(r / (self.ranks / n).max(1)).min(n - 1)])
    }

    /// The sizes of the sweep, each rounded down to whole elements of `dtype`.
    pub fn sizes(&self) -> Vec<u64> {
        let elem = self.dtype.size_bytes() as u64;
        let mut out = Vec::new();
        let mut s = self.min_bytes;
        while s <= self.max_bytes {
            let rounded = (s / elem).max(1) * elem;
            out.push(rounded);
            match s.checked_mul(self.factor) {
                Some(next) => s = next,
                None => break,
            }
        }
        out
    }
}

/// Parses `65536`, `64K`, `64KiB`, `64M`, `1G` (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 65536, 64K, 64M, 1G)"))?;
    let mult = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        other => {
            return Err(format!(
                "'{s}': unknown size unit '{other}' (use K, M or G)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{s}' is too large"))
}

pub fn parse_transport(s: &str) -> Result<odc_core::TransportKind, String> {
    odc_core::TransportKind::parse(s)
        .ok_or_else(|| format!("unknown transport {s:?}: shm, fabric, mixed or auto"))
}

pub fn parse_sharding(s: &str) -> Result<odc_core::Sharding, String> {
    odc_core::Sharding::parse(s)
        .ok_or_else(|| format!("unknown sharding {s:?}: full, hybrid or hybrid-zero"))
}

fn parse_netns(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((ns, addr)) if !ns.is_empty() && !addr.is_empty() => Ok((ns.into(), addr.into())),
        _ => Err(format!("--netns {s:?}: expected NAME=ADDR")),
    }
}

/// The transport's name as the flag spells it.
pub fn transport_name(kind: odc_core::TransportKind) -> &'static str {
    kind.name()
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse::<DType>().map_err(|e| e.to_string())
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Bytes of the operation (see the crate doc for which buffer).
    pub size: u64,
    /// Elements.
    pub count: u64,
    /// Element type.
    #[serde(rename = "type")]
    pub dtype: String,
    /// Reduction ("sum" for scatter-accumulate, "none" for gather).
    pub redop: String,
    /// Slowest rank's mean time per operation, microseconds.
    pub time_us: f64,
    /// size / time, GB/s.
    pub algbw: f64,
    /// algbw · (n − 1) / n, GB/s.
    pub busbw: f64,
    /// Wrong elements summed over ranks and iterations checked.
    pub wrong: u64,
    /// The single-thread limit for the same bytes, GB/s of busbw-equivalent.
    pub limit_busbw: f64,
    /// The same work done by every rank at once (slowest rank), GB/s of
    /// busbw-equivalent.
    pub ceiling_busbw: f64,
    /// The operation at its best, as the ceiling is taken: the slowest
    /// rank's fastest iteration (of the better variant for gather), GB/s of
    /// busbw. `%ceil` is this against `ceiling_busbw`; `busbw` stays the
    /// mean, as nccl-tests reports it. 0 where not measured.
    pub best_busbw: f64,
    /// Why `%ceil` exceeds 100 %, when it does (see [`ceiling_note`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ceiling_note: Option<String>,
    /// The in-place variant (gather only: this rank's shard is already in
    /// the output, as in FSDP, whose all-gather input aliases its output).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_place: Option<InPlace>,
}

impl Row {
    /// Sets the operation's best, the ceiling and the limit from `slow`
    /// (`[operation, ceiling, limit]`, each the slowest rank's fastest
    /// iteration, from [`slowest_best`]) for `moved` bytes per rank, and the
    /// note of a row above 100 %; `op` and `ceiling` are rank 0's times in
    /// the loop `slow` came from.
    pub fn set_baselines(
        &mut self,
        moved: usize,
        slow: &[Duration],
        op: PhaseTime,
        ceiling: PhaseTime,
    ) {
        self.best_busbw = gbps(moved, slow[0]);
        self.ceiling_busbw = gbps(moved, slow[1]);
        self.limit_busbw = gbps(moved, slow[2]);
        let pct = ceiling_pct(self.best_busbw, self.ceiling_busbw);
        self.ceiling_note = ceiling_note(self.size, pct, op, ceiling);
    }
}

/// Time, bandwidths and errors of an in-place run of the same size.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct InPlace {
    /// Slowest rank's mean time per operation, microseconds.
    pub time_us: f64,
    /// size / time, GB/s.
    pub algbw: f64,
    /// algbw · (n − 1) / n, GB/s.
    pub busbw: f64,
    /// Wrong elements summed over ranks.
    pub wrong: u64,
}

/// Prints the table header; `in_place` adds the in-place columns
/// (nccl-tests prints out-of-place, then in-place).
pub fn print_header(title: &str, args: &PerfArgs, in_place: bool) {
    println!(
        "# {title}: {} ranks ({} per node), {} warm-up + {} timed iterations, check={}, transport={}, sharding={}{}",
        args.ranks,
        args.local_world(),
        args.warmup,
        args.iters,
        args.check,
        transport_name(args.transport),
        args.sharding.name(),
        if args.deterministic { ", deterministic" } else { "" }
    );
    let group = format!(
        "{:>10} {:>8} {:>8} {:>7}",
        "time(us)", "algbw", "busbw", "#wrong"
    );
    let ip = if in_place {
        format!(" | {group}")
    } else {
        String::new()
    };
    println!(
        "# {:>10} {:>12} {:>5} {:>6} | {group}{ip} | {:>8} {:>8} {:>6}",
        "size", "count", "type", "redop", "limit", "ceiling", "%ceil"
    );
    if in_place {
        println!(
            "# {:>37} | {:>36} | {:>36} | {:>8} {:>8} {:>6}",
            "", "out-of-place", "in-place", "1 rank", "all", "(best)"
        );
    } else {
        println!(
            "# {:>37} | {:>36} | {:>8} {:>8} {:>6}",
            "", "", "1 rank", "all", ""
        );
    }
}

/// Prints one row; `%ceil` is [`Row::best_busbw`] against the ceiling.
pub fn print_row(r: &Row) {
    let pct = ceiling_pct(r.best_busbw, r.ceiling_busbw);
    let ip = r.in_place.map_or(String::new(), |ip| {
        format!(
            " | {:>10.2} {:>8.2} {:>8.2} {:>7}",
            ip.time_us, ip.algbw, ip.busbw, ip.wrong
        )
    });
    println!(
        "  {:>10} {:>12} {:>5} {:>6} | {:>10.2} {:>8.2} {:>8.2} {:>7}{ip} | {:>8.2} {:>8.2} {:>5.0}%",
        r.size,
        r.count,
        r.dtype,
        r.redop,
        r.time_us,
        r.algbw,
        r.busbw,
        r.wrong,
        r.limit_busbw,
        r.ceiling_busbw,
        pct
    );
    if let Some(note) = &r.ceiling_note {
        println!("# note: {note}");
    }
    let _ = std::io::stdout().flush();
}

/// The shared page the ranks of one run meet in: a sense-counting barrier
/// and one timing / error-count slot per rank.
#[repr(C)]
#[derive(Debug)]
struct PageLayout {
    arrived: AtomicU32,
    _pad0: [u32; 15],
    generation: EventCount,
    _pad1: [u32; 14],
    time_ns: [AtomicU64; MAX_RANKS],
    wrong: [AtomicU64; MAX_RANKS],
}

/// A mapped [`PageLayout`] shared by the ranks of one run.
#[derive(Debug)]
pub struct BenchPage {
    map: MmapMut,
    ranks: usize,
    timeout: Duration,
}

impl BenchPage {
    const FILE: &'static str = "bench.page";

    /// Creates the zeroed page in `job_dir` (launcher).
    pub fn create(job_dir: &Path) -> std::io::Result<()> {
        let f = File::create(job_dir.join(Self::FILE))?;
        f.set_len(std::mem::size_of::<PageLayout>() as u64)
    }

    /// Maps the page made by the launcher (rank processes).
    pub fn open(job_dir: &Path, ranks: usize, timeout: Duration) -> std::io::Result<BenchPage> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(job_dir.join(Self::FILE))?;
        // SAFETY: the file is private to this job and sized by `create`; all
        // concurrent access to the mapping goes through atomics.
        let map = unsafe { MmapMut::map_mut(&f)? };
        if map.len() < std::mem::size_of::<PageLayout>() {
            return Err(std::io::Error::other("bench page is too small"));
        }
        Ok(BenchPage {
            map,
            ranks,
            timeout,
        })
    }

    fn page(&self) -> &PageLayout {
        // SAFETY: the mapping is page-aligned, at least `size_of::<PageLayout>()`
        // bytes, lives as long as `self`, and every field is an atomic (any bit
        // pattern, zero included, is valid).
        unsafe { &*(self.map.as_ptr() as *const PageLayout) }
    }

    /// Waits until every rank has arrived. Fails after the timeout, naming
    /// how many ranks arrived.
    pub fn barrier(&self) -> Result<(), String> {
        let p = self.page();
        let epoch = p.generation.epoch();
        let n = self.ranks as u32;
        if p.arrived.fetch_add(1, Ordering::AcqRel) + 1 == n {
            p.arrived.store(0, Ordering::Release);
            p.generation.notify();
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        let mut spins = 0u32;
        while p.generation.epoch() == epoch {
            if spins < 200 {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "barrier timed out after {:?}: {} of {} ranks arrived",
                    self.timeout,
                    p.arrived.load(Ordering::Acquire),
                    n
                ));
            }
            p.generation
                .wait(epoch, (deadline - now).min(Duration::from_millis(100)));
        }
        Ok(())
    }

    /// Records this rank's mean time and wrong-element count for the current size.
    pub fn report(&self, rank: usize, mean: Duration, wrong: u64) {
        let p = self.page();
        p.time_ns[rank].store(mean.as_nanos() as u64, Ordering::Release);
        p.wrong[rank].store(wrong, Ordering::Release);
    }

    /// The slowest rank's time and the summed wrong count (after a barrier).
    pub fn collect(&self) -> (Duration, u64) {
        let p = self.page();
        let t = (0..self.ranks)
            .map(|r| p.time_ns[r].load(Ordering::Acquire))
            .max()
            .unwrap_or(0);
        let w = (0..self.ranks)
            .map(|r| p.wrong[r].load(Ordering::Acquire))
            .sum();
        (Duration::from_nanos(t), w)
    }
}

/// Launches `args.ranks` copies of the current executable as ranks of one
/// job and waits for them. Returns the process exit code.
pub fn launch(args: &PerfArgs) -> ExitCode {
    if let Err(e) = args.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let job = match tempfile::Builder::new().prefix("odc-perf-").tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: cannot create a job directory: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = BenchPage::create(job.path()) {
        eprintln!("error: cannot create the bench page: {e}");
        return ExitCode::FAILURE;
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: cannot find this executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let passthrough: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<Child> = Vec::new();
    for r in 0..args.ranks {
        let mut cmd = match args.netns_of(r) {
            Some((ns, addr)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns.as_str()])
                    .arg(&exe)
                    .env("ODC_FABRIC_ADDR", addr);
                c
            }
            None => Command::new(&exe),
        };
        let child = cmd
            .args(&passthrough)
            .arg("--rank")
            .arg(r.to_string())
            .arg("--job-dir")
            .arg(job.path())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                eprintln!("error: cannot start rank {r}: {e}");
                kill_all(&mut children);
                return ExitCode::FAILURE;
            }
        }
    }
    // Wait for all; if one fails, the others fail at their next wait (they
    // name it), but do not leave any behind.
    let mut failed = None;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_s.saturating_mul(4).max(60));
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for (r, c) in children.iter_mut().enumerate() {
            if done[r] {
                continue;
            }
            match c.try_wait() {
                Ok(Some(status)) => {
                    done[r] = true;
                    if !status.success() && failed.is_none() {
                        failed = Some((r, status));
                    }
                }
                Ok(None) => {}
                Err(_) => done[r] = true,
            }
        }
        if Instant::now() > deadline {
            eprintln!(
                "error: ranks still running after {:?}; killing them",
                deadline
            );
            kill_all(&mut children);
            return ExitCode::FAILURE;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match failed {
        None => ExitCode::SUCCESS,
        Some((r, status)) => {
            eprintln!("error: rank {r} failed ({status})");
            ExitCode::FAILURE
        }
    }
}

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// One phase's per-iteration times on this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PhaseTime {
    /// Mean over the timed iterations.
    pub mean: Duration,
    /// Fastest iteration.
    pub min: Duration,
    /// Slowest iteration.
    pub max: Duration,
}

/// Runs every phase once per iteration, in order, each framed by barriers
/// (`warmup` untimed iterations, then `iters` timed); returns each phase's
/// times on this rank. A phase a rank sits out (the limit on ranks other
/// than 0) simply returns at once.
pub fn timed_interleaved(
    page: &BenchPage,
    warmup: usize,
    iters: usize,
    phases: &mut [&mut dyn FnMut(usize) -> Result<(), String>],
) -> Result<Vec<PhaseTime>, String> {
    let mut sums = vec![Duration::ZERO; phases.len()];
    let mut mins = vec![Duration::MAX; phases.len()];
    let mut maxs = vec![Duration::ZERO; phases.len()];
    for i in 0..warmup + iters {
        for (p, phase) in phases.iter_mut().enumerate() {
            page.barrier()?;
            let t0 = Instant::now();
            phase(i)?;
            let t = t0.elapsed();
            if i >= warmup {
                sums[p] += t;
                mins[p] = mins[p].min(t);
                maxs[p] = maxs[p].max(t);
            }
        }
    }
    page.barrier()?;
    let n = iters.max(1) as u32;
    Ok((0..phases.len())
        .map(|p| PhaseTime {
            mean: sums[p] / n,
            min: if iters == 0 { Duration::ZERO } else { mins[p] },
            max: maxs[p],
        })
        .collect())
}

/// The slowest rank's fastest iteration of each phase (every rank gets
/// them), through the page: one report and two barriers per phase. A
/// baseline is what the work reaches at best, so a slow spell of a shared
/// host lowers it only if it lasts the whole run.
pub fn slowest_best(
    page: &BenchPage,
    rank: usize,
    times: &[PhaseTime],
) -> Result<Vec<Duration>, String> {
    let mut out = Vec::with_capacity(times.len());
    for t in times {
        page.report(rank, t.min, 0);
        page.barrier()?;
        out.push(page.collect().0);
        page.barrier()?;
    }
    Ok(out)
}

/// Busbw-equivalent GB/s of moving `bytes` per rank in `t`.
pub fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

/// `%ceil`: the operation's fastest iteration against the ceiling's, both
/// the slowest rank's, in percent (0 without a ceiling). Like against like:
/// a mean against a fastest iteration would count the host's noise as the
/// engine's cost (at 64 MiB on the 2-core development VM that alone read as
/// 5-15 points).
fn ceiling_pct(best_busbw: f64, ceiling_busbw: f64) -> f64 {
    if ceiling_busbw > 0.0 {
        100.0 * best_busbw / ceiling_busbw
    } else {
        0.0
    }
}

/// The explanation printed under a row whose operation beat its ceiling, or
/// `None` when it did not (`pct` ≤ 100). Both are the slowest rank's
/// fastest iteration, so the operation beats the ceiling only where its own
/// work is cheaper than the ceiling's or the ceiling's best iteration was
/// slowed; `op` and `ceiling` are rank 0's iteration times, printed to show
/// it.
fn ceiling_note(size: u64, pct: f64, op: PhaseTime, ceiling: PhaseTime) -> Option<String> {
    if pct <= 100.0 {
        return None;
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    Some(format!(
        "{size} B at {pct:.0}% of its ceiling: the operation's fastest iteration beat the fastest of the same work \
         without the engine in this run (rank 0: operation {:.2}..{:.2} us, mean {:.2}; ceiling {:.2}..{:.2} us, \
         mean {:.2}); the ceiling's copies took longer here than the engine's reads of the same bytes",
        us(op.min),
        us(op.max),
        us(op.mean),
        us(ceiling.min),
        us(ceiling.max),
        us(ceiling.mean),
    ))
}

/// Private buffers for the gather ceiling: one thread copies `bytes` with
/// the shm transport's copy.
#[derive(Debug)]
pub struct CopyWork {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl CopyWork {
    /// Buffers of `bytes`, touched once so no page is faulted in while timed.
    pub fn new(bytes: usize) -> Self {
        Self {
            src: vec![1u8; bytes.max(1)],
            dst: vec![2u8; bytes.max(1)],
        }
    }

    /// One copy of the whole buffer.
    pub fn run(&mut self) -> Result<(), String> {
        odc_kernels::cpu::copy_bytes(&mut self.dst, &self.src).map_err(|e| e.to_string())?;
        std::hint::black_box(&mut self.dst);
        Ok(())
    }
}

/// The memory work of a scatter-accumulate on one rank without the engine,
/// in its thread layout: [`run`](Self::run) copies the pushed bytes chunk
/// by chunk into two slots while the pipe's own thread (the daemon's role)
/// adds every landed chunk, fused with the matching part of the rank's own
/// slice on the first pass over the shard, into an f32 accumulator; `run`
/// returns when every chunk is added.
#[derive(Debug)]
pub struct CopyAddPipe {
    src: Vec<f32>,
    chunk: usize,
    slots: std::sync::Arc<[std::sync::Mutex<Vec<f32>>; 2]>,
    to_adder: Option<std::sync::mpsc::Sender<(usize, usize, usize)>>,
    freed: std::sync::mpsc::Receiver<usize>,
    adder: Option<std::thread::JoinHandle<()>>,
}

impl CopyAddPipe {
    /// A pipe pushing `moved` bytes per run into an accumulator of `shard`
    /// bytes, through slots of `chunk` bytes (all rounded to f32 elements).
    pub fn new(moved: usize, shard: usize, chunk: usize) -> Result<Self, String> {
        use std::sync::{mpsc, Arc, Mutex};
        let n = (moved / 4).max(1);
        let shard = (shard / 4).max(1);
        let chunk = (chunk / 4).clamp(1, n);
        let slots = Arc::new([Mutex::new(vec![0f32; chunk]), Mutex::new(vec![0f32; chunk])]);
        let (to_adder, jobs) = mpsc::channel::<(usize, usize, usize)>();
        let (free, freed) = mpsc::channel::<usize>();
        let theirs = Arc::clone(&slots);
        let adder = std::thread::Builder::new()
            .name("ceiling-adder".into())
            .spawn(move || {
                let mut acc = vec![0f32; shard];
                let own = vec![1f32; shard];
                // (slot, offset into the pushed bytes, elements)
                while let Ok((slot, offset, len)) = jobs.recv() {
                    if let Ok(data) = theirs[slot].lock() {
                        let mut done = 0;
                        while done < len {
                            let at = (offset + done) % shard;
                            let run = (len - done).min(shard - at);
                            let (a, x) = (&mut acc[at..at + run], &data[done..done + run]);
                            if offset + done < shard {
                                for ((a, x), o) in a.iter_mut().zip(x).zip(&own[at..at + run]) {
                                    *a += *x + *o;
                                }
                            } else {
                                for (a, x) in a.iter_mut().zip(x) {
                                    *a += *x;
                                }
                            }
                            done += run;
                        }
                    }
                    std::hint::black_box(&mut acc);
                    if free.send(slot).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| format!("cannot start the ceiling's adder thread: {e}"))?;
        Ok(Self {
            src: vec![1f32; n],
            chunk,
            slots,
            to_adder: Some(to_adder),
            freed,
            adder: Some(adder),
        })
    }

    /// Pushes the whole buffer through the pipe and waits for the adds.
    pub fn run(&mut self) -> Result<(), String> {
        let gone = || "the ceiling's adder thread stopped".to_string();
        let sender = self.to_adder.as_ref().ok_or_else(gone)?;
        let mut free = vec![0usize, 1];
        let mut in_flight = 0usize;
        let mut offset = 0usize;
        while offset < self.src.len() {
            let slot = match free.pop() {
                Some(s) => s,
                None => {
                    in_flight -= 1;
                    self.freed.recv().map_err(|_| gone())?
                }
            };
            let len = self.chunk.min(self.src.len() - offset);
            {
                let mut data = self.slots[slot].lock().map_err(|_| gone())?;
                data[..len].copy_from_slice(&self.src[offset..offset + len]);
            }
            sender.send((slot, offset, len)).map_err(|_| gone())?;
            in_flight += 1;
            offset += len;
        }
        for _ in 0..in_flight {
            self.freed.recv().map_err(|_| gone())?;
        }
        Ok(())
    }
}

impl Drop for CopyAddPipe {
    fn drop(&mut self) {
        self.to_adder.take();
        if let Some(h) = self.adder.take() {
            if h.join().is_err() {
                eprintln!("warning: the ceiling's adder thread panicked");
            }
        }
    }
}

/// What a result does not depend on: the benchmarks' own output under `docs/`, so that rerunning one figure
/// does not make the next one's run `+dirty` (git pathspecs from the top of the checkout; Python's
/// `odc.bench.report.OUTPUTS` leaves out the same).
const OUTPUTS: [&str; 3] = [
    ":(top,exclude)docs/bench",
    ":(top,exclude)docs/scale",
    ":(top,exclude,glob)docs/*.png",
];

/// How often [`sample_load`] reads the load average.
const LOAD_PERIOD: Duration = Duration::from_secs(5);

/// The load average samples since [`sample_load`].
struct LoadSamples {
    /// When sampling started.
    t0: Instant,
    /// `(seconds since t0, 1-minute load average)`.
    samples: std::sync::Mutex<Vec<(f64, f64)>>,
}

static LOAD: std::sync::OnceLock<LoadSamples> = std::sync::OnceLock::new();

/// The 1-minute load average (`/proc/loadavg`'s first field), or `None` where there is none.
fn load_now() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The machine's online cores: what its load average counts against (not this process's affinity).
fn online_cpus() -> Option<u64> {
    // SAFETY: sysconf reads a system constant; it takes and returns plain integers.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    u64::try_from(n).ok().filter(|&n| n > 0)
}

/// Starts sampling the machine's 1-minute load average every five seconds (a detached thread), for the
/// [`provenance`] of this process's results: call it where the run starts. Later calls do nothing.
pub fn sample_load() {
    LOAD.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("odc-bench-load".into())
            .spawn(|| loop {
                std::thread::sleep(LOAD_PERIOD);
                if let (Some(load), Some(v)) = (LOAD.get(), load_now()) {
                    if let Ok(mut s) = load.samples.lock() {
                        s.push((load.t0.elapsed().as_secs_f64(), v));
                    }
                }
            });
        if let Err(e) = spawned {
            eprintln!(
                "warning: no load average sampling thread ({e}): the JSON records its end only"
            );
        }
        let first = load_now().map(|v| (0.0, v));
        LoadSamples {
            t0: Instant::now(),
            samples: std::sync::Mutex::new(first.into_iter().collect()),
        }
    });
}

/// The `load` of [`provenance`]: the core count, the sampling period and the samples, the last taken now
/// (one, taken now, where [`sample_load`] never ran).
fn load_record() -> serde_json::Value {
    let now = load_now();
    let (period, samples) = match LOAD.get() {
        Some(load) => {
            let mut s = load.samples.lock().map(|s| s.clone()).unwrap_or_default();
            s.extend(now.map(|v| (load.t0.elapsed().as_secs_f64(), v)));
            (Some(LOAD_PERIOD.as_secs_f64()), s)
        }
        None => (None, now.map(|v| (0.0, v)).into_iter().collect()),
    };
    let samples: Vec<[f64; 2]> = samples
        .into_iter()
        .map(|(t, v)| [(t * 1e3).round() / 1e3, v])
        .collect();
    serde_json::json!({"cpus": online_cpus(), "period_s": period, "samples": samples})
}

/// What made a result, for the JSON files the docs render: the command line, the commit of the checkout
/// the binary was built from (`+dirty` when tracked files differ from it, the benchmarks' output under
/// `docs/` aside; `null` outside a git checkout), the UTC time, and the machine's load while it ran
/// (`load`: the samples since [`sample_load`], and the core count).
pub fn provenance() -> serde_json::Value {
    let checkout = env!("CARGO_MANIFEST_DIR");
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(checkout)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).map(|c| {
        let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--", ":/"];
        status.extend(OUTPUTS);
        let dirty = git(&status).is_some_and(|s| !s.is_empty());
        if dirty {
            c + "+dirty"
        } else {
            c
        }
    });
    serde_json::json!({
        "command": command_line(std::env::args().collect()),
        "commit": commit,
        "date": utc_now(),
        "load": load_record(),
    })
}

/// The command a user typed, from a rank's arguments: the launcher appends `--rank R` (and `--world`,
/// `--job-dir`) to what it was given, and starts the ranks by their absolute path.
fn command_line(mut args: Vec<String>) -> String {
    if let Some(i) = args.iter().rposition(|a| a == "--rank") {
        args.truncate(i);
    }
    if let (Some(exe), Ok(cwd)) = (args.first_mut(), std::env::current_dir()) {
        if let Ok(rel) = Path::new(exe.as_str()).strip_prefix(&cwd) {
            *exe = rel.display().to_string();
        }
    }
    args.join(" ")
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SS+00:00`.
fn utc_now() -> String {
    utc(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()))
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SS+00:00` (the civil-from-days algorithm: no date crate).
fn utc(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}+00:00",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Writes `rows` as JSON: `{"benchmark":..,"ranks":..,"dtype":..,"rows":[..],"provenance":{..}}`.
pub fn write_json(path: &Path, bench: &str, args: &PerfArgs, rows: &[Row]) -> Result<(), String> {
    let doc = serde_json::json!({
        "benchmark": bench,
        "ranks": args.ranks,
        "dtype": args.dtype.name(),
        "transport": transport_name(args.transport),
        "iters": args.iters,
        "warmup": args.warmup,
        "rows": rows,
        "provenance": provenance(),
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_the_users() {
        let cwd = std::env::current_dir().unwrap().display().to_string();
        let args = |s: &str| s.split(' ').map(str::to_string).collect::<Vec<_>>();
        let rank =
            format!("{cwd}/target/release/gather_perf -g 2 -J x.json --rank 1 --job-dir /tmp/j");
        assert_eq!(
            command_line(args(&rank)),
            "target/release/gather_perf -g 2 -J x.json"
        );
        assert_eq!(
            command_line(args("/elsewhere/scale_perf --ranks 2,4")),
            "/elsewhere/scale_perf --ranks 2,4"
        );
    }

    #[test]
    fn utc_dates_are_civil() {
        assert_eq!(utc(0), "1970-01-01T00:00:00+00:00");
        assert_eq!(utc(951_782_400 + 3_661), "2000-02-29T01:01:01+00:00");
        assert_eq!(utc(1_796_083_199), "2026-11-30T23:59:59+00:00");
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("12Q").unwrap_err().contains("unknown size unit"));
        assert!(parse_size("abc").unwrap_err().contains("not a size"));
    }

    #[test]
    fn sweep_is_geometric_and_whole_elements() {
        let a = PerfArgs::parse_from(["x", "-b", "64K", "-e", "1M", "-f", "4", "-d", "bf16"]);
        assert_eq!(a.sizes(), vec![65536, 262144, 1048576]);
        let b = PerfArgs::parse_from(["x", "-b", "7", "-e", "7", "-d", "f32"]);
        assert_eq!(b.sizes(), vec![4]);
    }

    #[test]
    fn bad_flags_are_named() {
        let a = PerfArgs::parse_from(["x", "-g", "1"]);
        assert!(a.validate().unwrap_err().contains("-g 1"));
        let a = PerfArgs::parse_from(["x", "-b", "1M", "-e", "64K"]);
        assert!(a.validate().unwrap_err().contains("minbytes"));
    }

    #[test]
    fn ceiling_notes_only_rows_above_it() {
        let t = |us: u64| PhaseTime {
            mean: Duration::from_micros(us),
            min: Duration::from_micros(us - 1),
            max: Duration::from_micros(us + 1),
        };
        assert_eq!(ceiling_note(1024, 99.0, t(10), t(10)), None);
        let note = ceiling_note(1024, 120.0, t(10), t(12)).unwrap();
        assert!(
            note.contains("1024 B at 120%") && note.contains("mean 10.00"),
            "{note}"
        );
    }

    #[test]
    fn copy_add_pipe_runs_any_shape() {
        // moved < chunk, moved = shard (2 ranks), moved = 3 shards (4 ranks), odd sizes.
        for (moved, shard, chunk) in [
            (4096, 4096, 1 << 20),
            (1 << 16, 1 << 16, 4096),
            (3 << 14, 1 << 14, 4096),
            (4100, 2052, 1000),
        ] {
            let mut pipe = CopyAddPipe::new(moved, shard, chunk).unwrap();
            for _ in 0..3 {
                pipe.run().unwrap();
            }
        }
        let mut work = CopyWork::new(1000);
        work.run().unwrap();
        assert_eq!(work.dst, work.src);
    }

    #[test]
    fn barrier_and_report_in_one_process() {
        let dir = tempfile::tempdir().unwrap();
        BenchPage::create(dir.path()).unwrap();
        let page = BenchPage::open(dir.path(), 1, Duration::from_secs(5)).unwrap();
        page.barrier().unwrap();
        page.report(0, Duration::from_micros(7), 3);
        assert_eq!(page.collect(), (Duration::from_micros(7), 3));
    }
}

/// What a rank process of a perf run holds.
#[derive(Debug)]
pub struct RankCtx {
    /// This rank.
    pub rank: usize,
    /// The engine, with one bucket registered per size of the sweep.
    pub engine: odc_core::Engine,
    /// The shared barrier page.
    pub page: BenchPage,
    /// The sizes of the sweep (bytes), one bucket each, named `size-<bytes>`.
    pub sizes: Vec<u64>,
}

/// Joins the job as `rank`: builds the engine on the launcher's store and
/// registers one bucket per size.
pub fn join(args: &PerfArgs, rank: usize) -> Result<RankCtx, String> {
    let job = args.job_dir.as_deref().ok_or("--rank needs --job-dir")?;
    let timeout = Duration::from_secs(args.timeout_s.max(1));
    let store = odc_core::FileStore::new(job.join("store")).map_err(|e| e.to_string())?;
    let topo =
        odc_core::Topology::new(rank, args.ranks, args.local_world()).map_err(|e| e.to_string())?;
    let mut cfg = odc_core::EngineConfig {
        timeout,
        transport: args.transport,
        sharding: args.sharding,
        deterministic: args.deterministic,
        ..Default::default()
    };
    if let Some(c) = args.chunk_bytes {
        cfg.chunk_bytes = usize::try_from(c).map_err(|e| e.to_string())?;
    }
    // One key per launched run (the job directory is unique), equal on every rank.
    let dir_name = job
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    cfg.job_key = dir_name.trim_start_matches("odc-perf-").to_string();
    let engine =
        odc_core::Engine::new(std::sync::Arc::new(store), topo, cfg).map_err(|e| e.to_string())?;
    let sizes = args.sizes();
    let elem = args.dtype.size_bytes() as u64;
    let specs: Vec<_> = sizes
        .iter()
        .map(|&s| odc_core::BucketSpec::new(format!("size-{s}"), (s / elem) as usize, args.dtype))
        .collect();
    engine.register(&specs).map_err(|e| e.to_string())?;
    let page = BenchPage::open(job, args.ranks, timeout).map_err(|e| e.to_string())?;
    Ok(RankCtx {
        rank,
        engine,
        page,
        sizes,
    })
}

/// Integer-valued test pattern, exact in f32, bf16 and f16.
pub fn pattern(rank: usize, i: usize) -> f32 {
    ((rank * 7 + i) % 61) as f32
}

/// Encodes `values` as `dtype` bytes.
pub fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * dtype.size_bytes()];
    let src: &[u8] = bytemuck::cast_slice(values);
    // f32 → dtype; the values are small integers, exact in every dtype.
    if odc_kernels::cpu::cast(src, DType::F32, &mut out, dtype).is_err() {
        out.clear();
    }
    out
}

/// Decodes `bytes` of `dtype` into f32.
pub fn decode(bytes: &[u8], dtype: DType) -> Vec<f32> {
    let n = bytes.len() / dtype.size_bytes();
    let mut out = vec![0f32; n];
    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
    if odc_kernels::cpu::cast(bytes, dtype, dst, DType::F32).is_err() {
        out.iter_mut().for_each(|v| *v = f32::NAN);
    }
    out
}

/// The main of a perf binary: launcher when `--rank` is absent, else one rank.
pub fn perf_main(
    title: &'static str,
    help: PerfHelp,
    in_place: bool,
    run_rank: fn(&PerfArgs, RankCtx) -> Result<Vec<Row>, String>,
) -> ExitCode {
    let args = PerfArgs::parse_as(title, help);
    let Some(rank) = args.rank else {
        return launch(&args);
    };
    if rank == 0 && args.json.is_some() {
        sample_load(); // rank 0 writes the JSON; it lives as long as the run
    }
    let result = join(&args, rank).and_then(|ctx| {
        if rank == 0 {
            print_header(title, &args, in_place);
        }
        run_rank(&args, ctx)
    });
    match result {
        Ok(rows) => {
            if rank == 0 {
                if let Some(path) = &args.json {
                    if let Err(e) = write_json(path, title, &args, &rows) {
                        eprintln!("error: {e}");
                        return ExitCode::FAILURE;
                    }
                }
                if rows.iter().any(|r| r.wrong > 0) {
                    eprintln!("error: wrong results (see #wrong)");
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {rank}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Builds the row for `size` after the ranks reported (call on rank 0 after a barrier).
pub fn make_row(args: &PerfArgs, size: u64, redop: &str, page: &BenchPage, limit_gbps: f64) -> Row {
    let (t, wrong) = page.collect();
    let secs = t.as_secs_f64().max(1e-12);
    let algbw = size as f64 / secs / 1e9;
    let n = args.ranks as f64;
    Row {
        size,
        count: size / args.dtype.size_bytes() as u64,
        dtype: args.dtype.name().to_string(),
        redop: redop.to_string(),
        time_us: secs * 1e6,
        algbw,
        busbw: algbw * (n - 1.0) / n,
        wrong,
        limit_busbw: limit_gbps,
        ceiling_busbw: 0.0,
        best_busbw: 0.0,
        ceiling_note: None,
        in_place: None,
    }
}

/// The in-place result for `size` after the ranks reported (rank 0, after
/// a barrier).
pub fn make_in_place(args: &PerfArgs, size: u64, page: &BenchPage) -> InPlace {
    let (t, wrong) = page.collect();
    let secs = t.as_secs_f64().max(1e-12);
    let algbw = size as f64 / secs / 1e9;
    let n = args.ranks as f64;
    InPlace {
        time_us: secs * 1e6,
        algbw,
        busbw: algbw * (n - 1.0) / n,
        wrong,
    }
}
