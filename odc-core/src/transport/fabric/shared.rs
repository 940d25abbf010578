//! What the transport and its progress thread share ([`Core`]): own and
//! remote regions, operation slots, read credits, bells; the progress loop
//! that dispatches completions; posting and waiting for one operation;
//! liveness probes and close notices.
//!
//! One file because the progress thread, the operation slots, the read
//! credits and the close notices all mutate `Core`'s private state, whose
//! invariants are stated once, here.

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::safe::{Av, Cq, Domain, Ep, Granted, Mr};
use super::signal::{Imm, Update, MAILBOX};
use super::{result, sys};
use super::{
    EAGAIN_STALL, FANOUT_BATCH, MAX_REGIONS, NOTICE_STRIDE, NOTICE_TIMEOUT, OFF_NOTICES,
    PROBE_PERIOD, PROBE_TIMEOUT, PROGRESS_BLOCK_MS, STATE_CLOSED, STATUS_ID,
};
use crate::region::{Bell, RegionDesc, RemoteRegion};
use crate::sync::{Backoff, EventCount, Ordering};
use crate::transport::PeerStatus;
use crate::{Error, Result};

/// Memory this rank registered and its MR. Shared by the [`LocalRegion`]
/// and the region table the progress thread stores signals through, so the
/// memory outlives both. `backing` owns the memory (anonymous pages, or a
/// region another transport mapped); field order closes the MR before the
/// backing unmaps it.
///
/// [`LocalRegion`]: crate::region::LocalRegion
pub(super) struct OwnRegion {
    pub(super) mr: Mr,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) _backing: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for OwnRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnRegion")
            .field("mr", &self.mr)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

// SAFETY: plain memory; access goes through raw pointers and atomics under
// the protocol's ordering; the MR is thread safe (FI_THREAD_SAFE).
unsafe impl Send for OwnRegion {}
// SAFETY: as above.
unsafe impl Sync for OwnRegion {}

impl OwnRegion {
    pub(super) fn word(&self, offset: usize) -> Option<&std::sync::atomic::AtomicU64> {
        if offset % 8 != 0 || offset.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: in range and aligned (page-aligned base); signal words are
        // only accessed atomically.
        Some(unsafe { &*self.ptr.add(offset).cast::<std::sync::atomic::AtomicU64>() })
    }
}

/// A connected peer.
#[derive(Debug)]
pub(super) struct Peer {
    /// `None` for this rank itself.
    pub(super) addr: Option<u64>,
    pub(super) regions: Vec<Option<RemoteRegion>>,
    pub(super) dead: AtomicBool,
    pub(super) blamed: AtomicU64,
    pub(super) probing: AtomicBool,
    /// Set once the warm-up operation completed (the connection is up).
    pub(super) warm: AtomicBool,
    /// Set once `peer_status` waited for the close notice of this peer.
    pub(super) notice_awaited: AtomicBool,
    /// Milliseconds since the transport started, of the last probe.
    pub(super) last_probe: AtomicU64,
    /// Where a probe reads the peer's status region into.
    pub(super) probe_buf: ProbeBuf,
}

/// The destination of a probe's read. It lives as long as the transport,
/// not the probe: a probe that gives up or passes its deadline abandons a
/// read that may still land.
#[derive(Default)]
pub(super) struct ProbeBuf(UnsafeCell<[u8; 16]>);

impl std::fmt::Debug for ProbeBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProbeBuf")
    }
}

// SAFETY: only the thread holding `Peer::probing` touches the buffer, and
// the read it posted; a probe whose read was abandoned leaves `probing`
// set for good, so nothing reads or posts into it again.
unsafe impl Sync for ProbeBuf {}

impl Peer {
    pub(super) fn region(&self, id: u32) -> Option<RemoteRegion> {
        self.regions.get(id as usize).copied().flatten()
    }
}

/// One operation in flight: the `fi_context` libfabric owns while it runs,
/// and its outcome.
#[repr(C, align(64))]
pub(super) struct OpSlot {
    pub(super) ctx: UnsafeCell<[*mut c_void; 4]>,
    pub(super) state: AtomicU32,
    pub(super) err: AtomicI32,
}

pub(super) const SLOT_FREE: u32 = 0;
pub(super) const SLOT_POSTED: u32 = 1;
pub(super) const SLOT_DONE: u32 = 2;
pub(super) const SLOT_FAILED: u32 = 3;
/// Its caller gave up; the progress thread frees it when it completes.
pub(super) const SLOT_ABANDONED: u32 = 4;

