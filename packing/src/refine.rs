//! Local refinement of a k-way partition.
//!
//! Owns one operation: take a partition and lower its largest part sum by
//! trading items between the largest part and another: moving one or two
//! items out, or swapping one or two of them for lighter ones (pairs only
//! for parts of at most [`PAIR_LIMIT`] items, where they pay off). Each accepted step
//! strictly lowers the sum of the part that was largest and leaves the
//! other part below that old sum, so the largest part sum never rises.
//! The search is bounded (see [`MAX_STEPS_PER_PART`]) and stops early once
//! the largest part meets the lower bound `max(mean, largest item)`.
//!
//! With `equal_size` only swaps are tried, so part sizes never change.

use std::cmp::Ordering;
use std::collections::BTreeSet;

/// A part sum, totally ordered.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key(f64);
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Upper bound on refinement steps, per part.
pub const MAX_STEPS_PER_PART: usize = 8;

/// Steps allowed regardless of `k`.
const MIN_STEPS: usize = 64;

/// Parts with at most this many items also trade pairs of items.
pub const PAIR_LIMIT: usize = 16;

/// Up to two positions within one part, traded as a unit.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bundle {
    weight: f64,
    len: usize,
    pos: [usize; 2],
}

/// Bundles of exactly `len` items of `part` (0, 1 or 2), by weight.
fn bundles(weights: &[f64], part: &[usize], len: usize) -> Vec<Bundle> {
    let mut out = Vec::new();
    match len {
        0 => out.push(Bundle {
            weight: 0.0,
            len: 0,
            pos: [0; 2],
        }),
        1 => out.extend(part.iter().enumerate().map(|(a, &i)| Bundle {
            weight: weights[i],
            len: 1,
            pos: [a, 0],
        })),
        _ => {
            for (a, &i) in part.iter().enumerate() {
                for (b, &j) in part.iter().enumerate().skip(a + 1) {
                    out.push(Bundle {
                        weight: weights[i] + weights[j],
                        len: 2,
                        pos: [a, b],
                    });
                }
            }
        }
    }
    if len == 2 {
        // Singles inherit the part's order; pairs need sorting.
        out.sort_by(|x, y| x.weight.total_cmp(&y.weight));
    }
    out
}

/// A candidate step: trade `out` of the largest part for `inc` of another.
#[derive(Debug, Clone, Copy)]
struct Step {
    score: f64,
    out: Bundle,
    inc: Bundle,
}

/// How much a transfer of `d` across a gap lowers the larger of the two
/// sums: `min(d, gap − d)`; not positive when the step would not help.
fn score(d: f64, gap: f64) -> f64 {
    d.min(gap - d)
}

/// Improves `parts` in place without ever raising the largest part sum.
///
/// `parts` must be a partition of indices into `weights` (as returned by
/// [`crate::kk::largest_differencing`]). Steps trade one item, or for parts
/// of at most [`PAIR_LIMIT`] items up to two, between the largest part and
/// another: moves (`k`-for-0, unequal sizes only) and swaps (sizes kept
/// with `equal_size`). No part is ever emptied. On return each part is
/// sorted ascending; part order is unchanged. Returns the number of steps.
pub fn refine(weights: &[f64], parts: &mut [Vec<usize>], equal_size: bool) -> usize {
    let k = parts.len();
    if k < 2 {
        return 0;
    }
    let w = |i: usize| weights[i];
    // Items of every part sorted by weight (ties by index).
    for part in parts.iter_mut() {
        part.sort_unstable_by(|&a, &b| w(a).total_cmp(&w(b)).then(a.cmp(&b)));
    }
    let mut sums: Vec<f64> = parts
        .iter()
        .map(|p| p.iter().map(|&i| w(i)).sum())
        .collect();
    let bound = crate::kk::lower_bound(weights, k);
    // Parts by ascending sum (ties by index), updated per step in O(log k).
    let mut order: BTreeSet<(Key, usize)> =
        sums.iter().enumerate().map(|(q, &s)| (Key(s), q)).collect();
    let max_steps = MIN_STEPS + MAX_STEPS_PER_PART * k;
    let mut steps = 0;
    while steps < max_steps {
        let Some(&(Key(top), p)) = order.last() else {
            break;
        };
        let tol = 1e-12 * top;
        if top <= bound + tol {
            break;
        }
        let mut found = None;
        for &(Key(sum), q) in &order {
            let gap = top - sum;
            if q == p || gap <= 2.0 * tol {
                break;
            }
            if let Some(step) = best_step(weights, &parts[p], &parts[q], gap, equal_size) {
                if step.score > tol {
                    found = Some((q, step));
                    break;
                }
            }
        }
        let Some((q, step)) = found else { break };
        let out = take(&mut parts[p], step.out);
        let inc = take(&mut parts[q], step.inc);
        let d: f64 =
            out.iter().map(|&i| w(i)).sum::<f64>() - inc.iter().map(|&i| w(i)).sum::<f64>();
        for i in inc {
            insert_sorted(weights, &mut parts[p], i);
        }
        for i in out {
            insert_sorted(weights, &mut parts[q], i);
        }
        order.remove(&(Key(sums[p]), p));
        order.remove(&(Key(sums[q]), q));
        sums[p] -= d;
        sums[q] += d;
        order.insert((Key(sums[p]), p));
        order.insert((Key(sums[q]), q));
        steps += 1;
    }
    for part in parts.iter_mut() {
        part.sort_unstable();
    }
    steps
}

