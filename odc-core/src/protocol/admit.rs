//! Pushes belong to a minibatch: an owner adds a pushed chunk only once its
//! accumulator takes that minibatch.
//!
//! A client stamps each chunk's header with its running minibatch (the
//! number of minibatches it finished). The owner's accumulator of a bucket
//! takes minibatch `m` once the owner has *opened* it for `m`: its first
//! call of minibatch `m` that may change the accumulator (publishing the
//! bucket, zeroing it, pushing into it, finishing `m`), which by the worker
//! API's contract comes after it read the sums of `m − 1`. Until then a
//! chunk of `m` stays in its landing slot, unacknowledged: it can neither
//! be counted in minibatch `m − 1` (a push that lands before the owner
//! read its gradients) nor be zeroed with it (one that lands between the
//! read and the zeroing). The owner never opens `m` before every client's
//! chunks of `m − 1` are in: it finished `m − 1`, which waited for every
//! client's `done`, which follows the acknowledgement of its last chunk.

/// What the owner does with a chunk of `pushed` (the minibatch in its
/// header) while its accumulator takes minibatch `open`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Add it now and acknowledge it.
    Add,
    /// Leave it in its slot (and the client's younger chunk behind it) until
    /// the accumulator takes its minibatch.
    Hold,
    /// A chunk of a minibatch the owner already closed: refuse it (a client
    /// that broke the protocol; the owner's finish reports it).
    Stale,
}

/// The rule for a chunk of minibatch `pushed` at an accumulator open for
/// minibatch `open`.
pub fn admit(pushed: u64, open: u64) -> Admit {
    match pushed.cmp(&open) {
        std::cmp::Ordering::Equal => Admit::Add,
        std::cmp::Ordering::Greater => Admit::Hold,
        std::cmp::Ordering::Less => Admit::Stale,
    }
}

/// The minibatch an accumulator is open for after an opening call made in
/// minibatch `running`, where it was open for `open`: openings never go
/// back (a later call of an older minibatch cannot happen, but costs
/// nothing to rule out).
pub fn opened(open: u64, running: u64) -> u64 {
    open.max(running)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_waits_for_its_minibatch() {
        assert_eq!(admit(0, 0), Admit::Add);
        assert_eq!(admit(3, 3), Admit::Add);
        assert_eq!(admit(4, 3), Admit::Hold); // the owner may still read minibatch 3's sums
        assert_eq!(admit(2, 3), Admit::Stale);
        assert_eq!(opened(3, 4), 4);
        assert_eq!(opened(4, 3), 4);
    }
}
