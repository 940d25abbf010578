//! The shard server daemon: one thread per rank that adds pushed gradient
//! chunks into this rank's accumulators and acknowledges them.
//!
//! It sleeps on the rank's server bell, which clients ring after writing a
//! landing-slot signal; it scans every client's two slot signals (acquire),
//! reads the slot header, holds a chunk of a minibatch this rank's
//! accumulator does not take yet in its slot ([`crate::protocol::admit`]:
//! the worker rings the bell when it opens the accumulator), adds `scale · data` into the bucket's f32
//! accumulator with `odc-kernels` (in deterministic mode into its exact
//! fixed-point accumulator, [`odc_kernels::cpu::exact`]), and acknowledges
//! with a `put_signal` of no data into the client's ack word. No lock, no
//! allocation in the loop.
//!
//! This rank's own slice of a push arrives through [`crate::protocol::handoff`] as a
//! pointer into the client's buffer. The daemon adds its front together
//! with the peer chunk for the same accumulator range when one arrives
//! (block by block, so the accumulator is read and written once for both);
//! when no peer chunk has come for [`SOLO_AFTER`] it adds a chunk from the
//! slice's back alone. Peers push from the front, so the two ends meet and
//! a descheduled peer does not cost the pairing of the chunks still to come.
//!
//! It also answers work-stealing requests: one compare-and-swap on the
//! rank's claim word per request, and a grant signal back
//! ([`crate::protocol::claims`]).
//!
//! It touches only the landing slots, the hand-off, accumulators and the
//! claim word; it never reads or writes published shards or version words. It depends on
//! the engine's state and the protocol, never on the worker API.
//!
//! A panic in the daemon (a bug) ends its thread, never the process: it is
//! caught at the thread's top, recorded with what the daemon was doing
//! ([`Doing`]), and every later call and wait of this rank fails with it as
//! [`crate::Error::Internal`] ([`crate::engine`]'s `record_server_panic`),
//! while the peers see this rank as gone. `ODC_FAULT_SERVER_PANIC`
//! ([`Fault`]) injects one, for the tests.

use std::cell::Cell;
use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use odc_kernels::cpu::accumulate_into_f32;
use odc_kernels::cpu::exact::accumulate_exact;
use odc_kernels::cpu::quant::dequantise_accumulate_chunk;
use odc_kernels::DType;

use crate::control::{check_header, Chunk, SlotHeader, HEADER_BYTES};
use crate::engine::{load, record_error, Core, NodeSums, Registered};
use crate::plane::Plane;
use crate::protocol::admit::{self, Admit};
use crate::protocol::claims;
use crate::protocol::handoff::OwnSlice;
use crate::protocol::slots::SlotReceiver;
use crate::region::{Bell, SignalRef};
use crate::sync::{Backoff, Ordering};
use crate::transport::Op;

/// Longest sleep between scans when nobody rings (shutdown is rung, so this
/// only bounds the damage of a lost wake-up).
const NAP: Duration = Duration::from_millis(100);

/// How long the own slice waits for a peer chunk to pair with before the
/// daemon adds it alone. About the time a peer needs to copy one chunk, so
/// that in a symmetric push both streams meet.
const SOLO_AFTER: Duration = Duration::from_micros(50);

/// Elements per block of a fused add: a 16 KiB f32 accumulator block stays
/// in L1 between the two sources.
const FUSE_BLOCK: usize = 4096;

/// The own slice being added: its generation, where it is, and the part
/// `[front, back)` (elements of the slice) still to add.
struct Own {
    gen: u64,
    slice: OwnSlice,
    dtype: DType,
    front: usize,
    back: usize,
}

/// The variable that injects a panic into a daemon, for the tests:
/// `RANK:N`, the daemon of rank RANK panics as it is about to add the N-th
/// chunk a peer pushed to it (N from 1).
pub(crate) const FAULT_ENV: &str = "ODC_FAULT_SERVER_PANIC";

/// A panic to inject ([`FAULT_ENV`]): in the daemon of `rank`, at its
/// `chunk`-th peer chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fault {
    rank: usize,
    chunk: u64,
}

