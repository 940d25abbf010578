//! The perf binaries run end to end at tiny sizes, check their own results
//! and reject bad flags with a message naming them.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn run(bin: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "-b",
        "4K",
        "-e",
        "64K",
        "-f",
        "4",
        "-n",
        "3",
        "-w",
        "1",
        "--timeout",
        "30",
    ];
    if !extra.contains(&"-g") {
        args.extend(["-g", "2"]);
    }
    let out = Command::new(bin)
        .args(args)
        .args(extra)
        .output()
        .expect("spawn perf binary");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn check_json(path: &std::path::Path, bench: &str) {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(doc["benchmark"], bench);
    // What made it, as the docs' benchmark pages show it: the command as typed (not a rank's, with the
    // launcher's --rank and --job-dir), the commit, the date.
    let command = doc["provenance"]["command"].as_str().unwrap();
    assert!(
        command.contains(bench) && command.contains(" -J ") && !command.contains("--rank"),
        "{command}"
    );
    assert!(doc["provenance"]["date"]
        .as_str()
        .unwrap()
        .ends_with("+00:00"));
    assert!(doc["provenance"].get("commit").is_some());
    // The load average sampled while it ran (rank 0 starts sampling at its start; the last sample is taken
    // as the JSON is written), against the machine's cores: what the docs require of a figure shown first.
    let load = &doc["provenance"]["load"];
    assert!(load["cpus"].as_u64().unwrap() > 0, "{load}");
    let samples = load["samples"].as_array().unwrap();
    assert!(samples.len() >= 2, "{load}");
    assert!(
        samples.iter().all(|s| s[1].as_f64().unwrap() >= 0.0),
        "{load}"
    );
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "sizes 4K, 16K, 64K");
    for r in rows {
        assert_eq!(r["wrong"], 0, "{r}");
        let busbw = r["busbw"].as_f64().unwrap();
        assert!(busbw > 0.0);
        assert!(r["ceiling_busbw"].as_f64().unwrap() > 0.0, "{r}");
        // %ceil's operation side is the slowest rank's fastest iteration
        // of the better variant, never below that variant's mean.
        let mean = r["in_place"]["busbw"]
            .as_f64()
            .map_or(busbw, |ip| ip.max(busbw));
        assert!(
            r["best_busbw"].as_f64().unwrap() >= mean * (1.0 - 1e-9),
            "{r}"
        );
    }
}

#[test]
fn gather_perf_small_sweep_is_correct() {
    for dtype in ["f32", "bf16", "f16"] {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("g.json");
        let (code, stdout, stderr) = run(
            env!("CARGO_BIN_EXE_gather_perf"),
            &["-d", dtype, "-J", json.to_str().unwrap()],
        );
        assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(stdout.contains("busbw"));
        check_json(&json, "gather_perf");
    }
}

#[test]
fn scatter_accumulate_perf_small_sweep_is_correct() {
    for dtype in ["f32", "bf16"] {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("s.json");
        let (code, stdout, stderr) = run(
            env!("CARGO_BIN_EXE_scatter_accumulate_perf"),
            &[
                "-d",
                dtype,
                "-J",
                json.to_str().unwrap(),
                "--chunk-bytes",
                "4K",
            ],
        );
        assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
        check_json(&json, "scatter_accumulate_perf");
    }
}

#[test]
fn help_says_what_each_binary_measures_and_gives_examples() {
    for (bin, name, what) in [
        (env!("CARGO_BIN_EXE_gather_perf"), "gather_perf", "gather"),
        (
            env!("CARGO_BIN_EXE_scatter_accumulate_perf"),
            "scatter_accumulate_perf",
            "scatter-accumulate",
        ),
        (
            env!("CARGO_BIN_EXE_scale_perf"),
            "scale_perf",
            "grow with D",
        ),
        (
            env!("CARGO_BIN_EXE_gpu_kernels_perf"),
            "gpu_kernels_perf",
            "device-to-device copy",
        ),
    ] {
        let out = Command::new(bin).arg("--help").output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{name} --help: {text}");
        assert!(text.contains(&format!("Usage: {name}")), "{name}: {text}");
        assert!(text.contains(what), "{name}: {text}");
        // The examples come after the flags, each a command line of the binary itself.
        let (flags, examples) = text
            .split_once("\nExamples:\n")
            .unwrap_or_else(|| panic!("{name}: {text}"));
        assert!(flags.contains("Options:"), "{name}: {text}");
        let commands: Vec<&str> = examples
            .lines()
            .filter(|l| l.trim_start().starts_with(&format!("{name} ")) || l.trim() == name)
            .collect();
        assert!(commands.len() >= 2, "{name}: {examples}");
    }
}

#[test]
fn bad_flags_exit_2_with_a_message() {
    let (code, _, stderr) = run(env!("CARGO_BIN_EXE_gather_perf"), &["-g", "1"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("-g 1"), "{stderr}");
    let (code, _, stderr) = run(env!("CARGO_BIN_EXE_gather_perf"), &["-d", "int8"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("int8"), "{stderr}");
}

#[test]
fn transport_flag_runs_fabric_or_says_it_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("f.json");
    for bin in [
        env!("CARGO_BIN_EXE_gather_perf"),
        env!("CARGO_BIN_EXE_scatter_accumulate_perf"),
    ] {
        let (code, stdout, stderr) = run(
            bin,
            &["--transport", "fabric", "-J", json.to_str().unwrap()],
        );
        if cfg!(feature = "fabric") {
            assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
            assert!(stdout.contains("transport=fabric"), "{stdout}");
            let doc: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
            assert_eq!(doc["transport"], "fabric");
            assert!(doc["rows"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["wrong"] == 0));
        } else {
            assert_eq!(code, 2, "stdout:\n{stdout}\nstderr:\n{stderr}");
            assert!(stderr.contains("--transport fabric"), "{stderr}");
        }
    }
    let (code, _, stderr) = run(env!("CARGO_BIN_EXE_gather_perf"), &["--transport", "ucx"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("ucx"), "{stderr}");
}
