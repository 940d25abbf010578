//! Plans: an assignment plus its simulated bubble rates, and the
//! every-strategy comparison table.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, FixedCost};
use crate::error::Result;
use crate::input::SplitMix64;
use crate::sim::{time_ratio, Timing};
use crate::strategy::{assign_ordered, Batching, Strategy};

/// Everything [`plan`] needs besides the lengths.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanConfig {
    /// Number of data-parallel ranks `D`.
    pub world: usize,
    /// Samples per rank per minibatch `M`; a global minibatch is `M·D`
    /// consecutive samples (of the shuffled order when `seed` is set).
    pub minibatch_size: usize,
    /// Packing strategy.
    pub strategy: Strategy,
    /// Most tokens one microbatch may hold.
    pub max_tokens: u64,
    /// Per-sample cost model.
    pub cost: CostModel,
    /// Fixed costs per microbatch and per minibatch, in the cost model's
    /// units. LB-Micro and LB-Mini minimise the predicted time with them
    /// (see [`crate::strategy`]); the predictions count them
    /// ([`crate::sim`]). [`FixedCost::NONE`]: the per-sample model alone.
    pub fixed: FixedCost,
    /// Shuffle seed of the sample order, like a data loader's. `None`
    /// forms minibatches from consecutive samples in dataset order;
    /// `Some(s)` first shuffles the samples with a permutation fixed by `s`
    /// (see [`sample_order`]), so which samples share a minibatch depends
    /// on `s`. Indices in the plan always name positions in the input, and
    /// the same seed gives the same plan.
    pub seed: Option<u64>,
}

impl Default for PlanConfig {
    /// 8 ranks, 4 samples per rank per minibatch, LB-Mini, 65 536 tokens,
    /// the Qwen2-7B quadratic cost model, no fixed costs, dataset order (no
    /// shuffle).
    fn default() -> Self {
        Self {
            world: 8,
            minibatch_size: 4,
            strategy: Strategy::LbMini,
            max_tokens: 65_536,
            cost: CostModel::default(),
            fixed: FixedCost::NONE,
            seed: None,
        }
    }
}

/// A full plan: per minibatch, per rank, the microbatches, with bubble
/// rates per minibatch and for the whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Global minibatches in input order.
    pub minibatches: Vec<MinibatchPlan>,
    /// Whole-run bubble rate under collectives.
    pub bubble_collective: f64,
    /// Whole-run bubble rate under ODC.
    pub bubble_odc: f64,
    /// `time_collective / time_odc`: how much faster this plan runs on ODC
    /// than on collectives (without fixed costs, `(1 − bubble_odc) /
    /// (1 − bubble_collective)`).
    pub predicted_speedup: f64,
    /// Predicted time of the whole run under collectives, in the cost
    /// model's units, fixed costs included (see [`crate::sim`]).
    #[serde(default)]
    pub time_collective: f64,
    /// Predicted time of the whole run under ODC, fixed costs included.
    #[serde(default)]
    pub time_odc: f64,
    /// The fixed costs the plan was made and predicted with.
    #[serde(default)]
    pub fixed: FixedCost,
}

/// One global minibatch of a [`Plan`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MinibatchPlan {
    /// One entry per rank, rank order.
    pub ranks: Vec<RankPlan>,
    /// This minibatch's bubble rate under collectives.
    pub bubble_collective: f64,
    /// This minibatch's bubble rate under ODC.
    pub bubble_odc: f64,
    /// This minibatch's predicted time under collectives, fixed costs
    /// included.
    #[serde(default)]
    pub time_collective: f64,
    /// This minibatch's predicted time under ODC, fixed costs included.
    #[serde(default)]
    pub time_odc: f64,
}

/// One rank's share of a minibatch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankPlan {
    /// Microbatches in execution order, each a list of global sample
    /// indices (ascending). May be empty, see [`Strategy`].
    pub microbatches: Vec<Vec<usize>>,
    /// Total cost of this rank's samples in the minibatch.
    pub cost: f64,
}

