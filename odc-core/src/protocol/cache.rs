//! The node cache of remote shards: a version of a shard owned on another
//! node crosses the network once per node. The rules for an **entry**
//! (one piece of one remote owner's shard of one bucket) and for the
//! **slot** (node memory) that holds it.
//!
//! The entry's word says who fetches which version into which slot, and
//! when it is in:
//!
//! - a reader of version `v` that finds the entry **empty or older** claims
//!   it (one compare-and-swap: [`claim`]), fetches the piece into the slot
//!   and marks it **ready** ([`filled`]);
//! - one that finds it **being fetched** at `v` waits for it, or, once the
//!   fetcher is dead, takes the claim over ([`take_over`]) and fetches
//!   itself;
//! - one that finds it **ready** at `v` copies the slot out;
//! - a **newer** version means this reader missed a release (an error, as
//!   a gather of an old version is).
//!
//! No node-mate waits for another except on an entry it needs: nobody
//! meets anybody, and node-mates stay out of phase.
//!
//! A slot's word guards its data like a sequence lock: a rank that takes a
//! slot for an entry bumps its generation and marks it filling *before* it
//! writes ([`Slot::claim`]), and clears the mark once the data is in
//! ([`Slot::filled`]). A reader copies only from a slot that holds its
//! entry and is not filling, and keeps the copy only if the slot word is
//! unchanged afterwards: a slot evicted (taken for another entry) while it
//! was read is caught, and the reader reads again. Eviction takes the least
//! recently used slot, preferring one every node-mate has read since it was
//! filled ([`victim`]); a slot being filled is never taken.
//!
//! Why a version can be overwritten in place: a fetcher of version `v + 1`
//! exists only once the owner published it, which it does only after every
//! rank released `v`, and a rank releases a version only after its gathers
//! of it returned: nobody on the node still reads `v` of that entry.
//!
//! Words (`u64`):
//!
//! | bits | entry word | slot word |
//! |---|---|---|
//! | 0–1 | state: 0 empty, 1 fetching, 2 ready | bit 0: filling |
//! | 2–9 / 1–31 | the fetcher's local rank | generation |
//! | 10–31 / 32–63 | the slot | the entry + 1 (0: none) |
//! | 32–63 | the version + 1 | |

/// Most slots a node cache has (22 bits of an entry word).
pub const MAX_SLOTS: usize = 1 << 22;
/// Most ranks per node a cache serves (8 bits of an entry word).
pub const MAX_LOCAL: usize = 1 << 8;
/// Most entries (32 bits of a slot word, less the empty value).
pub const MAX_ENTRIES: usize = (1 << 32) - 2;
/// The newest version an entry holds (32 bits of stamp): gathers of later
/// versions bypass the cache.
pub const MAX_VERSION: u64 = (1 << 32) - 2;

const EMPTY: u64 = 0;
const FETCHING: u64 = 1;
const READY: u64 = 2;

/// An entry word, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Never fetched.
    Empty,
    /// Local rank `by` fetches `version` into `slot`.
    Fetching {
        /// The version fetched.
        version: u64,
        /// Where it lands.
        slot: usize,
        /// The fetcher, by its local rank.
        by: usize,
    },
    /// `version` is in `slot`.
    Ready {
        /// The version held.
        version: u64,
        /// Where.
        slot: usize,
    },
}

impl Entry {
    /// The word for this state. Versions above [`MAX_VERSION`], slots from
    /// [`MAX_SLOTS`] and ranks from [`MAX_LOCAL`] do not fit (callers check).
    pub fn encode(self) -> u64 {
        match self {
            Entry::Empty => EMPTY,
            Entry::Fetching { version, slot, by } => {
                ((version + 1) << 32) | ((slot as u64) << 10) | ((by as u64) << 2) | FETCHING
            }
            Entry::Ready { version, slot } => ((version + 1) << 32) | ((slot as u64) << 10) | READY,
        }
    }

