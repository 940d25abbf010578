//! Landing slots: two per (client, owner) pair, so a client writes the next
//! chunk while the owner adds the previous one.
//!
//! Chunk sequence numbers per pair start at 1 and chunk `seq` goes to slot
//! `seq % 2`. The slot's signal word **counts** the chunks written into it
//! ([`slot_count`]): a network transport counts arrived writes instead of
//! carrying a value (fabric-lib's immediate counter), so the owner turns the
//! count back into the sequence number ([`slot_seq`]). The owner
//! acknowledges chunk `seq` of slot `s` by storing `seq` in its ack word.

/// The count of slot `seq % 2` once chunk `seq` (from 1) is in it.
pub fn slot_count(seq: u64) -> u64 {
    seq.div_ceil(2)
}

/// The sequence number of the `count`-th chunk (from 1) of `slot`; 0 for
/// none. The count is whatever the peer (or its NIC) left in the slot's
/// signal word: counts no push can reach (2^63 and more) saturate, and the
/// header's check refuses the chunk.
pub fn slot_seq(slot: usize, count: u64) -> u64 {
    if count == 0 {
        return 0;
    }
    let seq = 2 * u128::from(count) - u128::from(slot as u64 & 1);
    u64::try_from(seq).unwrap_or(u64::MAX)
}

/// A client's side of its two slots at one owner.
///
/// The rule: the next chunk's slot is free only once the owner acknowledged
/// the last chunk written into it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotSender {
    next_seq: u64,
    sent: [u64; 2],
}

impl SlotSender {
    /// The slot and sequence number the next chunk takes.
    pub fn next(&self) -> (usize, u64) {
        let seq = self.next_seq + 1;
        ((seq % 2) as usize, seq)
    }

    /// The next chunk's slot and sequence number if that slot is free, `ack`
    /// being the slot's ack word (as [`next`](Self::next) names it).
    pub fn ready(&self, ack: u64) -> Option<(usize, u64)> {
        let (slot, seq) = self.next();
        (ack == self.sent[slot]).then_some((slot, seq))
    }

    /// Records chunk `seq` written into `slot` (its signal sent).
    pub fn sent(&mut self, slot: usize, seq: u64) {
        debug_assert_eq!((slot, seq), self.next());
        self.next_seq = seq;
        self.sent[slot] = seq;
    }

    /// Whether the owner acknowledged every chunk sent, `acks` being the two
    /// ack words.
    pub fn acknowledged(&self, acks: [u64; 2]) -> bool {
        acks == self.sent
    }
}

/// The owner's side of one client's two slots.
///
/// The rule: a chunk is added once, and a client's chunks in push order
/// (the older slot is looked at first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotReceiver {
    last: [u64; 2],
}

impl SlotReceiver {
    /// The two slots in the order to look at them: the one the client's
    /// next-oldest chunk goes to first.
    pub fn order(&self) -> [usize; 2] {
        let older = (self.last[0].max(self.last[1]).wrapping_add(1) % 2) as usize;
        [older, 1 - older]
    }

    /// Slot `slot`'s signal reads `count`: the sequence number of a chunk not
    /// yet taken, which the owner now adds and then acknowledges.
    pub fn arrived(&mut self, slot: usize, count: u64) -> Option<u64> {
        let seq = self.waiting(slot, count)?;
        self.take(slot, seq);
        Some(seq)
    }

    /// Like [`arrived`](Self::arrived) without taking the chunk: an owner
    /// that holds it ([`crate::protocol::admit`]) looks at it again later.
    pub fn waiting(&self, slot: usize, count: u64) -> Option<u64> {
        let seq = slot_seq(slot, count);
        (seq != self.last[slot]).then_some(seq)
    }

    /// Takes chunk `seq` of `slot` (as [`waiting`](Self::waiting) named it).
    pub fn take(&mut self, slot: usize, seq: u64) {
        self.last[slot] = seq;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_sequence_numbers_map_one_to_one() {
        for seq in 1..100u64 {
            let slot = (seq % 2) as usize;
            assert_eq!(slot_seq(slot, slot_count(seq)), seq);
        }
        assert_eq!(slot_seq(0, 0), 0);
        assert_eq!(slot_seq(1, 0), 0);
    }

    #[test]
    fn a_count_no_push_reaches_saturates() {
        // A peer's signal word of 2^63 overflowed `2 * count` (found by the
        // control_words fuzz target): the daemon panicked in debug builds.
        assert_eq!(slot_seq(0, 1 << 63), u64::MAX);
        assert_eq!(slot_seq(0, u64::MAX), u64::MAX);
        assert_eq!(slot_seq(1, u64::MAX), u64::MAX);
        // Up to the top, the map stays one to one.
        assert_eq!(slot_seq(1, slot_count(u64::MAX)), u64::MAX);
        assert_eq!(slot_seq(0, slot_count(u64::MAX - 1)), u64::MAX - 1);
        let mut r = SlotReceiver::default();
        assert_eq!(r.arrived(0, u64::MAX), Some(u64::MAX));
        assert_eq!(r.arrived(0, u64::MAX), None);
        assert_eq!(r.order(), [0, 1]);
    }

    #[test]
    fn a_slot_is_reused_only_after_its_acknowledgement() {
        let mut s = SlotSender::default();
        assert_eq!(s.ready(0), Some((1, 1)));
        s.sent(1, 1);
        assert_eq!(s.ready(0), Some((0, 2))); // slot 0 never used
        s.sent(0, 2);
        assert_eq!(s.ready(0), None, "slot 1 still holds chunk 1");
        assert_eq!(s.ready(1), Some((1, 3)));
        s.sent(1, 3);
        assert!(!s.acknowledged([2, 1]));
        assert!(s.acknowledged([2, 3]));
    }

    #[test]
    fn the_receiver_takes_each_chunk_once_in_push_order() {
        let mut r = SlotReceiver::default();
        assert_eq!(r.order(), [1, 0]); // chunk 1 goes to slot 1
        assert_eq!(r.arrived(1, slot_count(1)), Some(1));
        assert_eq!(r.arrived(1, slot_count(1)), None);
        assert_eq!(r.order(), [0, 1]);
        assert_eq!(r.arrived(0, slot_count(2)), Some(2));
        assert_eq!(r.order(), [1, 0]);
    }
}
