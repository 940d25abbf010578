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

mod cache;
mod device;
mod host;
mod hybrid;
mod quantised;
mod rejoin;
mod signals;
mod steal;

use std::ops::Range;
use std::sync::MutexGuard;

use odc_kernels::DType;

pub use device::Device;
pub use host::Host;
pub(crate) use signals::Signals;

use crate::control::{SlotHeader, HEADER_BYTES};
use crate::engine::CrossNode;
use crate::engine::{load, BucketId, Core, NodeSums, Packer, PushState, Registered};
use crate::layout::BucketLayout;
use crate::plane::HostWork;
use crate::protocol::compress::{self, Compress};
use crate::protocol::{admit, finish, nodesum, versions};
use crate::region::Bell;
use crate::sync::Ordering;
use crate::topology::Topology;
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

    /// Copies `len` bytes from `src` to `dst`, both in this node's memory
    /// (a node-cache slot into a gather's output, addresses of the path's
    /// kind): before returning on the host, on the stream on a device.
    ///
    /// # Safety
    /// `src` and `dst` address `len` bytes each (readable, writable),
    /// valid until the copy ran, not overlapping.
    unsafe fn copy_in_node(&self, src: u64, dst: u64, len: usize) -> Result<()>;

    /// Zeroes `bytes` of a node buffer at `dst` (an address of the path's
    /// kind): before returning on the host; on a device on the daemon's
    /// stream, before every add enqueued there later.
    ///
    /// # Safety
    /// `dst` addresses `bytes` writable bytes of a node buffer that no add
    /// or read is still using.
    unsafe fn zero_sums(&self, dst: u64, bytes: usize) -> Result<()>;

    /// Runs `work` once every copy this path made so far ran: now on the
    /// host, on a device by work on the stream after them.
    fn then(&self, work: HostWork) -> Result<()> {
        work();
        Ok(())
    }

    /// Packs one compressed chunk of a push into staging cell `job.cell`
    /// and returns the chunk's address: on the host now, from the push's
    /// host buffers ([`Packer`]); a device path overrides it.
    ///
    /// # Safety
    /// `job.src` addresses `job.len` readable elements of `job.dtype`,
    /// valid until the chunk's write has run.
    unsafe fn pack(
        &self,
        reg: &Registered,
        b: &BucketLayout,
        packer: Option<&mut Packer>,
        job: Pack,
    ) -> Result<u64> {
        // SAFETY: the caller's contract.
        unsafe { pack_on_host(reg, b, packer, job) }
    }

    /// Whether the path's memory is a device's: [`DataPath::pack`] packs
    /// in device memory (the push keeps no host buffers for it then), and a
    /// compressed gather's staging is [`DataPath::device_staging`].
    fn on_device(&self) -> bool {
        false
    }

    /// Rewrites this rank's quantised copy of its shard of `bucket` after a
    /// publish wrote the shard (no-op without copies): on the host now
    /// ([`Worker::quantise_shard`]); a device path enqueues it.
    fn quantise_copy(&self, w: &Worker<'_>, bucket: usize) -> Result<()> {
        w.quantise_shard(bucket)
    }

    /// Dequantises the first `run.take` elements of the quantised run at
    /// `src` into `dst`: before returning on the host, on the stream on a
    /// device.
    ///
    /// # Safety
    /// `src` holds the run's chunk and `dst` `run.take` writable elements
    /// of `run.dtype` (addresses of the path's kind), valid until it ran.
    unsafe fn dequantise(&self, run: quantised::Run, src: u64, dst: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { quantised::dequantise_run(run, src, dst) }
    }

    /// A device path's staging for a compressed gather of `bucket` (device
    /// memory the engine keeps per bucket); `None` on the host, whose
    /// gathers take a host buffer from [`crate::engine::Quant`]'s pool.
    fn device_staging(&self, _reg: &Registered, _bucket: usize) -> Option<u64> {
        None
    }

    /// Every read `reads` yields ([`DataPath::read_shard`] each), with as
    /// many in flight at once as the transport takes; returns once all
    /// completed. The default makes them one after the other.
    ///
    /// # Safety
    /// As [`DataPath::read_shard`] for each read, until this returns.
    unsafe fn read_shards(
        &self,
        reg: &Registered,
        reads: &mut dyn Iterator<Item = ShardRead>,
    ) -> Result<()> {
        for r in reads {
            // SAFETY: the caller's contract, passed on.
            unsafe { self.read_shard(reg, r.rank, r.bucket, r.at, r.dst, r.len)? };
        }
        Ok(())
    }

    /// Every chunk `puts` yields ([`DataPath::put_chunk`] each), with as
    /// many in flight at once as the transport takes; returns once all
    /// were written. The default writes them one after the other.
    ///
    /// # Safety
    /// As [`DataPath::put_chunk`] for each chunk; each header pointer
    /// addresses its header until this returns.
    unsafe fn put_chunks(
        &self,
        reg: &Registered,
        puts: &mut dyn Iterator<Item = ChunkPut>,
    ) -> Result<()> {
        for p in puts {
            // SAFETY: the caller's contract, passed on (the header is read
            // here, before the write).
            unsafe {
                let header = *p.header;
                self.put_chunk(reg, p.rank, p.slot, header, p.src, p.len, p.seq)?
            };
        }
        Ok(())
    }
}

