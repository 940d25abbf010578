//! Parsing of `name:key=value,key=value` specs shared by cost models and
//! synthetic distributions.

use crate::error::{Error, Result};

/// The `key=value` pairs of one spec, checked against a list of known keys.
#[derive(Debug)]
pub(crate) struct Params<'a> {
    spec: &'static str,
    pairs: Vec<(&'a str, &'a str)>,
}

impl<'a> Params<'a> {
    /// Splits `text` (the part after `name:`) into pairs, rejecting keys not
    /// in `valid` (a comma-separated list) and pairs without `=`.
    pub(crate) fn parse(spec: &'static str, text: &'a str, valid: &'static str) -> Result<Self> {
        let mut pairs = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((key, value)) = item.split_once('=') else {
                return Err(Error::InvalidParameter {
                    spec,
                    key: item.to_owned(),
                    value: String::new(),
                    reason: "expected key=value",
                });
            };
            let key = key.trim();
            if !valid.split(',').any(|v| v.trim() == key) {
                return Err(Error::UnknownParameter {
                    spec,
                    key: key.to_owned(),
                    valid,
                });
            }
            pairs.push((key, value.trim()));
        }
        Ok(Self { spec, pairs })
    }

    fn raw(&self, key: &str) -> Option<&'a str> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
    }

    fn invalid(&self, key: &str, value: &str, reason: &'static str) -> Error {
        Error::InvalidParameter {
            spec: self.spec,
            key: key.to_owned(),
            value: value.to_owned(),
            reason,
        }
    }

    /// A finite float, or `None` when the key is absent.
    pub(crate) fn f64(&self, key: &str) -> Result<Option<f64>> {
        self.raw(key)
            .map(|v| match v.parse::<f64>() {
                Ok(x) if x.is_finite() => Ok(x),
                _ => Err(self.invalid(key, v, "expected a finite number")),
            })
            .transpose()
    }

    /// A non-negative integer, or `None` when the key is absent.
    pub(crate) fn u64(&self, key: &str) -> Result<Option<u64>> {
        self.raw(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| self.invalid(key, v, "expected a non-negative integer"))
            })
            .transpose()
    }

    /// A required finite float.
    pub(crate) fn require_f64(&self, key: &'static str) -> Result<f64> {
        self.f64(key)?.ok_or(Error::MissingParameter {
            spec: self.spec,
            key,
        })
    }

    /// Fails with `reason` unless `ok`, naming `key` and its value.
    pub(crate) fn check(&self, ok: bool, key: &str, reason: &'static str) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(self.invalid(key, self.raw(key).unwrap_or(""), reason))
        }
    }
}
