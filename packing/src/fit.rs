//! Fitting the quadratic cost model to measured timings.
//!
//! A user times forward + backward of single samples of a few lengths on
//! their own model (`odc.packing.fit_cost` does it for a torch module) and
//! hands the `(length, seconds)` pairs to [`fit_quadratic`]. The result is a
//! [`CostModel::Quadratic`] whose costs are predicted seconds, which the
//! planner takes like any other cost model, and the residual of the fit,
//! which says how far single-sample timings stray from `a·s² + b·s`.
//!
//! The fit is least squares on relative errors (timing noise is
//! multiplicative: a sample twice as long is disturbed twice as much), with
//! both coefficients non-negative (the planner's quadratic model refuses
//! negative ones); a three-term fit `a·s² + b·s + c` is reported beside it as a diagnostic:
//! `c` is a fixed cost per timed call (launches, interpreter overhead) that
//! the per-sample model cannot express.
//!
//! What a training loop pays per microbatch and per minibatch beside its
//! samples ([`FixedCost`]) is measured on whole minibatches:
//! [`fit_fixed`] takes the times of minibatches of a few different
//! microbatch counts, each microbatch one short sample, and fits
//! `seconds = g + n·(f + cost(sample))` with the per-sample cost from the
//! quadratic fit: `f` per microbatch, `g` per minibatch.

use serde::Serialize;

use crate::cost::{CostModel, FixedCost, QUADRATIC_SCALE};
use crate::error::{Error, Location, Result};

/// One measured timing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Timing {
    /// Tokens in the sample.
    pub length: u64,
    /// Seconds of its forward + backward.
    pub seconds: f64,
}

/// One timing next to what the fitted model predicts for it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FitPoint {
    /// Tokens in the sample.
    pub length: u64,
    /// Measured seconds.
    pub seconds: f64,
    /// Seconds the fitted `a·s² + b·s` predicts.
    pub predicted: f64,
    /// `predicted / seconds − 1`.
    pub relative_error: f64,
}

/// The result of [`fit_quadratic`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CostFit {
    /// The fitted model as the planner names it (`quadratic:a=..,b=..`):
    /// `a·x² + b·x` seconds with `x = s / 32000`.
    pub model: String,
    /// Seconds per token², `a` of `a·s² + b·s`.
    pub a_per_token2: f64,
    /// Seconds per token, `b` of `a·s² + b·s`.
    pub b_per_token: f64,
    /// Root mean square of `predicted − seconds` over the timings.
    pub rms_seconds: f64,
    /// Root mean square of the relative errors.
    pub rms_relative: f64,
    /// Largest relative error in absolute value.
    pub max_relative: f64,
    /// Diagnostic: the fixed seconds per call `c` of the unconstrained
    /// three-term fit `a·s² + b·s + c` (0 with fewer than 3 distinct lengths).
    pub overhead_seconds: f64,
    /// Every timing with its prediction, in input order.
    pub points: Vec<FitPoint>,
    /// The fixed costs per microbatch and per minibatch, when minibatch
    /// timings were fitted ([`CostFit::with_fixed`]).
    pub fixed: Option<FixedFit>,
}

impl CostFit {
    /// This fit with the fixed costs [`fit_fixed`] finds in `timings`.
    ///
    /// # Errors
    ///
    /// As [`fit_fixed`].
    pub fn with_fixed(mut self, timings: &[MinibatchTiming]) -> Result<Self> {
        self.fixed = Some(fit_fixed(&self, timings)?);
        Ok(self)
    }

    /// The fitted fixed costs in seconds, [`FixedCost::NONE`] when none
    /// were fitted.
    pub fn fixed_cost(&self) -> FixedCost {
        self.fixed.as_ref().map_or(FixedCost::NONE, FixedFit::cost)
    }

    /// The fitted cost model (costs in predicted seconds).
    pub fn cost_model(&self) -> CostModel {
        CostModel::Quadratic {
            a: self.a_per_token2 * QUADRATIC_SCALE * QUADRATIC_SCALE,
            b: self.b_per_token * QUADRATIC_SCALE,
        }
    }

