//! [`Device`]: the worker API of an engine whose data lives in device
//! memory (`cuda-ipc`, `nvshmem`, their emulations `emu-ipc`, `emu-shmem`):
//! the host calls' protocol, word for word, with the data moved on the
//! caller's stream (see [`crate::plane`] for what runs where). Only the
//! signals that announce data are sent by work on the stream after it,
//! instead of by the calling thread.

use std::sync::Arc;

use odc_kernels::DType;

use super::quantised::Run;
use super::{buffer_len_error, DataPath, Pack, Signals, Worker};
use crate::control::HEADER_BYTES;
use crate::engine::{record_error, BucketId, Core, Packer, Registered};
use crate::layout::BucketLayout;
use crate::plane::{DeviceOps, HostWork, PackJob, Plane, StreamHandle};
use crate::protocol::slots::slot_count;
use crate::region::{Bell, SignalRef};
use crate::Result;

/// Device memory on a stream.
struct DevicePath<'e> {
    core: &'e Core,
    plane: &'e dyn Plane,
    stream: StreamHandle,
}

impl DevicePath<'_> {
    /// Runs `work` (enqueues on the daemon's stream) after the work
    /// enqueued on the caller's stream so far, and makes the caller's later
    /// work wait for it: the daemon's stream is the one whose kernels the
    /// backend launches.
    fn on_server(&self, work: impl FnOnce(&dyn DeviceOps) -> Result<()>) -> Result<()> {
        let ops = self.plane.ops();
        let server = ops.server_stream();
        ops.order(server, self.stream)?;
        work(ops)?;
        ops.order(self.stream, server)
    }
}

