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

use serde::Serialize;

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
        }
    }

    /// Timing of one minibatch assignment `ranks[d][m]`.
    pub fn of_minibatch(ranks: &[Vec<Vec<usize>>], costs: &[f64]) -> Self {
        Self::from_matrix(&cost_matrix(ranks, costs), ranks.len())
    }

    /// Accumulates another minibatch into a run total.
    pub fn add(&mut self, other: &Timing) {
        self.world = self.world.max(other.world);
        self.work += other.work;
        self.collective += other.collective;
        self.odc += other.odc;
    }

    fn bubble(&self, time: f64) -> f64 {
        let capacity = self.world as f64 * time;
        if self.work <= 0.0 || capacity <= 0.0 {
            0.0
        } else {
            (1.0 - self.work / capacity).max(0.0)
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
}
