//! The worker API of a device engine (`cuda-ipc`, `emu-ipc`): the calls of
//! [`crate::client`] on device addresses, with the data moved on the
//! caller's stream (see [`crate::plane`] for what runs where).
//!
//! The protocol is the host one, word for word: the same waits on this
//! rank's control words and the same signals; only the signals that
//! announce data are sent by work on the stream after the data, instead of
//! by the calling thread.

use std::sync::Arc;

use odc_kernels::DType;

use crate::client::Signals;
use crate::control::{slot_count, HEADER_BYTES};
use crate::engine::{record_error, BucketId, Engine, Registered};
use crate::plane::{Plane, StreamHandle};
use crate::region::{Bell, SignalRef};
use crate::{Error, Result};

impl Engine {
    /// The registered state and data plane of a device engine.
    fn device(&self) -> Result<(&Registered, &dyn Plane)> {
        let reg = self.inner.registered()?;
        match &reg.plane {
            Some(plane) => Ok((reg, plane.as_ref())),
            None => Err(Error::Config(format!(
                "this engine's data lives in host memory ({}): the *_device calls need a \
                 device transport (cuda-ipc)",
                self.transport_name()
            ))),
        }
    }

    /// Enqueues `signals` on `stream`, after the work before them; a
    /// failure is reported at this rank's next finish.
    fn send_after(&self, plane: &dyn Plane, stream: StreamHandle, signals: Signals) -> Result<()> {
        let errors = Arc::clone(&self.inner.server_error);
        plane.ops().then(
            stream,
            Box::new(move || {
                if let Err(e) = signals.send() {
                    record_error(&errors, format!("a signal sent from a stream failed: {e}"));
                }
            }),
        )
    }

    /// [`publish`](Self::publish) of the shard at device address `src`
    /// (`bytes` long) on `stream`: waits on the host until every reader
    /// released `version - 1`, then enqueues the copy into this rank's
    /// published shard and, after it, the version signal to every reader.
    /// Returns before the copy runs.
    ///
    /// # Safety
    /// `src` must address `bytes` readable bytes of the engine's device,
    /// valid until the copy enqueued on `stream` has run, and `stream` must
    /// be a stream of that device that outlives the call's work.
    pub unsafe fn publish_device(
        &self,
        bucket: BucketId,
        src: u64,
        bytes: usize,
        dtype: DType,
        version: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let (reg, plane) = self.device()?;
        let b = reg.bucket(bucket)?;
        crate::client::check_dtype(b, dtype, "shard")?;
        crate::client::check_shard_len(b, bytes)?;
        let _guard = self
            .publish_lock
            .lock()
            .map_err(|_| Error::protocol(Some(b.name()), "a publish panicked"))?;
        let stamp = self.publish_wait(reg, b, bucket, version)?;
        let dst = plane.local_params() + reg.params_off[bucket.0] as u64;
        // SAFETY: the destination is this rank's shard (inside its params
        // region, sized at registration) and every reader released the
        // previous version; the caller vouches for `src`.
        unsafe { plane.ops().copy(stream, dst, src, bytes)? };
        self.send_after(plane, stream, self.version_signals(reg, bucket, stamp))
    }

