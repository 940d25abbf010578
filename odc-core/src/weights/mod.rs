//! Rollout weights: readers outside the training group read the trainer's
//! published parameter versions one-sidedly, a whole version or none,
//! without ever making the trainer wait.
//!
//! - [`WeightServer`]: one per trainer rank. It registers one region of K
//!   snapshot slots ([`slots`]) with its own transport and copies this
//!   rank's shards into slot `v mod K` at each [`publish`](WeightServer::publish)
//!   of version v. It never reads anything a reader writes: a reader holds
//!   no lock and no word the server waits on.
//! - [`WeightReader`]: any process on the host. It maps every server rank's
//!   region (the descriptors and endpoints come from the Store, written by
//!   the Python layer), picks the newest version every owner holds whole,
//!   copies each owner's slot with [`Transport::get`], and checks the slot
//!   words again ([`slots::after`]): a version overwritten meanwhile is read
//!   again (a newer one) or refused by name ([`Refusal`]).
//!
//! # Across nodes
//!
//! A server registers its slots with `shm` always and, when asked
//! ([`Serve`]), with a libfabric transport of its own too: one piece of
//! memory, two ways in (as the `shm+fabric` transport does). Its fabric
//! progress thread serves remote reads; the training thread's publish is
//! the same stores either way. A reader reaches each owner one way
//! ([`slots::reach`]): `shm` for owners on its node ([`node_id`]: host
//! name and network namespace), libfabric `fi_read` for the others. The
//! sequence words of a remote owner are one-sided reads (both words in one
//! read before the copy, `begin` again after it); the copies of every
//! owner's slot go out together in one batch (reads of up to 32 MiB, every
//! owner's link busy at once), the `shm` ones copied while the remote ones
//! fly. A dead or unreachable owner fails the read with `PeerDied` naming
//! its rank: an operation that fails, or none completing within the
//! reader's timeout.
//!
//! This module owns the slot words' use and the read loop; the rules are
//! the pure functions of [`slots`]. It knows nothing of parameters, names
//! or dtypes (the manifest is the Python layer's), and it does not touch
//! the engine: a server has its own transports, so a reader never maps or
//! reads a training rank's engine memory. Reads go through the
//! [`Transport`] verbs (words through [`Transport::mapped`] where `shm`
//! maps the owner, else `get`).

pub mod cache;
pub mod slots;

use std::ptr::NonNull;
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::region::{Endpoint, LocalRegion, RegionDesc};
use crate::sync::{fence, AtomicU64, Ordering};
#[cfg(feature = "fabric")]
use crate::transport::fabric::FabricTransport;
use crate::transport::shm::ShmTransport;
use crate::transport::{run_one, Op, PeerStatus, Transport};
use crate::{Error, Result};
use slots::{Before, OFF_CACHE, OFF_FAILED, OFF_LATEST, OFF_SLOTS, OFF_SLOT_BYTES};
pub use slots::{Prefer, Reach, SlotLayout};

/// The region id of a server's slots.
const REGION_ID: u32 = 0;
/// The largest single read of a slot copy over the network: a batch of
/// these keeps every owner's link busy, and no one read outlives its
/// deadline for being large. (256 MiB between two namespaces over tcp:
/// 0.84-1.11x a plain TCP stream's time with 32 MiB reads, 1.01-1.38x
/// with 4 MiB ones, on a noisy 2-core host.)
const READ_PIECE: usize = 32 << 20;
/// Bytes of a slot's two words read as one (`begin` at 0, `end` at 64).
const WORDS: usize = 72;

/// What a server registers its slots with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Serve {
    /// Shared memory only: readers on this node.
    #[default]
    Shm,
    /// Shared memory and libfabric: readers on any node. Creating the
    /// server fails if libfabric cannot be opened.
    Fabric,
    /// As `Fabric` where libfabric opens, else as `Shm`, keeping the
    /// reason ([`WeightServer::fabric_error`]) for readers to report.
    Auto,
}

impl Serve {
    /// Parses `"shm"`, `"fabric"` or `"auto"`.
    pub fn parse(name: &str) -> Option<Serve> {
        match name.trim().to_ascii_lowercase().as_str() {
            "shm" => Some(Serve::Shm),
            "fabric" => Some(Serve::Fabric),
            "auto" => Some(Serve::Auto),
            _ => None,
        }
    }
}

/// This process's node, as readers and servers compare them: the host
/// name and the network namespace (two namespaces of one host are two
/// nodes, as the multi-host tests emulate them; the init namespace has the
/// same number on every host, so the host name tells real hosts apart).
pub fn node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    let net = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{host}/{net}")
}

/// Opens this rank's libfabric transport and registers the `shm` region
/// with it too (the region moves into the registration's backing, which
/// keeps the segment mapped until the fabric transport let go of it).
#[cfg(feature = "fabric")]
fn fabric_region(
    rank: usize,
    world: usize,
    timeout: Duration,
    shm: LocalRegion,
) -> Result<(FabricTransport, LocalRegion)> {
    let fabric = FabricTransport::new(rank, world, timeout)?;
    let ptr = NonNull::new(shm.as_ptr())
        .ok_or_else(|| Error::transport("register", "null shm mapping"))?;
    let len = shm.len();
    // SAFETY: the shm region is a page-aligned mapping of `len` bytes that
    // stays mapped until the region itself, moved into the backing, is
    // dropped; nothing else unmaps it.
    let region = unsafe { fabric.register_foreign(REGION_ID, ptr, len, Box::new(shm))? };
    Ok((fabric, region))
}

/// One trainer rank's snapshot slots. See the module docs.
#[derive(Debug)]
pub struct WeightServer {
    // Field order is drop order: the region first, then the fabric
    // transport (its progress thread, and its registration that holds the
    // shm region), then the shm transport (the segments' job prefix).
    region: LocalRegion,
    #[cfg(feature = "fabric")]
    fabric: Option<FabricTransport>,
    transport: ShmTransport,
    /// Why the slots are not registered with libfabric ([`Serve::Auto`]).
    fabric_error: Option<String>,
    layout: SlotLayout,
    /// The last version published, plus one (0: none); serializes publishes.
    published: Mutex<u64>,
}

