//! [`Host`]: the worker API of an engine whose data lives in host memory
//! (`shm`, `fabric`, `mixed`). Data moves through the transport on the
//! calling thread; this rank's own slice of a push goes to its own server
//! by pointer ([`crate::protocol::handoff`]).

use std::ptr::NonNull;

use odc_kernels::DType;

use super::{buffer_len_error, elems_of, ChunkPut, DataPath, ShardRead, Signals, Worker};
use crate::control::HEADER_BYTES;
use crate::engine::{BucketId, Core, PushState, Registered};
use crate::protocol::claims::{Claim, Word};
use crate::protocol::handoff::OwnSlice;
use crate::protocol::slots::slot_count;
use crate::region::{Bell, SignalRef};
use crate::sync::Ordering;
use crate::transport::Op;
use crate::{Error, Result};

/// Host memory through the transport, on the calling thread.
pub(super) struct HostPath<'e> {
    pub(super) core: &'e Core,
}

impl DataPath for HostPath<'_> {
    unsafe fn write_shard(
        &self,
        reg: &Registered,
        bucket: usize,
        at: usize,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the destination is this rank's shard inside the params
        // region (offset and length fixed at registration); the caller
        // vouches for `src`, a host pointer to `bytes` bytes.
        unsafe {
            odc_kernels::cpu::copy_raw_cached(
                reg.params.as_ptr().add(reg.params_off[bucket] + at),
                src as usize as *const u8,
                bytes,
            )
        };
        Ok(())
    }

    fn announce(&self, signals: Signals) -> Result<()> {
        signals.send()
    }

    unsafe fn read_shard(
        &self,
        reg: &Registered,
        rank: usize,
        bucket: usize,
        at: usize,
        dst: u64,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller vouches for `dst`, a host pointer to `len`
        // writable bytes borrowed for this call.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst as usize as *mut u8, len) };
        self.count_across(reg, rank, len);
        self.core.transport.get(
            rank,
            &reg.peer_params[rank],
            reg.params_off[bucket] + at,
            dst,
        )
    }

    unsafe fn put_chunk(
        &self,
        reg: &Registered,
        rank: usize,
        slot: usize,
        header: [u8; HEADER_BYTES],
        src: u64,
        len: usize,
        seq: u64,
    ) -> Result<()> {
        let lay = &reg.ctrl_layout;
        let me = reg.groups.me;
        let sig = SignalRef {
            offset: lay.slot_signal(me, slot),
            bell: Bell::Server,
        };
        // SAFETY: the caller vouches for `src`, a host pointer to `len`
        // readable bytes borrowed for this call.
        let data = unsafe { std::slice::from_raw_parts(src as usize as *const u8, len) };
        self.core.transport.put_signal(
            rank,
            &reg.peer_ctrl[rank],
            lay.slot_header(me, slot),
            &[&header, data],
            sig,
            slot_count(seq),
        )
    }

    unsafe fn zero_sums(&self, dst: u64, bytes: usize) -> Result<()> {
        // SAFETY: a host pointer, per the caller's contract.
        unsafe { std::ptr::write_bytes(dst as usize as *mut u8, 0, bytes) };
        Ok(())
    }

    unsafe fn copy_in_node(&self, src: u64, dst: u64, len: usize) -> Result<()> {
        // SAFETY: host pointers, per the caller's contract.
        unsafe {
            odc_kernels::cpu::copy_raw(dst as usize as *mut u8, src as usize as *const u8, len)
        };
        Ok(())
    }

    unsafe fn read_shards(
        &self,
        reg: &Registered,
        reads: &mut dyn Iterator<Item = ShardRead>,
    ) -> Result<()> {
        let mut ops = reads.map(|r| {
            self.count_across(reg, r.rank, r.len);
            Self::get_op(reg, r)
        });
        // SAFETY: the caller vouches for every destination (host pointers)
        // until this returns, which is after every read completed.
        unsafe { self.core.transport.run_batch(&mut ops) }
    }

    unsafe fn put_chunks(
        &self,
        reg: &Registered,
        puts: &mut dyn Iterator<Item = ChunkPut>,
    ) -> Result<()> {
        let mut ops = puts.map(|p| Self::put_op(reg, p));
        // SAFETY: the caller vouches for every header and source (host
        // pointers) until this returns, which is after every write
        // completed.
        unsafe { self.core.transport.run_batch(&mut ops) }
    }
}

