//! `odc-pack`'s input readers — sequence lengths (a JSON array, or one
//! integer per line) and cost-fit timings (`length seconds` pairs, or a
//! JSON array of pairs) — and the command on what they accept.
//!
//! Properties: what the lengths reader accepts is exactly what a
//! spelled-out reader accepts (non-empty, every value a positive `u64`),
//! and a refusal names the line or index of the value; timings are
//! positive and finite and their fit does not panic; the command, given
//! the file and settings from the input, exits 0 or 2 with one `error:`
//! line, never panics, and what it prints is right: every
//! sample planned at most once, microbatches within the token budget, each
//! part's token count the sum of its samples.

use std::path::PathBuf;
use std::sync::OnceLock;

use arbitrary::{Result, Unstructured};
use odc_packing::fit::{fit_quadratic, parse_timings};
use odc_packing::{parse_lengths, Error, Location};
use serde_json::Value;

static SCRATCH: OnceLock<PathBuf> = OnceLock::new();

/// Where the command's input file is written (default: `ODC_FUZZ_SCRATCH`,
/// which scripts/fuzz.sh sets, else the system's temporary folder; the
/// replay test passes its own).
/// The first call wins.
pub fn set_scratch_dir(dir: impl Into<PathBuf>) {
    let _ = SCRATCH.set(dir.into());
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    let mode = u.int_in_range(0..=3u8)?;
    let settings = Settings::new(u)?;
    if mode == 3 {
        // Lengths as numbers, at the edges of what a u64 holds, written out
        // as a list or an array: the command on lengths that parse.
        let mut values = Vec::new();
        for _ in 0..u.int_in_range(1..=6u8)? {
            values.push(match u.int_in_range(0..=3u8)? {
                0 => u.int_in_range(1..=100_000u64)?,
                1 => (1u64 << 63) + u.int_in_range(0..=2u64)?,
                2 => u64::MAX - u.int_in_range(0..=2u64)?,
                _ => u.arbitrary::<u64>()?.max(1),
            });
        }
        let text = if u.arbitrary()? {
            format!("{values:?}")
        } else {
            values.iter().map(|v| format!("{v}\n")).collect()
        };
        if let Some(lengths) = lengths(&text) {
            command(&text, &lengths, &settings);
        }
        return Ok(());
    }
    let rest = u.bytes(u.len())?;
    let Ok(text) = std::str::from_utf8(rest) else {
        // The command refuses text that is not UTF-8 before parsing it.
        return Ok(());
    };
    match mode {
        0 => {
            lengths(text);
        }
        1 => timings(text),
        _ => {
            if let Some(lengths) = lengths(text) {
                command(text, &lengths, &settings);
            }
        }
    }
    Ok(())
}