/// Everything the transport and its progress thread share.
pub(super) struct Core {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) host: String,
    pub(super) timeout: Duration,
    pub(super) started: Instant,
    pub(super) granted: Granted,
    pub(super) mr_local: bool,
    pub(super) mr_virt: bool,
    pub(super) mr_prov_key: bool,
    pub(super) mr_endpoint: bool,
    pub(super) name: Vec<u8>,
    pub(super) ep: Arc<Ep>,
    pub(super) cq: Arc<Cq>,
    pub(super) av: Arc<Av>,
    pub(super) domain: Arc<Domain>,
    pub(super) regions: Vec<OnceLock<Arc<OwnRegion>>>,
    pub(super) peers: Vec<OnceLock<Peer>>,
    pub(super) ops: Box<[OpSlot]>,
    /// Where the next search for a free operation slot starts (a hint).
    pub(super) next_slot: AtomicUsize,
    pub(super) ops_done: EventCount,
    pub(super) credits: AtomicUsize,
    pub(super) credit_freed: EventCount,
    pub(super) bells: [EventCount; 2],
    /// Rung after `bells` whenever they are (see
    /// [`FabricTransport::forward_bells`](super::FabricTransport::forward_bells)).
    pub(super) forward: OnceLock<BellForward>,
    /// What the owning transport knows of peers' failures (see
    /// [`FabricTransport::forward_reports`](super::FabricTransport::forward_reports)).
    pub(super) reports: OnceLock<PeerReports>,
    /// The region and words whose signals wake the node, and how (see
    /// [`FabricTransport::ring_node_on`](super::FabricTransport::ring_node_on)).
    pub(super) node_ring: OnceLock<(u32, std::ops::Range<usize>, NodeRing)>,
    pub(super) stop: AtomicBool,
    pub(super) progress_errors: AtomicU64,
    /// The panic message of the progress thread, if it panicked: no
    /// completion arrives any more ([`Core::progress_failed`]).
    pub(super) progress_failure: OnceLock<String>,
    /// Tests: the progress thread panics at its next turn.
    #[cfg(test)]
    pub(super) inject_panic: AtomicBool,
    /// Next key for a per-operation local registration (`FI_MR_LOCAL`).
    pub(super) local_keys: AtomicU64,
    /// Seed of the completion-shuffling test mode, when it is on.
    pub(super) reorder: Option<u64>,
}

// SAFETY: the op slots' contexts are written only by the thread that owns
// the slot (state POSTED by its CAS) before posting, and by libfabric while
// the operation runs; every other field is thread safe.
unsafe impl Sync for Core {}
// SAFETY: as above; the raw pointers in slots are libfabric's scratch.
unsafe impl Send for Core {}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("rank", &self.rank)
            .field("granted", &self.granted)
            .field("mr_local", &self.mr_local)
            .field("mr_virt", &self.mr_virt)
            .field("mr_prov_key", &self.mr_prov_key)
            .field("mr_endpoint", &self.mr_endpoint)
            .finish_non_exhaustive()
    }
}

/// What a burst of completions calls for: a wake-up of the operations'
/// waiters, of the server bell, of the client bell.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Wakes {
    ops: bool,
    server: bool,
    client: bool,
    /// A signal landed in the words that wake the node ([`NodeRing`]).
    node: bool,
}

/// A callback that rings another transport's bell.
pub type BellForward = Arc<dyn Fn(Bell) + Send + Sync>;

/// A callback that rings this node's other ranks' client bells
/// ([`FabricTransport::ring_node_on`](super::FabricTransport::ring_node_on)).
pub type NodeRing = Arc<dyn Fn() + Send + Sync>;

/// One pure signal of a fan-out: the peer, its address, the region and
/// the immediate that names the word (see `Core::post_raise_batch`).
pub(super) type Target = (usize, u64, RemoteRegion, u32);

/// A fan-out batch's storage, filled from the front.
pub(super) fn no_targets() -> [Target; FANOUT_BATCH] {
    let none = RemoteRegion {
        id: 0,
        base: 0,
        len: 0,
        key: 0,
    };
    [(0, 0, none, 0); FANOUT_BATCH]
}

/// A callback that names a rank known (to the caller) to have failed
/// because of the given peer, if there is one.
pub type PeerReports = Arc<dyn Fn(usize) -> Option<usize> + Send + Sync>;

pub(super) fn bell_index(bell: Bell) -> usize {
    match bell {
        Bell::Server => 0,
        Bell::Client => 1,
    }
}

impl Core {
    /// Registers `len` zeroed bytes of fresh anonymous memory as region `id`.
    pub(super) fn register(&self, id: u32, len: usize) -> Result<Arc<OwnRegion>> {
        let len = len.max(64);
        let mut map = memmap2::MmapMut::map_anon(len)
            .map_err(|e| Error::transport_io("mmap", format!("region {id} ({len} bytes)"), e))?;
        let ptr = map.as_mut_ptr();
        // SAFETY: the anonymous mapping is `len` bytes, page aligned, and
        // owned by the backing it is moved into.
        unsafe { self.register_memory(id, ptr, len, Box::new(map)) }
    }

    /// Registers `len` bytes at `ptr`, owned by `backing`, as region `id`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, 64-byte
    /// aligned, and stay valid until `backing` is dropped; nothing but
    /// `backing` may free it.
    pub(super) unsafe fn register_memory(
        &self,
        id: u32,
        ptr: *mut u8,
        len: usize,
        backing: Box<dyn Send + Sync>,
    ) -> Result<Arc<OwnRegion>> {
        let slot = self.regions.get(id as usize).ok_or_else(|| {
            Error::transport("register", format!("region id {id} >= {MAX_REGIONS}"))
        })?;
        if slot.get().is_some() {
            return Err(Error::transport(
                "register",
                format!("region id {id} registered twice"),
            ));
        }
        let ep = self.mr_endpoint.then_some(&self.ep);
        // A key nobody outside the job can guess (ignored where the
        // provider picks its own, FI_MR_PROV_KEY); peers learn it only
        // through the job's store.
        let key = random_key()?;
        // SAFETY: the memory is valid for `len` bytes while `backing` lives
        // (the caller's contract); the backing lives in the same OwnRegion
        // as the MR and is dropped after it (field order).
        let mr = unsafe { Mr::register(&self.domain, ptr, len, true, key, ep)? };
        let region = Arc::new(OwnRegion {
            mr,
            ptr,
            len,
            _backing: backing,
        });
        slot.set(Arc::clone(&region)).map_err(|_| {
            Error::transport("register", format!("region id {id} registered twice"))
        })?;
        Ok(region)
    }

