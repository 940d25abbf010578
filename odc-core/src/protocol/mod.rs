//! The protocol's rules, as small state machines over control-word values:
//! no I/O, no clock, no transport. The engine loads the words (acquire),
//! asks these types what to do, and carries the decisions out with the
//! transport; the loom model (`loom_model`) drives the same types over loom
//! atomics.
//!
//! | module | the rule |
//! |---|---|
//! | [`cache`] | the node cache: one fetch per node of a remote shard's version; a slot is read only while it holds the entry and is not being filled, evicted least recently used first |
//! | [`nodesum`] | node aggregation: a chunk for an owner on another node goes to the node-mate that sums the node's chunks for it; the sum goes once every node-mate finished, and its `done` after it |
//! | [`admit`] | a pushed chunk is added only once the owner's accumulator takes its minibatch (the owner read and may clear the previous one first) |
//! | [`slots`] | a landing slot is reused only after its last chunk was acknowledged; the owner adds a client's chunks in push order |
//! | [`versions`] | a shard's next version is published only after every reader released the previous one; a reader reads a shard only at the version it needs |
//! | [`finish`] | a client's minibatch ends when its pushes are acknowledged; an owner's gradients are final when every client's done word reads the minibatch |
//! | [`partials`] | hybrid sharding: accumulators change again only after every other node read this rank's partial sums |
//! | [`pieces`] | hybrid-zero: a piece is overwritten only after every other node copied it; a node shard is announced only when every piece of its version is in |
//! | `handoff` | a client's own slice goes to its own server by pointer, read only under a claim |
//! | [`membership`] | elastic hybrid (the rule only, not yet driven by the engine): a minibatch's cross-node sum counts a node's partials only if every member's every rank read them; a member's death before that voids the round, and the minibatch runs again over the survivors |
//! | [`compress`] | compressed chunks and copies: by default only pushes to a landing slot on another node carry them, and only reads of a shard owned on another node take the owner's quantised copy (never a rank's own shard); a chunk, and a run of a copy, holds whole blocks of its format |
//! | [`claims`] | work stealing: each microbatch of a rank's list is claimed once, by the rank from the front or for a thief from the back, by one compare-and-swap in the rank's memory |
//!
//! Every word stores a **stamp**, value + 1 (0: never written), except the
//! landing-slot signals, which count chunks ([`slots::slot_count`]).
//!
//! This module may use [`crate::sync`] (for the hand-off's atomics) and
//! [`crate::error`]; nothing above it.

pub mod admit;
pub mod cache;
pub mod claims;
pub mod compress;
pub mod finish;
pub(crate) mod handoff;
pub mod membership;
pub mod nodesum;
pub mod partials;
pub mod pieces;
pub mod slots;
pub mod versions;

/// The stamp a word holds for `value` (value + 1; 0 means never written).
/// `None` for `u64::MAX`, which has no stamp.
pub fn stamp(value: u64) -> Option<u64> {
    value.checked_add(1)
}

/// The first rank (by index) whose word does not yet reach `stamp`, as
/// `index → word value`: the one a waiter names while it waits.
pub fn lagging(words: impl IntoIterator<Item = u64>, stamp: u64) -> Option<usize> {
    words.into_iter().position(|w| w < stamp)
}