/// Removes a bundle's items from `part` (higher position first).
fn take(part: &mut Vec<usize>, b: Bundle) -> Vec<usize> {
    match b.len {
        0 => Vec::new(),
        1 => vec![part.remove(b.pos[0])],
        _ => {
            let hi = part.remove(b.pos[1]);
            vec![part.remove(b.pos[0]), hi]
        }
    }
}

fn insert_sorted(weights: &[f64], part: &mut Vec<usize>, item: usize) {
    let wi = weights[item];
    let pos = part.partition_point(|&j| weights[j].total_cmp(&wi).then(j.cmp(&item)).is_lt());
    part.insert(pos, item);
}

/// The best trade from `from` (the largest part) to `to`, whose sum is
/// `gap` lower; both slices sorted by weight.
fn best_step(
    weights: &[f64],
    from: &[usize],
    to: &[usize],
    gap: f64,
    equal_size: bool,
) -> Option<Step> {
    let half = gap / 2.0;
    let pairs = from.len() <= PAIR_LIMIT && to.len() <= PAIR_LIMIT;
    let max_len = |part: &[usize]| {
        if pairs {
            part.len().min(2)
        } else {
            part.len().min(1)
        }
    };
    let mut best: Option<Step> = None;
    for out_len in 1..=max_len(from) {
        let outs = bundles(weights, from, out_len);
        for in_len in 0..=max_len(to) {
            let legal = if equal_size {
                in_len == out_len
            } else {
                from.len() - out_len + in_len >= 1
            };
            if !legal {
                continue;
            }
            let ins = bundles(weights, to, in_len);
            for out in &outs {
                // Best incoming weight is out.weight − gap/2.
                let at = ins.partition_point(|b| b.weight < out.weight - half);
                for pos in [at.wrapping_sub(1), at] {
                    if let Some(inc) = ins.get(pos) {
                        let s = score(out.weight - inc.weight, gap);
                        if s > 0.0 && best.is_none_or(|b| s > b.score) {
                            best = Some(Step {
                                score: s,
                                out: *out,
                                inc: *inc,
                            });
                        }
                    }
                }
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kk::{largest_differencing, max_part_sum};

    #[test]
    fn never_worse_and_keeps_sizes() {
        let w: Vec<f64> = (0..40).map(|i| ((i * 7919) % 101) as f64 + 0.5).collect();
        for k in [2, 4, 5, 8] {
            for equal in [false, true] {
                let mut parts = largest_differencing(&w, k, equal).unwrap();
                let before = max_part_sum(&w, &parts);
                let sizes: Vec<usize> = parts.iter().map(Vec::len).collect();
                refine(&w, &mut parts, equal);
                assert!(max_part_sum(&w, &parts) <= before);
                if equal {
                    assert_eq!(sizes, parts.iter().map(Vec::len).collect::<Vec<_>>());
                }
                assert!(parts.iter().all(|p| !p.is_empty()));
            }
        }
    }

    #[test]
    fn move_fixes_a_lopsided_split() {
        let w = [5.0, 5.0, 5.0, 5.0];
        let mut parts = vec![vec![0, 1, 2], vec![3]];
        refine(&w, &mut parts, false);
        assert_eq!(max_part_sum(&w, &parts), 10.0);
    }
}