    /// The progress thread panicked with `detail`: records it, tells the
    /// peers this rank is gone (as closing does) and wakes every waiter of
    /// this rank, which then fails with [`Core::progress_failed`].
    pub(super) fn progress_panicked(&self, detail: String) {
        let _ = self.progress_failure.set(detail);
        if let Some(w) = (self.regions.get(STATUS_ID as usize))
            .and_then(OnceLock::get)
            .and_then(|r| r.word(0))
        {
            w.store(STATE_CLOSED, Ordering::Release);
        }
        self.send_notices(true);
        self.ops_done.notify();
        self.credit_freed.notify();
        self.ring(Bell::Client);
        self.ring(Bell::Server);
    }

    /// The error every operation of this rank fails with once the progress
    /// thread panicked (no completion would ever arrive).
    pub(super) fn progress_failed(&self) -> Option<Error> {
        self.progress_failure.get().map(|detail| Error::Internal {
            rank: self.rank,
            during: "its libfabric progress thread was reading completions".to_owned(),
            detail: detail.clone(),
        })
    }

    /// Rings this rank's `bell`, and whatever bell it is forwarded to.
    pub(super) fn ring(&self, bell: Bell) {
        self.bells[bell_index(bell)].notify();
        if let Some(forward) = self.forward.get() {
            forward(bell);
        }
    }

    pub(super) fn remote(&self, r: &OwnRegion, id: u32) -> RemoteRegion {
        RemoteRegion {
            id,
            base: if self.mr_virt { r.ptr as u64 } else { 0 },
            len: r.len as u64,
            key: r.mr.key(),
        }
    }

    pub(super) fn peer(&self, peer: usize) -> Result<&Peer> {
        self.peers
            .get(peer)
            .and_then(OnceLock::get)
            .ok_or_else(|| Error::transport("lookup", format!("rank {peer} is not connected")))
    }

    pub(super) fn elapsed_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    // ---- progress ---------------------------------------------------------

