use std::collections::{BTreeMap, BTreeSet};

use super::*;

#[test]
fn rounds_round_trip_through_the_store_and_garbage_is_refused() {
    for r in [
        FRESH,
        Round::Open {
            read: 7,
            joining: 0b100,
        },
        Round::Committed { joining: u64::MAX },
        Round::Void { dead: node(63) },
    ] {
        assert_eq!(Round::from_bytes(Some(&r.to_bytes())), Ok(r));
    }
    assert_eq!(Round::from_bytes(None), Ok(FRESH));
    for bad in [
        &b"open 1"[..],
        b"void 3",
        b"void 0",
        b"commit",
        b"nope 1",
        b"open 1 2 3",
        b"\xff",
    ] {
        assert!(Round::from_bytes(Some(bad)).is_err(), "{bad:?}");
    }
}

#[test]
fn only_what_the_writers_write_is_read_and_a_refusal_names_the_field() {
    // Values the writers never write: a sign, a leading zero, upper case,
    // a double space, a trailing word; each refused naming its field.
    for (bad, field) in [
        (&b"commit +4"[..], "joining"),
        (b"commit 04", "joining"),
        (b"commit F", "joining"),
        (b"open 01 0", "read"),
        (b"open +1 0", "read"),
        (b"open 4294967296 0", "read"),
        (b"void  4", "dead"),
        (b"void 6", "dead"),
        (b"commit 4 ", "trailing"),
        (b"Commit 4", "kind"),
        (b"", "kind"),
    ] {
        let e = Round::from_bytes(Some(bad)).unwrap_err().to_string();
        assert!(e.contains(&format!(": {field} ")), "{bad:?}: {e}");
    }
}

#[test]
fn a_read_count_at_the_top_of_its_range_commits_without_overflow() {
    // Any count a stored value holds: "open 4294967295 0" decodes.
    let top = Round::from_bytes(Some(b"open 4294967295 0")).unwrap();
    assert_eq!(
        on_read(top, 3),
        Next::Write(Round::Committed { joining: 0 })
    );
}

#[test]
fn the_last_read_commits_a_death_first_voids_and_a_decided_round_stays() {
    let open = |read| Round::Open {
        read,
        joining: 0b1000,
    };
    assert_eq!(
        on_read(FRESH, 2),
        Next::Write(Round::Open {
            read: 1,
            joining: 0
        })
    );
    assert_eq!(
        on_read(open(1), 2),
        Next::Write(Round::Committed { joining: 0b1000 })
    );
    assert_eq!(
        on_death(open(1), 2),
        Next::Write(Round::Void { dead: 0b100 })
    );
    assert_eq!(
        on_join(open(1), 5),
        Next::Write(Round::Open {
            read: 1,
            joining: 0b10_1000
        })
    );
    for decided in [Round::Committed { joining: 0 }, Round::Void { dead: 1 }] {
        assert_eq!(on_read(decided, 2), Next::Wait);
        assert_eq!(on_death(decided, 1), Next::Wait);
        assert_eq!(on_join(decided, 1), Next::Wait);
        assert!(outcome(decided).is_some());
    }
    assert_eq!(outcome(open(1)), None);
    assert_eq!(
        next_members(0b011, Outcome::Committed { joining: 0b100 }),
        0b111
    );
    assert_eq!(next_members(0b111, Outcome::Void { dead: 0b010 }), 0b101);
    assert_eq!(total(0b101, 4), 8);
}

// -- the procedure, as a state machine over a simulated store ---------------------------------------------------
//
// Each rank of each node runs, per minibatch k: read every member's partial for its shard (the partial of member
// n is held by n's rank with the same local index, readable while that rank is alive), read in, wait for the
// round's outcome (voiding it on a member's death it learns of), then step (committed) or run the epoch again
// over the survivors (void). A rank whose node a round voids leaves. A joiner node asks to join the newest open
// round once started, and its ranks run from the minibatch after the round that admitted it. Deaths happen at
// random steps; each survivor learns of each one at a random later step (all of them eventually).

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Reading { k: u64, e: u32, next: usize },
    Waiting { k: u64, e: u32 },
    Done,
    Left,
}

struct Rank {
    node: usize,
    local: usize,
    alive: bool,
    phase: Phase,
    members: Nodes,
    known_dead: Nodes,
    /// (minibatch, epoch, members) of every round this rank committed.
    committed: Vec<(u64, u32, Nodes)>,
}

