//! Cost models: how long one sample of `s` tokens keeps a rank busy.
//!
//! A microbatch costs the sum of its samples' costs; the simulator and every
//! balancing strategy see samples only through [`CostModel::cost`]. Costs
//! are relative — only ratios between samples matter.
//!
//! | name | cost of `s` tokens |
//! |------|--------------------|
//! | `linear` | `s` |
//! | `quadratic` (= `quadratic:qwen2-7b`) | `a·x² + b·x`, `x = s/32000`, a = 4.348357, b = 8.768377 |
//! | `quadratic:qwen2-1.5b` | same with a = 1.982122, b = 2.611821 |
//! | `quadratic:a=A,b=B` | same with custom coefficients |
//! | `verl` | `s² + 24576·s` (verl's workload estimate) |
//! | `flops:hidden=H,layers=L,query=Q` | `L·(24·H²·s + 2·Q·s²)` |
//!
//! The `flops` model counts forward FLOPs of a decoder layer: the dense
//! matmuls (QKV and output projections plus a 4H MLP) cost `24·H²` FLOPs
//! per token, and causal attention costs `2·Q·s` FLOPs per token on
//! average (`QKᵀ` and `PV` are `2·s·Q` each, halved by the causal mask),
//! where `Q` is the query width `heads·head_dim`. Backward is a constant
//! multiple of forward and drops out of every ratio.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::spec::Params;

const VALID: &str = "linear, quadratic, quadratic:qwen2-1.5b, quadratic:qwen2-7b, \
                     quadratic:a=A,b=B, verl, flops:hidden=H,layers=L,query=Q";

/// Coefficients `(a, b)` fitted for Qwen2-1.5B.
pub const QWEN2_1_5B: (f64, f64) = (1.982122, 2.611821);
/// Coefficients `(a, b)` fitted for Qwen2-7B; the default `quadratic` model.
pub const QWEN2_7B: (f64, f64) = (4.348357, 8.768377);
/// Token scale of the quadratic model: `x = s / QUADRATIC_SCALE`.
pub const QUADRATIC_SCALE: f64 = 32000.0;

/// A per-sample cost model. Parse one from its name with [`str::parse`].
///
/// ```
/// use odc_packing::CostModel;
/// let m: CostModel = "quadratic".parse()?;
/// assert!(m.cost(64_000) > 2.0 * m.cost(32_000));
/// # Ok::<(), odc_packing::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CostModel {
    /// Cost equals the token count.
    Linear,
    /// `a·x² + b·x` with `x = s / 32000`.
    Quadratic {
        /// Quadratic coefficient.
        a: f64,
        /// Linear coefficient.
        b: f64,
    },
    /// `s² + 24576·s`, the estimate verl balances with.
    Verl,
    /// Forward FLOPs of `layers` decoder layers, see the module docs.
    Flops {
        /// Hidden size `H`.
        hidden: u64,
        /// Number of layers `L`.
        layers: u64,
        /// Query width `Q` (heads × head dim).
        query: u64,
    },
}

impl Default for CostModel {
    fn default() -> Self {
        let (a, b) = QWEN2_7B;
        CostModel::Quadratic { a, b }
    }
}

impl CostModel {
    /// Cost of one sample of `len` tokens.
    pub fn cost(&self, len: u64) -> f64 {
        let s = len as f64;
        match *self {
            CostModel::Linear => s,
            CostModel::Quadratic { a, b } => {
                let x = s / QUADRATIC_SCALE;
                a * x * x + b * x
            }
            CostModel::Verl => s * s + 24576.0 * s,
            CostModel::Flops {
                hidden,
                layers,
                query,
            } => {
                let (h, l, q) = (hidden as f64, layers as f64, query as f64);
                l * (24.0 * h * h * s + 2.0 * q * s * s)
            }
        }
    }
}

/// Fixed costs in the cost model's units: per microbatch and per minibatch.
///
/// A microbatch of samples `S` costs `Σ_{i∈S} cost(i) + microbatch`; a
/// minibatch adds `minibatch` once. `FixedCost::default()` (both 0) is the
/// per-sample model alone; the strategies then plan as they always did
/// (the fewest microbatches that fit), since a microbatch with no price
/// would otherwise be bought for any balance at all.
///
/// ```
/// use odc_packing::cost::FixedCost;
/// let f = FixedCost { microbatch: 0.017, minibatch: 0.3 };
/// assert!(f.check().is_ok() && !f.is_zero());
/// assert!(FixedCost { microbatch: -1.0, minibatch: 0.0 }.check().is_err());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct FixedCost {
    /// Cost of every microbatch on top of its samples' costs.
    pub microbatch: f64,
    /// Cost of every minibatch on top of its microbatches (once per rank,
    /// all ranks at once).
    pub minibatch: f64,
}

impl FixedCost {
    /// No fixed cost: the per-sample model alone.
    pub const NONE: FixedCost = FixedCost {
        microbatch: 0.0,
        minibatch: 0.0,
    };

    /// Whether both costs are zero.
    pub fn is_zero(&self) -> bool {
        self.microbatch == 0.0 && self.minibatch == 0.0
    }