/// One read of a gather: `len` bytes of global rank `rank`'s published
/// shard of `bucket`, from byte `at` of the shard, into `dst` (an address
/// of the path's kind).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ShardRead {
    pub(crate) rank: usize,
    pub(crate) bucket: usize,
    pub(crate) at: usize,
    pub(crate) dst: u64,
    pub(crate) len: usize,
}

/// One chunk of a push: `header` and `len` bytes at `src` into landing
/// slot `slot` of global rank `rank`, counted as chunk `seq`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkPut {
    pub(crate) rank: usize,
    pub(crate) slot: usize,
    pub(crate) header: *const [u8; HEADER_BYTES],
    pub(crate) src: u64,
    pub(crate) len: usize,
    pub(crate) seq: u64,
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
        // Compressed gathers: the quantised copy (of the piece, under
        // hybrid-zero), before the announce below or the pieces' signals
        // make the version (and with it the copy) visible.
        path.quantise_copy(self, bucket.0)?;
        if b.blocks() > 1 && reg.cross_node() {
            self.gather_pieces(b, bucket, stamp)?;
        }
        let offset = reg.ctrl_layout.seen_version(reg.groups.me, bucket.0);
        path.announce(Signals::to(self.core, &reg.announce_to, offset, stamp))
            .map_err(|e| self.core.attribute(Some(b.name()), e))
    }

    /// The part of a publish before the copy; returns the stamp to signal.
    fn publish_wait(&self, b: &BucketLayout, bucket: BucketId, version: u64) -> Result<u64> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let seen = load(reg.word(lay.seen_version(gs.me, bucket.0)));
        let stamp =
            versions::publish_stamp(seen, version).map_err(|e| version_error(b, e, None))?;
        // Under node aggregation a remote reader's reads are released by its
        // node's aggregator for this rank.
        let local = self.core.topo.local_world();
        let releaser = |c: usize| match reg.sums {
            Some(_) => nodesum::releaser(gs.me, c, local),
            None => c,
        };
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
                        load(reg.word(lay.done(releaser(c)))),
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
        // Compressed gathers: peers' quantised copies land in staging, one
        // place per owner, before they are dequantised into `out`.
        // (Hybrid-zero's copies of pieces cross only at the publish.)
        // A host path takes a buffer from the pool (handed back below).
        let quant = reg.quant.as_ref().filter(|_| b.blocks() == 1);
        let mut held = None;
        let staging = quant.map(|q| {
            let copy = q.copies[bucket.0];
            let stride = copy.staging_stride();
            let base = match path.device_staging(reg, bucket.0) {
                Some(addr) => addr,
                None => held
                    .insert(q.take(stride * reg.groups.group.len()))
                    .as_mut_ptr() as u64,
            };
            Staging { base, stride, copy }
        });
        // SAFETY: the caller's contract; the staging buffer outlives the call.
        let done = unsafe {
            self.gather_with(
                path,
                (b, bucket),
                version,
                (out, elems, dtype),
                skip_own,
                staging,
            )
        };
        if let (Some(q), Some(buf)) = (quant, held) {
            q.put_back(buf);
        }
        done
    }

    /// [`gather`](Self::gather) of `elems` elements into `out`, with
    /// `staging` for reads of quantised copies.
    ///
    /// # Safety
    /// As [`gather`](Self::gather); `staging` addresses `stride` bytes per
    /// shard-group rank until this returns.
    unsafe fn gather_with(
        &self,
        path: &impl DataPath,
        (b, bucket): (&BucketLayout, BucketId),
        version: u64,
        (out, elems, dtype): (u64, usize, DType),
        skip_own: bool,
        staging: Option<Staging>,
    ) -> Result<()> {
        let reg = self.reg;
        let mut reads = GatherReads {
            w: self,
            b,
            bucket,
            version,
            out,
            elems,
            size: dtype.size_bytes(),
            skip_own,
            at: 0,
            seg: 0,
            blocked: None,
            error: None,
            staging,
            pending: Vec::new(),
        };
        let cached = reg
            .cache
            .as_ref()
            .filter(|_| version <= crate::protocol::cache::MAX_VERSION && b.blocks() == 1);
        if let Some(cache) = cached {
            // The other nodes' shards through the node cache; this node's
            // read while the cache's fetches are in flight.
            reads.at = reg.groups.group.len();
            let size = dtype.size_bytes();
            let mut remote = cache::CachedReads::new(
                self,
                cache,
                (b, bucket),
                version,
                (out, elems * size),
                staging,
            );
            let pass = cache::Pass {
                reads: &mut remote,
                path,
            };
            // SAFETY: as below for this node's reads; the cached reads
            // land in slots this rank claimed, or in `out` (or staging).
            let first = unsafe { path.read_shards(reg, &mut pass.chain(&mut reads)) }
                .map_err(|e| self.core.attribute(Some(b.name()), e));
            // SAFETY: `out` is valid for the call (the caller's contract).
            unsafe { remote.finish(path, first.is_ok()) }?;
            first?;
            // SAFETY: the batch completed; `out` as above.
            unsafe { reads.dequantise_pending(path) }?;
        }
        loop {
            // SAFETY: each read is of a shard that holds `version` (the
            // iterator checked it) and stays unchanged until this client's
            // release; the checked length covers `out`.
            unsafe { path.read_shards(reg, &mut reads) }
                .map_err(|e| self.core.attribute(Some(b.name()), e))?;
            if let Some(e) = reads.error.take() {
                return Err(e);
            }
            // SAFETY: the batch completed; `out` as above.
            unsafe { reads.dequantise_pending(path) }?;
            match reads.blocked.take() {
                Some(owner) => self.wait_shard(b, bucket, owner, version)?,
                None => return Ok(()),
            }
        }
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
        let word = reg.version_word(owner, bucket.0);
        let rule =
            || versions::shard(load(word), version).map_err(|e| version_error(b, e, Some(rank)));
        if rule()? == versions::Shard::Ready {
            return Ok(());
        }
        self.core.wait_via(
            Some(b.name()),
            &|| format!("version {version} of its shard"),
            &|o| reg.version_relay(o),
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
    /// server stalls the rest; returns once every chunk is put. Under node
    /// aggregation a part for an owner on another node goes to the owner's
    /// aggregator on this node ([`crate::protocol::nodesum`]).
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
        // The owner adds the chunks once its accumulator takes this minibatch.
        let minibatch = reg.finished.load(Ordering::Acquire);
        let via = reg.cross_node == CrossNode::Node;
        // SAFETY: the caller's contract.
        unsafe {
            self.push_from(
                path,
                push,
                (b, bucket),
                (Source::Bucket { grads, offset }, dtype),
                scale,
                (minibatch, via),
            )
        }
    }

    /// [`push_chunks`](Self::push_chunks) from `source`, stamped with
    /// `minibatch`, routed through the aggregators when `via`.
    ///
    /// # Safety
    /// `source` addresses every cursor's elements of `dtype`, valid until
    /// the writes have run.
    unsafe fn push_from(
        &self,
        path: &impl DataPath,
        push: &mut PushState,
        (b, bucket): (&BucketLayout, BucketId),
        (source, dtype): (Source, DType),
        scale: f32,
        (minibatch, via): (u64, bool),
    ) -> Result<()> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let world = gs.group.len();
        let local = self.core.topo.local_world();
        let packing = self
            .core
            .config
            .compress
            .as_ref()
            .filter(|c| c.push.is_some());
        let host_packing = !path.on_device();
        if let (Some(c), None, true) = (packing.and_then(|c| c.push), &push.packer, host_packing) {
            let slot = lay.chunk_bytes();
            let elems = compress::chunk_elems(c, slot).unwrap_or(0);
            let feedback = packing.is_some_and(|c| c.feedback);
            push.packer = Some(Packer::new(c, feedback, world, slot, elems));
        }
        let headers = push.headers.as_mut_ptr();
        loop {
            let mut round = PushRound {
                path,
                topo: &self.core.topo,
                compress: packing,
                error: None,
                reg,
                push: &mut *push,
                headers,
                b,
                bucket: u32::try_from(bucket.0).unwrap_or(u32::MAX),
                source,
                dtype,
                scale,
                minibatch,
                via: via.then_some(local),
                step: 1,
                pushed: false,
            };
            // SAFETY: every chunk's slot is free (`ready`), its length fits
            // a chunk, the caller vouches for the source, and each header
            // sits in `push.headers` at its (server, slot), untouched until
            // the slot is acknowledged.
            let put = unsafe { path.put_chunks(reg, &mut round) };
            if let Some(e) = round.error.take() {
                return Err(e);
            }
            put.map_err(|e| self.core.attribute(Some(b.name()), e))?;
            let pushed = round.pushed;
            if push.cursor.iter().all(|c| c.is_empty()) {
                return Ok(());
            }
            if !pushed {
                let server = |o: usize| match via {
                    true => nodesum::server(gs.me, o, local),
                    false => o,
                };
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
                            let s = server(o);
                            let (slot, _) = push.slots[s].next();
                            if push.slots[s]
                                .ready(load(reg.word(lay.ack(s, slot))))
                                .is_some()
                            {
                                return Ok(None);
                            }
                            lagging.get_or_insert(gs.group[s]);
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
    pub(crate) fn finish(&self, path: &impl DataPath, k: u64) -> Result<()> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let world = gs.group.len();
        // Every accumulator takes this minibatch's pushes (a rank that
        // published, zeroed or pushed nothing in it opens them here).
        self.open_accumulators(None)?;
        let stamp;
        {
            let mut guard = self
                .core
                .push
                .lock()
                .map_err(|_| Error::protocol(None, "a push panicked"))?;
            self.wait_acknowledged(&guard, &|| {
                format!("acknowledgement of this rank's last pushes of minibatch {k}")
            })?;
            stamp = finish::done_stamp(reg.finished.load(Ordering::Acquire), k).map_err(
                |finish::FinishError::Backwards { k, earlier }| {
                    Error::protocol(
                        None,
                        format!("finish_minibatch({k}) after finish_minibatch({earlier})"),
                    )
                },
            )?;
            let done = lay.done(gs.me);
            if let Some(sums) = &reg.sums {
                // Node aggregation: this node hears `done` now, the
                // replicas after this node's sums for them, and no one else
                // (`nodesum::releaser`).
                Signals::to(self.core, &reg.done_early, done, stamp).send()?;
                self.push_node_sums(path, &mut guard, sums, k, stamp)?;
            }
            reg.finished.fetch_max(stamp, Ordering::AcqRel);
            for r in &reg.released {
                r.fetch_max(stamp, Ordering::AcqRel);
            }
            let late = if reg.sums.is_some() {
                &reg.done_late
            } else {
                &reg.group_ctrl
            };
            Signals::to(self.core, late, done, stamp).send()?;
        }
        // Under node aggregation only this node and this rank's
        // aggregators on the other nodes push to it.
        let local = self.core.topo.local_world();
        let feeds = |c: usize| reg.sums.is_none() || nodesum::feeds(gs.me, c, local);
        self.core.wait(
            None,
            &|| format!("its gradients of minibatch {k} (done = {k})"),
            || {
                let done = (0..world)
                    .filter(|&c| feeds(c))
                    .map(|c| (c, load(reg.word(lay.done(c)))));
                Ok(done
                    .filter(|&(_, w)| w < stamp)
                    .map(|(c, _)| gs.group[c])
                    .next())
            },
        )?;
        if let Some(e) = self.core.take_server_error() {
            return Err(Error::protocol(
                None,
                format!("the shard server rejected a push: {e}"),
            ));
        }
        if reg.cross_node() {
            // Deterministic: the cross-node sum reads every node's exact
            // sums itself (this rank's f32 accumulator keeps only spills).
            self.reduce_across_nodes(k)?;
        } else {
            self.read_exact()?;
        }
        Ok(())
    }
}

impl Worker<'_> {
    /// Waits until every chunk this client pushed is acknowledged.
    fn wait_acknowledged(&self, push: &PushState, what: &dyn Fn() -> String) -> Result<()> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        self.core.wait(None, what, || {
            Ok((0..gs.group.len())
                .find(|&o| {
                    let acks = [load(reg.word(lay.ack(o, 0))), load(reg.word(lay.ack(o, 1)))];
                    !push.slots[o].acknowledged(acks)
                })
                .map(|o| gs.group[o]))
        })
    }

    /// Node aggregation, at this rank's finish of minibatch `k` (its
    /// `done` stamp `stamp` sent to its node): once every node-mate's done
    /// word here reads `k` (their chunks of `k` for this rank's replicas are
    /// in the node buffers), pushes each buffer that holds anything to its
    /// owner as chunks of minibatch `k`, waits for their acknowledgement,
    /// clears them and opens the buffers for minibatch `k + 1`
    /// ([`crate::protocol::nodesum`]).
    fn push_node_sums(
        &self,
        path: &impl DataPath,
        push: &mut PushState,
        sums: &NodeSums,
        k: u64,
        stamp: u64,
    ) -> Result<()> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let (local, me) = (sums.local, gs.me);
        let first = (me / local) * local;
        self.core.wait(
            None,
            &|| format!("every node-mate's pushes of minibatch {k}, before the node's sums go"),
            || {
                let done = (first..first + local).map(|c| load(reg.word(lay.done(c))));
                Ok(nodesum::sums_ready(done, stamp).map(|i| gs.group[first + i]))
            },
        )?;
        let replicas: Vec<usize> = (0..sums.nodes)
            .filter(|&n| n != sums.node)
            .map(|n| n * local + me % local)
            .collect();
        for (bi, b) in reg.buckets.iter().enumerate() {
            let mut any = false;
            for &o in &replicas {
                let full = sums.touched(o, bi).load(Ordering::Acquire);
                push.cursor[o] = if full { 0..b.shard_len() } else { 0..0 };
                any |= full;
            }
            if !any {
                continue;
            }
            // SAFETY: the buffers hold `shard_len` f32s per bucket and
            // replica, untouched by the daemon until they are opened for
            // `k + 1` below (its node-mates' chunks of `k + 1` wait in their
            // slots), and the acknowledgements are awaited before that.
            unsafe {
                self.push_from(
                    path,
                    push,
                    (b, BucketId(bi)),
                    (Source::Sums, DType::F32),
                    1.0,
                    (k, false),
                )?
            };
        }
        self.wait_acknowledged(push, &|| {
            format!("acknowledgement of this node's sums of minibatch {k}")
        })?;
        for (bi, _) in reg.buckets.iter().enumerate() {
            for &o in &replicas {
                if sums.touched(o, bi).swap(false, Ordering::AcqRel) {
                    let len = reg.buckets[bi].shard_len();
                    // SAFETY: the buffer's `len` f32s, acknowledged (read by
                    // the owner's daemon) and not yet open to new chunks.
                    unsafe { path.zero_sums(sums.addr(o, reg.accum_off[bi], 0), len * 4)? };
                }
            }
        }
        sums.open.store(
            admit::opened(sums.open.load(Ordering::Acquire), k + 1),
            Ordering::Release,
        );
        self.core.transport.ring(Bell::Server);
        Ok(())
    }

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

    /// Deterministic mode on one node, once this rank's gradients of a
    /// minibatch are final: reads every exact accumulator the daemon added
    /// into since the last read out into the f32 one (what the optimizer
    /// and `read_grad_shard` read), rounded once. (Across nodes the
    /// cross-node sum reads the exact sums instead.) The exact sums stay: a minibatch finished again
    /// before a zeroing gives the exact sum of both, rounded once. Does
    /// nothing otherwise.
    fn read_exact(&self) -> Result<()> {
        let reg = self.reg;
        let Some(exact) = &reg.exact else {
            return Ok(());
        };
        for (b, bucket) in reg.buckets.iter().enumerate() {
            if !exact.touched[b].swap(false, Ordering::AcqRel) {
                continue; // nothing added since the last read
            }
            let (acc, len) = reg.accum_ptr(b);
            let fixed = reg.exact_at(exact, reg.accum_off[b]);
            // SAFETY: every client's done word reads this minibatch, so the
            // daemon has added (and acknowledged) every push of it and
            // touches neither accumulator until a push of the next one,
            // which follows this rank's next publish.
            let (fixed, acc) = unsafe {
                (
                    std::slice::from_raw_parts(fixed, len),
                    std::slice::from_raw_parts_mut(acc, len),
                )
            };
            odc_kernels::cpu::exact::read_exact(fixed, acc)
                .map_err(|e| Error::protocol(Some(bucket.name()), e.to_string()))?;
        }
        Ok(())
    }
}

