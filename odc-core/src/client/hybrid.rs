//! Hybrid sharding over several nodes: the cross-node sum of the partial
//! gradient sums at the end of a minibatch, and the wait before this rank's
//! accumulators may change again (rules: [`crate::protocol::partials`]).

use std::time::Instant;

use odc_kernels::DType;

use super::Worker;
use crate::elastic::{nodes_of, Event, Membership, Rounds};
use crate::engine::{load, BucketId};
use crate::layout::BucketLayout;
use crate::protocol::compress::QuantCopy;
use crate::protocol::membership::{self, Nodes, Outcome};
use crate::protocol::{partials, pieces};
use crate::region::{Bell, SignalRef};
use crate::sync::Ordering;
use crate::wait::{PeerStatus, LIVENESS_PERIOD};
use crate::{Error, Result};

impl Worker<'_> {
    /// Raises word `offset` of replica `r`'s control region to `stamp` (a
    /// pure signal waking its client bell); a failure goes through the
    /// blame rule.
    fn signal_replica(
        &self,
        r: usize,
        offset: usize,
        stamp: u64,
        bucket: Option<&str>,
    ) -> Result<()> {
        self.raw_signal(r, offset, stamp)
            .map_err(|e| self.core.attribute(bucket, e))
    }

    /// [`Worker::signal_replica`] with the transport's error as it is (an
    /// elastic engine decides first whether the replica's node died).
    fn raw_signal(&self, r: usize, offset: usize, stamp: u64) -> Result<()> {
        let sig = SignalRef {
            offset,
            bell: Bell::Client,
        };
        (self.core.transport).put_signal(r, &self.reg.peer_ctrl[r], 0, &[], sig, stamp)
    }

    /// Hybrid sharding over several nodes, at the end of minibatch `k`:
    /// tells the replicas this rank's partial sums are final, sums every
    /// node's partial sums in node order into `reduced` (reading the others'
    /// accumulators one chunk at a time), and tells the replicas it has
    /// read theirs. An elastic engine sums over the member nodes instead,
    /// and drops a node that died ([`Worker::reduce_elastic`]).
    pub(super) fn reduce_across_nodes(&self, k: u64) -> Result<()> {
        if let Some(m) = &self.core.elastic {
            return self.core.retire_on_failure(self.reduce_elastic(k, m));
        }
        let (core, reg) = (self.core, self.reg);
        let stamp = k.saturating_add(1);
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let signal_all = |offset: usize| -> Result<()> {
            gs.replicas
                .iter()
                .enumerate()
                .filter(|&(n, _)| n != gs.node)
                .try_for_each(|(_, &r)| self.signal_replica(r, offset, stamp, None))
        };
        self.quantise_partials(stamp)?;
        reg.partials_out.fetch_max(stamp, Ordering::AcqRel);
        signal_all(lay.partial_ready(gs.node))?;
        let mut sum = PartialSum::new(self);
        let exact = sum.exact();
        for (n, &r) in gs.replicas.iter().enumerate() {
            if n == gs.node {
                if !exact {
                    sum.add_own()?;
                }
                continue;
            }
            let word = reg.word(lay.partial_ready(n));
            core.wait(
                None,
                &|| format!("its partial gradient sums of minibatch {k} (hybrid sharding)"),
                || Ok((load(word) < stamp).then_some(r)),
            )?;
            if !exact {
                sum.add_replica(r).map_err(|e| core.attribute(None, e))?;
            }
        }
        if exact {
            let nodes: Vec<(usize, usize)> = gs.replicas.iter().copied().enumerate().collect();
            sum.add_exact(&nodes)
                .map_err(|(_, _, e)| core.attribute(None, e))?;
        }
        signal_all(lay.partial_read(gs.node))
    }

    /// Compressed cross-node sums (the engine's `QuantSums`), before
    /// this rank tells the replicas its partial sums of the minibatch
    /// stamped `stamp` are final: quantises its accumulators into its
    /// quantised copies, once per minibatch. With error feedback the
    /// residual is folded into the accumulators first, at the first
    /// quantisation since they were zeroed, and settled from the copies
    /// when they are zeroed ([`Worker::settle_partials`]): a minibatch that
    /// continues the sums (an elastic rerun, several minibatches per step)
    /// quantises everything since the zeroing from the residual it began
    /// with (one push per step: settled after each quantisation, the first
    /// one's error would be carried into the second and the residual lost).
    /// The copies of the last minibatch must have been read first (every
    /// replica read them before the accumulators changed; waited for again
    /// here, for a rank whose accumulators did not). No-op without
    /// compression.
    fn quantise_partials(&self, stamp: u64) -> Result<()> {
        let reg = self.reg;
        let Some(q) = &reg.qsum else {
            return Ok(());
        };
        let mut st =
            (q.state.lock()).map_err(|_| Error::protocol(None, "a cross-node sum panicked"))?;
        if st.quantised >= stamp {
            return Ok(());
        }
        self.wait_partials_read(None)?;
        let kernel = |e: odc_kernels::Error| Error::protocol(None, format!("cross-node sum: {e}"));
        let base = reg.accum.as_ptr();
        let st = &mut *st;
        for (i, b) in reg.buckets.iter().enumerate() {
            if let Some(fb) = &mut st.feedback {
                fb.register(i, b.shard_len()).map_err(kernel)?;
                if !st.folded[i] {
                    let (acc, len) = reg.accum_ptr(i);
                    // SAFETY: bucket `i`'s accumulators (nothing else
                    // touches them now: below).
                    let acc = unsafe { std::slice::from_raw_parts_mut(acc, len) };
                    fb.fold(i, 0, acc).map_err(kernel)?;
                    st.folded[i] = true;
                }
            }
            for (elems, chunk, spec) in q.runs(i, b.block_len()) {
                // SAFETY: the accumulators of bucket `i` and the run's
                // quantised copy lie inside the accumulator region (laid
                // out at registration, disjoint). Every push of the
                // minibatch is added (the done wait), none of the next
                // arrives before this rank publishes again, and every
                // replica read the last copies (above): nothing else reads
                // or writes them now.
                let (src, chunk) = unsafe {
                    (
                        std::slice::from_raw_parts(
                            base.cast::<f32>().add(reg.accum_off[i] + elems.start),
                            elems.len(),
                        ),
                        std::slice::from_raw_parts_mut(base.add(chunk.start), chunk.len()),
                    )
                };
                odc_kernels::cpu::quant::quantise_chunk(spec, src, chunk).map_err(kernel)?;
            }
        }
        st.quantised = stamp;
        Ok(())
    }

    /// Compressed cross-node sums with error feedback, before bucket
    /// `bucket`'s accumulators are zeroed (the sums consumed): keeps what
    /// its last quantised copies did not carry of them (the residual folded
    /// in included) as its residual. The other nodes read those copies
    /// already (the caller waited). No-op otherwise, and for a bucket not
    /// quantised since its last zeroing.
    pub(crate) fn settle_partials(&self, bucket: usize) -> Result<()> {
        let reg = self.reg;
        let Some(q) = &reg.qsum else {
            return Ok(());
        };
        let mut st =
            (q.state.lock()).map_err(|_| Error::protocol(None, "a cross-node sum panicked"))?;
        let st = &mut *st;
        let Some(fb) = st.feedback.as_mut().filter(|_| st.folded[bucket]) else {
            return Ok(());
        };
        let kernel = |e: odc_kernels::Error| Error::protocol(None, format!("cross-node sum: {e}"));
        let base = reg.accum.as_ptr();
        for (elems, chunk, _) in q.runs(bucket, reg.buckets[bucket].block_len()) {
            // SAFETY: as in `quantise_partials`; the accumulators are
            // unchanged since (no push of the next minibatch before they are
            // zeroed and opened) and every replica read the copies.
            let (sent, chunk) = unsafe {
                (
                    std::slice::from_raw_parts(
                        base.cast::<f32>().add(reg.accum_off[bucket] + elems.start),
                        elems.len(),
                    ),
                    std::slice::from_raw_parts(base.add(chunk.start), chunk.len()),
                )
            };
            fb.settle_chunk(bucket, elems.start, sent, chunk)
                .map_err(kernel)?;
        }
        st.folded[bucket] = false;
        Ok(())
    }

    /// Elastic hybrid sharding, at the end of minibatch `k`: sums the
    /// member nodes' partial sums as [`Worker::reduce_across_nodes`] does,
    /// reads in to the minibatch's round ([`Rounds`]) and waits until it is
    /// decided. A member that died (a rank of it gone, a signal or read to
    /// it failed) voids the round; the sum then runs again over the
    /// survivors, as the round's next epoch. Returns once a round
    /// committed, so every rank of every member has read this rank's
    /// accumulators ([`Worker::wait_partials_read`] has nothing to wait
    /// for); [`Error::Dropped`] when a round dropped this rank's node.
    fn reduce_elastic(&self, k: u64, m: &Membership) -> Result<()> {
        let core = self.core;
        let me = self.reg.groups.node;
        let stamp = k.saturating_add(1);
        let rounds = Rounds::new(&*core.store, &m.prefix, core.topo.rank());
        let per_node = u32::try_from(core.topo.local_world())
            .map_err(|_| Error::Config("too many ranks per node".into()))?;
        if let Some((from, nodes)) = m.admitted().filter(|&(from, _)| k >= from) {
            return Err(Error::Config(format!(
                "the membership round of minibatch {} admitted node(s) {:?} from minibatch \
                 {from}: this engine's generation ends there; build the next one (Engine.admit \
                 after the optimizer step) and finish minibatch {k} on it",
                from - 1,
                nodes_of(nodes)
            )));
        }
        let start = Instant::now();
        let (mut members, mut e) = (m.members(), 0u32);
        // The last drop, recorded once the next epoch's round is decided.
        let mut pending: Option<(Event, Instant)> = None;
        self.quantise_partials(stamp)?;
        self.reg.partials_out.fetch_max(stamp, Ordering::AcqRel);
        loop {
            let decided = match self.sum_members(k, e, members, stamp, &rounds)? {
                Some(voided) => voided,
                None => {
                    rounds.read_in(k, e, members, per_node)?;
                    let deadline = Instant::now() + core.config.timeout;
                    let mut probe = Probe::new(self, members);
                    rounds.outcome(k, e, deadline, || probe.dead())?
                }
            };
            if let Some((mut ev, learnt)) = pending.take() {
                ev.recovered_s = learnt.elapsed().as_secs_f64();
                m.record(ev);
            }
            let next = membership::next_members(members, decided);
            match decided {
                Outcome::Committed { joining } => {
                    // Joiners take part from the next generation, which
                    // the loop begins after its step (a member asking to
                    // join is a stale request: ignored).
                    m.set_members(members);
                    if joining & !members != 0 {
                        m.admit(k + 1, joining & !members);
                    }
                    return Ok(());
                }
                Outcome::Void { dead } if dead & membership::node(me) != 0 => {
                    return Err(Error::Dropped {
                        node: me,
                        minibatch: k,
                    });
                }
                Outcome::Void { dead } => {
                    // This node's ranks stop waiting on the dropped ranks
                    // (a post to a killed host may stall for seconds).
                    core.transport.report_dropped(dead);
                    let learnt = Instant::now();
                    let ev = Event {
                        minibatch: k,
                        epoch: e,
                        node: dead.trailing_zeros() as usize,
                        members: nodes_of(next),
                        detected_s: (learnt - start).as_secs_f64(),
                        recovered_s: 0.0,
                    };
                    pending = Some((ev, learnt));
                    (members, e) = (next, e + 1);
                }
            }
        }
    }

    /// One epoch's sum over `members` into `reduced`: `None` when every
    /// member's partial sums are in, the round's outcome when it was
    /// decided (voided) first, by this rank or another.
    fn sum_members(
        &self,
        k: u64,
        e: u32,
        members: Nodes,
        stamp: u64,
        rounds: &Rounds<'_>,
    ) -> Result<Option<Outcome>> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let others = || {
            (gs.replicas.iter().enumerate())
                .filter(move |&(n, _)| n != gs.node && members & membership::node(n) != 0)
                .map(|(n, &r)| (n, r))
        };
        for (n, r) in others() {
            if let Err(err) = self.raw_signal(r, lay.partial_ready(gs.node), stamp) {
                return self.on_failure(err, r, n, (k, e), rounds).map(Some);
            }
        }
        // In node order, this rank's own partials at its place: replicas
        // add the same numbers in the same order (bitwise-equal sums).
        let mut sum = PartialSum::new(self);
        let exact = sum.exact();
        let nodes: Vec<(usize, usize)> = (gs.replicas.iter().enumerate())
            .filter(|&(n, _)| members & membership::node(n) != 0)
            .map(|(n, &r)| (n, r))
            .collect();
        for &(n, r) in &nodes {
            if n == gs.node {
                if !exact {
                    sum.add_own()?;
                }
                continue;
            }
            let word = reg.word(lay.partial_ready(n));
            if let Some(o) = self.await_signal(word, stamp, r, members, (k, e), rounds)? {
                return Ok(Some(o));
            }
            if exact {
                continue;
            }
            if let Err(err) = sum.add_replica(r) {
                return self.on_failure(err, r, n, (k, e), rounds).map(Some);
            }
        }
        if exact {
            if let Err((n, r, err)) = sum.add_exact(&nodes) {
                if n == gs.node {
                    return Err(err);
                }
                return self.on_failure(err, r, n, (k, e), rounds).map(Some);
            }
        }
        Ok(None)
    }

    /// Waits until `word` reaches `stamp` (replica `r`'s signal): `None`
    /// then; round `(k, e)`'s outcome when a member's death or another rank
    /// decided it first (looked at every [`LIVENESS_PERIOD`]).
    fn await_signal(
        &self,
        word: &crate::sync::AtomicU64,
        stamp: u64,
        r: usize,
        members: Nodes,
        (k, e): (u64, u32),
        rounds: &Rounds<'_>,
    ) -> Result<Option<Outcome>> {
        let bells = &*self.core.transport;
        let start = Instant::now();
        let deadline = start + self.core.config.timeout;
        let mut probe = Probe::new(self, members);
        loop {
            let epoch = bells.bell_epoch(Bell::Client);
            if load(word) >= stamp {
                return Ok(None);
            }
            if probe.due() {
                if let Some(d) = probe.scan() {
                    return void(rounds, (k, e), d).map(Some);
                }
                if let Some(o) = rounds.decision(k, e)?.and_then(membership::outcome) {
                    return Ok(Some(o));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                bells.set_blame(r);
                return Err(Error::PeerTimeout {
                    peer: r,
                    bucket: None,
                    waited_for: format!(
                        "its partial gradient sums of minibatch {k} (elastic hybrid sharding)"
                    ),
                    after: now - start,
                });
            }
            bells.bell_wait(Bell::Client, epoch, LIVENESS_PERIOD.min(deadline - now))?;
        }
    }

    /// A signal to or a read from replica `r` (node `n`) failed with `err`:
    /// voids round `(k, e)` naming `n` if `r` is gone, else `err`.
    fn on_failure(
        &self,
        err: Error,
        r: usize,
        n: usize,
        (k, e): (u64, u32),
        rounds: &Rounds<'_>,
    ) -> Result<Outcome> {
        match self.core.transport.peer_status(r) {
            PeerStatus::Alive => Err(self.core.attribute(None, err)),
            PeerStatus::Dead { .. } | PeerStatus::Reported { .. } => void(rounds, (k, e), n),
        }
    }

    /// Hybrid-zero, in the publish of `stamp` (a version + 1) of `bucket`,
    /// after this rank wrote its own piece: tells the replicas its piece
    /// holds `stamp`, then, for every other node, waits until that node's
    /// piece holds `stamp` too, copies it into this rank's node shard (a
    /// one-sided read) and tells that node it did. The node shard is whole
    /// when this returns, before the publish announces it to the node.
    pub(super) fn gather_pieces(
        &self,
        b: &BucketLayout,
        bucket: BucketId,
        stamp: u64,
    ) -> Result<()> {
        let (core, reg) = (self.core, self.reg);
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let signal =
            |r: usize, offset: usize| self.signal_replica(r, offset, stamp, Some(b.name()));
        for (n, &r) in gs.replicas.iter().enumerate() {
            if n != gs.node {
                signal(r, lay.piece_version(gs.node, bucket.0))?;
            }
        }
        let bytes = b.block_bytes();
        for (m, &r) in gs.replicas.iter().enumerate() {
            if m == gs.node {
                continue;
            }
            let word = reg.word(lay.piece_version(m, bucket.0));
            core.wait(
                Some(b.name()),
                &|| format!("its piece of version {} (hybrid-zero)", stamp - 1),
                || match pieces::piece(load(word), stamp) {
                    Err(pieces::Ahead { current }) => Err(Error::protocol(
                        Some(b.name()),
                        format!(
                            "rank {r} published version {} of its piece while this rank publishes \
                             version {}: under hybrid-zero every rank publishes the same versions \
                             of every bucket, in the same order",
                            current - 1,
                            stamp - 1
                        ),
                    )),
                    Ok(p) => Ok((p == pieces::Piece::Pending).then_some(r)),
                },
            )?;
            let at = reg.params_off[bucket.0] + m * bytes;
            // SAFETY: block m of this rank's shard lies inside its params
            // region; no local reader reads it (every one released the last
            // version, and this version is announced only after this call),
            // and only this publish (under the publish lock) writes it.
            let dst = unsafe { std::slice::from_raw_parts_mut(reg.params.as_ptr().add(at), bytes) };
            let read = match &reg.quant {
                // Compressed: node m's copy of its piece, dequantised here.
                Some(q) => self.read_piece_copy(q, (b, bucket.0), r, dst)?,
                None => {
                    core.transport
                        .get(r, &reg.peer_params[r], at, dst)
                        .map_err(|e| core.attribute(Some(b.name()), e))?;
                    bytes
                }
            };
            (reg.read_across).fetch_add(read as u64, Ordering::Relaxed);
            signal(r, lay.piece_read(gs.node, bucket.0))?;
        }
        Ok(())
    }

    /// Hybrid-zero with compressed gathers: reads replica `r`'s quantised
    /// copy of its piece of bucket `b` (at the copy's offset in every
    /// rank's params region) into a staging buffer and dequantises it into
    /// `dst` (that piece's block of this rank's node shard, in the bucket's
    /// dtype); returns the bytes read.
    fn read_piece_copy(
        &self,
        q: &crate::engine::Quant,
        (b, bucket): (&crate::layout::BucketLayout, usize),
        r: usize,
        dst: &mut [u8],
    ) -> Result<usize> {
        let core = self.core;
        let copy = q.copies[bucket];
        let len = copy.len();
        let mut buf = q.take(len);
        let read = (|| {
            // SAFETY: `take` gave at least `len` bytes, this call's alone.
            let stage =
                unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u8>(), len) };
            // Every rank's copy of its piece lies at the same offset.
            core.transport
                .get(r, &self.reg.peer_params[r], q.off[bucket], stage)
                .map_err(|e| core.attribute(Some(b.name()), e))?;
            // SAFETY: the staging buffer holds the copy's `len` bytes
            // (8-aligned), `dst` the piece's `block_len` elements of the
            // bucket's dtype; both are this call's alone.
            unsafe {
                super::quantised::dequantise_copy(
                    &super::host::HostPath { core },
                    &copy,
                    (stage.as_ptr() as u64, b.block_len()),
                    dst.as_mut_ptr() as u64,
                    b.dtype(),
                )
            }
            .map_err(|e| core.attribute(Some(b.name()), e))
        })();
        q.put_back(buf);
        read.map(|()| len)
    }

    /// Hybrid-zero, before a publish overwrites this rank's piece of
    /// `bucket`: waits until every other node copied the version it holds
    /// (`seen`, a version + 1; 0 before the first publish).
    pub(super) fn wait_pieces_read(
        &self,
        b: &BucketLayout,
        bucket: BucketId,
        seen: u64,
    ) -> Result<()> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        if seen == 0 {
            return Ok(()); // nothing published yet
        }
        self.core.wait(
            Some(b.name()),
            &|| {
                format!(
                    "the other nodes to copy this rank's piece of version {}",
                    seen - 1
                )
            },
            || {
                let words =
                    (0..gs.replicas.len()).map(|n| load(reg.word(lay.piece_read(n, bucket.0))));
                Ok(pieces::unread(words, gs.node, seen).map(|n| gs.replicas[n]))
            },
        )
    }

    /// Hybrid sharding over several nodes: waits until every replica has
    /// read this rank's partial sums of the last finished minibatch, so the
    /// accumulators may change. Returns at once otherwise.
    pub(crate) fn wait_partials_read(&self, bucket: Option<&str>) -> Result<()> {
        let reg = self.reg;
        let stamp = load(&reg.partials_out);
        // Elastic: the minibatch's committed round says every member read
        // them (and a dropped node's ranks are not waited for).
        if !reg.cross_node() || stamp == 0 || self.core.elastic.is_some() {
            return Ok(());
        }
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        self.core.wait(
            bucket,
            &|| {
                format!(
                    "the other nodes to read this rank's partial sums of minibatch {}",
                    stamp - 1
                )
            },
            || {
                let words = (0..gs.replicas.len()).map(|n| load(reg.word(lay.partial_read(n))));
                Ok(partials::lagging_replica(words, gs.node, stamp).map(|n| gs.replicas[n]))
            },
        )
    }
}

