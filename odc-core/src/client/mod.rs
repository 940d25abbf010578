//! The worker API: publish, gather, release, scatter-accumulate, finish a
//! minibatch, and read or zero the gradients.
//!
//! The protocol's steps are written once (`Worker`), over a `DataPath`
//! that moves the data: [`Host`] moves host memory through the transport
//! on the calling thread; [`Device`] moves device memory on the caller's
//! stream, with the signals that announce data sent by work on the stream
//! after it. The engine hands out the handle of its kind once
//! ([`crate::Engine::host`], [`crate::Engine::device`]), so a host call on
//! a device engine cannot be written.
//!
//! Every wait here is on a word of this rank's own control region that a
//! peer sets with `put_signal` (see [`crate::control`]); every wait is a
//! causal edge, never a barrier. The rules are [`crate::protocol`]'s.
//!
//! This module depends on the engine's state and on the protocol, never on
//! the server daemon.

mod device;
mod host;
mod hybrid;
mod signals;
mod steal;

use std::ops::Range;
use std::sync::MutexGuard;

use odc_kernels::DType;

pub use device::Device;
pub use host::Host;
pub(crate) use signals::Signals;

use crate::control::{SlotHeader, HEADER_BYTES};
use crate::engine::{load, BucketId, Core, PushState, Registered};
use crate::layout::BucketLayout;
use crate::protocol::{admit, finish, versions};
use crate::region::Bell;
use crate::sync::Ordering;
use crate::{Error, Result};

/// How a worker call moves data. Addresses are host pointers on the host
/// path and device addresses on the device path; the handles build them
/// from what their callers gave them.
pub(crate) trait DataPath {
    /// Copies `bytes` at `src` into this rank's published shard of `bucket`,
    /// from byte `at` of the shard on.
    ///
    /// # Safety
    /// `src` addresses `bytes` readable bytes that stay valid until the copy
    /// has run; `at + bytes` fits the shard; every reader released the
    /// previous version.
    unsafe fn write_shard(
        &self,
        reg: &Registered,
        bucket: usize,
        at: usize,
        src: u64,
        bytes: usize,
    ) -> Result<()>;

    /// Sends `signals` once the data this path moved before them arrived.
    fn announce(&self, signals: Signals) -> Result<()>;

    /// Copies `len` bytes of global rank `rank`'s published shard of
    /// `bucket`, from byte `at` of the shard on, into `dst`.
    ///
    /// # Safety
    /// `dst` addresses `len` writable bytes valid until the copy has run,
    /// `at + len` fits the shard, and the owner's shard holds the version
    /// being gathered.
    unsafe fn read_shard(
        &self,
        reg: &Registered,
        rank: usize,
        bucket: usize,
        at: usize,
        dst: u64,
        len: usize,
    ) -> Result<()>;

    /// Writes `header` and `len` bytes at `src` into landing slot `slot`
    /// of `rank`, then counts chunk `seq` into the slot's signal.
    ///
    /// # Safety
    /// The slot is free (its last chunk was acknowledged), `len` fits a
    /// slot, and `src` addresses `len` readable bytes valid until the
    /// write has run.
    #[allow(clippy::too_many_arguments)]
    unsafe fn put_chunk(
        &self,
        reg: &Registered,
        rank: usize,
        slot: usize,
        header: [u8; HEADER_BYTES],
        src: u64,
        len: usize,
        seq: u64,
    ) -> Result<()>;
}

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

/// A publish hands the engine one block: the shard, or under hybrid-zero
/// this rank's piece of it.
pub(crate) fn check_shard_len(bucket: &BucketLayout, bytes: usize) -> Result<()> {
    if bytes != bucket.block_bytes() {
        let what = if bucket.blocks() > 1 {
            "piece (hybrid-zero: this rank's 1/D of the bucket)"
        } else {
            "shard"
        };
        return Err(Error::layout(
            Some(bucket.name()),
            format!(
                "{what} is {bytes} bytes; expected {} ({} {} elements)",
                bucket.block_bytes(),
                bucket.block_len(),
                bucket.dtype()
            ),
        ));
    }
    Ok(())
}

