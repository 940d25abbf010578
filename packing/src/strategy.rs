//! Strategies: who runs which sample, in which microbatch.
//!
//! One file for the four strategies, which share the minibatch cutting and
//! the microbatch packing; the last 130 lines are its tests.
//!
//! Owns the mapping from sequence lengths to an *assignment*: per global
//! minibatch, per rank, a list of microbatches, each a list of global
//! sample indices. It does not judge assignments — that is
//! [`crate::sim`] — and it sees costs only as numbers handed in.
//!
//! Common rules. The input, in dataset order or in the order given to
//! [`assign_ordered`], is cut into global minibatches of
//! `minibatch_size · world` consecutive samples (the last may be partial
//! and is kept). Every sample lands in exactly one microbatch; no
//! microbatch holds more than `max_tokens` tokens.
//!
//! Packing a sample set into microbatches searches the smallest bin count
//! whose cost-balanced partition (Karmarkar–Karp; greedy LPT when
//! `n·bins` exceeds 2²⁴) fits the budget, falling back to a balanced
//! first-fit by tokens. Both cost at least `n·bins`, which grows with the
//! square of a minibatch's sample count: minibatches of up to a few
//! thousand samples take milliseconds, a single one of 2·10⁴ samples
//! seconds.
//!
//! | strategy | balances | microbatch count per rank |
//! |----------|----------|---------------------------|
//! | [`Strategy::LocalSort`] | nothing | one per sample |
//! | [`Strategy::LbMicro`] | every microbatch step | equal on all ranks |
//! | [`Strategy::LbMini`] | each rank's minibatch total | free (may be 0) |
//! | [`Strategy::VerlNative`] | the whole batch, then microbatches | equal on all ranks |
//!
//! Fixed costs ([`FixedCost`], [`assign_ordered`]). With a per-microbatch
//! cost `f > 0`, LB-Micro and LB-Mini minimise the predicted time with it
//! (see [`crate::sim`]) instead of taking the fewest microbatches that fit
//! and balancing the samples' costs alone: LB-Micro tries a few more steps
//! than the fewest and keeps the count whose `Σ_m max_d C[m,d] + K·f` is
//! smallest (ties: fewer); LB-Mini starts from the best of three rank
//! partitions (Karmarkar–Karp by cost, Karmarkar–Karp by cost plus each
//! sample's share `f · tokens / max_tokens` of a microbatch, and the ranks'
//! samples in LB-Micro's plan) and moves or swaps samples between the rank
//! with the largest `Σ C + n_d·f` and the lightest ranks while that lowers
//! it, `n_d` being the fewest microbatches its samples pack into; where
//! LB-Micro's plan itself (an LB-Mini plan too, without its empty steps) is
//! faster under ODC, that is LB-Mini's plan. Neither ever does worse by
//! that measure than its plan without fixed costs, and LB-Mini never worse
//! than LB-Micro's plan run under ODC. With `f = 0` (unknown)
//! both plan exactly as without fixed costs. The per-minibatch cost is the
//! same for every plan and changes no choice.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::cost::FixedCost;
use crate::error::{Error, Location, Result};
use crate::kk::{karmarkar_karp, lpt};

/// Above this `n·k`, microbatch packing uses LPT instead of Karmarkar–Karp.
const LARGE_PARTITION: usize = 1 << 24;

/// With a per-microbatch cost, LB-Micro tries up to this many steps more
/// than the fewest that fit.
pub const MORE_STEPS: usize = 4;

/// With a per-microbatch cost, LB-Mini's search takes samples from the
/// slowest rank to at most this many of the fastest ranks per step ...
pub const SEARCH_RANKS: usize = 8;

/// ... for at most `SEARCH_MIN_STEPS + SEARCH_STEPS_PER_RANK · D` steps.
const SEARCH_MIN_STEPS: usize = 64;
const SEARCH_STEPS_PER_RANK: usize = 8;

/// Swaps are tried between two ranks only while their sample counts
/// multiply to at most this (moves always).
const SWAP_LIMIT: usize = 1024;

/// One microbatch: global sample indices, ascending.
pub type Microbatch = Vec<usize>;

/// One minibatch's assignment: `[rank][microbatch]`.
pub type MinibatchAssignment = Vec<Vec<Microbatch>>;