    /// The state a word holds (an unknown state reads as empty: claimed
    /// anew).
    pub fn decode(w: u64) -> Entry {
        let stamp = w >> 32;
        let slot = ((w >> 10) & (MAX_SLOTS as u64 - 1)) as usize;
        match w & 3 {
            FETCHING if stamp > 0 => Entry::Fetching {
                version: stamp - 1,
                slot,
                by: ((w >> 2) & (MAX_LOCAL as u64 - 1)) as usize,
            },
            READY if stamp > 0 => Entry::Ready {
                version: stamp - 1,
                slot,
            },
            _ => Entry::Empty,
        }
    }

    /// The state entry word `w` holds in a node cache of `slots` slots and
    /// `local` ranks per node, checked before any of it is used: only a
    /// word [`Entry::encode`] writes (no unknown state, no stamp without a
    /// state, no fetcher in a ready word), with a slot of the cache and a
    /// fetcher of the node. [`Entry::decode`] alone reads any word as
    /// something; a slot from it indexes node memory only once checked.
    pub fn check(w: u64, slots: usize, local: usize) -> Result<Entry, BadWord> {
        let e = Entry::decode(w);
        let bad = |field| Err(BadWord { field, word: w });
        if e.encode() != w {
            let fetcher = w & 3 == READY && w >> 32 > 0;
            return bad(if fetcher { "fetcher" } else { "state" });
        }
        match e {
            Entry::Fetching { slot, .. } | Entry::Ready { slot, .. } if slot >= slots => {
                bad("slot")
            }
            Entry::Fetching { by, .. } if by >= local => bad("fetcher"),
            _ => Ok(e),
        }
    }

    /// The slot the word names (a claimer's first choice: the entry's old
    /// version is overwritten in place).
    pub fn slot(self) -> Option<usize> {
        match self {
            Entry::Empty => None,
            Entry::Fetching { slot, .. } | Entry::Ready { slot, .. } => Some(slot),
        }
    }
}

/// An entry word that no node-mate following the rule writes: its field
/// (`state`, `slot`, `fetcher`) does not fit the cache ([`Entry::check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadWord {
    /// The field that is wrong.
    pub field: &'static str,
    /// The word.
    pub word: u64,
}

/// What a reader of `version` does with an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Look {
    /// Copy it out of `slot` (checking the slot's word around the copy).
    Hit {
        /// Where the version is.
        slot: usize,
    },
    /// Local rank `by` fetches it: wait, or take over once `by` is dead.
    Wait {
        /// The fetcher.
        by: usize,
    },
    /// Nobody has it: claim it and fetch it.
    Claim,
    /// The entry holds a later version: this reader missed a release.
    Newer {
        /// The version the entry holds.
        current: u64,
    },
}

/// The rule for a reader of `version` that loaded the entry word `w`.
pub fn look(w: u64, version: u64) -> Look {
    match Entry::decode(w) {
        Entry::Empty => Look::Claim,
        Entry::Ready { version: v, slot } if v == version => Look::Hit { slot },
        Entry::Fetching { version: v, by, .. } if v == version => Look::Wait { by },
        Entry::Ready { version: v, .. } | Entry::Fetching { version: v, .. } if v > version => {
            Look::Newer { current: v }
        }
        // An older version: its readers are done with it (see the module
        // docs), so it may be overwritten.
        _ => Look::Claim,
    }
}

/// The rule for a reader of `version` that loaded entry word `w` from a
/// node cache of `slots` slots and `local` ranks per node: [`look`], once
/// [`Entry::check`] accepted the word (a slot it hands out indexes the
/// cache, a fetcher it names is a node-mate).
pub fn look_in(w: u64, version: u64, slots: usize, local: usize) -> Result<Look, BadWord> {
    Entry::check(w, slots, local).map(|_| look(w, version))
}

/// The word with which local rank `me` claims the entry to fetch `version`
/// into `slot` (swapped in for the word it loaded; the loser of two claims
/// looks again and waits for the winner).
pub fn claim(version: u64, slot: usize, me: usize) -> u64 {
    Entry::Fetching {
        version,
        slot,
        by: me,
    }
    .encode()
}

/// The word once `version` is in `slot` (stored by the fetcher, release:
/// a reader that sees it sees the data).
pub fn filled(version: u64, slot: usize) -> u64 {
    Entry::Ready { version, slot }.encode()
}