impl WeightServer {
    /// Registers the slots of server rank `rank` of `world` under `job_key`
    /// and `job_id` (every server rank and every reader use the same two),
    /// with shared memory and, as `serve` says, libfabric (`timeout` bounds
    /// its operations).
    pub fn new(
        rank: usize,
        world: usize,
        job_key: &str,
        job_id: &str,
        layout: SlotLayout,
        serve: Serve,
        timeout: Duration,
    ) -> Result<WeightServer> {
        if layout.slots < 2 {
            return Err(Error::Config(format!(
                "weight server: slots={} (K must be at least 2, so that a reader of version v \
                 never blocks the publish of v + 1)",
                layout.slots
            )));
        }
        let transport = ShmTransport::new(rank, world, job_key, job_id)?;
        let shm = transport.register(REGION_ID, layout.region_bytes())?;
        #[cfg(feature = "fabric")]
        let (region, fabric, fabric_error) = match serve {
            Serve::Shm => (shm, None, Some("served with shared memory only".to_owned())),
            Serve::Fabric => {
                let (f, region) = fabric_region(rank, world, timeout, shm)?;
                (region, Some(f), None)
            }
            Serve::Auto => match fabric_region(rank, world, timeout, shm) {
                Ok((f, region)) => (region, Some(f), None),
                // The first region went with the failed registration.
                Err(e) => (
                    transport.register(REGION_ID, layout.region_bytes())?,
                    None,
                    Some(format!("libfabric could not serve the slots: {e}")),
                ),
            },
        };
        #[cfg(not(feature = "fabric"))]
        let (region, fabric_error) = match serve {
            Serve::Fabric => {
                let _ = timeout;
                return Err(Error::Config(
                    "weight server: serving over libfabric needs odc-core built with the `fabric` \
                     feature"
                        .into(),
                ));
            }
            Serve::Shm => (shm, Some("served with shared memory only".to_owned())),
            Serve::Auto => (
                shm,
                Some("odc-core was built without the `fabric` feature".to_owned()),
            ),
        };
        let server = WeightServer {
            region,
            #[cfg(feature = "fabric")]
            fabric,
            transport,
            fabric_error,
            layout,
            published: Mutex::new(0),
        };
        server
            .word(OFF_SLOTS)
            .store(layout.slots as u64, Ordering::Relaxed);
        server
            .word(OFF_SLOT_BYTES)
            .store(layout.slot_bytes as u64, Ordering::Relaxed);
        server.word(0).store(slots::MAGIC, Ordering::Release);
        Ok(server)
    }

    /// How readers on other nodes reach this rank's slots (its libfabric
    /// endpoint: address, keys, status region), if it serves them there.
    pub fn fabric_endpoint(&self) -> Option<Endpoint> {
        #[cfg(feature = "fabric")]
        {
            self.fabric.as_ref().map(Transport::endpoint)
        }
        #[cfg(not(feature = "fabric"))]
        {
            None
        }
    }

    /// Why this rank does not serve its slots over libfabric (`None` when
    /// it does).
    pub fn fabric_error(&self) -> Option<&str> {
        self.fabric_error.as_deref()
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        // Offsets come from `slots`, inside the region and 8-aligned.
        self.region
            .signal(offset)
            .unwrap_or_else(|| unreachable!("slot word {offset} outside the weight region"))
    }

    /// How readers on this node reach this rank's slots (its `shm`
    /// endpoint: pid and host).
    pub fn endpoint(&self) -> Endpoint {
        self.transport.endpoint()
    }

    /// The slots' region, for readers (with the libfabric key where it is
    /// served there; `shm` ignores the key).
    pub fn desc(&self) -> RegionDesc {
        self.region.desc()
    }

    /// The slots' layout.
    pub fn layout(&self) -> SlotLayout {
        self.layout
    }

    /// The newest version published, if any.
    pub fn latest(&self) -> Option<u64> {
        self.word(OFF_LATEST).load(Ordering::Acquire).checked_sub(1)
    }

    /// Publishes `version` (greater than every version published before):
    /// copies each `(offset, bytes)` of `parts` to that offset of slot
    /// `version mod K`, between the slot's sequence words, then announces
    /// it. Waits for nothing; bytes of the slot no part covers keep what
    /// they held (zeros, for a layout that never changes).
    pub fn publish(&self, version: u64, parts: &[(usize, &[u8])]) -> Result<()> {
        let parts: Vec<PublishPart<'_>> = (parts.iter())
            .map(|&(offset, bytes)| PublishPart {
                offset,
                bytes,
                cast: None,
            })
            .collect();
        self.publish_parts(version, &parts)
    }

    /// [`WeightServer::publish`] with parts that may be cast on the way
    /// into the slot ([`PublishPart::cast`]): one pass from the caller's
    /// tensor into the slot, where a cast into a staging buffer and a copy
    /// of that would be two.
    pub fn publish_parts(&self, version: u64, parts: &[PublishPart<'_>]) -> Result<()> {
        let mut lens = Vec::with_capacity(parts.len());
        for p in parts {
            let len = p.slot_len()?;
            if p.offset
                .checked_add(len)
                .is_none_or(|end| end > self.layout.slot_bytes)
            {
                return Err(Error::layout(
                    None,
                    format!(
                        "weight server: {len} bytes at offset {} exceed the slot's {} bytes",
                        p.offset, self.layout.slot_bytes
                    ),
                ));
            }
            lens.push(len);
        }
        let mut published = self.published.lock().map_err(|_| Error::Internal {
            rank: self.endpoint().rank,
            during: "publishing weights".into(),
            detail: "an earlier publish panicked".into(),
        })?;
        if version.checked_add(1).is_none_or(|tag| tag <= *published) {
            return Err(Error::protocol(
                None,
                format!(
                    "weight server: version {version} published after version {} (versions must \
                     grow)",
                    *published - 1
                ),
            ));
        }
        let tag = version + 1;
        let s = self.layout.slot_of(version);
        self.word(self.layout.begin(s))
            .store(tag, Ordering::Relaxed);
        // Orders `begin` before every byte of the data, streaming stores
        // included (a full fence: `mfence` on x86).
        fence(Ordering::SeqCst);
        let data = self.layout.data(s);
        let mut failed = None;
        for (p, &len) in parts.iter().zip(&lens) {
            // SAFETY: in bounds (checked above against the slot, which the
            // region holds); readers only read it, and detect a torn copy
            // by the sequence words; the caller's bytes never overlap the
            // region.
            let dst = unsafe { self.region.as_ptr().add(data + p.offset) };
            match p.cast {
                // SAFETY: as above, `len` bytes from `dst` are the slot's.
                None => unsafe { odc_kernels::cpu::copy_raw(dst, p.bytes.as_ptr(), len) },
                Some((from, to)) => {
                    // SAFETY: as above; only this publish (under the lock)
                    // writes the slot.
                    let out = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                    if let Err(e) = odc_kernels::cpu::cast(p.bytes, from, out, to) {
                        failed = Some(Error::layout(
                            None,
                            format!("weight server: a part at offset {}: {e}", p.offset),
                        ));
                        break;
                    }
                }
            }
        }
        fence(Ordering::SeqCst);
        if let Some(e) = failed {
            // The slot holds part of `version`: its end word stays behind
            // its begin word, so no reader takes it, and nothing announces it.
            return Err(e);
        }
        self.word(self.layout.end(s)).store(tag, Ordering::Release);
        self.word(OFF_LATEST).store(tag, Ordering::Release);
        *published = tag;
        Ok(())
    }
}

/// One part of a [`WeightServer::publish_parts`]: `bytes` go to byte
/// `offset` of the slot as they are, or with `cast = Some((from, to))`
/// element by element from `from` to `to` (rounded to nearest, ties to
/// even, as torch casts; the slot takes `to`'s bytes).
#[derive(Clone, Copy, Debug)]
pub struct PublishPart<'a> {
    /// Where the part starts in the slot, in bytes.
    pub offset: usize,
    /// The caller's bytes (in `from`'s dtype when cast).
    pub bytes: &'a [u8],
    /// `(from, to)`: cast element by element; `None`: copied as they are.
    pub cast: Option<(odc_kernels::DType, odc_kernels::DType)>,
}

