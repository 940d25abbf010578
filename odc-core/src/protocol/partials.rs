//! Hybrid sharding over several nodes: the cross-node sum of partial sums.
//!
//! At the end of minibatch `k` a rank announces `partial_ready = k` to its
//! replicas (the ranks holding the same shards on the other nodes), reads
//! each replica's accumulators (in deterministic mode its exact sums too)
//! once its `partial_ready` reads `k`, and
//! answers `partial_read = k`. The rule: this rank's accumulators change
//! again (zeroing, or the pushes a next publish lets in) only after every
//! other node read them.

/// The first replica (node index) other than `node` whose word has not
/// reached `stamp` (`partial_ready` to read from it, `partial_read` before
/// changing this rank's accumulators).
pub fn lagging_replica(
    words: impl IntoIterator<Item = u64>,
    node: usize,
    stamp: u64,
) -> Option<usize> {
    words
        .into_iter()
        .enumerate()
        .find(|&(n, w)| n != node && w < stamp)
        .map(|(n, _)| n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_other_nodes_count() {
        assert_eq!(lagging_replica([0, 5, 5], 0, 5), None);
        assert_eq!(lagging_replica([5, 4, 5], 0, 5), Some(1));
        assert_eq!(lagging_replica([5, 0], 1, 5), None);
    }
}
