//! `fabric`: the transport between hosts, over libfabric one-sided RMA
//! (`tcp` everywhere; `verbs` and `efa` on real NICs). Three layers, as for
//! every native library here: [`sys`] (the C shim `shim.c`, which turns
//! libfabric's static inline calls into plain functions), [`result`] (every
//! call returns `Result` naming the call, with `fi_strerror`), [`safe`]
//! (owned objects closed in dependency order). This module maps the
//! [`Transport`] verbs onto them; `shared` holds what the verbs and the
//! progress thread share (operation slots, the progress loop, liveness),
//! `signal` the remote CQ data format.
//!
//! One file for the `Transport` implementation (every verb, the connection
//! warm-up, the 4-byte signal encoding); the shared state and progress loop
//! live in `shared`, the libfabric layers in `sys` / `result` / `safe`.
//!
//! # Loading
//!
//! The cargo feature `fabric` compiles the shim against the libfabric
//! headers but links nothing: `libfabric.so.1` is opened on first use
//! ([`is_present`] says whether it can be), so binaries built with the
//! feature run where it is absent and never load it for `shm`. The fatal
//! signal handlers a dependency of libfabric installs when loaded (PSM's
//! libinfinipath) are undone, so a crashing rank still dies by its signal.
//!
//! # Endpoint
//!
//! One reliable-datagram endpoint (`FI_EP_RDM`; over tcp that is
//! `tcp;ofi_rxm`) per rank, one address vector, one completion queue. RDM
//! rather than connected `FI_EP_MSG` endpoints: one endpoint and one CQ
//! serve every peer (no per-peer connection management, no CM event
//! queue), and the measurements in FABRIC_NOTES gave RDM the faster reads
//! (10.4 vs 7.7 GB/s at 16 MiB with a polling owner; equal for
//! writes-with-data). RDM connects lazily, so [`Transport::connect`] warms
//! every peer up with a small read, retrying `-FI_EAGAIN` until the
//! engine's deadline.
//!
//! # Verbs
//!
//! - `get`: `fi_read` from the peer's region (split at the provider's
//!   largest message), bounds-checked against the published length before
//!   posting (a bad remote access breaks the connection). At most
//!   `read_credits` single reads are in flight per transport (default 8,
//!   `ODC_FABRIC_READS`).
//! - `run_batch` (a gather's reads, a push's chunks, a daemon's
//!   acknowledgements): every operation posted without waiting, up to the
//!   provider's transmit queue (at most 128 in flight), their completions
//!   awaited together (`batch`).
//! - `put_signal`: **one** `fi_writemsg` with 4 bytes of remote CQ data
//!   (an RDMA immediate) that names the signal word, never its value (see
//!   `signal`): a put with data writes the data and the owner's progress
//!   thread **counts** the completion into the word; a pure signal writes
//!   its 8-byte value into the word's mailbox and the progress thread
//!   raises the word to it. A remote completion is reported only once the
//!   operation's data is in the owner's memory, so when the progress thread
//!   updates the word (release order) and rings the bell, a reader that
//!   sees the word sees the data. No correctness depends on two operations
//!   completing in the order they were posted (EFA's SRD delivers
//!   unordered); [`FabricConfig::reorder`] holds back and shuffles
//!   completions to test it.
//! - `bell_wait`: a futex on the transport's own [`EventCount`]s, which the
//!   progress thread rings.
//!
//! Operations to this rank itself never touch libfabric: they are copies
//! into its own memory, as in `shm`.
//!
//! # Progress
//!
//! With the tcp provider nothing completes and no written data lands
//! unless the owner calls into libfabric. Every transport runs one progress
//! thread that blocks in `fi_cq_sread` (never spins: on shared cores a
//! spinning owner costs a scheduler slice per operation) and dispatches:
//! remote CQ data → signal store + bell; local completions → the waiting
//! caller's operation slot, then a wake-up.
//!
//! # Memory registration
//!
//! The `FI_MR_*` bits this code can honour are offered (`LOCAL`,
//! `VIRT_ADDR`, `ALLOCATED`, `PROV_KEY`, `ENDPOINT`) and whatever the
//! provider returns is honoured: provider keys are published, virtual base
//! addresses are published and added to offsets, MRs are bound to the
//! endpoint, and local buffers are registered per operation under
//! `FI_MR_LOCAL` (tcp requires none of these).
//!
//! # Liveness
//!
//! No pids across hosts. A peer is dead when an operation to it fails (CQ
//! error entry, a post error other than `-FI_EAGAIN`, or `-FI_EAGAIN` or
//! an unanswered operation past the deadline), or when a probe finds its
//! engine closed: [`Transport::peer_status`] reads the peer's small status
//! region (closed flag, blamed rank) at most every [`PROBE_PERIOD`].
//! A dead peer is `PeerStatus::Dead { pid: 0, blamed }`.
//!
//! A rank that fails on a peer sends every other live peer a notice naming
//! that peer, before its error reaches the caller (so a rank that then
//! exits without closing is still named by its root cause); one that
//! closes its engine sends a close notice, naming whom it blamed, if
//! anyone. A probe reads the blame too. Either way a peer that runs but
//! failed on a wait for a third rank counts as dead, blaming that rank (it
//! will not deliver what the waiter waits for).
//!
//! A killed process is not seen at once: tcp leaves a read of its status
//! pending (rxm logs the refused reconnection and keeps the operation)
//! until `PROBE_TIMEOUT`, and answers posts to it with `-FI_EAGAIN`. Its
//! own node's ranks see it gone at once and fail naming it, and that news
//! is what ends the wait here: a notice from any rank that blames the peer,
//! or (a mixed transport passes these, [`FabricTransport::forward_reports`])
//! a rank of this node whose blame word names it. Either answers
//! `PeerStatus::Reported` before a probe, cuts one in flight short, and
//! stops retrying a post to the peer.

