//! Property tests: partitions, strategies and the simulator.

// Test helpers may unwrap: a failure here is a test failure.
#![allow(clippy::unwrap_used)]

use odc_packing::kk::{largest_differencing, lower_bound, max_part_sum};
use odc_packing::sim::Timing;
use odc_packing::strategy::{assign, assign_ordered, Batching, MinibatchAssignment};
use odc_packing::{
    karmarkar_karp, lpt, plan, sample_order, synthetic, CostModel, FixedCost, Plan, PlanConfig,
    Strategy,
};
use proptest::prelude::*;
use proptest::strategy::Strategy as _;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

fn assert_partition(parts: &[Vec<usize>], n: usize, k: usize) {
    assert_eq!(parts.len(), k);
    let mut seen = vec![0u8; n];
    for p in parts {
        assert!(!p.is_empty(), "empty part");
        assert!(p.windows(2).all(|w| w[0] < w[1]), "part not ascending");
        for &i in p {
            seen[i] += 1;
        }
    }
    assert!(seen.iter().all(|&c| c == 1), "not a partition: {seen:?}");
}

/// Smallest largest-part sum over all k-way partitions with non-empty parts
/// (integer weights, so sums are exact), by enumerating part labels with
/// symmetry breaking and pruning.
fn brute_force(w: &[u64], k: usize, equal: bool) -> u64 {
    struct Search<'a> {
        w: &'a [u64],
        k: usize,
        equal: bool,
        sums: Vec<u64>,
        counts: Vec<usize>,
        best: u64,
    }
    impl Search<'_> {
        fn go(&mut self, i: usize, used: usize) {
            let cur = self.sums.iter().copied().max().unwrap_or(0);
            if cur >= self.best {
                return;
            }
            let n = self.w.len();
            if i == n {
                let sizes_ok = self.counts.iter().all(|&c| c > 0)
                    && (!self.equal || self.counts.iter().all(|&c| c == n / self.k));
                if sizes_ok {
                    self.best = cur;
                }
                return;
            }
            for p in 0..self.k.min(used + 1) {
                self.sums[p] += self.w[i];
                self.counts[p] += 1;
                self.go(i + 1, used.max(p + 1));
                self.sums[p] -= self.w[i];
                self.counts[p] -= 1;
            }
        }
    }
    let mut s = Search {
        w,
        k,
        equal,
        sums: vec![0; k],
        counts: vec![0; k],
        best: u64::MAX,
    };
    s.go(0, 0);
    s.best
}

