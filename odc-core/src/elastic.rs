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
    /// Nodes a committed round admitted, and the minibatch they join at:
    /// this generation cannot finish that minibatch (the next one can).
    admitted: Mutex<Option<(u64, Nodes)>>,
}

impl Membership {
    /// `members` the member nodes.
    pub(crate) fn new(prefix: String, members: Nodes) -> Membership {
        Membership {
            prefix,
            members: AtomicU64::new(members),
            events: Mutex::new(Vec::new()),
            admitted: Mutex::new(None),
        }
    }

    /// Nodes admitted from minibatch `from` (a committed round's joiners
    /// that are not members).
    pub(crate) fn admit(&self, from: u64, nodes: Nodes) {
        let mut a = self
            .admitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *a = Some((from, a.map_or(0, |(_, n)| n) | nodes));
    }

    /// Forgets an admission whose generation was abandoned
    /// ([`Generation::decide`]): this generation goes on without them.
    pub(crate) fn clear_admitted(&self) {
        *self
            .admitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    /// The nodes admitted so far and the minibatch they join at.
    pub(crate) fn admitted(&self) -> Option<(u64, Nodes)> {
        *self
            .admitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
            Some(raw) => decode(&key, &raw).map(Some),
        }
    }

    /// A counter or node set kept beside the round (absent: 0).
    fn number(&self, key: &str, radix: u32) -> Result<u64> {
        let Some(raw) = self.store.get(key)? else {
            return Ok(0);
        };
        let text = String::from_utf8_lossy(&raw);
        membership::number(text.trim(), radix).ok_or_else(|| Error::Store {
            op: "get",
            key: key.to_owned(),
            detail: format!(
                "membership round: unreadable value {text:?}: {} is not a number as written",
                key.rsplit('/').next().unwrap_or(key)
            ),
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
        decode(&key, &after)
    }

    /// This rank read every member's partials for round `(k, e)` over
    /// `members` of `per_node` ranks each: one atomic add to the round's
    /// read count (O(1) store requests per rank, whatever the world), and
    /// the read that completes the count commits the round, with the
    /// joiners so far (none after a void: epoch 0 only), unless a void came
    /// first. Returns the decision, or
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
        // A minibatch that dropped a node (a later epoch) admits no one: the
        // loop may run it again before its step (a rerun continues it), and
        // a node admitted there would start in the middle of a step. Its
        // joiners ask the next minibatch.
        let joining = match e {
            0 => self.number(&format!("{key}/joins"), 16)?,
            _ => 0,
        };
        let decided = self.decide(k, e, Round::Committed { joining })?;
        if matches!(decided, Round::Committed { .. }) {
            // Where a joiner starts looking for an open round (a hint: a
            // late write may leave an older minibatch, never a newer one).
            self.store.set(&self.last_key(), k.to_string().as_bytes())?;
        }
        Ok(decided)
    }

    fn last_key(&self) -> String {
        format!("{}/last", self.prefix)
    }

    /// The last committed minibatch written (see [`Rounds::read_in`]).
    pub fn last_committed(&self) -> Result<Option<u64>> {
        let key = self.last_key();
        match self.store.get(&key)? {
            None => Ok(None),
            Some(_) => self.number(&key, 10).map(Some),
        }
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

/// One generation of an elastic job: the engines every member rank built
/// at its start (the job's first, or one after a round admitted nodes).
/// Its keys are under its own store prefix; `{base}/elastic/current` names
/// the current one (absent: the first, under `base`), and
/// `{prefix}/generation` holds `start members joining` (absent: the first
/// generation, every node a member; `start` is `-` for a first generation
/// that started with some nodes only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generation {
    /// The store prefix of its engines.
    pub prefix: String,
    /// The first minibatch it runs (`None`: the job's first generation,
    /// which starts wherever the loop does).
    pub start: Option<u64>,
    /// Its member nodes.
    pub members: Nodes,
    /// The members that joined at its start (none in the first).
    pub joining: Nodes,
}

impl Generation {
    /// The store prefix of the generation admitted at minibatch `start` of
    /// the job under `base`.
    pub fn prefix_at(base: &str, start: u64) -> String {
        format!("{base}/gen/{start}")
    }

    /// The key naming the current generation of the job under `base`.
    fn current_key(base: &str) -> String {
        format!("{base}/elastic/current")
    }

    /// The current generation of the job under `base`, of `nodes` nodes.
    /// Only what [`Generation::begin`], [`Generation::describe_first`] and
    /// [`Generation::restore`] write is accepted: a pointer to `base` or to
    /// `{base}/gen/{start}`, a record there whose start is that one (`-` for
    /// the first generation, under `base`), members a nonempty set of the
    /// job's nodes and joiners among them (none in the first). A refusal is
    /// an [`Error::Store`] naming the key and the field.
    pub fn current(store: &dyn Store, base: &str, nodes: usize) -> Result<Generation> {
        let key = Generation::current_key(base);
        let refuse = |key: &str, text: &str, field: &str, why: &str| Error::Store {
            op: "get",
            key: key.to_owned(),
            detail: format!("elastic generation: unreadable value {text:?}: {field} {why}"),
        };
        let (prefix, at) = match store.get(&key)? {
            None => (base.to_owned(), None),
            Some(p) => {
                let text = String::from_utf8_lossy(&p).into_owned();
                let start = text
                    .strip_prefix(base)
                    .and_then(|r| r.strip_prefix("/gen/"))
                    .and_then(|s| membership::number(s, 10));
                match start {
                    _ if text == base => (text, None),
                    Some(s) => (text, Some(s)),
                    None => {
                        return Err(refuse(
                            &key,
                            &text,
                            "current",
                            &format!("is neither {base:?} nor a generation under {base:?}/gen"),
                        ));
                    }
                }
            }
        };
        let key = format!("{prefix}/generation");
        let Some(raw) = store.get(&key)? else {
            if at.is_some() {
                return Err(refuse(
                    &key,
                    "",
                    "generation",
                    "is missing (begin writes it first)",
                ));
            }
            return Ok(Generation {
                prefix,
                start: None,
                members: membership::all_nodes(nodes),
                joining: 0,
            });
        };
        let text = String::from_utf8_lossy(&raw);
        let bad = |field: &str, why: &str| refuse(&key, &text, field, why);
        let mut w = text.split(' ');
        let first = w.next();
        let mut hex = |field| {
            w.next()
                .and_then(|v| membership::number(v, 16))
                .ok_or_else(|| bad(field, "is missing or not a node set as written"))
        };
        let start = match (first, at) {
            // A first generation that started with some nodes only.
            (Some("-"), None) => None,
            (Some(s), Some(at)) if membership::number(s, 10) == Some(at) => Some(at),
            _ => {
                return Err(bad(
                    "start",
                    &format!("is not {}", at.map_or("-".into(), |s| s.to_string())),
                ));
            }
        };
        let members = hex("members")?;
        if members == 0 || members & !membership::all_nodes(nodes) != 0 {
            return Err(bad(
                "members",
                &format!("is not a nonempty set of the job's {nodes} nodes"),
            ));
        }
        let joining = hex("joining")?;
        if joining & !members != 0 || start.is_none() && joining != 0 {
            return Err(bad(
                "joining",
                "names a node that is not a member (or joins a first generation)",
            ));
        }
        if w.next().is_some() {
            return Err(bad("trailing", "words follow the last field"));
        }
        Ok(Generation {
            prefix,
            start,
            members,
            joining,
        })
    }

    /// The job's first generation, under `prefix`, starts with `members`
    /// only (not every node): says so where joiners look, unless a
    /// generation is described there already (one [`Generation::begin`]
    /// made). Every member rank writes the same.
    pub fn describe_first(store: &dyn Store, prefix: &str, members: Nodes) -> Result<()> {
        let value = format!("- {members:x} 0");
        store.compare_set(&format!("{prefix}/generation"), None, value.as_bytes())?;
        Ok(())
    }

    /// Whether the generation under `prefix` goes ahead: each of its ranks
    /// proposes `go` (it registered) or not (its registration failed, a
    /// rank having died or stalled), by a compare-and-set from absent on
    /// `{prefix}/admission`; the first proposal stands for every rank. An
    /// abandoned generation's members go on in the one before it (which
    /// [`Generation::restore`] makes current again) and its joiners give
    /// up.
    pub fn decide(store: &dyn Store, prefix: &str, go: bool) -> Result<bool> {
        let want: &[u8] = if go { b"go" } else { b"abort" };
        let after = store.compare_set(&format!("{prefix}/admission"), None, want)?;
        Ok(after == b"go")
    }

    /// Whether the generation under `prefix` was abandoned.
    pub fn abandoned(store: &dyn Store, prefix: &str) -> Result<bool> {
        Ok(store.get(&format!("{prefix}/admission"))?.as_deref() == Some(b"abort"))
    }

    /// Makes the generation under `prefix` the current one of the job
    /// under `base` again (after the one that followed it was abandoned).
    pub fn restore(store: &dyn Store, base: &str, prefix: &str) -> Result<()> {
        store.set(&Generation::current_key(base), prefix.as_bytes())
    }

    /// Makes the generation admitted at `start` of the job under `base`
    /// the current one (every member rank of the one before writes the
    /// same values: its description, then the pointer to it).
    pub fn begin(
        store: &dyn Store,
        base: &str,
        start: u64,
        members: Nodes,
        joining: Nodes,
    ) -> Result<Generation> {
        let prefix = Generation::prefix_at(base, start);
        let value = format!("{start} {members:x} {joining:x}");
        store.set(&format!("{prefix}/generation"), value.as_bytes())?;
        store.set(&Generation::current_key(base), prefix.as_bytes())?;
        Ok(Generation {
            prefix,
            start: Some(start),
            members,
            joining,
        })
    }
}

/// Rank `rank`, of node `node` (not a member), restarted: asks the job
/// under `base` (of `nodes` nodes) to admit its node and waits until a
/// generation does, which it returns; its engine then joins that
/// generation with its prefix and members. It asks the first undecided
/// round of the current generation (from the last committed minibatch on;
/// a later generation's engines number minibatches from its start, 0)
/// and waits for it: a round that commits with the node among its joiners
/// admits it from the next minibatch, whose generation the member ranks
/// begin once they stepped; a void forgets it (it asks the next epoch);
/// a round that committed without it asked too late (the next minibatch).
/// Every rank of the node asks alike (the same bit). A
/// [`Error::PeerTimeout`]-like [`Error::Store`] at `deadline`.
pub fn await_admission(
    store: &dyn Store,
    base: &str,
    nodes: usize,
    rank: usize,
    node: usize,
    deadline: Instant,
) -> Result<Generation> {
    let me = membership::node(node);
    let mut nap = Duration::from_millis(1);
    let mut sleep = |what: &str| -> Result<()> {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Store {
                op: "wait",
                key: Generation::current_key(base),
                detail: format!(
                    "node {node} (rank {rank}) was not admitted to the elastic job under {base:?} \
                     before the deadline: {what}"
                ),
            });
        }
        std::thread::sleep(nap.min(deadline - now));
        nap = (nap * 2).min(Duration::from_millis(20));
        Ok(())
    };
    loop {
        let mut generation = Generation::current(store, base, nodes)?;
        let job_key = format!("{}/job_id", generation.prefix);
        let mut job = store.get(&job_key)?;
        if generation.start.is_none() {
            // The first generation: its members are known once it drew its
            // job id (which follows their description of it).
            if job.is_none() {
                sleep("the job has not started")?;
                continue;
            }
            let again = Generation::current(store, base, nodes)?;
            if again.prefix != generation.prefix {
                continue; // a later generation began meanwhile: look at it
            }
            generation = again;
        }
        let registered = |g: &Generation| store.get(&format!("{}/reg/{rank}", g.prefix));
        if generation.members & me != 0 && registered(&generation)?.is_none() {
            return Ok(generation); // it expects this rank
        }
        if job.is_none() {
            job = store.get(&job_key)?;
        }
        let Some(job) = job else {
            sleep("its current generation has not started")?;
            continue;
        };
        let prefix = format!(
            "{}/elastic/{}",
            generation.prefix,
            String::from_utf8_lossy(&job)
        );
        let rounds = Rounds::new(store, &prefix, rank);
        // A later generation's engines count minibatches from its start.
        let Some(mut k) = rounds.last_committed()?.or(generation.start.map(|_| 0)) else {
            sleep("no minibatch of it has ended yet")?;
            continue;
        };
        let mut e = 0u32;
        // The minibatch after `k` (its number in the job's count too): none
        // past the counter's end, where a stored last minibatch or a
        // generation's start no job reaches would lead the walk.
        let start = generation.start.unwrap_or(0);
        let after = |k: u64| {
            (k.checked_add(1))
                .filter(|&n| start.checked_add(n).is_some())
                .ok_or_else(|| Error::Store {
                    op: "get",
                    key: format!("{prefix}/last"),
                    detail: format!(
                        "membership round: minibatch {k} of the generation that starts at {start} \
                         has no next one: the last committed minibatch or the generation's start \
                         is past any a job reaches"
                    ),
                })
        };
        // Walk to the first undecided round and ask it, until the
        // generation changes (its members began the next one).
        loop {
            let r = match rounds.get(k, e)? {
                Round::Open { joining, .. } if joining & me == 0 => rounds.join(k, e, node)?,
                r => r,
            };
            match r {
                Round::Committed { joining } if joining & me != 0 => {
                    // Admitted from k + 1: wait for that generation, unless
                    // it was abandoned (its members went on without it: an
                    // earlier incarnation's admission, or this one's that
                    // failed; ask again).
                    let next = Generation::prefix_at(base, start + after(k)?);
                    if Generation::abandoned(store, &next)? {
                        (k, e) = (after(k)?, 0);
                        continue;
                    }
                    while Generation::current(store, base, nodes)?.prefix == generation.prefix
                        && !Generation::abandoned(store, &next)?
                    {
                        sleep("its members did not begin the generation that admits it")?;
                    }
                    break;
                }
                Round::Committed { .. } => (k, e) = (after(k)?, 0),
                Round::Void { .. } => e += 1,
                Round::Open { .. } => {
                    if Generation::current(store, base, nodes)?.prefix != generation.prefix {
                        break;
                    }
                    sleep(&format!("minibatch {k}'s round (epoch {e}) is still open"))?;
                }
            }
        }
    }
}

