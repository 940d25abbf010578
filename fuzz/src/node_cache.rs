//! The node cache's words (`protocol::cache`), which every node-mate
//! writes into the others' cache regions: entry words (who fetches which
//! version into which slot, and when it is in) and slot words (the
//! sequence lock over a slot's data), with any value a node-mate, a torn
//! write or stale memory may leave.
//!
//! Properties: an entry word is accepted exactly when a spelled-out reader
//! accepts it (what `Entry::encode` writes, with a slot of the cache and a
//! fetcher of the node), and a refusal names the field; the reader's rule
//! (`look_in`) agrees with a spelled-out rule, and the slot it hands out
//! indexes the cache (`Look::Hit`) and the fetcher it names is a node-mate
//! (`Look::Wait`); a take-over keeps the claim's version and slot; slot
//! words round trip, a new claim always changes the word, and eviction
//! picks what a spelled-out LRU picks and never a slot being filled.
//! Node-mates gathering, fetching, evicting and dying in any interleaving,
//! as `client::cache` does: a copy a reader keeps is always the entry's
//! version it asked for, whole; a slot being filled is never taken; every
//! live reader finishes.

use arbitrary::{Result, Unstructured};
use odc_core::protocol::cache::{
    self, claim, filled, look, take_over, victim, BadWord, Entry, Look, Slot, MAX_LOCAL, MAX_SLOTS,
    MAX_VERSION,
};

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=2u8)? {
        0 => entry_words(u),
        1 => slot_words(u),
        _ => node(u),
    }
}

/// A word near the encoder's (an encoded entry with a bit or a field
/// changed), or anything.
fn entry_word(u: &mut Unstructured<'_>, slots: usize, local: usize) -> Result<u64> {
    let version = if u.ratio(1, 4)? {
        u.int_in_range(0..=MAX_VERSION)?
    } else {
        u.int_in_range(0..=5u64)?
    };
    let slot = u
        .int_in_range(0..=slots.min(MAX_SLOTS - 1) + 1)?
        .min(MAX_SLOTS - 1);
    let by = u
        .int_in_range(0..=local.min(MAX_LOCAL - 1) + 1)?
        .min(MAX_LOCAL - 1);
    let e = match u.int_in_range(0..=2u8)? {
        0 => Entry::Empty,
        1 => Entry::Fetching { version, slot, by },
        _ => Entry::Ready { version, slot },
    };
    let mut w = e.encode();
    match u.int_in_range(0..=4u8)? {
        0 => w ^= 1 << u.int_in_range(0..=63u32)?,
        1 => w = u.arbitrary()?,
        _ => {}
    }
    Ok(w)
}

/// The entry word `w` as a reader following the module docs' table reads
/// it, or the first field that is wrong.
fn spelled_entry(w: u64, slots: usize, local: usize) -> std::result::Result<Entry, &'static str> {
    let state = w & 3;
    let by = ((w >> 2) & 0xff) as usize;
    let slot = ((w >> 10) & 0x3f_ffff) as usize;
    let stamp = w >> 32;
    match state {
        0 if w == 0 => Ok(Entry::Empty),
        1 | 2 if stamp == 0 => Err("state"),
        1 => {
            if slot >= slots {
                Err("slot")
            } else if by >= local {
                Err("fetcher")
            } else {
                Ok(Entry::Fetching {
                    version: stamp - 1,
                    slot,
                    by,
                })
            }
        }
        2 => {
            if by != 0 {
                Err("fetcher")
            } else if slot >= slots {
                Err("slot")
            } else {
                Ok(Entry::Ready {
                    version: stamp - 1,
                    slot,
                })
            }
        }
        _ => Err("state"),
    }
}

