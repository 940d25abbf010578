//! The worker API on [`Engine`]: publish, gather, release,
//! scatter-accumulate, finish a minibatch, and read or zero gradients.
//!
//! Every wait here is on a word of this rank's own control region that a
//! peer sets with `put_signal` (see [`crate::control`]); every wait is a
//! causal edge, never a barrier.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, MutexGuard};

use odc_kernels::DType;

use crate::control::{slot_count, SlotHeader, HEADER_BYTES};
use crate::engine::{load, BucketId, Engine, Inner, PushState, Registered};
use crate::handoff::OwnSlice;
use crate::layout::BucketLayout;
use crate::region::{Bell, RegionDesc, SignalRef};
use crate::sync::Ordering;
use crate::transport::Transport;
use crate::{Error, Result};

pub(crate) fn check_dtype(bucket: &BucketLayout, dtype: DType, what: &str) -> Result<()> {
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

pub(crate) fn elems_of(
    bucket: &BucketLayout,
    bytes: usize,
    dtype: DType,
    what: &str,
) -> Result<usize> {
    if bytes % dtype.size_bytes() != 0 {
        return Err(Error::layout(
            Some(bucket.name()),
            format!("{what} is {bytes} bytes, not a whole number of {dtype} elements"),
        ));
    }
    Ok(bytes / dtype.size_bytes())
}

pub(crate) fn check_shard_len(bucket: &BucketLayout, bytes: usize) -> Result<()> {
    if bytes != bucket.shard_bytes() {
        return Err(Error::layout(
            Some(bucket.name()),
            format!(
                "shard is {bytes} bytes; expected {} ({} {} elements)",
                bucket.shard_bytes(),
                bucket.shard_len(),
                bucket.dtype()
            ),
        ));
    }
    Ok(())
}

/// Pure signals (no data) of one value into one word of every shard-group
/// rank's control region, sent now or later by work on a stream. Building
/// one allocates nothing (two reference counts).
pub(crate) struct Signals {
    transport: Arc<dyn Transport>,
    targets: Arc<[(usize, RegionDesc)]>,
    sig: SignalRef,
    value: u64,
}

impl Signals {
    pub(crate) fn new(inner: &Inner, reg: &Registered, offset: usize, value: u64) -> Signals {
        Signals {
            transport: Arc::clone(&inner.transport),
            targets: Arc::clone(&reg.group_ctrl),
            sig: SignalRef {
                offset,
                bell: Bell::Client,
            },
            value,
        }
    }

    pub(crate) fn send(&self) -> Result<()> {
        for (rank, desc) in self.targets.iter() {
            self.transport
                .put_signal(*rank, desc, 0, &[], self.sig, self.value)?;
        }
        Ok(())
    }
}

impl Engine {
    /// The registered state of a host engine; a device engine's data is not
    /// host memory, so its host calls are refused naming the device call.
    fn reg(&self) -> Result<&Registered> {
        let reg = self.inner.registered()?;
        if reg.plane.is_some() {
            return Err(Error::Config(format!(
                "this engine's data lives in device memory ({}): use the *_device calls \
                 (publish_device, gather_device, scatter_accumulate_device, ...)",
                self.transport_name()
            )));
        }
        Ok(reg)
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
        check_shard_len(b, shard.len())?;
        let _guard = self
            .publish_lock
            .lock()
            .map_err(|_| Error::protocol(Some(b.name()), "a publish panicked"))?;
        let stamp = self.publish_wait(reg, b, bucket, version)?;
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
        let name = reg.bucket(bucket)?.name();
        self.version_signals(reg, bucket, stamp)
            .send()
            .map_err(|e| self.inner.attribute(Some(name), e))
    }

    /// The signals that announce `stamp` of this rank's shard of `bucket` to
    /// every client.
    pub(crate) fn version_signals(
        &self,
        reg: &Registered,
        bucket: BucketId,
        stamp: u64,
    ) -> Signals {
        let offset = reg.ctrl_layout.seen_version(reg.groups.me, bucket.0);
        Signals::new(&self.inner, reg, offset, stamp)
    }

    /// The part of a publish before the copy: checks that `version`
    /// increases, and waits until every reader released `version - 1` (and,
    /// hybrid, the other nodes read the partial sums). Returns the stamp to
    /// signal. The caller holds `publish_lock`.
    pub(crate) fn publish_wait(
        &self,
        reg: &Registered,
        b: &BucketLayout,
        bucket: BucketId,
        version: u64,
    ) -> Result<u64> {
        let stamp = version
            .checked_add(1)
            .ok_or_else(|| Error::protocol(Some(b.name()), "version u64::MAX is reserved"))?;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let (me, world) = (gs.me, gs.group.len());
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
                    Ok((0..world)
                        .find(|&c| {
                            load(reg.word(lay.released(c, bucket.0)))
                                .max(load(reg.word(lay.done(c))))
                                < version
                        })
                        .map(|c| gs.group[c]))
                },
            )?;
        }
        // Hybrid: the other nodes read the accumulators this publish lets
        // the node's clients push into again.
        self.wait_partials_read(reg, Some(b.name()))?;
        Ok(stamp)
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
        let size = dtype.size_bytes();
        self.gather_with(
            reg,
            bucket,
            version,
            (out.len(), dtype),
            skip_own,
            &mut |rank, range| {
                let dst = &mut out[range.start * size..range.end * size];
                self.inner.transport.get(
                    rank,
                    &reg.peer_params[rank],
                    reg.params_off[bucket.0],
                    dst,
                )
            },
        )
    }

    /// A gather into an output of `bytes` bytes of `dtype` (checked against
    /// the bucket: its dtype, and `numel` or the padded length): for every
    /// owner, from this rank on, waits until its shard holds `version`, then
    /// calls `read(rank, elements)` for the part of the output it owns.
    pub(crate) fn gather_with(
        &self,
        reg: &Registered,
        bucket: BucketId,
        version: u64,
        (bytes, dtype): (usize, DType),
        skip_own: bool,
        read: &mut dyn FnMut(usize, Range<usize>) -> Result<()>,
    ) -> Result<()> {
        let b = reg.bucket(bucket)?;
        check_dtype(b, dtype, "output")?;
        let elems = b.check_full_len(elems_of(b, bytes, dtype, "output")?)?;
        let (me, world) = (reg.groups.me, reg.groups.group.len());
        for step in 0..world {
            // `owner` indexes the shard group; `rank` is its global rank.
            let owner = (me + step) % world;
            let rank = reg.groups.group[owner];
            self.wait_shard(reg, b, bucket, owner, version)?;
            let range = b.shard_range(owner);
            let (start, end) = (range.start.min(elems), range.end.min(elems));
            if start == end || (skip_own && owner == me) {
                continue;
            }
            read(rank, start..end).map_err(|e| self.inner.attribute(Some(b.name()), e))?;
        }
        Ok(())
    }

    /// Waits until `owner`'s (index in the shard group) shard of `bucket`
    /// holds `version`; a newer version there is a protocol error (this
    /// reader missed a release).
    pub(crate) fn wait_shard(
        &self,
        reg: &Registered,
        b: &BucketLayout,
        bucket: BucketId,
        owner: usize,
        version: u64,
    ) -> Result<()> {
        let stamp = version.saturating_add(1);
        let rank = reg.groups.group[owner];
        let word = reg.word(reg.ctrl_layout.seen_version(owner, bucket.0));
        if load(word) == stamp {
            return Ok(());
        }
        self.inner.wait(
            Some(b.name()),
            &|| format!("version {version} of its shard"),
            || match load(word) {
                s if s == stamp => Ok(None),
                s if s > stamp => Err(Error::protocol(
                    Some(b.name()),
                    format!(
                        "gather of version {version}, but rank {rank} already published version {}",
                        s - 1
                    ),
                )),
                _ => Ok(Some(rank)),
            },
        )
    }

    /// Declares that this client is done reading `version` of `bucket`, so
    /// its owners may publish `version + 1`.
    /// [`finish_minibatch(k)`](Self::finish_minibatch) implies `release(b, k)`
    /// for every bucket.
    pub fn release(&self, bucket: BucketId, version: u64) -> Result<()> {
        let reg = self.reg()?;
        match self.release_signals(reg, bucket, version)? {
            Some(signals) => signals.send().map_err(|e| self.inner.attribute(None, e)),
            None => Ok(()),
        }
    }

    /// The signals that release `version` of `bucket` to every owner, or
    /// `None` when this client already released it.
    pub(crate) fn release_signals(
        &self,
        reg: &Registered,
        bucket: BucketId,
        version: u64,
    ) -> Result<Option<Signals>> {
        reg.bucket(bucket)?;
        let stamp = version.saturating_add(1);
        if reg.released[bucket.0].fetch_max(stamp, Ordering::AcqRel) >= stamp {
            return Ok(None);
        }
        let (me, lay) = (reg.groups.me, &reg.ctrl_layout);
        let offset = lay.released(me, bucket.0);
        Ok(Some(Signals::new(&self.inner, reg, offset, stamp)))
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
        // This rank's own slice goes to its own server as a pointer into
        // `grads` (see `handoff`), not through a landing slot.
        let (mut guard, own) = self.start_push(reg, b, offset, grads.len(), dtype)?;
        let push = &mut *guard;
        let me = reg.groups.me;
        let size = dtype.size_bytes();
        let mut put =
            |rank: usize, slot: usize, seq: u64, header: [u8; HEADER_BYTES], data: Range<usize>| {
                let lay = &reg.ctrl_layout;
                let sig = SignalRef {
                    offset: lay.slot_signal(me, slot),
                    bell: Bell::Server,
                };
                self.inner.transport.put_signal(
                    rank,
                    &reg.peer_ctrl[rank],
                    lay.slot_header(me, slot),
                    &[&header, &grads[data]],
                    sig,
                    slot_count(seq),
                )
            };
        if own.is_empty() {
            return self.push_chunks(push, b, bucket, offset, dtype, scale, &mut put);
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
        let pushed = self.push_chunks(push, b, bucket, offset, dtype, scale, &mut put);
        let added = self.inner.wait(
            Some(b.name()),
            &|| "its own server to add this rank's own slice".to_owned(),
            || Ok((!self.inner.own.is_done(gen)).then_some(self.rank())),
        );
        if added.is_err() || pushed.is_err() {
            // `grads` is borrowed only for this call.
            self.inner.own.revoke(gen);
        }
        pushed.and(added)
    }

    /// The start of a push of `bytes` of `dtype` from element `offset` of
    /// bucket `b`: checks the range, takes the push lock, points every
    /// owner's cursor at its part, and takes this rank's own part out of
    /// them (it never goes through a landing slot). Returns the lock and the
    /// own part, in elements of this rank's shard.
    pub(crate) fn start_push(
        &self,
        reg: &Registered,
        b: &BucketLayout,
        offset: usize,
        bytes: usize,
        dtype: DType,
    ) -> Result<(MutexGuard<'_, PushState>, Range<usize>)> {
        let elems = elems_of(b, bytes, dtype, "gradient")?;
        let end = b.check_range(offset, elems)?;
        let mut push = self
            .push
            .lock()
            .map_err(|_| Error::protocol(Some(b.name()), "a push panicked"))?;
        // Owners are indexed by their place in the shard group.
        for o in 0..reg.groups.group.len() {
            push.cursor[o] = b.shard_overlap(o, offset, end);
        }
        let own = std::mem::replace(&mut push.cursor[reg.groups.me], 0..0);
        Ok((push, own))
    }

    /// Pushes every peer's part of a gradient (per `push.cursor`) through
    /// the landing slots: `put(rank, slot, seq, header, bytes)` writes the
    /// chunk at `bytes` of the caller's gradient buffer and the encoded
    /// header into slot `slot` of `rank`, then `seq` into the slot's signal.
    /// Returns once every chunk is put.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push_chunks(
        &self,
        push: &mut PushState,
        b: &BucketLayout,
        bucket: BucketId,
        offset: usize,
        dtype: DType,
        scale: f32,
        put: &mut dyn FnMut(usize, usize, u64, [u8; HEADER_BYTES], Range<usize>) -> Result<()>,
    ) -> Result<()> {
        let reg = self.inner.registered()?;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let (me, world) = (gs.me, gs.group.len());
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
                let data = first * size..(first + len) * size;
                let header = SlotHeader {
                    seq,
                    bucket: bucket_u32,
                    dtype,
                    offset: range.start as u64,
                    len: len as u64,
                    scale,
                }
                .encode();
                put(gs.group[o], slot, seq, header, data)
                    .map_err(|e| self.inner.attribute(Some(b.name()), e))?;
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
                            lagging.get_or_insert(gs.group[o]);
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
        self.finish_impl(reg, k)
    }

    /// [`finish_minibatch`](Self::finish_minibatch) on `reg`.
    pub(crate) fn finish_impl(&self, reg: &Registered, k: u64) -> Result<()> {
        let stamp = k.saturating_add(1);
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let (me, world) = (gs.me, gs.group.len());
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
                        .find(|&o| (0..2).any(|s| load(reg.word(lay.ack(o, s))) != sent[o][s]))
                        .map(|o| gs.group[o]))
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
            Signals::new(&self.inner, reg, lay.done(me), stamp)
                .send()
                .map_err(|e| self.inner.attribute(None, e))?;
        }
        self.inner.wait(
            None,
            &|| format!("its gradients of minibatch {k} (done = {k})"),
            || {
                Ok((0..world)
                    .find(|&c| load(reg.word(lay.done(c))) < stamp)
                    .map(|c| gs.group[c]))
            },
        )?;
        if let Some(e) = self.inner.take_server_error() {
            return Err(Error::protocol(
                None,
                format!("the shard server rejected a push: {e}"),
            ));
        }
        if reg.cross_node() {
            self.reduce_across_nodes(reg, k)?;
        }
        Ok(())
    }

    /// Hybrid sharding over several nodes, at the end of minibatch `k`:
    /// tells the replicas this rank's partial sums are final, sums every
    /// node's partial sums in node order into `reduced` (reading the
    /// others' accumulators one chunk at a time), and tells the replicas it
    /// has read theirs.
    fn reduce_across_nodes(&self, reg: &Registered, k: u64) -> Result<()> {
        let stamp = k.saturating_add(1);
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let signal_all = |offset: usize| -> Result<()> {
            for (n, &r) in gs.replicas.iter().enumerate() {
                if n != gs.node {
                    let sig = SignalRef {
                        offset,
                        bell: Bell::Client,
                    };
                    self.inner
                        .transport
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
                // SAFETY: every push of minibatch k is added (the done wait
                // above) and none of k + 1 can arrive before this rank
                // publishes again; the accumulators are stable.
                let own =
                    unsafe { std::slice::from_raw_parts(reg.accum.as_ptr().cast::<u8>(), len * 4) };
                odc_kernels::cpu::accumulate_into_f32(sum, own, DType::F32, 1.0)
                    .map_err(|e| Error::protocol(None, format!("cross-node sum: {e}")))?;
                continue;
            }
            let word = reg.word(lay.partial_ready(n));
            self.inner.wait(
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
                self.inner
                    .transport
                    .get(r, remote, at * 4, buf)
                    .map_err(|e| self.inner.attribute(None, e))?;
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
    fn wait_partials_read(&self, reg: &Registered, bucket: Option<&str>) -> Result<()> {
        let stamp = load(&reg.partials_out);
        if !reg.cross_node() || stamp == 0 {
            return Ok(());
        }
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        self.inner.wait(
            bucket,
            &|| {
                format!(
                    "the other nodes to read this rank's partial sums of minibatch {}",
                    stamp - 1
                )
            },
            || {
                Ok(gs
                    .replicas
                    .iter()
                    .enumerate()
                    .find(|&(n, _)| n != gs.node && load(reg.word(lay.partial_read(n))) < stamp)
                    .map(|(_, &r)| r))
            },
        )
    }

    /// Copies this rank's accumulated gradient shard of `bucket` (f32,
    /// `shard_len` elements) into `out`. Meaningful after
    /// [`finish_minibatch`](Self::finish_minibatch).
    pub fn read_grad_shard(&self, bucket: BucketId, out: &mut [f32]) -> Result<()> {
        let reg = self.reg()?;
        let b = reg.bucket(bucket)?;
        let (ptr, len) = reg.grad_ptr(bucket.0);
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
        let (ptr, len) = reg.grad_ptr(bucket.0);
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::protocol(None, "null accumulator"))?;
        Ok((ptr, len))
    }

    /// Zeroes the accumulator of `bucket` (after the optimizer step, before
    /// the next publish). Under hybrid sharding over several nodes it first
    /// waits until the other nodes have read this rank's partial sums.
    pub fn zero_grad(&self, bucket: BucketId) -> Result<()> {
        let reg = self.reg()?;
        let b = reg.bucket(bucket)?;
        self.wait_partials_read(reg, Some(b.name()))?;
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