/// The reads of a gather, in the order they are posted: the owners on
/// other nodes first (their reads in flight while this node's shards are
/// copied), then this node's, each pass from this rank on; one read per
/// run contiguous in the output. It stops at an owner whose shard does not
/// hold the version yet (`blocked`, which the gather waits for before it
/// goes on from there) or at a protocol error (`error`).
struct GatherReads<'w, 'e> {
    w: &'w Worker<'e>,
    b: &'w BucketLayout,
    bucket: BucketId,
    version: u64,
    out: u64,
    elems: usize,
    size: usize,
    skip_own: bool,
    /// Pass (0: other nodes, 1: this node) × world + step from this rank.
    at: usize,
    /// The owner's next segment.
    seg: usize,
    blocked: Option<usize>,
    error: Option<Error>,
    /// Compressed gathers: where reads of quantised copies land.
    staging: Option<Staging>,
    /// Those reads in the batch being posted: (staging address, elements
    /// the output takes, where they go).
    pending: Vec<(u64, usize, u64)>,
}

/// A gather's staging for reads of quantised copies: `stride` bytes per
/// shard-group rank (its whole copy, `copy`) from `base` (8-aligned).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Staging {
    pub(crate) base: u64,
    pub(crate) stride: usize,
    pub(crate) copy: crate::protocol::compress::QuantCopy,
}