impl HostPath<'_> {
    /// Counts a read of `len` bytes of global rank `rank`'s shards into
    /// the bytes read across nodes when `rank` is on another node.
    fn count_across(&self, reg: &Registered, rank: usize, len: usize) {
        if !self.core.topo.is_local(rank) {
            reg.read_across.fetch_add(len as u64, Ordering::Relaxed);
        }
    }

    /// A gather's read as a transport operation.
    fn get_op(reg: &Registered, r: ShardRead) -> Op {
        Op::Get {
            peer: r.rank,
            remote: reg.peer_params[r.rank],
            offset: reg.params_off[r.bucket] + r.at,
            dst: r.dst as usize as *mut u8,
            len: r.len,
        }
    }

    /// A push's chunk as a transport operation: header and data into the
    /// slot, counted into its signal.
    fn put_op(reg: &Registered, p: ChunkPut) -> Op {
        let (lay, me) = (&reg.ctrl_layout, reg.groups.me);
        Op::Put {
            peer: p.rank,
            remote: reg.peer_ctrl[p.rank],
            offset: lay.slot_header(me, p.slot),
            parts: [
                (p.header.cast::<u8>(), HEADER_BYTES),
                (p.src as usize as *const u8, p.len),
            ],
            signal: SignalRef {
                offset: lay.slot_signal(me, p.slot),
                bell: Bell::Server,
            },
            value: slot_count(p.seq),
        }
    }
}

fn addr(bytes: &[u8]) -> u64 {
    bytes.as_ptr() as usize as u64
}

/// The worker calls of an engine whose data lives in host memory, from
/// [`crate::Engine::host`]. Buffers are byte views of f32 / bf16 / f16
/// elements ([`crate::bytes_of`]).
#[derive(Clone, Copy, Debug)]
pub struct Host<'e> {
    pub(super) w: Worker<'e>,
}