impl DataPath for DevicePath<'_> {
    unsafe fn write_shard(
        &self,
        reg: &Registered,
        bucket: usize,
        at: usize,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        let dst = self.plane.local_params() + (reg.params_off[bucket] + at) as u64;
        // SAFETY: the destination is this rank's shard inside its params
        // region; the caller vouches for `src` and for the readers' release.
        unsafe { self.plane.ops().copy(self.stream, dst, src, bytes) }
    }

    fn announce(&self, signals: Signals) -> Result<()> {
        let errors = Arc::clone(&self.core.server_error);
        self.plane.ops().then(
            self.stream,
            Box::new(move || {
                if let Err(e) = signals.send() {
                    record_error(&errors, format!("a signal sent from a stream failed: {e}"));
                }
            }),
        )
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
        // SAFETY: the caller vouches for `dst` and for the owner's version,
        // which stays until this client's release, enqueued after this read.
        unsafe {
            self.plane
                .get_params(self.stream, dst, rank, reg.params_off[bucket] + at, len)
        }
    }

    unsafe fn pack(
        &self,
        reg: &Registered,
        b: &BucketLayout,
        _packer: Option<&mut Packer>,
        job: Pack,
    ) -> Result<u64> {
        let pack = reg.device_pack.as_ref().ok_or_else(|| {
            crate::Error::protocol(Some(b.name()), "compressed push without its device buffers")
        })?;
        let base = self.plane.local_landing();
        let (bucket, owner) = job.key;
        let residual = pack.residual(reg.accum_off[bucket], b, owner, job.start);
        if pack.feedback && residual.is_none() {
            // The layout keeps residuals for the owners the push rules
            // compress for; a chunk outside them would lose its feedback.
            return Err(crate::Error::protocol(
                Some(b.name()),
                format!(
                    "a compressed push to rank {} with error feedback, but no residual is kept \
                     for it",
                    reg.groups.group[owner]
                ),
            ));
        }
        let chunk = base + (pack.cells + job.cell * pack.cell_bytes) as u64;
        // The daemon's stream packs after the gradient was made, and the
        // caller's stream puts the chunk after that.
        self.on_server(|ops| {
            // SAFETY: the cell, the values and the residual lie past the
            // landing slots of this rank's landing region, laid out by
            // `DevicePack` (disjoint); the cell is free (its slot's last
            // chunk was acknowledged after the owner's add read it); the
            // values and the residual are used by the daemon's stream alone,
            // in order; the caller vouches for the source.
            unsafe {
                ops.pack_on_server(PackJob {
                    spec: job.spec,
                    src: job.src,
                    src_dtype: job.dtype,
                    scale: Some(job.scale),
                    n: job.len,
                    values: base + pack.values as u64,
                    residual: residual.map(|r| base + r as u64),
                    chunk,
                })
            }
        })?;
        Ok(chunk)
    }

    fn on_device(&self) -> bool {
        true
    }

    fn quantise_copy(&self, w: &Worker<'_>, bucket: usize) -> Result<()> {
        let reg = w.reg;
        let (Some(q), Some(dq)) = (&reg.quant, &reg.device_quant) else {
            return Ok(());
        };
        let b = &reg.buckets[bucket];
        let (copy, size) = (q.copies[bucket], b.dtype().size_bytes());
        let base = self.plane.local_params();
        // The daemon's stream quantises after the shard's copy on the
        // caller's stream, and the announce on that stream follows it.
        self.on_server(|ops| {
            (0..copy.runs()).try_for_each(|j| {
                let elems = copy.elems(j);
                // SAFETY: this rank's shard of `bucket`, its quantised copy
                // and the values scratch lie in its params region, disjoint
                // (`DeviceQuant`); every reader released the previous
                // version (the publish's wait), so nothing reads the copy;
                // the scratch is the daemon's stream's alone.
                unsafe {
                    ops.pack_on_server(PackJob {
                        spec: copy.spec,
                        src: base + (reg.params_off[bucket] + elems.start * size) as u64,
                        src_dtype: b.dtype(),
                        scale: None,
                        n: elems.len(),
                        values: base + dq.values as u64,
                        residual: None,
                        chunk: base + (q.off[bucket] + copy.at(j)) as u64,
                    })
                }
            })
        })
    }

    unsafe fn dequantise(&self, run: Run, src: u64, dst: u64) -> Result<()> {
        // SAFETY: the caller's contract; the daemon's stream runs it after
        // the read that brought the run (enqueued on the caller's stream
        // before this), and the caller's later work after it.
        self.on_server(|ops| unsafe {
            ops.dequantise_on_server(src, run.spec, run.len, run.take, dst, run.dtype)
        })
    }

    fn device_staging(&self, reg: &Registered, bucket: usize) -> Option<u64> {
        let dq = reg.device_quant.as_ref()?;
        Some(self.plane.local_params() + dq.staging[bucket] as u64)
    }

    unsafe fn copy_in_node(&self, src: u64, dst: u64, len: usize) -> Result<()> {
        // SAFETY: device addresses of this node (a node-mate's cache share
        // is mapped here), per the caller's contract.
        unsafe { self.plane.ops().copy(self.stream, dst, src, len) }
    }

    unsafe fn zero_sums(&self, dst: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract; the daemon's adds of the next
        // minibatch are enqueued on its stream after this.
        unsafe { self.plane.ops().zero_on_server(dst, bytes) }
    }

    fn then(&self, work: HostWork) -> Result<()> {
        self.plane.ops().then(self.stream, work)
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
        // SAFETY: the slot is free and holds `chunk_bytes` ≥ `len`; the
        // caller vouches for `src`.
        unsafe {
            self.plane
                .put_landing(self.stream, rank, lay.landing_data(me, slot), src, len)?
        };
        // The signal below announces the chunk: it must have arrived.
        self.plane.deliver(self.stream)?;
        let (transport, errors) = (
            Arc::clone(&self.core.transport),
            Arc::clone(&self.core.server_error),
        );
        let desc = reg.peer_ctrl[rank];
        let (at, sig) = (
            lay.slot_header(me, slot),
            SignalRef {
                offset: lay.slot_signal(me, slot),
                bell: Bell::Server,
            },
        );
        self.plane.ops().then(
            self.stream,
            Box::new(move || {
                if let Err(e) =
                    transport.put_signal(rank, &desc, at, &[&header], sig, slot_count(seq))
                {
                    record_error(&errors, format!("pushing a chunk to rank {rank}: {e}"));
                }
            }),
        )
    }
}

