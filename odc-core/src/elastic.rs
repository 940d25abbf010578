//! Elastic hybrid sharding, the store's side: the rounds of
//! [`crate::protocol::membership`] kept in the job's store and changed by
//! compare-and-set ([`Store::compare_set`]), and what an engine with
//! [`EngineConfig::elastic`](crate::EngineConfig::elastic) keeps of them
//! (the member nodes, and an [`Event`] per drop). The engine drives the
//! rounds at the end of each minibatch, in its cross-node sum
//! (`client::hybrid`).
//!
//! Round `(k, e)` is three keys under `{prefix}/round/{k}/{e}`: the key
//! itself holds the **decision** (`commit J` or `void D`, the rule's bytes,
//! followed by ` @{rank}`, the rank that wrote it), set once by a
//! compare-and-set from absent, so the first decision stands and every
//! rank reads the same; `…/reads` counts the read-ins by atomic add; and
//! `…/joins` holds the joiners (hexadecimal node set, compare-and-set).
//! A read-in is one add whatever the world size (a compare-and-set loop on
//! one shared value cost O(D) retries per rank under contention), and the
//! read that completes the count writes the commit. The rule's outcome is
//! the same as [`membership::on_read`] / [`membership::on_death`] applied
//! in order, with one more interleaving allowed: a void that lands between
//! the last read-in and its commit wins, which is safe (the survivors run
//! the next epoch without the dead node, all alike).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::protocol::membership::{self, node, Nodes, Outcome, Round};
use crate::store::Store;
use crate::{Error, Result};

/// A node dropped from the job, as one surviving rank saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// The minibatch whose cross-node sum left the node out (its
    /// microbatches there were dropped).
    pub minibatch: u64,
    /// The round's epoch that was voided (0 unless an earlier death had
    /// already voided this minibatch's round).
    pub epoch: u32,
    /// The node dropped.
    pub node: usize,
    /// The member nodes after it.
    pub members: Vec<usize>,
    /// Seconds from the start of this rank's cross-node sum of the
    /// minibatch to its learning of the death.
    pub detected_s: f64,
    /// Seconds from its learning of the death to the round over the
    /// survivors committing (when this rank may step).
    pub recovered_s: f64,
}

/// An elastic engine's membership: the member nodes (a set of
/// [`membership::MAX_NODES`] bits) and the drops seen so far.
#[derive(Debug)]
pub(crate) struct Membership {
    /// Key prefix of the rounds (the job's).
    pub(crate) prefix: String,
    members: AtomicU64,
    events: Mutex<Vec<Event>>,
}

impl Membership {
    /// Every one of `nodes` nodes a member.
    pub(crate) fn new(prefix: String, nodes: usize) -> Membership {
        debug_assert!(nodes <= membership::MAX_NODES);
        let all = if nodes >= 64 {
            u64::MAX
        } else {
            (1u64 << nodes) - 1
        };
        Membership {
            prefix,
            members: AtomicU64::new(all),
            events: Mutex::new(Vec::new()),
        }
    }

    /// The member nodes now.
    pub(crate) fn members(&self) -> Nodes {
        self.members.load(Ordering::Acquire)
    }

    pub(crate) fn set_members(&self, m: Nodes) {
        self.members.store(m, Ordering::Release);
    }

    pub(crate) fn record(&self, e: Event) {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(e);
    }

    /// Every drop seen so far, oldest first.
    pub(crate) fn events(&self) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The node indices in `m`, ascending.
pub fn nodes_of(m: Nodes) -> Vec<usize> {
    (0..membership::MAX_NODES)
        .filter(|&n| m & membership::node(n) != 0)
        .collect()
}

/// One rank's handle on the rounds of a job.
pub struct Rounds<'a> {
    store: &'a dyn Store,
    prefix: String,
    rank: usize,
}

