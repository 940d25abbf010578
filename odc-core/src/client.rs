//! The worker API on [`Engine`]: publish, gather, release,
//! scatter-accumulate, finish a minibatch, and read or zero gradients.
//!
//! Every wait here is on a word of this rank's own control region that a
//! peer sets with `put_signal` (see [`crate::control`]); every wait is a
//! causal edge, never a barrier.

use std::ptr::NonNull;

use odc_kernels::DType;

use crate::control::SlotHeader;
use crate::engine::{load, BucketId, Engine, PushState, Registered};
use crate::handoff::OwnSlice;
use crate::layout::BucketLayout;
use crate::region::{Bell, SignalRef};
use crate::sync::Ordering;
use crate::{Error, Result};

fn check_dtype(bucket: &BucketLayout, dtype: DType, what: &str) -> Result<()> {
    if dtype != bucket.dtype() {
        return Err(Error::layout(
            Some(bucket.name()),
            format!(
                "{what} is {dtype} but the bucket was registered as {}",
                bucket.dtype()
            ),
        ));
    }
    Ok(())
}

fn elems_of(bucket: &BucketLayout, bytes: usize, dtype: DType, what: &str) -> Result<usize> {
    if bytes % dtype.size_bytes() != 0 {
        return Err(Error::layout(
            Some(bucket.name()),
            format!("{what} is {bytes} bytes, not a whole number of {dtype} elements"),
        ));
    }
    Ok(bytes / dtype.size_bytes())
}

impl Engine {
    fn reg(&self) -> Result<&Registered> {
        self.inner.registered()
    }

    /// Publishes this rank's shard of `bucket` as `version` (param dtype,
    /// exactly `shard_len` elements). Waits first until every client has
    /// released `version - 1` (by [`release`](Self::release) or
    /// [`finish_minibatch`](Self::finish_minibatch)), so no reader sees a
    /// shard being overwritten; version 0 waits for nothing. Versions must
    /// increase.
    pub fn publish(
        &self,
        bucket: BucketId,
        shard: &[u8],
        dtype: DType,
        version: u64,
    ) -> Result<()> {
        let reg = self.reg()?;
        let b = reg.bucket(bucket)?;
        check_dtype(b, dtype, "shard")?;
        if shard.len() != b.shard_bytes() {
            return Err(Error::layout(
                Some(b.name()),
                format!(
                    "shard is {} bytes; expected {} ({} {} elements)",
                    shard.len(),
                    b.shard_bytes(),
                    b.shard_len(),
                    b.dtype()
                ),
            ));
        }
        let stamp = version
            .checked_add(1)
            .ok_or_else(|| Error::protocol(Some(b.name()), "version u64::MAX is reserved"))?;
        let _guard = self
            .publish_lock
            .lock()
            .map_err(|_| Error::protocol(Some(b.name()), "a publish panicked"))?;
        let (me, world, lay) = (self.rank(), self.world(), &reg.ctrl_layout);
        let current = load(reg.word(lay.seen_version(me, bucket.0)));
        if current >= stamp {
            return Err(Error::protocol(
                Some(b.name()),
                format!(
                    "publish of version {version} after version {} (versions must increase)",
                    current - 1
                ),
            ));
        }
        if version > 0 {
            self.inner.wait(
                Some(b.name()),
                &|| {
                    format!(
                        "every reader to release version {} before publishing {version}",
                        version - 1
                    )
                },
                || {
                    Ok((0..world).find(|&c| {
                        load(reg.word(lay.released(c, bucket.0))).max(load(reg.word(lay.done(c))))
                            < version
                    }))
                },
            )?;
        }
        // SAFETY: the shard lies inside the params region (offset and length
        // fixed at registration); every reader released the previous version,
        // so nobody reads this range until the signal below.
        unsafe {
            std::ptr::copy_nonoverlapping(
                shard.as_ptr(),
                reg.params.as_ptr().add(reg.params_off[bucket.0]),
                shard.len(),
            )
        };
        for c in 0..world {
            let sig = SignalRef {
                offset: lay.seen_version(me, bucket.0),
                bell: Bell::Client,
            };
            self.inner
                .transport
                .put_signal(c, &reg.peer_ctrl[c], 0, &[], sig, stamp)?;
        }
        Ok(())
    }

