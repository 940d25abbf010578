//! Work stealing: a rank's microbatches of a minibatch as claimable work.
//!
//! Each rank keeps one **claim word** per engine: the minibatch `k` it
//! describes and the part `[front, back)` of the rank's own list of
//! microbatches nobody has claimed yet. The rank claims its own work from
//! the front; a thief's request is served by the victim's shard server
//! daemon, which claims from the back on the thief's behalf. Both are one
//! compare-and-swap on the same word in the victim's own memory, so every
//! microbatch is claimed exactly once, whoever asks and however the two
//! race; no network atomic is needed (a request and its grant are plain
//! signals, see `client::steal`).
//!
//! The owner starts minibatch `k` with its first claim of `k`, which sets
//! the word to `(k, 0, count)` (its list as the plan gives it). A thief's
//! request for `k` that arrives earlier is answered [`Claim::NotYet`]; one
//! for a minibatch the victim has left behind is answered [`Claim::Empty`]:
//! the owner moves on only after its list of `k` is drained.
//!
//! Word layout: `stamp(k)` (24 bits) | front (20 bits) | back (20 bits).

/// Microbatches per rank per minibatch at most (20 bits).
pub const MAX_COUNT: u64 = (1 << 20) - 1;
/// Minibatch numbers below this (24 bits, with the stamp's + 1).
pub const MAX_MINIBATCH: u64 = (1 << 24) - 2;

const FIELD: u32 = 20;
const MASK: u64 = (1 << FIELD) - 1;

/// The decoded claim word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Word {
    /// `k + 1` of the minibatch the word describes (0: none yet).
    pub stamp: u64,
    /// The next of the owner's microbatches (its own end).
    pub front: u64,
    /// One past the last unclaimed microbatch (thieves' end).
    pub back: u64,
}

impl Word {
    /// Decodes a claim word.
    pub fn unpack(w: u64) -> Word {
        Word {
            stamp: w >> (2 * FIELD),
            front: (w >> FIELD) & MASK,
            back: w & MASK,
        }
    }

    /// Encodes it.
    pub fn pack(self) -> u64 {
        self.stamp << (2 * FIELD) | (self.front & MASK) << FIELD | (self.back & MASK)
    }

    /// Unclaimed microbatches of minibatch `k` (0 for any other minibatch).
    pub fn left(self, k: u64) -> u64 {
        if Some(self.stamp) == k.checked_add(1) {
            self.back.saturating_sub(self.front)
        } else {
            0
        }
    }
}

/// What a claim got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// Microbatch `i` of the owner's list is the claimer's to run.
    Got(u64),
    /// Every microbatch of the minibatch is claimed.
    Empty,
    /// (Thieves only) the owner has not started this minibatch yet.
    NotYet,
}

/// Why a claim is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimError {
    /// A count or minibatch number beyond the word's fields.
    TooLarge,
    /// The owner claims for a minibatch before the one it already started.
    Backwards {
        /// The minibatch asked for.
        k: u64,
        /// The one the word describes.
        current: u64,
    },
}

/// The owner's claim of its next microbatch of minibatch `k` (of `count`
/// in its list): the new word (`None`: unchanged) and the outcome.
pub fn own(word: u64, k: u64, count: u64) -> Result<(Option<u64>, Claim), ClaimError> {
    if count > MAX_COUNT || k > MAX_MINIBATCH {
        return Err(ClaimError::TooLarge);
    }
    let mut w = Word::unpack(word);
    if w.stamp > k + 1 {
        return Err(ClaimError::Backwards {
            k,
            current: w.stamp - 1,
        });
    }
    if w.stamp < k + 1 {
        w = Word {
            stamp: k + 1,
            front: 0,
            back: count,
        };
    }
    if w.front >= w.back {
        return Ok(((w.pack() != word).then(|| w.pack()), Claim::Empty));
    }
    let i = w.front;
    w.front += 1;
    Ok((Some(w.pack()), Claim::Got(i)))
}

/// A thief's claim of minibatch `k` from the back: the new word (`None`:
/// unchanged) and the outcome.
pub fn steal(word: u64, k: u64) -> (Option<u64>, Claim) {
    let mut w = Word::unpack(word);
    // `u64::MAX` has no stamp: no owner ever starts it.
    let Some(s) = k.checked_add(1).filter(|&s| w.stamp >= s) else {
        return (None, Claim::NotYet);
    };
    if w.stamp > s || w.front >= w.back {
        return (None, Claim::Empty);
    }
    w.back -= 1;
    (Some(w.pack()), Claim::Got(w.back))
}