impl<'e> Host<'e> {
    pub(crate) fn new(core: &'e Core, reg: &'e Registered) -> Host<'e> {
        Host {
            w: Worker { core, reg },
        }
    }

    fn path(&self) -> HostPath<'e> {
        HostPath { core: self.w.core }
    }

    /// Publishes this rank's shard of `bucket` as `version` (param dtype,
    /// exactly `shard_len` elements). Waits first until every client has
    /// released `version − 1` (by [`release`](Self::release) or
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
        // SAFETY: `shard` is borrowed for the call and the host path copies
        // it before returning.
        unsafe {
            self.w.publish(
                &self.path(),
                bucket,
                (addr(shard), shard.len(), dtype),
                version,
            )
        }
    }

    /// Gathers `version` of the full `bucket` into `out` (param dtype;
    /// `numel` or `D * shard_len` elements): for every owner, waits until
    /// its shard holds `version`, then reads it. A newer version at an owner
    /// is a protocol error (this reader missed a release).
    pub fn gather(
        &self,
        bucket: BucketId,
        version: u64,
        out: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        self.gather_into(bucket, version, out, dtype, false)
    }

    /// Like [`gather`](Self::gather) but leaves this rank's own shard range
    /// of `out` untouched, for callers that already copied their shard in
    /// (FSDP's copy-in); only the D − 1 remote shards move.
    pub fn gather_remote(
        &self,
        bucket: BucketId,
        version: u64,
        out: &mut [u8],
        dtype: DType,
    ) -> Result<()> {
        self.gather_into(bucket, version, out, dtype, true)
    }

    fn gather_into(
        &self,
        bucket: BucketId,
        version: u64,
        out: &mut [u8],
        dtype: DType,
        skip_own: bool,
    ) -> Result<()> {
        let out = (addr(out), out.len(), dtype);
        // SAFETY: `out` is borrowed mutably for the call; the host path
        // writes it before returning.
        unsafe { self.w.gather(&self.path(), bucket, version, out, skip_own) }
    }

    /// Declares that this client is done reading `version` of `bucket`, so
    /// its owners may publish `version + 1`.
    /// [`finish_minibatch(k)`](Self::finish_minibatch) implies
    /// `release(b, k)` for every bucket.
    pub fn release(&self, bucket: BucketId, version: u64) -> Result<()> {
        self.w.release(&self.path(), bucket, version)
    }

    /// Pushes the full-bucket gradient `grads` (`numel` or `D * shard_len`
    /// elements of `dtype`, which may differ from the parameter dtype) so
    /// that every owner adds `scale · grads[its shard]` into its
    /// accumulator. Returns once every chunk is written into a landing slot
    /// and this rank's own slice is added, without waiting for the peers'
    /// acknowledgements.
    pub fn scatter_accumulate(
        &self,
        bucket: BucketId,
        grads: &[u8],
        dtype: DType,
        scale: f32,
    ) -> Result<()> {
        let b = self.w.reg.bucket(bucket)?;
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
        let (core, reg) = (self.w.core, self.w.reg);
        let b = reg.bucket(bucket)?;
        let (mut guard, own) = self.w.start_push(b, bucket, offset, grads.len(), dtype)?;
        let push = &mut *guard;
        let src = (addr(grads), offset, dtype);
        if own.is_empty() {
            // SAFETY: `grads` is borrowed for the call; the host path writes
            // every chunk before returning.
            return unsafe {
                self.w
                    .push_chunks(&self.path(), push, b, bucket, src, scale)
            };
        }
        // This rank's own slice goes to its own server as a pointer into
        // `grads` (see `protocol::handoff`), not through a landing slot: one
        // post per run contiguous in `grads` (one unless the layout is
        // blocked, hybrid-zero), the first overlapping the pushes.
        let mut runs = Vec::new();
        let mut at = own.start;
        while at < own.end {
            let end = b.block_end(at).min(own.end);
            runs.push(at..end);
            at = end;
        }
        let size = dtype.size_bytes();
        let post = |push: &mut PushState, run: &std::ops::Range<usize>| {
            let first = b.global_of(reg.groups.me, run.start) - offset;
            let bytes = &grads[first * size..(first + run.len()) * size];
            push.own_gen += 1;
            core.own.post(
                push.own_gen,
                OwnSlice {
                    bucket: bucket.0,
                    offset: run.start,
                    len: run.len(),
                    addr: bytes.as_ptr() as usize,
                    dtype: dtype.as_u8(),
                    scale,
                },
            );
            core.transport.ring(Bell::Server);
            push.own_gen
        };
        let wait_own = |gen: u64| {
            let added = core.wait(
                Some(b.name()),
                &|| "its own server to add this rank's own slice".to_owned(),
                || Ok((!core.own.is_done(gen)).then_some(core.topo.rank())),
            );
            if added.is_err() {
                // `grads` is borrowed only for this call.
                core.own.revoke(gen);
            }
            added
        };
        let gen = post(push, &runs[0]);
        // SAFETY: as above.
        let pushed = unsafe {
            self.w
                .push_chunks(&self.path(), push, b, bucket, src, scale)
        };
        if pushed.is_err() {
            core.own.revoke(gen);
            return pushed;
        }
        wait_own(gen)?;
        for run in &runs[1..] {
            let gen = post(push, run);
            wait_own(gen)?;
        }
        Ok(())
    }

    /// Work stealing: claims this rank's next microbatch of minibatch `k`
    /// (of `count` in its list). The first claim of `k` starts it (earlier
    /// minibatches can no longer be claimed); see
    /// [`crate::protocol::claims`].
    pub fn claim_own(&self, k: u64, count: u64) -> Result<Claim> {
        self.w.claim_own(k, count)
    }

    /// Work stealing: claims one of global rank `victim`'s unclaimed
    /// microbatches of minibatch `k` (from the back of its list), through
    /// its daemon; waits for the answer within the deadline.
    pub fn steal(&self, victim: usize, k: u64) -> Result<Claim> {
        self.w.steal(victim, k)
    }

    /// Work stealing: global rank `rank`'s claim word as it reads now (its
    /// minibatch and unclaimed range; a hint, not a claim).
    pub fn claims_of(&self, rank: usize) -> Result<Word> {
        self.w.claims_of(rank)
    }

    /// Ends minibatch `k` for this client and waits for this rank's own
    /// gradient shards to be final: waits until every push is acknowledged,
    /// releases every bucket at version `k`, writes `done = k` into every
    /// owner's control region, then waits until every client's done word
    /// here reads at least `k`. No barrier: a fast rank returns as soon as
    /// its own shards are complete.
    pub fn finish_minibatch(&self, k: u64) -> Result<()> {
        self.w.finish(&self.path(), k)
    }

    /// Copies this rank's gradient shard of `bucket` (f32, `shard_len`
    /// elements; under hybrid sharding over several nodes the cross-node
    /// sum) into `out`. Meaningful after
    /// [`finish_minibatch`](Self::finish_minibatch).
    pub fn read_grad_shard(&self, bucket: BucketId, out: &mut [f32]) -> Result<()> {
        let reg = self.w.reg;
        let b = reg.bucket(bucket)?;
        let (ptr, len) = reg.grad_ptr(bucket.0);
        if out.len() != len {
            return Err(buffer_len_error(b, out.len(), len));
        }
        // SAFETY: `ptr` is valid for `len` f32s; the server writes it only
        // while pushes are in flight, which the protocol orders before this.
        unsafe {
            odc_kernels::cpu::copy_raw_cached(
                out.as_mut_ptr().cast::<u8>(),
                ptr.cast::<u8>(),
                len * std::mem::size_of::<f32>(),
            )
        };
        Ok(())
    }

    /// This rank's gradient shard of `bucket`: a pointer to `shard_len` f32s
    /// valid for the engine's lifetime (for zero-copy optimizer steps from
    /// Python). Access it only between `finish_minibatch` and the next
    /// publish.
    pub fn grad_shard_ptr(&self, bucket: BucketId) -> Result<(NonNull<f32>, usize)> {
        let reg = self.w.reg;
        reg.bucket(bucket)?;
        let (ptr, len) = reg.grad_ptr(bucket.0);
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::protocol(None, "null accumulator"))?;
        Ok((ptr, len))
    }

    /// Zeroes the accumulator of `bucket` (after the optimizer step, before
    /// the next publish; in deterministic mode its exact sum too: until
    /// then every finish reads out the exact sum since the last zeroing). Under hybrid sharding over several nodes it first
    /// waits until the other nodes have read this rank's partial sums, and with compressed sums and error feedback
    /// keeps what the last quantised copies did not carry of them as the residual (the sums are consumed now).
    pub fn zero_grad(&self, bucket: BucketId) -> Result<()> {
        let reg = self.w.reg;
        let b = reg.bucket(bucket)?;
        self.w.wait_partials_read(Some(b.name()))?;
        self.w.settle_partials(bucket.0)?;
        let (ptr, len) = reg.accum_ptr(bucket.0);
        // SAFETY: as in `read_grad_shard`; all-zero bits are 0.0f32.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        if let Some(exact) = &reg.exact {
            // SAFETY: the exact accumulator has the f32 one's element
            // offsets and length, and the same window (the daemon adds
            // into it only after the open below); all-zero bits are 0.
            unsafe { std::ptr::write_bytes(reg.exact_at(exact, reg.accum_off[bucket.0]), 0, len) };
            exact.touched[bucket.0].store(false, Ordering::Release);
        }
        self.w.open_accumulators(Some(bucket))
    }

    /// Hybrid sharding over several nodes: waits until every other node
    /// has read this rank's partial sums of the last finished minibatch
    /// (what [`zero_grad`](Self::zero_grad) waits for first), without
    /// changing them: after it this rank may hold them, or exit, without a
    /// peer still reading. Returns at once otherwise.
    pub fn wait_partials_read(&self) -> Result<()> {
        self.w.wait_partials_read(None)
    }

    /// Zeroes every accumulator.
    pub fn zero_grads(&self) -> Result<()> {
        (0..self.w.reg.buckets.len()).try_for_each(|b| self.zero_grad(BucketId(b)))
    }
}