impl Fault {
    /// The fault [`FAULT_ENV`] asks for, if set; a malformed value is a
    /// configuration error naming it.
    pub(crate) fn from_env() -> crate::Result<Option<Fault>> {
        match std::env::var(FAULT_ENV) {
            Ok(v) => Fault::parse(&v).map(Some).ok_or_else(|| {
                crate::Error::Config(format!(
                    "{FAULT_ENV}={v:?}: expected RANK:N (the daemon of rank RANK panics at the \
                     N-th chunk pushed to it, N from 1)"
                ))
            }),
            Err(_) => Ok(None),
        }
    }

    fn parse(v: &str) -> Option<Fault> {
        let (rank, chunk) = v.trim().split_once(':')?;
        let chunk = chunk.trim().parse().ok().filter(|&n| n > 0)?;
        Some(Fault {
            rank: rank.trim().parse().ok()?,
            chunk,
        })
    }
}

/// What the daemon is doing: set before each step of its loop (a store
/// into a local cell), read only to describe a panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Doing {
    Starting,
    TakingOwnSlice,
    Adding { client: usize, slot: usize },
    AddingOwnSlice,
    Acknowledging,
    AnsweringSteals,
    Sleeping,
}

impl Doing {
    /// In words, for [`crate::Error::Internal`]; a chunk's header names its
    /// bucket, minibatch and range where it still decodes.
    fn describe(self, reg: Option<&Registered>) -> String {
        match self {
            Doing::Starting => "starting".to_owned(),
            Doing::TakingOwnSlice => "taking this rank's own slice of a push".to_owned(),
            Doing::AddingOwnSlice => "adding this rank's own slice of a push".to_owned(),
            Doing::Acknowledging => "acknowledging chunks".to_owned(),
            Doing::AnsweringSteals => "answering steal requests".to_owned(),
            Doing::Sleeping => "waiting for pushes".to_owned(),
            Doing::Adding { client, slot } => {
                let Some(reg) = reg else {
                    return format!("adding a chunk from landing slot {slot} of client {client}");
                };
                let rank = reg.groups.group.get(client).copied().unwrap_or(client);
                let header = read_header(reg, client, slot);
                match header.and_then(|h| Some((reg.buckets.get(h.bucket as usize)?, h))) {
                    Some((b, h)) => format!(
                        "adding rank {rank}'s chunk of bucket {:?} (minibatch {}, elements {}..{} \
                         of this rank's shard)",
                        b.name(),
                        h.minibatch,
                        h.offset,
                        h.offset.saturating_add(h.len)
                    ),
                    None => format!("adding rank {rank}'s chunk in landing slot {slot}"),
                }
            }
        }
    }
}

/// Starts the daemon of `core` (registered) on a thread of its own. A panic
/// in it is caught here and recorded (see the module doc).
pub(crate) fn spawn(core: Arc<Core>, fault: Option<Fault>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("odc-server-{}", core.topo.rank()))
        .spawn(move || {
            let doing = Cell::new(Doing::Starting);
            let fault = fault.filter(|f| f.rank == core.topo.rank());
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run(&core, &doing, fault);
            }));
            if let Err(payload) = ran {
                let detail = crate::error::panic_message(payload);
                // Describing reads the chunk's header: never let that be a
                // second panic that leaves the first unrecorded.
                let during = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    doing.get().describe(core.reg.get())
                }))
                .unwrap_or_else(|p| {
                    let again = crate::error::panic_message(p);
                    format!("{:?} (describing it panicked too: {again})", doing.get())
                });
                core.record_server_panic(during, detail);
            }
        })
}