impl PublishPart<'_> {
    /// The bytes this part takes in the slot.
    fn slot_len(&self) -> Result<usize> {
        match self.cast {
            None => Ok(self.bytes.len()),
            Some((from, to)) if self.bytes.len() % from.size_bytes() == 0 => {
                Ok(self.bytes.len() / from.size_bytes() * to.size_bytes())
            }
            Some((from, _)) => Err(Error::layout(
                None,
                format!(
                    "weight server: a part at offset {} holds {} bytes, not whole {from} elements",
                    self.offset,
                    self.bytes.len()
                ),
            )),
        }
    }
}

/// Where one server rank's slots are, as the Store gives them.
#[derive(Clone, Debug)]
pub struct Owner {
    /// Its `shm` transport's endpoint.
    pub endpoint: Endpoint,
    /// Its slots' region.
    pub region: RegionDesc,
    /// Its slots' layout.
    pub layout: SlotLayout,
    /// Its node ([`node_id`] on the server).
    pub node: String,
    /// Its libfabric endpoint, where it serves its slots there.
    pub fabric: Option<Endpoint>,
    /// Why it does not serve them there (reported to a reader that needs it).
    pub fabric_error: Option<String>,
}

/// Which version a read wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// The newest every owner holds whole; a newer one when it is
    /// overwritten while read.
    Latest,
    /// Exactly this one: refused if it is overwritten.
    Exactly(u64),
}

/// How a read waits and retries.
#[derive(Clone, Copy, Debug)]
pub struct ReadOptions {
    /// The deadline of the whole read (the first publish included).
    pub timeout: Duration,
    /// How many times a read of [`Want::Latest`] starts again after a
    /// version was overwritten under it.
    pub retries: u32,
    /// Where in every owner's slot data the copy starts (bytes; 0: the
    /// whole slot from its start): a reader that takes a slot in pieces.
    pub at: usize,
}

/// A version read whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Got {
    /// The version read.
    pub version: u64,
    /// The newest version any owner had published when the read ended.
    pub newest: u64,
    /// Reads started (1 when nothing was overwritten).
    pub attempts: u32,
}

/// A read that gave up: a version was overwritten while it was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The server rank whose slot was overwritten.
    pub owner: usize,
    /// The version being read.
    pub version: u64,
    /// The version that overwrote it.
    pub by: u64,
    /// Reads started.
    pub attempts: u32,
    /// K.
    pub slots: usize,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "version {} of owner rank {} was overwritten by version {} before the read of it \
             completed (the trainer keeps K={} versions per rank; {} read(s) started)",
            self.version, self.owner, self.by, self.slots, self.attempts
        )
    }
}

/// How a read ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every owner's shards of one version, in the caller's buffers.
    Got(Got),
    /// No whole version within the retries (the buffers hold garbage).
    Refused(Refusal),
}

/// A test fault: sleep `delay` halfway through the copy of the last
/// owner's slot, in each of the first `reads` reads started.
#[derive(Clone, Copy, Debug, Default)]
struct Fault {
    delay: Duration,
    reads: u32,
}

/// Distinguishes the readers of one process (their bell segments' names).
static READERS: AtomicUsize = AtomicUsize::new(0);

/// A reader of every server rank's slots. See the module docs.
#[derive(Debug)]
pub struct WeightReader {
    shm: Option<ShmTransport>,
    #[cfg(feature = "fabric")]
    fabric: Option<FabricTransport>,
    owners: Vec<Owner>,
    /// How each owner is reached.
    reach: Vec<Reach>,
    /// Where `shm` maps each owner's region (owners reached by `shm`).
    mapped: Vec<Option<NonNull<u8>>>,
    /// Owners that are a reader-node cache's copies ([`cache`]).
    cached: Vec<bool>,
    fault: Mutex<Fault>,
}

// SAFETY: the mapped pointers address shared mappings the transport keeps
// alive as long as `self`; they are only read through atomics and copies.
unsafe impl Send for WeightReader {}
// SAFETY: as above; `read` takes no `&mut self` state but the fault mutex.
unsafe impl Sync for WeightReader {}

