//! The `odc-pack` command, as a library function so that other front ends
//! (the Python package) can expose the very same command.
//!
//! ```text
//! odc-pack --synthetic lognormal:n=4096,seed=0 --world 8 --minibatch-size 4 --compare
//! odc-pack --lengths lengths.txt --strategy lb-micro --json
//! odc-pack --lengths lengths.txt --partition 8 --equal-size --cost linear
//! odc-pack --fit-cost timings.txt                      # fit a·s² + b·s to measured timings
//! odc-pack --fit-cost timings.txt --lengths lengths.txt --compare
//! odc-pack --lengths lengths.txt --cost linear --microbatch-cost 300 --compare
//! ```
//!
//! Exit codes: 0 on success, 2 on bad input or usage (one `error:` line on
//! stderr naming the offending value), 1 when output cannot be written.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::PathBuf;

use clap::{ArgGroup, Parser};

use crate::cost::{CostModel, FixedCost};
use crate::error::{Error, Result};
use crate::fit::{fit_quadratic, parse_timing_file, CostFit};
use crate::input::{parse_lengths, synthetic, total_tokens};
use crate::kk::{karmarkar_karp, lower_bound, max_part_sum, part_sum};
use crate::planner::{compare, plan, Plan, PlanConfig};

const AFTER_HELP: &str = "\
Strategies: local-sort, lb-micro, lb-mini, verl-native.
Cost models: linear, quadratic (= quadratic:qwen2-7b), quadratic:qwen2-1.5b,
  quadratic:a=A,b=B, verl, flops:hidden=H,layers=L,query=Q.
Fitted cost: --fit-cost FILE reads `length seconds` pairs (forward + backward
  of single samples on your model; odc.packing.fit_cost times them), fits
  a·s² + b·s and prints the model and its residual; with --lengths or
  --synthetic it plans with the fitted model instead of --cost. Lines
  `minibatch N LENGTH SECONDS` (a minibatch of N microbatches of one
  LENGTH-token sample took SECONDS) fit the fixed costs too.
Fixed costs: --microbatch-cost / --minibatch-cost (in the cost model's units;
  seconds with --fit-cost, overriding the fitted ones) are what a microbatch and
  a minibatch cost beside their samples. lb-micro and lb-mini then minimise the
  predicted time with them (fewer, fuller microbatches where that wins), and the
  times and speedups count them.
Synthetic: lognormal:n=N[,median=10000][,sigma=1.0][,min=1][,max=65536][,seed=0]
  (its seed draws the lengths; --seed only shuffles their order).

Times:        collective = sum_m max_d C[m,d] + K*f + g;
              odc        = max_d (sum_m C[m,d] + n_d*f) + g
              (f, g: fixed costs per microbatch and minibatch; speedup = ratio of times).
Bubble rates: 1 - busy / (D * time), busy = sum(C) plus the fixed costs ranks run
              (without fixed costs: 1 - sum(C) / (D * time)).
Exit status: 0 ok, 2 bad input or usage, 1 output could not be written.

Examples:
  odc-pack --synthetic lognormal:n=4096,seed=0 --world 8 --minibatch-size 4 --compare
      every strategy's predicted bubble under collectives and ODC
  odc-pack --lengths lengths.txt --world 8 --strategy lb-mini --json
      LB-Mini's plan for the lengths in a file, as JSON
  odc-pack --lengths lengths.txt --partition 8 --equal-size --cost linear
      8 parts of equal size, balanced by cost (Karmarkar-Karp)
  odc-pack --fit-cost timings.txt --lengths lengths.txt --compare
      plan with a cost model fitted to measured `length seconds` pairs
  odc-pack --lengths lengths.txt --cost linear --microbatch-cost 300 --compare
      every strategy when a microbatch costs as much as 300 tokens beside its samples";

/// Plan sequence packing for data-parallel training and predict the
/// bubble rate under collectives and under ODC.
#[derive(Debug, Parser)]
#[command(name = "odc-pack", version, after_help = AFTER_HELP)]
#[command(group(ArgGroup::new("input").args(["lengths", "synthetic"])))]
struct Args {
    /// File of sequence lengths: one integer per line, or a JSON array; `-` reads stdin.
    #[arg(long, value_name = "FILE")]
    lengths: Option<PathBuf>,

