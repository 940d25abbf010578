//! A panic in a rank's shard server daemon (a bug, injected here with
//! `ODC_FAULT_SERVER_PANIC`) ends neither the process nor the job silently:
//! the rank's next engine call fails naming itself and what its daemon was
//! doing, and the other ranks name it well within their deadline.

#![allow(clippy::unwrap_used)] // test helpers, not #[test] fns

use std::time::Duration;

use odc_tests::{describe, Job, EXIT_EXPECTED_ERROR};

const WORKER: &str = env!("CARGO_BIN_EXE_odc-rank-worker");

#[test]
fn a_panic_in_a_daemon_is_an_error_naming_its_rank_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_server_panic", std::process::id());
    let out = Job {
        worker: WORKER,
        scenario: "train",
        world: 3,
        store_dir: dir.path(),
        job_key: &key,
        env: [
            ("ODC_TIMEOUT_S", "30"),
            ("ODC_EXPECT_ERROR", "1"),
            ("ODC_MINIBATCHES", "3"),
            // The daemon of rank 1 panics at the first chunk a peer pushes to it.
            ("ODC_FAULT_SERVER_PANIC", "1:1"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        limit: Duration::from_secs(60),
    }
    .run();
    for o in &out {
        // An exit code, not a signal: nothing aborted.
        assert_eq!(o.code, Some(EXIT_EXPECTED_ERROR), "{}", describe(&out));
        // Named at once (retired, woken), not at the 30 s deadline.
        assert!(o.elapsed < Duration::from_secs(15), "{}", describe(&out));
        if o.rank == 1 {
            assert!(
                o.stdout.contains("kind=Internal")
                    && o.stdout.contains(
                        "rank 1: internal error in ODC while its shard server thread was \
                         adding rank "
                    )
                    && o.stdout.contains("injected by ODC_FAULT_SERVER_PANIC"),
                "{}",
                describe(&out)
            );
        } else {
            assert!(
                o.stdout.contains("kind=PeerDied peer=1")
                    || o.stdout.contains("kind=PeerTimeout peer=1"),
                "rank {} did not name rank 1:\n{}",
                o.rank,
                describe(&out)
            );
        }
    }
}

#[test]
fn a_malformed_fault_variable_is_a_configuration_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_bad_fault", std::process::id());
    let out = Job {
        worker: WORKER,
        scenario: "train",
        world: 2,
        store_dir: dir.path(),
        job_key: &key,
        env: [
            ("ODC_TIMEOUT_S", "10"),
            ("ODC_EXPECT_ERROR", "1"),
            ("ODC_FAULT_SERVER_PANIC", "1:0"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        limit: Duration::from_secs(60),
    }
    .run();
    for o in &out {
        assert_eq!(o.code, Some(EXIT_EXPECTED_ERROR), "{}", describe(&out));
        assert!(
            o.stdout.contains("kind=Config") && o.stdout.contains("ODC_FAULT_SERVER_PANIC=\"1:0\""),
            "{}",
            describe(&out)
        );
    }
}
