//! The crate's one error type.
//!
//! Every failure a caller can cause — a bad length, an unknown name, a sample
//! that cannot fit the token budget — is a value of [`Error`] carrying the
//! offending value and where it was found, so a command-line front end can
//! print one line that points at the problem.

use std::fmt;

/// Where a value sat in the input handed to [`crate::parse_lengths`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// A 1-based line number of line-oriented text.
    Line(usize),
    /// A 0-based index into a JSON array or a slice.
    Index(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Index(i) => write!(f, "index {i}"),
        }
    }
}

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The input held no sequence lengths at all.
    #[error("no sequence lengths in the input")]
    EmptyLengths,

    /// A length was not an integer (text, a fraction, a boolean).
    #[error("sequence length at {at} is not a positive integer: {value:?}")]
    NonIntegerLength {
        /// Where the value was found.
        at: Location,
        /// The value as written.
        value: String,
    },

    /// A length was zero; every sample holds at least one token.
    #[error("sequence length at {at} is zero; every sample needs at least one token")]
    ZeroLength {
        /// Where the value was found.
        at: Location,
    },

    /// A length was negative.
    #[error("sequence length at {at} is negative: {value}")]
    NegativeLength {
        /// Where the value was found.
        at: Location,
        /// The value as written.
        value: String,
    },

    /// A length was a whole number too large for a `u64`.
    #[error("sequence length at {at} is {value}, more than the largest supported length 2^64 - 1")]
    LengthTooLarge {
        /// Where the value was found.
        at: Location,
        /// The value as written.
        value: String,
    },

    /// Text that looked like a JSON array did not parse.
    #[error("lengths look like a JSON array but do not parse: {source}")]
    InvalidJson {
        /// The parser's complaint.
        #[source]
        source: serde_json::Error,
    },

    /// The lengths add up to more tokens than 2^64 − 1: no sum of them
    /// (a microbatch's, a part's, the whole input's) may overflow.
    #[error(
        "the sequence lengths add up to more than 2^64 - 1 tokens by sample {index} (of {count})"
    )]
    TotalTooLarge {
        /// Index of the sample whose length makes the sum overflow.
        index: usize,
        /// Number of samples.
        count: usize,
    },

    /// A single sample holds more tokens than a microbatch may.
    #[error("sample {index} has {length} tokens, more than max_tokens = {max_tokens}")]
    SampleTooLong {
        /// Global index of the sample.
        index: usize,
        /// Its length in tokens.
        length: u64,
        /// The per-microbatch budget it exceeds.
        max_tokens: u64,
    },

    /// A partition was asked of an empty list of weights.
    #[error("cannot partition an empty list of weights")]
    EmptyWeights,

    /// A partition into zero parts was requested.
    #[error("cannot partition into k = 0 parts")]
    ZeroParts,

    /// More parts than items were requested; every part must be non-empty.
    #[error("cannot split n = {n} items into k = {k} non-empty parts (k > n)")]
    TooManyParts {
        /// Requested number of parts.
        k: usize,
        /// Number of items.
        n: usize,
    },

    /// Equal-size parts were requested but `n` is not a multiple of `k`.
    #[error("equal-size partition needs n divisible by k, got n = {n}, k = {k}")]
    NotDivisible {
        /// Number of items.
        n: usize,
        /// Requested number of parts.
        k: usize,
    },

    /// More items than one partition can index.
    #[error("cannot partition n = {n} items; at most {limit} are supported")]
    TooManyItems {
        /// Number of items.
        n: usize,
        /// The supported maximum.
        limit: usize,
    },

    /// A weight was negative, NaN or infinite.
    #[error("weight {index} is {value}; weights must be finite and non-negative")]
    InvalidWeight {
        /// Index of the weight.
        index: usize,
        /// The weight.
        value: f64,
    },

    /// A strategy name was not recognised.
    #[error("unknown strategy {name:?}; valid strategies: {valid}")]
    UnknownStrategy {
        /// The name given.
        name: String,
        /// The accepted names.
        valid: &'static str,
    },

    /// A cost-model name was not recognised.
    #[error("unknown cost model {name:?}; valid cost models: {valid}")]
    UnknownCostModel {
        /// The name given.
        name: String,
        /// The accepted names.
        valid: &'static str,
    },

    /// A synthetic-distribution name was not recognised.
    #[error("unknown synthetic distribution {name:?}; valid distributions: {valid}")]
    UnknownDistribution {
        /// The name given.
        name: String,
        /// The accepted names.
        valid: &'static str,
    },

    /// A `key=value` spec lacked a required key.
    #[error("{spec}: missing required parameter {key:?}")]
    MissingParameter {
        /// Which spec (`flops`, `lognormal`, ...).
        spec: &'static str,
        /// The missing key.
        key: &'static str,
    },

    /// A `key=value` spec had a key it does not know.
    #[error("{spec}: unknown parameter {key:?}; valid parameters: {valid}")]
    UnknownParameter {
        /// Which spec.
        spec: &'static str,
        /// The key given.
        key: String,
        /// The accepted keys.
        valid: &'static str,
    },

    /// A `key=value` spec had a value that does not parse or is out of range.
    #[error("{spec}: parameter {key} = {value:?} is invalid: {reason}")]
    InvalidParameter {
        /// Which spec.
        spec: &'static str,
        /// The key.
        key: String,
        /// The value as written.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// A planning setting is out of range (zero world size, zero budget, ...).
    #[error("invalid {field} = {value}: {reason}")]
    InvalidConfig {
        /// The setting.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// A timing handed to the cost fit was not usable.
    #[error("timing at {at} is invalid ({value}): {reason}")]
    InvalidTiming {
        /// Where the timing was found.
        at: Location,
        /// The timing as written.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The cost fit needs timings of at least two distinct lengths.
    #[error("fitting a·s² + b·s needs timings of at least 2 distinct lengths, got {distinct}")]
    TooFewTimings {
        /// Distinct lengths timed.
        distinct: usize,
    },

    /// A value in a file was refused: which file, and (in `source`) which
    /// value and why.
    #[error("{path}: {source}")]
    InFile {
        /// The path as given (`stdin` for `-`).
        path: String,
        /// What is wrong with the contents.
        #[source]
        source: Box<Error>,
    },
    /// The fixed-cost fit needs minibatches of at least two distinct
    /// microbatch counts.
    #[error(
        "fitting the fixed costs needs minibatches of at least 2 distinct microbatch counts, got {distinct}"
    )]
    TooFewMinibatchTimings {
        /// Distinct microbatch counts timed.
        distinct: usize,
    },

    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path as given (`-` for stdin).
        path: String,
        /// The operating system's complaint.
        #[source]
        source: std::io::Error,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
