//! Compressed gathers ([`crate::protocol::compress`]): the owner's
//! quantised copy of its shard, rewritten at each publish before the
//! version is announced, and the reads of peers' copies, which land in a
//! staging buffer (or a node cache slot, [`super::cache`]) and are
//! dequantised into the gather's output.
//!
//! Versions need no rule of their own. A copy is rewritten only inside a
//! publish, after every reader released the previous version (the wait
//! that guards the shard itself) and before the new version is announced;
//! a reader reads a copy only once it saw the version it asks for, and
//! before it releases it. So whatever copy a reader gets is its version's,
//! by the rule that keeps the shard whole, and the node cache keys its
//! entries by version as it does for f32 pieces.
//!
//! The host's quantising and dequantising are here; a device path does
//! both on its daemon's stream ([`super::DataPath::quantise_copy`],
//! [`super::DataPath::dequantise`]), the same rule and the same bits.

use odc_kernels::cpu::quant::{self, Spec};
use odc_kernels::DType;

use super::{DataPath, Worker};
use crate::engine::Registered;
use crate::protocol::compress::QuantCopy;
use crate::{Error, Result};

impl Worker<'_> {
    /// Rewrites this rank's quantised copy of its shard of `bucket` from
    /// the shard a publish just wrote (under hybrid-zero: of its piece, the
    /// block of the node shard it publishes); no-op without copies.
    pub(super) fn quantise_shard(&self, bucket: usize) -> Result<()> {
        let reg = self.reg;
        let Some(q) = &reg.quant else {
            return Ok(());
        };
        let b = &reg.buckets[bucket];
        let copy = q.copies[bucket];
        let (dtype, size) = (b.dtype(), b.dtype().size_bytes());
        let first = if b.blocks() > 1 {
            reg.piece() * b.block_len()
        } else {
            0
        };
        let kernel = |e: odc_kernels::Error| Error::protocol(Some(b.name()), e.to_string());
        let mut values = vec![0f32; copy.run.min(copy.shard_len)];
        for j in 0..copy.runs() {
            let elems = copy.elems(j);
            // SAFETY: this rank's shard of `bucket` and its quantised copy
            // lie inside its params region (offsets fixed at registration,
            // disjoint); the publish lock is held and every reader released
            // the previous version (under hybrid-zero every other node also
            // copied the previous piece: `wait_pieces_read`), so nothing
            // else reads or writes them.
            let (src, dst) = unsafe {
                let base = reg.params.as_ptr();
                (
                    std::slice::from_raw_parts(
                        base.add(reg.params_off[bucket] + (first + elems.start) * size),
                        elems.len() * size,
                    ),
                    std::slice::from_raw_parts_mut(
                        base.add(q.off[bucket] + copy.at(j)),
                        copy.bytes(j),
                    ),
                )
            };
            let v = &mut values[..elems.len()];
            // Widened exactly (signed zeros kept), as the device path does.
            odc_kernels::cpu::cast(src, dtype, crate::bytes_of_mut(v), DType::F32)
                .map_err(kernel)?;
            quant::quantise_chunk(copy.spec, v, dst).map_err(kernel)?;
        }
        Ok(())
    }
}

/// The offset, from bucket `bucket`'s shard in a params region, of byte
/// `at` of its quantised copy (which follows every shard there): what a
/// [`super::ShardRead`] of the copy names.
pub(super) fn copy_at(reg: &Registered, bucket: usize, at: usize) -> usize {
    match &reg.quant {
        Some(q) => q.off[bucket] - reg.params_off[bucket] + at,
        None => at,
    }
}

/// One run of a quantised copy, as read: its format, its elements and how
/// many of them the output takes (a prefix), and the output's dtype.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Run {
    pub(crate) spec: Spec,
    pub(crate) len: usize,
    pub(crate) take: usize,
    pub(crate) dtype: DType,
}

/// Dequantises the first `run.take` elements of the run at `src` (a chunk
/// of `run.len` elements: scales, then codes) into `dst`.
///
/// # Safety
/// `src` addresses the run's `spec.chunk_bytes(run.len)` bytes (host
/// memory, 4-aligned) and `dst` `run.take` writable elements of
/// `run.dtype`, neither changed by anyone else during the call (a node
/// cache slot may be: its reader checks the slot word afterwards and drops
/// what it wrote).
pub(super) unsafe fn dequantise_run(run: Run, src: u64, dst: u64) -> Result<()> {
    let Run {
        spec,
        len,
        take,
        dtype,
    } = run;
    debug_assert!(take <= len);
    let bad = |e: odc_kernels::Error| Error::protocol(None, format!("a compressed gather: {e}"));
    // SAFETY: the caller's contract.
    let (chunk, out) = unsafe {
        (
            std::slice::from_raw_parts(src as usize as *const u8, spec.chunk_bytes(len)),
            std::slice::from_raw_parts_mut(dst as usize as *mut u8, take * dtype.size_bytes()),
        )
    };
    quant::dequantise_chunk_into(spec, len, chunk, out, dtype).map_err(bad)
}

/// Dequantises shard elements `[0, take)` of the quantised copy `copy`,
/// whose runs from the first on are at `src`, into `dst` (`take`
/// elements of `dtype`), on `path` ([`DataPath::dequantise`]).
///
/// # Safety
/// As [`DataPath::dequantise`] for each run: `src` holds
/// `copy.covering(take)`'s bytes, `dst` `take` elements.
pub(super) unsafe fn dequantise_copy(
    path: &impl DataPath,
    copy: &QuantCopy,
    (src, take): (u64, usize),
    dst: u64,
    dtype: DType,
) -> Result<()> {
    let (runs, _) = copy.covering(take);
    let size = dtype.size_bytes() as u64;
    for j in 0..runs {
        let elems = copy.elems(j);
        let run = Run {
            spec: copy.spec,
            len: elems.len(),
            take: elems.len().min(take - elems.start),
            dtype,
        };
        // SAFETY: run j of the copy is at `copy.at(j)` of `src` and its
        // elements at `elems.start` of `dst` (the caller's contract).
        unsafe {
            path.dequantise(
                run,
                src + copy.at(j) as u64,
                dst + elems.start as u64 * size,
            )?
        };
    }
    Ok(())
}