/// Voids round `(k, e)` naming node `n` (a member that died); the round's
/// outcome (an earlier void stands).
fn void(rounds: &Rounds<'_>, (k, e): (u64, u32), n: usize) -> Result<Outcome> {
    let r = rounds.void(k, e, n)?;
    membership::outcome(r).ok_or_else(|| {
        Error::protocol(
            None,
            format!("membership round {k}/{e} still open after a void ({r:?})"),
        )
    })
}

/// Liveness of every rank of the member nodes but this one, looked at
/// once per [`LIVENESS_PERIOD`].
struct Probe<'w, 'a> {
    w: &'w Worker<'a>,
    members: Nodes,
    next: Instant,
    remote_after: Instant,
}

/// How long a wait of an elastic round looks at this node's ranks alone
/// before it probes the other nodes' too: long enough for a dead rank's
/// node-mates (who see the death at once) to void the round, so a network
/// probe is only for a node that died whole.
const REMOTE_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

impl<'w, 'a> Probe<'w, 'a> {
    fn new(w: &'w Worker<'a>, members: Nodes) -> Probe<'w, 'a> {
        let now = Instant::now();
        Probe {
            w,
            members,
            next: now,
            remote_after: now + REMOTE_GRACE,
        }
    }

    /// Whether a period passed since the last look (the first call: yes).
    fn due(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        self.next = now + LIVENESS_PERIOD;
        true
    }

