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
//! This module owns the slot words' use and the read loop; the rules are
//! the pure functions of [`slots`]. It knows nothing of parameters, names
//! or dtypes (the manifest is the Python layer's), and it does not touch
//! the engine: a server has its own transport, so a reader never maps a
//! training rank's engine memory. Only the `shm` transport is built here;
//! reads go through the [`Transport`] verbs (words through
//! [`Transport::mapped`] where the transport maps the peer, else `get`), so
//! a network transport slots in at [`WeightReader::connect`].

pub mod slots;

use std::ptr::NonNull;
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::region::{Endpoint, LocalRegion, RegionDesc};
use crate::sync::{fence, AtomicU64, Ordering};
use crate::transport::shm::ShmTransport;
use crate::transport::{PeerStatus, Transport};
use crate::{Error, Result};
pub use slots::SlotLayout;
use slots::{Before, OFF_LATEST, OFF_SLOTS, OFF_SLOT_BYTES};

/// The region id of a server's slots.
const REGION_ID: u32 = 0;

/// One trainer rank's snapshot slots. See the module docs.
#[derive(Debug)]
pub struct WeightServer {
    // Dropped after the region (field order): the region's segment belongs
    // to the transport's job prefix.
    region: LocalRegion,
    transport: ShmTransport,
    layout: SlotLayout,
    /// The last version published, plus one (0: none); serializes publishes.
    published: Mutex<u64>,
}

