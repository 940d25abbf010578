//! Multi-process integration tests for ODC live in `tests/tests/`; the rank
//! worker binary in `src/bin/`. This library is the harness both share: it
//! spawns one worker process per rank, bounds them in time, and collects
//! their exit codes and output.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Exit code of a worker whose scenario passed.
pub const EXIT_OK: i32 = 0;
/// Exit code of a worker that got an engine error the scenario expected.
pub const EXIT_EXPECTED_ERROR: i32 = 10;
/// Exit code of a worker that got an engine error it did not expect.
pub const EXIT_ENGINE_ERROR: i32 = 2;
/// Exit code of a worker whose check failed.
pub const EXIT_CHECK_FAILED: i32 = 3;

/// What one rank's process did.
#[derive(Debug)]
pub struct RankOutcome {
    /// The rank.
    pub rank: usize,
    /// Its exit code (`None` when killed by a signal or by the watchdog).
    pub code: Option<i32>,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
    /// How long it ran.
    pub elapsed: Duration,
    /// Whether the watchdog killed it.
    pub killed: bool,
}

/// A job to run: one worker process per rank.
#[derive(Debug, Clone)]
pub struct Job<'a> {
    /// Path of the `odc-rank-worker` binary.
    pub worker: &'a str,
    /// Scenario name.
    pub scenario: &'a str,
    /// World size.
    pub world: usize,
    /// Store directory (shared by all ranks).
    pub store_dir: &'a Path,
    /// Job key for shared-memory segment names.
    pub job_key: &'a str,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Watchdog: every process is killed after this long.
    pub limit: Duration,
}

fn spawn_reader(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

impl Job<'_> {
    /// Runs every rank to completion (or until the watchdog) and returns
    /// their outcomes in rank order.
    pub fn run(&self) -> Vec<RankOutcome> {
        let start = Instant::now();
        let mut children: Vec<(Child, _, _)> = (0..self.world)
            .map(|rank| {
                let mut cmd = Command::new(self.worker);
                cmd.env("ODC_RANK", rank.to_string())
                    .env("ODC_WORLD", self.world.to_string())
                    .env("ODC_STORE_DIR", self.store_dir)
                    .env("ODC_SCENARIO", self.scenario)
                    .env("ODC_JOB_KEY", self.job_key)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                for (k, v) in &self.env {
                    cmd.env(k, v);
                }
                let mut child = match cmd.spawn() {
                    Ok(c) => c,
                    Err(e) => panic!("cannot spawn {}: {e}", self.worker),
                };
                let out = child.stdout.take().map(spawn_reader);
                let err = child.stderr.take().map(spawn_reader);
                (child, out, err)
            })
            .collect();
        let mut done: Vec<Option<(Option<i32>, Duration, bool)>> = vec![None; self.world];
        while done.iter().any(Option::is_none) {
            for (rank, (child, _, _)) in children.iter_mut().enumerate() {
                if done[rank].is_some() {
                    continue;
                }
                if let Ok(Some(status)) = child.try_wait() {
                    done[rank] = Some((status.code(), start.elapsed(), false));
                } else if start.elapsed() > self.limit {
                    let _ = child.kill();
                    let _ = child.wait();
                    done[rank] = Some((None, start.elapsed(), true));
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        children
            .into_iter()
            .enumerate()
            .map(|(rank, (_, out, err))| {
                let (code, elapsed, killed) = done[rank].unwrap_or((None, Duration::ZERO, true));
                RankOutcome {
                    rank,
                    code,
                    stdout: out.and_then(|h| h.join().ok()).unwrap_or_default(),
                    stderr: err.and_then(|h| h.join().ok()).unwrap_or_default(),
                    elapsed,
                    killed,
                }
            })
            .collect()
    }
}

/// Panics with every rank's output unless all exited with `EXIT_OK`.
pub fn assert_all_ok(outcomes: &[RankOutcome]) {
    if outcomes.iter().any(|o| o.code != Some(EXIT_OK)) {
        panic!("some ranks failed:\n{}", describe(outcomes));
    }
}

/// Panics unless rank `crashed` aborted (died by a signal, not the watchdog)
/// and every other rank failed with an error naming it — `PeerDied` or
/// `PeerTimeout` with `peer=<crashed>` — in less than `within` after the
/// crashed rank was seen gone (its exit, to the harness's 5 ms poll): the
/// time to learn of the death, not the ranks' start-up, which a loaded
/// machine stretches.
pub fn assert_survivors_name(outcomes: &[RankOutcome], crashed: usize, within: Duration) {
    let died = outcomes
        .iter()
        .find(|o| o.rank == crashed)
        .map_or(Duration::ZERO, |o| o.elapsed);
    let named = [
        format!("kind=PeerDied peer={crashed}"),
        format!("kind=PeerTimeout peer={crashed}"),
    ];
    for o in outcomes {
        if o.rank == crashed {
            assert!(
                o.code.is_none() && !o.killed,
                "rank {crashed} should abort:\n{}",
                describe(outcomes)
            );
            continue;
        }
        assert_eq!(o.code, Some(EXIT_EXPECTED_ERROR), "{}", describe(outcomes));
        assert!(
            named.iter().any(|n| o.stdout.contains(n.as_str())),
            "rank {} did not name rank {crashed}:\n{}",
            o.rank,
            describe(outcomes)
        );
        assert!(
            o.elapsed.saturating_sub(died) < within,
            "rank {} failed {:?} after rank {crashed} died ({:?} from the start)",
            o.rank,
            o.elapsed.saturating_sub(died),
            o.elapsed
        );
    }
}

/// Every rank's exit code and output, for failure messages.
pub fn describe(outcomes: &[RankOutcome]) -> String {
    outcomes
        .iter()
        .map(|o| {
            format!(
                "--- rank {} code {:?} killed {} after {:?}\nstdout:\n{}stderr:\n{}",
                o.rank, o.code, o.killed, o.elapsed, o.stdout, o.stderr
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Names of `/dev/shm` entries of job key `key`.
pub fn shm_segments(key: &str) -> Vec<String> {
    let prefix = format!("odc-{key}-");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}
