//! The engine as containers run it: a small `/dev/shm` (a mount namespace
//! with a tmpfs of a few MiB, like Docker's default 64 MiB scaled down),
//! ranks in separate pid namespaces sharing `/dev/shm`, and two jobs on
//! the default job key at once. Needs root and `unshare` (util-linux);
//! skipped with the reason where namespaces cannot be made.

#![allow(clippy::unwrap_used)] // test helpers, not #[test] fns

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use odc_tests::{describe, Job, RankOutcome, EXIT_EXPECTED_ERROR, EXIT_OK};

const WORKER: &str = env!("CARGO_BIN_EXE_odc-rank-worker");

/// Whether `unshare` can make the namespaces (`flags`); prints why not.
fn can_unshare(flags: &[&str]) -> bool {
    let ok = Command::new("unshare")
        .args(flags)
        .arg("true")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "skipped: `unshare {} true` failed here (needs root and util-linux)",
            flags.join(" ")
        );
    }
    ok
}

/// A launcher that runs rank 0 as it is and every other rank (every rank
/// with `ODC_ALL_NS=1`) in a pid namespace of its own, as the child of
/// that namespace's init (so an abort kills it like any process).
fn launcher(dir: &Path) -> String {
    let path = dir.join("in-own-pid-ns.sh");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\n\
             if [ \"$ODC_RANK\" = 0 ] && [ -z \"$ODC_ALL_NS\" ]; then exec {WORKER} \"$@\"; fi\n\
             exec unshare --pid --fork --kill-child sh -c '\"$0\" \"$@\"' {WORKER} \"$@\"\n"
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_string_lossy().into_owned()
}

fn job<'a>(
    worker: &'a str,
    world: usize,
    dir: &'a Path,
    key: &'a str,
    env: &[(&str, &str)],
) -> Job<'a> {
    Job {
        worker,
        scenario: "train",
        world,
        store_dir: dir,
        job_key: key,
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        limit: Duration::from_secs(90),
    }
}

fn assert_all_ok(out: &[RankOutcome]) {
    assert!(
        out.iter().all(|o| o.code == Some(EXIT_OK)),
        "{}",
        describe(out)
    );
    assert!(
        !out.iter().any(|o| o.stdout.contains("PeerDied")),
        "a false PeerDied:\n{}",
        describe(out)
    );
}