/// The word with which local rank `me` takes over a claim whose fetcher is
/// dead, if `w` is still that fetcher's claim; `None` otherwise (someone
/// else took it over or it is in).
pub fn take_over(w: u64, dead: usize, me: usize) -> Option<u64> {
    match Entry::decode(w) {
        Entry::Fetching { version, slot, by } if by == dead => Some(claim(version, slot, me)),
        _ => None,
    }
}

/// A slot word, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The entry it holds or is being filled with.
    pub entry: Option<usize>,
    /// Bumped each time the slot is taken for an entry.
    pub gen: u32,
    /// Data is being written into it.
    pub filling: bool,
}

impl Slot {
    /// The state a word holds.
    pub fn decode(w: u64) -> Slot {
        Slot {
            entry: (w >> 32).checked_sub(1).map(|e| e as usize),
            gen: ((w >> 1) & 0x7fff_ffff) as u32,
            filling: w & 1 == 1,
        }
    }

    /// Its word.
    pub fn encode(self) -> u64 {
        let entry = self.entry.map_or(0, |e| e as u64 + 1);
        (entry << 32) | (u64::from(self.gen & 0x7fff_ffff) << 1) | u64::from(self.filling)
    }

    /// The word that takes slot word `w` for `entry`: a new generation,
    /// filling (stored before any byte of the new data is written).
    pub fn claim(w: u64, entry: usize) -> u64 {
        let s = Slot::decode(w);
        Slot {
            entry: Some(entry),
            gen: s.gen.wrapping_add(1),
            filling: true,
        }
        .encode()
    }

    /// The word once the data is in: the same generation, not filling.
    pub fn filled(w: u64) -> u64 {
        Slot {
            filling: false,
            ..Slot::decode(w)
        }
        .encode()
    }

    /// Whether a reader of `entry` may copy from a slot whose word is `w`
    /// (and keep the copy if the word still reads `w` after it).
    pub fn holds(w: u64, entry: usize) -> bool {
        let s = Slot::decode(w);
        s.entry == Some(entry) && !s.filling
    }
}