/// A thief's request as a signal value: its sequence number (32 bits, 1
/// on) and the minibatch's stamp. Raised (a maximum), so later requests
/// supersede earlier ones.
pub fn request(seq: u64, k: u64) -> u64 {
    seq << 32 | (k + 1)
}

/// Decodes a request: `(seq, k)`; `None` for an empty word.
pub fn parse_request(v: u64) -> Option<(u64, u64)> {
    let (seq, stamp) = (v >> 32, v & 0xffff_ffff);
    (seq > 0 && stamp > 0).then(|| (seq, stamp - 1))
}

/// The daemon's answer to request `seq` as a signal value (raised too).
pub fn grant(seq: u64, claim: Claim) -> u64 {
    let code = match claim {
        Claim::Empty => 0,
        Claim::NotYet => 1,
        Claim::Got(i) => i + 2,
    };
    seq << 32 | code
}

/// Decodes a grant: `(seq, claim)`.
pub fn parse_grant(v: u64) -> (u64, Claim) {
    let claim = match v & 0xffff_ffff {
        0 => Claim::Empty,
        1 => Claim::NotYet,
        c => Claim::Got(c - 2),
    };
    (v >> 32, claim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(word: &mut u64, f: impl Fn(u64) -> (Option<u64>, Claim)) -> Claim {
        let (new, claim) = f(*word);
        if let Some(w) = new {
            *word = w;
        }
        claim
    }

    #[test]
    fn owner_from_the_front_thieves_from_the_back_each_once() {
        let mut w = 0;
        assert_eq!(apply(&mut w, |w| steal(w, 0)), Claim::NotYet);
        assert_eq!(apply(&mut w, |w| own(w, 0, 4).unwrap()), Claim::Got(0));
        assert_eq!(apply(&mut w, |w| steal(w, 0)), Claim::Got(3));
        assert_eq!(apply(&mut w, |w| steal(w, 0)), Claim::Got(2));
        assert_eq!(Word::unpack(w).left(0), 1);
        assert_eq!(apply(&mut w, |w| own(w, 0, 4).unwrap()), Claim::Got(1));
        assert_eq!(apply(&mut w, |w| own(w, 0, 4).unwrap()), Claim::Empty);
        assert_eq!(apply(&mut w, |w| steal(w, 0)), Claim::Empty);
        // The next minibatch starts with the owner's first claim of it.
        assert_eq!(apply(&mut w, |w| steal(w, 1)), Claim::NotYet);
        assert_eq!(apply(&mut w, |w| own(w, 1, 0).unwrap()), Claim::Empty);
        assert_eq!(Word::unpack(w).stamp, 2);
        // A late thief of minibatch 0 finds nothing; the owner cannot go back.
        assert_eq!(apply(&mut w, |w| steal(w, 0)), Claim::Empty);
        assert_eq!(
            own(w, 0, 4),
            Err(ClaimError::Backwards { k: 0, current: 1 })
        );
        assert_eq!(own(w, 2, MAX_COUNT + 1), Err(ClaimError::TooLarge));
    }

    #[test]
    fn the_last_minibatch_number_has_no_stamp() {
        // `k + 1` overflowed for k = u64::MAX (found by the claims fuzz
        // target): a pure function of any word and number must not panic.
        let w = Word {
            stamp: (1 << 24) - 1,
            front: 0,
            back: 3,
        }
        .pack();
        assert_eq!(steal(w, u64::MAX), (None, Claim::NotYet));
        assert_eq!(Word::unpack(w).left(u64::MAX), 0);
        assert_eq!(Word::unpack(w).left((1 << 24) - 2), 3);
    }

    #[test]
    fn requests_and_grants_round_trip() {
        assert_eq!(parse_request(request(7, 12)), Some((7, 12)));
        assert_eq!(parse_request(0), None);
        assert!(request(8, 0) > request(7, MAX_MINIBATCH));
        for c in [
            Claim::Empty,
            Claim::NotYet,
            Claim::Got(0),
            Claim::Got(MAX_COUNT),
        ] {
            assert_eq!(parse_grant(grant(9, c)), (9, c));
        }
        assert!(grant(2, Claim::Empty) > grant(1, Claim::Got(5)));
    }
}