    pub(super) fn progress_loop(&self) {
        let mut buf = [sys::CqEntry::default(); 16];
        let mut quiet_since: Option<Instant> = None;
        // Seeded per rank: ranks of one job shuffle differently.
        let mut shuffler = self
            .reorder
            .map(|seed| Shuffler::new(seed ^ (self.rank as u64).wrapping_mul(0x9e37_79b9)));
        let mut due = Vec::new();
        loop {
            #[cfg(test)]
            if self.inject_panic.load(Ordering::Acquire) {
                panic!("injected into the progress thread by a test");
            }
            let stopping = self.stop.load(Ordering::Acquire);
            // On stop, drain until the CQ stays quiet: closing an endpoint
            // with a partly arrived write crashed libfabric 1.17.
            let mut block = if stopping { 5 } else { PROGRESS_BLOCK_MS };
            if let Some(next) = shuffler.as_ref().and_then(Shuffler::next_due) {
                let ms = next.saturating_duration_since(Instant::now()).as_millis();
                block = block.min(i32::try_from(ms).unwrap_or(i32::MAX).max(1));
            }
            let read = self.cq.sread(&mut buf, block);
            if let Some(s) = shuffler.as_mut() {
                // Test mode: every completion is held back a random while
                // and the due ones are dispatched in a random order.
                if let Ok(n) = read {
                    buf[..n.max(0) as usize].iter().for_each(|e| s.hold(*e));
                }
                s.take_due(if stopping { None } else { Some(Instant::now()) }, &mut due);
                let mut wakes = Wakes::default();
                due.drain(..).for_each(|e| self.dispatch(&e, &mut wakes));
                self.wake(wakes);
            }
            match read {
                Ok(n) if n > 0 => {
                    quiet_since = None;
                    if shuffler.is_none() {
                        // One wake-up per bell for the whole burst, not
                        // one per completion.
                        let mut wakes = Wakes::default();
                        for e in &buf[..n as usize] {
                            self.dispatch(e, &mut wakes);
                        }
                        self.wake(wakes);
                    }
                }
                Ok(0) => {
                    if stopping {
                        let since = *quiet_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= Duration::from_millis(20) {
                            return;
                        }
                    }
                }
                Ok(_) => self.dispatch_error(),
                Err(e) => {
                    if self.progress_errors.fetch_add(1, Ordering::Relaxed) < 5 {
                        eprintln!("odc: fabric rank {}: progress: {e}", self.rank);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                    if stopping {
                        return;
                    }
                }
            }
        }
    }

    pub(super) fn slot_of(&self, ctx: *mut c_void) -> Option<&OpSlot> {
        let base = self.ops.as_ptr() as usize;
        let size = std::mem::size_of::<OpSlot>();
        let at = (ctx as usize).checked_sub(base)?;
        if at % size != 0 {
            return None;
        }
        self.ops.get(at / size)
    }

    pub(super) fn complete(&self, slot: &OpSlot, err: i32) {
        slot.err.store(err, Ordering::Relaxed);
        let done = if err == 0 { SLOT_DONE } else { SLOT_FAILED };
        if slot
            .state
            .compare_exchange(SLOT_POSTED, done, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // Abandoned by its caller: libfabric is done with it now.
            slot.state.store(SLOT_FREE, Ordering::Release);
        }
    }

    /// Wakes whoever waits for what a burst of completions did.
    fn wake(&self, wakes: Wakes) {
        if wakes.ops {
            self.ops_done.notify();
        }
        for (bell, rung) in [(Bell::Server, wakes.server), (Bell::Client, wakes.client)] {
            if rung {
                self.ring(bell);
            }
        }
        if wakes.node {
            if let Some((_, _, ring)) = self.node_ring.get() {
                ring();
            }
        }
    }

    /// Carries out one completion; records in `wakes` whom it concerns.
    pub(super) fn dispatch(&self, e: &sys::CqEntry, wakes: &mut Wakes) {
        if let Some(slot) = self.slot_of(e.op_context) {
            self.complete(slot, 0);
            wakes.ops = true;
            return;
        }
        if e.flags & result::consts::remote_cq_data() == 0 {
            return;
        }
        let imm = Imm::decode(e.data);
        let own = self
            .regions
            .get(imm.region as usize)
            .and_then(OnceLock::get);
        let words = own.and_then(|r| {
            let (word, mailbox) = imm.words(r.len)?;
            Some((r.word(word)?, mailbox.and_then(|m| r.word(m))))
        });
        let updated = match (imm.update, words) {
            // The write is in memory (its completion says so): its data
            // for a count, the value in the mailbox for a raise. The
            // release order publishes it with the word.
            (Update::Count, Some((w, _))) => {
                w.fetch_add(1, Ordering::Release);
                true
            }
            (Update::Raise, Some((w, Some(mailbox)))) => {
                w.fetch_max(
                    u64::from_le(mailbox.load(Ordering::Acquire)),
                    Ordering::Release,
                );
                true
            }
            _ => false,
        };
        if updated {
            match imm.bell {
                Bell::Server => wakes.server = true,
                Bell::Client => wakes.client = true,
            }
            if let Some((region, words, _)) = self.node_ring.get() {
                wakes.node |= imm.region == *region && words.contains(&imm.offset);
            }
        } else if self.progress_errors.fetch_add(1, Ordering::Relaxed) < 5 {
            eprintln!(
                "odc: fabric rank {}: signal for unknown word {} of region {}",
                self.rank, imm.offset, imm.region
            );
        }
    }

    pub(super) fn dispatch_error(&self) {
        match self.cq.readerr() {
            Ok((ctx, err, text)) => match self.slot_of(ctx) {
                Some(slot) => {
                    self.complete(slot, err.max(1));
                    self.ops_done.notify();
                }
                None => {
                    if self.progress_errors.fetch_add(1, Ordering::Relaxed) < 5 {
                        eprintln!(
                            "odc: fabric rank {}: completion error {err}: {text}",
                            self.rank
                        );
                    }
                }
            },
            Err(e) => {
                if self.progress_errors.fetch_add(1, Ordering::Relaxed) < 5 {
                    eprintln!("odc: fabric rank {}: {e}", self.rank);
                }
            }
        }
    }

    // ---- operations -------------------------------------------------------

    pub(super) fn acquire_slot(&self, deadline: Instant) -> Result<(usize, *mut c_void)> {
        let mut backoff = Backoff::new();
        let n = self.ops.len();
        loop {
            let epoch = self.ops_done.epoch();
            // From the slot after the last one taken: a batch holds the
            // slots before it, which a scan from 0 would try one by one.
            let from = self.next_slot.load(Ordering::Relaxed);
            for i in (from..n).chain(0..from) {
                let s = &self.ops[i];
                if s.state
                    .compare_exchange(SLOT_FREE, SLOT_POSTED, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    self.next_slot.store((i + 1) % n, Ordering::Relaxed);
                    return Ok((i, s.ctx.get().cast()));
                }
            }
            if let Some(e) = self.progress_failed() {
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Err(Error::transport(
                    "fabric",
                    "no free operation slot before the deadline",
                ));
            }
            if backoff.is_completed() {
                self.ops_done.wait(epoch, Duration::from_millis(10));
            } else {
                backoff.snooze();
            }
        }
    }

    pub(super) fn acquire_credit(&self, deadline: Instant) -> Result<()> {
        let mut backoff = Backoff::new();
        loop {
            let epoch = self.credit_freed.epoch();
            let n = self.credits.load(Ordering::Acquire);
            if n > 0 {
                if self
                    .credits
                    .compare_exchange(n, n - 1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(());
                }
                continue;
            }
            if Instant::now() >= deadline {
                return Err(Error::transport(
                    "get",
                    "no read credit before the deadline",
                ));
            }
            if backoff.is_completed() {
                self.credit_freed.wait(epoch, Duration::from_millis(10));
            } else {
                backoff.snooze();
            }
        }
    }

    pub(super) fn release_credit(&self) {
        self.credits.fetch_add(1, Ordering::AcqRel);
        self.credit_freed.notify();
    }

    pub(super) fn mark_dead(&self, peer: usize) {
        if let Some(p) = self.peers.get(peer).and_then(OnceLock::get) {
            p.dead.store(true, Ordering::Release);
        }
        // Waiters on this rank re-check (and probe) at once.
        self.ring(Bell::Client);
    }

    /// Posts one operation with `post(ctx)` (retrying `-FI_EAGAIN`) and
    /// waits for its completion, until `deadline`. On failure the peer is
    /// marked dead.
    pub(super) fn run_op(
        &self,
        peer: usize,
        what: &'static str,
        deadline: Instant,
        post: impl Fn(*mut c_void) -> i32,
    ) -> Result<()> {
        let i = self.start_op(peer, what, deadline, post)?;
        self.finish_op(peer, what, deadline, i)
    }

    /// The first half of [`run_op`](Self::run_op): takes an operation slot
    /// and posts, retrying `-FI_EAGAIN` (a connection being set up) until
    /// the deadline. Returns the slot, whose completion
    /// [`finish_op`](Self::finish_op) must then wait for (what the operation
    /// reads or writes must live until then).
    pub(super) fn start_op(
        &self,
        peer: usize,
        what: &'static str,
        deadline: Instant,
        post: impl Fn(*mut c_void) -> i32,
    ) -> Result<usize> {
        let (i, ctx) = self.acquire_slot(deadline)?;
        let slot = &self.ops[i];
        let mut backoff = Backoff::new();
        let mut nap = Duration::from_micros(50);
        let first_try = Instant::now();
        let connected = self
            .peers
            .get(peer)
            .and_then(OnceLock::get)
            .is_some_and(|p| p.warm.load(Ordering::Acquire));
        loop {
            let ret = post(ctx);
            if ret == 0 {
                break;
            }
            let free = || slot.state.store(SLOT_FREE, Ordering::Release);
            if ret != result::eagain() {
                free();
                // A post returns 0 or a negative error code.
                return Err(match result::check(what, ret) {
                    Ok(_) => Error::transport(what, format!("returned {ret}")),
                    Err(e) => e,
                })
                .map_err(|e| with_peer(e, peer));
            }
            // A killed or closed peer's connection answers -FI_EAGAIN until
            // EAGAIN_STALL; its close notice, or a rank that failed because
            // of it, says so sooner. Nothing is posted yet, so giving up
            // leaves nothing in flight.
            let gone = || self.notice(peer).is_some() || self.reported(peer).is_some();
            if backoff.is_completed() && gone() {
                free();
                // The caller's attribution names the rank that reported it.
                return Err(peer_died(peer, format!("its {what} to be accepted")));
            }
            let stalled = connected && first_try.elapsed() >= EAGAIN_STALL;
            if Instant::now() >= deadline || stalled {
                free();
                self.mark_dead(peer);
                return Err(peer_died(
                    peer,
                    format!("its {what} to be accepted (FI_EAGAIN until the deadline)"),
                ));
            }
            // RDM connects lazily: the first operations to a peer get
            // -FI_EAGAIN for tens of milliseconds while the progress
            // thread sets the connection up.
            if backoff.is_completed() {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(5));
            } else {
                backoff.snooze();
            }
        }
        Ok(i)
    }

