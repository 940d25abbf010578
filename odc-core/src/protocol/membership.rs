//! Elastic hybrid sharding: which nodes' replicas a minibatch's cross-node
//! sum counts, when a node dies or joins. The rule only; the engine drives
//! it through [`crate::elastic::Rounds`] (the module's tests follow the
//! same procedure a rank does). Joining is in the rule but not driven yet.
//!
//! Under `sharding="hybrid"` every node holds a whole replica, and at the
//! end of minibatch `k` each rank sums its shard's partial sums over the
//! member nodes ([`super::partials`]). A member dying during that sum must
//! leave every survivor with the same answer to "did `k` count its
//! partials?", or the replicas diverge: one survivor would step with the
//! dead node's gradients and another without them.
//!
//! The answer is one **round** per `(minibatch k, epoch e)` in the job's
//! store, decided once ([`crate::elastic::Rounds`] keeps it), over the
//! members `M` of that epoch (epoch 0: the members the previous minibatch
//! committed):
//!
//! - a rank that has read every member's partials for its shard **reads
//!   in** ([`on_read`]): the round counts it; the `|M| × G`-th read
//!   **commits** the round, so a committed round's partials were read in
//!   full by every rank of every member;
//! - a rank that learns of a member's death while the round is open
//!   **voids** it ([`on_death`]): the round names the dead node, and the
//!   same minibatch runs again as epoch `e + 1` over `M` less that node.
//!   A death learnt once the round committed counts from the next
//!   minibatch (the dead node's partials are in every survivor's sum); one
//!   learnt in a voided round is handled at the next epoch;
//! - a restarted node **asks to join** an open round ([`on_join`]); a
//!   committed round's joiners are members from the next minibatch, and a
//!   voided round forgets them (they ask again). The engine commits a
//!   later epoch (a minibatch that dropped a node) without joiners: the
//!   loop may continue that minibatch before its step (a rerun), which a
//!   node admitted from the next minibatch would start in the middle of.
//!
//! A round is decided once (committed or void) and never changes after:
//! every rank that reads it decided reads the same outcome, and the next
//! epoch's or minibatch's members follow from it alone ([`next_members`]).
//! A rank waits on an open round until it is decided, voiding it itself if
//! a member it waits for is dead, so a death anywhere in the minibatch ends
//! every survivor's wait.
//!
//! Nodes are bits of a `u64`: at most [`MAX_NODES`].

use std::fmt;

/// Most nodes a round tracks (the bits of a node set).
pub const MAX_NODES: usize = 64;

/// A set of nodes, one bit per node index.
pub type Nodes = u64;

/// The bit of node `n` (`n < MAX_NODES`).
pub fn node(n: usize) -> Nodes {
    debug_assert!(n < MAX_NODES);
    1 << n
}

/// Every one of `nodes` nodes (at most [`MAX_NODES`]).
pub fn all_nodes(nodes: usize) -> Nodes {
    if nodes >= MAX_NODES {
        u64::MAX
    } else {
        (1u64 << nodes) - 1
    }
}

/// One round's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Round {
    /// Collecting reads: `read` ranks read in so far; `joining` asked to
    /// join from the next minibatch.
    Open {
        /// Ranks that read in.
        read: u32,
        /// Nodes asking to join.
        joining: Nodes,
    },
    /// Every rank of every member read in: the sum counts every member.
    Committed {
        /// Members from the next minibatch on, besides these.
        joining: Nodes,
    },
    /// A member died first: the minibatch runs again without `dead`.
    Void {
        /// The node whose death voided the round.
        dead: Nodes,
    },
}

/// A round no rank has written yet.
pub const FRESH: Round = Round::Open {
    read: 0,
    joining: 0,
};

/// What a rank does after looking at the round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Swap this value in for the one looked at (look again on a lost swap).
    Write(Round),
    /// Nothing to write: the round is decided (or, for a reader, already
    /// counts it); wait for [`outcome`].
    Wait,
}

/// A decided round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The sum counts every member; `joining` are members from the next
    /// minibatch.
    Committed {
        /// The joiners.
        joining: Nodes,
    },
    /// The minibatch runs again without `dead`.
    Void {
        /// The dead node.
        dead: Nodes,
    },
}

/// How a round failed to decode or a call was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundError(pub String);

impl fmt::Display for RoundError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RoundError {}

/// Ranks that must read in for a round over `members` of `per_node` ranks
/// each.
pub fn total(members: Nodes, per_node: u32) -> u32 {
    members.count_ones() * per_node
}