#[test]
fn ranks_in_separate_pid_namespaces_sum_exactly() {
    if !can_unshare(&["--pid", "--fork"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let worker = launcher(dir.path());
    let key = format!("t{}_pidns", std::process::id());
    // Rank 0 in this namespace, ranks 1 and 2 each in their own: each sees
    // the others' pids as nothing (or as someone else).
    let out = job(
        &worker,
        3,
        dir.path(),
        &key,
        &[
            ("ODC_TIMEOUT_S", "30"),
            ("ODC_MICRO", "2,0,3"),
            ("ODC_NUMELS", "3001,64"),
            ("ODC_MINIBATCHES", "4"),
            ("ODC_CHUNK", "512"),
            ("ODC_JITTER", "1"),
        ],
    )
    .run();
    assert_all_ok(&out);
    assert!(odc_tests::shm_segments(&key).is_empty(), "segments left");
}

#[test]
fn a_killed_rank_in_its_own_pid_namespace_is_named_dead() {
    if !can_unshare(&["--pid", "--fork"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let worker = launcher(dir.path());
    let key = format!("t{}_pidns_kill", std::process::id());
    let out = job(
        &worker,
        3,
        dir.path(),
        &key,
        &[
            ("ODC_TIMEOUT_S", "30"),
            ("ODC_EXPECT_ERROR", "1"),
            ("ODC_CRASH_RANK", "2"),
            ("ODC_CRASH_AT", "before_finish"),
            ("ODC_CRASH_MINIBATCH", "1"),
            ("ODC_MINIBATCHES", "3"),
        ],
    )
    .run();
    assert!(out[2].stdout.contains("CRASH rank=2"), "{}", describe(&out));
    for o in &out[..2] {
        assert_eq!(o.code, Some(EXIT_EXPECTED_ERROR), "{}", describe(&out));
        // Dead by the kernel's lock, long before the 30 s deadline; its pid
        // in another namespace says nothing.
        assert!(
            o.stdout.contains("kind=PeerDied peer=2"),
            "rank {} did not see rank 2 die:\n{}",
            o.rank,
            describe(&out)
        );
        assert!(
            o.elapsed < Duration::from_secs(10),
            "rank {} took {:?}",
            o.rank,
            o.elapsed
        );
    }
}

/// `odc-default-*` segments of this release (locked by their creator).
fn default_segments() -> Vec<String> {
    odc_tests::shm_segments("default")
        .into_iter()
        .filter(|n| n.contains("-l"))
        .collect()
}

#[test]
fn two_jobs_on_the_default_key_leave_each_other_alone() {
    if !can_unshare(&["--pid", "--fork"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let worker = launcher(dir.path());
    let (store_b, store_a) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let before = default_segments();
    let b_done = AtomicBool::new(false);
    std::thread::scope(|s| {
        // Job B, long, in this pid namespace.
        let b = s.spawn(|| {
            let out = job(
                WORKER,
                2,
                store_b.path(),
                "default",
                &[
                    ("ODC_TIMEOUT_S", "60"),
                    ("ODC_MINIBATCHES", "2500"),
                    ("ODC_JITTER", "1"),
                ],
            )
            .run();
            b_done.store(true, Ordering::Release);
            out
        });
        // Its segments, once it registered.
        let until = Instant::now() + Duration::from_secs(30);
        let b_segs = loop {
            let segs: Vec<String> = default_segments()
                .into_iter()
                .filter(|n| !before.contains(n))
                .collect();
            if segs.len() >= 6 {
                break segs;
            }
            assert!(Instant::now() < until, "job B never registered: {segs:?}");
            std::thread::sleep(Duration::from_millis(20));
        };
        // Job A, every rank in a pid namespace of its own (where B's pids
        // mean nothing): its start sweeps every key's stale segments.
        let out_a = job(
            &worker,
            2,
            store_a.path(),
            "default",
            &[
                ("ODC_ALL_NS", "1"),
                ("ODC_TIMEOUT_S", "30"),
                ("ODC_MINIBATCHES", "3"),
                ("ODC_MICRO", "1,2"),
            ],
        )
        .run();
        assert_all_ok(&out_a);
        let still = default_segments();
        let gone: Vec<&String> = b_segs.iter().filter(|n| !still.contains(n)).collect();
        let b_running = !b_done.load(Ordering::Acquire);
        let out_b = b.join().unwrap();
        assert_all_ok(&out_b);
        assert!(
            b_running,
            "job B finished before job A did: the sweep was not checked against a live job"
        );
        assert!(
            gone.is_empty(),
            "job A's sweep removed live job B's {gone:?}"
        );
    });
}

/// The body of the small-`/dev/shm` test, run by [`a_small_dev_shm_is_a_typed_error`]
/// inside a mount namespace whose `/dev/shm` is a 4 MiB tmpfs.
#[test]
#[ignore = "run by a_small_dev_shm_is_a_typed_error inside a mount namespace"]
fn small_dev_shm_inside() {
    assert_eq!(
        std::env::var("ODC_IN_SMALL_SHM").as_deref(),
        Ok("1"),
        "run by a_small_dev_shm_is_a_typed_error"
    );
    let free = odc_core::transport::shm::shm_free().unwrap();
    assert!(free <= 4 << 20, "not the small tmpfs: {free} bytes free");
    // One segment larger than the room: refused at creation (preallocated),
    // never a SIGBUS at its first touch.
    let t = odc_core::transport::shm::ShmTransport::new(0, 1, "smallshm", "j1").unwrap();
    use odc_core::Transport;
    match t.register(0, 8 << 20) {
        Err(odc_core::Error::ShmSpace {
            dir, needed, free, ..
        }) => {
            assert_eq!(dir, "/dev/shm");
            assert_eq!(needed, 8 << 20);
            assert!(free < needed, "{free}");
        }
        other => panic!("expected ShmSpace, got {other:?}"),
    }
    // Segments that fit are really there: touching every page is safe.
    let r = t.register(1, 1 << 20).unwrap();
    // SAFETY: our own fresh region of that length; nobody else maps it.
    unsafe { std::ptr::write_bytes(r.as_ptr(), 1, r.len()) };
    drop(r);
    drop(t);
    // A whole job that does not fit: every rank fails at registration with
    // the typed error naming /dev/shm and the bytes, at once (not at the
    // 60 s deadline).
    let dir = tempfile::tempdir().unwrap();
    let out = job(
        WORKER,
        2,
        dir.path(),
        "smallshmjob",
        &[
            ("ODC_TIMEOUT_S", "60"),
            ("ODC_EXPECT_ERROR", "1"),
            ("ODC_NUMELS", "300000"),
            ("ODC_CHUNK", "1048576"),
        ],
    )
    .run();
    for o in &out {
        assert_eq!(o.code, Some(EXIT_EXPECTED_ERROR), "{}", describe(&out));
        assert!(
            o.stdout.contains("kind=ShmSpace")
                && o.stdout.contains("/dev/shm")
                && o.stdout.contains("bytes needed")
                && o.stdout.contains("bytes free"),
            "{}",
            describe(&out)
        );
        assert!(o.elapsed < Duration::from_secs(20), "{}", describe(&out));
    }
    assert!(odc_tests::shm_segments("smallshmjob").is_empty());
}

#[test]
fn a_small_dev_shm_is_a_typed_error() {
    if !can_unshare(&["--mount", "--propagation", "private"]) {
        return;
    }
    let me = std::env::current_exe().unwrap();
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(
            "mount -t tmpfs -o size=4m tmpfs /dev/shm && exec \"$0\" --exact small_dev_shm_inside \
             --ignored --nocapture --test-threads 1",
        )
        .arg(&me)
        .env("ODC_IN_SMALL_SHM", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "the test inside the mount namespace failed:\n{text}"
    );
}