    /// The second half of [`run_op`](Self::run_op): waits for slot `i`'s
    /// completion and frees the slot; past the deadline cancels the
    /// operation and counts `peer` as dead. Gives up sooner once `peer`'s
    /// close notice arrives or a rank reports failing because of it (a
    /// write to a killed peer may otherwise wait for the provider's own
    /// timeout before it fails).
    pub(super) fn finish_op(
        &self,
        peer: usize,
        what: &'static str,
        deadline: Instant,
        i: usize,
    ) -> Result<()> {
        let gone = || self.notice(peer).is_some() || self.reported(peer).is_some();
        self.finish_op_or(peer, what, deadline, i, &gone)
    }

    /// [`finish_op`](Self::finish_op) that also stops waiting once
    /// `give_up` says so (checked at least every 10 ms): the operation is
    /// then cancelled as at the deadline, but `peer` is not marked dead by
    /// it (whoever gave up knows why).
    pub(super) fn finish_op_or(
        &self,
        peer: usize,
        what: &'static str,
        deadline: Instant,
        i: usize,
        give_up: &dyn Fn() -> bool,
    ) -> Result<()> {
        let slot = &self.ops[i];
        let ctx: *mut c_void = slot.ctx.get().cast();
        let mut backoff = Backoff::new();
        loop {
            let epoch = self.ops_done.epoch();
            match slot.state.load(Ordering::Acquire) {
                SLOT_DONE => {
                    slot.state.store(SLOT_FREE, Ordering::Release);
                    return Ok(());
                }
                SLOT_FAILED => {
                    let err = slot.err.load(Ordering::Relaxed);
                    slot.state.store(SLOT_FREE, Ordering::Release);
                    self.mark_dead(peer);
                    return Err(peer_died(
                        peer,
                        format!("its {what} to complete ({})", result::strerror(err)),
                    ));
                }
                _ => {}
            }
            if let Some(e) = self.progress_failed() {
                // No completion arrives any more: the slot stays taken (the
                // engine cannot go on), and the peer is not blamed.
                return Err(e);
            }
            let gave_up = backoff.is_completed() && give_up();
            if gave_up || Instant::now() >= deadline {
                // SAFETY: our slot is still POSTED: its completion is unread.
                let _ = unsafe { self.ep.cancel(ctx) };
                // Give the cancellation its completion; otherwise leave the
                // slot to the progress thread.
                let grace = Instant::now() + Duration::from_millis(100);
                while Instant::now() < grace && slot.state.load(Ordering::Acquire) == SLOT_POSTED {
                    let e = self.ops_done.epoch();
                    self.ops_done.wait(e, Duration::from_millis(5));
                }
                if slot
                    .state
                    .compare_exchange(
                        SLOT_POSTED,
                        SLOT_ABANDONED,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_err()
                {
                    slot.state.store(SLOT_FREE, Ordering::Release);
                }
                if gave_up {
                    return Err(peer_died(peer, format!("its {what} (given up)")));
                }
                self.mark_dead(peer);
                return Err(peer_died(
                    peer,
                    format!("its {what} to complete (no completion before the deadline)"),
                ));
            }
            if backoff.is_completed() {
                self.ops_done.wait(epoch, Duration::from_millis(10));
            } else {
                backoff.snooze();
            }
        }
    }

    /// Registers `buf` for one local operation when the provider wants
    /// local buffers registered (`FI_MR_LOCAL`).
    pub(super) fn local_mr(&self, buf: *mut u8, len: usize) -> Result<Option<Mr>> {
        if !self.mr_local || len == 0 {
            return Ok(None);
        }
        // Requested keys must be unique in the domain (unless the provider
        // picks them): region keys are random, local ones count up from a
        // random start.
        let key = self.local_keys.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller keeps `buf` alive until the Mr drops, which is
        // after the operation completed.
        unsafe { Mr::register(&self.domain, buf, len, false, key, None) }.map(Some)
    }

    pub(super) fn read(
        &self,
        peer: usize,
        p: &Peer,
        r: &RemoteRegion,
        offset: usize,
        dst: &mut [u8],
        deadline: Instant,
    ) -> Result<()> {
        self.read_or(peer, p, r, offset, dst, deadline, &|| false)
    }

    /// [`read`](Self::read) that stops waiting once `give_up` says so (see
    /// [`finish_op_or`](Self::finish_op_or)).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn read_or(
        &self,
        peer: usize,
        p: &Peer,
        r: &RemoteRegion,
        offset: usize,
        dst: &mut [u8],
        deadline: Instant,
        give_up: &dyn Fn() -> bool,
    ) -> Result<()> {
        let Some(addr) = p.addr else {
            return Err(Error::transport("get", "read from self over the fabric"));
        };
        let max = usize::try_from(self.granted.max_msg_size)
            .unwrap_or(usize::MAX)
            .clamp(4096, 1 << 30);
        self.acquire_credit(deadline)?;
        let out = (|| {
            let mr = self.local_mr(dst.as_mut_ptr(), dst.len())?;
            let desc = mr.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
            let mut done = 0;
            while done < dst.len() {
                let n = (dst.len() - done).min(max);
                let buf = dst[done..].as_mut_ptr();
                let raddr = r.base + (offset + done) as u64;
                let post = |ctx| {
                    // SAFETY: `buf` has `n` bytes and stays borrowed (and
                    // registered) until finish_op_or has seen the
                    // completion or abandoned the slot; `ctx` is our slot's
                    // fi_context.
                    unsafe { self.ep.post_read(buf, n, desc, addr, raddr, r.key, ctx) }
                };
                let i = self.start_op(peer, "fi_read", deadline, post)?;
                self.finish_op_or(peer, "fi_read", deadline, i, give_up)?;
                done += n;
            }
            drop(mr);
            Ok(())
        })();
        self.release_credit();
        out
    }