/// The daemon's loop; returns when the engine shuts down.
fn run(core: &Core, doing: &Cell<Doing>, fault: Option<Fault>) {
    let Some(reg) = core.reg.get() else { return };
    // Peer chunks taken so far, for the injected fault.
    let mut added = 0u64;
    // Clients are indexed by their place in the shard group; one receiver
    // per client, allocated once.
    let world = reg.groups.group.len();
    let mut receivers = vec![SlotReceiver::default(); world];
    let mut seen_gen = 0u64;
    let mut own: Option<Own> = None;
    let mut served = vec![0u64; world]; // last steal request answered, per client
    let mut backoff = Backoff::new();
    let mut last_progress = Instant::now();
    // Acknowledgements of one scan, sent together (allocated once).
    let mut acks = Acks::new(world);
    loop {
        if core.shutdown.load(Ordering::Acquire) {
            return;
        }
        let epoch = core.transport.bell_epoch(Bell::Server);
        doing.set(Doing::TakingOwnSlice);
        if let Some((gen, slice)) = core.own.take(seen_gen) {
            seen_gen = gen;
            // Give the peers' first chunks their time to arrive and pair.
            last_progress = Instant::now();
            own = match DType::from_u8(slice.dtype) {
                Some(dtype) => Some(Own {
                    gen,
                    slice,
                    dtype,
                    front: 0,
                    back: slice.len,
                }),
                None => {
                    core.record_server_error(format!("own slice with dtype code {}", slice.dtype));
                    finish_own(core, gen);
                    None
                }
            };
        }
        let mut progressed = false;
        for (client, receiver) in receivers.iter_mut().enumerate() {
            // Chunks are added in push order (the older slot first), so the
            // own slice pairs with them front to back.
            for slot in receiver.order() {
                let count = load(reg.word(reg.ctrl_layout.slot_signal(client, slot)));
                let Some(seq) = receiver.waiting(slot, count) else {
                    continue;
                };
                doing.set(Doing::Adding { client, slot });
                match admission(reg, client, slot) {
                    // The client's younger chunk waits behind this one.
                    Admit::Hold => break,
                    Admit::Add => {}
                    Admit::Stale => {
                        receiver.take(slot, seq);
                        core.record_server_error(stale_push(reg, client, slot));
                        acks.add(core, reg, client, slot, seq);
                        progressed = true;
                        continue;
                    }
                }
                receiver.take(slot, seq);
                progressed = true;
                added += 1;
                if fault.is_some_and(|f| f.chunk == added) {
                    panic!("injected by {FAULT_ENV} at this daemon's chunk {added}");
                }
                if let Some(plane) = &reg.plane {
                    add_on_device(core, reg, plane.as_ref(), client, slot, seq);
                    continue;
                }
                if let Err(msg) = accumulate(core, reg, client, slot, seq, &mut own) {
                    core.record_server_error(msg);
                }
                // Acknowledge even a rejected chunk so the client never
                // hangs; the error surfaces at this rank's finish.
                doing.set(Doing::Acknowledging);
                acks.add(core, reg, client, slot, seq);
            }
        }
        doing.set(Doing::Acknowledging);
        acks.send(core, reg);
        doing.set(Doing::AnsweringSteals);
        progressed |= serve_steals(core, reg, &mut served);
        if progressed {
            last_progress = Instant::now();
            backoff.reset();
            continue;
        }
        if own.is_some() {
            // Never sleep while the own slice is pending: add a chunk of it
            // alone once no peer chunk came for a while.
            if last_progress.elapsed() >= SOLO_AFTER {
                doing.set(Doing::AddingOwnSlice);
                add_own_solo(core, reg, &mut own);
                last_progress = Instant::now();
                backoff.reset();
            } else {
                backoff.snooze();
            }
        } else if !backoff.is_completed() {
            backoff.snooze();
        } else {
            doing.set(Doing::Sleeping);
            // A failed wait only means "scan again".
            let _ = core.transport.bell_wait(Bell::Server, epoch, NAP);
        }
    }
}

/// Whether the chunk in landing slot `[client][slot]` may be added now: the
/// minibatch its header names against the one its bucket's accumulator
/// takes. A header that does not decode or names no bucket is added (and
/// refused there, by [`checked_header`]).
fn admission(reg: &Registered, client: usize, slot: usize) -> Admit {
    let Some(h) = read_header(reg, client, slot) else {
        return Admit::Add;
    };
    if h.owner.is_some() {
        // For a node buffer (node aggregation): it takes the minibatch the
        // buffers are open for; none to take it is refused when added.
        return match &reg.sums {
            Some(sums) => admit::admit(h.minibatch, sums.open.load(Ordering::Acquire)),
            None => Admit::Add,
        };
    }
    match usize::try_from(h.bucket).ok().and_then(|b| reg.open.get(b)) {
        Some(open) => admit::admit(h.minibatch, open.load(Ordering::Acquire)),
        None => Admit::Add,
    }
}