/// A packing strategy. Parse one from its name with [`str::parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Strided split of each minibatch (rank `d` gets samples `d, d+D, …`),
    /// each rank sorts its samples by length, descending, and runs one
    /// sample per microbatch.
    LocalSort,
    /// Balance every microbatch step across ranks, with the same number of
    /// microbatches on every rank (what collectives need). The minibatch is
    /// split by Karmarkar–Karp into `K·D` bins for the smallest `K` whose
    /// bins respect `max_tokens`; bins sorted by cost are dealt in groups
    /// of `D`, one step per group. A rank gets an empty microbatch `[]`
    /// only when the minibatch has fewer than `K·D` samples (a short final
    /// minibatch, or fewer samples than ranks).
    LbMicro,
    /// Balance each rank's total cost per minibatch with Karmarkar–Karp
    /// (`k = D`, unequal sizes; with fewer samples than ranks some ranks get
    /// none), then each rank packs its own samples into the fewest
    /// microbatches that fit `max_tokens`, balanced by cost. Counts differ
    /// between ranks, so this needs ODC rather than collectives.
    LbMini,
    /// verl's pipeline: balance the whole batch into `D` equal-count parts
    /// (as verl's `balance_batch`), split each rank's part in order into
    /// minibatches of `minibatch_size`, then split each rank's minibatch
    /// into cost-balanced microbatches under `max_tokens` and raise every
    /// rank to the largest microbatch count of that minibatch (splitting
    /// microbatches, or adding empty ones). When `D` does not divide the
    /// sample count, parts differ in size by at most one (the partition is
    /// padded with zero-cost phantom samples that are then dropped), and a
    /// rank may run out one minibatch early.
    VerlNative,
}

const VALID: &str = "local-sort, lb-micro, lb-mini, verl-native";

impl Strategy {
    /// Every strategy, in table order.
    pub const ALL: [Strategy; 4] = [
        Strategy::LocalSort,
        Strategy::LbMicro,
        Strategy::LbMini,
        Strategy::VerlNative,
    ];

    /// The name [`str::parse`] accepts.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::LocalSort => "local-sort",
            Strategy::LbMicro => "lb-micro",
            Strategy::LbMini => "lb-mini",
            Strategy::VerlNative => "verl-native",
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for Strategy {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        Strategy::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .ok_or_else(|| Error::UnknownStrategy {
                name: s.to_owned(),
                valid: VALID,
            })
    }
}

/// Largest supported world size (plans hold a list per rank).
pub const MAX_WORLD: usize = 1 << 20;

/// How samples are batched: world size, minibatch size and token budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Number of data-parallel ranks `D`.
    pub world: usize,
    /// Samples per rank per minibatch `M`.
    pub minibatch_size: usize,
    /// Most tokens one microbatch may hold.
    pub max_tokens: u64,
}

impl Batching {
    fn validate(&self, lengths: &[u64], costs: &[f64]) -> Result<()> {
        let bad = |field, value: String, reason| Error::InvalidConfig {
            field,
            value,
            reason,
        };
        if self.world == 0 {
            return Err(bad("world", "0".into(), "need at least one rank"));
        }
        if self.world > MAX_WORLD {
            return Err(bad(
                "world",
                self.world.to_string(),
                "at most 1048576 ranks",
            ));
        }
        if self.minibatch_size == 0 {
            return Err(bad(
                "minibatch_size",
                "0".into(),
                "need at least one sample per rank",
            ));
        }
        if self.max_tokens == 0 {
            return Err(bad(
                "max_tokens",
                "0".into(),
                "need a positive token budget",
            ));
        }
        if lengths.is_empty() {
            return Err(Error::EmptyLengths);
        }
        if costs.len() != lengths.len() {
            return Err(bad(
                "costs",
                costs.len().to_string(),
                "need one cost per sequence length",
            ));
        }
        for (index, &length) in lengths.iter().enumerate() {
            if length == 0 {
                return Err(Error::ZeroLength {
                    at: Location::Index(index),
                });
            }
            if length > self.max_tokens {
                return Err(Error::SampleTooLong {
                    index,
                    length,
                    max_tokens: self.max_tokens,
                });
            }
        }
        crate::input::total_tokens(lengths)?;
        if let Some((index, &value)) = costs
            .iter()
            .enumerate()
            .find(|(_, c)| !(c.is_finite() && **c >= 0.0))
        {
            return Err(Error::InvalidWeight { index, value });
        }
        Ok(())
    }
}

