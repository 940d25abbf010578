//! Every target on its committed inputs — the seed corpus (`corpus/<target>/`)
//! and the inputs that once failed (`regressions/<target>/`) — and on a
//! bounded sample of pseudo-random inputs: the fuzz targets' properties as
//! plain tests, without libFuzzer (`make fuzz` runs the coverage-guided
//! campaigns).

use std::path::Path;

/// Pseudo-random inputs per target (seeded: the same every run).
const RANDOM_INPUTS: u64 = 2000;

fn committed(target: &str) -> Vec<(String, Vec<u8>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut inputs = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for e in entries.flatten() {
            if let Ok(bytes) = std::fs::read(e.path()) {
                inputs.push((e.path().display().to_string(), bytes));
            }
        }
    }
    inputs
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
fn every_target_holds_on_its_corpus_and_a_random_sample() {
    odc_fuzz::pack_input::set_scratch_dir(env!("CARGO_TARGET_TMPDIR"));
    for &(name, run) in odc_fuzz::TARGETS {
        let inputs = committed(name);
        for (path, bytes) in &inputs {
            eprintln!("{name}: {path}");
            run(bytes);
        }
        let mut state = 0x0dc0_f022 ^ name.len() as u64;
        for _ in 0..RANDOM_INPUTS {
            let len = (splitmix(&mut state) % 300) as usize;
            let bytes: Vec<u8> = (0..len).map(|_| splitmix(&mut state) as u8).collect();
            run(&bytes);
        }
        eprintln!(
            "{name}: {} committed inputs, {RANDOM_INPUTS} random ones",
            inputs.len()
        );
    }
}

#[test]
fn every_target_has_a_binary_and_seeds() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for &(name, _) in odc_fuzz::TARGETS {
        assert!(
            root.join("fuzz_targets")
                .join(format!("{name}.rs"))
                .is_file(),
            "{name}"
        );
        assert!(!committed(name).is_empty(), "{name} has no seed corpus");
    }
}