    /// Both costs must be finite and non-negative.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the cost and its value.
    pub fn check(&self) -> Result<()> {
        for (field, value) in [
            ("microbatch_cost", self.microbatch),
            ("minibatch_cost", self.minibatch),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(Error::InvalidConfig {
                    field,
                    value: value.to_string(),
                    reason: "a fixed cost must be finite and non-negative",
                });
            }
        }
        Ok(())
    }
}

impl FromStr for CostModel {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let text = text.trim();
        let (name, args) = match text.split_once(':') {
            Some((n, a)) => (n.trim(), Some(a.trim())),
            None => (text, None),
        };
        let unknown = || Error::UnknownCostModel {
            name: text.to_owned(),
            valid: VALID,
        };
        let preset = |(a, b): (f64, f64)| CostModel::Quadratic { a, b };
        match (name, args) {
            ("linear", None) => Ok(CostModel::Linear),
            ("verl", None) => Ok(CostModel::Verl),
            ("quadratic", None) | ("quadratic", Some("qwen2-7b")) | ("qwen2-7b", None) => {
                Ok(preset(QWEN2_7B))
            }
            ("quadratic", Some("qwen2-1.5b")) | ("qwen2-1.5b", None) => Ok(preset(QWEN2_1_5B)),
            ("quadratic", Some(args)) => {
                let p = Params::parse("quadratic", args, "a,b")?;
                let (a, b) = (p.require_f64("a")?, p.require_f64("b")?);
                p.check(a >= 0.0, "a", "must be non-negative")?;
                p.check(b >= 0.0, "b", "must be non-negative")?;
                Ok(CostModel::Quadratic { a, b })
            }
            ("flops", Some(args)) => {
                let p = Params::parse("flops", args, "hidden,layers,query")?;
                let get = |key: &'static str| -> Result<u64> {
                    let v = p
                        .u64(key)?
                        .ok_or(Error::MissingParameter { spec: "flops", key })?;
                    p.check(v > 0, key, "must be positive")?;
                    Ok(v)
                };
                Ok(CostModel::Flops {
                    hidden: get("hidden")?,
                    layers: get("layers")?,
                    query: get("query")?,
                })
            }
            ("flops", None) => Err(Error::MissingParameter {
                spec: "flops",
                key: "hidden",
            }),
            _ => Err(unknown()),
        }
    }
}

impl fmt::Display for CostModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CostModel::Linear => f.write_str("linear"),
            CostModel::Verl => f.write_str("verl"),
            CostModel::Quadratic { a, b } if (a, b) == QWEN2_7B => {
                f.write_str("quadratic:qwen2-7b")
            }
            CostModel::Quadratic { a, b } if (a, b) == QWEN2_1_5B => {
                f.write_str("quadratic:qwen2-1.5b")
            }
            CostModel::Quadratic { a, b } => write!(f, "quadratic:a={a},b={b}"),
            CostModel::Flops {
                hidden,
                layers,
                query,
            } => write!(f, "flops:hidden={hidden},layers={layers},query={query}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_round_trip() {
        for name in [
            "linear",
            "verl",
            "quadratic:qwen2-7b",
            "quadratic:qwen2-1.5b",
            "quadratic:a=1.5,b=2",
            "flops:hidden=4096,layers=32,query=4096",
        ] {
            let m: CostModel = name.parse().unwrap();
            let again: CostModel = m.to_string().parse().unwrap();
            assert_eq!(m, again, "{name}");
        }
        assert_eq!(
            "quadratic".parse::<CostModel>().unwrap(),
            CostModel::default()
        );
        assert_eq!(
            "qwen2-1.5b".parse::<CostModel>().unwrap(),
            CostModel::Quadratic {
                a: 1.982122,
                b: 2.611821
            }
        );
    }

    #[test]
    fn values() {
        assert_eq!(CostModel::Linear.cost(7), 7.0);
        assert_eq!(CostModel::Verl.cost(2), 4.0 + 49152.0);
        let q: CostModel = "quadratic".parse().unwrap();
        assert!((q.cost(32000) - (4.348357 + 8.768377)).abs() < 1e-12);
        let f = CostModel::Flops {
            hidden: 2,
            layers: 3,
            query: 5,
        };
        assert_eq!(f.cost(10), 3.0 * (24.0 * 4.0 * 10.0 + 2.0 * 5.0 * 100.0));
    }

    #[test]
    fn errors_name_the_problem() {
        let e = "cubic".parse::<CostModel>().unwrap_err().to_string();
        assert!(
            e.contains("cubic") && e.contains("linear") && e.contains("flops"),
            "{e}"
        );
        let e = "flops:hidden=1,layers=2"
            .parse::<CostModel>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("query"), "{e}");
        let e = "flops:hidden=1,layers=2,query=3,heads=4"
            .parse::<CostModel>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("heads"), "{e}");
        let e = "quadratic:a=x,b=1"
            .parse::<CostModel>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"x\""), "{e}");
        let e = "quadratic:a=1"
            .parse::<CostModel>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"b\""), "{e}");
    }
}