    /// Predicted seconds of one sample of `length` tokens.
    pub fn seconds(&self, length: u64) -> f64 {
        let s = length as f64;
        self.a_per_token2 * s * s + self.b_per_token * s
    }
}

/// Fits `seconds ≈ a·s² + b·s` (`a, b ≥ 0`) to `timings`, minimising the
/// sum of squared relative errors `(a·s² + b·s) / seconds − 1`.
///
/// ```
/// use odc_packing::fit::{fit_quadratic, Timing};
/// let t: Vec<Timing> = [256u64, 512, 1024, 2048]
///     .iter()
///     .map(|&s| Timing { length: s, seconds: 2e-8 * (s * s) as f64 + 1e-4 * s as f64 })
///     .collect();
/// let fit = fit_quadratic(&t)?;
/// assert!((fit.a_per_token2 / 2e-8 - 1.0).abs() < 1e-9);
/// assert!((fit.b_per_token / 1e-4 - 1.0).abs() < 1e-9);
/// assert!(fit.max_relative < 1e-9);
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidTiming`] for a zero length or a time that is not a
/// finite positive number (naming its index); [`Error::TooFewTimings`]
/// when fewer than two distinct lengths were timed.
pub fn fit_quadratic(timings: &[Timing]) -> Result<CostFit> {
    for (i, t) in timings.iter().enumerate() {
        if t.length == 0 {
            return Err(Error::InvalidTiming {
                at: Location::Index(i),
                value: format!("{} tokens", t.length),
                reason: "a sample holds at least one token",
            });
        }
        if !(t.seconds.is_finite() && t.seconds > 0.0) {
            return Err(Error::InvalidTiming {
                at: Location::Index(i),
                value: format!("{} seconds", t.seconds),
                reason: "seconds must be finite and positive",
            });
        }
    }
    let mut distinct: Vec<u64> = timings.iter().map(|t| t.length).collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < 2 {
        return Err(Error::TooFewTimings {
            distinct: distinct.len(),
        });
    }
    // Work in u = s / s_max ∈ (0, 1] so the normal equations are well conditioned.
    let scale = *distinct.last().unwrap_or(&1) as f64;
    let pts: Vec<(f64, f64)> = timings
        .iter()
        .map(|t| (t.length as f64 / scale, t.seconds))
        .collect();
    // Relative errors: each timing weighs 1 / seconds².
    let (au, bu) = nonnegative_fit(&pts);
    let a = au / (scale * scale);
    let b = bu / scale;
    let overhead_seconds = if distinct.len() >= 3 {
        three_term_fit(&pts).map_or(0.0, |(_, _, c)| c)
    } else {
        0.0
    };
    let points: Vec<FitPoint> = timings
        .iter()
        .map(|t| {
            let s = t.length as f64;
            let predicted = a * s * s + b * s;
            FitPoint {
                length: t.length,
                seconds: t.seconds,
                predicted,
                relative_error: predicted / t.seconds - 1.0,
            }
        })
        .collect();
    let n = points.len() as f64;
    let rms_seconds = (points
        .iter()
        .map(|p| (p.predicted - p.seconds).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let rms_relative = (points.iter().map(|p| p.relative_error.powi(2)).sum::<f64>() / n).sqrt();
    let max_relative = points
        .iter()
        .map(|p| p.relative_error.abs())
        .fold(0.0, f64::max);
    let model = CostModel::Quadratic {
        a: a * QUADRATIC_SCALE * QUADRATIC_SCALE,
        b: b * QUADRATIC_SCALE,
    }
    .to_string();
    Ok(CostFit {
        model,
        a_per_token2: a,
        b_per_token: b,
        rms_seconds,
        rms_relative,
        max_relative,
        overhead_seconds,
        points,
        fixed: None,
    })
}

/// One measured minibatch: `microbatches` microbatches of one sample of
/// `length` tokens each (forward + backward), then the minibatch's own
/// work (gradient clipping, the optimizer step), in `seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MinibatchTiming {
    /// Microbatches the minibatch ran.
    pub microbatches: u64,
    /// Tokens of the one sample of each microbatch.
    pub length: u64,
    /// Seconds of the whole minibatch.
    pub seconds: f64,
}

