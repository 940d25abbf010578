//! End-to-end tests of the `odc-pack` binary.

// Test helpers may unwrap: a failure here is a test failure.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_odc-pack");

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn run_stdin(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts exit code 2, one `error:` line, no panic, mentioning `needles`.
fn assert_bad(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in {err:?}");
    }
}

/// A file under cargo's scratch folder for integration tests (inside
/// `target/`, one per name, rewritten by every run), so a run leaves nothing
/// in the system's temporary folder.
fn temp_file(name: &str, contents: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("odc-pack-cli");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn empty_input() {
    assert_bad(
        &run_stdin(&["--lengths", "-"], "\n\n"),
        &["no sequence lengths"],
    );
}

#[test]
fn zero_length() {
    assert_bad(
        &run_stdin(&["--lengths", "-"], "5\n0\n7\n"),
        &["stdin: ", "line 2", "zero"],
    );
}

#[test]
fn a_refused_value_names_its_file() {
    let path = temp_file("bad-lengths.txt", "5\nabc\n");
    let shown = path.display().to_string();
    assert_bad(
        &run(&["--lengths", &shown]),
        &[&format!("{shown}: "), "line 2", "abc"],
    );
    let path = temp_file("bad-timings.txt", "100 0.1\n200 -3\n");
    let shown = path.display().to_string();
    assert_bad(
        &run(&["--fit-cost", &shown]),
        &[&format!("{shown}: "), "line 2", "-3"],
    );
}

#[test]
fn negative_length() {
    assert_bad(
        &run_stdin(&["--lengths", "-"], "5\n7\n-3\n"),
        &["line 3", "-3"],
    );
}

#[test]
fn non_integer_length() {
    assert_bad(
        &run_stdin(&["--lengths", "-"], "5\n7.5\n"),
        &["line 2", "7.5"],
    );
    assert_bad(
        &run_stdin(&["--lengths", "-"], "[5, \"x\"]"),
        &["index 1", "x"],
    );
}

#[test]
fn too_many_parts() {
    assert_bad(
        &run_stdin(&["--lengths", "-", "--partition", "5"], "10\n20\n30\n"),
        &["k = 5", "n = 3"],
    );
    assert_bad(
        &run_stdin(
            &["--lengths", "-", "--partition", "2", "--equal-size"],
            "1\n2\n3\n",
        ),
        &["n = 3", "k = 2"],
    );
    assert_bad(
        &run(&["--synthetic", "lognormal:n=10", "--world", "0"]),
        &["world", "0"],
    );
}

#[test]
fn partition_output() {
    let o = run_stdin(
        &[
            "--lengths",
            "-",
            "--partition",
            "2",
            "--cost",
            "linear",
            "--json",
        ],
        "8\n7\n6\n5\n4\n",
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["parts"], serde_json::json!([[0, 1], [2, 3, 4]]));
    assert_eq!(v["tokens"], serde_json::json!([15, 15]));
}

#[test]
fn sample_longer_than_budget() {
    assert_bad(
        &run_stdin(&["--lengths", "-", "--max-tokens", "100"], "50\n20\n150\n"),
        &["sample 2", "150", "100"],
    );
}

#[test]
fn unknown_strategy_and_cost() {
    assert_bad(
        &run(&["--synthetic", "lognormal:n=10", "--strategy", "fast"]),
        &["\"fast\"", "lb-mini", "verl-native"],
    );
    assert_bad(
        &run(&["--synthetic", "lognormal:n=10", "--cost", "cubic"]),
        &["\"cubic\"", "quadratic", "flops"],
    );
    assert_bad(
        &run(&[
            "--synthetic",
            "lognormal:n=10",
            "--cost",
            "flops:hidden=1,layers=2",
        ]),
        &["\"query\""],
    );
}

#[test]
fn bad_synthetic_spec() {
    assert_bad(&run(&["--synthetic", "zipf:n=10"]), &["zipf"]);
    assert_bad(&run(&["--synthetic", "lognormal:n=ten"]), &["\"ten\""]);
}

#[test]
fn missing_and_unreadable_files() {
    let missing = "/nonexistent/odc-pack/lengths.txt";
    assert_bad(&run(&["--lengths", missing]), &[missing]);
    let shown = env!("CARGO_TARGET_TMPDIR").to_string();
    assert_bad(&run(&["--lengths", &shown]), &[&shown]);
}

#[test]
fn usage_errors_exit_2() {
    let o = run(&[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--lengths"));
    let o = run(&["--synthetic", "lognormal:n=4", "--world", "-1"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn help() {
    let o = run(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "--lengths",
        "--synthetic",
        "--compare",
        "lb-micro",
        "quadratic",
    ] {
        assert!(out.contains(needle), "{needle}");
    }
    // Examples at the end, each an odc-pack command line with what it does beneath.
    let (_, examples) = out
        .split_once("\nExamples:\n")
        .expect("an Examples section");
    let commands = examples
        .lines()
        .filter(|l| l.trim_start().starts_with("odc-pack --"))
        .count();
    assert!(commands >= 3, "{examples}");
}

#[test]
fn json_matches_schema() {
    let path = temp_file("lengths.txt", "1000\n2000\n\n3000\n40000\n500\n600\n700\n");
    let o = run(&[
        "--lengths",
        path.to_str().unwrap(),
        "--world",
        "2",
        "--minibatch-size",
        "2",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let top = v.as_object().unwrap();
    let mut keys: Vec<&str> = top.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "bubble_collective",
            "bubble_odc",
            "fixed",
            "minibatches",
            "predicted_speedup",
            "time_collective",
            "time_odc"
        ]
    );
    assert_eq!(top["fixed"]["microbatch"], 0.0);
    let mbs = top["minibatches"].as_array().unwrap();
    assert_eq!(mbs.len(), 2); // 7 samples, 4 per minibatch
    let mut seen = Vec::new();
    for mb in mbs {
        let mb = mb.as_object().unwrap();
        assert_eq!(mb.len(), 5);
        assert!(mb["bubble_collective"].is_f64() && mb["bubble_odc"].is_f64());
        assert!(mb["time_collective"].as_f64().unwrap() >= mb["time_odc"].as_f64().unwrap());
        let ranks = mb["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 2);
        for r in ranks {
            let r = r.as_object().unwrap();
            assert_eq!(r.len(), 2);
            assert!(r["cost"].is_number());
            for micro in r["microbatches"].as_array().unwrap() {
                for i in micro.as_array().unwrap() {
                    seen.push(i.as_u64().unwrap());
                }
            }
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..7).collect::<Vec<u64>>());
    // The schema deserialises into the library's Plan.
    let plan: odc_packing::Plan = serde_json::from_slice(&o.stdout).unwrap();
    assert!(plan.bubble_odc <= plan.bubble_collective);
}

#[test]
fn compare_table_and_json() {
    let args = [
        "--synthetic",
        "lognormal:n=256,seed=1",
        "--world",
        "4",
        "--compare",
    ];
    let o = run(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout);
    for s in [
        "local-sort",
        "lb-micro",
        "lb-mini",
        "verl-native",
        "collective",
        "odc",
    ] {
        assert!(table.contains(s), "{s} in {table}");
    }
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let o = run(&with_json);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 8);
    let base = rows
        .iter()
        .find(|r| r["strategy"] == "lb-micro" && r["mode"] == "collective")
        .unwrap();
    assert!((base["speedup"].as_f64().unwrap() - 1.0).abs() < 1e-12);
}

#[test]
fn summary_and_determinism() {
    let args = ["--synthetic", "lognormal:n=300", "--seed", "3", "--json"];
    let a = run(&args);
    let b = run(&args);
    assert_eq!(a.stdout, b.stdout);
    let o = run(&["--synthetic", "lognormal:n=300"]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("minibatches") && out.contains("bubble") && out.contains("speedup"));
}

/// The `samples:` line of the text summary: count and total tokens.
fn samples_line(o: &Output) -> String {
    assert_eq!(o.status.code(), Some(0), "{}", stderr(o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find(|l| l.starts_with("samples:"))
        .unwrap()
        .to_owned()
}

/// Sorted sample indices of every minibatch of a `--json` plan.
fn minibatch_sets(o: &Output) -> Vec<Vec<u64>> {
    assert_eq!(o.status.code(), Some(0), "{}", stderr(o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut all: Vec<u64> = Vec::new();
    let sets: Vec<Vec<u64>> = v["minibatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|mb| {
            let mut s: Vec<u64> = mb["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|r| r["microbatches"].as_array().unwrap().iter())
                .flat_map(|m| m.as_array().unwrap().iter().map(|i| i.as_u64().unwrap()))
                .collect();
            s.sort_unstable();
            all.extend(&s);
            s
        })
        .collect();
    all.sort_unstable();
    assert_eq!(all, (0..all.len() as u64).collect::<Vec<_>>());
    sets
}

#[test]
fn seed_shuffles_samples_and_is_not_the_synthetic_seed() {
    let base = ["--synthetic", "lognormal:n=300", "--world", "4"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    // --seed leaves the lengths alone: the synthetic spec's seed (0 by
    // default) picks them, so count and token total stay the same ...
    let plain = samples_line(&run(&base));
    assert_eq!(plain, samples_line(&run(&with(&["--seed", "3"]))));
    assert_ne!(
        plain,
        samples_line(&run(&[
            "--synthetic",
            "lognormal:n=300,seed=3",
            "--world",
            "4"
        ]))
    );
    // ... while it reshuffles which samples share a minibatch.
    let ordered = minibatch_sets(&run(&with(&["--json"])));
    let windows: Vec<Vec<u64>> = (0..300u64)
        .collect::<Vec<_>>()
        .chunks(16)
        .map(<[u64]>::to_vec)
        .collect();
    assert_eq!(ordered, windows, "no --seed: consecutive samples");
    let three = minibatch_sets(&run(&with(&["--seed", "3", "--json"])));
    let four = minibatch_sets(&run(&with(&["--seed", "4", "--json"])));
    assert_ne!(three, ordered);
    assert_ne!(three, four);
    assert_eq!(
        three,
        minibatch_sets(&run(&with(&["--seed", "3", "--json"])))
    );
    let o = run(&with(&["--seed=-1"]));
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("-1") && !stderr(&o).contains("panicked"));
}

#[test]
fn fit_cost_prints_the_model_and_plans_with_it() {
    // seconds = 2e-8·s² + 1e-4·s exactly: the fit recovers it with no residual.
    let text: String = [128u64, 256, 512, 1024, 2048]
        .iter()
        .map(|&s| format!("{s} {}\n", 2e-8 * (s * s) as f64 + 1e-4 * s as f64))
        .collect();
    let f = temp_file("timings.txt", &format!("# length seconds\n{text}"));
    let path = f.to_str().unwrap();
    let o = run(&["--fit-cost", path, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        (doc["a_per_token2"].as_f64().unwrap() / 2e-8 - 1.0).abs() < 1e-9,
        "{doc}"
    );
    assert!(
        (doc["b_per_token"].as_f64().unwrap() / 1e-4 - 1.0).abs() < 1e-9,
        "{doc}"
    );
    assert!(doc["rms_relative"].as_f64().unwrap() < 1e-9);
    assert_eq!(doc["points"].as_array().unwrap().len(), 5);
    let o = run(&["--fit-cost", path]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("cost model:     quadratic:a=") && out.contains("residual"),
        "{out}"
    );
    // With lengths, it plans with the fitted model: the same plan as naming it by hand.
    let model = doc["model"].as_str().unwrap().to_owned();
    let common = [
        "--synthetic",
        "lognormal:n=64,median=300,max=2048",
        "--world",
        "2",
        "--max-tokens",
        "2048",
        "--json",
    ];
    let fitted = run(&[&["--fit-cost", path][..], &common[..]].concat());
    let named = run(&[&["--cost", model.as_str()][..], &common[..]].concat());
    assert_eq!(fitted.status.code(), Some(0), "{}", stderr(&fitted));
    assert_eq!(fitted.stdout, named.stdout);
    // --cost and --fit-cost together are refused; bad timings are named.
    assert_eq!(
        run(&["--fit-cost", path, "--cost", "linear"]).status.code(),
        Some(2)
    );
    let bad = temp_file("bad-timings.txt", "128 0.01\n256 zero\n");
    assert_bad(
        &run(&["--fit-cost", bad.to_str().unwrap()]),
        &["line 2", "256 zero"],
    );
    let one = temp_file("one-length.txt", "128 0.01\n128 0.011\n");
    assert_bad(
        &run(&["--fit-cost", one.to_str().unwrap()]),
        &["2 distinct lengths"],
    );
}

#[test]
fn fixed_costs_change_the_plans_and_are_in_the_prediction() {
    let common = [
        "--synthetic",
        "lognormal:n=512,median=312,max=2048,seed=0",
        "--world",
        "4",
        "--minibatch-size",
        "8",
        "--max-tokens",
        "2048",
        "--cost",
        "linear",
    ];
    let plain = run(&common);
    let text = String::from_utf8_lossy(&plain.stdout).into_owned();
    assert!(
        text.contains("fixed costs:    0 per microbatch, 0 per minibatch"),
        "{text}"
    );
    // A microbatch that costs as much as 600 tokens beside its samples.
    let dear = run(&[
        &common[..],
        &["--microbatch-cost", "600", "--minibatch-cost", "50"],
    ]
    .concat());
    assert_eq!(dear.status.code(), Some(0), "{}", stderr(&dear));
    let out = String::from_utf8_lossy(&dear.stdout);
    assert!(
        out.contains("fixed costs:    600 per microbatch, 50 per minibatch")
            && out.contains("time:"),
        "{out}"
    );
    let json = |extra: &[&str]| -> serde_json::Value {
        let o = run(&[&common[..], extra, &["--json"]].concat());
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let p = json(&["--microbatch-cost", "600", "--minibatch-cost", "50"]);
    let t = p["time_odc"].as_f64().unwrap();
    assert!(t > json(&[])["time_odc"].as_f64().unwrap());
    assert!(
        (p["predicted_speedup"].as_f64().unwrap() - p["time_collective"].as_f64().unwrap() / t)
            .abs()
            < 1e-12
    );
    // The table gains the times and says which fixed costs it used.
    let o = run(&[&common[..], &["--microbatch-cost", "600", "--compare"]].concat());
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("time") && table.contains("with fixed costs 600 per microbatch"),
        "{table}"
    );
    // Negative or non-finite fixed costs are refused by name.
    assert_bad(
        &run(&[&common[..], &["--microbatch-cost=-1"]].concat()),
        &["microbatch_cost", "-1"],
    );
    assert_bad(
        &run(&[&common[..], &["--minibatch-cost", "inf"]].concat()),
        &["minibatch_cost", "inf"],
    );
}

#[test]
fn fit_cost_fits_the_fixed_costs_from_minibatch_lines() {
    // Samples: 1e-4 s per token; minibatches of n microbatches of a 16-token sample: 0.3 + n·(0.02 + 0.0016) s.
    let mut text: String = [128u64, 256, 512, 1024]
        .iter()
        .map(|&s| format!("{s} {}\n", 1e-4 * s as f64))
        .collect();
    for n in [1u64, 4, 1, 4] {
        text.push_str(&format!(
            "minibatch {n} 16 {}\n",
            0.3 + n as f64 * (0.02 + 1.6e-3)
        ));
    }
    let f = temp_file("timings-fixed.txt", &text);
    let path = f.to_str().unwrap();
    let o = run(&["--fit-cost", path]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("fixed costs:    2.000e-2 s per microbatch, 3.000e-1 s per minibatch"),
        "{out}"
    );
    let o = run(&["--fit-cost", path, "--json"]);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!((doc["fixed"]["microbatch_seconds"].as_f64().unwrap() - 0.02).abs() < 1e-9);
    // Planning with the fit uses its fixed costs; an explicit flag overrides one of them.
    let common = [
        "--synthetic",
        "lognormal:n=64,median=300,max=2048",
        "--world",
        "2",
        "--max-tokens",
        "2048",
        "--json",
    ];
    let p: serde_json::Value =
        serde_json::from_slice(&run(&[&["--fit-cost", path][..], &common[..]].concat()).stdout)
            .unwrap();
    assert!((p["fixed"]["microbatch"].as_f64().unwrap() - 0.02).abs() < 1e-9);
    assert!((p["fixed"]["minibatch"].as_f64().unwrap() - 0.3).abs() < 1e-9);
    let q: serde_json::Value = serde_json::from_slice(
        &run(&[
            &["--fit-cost", path, "--microbatch-cost", "0"][..],
            &common[..],
        ]
        .concat())
        .stdout,
    )
    .unwrap();
    assert_eq!(q["fixed"]["microbatch"], 0.0);
    let bad = temp_file("bad-minibatch.txt", "128 0.01\n256 0.02\nminibatch 4 0.3\n");
    assert_bad(
        &run(&["--fit-cost", bad.to_str().unwrap()]),
        &["line 3", "minibatch MICROBATCHES LENGTH SECONDS"],
    );
}