/// The lengths reader against a spelled-out one; the accepted lengths.
fn lengths(text: &str) -> Option<Vec<u64>> {
    let got = parse_lengths(text);
    let json = text.trim_start().starts_with('[');
    let want: Option<Vec<u64>> = if json {
        serde_json::from_str::<Vec<Value>>(text)
            .ok()
            .and_then(|v| v.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
    } else {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(|l| l.parse::<u64>().ok())
            .collect()
    };
    let want = want.filter(|v| !v.is_empty() && v.iter().all(|&n| n > 0));
    match (&got, &want) {
        (Ok(g), Some(w)) => assert_eq!(g, w, "{text:?}"),
        (Err(e), None) => located(e, text),
        _ => panic!("parse_lengths({text:?}) = {got:?}, the rule says {want:?}"),
    }
    got.ok()
}

/// A refused value is named by where it is: its line (1-based) or index.
fn located(e: &Error, text: &str) {
    let at = match e {
        Error::NonIntegerLength { at, .. }
        | Error::ZeroLength { at }
        | Error::NegativeLength { at, .. }
        | Error::LengthTooLarge { at, .. } => *at,
        Error::EmptyLengths | Error::InvalidJson { .. } => return,
        other => panic!("parse_lengths({text:?}): unexpected {other:?}"),
    };
    let ok = match at {
        Location::Line(n) => n >= 1 && n <= text.lines().count(),
        Location::Index(i) => serde_json::from_str::<Vec<Value>>(text).is_ok_and(|v| i < v.len()),
    };
    assert!(ok, "{e} points outside {text:?}");
    assert!(e.to_string().contains(&at.to_string()), "{e}");
}

fn timings(text: &str) {
    match parse_timings(text) {
        Ok(t) => {
            assert!(!t.is_empty());
            for x in &t {
                assert!(
                    x.length > 0 && x.seconds.is_finite() && x.seconds > 0.0,
                    "{x:?}"
                );
            }
            if let Ok(fit) = fit_quadratic(&t) {
                assert!(fit.a_per_token2 >= 0.0 && fit.b_per_token >= 0.0, "{fit:?}");
            }
        }
        Err(Error::InvalidTiming { at, .. }) => {
            if let Location::Line(n) = at {
                assert!(n >= 1 && n <= text.lines().count());
            }
        }
        Err(Error::InvalidJson { .. } | Error::TooFewTimings { .. }) => {}
        Err(e) => panic!("parse_timings({text:?}): unexpected {e:?}"),
    }
}

/// `odc-pack`'s settings, drawn from the input.
struct Settings {
    world: u64,
    minibatch: u64,
    max_tokens: Option<u64>,
    cost: &'static str,
    action: Action,
    json: bool,
}

enum Action {
    Plan(&'static str),
    Compare,
    Partition(u64, bool),
}

impl Settings {
    fn new(u: &mut Unstructured<'_>) -> Result<Settings> {
        let strategies = ["lb-mini", "lb-micro", "local-sort", "verl-native"];
        Ok(Settings {
            world: u.int_in_range(1..=4u64)?,
            minibatch: u.int_in_range(1..=4u64)?,
            max_tokens: match u.int_in_range(0..=3u8)? {
                0 => None,
                1 => Some(u64::MAX),
                _ => Some(u.arbitrary()?),
            },
            cost: ["linear", "quadratic"][u.choose_index(2)?],
            action: match u.int_in_range(0..=2u8)? {
                0 => Action::Plan(strategies[u.choose_index(strategies.len())?]),
                1 => Action::Compare,
                _ => Action::Partition(u.int_in_range(1..=5u64)?, u.arbitrary()?),
            },
            json: u.arbitrary()?,
        })
    }
}

fn command(text: &str, lengths: &[u64], s: &Settings) {
    if lengths.len() > 256 {
        return; // keeps one execution short
    }
    let dir = SCRATCH.get_or_init(|| {
        std::env::var_os("ODC_FUZZ_SCRATCH").map_or_else(std::env::temp_dir, PathBuf::from)
    });
    let path = dir.join(format!("odc-fuzz-lengths-{}.txt", std::process::id()));
    if std::fs::write(&path, text).is_err() {
        return;
    }
    let max = lengths.iter().copied().max().unwrap_or(1);
    let max_tokens = s.max_tokens.unwrap_or(max).to_string();
    let mut args: Vec<String> = ["odc-pack", "--lengths"].map(String::from).to_vec();
    args.push(path.display().to_string());
    for (flag, value) in [
        ("--world", s.world.to_string()),
        ("--minibatch-size", s.minibatch.to_string()),
        ("--max-tokens", max_tokens.clone()),
        ("--cost", s.cost.to_owned()),
    ] {
        args.push(flag.into());
        args.push(value);
    }
    match s.action {
        Action::Plan(name) => args.extend(["--strategy".into(), name.into()]),
        Action::Compare => args.push("--compare".into()),
        Action::Partition(k, equal) => {
            args.extend(["--partition".into(), k.to_string()]);
            if equal {
                args.push("--equal-size".into());
            }
        }
    }
    if s.json {
        args.push("--json".into());
    }
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = odc_packing::cli::run_with(args.iter().map(Into::into), &mut out, &mut err);
    let (out, err) = (String::from_utf8_lossy(&out), String::from_utf8_lossy(&err));
    match code {
        0 => {
            assert!(err.is_empty(), "{err}");
            if s.json {
                let budget = max_tokens.parse::<u64>().unwrap_or(u64::MAX);
                printed(&out, lengths, s, budget);
            }
        }
        2 => assert!(
            err.trim_end().lines().count() == 1 && err.starts_with("odc-pack: error: "),
            "{args:?}: {err}"
        ),
        other => panic!("{args:?}: exit {other}: {err}"),
    }
}

/// The command's JSON output is right about the lengths it was given.
fn printed(out: &str, lengths: &[u64], s: &Settings, budget: u64) {
    let v: Value = match serde_json::from_str(out) {
        Ok(v) => v,
        Err(e) => panic!("not JSON ({e}): {out}"),
    };
    let index = |x: &Value| -> usize {
        match x
            .as_u64()
            .map(|i| i as usize)
            .filter(|&i| i < lengths.len())
        {
            Some(i) => i,
            None => panic!("sample {x} of {}", lengths.len()),
        }
    };
    match s.action {
        Action::Partition(k, equal) => {
            let parts = v["parts"].as_array().map(Vec::as_slice).unwrap_or_default();
            let tokens = v["tokens"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            assert_eq!(
                (parts.len(), tokens.len()),
                (k as usize, k as usize),
                "{out}"
            );
            let mut seen = vec![false; lengths.len()];
            for (p, t) in parts.iter().zip(tokens) {
                let p = p.as_array().map(Vec::as_slice).unwrap_or_default();
                assert!(!p.is_empty(), "an empty part: {out}");
                if equal {
                    assert_eq!(p.len(), lengths.len() / k as usize);
                }
                let mut sum = 0u128;
                for x in p {
                    let i = index(x);
                    assert!(
                        !std::mem::replace(&mut seen[i], true),
                        "sample {i} twice: {out}"
                    );
                    sum += u128::from(lengths[i]);
                }
                assert_eq!(
                    t.as_u64().map(u128::from),
                    Some(sum),
                    "a part's tokens: {out}"
                );
            }
            assert!(seen.iter().all(|&s| s), "a sample in no part: {out}");
        }
        Action::Plan(_) => {
            let mut seen = vec![false; lengths.len()];
            for mb in v["minibatches"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
            {
                for r in mb["ranks"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                {
                    for micro in r["microbatches"]
                        .as_array()
                        .map(Vec::as_slice)
                        .unwrap_or_default()
                    {
                        let mut sum = 0u128;
                        for x in micro.as_array().map(Vec::as_slice).unwrap_or_default() {
                            let i = index(x);
                            assert!(
                                !std::mem::replace(&mut seen[i], true),
                                "sample {i} twice: {out}"
                            );
                            sum += u128::from(lengths[i]);
                        }
                        assert!(
                            sum <= u128::from(budget),
                            "{sum} tokens over {budget}: {out}"
                        );
                    }
                }
            }
        }
        Action::Compare => {}
    }
}