impl Plan {
    /// Microbatch count of every (minibatch, rank), minibatch-major.
    pub fn microbatch_counts(&self) -> impl Iterator<Item = usize> + '_ {
        self.minibatches
            .iter()
            .flat_map(|mb| mb.ranks.iter().map(|r| r.microbatches.len()))
    }
}

/// Keeps shuffle permutations apart from a synthetic data set drawn with
/// the same seed (`lognormal:...,seed=s` together with `seed: Some(s)`).
const SHUFFLE_STREAM: u64 = 0x5348_5546_464C_4531;

/// The order in which [`plan`] takes `n` samples: `0..n` for `None`, a
/// uniformly random permutation fixed by the seed for `Some(seed)`
/// (Fisher–Yates over a SplitMix64 stream, identical on every machine).
///
/// ```
/// let order = odc_packing::sample_order(6, Some(1));
/// assert_eq!(order, odc_packing::sample_order(6, Some(1)));
/// let mut sorted = order.clone();
/// sorted.sort_unstable();
/// assert_eq!(sorted, (0..6).collect::<Vec<_>>());
/// assert_eq!(odc_packing::sample_order(3, None), vec![0, 1, 2]);
/// ```
pub fn sample_order(n: usize, seed: Option<u64>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if let Some(seed) = seed {
        let mut rng = SplitMix64::new(seed ^ SHUFFLE_STREAM);
        for i in (1..n).rev() {
            // Multiply-shift maps 64 random bits onto 0..=i; the bias,
            // below i / 2⁶⁴, is far beneath anything a plan could show.
            let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// Plans `lengths` (tokens per sample, in input order) under `cfg`.
///
/// ```
/// use odc_packing::{plan, PlanConfig, Strategy};
/// let cfg = PlanConfig { world: 2, minibatch_size: 2, strategy: Strategy::LbMicro, ..PlanConfig::default() };
/// let p = plan(&[100, 200, 300, 400, 500], &cfg)?;
/// assert_eq!(p.minibatches.len(), 2); // 4 samples, then the final 1
/// assert!(p.bubble_odc <= p.bubble_collective);
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// As [`crate::strategy::assign`]: bad settings, empty input, a zero
/// length, or a sample longer than `max_tokens` (indices in errors, as in
/// the plan, are positions in `lengths`, shuffled or not).
pub fn plan(lengths: &[u64], cfg: &PlanConfig) -> Result<Plan> {
    let costs: Vec<f64> = lengths.iter().map(|&s| cfg.cost.cost(s)).collect();
    plan_with_costs(lengths, &costs, cfg)
}

fn plan_with_costs(lengths: &[u64], costs: &[f64], cfg: &PlanConfig) -> Result<Plan> {
    let batching = Batching {
        world: cfg.world,
        minibatch_size: cfg.minibatch_size,
        max_tokens: cfg.max_tokens,
    };
    let order = sample_order(lengths.len(), cfg.seed);
    let assignment = assign_ordered(cfg.strategy, lengths, costs, &batching, &order, &cfg.fixed)?;
    let mut total = Timing {
        world: cfg.world,
        ..Timing::default()
    };
    let minibatches = assignment
        .into_iter()
        .map(|ranks| {
            let t = Timing::of_minibatch_fixed(&ranks, costs, &cfg.fixed);
            total.add(&t);
            MinibatchPlan {
                ranks: ranks
                    .into_iter()
                    .map(|microbatches| RankPlan {
                        cost: microbatches.iter().flatten().map(|&i| costs[i]).sum(),
                        microbatches,
                    })
                    .collect(),
                bubble_collective: t.bubble_collective(),
                bubble_odc: t.bubble_odc(),
                time_collective: t.collective,
                time_odc: t.odc,
            }
        })
        .collect();
    Ok(Plan {
        minibatches,
        bubble_collective: total.bubble_collective(),
        bubble_odc: total.bubble_odc(),
        predicted_speedup: total.speedup(),
        time_collective: total.collective,
        time_odc: total.odc,
        fixed: cfg.fixed,
    })
}

/// How a plan's microbatches are synchronised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// All-gather / reduce-scatter per microbatch: ranks wait per step.
    Collective,
    /// On-demand communication: ranks wait only per minibatch.
    Odc,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Mode::Collective => "collective",
            Mode::Odc => "odc",
        })
    }
}