mod batch;
pub mod result;
pub mod safe;
mod shared;
mod signal;
pub mod sys;

pub use signal::{Imm, Update, IMM_BYTES, MAILBOX, WORD_BITS};

#[cfg(test)]
mod tests;

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use self::safe::{Av, Cq, Domain, Ep, Fabric, Granted, Info, Mr};
use self::shared::{
    bell_index, no_targets, peer_died, with_peer, Core, OpSlot, OwnRegion, Peer, SLOT_FREE,
};
pub use self::shared::{BellForward, NodeRing, PeerReports};
use super::{Op, PeerStatus, Transport};
use crate::region::{Bell, Endpoint, LocalRegion, RegionDesc, RemoteRegion, SignalRef};
use crate::sync::{EventCount, Ordering};
use crate::{Error, Result};

/// Region ids below this are the engine's; [`STATUS_ID`] is the transport's.
pub const MAX_REGIONS: u32 = 7;
/// Region id of the transport's own status region (closed flag, blame).
pub const STATUS_ID: u32 = 7;
/// Most local buffers in one write (the shim's iovec array).
const MAX_IOV: usize = 4;
/// Operation slots (operations in flight from this rank, every thread
/// together).
const OP_SLOTS: usize = 256;
/// Pure signals of one fan-out in flight at once (a quarter of the slots:
/// the daemon's acknowledgements and other threads' operations keep theirs).
const FANOUT_BATCH: usize = OP_SLOTS / 4;
/// How often `peer_status` reads a peer's status region at most.
pub const PROBE_PERIOD: Duration = Duration::from_millis(250);
/// How long a liveness probe may take before the peer counts as dead.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// The progress thread's longest block in `fi_cq_sread`. Completions and
/// arriving data wake it, and closing the transport wakes it explicitly,
/// so this only sets how often an idle rank wakes for nothing: at 100 ms
/// an idle engine on `mixed` cost 0.12 % of a core (`scale_perf`), the
/// daemon's own 100 ms nap 0.04 % of it; at 250 ms, 0.07 %.
const PROGRESS_BLOCK_MS: i32 = 250;
const STATE_CLOSED: u64 = 1;
/// Status region: word 0 state, word 1 blamed rank + 1, then one 16-byte
/// signal cell (word and mailbox) per rank where that rank's close notice
/// lands.
const OFF_NOTICES: usize = 16;
/// Bytes per close-notice cell.
const NOTICE_STRIDE: usize = 16;
/// A peer answering `-FI_EAGAIN` this long after its connection was set up
/// counts as dead (rxm keeps retrying a vanished peer's connection).
const EAGAIN_STALL: Duration = Duration::from_secs(3);
/// How long a closing transport tries to deliver its close notice per peer.
const NOTICE_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a peer found dead may take to deliver its close notice.
const NOTICE_GRACE: Duration = Duration::from_millis(100);

