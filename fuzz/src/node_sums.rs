//! Node aggregation (`cross_node = "node"`, `protocol::nodesum`): where a
//! chunk goes, the owner field an aggregator's daemon reads from a
//! node-mate's header and accepts (`nodesum::aggregates`), the minibatch a
//! node buffer admits (`admit`), whose done words feed an owner's
//! gradients and release its versions, and when an aggregator's sums go
//! (`sums_ready`), with any ranks, node sizes and words.
//!
//! Properties: every rule agrees with a spelled-out one on any values
//! (no overflow, no division by zero); a chunk stays in its node and
//! reaches the owner's local rank; an aggregator accepts an owner field
//! exactly for the chunks the route sends it, and only for ranks of the
//! job; the ranks feeding an owner are the ones the route delivers through,
//! and a rank's releaser is one of them on its node. Node-mates, their
//! aggregators and the owners pushing, adding, finishing and summing in
//! any interleaving over two minibatches, as `client` and `server` do: an
//! owner's gradients are final only with every client's chunk of that
//! minibatch in, each once; no chunk lands in an accumulator or node
//! buffer not open for its minibatch; every rank finishes.

use std::collections::VecDeque;

use arbitrary::{Result, Unstructured};
use odc_core::protocol::admit::{admit, Admit};
use odc_core::protocol::nodesum::{
    aggregates, done_after_sums, feeds, releaser, server, sums_ready,
};

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=1u8)? {
        0 => rules(u),
        _ => job(u),
    }
}

/// A rank or size: small (where the rules' cases are), or anything.
fn small_or_any(u: &mut Unstructured<'_>, small: usize) -> Result<usize> {
    if u.ratio(1, 5)? {
        u.arbitrary()
    } else {
        u.int_in_range(0..=small)
    }
}

fn rules(u: &mut Unstructured<'_>) -> Result<()> {
    // Ranks of a job (its own ranks are all the rules see, but for the
    // owner field a peer writes, which may be anything): nodes of `local`
    // ranks, any sizes whose world fits a usize.
    let local = small_or_any(u, 5)?.max(1);
    let nodes = small_or_any(u, 5)?.max(1);
    let Some(world) = nodes.checked_mul(local) else {
        return Ok(());
    };
    let rank = |u: &mut Unstructured<'_>| -> Result<usize> { Ok(small_or_any(u, 24)? % world) };
    let (me, client, owner) = (rank(u)?, rank(u)?, rank(u)?);
    let field = small_or_any(u, 24)?;
    let l = local;
    let node = |r: usize| r / l;

    // The daemon's check of a node-mate's owner field, on any value.
    let spelled =
        field < world && node(client) == node(me) && node(field) != node(me) && field % l == me % l;
    assert_eq!(
        aggregates(me, client, field, nodes, local),
        spelled,
        "me {me} client {client} owner {field} nodes {nodes} local {local}"
    );
    if spelled {
        assert_eq!(
            server(client, field, local),
            me,
            "accepted a chunk routed elsewhere"
        );
    }

    // The route: the owner itself on the client's node, else the client's
    // node-mate with the owner's local rank.
    let s = server(client, owner, local);
    let want = if node(client) == node(owner) {
        owner
    } else {
        node(client) * l + owner % l
    };
    assert_eq!(s, want);
    assert_eq!((node(s), s % l), (node(client), owner % l));

    if node(client) != node(owner) {
        assert!(
            aggregates(s, client, owner, nodes, local),
            "refused a routed chunk"
        );
    }

    // Whose done words feed an owner, and who releases a client's reads.
    assert_eq!(
        feeds(owner, client, local),
        node(client) == node(owner) || client % l == owner % l
    );
    assert!(feeds(owner, s, local));
    let r = releaser(owner, client, local);
    assert!(node(r) == node(client) && feeds(owner, r, local));
    assert_eq!(
        done_after_sums(client, owner, local),
        node(client) != node(owner) && client % l == owner % l
    );

    // When the sums go, and what a node buffer takes.
    let n = u.int_in_range(0..=8usize)?;
    let mut done = Vec::with_capacity(n);
    for _ in 0..n {
        done.push(if u.ratio(1, 4)? {
            u.arbitrary()?
        } else {
            u.int_in_range(0..=4u64)?
        });
    }
    let stamp: u64 = if u.ratio(1, 4)? {
        u.arbitrary()?
    } else {
        u.int_in_range(0..=4u64)?
    };
    assert_eq!(
        sums_ready(done.iter().copied(), stamp),
        done.iter().position(|&d| d < stamp)
    );
    let (pushed, open): (u64, u64) = (u.arbitrary()?, u.arbitrary()?);
    let want = match pushed {
        p if p == open => Admit::Add,
        p if p > open => Admit::Hold,
        _ => Admit::Stale,
    };
    assert_eq!(admit(pushed, open), want);
    Ok(())
}