    /// [`gather`](Self::gather) into the device buffer at `out` (`bytes`
    /// long: `numel` or `D * shard_len` elements of the parameter dtype):
    /// waits on the host until each owner's shard holds `version`, and
    /// enqueues the copy of it on `stream`. Returns before the copies run;
    /// [`release_device`](Self::release_device) on the same stream lets the
    /// owners publish again once they have. With `skip_own`, this rank's
    /// own shard range of `out` is left alone (FSDP's copy-in).
    ///
    /// # Safety
    /// `out` must address `bytes` writable bytes of the engine's device,
    /// valid until the copies enqueued on `stream` have run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gather_device(
        &self,
        bucket: BucketId,
        version: u64,
        out: u64,
        bytes: usize,
        dtype: DType,
        stream: StreamHandle,
        skip_own: bool,
    ) -> Result<()> {
        let (reg, plane) = self.device()?;
        let size = dtype.size_bytes();
        self.gather_with(
            reg,
            bucket,
            version,
            (bytes, dtype),
            skip_own,
            &mut |rank, range| {
                let dst = out + (range.start * size) as u64;
                let (off, len) = (reg.params_off[bucket.0], range.len() * size);
                // SAFETY: the owner's shard holds `version` and stays unchanged
                // until this client's release, which is enqueued after this read;
                // the caller vouches for `out`, which the checked length covers.
                unsafe { plane.get_params(stream, dst, rank, off, len) }
            },
        )
    }

    /// [`release`](Self::release) enqueued on `stream`: the owners learn
    /// that this client is done reading `version` of `bucket` once the work
    /// before it on `stream` (the gather's copies) has run.
    pub fn release_device(
        &self,
        bucket: BucketId,
        version: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let (reg, plane) = self.device()?;
        match self.release_signals(reg, bucket, version)? {
            Some(signals) => self.send_after(plane, stream, signals),
            None => Ok(()),
        }
    }

    /// [`scatter_accumulate_at`](Self::scatter_accumulate_at) of the device
    /// gradient at `grads` (`bytes` long, covering elements `[offset, ..)`
    /// of the padded bucket), produced on `stream`. Every peer's chunk is
    /// copied on `stream` into the owner's landing slot, and its signal
    /// follows it on the stream. This rank's own slice is added by the
    /// daemon's stream after `stream`'s work so far, and `stream` waits for
    /// that add before its later work (so `grads` may be reused after it).
    /// Returns once every chunk is enqueued (waiting on the host, as the
    /// host call does, whenever both of an owner's slots are in flight).
    ///
    /// # Safety
    /// `grads` must address `bytes` readable bytes of the engine's device,
    /// valid and unchanged until the work enqueued on `stream` has run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn scatter_accumulate_device(
        &self,
        bucket: BucketId,
        offset: usize,
        grads: u64,
        bytes: usize,
        dtype: DType,
        scale: f32,
        stream: StreamHandle,
    ) -> Result<()> {
        let (reg, plane) = self.device()?;
        let b = reg.bucket(bucket)?;
        let (mut guard, own) = self.start_push(reg, b, offset, bytes, dtype)?;
        let push = &mut *guard;
        let me = reg.groups.me;
        let size = dtype.size_bytes();
        if !own.is_empty() {
            let first = b.shard_range(me).start + own.start - offset;
            let server = plane.ops().server_stream();
            let acc = accum_addr(reg, plane, bucket.0, own.start);
            plane.ops().order(server, stream)?;
            // SAFETY: the range lies inside the bucket's accumulator (the
            // overlap of its shard); the daemon's stream runs it after the
            // caller's work so far, and the caller's stream waits for it.
            unsafe {
                plane.ops().accumulate_on_server(
                    acc,
                    grads + (first * size) as u64,
                    dtype,
                    own.len(),
                    scale,
                )?
            };
            plane.ops().order(stream, server)?;
        }
        let lay = &reg.ctrl_layout;
        let mut put = |rank: usize,
                       slot: usize,
                       seq: u64,
                       header: [u8; HEADER_BYTES],
                       data: std::ops::Range<usize>|
         -> Result<()> {
            // SAFETY: the slot is free (its last chunk was acknowledged) and
            // holds `chunk_bytes`, at least `data.len()`; the caller vouches
            // for `grads`.
            unsafe {
                plane.put_landing(
                    stream,
                    rank,
                    lay.landing_data(me, slot),
                    grads + data.start as u64,
                    data.len(),
                )?
            };
            // The signal below announces the chunk: it must have arrived.
            plane.deliver(stream)?;
            let (transport, errors) = (
                Arc::clone(&self.inner.transport),
                Arc::clone(&self.inner.server_error),
            );
            let desc = reg.peer_ctrl[rank];
            let (at, sig) = (
                lay.slot_header(me, slot),
                SignalRef {
                    offset: lay.slot_signal(me, slot),
                    bell: Bell::Server,
                },
            );
            plane.ops().then(
                stream,
                Box::new(move || {
                    if let Err(e) =
                        transport.put_signal(rank, &desc, at, &[&header], sig, slot_count(seq))
                    {
                        record_error(&errors, format!("pushing a chunk to rank {rank}: {e}"));
                    }
                }),
            )
        };
        self.push_chunks(push, b, bucket, offset, dtype, scale, &mut put)
    }

    /// [`finish_minibatch`](Self::finish_minibatch) of a device engine:
    /// waits until the work enqueued on `stream` has run (the last gathers'
    /// copies, the last pushes' signals), then finishes as the host call
    /// does. On return this rank's accumulators are final in device memory.
    pub fn finish_minibatch_device(&self, k: u64, stream: StreamHandle) -> Result<()> {
        let (reg, plane) = self.device()?;
        plane.ops().synchronize(stream)?;
        self.finish_impl(reg, k)?;
        plane.ops().synchronize(plane.ops().server_stream())
    }

    /// This rank's accumulator of `bucket`: its device address and length
    /// in f32 elements, valid for the engine's lifetime (the optimizer step
    /// reads it between a finish and the next publish).
    pub fn grad_shard_device(&self, bucket: BucketId) -> Result<(u64, usize)> {
        let (_, addr, len) = self.device_grad(bucket)?;
        Ok((addr, len))
    }

    /// The plane, and the address and length of `bucket`'s accumulator.
    fn device_grad(&self, bucket: BucketId) -> Result<(&dyn Plane, u64, usize)> {
        let (reg, plane) = self.device()?;
        let len = reg.bucket(bucket)?.shard_len();
        Ok((plane, accum_addr(reg, plane, bucket.0, 0), len))
    }

    /// Copies this rank's accumulator of `bucket` into host memory (after
    /// the daemon's stream has run everything enqueued on it).
    pub fn read_grad_shard_device(&self, bucket: BucketId, out: &mut [f32]) -> Result<()> {
        let (plane, addr, len) = self.device_grad(bucket)?;
        if out.len() != len {
            return Err(Error::layout(
                Some(self.bucket(bucket)?.name()),
                format!(
                    "gradient buffer holds {} elements; the shard has {len}",
                    out.len()
                ),
            ));
        }
        // SAFETY: `addr` holds `len` f32s of this rank's accumulators.
        unsafe { plane.ops().read_to_host(addr, crate::bytes_of_mut(out)) }
    }

    /// Zeroes the accumulator of `bucket` on the daemon's stream, after the
    /// work enqueued on `stream` so far (the optimizer step that read it);
    /// `stream`'s later work sees the zeros.
    pub fn zero_grad_device(&self, bucket: BucketId, stream: StreamHandle) -> Result<()> {
        let (plane, addr, len) = self.device_grad(bucket)?;
        let ops = plane.ops();
        let server = ops.server_stream();
        ops.order(server, stream)?;
        // SAFETY: `addr` holds `len` f32s of this rank's accumulators; no
        // push adds into them before this rank's next publish, which comes
        // after this on `stream`.
        unsafe { ops.zero_on_server(addr, len * 4)? };
        ops.order(stream, server)
    }

    /// [`zero_grad_device`](Self::zero_grad_device) for every bucket.
    pub fn zero_grads_device(&self, stream: StreamHandle) -> Result<()> {
        let n = self.inner.registered()?.buckets.len();
        (0..n).try_for_each(|b| self.zero_grad_device(BucketId(b), stream))
    }
}

/// Device address of element `elem` of bucket `bucket`'s f32 accumulator.
pub(crate) fn accum_addr(reg: &Registered, plane: &dyn Plane, bucket: usize, elem: usize) -> u64 {
    plane.accum() + ((reg.accum_off[bucket] + elem) * 4) as u64
}