/// Whether libfabric can be loaded here (tests skip when it cannot).
pub fn is_present() -> bool {
    sys::is_present()
}

/// Settings of a [`FabricTransport`]; `Default` reads the environment.
#[derive(Clone, Debug)]
pub struct FabricConfig {
    /// libfabric provider (`ODC_FABRIC_PROVIDER`, default `tcp`); an RDM
    /// utility layer (`;ofi_rxm`) is added when the core provider needs it.
    pub provider: String,
    /// Address to bind, `host[:port]` (`ODC_FABRIC_ADDR`, default
    /// `127.0.0.1`, any port).
    pub addr: String,
    /// Single reads ([`Transport::get`]) in flight per transport
    /// (`ODC_FABRIC_READS`, default 8); a batch's reads keep its window
    /// instead ([`FabricTransport::batch_window`]).
    pub read_credits: usize,
    /// Test mode (`ODC_FABRIC_REORDER=<seed>`): the progress thread holds
    /// every completion back a random while (up to 3 ms) and dispatches
    /// them in a random order, seeded, so that nothing may rely on two
    /// operations completing in the order they were posted. Slower; for
    /// tests only.
    pub reorder: Option<u64>,
}

impl Default for FabricConfig {
    fn default() -> FabricConfig {
        FabricConfig {
            provider: std::env::var("ODC_FABRIC_PROVIDER").unwrap_or_else(|_| "tcp".into()),
            addr: std::env::var("ODC_FABRIC_ADDR").unwrap_or_else(|_| "127.0.0.1".into()),
            read_credits: std::env::var("ODC_FABRIC_READS")
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .filter(|&n: &usize| n > 0)
                .unwrap_or(8),
            reorder: std::env::var("ODC_FABRIC_REORDER")
                .ok()
                .and_then(|s| s.trim().parse().ok()),
        }
    }
}