/// One minibatch timing next to what the fitted costs predict for it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FixedPoint {
    /// Microbatches the minibatch ran.
    pub microbatches: u64,
    /// Tokens of each microbatch's sample.
    pub length: u64,
    /// Measured seconds.
    pub seconds: f64,
    /// Seconds `g + n·(f + cost(length))` predicts.
    pub predicted: f64,
}

/// The result of [`fit_fixed`]: seconds per microbatch and per minibatch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FixedFit {
    /// Seconds per microbatch beside its samples, `f ≥ 0`.
    pub microbatch_seconds: f64,
    /// Seconds per minibatch beside its microbatches, `g ≥ 0`.
    pub minibatch_seconds: f64,
    /// Diagnostic: `f` of the unconstrained line (negative: the timings'
    /// noise exceeds the cost).
    pub raw_microbatch_seconds: f64,
    /// Diagnostic: `g` of the unconstrained line.
    pub raw_minibatch_seconds: f64,
    /// Every timing with its prediction, in input order.
    pub points: Vec<FixedPoint>,
}

impl FixedFit {
    /// The fitted fixed costs, in seconds.
    pub fn cost(&self) -> FixedCost {
        FixedCost {
            microbatch: self.microbatch_seconds,
            minibatch: self.minibatch_seconds,
        }
    }
}

