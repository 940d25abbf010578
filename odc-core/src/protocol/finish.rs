//! The end of a minibatch, without a barrier.
//!
//! A client finishes minibatch `k` once every chunk it pushed was
//! acknowledged ([`super::slots::SlotSender::acknowledged`]); it then
//! writes `done = k` (stamp `k + 1`) into every owner's control region,
//! which also releases every bucket at version `k`. An owner's gradient
//! shards for `k` are final once every client's `done` word reads `k`:
//! each wait is a causal edge (the owner waits for its clients, a reader
//! for the owner's next version), never a global barrier.

use super::stamp;

/// Why a finish is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishError {
    /// `finish_minibatch(k)` after `finish_minibatch(earlier)` with
    /// `earlier > k`.
    Backwards {
        /// The minibatch this finish was asked for.
        k: u64,
        /// The later minibatch this client already finished.
        earlier: u64,
    },
}

/// The stamp a finish of `k` writes, given the highest stamp this client
/// finished before (`finished`).
pub fn done_stamp(finished: u64, k: u64) -> Result<u64, FinishError> {
    let s = stamp(k).unwrap_or(u64::MAX);
    if finished > s {
        return Err(FinishError::Backwards {
            k,
            earlier: finished - 1,
        });
    }
    Ok(s)
}

/// The first client (index) whose `done` word has not reached `stamp`;
/// `None`: this owner's gradients of the minibatch are final.
pub fn unfinished_client(done: impl IntoIterator<Item = u64>, stamp: u64) -> Option<usize> {
    super::lagging(done, stamp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finishes_go_forward() {
        assert_eq!(done_stamp(0, 0), Ok(1));
        assert_eq!(done_stamp(1, 0), Ok(1)); // again: fine, idempotent
        assert_eq!(
            done_stamp(3, 1),
            Err(FinishError::Backwards { k: 1, earlier: 2 })
        );
    }

    #[test]
    fn gradients_are_final_when_every_client_is_done() {
        assert_eq!(unfinished_client([2, 2, 1], 2), Some(2));
        assert_eq!(unfinished_client([2, 3, 2], 2), None);
    }
}