    pub(super) fn bounds(
        &self,
        peer: usize,
        p: &Peer,
        remote: &RegionDesc,
        offset: usize,
        len: usize,
    ) -> Result<RemoteRegion> {
        let r = p.region(remote.id).ok_or_else(|| {
            Error::transport("lookup", format!("rank {peer} has no region {}", remote.id))
        })?;
        let limit = r.len.min(remote.len);
        match (offset as u64).checked_add(len as u64) {
            Some(end) if end <= limit => Ok(r),
            _ => Err(Error::transport(
                "bounds",
                format!(
                    "{len} bytes at {offset} exceed region {} of rank {peer} ({limit} bytes)",
                    remote.id
                ),
            )),
        }
    }

    pub(super) fn status_word(&self, offset: usize) -> Option<&std::sync::atomic::AtomicU64> {
        self.regions
            .get(STATUS_ID as usize)
            .and_then(OnceLock::get)
            .and_then(|r| r.word(offset))
    }

    /// Records `peer` as the rank this rank failed because of (the first
    /// blame stands) and tells every live peer at once, before the error
    /// reaches the caller: a peer waiting on this rank then names `peer`
    /// even if this process exits before its next probe or its close.
    pub(super) fn blame(&self, peer: usize) {
        let Some(w) = self.status_word(8) else {
            return;
        };
        let first = w
            .compare_exchange(0, peer as u64 + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok();
        if first {
            self.send_notices(false);
        }
    }

    /// The notice `peer` sent this rank, if it closed its engine or failed
    /// on a third rank: `Dead` with the rank it blamed (a failing rank
    /// delivers nothing more, as a closed one).
    pub(super) fn notice(&self, peer: usize) -> Option<PeerStatus> {
        let v = self
            .status_word(OFF_NOTICES + NOTICE_STRIDE * peer)?
            .load(Ordering::Acquire);
        (v != 0).then(|| PeerStatus::Dead {
            pid: 0,
            blamed: (v >> 1)
                .checked_sub(1)
                .and_then(|b| usize::try_from(b).ok()),
        })
    }

    /// Whether `peer`'s notice says it closed its engine.
    fn closed(&self, peer: usize) -> bool {
        self.status_word(OFF_NOTICES + NOTICE_STRIDE * peer)
            .is_some_and(|w| w.load(Ordering::Acquire) & 1 == 1)
    }

    /// Tells every live peer that this rank closes (`closed`) or failed
    /// (and whom it blames), with a pure signal that raises the notice
    /// word: [`FANOUT_BATCH`] peers at a time, their completions awaited
    /// together (one at a time, a rank with many remote peers on a loaded
    /// host took seconds to tell the last of them, who waited that long to
    /// name a killed rank).
    pub(super) fn send_notices(&self, closed: bool) {
        let blame = self.status_word(8).map_or(0, |w| w.load(Ordering::Acquire));
        let value = blame << 1 | u64::from(closed);
        let at = OFF_NOTICES + NOTICE_STRIDE * self.rank;
        let Ok(imm) = (Imm {
            region: STATUS_ID,
            offset: at,
            bell: Bell::Client,
            update: Update::Raise,
        })
        .encode() else {
            return;
        };
        // Not the rank this one failed because of: it is dead or failing, and
        // a post to a killed peer can stall the batch (FI_EAGAIN) before the
        // notices to the live ranks behind it go out.
        let blamed = blame.checked_sub(1);
        let live = (0..self.world).filter_map(|peer| {
            if blamed == Some(peer as u64) {
                return None;
            }
            let p = self.peers.get(peer).and_then(OnceLock::get)?;
            let (addr, r) = (p.addr?, p.region(STATUS_ID)?);
            // A peer that only failed (its notice without the closed bit)
            // still runs and takes notices.
            let gone = p.dead.load(Ordering::Acquire) || self.closed(peer);
            (!gone).then_some((peer, addr, r, imm))
        });
        let mut batch = no_targets();
        let mut n = 0;
        for target in live {
            batch[n] = target;
            n += 1;
            if n == FANOUT_BATCH {
                let _ = self.post_raise_batch(&batch, at, value, NOTICE_TIMEOUT);
                n = 0;
            }
        }
        let _ = self.post_raise_batch(&batch[..n], at, value, NOTICE_TIMEOUT);
    }

    /// A pure signal: one 8-byte write of `value` into the mailbox of the
    /// word at `word` of `r`, with the immediate `imm` (which names the
    /// word), waited for until `timeout` passes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post_raise(
        &self,
        peer: usize,
        addr: u64,
        r: &RemoteRegion,
        word: usize,
        imm: u32,
        value: u64,
        timeout: Duration,
    ) -> Result<()> {
        let mut buf = value.to_le_bytes();
        let mr = self.local_mr(buf.as_mut_ptr(), buf.len())?;
        let desc = mr.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
        let ptr = buf.as_mut_ptr().cast::<c_void>();
        let out = self.run_op(peer, "fi_writemsg", Instant::now() + timeout, |ctx| {
            // SAFETY: `buf` (registered by `mr` where the provider wants
            // it) lives until run_op has seen the completion; `ctx` is our
            // slot's fi_context.
            unsafe { self.post_mailbox(ctx, ptr, desc, addr, r, word, imm) }
        });
        drop(mr);
        out
    }