/// The decision a round's key holds (`commit J` or `void D`, then
/// ` @{rank}`, the rank that wrote it), its writer's tag dropped. An open
/// round (never a decision) or a value without a rank's tag is refused,
/// naming the key and the field.
pub(crate) fn decode(key: &str, raw: &[u8]) -> Result<Round> {
    let refuse = |detail: String| Error::Store {
        op: "get",
        key: key.to_owned(),
        detail,
    };
    let text = || String::from_utf8_lossy(raw);
    let body = match raw.iter().rposition(|&c| c == b'@') {
        Some(at) if at > 0 && raw[at - 1] == b' ' => {
            let tag = std::str::from_utf8(&raw[at + 1..]).ok();
            if tag.and_then(|t| membership::number(t, 10)).is_none() {
                return Err(refuse(format!(
                    "membership round: unreadable value {:?}: writer is not a rank",
                    text()
                )));
            }
            &raw[..at - 1]
        }
        _ => {
            return Err(refuse(format!(
                "membership round: unreadable value {:?}: writer is missing (\" @rank\")",
                text()
            )));
        }
    };
    let r = Round::from_bytes(Some(body)).map_err(|e| refuse(e.to_string()))?;
    if membership::outcome(r).is_none() {
        return Err(refuse(format!(
            "membership round: unreadable value {:?}: kind is open, which is never a decision",
            text()
        )));
    }
    Ok(r)
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

    /// A restarted node 2 of 3 (`per_node` 1) asks while the members `0b011` run minibatches from 5 on; the
    /// members read in to each round and, once one admits the joiner, begin the next generation. Returns
    /// the generation the joiner got and the minibatch that admitted it.
    fn admit_while_running(stale_member: bool) -> (Generation, u64) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        store.set("job/job_id", b"j0").unwrap();
        store.set("job/reg/2", b"{}").unwrap(); // the dead incarnation registered
        let joiner = {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                await_admission(&*store, "job", 3, 2, 2, deadline).unwrap()
            })
        };
        let rounds = Rounds::new(&*store, "job/elastic/j0", 0);
        // Members 0 and 1 (and, stale, node 2 whose ranks are dead) run minibatches until one admits node 2.
        let mut members: Nodes = if stale_member { 0b111 } else { 0b011 };
        for k in 5.. {
            std::thread::sleep(Duration::from_millis(20)); // the minibatch's work
            let mut e = 0;
            let outcome = loop {
                if members & node(2) != 0 {
                    // Node 2's ranks never read in: a member's probe finds them dead.
                    rounds.void(k, e, 2).unwrap();
                    members &= !node(2);
                    e += 1;
                    continue;
                }
                for _ in 0..2 {
                    rounds.read_in(k, e, members, 1).unwrap();
                }
                break rounds.get(k, e).unwrap();
            };
            if let Round::Committed { joining } = outcome {
                if joining & node(2) != 0 {
                    Generation::begin(&*store, "job", k + 1, members | joining, joining).unwrap();
                    return (joiner.join().unwrap(), k);
                }
            }
            assert!(k < 200, "no round admitted the joiner");
        }
        unreachable!()
    }

    #[test]
    fn a_restarted_node_is_admitted_by_the_round_it_asked_and_gets_the_generation_after_it() {
        let (g, k) = admit_while_running(false);
        assert_eq!(g.prefix, format!("job/gen/{}", k + 1));
        assert_eq!(
            (g.start, g.members, g.joining),
            (Some(k + 1), 0b111, node(2))
        );
    }

    #[test]
    fn a_restarted_node_still_counted_a_member_is_admitted_after_the_void_that_drops_it() {
        let (g, k) = admit_while_running(true);
        assert_eq!((g.members, g.joining), (0b111, node(2)));
        assert!(k > 5, "admitted by minibatch 5, which dropped its node");
    }

    #[test]
    fn a_minibatch_that_dropped_a_node_admits_no_one_and_its_joiner_asks_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        let rounds = Rounds::new(&*store, "job/elastic/j0", 0);
        // Minibatch 3: node 2 dies (epoch 0 void), node 3 asks to join epoch 1; the survivors commit epoch 1
        // without it (the loop may rerun minibatch 3 before its step).
        rounds.void(3, 0, 2).unwrap();
        rounds.join(3, 1, 3).unwrap();
        rounds.read_in(3, 1, 0b011, 1).unwrap();
        assert_eq!(
            rounds.read_in(3, 1, 0b011, 1).unwrap(),
            Round::Committed { joining: 0 }
        );
        // Minibatch 4 (epoch 0) admits it.
        rounds.join(4, 0, 3).unwrap();
        rounds.read_in(4, 0, 0b011, 1).unwrap();
        assert_eq!(
            rounds.read_in(4, 0, 0b011, 1).unwrap(),
            Round::Committed { joining: node(3) }
        );
    }

    #[test]
    fn an_admission_whose_generation_was_abandoned_is_skipped_and_the_joiner_asks_the_next_round() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        store.set("job/job_id", b"j0").unwrap();
        store.set("job/reg/2", b"{}").unwrap();
        let rounds = Rounds::new(&*store, "job/elastic/j0", 0);
        // Minibatch 3 admitted node 2 from 4, but generation job/gen/4 was abandoned.
        rounds.join(3, 0, 2).unwrap();
        rounds.read_in(3, 0, 0b011, 1).unwrap();
        rounds.read_in(3, 0, 0b011, 1).unwrap();
        assert!(Generation::begin(&*store, "job", 4, 0b111, 0b100).is_ok());
        assert!(!Generation::decide(&*store, "job/gen/4", false).unwrap());
        assert!(
            !Generation::decide(&*store, "job/gen/4", true).unwrap(),
            "the first decision stands"
        );
        Generation::restore(&*store, "job", "job").unwrap();
        let joiner = {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                await_admission(&*store, "job", 3, 2, 2, deadline).unwrap()
            })
        };
        // It asks minibatch 4's round, which admits it from 5.
        let give_up = Instant::now() + Duration::from_secs(10);
        while rounds.get(4, 0).unwrap() == FRESH {
            assert!(
                Instant::now() < give_up,
                "the joiner did not ask minibatch 4's round"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        rounds.read_in(4, 0, 0b011, 1).unwrap();
        assert_eq!(
            rounds.read_in(4, 0, 0b011, 1).unwrap(),
            Round::Committed { joining: node(2) }
        );
        Generation::begin(&*store, "job", 5, 0b111, 0b100).unwrap();
        assert_eq!(joiner.join().unwrap().prefix, "job/gen/5");
    }

    #[test]
    fn a_node_outside_a_first_generation_of_some_nodes_asks_a_round_instead_of_registering_there() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        // Node 0 of 2 starts the job alone (as Core::new writes it: the description, then the job id).
        Generation::describe_first(&*store, "job", 0b01).unwrap();
        store.set("job/job_id", b"j0").unwrap();
        let rounds = Rounds::new(&*store, "job/elastic/j0", 0);
        assert_eq!(
            rounds.read_in(0, 0, 0b01, 1).unwrap(),
            Round::Committed { joining: 0 }
        );
        let joiner = {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                await_admission(&*store, "job", 2, 1, 1, deadline).unwrap()
            })
        };
        let give_up = Instant::now() + Duration::from_secs(10);
        while rounds.get(1, 0).unwrap() == FRESH {
            assert!(
                Instant::now() < give_up,
                "node 1 did not ask minibatch 1's round"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            rounds.read_in(1, 0, 0b01, 1).unwrap(),
            Round::Committed { joining: node(1) }
        );
        Generation::begin(&*store, "job", 2, 0b11, 0b10).unwrap();
        let g = joiner.join().unwrap();
        assert_eq!(
            (g.prefix.as_str(), g.start, g.members),
            ("job/gen/2", Some(2), 0b11)
        );
    }

    #[test]
    fn a_joiner_waits_for_a_generation_that_expects_it_and_times_out_naming_itself() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path()).unwrap();
        // The current generation lists node 1 and waits for its rank 1's registration: join it at once.
        Generation::begin(&store, "job", 7, 0b11, 0b10).unwrap();
        let g = await_admission(&store, "job", 2, 1, 1, Instant::now()).unwrap();
        assert_eq!((g.prefix.as_str(), g.start), ("job/gen/7", Some(7)));
        // Once rank 1 registered there (and died), it must ask a round: none runs, so the deadline names it.
        store.set("job/gen/7/reg/1", b"{}").unwrap();
        store.set("job/gen/7/job_id", b"j1").unwrap();
        let deadline = Instant::now() + Duration::from_millis(200);
        let e = await_admission(&store, "job", 2, 1, 1, deadline)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("node 1 (rank 1) was not admitted") && e.contains("minibatch 0's round"),
            "{e}"
        );
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

    #[test]
    fn an_open_round_in_a_decision_key_is_refused_and_leave_returns() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileStore::new(dir.path()).unwrap());
        // Never written by a rank (a decision is commit or void), so nothing
        // could decide the round: `leave` voided it again and again.
        store.set("job/round/4/0", b"open 0 0 @1").unwrap();
        let left = {
            let store = Arc::clone(&store);
            std::thread::spawn(move || Rounds::new(&*store, "job", 0).leave(4, 0b11, 1))
        };
        let give_up = Instant::now() + Duration::from_secs(10);
        while !left.is_finished() {
            assert!(
                Instant::now() < give_up,
                "leave still loops on an open decision"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let e = left.join().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("job/round/4/0") && e.contains("kind is open"),
            "{e}"
        );
        for (bad, field) in [
            (&b"commit 1"[..], "writer"),
            (b"commit 1 @x", "writer"),
            (b"void 3 @0", "dead"),
        ] {
            store.set("job/round/5/0", bad).unwrap();
            let e = Rounds::new(&*store, "job", 0)
                .get(5, 0)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("job/round/5/0") && e.contains(field),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn a_generation_record_is_read_only_as_written_and_a_refusal_names_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path()).unwrap();
        let g = Generation::begin(&store, "job", 7, 0b11, 0b10).unwrap();
        assert_eq!(Generation::current(&store, "job", 2).unwrap(), g);
        for (key, value, field) in [
            ("job/gen/7/generation", &b"7 3 2 junk"[..], "trailing"),
            ("job/gen/7/generation", b"+7 3 2", "start"),
            ("job/gen/7/generation", b"8 3 2", "start"),
            ("job/gen/7/generation", b"7 7 2", "members"), // node 2 of a 2-node job
            ("job/gen/7/generation", b"7 0 0", "members"),
            ("job/gen/7/generation", b"7 1 2", "joining"), // a joiner that is no member
            ("job/elastic/current", b"elsewhere", "current"),
        ] {
            Generation::begin(&store, "job", 7, 0b11, 0b10).unwrap();
            store.set(key, value).unwrap();
            let e = Generation::current(&store, "job", 2)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(key) && e.contains(&format!(": {field} ")),
                "{value:?}: {e}"
            );
        }
    }

    #[test]
    fn a_walk_from_the_counters_last_minibatch_is_refused_not_overflowed() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path()).unwrap();
        store.set("job/job_id", b"j0").unwrap();
        store.set("job/reg/0", b"{}").unwrap();
        store
            .set("job/elastic/j0/last", u64::MAX.to_string().as_bytes())
            .unwrap();
        store
            .set(
                &format!("job/elastic/j0/round/{}/0", u64::MAX),
                b"commit 0 @1",
            )
            .unwrap();
        let e = await_admission(&store, "job", 2, 0, 0, Instant::now())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("job/elastic/j0/last") && e.contains("has no next one"),
            "{e}"
        );
    }
}