struct World {
    per_node: usize,
    minibatches: u64,
    store: BTreeMap<(u64, u32), Round>,
    /// The members of each (minibatch, epoch) round, as the ranks that ran it saw them (all must agree).
    round_members: BTreeMap<(u64, u32), Nodes>,
    /// Who read in at each round.
    reads: BTreeMap<(u64, u32), BTreeSet<usize>>,
    ranks: Vec<Rank>,
    /// A node waiting to join: (node, asked in round).
    joiner: Option<(usize, Option<(u64, u32)>)>,
    rng: u64,
}

impl World {
    fn rand(&mut self, n: usize) -> usize {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }

    fn new(nodes: usize, per_node: usize, members: Nodes, minibatches: u64, seed: u64) -> World {
        let ranks = (0..nodes * per_node)
            .map(|r| Rank {
                node: r / per_node,
                local: r % per_node,
                alive: true,
                phase: if members & node(r / per_node) != 0 {
                    Phase::Reading {
                        k: 0,
                        e: 0,
                        next: 0,
                    }
                } else {
                    Phase::Left
                },
                members,
                known_dead: 0,
                committed: Vec::new(),
            })
            .collect();
        World {
            per_node,
            minibatches,
            store: BTreeMap::new(),
            round_members: BTreeMap::new(),
            reads: BTreeMap::new(),
            ranks,
            joiner: None,
            rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
        }
    }

    fn dead_nodes(&self) -> Nodes {
        self.ranks
            .iter()
            .filter(|r| !r.alive)
            .fold(0, |s, r| s | node(r.node))
    }

    /// One compare-and-swap of round `key` by `next` (the simulated store is linearizable: a rank's look and
    /// swap happen in one step here; a lost swap is a look at the new value, which the next step takes).
    fn swap(&mut self, key: (u64, u32), next: Next) {
        if let Next::Write(v) = next {
            self.store.insert(key, v);
        }
    }

    fn round(&self, key: (u64, u32)) -> Round {
        self.store.get(&key).copied().unwrap_or(FRESH)
    }

    /// One step of rank `i`; `false` when it could not move (waiting on a dead peer or an open round).
    fn step(&mut self, i: usize) -> bool {
        let per_node = self.per_node as u32;
        let (phase, members, known) = {
            let r = &self.ranks[i];
            (r.phase, r.members, r.known_dead)
        };
        let (k, e) = match phase {
            Phase::Reading { k, e, .. } | Phase::Waiting { k, e } => (k, e),
            Phase::Done | Phase::Left => return false,
        };
        let key = (k, e);
        let seen = *self.round_members.entry(key).or_insert(members);
        assert_eq!(
            seen, members,
            "rank {i} runs round {key:?} over other members"
        );
        // A member known dead: void the round (a no-op once it is decided).
        // (The rule, not this driver, says what a decided round does with it: nothing.)
        if let Some(d) = (0..MAX_NODES).find(|&d| known & members & node(d) != 0) {
            if let next @ Next::Write(_) = on_death(self.round(key), d) {
                self.swap(key, next);
                return true;
            }
        }
        match phase {
            Phase::Reading { .. } if outcome(self.round(key)).is_some() => {
                self.ranks[i].phase = Phase::Waiting { k, e }; // voided meanwhile: no need to read on
                true
            }
            Phase::Reading { next, .. } => {
                let nodes: Vec<usize> =
                    (0..MAX_NODES).filter(|&n| members & node(n) != 0).collect();
                if next < nodes.len() {
                    let holder = nodes[next] * self.per_node + self.ranks[i].local;
                    if !self.ranks[holder].alive {
                        // Its memory is gone: the read fails naming the peer (a death learnt).
                        self.ranks[i].known_dead |= node(nodes[next]);
                        return true;
                    }
                    self.ranks[i].phase = Phase::Reading {
                        k,
                        e,
                        next: next + 1,
                    };
                    return true;
                }
                let cur = self.round(key);
                if let Next::Write(v) = on_read(cur, total(members, per_node)) {
                    self.store.insert(key, v);
                    self.reads.entry(key).or_default().insert(i);
                }
                self.ranks[i].phase = Phase::Waiting { k, e };
                true
            }
            Phase::Waiting { .. } => match outcome(self.round(key)) {
                None => false,
                Some(o) => {
                    let r = &mut self.ranks[i];
                    let next = next_members(members, o);
                    match o {
                        Outcome::Committed { .. } => {
                            r.committed.push((k, e, members));
                            r.members = next;
                            r.phase = if k + 1 == self.minibatches {
                                Phase::Done
                            } else {
                                Phase::Reading {
                                    k: k + 1,
                                    e: 0,
                                    next: 0,
                                }
                            };
                        }
                        Outcome::Void { .. } if next & node(r.node) == 0 => r.phase = Phase::Left,
                        Outcome::Void { .. } => {
                            r.members = next;
                            r.phase = Phase::Reading {
                                k,
                                e: e + 1,
                                next: 0,
                            };
                        }
                    }
                    true
                }
            },
            Phase::Done | Phase::Left => false,
        }
    }

