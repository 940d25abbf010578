//! k-way number partitioning: Karmarkar–Karp largest differencing with a
//! local refinement, and greedy LPT as a baseline.
//!
//! This module owns the partitioning algorithms and nothing else: it sees
//! weights, never tokens or ranks. Strategies in [`crate::strategy`] decide
//! what the weights mean.
//!
//! # Algorithm
//!
//! [`largest_differencing`] is the k-way largest differencing method. A
//! *partial solution* is a k-vector of subsets sorted by sum; its spread is
//! `max − min`. Every item starts as its own partial solution (or, with
//! `equal_size`, items sorted ascending are grouped k at a time, one item per
//! subset, so every merge keeps the subsets equally sized). A binary heap
//! repeatedly pops the two partial solutions of largest spread and merges
//! them by pairing the largest subset of one with the smallest of the other,
//! which cancels as much of both spreads as possible.
//!
//! Subsets are intrusive singly linked lists over one `next[]` array with a
//! head and a tail per subset, so merging two subsets is O(1) and no item
//! list is ever copied. Partial solutions store only their non-empty
//! subsets (the rest are implicit zeros), so the early merges of singletons
//! cost O(1) instead of O(k). A full run is O(n·k·log k).
//!
//! [`karmarkar_karp`] then runs [`crate::refine::refine`], a bounded local
//! search that never raises the largest part sum. It matters where parts
//! are small (a few items each), where plain differencing can leave the
//! largest part well above the lower bound.
//!
//! Ties are broken by index everywhere, so results are deterministic.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::error::{Error, Result};

const NONE: u32 = u32::MAX;

/// Most items one partition may hold: item indices and partial-solution
/// sequence numbers are stored as `u32`.
pub const MAX_ITEMS: usize = (u32::MAX / 2) as usize;

/// One subset of a partial solution: its sum and its item list
/// `head → next[head] → … → tail`.
#[derive(Debug, Clone, Copy)]
struct Subset {
    sum: f64,
    head: u32,
    tail: u32,
}

/// Descending by sum; ties by head index, which is unique per subset.
fn by_sum_desc(a: &Subset, b: &Subset) -> Ordering {
    b.sum.total_cmp(&a.sum).then(a.head.cmp(&b.head))
}

/// A queued partial solution keyed by its spread. `seq` orders equal
/// spreads (earliest first) and is unique; `slot` locates the subsets.
#[derive(Debug, Clone, Copy)]
struct Entry {
    spread: f64,
    seq: u32,
    slot: u32,
}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        // Largest spread first; among equal spreads the earliest-created.
        self.spread
            .total_cmp(&other.spread)
            .then(other.seq.cmp(&self.seq))
    }
}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Entry {}

