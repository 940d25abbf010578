//! What the transport and its progress thread share ([`Core`]): own and
//! remote regions, operation slots, read credits, bells; the progress loop
//! that dispatches completions; posting and waiting for one operation;
//! liveness probes and close notices.

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::safe::{Av, Cq, Domain, Ep, Granted, Mr};
use super::signal::{decode_signal, encode_signal};
use super::{result, sys};
use super::{
    EAGAIN_STALL, MAX_REGIONS, NOTICE_TIMEOUT, OFF_NOTICES, PROBE_PERIOD, PROBE_TIMEOUT,
    PROGRESS_BLOCK_MS, STATE_CLOSED, STATUS_ID,
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
    /// Milliseconds since the transport started, of the last probe.
    pub(super) last_probe: AtomicU64,
}

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
    pub(super) ops_done: EventCount,
    pub(super) credits: AtomicUsize,
    pub(super) credit_freed: EventCount,
    pub(super) bells: [EventCount; 2],
    /// Rung after `bells` whenever they are (see
    /// [`FabricTransport::forward_bells`](super::FabricTransport::forward_bells)).
    pub(super) forward: OnceLock<BellForward>,
    pub(super) stop: AtomicBool,
    pub(super) progress_errors: AtomicU64,
    /// Next key for a per-operation local registration (`FI_MR_LOCAL`).
    pub(super) local_keys: AtomicU64,
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

/// A callback that rings another transport's bell.
pub type BellForward = Arc<dyn Fn(Bell) + Send + Sync>;

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
        // SAFETY: the memory is valid for `len` bytes while `backing` lives
        // (the caller's contract); the backing lives in the same OwnRegion
        // as the MR and is dropped after it (field order).
        let mr = unsafe { Mr::register(&self.domain, ptr, len, true, u64::from(id) + 1, ep)? };
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
        loop {
            let stopping = self.stop.load(Ordering::Acquire);
            // On stop, drain until the CQ stays quiet: closing an endpoint
            // with a partly arrived write crashed libfabric 1.17.
            let block = if stopping { 5 } else { PROGRESS_BLOCK_MS };
            match self.cq.sread(&mut buf, block) {
                Ok(n) if n > 0 => {
                    quiet_since = None;
                    for e in &buf[..n as usize] {
                        self.dispatch(e);
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
        self.ops_done.notify();
    }

    pub(super) fn dispatch(&self, e: &sys::CqEntry) {
        if let Some(slot) = self.slot_of(e.op_context) {
            self.complete(slot, 0);
            return;
        }
        if e.flags & result::consts::remote_cq_data() == 0 {
            return;
        }
        let (region, offset, bell, value) = decode_signal(e.data);
        let word = self
            .regions
            .get(region as usize)
            .and_then(OnceLock::get)
            .and_then(|r| r.word(offset));
        match word {
            Some(w) => {
                // The write's data is in memory (its completion says so);
                // the release store orders it before the signal.
                w.store(value, Ordering::Release);
                self.ring(bell);
            }
            None => {
                if self.progress_errors.fetch_add(1, Ordering::Relaxed) < 5 {
                    eprintln!(
                        "odc: fabric rank {}: signal for unknown word {offset} of region {region}",
                        self.rank
                    );
                }
            }
        }
    }

    pub(super) fn dispatch_error(&self) {
        match self.cq.readerr() {
            Ok((ctx, err, text)) => match self.slot_of(ctx) {
                Some(slot) => self.complete(slot, err.max(1)),
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
        loop {
            let epoch = self.ops_done.epoch();
            for (i, s) in self.ops.iter().enumerate() {
                if s.state
                    .compare_exchange(SLOT_FREE, SLOT_POSTED, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok((i, s.ctx.get().cast()));
                }
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
                return result::check(what, ret)
                    .map(|_| ())
                    .map_err(|e| with_peer(e, peer));
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
            if Instant::now() >= deadline {
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
        // picks them): region keys are id + 1, local ones count from 2^32.
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
                self.run_op(peer, "fi_read", deadline, |ctx| {
                    // SAFETY: `buf` has `n` bytes and stays borrowed (and
                    // registered) until run_op has seen the completion;
                    // `ctx` is our slot's fi_context.
                    unsafe { self.ep.post_read(buf, n, desc, addr, raddr, r.key, ctx) }
                })?;
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

    pub(super) fn blame(&self, peer: usize) {
        if let Some(w) = self.status_word(8) {
            let _ = w.compare_exchange(0, peer as u64 + 1, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// The close notice `peer` sent this rank, if it closed its engine:
    /// `Dead` with the rank it blamed.
    pub(super) fn notice(&self, peer: usize) -> Option<PeerStatus> {
        let v = self
            .status_word(OFF_NOTICES + 8 * peer)?
            .load(Ordering::Acquire);
        (v != 0).then(|| PeerStatus::Dead {
            pid: 0,
            blamed: (v >> 1)
                .checked_sub(1)
                .and_then(|b| usize::try_from(b).ok()),
        })
    }

    /// Tells every live peer that this rank closes (and whom it blames),
    /// with a zero-length write whose CQ data stores the notice.
    pub(super) fn send_close_notices(&self) {
        let blame = self.status_word(8).map_or(0, |w| w.load(Ordering::Acquire));
        let Ok(data) = encode_signal(
            STATUS_ID,
            OFF_NOTICES + 8 * self.rank,
            Bell::Client,
            blame << 1 | 1,
        ) else {
            return;
        };
        for peer in 0..self.world {
            let Some(p) = self.peers.get(peer).and_then(OnceLock::get) else {
                continue;
            };
            let (Some(addr), Some(r)) = (p.addr, p.region(STATUS_ID)) else {
                continue;
            };
            if p.dead.load(Ordering::Acquire) || self.notice(peer).is_some() {
                continue;
            }
            let raddr = r.base + (OFF_NOTICES + 8 * self.rank) as u64;
            let _ = self.run_op(
                peer,
                "fi_writemsg",
                Instant::now() + NOTICE_TIMEOUT,
                |ctx| {
                    // SAFETY: no buffers; `ctx` is our slot's fi_context.
                    unsafe {
                        self.ep
                            .post_writedata(&[], &[], &mut [], addr, raddr, r.key, data, ctx)
                    }
                },
            );
        }
    }

    pub(super) fn probe(&self, peer: usize, p: &Peer) {
        let now = self.elapsed_ms();
        let last = p.last_probe.load(Ordering::Relaxed);
        if now.saturating_sub(last) < PROBE_PERIOD.as_millis() as u64
            || p.probing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        p.last_probe.store(now, Ordering::Relaxed);
        let mut status = [0u8; 16];
        let outcome = p.region(STATUS_ID).map(|r| {
            let deadline = Instant::now() + PROBE_TIMEOUT.min(self.timeout);
            self.read(peer, p, &r, 0, &mut status, deadline)
        });
        match outcome {
            Some(Ok(())) => {
                let word = |i: usize| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&status[i * 8..i * 8 + 8]);
                    u64::from_ne_bytes(w)
                };
                p.blamed.store(word(1), Ordering::Release);
                if word(0) == STATE_CLOSED {
                    p.dead.store(true, Ordering::Release);
                }
            }
            Some(Err(_)) => p.dead.store(true, Ordering::Release),
            None => {}
        }
        p.probing.store(false, Ordering::Release);
    }
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
