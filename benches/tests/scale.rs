//! `scale_perf` at sizes this 2-core machine runs in seconds (8 and 32
//! ranks, full and hybrid-zero sharding): every sum exact, every
//! microbatch of a list many thieves steal from claimed once, a killed rank
//! named by every survivor in time, idle daemons idle, per-rank memory and
//! store bytes growing no faster than linearly in D and store requests not
//! at all, so that a regression to quadratic shows here rather than at 256
//! ranks. And 16 ranks in two emulated nodes over `mixed` (libfabric `tcp`
//! between them): a rank killed on one node is named on the other well
//! within the fabric probe's 2 s timeout.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn sweep(ranks: &str, transport: &str, sharding: &str) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("scale.json");
    let out = Command::new(env!("CARGO_BIN_EXE_scale_perf"))
        .args(["--ranks", ranks, "--transport", transport])
        .args(["--sharding", sharding, "--bucket-bytes", "256K"])
        .args([
            "--minibatches",
            "3",
            "--idle-s",
            "1",
            "--timeout",
            "60",
            "-J",
        ])
        .arg(&json)
        .output()
        .expect("spawn scale_perf");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

/// Growth exponent of `field` between the two world sizes.
fn growth(points: &[serde_json::Value], field: &str) -> f64 {
    let (a, b) = (&points[0], &points[1]);
    let ratio = b[field].as_f64().unwrap() / a[field].as_f64().unwrap();
    let d = b["ranks"].as_f64().unwrap() / a["ranks"].as_f64().unwrap();
    ratio.ln() / d.ln()
}

#[test]
fn eight_and_thirty_two_ranks_sum_exactly_name_a_killed_rank_and_grow_linearly() {
    for sharding in ["full", "hybrid-zero"] {
        let doc = sweep("8,32", "shm", sharding);
        let points = doc["points"].as_array().unwrap();
        assert_eq!(points.len(), 2, "{doc}");
        for p in points {
            let d = p["ranks"].as_u64().unwrap();
            assert_eq!(p["wrong"], 0, "{sharding}: {p}");
            assert_eq!(p["survivors"].as_u64().unwrap(), d - 1, "{sharding}: {p}");
            assert_eq!(
                p["named"], p["survivors"],
                "{sharding}: every survivor names the rank: {p}"
            );
            assert!(p["detect_s"].as_f64().unwrap() < 2.0, "{sharding}: {p}");
            // Rank 0's list (4 per rank of its group) claimed exactly once
            // between its own claims and every other rank's steals.
            assert_eq!(p["steal_wrong"], 0, "{sharding}: {p}");
            assert!(p["stolen"].as_u64().unwrap() > 0, "nothing stolen: {p}");
            // About 0.03 % measured here; the target is 0.1 % per daemon.
            assert!(
                p["idle_cpu_pct_max"].as_f64().unwrap() < 0.5,
                "{sharding}: {p}"
            );
        }
        // Prefaulting every peer's whole control region (2 · D landing
        // slots each) made each rank's resident shared memory grow as
        // D^1.7 between these sizes (3.2 → 33.8 MiB); a rank's own slots
        // in each peer grow it linearly at most.
        for field in ["rss_shmem_mib", "store_bytes_per_rank", "mappings"] {
            let e = growth(points, field);
            assert!(e < 1.2, "{sharding}: {field} grows as D^{e:.2}: {doc}");
        }
        // Every rank's posts are read with one batched request per step:
        // a rank's store requests do not grow with D (they did, 4 per
        // rank: 38 at 8 ranks, 134 at 32, when each post was its own read).
        let e = growth(points, "store_calls_per_rank");
        assert!(
            e.abs() < 0.2,
            "{sharding}: store requests per rank grow as D^{e:.2}: {doc}"
        );
    }
}

#[test]
fn a_rank_killed_on_another_node_is_named_within_a_second_over_mixed() {
    for sharding in ["full", "hybrid-zero"] {
        let doc = sweep("16", "mixed", sharding);
        let p = &doc["points"][0];
        assert_eq!(p["wrong"], 0, "{sharding}: {p}");
        assert_eq!(p["survivors"], 15, "{sharding}: {p}");
        assert_eq!(
            p["named"], 15,
            "{sharding}: every survivor names the rank: {p}"
        );
        // The survivors on the other node used to wait out the fabric
        // probe's 2 s timeout (2.3 s here: tcp leaves a read of a killed
        // peer pending); the news from the victim's node takes about 0.1 s.
        let s = p["detect_s"].as_f64().unwrap();
        assert!(s < 1.0, "{sharding}: named after {s} s: {p}");
    }
}