fn entry_words(u: &mut Unstructured<'_>) -> Result<()> {
    let slots = u.int_in_range(1..=MAX_SLOTS)?;
    let local = u.int_in_range(1..=MAX_LOCAL)?;
    let w = entry_word(u, slots, local)?;
    let version = if u.ratio(1, 2)? {
        u.int_in_range(0..=6u64)?
    } else {
        u.arbitrary()?
    };
    let checked = Entry::check(w, slots, local);
    match (checked, spelled_entry(w, slots, local)) {
        (Ok(e), Ok(want)) => {
            assert_eq!(e, want);
            assert_eq!(e.encode(), w, "{e:?}");
        }
        (Err(BadWord { field, word }), Err(want)) => {
            assert_eq!((field, word), (want, w), "{w:#x}");
        }
        (got, want) => {
            panic!("{w:#x} ({slots} slots, {local} local): check {got:?}, the rule {want:?}")
        }
    }
    // Any word decodes to something that encodes back to a word decoding
    // the same.
    let d = Entry::decode(w);
    assert_eq!(Entry::decode(d.encode()), d);

    // The reader's rule on the word, checked first.
    match cache::look_in(w, version, slots, local) {
        Ok(l) => {
            // What the engine indexes with: the cache's slots, the node's ranks.
            match l {
                Look::Hit { slot } => assert!(slot < slots, "{w:#x}: slot {slot} of {slots}"),
                Look::Wait { by } => assert!(by < local, "{w:#x}: fetcher {by} of {local}"),
                _ => {}
            }
            let Ok(e) = checked else {
                panic!("{w:#x}: looked at without being checked: {l:?}")
            };
            let want = match e {
                Entry::Empty => Look::Claim,
                Entry::Ready { version: v, slot } if v == version => Look::Hit { slot },
                Entry::Fetching { version: v, by, .. } if v == version => Look::Wait { by },
                Entry::Ready { version: v, .. } | Entry::Fetching { version: v, .. }
                    if v > version =>
                {
                    Look::Newer { current: v }
                }
                _ => Look::Claim,
            };
            assert_eq!(l, want, "{w:#x} at {version}");
            assert_eq!(l, look(w, version));
        }
        Err(b) => assert_eq!(Some(b), checked.err()),
    }

    // A take-over keeps the claim's version and slot, and only of the
    // dead fetcher's claim.
    let dead = u.int_in_range(0..=local - 1)?;
    let me = u.int_in_range(0..=local - 1)?;
    match (take_over(w, dead, me), Entry::decode(w)) {
        (Some(m), Entry::Fetching { version, slot, by }) => {
            assert_eq!(by, dead);
            assert_eq!(m, claim(version, slot, me));
            if checked.is_ok() {
                assert_eq!(
                    Entry::check(m, slots, local),
                    Ok(Entry::Fetching {
                        version,
                        slot,
                        by: me
                    })
                );
            }
        }
        (None, Entry::Fetching { by, .. }) => assert_ne!(by, dead),
        (None, _) => {}
        (Some(m), e) => panic!("took over {e:?} as {m:#x}"),
    }

    // What the fetchers write is accepted.
    let v = u.int_in_range(0..=MAX_VERSION)?;
    let slot = u.int_in_range(0..=slots - 1)?;
    let ok = |w| Entry::check(w, slots, local).is_ok();
    assert!(ok(claim(v, slot, me)) && ok(filled(v, slot)) && ok(Entry::Empty.encode()));
    Ok(())
}

fn slot_words(u: &mut Unstructured<'_>) -> Result<()> {
    let w: u64 = u.arbitrary()?;
    let s = Slot::decode(w);
    assert_eq!(s.encode(), w, "{s:?}");
    assert_eq!(s.entry, (w >> 32).checked_sub(1).map(|e| e as usize));
    assert_eq!(
        (s.gen, s.filling),
        (((w >> 1) & 0x7fff_ffff) as u32, w & 1 == 1)
    );
    let entry = u.int_in_range(0..=(u32::MAX - 1) as usize)?;
    // A claim is a new generation, filling, for the entry: whatever a
    // reader loaded before it, the word differs after the fill as well.
    let c = Slot::claim(w, entry);
    assert_eq!(
        Slot::decode(c),
        Slot {
            entry: Some(entry),
            gen: s.gen.wrapping_add(1) & 0x7fff_ffff,
            filling: true
        }
    );
    assert!(c != w && Slot::filled(c) != w);
    assert!(!Slot::holds(c, entry), "read while filling");
    assert!(Slot::holds(Slot::filled(c), entry));
    assert_eq!(Slot::holds(w, entry), s.entry == Some(entry) && !s.filling);

    // Eviction over any slot words, uses and readers.
    let n = u.int_in_range(0..=8usize)?;
    let mut slots = Vec::with_capacity(n);
    for _ in 0..n {
        let w = if u.ratio(1, 2)? {
            u.arbitrary()?
        } else {
            Slot {
                entry: Some(u.int_in_range(0..=4usize)?),
                gen: u.int_in_range(0..=3u32)?,
                filling: u.ratio(1, 3)?,
            }
            .encode()
        };
        let used = u.int_in_range(0..=5u64)?;
        let readers = u.int_in_range(0..=15u64)?;
        slots.push((w, used, readers));
    }
    let all = [0u64, 1, 3, 7, 15, u64::MAX][u.choose_index(6)?];
    let got = victim(slots.iter().copied(), all);
    // The least recently used (first on a tie) of those every node-mate
    // read, else of all; never one being filled.
    let free: Vec<(usize, u64, u64)> = (slots.iter().enumerate())
        .filter(|(_, s)| !Slot::decode(s.0).filling)
        .map(|(i, s)| (i, s.1, s.2))
        .collect();
    let oldest = |it: &mut dyn Iterator<Item = &(usize, u64, u64)>| {
        it.fold(None::<(u64, usize)>, |best, &(i, used, _)| match best {
            Some((u, _)) if u <= used => best,
            _ => Some((used, i)),
        })
        .map(|(_, i)| i)
    };
    let read_by_all = oldest(&mut free.iter().filter(|s| all != 0 && s.2 & all == all));
    let want = read_by_all.or_else(|| oldest(&mut free.iter()));
    assert_eq!(got, want, "{slots:?} all {all:#x}");
    Ok(())
}