/// The error a stale chunk records: a client pushed into a minibatch this
/// rank had closed (it broke the protocol: its finish acknowledged chunks
/// it had not pushed yet).
fn stale_push(reg: &Registered, client: usize, slot: usize) -> String {
    let rank = reg.groups.group[client];
    let h = read_header(reg, client, slot);
    let (b, m) = h.map_or((u32::MAX, 0), |h| (h.bucket, h.minibatch));
    let open = usize::try_from(b)
        .ok()
        .and_then(|b| reg.open.get(b))
        .map_or(0, |o| o.load(Ordering::Acquire));
    format!(
        "rank {rank}: a push of minibatch {m} into bucket {b} after this rank's accumulator moved \
         on to minibatch {open}; dropped"
    )
}

/// The wire form of landing slot `[client][slot]`'s header, as the client
/// wrote it.
fn raw_header(reg: &Registered, client: usize, slot: usize) -> [u8; HEADER_BYTES] {
    let mut raw = [0u8; HEADER_BYTES];
    // SAFETY: the header lies inside the control region; the client wrote it
    // before the signal observed with acquire and leaves the slot alone
    // until the acknowledgement.
    unsafe {
        std::ptr::copy_nonoverlapping(
            reg.ctrl
                .as_ptr()
                .add(reg.ctrl_layout.slot_header(client, slot)),
            raw.as_mut_ptr(),
            HEADER_BYTES,
        )
    };
    raw
}

/// The header of landing slot `[client][slot]`, decoded (unchecked: only
/// the admission rule reads it so; [`checked_header`] checks it before an
/// add).
fn read_header(reg: &Registered, client: usize, slot: usize) -> Option<SlotHeader> {
    SlotHeader::decode(&raw_header(reg, client, slot))
}

/// Answers every client's new steal request: claims one of this rank's
/// microbatches from the back of its list for it (one compare-and-swap on
/// the claim word the rank's own claims also use), and raises the
/// client's grant word. Returns whether it answered any.
fn serve_steals(core: &Core, reg: &Registered, served: &mut [u64]) -> bool {
    let lay = &reg.ctrl_layout;
    let mut answered = false;
    for (client, last) in served.iter_mut().enumerate() {
        let Some((seq, k)) = claims::parse_request(load(reg.word(lay.steal_req(client)))) else {
            continue;
        };
        if seq <= *last {
            continue;
        }
        *last = seq;
        answered = true;
        let word = reg.word(lay.claim());
        let mut cur = word.load(Ordering::Acquire);
        let claim = loop {
            let (new, claim) = claims::steal(cur, k);
            let Some(new) = new else { break claim };
            match word.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break claim,
                Err(now) => cur = now,
            }
        };
        let sig = SignalRef {
            offset: lay.steal_grant(reg.groups.me),
            bell: Bell::Client,
        };
        let peer = reg.groups.group[client];
        if let Err(e) = core.transport.put_signal(
            peer,
            &reg.peer_ctrl[peer],
            0,
            &[],
            sig,
            claims::grant(seq, claim),
        ) {
            // The thief waits for the grant within its deadline and names
            // this rank; a claimed microbatch it never hears of is lost
            // with it (the job fails).
            core.record_server_error(format!("answering rank {peer}'s steal request: {e}"));
        }
    }
    answered
}

/// The acknowledgements of a scan, sent together
/// ([`crate::transport::Transport::run_batch`]: over a network all in
/// flight at once, where one at a time each cost the daemon a round trip
/// before it looked at the next chunk): `(client, slot, seq)`.
struct Acks {
    due: Vec<(usize, usize, u64)>,
}

impl Acks {
    /// Sent once this many are due, so the first clients are not held back
    /// by a long scan.
    const BATCH: usize = 64;

    fn new(world: usize) -> Acks {
        Acks {
            due: Vec::with_capacity((2 * world).min(Self::BATCH)),
        }
    }

