//! Sequence packing for ODC: turns sequence lengths into per-rank
//! microbatch plans and predicts how much time each plan wastes.
//!
//! Data-parallel training splits a global minibatch across `D` ranks and
//! each rank runs its share as microbatches under a token budget. With
//! collectives every microbatch step ends in a synchronisation, so ranks
//! need equal microbatch counts and each step waits for its slowest rank.
//! ODC synchronises only at minibatch boundaries, which frees a rank to
//! pack its own share as it likes ([`Strategy::LbMini`]).
//!
//! # Module map
//!
//! | module | owns |
//! |--------|------|
//! | [`cost`] | per-sample cost models ([`CostModel`]) and fixed costs per microbatch and minibatch ([`FixedCost`]) |
//! | [`fit`] | the quadratic cost model fitted to measured timings ([`fit::fit_quadratic`]), the fixed costs ([`fit::fit_fixed`]) |
//! | [`kk`] | Karmarkar–Karp largest differencing, LPT, bounds |
//! | [`refine`] | local search that lowers the largest part sum |
//! | [`strategy`] | minibatch → rank → microbatch assignment ([`Strategy`]) |
//! | [`sim`] | bubble rates under collectives and ODC ([`sim::Timing`]) |
//! | [`input`] | [`parse_lengths`], [`synthetic`] lengths, the PRNG |
//! | [`cli`] | the `odc-pack` command as a library function |
//!
//! The plan API ([`plan`], [`compare`], [`Plan`], [`PlanConfig`]) lives at
//! the crate root; errors are one [`Error`] type.
//!
//! # Quick start
//!
//! ```
//! use odc_packing::{compare, plan, synthetic, FixedCost, PlanConfig, Strategy};
//!
//! let lengths = synthetic("lognormal:n=256,median=10000,sigma=1.0,max=65536,seed=0")?;
//! let cfg = PlanConfig {
//!     world: 8,
//!     minibatch_size: 4,
//!     strategy: Strategy::LbMini,
//!     max_tokens: 65_536,
//!     cost: "quadratic".parse()?,
//!     fixed: FixedCost::NONE, // or what a microbatch and a minibatch cost beside their samples
//!     seed: None, // dataset order; Some(s) shuffles samples before batching
//! };
//! let p = plan(&lengths, &cfg)?;
//! assert_eq!(p.minibatches.len(), 8); // 256 samples / (4 · 8)
//! assert!(p.bubble_odc <= p.bubble_collective);
//! println!("{}", compare(&lengths, &cfg)?); // every strategy × mode
//!
//! // The partitioner on its own:
//! let parts = odc_packing::karmarkar_karp(&[5.0, 4.0, 3.0, 3.0, 3.0], 2, false)?;
//! assert_eq!(parts, vec![vec![0, 1], vec![2, 3, 4]]);
//! # Ok::<(), odc_packing::Error>(())
//! ```
//!
//! # Determinism
//!
//! Every algorithm breaks ties by index, and synthetic data and the
//! optional sample shuffle ([`PlanConfig::seed`]) come from fixed SplitMix64
//! streams, so the same input and configuration give the same plan on
//! every machine.
//!
//! # Errors
//!
//! Nothing here panics on user input: empty input, zero or negative
//! lengths, unknown names, `k > n`, or a sample longer than the token
//! budget are [`Error`] values naming the offending value and its index.

#![warn(missing_docs)]

pub mod cli;
pub mod cost;
mod error;
pub mod fit;
pub mod input;
pub mod kk;
mod planner;
pub mod refine;
pub mod sim;
mod spec;
pub mod strategy;

pub use cost::{CostModel, FixedCost};
pub use error::{Error, Location, Result};
pub use input::{parse_lengths, synthetic};
pub use kk::{karmarkar_karp, karmarkar_karp_u64, lpt};
pub use planner::{
    compare, plan, sample_order, Comparison, ComparisonRow, MinibatchPlan, Mode, Plan, PlanConfig,
    RankPlan,
};
pub use strategy::Strategy;