    /// Synthetic lengths, e.g. lognormal:n=1000,median=10000,sigma=1.0,max=65536,seed=0.
    #[arg(long, value_name = "SPEC")]
    synthetic: Option<String>,

    /// Number of data-parallel ranks D.
    #[arg(long, value_name = "N", default_value_t = 8)]
    world: usize,

    /// Samples per rank per minibatch M (a global minibatch is M·D samples).
    #[arg(long, value_name = "M", default_value_t = 4)]
    minibatch_size: usize,

    /// Packing strategy: local-sort, lb-micro, lb-mini or verl-native.
    #[arg(long, value_name = "NAME", default_value = "lb-mini")]
    strategy: String,

    /// Most tokens one microbatch may hold.
    #[arg(long, value_name = "T", default_value_t = 65536)]
    max_tokens: u64,

    /// Per-sample cost model (see below).
    #[arg(long, value_name = "NAME", default_value = "quadratic")]
    cost: String,

    /// Fit a·s² + b·s to the `length seconds` pairs in FILE (`-` is stdin)
    /// and use it as the cost model; alone, print the fit and its residual.
    /// `minibatch N LENGTH SECONDS` lines fit the fixed costs too.
    #[arg(long, value_name = "FILE", conflicts_with = "cost")]
    fit_cost: Option<PathBuf>,

    /// Fixed cost of every microbatch beside its samples, in the cost
    /// model's units (seconds with --fit-cost).
    #[arg(long, value_name = "COST")]
    microbatch_cost: Option<f64>,

    /// Fixed cost of every minibatch beside its microbatches, in the cost
    /// model's units (seconds with --fit-cost).
    #[arg(long, value_name = "COST")]
    minibatch_cost: Option<f64>,

    /// Shuffle the samples with seed S before cutting minibatches (like a
    /// data loader's shuffle); without it minibatches take samples in input
    /// order. Plan indices always name input positions. Independent of the
    /// seed= of --synthetic, which picks the lengths; --partition ignores it.
    #[arg(long, value_name = "S")]
    seed: Option<u64>,

    /// Print the plan (or, with --compare, the table) as JSON.
    #[arg(long)]
    json: bool,

    /// Compare every strategy under collectives and ODC.
    #[arg(long, conflicts_with = "partition")]
    compare: bool,

    /// Instead of planning, split the samples into K non-empty parts
    /// balanced by cost with Karmarkar–Karp (K must not exceed the count).
    #[arg(long, value_name = "K")]
    partition: Option<usize>,

    /// With --partition: every part gets the same number of samples.
    #[arg(long, requires = "partition")]
    equal_size: bool,
}

/// Runs `odc-pack` with `args` (the first item is the program name),
/// writing to the process's stdout and stderr. Returns the exit code.
pub fn run<I: IntoIterator<Item = OsString>>(args: I) -> i32 {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    run_with(args, &mut stdout.lock(), &mut stderr.lock())
}