    /// Posts the 8-byte write of a pure signal, `buf` (registered as `desc`,
    /// or null), into the mailbox of the word at `word` of `r` at `addr`,
    /// with the immediate `imm` that names the word, as operation `ctx`.
    ///
    /// # Safety
    /// `buf` must stay valid until the operation's completion is seen, and
    /// `ctx` must be an operation slot's `fi_context` this caller holds.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn post_mailbox(
        &self,
        ctx: *mut c_void,
        buf: *mut c_void,
        desc: *mut c_void,
        addr: u64,
        r: &RemoteRegion,
        word: usize,
        imm: u32,
    ) -> i32 {
        let mut descs = [desc];
        let raddr = r.base + (word + MAILBOX) as u64;
        // SAFETY: per the contract above.
        unsafe {
            self.ep.post_writedata(
                &[buf],
                &[8],
                &mut descs,
                addr,
                raddr,
                r.key,
                u64::from(imm),
                ctx,
            )
        }
    }

    /// Pure signals of one `value` into the word at `word` of each target's
    /// region (peer, its address, the region, the immediate that names the
    /// word; at most [`FANOUT_BATCH`] of them): all posted, then their
    /// completions awaited together, so a batch costs about one round trip
    /// instead of one per peer. Every posted write is waited for before
    /// this returns (they read `value` from this frame). Returns the first
    /// failure in target order, except a peer's whose close notice arrived
    /// (nobody reads its words any more). Allocates nothing.
    pub(super) fn post_raise_batch(
        &self,
        batch: &[Target],
        word: usize,
        value: u64,
        timeout: Duration,
    ) -> Result<()> {
        debug_assert!(batch.len() <= FANOUT_BATCH);
        let mut buf = value.to_le_bytes();
        let mr = self.local_mr(buf.as_mut_ptr(), buf.len())?;
        let desc = mr.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
        let ptr = buf.as_mut_ptr().cast::<c_void>();
        let deadline = Instant::now() + timeout;
        let mut posted: [Option<Result<usize>>; FANOUT_BATCH] = std::array::from_fn(|_| None);
        for (slot, &(peer, addr, ref r, imm)) in posted.iter_mut().zip(batch) {
            *slot = Some(self.start_op(peer, "fi_writemsg", deadline, |ctx| {
                // SAFETY: `buf` (registered by `mr` where the provider
                // wants it) lives until every operation of this call has
                // completed (finish_op below); `ctx` is the slot's
                // fi_context.
                unsafe { self.post_mailbox(ctx, ptr, desc, addr, r, word, imm) }
            }));
        }
        let mut first = Ok(());
        for (&(peer, ..), p) in batch.iter().zip(posted.iter_mut()) {
            let out = p
                .take()
                .unwrap_or(Ok(usize::MAX))
                .and_then(|i| self.finish_op(peer, "fi_writemsg", deadline, i));
            if let Err(e) = out {
                if first.is_ok() && self.notice(peer).is_none() {
                    first = Err(e);
                }
            }
        }
        drop(mr);
        first
    }

    /// Reads `peer`'s status region (closed flag, blamed rank), at most
    /// every [`PROBE_PERIOD`]. A read that fails or passes
    /// [`PROBE_TIMEOUT`] marks the peer dead; one cut short because a rank
    /// reported the peer ([`reported`](Self::reported)) leaves that to the
    /// caller. Either way the abandoned read keeps the peer's probe slot:
    /// the peer is not probed again.
    pub(super) fn probe(&self, peer: usize, p: &Peer) {
        let give_up = || self.reported(peer).is_some();
        let now = self.elapsed_ms();
        let last = p.last_probe.load(Ordering::Relaxed);
        if now.saturating_sub(last) < PROBE_PERIOD.as_millis() as u64
            || p.probing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        p.last_probe.store(now, Ordering::Relaxed);
        let Some(r) = p.region(STATUS_ID) else {
            p.probing.store(false, Ordering::Release);
            return;
        };
        let deadline = Instant::now() + PROBE_TIMEOUT.min(self.timeout);
        // SAFETY: this thread holds `probing` (see ProbeBuf).
        let status = unsafe { &mut *p.probe_buf.0.get() };
        if self
            .read_or(peer, p, &r, 0, status, deadline, &give_up)
            .is_err()
        {
            if !give_up() {
                p.dead.store(true, Ordering::Release);
            }
            return;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&status[i * 8..i * 8 + 8]);
            u64::from_ne_bytes(w)
        };
        p.blamed.store(word(1), Ordering::Release);
        if word(0) == STATE_CLOSED {
            p.dead.store(true, Ordering::Release);
        }
        p.probing.store(false, Ordering::Release);
    }

    /// A rank known to have failed because of `peer`: one the owning
    /// transport reports, or one whose close notice blamed `peer`. Loads
    /// only, no round trip.
    pub(super) fn reported(&self, peer: usize) -> Option<usize> {
        if let Some(by) = self.reports.get().and_then(|f| f(peer)) {
            return Some(by);
        }
        (0..self.world)
            .filter(|&q| q != self.rank && q != peer)
            .find(|&q| {
                matches!(self.notice(q), Some(PeerStatus::Dead { blamed: Some(b), .. }) if b == peer)
            })
    }
}