/// Assigns samples to minibatches, ranks and microbatches, without fixed
/// costs ([`assign_ordered`] takes them).
///
/// `costs[i]` is the cost of sample `i` (see [`crate::cost`]). Returns one
/// [`MinibatchAssignment`] per global minibatch.
///
/// # Errors
///
/// [`Error::InvalidConfig`] for a zero world, minibatch size or budget;
/// [`Error::EmptyLengths`]; [`Error::ZeroLength`]; [`Error::SampleTooLong`]
/// naming the first sample over `max_tokens`; [`Error::TotalTooLarge`]
/// when the lengths add up past 2^64 − 1; [`Error::InvalidWeight`] for a
/// non-finite or negative cost.
pub fn assign(
    strategy: Strategy,
    lengths: &[u64],
    costs: &[f64],
    batching: &Batching,
) -> Result<Vec<MinibatchAssignment>> {
    let order: Vec<usize> = (0..lengths.len()).collect();
    assign_ordered(strategy, lengths, costs, batching, &order, &FixedCost::NONE)
}

/// [`assign`] with the samples taken in `order` rather than dataset order,
/// and with fixed costs: minibatches are cut from `order` (a permutation of
/// `0..lengths.len()`, a shuffled epoch say), while every index in the
/// result still names a position in `lengths`; `fixed` (in the units of
/// `costs`) is what LB-Micro and LB-Mini weigh extra microbatches with
/// (see the module docs).
///
/// # Errors
///
/// As [`assign`], [`Error::InvalidConfig`] when `order` is not a
/// permutation of `0..lengths.len()` or a fixed cost is negative or not
/// finite.
pub fn assign_ordered(
    strategy: Strategy,
    lengths: &[u64],
    costs: &[f64],
    batching: &Batching,
    order: &[usize],
    fixed: &FixedCost,
) -> Result<Vec<MinibatchAssignment>> {
    batching.validate(lengths, costs)?;
    fixed.check()?;
    check_permutation(order, lengths.len())?;
    let packer = Packer {
        lengths,
        costs,
        max_tokens: batching.max_tokens,
        per_microbatch: fixed.microbatch,
    };
    let d = batching.world;
    let global = batching.minibatch_size.saturating_mul(d);
    let indices = order;
    match strategy {
        Strategy::LocalSort => Ok(indices
            .chunks(global)
            .map(|mb| local_sort(mb, d, lengths))
            .collect()),
        Strategy::LbMicro => indices
            .chunks(global)
            .map(|mb| lb_micro(mb, d, &packer))
            .collect(),
        Strategy::LbMini => indices
            .chunks(global)
            .map(|mb| lb_mini(mb, d, &packer))
            .collect(),
        Strategy::VerlNative => verl_native(indices, d, batching.minibatch_size, &packer),
    }
}

fn local_sort(mb: &[usize], d: usize, lengths: &[u64]) -> MinibatchAssignment {
    (0..d)
        .map(|rank| {
            let mut mine: Vec<usize> = mb.iter().copied().skip(rank).step_by(d).collect();
            mine.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
            mine.into_iter().map(|i| vec![i]).collect()
        })
        .collect()
}

fn lb_micro(mb: &[usize], d: usize, packer: &Packer<'_>) -> Result<MinibatchAssignment> {
    let mut best = deal(packer, packer.pack_min(mb, d)?, d);
    let f = packer.per_microbatch;
    if f > 0.0 {
        // More steps balance each step better and cost f each: keep the
        // count with the smallest predicted time, the fewest on a tie.
        let fewest = best.iter().map(Vec::len).max().unwrap_or(0);
        let most = mb.len().div_ceil(d).min(fewest + MORE_STEPS);
        let mut best_time = packer.collective_time(&best);
        for k in fewest + 1..=most {
            if let Some(bins) = packer.try_pack(mb, k * d)? {
                let candidate = deal(packer, bins, d);
                let time = packer.collective_time(&candidate);
                if time < best_time {
                    (best, best_time) = (candidate, time);
                }
            }
        }
    }
    Ok(best)
}

/// `bins` (a multiple of `d` of them) dealt into steps of `d`, largest
/// first, in snake order, which evens out each rank's total across steps.
fn deal(packer: &Packer<'_>, mut bins: Vec<Microbatch>, d: usize) -> MinibatchAssignment {
    packer.sort_by_cost_desc(&mut bins);
    let mut ranks: MinibatchAssignment = vec![Vec::new(); d];
    for (step, group) in bins.chunks(d).enumerate() {
        for (j, bin) in group.iter().enumerate() {
            let rank = if step % 2 == 0 { j } else { d - 1 - j };
            ranks[rank].push(bin.clone());
        }
    }
    ranks
}