/// The libfabric transport. See the module docs.
#[derive(Debug)]
pub struct FabricTransport {
    core: Arc<Core>,
    progress: Option<JoinHandle<()>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The libfabric address rank `peer` published in its endpoint (the hex
/// of its `fi_getname` bytes), checked to be exactly `len` bytes, the
/// length of this rank's own address: every rank opens the same provider,
/// and `fi_av_insert` reads an address of the provider's length from the
/// pointer it is given, whatever the buffer behind it holds.
pub fn peer_address(peer: usize, hex: &str, len: usize) -> Result<Vec<u8>> {
    let bad = |detail: String| Error::malformed(peer, "endpoint", "address", detail);
    let digit = |c: u8| char::from(c).to_digit(16);
    let name = hex
        .as_bytes()
        .chunks(2)
        .map(|p| match p {
            [hi, lo] => Some((digit(*hi)? << 4 | digit(*lo)?) as u8),
            _ => None,
        })
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(|| bad(format!("{hex:?} is not hex digits in pairs")))?;
    if name.len() != len {
        return Err(bad(format!(
            "is {} bytes, the provider's addresses {len}",
            name.len()
        )));
    }
    Ok(name)
}

impl FabricTransport {
    /// Opens this rank's endpoint with [`FabricConfig::default`] and starts
    /// its progress thread. `timeout` bounds every operation (the engine's
    /// deadline).
    pub fn new(rank: usize, world: usize, timeout: Duration) -> Result<FabricTransport> {
        FabricTransport::with_config(rank, world, timeout, &FabricConfig::default())
    }

    /// As [`FabricTransport::new`] with explicit settings.
    pub fn with_config(
        rank: usize,
        world: usize,
        timeout: Duration,
        config: &FabricConfig,
    ) -> Result<FabricTransport> {
        sys::load().map_err(|detail| Error::Fabric {
            call: "dlopen",
            code: 0,
            detail: format!("cannot load libfabric: {detail}"),
        })?;
        let (node, service) = match config.addr.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => (h, p),
            _ => (config.addr.as_str(), "0"),
        };
        let [local, virt, allocated, prov_key, endpoint] = result::consts::mr_bits();
        let offered = local | virt | allocated | prov_key | endpoint;
        let info = Info::get(&config.provider, node, service, offered).or_else(|first| {
            if config.provider.contains(';') {
                return Err(first);
            }
            // A core provider without RDM endpoints of its own (tcp, verbs)
            // gets them from the rxm utility layer.
            Info::get(
                &format!("{};ofi_rxm", config.provider),
                node,
                service,
                offered,
            )
            .map_err(|_| first)
        })?;
        let granted = info.granted();
        if granted.cq_data_size < IMM_BYTES {
            return Err(Error::Fabric {
                call: "fi_getinfo",
                code: 0,
                detail: format!(
                    "provider {} offers {} bytes of remote CQ data, {IMM_BYTES} needed",
                    granted.provider, granted.cq_data_size
                ),
            });
        }
        if result::consts::context_size() > std::mem::size_of::<[*mut c_void; 4]>() {
            return Err(Error::transport(
                "fabric",
                "struct fi_context larger than 4 pointers",
            ));
        }
        let fabric = Fabric::open(&info)?;
        let domain = Domain::open(&fabric, &info)?;
        let cq = Cq::open(&domain, 1024)?;
        let av = Av::open(&domain)?;
        let ep = Ep::open(&domain, &info, &cq, &av)?;
        let name = ep.name()?;
        let mode = granted.mr_mode;
        let core = Arc::new(Core {
            rank,
            world,
            host: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default(),
            timeout,
            started: Instant::now(),
            mr_local: mode & local != 0,
            mr_virt: mode & virt != 0,
            mr_prov_key: mode & prov_key != 0,
            mr_endpoint: mode & endpoint != 0,
            granted,
            name,
            ep,
            cq,
            av,
            domain,
            regions: (0..=STATUS_ID).map(|_| OnceLock::new()).collect(),
            peers: (0..world).map(|_| OnceLock::new()).collect(),
            ops: (0..OP_SLOTS)
                .map(|_| OpSlot {
                    ctx: UnsafeCell::new([std::ptr::null_mut(); 4]),
                    state: AtomicU32::new(SLOT_FREE),
                    err: AtomicI32::new(0),
                })
                .collect(),
            next_slot: AtomicUsize::new(0),
            ops_done: EventCount::default(),
            credits: AtomicUsize::new(config.read_credits.max(1)),
            credit_freed: EventCount::default(),
            bells: [EventCount::default(), EventCount::default()],
            forward: OnceLock::new(),
            node_ring: OnceLock::new(),
            reports: OnceLock::new(),
            stop: AtomicBool::new(false),
            progress_errors: AtomicU64::new(0),
            progress_failure: OnceLock::new(),
            #[cfg(test)]
            inject_panic: AtomicBool::new(false),
            local_keys: AtomicU64::new(shared::random_key()?),
            reorder: config.reorder,
        });
        core.register(STATUS_ID, OFF_NOTICES + NOTICE_STRIDE * world)?;
        let worker = Arc::clone(&core);
        let progress = std::thread::Builder::new()
            .name(format!("odc-fabric-{rank}"))
            .spawn(move || {
                // A panic (a bug) ends the thread, never the process: every
                // operation and wait of this rank then fails naming it.
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    worker.progress_loop();
                }));
                if let Err(payload) = ran {
                    worker.progress_panicked(crate::error::panic_message(payload));
                }
            })?;
        Ok(FabricTransport {
            core,
            progress: Some(progress),
        })
    }

    /// What the provider granted (name, MR mode bits, limits).
    pub fn granted(&self) -> &Granted {
        &self.core.granted
    }

    /// Makes every ring of this transport's bells (a signal or close notice
    /// from a peer, a peer found dead, [`Transport::ring`]) also call
    /// `forward`, from whichever thread rang: the progress thread, mostly.
    /// A transport that owns this one and sleeps on bells of its own (the
    /// mixed transport) uses it so that remote signals wake it. At most
    /// once per transport; `forward` must not block.
    pub fn forward_bells(&self, forward: BellForward) -> Result<()> {
        self.core
            .forward
            .set(forward)
            .map_err(|_| Error::transport("forward_bells", "bells already forwarded"))
    }

    /// Makes every signal that lands in `words` (bytes) of this rank's
    /// region `region` call `ring` after it rang this rank's bell (the
    /// mixed transport rings the node-mates': [`Transport::wake_node_on`]).
    /// At most once per transport; `ring` must not block.
    pub fn ring_node_on(
        &self,
        region: u32,
        words: std::ops::Range<usize>,
        ring: NodeRing,
    ) -> Result<()> {
        self.core
            .node_ring
            .set((region, words, ring))
            .map_err(|_| Error::transport("ring_node_on", "node words already set"))
    }

    /// Makes `reports` part of what this transport knows of peers'
    /// failures: a rank it names (as having failed because of the peer)
    /// ends a wait on that peer with [`PeerStatus::Reported`], cuts a probe
    /// of it short, and stops retrying a post to it (see the module docs).
    /// The mixed transport passes its node's blame words. At most once per
    /// transport; `reports` must not block.
    pub fn forward_reports(&self, reports: PeerReports) -> Result<()> {
        self.core
            .reports
            .set(reports)
            .map_err(|_| Error::transport("forward_reports", "reports already forwarded"))
    }

    /// Registers memory that something else allocated (another
    /// transport's region) as region `id`, so that peers reach it over the
    /// fabric. The returned region's descriptor carries the fabric key;
    /// `backing` is dropped only after the memory registration is closed
    /// and the transport's own region table (which the progress thread
    /// stores signals through) let go of it, so a late remote write never
    /// lands in unmapped memory.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, 64-byte
    /// aligned, and stay valid until `backing` is dropped; nothing but
    /// `backing` may free it.
    pub unsafe fn register_foreign(
        &self,
        id: u32,
        ptr: std::ptr::NonNull<u8>,
        len: usize,
        backing: Box<dyn Send + Sync>,
    ) -> Result<LocalRegion> {
        check_id(id)?;
        // SAFETY: the caller's contract, passed on.
        let region = unsafe { self.core.register_memory(id, ptr.as_ptr(), len, backing)? };
        self.local_region(id, region)
    }

    /// One write of `src` (`total` bytes, not empty) at `offset` of `r`
    /// with the immediate `imm`, waited for until the deadline.
    #[allow(clippy::too_many_arguments)]
    fn post_data(
        &self,
        peer: usize,
        addr: u64,
        r: &RemoteRegion,
        offset: usize,
        src: &[&[u8]],
        total: usize,
        imm: u32,
    ) -> Result<()> {
        let c = &self.core;
        if total as u64 > c.granted.max_msg_size {
            return Err(Error::transport(
                "put_signal",
                format!(
                    "{total} bytes exceed the provider's {} byte messages",
                    c.granted.max_msg_size
                ),
            ));
        }
        let limit = usize::try_from(c.granted.iov_limit)
            .unwrap_or(1)
            .clamp(1, MAX_IOV);
        let nonempty = src.iter().filter(|s| !s.is_empty()).count();
        // More pieces than the provider takes in one operation (never for
        // the engine's header + data): join them, the only allocation here.
        let joined: Vec<u8> = if nonempty > limit {
            src.concat()
        } else {
            Vec::new()
        };
        let joined_parts = [joined.as_slice()];
        let parts: &[&[u8]] = if nonempty > limit { &joined_parts } else { src };
        let mut bufs = [std::ptr::null_mut::<c_void>(); MAX_IOV];
        let mut lens = [0usize; MAX_IOV];
        let mut descs = [std::ptr::null_mut::<c_void>(); MAX_IOV];
        let mut mrs: [Option<Mr>; MAX_IOV] = [None, None, None, None];
        let mut n = 0;
        for part in parts.iter().filter(|p| !p.is_empty()) {
            let mr = c.local_mr(part.as_ptr().cast_mut(), part.len())?;
            bufs[n] = part.as_ptr().cast_mut().cast();
            lens[n] = part.len();
            descs[n] = mr.as_ref().map_or(std::ptr::null_mut(), Mr::desc);
            mrs[n] = mr;
            n += 1;
        }
        let raddr = r.base + offset as u64;
        let out = c.run_op(peer, "fi_writemsg", Instant::now() + c.timeout, |ctx| {
            let mut descs = descs;
            // SAFETY: the sources are borrowed (and registered: `mrs` lives
            // past run_op) until run_op has seen the completion; `ctx` is
            // our slot's fi_context.
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
        });
        drop(mrs);
        out
    }

    fn local_region(&self, id: u32, region: Arc<OwnRegion>) -> Result<LocalRegion> {
        let c = &self.core;
        let desc = RegionDesc {
            owner: u32::try_from(c.rank).unwrap_or(u32::MAX),
            id,
            len: region.len as u64,
            key: region.mr.key(),
        };
        let ptr = std::ptr::NonNull::new(region.ptr)
            .ok_or_else(|| Error::transport("mmap", "null mapping"))?;
        let len = region.len;
        // SAFETY: `len` bytes at `ptr`, 64-byte aligned (register_memory's
        // contract), kept alive by the Arc the region owns.
        Ok(unsafe { LocalRegion::new(ptr, len, desc, Box::new(region)) })
    }
}