    /// Acknowledges chunk `seq` in slot `[client][slot]` with the next batch.
    fn add(&mut self, core: &Core, reg: &Registered, client: usize, slot: usize, seq: u64) {
        self.due.push((client, slot, seq));
        if self.due.len() >= Self::BATCH {
            self.send(core, reg);
        }
    }

    /// Sends every acknowledgement due, and waits until they are delivered.
    fn send(&mut self, core: &Core, reg: &Registered) {
        if self.due.is_empty() {
            return;
        }
        let me = reg.groups.me;
        let mut ops = self.due.iter().map(|&(client, slot, seq)| {
            let peer = reg.groups.group[client];
            Op::Put {
                peer,
                remote: reg.peer_ctrl[peer],
                offset: 0,
                parts: [(std::ptr::null(), 0); 2],
                signal: SignalRef {
                    offset: reg.ctrl_layout.ack(me, slot),
                    bell: Bell::Client,
                },
                value: seq,
            }
        });
        // SAFETY: pure signals carry no buffers.
        if let Err(e) = unsafe { core.transport.run_batch(&mut ops) } {
            // The batch stops at its first failure: send the rest one by
            // one, so that every live client still hears of its chunks.
            for &(client, slot, seq) in &self.due {
                acknowledge(core, reg, client, slot, seq);
            }
            core.record_server_error(format!("acknowledging a batch of chunks: {e}"));
        }
        self.due.clear();
    }
}

/// Acknowledges chunk `seq` in slot `[client][slot]` now.
fn acknowledge(core: &Core, reg: &Registered, client: usize, slot: usize, seq: u64) {
    let ack = SignalRef {
        offset: reg.ctrl_layout.ack(reg.groups.me, slot),
        bell: Bell::Client,
    };
    let peer = reg.groups.group[client];
    if let Err(e) = core
        .transport
        .put_signal(peer, &reg.peer_ctrl[peer], 0, &[], ack, seq)
    {
        core.record_server_error(format!("acknowledging rank {peer}: {e}"));
    }
}

/// A device engine's landing chunk: enqueues its add on the daemon's
/// stream, and the acknowledgement after it (the client reuses the slot only
/// once the add has read it). A rejected chunk is acknowledged at once.
fn add_on_device(
    core: &Core,
    reg: &Registered,
    plane: &dyn Plane,
    client: usize,
    slot: usize,
    seq: u64,
) {
    let peer = reg.groups.group[client];
    let lay = &reg.ctrl_layout;
    let enqueued = checked_header(reg, client, slot, seq).and_then(|h| {
        let x = plane.local_landing() + lay.landing_data(client, slot) as u64;
        let acc = match h.owner {
            // Node aggregation: into this rank's node buffer for `owner`.
            Some(owner) => {
                let (sums, owner) = node_sum_target(reg, client, &h, owner)?;
                sums.addr(owner, reg.accum_off[h.bucket], h.offset)
            }
            None => reg.accum_addr(plane, h.bucket, h.offset),
        };
        // SAFETY: `checked_header` put the range inside the bucket's
        // accumulator and the data (a compressed chunk's too) inside the
        // slot; the client leaves the slot alone until the acknowledgement,
        // enqueued after the add.
        unsafe {
            match h.compress {
                Some(spec) => plane
                    .ops()
                    .dequantise_accumulate_on_server(acc, x, spec, h.len, h.scale),
                None => plane
                    .ops()
                    .accumulate_on_server(acc, x, h.dtype, h.len, h.scale),
            }
        }
        .map_err(|e| format!("rank {peer}: {e}"))?;
        let (transport, errors) = (Arc::clone(&core.transport), Arc::clone(&core.server_error));
        let desc = reg.peer_ctrl[peer];
        let ack = SignalRef {
            offset: lay.ack(reg.groups.me, slot),
            bell: Bell::Client,
        };
        let work = Box::new(move || {
            if let Err(e) = transport.put_signal(peer, &desc, 0, &[], ack, seq) {
                record_error(&errors, format!("acknowledging rank {peer}: {e}"));
            }
        });
        plane
            .ops()
            .then(plane.ops().server_stream(), work)
            .map_err(|e| format!("acknowledging rank {peer}: {e}"))
    });
    if let Err(msg) = enqueued {
        core.record_server_error(msg);
        acknowledge(core, reg, client, slot, seq);
    }
}

