//! Bubble simulator: how much rank time an assignment wastes.
//!
//! Owns the arithmetic only. For one minibatch let `C[m,d]` be the cost of
//! microbatch `m` on rank `d` (the sum of its samples' costs; 0 where rank
//! `d` has fewer than `m + 1` microbatches). Then
//!
//! * under **collectives** every microbatch step waits for the slowest
//!   rank: time `Σ_m max_d C[m,d]`, bubble `1 − ΣC / (D · Σ_m max_d C[m,d])`;
//! * under **ODC** ranks only meet at the minibatch boundary: time
//!   `max_d Σ_m C[m,d]`, bubble `1 − ΣC / (D · max_d Σ_m C[m,d])`.
//!
//! Both bubbles are 0 when `ΣC = 0`. Over a run the totals and times are
//! summed over minibatches before the same formulas are applied
//! ([`Timing::add`]). Since `max_d Σ_m ≤ Σ_m max_d`, the ODC bubble never
//! exceeds the collective one for the same assignment.
//!
//! With [`FixedCost`]s `f` per microbatch and `g` per minibatch
//! ([`Timing::of_minibatch_fixed`]) the times become what ranks run:
//! under collectives every rank runs all `K` steps, time
//! `Σ_m max_d C[m,d] + K·f + g`; under ODC rank `d` runs its own `n_d`
//! microbatches, time `max_d (Σ_m C[m,d] + n_d·f) + g`. The busy time of
//! the ranks is their samples and the fixed costs of their own
//! microbatches, `ΣC + Σ_d n_d·f + D·g`, the same in both modes (the steps a
//! collective makes a rank run beyond its own are idle), so the bubble
//! stays the idle share `1 − busy / (D · time)`, the ODC bubble never
//! exceeds the collective one, and the predicted speedup is the ratio of
//! the times.

use serde::Serialize;

use crate::cost::FixedCost;

/// Per-microbatch costs of one minibatch: `matrix[m][d]`.
pub fn cost_matrix(ranks: &[Vec<Vec<usize>>], costs: &[f64]) -> Vec<Vec<f64>> {
    let steps = ranks.iter().map(Vec::len).max().unwrap_or(0);
    (0..steps)
        .map(|m| {
            ranks
                .iter()
                .map(|r| {
                    r.get(m)
                        .map_or(0.0, |mb| mb.iter().map(|&i| costs[i]).sum())
                })
                .collect()
        })
        .collect()
}

/// Work and wall time of a minibatch (or, summed, of a run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timing {
    /// Number of ranks `D`.
    pub world: usize,
    /// Total work `ΣC` over all ranks and microbatches.
    pub work: f64,
    /// Wall time under collectives, `Σ_m max_d C[m,d]`.
    pub collective: f64,
    /// Wall time under ODC, `max_d Σ_m C[m,d]`.
    pub odc: f64,
    /// Rank time spent on the ranks' own work, summed over ranks: `ΣC`
    /// plus the fixed costs of their own microbatches and of the minibatch,
    /// `Σ_d n_d·f + D·g` (`ΣC` without fixed costs).
    pub busy: f64,
}

impl Timing {
    /// Timing of a cost matrix `matrix[m][d]` over `world` ranks.
    pub fn from_matrix(matrix: &[Vec<f64>], world: usize) -> Self {
        let mut per_rank = vec![0.0; world];
        let mut work = 0.0;
        let mut collective = 0.0;
        for row in matrix {
            let mut step = 0.0_f64;
            for (d, &c) in row.iter().enumerate() {
                work += c;
                step = step.max(c);
                if let Some(slot) = per_rank.get_mut(d) {
                    *slot += c;
                }
            }
            collective += step;
        }
        let odc = per_rank.into_iter().fold(0.0, f64::max);
        Self {
            world,
            work,
            collective,
            odc,
            busy: work,
        }
    }

    /// Timing of one minibatch assignment `ranks[d][m]`.
    pub fn of_minibatch(ranks: &[Vec<Vec<usize>>], costs: &[f64]) -> Self {
        Self::from_matrix(&cost_matrix(ranks, costs), ranks.len())
    }

    /// Timing of one minibatch assignment `ranks[d][m]` with fixed costs
    /// (see the module docs). A microbatch counts whether or not it holds
    /// samples: an empty step still runs.
    pub fn of_minibatch_fixed(ranks: &[Vec<Vec<usize>>], costs: &[f64], fixed: &FixedCost) -> Self {
        let mut t = Self::of_minibatch(ranks, costs);
        if fixed.is_zero() {
            return t;
        }
        let d = ranks.len() as f64;
        let steps = ranks.iter().map(Vec::len).max().unwrap_or(0) as f64;
        let (f, g) = (fixed.microbatch, fixed.minibatch);
        t.collective += steps * f + g;
        t.odc = ranks
            .iter()
            .map(|r| r.iter().flatten().map(|&i| costs[i]).sum::<f64>() + r.len() as f64 * f)
            .fold(0.0, f64::max)
            + g;
        let runs: usize = ranks.iter().map(Vec::len).sum();
        t.busy += runs as f64 * f + d * g;
        t
    }