/// Fits the fixed costs `f` per microbatch and `g` per minibatch
/// (`f, g ≥ 0`) to whole-minibatch `timings`: least squares of
/// `seconds − n·cost(length) ≈ g + n·f`, with `cost` the per-sample
/// seconds of `fit`. Time the minibatches as training runs them (every
/// rank at once, the same communication), each microbatch one short sample
/// so that the fixed costs dominate.
///
/// ```
/// use odc_packing::fit::{fit_fixed, fit_quadratic, MinibatchTiming, Timing};
/// let t: Vec<Timing> = [64u64, 256, 1024].iter()
///     .map(|&s| Timing { length: s, seconds: 1e-4 * s as f64 }).collect();
/// let fit = fit_quadratic(&t)?;
/// let mb = |n: u64| MinibatchTiming { microbatches: n, length: 16, seconds: 0.3 + n as f64 * (0.02 + 1.6e-3) };
/// let fixed = fit_fixed(&fit, &[mb(1), mb(4)])?;
/// assert!((fixed.microbatch_seconds - 0.02).abs() < 1e-9 && (fixed.minibatch_seconds - 0.3).abs() < 1e-9);
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidTiming`] for a zero microbatch count or length, or a
/// time that is not a finite positive number (naming its index);
/// [`Error::TooFewMinibatchTimings`] when fewer than two distinct
/// microbatch counts were timed.
pub fn fit_fixed(fit: &CostFit, timings: &[MinibatchTiming]) -> Result<FixedFit> {
    for (i, t) in timings.iter().enumerate() {
        let bad = |value: String, reason| Error::InvalidTiming {
            at: Location::Index(i),
            value,
            reason,
        };
        if t.microbatches == 0 || t.length == 0 {
            return Err(bad(
                format!("{} microbatches of {} tokens", t.microbatches, t.length),
                "a timed minibatch runs at least one microbatch of at least one token",
            ));
        }
        if !(t.seconds.is_finite() && t.seconds > 0.0) {
            return Err(bad(
                format!("{} seconds", t.seconds),
                "seconds must be finite and positive",
            ));
        }
    }
    let mut distinct: Vec<u64> = timings.iter().map(|t| t.microbatches).collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < 2 {
        return Err(Error::TooFewMinibatchTimings {
            distinct: distinct.len(),
        });
    }
    // (n, seconds left once the samples' own cost is taken off)
    let pts: Vec<(f64, f64)> = timings
        .iter()
        .map(|t| {
            let n = t.microbatches as f64;
            (n, t.seconds - n * fit.seconds(t.length))
        })
        .collect();
    let m = pts.len() as f64;
    let (sn, sr) = pts
        .iter()
        .fold((0.0, 0.0), |(a, b), &(n, r)| (a + n, b + r));
    let (mean_n, mean_r) = (sn / m, sr / m);
    let (mut sxx, mut sxy, mut snn, mut snr) = (0.0, 0.0, 0.0, 0.0);
    for &(n, r) in &pts {
        sxx += (n - mean_n) * (n - mean_n);
        sxy += (n - mean_n) * (r - mean_r);
        snn += n * n;
        snr += n * r;
    }
    let raw_f = sxy / sxx; // sxx > 0: two distinct counts
    let raw_g = mean_r - raw_f * mean_n;
    let (f, g) = if raw_f >= 0.0 && raw_g >= 0.0 {
        (raw_f, raw_g)
    } else {
        // The optimum of the bounded problem lies on a bound: no fixed cost
        // per microbatch, or none per minibatch.
        let sse =
            |f: f64, g: f64| -> f64 { pts.iter().map(|&(n, r)| (g + n * f - r).powi(2)).sum() };
        let only_g = (0.0, mean_r.max(0.0));
        let only_f = ((snr / snn).max(0.0), 0.0);
        if sse(only_g.0, only_g.1) <= sse(only_f.0, only_f.1) {
            only_g
        } else {
            only_f
        }
    };
    let points = timings
        .iter()
        .map(|t| {
            let n = t.microbatches as f64;
            FixedPoint {
                microbatches: t.microbatches,
                length: t.length,
                seconds: t.seconds,
                predicted: g + n * (f + fit.seconds(t.length)),
            }
        })
        .collect();
    Ok(FixedFit {
        microbatch_seconds: f,
        minibatch_seconds: g,
        raw_microbatch_seconds: raw_f,
        raw_minibatch_seconds: raw_g,
        points,
    })
}

/// Weighted least squares `t ≈ A·u² + B·u` (weights `1 / t²`) with
/// `A, B ≥ 0`: the unconstrained solution if it is feasible, else the
/// better of the two one-term fits (the optimum of a convex problem with a
/// violated bound lies on it).
fn nonnegative_fit(pts: &[(f64, f64)]) -> (f64, f64) {
    let (mut s4, mut s3, mut s2, mut s2t, mut s1t) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(u, t) in pts {
        let w = 1.0 / (t * t);
        s4 += w * u.powi(4);
        s3 += w * u.powi(3);
        s2 += w * u * u;
        s2t += w * u * u * t;
        s1t += w * u * t;
    }
    let det = s4 * s2 - s3 * s3;
    if det > 0.0 {
        let a = (s2t * s2 - s3 * s1t) / det;
        let b = (s4 * s1t - s3 * s2t) / det;
        if a >= 0.0 && b >= 0.0 {
            return (a, b);
        }
    }
    let sse = |a: f64, b: f64| -> f64 {
        pts.iter()
            .map(|&(u, t)| ((a * u * u + b * u) / t - 1.0).powi(2))
            .sum()
    };
    let only_a = ((s2t / s4).max(0.0), 0.0);
    let only_b = (0.0, (s1t / s2).max(0.0));
    if sse(only_a.0, only_a.1) <= sse(only_b.0, only_b.1) {
        only_a
    } else {
        only_b
    }
}

/// Unconstrained weighted least squares `t ≈ A·u² + B·u + C` (weights
/// `1 / t²`; normal equations, Gaussian elimination with partial
/// pivoting); `None` if singular.
fn three_term_fit(pts: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    let mut m = [[0.0f64; 4]; 3];
    for &(u, t) in pts {
        let w = 1.0 / (t * t);
        let row = [u * u, u, 1.0];
        for i in 0..3 {
            for j in 0..3 {
                m[i][j] += w * row[i] * row[j];
            }
            m[i][3] += w * row[i] * t;
        }
    }
    for col in 0..3 {
        let pivot = (col..3).max_by(|&x, &y| m[x][col].abs().total_cmp(&m[y][col].abs()))?;
        if m[pivot][col].abs() < 1e-300 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col];
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row.iter_mut().zip(pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]))
}

/// Parses timings: one `length seconds` pair per line (a comma or blanks
/// between them; blank lines and `#` comments ignored), or a JSON array of
/// `[length, seconds]` pairs.
///
/// ```
/// use odc_packing::fit::parse_timings;
/// let t = parse_timings("# length seconds\n256 0.031\n512, 0.07\n")?;
/// assert_eq!((t[1].length, t[1].seconds), (512, 0.07));
/// assert_eq!(parse_timings("[[256, 0.031], [512, 0.07]]")?, t);
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidTiming`] naming the line (1-based) or index (0-based)
/// of an entry that is not a positive integer length and a positive
/// number of seconds; [`Error::InvalidJson`]; [`Error::TooFewTimings`]
/// for input without any timing.
pub fn parse_timings(text: &str) -> Result<Vec<Timing>> {
    let bad = |at: Location, value: &str, reason: &'static str| Error::InvalidTiming {
        at,
        value: value.to_owned(),
        reason,
    };
    let one = |at: Location, len: &str, secs: &str, shown: &str| -> Result<Timing> {
        let length = len
            .parse::<u64>()
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| bad(at, shown, "the length must be a positive integer"))?;
        let seconds = secs
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .ok_or_else(|| bad(at, shown, "seconds must be a finite positive number"))?;
        Ok(Timing { length, seconds })
    };
    let timings = if text.trim_start().starts_with('[') {
        let values: Vec<serde_json::Value> =
            serde_json::from_str(text).map_err(|source| Error::InvalidJson { source })?;
        values
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_array().map(Vec::as_slice) {
                Some([len, secs]) => one(
                    Location::Index(i),
                    &len.to_string(),
                    &secs.to_string(),
                    &v.to_string(),
                ),
                _ => Err(bad(
                    Location::Index(i),
                    &v.to_string(),
                    "expected a [length, seconds] pair",
                )),
            })
            .collect::<Result<Vec<_>>>()?
    } else {
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let body = line.split('#').next().unwrap_or("").trim();
            if body.is_empty() {
                continue;
            }
            let fields: Vec<&str> = body
                .split(|c: char| c == ',' || c.is_whitespace())
                .filter(|f| !f.is_empty())
                .collect();
            let at = Location::Line(i + 1);
            match fields.as_slice() {
                [len, secs] => out.push(one(at, len, secs, body)?),
                _ => return Err(bad(at, body, "expected `length seconds`")),
            }
        }
        out
    };
    if timings.is_empty() {
        return Err(Error::TooFewTimings { distinct: 0 });
    }
    Ok(timings)
}

/// The contents of a timings file: single-sample timings and, optionally,
/// whole-minibatch timings for [`fit_fixed`].
///
/// Lines are `length seconds` as for [`parse_timings`], or
/// `minibatch N LENGTH SECONDS`: a minibatch of `N` microbatches of one
/// `LENGTH`-token sample each took `SECONDS`. A JSON array holds pairs
/// only.
///
/// ```
/// use odc_packing::fit::parse_timing_file;
/// let (samples, minibatches) = parse_timing_file("256 0.031\n512 0.07\nminibatch 4 16 0.41\n")?;
/// assert_eq!((samples.len(), minibatches[0].microbatches, minibatches[0].seconds), (2, 4, 0.41));
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// As [`parse_timings`]; [`Error::InvalidTiming`] naming the line of a
/// `minibatch` line that is not a positive microbatch count, a positive
/// length and a finite positive time.
pub fn parse_timing_file(text: &str) -> Result<(Vec<Timing>, Vec<MinibatchTiming>)> {
    if text.trim_start().starts_with('[') {
        return Ok((parse_timings(text)?, Vec::new()));
    }
    let mut pairs = String::new();
    let mut minibatches = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let body = line.split('#').next().unwrap_or("").trim();
        let fields: Vec<&str> = body
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|f| !f.is_empty())
            .collect();
        if fields.first() != Some(&"minibatch") {
            pairs.push_str(line);
            pairs.push('\n');
            continue;
        }
        pairs.push('\n'); // keep the line numbers of what parse_timings reads
        let bad = |reason| Error::InvalidTiming {
            at: Location::Line(i + 1),
            value: body.to_owned(),
            reason,
        };
        let [_, n, len, secs] = fields.as_slice() else {
            return Err(bad("expected `minibatch MICROBATCHES LENGTH SECONDS`"));
        };
        let count = |v: &str| v.parse::<u64>().ok().filter(|&x| x > 0);
        let (Some(microbatches), Some(length)) = (count(n), count(len)) else {
            return Err(bad(
                "the microbatch count and the length must be positive integers",
            ));
        };
        let seconds = secs
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .ok_or_else(|| bad("seconds must be a finite positive number"))?;
        minibatches.push(MinibatchTiming {
            microbatches,
            length,
            seconds,
        });
    }
    Ok((parse_timings(&pairs)?, minibatches))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timings(a: f64, b: f64, lengths: &[u64], noise: &[f64]) -> Vec<Timing> {
        lengths
            .iter()
            .zip(noise.iter().cycle())
            .map(|(&s, &e)| {
                let s_f = s as f64;
                Timing {
                    length: s,
                    seconds: (a * s_f * s_f + b * s_f) * (1.0 + e),
                }
            })
            .collect()
    }

    #[test]
    fn recovers_known_coefficients_and_reports_the_residual() {
        let lengths = [64, 128, 256, 512, 1024, 2048, 4096];
        let exact = fit_quadratic(&timings(3e-8, 1.5e-4, &lengths, &[0.0])).unwrap();
        assert!((exact.a_per_token2 / 3e-8 - 1.0).abs() < 1e-9, "{exact:?}");
        assert!((exact.b_per_token / 1.5e-4 - 1.0).abs() < 1e-9, "{exact:?}");
        assert!(exact.rms_relative < 1e-9 && exact.overhead_seconds.abs() < 1e-9);
        // ±2 % noise: coefficients within a few percent, the residual says about 2 %.
        let noisy = fit_quadratic(&timings(3e-8, 1.5e-4, &lengths, &[0.02, -0.02])).unwrap();
        assert!((noisy.a_per_token2 / 3e-8 - 1.0).abs() < 0.05, "{noisy:?}");
        assert!((noisy.b_per_token / 1.5e-4 - 1.0).abs() < 0.05, "{noisy:?}");
        assert!((0.01..0.04).contains(&noisy.rms_relative), "{noisy:?}");
        // The model the planner takes costs predicted seconds.
        let m = noisy.cost_model();
        assert!((m.cost(1000) / noisy.seconds(1000) - 1.0).abs() < 1e-12);
        let again: CostModel = noisy.model.parse().unwrap();
        assert!((again.cost(1000) / m.cost(1000) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_fixed_cost_per_call_shows_in_the_diagnostic() {
        let lengths = [32, 64, 128, 256, 512, 1024, 2048];
        let mut t = timings(2e-8, 1e-4, &lengths, &[0.0]);
        for x in &mut t {
            x.seconds += 0.010;
        }
        let fit = fit_quadratic(&t).unwrap();
        assert!((fit.overhead_seconds - 0.010).abs() < 1e-9, "{fit:?}");
        // Without a constant term, the shortest sample is predicted far too cheap.
        assert!(fit.points[0].relative_error < -0.3, "{fit:?}");
    }

    #[test]
    fn coefficients_stay_non_negative() {
        // Purely linear with a slight downward bend: a would go negative.
        let t: Vec<Timing> = [100u64, 200, 400, 800]
            .iter()
            .map(|&s| Timing {
                length: s,
                seconds: 1e-4 * s as f64 - 1e-9 * (s * s) as f64,
            })
            .collect();
        let fit = fit_quadratic(&t).unwrap();
        assert_eq!(fit.a_per_token2, 0.0);
        assert!(fit.b_per_token > 0.0);
        // Purely quadratic with a tiny negative linear term: b is clamped.
        let t = timings(1e-7, -1e-7, &[100, 200, 400, 800], &[0.0]);
        let fit = fit_quadratic(&t).unwrap();
        assert_eq!(fit.b_per_token, 0.0);
        assert!(fit.a_per_token2 > 0.0);
    }

    #[test]
    fn fixed_costs_are_recovered_and_never_negative() {
        let fit = fit_quadratic(&timings(2e-8, 1e-4, &[64, 256, 1024, 2048], &[0.0])).unwrap();
        let sample = fit.seconds(16);
        let mb = |n: u64, s: f64| MinibatchTiming {
            microbatches: n,
            length: 16,
            seconds: s,
        };
        let exact: Vec<_> = [1u64, 2, 4, 4, 1]
            .iter()
            .map(|&n| mb(n, 0.25 + n as f64 * (0.017 + sample)))
            .collect();
        let f = fit_fixed(&fit, &exact).unwrap();
        assert!((f.microbatch_seconds - 0.017).abs() < 1e-12, "{f:?}");
        assert!((f.minibatch_seconds - 0.25).abs() < 1e-12, "{f:?}");
        assert!(f
            .points
            .iter()
            .all(|p| (p.predicted - p.seconds).abs() < 1e-12));
        let with = fit.clone().with_fixed(&exact).unwrap();
        assert_eq!(
            with.fixed_cost(),
            FixedCost {
                microbatch: f.microbatch_seconds,
                minibatch: f.minibatch_seconds
            }
        );
        assert_eq!(fit.fixed_cost(), FixedCost::NONE);
        // More microbatches taking less time is noise: no cost per microbatch, the mean per minibatch.
        let noisy = fit_fixed(&fit, &[mb(1, 0.40), mb(4, 0.30)]).unwrap();
        assert!(
            noisy.raw_microbatch_seconds < 0.0 && noisy.microbatch_seconds == 0.0,
            "{noisy:?}"
        );
        assert!(noisy.minibatch_seconds > 0.0, "{noisy:?}");
        // A negative per-minibatch cost is clamped, the line refitted through the origin.
        let steep = fit_fixed(&fit, &[mb(1, 0.01), mb(4, 0.2)]).unwrap();
        assert!(
            steep.raw_minibatch_seconds < 0.0 && steep.minibatch_seconds == 0.0,
            "{steep:?}"
        );
        assert!(steep.microbatch_seconds > 0.0, "{steep:?}");
        // Errors name the problem.
        let e = fit_fixed(&fit, &[mb(2, 0.1), mb(2, 0.2)]).unwrap_err();
        assert!(
            e.to_string().contains("2 distinct microbatch counts"),
            "{e}"
        );
        let e = fit_fixed(&fit, &[mb(1, 0.1), mb(0, 0.2)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("index 1") && e.contains("0 microbatches"), "{e}");
        let (pairs, mbs) =
            parse_timing_file("# t\n100 0.1\nminibatch 1 16 0.3\n200 0.2\n").unwrap();
        assert_eq!((pairs.len(), mbs.len(), mbs[0].length), (2, 1, 16));
        let e = parse_timing_file("100 0.1\nminibatch 1 x 0.3\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2") && e.contains("positive integers"),
            "{e}"
        );
        let e = parse_timing_file("100 0.1\n200 x\nminibatch 1 16 0.3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn bad_timings_are_named() {
        let e = fit_quadratic(&timings(1e-8, 1e-4, &[100, 100], &[0.0])).unwrap_err();
        assert!(e.to_string().contains("2 distinct lengths"), "{e}");
        let mut t = timings(1e-8, 1e-4, &[100, 200], &[0.0]);
        t[1].seconds = f64::NAN;
        let e = fit_quadratic(&t).unwrap_err().to_string();
        assert!(e.contains("index 1") && e.contains("NaN"), "{e}");
        let e = parse_timings("100 0.1\n200 -3\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("-3"), "{e}");
        let e = parse_timings("100 0.1\n2.5 0.3\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("2.5"), "{e}");
        let e = parse_timings("100 0.1 7\n").unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("length seconds"), "{e}");
        let e = parse_timings("[[100, 0.1], [200]]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("index 1"), "{e}");
        assert!(matches!(
            parse_timings("# nothing\n"),
            Err(Error::TooFewTimings { distinct: 0 })
        ));
    }
}