/// Reports own slice `gen` dropped (unusable) and wakes its client.
fn finish_own(core: &Core, gen: u64) {
    if core.own.claim(gen) {
        core.own.unclaim(gen, true);
    }
    core.transport.ring(Bell::Client);
}

/// Where a range of an accumulator is added: the f32 accumulator, or in
/// deterministic mode the exact one, with the f32 accumulator beside it for
/// infinities and NaNs ([`odc_kernels::cpu::exact`]).
enum Target<'a> {
    F32(&'a mut [f32]),
    Exact(&'a mut [i128], &'a mut [f32]),
}

impl Target<'_> {
    /// Adds `scale · data` (elements of `dtype`) into elements `range` of
    /// the target.
    fn add(
        &mut self,
        range: Range<usize>,
        data: &[u8],
        dtype: DType,
        scale: f32,
    ) -> odc_kernels::Result<()> {
        match self {
            Target::F32(acc) => accumulate_into_f32(&mut acc[range], data, dtype, scale),
            Target::Exact(fixed, spill) => accumulate_exact(
                &mut fixed[range.clone()],
                &mut spill[range],
                data,
                dtype,
                scale,
            ),
        }
    }

    /// Adds the checked chunk `h`'s slot data `data` into elements `range`
    /// of the target: `h.len` elements of `h.dtype`, or a compressed chunk
    /// dequantised into f32 in one pass.
    fn add_chunk(
        &mut self,
        range: Range<usize>,
        data: &[u8],
        h: &Chunk,
    ) -> odc_kernels::Result<()> {
        match (h.compress, self) {
            (None, target) => target.add(range, data, h.dtype, h.scale),
            (Some(spec), Target::F32(acc)) => {
                dequantise_accumulate_chunk(spec, data, &mut acc[range], h.scale)
            }
            (Some(spec), Target::Exact(..)) => Err(odc_kernels::Error::InvalidArgument {
                op: "accumulate",
                detail: format!(
                    "a compressed chunk ({spec}) into an exact accumulator: deterministic mode \
                     takes no compressed pushes"
                ),
            }),
        }
    }
}

/// The accumulator range `[offset, offset + len)` of bucket `b`, checked.
///
/// # Safety
/// Only the server thread may call this, and it may hold one returned
/// target at a time: the accumulators are written only by that thread while
/// pushes are in flight (the worker reads or zeroes them only after
/// `finish_minibatch`, ordered by the ack/done release-acquire chain).
unsafe fn accum_range(reg: &Registered, b: usize, offset: usize, len: usize) -> Option<Target<'_>> {
    let bucket = reg.buckets.get(b)?;
    if offset.checked_add(len)? > bucket.shard_len() {
        return None;
    }
    let (acc_ptr, _) = reg.accum_ptr(b);
    // SAFETY: in range (checked); exclusive per the caller's contract.
    let acc = unsafe { std::slice::from_raw_parts_mut(acc_ptr.add(offset), len) };
    let Some(exact) = &reg.exact else {
        return Some(Target::F32(acc));
    };
    // Read by the finish after this add's acknowledgement and the done that
    // follows it.
    exact.touched[b].store(true, Ordering::Release);
    // SAFETY: the exact accumulator has the same element offsets and
    // lengths as the f32 one; exclusive per the caller's contract.
    let fixed = unsafe {
        std::slice::from_raw_parts_mut(reg.exact_at(exact, reg.accum_off[b] + offset), len)
    };
    Some(Target::Exact(fixed, acc))
}

/// `len` elements of the own slice from element `from`, as bytes.
///
/// # Safety
/// The caller holds the hand-off claim of `own.gen`, so the client's buffer
/// is live and unchanged, and `from + len <= own.slice.len`.
unsafe fn own_bytes(own: &Own, from: usize, len: usize) -> &[u8] {
    let size = own.dtype.size_bytes();
    // SAFETY: the client posted `slice.len` elements at `addr` and keeps
    // them alive and unwritten while the claim is held (caller's contract).
    unsafe { std::slice::from_raw_parts((own.slice.addr + from * size) as *const u8, len * size) }
}