    /// The first member node with a rank that is gone: this node's ranks
    /// from the start, the other nodes' only after [`REMOTE_GRACE`] (a
    /// network probe of a killed peer may block for seconds, while a death
    /// the dead rank's node-mates saw voids the round within a poll).
    fn scan(&self) -> Option<usize> {
        let topo = &self.w.core.topo;
        let me = topo.rank();
        let remote = Instant::now() >= self.remote_after;
        (0..topo.world())
            .filter(|&r| r != me && self.members & membership::node(topo.node_of(r)) != 0)
            .filter(|&r| remote || topo.is_local(r))
            .find(|&r| self.w.core.transport.peer_status(r) != PeerStatus::Alive)
            .map(|r| topo.node_of(r))
    }

    /// [`Probe::scan`], when due.
    fn dead(&mut self) -> Option<usize> {
        if self.due() {
            self.scan()
        } else {
            None
        }
    }
}

/// The partial sums of one epoch, added into `reduced` in node order.
struct PartialSum<'w, 'a> {
    w: &'w Worker<'a>,
    /// (first accumulator element, first element of `reduced`, elements).
    runs: Vec<(usize, usize, usize)>,
    /// Compressed: per run, its quantised copy and that copy's byte offset
    /// in every replica's accumulator region (the engine's `QuantSums`).
    quant: Option<Vec<(QuantCopy, usize)>>,
    sum: &'w mut [f32],
    scratch: Vec<u8>,
    /// Compressed: one run of a copy as read (4-aligned for its scales).
    qscratch: Vec<f32>,
}