impl WeightReader {
    /// Connects to every owner's slots (`owners[r]` is server rank r) of
    /// the servers under `job_key` / `job_id`, each the way `prefer` and
    /// its node say ([`slots::reach`]), and checks their headers. `timeout`
    /// bounds every network operation: an owner that answers none within
    /// it counts as dead.
    pub fn connect(
        job_key: &str,
        job_id: &str,
        owners: Vec<Owner>,
        prefer: Prefer,
        timeout: Duration,
    ) -> Result<WeightReader> {
        let world = owners.len();
        if world == 0 {
            return Err(Error::Config("weight reader: no server ranks".into()));
        }
        let here = node_id();
        let mut reach = Vec::with_capacity(world);
        for (r, o) in owners.iter().enumerate() {
            if o.region.owner as usize != r || o.endpoint.rank != r {
                return Err(Error::Config(format!(
                    "weight reader: entry {r} describes rank {} (region of rank {})",
                    o.endpoint.rank, o.region.owner
                )));
            }
            if (o.region.len as usize) < o.layout.region_bytes() {
                return Err(Error::Config(format!(
                    "weight reader: rank {r}'s region is {} bytes, its layout needs {}",
                    o.region.len,
                    o.layout.region_bytes()
                )));
            }
            let fabric = o.fabric.is_some() && cfg!(feature = "fabric");
            reach.push(slots::reach(prefer, o.node == here, fabric).map_err(|why| {
                let detail = o
                    .fabric_error
                    .as_deref()
                    .map_or(String::new(), |e| format!(" ({e})"));
                Error::Config(format!(
                    "weight reader: cannot reach trainer rank {r} (node {:?}, this reader's \
                         {here:?}): {why}{detail}",
                    o.node
                ))
            })?);
        }
        // A rank number no server has (its bell page's and its fabric
        // endpoint's only).
        let me = world + READERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shm = if reach.contains(&Reach::Shm) {
            Some(ShmTransport::new(me, me + 1, job_key, job_id)?)
        } else {
            None
        };
        #[cfg(feature = "fabric")]
        let fabric = if reach.contains(&Reach::Fabric) {
            Some(FabricTransport::new(me, me + 1, timeout)?)
        } else {
            None
        };
        #[cfg(not(feature = "fabric"))]
        let _ = timeout;
        let mut mapped = Vec::with_capacity(world);
        for (r, o) in owners.iter().enumerate() {
            match reach[r] {
                Reach::Shm => {
                    let t = shm.as_ref().ok_or_else(|| no_route(r, "shm"))?;
                    t.connect(r, &o.endpoint, &[o.region])?;
                    mapped.push(t.mapped(r, &o.region));
                }
                Reach::Fabric => {
                    #[cfg(feature = "fabric")]
                    {
                        let (t, ep) = fabric
                            .as_ref()
                            .zip(o.fabric.as_ref())
                            .ok_or_else(|| no_route(r, "fabric"))?;
                        t.connect(r, ep, &[o.region])?;
                    }
                    mapped.push(None);
                }
            }
        }
        let reader = WeightReader {
            shm,
            #[cfg(feature = "fabric")]
            fabric,
            owners,
            reach,
            mapped,
            cached: vec![false; world],
            fault: Mutex::new(Fault::default()),
        };
        let mut heads = vec![[0u8; 40]; world];
        reader.get_all(
            heads
                .iter_mut()
                .enumerate()
                .map(|(r, h)| (r, 0, h.as_mut_slice())),
        )?;
        for (r, o) in reader.owners.iter().enumerate() {
            let word = |i: usize| {
                u64::from_ne_bytes(heads[r][i * 8..i * 8 + 8].try_into().unwrap_or_default())
            };
            let (magic, k, bytes) = (word(0), word(1), word(2));
            if magic != slots::MAGIC
                || k != o.layout.slots as u64
                || bytes != o.layout.slot_bytes as u64
            {
                return Err(Error::malformed(
                    r,
                    "weight slot header",
                    "magic/K/slot bytes",
                    format!(
                        "{magic:#x}/{k}/{bytes}, the Store says K={} and {} bytes",
                        o.layout.slots, o.layout.slot_bytes
                    ),
                ));
            }
        }
        let mut reader = reader;
        reader.cached = (0..world)
            .map(|r| {
                let w = &heads[r][OFF_CACHE..OFF_CACHE + 8];
                u64::from_ne_bytes(w.try_into().unwrap_or_default()) == 1
            })
            .collect();
        if reader.cached.iter().any(|&c| c) && reader.reach.contains(&Reach::Fabric) {
            return Err(Error::Config(
                "weight reader: a node cache's copies are read over shared memory only".into(),
            ));
        }
        Ok(reader)
    }

    /// Fails, naming the rank, when an owner is a node cache's copy whose
    /// fetch failed (the trainer rank it failed on) or whose fetching
    /// process is gone: its versions would stop without either.
    fn check_cache(&self) -> Result<()> {
        for r in (0..self.owners.len()).filter(|&r| self.cached[r]) {
            if let Some(failed) = self
                .mapped_word(r, OFF_FAILED)
                .and_then(|w| w.checked_sub(1))
            {
                return Err(Error::PeerDied {
                    peer: usize::try_from(failed).unwrap_or(r),
                    pid: 0,
                    bucket: None,
                    waited_for: "its weight slots, which this node's cache failed to fetch".into(),
                    reported_by: None,
                });
            }
            if let PeerStatus::Dead { pid, .. } = self.transport(r)?.peer_status(r) {
                return Err(Error::PeerDied {
                    peer: r,
                    pid: 0,
                    bucket: None,
                    waited_for: format!(
                        "its weight slots from this node's cache, whose fetching reader (pid \
                         {pid}) is gone"
                    ),
                    reported_by: None,
                });
            }
        }
        Ok(())
    }

    /// How each owner is reached, by rank.
    pub fn reach(&self) -> &[Reach] {
        &self.reach
    }

    /// The transport owner `r` is reached through.
    fn transport(&self, r: usize) -> Result<&dyn Transport> {
        match self.reach[r] {
            Reach::Shm => self
                .shm
                .as_ref()
                .map(|t| t as &dyn Transport)
                .ok_or_else(|| no_route(r, "shm")),
            #[cfg(feature = "fabric")]
            Reach::Fabric => self
                .fabric
                .as_ref()
                .map(|t| t as &dyn Transport)
                .ok_or_else(|| no_route(r, "fabric")),
            #[cfg(not(feature = "fabric"))]
            Reach::Fabric => Err(no_route(r, "fabric")),
        }
    }