    /// Gathers `version` of the full `bucket` into `out` (param dtype; either
    /// `numel` or `D * shard_len` elements): for every owner, waits until its
    /// shard holds `version`, then reads it. A newer version at an owner is a
    /// protocol error (this reader missed a release).
    pub fn gather(
        &self,
        bucket: BucketId,
        version: u64,
        out: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        self.gather_impl(bucket, version, out, dtype, false)
    }

    /// Like [`gather`](Self::gather) but leaves this rank's own shard range
    /// of `out` untouched, for callers that already copied their shard in
    /// (FSDP's copy-in); only the D−1 remote shards move.
    pub fn gather_remote(
        &self,
        bucket: BucketId,
        version: u64,
        out: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        self.gather_impl(bucket, version, out, dtype, true)
    }

    fn gather_impl(
        &self,
        bucket: BucketId,
        version: u64,
        out: &mut [u8],
        dtype: DType,
        skip_own: bool,
    ) -> Result<()> {
        let reg = self.reg()?;
        let b = reg.bucket(bucket)?;
        check_dtype(b, dtype, "output")?;
        let elems = b.check_full_len(elems_of(b, out.len(), dtype, "output")?)?;
        let stamp = version.saturating_add(1);
        let (me, world, lay) = (self.rank(), self.world(), &reg.ctrl_layout);
        let size = dtype.size_bytes();
        for step in 0..world {
            let owner = (me + step) % world;
            let word = reg.word(lay.seen_version(owner, bucket.0));
            if load(word) != stamp {
                self.inner.wait(
                    Some(b.name()),
                    &|| format!("version {version} of its shard"),
                    || match load(word) {
                        s if s == stamp => Ok(None),
                        s if s > stamp => Err(Error::protocol(
                            Some(b.name()),
                            format!(
                                "gather of version {version}, but rank {owner} already published version {}",
                                s - 1
                            ),
                        )),
                        _ => Ok(Some(owner)),
                    },
                )?;
            }
            let range = b.shard_range(owner);
            let (start, end) = (range.start.min(elems), range.end.min(elems));
            if start == end || (skip_own && owner == me) {
                continue;
            }
            let dst = &mut out[start * size..end * size];
            self.inner.transport.get(
                owner,
                &reg.peer_params[owner],
                reg.params_off[bucket.0],
                dst,
            )?;
        }
        Ok(())
    }

    /// Declares that this client is done reading `version` of `bucket`, so
    /// its owners may publish `version + 1`.
    /// [`finish_minibatch(k)`](Self::finish_minibatch) implies `release(b, k)`
    /// for every bucket.
    pub fn release(&self, bucket: BucketId, version: u64) -> Result<()> {
        let reg = self.reg()?;
        reg.bucket(bucket)?;
        let stamp = version.saturating_add(1);
        if reg.released[bucket.0].fetch_max(stamp, Ordering::AcqRel) >= stamp {
            return Ok(());
        }
        let (me, lay) = (self.rank(), &reg.ctrl_layout);
        for o in 0..self.world() {
            let sig = SignalRef {
                offset: lay.released(me, bucket.0),
                bell: Bell::Client,
            };
            self.inner
                .transport
                .put_signal(o, &reg.peer_ctrl[o], 0, &[], sig, stamp)?;
        }
        Ok(())
    }

    /// Pushes the full-bucket gradient `grads` (`numel` or `D * shard_len`
    /// elements of `dtype`, which may differ from the parameter dtype) so
    /// that every owner adds `scale · grads[its shard]` into its
    /// accumulator. Returns once every chunk is written into a landing slot
    /// and this rank's own slice is added (it is handed to this rank's
    /// server without a copy), without waiting for the peers'
    /// acknowledgements.
    pub fn scatter_accumulate(
        &self,
        bucket: BucketId,
        grads: &[u8],
        dtype: DType,
        scale: f32,
    ) -> Result<()> {
        let reg = self.reg()?;
        let b = reg.bucket(bucket)?;
        b.check_full_len(elems_of(b, grads.len(), dtype, "gradient")?)?;
        self.scatter_accumulate_at(bucket, 0, grads, dtype, scale)
    }