impl<'w, 'a> PartialSum<'w, 'a> {
    /// `reduced` zeroed. The runs: the whole accumulators under hybrid,
    /// this rank's piece of every bucket under hybrid-zero (a
    /// reduce-scatter, not an all-reduce).
    fn new(w: &'w Worker<'a>) -> PartialSum<'w, 'a> {
        let reg = w.reg;
        let runs: Vec<(usize, usize, usize)> = if reg.groups.blocks > 1 || reg.qsum.is_some() {
            let piece = reg.piece();
            (reg.buckets.iter().enumerate())
                .map(|(i, b)| {
                    let n = b.block_len();
                    (reg.accum_off[i] + piece * n, reg.grad_off[i], n)
                })
                .collect()
        } else {
            vec![(0, 0, reg.accum_len)]
        };
        let len: usize = runs.iter().map(|r| r.2).sum();
        // SAFETY: `reduced` holds `len` f32s (registration sized it so) that
        // only the cross-node sum (under the finish protocol: one finish at a
        // time) writes; readers use it only after finish_minibatch returns.
        let sum =
            unsafe { std::slice::from_raw_parts_mut(reg.reduced.as_ptr().cast::<f32>(), len) };
        sum.fill(0.0);
        let chunk = (reg.ctrl_layout.chunk_bytes() / 4).max(1);
        let longest = runs.iter().map(|r| r.2).max().unwrap_or(0);
        let piece = reg.piece();
        let quant: Option<Vec<(QuantCopy, usize)>> = reg.qsum.as_ref().map(|q| {
            (0..reg.buckets.len())
                .map(|i| (q.copies[i * q.blocks + piece], q.off[i * q.blocks + piece]))
                .collect()
        });
        let widest = (quant.iter().flatten())
            .map(|(c, _)| c.stride().min(c.len()))
            .max()
            .unwrap_or(0);
        PartialSum {
            w,
            runs,
            quant,
            sum,
            scratch: vec![0u8; chunk.min(longest) * 4],
            qscratch: vec![0f32; widest.div_ceil(4)],
        }
    }