/// The worker calls of an engine whose data lives in device memory, from
/// [`crate::Engine::device`]. Buffers are device addresses of the engine's
/// device; every call enqueues its data movement on `stream` and returns
/// before it runs, as a kernel launch does.
#[derive(Clone, Copy, Debug)]
pub struct Device<'e> {
    w: Worker<'e>,
    plane: &'e dyn Plane,
}

impl<'e> Device<'e> {
    pub(crate) fn new(core: &'e Core, reg: &'e Registered, plane: &'e dyn Plane) -> Device<'e> {
        Device {
            w: Worker { core, reg },
            plane,
        }
    }

    fn path(&self, stream: StreamHandle) -> DevicePath<'e> {
        DevicePath {
            core: self.w.core,
            plane: self.plane,
            stream,
        }
    }

    /// Publishes the shard at device address `src` (`bytes` long) on
    /// `stream`: waits on the host until every reader released
    /// `version − 1`, then enqueues the copy into this rank's published
    /// shard and, after it, the version signal to every reader.
    ///
    /// # Safety
    /// `src` must address `bytes` readable bytes of the engine's device,
    /// valid until the copy enqueued on `stream` has run, and `stream` must
    /// be a stream of that device that outlives the call's work.
    pub unsafe fn publish(
        &self,
        bucket: BucketId,
        src: u64,
        bytes: usize,
        dtype: DType,
        version: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            self.w
                .publish(&self.path(stream), bucket, (src, bytes, dtype), version)
        }
    }

    /// Gathers into the device buffer at `out` (`bytes` long: `numel` or
    /// `D * shard_len` elements of the parameter dtype): waits on the host
    /// until each owner's shard holds `version`, and enqueues the copy of it
    /// on `stream`. [`release`](Self::release) on the same stream lets the
    /// owners publish again once the copies ran. With `skip_own`, this
    /// rank's own shard range of `out` is left alone (FSDP's copy-in).
    ///
    /// # Safety
    /// `out` must address `bytes` writable bytes of the engine's device,
    /// valid until the copies enqueued on `stream` have run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gather(
        &self,
        bucket: BucketId,
        version: u64,
        out: u64,
        bytes: usize,
        dtype: DType,
        stream: StreamHandle,
        skip_own: bool,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            self.w.gather(
                &self.path(stream),
                bucket,
                version,
                (out, bytes, dtype),
                skip_own,
            )
        }
    }

    /// Releases `version` of `bucket` once the work before it on `stream`
    /// (the gather's copies) has run.
    pub fn release(&self, bucket: BucketId, version: u64, stream: StreamHandle) -> Result<()> {
        self.w.release(&self.path(stream), bucket, version)
    }

    /// Pushes the device gradient at `grads` (`bytes` long, covering
    /// elements `[offset, ..)` of the padded bucket), produced on `stream`.
    /// Every peer's chunk is copied on `stream` into the owner's landing
    /// slot, and its signal follows it on the stream. This rank's own slice
    /// is added by the daemon's stream after `stream`'s work so far, and
    /// `stream` waits for that add before its later work (so `grads` may be
    /// reused after it). Returns once every chunk is enqueued (waiting on
    /// the host, as the host call does, whenever both of an owner's slots
    /// are in flight).
    ///
    /// # Safety
    /// `grads` must address `bytes` readable bytes of the engine's device,
    /// valid and unchanged until the work enqueued on `stream` has run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn scatter_accumulate(
        &self,
        bucket: BucketId,
        offset: usize,
        grads: u64,
        bytes: usize,
        dtype: DType,
        scale: f32,
        stream: StreamHandle,
    ) -> Result<()> {
        let (reg, plane) = (self.w.reg, self.plane);
        let b = reg.bucket(bucket)?;
        let (mut guard, own) = self.w.start_push(b, bucket, offset, bytes, dtype)?;
        if !own.is_empty() {
            let size = dtype.size_bytes();
            // Device engines are never blocked (registration refuses
            // hybrid-zero there): the own part is contiguous in `grads`.
            let first = b.global_of(reg.groups.me, own.start) - offset;
            let acc = reg.accum_addr(plane, bucket.0, own.start);
            // SAFETY: the range lies inside the bucket's accumulator (the
            // overlap of its shard); the daemon's stream runs it after the
            // caller's work so far, and the caller's stream waits for it.
            self.path(stream).on_server(|ops| unsafe {
                ops.accumulate_on_server(
                    acc,
                    grads + (first * size) as u64,
                    dtype,
                    own.len(),
                    scale,
                )
            })?;
        }
        // SAFETY: the caller's contract.
        unsafe {
            self.w.push_chunks(
                &self.path(stream),
                &mut guard,
                b,
                bucket,
                (grads, offset, dtype),
                scale,
            )
        }
    }

    /// Waits until the work enqueued on `stream` has run (the last gathers'
    /// copies, the last pushes' signals), then finishes minibatch `k` as the
    /// host call does. On return this rank's accumulators are final in
    /// device memory.
    pub fn finish_minibatch(&self, k: u64, stream: StreamHandle) -> Result<()> {
        self.plane.ops().synchronize(stream)?;
        self.w.finish(&self.path(stream), k)?;
        self.plane
            .ops()
            .synchronize(self.plane.ops().server_stream())
    }

    /// This rank's accumulator of `bucket`: its device address and length in
    /// f32 elements, valid for the engine's lifetime (the optimizer step
    /// reads it between a finish and the next publish).
    pub fn grad_shard(&self, bucket: BucketId) -> Result<(u64, usize)> {
        let len = self.w.reg.bucket(bucket)?.shard_len();
        Ok((self.w.reg.accum_addr(self.plane, bucket.0, 0), len))
    }

    /// Copies this rank's accumulator of `bucket` into host memory (after
    /// the daemon's stream has run everything enqueued on it).
    pub fn read_grad_shard(&self, bucket: BucketId, out: &mut [f32]) -> Result<()> {
        let (addr, len) = self.grad_shard(bucket)?;
        if out.len() != len {
            return Err(buffer_len_error(self.w.reg.bucket(bucket)?, out.len(), len));
        }
        // SAFETY: `addr` holds `len` f32s of this rank's accumulators.
        unsafe {
            self.plane
                .ops()
                .read_to_host(addr, crate::bytes_of_mut(out))
        }
    }

    /// Zeroes the accumulator of `bucket` on the daemon's stream, after the
    /// work enqueued on `stream` so far (the optimizer step that read it);
    /// `stream`'s later work sees the zeros.
    pub fn zero_grad(&self, bucket: BucketId, stream: StreamHandle) -> Result<()> {
        let (addr, len) = self.grad_shard(bucket)?;
        self.path(stream).on_server(|ops| {
            // SAFETY: `addr` holds `len` f32s of this rank's accumulators; no
            // push adds into them before this rank's next publish, which
            // comes after this on `stream`.
            unsafe { ops.zero_on_server(addr, len * 4) }
        })?;
        // The adds of the chunks held until now queue behind the zeroing on
        // the daemon's stream.
        self.w.open_accumulators(Some(bucket))
    }

    /// [`zero_grad`](Self::zero_grad) for every bucket.
    pub fn zero_grads(&self, stream: StreamHandle) -> Result<()> {
        (0..self.w.reg.buckets.len()).try_for_each(|b| self.zero_grad(BucketId(b), stream))
    }
}