    /// Accumulates another minibatch into a run total.
    pub fn add(&mut self, other: &Timing) {
        self.world = self.world.max(other.world);
        self.work += other.work;
        self.collective += other.collective;
        self.odc += other.odc;
        self.busy += other.busy;
    }

    fn bubble(&self, time: f64) -> f64 {
        let capacity = self.world as f64 * time;
        if self.busy <= 0.0 || capacity <= 0.0 {
            0.0
        } else {
            (1.0 - self.busy / capacity).max(0.0)
        }
    }

    /// Bubble rate under collectives.
    pub fn bubble_collective(&self) -> f64 {
        self.bubble(self.collective)
    }

    /// Bubble rate under ODC.
    pub fn bubble_odc(&self) -> f64 {
        self.bubble(self.odc)
    }

    /// Predicted speedup of ODC over collectives on this assignment: the
    /// ratio of the times (1 when nothing runs).
    pub fn speedup(&self) -> f64 {
        time_ratio(self.collective, self.odc)
    }
}

/// `baseline / time`, or 1 when `time` is not positive (nothing runs).
pub fn time_ratio(baseline: f64, time: f64) -> f64 {
    if time > 0.0 {
        baseline / time
    } else {
        1.0
    }
}

/// Predicted speedup of a run with bubble `bubble` over one with bubble
/// `baseline` doing the same work: `(1 − bubble) / (1 − baseline)`.
pub fn speedup(bubble: f64, baseline: f64) -> f64 {
    let base = 1.0 - baseline;
    if base <= 0.0 {
        1.0
    } else {
        (1.0 - bubble) / base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed() {
        // Two ranks, two steps: [[4, 1], [1, 4]].
        let t = Timing::from_matrix(&[vec![4.0, 1.0], vec![1.0, 4.0]], 2);
        assert_eq!((t.work, t.collective, t.odc), (10.0, 8.0, 5.0));
        assert!((t.bubble_collective() - (1.0 - 10.0 / 16.0)).abs() < 1e-12);
        assert_eq!(t.bubble_odc(), 0.0);
        assert!((speedup(0.0, 0.375) - 1.6).abs() < 1e-12);
    }

    #[test]
    fn ragged_ranks_pad_with_zero() {
        let ranks = vec![vec![vec![0], vec![1]], vec![]];
        let m = cost_matrix(&ranks, &[3.0, 2.0]);
        assert_eq!(m, vec![vec![3.0, 0.0], vec![2.0, 0.0]]);
        let t = Timing::of_minibatch(&ranks, &[3.0, 2.0]);
        assert_eq!((t.bubble_collective(), t.bubble_odc()), (0.5, 0.5));
        assert_eq!(Timing::default().bubble_odc(), 0.0);
    }

    #[test]
    fn fixed_costs_by_hand() {
        // Rank 0 runs [3] and [1], rank 1 runs [4]; f = 1 per microbatch, g = 2 per minibatch.
        let ranks = vec![vec![vec![0], vec![1]], vec![vec![2]]];
        let costs = [3.0, 1.0, 4.0];
        let fixed = FixedCost {
            microbatch: 1.0,
            minibatch: 2.0,
        };
        let t = Timing::of_minibatch_fixed(&ranks, &costs, &fixed);
        // Collectives: steps max(3,4) + max(1,0) = 5, plus 2 steps · 1, plus 2.
        assert_eq!(t.collective, 9.0);
        // ODC: rank 0 runs 4 + 2·1, rank 1 runs 4 + 1; plus 2.
        assert_eq!(t.odc, 8.0);
        assert_eq!(t.busy, 8.0 + 3.0 + 2.0 * 2.0);
        assert!((t.bubble_odc() - (1.0 - 15.0 / 16.0)).abs() < 1e-12);
        assert!((t.bubble_collective() - (1.0 - 15.0 / 18.0)).abs() < 1e-12);
        assert_eq!(t.speedup(), 9.0 / 8.0);
        let plain = Timing::of_minibatch_fixed(&ranks, &costs, &FixedCost::NONE);
        assert_eq!(plain, Timing::of_minibatch(&ranks, &costs));
        assert_eq!(plain.speedup(), 5.0 / 4.0);
    }
}
