//! Elastic hybrid sharding, the store's side: the rounds of
//! [`crate::protocol::membership`] kept in the job's store and changed by
//! compare-and-set ([`Store::compare_set`]). Nothing in the engine calls it
//! yet; it is the piece a rank's end of minibatch will drive.
//!
//! A round's key is `{prefix}/round/{k}/{e}`; its value is the rule's
//! bytes followed by ` @{rank}`, the rank that wrote it, so that a rank
//! knows its swap won by reading its own value back (two ranks moving an
//! open round from the same count to the same next count would otherwise
//! both see "their" value, and one read-in would be lost).

use std::time::{Duration, Instant};

use crate::protocol::membership::{self, Next, Outcome, Round};
use crate::store::Store;
use crate::{Error, Result};

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

    /// The round's value now.
    pub fn get(&self, k: u64, e: u32) -> Result<Round> {
        let key = self.key(k, e);
        decode(&key, self.store.get(&key)?.as_deref())
    }

    /// Applies `rule` until it has nothing to write or this rank's write
    /// went in; the round's value after.
    fn apply(&self, k: u64, e: u32, rule: impl Fn(Round) -> Next) -> Result<Round> {
        let key = self.key(k, e);
        let mut raw = self.store.get(&key)?;
        loop {
            let cur = decode(&key, raw.as_deref())?;
            let Next::Write(next) = rule(cur) else {
                return Ok(cur);
            };
            let mut want = next.to_bytes();
            want.extend_from_slice(format!(" @{}", self.rank).as_bytes());
            let after = self.store.compare_set(&key, raw.as_deref(), &want)?;
            if after == want {
                return Ok(next);
            }
            raw = Some(after); // lost to another rank's write: look at it
        }
    }

    /// This rank read every member's partials for round `(k, e)` over
    /// `members` of `per_node` ranks each.
    pub fn read_in(&self, k: u64, e: u32, members: u64, per_node: u32) -> Result<Round> {
        let total = membership::total(members, per_node);
        self.apply(k, e, |r| membership::on_read(r, total))
    }

    /// Member node `dead` died: voids round `(k, e)` if it is open.
    pub fn void(&self, k: u64, e: u32, dead: usize) -> Result<Round> {
        self.apply(k, e, |r| membership::on_death(r, dead))
    }

    /// Node `who` asks to join from the minibatch after round `(k, e)`.
    pub fn join(&self, k: u64, e: u32, who: usize) -> Result<Round> {
        self.apply(k, e, |r| membership::on_join(r, who))
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
            let r = match dead_member() {
                Some(d) => self.void(k, e, d)?,
                None => self.get(k, e)?,
            };
            if let Some(o) = membership::outcome(r) {
                return Ok(o);
            }
            let now = Instant::now();
            if now >= deadline {
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
    use crate::protocol::membership::node;
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
