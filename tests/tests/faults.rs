//! Faults across processes: a rank that dies mid-minibatch is named by every
//! other rank well within the deadline; bad input and mismatched
//! registration give clear errors, never a panic or a hang.

#![allow(clippy::unwrap_used)] // test helpers, not #[test] fns

use std::time::Duration;

use odc_tests::{assert_survivors_name, describe, Job, EXIT_EXPECTED_ERROR, EXIT_OK};

const WORKER: &str = env!("CARGO_BIN_EXE_odc-rank-worker");

fn job<'a>(
    scenario: &'a str,
    world: usize,
    dir: &'a std::path::Path,
    key: &'a str,
    env: &[(&str, &str)],
) -> Job<'a> {
    Job {
        worker: WORKER,
        scenario,
        world,
        store_dir: dir,
        job_key: key,
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        limit: Duration::from_secs(30),
    }
}

fn crash(at: &str, minibatch: &str) {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_crash_{at}", std::process::id());
    let crash_rank = 2;
    let out = job(
        "train",
        4,
        dir.path(),
        &key,
        &[
            ("ODC_TIMEOUT_S", "5"),
            ("ODC_EXPECT_ERROR", "1"),
            ("ODC_CRASH_RANK", "2"),
            ("ODC_CRASH_AT", at),
            ("ODC_CRASH_MINIBATCH", minibatch),
            ("ODC_MINIBATCHES", "3"),
        ],
    )
    .run();
    assert_survivors_name(&out, crash_rank, Duration::from_secs(8));
    // The crashed rank's segments stay until the next start of the job.
    let dir2 = tempfile::tempdir().unwrap();
    let out = job("train", 2, dir2.path(), &key, &[("ODC_TIMEOUT_S", "10")]).run();
    odc_tests::assert_all_ok(&out);
    assert!(
        odc_tests::shm_segments(&key).is_empty(),
        "stale segments not swept"
    );
}

#[test]
fn rank_dying_before_finish_is_named() {
    crash("before_finish", "1");
}

#[test]
fn rank_dying_before_publish_is_named() {
    crash("before_publish", "1");
}

#[test]
fn bad_input_gives_layout_errors() {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_bad", std::process::id());
    let out = job("bad_input", 2, dir.path(), &key, &[("ODC_TIMEOUT_S", "10")]).run();
    for o in &out {
        assert_eq!(o.code, Some(EXIT_OK), "{}", describe(&out));
        assert_eq!(
            o.stdout.matches("LAYOUT ").count(),
            10,
            "{}",
            describe(&out)
        );
    }
}

#[test]
fn mismatched_registration_names_first_differing_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_mismatch", std::process::id());
    let out = job(
        "mismatch",
        3,
        dir.path(),
        &key,
        &[
            ("ODC_TIMEOUT_S", "10"),
            ("ODC_EXPECT_ERROR", "1"),
            ("ODC_BAD_RANK", "1"),
        ],
    )
    .run();
    for o in &out {
        assert_eq!(o.code, Some(EXIT_EXPECTED_ERROR), "{}", describe(&out));
        assert!(
            o.stdout.contains("kind=Registration") && o.stdout.contains("bucket=1"),
            "{}",
            describe(&out)
        );
        assert!(
            o.stdout.contains("y numel=11 dtype=bf16")
                && o.stdout.contains("y numel=10 dtype=bf16"),
            "{}",
            describe(&out)
        );
    }
}

#[test]
fn stalled_rank_times_out_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_stall", std::process::id());
    let out = job(
        "train",
        3,
        dir.path(),
        &key,
        &[
            ("ODC_TIMEOUT_S", "1.5"),
            ("ODC_EXPECT_ERROR", "1"),
            ("ODC_CRASH_RANK", "1"),
            ("ODC_CRASH_AT", "before_finish"),
            ("ODC_STALL", "1"),
            ("ODC_STALL_S", "4"),
        ],
    )
    .run();
    for o in out.iter().filter(|o| o.rank != 1) {
        assert_eq!(o.code, Some(EXIT_EXPECTED_ERROR), "{}", describe(&out));
        assert!(
            o.stdout.contains("kind=PeerTimeout peer=1"),
            "{}",
            describe(&out)
        );
        assert!(
            o.elapsed < Duration::from_secs(3),
            "rank {} took {:?}",
            o.rank,
            o.elapsed
        );
    }
    // The stalled rank exits without dropping its engine; the next start of
    // the job removes its segments.
    let dir2 = tempfile::tempdir().unwrap();
    odc_tests::assert_all_ok(&job("train", 2, dir2.path(), &key, &[("ODC_TIMEOUT_S", "10")]).run());
    assert!(
        odc_tests::shm_segments(&key).is_empty(),
        "stale segments not swept"
    );
}