fn lb_mini(mb: &[usize], d: usize, packer: &Packer<'_>) -> Result<MinibatchAssignment> {
    let k = d.min(mb.len());
    let weights: Vec<f64> = mb.iter().map(|&i| packer.costs[i]).collect();
    let to_samples = |parts: Vec<Vec<usize>>| -> Vec<Vec<usize>> {
        parts
            .into_iter()
            .map(|p| p.into_iter().map(|j| mb[j]).collect())
            .collect()
    };
    let parts = to_samples(karmarkar_karp(&weights, k, false)?);
    let f = packer.per_microbatch;
    if f > 0.0 && k >= 2 {
        // Each sample also carries its share of a microbatch's fixed cost.
        let budget = packer.max_tokens as f64;
        let shared: Vec<f64> = mb
            .iter()
            .map(|&i| packer.costs[i] + f * packer.lengths[i] as f64 / budget)
            .collect();
        let other = to_samples(karmarkar_karp(&shared, k, false)?);
        // LB-Micro's plan is an LB-Mini plan too (without its empty steps): its ranks' samples are a third start,
        // and the plan itself what the result must beat.
        let mut micro = lb_micro(mb, d, packer)?;
        for rank in &mut micro {
            rank.retain(|b| !b.is_empty());
        }
        let dealt: Vec<Vec<usize>> = micro
            .iter()
            .map(|r| {
                let mut s: Vec<usize> = r.iter().flatten().copied().collect();
                s.sort_unstable();
                s
            })
            .filter(|s| !s.is_empty())
            .collect();
        let mut search = RankSearch::new(packer, parts)?;
        for start in [other, dealt] {
            if start.len() == k {
                let alternative = RankSearch::new(packer, start)?;
                if alternative.slowest().1 < search.slowest().1 {
                    search = alternative;
                }
            }
        }
        search.run(SEARCH_MIN_STEPS + SEARCH_STEPS_PER_RANK * k)?;
        let ranks = packer.pack_ranks(&search.parts, d)?;
        return Ok(if packer.odc_time(&micro) < packer.odc_time(&ranks) {
            micro
        } else {
            ranks
        });
    }
    packer.pack_ranks(&parts, d)
}

/// LB-Mini's local search with a per-microbatch cost `f`: lowers the
/// largest rank time `Σ C + n·f` (`n` the fewest microbatches the rank's
/// samples pack into) by moving one sample from the slowest rank to one of
/// the [`SEARCH_RANKS`] fastest, or swapping one for a lighter one. Each
/// accepted step strictly lowers the slowest rank's time and leaves the
/// other rank below it, so the largest time never rises; no rank is
/// emptied.
struct RankSearch<'a> {
    packer: &'a Packer<'a>,
    parts: Vec<Vec<usize>>,
    times: Vec<f64>,
}