impl Staging {
    /// Where owner `owner`'s (index in the shard group) copy lands.
    pub(crate) fn of(&self, owner: usize) -> u64 {
        self.base + (owner * self.stride) as u64
    }
}

impl GatherReads<'_, '_> {
    /// Dequantises every quantised copy the last batch read into the
    /// output.
    ///
    /// # Safety
    /// The batch completed; the output is valid for the gather's call.
    unsafe fn dequantise_pending(&mut self, path: &impl DataPath) -> Result<()> {
        let Some(st) = self.staging else {
            return Ok(());
        };
        let dtype = self.b.dtype();
        for (src, take, dst) in self.pending.drain(..) {
            // SAFETY: the read of the copy's covering runs completed into
            // `src` (on a device: was enqueued before this on the stream);
            // `dst` holds `take` elements of the output.
            unsafe { quantised::dequantise_copy(path, &st.copy, (src, take), dst, dtype) }
                .map_err(|e| self.w.core.attribute(Some(self.b.name()), e))?;
        }
        Ok(())
    }

    /// The read of owner `owner`'s (global rank `rank`) quantised copy
    /// when this gather takes it: the runs covering the output's part of
    /// its shard, into staging (recorded in `pending`); `None` otherwise
    /// (and for a blocked layout, whose shard is not contiguous in the
    /// output: the engine makes no copies there).
    fn quantised_read(&mut self, owner: usize, rank: usize) -> Option<Option<ShardRead>> {
        let st = self.staging.filter(|_| self.b.blocks() == 1)?;
        let (me, topo) = (self.w.reg.groups.me, &self.w.core.topo);
        compress::gather_spec(
            self.w.core.config.compress.as_ref(),
            owner == me,
            topo.is_local(rank),
        )?;
        let (_, global, len) = self.b.segments(owner).next()?;
        let take = (global + len).min(self.elems).saturating_sub(global);
        if take == 0 {
            return Some(None);
        }
        let (_, bytes) = st.copy.covering(take);
        let dst = st.of(owner);
        self.pending
            .push((dst, take, self.out + (global * self.size) as u64));
        Some(Some(ShardRead {
            rank,
            bucket: self.bucket.0,
            at: quantised::copy_at(self.w.reg, self.bucket.0, 0),
            dst,
            len: bytes,
        }))
    }
}