fn buffer_len_error(b: &BucketLayout, got: usize, len: usize) -> Error {
    Error::layout(
        Some(b.name()),
        format!("gradient buffer holds {got} elements; the shard has {len}"),
    )
}

/// The protocol's steps on one rank's registered state, over any data path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Worker<'e> {
    pub(crate) core: &'e Core,
    pub(crate) reg: &'e Registered,
}

impl<'e> Worker<'e> {
    /// Publishes `bytes` at `src` as `version` of this rank's shard of
    /// `bucket`: waits until every reader released `version − 1` (and,
    /// hybrid, the other nodes read the partial sums), copies, announces.
    ///
    /// # Safety
    /// As [`DataPath::write_shard`] for `src`.
    pub(crate) unsafe fn publish(
        &self,
        path: &impl DataPath,
        bucket: BucketId,
        (src, bytes, dtype): (u64, usize, DType),
        version: u64,
    ) -> Result<()> {
        let reg = self.reg;
        let b = reg.bucket(bucket)?;
        check_dtype(b, dtype, "shard")?;
        check_shard_len(b, bytes)?;
        let _guard = self
            .core
            .publish_lock
            .lock()
            .map_err(|_| Error::protocol(Some(b.name()), "a publish panicked"))?;
        let stamp = self.publish_wait(b, bucket, version)?;
        // Past the wait for the other nodes' reads of the partial sums: a
        // publish ends the window in which the caller reads the gradients.
        self.open_accumulators(Some(bucket))?;
        let at = reg.piece() * b.block_bytes();
        // SAFETY: the caller vouches for `src`; the wait above is the rule.
        unsafe { path.write_shard(reg, bucket.0, at, src, bytes)? };
        if b.blocks() > 1 && reg.cross_node() {
            self.gather_pieces(b, bucket, stamp)?;
        }
        let offset = reg.ctrl_layout.seen_version(reg.groups.me, bucket.0);
        path.announce(Signals::new(self.core, reg, offset, stamp))
            .map_err(|e| self.core.attribute(Some(b.name()), e))
    }

