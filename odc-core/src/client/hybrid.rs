//! Hybrid sharding over several nodes: the cross-node sum of the partial
//! gradient sums at the end of a minibatch, and the wait before this rank's
//! accumulators may change again (rules: [`crate::protocol::partials`]).

use odc_kernels::DType;

use super::Worker;
use crate::engine::{load, BucketId};
use crate::layout::BucketLayout;
use crate::protocol::{partials, pieces};
use crate::region::{Bell, SignalRef};
use crate::sync::Ordering;
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
        let sig = SignalRef {
            offset,
            bell: Bell::Client,
        };
        self.core
            .transport
            .put_signal(r, &self.reg.peer_ctrl[r], 0, &[], sig, stamp)
            .map_err(|e| self.core.attribute(bucket, e))
    }

    /// Hybrid sharding over several nodes, at the end of minibatch `k`:
    /// tells the replicas this rank's partial sums are final, sums every
    /// node's partial sums in node order into `reduced` (reading the others'
    /// accumulators one chunk at a time), and tells the replicas it has
    /// read theirs.
    pub(super) fn reduce_across_nodes(&self, k: u64) -> Result<()> {
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
        reg.partials_out.fetch_max(stamp, Ordering::AcqRel);
        signal_all(lay.partial_ready(gs.node))?;
        // (first accumulator element, first element of `reduced`, elements):
        // the whole accumulators under hybrid, this rank's piece of every
        // bucket under hybrid-zero (a reduce-scatter, not an all-reduce).
        let runs: Vec<(usize, usize, usize)> = if gs.blocks > 1 {
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
        // only this call (under the finish protocol: one finish at a time)
        // writes; readers use it only after finish_minibatch returns.
        let sum =
            unsafe { std::slice::from_raw_parts_mut(reg.reduced.as_ptr().cast::<f32>(), len) };
        sum.fill(0.0);
        let add = |dst: &mut [f32], src: &[u8]| {
            odc_kernels::cpu::accumulate_into_f32(dst, src, DType::F32, 1.0)
                .map_err(|e| Error::protocol(None, format!("cross-node sum: {e}")))
        };
        let chunk = (lay.chunk_bytes() / 4).max(1);
        let longest = runs.iter().map(|r| r.2).max().unwrap_or(0);
        let mut scratch = vec![0u8; chunk.min(longest) * 4];
        for (n, &r) in gs.replicas.iter().enumerate() {
            if n == gs.node {
                for &(src, dst, len) in &runs {
                    // SAFETY: every push of minibatch k is added (the done
                    // wait) and none of k + 1 can arrive before this rank
                    // publishes again; the accumulators are stable.
                    let own = unsafe {
                        std::slice::from_raw_parts(
                            reg.accum.as_ptr().cast::<u8>().add(src * 4),
                            len * 4,
                        )
                    };
                    add(&mut sum[dst..dst + len], own)?;
                }
                continue;
            }
            let word = reg.word(lay.partial_ready(n));
            core.wait(
                None,
                &|| format!("its partial gradient sums of minibatch {k} (hybrid sharding)"),
                || Ok((load(word) < stamp).then_some(r)),
            )?;
            let remote = reg.peer_accum[r].as_ref().ok_or_else(|| {
                Error::protocol(None, format!("rank {r} published no accumulators"))
            })?;
            for &(src, dst, len) in &runs {
                let mut at = 0;
                while at < len {
                    let n_el = chunk.min(len - at);
                    let buf = &mut scratch[..n_el * 4];
                    core.transport
                        .get(r, remote, (src + at) * 4, buf)
                        .map_err(|e| core.attribute(None, e))?;
                    add(&mut sum[dst + at..dst + at + n_el], buf)?;
                    at += n_el;
                }
            }
        }
        signal_all(lay.partial_read(gs.node))
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
            core.transport
                .get(r, &reg.peer_params[r], at, dst)
                .map_err(|e| core.attribute(Some(b.name()), e))?;
            signal(r, lay.piece_read(gs.node, bucket.0))?;
        }
        Ok(())
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
        if !reg.cross_node() || stamp == 0 {
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