/// One row of a [`Comparison`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ComparisonRow {
    /// Strategy that built the plan.
    pub strategy: Strategy,
    /// Synchronisation it runs under.
    pub mode: Mode,
    /// Whole-run bubble rate.
    pub bubble: f64,
    /// Predicted time of the whole run, fixed costs included.
    pub time: f64,
    /// Predicted speedup over collective + LB-Micro on the same data: the
    /// ratio of the times.
    pub speedup: f64,
    /// Largest microbatch count any rank runs in any minibatch.
    pub max_microbatches: usize,
}

/// Every strategy under both modes, relative to collective + LB-Micro.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// Bubble rate of the baseline (collective + LB-Micro).
    pub baseline_bubble: f64,
    /// Predicted time of the baseline, fixed costs included.
    pub baseline_time: f64,
    /// The fixed costs every plan was made and predicted with.
    pub fixed: FixedCost,
    /// Rows in [`Strategy::ALL`] order, collective before ODC.
    pub rows: Vec<ComparisonRow>,
}

/// Plans `lengths` with every strategy (keeping the rest of `base`) and
/// scores each under collectives and ODC.
///
/// # Errors
///
/// As [`plan`].
pub fn compare(lengths: &[u64], base: &PlanConfig) -> Result<Comparison> {
    let costs: Vec<f64> = lengths.iter().map(|&s| base.cost.cost(s)).collect();
    let plans = Strategy::ALL
        .into_iter()
        .map(|strategy| {
            let cfg = PlanConfig { strategy, ..*base };
            plan_with_costs(lengths, &costs, &cfg).map(|p| (strategy, p))
        })
        .collect::<Result<Vec<_>>>()?;
    let (baseline_bubble, baseline_time) = plans
        .iter()
        .find(|(s, _)| *s == Strategy::LbMicro)
        .map_or((0.0, 0.0), |(_, p)| {
            (p.bubble_collective, p.time_collective)
        });
    let rows = plans
        .iter()
        .flat_map(|(strategy, p)| {
            let max_microbatches = p.microbatch_counts().max().unwrap_or(0);
            [
                (Mode::Collective, p.bubble_collective, p.time_collective),
                (Mode::Odc, p.bubble_odc, p.time_odc),
            ]
            .map(|(mode, bubble, time)| ComparisonRow {
                strategy: *strategy,
                mode,
                bubble,
                time,
                speedup: time_ratio(baseline_time, time),
                max_microbatches,
            })
        })
        .collect();
    Ok(Comparison {
        baseline_bubble,
        baseline_time,
        fixed: base.fixed,
        rows,
    })
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fixed = !self.fixed.is_zero();
        write!(
            f,
            "{:<12} {:<11} {:>8} {:>9} {:>10}",
            "strategy", "mode", "bubble", "speedup", "max-micro"
        )?;
        if fixed {
            write!(f, " {:>12}", "time")?;
        }
        writeln!(f)?;
        for r in &self.rows {
            write!(
                f,
                "{:<12} {:<11} {:>7.2}% {:>8.3}x {:>10}",
                r.strategy.name(),
                r.mode,
                100.0 * r.bubble,
                r.speedup,
                r.max_microbatches
            )?;
            if fixed {
                write!(f, " {:>12.6}", r.time)?;
            }
            writeln!(f)?;
        }
        write!(f, "speedup is relative to collective + lb-micro")?;
        if fixed {
            write!(
                f,
                "; with fixed costs {} per microbatch and {} per minibatch (plans and times)",
                self.fixed.microbatch, self.fixed.minibatch
            )?;
        }
        Ok(())
    }
}