impl Iterator for GatherReads<'_, '_> {
    type Item = ShardRead;

    fn next(&mut self) -> Option<ShardRead> {
        let reg = self.w.reg;
        let (me, world) = (reg.groups.me, reg.groups.group.len());
        while self.at < 2 * world {
            let (pass, step) = (self.at / world, self.at % world);
            let owner = (me + step) % world;
            let rank = reg.groups.group[owner];
            if (pass == 0) == self.w.core.topo.is_local(rank) {
                self.at += 1;
                continue;
            }
            if self.seg == 0 {
                let word = reg.version_word(owner, self.bucket.0);
                match versions::shard(load(word), self.version) {
                    Err(e) => {
                        self.error = Some(version_error(self.b, e, Some(rank)));
                        return None;
                    }
                    Ok(versions::Shard::Pending) => {
                        self.blocked = Some(owner);
                        return None;
                    }
                    Ok(versions::Shard::Ready) => {}
                }
                if let Some(read) = self.quantised_read(owner, rank) {
                    self.at += 1;
                    match read {
                        Some(read) => return Some(read),
                        None => continue,
                    }
                }
            }
            while let Some((local, global, len)) = self.b.segments(owner).nth(self.seg) {
                let n = self.seg;
                self.seg += 1;
                let (start, end) = (global.min(self.elems), (global + len).min(self.elems));
                if start == end || (self.skip_own && owner == me && n == reg.piece()) {
                    continue;
                }
                return Some(ShardRead {
                    rank,
                    bucket: self.bucket.0,
                    at: local * self.size,
                    dst: self.out + (start * self.size) as u64,
                    len: (end - start) * self.size,
                });
            }
            self.at += 1;
            self.seg = 0;
        }
        None
    }
}

