//! Operations in flight together: [`Transport::run_batch`] over libfabric.
//!
//! [`Transport::run_batch`]: crate::transport::Transport::run_batch
//!
//! A gather reads a shard from every owner and a push writes a chunk to
//! every owner; one operation at a time, each costs a round trip and the
//! D − 1 of them add up (over tcp a round trip is 7–20 µs idle and a
//! scheduler slice under load). A batch posts operation after operation
//! without waiting, up to a window (the provider's transmit queue, at most
//! [`WINDOW`]), and waits for the oldest only when the window is full, so a
//! gather or push costs about one round trip per window. Nothing is
//! ordered between the operations of a batch (EFA delivers unordered), so
//! only operations that need no order go into one: each put's signal still
//! follows its own data.
//!
//! The flights (op slot, deadline, local registrations, a pure signal's
//! value) live in arrays in the frame of [`FabricTransport::run_ops`], which
//! waits for every posted operation before it returns: what libfabric reads
//! or writes outlives the operation.

use std::time::Instant;

use super::safe::Mr;
use super::signal::{Imm, Update, MAILBOX};
use super::{FabricTransport, OP_SLOTS};
use crate::transport::{run_one, Op};
use crate::Result;

/// The most operations one batch keeps in flight: half the operation
/// slots, so that the daemon's acknowledgements and another thread's batch
/// still find slots.
pub(super) const WINDOW: usize = OP_SLOTS / 2;

/// One posted operation.
struct Flight {
    peer: usize,
    slot: usize,
    what: &'static str,
    deadline: Instant,
    /// A put: its failure is no error once the peer's close notice came.
    put: bool,
    _mrs: [Option<Mr>; 2],
}

impl FabricTransport {
    /// The operations in flight at once in a batch: the provider's transmit
    /// queue, at most 128 (half the operation slots).
    pub fn batch_window(&self) -> usize {
        usize::try_from(self.core.granted.tx_size)
            .unwrap_or(WINDOW)
            .clamp(1, WINDOW)
    }

    /// [`Transport::run_batch`](crate::transport::Transport::run_batch),
    /// with `divert` offered every operation
    /// first: it runs the ones it takes (the mixed transport's local peers,
    /// while the remote ones are in flight) and returns their outcome, or
    /// `None` for the ones left to libfabric.
    ///
    /// # Safety
    /// As [`Transport::run_batch`](crate::transport::Transport::run_batch).
    pub unsafe fn run_ops(
        &self,
        ops: &mut dyn Iterator<Item = Op>,
        divert: &mut dyn FnMut(Op) -> Option<Result<()>>,
    ) -> Result<()> {
        let window = self.batch_window();
        let mut flights: [Option<Flight>; WINDOW] = std::array::from_fn(|_| None);
        // A pure signal's 8 bytes, beside its flight (same index).
        let mut values = [[0u8; 8]; WINDOW];
        let (mut head, mut live) = (0usize, 0usize);
        let mut first: Result<()> = Ok(());
        for op in ops {
            if let Some(out) = divert(op) {
                first = first.and(out);
                if first.is_err() {
                    break;
                }
                continue;
            }
            if live == window {
                let oldest = flights[head].take();
                first = first.and(self.land(oldest));
                head = (head + 1) % WINDOW;
                live -= 1;
                if first.is_err() {
                    break;
                }
            }
            let at = (head + live) % WINDOW;
            // SAFETY: the caller vouches for the op's buffers; `values[at]`
            // and the flight live in this frame until they landed below.
            match unsafe { self.post(op, &mut values[at]) } {
                Ok(Some(flight)) => {
                    flights[at] = Some(flight);
                    live += 1;
                }
                Ok(None) => {}
                Err(e) => {
                    first = Err(e);
                    break;
                }
            }
        }
        while live > 0 {
            let oldest = flights[head].take();
            first = first.and(self.land(oldest));
            head = (head + 1) % WINDOW;
            live -= 1;
        }
        first
    }

    /// Waits for a flight's completion.
    fn land(&self, flight: Option<Flight>) -> Result<()> {
        let Some(f) = flight else { return Ok(()) };
        match self.core.finish_op(f.peer, f.what, f.deadline, f.slot) {
            // The peer closed its engine: nobody reads what was put.
            Err(_) if f.put && self.core.notice(f.peer).is_some() => Ok(()),
            other => other,
        }
    }