// ----- node-mates on one cache --------------------------------------------------------------------------------

/// What a slot's data holds: (entry, version, whole).
type Data = (usize, u64, bool);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    Idle,
    /// Reading `v` of entry `e`.
    Look {
        e: usize,
        v: u64,
    },
    /// A hit: the slot word loaded before the copy.
    CopyStart {
        e: usize,
        v: u64,
        slot: usize,
        before: u64,
    },
    /// Copied `data`; the slot word is checked next.
    CopyEnd {
        e: usize,
        v: u64,
        slot: usize,
        before: u64,
        data: Data,
    },
    /// This rank claimed `e` into `slot`: it writes the data, then marks it.
    Fill {
        e: usize,
        v: u64,
        slot: usize,
        written: bool,
    },
    Dead,
}

struct Node {
    entries: Vec<u64>,
    slots: Vec<u64>,
    used: Vec<u64>,
    readers: Vec<u64>,
    data: Vec<Data>,
    clock: u64,
    /// The version each entry's owner published last.
    published: Vec<u64>,
    local: usize,
}

impl Node {
    fn direct(&self) -> bool {
        self.slots.len() >= self.entries.len()
    }

    fn touch(&mut self, slot: usize, me: usize) {
        self.clock += 1;
        self.used[slot] = self.clock;
        self.readers[slot] |= 1 << me;
    }

    fn all(&self) -> u64 {
        (1u64 << self.local) - 1
    }

    /// `client::cache::claim` in one step: the entry (its word read `w`),
    /// then a slot; `None` when the entry changed (lost) or no slot is free
    /// of fills (the claim is given back).
    fn claim(&mut self, e: usize, w: u64, v: u64, me: usize) -> Option<Option<usize>> {
        if self.entries[e] != w {
            return None;
        }
        let n = self.slots.len();
        let guess = if self.direct() {
            e
        } else {
            Entry::decode(w).slot().unwrap_or(0) % n
        };
        self.entries[e] = claim(v, guess, me);
        let mut slot = guess;
        for attempt in 0..8 {
            let s = Slot::decode(self.slots[slot]);
            let reusable = (s.entry == Some(e) || s.entry.is_none()) && !s.filling;
            if attempt > 0 || !reusable {
                if self.direct() {
                    break;
                }
                let all = self.all();
                let pick = victim(
                    (0..n).map(|i| (self.slots[i], self.used[i], self.readers[i])),
                    all,
                );
                match pick {
                    Some(p) => slot = p,
                    None => break,
                }
            }
            let s = Slot::decode(self.slots[slot]);
            if s.filling && s.entry != Some(e) {
                continue;
            }
            self.slots[slot] = Slot::claim(self.slots[slot], e);
            self.readers[slot] = 0;
            if slot != guess {
                self.entries[e] = claim(v, slot, me);
            }
            return Some(Some(slot));
        }
        if self.direct() {
            // Its own slot, marked filling by a claim that died.
            self.slots[e] = Slot::claim(self.slots[e], e);
            return Some(Some(e));
        }
        self.entries[e] = Entry::Empty.encode();
        Some(None)
    }
}