    /// One-sided reads of `(owner, offset, dst)`, all in flight together
    /// where the network carries them (in pieces of [`READ_PIECE`]), the
    /// `shm` ones copied meanwhile. Returns once every read landed, or with
    /// the first failure.
    fn get_all<'a>(&self, reads: impl Iterator<Item = (usize, usize, &'a mut [u8])>) -> Result<()> {
        let mut per_read = Vec::new();
        for (r, offset, dst) in reads {
            let remote = self.owners[r].region;
            let piece = match self.reach[r] {
                Reach::Shm => dst.len().max(1),
                Reach::Fabric => READ_PIECE,
            };
            let ops: Vec<Op> = dst
                .chunks_mut(piece)
                .enumerate()
                .map(|(i, chunk)| Op::Get {
                    peer: r,
                    remote,
                    offset: offset + i * piece,
                    dst: chunk.as_mut_ptr(),
                    len: chunk.len(),
                })
                .collect();
            per_read.push(ops.into_iter());
        }
        // One op of each owner in turn: the window of reads in flight spans
        // every owner, so owners on different nodes send over their links at
        // once.
        let mut ops = Vec::new();
        while per_read.iter().any(|o| o.len() > 0) {
            ops.extend(per_read.iter_mut().filter_map(Iterator::next));
        }
        #[cfg(feature = "fabric")]
        if let Some(f) = &self.fabric {
            let shm = self.shm.as_ref();
            let reach = &self.reach;
            let mut local = |op: Op| match (reach[op.peer()], shm) {
                // SAFETY: as for `run_ops` below.
                (Reach::Shm, Some(t)) => Some(unsafe { run_one(t, op) }),
                _ => None,
            };
            // SAFETY: every op addresses a part of one caller's buffer,
            // borrowed mutably (and so unaliased) until this returns; the
            // parts of one buffer do not overlap.
            return unsafe { f.run_ops(&mut ops.into_iter(), &mut local) };
        }
        for op in ops {
            // SAFETY: as above.
            unsafe { run_one(self.transport(op.peer())?, op)? };
        }
        Ok(())
    }

    /// The owners' layouts, by rank.
    pub fn layouts(&self) -> Vec<SlotLayout> {
        self.owners.iter().map(|o| o.layout).collect()
    }

    /// Test fault point: sleeps `delay` halfway through the copy of the
    /// last owner's slot in each of the next `reads` reads started.
    #[doc(hidden)]
    pub fn set_fault(&self, delay: Duration, reads: u32) {
        if let Ok(mut f) = self.fault.lock() {
            *f = Fault { delay, reads };
        }
    }

    fn take_fault(&self) -> Option<Duration> {
        let mut f = self.fault.lock().ok()?;
        if f.reads == 0 {
            return None;
        }
        f.reads -= 1;
        Some(f.delay)
    }

    /// Where owner `r`'s data of the slot of `version` lies in this
    /// process, and its bytes, when `shm` maps the owner (None over the
    /// network). For readers that consume a slot in place (a cast straight
    /// out of it) instead of copying it: the bytes may change under them
    /// at any time, so the caller brackets its reads between two
    /// [`WeightReader::read`]s of exactly `version` with empty buffers (the
    /// second one's `begin` re-check, after its acquire fence, proves that
    /// nothing was overwritten in between) and uses what it read only then.
    pub fn mapped_data(&self, r: usize, version: u64) -> Option<(*const u8, usize)> {
        let base = (*self.mapped.get(r)?)?;
        let l = self.owners[r].layout;
        // SAFETY: the data of a slot lies inside the region, whose length
        // was checked at connect; the mapping lives as long as `self`.
        Some((
            unsafe { base.as_ptr().add(l.data(l.slot_of(version))) }.cast_const(),
            l.slot_bytes,
        ))
    }

    /// The mapped word at `offset` of owner `r`'s region (owners `shm`
    /// maps), loaded with acquire order.
    fn mapped_word(&self, r: usize, offset: usize) -> Option<u64> {
        let base = self.mapped[r]?;
        // SAFETY: `offset` comes from `slots` and lies inside the region
        // (its length was checked at connect); the base is page aligned, so
        // the word is 8-aligned; the mapping lives as long as the
        // transport; slot words are only accessed atomically.
        let w = unsafe { &*base.as_ptr().add(offset).cast::<AtomicU64>() };
        Some(w.load(Ordering::Acquire))
    }

    /// The word at `offset(r)` of every owner `r`'s region: an atomic load
    /// where `shm` maps the owner, else a one-sided read (all of them in
    /// flight together).
    fn words(&self, offset: impl Fn(usize) -> usize) -> Result<Vec<u64>> {
        let n = self.owners.len();
        let mut bytes = vec![[0u8; 8]; n];
        self.get_all(
            bytes
                .iter_mut()
                .enumerate()
                .filter(|(r, _)| self.mapped[*r].is_none())
                .map(|(r, b)| (r, offset(r), b.as_mut_slice())),
        )?;
        Ok((0..n)
            .map(|r| {
                self.mapped_word(r, offset(r))
                    .unwrap_or_else(|| u64::from_ne_bytes(bytes[r]))
            })
            .collect())
    }

    /// Every owner's `(begin, end)` words of the slot of `version`, `end`
    /// read first where they are loads. A remote owner's two words come in
    /// one read (in no defined order): the copy after it starts only once
    /// `end` named the version, and the `begin` read after the copy
    /// decides, so their order does not matter there.
    fn slot_words(&self, version: u64) -> Result<Vec<(u64, u64)>> {
        let n = self.owners.len();
        let mut bytes = vec![[0u8; WORDS]; n];
        self.get_all(
            bytes
                .iter_mut()
                .enumerate()
                .filter(|(r, _)| self.mapped[*r].is_none())
                .map(|(r, b)| {
                    let l = self.owners[r].layout;
                    (r, l.begin(l.slot_of(version)), b.as_mut_slice())
                }),
        )?;
        Ok((0..n)
            .map(|r| {
                let l = self.owners[r].layout;
                let s = l.slot_of(version);
                match self.mapped_word(r, l.end(s)) {
                    Some(end) => (self.mapped_word(r, l.begin(s)).unwrap_or(0), end),
                    None => {
                        let w = |at: usize| {
                            u64::from_ne_bytes(bytes[r][at..at + 8].try_into().unwrap_or_default())
                        };
                        (w(0), w(l.end(s) - l.begin(s)))
                    }
                }
            })
            .collect())
    }

    /// Every owner's `latest` word (version + 1, 0: nothing published).
    pub fn latest(&self) -> Result<Vec<u64>> {
        self.words(|_| OFF_LATEST)
    }

    /// Waits until every owner published a version at least `at_least`
    /// (any, for `None`), and returns their `latest` words.
    fn wait_published(&self, at_least: Option<u64>, deadline: Instant) -> Result<Vec<u64>> {
        let start = Instant::now();
        let mut nap = Duration::from_micros(100);
        loop {
            self.check_cache()?;
            let latest = self.latest()?;
            let missing = match at_least {
                None => slots::newest_whole(&latest).err(),
                Some(v) => latest.iter().position(|&l| l < v + 1),
            };
            let Some(o) = missing else {
                return Ok(latest);
            };
            let waited_for = match at_least {
                None => "its first published weight version".to_owned(),
                Some(v) => format!("weight version {v}"),
            };
            if let PeerStatus::Dead { pid, .. } = self.transport(o)?.peer_status(o) {
                return Err(Error::PeerDied {
                    peer: o,
                    pid,
                    bucket: None,
                    waited_for,
                    reported_by: None,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::PeerTimeout {
                    peer: o,
                    bucket: None,
                    waited_for,
                    after: now - start,
                });
            }
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(Duration::from_millis(20));
        }
    }

    /// Reads one version of every owner's shards, `dst[r]` receiving the
    /// first `dst[r].len()` bytes (at most its slot's) of owner r's slot.
    /// Waits (up to the timeout) for owners that published nothing yet, or
    /// not yet `want`'s version. The buffers hold a whole version only when
    /// this returns [`Outcome::Got`].
    pub fn read(&self, want: Want, dst: &mut [&mut [u8]], opts: ReadOptions) -> Result<Outcome> {
        self.read_inner(want, dst, opts).map_err(|e| match e {
            // A trainer rank the network lost: say that it was a weight
            // read, and how the owner was reached.
            Error::PeerDied {
                peer,
                pid,
                bucket,
                waited_for,
                reported_by,
            } if self.reach.get(peer) == Some(&Reach::Fabric) => Error::PeerDied {
                peer,
                pid,
                bucket,
                waited_for: format!(
                    "{waited_for}, reading trainer rank {peer}'s weight slots over libfabric"
                ),
                reported_by,
            },
            other => other,
        })
    }

    fn read_inner(&self, want: Want, dst: &mut [&mut [u8]], opts: ReadOptions) -> Result<Outcome> {
        if dst.len() != self.owners.len() {
            return Err(Error::layout(
                None,
                format!(
                    "weight reader: {} buffers for {} owners",
                    dst.len(),
                    self.owners.len()
                ),
            ));
        }
        for (r, (d, o)) in dst.iter().zip(&self.owners).enumerate() {
            if !d.is_empty() && opts.at + d.len() > o.layout.slot_bytes {
                return Err(Error::layout(
                    None,
                    format!(
                        "weight reader: {} bytes from byte {} asked of owner {r}'s {}-byte slot",
                        d.len(),
                        opts.at,
                        o.layout.slot_bytes
                    ),
                ));
            }
        }
        let deadline = Instant::now() + opts.timeout;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let latest = match want {
                Want::Latest => self.wait_published(None, deadline)?,
                Want::Exactly(v) => self.wait_published(Some(v), deadline)?,
            };
            let version = match want {
                Want::Latest => slots::newest_whole(&latest).unwrap_or_default(),
                Want::Exactly(v) => v,
            };
            let refusal = |owner: usize, by: u64| Refusal {
                owner,
                version,
                by,
                attempts,
                slots: self.owners[owner].layout.slots,
            };
            match self.read_once(version, dst, opts.at)? {
                Ok(()) => {
                    let newest = slots::newest_any(&self.latest()?).unwrap_or(version);
                    return Ok(Outcome::Got(Got {
                        version,
                        newest: newest.max(version),
                        attempts,
                    }));
                }
                Err((owner, by)) => {
                    let again = want == Want::Latest
                        && attempts <= opts.retries
                        && Instant::now() < deadline;
                    if !again {
                        return Ok(Outcome::Refused(refusal(owner, by)));
                    }
                }
            }
        }
    }

    /// One attempt at `version`: `Err((owner, by))` when owner's slot was
    /// overwritten by version `by` (or held no whole copy) before or while
    /// it was copied.
    fn read_once(
        &self,
        version: u64,
        dst: &mut [&mut [u8]],
        at: usize,
    ) -> Result<std::result::Result<(), (usize, u64)>> {
        let fault = self.take_fault();
        for (r, (begin, end)) in self.slot_words(version)?.into_iter().enumerate() {
            match slots::before(begin, end, version) {
                Before::Whole => {}
                Before::Overwritten { by } => return Ok(Err((r, by))),
                // `latest` said the owner finished it: only a later write
                // can have moved the words since.
                Before::NotYet => return Ok(Err((r, begin.max(end).saturating_sub(1)))),
            }
        }
        let data = |r: usize| {
            let l = self.owners[r].layout;
            l.data(l.slot_of(version)) + at
        };
        let last = dst.len() - 1;
        match fault {
            // The test fault sleeps in the middle of the last owner's copy,
            // where only the re-check below can see a torn copy.
            Some(delay) => {
                let (first, rest) = dst.split_at_mut(last);
                let tail = &mut rest[0];
                let half = tail.len() / 2;
                let (a, b) = tail.split_at_mut(half);
                let at = data(last);
                self.get_all(
                    first
                        .iter_mut()
                        .enumerate()
                        .map(|(r, d)| (r, data(r), &mut **d))
                        .chain(std::iter::once((last, at, a))),
                )?;
                std::thread::sleep(delay);
                self.get_all(std::iter::once((last, at + half, b)))?;
            }
            None => self.get_all(
                dst.iter_mut()
                    .enumerate()
                    .map(|(r, d)| (r, data(r), &mut **d)),
            )?,
        }
        // The copies above happen before the re-reads below.
        fence(Ordering::Acquire);
        let begins = self.words(|r| {
            let l = self.owners[r].layout;
            l.begin(l.slot_of(version))
        })?;
        for (r, begin) in begins.into_iter().enumerate() {
            if let Err(by) = slots::after(begin, version) {
                return Ok(Err((r, by)));
            }
        }
        Ok(Ok(()))
    }
}