/// The longest a [`Shuffler`] holds a completion back.
const MAX_HOLD: Duration = Duration::from_millis(3);

/// Test mode ([`FabricConfig::reorder`](super::FabricConfig::reorder)):
/// holds every completion back a random while (up to [`MAX_HOLD`]) and
/// hands out the due ones in a random order, seeded, so that operations
/// posted one after the other complete in another order — as EFA's SRD
/// may deliver them.
pub(super) struct Shuffler {
    state: u64,
    held: Vec<(Instant, sys::CqEntry)>,
}

impl Shuffler {
    pub(super) fn new(seed: u64) -> Shuffler {
        Shuffler {
            state: seed,
            held: Vec::with_capacity(64),
        }
    }

    /// splitmix64.
    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(super) fn hold(&mut self, e: sys::CqEntry) {
        let hold = self.next() % (MAX_HOLD.as_micros() as u64 + 1);
        self.held
            .push((Instant::now() + Duration::from_micros(hold), e));
    }

    pub(super) fn next_due(&self) -> Option<Instant> {
        self.held.iter().map(|(t, _)| *t).min()
    }

    /// Moves the completions due at `now` (all of them for `None`) into
    /// `out`, shuffled.
    pub(super) fn take_due(&mut self, now: Option<Instant>, out: &mut Vec<sys::CqEntry>) {
        let start = out.len();
        let mut i = 0;
        while i < self.held.len() {
            if now.is_none_or(|now| self.held[i].0 <= now) {
                out.push(self.held.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        let n = out.len() - start;
        for j in (1..n).rev() {
            let k = (self.next() % (j as u64 + 1)) as usize;
            out.swap(start + j, start + k);
        }
    }
}

/// A random, non-zero 64-bit memory-region key (`getrandom`).
pub(super) fn random_key() -> Result<u64> {
    let mut b = [0u8; 8];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: writes at most `b.len() - got` bytes into `b[got..]`.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::transport_io("getrandom", "a memory-region key", e));
        }
        got += n as usize;
    }
    Ok(u64::from_ne_bytes(b).max(1))
}

/// A peer whose connection failed: the engine reports it like a dead
/// process (no pid across hosts).
pub(super) fn peer_died(peer: usize, waited_for: String) -> Error {
    Error::PeerDied {
        peer,
        pid: 0,
        bucket: None,
        waited_for,
        reported_by: None,
    }
}

pub(super) fn with_peer(e: Error, peer: usize) -> Error {
    match e {
        Error::Fabric { call, code, detail } => Error::Fabric {
            call,
            code,
            detail: format!("rank {peer}: {detail}"),
        },
        other => other,
    }
}