/// Up to 4 node-mates gathering up to 6 entries through up to 6 slots, a
/// step of one of them at a time as the input picks, owners publishing new
/// versions once nobody reads the old one, fetchers dying mid-fill.
fn node(u: &mut Unstructured<'_>) -> Result<()> {
    let local = u.int_in_range(1..=4usize)?;
    let entries = u.int_in_range(1..=6usize)?;
    let slots = u.int_in_range(1..=entries)?;
    let mut n = Node {
        entries: vec![0; entries],
        slots: vec![0; slots],
        used: vec![0; slots],
        readers: vec![0; slots],
        data: vec![(usize::MAX, 0, true); slots],
        clock: 0,
        published: vec![0; entries],
        local,
    };
    let mut ranks = vec![Step::Idle; local];
    let mut finished = 0usize;
    let steps = u.int_in_range(0..=200u16)?;
    for _ in 0..steps {
        if u.ratio(1, 12)? {
            // An owner publishes the next version of an entry nobody reads.
            let e = u.choose_index(entries)?;
            let busy = ranks.iter().any(|s| match *s {
                Step::Look { e: x, .. }
                | Step::CopyStart { e: x, .. }
                | Step::CopyEnd { e: x, .. }
                | Step::Fill { e: x, .. } => x == e,
                _ => false,
            });
            if !busy {
                n.published[e] += 1;
            }
            continue;
        }
        let me = u.choose_index(local)?;
        let die = u.ratio(1, 40)?;
        let pick = u.choose_index(entries)?;
        step(&mut n, &mut ranks, me, die, pick, &mut finished);
    }
    // Every live rank finishes once it gets its turns.
    for round in 0..2000 {
        if ranks.iter().all(|s| matches!(s, Step::Idle | Step::Dead)) {
            return Ok(());
        }
        let me = round % local;
        step(&mut n, &mut ranks, me, false, usize::MAX, &mut finished);
    }
    panic!("node-mates stuck: {ranks:?}");
}

/// One step of rank `me` (`pick`: the entry an idle rank reads next,
/// `usize::MAX` for none).
fn step(n: &mut Node, ranks: &mut [Step], me: usize, die: bool, pick: usize, finished: &mut usize) {
    let (slots, local) = (n.slots.len(), n.local);
    ranks[me] = match ranks[me] {
        Step::Dead => Step::Dead,
        Step::Idle if pick == usize::MAX => Step::Idle,
        Step::Idle => Step::Look {
            e: pick,
            v: n.published[pick],
        },
        Step::Look { e, v } => {
            let w = n.entries[e];
            let look = cache::look_in(w, v, slots, local)
                .unwrap_or_else(|b| panic!("a node-mate following the rule wrote {b:?}"));
            match look {
                Look::Hit { slot } => {
                    let before = n.slots[slot];
                    if Slot::holds(before, e) {
                        Step::CopyStart { e, v, slot, before }
                    } else {
                        claimed(n, e, w, v, me)
                    }
                }
                Look::Wait { by } => match ranks[by] {
                    Step::Dead => match take_over(w, by, me) {
                        Some(mine) if n.entries[e] == w => {
                            n.entries[e] = mine;
                            let slot = Entry::decode(mine).slot().unwrap_or(0);
                            assert!(slot < slots);
                            n.slots[slot] = Slot::claim(n.slots[slot], e);
                            Step::Fill {
                                e,
                                v,
                                slot,
                                written: false,
                            }
                        }
                        _ => Step::Look { e, v },
                    },
                    _ => Step::Look { e, v },
                },
                Look::Newer { current } => {
                    panic!("entry {e} at {current} while a reader of {v} had not released it")
                }
                Look::Claim => claimed(n, e, w, v, me),
            }
        }
        Step::CopyStart { e, v, slot, before } => Step::CopyEnd {
            e,
            v,
            slot,
            before,
            data: n.data[slot],
        },
        Step::CopyEnd {
            e,
            v,
            slot,
            before,
            data,
        } => {
            if n.slots[slot] == before {
                assert_eq!(
                    data,
                    (e, v, true),
                    "a copy of slot {slot} kept for {e} at {v}"
                );
                n.touch(slot, me);
                *finished += 1;
                Step::Idle
            } else {
                Step::Look { e, v }
            }
        }
        Step::Fill { .. } if die => Step::Dead,
        Step::Fill {
            e,
            v,
            slot,
            written: false,
        } => {
            n.data[slot] = (e, v, false);
            Step::Fill {
                e,
                v,
                slot,
                written: true,
            }
        }
        Step::Fill {
            e,
            v,
            slot,
            written: true,
        } => {
            let s = Slot::decode(n.slots[slot]);
            assert!(
                s.entry == Some(e) && s.filling,
                "slot {slot}, being filled with {e} by {me}, was taken: {s:?}"
            );
            n.data[slot] = (e, v, true);
            n.slots[slot] = Slot::filled(n.slots[slot]);
            n.entries[e] = filled(v, slot);
            n.touch(slot, me);
            *finished += 1;
            Step::Idle
        }
    };
}

/// A reader's claim of entry `e` (its word read `w`) at version `v`.
fn claimed(n: &mut Node, e: usize, w: u64, v: u64, me: usize) -> Step {
    match n.claim(e, w, v, me) {
        None => Step::Look { e, v },
        // No slot free of fills: read straight into the output.
        Some(None) => Step::Idle,
        Some(Some(slot)) => Step::Fill {
            e,
            v,
            slot,
            written: false,
        },
    }
}