/// [`run`] with explicit output streams; stdin is still the process's.
pub fn run_with<I: IntoIterator<Item = OsString>>(
    args: I,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> i32 {
    let args = match Args::try_parse_from(args) {
        Ok(a) => a,
        Err(e) => {
            let text = e.render().to_string();
            // Nothing sensible is left to do if even this write fails.
            let _ = if e.use_stderr() {
                write!(err, "{text}")
            } else {
                write!(out, "{text}")
            };
            return e.exit_code();
        }
    };
    match execute(&args) {
        Ok(text) => match writeln!(out, "{text}").and_then(|()| out.flush()) {
            Ok(()) => 0,
            Err(e) => {
                let _ = writeln!(err, "odc-pack: error: cannot write output: {e}");
                1
            }
        },
        Err(e) => {
            let _ = writeln!(err, "odc-pack: error: {e}");
            2
        }
    }
}

fn read_lengths(args: &Args) -> Result<Vec<u64>> {
    if let Some(spec) = &args.synthetic {
        return synthetic(spec);
    }
    let path = args.lengths.as_deref();
    parse_lengths(&read_text(path)?).map_err(|e| in_file(path, e))
}

/// `e`, a refusal of what `path` (none or `-`: stdin) holds, naming it.
fn in_file(path: Option<&std::path::Path>, e: Error) -> Error {
    let path = match path {
        Some(p) if p.as_os_str() != "-" => p.display().to_string(),
        _ => "stdin".to_owned(),
    };
    Error::InFile {
        path,
        source: Box::new(e),
    }
}

/// The text of `path` (`-` or none: stdin).
fn read_text(path: Option<&std::path::Path>) -> Result<String> {
    let path = path.map_or_else(|| PathBuf::from("-"), PathBuf::from);
    let shown = path.display().to_string();
    let io = |source| Error::Io {
        path: shown.clone(),
        source,
    };
    let mut bytes = Vec::new();
    if path.as_os_str() == "-" {
        std::io::stdin().read_to_end(&mut bytes).map_err(io)?;
    } else {
        bytes = std::fs::read(&path).map_err(io)?;
    }
    String::from_utf8(bytes)
        .map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
}

fn execute(args: &Args) -> Result<String> {
    let fit = match &args.fit_cost {
        Some(path) => {
            let (pairs, minibatches) =
                parse_timing_file(&read_text(Some(path))?).map_err(|e| in_file(Some(path), e))?;
            let fit = fit_quadratic(&pairs).map_err(|e| in_file(Some(path), e))?;
            Some(if minibatches.is_empty() {
                fit
            } else {
                fit.with_fixed(&minibatches)
                    .map_err(|e| in_file(Some(path), e))?
            })
        }
        None => None,
    };
    let cost: CostModel = match &fit {
        Some(f) => f.cost_model(),
        None => args.cost.parse()?,
    };
    let fitted = fit.as_ref().map_or(FixedCost::NONE, CostFit::fixed_cost);
    let fixed = FixedCost {
        microbatch: args.microbatch_cost.unwrap_or(fitted.microbatch),
        minibatch: args.minibatch_cost.unwrap_or(fitted.minibatch),
    };
    fixed.check()?;
    let cfg = PlanConfig {
        world: args.world,
        minibatch_size: args.minibatch_size,
        strategy: args.strategy.parse()?,
        max_tokens: args.max_tokens,
        cost,
        fixed,
        seed: args.seed,
    };
    if args.lengths.is_none() && args.synthetic.is_none() {
        return match &fit {
            Some(f) if args.json => Ok(json(f)),
            Some(f) => Ok(fit_summary(f)),
            None => Err(Error::InvalidConfig {
                field: "input",
                value: "none".to_owned(),
                reason: "give --lengths FILE, --synthetic SPEC or --fit-cost FILE",
            }),
        };
    }
    let lengths = read_lengths(args)?;
    if let Some(k) = args.partition {
        return partition(&lengths, k, args, &cfg);
    }
    if args.compare {
        let table = compare(&lengths, &cfg)?;
        return Ok(if args.json {
            json(&table)
        } else {
            table.to_string()
        });
    }
    let p = plan(&lengths, &cfg)?;
    Ok(if args.json {
        json(&p)
    } else {
        summary(&p, &lengths, &cfg)
    })
}

/// Plans and tables hold only numbers, strings and vectors, which always
/// serialise; the fallback keeps even an impossible failure panic-free.
fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| format!("{{\"error\":{:?}}}", e.to_string()))
}

/// Output of `--partition`.
#[derive(Debug, serde::Serialize)]
struct Partition {
    parts: Vec<Vec<usize>>,
    costs: Vec<f64>,
    tokens: Vec<u64>,
    max_over_lower_bound: f64,
}