impl WeightServer {
    /// Registers the slots of server rank `rank` of `world` under `job_key`
    /// and `job_id` (every server rank and every reader use the same two).
    pub fn new(
        rank: usize,
        world: usize,
        job_key: &str,
        job_id: &str,
        layout: SlotLayout,
    ) -> Result<WeightServer> {
        if layout.slots < 2 {
            return Err(Error::Config(format!(
                "weight server: slots={} (K must be at least 2, so that a reader of version v \
                 never blocks the publish of v + 1)",
                layout.slots
            )));
        }
        let transport = ShmTransport::new(rank, world, job_key, job_id)?;
        let region = transport.register(REGION_ID, layout.region_bytes())?;
        let server = WeightServer {
            region,
            transport,
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

    fn word(&self, offset: usize) -> &AtomicU64 {
        // Offsets come from `slots`, inside the region and 8-aligned.
        self.region
            .signal(offset)
            .unwrap_or_else(|| unreachable!("slot word {offset} outside the weight region"))
    }

    /// How readers reach this rank's transport.
    pub fn endpoint(&self) -> Endpoint {
        self.transport.endpoint()
    }

    /// The slots' region, for readers.
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
        for (offset, bytes) in parts {
            if offset
                .checked_add(bytes.len())
                .is_none_or(|end| end > self.layout.slot_bytes)
            {
                return Err(Error::layout(
                    None,
                    format!(
                        "weight server: {} bytes at offset {offset} exceed the slot's {} bytes",
                        bytes.len(),
                        self.layout.slot_bytes
                    ),
                ));
            }
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
        for (offset, bytes) in parts {
            // SAFETY: in bounds (checked above against the slot, which the
            // region holds); readers only read it, and detect a torn copy
            // by the sequence words; the caller's bytes never overlap the
            // region.
            unsafe {
                odc_kernels::cpu::copy_raw(
                    self.region.as_ptr().add(data + offset),
                    bytes.as_ptr(),
                    bytes.len(),
                )
            };
        }
        fence(Ordering::SeqCst);
        self.word(self.layout.end(s)).store(tag, Ordering::Release);
        self.word(OFF_LATEST).store(tag, Ordering::Release);
        *published = tag;
        Ok(())
    }
}

/// Where one server rank's slots are, as the Store gives them.
#[derive(Clone, Debug)]
pub struct Owner {
    /// Its transport's endpoint.
    pub endpoint: Endpoint,
    /// Its slots' region.
    pub region: RegionDesc,
    /// Its slots' layout.
    pub layout: SlotLayout,
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
    transport: Box<dyn Transport>,
    owners: Vec<Owner>,
    /// Where the transport maps each owner's region (`shm`).
    mapped: Vec<Option<NonNull<u8>>>,
    fault: Mutex<Fault>,
}

// SAFETY: the mapped pointers address shared mappings the transport keeps
// alive as long as `self`; they are only read through atomics and copies.
unsafe impl Send for WeightReader {}
// SAFETY: as above; `read` takes no `&mut self` state but the fault mutex.
unsafe impl Sync for WeightReader {}

impl WeightReader {
    /// Maps every owner's slots (`owners[r]` is server rank r) of the
    /// servers under `job_key` / `job_id`, and checks their headers.
    pub fn connect(job_key: &str, job_id: &str, owners: Vec<Owner>) -> Result<WeightReader> {
        let world = owners.len();
        if world == 0 {
            return Err(Error::Config("weight reader: no server ranks".into()));
        }
        // A rank number no server has (its bell page's name only).
        let me = world + READERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let transport: Box<dyn Transport> =
            Box::new(ShmTransport::new(me, me + 1, job_key, job_id)?);
        let mut mapped = Vec::with_capacity(world);
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
            transport.connect(r, &o.endpoint, &[o.region])?;
            mapped.push(transport.mapped(r, &o.region));
        }
        let reader = WeightReader {
            transport,
            owners,
            mapped,
            fault: Mutex::new(Fault::default()),
        };
        for (r, o) in reader.owners.iter().enumerate() {
            let (magic, k, bytes) = (
                reader.word(r, 0)?,
                reader.word(r, OFF_SLOTS)?,
                reader.word(r, OFF_SLOT_BYTES)?,
            );
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
        Ok(reader)
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

    /// One 64-bit word of owner `r`'s region: an atomic load from the
    /// mapping where the transport maps it, else a `get`.
    fn word(&self, r: usize, offset: usize) -> Result<u64> {
        if let Some(base) = self.mapped[r] {
            // SAFETY: `offset` comes from `slots` and lies inside the
            // region (its length was checked at connect); the base is page
            // aligned, so the word is 8-aligned; the mapping lives as long
            // as the transport; slot words are only accessed atomically.
            let w = unsafe { &*base.as_ptr().add(offset).cast::<AtomicU64>() };
            return Ok(w.load(Ordering::Acquire));
        }
        let mut b = [0u8; 8];
        self.transport
            .get(r, &self.owners[r].region, offset, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Every owner's `latest` word (version + 1, 0: nothing published).
    pub fn latest(&self) -> Result<Vec<u64>> {
        (0..self.owners.len())
            .map(|r| self.word(r, OFF_LATEST))
            .collect()
    }

    /// Waits until every owner published a version at least `at_least`
    /// (any, for `None`), and returns their `latest` words.
    fn wait_published(&self, at_least: Option<u64>, deadline: Instant) -> Result<Vec<u64>> {
        let start = Instant::now();
        let mut nap = Duration::from_micros(100);
        loop {
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
            if let PeerStatus::Dead { pid, .. } = self.transport.peer_status(o) {
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
            if d.len() > o.layout.slot_bytes {
                return Err(Error::layout(
                    None,
                    format!(
                        "weight reader: {} bytes asked of owner {r}'s {}-byte slot",
                        d.len(),
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
            match self.read_once(version, dst)? {
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
    ) -> Result<std::result::Result<(), (usize, u64)>> {
        let fault = self.take_fault();
        let last = dst.len() - 1;
        for (r, d) in dst.iter_mut().enumerate() {
            let l = self.owners[r].layout;
            let s = l.slot_of(version);
            let end = self.word(r, l.end(s))?;
            let begin = self.word(r, l.begin(s))?;
            match slots::before(begin, end, version) {
                Before::Whole => {}
                Before::Overwritten { by } => return Ok(Err((r, by))),
                // `latest` said the owner finished it: only a later write
                // can have moved the words since.
                Before::NotYet => return Ok(Err((r, begin.max(end).saturating_sub(1)))),
            }
            match fault {
                // The test fault sleeps in the middle of the last owner's
                // copy, where only the re-check below can see a torn copy.
                Some(delay) if r == last => {
                    let half = d.len() / 2;
                    let (a, b) = d.split_at_mut(half);
                    self.transport
                        .get(r, &self.owners[r].region, l.data(s), a)?;
                    std::thread::sleep(delay);
                    self.transport
                        .get(r, &self.owners[r].region, l.data(s) + half, b)?;
                }
                _ => self
                    .transport
                    .get(r, &self.owners[r].region, l.data(s), d)?,
            }
        }
        // The copies above happen before the re-reads below.
        fence(Ordering::Acquire);
        for r in 0..dst.len() {
            let l = self.owners[r].layout;
            let begin = self.word(r, l.begin(l.slot_of(version)))?;
            if let Err(by) = slots::after(begin, version) {
                return Ok(Err((r, by)));
            }
        }
        Ok(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servers(job: &str, world: usize, layout: SlotLayout) -> Vec<WeightServer> {
        (0..world)
            .map(|r| WeightServer::new(r, world, "wtest", job, layout).expect("server"))
            .collect()
    }

    fn owners(servers: &[WeightServer]) -> Vec<Owner> {
        servers
            .iter()
            .map(|s| Owner {
                endpoint: s.endpoint(),
                region: s.desc(),
                layout: s.layout(),
            })
            .collect()
    }

    fn opts() -> ReadOptions {
        ReadOptions {
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
        let srv = servers(&job, 2, layout);
        let reader = WeightReader::connect("wtest", &job, owners(&srv)).expect("connect");
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

    #[test]
    fn concurrent_reads_are_whole() {
        let layout = SlotLayout {
            slots: 2,
            slot_bytes: 1 << 16,
        };
        let job = format!("b{}", std::process::id());
        let srv = servers(&job, 2, layout);
        publish_all(&srv, 0);
        let reader = WeightReader::connect("wtest", &job, owners(&srv)).expect("connect");
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                for v in 1..2000 {
                    publish_all(&srv, v);
                }
                stop.store(true, std::sync::atomic::Ordering::Release);
            });
            let (mut a, mut b) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
            let mut reads = 0;
            while !stop.load(std::sync::atomic::Ordering::Acquire) || reads == 0 {
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
                }
            }
        });
    }
}