fn check_id(id: u32) -> Result<()> {
    if id >= MAX_REGIONS {
        return Err(Error::transport(
            "register",
            format!("region id {id} >= {MAX_REGIONS}"),
        ));
    }
    Ok(())
}

impl FabricTransport {
    /// [`Transport::put_signals`] to the targets `targets` yields (`mixed`
    /// passes its remote ones): validated and posted `FANOUT_BATCH` at a
    /// time from a fixed array, so the fan-out allocates nothing. This rank
    /// and a peer that closed its engine get [`Transport::put_signal`].
    pub fn put_signals_to<'a>(
        &self,
        targets: impl Iterator<Item = &'a (usize, RegionDesc)>,
        signal: SignalRef,
        value: u64,
    ) -> Result<()> {
        let c = &self.core;
        let mut batch = no_targets();
        let (mut n, mut first) = (0, Ok(()));
        for (peer, desc) in targets {
            let (peer, p) = (*peer, c.peer(*peer)?);
            let addr = match p.addr {
                Some(addr) if c.notice(peer).is_none() => addr,
                _ => {
                    self.put_signal(peer, desc, 0, &[], signal, value)?;
                    continue;
                }
            };
            let r = c.bounds(peer, p, desc, 0, 0)?;
            c.bounds(peer, p, desc, signal.offset, 8 + MAILBOX)?;
            let imm = Imm {
                region: desc.id,
                offset: signal.offset,
                bell: signal.bell,
                update: Update::Raise,
            }
            .encode()?;
            batch[n] = (peer, addr, r, imm);
            n += 1;
            if n == FANOUT_BATCH {
                first = first.and(c.post_raise_batch(&batch, signal.offset, value, c.timeout));
                n = 0;
            }
        }
        first.and(c.post_raise_batch(&batch[..n], signal.offset, value, c.timeout))
    }
}