    /// Posts `op` without waiting; returns its flight, or `None` when it
    /// ran to completion here (to this rank itself, to a peer that closed,
    /// or in more pieces than one post takes: the single verbs do those).
    ///
    /// # Safety
    /// As `Transport::run_batch` for `op`; `value` stays in place until
    /// the flight landed.
    unsafe fn post(&self, op: Op, value: &mut [u8; 8]) -> Result<Option<Flight>> {
        let c = &self.core;
        let p = c.peer(op.peer())?;
        let addr = match p.addr {
            Some(addr) if c.notice(op.peer()).is_none() => addr,
            _ => {
                // SAFETY: the caller's contract, passed on.
                unsafe { run_one(self, op)? };
                return Ok(None);
            }
        };
        let deadline = Instant::now() + c.timeout;
        match op {
            Op::Get {
                peer,
                remote,
                offset,
                dst,
                len,
            } => {
                let r = c.bounds(peer, p, &remote, offset, len)?;
                let max = usize::try_from(c.granted.max_msg_size).unwrap_or(usize::MAX);
                if len == 0 || len > max {
                    // SAFETY: as above.
                    unsafe { run_one(self, op)? };
                    return Ok(None);
                }
                let mr = c.local_mr(dst, len)?;
                let desc = mr.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
                let raddr = r.base + offset as u64;
                let slot = c.start_op(peer, "fi_read", deadline, |ctx| {
                    // SAFETY: `dst` has `len` writable bytes until the batch
                    // returns, which is after the flight landed (and the MR
                    // in it dropped); `ctx` is the slot's fi_context.
                    unsafe { c.ep.post_read(dst, len, desc, addr, raddr, r.key, ctx) }
                })?;
                Ok(Some(Flight {
                    peer,
                    slot,
                    what: "fi_read",
                    deadline,
                    put: false,
                    _mrs: [mr, None],
                }))
            }
            Op::Put {
                peer,
                remote,
                offset,
                parts,
                signal,
                value: v,
            } => {
                let total = parts[0].1 + parts[1].1;
                let pure = total == 0;
                let r = c.bounds(peer, p, &remote, offset, total)?;
                let cell = if pure { 8 + MAILBOX } else { 8 };
                c.bounds(peer, p, &remote, signal.offset, cell)?;
                let imm = Imm {
                    region: remote.id,
                    offset: signal.offset,
                    bell: signal.bell,
                    update: if pure { Update::Raise } else { Update::Count },
                }
                .encode()?;
                if pure {
                    *value = v.to_le_bytes();
                    let buf = value.as_mut_ptr();
                    let mr = c.local_mr(buf, 8)?;
                    let desc = mr.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
                    let slot = c.start_op(peer, "fi_writemsg", deadline, |ctx| {
                        // SAFETY: `value` stays in place until the flight
                        // landed (the caller's contract); `ctx` is the
                        // slot's fi_context.
                        unsafe {
                            c.post_mailbox(ctx, buf.cast(), desc, addr, &r, signal.offset, imm)
                        }
                    })?;
                    return Ok(Some(Flight {
                        peer,
                        slot,
                        what: "fi_writemsg",
                        deadline,
                        put: true,
                        _mrs: [mr, None],
                    }));
                }
                let nonempty = parts.iter().filter(|(_, n)| *n > 0).count();
                let iov = usize::try_from(c.granted.iov_limit).unwrap_or(1).max(1);
                if nonempty > iov || total as u64 > c.granted.max_msg_size {
                    // SAFETY: as above (the single verb joins or refuses).
                    unsafe { run_one(self, op)? };
                    return Ok(None);
                }
                let mut bufs = [std::ptr::null_mut::<std::ffi::c_void>(); 2];
                let mut lens = [0usize; 2];
                let mut descs = [std::ptr::null_mut::<std::ffi::c_void>(); 2];
                let mut mrs: [Option<Mr>; 2] = [None, None];
                let mut n = 0;
                for &(ptr, len) in parts.iter().filter(|(_, n)| *n > 0) {
                    let mr = c.local_mr(ptr.cast_mut(), len)?;
                    bufs[n] = ptr.cast_mut().cast();
                    lens[n] = len;
                    descs[n] = mr.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
                    mrs[n] = mr;
                    n += 1;
                }
                let raddr = r.base + offset as u64;
                let slot = c.start_op(peer, "fi_writemsg", deadline, |ctx| {
                    let mut descs = descs;
                    // SAFETY: the parts stay readable (and registered: the
                    // MRs live in the flight) until it landed; `ctx` is the
                    // slot's fi_context.
                    unsafe {
                        c.ep.post_writedata(
                            &bufs[..n],
                            &lens[..n],
                            &mut descs[..n],
                            addr,
                            raddr,
                            r.key,
                            u64::from(imm),
                            ctx,
                        )
                    }
                })?;
                Ok(Some(Flight {
                    peer,
                    slot,
                    what: "fi_writemsg",
                    deadline,
                    put: true,
                    _mrs: mrs,
                }))
            }
        }
    }
}

// The window leaves slots to the other threads.
const _: () = assert!(WINDOW >= 1 && WINDOW < OP_SLOTS);