/// Where a push's elements come from: a gradient buffer covering the
/// bucket from element `offset`, or (node aggregation) this rank's node
/// buffers.
#[derive(Clone, Copy, Debug)]
enum Source {
    Bucket { grads: u64, offset: usize },
    Sums,
}

/// One round of a push: for every owner from the next one on, a chunk into
/// each free landing slot of its server (the owner, or under node
/// aggregation its aggregator on this node), from its cursor on. Each
/// header is written into the server's header cell
/// (`headers[2 · server + slot]`), which stays untouched until the slot's
/// acknowledgement.
struct PushRound<'a, P> {
    /// Where compressed chunks are packed.
    path: &'a P,
    reg: &'a Registered,
    topo: &'a Topology,
    /// The compressed-chunk setting, when pushes are compressed.
    compress: Option<&'a Compress>,
    /// Why a chunk could not be compressed (the round stops there).
    error: Option<Error>,
    push: &'a mut PushState,
    headers: *mut [u8; HEADER_BYTES],
    b: &'a BucketLayout,
    bucket: u32,
    source: Source,
    dtype: DType,
    scale: f32,
    minibatch: u64,
    /// Node aggregation's node size: route through the aggregators.
    via: Option<usize>,
    /// Owners after this rank, from 1 to the world size.
    step: usize,
    pushed: bool,
}

