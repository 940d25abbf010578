//! Hybrid sharding over several nodes: the cross-node sum of the partial
//! gradient sums at the end of a minibatch, and the wait before this rank's
//! accumulators may change again (rules: [`crate::protocol::partials`]).

use odc_kernels::DType;

use super::Worker;
use crate::engine::load;
use crate::protocol::partials;
use crate::region::{Bell, SignalRef};
use crate::sync::Ordering;
use crate::{Error, Result};

impl Worker<'_> {
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
            for (n, &r) in gs.replicas.iter().enumerate() {
                if n != gs.node {
                    let sig = SignalRef {
                        offset,
                        bell: Bell::Client,
                    };
                    core.transport
                        .put_signal(r, &reg.peer_ctrl[r], 0, &[], sig, stamp)?;
                }
            }
            Ok(())
        };
        reg.partials_out.fetch_max(stamp, Ordering::AcqRel);
        signal_all(lay.partial_ready(gs.node))?;
        let len = reg.accum_len;
        // SAFETY: `reduced` holds accum_len f32s that only this call (under
        // the finish protocol: one finish at a time) writes; readers use it
        // only after finish_minibatch returns.
        let sum =
            unsafe { std::slice::from_raw_parts_mut(reg.reduced.as_ptr().cast::<f32>(), len) };
        sum.fill(0.0);
        let chunk = (lay.chunk_bytes() / 4).max(1);
        let mut scratch = vec![0u8; chunk.min(len) * 4];
        for (n, &r) in gs.replicas.iter().enumerate() {
            if n == gs.node {
                // SAFETY: every push of minibatch k is added (the done wait)
                // and none of k + 1 can arrive before this rank publishes
                // again; the accumulators are stable.
                let own =
                    unsafe { std::slice::from_raw_parts(reg.accum.as_ptr().cast::<u8>(), len * 4) };
                odc_kernels::cpu::accumulate_into_f32(sum, own, DType::F32, 1.0)
                    .map_err(|e| Error::protocol(None, format!("cross-node sum: {e}")))?;
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
            let mut at = 0;
            while at < len {
                let n_el = chunk.min(len - at);
                let buf = &mut scratch[..n_el * 4];
                core.transport
                    .get(r, remote, at * 4, buf)
                    .map_err(|e| core.attribute(None, e))?;
                odc_kernels::cpu::accumulate_into_f32(
                    &mut sum[at..at + n_el],
                    buf,
                    DType::F32,
                    1.0,
                )
                .map_err(|e| Error::protocol(None, format!("cross-node sum: {e}")))?;
                at += n_el;
            }
        }
        signal_all(lay.partial_read(gs.node))
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