/// Checks the arguments every partitioner shares.
pub(crate) fn validate(weights: &[f64], k: usize, equal_size: bool) -> Result<()> {
    if k == 0 {
        return Err(Error::ZeroParts);
    }
    if weights.is_empty() {
        return Err(Error::EmptyWeights);
    }
    let n = weights.len();
    if n > MAX_ITEMS {
        return Err(Error::TooManyItems {
            n,
            limit: MAX_ITEMS,
        });
    }
    if let Some((index, &value)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
    {
        return Err(Error::InvalidWeight { index, value });
    }
    if k > n {
        return Err(Error::TooManyParts { k, n });
    }
    if equal_size && n % k != 0 {
        return Err(Error::NotDivisible { n, k });
    }
    Ok(())
}

/// Spread of a sorted partial solution; absent subsets count as zero.
fn spread(subsets: &[Subset], k: usize) -> f64 {
    match (subsets.first(), subsets.len() < k) {
        (None, _) => 0.0,
        (Some(max), true) => max.sum,
        (Some(max), false) => max.sum - subsets[k - 1].sum,
    }
}

/// Merges partial solutions `a` and `b` into `out`: the i-th largest subset
/// of `a` joins the i-th smallest of `b` (absent subsets are empty).
///
/// Only subsets present on both sides change, so the result is three
/// sorted runs — `a`'s unpaired largest, the paired middle, `b`'s unpaired
/// largest — and only the middle needs sorting: O(k + m log m) for `m`
/// paired subsets instead of O(k log k).
fn merge(
    a: &[Subset],
    b: &[Subset],
    k: usize,
    next: &mut [u32],
    mid: &mut Vec<Subset>,
    out: &mut Vec<Subset>,
) {
    out.clear();
    if a.len() + b.len() <= k {
        // Every subset pairs with an absent one: the result is the union.
        merge_sorted(a, b, out);
        return;
    }
    // Position i of the result pairs a[i] with b[k-1-i]: a alone for
    // i < k - |b|, both for k - |b| ≤ i < |a|, b alone for i ≥ |a|.
    let (only_a, only_b) = (&a[..k - b.len()], &b[..k - a.len()]);
    mid.clear();
    for (i, x) in a.iter().enumerate().skip(k - b.len()) {
        let y = &b[k - 1 - i];
        next[x.tail as usize] = y.head;
        mid.push(Subset {
            sum: x.sum + y.sum,
            head: x.head,
            tail: y.tail,
        });
    }
    mid.sort_unstable_by(by_sum_desc);
    // `out` first holds the short runs merged, then moves to `mid`, then
    // the final result is written back to `out`.
    merge_sorted(mid, only_b, out);
    std::mem::swap(mid, out);
    out.clear();
    merge_sorted(only_a, mid, out);
}

/// Appends the union of two runs sorted by [`by_sum_desc`] to `out`,
/// sorted. Each element of the shorter run is placed by binary search and
/// the longer run is copied in slices, so merging a few changed subsets
/// into a long unchanged run costs little more than a copy.
fn merge_sorted(x: &[Subset], y: &[Subset], out: &mut Vec<Subset>) {
    let (long, short) = if x.len() >= y.len() { (x, y) } else { (y, x) };
    let mut at = 0;
    for e in short {
        let before = long[at..].partition_point(|l| by_sum_desc(l, e) == Ordering::Less);
        out.extend_from_slice(&long[at..at + before]);
        out.push(*e);
        at += before;
    }
    out.extend_from_slice(&long[at..]);
}

/// Partial solutions: the initial ones in a queue sorted once (they never
/// change), merged ones in a heap, so the heap stays small.
#[derive(Debug)]
struct Frontier {
    initial: Vec<Entry>,
    next_initial: usize,
    heap: BinaryHeap<Entry>,
}

impl Frontier {
    fn pop(&mut self) -> Option<Entry> {
        let queued = self.initial.get(self.next_initial).copied();
        match (queued, self.heap.peek()) {
            (Some(q), Some(h)) if *h > q => self.heap.pop(),
            (Some(q), _) => {
                self.next_initial += 1;
                Some(q)
            }
            (None, _) => self.heap.pop(),
        }
    }

    fn len(&self) -> usize {
        self.initial.len() - self.next_initial + self.heap.len()
    }
}

/// Plain k-way largest differencing, without refinement.
///
/// Returns `k` parts of indices into `weights`, each sorted ascending,
/// parts ordered by descending sum (ties: smallest first index first).
/// With `equal_size`, every part holds exactly `n / k` items.
///
/// # Errors
///
/// [`Error::ZeroParts`], [`Error::EmptyWeights`], [`Error::InvalidWeight`]
/// (negative, NaN or infinite), [`Error::TooManyParts`] when `k > n`,
/// [`Error::NotDivisible`] when `equal_size` and `k` does not divide `n`,
/// and [`Error::TooManyItems`] beyond [`MAX_ITEMS`].
pub fn largest_differencing(
    weights: &[f64],
    k: usize,
    equal_size: bool,
) -> Result<Vec<Vec<usize>>> {
    validate(weights, k, equal_size)?;
    let n = weights.len();
    let mut next = vec![NONE; n];
    let single = |i: usize| Subset {
        sum: weights[i],
        head: i as u32,
        tail: i as u32,
    };
    // Slot s < n_initial is initial partial solution s: item s itself when
    // unequal (materialised on demand), or stored group s when equal-size.
    let mut slots: Vec<Vec<Subset>> = Vec::new();
    let mut initial: Vec<Entry> = if equal_size {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_unstable_by(|&a, &b| weights[a].total_cmp(&weights[b]).then(a.cmp(&b)));
        slots.extend(order.chunks(k).map(|chunk| {
            let mut subsets: Vec<Subset> = chunk.iter().map(|&i| single(i)).collect();
            subsets.sort_unstable_by(by_sum_desc);
            subsets
        }));
        slots
            .iter()
            .enumerate()
            .map(|(g, s)| Entry {
                spread: spread(s, k),
                seq: g as u32,
                slot: g as u32,
            })
            .collect()
    } else {
        (0..n)
            .map(|i| Entry {
                spread: weights[i],
                seq: i as u32,
                slot: i as u32,
            })
            .collect()
    };
    let n_initial = initial.len();
    if !equal_size {
        slots.resize(n_initial, Vec::new());
    }
    initial.sort_unstable_by(|a, b| b.cmp(a));
    let mut frontier = Frontier {
        initial,
        next_initial: 0,
        heap: BinaryHeap::new(),
    };
    let mut free_slots: Vec<u32> = Vec::new();
    let mut pool: Vec<Vec<Subset>> = Vec::new();
    let mut mid: Vec<Subset> = Vec::with_capacity(k);
    let mut seq = n_initial as u32;
    // Subsets of a partial solution, moved out of its slot.
    let take = |slots: &mut Vec<Vec<Subset>>, pool: &mut Vec<Vec<Subset>>, e: Entry| {
        let s = e.slot as usize;
        if !equal_size && s < n_initial {
            let mut v = pool.pop().unwrap_or_else(|| Vec::with_capacity(k));
            v.push(single(s));
            v
        } else {
            std::mem::take(&mut slots[s])
        }
    };
    // Merge the two widest partial solutions until one is left.
    let mut root = Vec::new();
    while let (Some(a), Some(b)) = (frontier.pop(), frontier.pop()) {
        let left = take(&mut slots, &mut pool, a);
        let right = take(&mut slots, &mut pool, b);
        let mut out = pool.pop().unwrap_or_else(|| Vec::with_capacity(k));
        merge(&left, &right, k, &mut next, &mut mid, &mut out);
        for mut v in [left, right] {
            v.clear();
            pool.push(v);
        }
        if frontier.len() == 0 {
            root = out;
            break;
        }
        free_slots.extend(
            [a.slot, b.slot]
                .into_iter()
                .filter(|&s| s as usize >= n_initial),
        );
        let slot = free_slots.pop().unwrap_or_else(|| {
            slots.push(Vec::new());
            (slots.len() - 1) as u32
        });
        frontier.heap.push(Entry {
            spread: spread(&out, k),
            seq,
            slot,
        });
        slots[slot as usize] = out;
        seq += 1;
    }
    if n_initial == 1 {
        // Nothing was merged (k = n = 1, or a single equal-size group); the
        // loop's first pop took the only partial solution.
        root = take(
            &mut slots,
            &mut pool,
            Entry {
                spread: 0.0,
                seq: 0,
                slot: 0,
            },
        );
    }
    let parts = root
        .iter()
        .map(|s| {
            let mut items = Vec::new();
            let mut i = s.head;
            while i != NONE {
                items.push(i as usize);
                i = next[i as usize];
            }
            items.sort_unstable();
            items
        })
        .collect();
    Ok(parts)
}

/// Karmarkar–Karp partition of `weights` into `k` parts, refined.
///
/// Runs [`largest_differencing`] and then [`crate::refine::refine`], which
/// only ever lowers the largest part sum. With unequal sizes, unless that
/// result already meets the lower bound, an [`lpt`] partition is computed
/// as well and, if it is better, refined and kept instead, so the result
/// is never worse than plain differencing nor than LPT. Returns `k` non-empty parts of
/// indices into `weights`, each sorted ascending, parts ordered by
/// descending sum (ties: smallest first index first). With `equal_size`
/// every part holds exactly `n / k` items.
///
/// ```
/// let parts = odc_packing::karmarkar_karp(&[8.0, 7.0, 6.0, 5.0, 4.0], 2, false)?;
/// assert_eq!(parts, vec![vec![0, 1], vec![2, 3, 4]]); // sums 15 and 15
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// As [`largest_differencing`].
pub fn karmarkar_karp(weights: &[f64], k: usize, equal_size: bool) -> Result<Vec<Vec<usize>>> {
    let mut parts = largest_differencing(weights, k, equal_size)?;
    crate::refine::refine(weights, &mut parts, equal_size);
    if !equal_size && max_part_sum(weights, &parts) > lower_bound(weights, k) {
        // Differencing and greedy fail on different inputs; LPT costs
        // O(n log n) and checking it makes the result never worse than LPT.
        let mut greedy = lpt(weights, k)?;
        if max_part_sum(weights, &greedy) < max_part_sum(weights, &parts) {
            crate::refine::refine(weights, &mut greedy, false);
            parts = greedy;
        }
    }
    order_parts(weights, &mut parts);
    Ok(parts)
}

/// [`karmarkar_karp`] over integer weights (token counts, say).
///
/// # Errors
///
/// As [`largest_differencing`].
pub fn karmarkar_karp_u64(weights: &[u64], k: usize, equal_size: bool) -> Result<Vec<Vec<usize>>> {
    let w: Vec<f64> = weights.iter().map(|&x| x as f64).collect();
    karmarkar_karp(&w, k, equal_size)
}

/// Greedy longest-processing-time: items in descending order, each to the
/// currently lightest part (ties: lowest part index). Parts are returned
/// like [`karmarkar_karp`]'s; with `k ≤ n` none is empty.
///
/// # Errors
///
/// As [`largest_differencing`] with `equal_size = false`.
pub fn lpt(weights: &[f64], k: usize) -> Result<Vec<Vec<usize>>> {
    validate(weights, k, false)?;
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_unstable_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    // Min-heap on (sum, part) through reversed Entry ordering.
    let mut heap: BinaryHeap<std::cmp::Reverse<(Sum, usize)>> =
        (0..k).map(|p| std::cmp::Reverse((Sum(0.0), p))).collect();
    let mut parts = vec![Vec::new(); k];
    for i in order {
        if let Some(std::cmp::Reverse((Sum(s), p))) = heap.pop() {
            parts[p].push(i);
            heap.push(std::cmp::Reverse((Sum(s + weights[i]), p)));
        }
    }
    for part in &mut parts {
        part.sort_unstable();
    }
    order_parts(weights, &mut parts);
    Ok(parts)
}

/// A totally ordered f64 for heaps.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sum(f64);
impl Eq for Sum {}
impl PartialOrd for Sum {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Sum {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Sum of the weights of one part.
pub fn part_sum(weights: &[f64], part: &[usize]) -> f64 {
    part.iter().map(|&i| weights[i]).sum()
}

/// Largest part sum of a partition.
pub fn max_part_sum(weights: &[f64], parts: &[Vec<usize>]) -> f64 {
    parts
        .iter()
        .map(|p| part_sum(weights, p))
        .fold(0.0, f64::max)
}

/// A lower bound on the largest part sum of any k-way partition:
/// `max(mean part sum, largest weight)`.
pub fn lower_bound(weights: &[f64], k: usize) -> f64 {
    let total: f64 = weights.iter().sum();
    let largest = weights.iter().copied().fold(0.0, f64::max);
    (total / k.max(1) as f64).max(largest)
}

/// Orders parts by descending sum, ties by smallest first index.
fn order_parts(weights: &[f64], parts: &mut [Vec<usize>]) {
    parts.sort_by_cached_key(|p| {
        (
            std::cmp::Reverse(Sum(part_sum(weights, p))),
            p.first().copied().unwrap_or(usize::MAX),
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_partition(parts: &[Vec<usize>], n: usize, k: usize) {
        assert_eq!(parts.len(), k);
        let mut seen = vec![false; n];
        for p in parts {
            assert!(!p.is_empty());
            assert!(p.windows(2).all(|w| w[0] < w[1]));
            for &i in p {
                assert!(!seen[i]);
                seen[i] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn errors() {
        assert!(matches!(
            karmarkar_karp(&[1.0], 0, false),
            Err(Error::ZeroParts)
        ));
        assert!(matches!(
            karmarkar_karp(&[], 2, false),
            Err(Error::EmptyWeights)
        ));
        assert!(matches!(
            karmarkar_karp(&[1.0, -1.0], 1, false),
            Err(Error::InvalidWeight { index: 1, .. })
        ));
        assert!(matches!(
            karmarkar_karp(&[1.0, f64::NAN], 1, false),
            Err(Error::InvalidWeight { index: 1, .. })
        ));
        assert!(matches!(
            karmarkar_karp(&[1.0, 2.0], 3, false),
            Err(Error::TooManyParts { k: 3, n: 2 })
        ));
        assert!(matches!(
            karmarkar_karp(&[1.0, 2.0, 3.0], 2, true),
            Err(Error::NotDivisible { n: 3, k: 2 })
        ));
        let msg = lpt(&[1.0], 4).unwrap_err().to_string();
        assert!(msg.contains("k = 4") && msg.contains("n = 1"), "{msg}");
    }

    #[test]
    fn classic_examples() {
        // Two-way differencing of {8,7,6,5,4} is 2 off; refinement finds 15/15.
        let w = [8.0, 7.0, 6.0, 5.0, 4.0];
        let plain = largest_differencing(&w, 2, false).unwrap();
        check_partition(&plain, 5, 2);
        assert_eq!(max_part_sum(&w, &plain), 16.0);
        let refined = karmarkar_karp(&w, 2, false).unwrap();
        assert_eq!(max_part_sum(&w, &refined), 15.0);
    }

    #[test]
    fn equal_size_parts_are_equal() {
        let w: Vec<f64> = (0..48).map(|i| ((i * 37) % 23) as f64 + 1.0).collect();
        for k in [1, 2, 3, 4, 6, 8, 12, 48] {
            let parts = karmarkar_karp(&w, k, true).unwrap();
            check_partition(&parts, w.len(), k);
            assert!(parts.iter().all(|p| p.len() == w.len() / k));
        }
    }

    #[test]
    fn k_equals_n_and_k_one() {
        let w = [3.0, 1.0, 2.0];
        assert_eq!(
            karmarkar_karp(&w, 3, false).unwrap(),
            vec![vec![0], vec![2], vec![1]]
        );
        assert_eq!(karmarkar_karp(&w, 1, true).unwrap(), vec![vec![0, 1, 2]]);
    }

    #[test]
    fn zero_weights_are_fine() {
        let w = [0.0; 5];
        let parts = karmarkar_karp(&w, 3, false).unwrap();
        check_partition(&parts, 5, 3);
    }

    #[test]
    fn lpt_basic() {
        let w = [5.0, 4.0, 3.0, 3.0, 3.0];
        let parts = lpt(&w, 2).unwrap();
        check_partition(&parts, 5, 2);
        assert_eq!(max_part_sum(&w, &parts), 10.0);
        assert_eq!(
            max_part_sum(&w, &karmarkar_karp(&w, 2, false).unwrap()),
            9.0
        );
    }
}