    /// Compressed: adds run `j` of copy `copy` (at `src`, read) into the
    /// run's elements of `reduced` starting at `dst`.
    fn add_quantised(dst: &mut [f32], copy: &QuantCopy, j: usize, src: &[u8]) -> Result<()> {
        let elems = copy.elems(j);
        odc_kernels::cpu::quant::dequantise_accumulate_chunk(
            copy.spec,
            &src[..copy.bytes(j)],
            &mut dst[elems],
            1.0,
        )
        .map_err(|e| Error::protocol(None, format!("cross-node sum: {e}")))
    }

    fn add(dst: &mut [f32], src: &[u8]) -> Result<()> {
        odc_kernels::cpu::accumulate_into_f32(dst, src, DType::F32, 1.0)
            .map_err(|e| Error::protocol(None, format!("cross-node sum: {e}")))
    }

    /// Adds this rank's own accumulators (compressed: its own quantised
    /// copies, as the other nodes add them).
    fn add_own(&mut self) -> Result<()> {
        let reg = self.w.reg;
        if let Some(quant) = &self.quant {
            let base = reg.accum.as_ptr();
            for (&(_, dst, len), (copy, off)) in self.runs.iter().zip(quant) {
                for j in 0..copy.runs() {
                    // SAFETY: this rank's quantised copies lie inside its
                    // accumulator region; they were written before it told
                    // the replicas its sums are final and change only at the
                    // next minibatch's end.
                    let own = unsafe {
                        std::slice::from_raw_parts(base.add(off + copy.at(j)), copy.bytes(j))
                    };
                    Self::add_quantised(&mut self.sum[dst..dst + len], copy, j, own)?;
                }
            }
            return Ok(());
        }
        for &(src, dst, len) in &self.runs {
            // SAFETY: every push of the minibatch is added (the done wait)
            // and none of the next can arrive before this rank publishes
            // again; the accumulators are stable.
            let own = unsafe {
                std::slice::from_raw_parts(reg.accum.as_ptr().cast::<u8>().add(src * 4), len * 4)
            };
            Self::add(&mut self.sum[dst..dst + len], own)?;
        }
        Ok(())
    }