impl<P> PushRound<'_, P> {
    /// The address of element `start` of owner `o`'s shard in the source.
    fn addr(&self, o: usize, start: usize) -> u64 {
        let size = self.dtype.size_bytes();
        match self.source {
            Source::Bucket { grads, offset } => {
                grads + ((self.b.global_of(o, start) - offset) * size) as u64
            }
            Source::Sums => {
                let (reg, b) = (self.reg, self.bucket as usize);
                match &reg.sums {
                    Some(sums) => sums.addr(reg.groups.group[o], reg.accum_off[b], start),
                    None => 0,
                }
            }
        }
    }
}

impl<P: DataPath> PushRound<'_, P> {
    /// Quantises `scale ·` elements `start..start + len` of owner `o`'s
    /// shard in the source (plus their residual, with error feedback) into
    /// staging cell `cell` (scales, then codes); returns the cell's address.
    fn pack(
        &mut self,
        spec: odc_kernels::cpu::quant::Spec,
        o: usize,
        cell: usize,
        start: usize,
        len: usize,
    ) -> Result<u64> {
        let job = Pack {
            spec,
            src: self.addr(o, start),
            dtype: self.dtype,
            scale: self.scale,
            len,
            key: (self.bucket as usize, o),
            start,
            cell,
        };
        // SAFETY: `push_from`'s caller vouches that the source holds every
        // cursor's elements, valid until the writes have run; the job reads
        // `len` of them from the cursor's start.
        unsafe {
            self.path
                .pack(self.reg, self.b, self.push.packer.as_mut(), job)
        }
    }
}

/// One compressed chunk of a push to pack ([`DataPath::pack`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pack {
    pub(crate) spec: odc_kernels::cpu::quant::Spec,
    /// `len` elements of `dtype`: the gradient of the chunk.
    pub(crate) src: u64,
    pub(crate) dtype: DType,
    pub(crate) scale: f32,
    pub(crate) len: usize,
    /// (bucket, owner in the shard group): whose residual it carries.
    pub(crate) key: (usize, usize),
    /// The chunk's first element in the owner's shard.
    pub(crate) start: usize,
    /// The staging cell (`2 · server + slot`).
    pub(crate) cell: usize,
}