/// A reader whose route to owner `r` was never opened (a bug, named).
fn no_route(r: usize, how: &str) -> Error {
    Error::transport(
        "weight reader",
        format!("no {how} transport for trainer rank {r}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servers(job: &str, world: usize, layout: SlotLayout, serve: Serve) -> Vec<WeightServer> {
        (0..world)
            .map(|r| {
                WeightServer::new(
                    r,
                    world,
                    "wtest",
                    job,
                    layout,
                    serve,
                    Duration::from_secs(10),
                )
                .expect("server")
            })
            .collect()
    }

    fn owners(servers: &[WeightServer]) -> Vec<Owner> {
        servers
            .iter()
            .map(|s| Owner {
                endpoint: s.endpoint(),
                region: s.desc(),
                layout: s.layout(),
                node: node_id(),
                fabric: s.fabric_endpoint(),
                fabric_error: s.fabric_error().map(str::to_owned),
            })
            .collect()
    }

    fn reader(job: &str, srv: &[WeightServer], prefer: Prefer) -> WeightReader {
        WeightReader::connect("wtest", job, owners(srv), prefer, Duration::from_secs(10))
            .expect("connect")
    }

    fn opts() -> ReadOptions {
        ReadOptions {
            at: 0,
            timeout: Duration::from_secs(10),
            retries: 1000,
        }
    }

    fn publish_all(servers: &[WeightServer], v: u64) {
        for (r, s) in servers.iter().enumerate() {
            let data = vec![(v as u8) ^ (r as u8); s.layout().slot_bytes];
            s.publish(v, &[(0, &data)]).expect("publish");
        }
    }

    #[test]
    fn latest_exact_and_refused() {
        let layout = SlotLayout {
            slots: 2,
            slot_bytes: 1000,
        };
        let job = format!("a{}", std::process::id());
        let srv = servers(&job, 2, layout, Serve::Shm);
        let reader = reader(&job, &srv, Prefer::Auto);
        assert_eq!(reader.reach(), [Reach::Shm, Reach::Shm]);
        for v in 0..6 {
            publish_all(&srv, v);
        }
        let (mut a, mut b) = (vec![0u8; 1000], vec![0u8; 1000]);
        let got = reader
            .read(Want::Latest, &mut [&mut a, &mut b], opts())
            .expect("read");
        assert!(matches!(
            got,
            Outcome::Got(Got {
                version: 5,
                newest: 5,
                ..
            })
        ));
        assert!(a.iter().all(|&x| x == 5) && b.iter().all(|&x| x == 4));
        let old = reader
            .read(Want::Exactly(3), &mut [&mut a, &mut b], opts())
            .expect("read");
        assert!(
            matches!(
                old,
                Outcome::Refused(Refusal {
                    owner: 0,
                    version: 3,
                    by: 5,
                    ..
                })
            ),
            "{old:?}"
        );
        assert!(srv[0].publish(5, &[]).is_err(), "a version published twice");
    }

    /// A cast part lands in the slot as the kernels' cast gives it (f32 to
    /// bf16, rounded to nearest, ties to even) beside a part copied as it
    /// is; a part of no whole element is refused and announces nothing.
    #[test]
    fn cast_parts_land_cast_in_one_pass() {
        use odc_kernels::DType;
        let layout = SlotLayout {
            slots: 2,
            slot_bytes: 64,
        };
        let job = format!("c{}", std::process::id());
        let srv = servers(&job, 1, layout, Serve::Shm);
        // 1 + 2^-8 is a tie (rounds to 1), 1 + 3 * 2^-8 rounds up.
        let xs: Vec<f32> = (0..8)
            .map(|i| 1.0 + i as f32 / 256.0 - 3.5 * (i % 2) as f32)
            .collect();
        let raw = [7u8; 16];
        let f32s = crate::bytes_of(&xs);
        srv[0]
            .publish_parts(
                0,
                &[
                    PublishPart {
                        offset: 0,
                        bytes: f32s,
                        cast: Some((DType::F32, DType::BF16)),
                    },
                    PublishPart {
                        offset: 16,
                        bytes: &raw,
                        cast: None,
                    },
                ],
            )
            .expect("publish");
        let reader = reader(&job, &srv, Prefer::Auto);
        let mut got = vec![0u8; 64];
        let out = reader
            .read(Want::Latest, &mut [&mut got], opts())
            .expect("read");
        assert!(matches!(out, Outcome::Got(Got { version: 0, .. })));
        let want: Vec<u8> = xs
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_ne_bytes())
            .collect();
        assert_eq!(&got[..16], &want[..]);
        assert_eq!(&got[16..32], &raw);
        let err = srv[0]
            .publish_parts(
                1,
                &[PublishPart {
                    offset: 0,
                    bytes: &raw[..6],
                    cast: Some((DType::F32, DType::BF16)),
                }],
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("not whole f32 elements"), "{err}");
        assert_eq!(srv[0].latest(), Some(0));
    }

    /// Every read while the servers publish versions (`pause` between two)
    /// is one whole version (a third of the reads sleep inside the last
    /// owner's copy). The servers publish until the reader made 20 reads
    /// and was made to read again at least once (or 20 s passed).
    fn whole_while_publishing(
        srv: &[WeightServer],
        reader: &WeightReader,
        bytes: usize,
        pause: Duration,
    ) {
        let enough = std::sync::atomic::AtomicBool::new(false);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let relaxed = std::sync::atomic::Ordering::Acquire;
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let until = Instant::now() + Duration::from_secs(20);
                let mut v = 1;
                while !enough.load(relaxed) && Instant::now() < until {
                    publish_all(srv, v);
                    v += 1;
                    std::thread::sleep(pause);
                }
                stop.store(true, std::sync::atomic::Ordering::Release);
            });
            let (mut a, mut b) = (vec![0u8; bytes], vec![0u8; bytes]);
            let (mut reads, mut retried) = (0, 0);
            while !stop.load(relaxed) || reads == 0 {
                reader.set_fault(Duration::from_micros(50), u32::from(reads % 3 == 0));
                if let Outcome::Got(g) = reader
                    .read(Want::Latest, &mut [&mut a, &mut b], opts())
                    .expect("read")
                {
                    let v = g.version as u8;
                    assert!(a.iter().all(|&x| x == v), "owner 0 torn at {}", g.version);
                    assert!(
                        b.iter().all(|&x| x == v ^ 1),
                        "owner 1 torn at {}",
                        g.version
                    );
                    reads += 1;
                    retried += usize::from(g.attempts > 1);
                    if reads >= 20 && retried > 0 {
                        enough.store(true, std::sync::atomic::Ordering::Release);
                    }
                }
            }
            eprintln!("{reads} reads, {retried} retried");
            assert!(
                reads >= 20 && retried > 0,
                "{reads} reads, {retried} retried"
            );
        });
    }

    #[test]
    fn concurrent_reads_are_whole() {
        let layout = SlotLayout {
            slots: 2,
            slot_bytes: 1 << 16,
        };
        let job = format!("b{}", std::process::id());
        let srv = servers(&job, 2, layout, Serve::Shm);
        publish_all(&srv, 0);
        let reader = reader(&job, &srv, Prefer::Auto);
        whole_while_publishing(&srv, &reader, 1 << 16, Duration::ZERO);
    }

    #[test]
    fn an_owner_that_serves_no_fabric_is_refused_by_name() {
        let layout = SlotLayout {
            slots: 2,
            slot_bytes: 64,
        };
        let job = format!("c{}", std::process::id());
        let srv = servers(&job, 1, layout, Serve::Shm);
        let mut o = owners(&srv);
        o[0].node = "elsewhere/net:[1]".into();
        let err = WeightReader::connect("wtest", &job, o, Prefer::Auto, Duration::from_secs(1))
            .expect_err("no way to another node");
        let msg = err.to_string();
        assert!(
            msg.contains("trainer rank 0") && msg.contains("another node"),
            "{msg}"
        );
        assert!(msg.contains("shared memory only"), "{msg}");
    }

    #[test]
    fn a_node_cache_serves_whole_versions() {
        let layout = SlotLayout {
            slots: 2,
            slot_bytes: 1 << 16,
        };
        let job = format!("d{}", std::process::id());
        let srv = servers(&job, 2, layout, Serve::Shm);
        publish_all(&srv, 0);
        let up = std::sync::Arc::new(reader(&job, &srv, Prefer::Auto));
        let copies = format!("d{}c", std::process::id());
        let cache =
            cache::NodeCache::start(up, "wtest", &copies, Duration::from_secs(10)).expect("cache");
        let node = WeightReader::connect(
            "wtest",
            &copies,
            cache.owners(),
            Prefer::Shm,
            Duration::from_secs(10),
        )
        .expect("connect to the cache");
        assert_eq!(node.cached, [true, true]);
        whole_while_publishing(&srv, &node, 1 << 16, Duration::from_micros(200));
        let fetched = cache.fetched();
        assert!(fetched >= 2, "{fetched}");
        assert!(cache.failure().is_none());
    }

    #[cfg(feature = "fabric")]
    mod fabric {
        use super::*;

        /// Two owners of 2 slots of 4 KiB serving over libfabric (version 0
        /// published) and a reader of them over libfabric, for job `tag` +
        /// this process's id; `None` (skipped, said) without libfabric.
        fn fabric_owners(tag: &str) -> Option<(Vec<WeightServer>, WeightReader)> {
            if !crate::transport::fabric::is_present() {
                eprintln!("skipped: libfabric.so.1 cannot be loaded here");
                return None;
            }
            let layout = SlotLayout {
                slots: 2,
                slot_bytes: 4096,
            };
            let job = format!("{tag}{}", std::process::id());
            let srv = servers(&job, 2, layout, Serve::Fabric);
            publish_all(&srv, 0);
            let r = WeightReader::connect(
                "wtest",
                &job,
                owners(&srv),
                Prefer::Fabric,
                Duration::from_secs(5),
            )
            .expect("connect");
            Some((srv, r))
        }

        #[test]
        fn a_node_cache_whose_fetch_fails_names_the_trainer_rank() {
            let Some((mut srv, up)) = fabric_owners("h") else {
                return;
            };
            let copies = format!("h{}c", std::process::id());
            let cache = cache::NodeCache::start(
                std::sync::Arc::new(up),
                "wtest",
                &copies,
                Duration::from_secs(5),
            )
            .expect("cache");
            let node = WeightReader::connect(
                "wtest",
                &copies,
                cache.owners(),
                Prefer::Auto,
                Duration::from_secs(5),
            )
            .expect("connect to the cache");
            let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
            let got = node
                .read(Want::Latest, &mut [&mut a, &mut b], opts())
                .expect("read");
            assert!(
                matches!(got, Outcome::Got(Got { version: 0, .. })),
                "{got:?}"
            );
            drop(srv.pop());
            publish_all(&srv, 1); // a newer version the cache must fetch from both
            let t0 = Instant::now();
            let err = loop {
                match node.read(Want::Latest, &mut [&mut a, &mut b], opts()) {
                    Err(e) => break e,
                    Ok(_) => assert!(t0.elapsed() < Duration::from_secs(10), "no error"),
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            assert!(
                matches!(err, Error::PeerDied { peer: 1, .. }),
                "{err:?} ({:?})",
                cache.failure()
            );
            assert!(err.to_string().contains("node's cache"), "{err}");
            assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
        }

        #[test]
        fn reads_over_libfabric_are_whole() {
            if !crate::transport::fabric::is_present() {
                eprintln!("skipped: libfabric.so.1 cannot be loaded here");
                return;
            }
            let layout = SlotLayout {
                slots: 2,
                slot_bytes: (1 << 16) + 40,
            };
            let job = format!("f{}", std::process::id());
            let srv = servers(&job, 2, layout, Serve::Fabric);
            assert!(srv.iter().all(|s| s.fabric_endpoint().is_some()));
            publish_all(&srv, 0);
            // One owner over the network, one mapped: both routes in one read.
            let mut o = owners(&srv);
            o[1].node = "elsewhere/net:[1]".into();
            let reader =
                WeightReader::connect("wtest", &job, o, Prefer::Auto, Duration::from_secs(10))
                    .expect("connect");
            assert_eq!(reader.reach(), [Reach::Shm, Reach::Fabric]);
            whole_while_publishing(&srv, &reader, layout.slot_bytes, Duration::from_micros(200));
            let all = reader_fabric(&job, &srv);
            let (mut a, mut b) = (vec![0u8; 100], vec![0u8; 100]);
            let got = all
                .read(Want::Latest, &mut [&mut a, &mut b], opts())
                .expect("read");
            let last = srv[1].latest();
            assert!(
                matches!(got, Outcome::Got(Got { version, .. }) if Some(version) == last),
                "{got:?}, last published {last:?}"
            );
        }

        fn reader_fabric(job: &str, srv: &[WeightServer]) -> WeightReader {
            let r = reader(job, srv, Prefer::Fabric);
            assert_eq!(r.reach(), [Reach::Fabric, Reach::Fabric]);
            r
        }

        #[test]
        fn a_gone_owner_is_named_not_waited_for() {
            let Some((mut srv, r)) = fabric_owners("g") else {
                return;
            };
            drop(srv.pop());
            let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
            let t0 = Instant::now();
            let err = r
                .read(Want::Latest, &mut [&mut a, &mut b], opts())
                .expect_err("owner 1 is gone");
            assert!(
                matches!(
                    err,
                    Error::PeerDied { peer: 1, .. } | Error::PeerTimeout { peer: 1, .. }
                ),
                "{err:?}"
            );
            assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
        }
    }
}