impl std::fmt::Debug for Rounds<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rounds")
            .field("prefix", &self.prefix)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl<'a> Rounds<'a> {
    /// The rounds under `prefix` in `store`, as `rank` writes them.
    pub fn new(store: &'a dyn Store, prefix: &str, rank: usize) -> Rounds<'a> {
        Rounds {
            store,
            prefix: prefix.to_owned(),
            rank,
        }
    }

    fn key(&self, k: u64, e: u32) -> String {
        format!("{}/round/{k}/{e}", self.prefix)
    }

    /// The round's decision, once made: `Some(Committed | Void)`.
    pub fn decision(&self, k: u64, e: u32) -> Result<Option<Round>> {
        let key = self.key(k, e);
        match self.store.get(&key)? {
            None => Ok(None),
            Some(raw) => decode(&key, Some(&raw)).map(Some),
        }
    }

    /// A counter or node set kept beside the round (absent: 0).
    fn number(&self, key: &str, radix: u32) -> Result<u64> {
        let Some(raw) = self.store.get(key)? else {
            return Ok(0);
        };
        let text = String::from_utf8_lossy(&raw);
        u64::from_str_radix(text.trim(), radix).map_err(|_| Error::Store {
            op: "get",
            key: key.to_owned(),
            detail: format!("membership round: unreadable value {text:?}"),
        })
    }

    /// The round's value now: its decision, or (open) the read-ins and
    /// joiners so far.
    pub fn get(&self, k: u64, e: u32) -> Result<Round> {
        if let Some(d) = self.decision(k, e)? {
            return Ok(d);
        }
        let key = self.key(k, e);
        Ok(Round::Open {
            read: u32::try_from(self.number(&format!("{key}/reads"), 10)?).unwrap_or(u32::MAX),
            joining: self.number(&format!("{key}/joins"), 16)?,
        })
    }

    /// Decides the round as `want` unless it is decided already: a
    /// compare-and-set from absent, so the first decision stands; the
    /// decision after.
    fn decide(&self, k: u64, e: u32, want: Round) -> Result<Round> {
        let key = self.key(k, e);
        let mut bytes = want.to_bytes();
        bytes.extend_from_slice(format!(" @{}", self.rank).as_bytes());
        let after = self.store.compare_set(&key, None, &bytes)?;
        decode(&key, Some(&after))
    }

    /// This rank read every member's partials for round `(k, e)` over
    /// `members` of `per_node` ranks each: one atomic add to the round's
    /// read count (O(1) store requests per rank, whatever the world), and
    /// the read that completes the count commits the round, with the
    /// joiners so far, unless a void came first. Returns the decision, or
    /// `Open` with the count this read made (its joiners left out).
    pub fn read_in(&self, k: u64, e: u32, members: u64, per_node: u32) -> Result<Round> {
        if let Some(d) = self.decision(k, e)? {
            return Ok(d); // voided before this read: it does not count
        }
        let total = membership::total(members, per_node);
        let key = self.key(k, e);
        let read = self.store.add(&format!("{key}/reads"), 1)?;
        if read < i64::from(total) {
            // Open (its joiners are not looked up: only the commit needs them).
            let read = u32::try_from(read).unwrap_or(u32::MAX);
            return Ok(Round::Open { read, joining: 0 });
        }
        let joining = self.number(&format!("{key}/joins"), 16)?;
        self.decide(k, e, Round::Committed { joining })
    }

    /// Member node `dead` died: voids round `(k, e)` if it is open.
    pub fn void(&self, k: u64, e: u32, dead: usize) -> Result<Round> {
        self.decide(k, e, Round::Void { dead: node(dead) })
    }

    /// Node `who` asks to join from the minibatch after round `(k, e)`: its
    /// bit joins the round's joiners (a compare-and-set loop on that key
    /// alone). A round that committed without it (it asked too late, or the
    /// commit read the joiners first) does not admit it: it asks again.
    pub fn join(&self, k: u64, e: u32, who: usize) -> Result<Round> {
        let key = format!("{}/joins", self.key(k, e));
        let mut raw = self.store.get(&key)?;
        loop {
            if let Some(d) = self.decision(k, e)? {
                return Ok(d);
            }
            let cur = self.number(&key, 16)?;
            let want = format!("{:x}", cur | node(who));
            let after = self
                .store
                .compare_set(&key, raw.as_deref(), want.as_bytes())?;
            if after == want.as_bytes() {
                return self.get(k, e);
            }
            raw = Some(after);
        }
    }

    /// Node `node` (this rank's) cannot go on: voids the first open round
    /// it is a member of, in minibatch `k0` or, if `k0` committed, `k0 + 1`
    /// (its death then counts from there); `members` are `k0`'s members at
    /// epoch 0. Nothing once a round already dropped the node.
    pub fn leave(&self, k0: u64, mut members: Nodes, node: usize) -> Result<()> {
        for k in [k0, k0 + 1] {
            let mut e = 0;
            loop {
                if members & membership::node(node) == 0 {
                    return Ok(());
                }
                let Some(o) = membership::outcome(self.get(k, e)?) else {
                    self.void(k, e, node)?; // then look again: void (or committed first)
                    continue;
                };
                members = membership::next_members(members, o);
                match o {
                    Outcome::Void { .. } => e += 1,
                    Outcome::Committed { .. } => break,
                }
            }
        }
        Ok(())
    }

    /// Waits until round `(k, e)` is decided, voiding it as soon as
    /// `dead_member` names a member that died; a [`Error::Store`] at
    /// `deadline`.
    pub fn outcome(
        &self,
        k: u64,
        e: u32,
        deadline: Instant,
        mut dead_member: impl FnMut() -> Option<usize>,
    ) -> Result<Outcome> {
        let mut nap = Duration::from_micros(200);
        loop {
            let decided = match dead_member() {
                Some(d) => Some(self.void(k, e, d)?),
                None => self.decision(k, e)?,
            };
            if let Some(o) = decided.and_then(membership::outcome) {
                return Ok(o);
            }
            let now = Instant::now();
            if now >= deadline {
                let r = self.get(k, e)?;
                return Err(Error::Store {
                    op: "wait",
                    key: self.key(k, e),
                    detail: format!("membership round still open at the deadline ({r:?})"),
                });
            }
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(Duration::from_millis(10));
        }
    }
}

/// The round in a stored value (absent: fresh), its writer's tag dropped.
fn decode(key: &str, raw: Option<&[u8]>) -> Result<Round> {
    let body = raw.map(|b| match b.iter().rposition(|&c| c == b'@') {
        Some(at) if at > 0 && b[at - 1] == b' ' => &b[..at - 1],
        _ => b,
    });
    Round::from_bytes(body).map_err(|e| Error::Store {
        op: "get",
        key: key.to_owned(),
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Barrier};

    use super::*;
    use crate::protocol::membership::{node, FRESH};
    use crate::store::FileStore;

    /// Every rank of nodes `0..nodes` (`per_node` each) runs minibatch 0: reads in (unless its node is
    /// `silent`: its ranks died before reading), then waits for the outcome, learning of the silent node's
    /// death after `learn` polls; on a void it runs the next epoch over the survivors. Returns each
    /// survivor's (epoch, members) of its commit.
    fn run(nodes: usize, per_node: usize, silent: Option<usize>, learn: usize) -> Vec<(u32, u64)> {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        let live = nodes * per_node - silent.map_or(0, |_| per_node);
        let start = Arc::new(Barrier::new(live));
        let all: u64 = (1 << nodes) - 1;
        let threads: Vec<_> = (0..nodes * per_node)
            .filter(|r| Some(r / per_node) != silent)
            .map(|rank| {
                let (store, start) = (Arc::clone(&store), Arc::clone(&start));
                std::thread::spawn(move || {
                    let rounds = Rounds::new(&*store, "job", rank);
                    start.wait();
                    let (mut e, mut members) = (0, all);
                    loop {
                        rounds.read_in(0, e, members, per_node as u32).unwrap();
                        let mut polls = 0;
                        let deadline = Instant::now() + Duration::from_secs(30);
                        let o = rounds
                            .outcome(0, e, deadline, || {
                                polls += 1;
                                silent.filter(|&d| polls > learn && members & node(d) != 0)
                            })
                            .unwrap();
                        match o {
                            Outcome::Committed { .. } => return (e, members),
                            Outcome::Void { .. } => {
                                members = membership::next_members(members, o);
                                e += 1;
                            }
                        }
                    }
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn every_read_in_counts_once_under_contention_and_the_last_commits() {
        // 4 nodes x 3 ranks read in at once through the file store's compare-and-set.
        let out = run(4, 3, None, 0);
        assert_eq!(out.len(), 12);
        assert!(out.iter().all(|&o| o == (0, 0b1111)), "{out:?}");
    }

    #[test]
    fn a_node_that_never_reads_in_is_voided_and_the_survivors_agree_on_the_next_epoch() {
        for learn in [0, 3, 20] {
            let out = run(3, 2, Some(1), learn);
            assert_eq!(out.len(), 4);
            assert!(
                out.iter().all(|&o| o == (1, 0b101)),
                "learn after {learn}: {out:?}"
            );
        }
    }

    #[test]
    fn a_failing_node_voids_the_round_it_would_count_in_and_only_that_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path()).unwrap();
        let r = Rounds::new(&store, "job", 0);
        // Minibatch 4 still open: its epoch 0 is voided naming node 1.
        r.leave(4, 0b111, 1).unwrap();
        assert_eq!(r.get(4, 0).unwrap(), Round::Void { dead: node(1) });
        assert_eq!(r.get(5, 0).unwrap(), FRESH, "the next minibatch untouched");
        // Again (the node's other rank): nothing more, node 1 is out of epoch 1.
        r.leave(4, 0b111, 1).unwrap();
        assert_eq!(r.get(4, 1).unwrap(), FRESH);
        // Minibatch 6 committed before node 2 failed: its death counts from 7.
        for _ in 0..3 {
            r.read_in(6, 0, 0b111, 1).unwrap();
        }
        r.leave(6, 0b111, 2).unwrap();
        assert_eq!(r.get(6, 0).unwrap(), Round::Committed { joining: 0 });
        assert_eq!(r.get(7, 0).unwrap(), Round::Void { dead: node(2) });
        // Minibatch 8's epoch 0 voided by node 0's death: node 2 voids epoch 1 (it is a member there).
        r.void(8, 0, 0).unwrap();
        r.leave(8, 0b111, 2).unwrap();
        assert_eq!(r.get(8, 1).unwrap(), Round::Void { dead: node(2) });
    }

    #[test]
    fn a_joiner_is_recorded_by_an_open_round_and_an_unreadable_value_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path()).unwrap();
        let r = Rounds::new(&store, "job", 0);
        assert_eq!(
            r.join(3, 0, 2).unwrap(),
            Round::Open {
                read: 0,
                joining: node(2)
            }
        );
        assert_eq!(
            r.read_in(3, 0, 0b1, 1).unwrap(),
            Round::Committed { joining: node(2) }
        );
        assert_eq!(
            r.join(3, 0, 4).unwrap(),
            Round::Committed { joining: node(2) },
            "too late"
        );
        store.set("job/round/3/1", b"garbage @1").unwrap();
        let e = r.get(3, 1).unwrap_err().to_string();
        assert!(e.contains("job/round/3/1") && e.contains("garbage"), "{e}");
    }
}
