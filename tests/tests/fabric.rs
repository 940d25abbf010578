//! The engine on the libfabric transport (tcp over loopback) across real
//! processes: exact gather / scatter-accumulate sums, uneven microbatches,
//! and a killed rank named by every survivor within the deadline. Built
//! only with the `fabric` feature (`cargo test -p odc-tests --features
//! fabric`).

#![cfg(feature = "fabric")]
#![allow(clippy::unwrap_used)] // test helpers, not #[test] fns

use std::time::Duration;

use odc_tests::{assert_all_ok, assert_survivors_name, describe, Job, EXIT_EXPECTED_ERROR};

const WORKER: &str = env!("CARGO_BIN_EXE_odc-rank-worker");

fn job<'a>(
    world: usize,
    dir: &'a std::path::Path,
    key: &'a str,
    env: &[(&str, &str)],
    limit: Duration,
) -> Job<'a> {
    let mut env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.push(("ODC_TRANSPORT".into(), "fabric".into()));
    Job {
        worker: WORKER,
        scenario: "train",
        world,
        store_dir: dir,
        job_key: key,
        env,
        limit,
    }
}

/// Where libfabric cannot be loaded the tests pass with a message.
fn skip() -> bool {
    let missing = !odc_core::transport::fabric::is_present();
    if missing {
        eprintln!("skipped: libfabric.so.1 cannot be loaded here");
    }
    missing
}

fn train(name: &str, world: usize, env: &[(&str, &str)]) {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_fab_{name}", std::process::id());
    let mut env = env.to_vec();
    env.push(("ODC_TIMEOUT_S", "30"));
    let out = job(world, dir.path(), &key, &env, Duration::from_secs(90)).run();
    assert_all_ok(&out);
    assert!(
        odc_tests::shm_segments(&key).is_empty(),
        "the fabric transport left shared-memory segments"
    );
}

#[test]
fn fabric_two_ranks_exact_sums() {
    for dtype in ["f32", "bf16"] {
        train(
            &format!("w2{dtype}"),
            2,
            &[
                ("ODC_DTYPE", dtype),
                ("ODC_NUMELS", "1001,37,4096"),
                ("ODC_CHUNK", "512"),
                ("ODC_MINIBATCHES", "3"),
            ],
        );
    }
}

#[test]
fn fabric_four_ranks_uneven_microbatches() {
    train(
        "w4uneven",
        4,
        &[
            ("ODC_MICRO", "1,5,0,3"),
            ("ODC_NUMELS", "2049,100"),
            ("ODC_MINIBATCHES", "3"),
            ("ODC_CHUNK", "256"),
        ],
    );
}

#[test]
fn fabric_twenty_minibatches_with_jitter_never_mix_versions() {
    train(
        "versions",
        4,
        &[
            ("ODC_MINIBATCHES", "20"),
            ("ODC_NUMELS", "3001,64"),
            ("ODC_JITTER", "1"),
            ("ODC_MICRO", "2,1,3,1"),
        ],
    );
}

#[test]
fn fabric_eight_ranks() {
    train(
        "w8",
        8,
        &[
            ("ODC_DTYPE", "bf16"),
            ("ODC_NUMELS", "10007,3"),
            ("ODC_CHUNK", "1024"),
        ],
    );
}

/// More peers than one fan-out batch of pure signals (versions, releases,
/// done words go out 16 at a time, their completions awaited together).
#[test]
fn fabric_twenty_ranks_signal_in_batches() {
    train(
        "w20",
        20,
        &[("ODC_NUMELS", "4099,3"), ("ODC_MINIBATCHES", "3")],
    );
}

#[test]
fn fabric_four_ranks_large_chunks() {
    train(
        "w4large",
        4,
        &[
            ("ODC_DTYPE", "f32"),
            ("ODC_NUMELS", "600000,3"),
            ("ODC_MINIBATCHES", "2"),
        ],
    );
}

fn crash(at: &str) {
    crash_with(at, &[]);
}

fn crash_with(at: &str, extra: &[(&str, &str)]) {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_fab_crash_{at}{}", std::process::id(), extra.len());
    let mut env = vec![
        ("ODC_TIMEOUT_S", "5"),
        ("ODC_EXPECT_ERROR", "1"),
        ("ODC_CRASH_RANK", "2"),
        ("ODC_CRASH_AT", at),
        ("ODC_CRASH_MINIBATCH", "1"),
        ("ODC_MINIBATCHES", "3"),
    ];
    env.extend_from_slice(extra);
    let out = job(4, dir.path(), &key, &env, Duration::from_secs(40)).run();
    // Rank 2 aborts by SIGABRT (the transport keeps the signal handlers a
    // libfabric dependency would install at load) and prints CRASH first.
    assert!(
        out.iter()
            .any(|o| o.rank == 2 && o.stdout.contains("CRASH rank=2")),
        "{}",
        describe(&out)
    );
    assert_survivors_name(&out, 2, Duration::from_secs(9));
}

#[test]
fn fabric_rank_killed_before_finish_is_named() {
    crash("before_finish");
}

#[test]
fn fabric_rank_killed_before_publish_is_named() {
    crash("before_publish");
}

// The same jobs with the progress threads holding back and shuffling
// every completion (`ODC_FABRIC_REORDER`, seeded per rank): nothing may
// rely on two operations completing in the order they were posted.

#[test]
fn fabric_shuffled_completions_exact_sums() {
    train(
        "shuffled",
        4,
        &[
            ("ODC_FABRIC_REORDER", "1"),
            ("ODC_DTYPE", "bf16"),
            ("ODC_MICRO", "1,4,0,2"),
            ("ODC_NUMELS", "2049,100,7"),
            ("ODC_MINIBATCHES", "4"),
            ("ODC_CHUNK", "256"),
            ("ODC_JITTER", "1"),
        ],
    );
}

#[test]
fn fabric_shuffled_completions_killed_rank_is_named() {
    crash_with("before_finish", &[("ODC_FABRIC_REORDER", "2")]);
}

#[test]
fn fabric_stalled_rank_is_named_at_the_deadline() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_fab_stall", std::process::id());
    let out = job(
        3,
        dir.path(),
        &key,
        &[
            ("ODC_TIMEOUT_S", "2"),
            ("ODC_EXPECT_ERROR", "1"),
            ("ODC_CRASH_RANK", "1"),
            ("ODC_CRASH_AT", "before_finish"),
            ("ODC_STALL", "1"),
            ("ODC_STALL_S", "5"),
        ],
        Duration::from_secs(40),
    )
    .run();
    for o in out.iter().filter(|o| o.rank != 1) {
        assert_eq!(o.code, Some(EXIT_EXPECTED_ERROR), "{}", describe(&out));
        // Alive but stuck: its progress thread still answers probes, so
        // the deadline names it (or a peer that timed out on it first).
        assert!(
            o.stdout.contains("kind=PeerTimeout peer=1")
                || o.stdout.contains("kind=PeerDied peer=1"),
            "{}",
            describe(&out)
        );
        assert!(
            o.elapsed < Duration::from_secs(5),
            "rank {} took {:?}",
            o.rank,
            o.elapsed
        );
    }
}