fn partition(lengths: &[u64], k: usize, args: &Args, cfg: &PlanConfig) -> Result<String> {
    if let Some(index) = lengths.iter().position(|&s| s == 0) {
        return Err(Error::ZeroLength {
            at: crate::error::Location::Index(index),
        });
    }
    // Every part's token count is at most the total.
    total_tokens(lengths)?;
    let weights: Vec<f64> = lengths.iter().map(|&s| cfg.cost.cost(s)).collect();
    let parts = karmarkar_karp(&weights, k, args.equal_size)?;
    let costs: Vec<f64> = parts.iter().map(|p| part_sum(&weights, p)).collect();
    let tokens = parts
        .iter()
        .map(|p| p.iter().map(|&i| lengths[i]).sum())
        .collect();
    let bound = lower_bound(&weights, k);
    let result = Partition {
        max_over_lower_bound: if bound > 0.0 {
            max_part_sum(&weights, &parts) / bound
        } else {
            1.0
        },
        parts,
        costs,
        tokens,
    };
    if args.json {
        return Ok(json(&result));
    }
    let mut text = format!(
        "{} samples into {} parts (cost {}), max/lower-bound {:.4}",
        lengths.len(),
        k,
        cfg.cost,
        result.max_over_lower_bound
    );
    for (j, p) in result.parts.iter().enumerate() {
        text.push_str(&format!(
            "\npart {j}: {} samples, {} tokens, cost {:.6}",
            p.len(),
            result.tokens[j],
            result.costs[j]
        ));
    }
    Ok(text)
}

fn fit_summary(f: &CostFit) -> String {
    let mut text = format!(
        "cost model:     {}\n\
         seconds:        {:.4e}·s² + {:.4e}·s\n\
         residual:       rms {:.2}% (max {:.2}%) of the measured seconds, rms {:.3e} s\n\
         fixed cost:     {:.3e} s per call in a fit a·s² + b·s + c (not part of the model)\n\
         {:>10} {:>12} {:>12} {:>8}",
        f.model,
        f.a_per_token2,
        f.b_per_token,
        100.0 * f.rms_relative,
        100.0 * f.max_relative,
        f.rms_seconds,
        f.overhead_seconds,
        "length",
        "seconds",
        "fitted",
        "error"
    );
    for p in &f.points {
        text.push_str(&format!(
            "\n{:>10} {:>12.6} {:>12.6} {:>+7.2}%",
            p.length,
            p.seconds,
            p.predicted,
            100.0 * p.relative_error
        ));
    }
    if let Some(x) = &f.fixed {
        text.push_str(&format!(
            "\nfixed costs:    {:.3e} s per microbatch, {:.3e} s per minibatch (the line's own: {:.3e}, {:.3e})\n\
             {:>12} {:>10} {:>12} {:>12}",
            x.microbatch_seconds,
            x.minibatch_seconds,
            x.raw_microbatch_seconds,
            x.raw_minibatch_seconds,
            "microbatches",
            "length",
            "seconds",
            "fitted"
        ));
        for p in &x.points {
            text.push_str(&format!(
                "\n{:>12} {:>10} {:>12.6} {:>12.6}",
                p.microbatches, p.length, p.seconds, p.predicted
            ));
        }
    }
    text
}

fn summary(p: &Plan, lengths: &[u64], cfg: &PlanConfig) -> String {
    let counts: Vec<usize> = p.microbatch_counts().collect();
    let min = counts.iter().copied().min().unwrap_or(0);
    let max = counts.iter().copied().max().unwrap_or(0);
    let mean = counts.iter().sum::<usize>() as f64 / counts.len().max(1) as f64;
    let tokens: u64 = lengths.iter().sum();
    format!(
        "samples:        {} ({} tokens)\n\
         world:          {} ranks, {} samples per rank per minibatch\n\
         strategy:       {} (cost {}, max {} tokens per microbatch)\n\
         minibatches:    {}\n\
         microbatches:   per rank per minibatch min {}, mean {:.2}, max {}\n\
         fixed costs:    {} per microbatch, {} per minibatch\n\
         time:           collective {:.6}, odc {:.6} (predicted, in the cost model's units, fixed costs included)\n\
         bubble:         collective {:.2}%, odc {:.2}%\n\
         speedup:        {:.3}x predicted for odc over collective",
        lengths.len(),
        tokens,
        cfg.world,
        cfg.minibatch_size,
        cfg.strategy,
        cfg.cost,
        cfg.max_tokens,
        p.minibatches.len(),
        min,
        mean,
        max,
        cfg.fixed.microbatch,
        cfg.fixed.minibatch,
        p.time_collective,
        p.time_odc,
        100.0 * p.bubble_collective,
        100.0 * p.bubble_odc,
        p.predicted_speedup,
    )
}
