//! Hybrid-zero: the exchange of updated pieces across nodes at publish.
//!
//! A node shard is made of N pieces, one per node; rank (n, l) steps piece
//! n and every node's rank l needs all N in its working copy. At the
//! publish of version `v` (stamp `s = v + 1`) rank (n, l):
//!
//! 1. waits until every other node copied its piece of the version it
//!    holds (`piece_read[m] ≥ seen`, [`unread`]): the piece is overwritten
//!    only after its last remote reader is done with it;
//! 2. writes its piece and raises `piece_version[n] = s` at every (m, l);
//! 3. for every other node m waits until `piece_version[m]` reads `s`
//!    ([`piece`]), copies piece m into its working copy, and raises
//!    `piece_read[n] = s` at (m, l);
//! 4. announces the node shard to its node only then.
//!
//! Rank (m, l) cannot publish `v + 1` before step 3 answered it, so
//! `piece_version[m]` never passes `s` while this rank waits on it; a
//! larger value means the ranks published different versions.

use super::partials::lagging_replica;

/// Where a peer's piece stands against the version being published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Not yet at this version.
    Pending,
    /// Holds this version: copy it.
    Ready,
}

/// A peer's piece is at a newer version than the one this rank publishes
/// (the ranks did not publish the same versions); `current` is its stamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ahead {
    /// The peer's `piece_version` word.
    pub current: u64,
}

/// A peer's `piece_version` word against the stamp being published.
pub fn piece(word: u64, stamp: u64) -> Result<Piece, Ahead> {
    match word {
        w if w > stamp => Err(Ahead { current: w }),
        w if w == stamp => Ok(Piece::Ready),
        _ => Ok(Piece::Pending),
    }
}

/// The first other node (index) that has not copied this rank's piece of
/// the version it holds (`seen`, a stamp; 0: nothing published yet), given
/// every node's `piece_read` word.
pub fn unread(words: impl IntoIterator<Item = u64>, node: usize, seen: u64) -> Option<usize> {
    if seen == 0 {
        return None;
    }
    lagging_replica(words, node, seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_is_copied_at_exactly_its_version() {
        assert_eq!(piece(0, 1), Ok(Piece::Pending));
        assert_eq!(piece(3, 4), Ok(Piece::Pending));
        assert_eq!(piece(4, 4), Ok(Piece::Ready));
        assert_eq!(piece(5, 4), Err(Ahead { current: 5 }));
    }

    #[test]
    fn only_other_nodes_must_have_read() {
        assert_eq!(unread([0, 0], 0, 0), None); // the first publish waits for nobody
        assert_eq!(unread([0, 2], 0, 3), Some(1));
        assert_eq!(unread([0, 3, 3], 0, 3), None);
        assert_eq!(unread([3, 9, 2], 1, 3), Some(2));
    }
}