impl<'a> RankSearch<'a> {
    fn new(packer: &'a Packer<'a>, parts: Vec<Vec<usize>>) -> Result<Self> {
        let times = parts
            .iter()
            .map(|p| packer.rank_time(p))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            packer,
            parts,
            times,
        })
    }

    /// The slowest rank and its time (ties: the lowest rank).
    fn slowest(&self) -> (usize, f64) {
        self.times
            .iter()
            .copied()
            .enumerate()
            .fold((0, f64::NEG_INFINITY), |best, (r, t)| {
                if t > best.1 {
                    (r, t)
                } else {
                    best
                }
            })
    }

    fn run(&mut self, max_steps: usize) -> Result<()> {
        for _ in 0..max_steps {
            if !self.step()? {
                break;
            }
        }
        Ok(())
    }

    /// One improving move or swap; `false` when none is found.
    fn step(&mut self) -> Result<bool> {
        let (p, top) = self.slowest();
        let tol = 1e-12 * top.abs();
        let mut others: Vec<usize> = (0..self.parts.len()).filter(|&q| q != p).collect();
        others.sort_by(|&a, &b| self.times[a].total_cmp(&self.times[b]).then(a.cmp(&b)));
        others.truncate(SEARCH_RANKS);
        // The best (new time of p, new time of q, q, taken from p, taken from q).
        let mut best: Option<(f64, f64, f64, usize, usize, Option<usize>)> = None;
        let from = self.parts[p].clone();
        for &q in &others {
            if top - self.times[q] <= tol {
                break;
            }
            let to = &self.parts[q];
            let swaps = from.len().saturating_mul(to.len()) <= SWAP_LIMIT;
            let takes = std::iter::once(None).chain(
                to.iter()
                    .copied()
                    .map(Some)
                    .filter(|_| swaps)
                    .collect::<Vec<_>>(),
            );
            for back in takes {
                if back.is_none() && from.len() < 2 {
                    continue; // never empty a rank
                }
                for &out in &from {
                    let (new_p, new_q) = traded(&from, to, out, back);
                    let bound = self
                        .packer
                        .time_bound(&new_p)
                        .max(self.packer.time_bound(&new_q));
                    let goal = best.map_or(top - tol, |b| b.0);
                    if bound >= goal {
                        continue;
                    }
                    let (tp, tq) = (
                        self.packer.rank_time(&new_p)?,
                        self.packer.rank_time(&new_q)?,
                    );
                    let worst = tp.max(tq);
                    if worst < goal {
                        best = Some((worst, tp, tq, q, out, back));
                    }
                }
            }
        }
        let Some((_, tp, tq, q, out, back)) = best else {
            return Ok(false);
        };
        let (new_p, new_q) = traded(&self.parts[p], &self.parts[q], out, back);
        (self.parts[p], self.parts[q]) = (new_p, new_q);
        (self.times[p], self.times[q]) = (tp, tq);
        Ok(true)
    }
}

/// `from` without `out` (plus `back`) and `to` with `out` (without `back`),
/// both ascending.
fn traded(
    from: &[usize],
    to: &[usize],
    out: usize,
    back: Option<usize>,
) -> (Vec<usize>, Vec<usize>) {
    let mut a: Vec<usize> = from.iter().copied().filter(|&i| i != out).collect();
    let mut b: Vec<usize> = to.iter().copied().filter(|&i| Some(i) != back).collect();
    a.extend(back);
    b.push(out);
    a.sort_unstable();
    b.sort_unstable();
    (a, b)
}

fn verl_native(
    all: &[usize],
    d: usize,
    m: usize,
    packer: &Packer<'_>,
) -> Result<Vec<MinibatchAssignment>> {
    let n = all.len();
    let padded = n.div_ceil(d) * d;
    // Position j of the partition is sample all[j]; positions ≥ n are the
    // zero-cost padding.
    let mut weights: Vec<f64> = all.iter().map(|&i| packer.costs[i]).collect();
    weights.resize(padded, 0.0);
    let parts = karmarkar_karp(&weights, d, true)?;
    let per_rank: Vec<Vec<usize>> = parts
        .into_iter()
        .map(|p| p.into_iter().filter(|&j| j < n).map(|j| all[j]).collect())
        .collect();
    let longest = per_rank.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest.div_ceil(m))
        .map(|b| {
            let chunks: Vec<&[usize]> = per_rank
                .iter()
                .map(|p| p.get(b * m..((b + 1) * m).min(p.len())).unwrap_or(&[]))
                .collect();
            let mut count = 0;
            let mut ranks = Vec::with_capacity(d);
            for chunk in &chunks {
                let bins = packer.pack_min(chunk, 1)?;
                count = count.max(bins.len());
                ranks.push(bins);
            }
            for (bins, chunk) in ranks.iter_mut().zip(&chunks) {
                if bins.len() < count {
                    *bins = packer.pack_exact(chunk, count, std::mem::take(bins))?;
                }
                packer.sort_by_cost_desc(bins);
            }
            Ok(ranks)
        })
        .collect()
}

/// `order` must hold every index below `n` exactly once.
fn check_permutation(order: &[usize], n: usize) -> Result<()> {
    let bad = |value: String, reason| Error::InvalidConfig {
        field: "order",
        value,
        reason,
    };
    if order.len() != n {
        return Err(bad(
            format!("{} indices", order.len()),
            "need one index per sequence length",
        ));
    }
    let mut seen = vec![false; n];
    for &i in order {
        match seen.get_mut(i) {
            Some(s) if !*s => *s = true,
            Some(_) => return Err(bad(i.to_string(), "index appears twice")),
            None => return Err(bad(i.to_string(), "index past the last sample")),
        }
    }
    Ok(())
}

