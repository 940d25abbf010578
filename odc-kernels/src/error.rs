//! The crate's one error type.
//!
//! Kernels fail only on bad arguments: buffers whose lengths disagree, byte
//! buffers that do not hold whole, aligned elements, or a dtype name or code
//! that is not one of ours. No kernel panics on user input.

use crate::DType;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Destination and source hold different numbers of elements.
    #[error("{op}: destination has {dst} elements but source has {src}")]
    LengthMismatch {
        /// The operation that was called (`"accumulate"`, `"cast"`, ...).
        op: &'static str,
        /// Elements in the destination (the accumulator for accumulates).
        dst: usize,
        /// Elements in the source.
        src: usize,
    },

    /// A byte buffer's length is not a multiple of its element size.
    #[error("{op}: {what} is {len} bytes, not a whole number of {dtype} elements")]
    PartialElement {
        /// The operation that was called.
        op: &'static str,
        /// Which buffer: `"source"` or `"destination"`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The dtype it was said to hold.
        dtype: DType,
    },

    /// A byte buffer does not start on an element boundary.
    #[error("{op}: {what} at {addr:#x} is not aligned to {align} bytes as {dtype} requires")]
    Misaligned {
        /// The operation that was called.
        op: &'static str,
        /// Which buffer: `"source"` or `"destination"`.
        what: &'static str,
        /// Its start address.
        addr: usize,
        /// The alignment the dtype needs (its size).
        align: usize,
        /// The dtype it was said to hold.
        dtype: DType,
    },

    /// A dtype name that none of [`DType`]'s spellings match.
    #[error("unknown dtype {0:?}: expected f32, bf16 or f16 (or float32, bfloat16, float16)")]
    UnknownDTypeName(String),

    /// A dtype code (from a shared-memory descriptor) that is not assigned.
    #[error("unknown dtype code {0}: expected 0 (f32), 1 (bf16) or 2 (f16)")]
    UnknownDTypeCode(u8),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