    /// Deterministic mode: the sum is exact ([`PartialSum::add_exact`]).
    fn exact(&self) -> bool {
        self.w.reg.exact.is_some()
    }

    /// Deterministic mode: every node of `nodes` (node, rank: this rank's
    /// own at its node) has its exact sums in; adds them as integers into
    /// `reduced`, one run of elements at a time (every node's, read
    /// one-sidedly, then the next run), read out once: the f32 nearest to
    /// the exact sum over every node, so the same bits whichever node ran
    /// which microbatch. Each node's f32 accumulator (zeros and spills: the
    /// finish does not read the exact sums out into it across nodes) is
    /// read beside its exact one for what did not fit the integer
    /// (infinities, NaNs).
    /// An error names the node and rank whose read failed (the transport's
    /// error as it is: the caller attributes it).
    fn add_exact(
        &mut self,
        nodes: &[(usize, usize)],
    ) -> std::result::Result<(), (usize, usize, Error)> {
        use odc_kernels::cpu::exact::{add_exact, read_exact, BYTES_PER_ELEMENT as W};
        let (reg, core) = (self.w.reg, self.w.core);
        let me = reg.groups.node;
        let own_rank = core.topo.rank();
        let kernel = |n: usize, r: usize| {
            move |e: odc_kernels::Error| {
                (n, r, Error::protocol(None, format!("cross-node sum: {e}")))
            }
        };
        let Some(exact) = &reg.exact else {
            return Ok(());
        };
        let longest = self.runs.iter().map(|r| r.2).max().unwrap_or(0);
        let chunk = (reg.ctrl_layout.chunk_bytes() / W)
            .max(1)
            .min(longest.max(1));
        let mut fixed = vec![0i128; chunk];
        let mut xbuf = vec![0u8; chunk * W];
        let mut fbuf = vec![0f32; chunk];
        for &(src, dst, len) in &self.runs {
            let mut at = 0;
            while at < len {
                let n_el = chunk.min(len - at);
                let (fixed, el) = (&mut fixed[..n_el], src + at);
                fixed.fill(0);
                let spill = &mut self.sum[dst + at..dst + at + n_el];
                for &(n, r) in nodes {
                    if n == me {
                        // SAFETY: every push of the minibatch is added (the
                        // done wait) and none of the next can arrive before
                        // this rank publishes again: both accumulators are
                        // stable; `el + n_el` is within them.
                        let (x, o) = unsafe {
                            (
                                std::slice::from_raw_parts(
                                    reg.exact_at(exact, el).cast::<u8>(),
                                    n_el * W,
                                ),
                                std::slice::from_raw_parts(
                                    reg.accum.as_ptr().cast::<f32>().add(el),
                                    n_el,
                                ),
                            )
                        };
                        add_exact(fixed, spill, x, o).map_err(kernel(n, own_rank))?;
                        continue;
                    }
                    let remote = reg.peer_accum[r].as_ref().ok_or_else(|| {
                        (
                            n,
                            r,
                            Error::protocol(None, format!("rank {r} published no accumulators")),
                        )
                    })?;
                    let (x, o) = (&mut xbuf[..n_el * W], &mut fbuf[..n_el]);
                    (core.transport.get(r, remote, exact.region_off + el * W, x))
                        .and_then(|()| {
                            core.transport
                                .get(r, remote, el * 4, crate::bytes_of_mut(o))
                        })
                        .map_err(|e| (n, r, e))?;
                    (reg.summed_across)
                        .fetch_add((x.len() + 4 * o.len()) as u64, Ordering::Relaxed);
                    add_exact(fixed, spill, x, o).map_err(kernel(n, r))?;
                }
                read_exact(fixed, spill).map_err(kernel(me, own_rank))?;
                at += n_el;
            }
        }
        Ok(())
    }

