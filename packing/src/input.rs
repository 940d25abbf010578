//! Where sequence lengths come from: text a user supplies
//! ([`parse_lengths`]) or a seeded synthetic distribution ([`synthetic`]).
//!
//! Synthetic data uses its own tiny PRNG (SplitMix64) and Box–Muller, so a
//! spec yields the same lengths on every machine and every release of this
//! crate.

use crate::error::{Error, Location, Result};
use crate::spec::Params;

/// Parses sequence lengths: a JSON array of integers, or one integer per
/// line with blank lines ignored.
///
/// ```
/// assert_eq!(odc_packing::parse_lengths("3\n\n 5\n")?, vec![3, 5]);
/// assert_eq!(odc_packing::parse_lengths("[3, 5]")?, vec![3, 5]);
/// assert!(odc_packing::parse_lengths("3\n0\n").is_err());
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::EmptyLengths`] when there is no value; [`Error::ZeroLength`],
/// [`Error::NegativeLength`], [`Error::LengthTooLarge`] or
/// [`Error::NonIntegerLength`] naming the line
/// (1-based) or array index (0-based) and the value;
/// [`Error::InvalidJson`] for a malformed array.
pub fn parse_lengths(text: &str) -> Result<Vec<u64>> {
    let lengths = if text.trim_start().starts_with('[') {
        let values: Vec<serde_json::Value> =
            serde_json::from_str(text).map_err(|source| Error::InvalidJson { source })?;
        values
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                serde_json::Value::Number(num) => one_length(&num.to_string(), Location::Index(i)),
                other => Err(Error::NonIntegerLength {
                    at: Location::Index(i),
                    value: other.to_string(),
                }),
            })
            .collect::<Result<Vec<u64>>>()?
    } else {
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(i, line)| one_length(line.trim(), Location::Line(i + 1)))
            .collect::<Result<Vec<u64>>>()?
    };
    if lengths.is_empty() {
        return Err(Error::EmptyLengths);
    }
    Ok(lengths)
}

/// The tokens of all `lengths` together: every sum the planner and the
/// command make of some of them is at most this.
///
/// ```
/// assert_eq!(odc_packing::input::total_tokens(&[3, 5])?, 8);
/// assert!(odc_packing::input::total_tokens(&[u64::MAX, 1]).is_err());
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::TotalTooLarge`] naming the sample at which the sum passes
/// 2^64 − 1.
pub fn total_tokens(lengths: &[u64]) -> Result<u64> {
    let mut total = 0u64;
    for (index, &s) in lengths.iter().enumerate() {
        total = total.checked_add(s).ok_or(Error::TotalTooLarge {
            index,
            count: lengths.len(),
        })?;
    }
    Ok(total)
}

fn one_length(value: &str, at: Location) -> Result<u64> {
    match value.parse::<u64>() {
        Ok(0) => Err(Error::ZeroLength { at }),
        Ok(n) => Ok(n),
        Err(_) if value.starts_with('-') && value.len() > 1 => {
            let rest = &value[1..];
            // "-0" is zero, "-5" negative, "-x" simply not a number.
            if rest.bytes().all(|b| b.is_ascii_digit()) {
                if rest.bytes().all(|b| b == b'0') {
                    Err(Error::ZeroLength { at })
                } else {
                    Err(Error::NegativeLength {
                        at,
                        value: value.to_owned(),
                    })
                }
            } else {
                Err(Error::NonIntegerLength {
                    at,
                    value: value.to_owned(),
                })
            }
        }
        Err(_) if value.bytes().all(|b| b.is_ascii_digit()) => Err(Error::LengthTooLarge {
            at,
            value: value.to_owned(),
        }),
        Err(_) => Err(Error::NonIntegerLength {
            at,
            value: value.to_owned(),
        }),
    }
}

/// SplitMix64: a tiny, fast, well-mixed 64-bit generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator started at `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal by Box–Muller (one draw per two uniforms).
    pub fn next_normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]: ln is finite
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// Most samples [`synthetic`] generates (1 GiB of lengths).
pub const MAX_SYNTHETIC: u64 = 1 << 27;

const DISTRIBUTIONS: &str = "lognormal:n=N,median=M,sigma=S,min=A,max=B,seed=X";

/// Generates sequence lengths from a spec.
///
/// `lognormal:n=N,median=M,sigma=S,min=A,max=B,seed=X` draws
/// `round(M · exp(S · z))`, `z ~ N(0, 1)`, clamped to `[A, B]`. Only `n` is
/// required; the defaults are `median=10000`, `sigma=1.0`, `min=1`,
/// `max=65536`, `seed=0` (LongAlign-like lengths).
///
/// ```
/// let a = odc_packing::synthetic("lognormal:n=100,median=10000,sigma=1.0,max=65536,seed=0")?;
/// let b = odc_packing::synthetic("lognormal:n=100,seed=0")?;
/// assert_eq!(a, b);
/// assert!(a.iter().all(|&s| (1..=65536).contains(&s)));
/// # Ok::<(), odc_packing::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::UnknownDistribution`], [`Error::MissingParameter`] (no `n`),
/// [`Error::UnknownParameter`], [`Error::InvalidParameter`] (unparsable,
/// `n = 0`, `n >` [`MAX_SYNTHETIC`], `median ≤ 0`, `sigma < 0`, `min = 0`, `min > max`).
pub fn synthetic(spec: &str) -> Result<Vec<u64>> {
    synthetic_with_seed(spec, 0)
}