/// Packs samples into microbatch bins under the token budget.
#[derive(Debug)]
struct Packer<'a> {
    lengths: &'a [u64],
    costs: &'a [f64],
    max_tokens: u64,
    /// The fixed cost of a microbatch (0: the fewest that fit, as always).
    per_microbatch: f64,
}

impl Packer<'_> {
    /// Under collectives: `Σ_m max_d C[m,d] + K·f` (the minibatch's fixed
    /// cost left out: the same for every plan).
    fn collective_time(&self, ranks: &MinibatchAssignment) -> f64 {
        let steps = ranks.iter().map(Vec::len).max().unwrap_or(0);
        (0..steps)
            .map(|m| {
                ranks
                    .iter()
                    .map(|r| r.get(m).map_or(0.0, |mb| self.cost(mb)))
                    .fold(0.0, f64::max)
            })
            .sum::<f64>()
            + steps as f64 * self.per_microbatch
    }

    /// Each part's samples packed into its fewest microbatches, largest first; `d` ranks (the parts first).
    fn pack_ranks(&self, parts: &[Vec<usize>], d: usize) -> Result<MinibatchAssignment> {
        let mut ranks: MinibatchAssignment = vec![Vec::new(); d];
        for (rank, samples) in parts.iter().enumerate() {
            let mut bins = self.pack_min(samples, 1)?;
            self.sort_by_cost_desc(&mut bins);
            ranks[rank] = bins;
        }
        Ok(ranks)
    }

    /// Under ODC: `max_d (Σ C + n_d·f)` (the minibatch's fixed cost left out).
    fn odc_time(&self, ranks: &MinibatchAssignment) -> f64 {
        ranks
            .iter()
            .map(|r| {
                r.iter().map(|mb| self.cost(mb)).sum::<f64>() + r.len() as f64 * self.per_microbatch
            })
            .fold(0.0, f64::max)
    }

    /// Under ODC, one rank's time: `Σ C + n·f` with `n` the microbatches
    /// [`Packer::pack_min`] packs its samples into.
    fn rank_time(&self, samples: &[usize]) -> Result<f64> {
        let n = self.pack_min(samples, 1)?.len();
        Ok(self.cost(samples) + n as f64 * self.per_microbatch)
    }

    /// A lower bound of [`Packer::rank_time`]: as many microbatches as the
    /// tokens need at least.
    fn time_bound(&self, samples: &[usize]) -> f64 {
        let n = self.tokens(samples).div_ceil(self.max_tokens);
        self.cost(samples) + n as f64 * self.per_microbatch
    }

    fn tokens(&self, bin: &[usize]) -> u64 {
        bin.iter().map(|&i| self.lengths[i]).sum()
    }

    fn cost(&self, bin: &[usize]) -> f64 {
        bin.iter().map(|&i| self.costs[i]).sum()
    }

    fn fits(&self, bin: &[usize]) -> bool {
        self.tokens(bin) <= self.max_tokens
    }

    /// Bins ordered by descending cost (ties: smallest first index first;
    /// empty bins last).
    fn sort_by_cost_desc(&self, bins: &mut [Microbatch]) {
        bins.sort_by(|a, b| {
            self.cost(b).total_cmp(&self.cost(a)).then(
                a.first()
                    .unwrap_or(&usize::MAX)
                    .cmp(b.first().unwrap_or(&usize::MAX)),
            )
        });
    }

    /// Exactly `count` bins balanced by cost, or `None` when neither
    /// Karmarkar–Karp nor balanced first-fit finds bins under the budget.
    fn try_pack(&self, samples: &[usize], count: usize) -> Result<Option<Vec<Microbatch>>> {
        if samples.is_empty() {
            return Ok(Some(vec![Vec::new(); count]));
        }
        if count == 0 {
            return Ok(None);
        }
        let weights: Vec<f64> = samples.iter().map(|&i| self.costs[i]).collect();
        let k = count.min(samples.len());
        // Differencing costs O(n·k); beyond a few million subset steps (a
        // single minibatch of ~10⁴ samples into thousands of microbatches)
        // greedy LPT, O(n log k), balances almost as well.
        let parts = if samples.len().saturating_mul(k) <= LARGE_PARTITION {
            karmarkar_karp(&weights, k, false)?
        } else {
            lpt(&weights, k)?
        };
        let mut bins: Vec<Microbatch> = parts
            .into_iter()
            .map(|p| p.into_iter().map(|j| samples[j]).collect())
            .collect();
        if !bins.iter().all(|b| self.fits(b)) {
            match self.balanced_fit(samples, count) {
                Some(b) => bins = b,
                None => return Ok(None),
            }
        }
        for bin in &mut bins {
            bin.sort_unstable();
        }
        bins.resize(count, Vec::new());
        Ok(Some(bins))
    }

    /// Decreasing by tokens, each sample into the cheapest bin with room
    /// (ties: lowest bin). O(n · count).
    fn balanced_fit(&self, samples: &[usize], count: usize) -> Option<Vec<Microbatch>> {
        let mut order = samples.to_vec();
        order.sort_by(|&a, &b| self.lengths[b].cmp(&self.lengths[a]).then(a.cmp(&b)));
        let mut bins: Vec<(u64, f64, Microbatch)> = vec![(0, 0.0, Vec::new()); count];
        for i in order {
            let len = self.lengths[i];
            let (_, bin) = bins
                .iter_mut()
                .enumerate()
                .filter(|(_, b)| b.0 + len <= self.max_tokens)
                .min_by(|(x, a), (y, b)| a.1.total_cmp(&b.1).then(x.cmp(y)))?;
            bin.0 += len;
            bin.1 += self.costs[i];
            bin.2.push(i);
        }
        Some(bins.into_iter().map(|b| b.2).collect())
    }

    /// `group·K` bins for the smallest feasible `K` found; no bins for no
    /// samples. `K` starts at the token lower bound and grows by doubling
    /// steps until the bins fit, then a bisection looks for a smaller `K`
    /// (feasibility is nearly monotone in `K`), so a minibatch costs
    /// O(log n) partitions rather than one per candidate `K`.
    fn pack_min(&self, samples: &[usize], group: usize) -> Result<Vec<Microbatch>> {
        if samples.is_empty() {
            return Ok(Vec::new());
        }
        let tokens = self.tokens(samples);
        let budget = self.max_tokens.saturating_mul(group as u64);
        let first = usize::try_from(tokens.div_ceil(budget))
            .unwrap_or(usize::MAX)
            .max(1);
        // Once K·group ≥ n every sample has its own bin, which always fits.
        let last = samples.len().div_ceil(group).max(first);
        let (mut lo, mut k, mut step) = (first - 1, first, 1);
        let (mut hi, mut best) = loop {
            if let Some(bins) = self.try_pack(samples, k * group)? {
                break (k, bins);
            }
            if k >= last {
                let mut bins: Vec<Microbatch> = samples.iter().map(|&i| vec![i]).collect();
                bins.resize(last * group, Vec::new());
                return Ok(bins);
            }
            lo = k;
            k = k.saturating_add(step).min(last);
            step = step.saturating_mul(2);
        };
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match self.try_pack(samples, mid * group)? {
                Some(bins) => (hi, best) = (mid, bins),
                None => lo = mid,
            }
        }
        Ok(best)
    }

    /// Exactly `count` bins, given a feasible packing `fallback` with fewer:
    /// repack from scratch if that fits, else split the fullest bins.
    fn pack_exact(
        &self,
        samples: &[usize],
        count: usize,
        mut fallback: Vec<Microbatch>,
    ) -> Result<Vec<Microbatch>> {
        if let Some(bins) = self.try_pack(samples, count)? {
            return Ok(bins);
        }
        while fallback.len() < count {
            let widest = fallback
                .iter()
                .enumerate()
                .max_by(|(x, a), (y, b)| a.len().cmp(&b.len()).then(y.cmp(x)))
                .map_or(0, |(j, _)| j);
            if fallback.get(widest).is_some_and(|b| b.len() >= 2) {
                let bin = std::mem::take(&mut fallback[widest]);
                let weights: Vec<f64> = bin.iter().map(|&i| self.costs[i]).collect();
                let mut halves = karmarkar_karp(&weights, 2, false)?
                    .into_iter()
                    .map(|p| p.into_iter().map(|j| bin[j]).collect::<Microbatch>());
                fallback[widest] = halves.next().unwrap_or_default();
                fallback.push(halves.next().unwrap_or_default());
            } else {
                fallback.push(Vec::new());
            }
        }
        Ok(fallback)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        strategy: Strategy,
        lengths: &[u64],
        d: usize,
        m: usize,
        t: u64,
    ) -> Vec<MinibatchAssignment> {
        let costs: Vec<f64> = lengths.iter().map(|&s| s as f64).collect();
        let batching = Batching {
            world: d,
            minibatch_size: m,
            max_tokens: t,
        };
        assign(strategy, lengths, &costs, &batching).unwrap()
    }

    fn check(plan: &[MinibatchAssignment], lengths: &[u64], d: usize, t: u64) {
        let mut seen = vec![0; lengths.len()];
        for mb in plan {
            assert_eq!(mb.len(), d);
            for rank in mb {
                for micro in rank {
                    assert!(micro.iter().map(|&i| lengths[i]).sum::<u64>() <= t);
                    for &i in micro {
                        seen[i] += 1;
                    }
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "{seen:?}");
    }

    #[test]
    fn names() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
        }
        let e = "lb-maxi".parse::<Strategy>().unwrap_err().to_string();
        assert!(e.contains("lb-maxi") && e.contains("verl-native"), "{e}");
    }

    #[test]
    fn local_sort_is_strided_and_sorted() {
        let lengths = [1, 2, 3, 4, 5, 6];
        let plan = run(Strategy::LocalSort, &lengths, 2, 3, 100);
        assert_eq!(plan.len(), 1);
        assert_eq!(plan[0][0], vec![vec![4], vec![2], vec![0]]);
        assert_eq!(plan[0][1], vec![vec![5], vec![3], vec![1]]);
    }

    #[test]
    fn every_strategy_covers_all_samples() {
        let lengths: Vec<u64> = (0..37).map(|i| (i * 7919 % 97 + 1) as u64 * 10).collect();
        for s in Strategy::ALL {
            for (d, m) in [(1, 1), (2, 3), (4, 4), (8, 2), (64, 1)] {
                let plan = run(s, &lengths, d, m, 1500);
                check(&plan, &lengths, d, 1500);
            }
        }
    }

    #[test]
    fn lb_micro_counts_equal() {
        let lengths: Vec<u64> = (0..50).map(|i| (i * 31 % 17 + 1) as u64 * 100).collect();
        for mb in run(Strategy::LbMicro, &lengths, 4, 4, 2000) {
            let c = mb[0].len();
            assert!(mb.iter().all(|r| r.len() == c));
        }
        for mb in run(Strategy::VerlNative, &lengths, 4, 4, 2000) {
            let c = mb[0].len();
            assert!(mb.iter().all(|r| r.len() == c));
        }
    }

    #[test]
    fn too_long_sample_is_named() {
        let costs = [1.0, 1.0];
        let b = Batching {
            world: 1,
            minibatch_size: 1,
            max_tokens: 10,
        };
        let e = assign(Strategy::LbMini, &[5, 11], &costs, &b).unwrap_err();
        assert!(matches!(
            e,
            Error::SampleTooLong {
                index: 1,
                length: 11,
                max_tokens: 10
            }
        ));
    }

    #[test]
    fn order_decides_minibatches_and_must_be_a_permutation() {
        let lengths = [10, 20, 30, 40];
        let costs = [10.0, 20.0, 30.0, 40.0];
        let b = Batching {
            world: 1,
            minibatch_size: 2,
            max_tokens: 100,
        };
        let plan = assign_ordered(
            Strategy::LocalSort,
            &lengths,
            &costs,
            &b,
            &[3, 0, 2, 1],
            &FixedCost::NONE,
        )
        .unwrap();
        assert_eq!(
            plan,
            vec![vec![vec![vec![3], vec![0]]], vec![vec![vec![2], vec![1]]]]
        );
        for bad in [&[0, 1, 2][..], &[0, 1, 1, 2], &[0, 1, 2, 4]] {
            let e = assign_ordered(
                Strategy::LbMini,
                &lengths,
                &costs,
                &b,
                bad,
                &FixedCost::NONE,
            )
            .unwrap_err();
            assert!(
                matches!(e, Error::InvalidConfig { field: "order", .. }),
                "{e}"
            );
        }
    }

    #[test]
    fn fewer_samples_than_ranks() {
        let lengths = [10, 20, 30];
        for s in Strategy::ALL {
            let plan = run(s, &lengths, 8, 4, 100);
            check(&plan, &lengths, 8, 100);
        }
        let plan = run(Strategy::LbMini, &lengths, 8, 4, 100);
        assert_eq!(plan[0].iter().filter(|r| r.is_empty()).count(), 5);
    }
}