    /// The joiner asks the newest open round; once a round admitting it committed, its ranks start the next
    /// minibatch with that round's members.
    fn join_step(&mut self) -> bool {
        let Some((j, asked)) = self.joiner else {
            return false;
        };
        if let Some(key) = asked {
            match outcome(self.round(key)) {
                None => return false,
                Some(Outcome::Committed { joining }) if joining & node(j) != 0 => {
                    let members = self.round_members[&key] | joining;
                    let (k, per_node) = (key.0 + 1, self.per_node);
                    for r in &mut self.ranks[j * per_node..(j + 1) * per_node] {
                        if r.alive && k < self.minibatches {
                            r.members = members;
                            r.phase = Phase::Reading { k, e: 0, next: 0 };
                        }
                    }
                    self.joiner = None;
                    return true;
                }
                Some(_) => {} // voided before it committed: ask again
            }
        }
        let Some(&key) = self.round_members.keys().next_back() else {
            return false;
        };
        if outcome(self.round(key)).is_some() || key.0 + 1 >= self.minibatches {
            self.joiner = Some((j, None));
            return false;
        }
        let next = on_join(self.round(key), j);
        self.swap(key, next);
        self.joiner = Some((j, Some(key)));
        true
    }

    fn kill(&mut self, rank: usize) {
        self.ranks[rank].alive = false;
        if self.joiner.is_some_and(|(j, _)| j == self.ranks[rank].node) {
            self.joiner = None; // a joiner dying before it is admitted: nothing to undo
        }
    }

    /// Runs until every live rank is done or left; deaths from `kills` (rank, at step), detection random.
    fn run(&mut self, kills: &[(usize, usize)]) {
        let n = self.ranks.len();
        for steps in 0..200_000 {
            for &(rank, at) in kills {
                if at == steps {
                    self.kill(rank);
                }
            }
            let dead = self.dead_nodes();
            let live = (0..n).filter(|&i| self.ranks[i].alive).collect::<Vec<_>>();
            if live
                .iter()
                .all(|&i| matches!(self.ranks[i].phase, Phase::Done | Phase::Left))
                && self.joiner.is_none()
                && kills.iter().all(|&(_, at)| at < steps)
            {
                return;
            }
            match self.rand(8) {
                0 if dead != 0 => {
                    // Some survivor learns of every death so far (each learns eventually).
                    let i = live[self.rand(live.len())];
                    self.ranks[i].known_dead |= dead;
                }
                1 => {
                    self.join_step();
                }
                _ => {
                    let i = live[self.rand(live.len())];
                    if !self.step(i) && steps > 100_000 {
                        self.ranks[i].known_dead |= dead; // fairness: waiters learn of deaths at last
                    }
                }
            }
        }
        panic!(
            "no progress after 200000 steps: {:?}",
            self.ranks.iter().map(|r| r.phase).collect::<Vec<_>>()
        );
    }