fn as_f64(w: &[u64]) -> Vec<f64> {
    w.iter().map(|&x| x as f64).collect()
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn kk_is_a_partition(w in prop::collection::vec(0.0f64..1e6, 1..200), k in 1usize..20, equal in any::<bool>()) {
        let k = k.min(w.len());
        let n = if equal { w.len() / k * k } else { w.len() };
        let w = &w[..n];
        let parts = karmarkar_karp(w, k, equal).unwrap();
        assert_partition(&parts, n, k);
        if equal {
            prop_assert!(parts.iter().all(|p| p.len() == n / k));
        }
    }

    #[test]
    fn refinement_never_worse_than_plain_kk_or_lpt(w in prop::collection::vec(1u64..100_000, 1..120), k in 1usize..12) {
        let k = k.min(w.len());
        let w = as_f64(&w);
        let refined = max_part_sum(&w, &karmarkar_karp(&w, k, false).unwrap());
        let plain = max_part_sum(&w, &largest_differencing(&w, k, false).unwrap());
        let greedy = max_part_sum(&w, &lpt(&w, k).unwrap());
        prop_assert!(refined <= plain);
        prop_assert!(refined <= greedy, "refined {refined} > lpt {greedy}");
        prop_assert!(refined >= lower_bound(&w, k) * (1.0 - 1e-12));
    }

    #[test]
    fn equal_size_refinement_never_worse(w in prop::collection::vec(1u64..100_000, 1..120), k in 1usize..12) {
        let k = k.min(w.len());
        let n = w.len() / k * k;
        let w = as_f64(&w[..n]);
        let refined = max_part_sum(&w, &karmarkar_karp(&w, k, true).unwrap());
        let plain = max_part_sum(&w, &largest_differencing(&w, k, true).unwrap());
        prop_assert!(refined <= plain);
    }

    #[test]
    fn kk_is_deterministic(w in prop::collection::vec(0u64..50, 1..100), k in 1usize..10) {
        // Small integer weights force many ties.
        let k = k.min(w.len());
        let w = as_f64(&w);
        prop_assert_eq!(karmarkar_karp(&w, k, false).unwrap(), karmarkar_karp(&w, k, false).unwrap());
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// Empirically optimal family (checked on 20 000 random cases each):
    /// k ≤ 3 parts with n ≤ 5 items, and k = 2 with n ≤ 6, unequal sizes.
    /// (At k = 3, n = 6 a few inputs need a three-part exchange that the
    /// pairwise refinement cannot make.)
    #[test]
    fn optimal_on_small_cases(w in prop::collection::vec(1u64..1000, 1..=6), k in 1usize..=3) {
        let k = k.min(w.len());
        prop_assume!(w.len() <= 5 || k <= 2);
        let best = brute_force(&w, k, false);
        let got = max_part_sum(&as_f64(&w), &karmarkar_karp(&as_f64(&w), k, false).unwrap());
        prop_assert_eq!(got, best as f64, "weights {:?} k {}", w, k);
    }
}

fn lengths_strategy() -> impl proptest::strategy::Strategy<Value = Vec<u64>> {
    prop::collection::vec(1u64..=4096, 1..160)
}

fn strategy_strategy() -> impl proptest::strategy::Strategy<Value = Strategy> {
    prop::sample::select(Strategy::ALL.to_vec())
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn strategies_cover_every_sample_within_budget(
        lengths in lengths_strategy(),
        strategy in strategy_strategy(),
        world in 1usize..10,
        m in 1usize..6,
        max_tokens in 4096u64..12000,
    ) {
        let costs: Vec<f64> = lengths.iter().map(|&s| CostModel::default().cost(s)).collect();
        let batching = Batching { world, minibatch_size: m, max_tokens };
        let plan = assign(strategy, &lengths, &costs, &batching).unwrap();
        let mut seen = vec![0u8; lengths.len()];
        for mb in &plan {
            prop_assert_eq!(mb.len(), world);
            if matches!(strategy, Strategy::LbMicro | Strategy::VerlNative) {
                prop_assert!(mb.iter().all(|r| r.len() == mb[0].len()), "unequal microbatch counts");
            }
            for rank in mb {
                for micro in rank {
                    prop_assert!(micro.iter().map(|&i| lengths[i]).sum::<u64>() <= max_tokens);
                    for &i in micro {
                        seen[i] += 1;
                    }
                }
            }
        }
        prop_assert!(seen.iter().all(|&c| c == 1));
        if strategy != Strategy::VerlNative {
            // Minibatches are consecutive input windows of M·D samples.
            prop_assert_eq!(plan.len(), lengths.len().div_ceil(world * m));
        }
    }

    #[test]
    fn lb_micro_empty_only_when_short(lengths in lengths_strategy(), world in 1usize..10, m in 1usize..6) {
        let cfg = PlanConfig { world, minibatch_size: m, strategy: Strategy::LbMicro, ..PlanConfig::default() };
        let p = plan(&lengths, &cfg).unwrap();
        for (b, mb) in p.minibatches.iter().enumerate() {
            let samples = (lengths.len() - b * world * m).min(world * m);
            let steps = mb.ranks[0].microbatches.len();
            if samples >= steps * world {
                prop_assert!(mb.ranks.iter().all(|r| r.microbatches.iter().all(|x| !x.is_empty())));
            }
        }
    }

    #[test]
    fn odc_bubble_at_most_collective_and_same_seed_same_plan(
        lengths in lengths_strategy(),
        strategy in strategy_strategy(),
        world in 1usize..10,
        m in 1usize..6,
        seed in proptest::option::of(any::<u64>()),
    ) {
        let cfg = PlanConfig { world, minibatch_size: m, strategy, seed, ..PlanConfig::default() };
        let p = plan(&lengths, &cfg).unwrap();
        prop_assert!(p.bubble_odc <= p.bubble_collective + 1e-12);
        prop_assert!((0.0..=1.0).contains(&p.bubble_odc));
        for mb in &p.minibatches {
            prop_assert!(mb.bubble_odc <= mb.bubble_collective + 1e-12);
        }
        prop_assert!(p.predicted_speedup >= 1.0 - 1e-12);
        prop_assert_eq!(p, plan(&lengths, &cfg).unwrap());
    }

    #[test]
    fn seeded_plans_shuffle_minibatches_and_cover_every_sample_once(
        lengths in lengths_strategy(),
        strategy in strategy_strategy(),
        world in 1usize..10,
        m in 1usize..6,
        seed in any::<u64>(),
    ) {
        let cfg = PlanConfig { world, minibatch_size: m, strategy, seed: Some(seed), ..PlanConfig::default() };
        let p = plan(&lengths, &cfg).unwrap();
        prop_assert_eq!(&p, &plan(&lengths, &cfg).unwrap());
        let mut seen = vec![0u8; lengths.len()];
        for mb in &p.minibatches {
            for micro in mb.ranks.iter().flat_map(|r| &r.microbatches) {
                prop_assert!(micro.windows(2).all(|w| w[0] < w[1]), "microbatch not ascending");
                prop_assert!(micro.iter().map(|&i| lengths[i]).sum::<u64>() <= cfg.max_tokens);
                for &i in micro {
                    seen[i] += 1;
                }
            }
        }
        prop_assert!(seen.iter().all(|&c| c == 1), "not every sample once: {:?}", seen);
        if strategy != Strategy::VerlNative {
            // Minibatches are consecutive windows of the shuffled order.
            let order = sample_order(lengths.len(), Some(seed));
            let windows: Vec<Vec<usize>> = order
                .chunks(world * m)
                .map(|w| { let mut w = w.to_vec(); w.sort_unstable(); w })
                .collect();
            prop_assert_eq!(minibatch_sets(&p), windows);
        }
    }

    #[test]
    fn no_seed_plans_in_dataset_order(
        lengths in lengths_strategy(),
        strategy in strategy_strategy(),
        world in 1usize..10,
        m in 1usize..6,
    ) {
        let cfg = PlanConfig { world, minibatch_size: m, strategy, seed: None, ..PlanConfig::default() };
        let p = plan(&lengths, &cfg).unwrap();
        let costs: Vec<f64> = lengths.iter().map(|&s| cfg.cost.cost(s)).collect();
        let batching = Batching { world, minibatch_size: m, max_tokens: cfg.max_tokens };
        let expected = assign(strategy, &lengths, &costs, &batching).unwrap();
        let got: Vec<Vec<Vec<Vec<usize>>>> = p
            .minibatches
            .iter()
            .map(|mb| mb.ranks.iter().map(|r| r.microbatches.clone()).collect())
            .collect();
        prop_assert_eq!(got, expected);
        if strategy != Strategy::VerlNative {
            let windows: Vec<Vec<usize>> = (0..lengths.len())
                .collect::<Vec<_>>()
                .chunks(world * m)
                .map(<[usize]>::to_vec)
                .collect();
            prop_assert_eq!(minibatch_sets(&p), windows);
        }
    }

    #[test]
    fn timing_bubbles_ordered(matrix in prop::collection::vec(prop::collection::vec(0.0f64..100.0, 4), 0..6)) {
        let t = Timing::from_matrix(&matrix, 4);
        prop_assert!(t.bubble_odc() <= t.bubble_collective() + 1e-12);
    }
}

fn fixed_strategy() -> impl proptest::strategy::Strategy<Value = FixedCost> {
    // Per-sample costs of the default model run from about 1e-3 (a few
    // tokens) to 2.3 (4096 tokens): fixed costs from negligible to dominant.
    (1e-4f64..3.0, 0.0f64..3.0).prop_map(|(microbatch, minibatch)| FixedCost {
        microbatch,
        minibatch,
    })
}

/// Per minibatch: the time under `mode` with `fixed`, as the simulator counts it.
fn times(plan: &[MinibatchAssignment], costs: &[f64], fixed: &FixedCost, odc: bool) -> Vec<f64> {
    plan.iter()
        .map(|ranks| {
            let t = Timing::of_minibatch_fixed(ranks, costs, fixed);
            if odc {
                t.odc
            } else {
                t.collective
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(config(96))]

    /// LB-Micro (under collectives) and LB-Mini (under ODC) start from their
    /// plans without fixed costs and only take what lowers the predicted
    /// time with them: never slower by that measure, minibatch by minibatch,
    /// and every sample still once, within the budget, with equal counts for
    /// LB-Micro; under ODC LB-Mini is never slower than LB-Micro's plan.
    #[test]
    fn fixed_cost_plans_are_never_slower_than_plans_without(
        lengths in lengths_strategy(),
        world in 1usize..9,
        m in 1usize..6,
        max_tokens in 4096u64..12000,
        fixed in fixed_strategy(),
        seed in proptest::option::of(any::<u64>()),
    ) {
        let costs: Vec<f64> = lengths.iter().map(|&s| CostModel::default().cost(s)).collect();
        let batching = Batching { world, minibatch_size: m, max_tokens };
        let order = sample_order(lengths.len(), seed);
        for (strategy, odc) in [(Strategy::LbMicro, false), (Strategy::LbMini, true)] {
            let with = assign_ordered(strategy, &lengths, &costs, &batching, &order, &fixed).unwrap();
            let without = assign_ordered(strategy, &lengths, &costs, &batching, &order, &FixedCost::NONE).unwrap();
            let (t_with, t_without) = (times(&with, &costs, &fixed, odc), times(&without, &costs, &fixed, odc));
            for (a, b) in t_with.iter().zip(&t_without) {
                prop_assert!(*a <= b * (1.0 + 1e-12), "{strategy}: {a} > {b} with {fixed:?}");
            }
            let mut seen = vec![0u8; lengths.len()];
            for (mb, plain) in with.iter().zip(&without) {
                prop_assert_eq!(mb.len(), world);
                if strategy == Strategy::LbMicro {
                    prop_assert!(mb.iter().all(|r| r.len() == mb[0].len()), "unequal counts");
                } else {
                    // No rank loses all its samples to the search.
                    let empty = |a: &MinibatchAssignment| a.iter().filter(|r| r.is_empty()).count();
                    prop_assert_eq!(empty(mb), empty(plain));
                }
                for micro in mb.iter().flatten() {
                    prop_assert!(micro.iter().map(|&i| lengths[i]).sum::<u64>() <= max_tokens);
                    for &i in micro {
                        seen[i] += 1;
                    }
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1), "{strategy}: not every sample once");
        }
        // LB-Micro's plan runs under ODC too: LB-Mini's is never slower there.
        let mini = assign_ordered(Strategy::LbMini, &lengths, &costs, &batching, &order, &fixed).unwrap();
        let micro = assign_ordered(Strategy::LbMicro, &lengths, &costs, &batching, &order, &fixed).unwrap();
        let without_empty: Vec<MinibatchAssignment> = micro
            .iter()
            .map(|mb| mb.iter().map(|r| r.iter().filter(|b| !b.is_empty()).cloned().collect()).collect())
            .collect();
        for (a, b) in times(&mini, &costs, &fixed, true).iter().zip(&times(&without_empty, &costs, &fixed, true)) {
            prop_assert!(*a <= b * (1.0 + 1e-12), "lb-mini {a} > lb-micro {b} under ODC with {fixed:?}");
        }
    }

    /// The plan's times are the fixed-cost arithmetic of its own
    /// microbatches, and its speedup their ratio.
    #[test]
    fn plan_times_count_every_fixed_cost(
        lengths in lengths_strategy(),
        strategy in strategy_strategy(),
        world in 1usize..9,
        m in 1usize..6,
        fixed in fixed_strategy(),
    ) {
        let cfg = PlanConfig { world, minibatch_size: m, strategy, fixed, ..PlanConfig::default() };
        let p = plan(&lengths, &cfg).unwrap();
        let cost = |mb: &[usize]| mb.iter().map(|&i| cfg.cost.cost(lengths[i])).sum::<f64>();
        let (mut coll, mut odc) = (0.0, 0.0);
        for mb in &p.minibatches {
            let steps = mb.ranks.iter().map(|r| r.microbatches.len()).max().unwrap();
            let c: f64 = (0..steps)
                .map(|j| mb.ranks.iter().map(|r| r.microbatches.get(j).map_or(0.0, |x| cost(x))).fold(0.0, f64::max))
                .sum::<f64>() + steps as f64 * fixed.microbatch + fixed.minibatch;
            let o = mb.ranks.iter()
                .map(|r| r.microbatches.iter().map(|x| cost(x) + fixed.microbatch).sum::<f64>())
                .fold(0.0, f64::max) + fixed.minibatch;
            prop_assert!((mb.time_collective - c).abs() <= 1e-9 * c.max(1.0), "{} vs {c}", mb.time_collective);
            prop_assert!((mb.time_odc - o).abs() <= 1e-9 * o.max(1.0), "{} vs {o}", mb.time_odc);
            prop_assert!(mb.bubble_odc <= mb.bubble_collective + 1e-12);
            coll += c;
            odc += o;
        }
        prop_assert!((p.time_collective - coll).abs() <= 1e-9 * coll);
        prop_assert!((p.time_odc - odc).abs() <= 1e-9 * odc);
        prop_assert!((p.predicted_speedup - coll / odc).abs() <= 1e-9 * p.predicted_speedup);
        prop_assert!(p.predicted_speedup >= 1.0 - 1e-12);
        prop_assert_eq!(p.fixed, fixed);
    }

    /// LB-Micro's step count is the argmin of `Σ_m max_d C + K·f`: a dearer
    /// microbatch never buys more steps.
    #[test]
    fn dearer_microbatches_never_buy_lb_micro_more_steps(
        lengths in lengths_strategy(),
        world in 1usize..9,
        m in 1usize..6,
        f in 1e-4f64..1.0,
        more in 1.0f64..20.0,
    ) {
        let costs: Vec<f64> = lengths.iter().map(|&s| CostModel::default().cost(s)).collect();
        let batching = Batching { world, minibatch_size: m, max_tokens: 4096 };
        let order: Vec<usize> = (0..lengths.len()).collect();
        let steps = |f: f64| -> Vec<usize> {
            let fixed = FixedCost { microbatch: f, minibatch: 0.0 };
            assign_ordered(Strategy::LbMicro, &lengths, &costs, &batching, &order, &fixed)
                .unwrap()
                .iter()
                .map(|mb| mb[0].len())
                .collect()
        };
        let (cheap, dear) = (steps(f), steps(f * more));
        for (a, b) in cheap.iter().zip(&dear) {
            prop_assert!(b <= a, "{f} -> {}: {cheap:?} vs {dear:?}", f * more);
        }
    }
}

#[test]
fn a_dear_microbatch_makes_lb_mini_trade_balance_for_fewer_microbatches() {
    // Costs that grow faster than tokens: balancing cost alone leaves rank 1
    // with 120 tokens, two microbatches of a 100-token budget.
    let lengths = [80, 20, 60, 40];
    let costs = [6400.0, 400.0, 3600.0, 1600.0];
    let batching = Batching {
        world: 2,
        minibatch_size: 2,
        max_tokens: 100,
    };
    let order = [0, 1, 2, 3];
    // Which samples each rank runs, whichever rank that is.
    let ranks = |f: f64| -> Vec<Vec<usize>> {
        let fixed = FixedCost {
            microbatch: f,
            minibatch: 0.0,
        };
        let mut sets: Vec<Vec<usize>> = assign_ordered(
            Strategy::LbMini,
            &lengths,
            &costs,
            &batching,
            &order,
            &fixed,
        )
        .unwrap()[0]
            .iter()
            .map(|r| {
                let mut s: Vec<usize> = r.iter().flatten().copied().collect();
                s.sort_unstable();
                s
            })
            .collect();
        sets.sort();
        sets
    };
    // Without fixed costs: 6400 against 5600 (one microbatch against two).
    assert_eq!(ranks(0.0), vec![vec![0], vec![1, 2, 3]]);
    // At 2000 a microbatch: 6400 + 2000 against 5600 + 4000 loses to one
    // microbatch each, 6800 + 2000 against 5200 + 2000.
    assert_eq!(ranks(2000.0), vec![vec![0, 1], vec![2, 3]]);
    // Cheap microbatches keep the cost balance.
    assert_eq!(ranks(100.0), vec![vec![0], vec![1, 2, 3]]);
}

/// The samples of each minibatch, ascending.
fn minibatch_sets(p: &Plan) -> Vec<Vec<usize>> {
    p.minibatches
        .iter()
        .map(|mb| {
            let mut s: Vec<usize> = mb
                .ranks
                .iter()
                .flat_map(|r| r.microbatches.iter().flatten().copied())
                .collect();
            s.sort_unstable();
            s
        })
        .collect()
}

/// Which samples each rank runs in each minibatch, ascending.
fn rank_sets(p: &Plan) -> Vec<Vec<Vec<usize>>> {
    p.minibatches
        .iter()
        .map(|mb| {
            mb.ranks
                .iter()
                .map(|r| {
                    let mut s: Vec<usize> = r.microbatches.iter().flatten().copied().collect();
                    s.sort_unstable();
                    s
                })
                .collect()
        })
        .collect()
}

#[test]
fn different_seeds_give_different_minibatches() {
    let lengths = synthetic("lognormal:n=256,seed=0").unwrap();
    for strategy in Strategy::ALL {
        let cfg = |seed| PlanConfig {
            world: 4,
            minibatch_size: 4,
            strategy,
            seed,
            ..PlanConfig::default()
        };
        let plans: Vec<Plan> = [None, Some(1), Some(2)]
            .into_iter()
            .map(|seed| plan(&lengths, &cfg(seed)).unwrap())
            .collect();
        for p in &plans {
            let mut all: Vec<usize> = minibatch_sets(p).concat();
            all.sort_unstable();
            assert_eq!(all, (0..lengths.len()).collect::<Vec<_>>(), "{strategy}");
        }
        // verl-native balances the whole batch first, so compare who runs
        // what where; for the others the minibatch sets alone differ.
        let composition = |p: &Plan| {
            if strategy == Strategy::VerlNative {
                rank_sets(p)
            } else {
                vec![minibatch_sets(p)]
            }
        };
        assert_ne!(composition(&plans[0]), composition(&plans[1]), "{strategy}");
        assert_ne!(composition(&plans[1]), composition(&plans[2]), "{strategy}");
        assert_ne!(composition(&plans[0]), composition(&plans[2]), "{strategy}");
    }
}

#[test]
fn sample_order_is_pinned() {
    // The shuffle is part of a plan's reproducibility: the same seed must
    // give the same order on every machine and in every release.
    assert_eq!(sample_order(5, None), vec![0, 1, 2, 3, 4]);
    assert_eq!(sample_order(0, Some(7)), Vec::<usize>::new());
    // Cross-checked against an independent SplitMix64 + Fisher–Yates.
    assert_eq!(sample_order(10, Some(0)), [4, 8, 6, 0, 7, 1, 2, 9, 3, 5]);
}

#[test]
fn brute_force_sanity() {
    assert_eq!(brute_force(&[8, 7, 6, 5, 4], 2, false), 15);
    assert_eq!(brute_force(&[5, 4, 3, 3, 3], 2, false), 9);
    assert_eq!(brute_force(&[5, 1, 1, 1], 2, true), 6);
}

#[test]
fn n_at_most_k_plus_one_is_optimal_for_any_k() {
    // Provable family: with n ≤ k + 1 the optimum is max(largest item, the
    // two smallest together) and refinement's swaps always reach it.
    let mut x: u64 = 12345;
    for _ in 0..300 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let k = (x >> 33) as usize % 12 + 1;
        let n = k + ((x >> 20) as usize % 2).min(1);
        let w: Vec<u64> = (0..n)
            .map(|i| ((x >> (i % 40)) % 997 + 1) ^ (i as u64 * 31 % 7))
            .map(|v| v.max(1))
            .collect();
        let mut sorted = w.clone();
        sorted.sort_unstable();
        let optimum = if n <= k {
            sorted[n - 1]
        } else {
            sorted[n - 1].max(sorted[0] + sorted[1])
        };
        let got = max_part_sum(&as_f64(&w), &karmarkar_karp(&as_f64(&w), k, false).unwrap());
        assert_eq!(got, optimum as f64, "{w:?} k={k}");
    }
}