// ----- a job under node aggregation ---------------------------------------------------------------------------

/// A chunk in a landing slot: the owner it is for when it goes into a node
/// buffer, its minibatch, its value.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    owner: Option<usize>,
    k: u64,
    value: u64,
}

/// Where a rank's worker is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Pushing minibatch `k`'s chunk for owner `next`.
    Push {
        k: u64,
        next: usize,
    },
    /// Waiting for its chunks' acknowledgements, then telling its node.
    Acked {
        k: u64,
    },
    /// Waiting for its node-mates' done words, then pushing its sums.
    Sums {
        k: u64,
    },
    /// Waiting for the sums' acknowledgements, then telling its replicas.
    SumsAcked {
        k: u64,
    },
    /// Waiting for the done words that feed its gradients.
    Final {
        k: u64,
    },
    Done,
}

const MINIBATCHES: u64 = 2;

/// Client `c`'s gradient for owner `o` in minibatch `k` (distinct sums
/// catch a chunk counted twice, dropped or counted in the wrong minibatch).
fn grad(k: u64, c: usize, o: usize) -> u64 {
    1 + k * 1000 + (c as u64) * 31 + o as u64 * 7
}

struct Job {
    local: usize,
    world: usize,
    /// Landing slots, `[server][client]`, in push order.
    slots: Vec<Vec<VecDeque<Chunk>>>,
    /// Each rank's accumulator and the minibatch it takes.
    acc: Vec<u64>,
    acc_open: Vec<u64>,
    /// Each rank's node buffers, by owner, and the minibatch they take.
    buf: Vec<Vec<u64>>,
    buf_open: Vec<u64>,
    /// `done[reader][writer]`: the done word `writer` wrote into `reader`.
    done: Vec<Vec<u64>>,
    phase: Vec<Phase>,
}

impl Job {
    fn node(&self, r: usize) -> usize {
        r / self.local
    }

    /// Whether any chunk `c` pushed (of minibatch `k`) is still in a slot.
    fn pending(&self, c: usize) -> bool {
        self.slots.iter().any(|s| !s[c].is_empty())
    }