/// Adds the last chunk still pending of the own slice on its own.
fn add_own_solo(core: &Core, reg: &Registered, own_slot: &mut Option<Own>) {
    let Some(own) = own_slot.as_mut() else { return };
    if !core.own.claim(own.gen) {
        // Revoked by its client: drop it untouched.
        *own_slot = None;
        return;
    }
    let chunk = (reg.ctrl_layout.chunk_bytes() / own.dtype.size_bytes()).max(1);
    let len = chunk.min(own.back - own.front);
    let from = own.back - len;
    // SAFETY: the server thread, one accumulator slice at a time.
    let acc = unsafe { accum_range(reg, own.slice.bucket, own.slice.offset + from, len) };
    let result = match acc {
        None => Err(format!(
            "own slice of {} elements at {} outside bucket {}'s shard",
            own.slice.len, own.slice.offset, own.slice.bucket
        )),
        Some(mut acc) => {
            // SAFETY: claimed above; `from + len = back <= slice.len`.
            let data = unsafe { own_bytes(own, from, len) };
            acc.add(0..len, data, own.dtype, own.slice.scale)
                .map_err(|e| {
                    let name = reg.buckets[own.slice.bucket].name();
                    format!("this rank's own slice of bucket {name:?}: {e}")
                })
        }
    };
    own.back = from;
    if let Err(msg) = result {
        core.record_server_error(msg);
        own.back = own.front;
    }
    let finished = own.front == own.back;
    core.own.unclaim(own.gen, finished);
    if finished {
        core.transport.ring(Bell::Client);
        *own_slot = None;
    }
}

/// Adds the chunk in landing slot `[client][slot]` into its accumulator,
/// fused with the same range of the own slice when that is next in line.
fn accumulate(
    core: &Core,
    reg: &Registered,
    client: usize,
    slot: usize,
    seq: u64,
    own_slot: &mut Option<Own>,
) -> Result<(), String> {
    let h = checked_header(reg, client, slot, seq)?;
    let rank = reg.groups.group[client];
    let (b, offset, len, bytes) = (h.bucket, h.offset, h.len, h.bytes);
    if let Some(owner) = h.owner {
        return add_to_node_sum(reg, client, slot, &h, owner);
    }
    // SAFETY: the server thread, one accumulator slice at a time.
    let mut acc = unsafe { accum_range(reg, b, offset, len) }
        .ok_or_else(|| format!("rank {rank}: push outside the shard"))?;
    // SAFETY: the data lies inside the control region (bytes <= chunk) and
    // is stable until we acknowledge, as in `checked_header`.
    let data = unsafe {
        std::slice::from_raw_parts(
            reg.ctrl
                .as_ptr()
                .add(reg.ctrl_layout.slot_data(client, slot)),
            bytes,
        )
    };
    // A compressed chunk is added alone (its elements are not addressable
    // one by one); the own slice goes on its own.
    let pairs = h.compress.is_none()
        && own_slot
            .as_ref()
            .is_some_and(|o| o.slice.bucket == b && o.slice.offset + o.front == offset);
    let rejected = |e| {
        format!(
            "rank {rank}'s push into bucket {:?}: {e}",
            reg.buckets[b].name()
        )
    };
    let Some(own) = own_slot.as_mut().filter(|_| pairs) else {
        return acc.add_chunk(0..len, data, &h).map_err(rejected);
    };
    if !core.own.claim(own.gen) {
        *own_slot = None;
        return acc.add_chunk(0..len, data, &h).map_err(rejected);
    }
    // The pending front of the own slice may be shorter than the chunk
    // (its back was added alone): pair what overlaps, add the rest alone.
    let paired = len.min(own.back - own.front);
    // SAFETY: claimed above; `front + paired <= back <= slice.len`.
    let mine = unsafe { own_bytes(own, own.front, paired) };
    let (ms, ds) = (own.dtype.size_bytes(), h.dtype.size_bytes());
    let mut result = Ok(());
    for s in (0..paired).step_by(FUSE_BLOCK) {
        let e = (s + FUSE_BLOCK).min(paired);
        result = acc
            .add(s..e, &mine[s * ms..e * ms], own.dtype, own.slice.scale)
            .and_then(|()| acc.add(s..e, &data[s * ds..e * ds], h.dtype, h.scale));
        if result.is_err() {
            break;
        }
    }
    if result.is_ok() && paired < len {
        result = acc.add(paired..len, &data[paired * ds..], h.dtype, h.scale);
    }
    own.front += paired;
    let finished = own.front == own.back;
    core.own.unclaim(own.gen, finished);
    if finished {
        core.transport.ring(Bell::Client);
        *own_slot = None;
    }
    result.map_err(rejected)
}