/// [`DataPath::pack`] on the host.
///
/// # Safety
/// As [`DataPath::pack`].
unsafe fn pack_on_host(
    reg: &Registered,
    b: &BucketLayout,
    packer: Option<&mut Packer>,
    job: Pack,
) -> Result<u64> {
    let Pack { spec, len, .. } = job;
    let (shard, name) = (b.shard_len(), b.name());
    let kernel = |e: odc_kernels::Error| Error::protocol(Some(name), e.to_string());
    let packer =
        packer.ok_or_else(|| Error::protocol(Some(name), "compressed push without its buffers"))?;
    // SAFETY: the caller's contract.
    let data =
        unsafe { std::slice::from_raw_parts(job.src as *const u8, len * job.dtype.size_bytes()) };
    let values = &mut packer.values[..len];
    values.fill(0.0);
    odc_kernels::cpu::accumulate_into_f32(values, data, job.dtype, job.scale).map_err(kernel)?;
    let cell = &mut packer.staging[job.cell];
    let (scales, rest) = cell.split_at_mut(spec.scales(len));
    let payload = &mut crate::bytes_of_mut(rest)[..spec.payload_bytes(len)];
    match &mut packer.feedback {
        Some(fb) => {
            let key = job.key.0 * reg.groups.group.len() + job.key.1;
            fb.register(key, shard).map_err(kernel)?;
            fb.push(key, job.start, values, payload, scales)
                .map_err(kernel)?;
        }
        None => odc_kernels::cpu::quant::quantise(spec, values, payload, scales).map_err(kernel)?,
    }
    Ok(cell.as_ptr() as u64)
}

impl<P: DataPath> Iterator for PushRound<'_, P> {
    type Item = ChunkPut;

    fn next(&mut self) -> Option<ChunkPut> {
        let reg = self.reg;
        let (gs, lay) = (&reg.groups, &reg.ctrl_layout);
        let (me, world) = (gs.me, gs.group.len());
        let size = self.dtype.size_bytes();
        let chunk = lay.chunk_bytes() / size;
        while self.step <= world {
            let o = (me + self.step) % world;
            let srv = self.via.map_or(o, |local| nodesum::server(me, o, local));
            let range = self.push.cursor[o].clone();
            let (slot, _) = self.push.slots[srv].next();
            let ready = (!range.is_empty())
                .then(|| self.push.slots[srv].ready(load(reg.word(lay.ack(srv, slot)))))
                .flatten();
            let Some((slot, seq)) = ready else {
                self.step += 1;
                continue;
            };
            // Compressed: whole blocks that fit the slot (none fit: as is).
            let local = self.topo.is_local(gs.group[srv]);
            let packed = compress::push_spec(self.compress, local)
                .and_then(|spec| Some((spec, compress::chunk_elems(spec, lay.chunk_bytes())?)));
            // A chunk never crosses a block: it is contiguous in the source.
            let len = range
                .len()
                .min(packed.map_or(chunk, |(_, elems)| elems))
                .min(self.b.block_end(range.start) - range.start);
            let (src, bytes, dtype, scale) = match packed {
                None => (
                    self.addr(o, range.start),
                    len * size,
                    self.dtype,
                    self.scale,
                ),
                Some((spec, _)) => match self.pack(spec, o, 2 * srv + slot, range.start, len) {
                    // The factor went into the values before they were quantised.
                    Ok(src) => (src, spec.chunk_bytes(len), DType::F32, 1.0),
                    Err(e) => {
                        self.error = Some(e);
                        return None;
                    }
                },
            };
            let header = SlotHeader {
                seq,
                bucket: self.bucket,
                dtype,
                offset: range.start as u64,
                len: len as u64,
                scale,
                minibatch: self.minibatch,
                owner: (srv != o).then(|| u32::try_from(gs.group[o]).unwrap_or(u32::MAX)),
                compress: packed.map(|(spec, _)| spec),
            }
            .encode();
            if !local {
                self.push.sent_across += (HEADER_BYTES + bytes) as u64;
            }
            // SAFETY: `headers` holds 2 · world cells; this one's slot is
            // free, so no write still reads it.
            let cell = unsafe {
                let cell = self.headers.add(2 * srv + slot);
                cell.write(header);
                cell.cast_const()
            };
            self.push.slots[srv].sent(slot, seq);
            self.push.cursor[o].start += len;
            self.pushed = true;
            // Stay on this owner: its server's other slot may be free too.
            return Some(ChunkPut {
                rank: gs.group[srv],
                slot,
                header: cell,
                src,
                len: bytes,
                seq,
            });
        }
        None
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