/// [`synthetic`] with the seed used when the spec gives none.
///
/// # Errors
///
/// As [`synthetic`].
pub fn synthetic_with_seed(spec: &str, default_seed: u64) -> Result<Vec<u64>> {
    let spec = spec.trim();
    let (name, args) = spec.split_once(':').unwrap_or((spec, ""));
    if name.trim() != "lognormal" {
        return Err(Error::UnknownDistribution {
            name: name.trim().to_owned(),
            valid: DISTRIBUTIONS,
        });
    }
    let p = Params::parse("lognormal", args, "n,median,sigma,min,max,seed")?;
    let n = p.u64("n")?.ok_or(Error::MissingParameter {
        spec: "lognormal",
        key: "n",
    })?;
    p.check(n > 0, "n", "must be positive")?;
    p.check(n <= MAX_SYNTHETIC, "n", "at most 134217728 samples")?;
    let n = n as usize;
    let median = p.f64("median")?.unwrap_or(10_000.0);
    p.check(median > 0.0, "median", "must be positive")?;
    let sigma = p.f64("sigma")?.unwrap_or(1.0);
    p.check(sigma >= 0.0, "sigma", "must be non-negative")?;
    let min = p.u64("min")?.unwrap_or(1);
    p.check(min > 0, "min", "must be positive")?;
    let max = p.u64("max")?.unwrap_or(65_536);
    p.check(max >= min, "max", "must be at least min")?;
    let seed = p.u64("seed")?.unwrap_or(default_seed);
    let mut rng = SplitMix64::new(seed);
    Ok((0..n)
        .map(|_| {
            let x = (median * (sigma * rng.next_normal()).exp()).round();
            // Float-to-int casts saturate, so huge or tiny draws clamp cleanly.
            (x as u64).clamp(min, max)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_errors_name_line_and_value() {
        let e = parse_lengths("5\n\nabc\n").unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("abc"), "{e}");
        let e = parse_lengths("5\n-7\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("-7"), "{e}");
        let e = parse_lengths("5\n0\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("zero"), "{e}");
        let e = parse_lengths("[1, 2.5]").unwrap_err().to_string();
        assert!(e.contains("index 1") && e.contains("2.5"), "{e}");
        let e = parse_lengths("[1, \"x\"]").unwrap_err().to_string();
        assert!(e.contains("index 1"), "{e}");
        let e = parse_lengths("[1, -3]").unwrap_err().to_string();
        assert!(e.contains("index 1") && e.contains("-3"), "{e}");
        let e = parse_lengths("5\n18446744073709551616\n").unwrap_err();
        assert!(matches!(e, Error::LengthTooLarge { .. }), "{e}");
        let e = e.to_string();
        assert!(
            e.contains("line 2") && e.contains("18446744073709551616"),
            "{e}"
        );
        assert!(matches!(parse_lengths("\n \n"), Err(Error::EmptyLengths)));
        assert!(matches!(parse_lengths("[]"), Err(Error::EmptyLengths)));
        assert!(matches!(
            parse_lengths("[1,"),
            Err(Error::InvalidJson { .. })
        ));
    }

    #[test]
    fn lengths_whose_sum_overflows_are_refused() {
        // Two lengths of 2^63 overflowed the token sums of `odc-pack
        // --partition` and of the planner (found by the pack_input fuzz
        // target): a panic in debug builds, a wrong sum in release.
        let e = total_tokens(&[1, 1 << 63, 1 << 63]).unwrap_err();
        assert!(
            matches!(e, Error::TotalTooLarge { index: 2, count: 3 }),
            "{e}"
        );
        assert_eq!(total_tokens(&[u64::MAX]).unwrap(), u64::MAX);
    }

    #[test]
    fn synthetic_is_stable() {
        let a = synthetic("lognormal:n=2000,seed=7").unwrap();
        assert_eq!(a, synthetic("lognormal:n=2000,seed=7").unwrap());
        assert_ne!(a, synthetic("lognormal:n=2000,seed=8").unwrap());
        let mut sorted = a.clone();
        sorted.sort_unstable();
        let median = sorted[1000] as f64;
        assert!((7000.0..14000.0).contains(&median), "{median}");
        let c = synthetic("lognormal:n=50,min=100,max=200,sigma=3").unwrap();
        assert!(c.iter().all(|&s| (100..=200).contains(&s)));
    }

    #[test]
    fn synthetic_errors() {
        let e = synthetic("uniform:n=3").unwrap_err().to_string();
        assert!(e.contains("uniform") && e.contains("lognormal"), "{e}");
        let e = synthetic("lognormal:median=3").unwrap_err().to_string();
        assert!(e.contains("\"n\""), "{e}");
        let e = synthetic("lognormal:n=3,min=5,max=4")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max"), "{e}");
        let e = synthetic("lognormal:n=3,mu=4").unwrap_err().to_string();
        assert!(e.contains("mu"), "{e}");
    }
}
