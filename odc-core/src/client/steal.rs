//! Work stealing: claims of this rank's own microbatches, requests to steal
//! another rank's, and a look at how many it has left
//! ([`crate::protocol::claims`] has the rules).
//!
//! A rank claims its own work with a compare-and-swap on its claim word. A
//! thief never touches the victim's word: it raises its request word at
//! the victim (a pure signal that rings the victim's server bell) and
//! waits for the grant the victim's daemon raises in return, after its own
//! compare-and-swap on the word. Both are signals every transport carries
//! (a 4-byte immediate names the word, the value rides in its mailbox), so
//! stealing needs no network atomics.

use super::Worker;
use crate::engine::load;
use crate::protocol::claims::{self, Claim, ClaimError, Word};
use crate::region::{Bell, SignalRef};
use crate::sync::Ordering;
use crate::{Error, Result};

impl Worker<'_> {
    /// The shard-group index of global rank `rank`.
    fn group_index(&self, rank: usize, what: &str) -> Result<usize> {
        self.reg
            .groups
            .group
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| {
                Error::Config(format!(
                    "{what}: rank {rank} is not in this rank's shard group {:?} (work is stolen \
                     within the shard group: every rank under full sharding, the node under \
                     hybrid sharding)",
                    self.reg.groups.group
                ))
            })
    }

    /// Claims this rank's next microbatch of minibatch `k` (of `count` in
    /// its list): [`Claim::Got`] with its index, or [`Claim::Empty`] once
    /// the owner and the thieves have claimed them all.
    pub(crate) fn claim_own(&self, k: u64, count: u64) -> Result<Claim> {
        let word = self.reg.word(self.reg.ctrl_layout.claim());
        let mut cur = word.load(Ordering::Acquire);
        loop {
            let (new, claim) = claims::own(cur, k, count).map_err(|e| match e {
                ClaimError::TooLarge => Error::Config(format!(
                    "claim of minibatch {k} with {count} microbatches: at most {} per rank and \
                     minibatch numbers below {}",
                    claims::MAX_COUNT,
                    claims::MAX_MINIBATCH + 1
                )),
                ClaimError::Backwards { k, current } => Error::protocol(
                    None,
                    format!("claim of minibatch {k} after this rank started minibatch {current}"),
                ),
            })?;
            let Some(new) = new else { return Ok(claim) };
            match word.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(claim),
                Err(now) => cur = now,
            }
        }
    }

    /// Asks global rank `victim` for one of its unclaimed microbatches of
    /// minibatch `k` and waits for the answer (its daemon's): the index in
    /// the victim's list, [`Claim::Empty`], or [`Claim::NotYet`] (the
    /// victim has not started `k`).
    pub(crate) fn steal(&self, victim: usize, k: u64) -> Result<Claim> {
        let (core, reg) = (self.core, self.reg);
        let o = self.group_index(victim, "steal")?;
        if o == reg.groups.me {
            return Err(Error::Config(
                "steal from this rank itself: claim its own work with claim_own".into(),
            ));
        }
        if k > claims::MAX_MINIBATCH {
            return Err(Error::Config(format!(
                "steal of minibatch {k}: minibatch numbers below {}",
                claims::MAX_MINIBATCH + 1
            )));
        }
        let lay = &reg.ctrl_layout;
        let seq = reg.steal_seq[o].fetch_add(1, Ordering::AcqRel) + 1;
        let sig = SignalRef {
            offset: lay.steal_req(reg.groups.me),
            bell: Bell::Server,
        };
        core.transport
            .put_signal(
                victim,
                &reg.peer_ctrl[victim],
                0,
                &[],
                sig,
                claims::request(seq, k),
            )
            .map_err(|e| core.attribute(None, e))?;
        let word = reg.word(lay.steal_grant(o));
        core.wait(
            None,
            &|| format!("its answer to a request to steal work of minibatch {k}"),
            || Ok((claims::parse_grant(load(word)).0 < seq).then_some(victim)),
        )?;
        let (got, claim) = claims::parse_grant(load(word));
        if got != seq {
            return Err(Error::protocol(
                None,
                format!(
                    "rank {victim} answered steal request {got}, this rank's latest is {seq} \
                     (one thread of a rank steals from a given rank at a time)"
                ),
            ));
        }
        Ok(claim)
    }

    /// Global rank `rank`'s claim word as it reads now (a one-sided read;
    /// a hint for choosing a victim, not a claim).
    pub(crate) fn claims_of(&self, rank: usize) -> Result<Word> {
        let (core, reg) = (self.core, self.reg);
        let o = self.group_index(rank, "claims_left")?;
        let at = reg.ctrl_layout.claim();
        if o == reg.groups.me {
            return Ok(Word::unpack(load(reg.word(at))));
        }
        let mut buf = [0u8; 8];
        core.transport
            .get(rank, &reg.peer_ctrl[rank], at, &mut buf)
            .map_err(|e| core.attribute(None, e))?;
        Ok(Word::unpack(u64::from_ne_bytes(buf)))
    }
}
