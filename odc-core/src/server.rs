//! The shard server daemon: one thread per rank that adds pushed gradient
//! chunks into this rank's accumulators and acknowledges them.
//!
//! It sleeps on the rank's server bell, which clients ring after writing a
//! landing-slot signal; it scans every client's two slot signals (acquire),
//! reads the slot header, adds `scale · data` into the bucket's f32
//! accumulator with `odc-kernels`, and acknowledges with a `put_signal` of no
//! data into the client's ack word. No lock, no allocation in the loop.
//!
//! It touches only the landing slots and accumulators; it never reads or
//! writes published shards or version words.

use std::time::Duration;

use odc_kernels::cpu::accumulate_into_f32;

use crate::control::{SlotHeader, HEADER_BYTES};
use crate::engine::{load, Inner, Registered};
use crate::region::{Bell, SignalRef};
use crate::sync::{Backoff, Ordering};

/// Longest sleep between scans when nobody rings (shutdown is rung, so this
/// only bounds the damage of a lost wake-up).
const NAP: Duration = Duration::from_millis(100);

/// The daemon's loop; returns when the engine shuts down.
pub(crate) fn run(inner: &Inner) {
    let Some(reg) = inner.reg.get() else { return };
    let world = inner.topo.world();
    // Sequence number last processed per (client, slot): allocated once.
    let mut last = vec![[0u64; 2]; world];
    let mut backoff = Backoff::new();
    loop {
        if inner.shutdown.load(Ordering::Acquire) {
            return;
        }
        let epoch = inner.transport.bell_epoch(Bell::Server);
        let mut progressed = false;
        for (client, seen) in last.iter_mut().enumerate() {
            for (slot, seen_seq) in seen.iter_mut().enumerate() {
                let seq = load(reg.word(reg.ctrl_layout.slot_signal(client, slot)));
                if seq != *seen_seq {
                    *seen_seq = seq;
                    progressed = true;
                    if let Err(msg) = accumulate(reg, client, slot, seq) {
                        inner.record_server_error(msg);
                    }
                    // Acknowledge even a rejected chunk so the client never
                    // hangs; the error surfaces at this rank's finish.
                    let ack = SignalRef {
                        offset: reg.ctrl_layout.ack(inner.topo.rank(), slot),
                        bell: Bell::Client,
                    };
                    if let Err(e) =
                        inner
                            .transport
                            .put_signal(client, &reg.peer_ctrl[client], 0, &[], ack, seq)
                    {
                        inner.record_server_error(format!("acknowledging rank {client}: {e}"));
                    }
                }
            }
        }
        if progressed {
            backoff.reset();
        } else if !backoff.is_completed() {
            backoff.snooze();
        } else {
            // A failed wait only means "scan again".
            let _ = inner.transport.bell_wait(Bell::Server, epoch, NAP);
        }
    }
}

/// Adds the chunk in landing slot `[client][slot]` into its accumulator.
fn accumulate(reg: &Registered, client: usize, slot: usize, seq: u64) -> Result<(), String> {
    let lay = &reg.ctrl_layout;
    let mut raw = [0u8; HEADER_BYTES];
    // SAFETY: the header lies inside the control region; the client wrote it
    // before the signal we observed with acquire and will not touch the slot
    // again until we acknowledge.
    unsafe {
        std::ptr::copy_nonoverlapping(
            reg.ctrl.as_ptr().add(lay.slot_header(client, slot)),
            raw.as_mut_ptr(),
            HEADER_BYTES,
        )
    };
    let h = SlotHeader::decode(&raw)
        .ok_or_else(|| format!("rank {client}: landing slot with an unknown dtype"))?;
    if h.seq != seq {
        return Err(format!(
            "rank {client}: slot header seq {} but signal {seq}",
            h.seq
        ));
    }
    let b = usize::try_from(h.bucket).unwrap_or(usize::MAX);
    let bucket = reg
        .buckets
        .get(b)
        .ok_or_else(|| format!("rank {client}: push into unknown bucket {b}"))?;
    let (offset, len) = (
        usize::try_from(h.offset).unwrap_or(usize::MAX),
        usize::try_from(h.len).unwrap_or(usize::MAX),
    );
    let bytes = len.saturating_mul(h.dtype.size_bytes());
    if offset.saturating_add(len) > bucket.shard_len() || bytes > lay.chunk_bytes() {
        return Err(format!(
            "rank {client}: push of {len} elements at {offset} outside shard of {:?} ({} elements)",
            bucket.name(),
            bucket.shard_len()
        ));
    }
    let (acc_ptr, _) = reg.accum_ptr(b);
    // SAFETY: in range (checked). The accumulator is written only by this
    // thread while pushes are in flight; the worker reads or zeroes it only
    // after finish_minibatch, ordered by the ack/done release-acquire chain.
    let acc = unsafe { std::slice::from_raw_parts_mut(acc_ptr.add(offset), len) };
    // SAFETY: the data lies inside the control region (bytes <= chunk) and
    // is stable until we acknowledge, as above.
    let data = unsafe {
        std::slice::from_raw_parts(reg.ctrl.as_ptr().add(lay.slot_data(client, slot)), bytes)
    };
    accumulate_into_f32(acc, data, h.dtype, h.scale).map_err(|e| format!("rank {client}: {e}"))
}