impl FabricTransport {
    fn status_of(&self, peer: usize) -> PeerStatus {
        let c = &self.core;
        if peer == c.rank {
            return PeerStatus::Alive;
        }
        if let Some(closed) = c.notice(peer) {
            return closed;
        }
        let Ok(p) = c.peer(peer) else {
            return PeerStatus::Alive;
        };
        if !p.dead.load(Ordering::Acquire) {
            if let Some(by) = c.reported(peer) {
                return PeerStatus::Reported { by };
            }
            c.probe(peer, p);
        }
        if p.dead.load(Ordering::Acquire) && !p.notice_awaited.swap(true, Ordering::AcqRel) {
            // A peer that closed its engine sent its close notice (whom it
            // blamed) before its endpoint went, but on an unordered network
            // the notice may complete after the operation that failed on
            // it: give it a moment, once per peer.
            let until = Instant::now() + NOTICE_GRACE;
            while Instant::now() < until {
                if let Some(closed) = c.notice(peer) {
                    return closed;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        if let Some(closed) = c.notice(peer) {
            return closed;
        }
        let blamed = p
            .blamed
            .load(Ordering::Acquire)
            .checked_sub(1)
            .and_then(|b| usize::try_from(b).ok());
        if p.dead.load(Ordering::Acquire) {
            return PeerStatus::Dead { pid: 0, blamed };
        }
        // Running, but a wait of its own failed on a third rank (the blame
        // the probe read): it will not deliver what this rank waits for, and
        // the root cause is that rank (its notice, or its close notice,
        // says so too).
        if blamed.is_some_and(|b| b != c.rank && b != peer) {
            return PeerStatus::Dead { pid: 0, blamed };
        }
        match c.reported(peer) {
            Some(by) => PeerStatus::Reported { by },
            None => PeerStatus::Alive,
        }
    }
}

impl Transport for FabricTransport {
    fn name(&self) -> &'static str {
        "fabric"
    }

    fn endpoint(&self) -> Endpoint {
        let c = &self.core;
        Endpoint {
            rank: c.rank,
            pid: std::process::id(),
            host: c.host.clone(),
            address: hex(&c.name),
            regions: c
                .regions
                .iter()
                .enumerate()
                .filter_map(|(id, r)| Some(c.remote(r.get()?, id as u32)))
                .collect(),
        }
    }

    fn register(&self, id: u32, len: usize) -> Result<LocalRegion> {
        check_id(id)?;
        let region = self.core.register(id, len)?;
        self.local_region(id, region)
    }

    fn connect(&self, peer: usize, endpoint: &Endpoint, regions: &[RegionDesc]) -> Result<()> {
        let c = &self.core;
        let slot = c
            .peers
            .get(peer)
            .ok_or_else(|| Error::transport("connect", format!("rank {peer} out of range")))?;
        let mut table: Vec<Option<RemoteRegion>> = vec![None; STATUS_ID as usize + 1];
        let published = |id: u32| endpoint.regions.iter().find(|r| r.id == id).copied();
        for d in regions {
            let r = published(d.id).unwrap_or(RemoteRegion {
                id: d.id,
                base: 0,
                len: d.len,
                key: d.key,
            });
            *table.get_mut(d.id as usize).ok_or_else(|| {
                Error::transport("connect", format!("rank {peer}: region id {}", d.id))
            })? = Some(r);
        }
        table[STATUS_ID as usize] = published(STATUS_ID);
        let addr = if peer == c.rank {
            None
        } else {
            let name = peer_address(peer, &endpoint.address, c.name.len())?;
            Some(c.av.insert(&name).map_err(|e| with_peer(e, peer))?)
        };
        let p = Peer {
            addr,
            regions: table,
            dead: AtomicBool::new(false),
            blamed: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            warm: AtomicBool::new(peer == c.rank),
            notice_awaited: AtomicBool::new(false),
            last_probe: AtomicU64::new(0),
            probe_buf: Default::default(),
        };
        slot.set(p)
            .map_err(|_| Error::transport("connect", format!("rank {peer} connected twice")))?;
        // Warm up: RDM sets up the connection on the first operation.
        if let (Ok(p), true) = (c.peer(peer), peer != c.rank) {
            if let Some(r) = p
                .region(STATUS_ID)
                .or_else(|| p.regions.iter().flatten().next().copied())
            {
                let mut buf = [0u8; 8];
                c.read(peer, p, &r, 0, &mut buf, Instant::now() + c.timeout)?;
            }
            p.warm.store(true, Ordering::Release);
        }
        Ok(())
    }

    fn get(&self, peer: usize, remote: &RegionDesc, offset: usize, dst: &mut [u8]) -> Result<()> {
        let c = &self.core;
        let p = c.peer(peer)?;
        let r = c.bounds(peer, p, remote, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        if c.notice(peer).is_some() {
            return Err(peer_died(peer, format!("a read of {} bytes", dst.len())));
        }
        if p.addr.is_none() {
            let own = c
                .regions
                .get(remote.id as usize)
                .and_then(OnceLock::get)
                .ok_or_else(|| Error::transport("get", format!("no own region {}", remote.id)))?;
            if offset + dst.len() > own.len {
                return Err(Error::transport("bounds", "own region too short"));
            }
            // SAFETY: in range (checked); our own memory never overlaps a
            // caller's buffer.
            unsafe { odc_kernels::cpu::copy_raw(dst.as_mut_ptr(), own.ptr.add(offset), dst.len()) };
            return Ok(());
        }
        // A `PeerDied` is attributed (and blamed) by the engine, which
        // asks the dead peer whom it blamed in turn.
        c.read(peer, p, &r, offset, dst, Instant::now() + c.timeout)
    }

    fn put_signal(
        &self,
        peer: usize,
        remote: &RegionDesc,
        offset: usize,
        src: &[&[u8]],
        signal: SignalRef,
        value: u64,
    ) -> Result<()> {
        let c = &self.core;
        let p = c.peer(peer)?;
        let total: usize = src.iter().map(|s| s.len()).sum();
        let pure = total == 0;
        let r = c.bounds(peer, p, remote, offset, total)?;
        // A pure signal also owns the word's mailbox.
        let cell = if pure { 8 + MAILBOX } else { 8 };
        c.bounds(peer, p, remote, signal.offset, cell)?;
        let imm = Imm {
            region: remote.id,
            offset: signal.offset,
            bell: signal.bell,
            update: if pure { Update::Raise } else { Update::Count },
        }
        .encode()?;
        if c.notice(peer).is_some() {
            // The peer closed its engine: nobody will read the signal (as
            // with shm, where it would land in an orphaned segment).
            return Ok(());
        }
        let Some(addr) = p.addr else {
            let own = c
                .regions
                .get(remote.id as usize)
                .and_then(OnceLock::get)
                .ok_or_else(|| {
                    Error::transport("put_signal", format!("no own region {}", remote.id))
                })?;
            if offset + total > own.len {
                return Err(Error::transport("bounds", "own region too short"));
            }
            let mut at = offset;
            for part in src {
                // SAFETY: in range (checked); sources never overlap our
                // registered memory.
                unsafe {
                    odc_kernels::cpu::copy_raw_cached(own.ptr.add(at), part.as_ptr(), part.len())
                };
                at += part.len();
            }
            let word = own
                .word(signal.offset)
                .ok_or_else(|| Error::transport("put_signal", "signal word out of range"))?;
            // What the progress thread does for a remote writer.
            if pure {
                word.fetch_max(value, Ordering::Release);
            } else {
                word.fetch_add(1, Ordering::Release);
            }
            c.ring(signal.bell);
            return Ok(());
        };
        let out = if pure {
            c.post_raise(peer, addr, &r, signal.offset, imm, value, c.timeout)
        } else {
            self.post_data(peer, addr, &r, offset, src, total, imm)
        };
        match out {
            // The peer's close notice arrived while the write failed.
            Err(_) if c.notice(peer).is_some() => Ok(()),
            other => other,
        }
    }

    fn put_signals(
        &self,
        targets: &[(usize, RegionDesc)],
        signal: SignalRef,
        value: u64,
    ) -> Result<()> {
        self.put_signals_to(targets.iter(), signal, value)
    }

    unsafe fn run_batch(&self, ops: &mut dyn Iterator<Item = Op>) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.run_ops(ops, &mut |_| None) }
    }

    fn bell_epoch(&self, bell: Bell) -> u32 {
        self.core.bells[bell_index(bell)].epoch()
    }

    fn bell_wait(&self, bell: Bell, epoch: u32, timeout: Duration) -> Result<()> {
        // The progress thread drives libfabric; this only sleeps.
        self.core.bells[bell_index(bell)].wait(epoch, timeout);
        Ok(())
    }

    fn ring(&self, bell: Bell) {
        self.core.ring(bell);
    }

    fn peer_status(&self, peer: usize) -> PeerStatus {
        self.status_of(peer)
    }

    fn set_blame(&self, peer: usize) {
        self.core.blame(peer);
    }

    fn failure(&self) -> Option<Error> {
        self.core.progress_failed()
    }

    fn retire(&self) {
        let c = &self.core;
        if let Some(w) = (c.regions.get(STATUS_ID as usize))
            .and_then(OnceLock::get)
            .and_then(|r| r.word(0))
        {
            w.store(STATE_CLOSED, Ordering::Release);
        }
        c.send_notices(true);
    }
}

impl Drop for FabricTransport {
    fn drop(&mut self) {
        let c = &self.core;
        // Peers probing this rank see it closed.
        if let Some(w) = c
            .regions
            .get(STATUS_ID as usize)
            .and_then(OnceLock::get)
            .and_then(|r| r.word(0))
        {
            w.store(STATE_CLOSED, Ordering::Release);
        }
        c.ring(Bell::Client);
        c.send_notices(true);
        c.stop.store(true, Ordering::Release);
        if let Err(e) = c.cq.signal() {
            eprintln!(
                "odc: fabric rank {}: waking the progress thread: {e}",
                c.rank
            );
        }
        if let Some(h) = self.progress.take() {
            if h.join().is_err() {
                eprintln!("odc: fabric rank {}: progress thread panicked", c.rank);
            }
        }
        // The endpoint, CQ, AV and domain close when the last Arc goes
        // (after the regions that still hold memory registrations).
    }
}