    /// Adds replica `r`'s accumulators, read one chunk at a time (the
    /// transport's error as it is: the caller attributes it).
    fn add_replica(&mut self, r: usize) -> Result<()> {
        let core = self.w.core;
        let remote = self.w.reg.peer_accum[r]
            .as_ref()
            .ok_or_else(|| Error::protocol(None, format!("rank {r} published no accumulators")))?;
        let counted = &self.w.reg.summed_across;
        if let Some(quant) = &self.quant {
            for (&(_, dst, len), (copy, off)) in self.runs.iter().zip(quant) {
                for j in 0..copy.runs() {
                    let buf = &mut crate::bytes_of_mut(&mut self.qscratch[..])[..copy.bytes(j)];
                    core.transport.get(r, remote, off + copy.at(j), buf)?;
                    counted.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    Self::add_quantised(&mut self.sum[dst..dst + len], copy, j, buf)?;
                }
            }
            return Ok(());
        }
        let chunk = self.scratch.len() / 4;
        for &(src, dst, len) in &self.runs {
            let mut at = 0;
            while at < len {
                let n_el = chunk.min(len - at);
                let buf = &mut self.scratch[..n_el * 4];
                core.transport.get(r, remote, (src + at) * 4, buf)?;
                counted.fetch_add(buf.len() as u64, Ordering::Relaxed);
                Self::add(&mut self.sum[dst + at..dst + at + n_el], buf)?;
                at += n_el;
            }
        }
        Ok(())
    }
}
