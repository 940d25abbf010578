//! Shared-memory segments: created 0600, gone after drop, and a crashed
//! job's leftovers removed at the next start of any job, whatever its key.

#![allow(clippy::unwrap_used)] // test helpers, not #[test] fns

use std::time::Duration;

use odc_tests::{assert_all_ok, describe, shm_segments, Job};

const WORKER: &str = env!("CARGO_BIN_EXE_odc-rank-worker");

/// Held by each test: any engine's start sweeps every key's leftovers, so
/// one test's start would remove the leftovers the other is looking at.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn job<'a>(dir: &'a std::path::Path, key: &'a str, env: &[(&str, &str)]) -> Job<'a> {
    Job {
        worker: WORKER,
        scenario: "segments",
        world: 2,
        store_dir: dir,
        job_key: key,
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        limit: Duration::from_secs(30),
    }
}

#[test]
fn segments_are_private_and_unlinked_on_drop() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_seg", std::process::id());
    let out = job(dir.path(), &key, &[("ODC_TIMEOUT_S", "10")]).run();
    assert_all_ok(&out);
    for o in &out {
        assert!(
            o.stdout.contains("MODE ok 3") && o.stdout.contains("GONE ok"),
            "{}",
            describe(&out)
        );
    }
    assert!(shm_segments(&key).is_empty());
}

#[test]
fn stale_segments_of_any_key_are_swept_at_next_start() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_stale", std::process::id());
    // Both ranks abort right after registering: six segments stay behind.
    let out = job(
        dir.path(),
        &key,
        &[
            ("ODC_TIMEOUT_S", "10"),
            ("ODC_CRASH_RANK", "0"),
            ("ODC_CRASH_AT", "after_register"),
        ],
    )
    .run();
    assert!(out[0].code.is_none(), "{}", describe(&out));
    let stale = shm_segments(&key);
    assert!(
        stale.len() >= 3,
        "expected leftovers of the aborted rank, found {stale:?}\n{}",
        describe(&out)
    );
    // The next job has a key of its own (as the "odc" process group's and
    // most launchers' keys are); its start removes the leftovers anyway.
    // That a live job's segments survive another's start is
    // containers.rs's two_jobs_on_the_default_key_leave_each_other_alone.
    let dir2 = tempfile::tempdir().unwrap();
    let other = format!("t{}_next", std::process::id());
    let out = job(dir2.path(), &other, &[("ODC_TIMEOUT_S", "10")]).run();
    assert_all_ok(&out);
    assert!(
        shm_segments(&key).is_empty(),
        "left: {:?}",
        shm_segments(&key)
    );
    assert!(shm_segments(&other).is_empty());
}