    /// The part of a publish before the copy; returns the stamp to signal.
    fn publish_wait(&self, b: &BucketLayout, bucket: BucketId, version: u64) -> Result<u64> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let seen = load(reg.word(lay.seen_version(gs.me, bucket.0)));
        let stamp =
            versions::publish_stamp(seen, version).map_err(|e| version_error(b, e, None))?;
        self.core.wait(
            Some(b.name()),
            &|| {
                format!(
                    "every reader to release version {} before publishing {version}",
                    version.saturating_sub(1)
                )
            },
            || {
                let words = (0..gs.group.len()).map(|c| {
                    (
                        load(reg.word(lay.released(c, bucket.0))),
                        load(reg.word(lay.done(c))),
                    )
                });
                Ok(versions::unreleased_reader(words, version).map(|c| gs.group[c]))
            },
        )?;
        self.wait_partials_read(Some(b.name()))?;
        if b.blocks() > 1 && reg.cross_node() {
            self.wait_pieces_read(b, bucket, seen)?;
        }
        Ok(stamp)
    }

    /// Gathers `version` of the full bucket into `out` (`bytes` of `dtype`:
    /// `numel` or the padded length): for every owner, from this rank on,
    /// waits until its shard holds `version`, then reads its part. With
    /// `skip_own` the range this rank published (its shard, or its piece
    /// under hybrid-zero) is left as it is.
    ///
    /// # Safety
    /// As [`DataPath::read_shard`] for `out`.
    pub(crate) unsafe fn gather(
        &self,
        path: &impl DataPath,
        bucket: BucketId,
        version: u64,
        (out, bytes, dtype): (u64, usize, DType),
        skip_own: bool,
    ) -> Result<()> {
        let reg = self.reg;
        let b = reg.bucket(bucket)?;
        check_dtype(b, dtype, "output")?;
        let elems = b.check_full_len(elems_of(b, bytes, dtype, "output")?)?;
        let size = dtype.size_bytes() as u64;
        let (me, world) = (reg.groups.me, reg.groups.group.len());
        let piece = reg.piece();
        for step in 0..world {
            // `owner` indexes the shard group; `rank` is its global rank.
            let owner = (me + step) % world;
            let rank = reg.groups.group[owner];
            self.wait_shard(b, bucket, owner, version)?;
            for (n, (local, global, len)) in b.segments(owner).enumerate() {
                let (start, end) = (global.min(elems), (global + len).min(elems));
                if start == end || (skip_own && owner == me && n == piece) {
                    continue;
                }
                let dst = out + start as u64 * size;
                let at = local * size as usize;
                let len = (end - start) * size as usize;
                // SAFETY: the owner's shard holds `version` (waited above)
                // and stays unchanged until this client's release; the
                // checked length covers `[start, end)` of `out`.
                unsafe { path.read_shard(reg, rank, bucket.0, at, dst, len) }
                    .map_err(|e| self.core.attribute(Some(b.name()), e))?;
            }
        }
        Ok(())
    }

    /// Waits until `owner`'s (index in the shard group) shard of `bucket`
    /// holds `version`.
    fn wait_shard(
        &self,
        b: &BucketLayout,
        bucket: BucketId,
        owner: usize,
        version: u64,
    ) -> Result<()> {
        let reg = self.reg;
        let rank = reg.groups.group[owner];
        let word = reg.word(reg.ctrl_layout.seen_version(owner, bucket.0));
        let rule =
            || versions::shard(load(word), version).map_err(|e| version_error(b, e, Some(rank)));
        if rule()? == versions::Shard::Ready {
            return Ok(());
        }
        self.core.wait(
            Some(b.name()),
            &|| format!("version {version} of its shard"),
            || Ok((rule()? == versions::Shard::Pending).then_some(rank)),
        )
    }

    /// The signals that release `version` of `bucket` to every owner, or
    /// `None` when this client released it already.
    pub(crate) fn release_signals(
        &self,
        bucket: BucketId,
        version: u64,
    ) -> Result<Option<Signals>> {
        let reg = self.reg;
        reg.bucket(bucket)?;
        let stamp = version.saturating_add(1);
        if reg.released[bucket.0].fetch_max(stamp, Ordering::AcqRel) >= stamp {
            return Ok(None);
        }
        let offset = reg.ctrl_layout.released(reg.groups.me, bucket.0);
        Ok(Some(Signals::new(self.core, reg, offset, stamp)))
    }

    /// Declares this client done reading `version` of `bucket`.
    pub(crate) fn release(
        &self,
        path: &impl DataPath,
        bucket: BucketId,
        version: u64,
    ) -> Result<()> {
        match self.release_signals(bucket, version)? {
            Some(signals) => path
                .announce(signals)
                .map_err(|e| self.core.attribute(None, e)),
            None => Ok(()),
        }
    }

    /// The start of a push of `bytes` of `dtype` from element `offset` of
    /// bucket `b`: checks the range, takes the push lock, points every
    /// owner's cursor at its part, and takes this rank's own part out of
    /// them (it never goes through a landing slot); this rank's accumulator
    /// of the bucket takes the running minibatch from here on
    /// ([`Self::open_accumulators`]). Returns the lock and the
    /// own part, in elements of this rank's shard.
    pub(crate) fn start_push(
        &self,
        b: &BucketLayout,
        bucket: BucketId,
        offset: usize,
        bytes: usize,
        dtype: DType,
    ) -> Result<(MutexGuard<'e, PushState>, Range<usize>)> {
        let elems = elems_of(b, bytes, dtype, "gradient")?;
        let end = b.check_range(offset, elems)?;
        // This rank's own slice goes into its own accumulator right away.
        self.open_accumulators(Some(bucket))?;
        let mut push = self
            .core
            .push
            .lock()
            .map_err(|_| Error::protocol(Some(b.name()), "a push panicked"))?;
        for o in 0..self.reg.groups.group.len() {
            push.cursor[o] = b.shard_overlap(o, offset, end);
        }
        let own = std::mem::replace(&mut push.cursor[self.reg.groups.me], 0..0);
        Ok((push, own))
    }

    /// Pushes every peer's part of a gradient (per `push.cursor`) through
    /// the landing slots, round-robin over owners so that no single slow
    /// server stalls the rest; returns once every chunk is put.
    ///
    /// # Safety
    /// `grads` addresses the gradient (elements from `offset` of the padded
    /// bucket, covering every cursor), valid until the writes have run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn push_chunks(
        &self,
        path: &impl DataPath,
        push: &mut PushState,
        b: &BucketLayout,
        bucket: BucketId,
        (grads, offset, dtype): (u64, usize, DType),
        scale: f32,
    ) -> Result<()> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let (me, world) = (gs.me, gs.group.len());
        let size = dtype.size_bytes();
        let chunk = lay.chunk_bytes() / size;
        let bucket_u32 = u32::try_from(bucket.0).unwrap_or(u32::MAX);
        // The owner adds the chunks once its accumulator takes this minibatch.
        let minibatch = reg.finished.load(Ordering::Acquire);
        loop {
            let (mut pending, mut pushed) = (false, false);
            for step in 1..=world {
                let o = (me + step) % world;
                let range = push.cursor[o].clone();
                if range.is_empty() {
                    continue;
                }
                pending = true;
                let (slot, _) = push.slots[o].next();
                let Some((slot, seq)) = push.slots[o].ready(load(reg.word(lay.ack(o, slot))))
                else {
                    continue;
                };
                // A chunk never crosses a block: it is contiguous in `grads`.
                let len = range
                    .len()
                    .min(chunk)
                    .min(b.block_end(range.start) - range.start);
                let first = b.global_of(o, range.start) - offset;
                let header = SlotHeader {
                    seq,
                    bucket: bucket_u32,
                    dtype,
                    offset: range.start as u64,
                    len: len as u64,
                    scale,
                    minibatch,
                }
                .encode();
                let src = grads + (first * size) as u64;
                // SAFETY: the slot is free (`ready`), `len` elements fit a
                // chunk, and the caller vouches for `grads`.
                unsafe { path.put_chunk(reg, gs.group[o], slot, header, src, len * size, seq) }
                    .map_err(|e| self.core.attribute(Some(b.name()), e))?;
                push.slots[o].sent(slot, seq);
                push.cursor[o].start += len;
                pushed = true;
            }
            if !pending {
                return Ok(());
            }
            if !pushed {
                self.core.wait(
                    Some(b.name()),
                    &|| {
                        format!(
                            "acknowledgement of a landing slot (an owner adds minibatch \
                             {minibatch}'s pushes once it has started minibatch {minibatch})"
                        )
                    },
                    || {
                        let mut lagging = None;
                        for o in (0..world).filter(|&o| !push.cursor[o].is_empty()) {
                            let (slot, _) = push.slots[o].next();
                            if push.slots[o]
                                .ready(load(reg.word(lay.ack(o, slot))))
                                .is_some()
                            {
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
    /// gradient shards to be final: every push acknowledged, every bucket
    /// released at `k`, `done = k` written to every owner, then every
    /// client's done word here at `k`. No barrier.
    pub(crate) fn finish(&self, k: u64) -> Result<()> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let world = gs.group.len();
        // Every accumulator takes this minibatch's pushes (a rank that
        // published, zeroed or pushed nothing in it opens them here).
        self.open_accumulators(None)?;
        let stamp;
        {
            let guard = self
                .core
                .push
                .lock()
                .map_err(|_| Error::protocol(None, "a push panicked"))?;
            self.core.wait(
                None,
                &|| format!("acknowledgement of this rank's last pushes of minibatch {k}"),
                || {
                    Ok((0..world)
                        .find(|&o| {
                            let acks =
                                [load(reg.word(lay.ack(o, 0))), load(reg.word(lay.ack(o, 1)))];
                            !guard.slots[o].acknowledged(acks)
                        })
                        .map(|o| gs.group[o]))
                },
            )?;
            stamp = finish::done_stamp(reg.finished.load(Ordering::Acquire), k).map_err(
                |finish::FinishError::Backwards { k, earlier }| {
                    Error::protocol(
                        None,
                        format!("finish_minibatch({k}) after finish_minibatch({earlier})"),
                    )
                },
            )?;
            reg.finished.fetch_max(stamp, Ordering::AcqRel);
            for r in &reg.released {
                r.fetch_max(stamp, Ordering::AcqRel);
            }
            Signals::new(self.core, reg, lay.done(gs.me), stamp).send()?;
        }
        self.core.wait(
            None,
            &|| format!("its gradients of minibatch {k} (done = {k})"),
            || {
                let done = (0..world).map(|c| load(reg.word(lay.done(c))));
                Ok(finish::unfinished_client(done, stamp).map(|c| gs.group[c]))
            },
        )?;
        if let Some(e) = self.core.take_server_error() {
            return Err(Error::protocol(
                None,
                format!("the shard server rejected a push: {e}"),
            ));
        }
        self.drain_exact()?;
        if reg.cross_node() {
            self.reduce_across_nodes(k)?;
        }
        Ok(())
    }
}

impl Worker<'_> {
    /// Opens this rank's accumulator of `bucket` (every bucket: `None`) for
    /// the running minibatch: from here on the daemon adds the peers'
    /// chunks of this minibatch, which it held in their landing slots until
    /// now ([`admit`]). Called by the calls that end the window in which a
    /// caller reads the previous minibatch's gradients: a publish, a zeroing,
    /// a push, a finish. Under hybrid sharding across nodes it first waits
    /// until the other nodes have read this rank's partial sums. One load
    /// per bucket when open already.
    pub(crate) fn open_accumulators(&self, bucket: Option<BucketId>) -> Result<()> {
        let reg = self.reg;
        let running = reg.finished.load(Ordering::Acquire);
        let open = match bucket {
            Some(b) => &reg.open[b.0..=b.0],
            None => &reg.open[..],
        };
        if open.iter().all(|o| o.load(Ordering::Acquire) >= running) {
            return Ok(());
        }
        self.wait_partials_read(bucket.and_then(|b| reg.buckets.get(b.0)).map(|b| b.name()))?;
        for o in open {
            o.store(
                admit::opened(o.load(Ordering::Acquire), running),
                Ordering::Release,
            );
        }
        self.core.transport.ring(Bell::Server);
        Ok(())
    }

    /// Deterministic mode, once this rank's gradients of a minibatch are
    /// final: reads every exact accumulator the daemon added into out into
    /// the f32 one (what the optimizer, `read_grad_shard` and the other
    /// nodes read) and zeroes it. Does nothing otherwise.
    fn drain_exact(&self) -> Result<()> {
        let reg = self.reg;
        let Some(exact) = &reg.exact else {
            return Ok(());
        };
        for (b, bucket) in reg.buckets.iter().enumerate() {
            if !exact.touched[b].swap(false, Ordering::AcqRel) {
                continue; // all zero: nothing to add
            }
            let (acc, len) = reg.accum_ptr(b);
            let fixed = exact.at(reg.accum_off[b]);
            // SAFETY: every client's done word reads this minibatch, so the
            // daemon has added (and acknowledged) every push of it and
            // touches neither accumulator until a push of the next one,
            // which follows this rank's next publish.
            let (fixed, acc) = unsafe {
                (
                    std::slice::from_raw_parts_mut(fixed, len),
                    std::slice::from_raw_parts_mut(acc, len),
                )
            };
            odc_kernels::cpu::exact::drain_exact(fixed, acc)
                .map_err(|e| Error::protocol(Some(bucket.name()), e.to_string()))?;
        }
        Ok(())
    }
}

fn version_error(b: &BucketLayout, e: versions::VersionError, owner: Option<usize>) -> Error {
    let msg = match e {
        versions::VersionError::Reserved => "version u64::MAX is reserved".to_owned(),
        versions::VersionError::NotIncreasing { version, current } => {
            format!("publish of version {version} after version {current} (versions must increase)")
        }
        versions::VersionError::Newer { version, current } => format!(
            "gather of version {version}, but rank {} already published version {current}",
            owner.unwrap_or(usize::MAX)
        ),
    };
    Error::protocol(Some(b.name()), msg)
}