/// A rank read every member's partials: counted in, the last one commits.
/// `total` from [`total`].
pub fn on_read(cur: Round, total: u32) -> Next {
    match cur {
        // (A count read from the store may be any u32: no overflow.)
        Round::Open { read, joining } if read.saturating_add(1) >= total => {
            Next::Write(Round::Committed { joining })
        }
        Round::Open { read, joining } => Next::Write(Round::Open {
            read: read + 1,
            joining,
        }),
        // Voided before this read: the read does not count (the minibatch
        // runs again); committed without it cannot be (it was not counted).
        Round::Committed { .. } | Round::Void { .. } => Next::Wait,
    }
}

/// A rank learnt that `dead` (a member) died: an open round is voided
/// naming it; a decided one is left as it is.
pub fn on_death(cur: Round, dead: usize) -> Next {
    match cur {
        Round::Open { .. } => Next::Write(Round::Void { dead: node(dead) }),
        Round::Committed { .. } | Round::Void { .. } => Next::Wait,
    }
}

/// Node `who` (not a member) asks to join from the next minibatch: an open
/// round records it; a decided one does not (ask in the next round).
pub fn on_join(cur: Round, who: usize) -> Next {
    match cur {
        Round::Open { read, joining } => Next::Write(Round::Open {
            read,
            joining: joining | node(who),
        }),
        Round::Committed { .. } | Round::Void { .. } => Next::Wait,
    }
}

/// The round's outcome, once decided.
pub fn outcome(cur: Round) -> Option<Outcome> {
    match cur {
        Round::Open { .. } => None,
        Round::Committed { joining } => Some(Outcome::Committed { joining }),
        Round::Void { dead } => Some(Outcome::Void { dead }),
    }
}

/// The members after a decided round over `members`: a committed round's
/// members and joiners (the next minibatch's epoch 0), a voided round's
/// members less the dead (the same minibatch's next epoch).
pub fn next_members(members: Nodes, outcome: Outcome) -> Nodes {
    match outcome {
        Outcome::Committed { joining } => members | joining,
        Outcome::Void { dead } => members & !dead,
    }
}

impl Round {
    /// The store's bytes for this value (ASCII: `open R J`, `commit J`,
    /// `void D`, node sets in hexadecimal).
    pub fn to_bytes(self) -> Vec<u8> {
        match self {
            Round::Open { read, joining } => format!("open {read} {joining:x}"),
            Round::Committed { joining } => format!("commit {joining:x}"),
            Round::Void { dead } => format!("void {dead:x}"),
        }
        .into_bytes()
    }

    /// The value the store's bytes hold; absent bytes are [`FRESH`]. Only
    /// what [`Round::to_bytes`] writes is accepted (decimal and lower-case
    /// hexadecimal without sign or leading zeros, single spaces, a void
    /// naming one node); a refusal names the first field that is wrong
    /// (`kind`, `read`, `joining`, `dead`, `trailing`).
    pub fn from_bytes(b: Option<&[u8]>) -> Result<Round, RoundError> {
        let Some(b) = b else { return Ok(FRESH) };
        let text = std::str::from_utf8(b).map_err(|_| bad(b, "kind", "is not text"))?;
        let mut words = text.split(' ');
        let kind = words.next().unwrap_or_default();
        let mut field = |name: &'static str, radix: u32| {
            words
                .next()
                .and_then(|w| number(w, radix))
                .ok_or_else(|| bad(b, name, "is missing or not a number as written"))
        };
        let r = match kind {
            "open" => Round::Open {
                read: u32::try_from(field("read", 10)?)
                    .map_err(|_| bad(b, "read", "exceeds 32 bits"))?,
                joining: field("joining", 16)?,
            },
            "commit" => Round::Committed {
                joining: field("joining", 16)?,
            },
            "void" => match field("dead", 16)? {
                dead if dead.count_ones() == 1 => Round::Void { dead },
                _ => return Err(bad(b, "dead", "does not name exactly one node")),
            },
            _ => return Err(bad(b, "kind", "is not open, commit or void")),
        };
        if words.next().is_some() {
            return Err(bad(b, "trailing", "words follow the last field"));
        }
        Ok(r)
    }
}

/// `w` as the writers of rounds and generation records write a number in
/// `radix` (10: `{}`, 16: `{:x}`): digits only (lower case), no sign, no
/// leading zero.
pub fn number(w: &str, radix: u32) -> Option<u64> {
    let digits = w
        .bytes()
        .all(|c| c.is_ascii_digit() || radix == 16 && matches!(c, b'a'..=b'f'));
    let canonical = digits && !w.is_empty() && (w == "0" || !w.starts_with('0'));
    canonical
        .then(|| u64::from_str_radix(w, radix).ok())
        .flatten()
}

fn bad(b: &[u8], field: &str, why: &str) -> RoundError {
    RoundError(format!(
        "membership round: unreadable value {:?}: {field} {why}",
        String::from_utf8_lossy(b)
    ))
}

#[cfg(test)]
mod tests;