/// Node aggregation: adds the chunk in landing slot `[client][slot]` (its
/// checked header `h`), pushed by a node-mate for `owner`, into
/// this rank's node buffer for `owner` ([`node_sum_target`]).
fn add_to_node_sum(
    reg: &Registered,
    client: usize,
    slot: usize,
    h: &Chunk,
    owner: u32,
) -> Result<(), String> {
    let (sums, owner) = node_sum_target(reg, client, h, owner)?;
    let (b, offset, len) = (h.bucket, h.offset, h.len);
    // SAFETY: `checked_header` put the range inside the bucket's shard; the
    // buffer holds `shard_len` f32s per bucket and replica, written only by
    // this thread while it is open (the worker clears it before opening it
    // again); the slot's data is stable until acknowledged.
    let (acc, data) = unsafe {
        (
            std::slice::from_raw_parts_mut(sums.ptr(owner, reg.accum_off[b], offset), len),
            std::slice::from_raw_parts(
                reg.ctrl
                    .as_ptr()
                    .add(reg.ctrl_layout.slot_data(client, slot)),
                h.bytes,
            ),
        )
    };
    let added = match h.compress {
        None => accumulate_into_f32(acc, data, h.dtype, h.scale),
        Some(spec) => dequantise_accumulate_chunk(spec, data, acc, h.scale),
    };
    added.map_err(|e| {
        format!(
            "rank {}'s push for rank {owner} into bucket {:?}: {e}",
            reg.groups.group[client],
            reg.buckets[b].name()
        )
    })
}

/// Node aggregation: the node buffers a chunk (checked header `h`) that
/// `client` pushed for `owner` goes into, and `owner` as an index; the
/// bucket's buffer for `owner` is marked touched (read by the worker after
/// the chunk's acknowledgement and the done that follows it). Refused when
/// this rank keeps no buffers or `owner` is not one of its replicas (a rank
/// on another node with its local rank) or the client is not on its node.
fn node_sum_target<'r>(
    reg: &'r Registered,
    client: usize,
    h: &Chunk,
    owner: u32,
) -> Result<(&'r NodeSums, usize), String> {
    let rank = reg.groups.group[client];
    let Some(sums) = &reg.sums else {
        return Err(format!(
            "rank {rank}: a push for rank {owner} through this rank, which sums no node's \
             gradients (cross_node is not \"node\" here)"
        ));
    };
    let (me, local) = (reg.groups.group[reg.groups.me], sums.local);
    let owner = owner as usize;
    if !crate::protocol::nodesum::aggregates(me, rank, owner, sums.nodes, local) {
        return Err(format!(
            "rank {rank}: a push for rank {owner} through rank {me}, which is not its \
             aggregator (nodes of {local})"
        ));
    }
    sums.touched(owner, h.bucket).store(true, Ordering::Release);
    Ok((sums, owner))
}

/// Reads the header of landing slot `[client][slot]`, whose signal reads
/// `seq`, and checks it against the registered layout
/// ([`check_header`]): the chunk to add, or why it is refused.
fn checked_header(reg: &Registered, client: usize, slot: usize, seq: u64) -> Result<Chunk, String> {
    let lay = &reg.ctrl_layout;
    // `client` indexes the shard group; errors name the global rank.
    check_header(
        &raw_header(reg, client, slot),
        seq,
        reg.groups.group[client],
        &reg.buckets,
        lay.chunk_bytes(),
    )
    .map_err(|e| e.to_string())
}
