//! Gather and scatter-accumulate across real processes: exact sums for every
//! dtype and sizes not divisible by D, uneven microbatch counts, and many
//! minibatches of publish → gather → scatter → finish → step → publish.

#![allow(clippy::unwrap_used)] // test helpers, not #[test] fns

use std::time::Duration;

use odc_tests::{assert_all_ok, Job};

const WORKER: &str = env!("CARGO_BIN_EXE_odc-rank-worker");

fn train(name: &str, world: usize, env: &[(&str, &str)]) {
    run("train", name, world, env);
}

fn run(scenario: &str, name: &str, world: usize, env: &[(&str, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    let key = format!("t{}_{name}", std::process::id());
    let mut env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.push(("ODC_TIMEOUT_S".into(), "30".into()));
    let job = Job {
        worker: WORKER,
        scenario,
        world,
        store_dir: dir.path(),
        job_key: &key,
        env,
        limit: Duration::from_secs(60),
    };
    let out = job.run();
    assert_all_ok(&out);
    assert!(
        odc_tests::shm_segments(&key).is_empty(),
        "segments left behind"
    );
}

#[test]
fn two_ranks_every_dtype() {
    for dtype in ["f32", "bf16", "f16"] {
        train(
            &format!("w2{dtype}"),
            2,
            &[
                ("ODC_DTYPE", dtype),
                ("ODC_NUMELS", "1001,37,4096"),
                ("ODC_CHUNK", "512"),
            ],
        );
    }
}

#[test]
fn four_ranks_every_dtype_and_mixed_grads() {
    for dtype in ["f32", "bf16", "f16"] {
        train(
            &format!("w4{dtype}"),
            4,
            &[
                ("ODC_DTYPE", dtype),
                ("ODC_NUMELS", "999,5,3000"),
                ("ODC_CHUNK", "256"),
            ],
        );
    }
    train(
        "w4mixed",
        4,
        &[
            ("ODC_DTYPE", "bf16"),
            ("ODC_GRAD_DTYPE", "f32"),
            ("ODC_NUMELS", "777"),
        ],
    );
}

#[test]
fn eight_ranks() {
    train(
        "w8f32",
        8,
        &[
            ("ODC_DTYPE", "f32"),
            ("ODC_NUMELS", "10007,3"),
            ("ODC_CHUNK", "1024"),
        ],
    );
    train(
        "w8bf16",
        8,
        &[("ODC_DTYPE", "bf16"), ("ODC_NUMELS", "5000")],
    );
}

#[test]
fn uneven_microbatches_finish_without_stalls() {
    // Rank 0 runs one microbatch, rank 1 seven, rank 2 none, rank 3 three.
    train(
        "uneven",
        4,
        &[
            ("ODC_MICRO", "1,7,0,3"),
            ("ODC_NUMELS", "2049,100"),
            ("ODC_MINIBATCHES", "3"),
            ("ODC_CHUNK", "256"),
        ],
    );
}

#[test]
fn twenty_minibatches_never_mix_versions() {
    // Parameters are stamped with their version; every gather checks every
    // element, with timing jitter so fast readers race slow owners.
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
fn publish_waits_for_releases_so_reads_never_tear() {
    // No finish between versions: only release → publish orders the reads.
    run(
        "publish_gather",
        "pubgather",
        3,
        &[
            ("ODC_VERSIONS", "12"),
            ("ODC_JITTER", "1"),
            ("ODC_NUMEL", "30000"),
        ],
    );
}

#[test]
fn large_shards_stream_and_never_tear() {
    // Shards just over 16 MiB: every read of one is a streaming copy
    // (odc_kernels::cpu::STREAM_COPY_MIN), of a length no vector divides.
    let numel = (1usize << 23) + 3;
    assert!(numel / 2 * 4 >= odc_kernels::cpu::STREAM_COPY_MIN);
    run(
        "publish_gather",
        "pubgather_large",
        2,
        &[
            ("ODC_VERSIONS", "3"),
            ("ODC_JITTER", "1"),
            ("ODC_NUMEL", &numel.to_string()),
        ],
    );
}