    /// One step of rank `r`'s worker (nothing while it waits).
    fn worker(&mut self, r: usize) {
        let (g, world) = (self.local, self.world);
        self.phase[r] = match self.phase[r] {
            Phase::Push { k, next } if next == world => Phase::Acked { k },
            Phase::Push { k, next: o } => {
                let s = server(r, o, g);
                let owner = (self.node(r) != self.node(o)).then_some(o);
                self.slots[s][r].push_back(Chunk {
                    owner,
                    k,
                    value: grad(k, r, o),
                });
                Phase::Push { k, next: o + 1 }
            }
            Phase::Acked { k } if !self.pending(r) => {
                // Its node hears done at once.
                let first = self.node(r) * g;
                for m in first..first + g {
                    self.done[m][r] = k + 1;
                }
                Phase::Sums { k }
            }
            Phase::Sums { k } => {
                let first = self.node(r) * g;
                match sums_ready(self.done[r][first..first + g].iter().copied(), k + 1) {
                    Some(_) => Phase::Sums { k },
                    None => {
                        for o in (0..world).filter(|&o| done_after_sums(r, o, g)) {
                            let value = std::mem::take(&mut self.buf[r][o]);
                            self.slots[o][r].push_back(Chunk {
                                owner: None,
                                k,
                                value,
                            });
                        }
                        Phase::SumsAcked { k }
                    }
                }
            }
            Phase::SumsAcked { k } if !self.pending(r) => {
                // The buffers are pushed and cleared: open for k + 1; the
                // replicas hear done after their sums.
                self.buf_open[r] = k + 1;
                for o in (0..world).filter(|&o| done_after_sums(r, o, g)) {
                    self.done[o][r] = k + 1;
                }
                Phase::Final { k }
            }
            Phase::Final { k } => {
                let fed = (0..world)
                    .filter(|&c| feeds(r, c, g))
                    .all(|c| self.done[r][c] > k);
                if !fed {
                    return;
                }
                let want: u64 = (0..world).map(|c| grad(k, c, r)).sum();
                assert_eq!(
                    self.acc[r], want,
                    "rank {r}'s gradients of minibatch {k} read as final"
                );
                self.acc[r] = 0;
                self.acc_open[r] = k + 1;
                if k + 1 == MINIBATCHES {
                    Phase::Done
                } else {
                    Phase::Push { k: k + 1, next: 0 }
                }
            }
            p => p,
        };
    }

    /// One step of rank `s`'s daemon: the oldest chunk of client `c`'s
    /// slot, added when its accumulator or node buffer takes it.
    fn daemon(&mut self, s: usize, c: usize) {
        let Some(&chunk) = self.slots[s][c].front() else {
            return;
        };
        let nodes = self.world / self.local;
        let open = match chunk.owner {
            Some(o) => {
                assert!(
                    aggregates(s, c, o, nodes, self.local),
                    "rank {s} refused rank {c}'s chunk for {o}, which the route sent it"
                );
                self.buf_open[s]
            }
            None => self.acc_open[s],
        };
        match admit(chunk.k, open) {
            Admit::Hold => return,
            Admit::Stale => panic!("{chunk:?} from {c} at rank {s}, open for {open}"),
            Admit::Add => {}
        }
        match chunk.owner {
            Some(o) => self.buf[s][o] += chunk.value,
            None => self.acc[s] += chunk.value,
        }
        self.slots[s][c].pop_front();
    }
}

/// Up to 3 nodes of up to 3 ranks, each pushing every owner a chunk per
/// minibatch through its aggregators, workers and daemons stepping as the
/// input picks.
fn job(u: &mut Unstructured<'_>) -> Result<()> {
    let local = u.int_in_range(1..=3usize)?;
    let nodes = u.int_in_range(1..=3usize)?;
    let world = local * nodes;
    let mut j = Job {
        local,
        world,
        slots: vec![vec![VecDeque::new(); world]; world],
        acc: vec![0; world],
        acc_open: vec![0; world],
        buf: vec![vec![0; world]; world],
        buf_open: vec![0; world],
        done: vec![vec![0; world]; world],
        phase: vec![Phase::Push { k: 0, next: 0 }; world],
    };
    for _ in 0..u.int_in_range(0..=400u16)? {
        let r = u.choose_index(world)?;
        if u.arbitrary()? {
            j.worker(r);
        } else {
            let c = u.choose_index(world)?;
            j.daemon(r, c);
        }
    }
    // Every rank finishes once each worker and daemon gets its turns.
    for _ in 0..2000 {
        if j.phase.iter().all(|p| *p == Phase::Done) {
            assert!((0..world).all(|r| !j.pending(r)));
            return Ok(());
        }
        for r in 0..world {
            j.worker(r);
            for c in 0..world {
                j.daemon(r, c);
            }
        }
    }
    panic!("stuck: {:?}", j.phase);
}