/// The slot to evict for a new entry, given `(slot word, last use,
/// readers)` per slot and `all`, the readers' set once every node-mate has
/// read a fill: of the slots not being filled, the least recently used
/// (smallest use stamp) among those every node-mate has read since they
/// were filled, else the least recently used of all. A fill some node-mate
/// has not read yet is one a node-mate running behind is likely still to
/// need, which plain LRU evicts first when node-mates run out of phase.
/// `None` when every slot is being filled. (`all == 0`: plain LRU.)
pub fn victim(slots: impl IntoIterator<Item = (u64, u64, u64)>, all: u64) -> Option<usize> {
    // One pass: the oldest slot read by all, and the oldest of any (first wins a tie).
    // (last use, slot) of each best so far.
    let (mut read, mut any) = (None::<(u64, usize)>, None::<(u64, usize)>);
    let older = |best: Option<(u64, usize)>, used: u64| best.is_none_or(|(u, _)| used < u);
    for (i, (w, used, readers)) in slots.into_iter().enumerate() {
        if Slot::decode(w).filling {
            continue;
        }
        if all != 0 && readers & all == all && older(read, used) {
            read = Some((used, i));
        }
        if older(any, used) {
            any = Some((used, i));
        }
    }
    read.or(any).map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_words_round_trip() {
        for e in [
            Entry::Empty,
            Entry::Fetching {
                version: 0,
                slot: 0,
                by: 0,
            },
            Entry::Fetching {
                version: MAX_VERSION,
                slot: MAX_SLOTS - 1,
                by: MAX_LOCAL - 1,
            },
            Entry::Ready {
                version: 12,
                slot: 77,
            },
        ] {
            assert_eq!(Entry::decode(e.encode()), e);
        }
        assert_eq!(Entry::decode(3 | 1 << 40), Entry::Empty);
        assert_eq!(Entry::decode(READY), Entry::Empty, "no stamp");
    }

    #[test]
    fn a_word_whose_slot_or_fetcher_is_not_the_caches_is_refused_before_use() {
        // 4 slots, 2 ranks per node.
        assert_eq!(look_in(filled(3, 2), 3, 4, 2), Ok(Look::Hit { slot: 2 }));
        let bad = |w, field| Err(BadWord { field, word: w });
        // A ready word naming slot 4 would index past the node's slots.
        assert_eq!(look_in(filled(3, 4), 3, 4, 2), bad(filled(3, 4), "slot"));
        assert_eq!(
            look_in(claim(3, 1, 2), 3, 4, 2),
            bad(claim(3, 1, 2), "fetcher")
        );
        for w in [1, READY, 3 | 1 << 40, filled(3, 2) | 1 << 4] {
            let field = if w == filled(3, 2) | 1 << 4 {
                "fetcher"
            } else {
                "state"
            };
            assert_eq!(look_in(w, 3, 4, 2), bad(w, field), "{w:#x}");
        }
    }

    #[test]
    fn readers_claim_wait_hit_or_refuse() {
        assert_eq!(look(0, 4), Look::Claim);
        let fetching = claim(4, 9, 2);
        assert_eq!(look(fetching, 4), Look::Wait { by: 2 });
        assert_eq!(look(filled(4, 9), 4), Look::Hit { slot: 9 });
        // An older version is overwritten; a newer one is an error.
        assert_eq!(look(filled(3, 9), 4), Look::Claim);
        assert_eq!(look(filled(5, 9), 4), Look::Newer { current: 5 });
        assert_eq!(look(claim(5, 9, 1), 4), Look::Newer { current: 5 });
        // Taking over only the dead fetcher's claim.
        assert_eq!(take_over(fetching, 2, 0), Some(claim(4, 9, 0)));
        assert_eq!(take_over(fetching, 1, 0), None);
        assert_eq!(take_over(filled(4, 9), 2, 0), None);
    }

    #[test]
    fn a_slot_is_read_only_while_it_holds_the_entry_and_is_not_filling() {
        let w0 = Slot {
            entry: Some(3),
            gen: 7,
            filling: false,
        }
        .encode();
        assert!(Slot::holds(w0, 3));
        assert!(!Slot::holds(w0, 4));
        let taken = Slot::claim(w0, 4);
        assert_eq!(
            Slot::decode(taken),
            Slot {
                entry: Some(4),
                gen: 8,
                filling: true
            }
        );
        assert!(!Slot::holds(taken, 4), "filling");
        let done = Slot::filled(taken);
        assert!(Slot::holds(done, 4));
        assert_ne!(done, w0);
        // Refilled with the same entry: a new generation, so a reader of
        // the old fill sees the change.
        assert_ne!(Slot::filled(Slot::claim(done, 4)), done);
        assert_eq!(Slot::decode(0).entry, None);
    }

    /// The word of a slot holding entry `e`, not being filled.
    fn idle(e: usize) -> u64 {
        Slot {
            entry: Some(e),
            gen: 1,
            filling: false,
        }
        .encode()
    }

    #[test]
    fn the_victim_is_the_least_recently_used_slot_not_being_filled() {
        let busy = Slot::claim(idle(0), 5);
        assert_eq!(
            victim([(idle(0), 9, 0), (busy, 1, 0), (idle(2), 4, 0)], 0),
            Some(2)
        );
        assert_eq!(victim([(busy, 1, 0)], 0), None);
        assert_eq!(victim([(0, 0, 0), (idle(1), 0, 0)], 0), Some(0));
    }

    #[test]
    fn the_victim_is_one_every_node_mate_has_read_where_there_is_one() {
        // Node-mates 0..3 (all = 0b111): slot 0 is the oldest but node-mate 2 has not read it.
        let slots = [
            (idle(0), 1, 0b011),
            (idle(1), 5, 0b111),
            (idle(2), 3, 0b111),
        ];
        assert_eq!(victim(slots, 0b111), Some(2));
        // None read by all: plain LRU.
        assert_eq!(
            victim([(idle(0), 1, 0b011), (idle(1), 5, 0b001)], 0b111),
            Some(0)
        );
        // A full mask on a slot being filled does not make it a victim.
        let busy = Slot::claim(idle(3), 4);
        assert_eq!(
            victim([(idle(0), 9, 0b001), (busy, 1, 0b111)], 0b111),
            Some(0)
        );
    }
}