    /// The properties every run keeps.
    fn check(&self) {
        // Agreement: every rank that committed minibatch k committed the same epoch over the same members.
        let mut per_k: BTreeMap<u64, BTreeSet<(u32, Nodes)>> = BTreeMap::new();
        for r in &self.ranks {
            for &(k, e, m) in &r.committed {
                per_k.entry(k).or_default().insert((e, m));
            }
        }
        for (k, v) in &per_k {
            assert_eq!(v.len(), 1, "minibatch {k} committed differently: {v:?}");
            let &(e, m) = v.iter().next().unwrap();
            // Validity: a committed round was read in by every rank of every member, each once.
            let want: BTreeSet<usize> = (0..self.ranks.len())
                .filter(|&i| m & node(self.ranks[i].node) != 0)
                .collect();
            assert_eq!(
                self.reads.get(&(*k, e)),
                Some(&want),
                "minibatch {k} epoch {e}"
            );
            assert!(
                matches!(self.round((*k, e)), Round::Committed { .. }),
                "minibatch {k} epoch {e}"
            );
        }
        // Every survivor on a node no death touched finished every minibatch.
        let dead = self.dead_nodes();
        for r in self
            .ranks
            .iter()
            .filter(|r| r.alive && dead & node(r.node) == 0)
        {
            if r.phase != Phase::Left {
                assert_eq!(r.phase, Phase::Done, "rank on node {}", r.node);
                assert_eq!(
                    r.committed.len() as u64,
                    self.minibatches - r.committed[0].0
                );
            }
        }
        // No dead node is a member after a survivor's last commit of a minibatch it died before.
        for r in self
            .ranks
            .iter()
            .filter(|r| r.alive && r.phase == Phase::Done)
        {
            assert_eq!(r.members & dead & !r.committed.last().map_or(0, |c| c.2), 0);
        }
    }
}

#[test]
fn a_death_during_the_cross_node_sum_leaves_every_survivor_with_one_answer() {
    // 3 nodes x 2 ranks, 3 minibatches; one rank of node 1 killed at a random step (before, during or after
    // the sums, including between its own read-in and the round's commit).
    for seed in 0..3000 {
        let mut w = World::new(3, 2, 0b111, 3, seed);
        let at = w.rand(60);
        let victim = 2 + w.rand(2);
        w.run(&[(victim, at)]);
        w.check();
        // The survivors finished; whether a minibatch counted node 1 is the same everywhere (check), and from
        // the minibatch after the death was learnt on it is out.
        let survivor = &w.ranks[0];
        assert_eq!(survivor.phase, Phase::Done, "seed {seed}");
        assert_eq!(
            survivor.members & node(1),
            0,
            "seed {seed}: node 1 still a member"
        );
    }
}

#[test]
fn two_deaths_in_one_minibatch_drop_both_nodes() {
    for seed in 0..3000 {
        let mut w = World::new(4, 2, 0b1111, 2, seed);
        let (a, b) = (w.rand(40), w.rand(40));
        w.run(&[(2, a), (5, b)]); // a rank of node 1 and one of node 2
        w.check();
        let survivor = &w.ranks[0];
        assert_eq!(survivor.phase, Phase::Done, "seed {seed}");
        assert_eq!(survivor.members & 0b0110, 0, "seed {seed}");
        assert_eq!(
            w.ranks[7].phase,
            Phase::Done,
            "seed {seed}: node 3 survives"
        );
    }
}

#[test]
fn a_joiner_is_a_member_from_the_minibatch_after_the_round_that_admitted_it() {
    let mut admitted = 0;
    for seed in 0..2000 {
        // Nodes 0 and 1 train 4 minibatches; node 2 asks to join.
        let mut w = World::new(3, 2, 0b011, 4, seed);
        w.joiner = Some((2, None));
        w.run(&[]);
        w.check();
        let first = w.ranks[4].committed.first().map(|c| c.0);
        if let Some(k) = first {
            admitted += 1;
            // Everyone agrees on the members of each minibatch (check); from k on node 2 is one of them.
            for r in &w.ranks {
                for &(kk, _, m) in &r.committed {
                    assert_eq!(m & node(2) != 0, kk >= k, "seed {seed}: minibatch {kk}");
                }
            }
        }
    }
    assert!(
        admitted > 1000,
        "the joiner was admitted in {admitted} of 2000 runs"
    );
}

#[test]
fn a_joiner_dying_before_or_after_admission_is_dropped_and_nothing_hangs() {
    for seed in 0..2000 {
        let mut w = World::new(3, 2, 0b011, 4, seed);
        w.joiner = Some((2, None));
        let (at, victim) = (w.rand(80), 4 + w.rand(2));
        w.run(&[(victim, at)]);
        w.check();
        for i in 0..4 {
            assert_eq!(w.ranks[i].phase, Phase::Done, "seed {seed}: rank {i}");
            assert_eq!(w.ranks[i].members & node(2), 0, "seed {seed}");
        }
    }
}