    /// Like [`scatter_accumulate`](Self::scatter_accumulate) for the part of
    /// the bucket that starts at element `offset`: `grads` covers
    /// `[offset, offset + len)` of the padded bucket.
    pub fn scatter_accumulate_at(
        &self,
        bucket: BucketId,
        offset: usize,
        grads: &[u8],
        dtype: DType,
        scale: f32,
    ) -> Result<()> {
        let reg = self.reg()?;
        let b = reg.bucket(bucket)?;
        let elems = elems_of(b, grads.len(), dtype, "gradient")?;
        let end = offset.checked_add(elems).filter(|&e| e <= b.padded_len()).ok_or_else(|| {
            Error::layout(
                Some(b.name()),
                format!("{elems} elements at offset {offset} overrun the padded bucket of {} elements", b.padded_len()),
            )
        })?;
        let mut guard = self
            .push
            .lock()
            .map_err(|_| Error::protocol(Some(b.name()), "a push panicked"))?;
        let push = &mut *guard;
        let (me, world) = (self.rank(), self.world());
        let size = dtype.size_bytes();
        for o in 0..world {
            push.cursor[o] = b.shard_overlap(o, offset, end);
        }
        // This rank's own slice goes to its own server as a pointer into
        // `grads` (see `handoff`), not through a landing slot.
        let own = std::mem::replace(&mut push.cursor[me], 0..0);
        if own.is_empty() {
            return self.push_chunks(push, b, bucket, offset, grads, dtype, scale);
        }
        let first = b.shard_range(me).start + own.start - offset;
        let bytes = &grads[first * size..(first + own.len()) * size];
        push.own_gen += 1;
        let gen = push.own_gen;
        self.inner.own.post(
            gen,
            OwnSlice {
                bucket: bucket.0,
                offset: own.start,
                len: own.len(),
                addr: bytes.as_ptr() as usize,
                dtype: dtype.as_u8(),
                scale,
            },
        );
        self.inner.transport.ring(Bell::Server);
        let pushed = self.push_chunks(push, b, bucket, offset, grads, dtype, scale);
        let added = self.inner.wait(
            Some(b.name()),
            &|| "its own server to add this rank's own slice".to_owned(),
            || Ok((!self.inner.own.is_done(gen)).then_some(me)),
        );
        if added.is_err() || pushed.is_err() {
            // `grads` is borrowed only for this call.
            self.inner.own.revoke(gen);
        }
        pushed.and(added)
    }

    /// Pushes every peer's part of `grads` (per `push.cursor`) through the
    /// landing slots. Returns once every chunk is written into a slot.
    #[allow(clippy::too_many_arguments)]
    fn push_chunks(
        &self,
        push: &mut PushState,
        b: &BucketLayout,
        bucket: BucketId,
        offset: usize,
        grads: &[u8],
        dtype: DType,
        scale: f32,
    ) -> Result<()> {
        let reg = self.reg()?;
        let (me, world, lay) = (self.rank(), self.world(), &reg.ctrl_layout);
        let size = dtype.size_bytes();
        let chunk = lay.chunk_bytes() / size;
        let bucket_u32 = u32::try_from(bucket.0).unwrap_or(u32::MAX);
        // Round-robin over owners so that no single slow server stalls the rest.
        loop {
            let mut pending = false;
            let mut pushed = false;
            for step in 1..=world {
                let o = (me + step) % world;
                let range = push.cursor[o].clone();
                if range.is_empty() {
                    continue;
                }
                pending = true;
                let seq = push.next_seq[o] + 1;
                let slot = (seq % 2) as usize;
                if load(reg.word(lay.ack(o, slot))) != push.sent[o][slot] {
                    continue;
                }
                let len = range.len().min(chunk);
                let first = b.shard_range(o).start + range.start - offset;
                let data = &grads[first * size..(first + len) * size];
                let header = SlotHeader {
                    seq,
                    bucket: bucket_u32,
                    dtype,
                    offset: range.start as u64,
                    len: len as u64,
                    scale,
                }
                .encode();
                let sig = SignalRef {
                    offset: lay.slot_signal(me, slot),
                    bell: Bell::Server,
                };
                self.inner.transport.put_signal(
                    o,
                    &reg.peer_ctrl[o],
                    lay.slot_header(me, slot),
                    &[&header, data],
                    sig,
                    seq,
                )?;
                push.next_seq[o] = seq;
                push.sent[o][slot] = seq;
                push.cursor[o].start += len;
                pushed = true;
            }
            if !pending {
                return Ok(());
            }
            if !pushed {
                let sent = &push.sent;
                let next = &push.next_seq;
                let cursor = &push.cursor;
                self.inner.wait(
                    Some(b.name()),
                    &|| "acknowledgement of a landing slot".to_owned(),
                    || {
                        let mut lagging = None;
                        for o in 0..world {
                            if cursor[o].is_empty() {
                                continue;
                            }
                            let slot = ((next[o] + 1) % 2) as usize;
                            if load(reg.word(lay.ack(o, slot))) == sent[o][slot] {
                                return Ok(None);
                            }
                            lagging.get_or_insert(o);
                        }
                        Ok(lagging)
                    },
                )?;
            }
        }
    }

    /// Ends minibatch `k` for this client and waits for this rank's own
    /// gradient shards to be final: waits until every push is acknowledged,
    /// releases every bucket at version `k`, writes `done = k` into every
    /// owner's control region, then waits until every client's done word
    /// here reads at least `k`. No barrier: a fast rank returns as soon as
    /// its own shards are complete.
    pub fn finish_minibatch(&self, k: u64) -> Result<()> {
        let reg = self.reg()?;
        let stamp = k.saturating_add(1);
        let (me, world, lay) = (self.rank(), self.world(), &reg.ctrl_layout);
        {
            let guard = self
                .push
                .lock()
                .map_err(|_| Error::protocol(None, "a push panicked"))?;
            let sent = &guard.sent;
            self.inner.wait(
                None,
                &|| format!("acknowledgement of this rank's last pushes of minibatch {k}"),
                || {
                    Ok((0..world)
                        .find(|&o| (0..2).any(|s| load(reg.word(lay.ack(o, s))) != sent[o][s])))
                },
            )?;
            let prev = reg.finished.fetch_max(stamp, Ordering::AcqRel);
            if prev > stamp {
                return Err(Error::protocol(
                    None,
                    format!("finish_minibatch({k}) after finish_minibatch({})", prev - 1),
                ));
            }
            for r in &reg.released {
                r.fetch_max(stamp, Ordering::AcqRel);
            }
            for o in 0..world {
                let sig = SignalRef {
                    offset: lay.done(me),
                    bell: Bell::Client,
                };
                self.inner
                    .transport
                    .put_signal(o, &reg.peer_ctrl[o], 0, &[], sig, stamp)?;
            }
        }
        self.inner.wait(
            None,
            &|| format!("its gradients of minibatch {k} (done = {k})"),
            || Ok((0..world).find(|&c| load(reg.word(lay.done(c))) < stamp)),
        )?;
        match self.inner.take_server_error() {
            Some(e) => Err(Error::protocol(
                None,
                format!("the shard server rejected a push: {e}"),
            )),
            None => Ok(()),
        }
    }

    /// Copies this rank's accumulated gradient shard of `bucket` (f32,
    /// `shard_len` elements) into `out`. Meaningful after
    /// [`finish_minibatch`](Self::finish_minibatch).
    pub fn read_grad_shard(&self, bucket: BucketId, out: &mut [f32]) -> Result<()> {
        let reg = self.reg()?;
        let b = reg.bucket(bucket)?;
        let (ptr, len) = reg.accum_ptr(bucket.0);
        if out.len() != len {
            return Err(Error::layout(
                Some(b.name()),
                format!(
                    "gradient buffer holds {} elements; the shard has {len}",
                    out.len()
                ),
            ));
        }
        // SAFETY: `ptr` is valid for `len` f32s; the server writes it only
        // while pushes are in flight, which the protocol orders before this.
        unsafe { std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr(), len) };
        Ok(())
    }

    /// The accumulator of `bucket`: a pointer to `shard_len` f32s valid for
    /// the engine's lifetime (for zero-copy optimizer steps from Python).
    /// Access it only between `finish_minibatch` and the next publish.
    pub fn grad_shard_ptr(&self, bucket: BucketId) -> Result<(NonNull<f32>, usize)> {
        let reg = self.reg()?;
        reg.bucket(bucket)?;
        let (ptr, len) = reg.accum_ptr(bucket.0);
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::protocol(None, "null accumulator"))?;
        Ok((ptr, len))
    }

    /// Zeroes the accumulator of `bucket` (after the optimizer step, before
    /// the next publish).
    pub fn zero_grad(&self, bucket: BucketId) -> Result<()> {
        let reg = self.reg()?;
        reg.bucket(bucket)?;
        let (ptr, len) = reg.accum_ptr(bucket.0);
        // SAFETY: as in `read_grad_shard`; all-zero bits are 0.0f32.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(())
    }

    /// Zeroes every accumulator.
    pub fn zero_grads(&self) -> Result<()> {
        let n = self.reg()?.buckets.len();
        (0..n).try_for_each(|b| self.zero_grad(BucketId(b)))
    }
}
