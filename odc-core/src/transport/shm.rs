//! `shm`: the transport between processes on one host, over POSIX shared
//! memory. A read is a copy out of the peer's mapping (streaming stores
//! when large, [`odc_kernels::cpu::copy_raw`]); a signal is a release store
//! into it followed by a futex wake on the peer's bell page.
//!
//! Segments are named `/odc-<jobkey>-<jobid>-r<rank>-l<pid>-<id>` (the pid
//! only makes names unique; nothing reads it back), created with `O_EXCL`
//! and mode 0600, **preallocated** (`posix_fallocate`: a `/dev/shm` too
//! small for them is an [`Error::ShmSpace`] at creation, naming the bytes
//! needed and free, instead of a SIGBUS at the first touch), and unlinked
//! when the rank's transport and regions drop.
//!
//! # Liveness
//!
//! The creator holds a shared open-file-description lock
//! (`F_OFD_SETLK`) on every segment it creates for as long as it lives;
//! the kernel drops it when the process dies, however it dies. A peer is
//! dead when nobody holds the lock on its bell page any more, and a
//! segment is stale when nobody holds its lock: both hold across pid
//! namespaces (containers sharing `/dev/shm`), where pid numbers mean
//! nothing. A forked child (a data-loader worker) does not keep its
//! parent's locks: a fork handler points the child's copies of the lock
//! descriptors at `/dev/null`. A rank that is killed, crashes or ends
//! without dropping its engine (a `multiprocessing` child ends with
//! `os._exit`; a process group torch still holds at exit is never freed)
//! leaves its segments behind; the next start of any ODC engine on the
//! host removes every `odc-*` segment nobody holds ([`sweep_stale`]),
//! whatever job key it had, and never a live job's.
//!
//! Region id [`BELL_ID`] is the transport's own bell page: owner pid, state,
//! blame, and the two [`EventCount`]s the owner sleeps on.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::time::Duration;

use memmap2::MmapMut;
use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::Mode;

use super::shm_lock::{try_lock, LockFile};
use super::{PeerStatus, Transport};
use crate::region::{Bell, Endpoint, LocalRegion, RegionDesc, SignalRef};
use crate::sync::{AtomicU64, EventCount, Ordering};
use crate::{Error, Result};

/// Where POSIX shared memory lives.
pub const SHM_DIR: &str = "/dev/shm";

/// Bytes free in [`SHM_DIR`] for this user (`statvfs`), if it can be read.
pub fn shm_free() -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(SHM_DIR).ok()?;
    Some((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

/// Gives `len` bytes of `file` (a new segment) their pages now, so that a
/// `/dev/shm` too small fails here with [`Error::ShmSpace`] and never with
/// a SIGBUS at the first touch of a page.
fn preallocate(file: &File, len: usize, name: &str) -> Result<()> {
    let len_off = libc::off_t::try_from(len)
        .map_err(|_| Error::transport("posix_fallocate", format!("{name}: {len} bytes")))?;
    loop {
        // SAFETY: a valid descriptor; the call only sizes the file.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len_off) };
        match rc {
            0 => return Ok(()),
            libc::EINTR => continue,
            libc::ENOSPC | libc::EFBIG => {
                return Err(Error::ShmSpace {
                    dir: SHM_DIR.into(),
                    needed: len as u64,
                    free: shm_free().unwrap_or(0),
                    what: format!("segment {name}"),
                })
            }
            other => {
                return Err(Error::transport_io(
                    "posix_fallocate",
                    format!("{name}: {len} bytes"),
                    std::io::Error::from_raw_os_error(other),
                ))
            }
        }
    }
}

/// Region id of the bell page (not a user region).
pub const BELL_ID: u32 = u32::MAX;
const MAX_REGIONS: u32 = 16;
const BELL_LEN: usize = 4096;
const MAGIC: u64 = 0x4f44_435f_5348_4d31; // "ODC_SHM1"
const OFF_MAGIC: usize = 0;
const OFF_PID: usize = 8;
const OFF_STATE: usize = 16;
const OFF_BLAME: usize = 24;
/// Nodes the elastic membership rounds dropped, a bit per node
/// ([`Transport::report_dropped`]).
const OFF_DROPPED: usize = 32;
const OFF_SERVER_BELL: usize = 64;
const OFF_CLIENT_BELL: usize = 128;
const STATE_CLOSED: u64 = 1;

/// A mapped segment; unlinks its name on drop when this process created it.
struct Segment {
    name: String,
    map: MmapMut,
    ptr: NonNull<u8>,
    owned: bool,
    /// The open segment: for our own, holding the liveness lock; for a
    /// peer's bell page, what its lock is probed through.
    file: Option<LockFile>,
}

// SAFETY: the mapping is process-wide memory; access goes through raw
// pointers and atomics under the protocol's ordering.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("name", &self.name)
            .field("len", &self.map.len())
            .finish()
    }
}

impl Segment {
    fn create(name: &str, len: usize) -> Result<Segment> {
        let fd = shm_open(
            name,
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(|e| Error::transport_io("shm_open", format!("create {name}"), e.into()))?;
        let seg = (|| {
            // Locked before it has a size: a sweeper that finds it unlocked
            // and empty leaves it alone (see `sweep_stale`).
            let file = LockFile::hold(File::from(fd), name)?;
            nix::unistd::ftruncate(file.file(), i64::try_from(len).unwrap_or(i64::MAX)).map_err(
                |e| Error::transport_io("ftruncate", format!("{name} to {len} bytes"), e.into()),
            )?;
            preallocate(file.file(), len, name)?;
            Segment::map(name, file, true)
        })();
        if seg.is_err() {
            let _ = shm_unlink(name);
        }
        seg
    }

    fn open(name: &str) -> Result<Segment> {
        let fd = shm_open(name, OFlag::O_RDWR, Mode::empty())
            .map_err(|e| Error::transport_io("shm_open", format!("open {name}"), e.into()))?;
        Segment::map(name, LockFile::probe(File::from(fd)), false)
    }

    fn map(name: &str, lock: LockFile, owned: bool) -> Result<Segment> {
        let file = lock.file();
        // A peer's segment is mapped lazily: the engine prefaults the parts
        // this rank touches ([`Transport::prefault`]), not the whole of it.
        let opts = memmap2::MmapOptions::new();
        // SAFETY: the segment is shared memory that peers write concurrently;
        // we never form long-lived references into it, only raw-pointer
        // copies and atomics whose ordering the protocol defines.
        let mut map = unsafe { opts.map_mut(file) }
            .map_err(|e| Error::transport_io("mmap", name.to_owned(), e))?;
        let ptr = NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| Error::transport("mmap", format!("{name}: null mapping")))?;
        Ok(Segment {
            name: name.to_owned(),
            map,
            ptr,
            owned,
            // A peer's data segments need no descriptor once mapped.
            file: (owned || name.ends_with("-bell")).then_some(lock),
        })
    }

    /// Whether a live process still holds the lock of this (a peer's)
    /// segment; `true` when it cannot be told.
    fn held(&self) -> bool {
        self.file.as_ref().is_none_or(LockFile::held)
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= self.len());
        // SAFETY: callers pass an 8-aligned offset inside the mapping (page
        // aligned base); signal words are only ever accessed atomically.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    fn event_count(&self, offset: usize) -> &EventCount {
        // SAFETY: the bell page is BELL_LEN bytes and `offset` is one of the
        // fixed, aligned bell offsets; EventCount is two atomics, repr(C).
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<EventCount>() }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owned {
            if let Err(e) = shm_unlink(self.name.as_str()) {
                // Nothing to propagate from drop; a leftover is swept at the
                // next start of the job.
                eprintln!("odc: shm_unlink({}) failed: {e}", self.name);
            }
        }
    }
}

/// Maps in the pages of `[base, base + len)`, part of a shared mapping:
/// `MADV_POPULATE_WRITE` / `_READ` (Linux 5.14), or, where the kernel lacks
/// them, a read of one byte per page (on `/dev/shm` a read fault maps the
/// page writable too). Only a cost saved, never a correctness matter.
fn prefault_pages(base: *mut u8, len: usize, write: bool) {
    let page = 4096usize;
    let start = (base as usize) / page * page;
    let end = (base as usize + len).div_ceil(page) * page;
    let advice = if write {
        libc::MADV_POPULATE_WRITE
    } else {
        libc::MADV_POPULATE_READ
    };
    // SAFETY: `[start, end)` lies inside one mapping of this process (the
    // caller's range, widened to its pages); madvise only maps pages in.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
    if rc != 0 {
        for p in (start..end).step_by(page) {
            // SAFETY: `p` is inside the mapping (above); a volatile read
            // of a shared word the protocol reads atomically elsewhere only
            // faults the page in; its value is discarded.
            unsafe { std::ptr::read_volatile(p.max(base as usize) as *const u8) };
        }
    }
}

/// A connected peer: its pid, bell page and regions by id.
#[derive(Debug)]
struct Peer {
    pid: u32,
    bell: Segment,
    regions: Vec<Option<Segment>>,
}

/// The POSIX shared-memory transport. See the module docs.
#[derive(Debug)]
pub struct ShmTransport {
    rank: usize,
    prefix: String,
    pid: u32,
    bell: Segment,
    peers: Vec<OnceLock<Peer>>,
}

/// Sanitizes a job key into `[A-Za-z0-9_]{1,32}`.
pub fn sanitize_job_key(key: &str) -> String {
    let s: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(32)
        .collect();
    if s.is_empty() {
        "default".into()
    } else {
        s
    }
}

/// Whether process `pid` exists and is not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if let Err(nix::errno::Errno::ESRCH) =
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None)
    {
        return false;
    }
    // A zombie still answers kill(); its state in /proc is 'Z' (or 'X').
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rfind(')')
                .and_then(|i| stat[i + 1..].trim_start().chars().next()),
            Some('Z') | Some('X')
        ),
        Err(_) => false,
    }
}

/// Removes `/dev/shm/odc-*` segments that no live process holds (their
/// creator died without unlinking them), of every job key: a job's keys
/// are often random (the `"odc"` process group's, a test's), so sweeping
/// only the starting job's own key left every other job's leftovers until
/// the host rebooted. A segment is removed only when its lock can be taken
/// and it has a size, so a live job's segments (locked) and one being
/// created (locked before it is sized) stay, whatever job keys the jobs
/// use; another user's (mode 0600) cannot be opened and stays. Returns how
/// many were removed.
pub fn sweep_stale() -> usize {
    let prefix = "odc-";
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return 0;
    };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(prefix) || !is_locked_kind(name) {
            continue;
        }
        let path = format!("/{name}");
        let Ok(fd) = shm_open(path.as_str(), OFlag::O_RDWR, Mode::empty()) else {
            continue;
        };
        let file = File::from(fd);
        let sized = file.metadata().is_ok_and(|m| m.len() > 0);
        // Held while it is unlinked, so its creator cannot be mid-way.
        if sized
            && try_lock(&file, libc::F_WRLCK as libc::c_short)
            && shm_unlink(path.as_str()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

impl ShmTransport {
    /// Creates this rank's transport (and its bell page) for job `job_id`
    /// under `job_key`, after sweeping stale segments (of every key).
    pub fn new(rank: usize, world: usize, job_key: &str, job_id: &str) -> Result<ShmTransport> {
        sweep_stale();
        let prefix = format!(
            "/odc-{}-{}",
            sanitize_job_key(job_key),
            sanitize_job_key(job_id)
        );
        let pid = std::process::id();
        let bell = Segment::create(&segment_name(&prefix, rank, pid, BELL_ID), BELL_LEN)?;
        bell.word(OFF_PID).store(u64::from(pid), Ordering::Relaxed);
        bell.word(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(ShmTransport {
            rank,
            prefix,
            pid,
            bell,
            peers: (0..world).map(|_| OnceLock::new()).collect(),
        })
    }

    fn peer(&self, peer: usize) -> Result<&Peer> {
        self.peers
            .get(peer)
            .and_then(OnceLock::get)
            .ok_or_else(|| Error::transport("lookup", format!("rank {peer} is not connected")))
    }

    fn remote(
        &self,
        peer: usize,
        remote: &RegionDesc,
        offset: usize,
        len: usize,
    ) -> Result<*mut u8> {
        let p = self.peer(peer)?;
        let seg = usize::try_from(remote.id)
            .ok()
            .and_then(|i| p.regions.get(i))
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                Error::transport("lookup", format!("rank {peer} has no region {}", remote.id))
            })?;
        match offset.checked_add(len) {
            Some(end) if end <= seg.len() => {
                // SAFETY: offset + len is within the mapping (checked).
                Ok(unsafe { seg.ptr.as_ptr().add(offset) })
            }
            _ => Err(Error::transport(
                "bounds",
                format!(
                    "{len} bytes at {offset} exceed region {} of rank {peer} ({} bytes)",
                    remote.id,
                    seg.len()
                ),
            )),
        }
    }

    fn own_bell(&self, bell: Bell) -> &EventCount {
        self.bell.event_count(bell_offset(bell))
    }
}

fn bell_offset(bell: Bell) -> usize {
    match bell {
        Bell::Server => OFF_SERVER_BELL,
        Bell::Client => OFF_CLIENT_BELL,
    }
}

/// `l<pid>`: the segment is held by its creator's lock (an older release
/// wrote `p<pid>` and swept by pid: each sweep leaves the other's alone).
fn segment_name(prefix: &str, rank: usize, pid: u32, id: u32) -> String {
    if id == BELL_ID {
        format!("{prefix}-r{rank}-l{pid}-bell")
    } else {
        format!("{prefix}-r{rank}-l{pid}-{id}")
    }
}

/// Whether `name` (without the leading `/`) is a segment this release
/// creates, locked by its creator.
fn is_locked_kind(name: &str) -> bool {
    name.split('-').any(|part| {
        part.strip_prefix('l')
            .is_some_and(|p| p.parse::<u32>().is_ok())
    })
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint {
            rank: self.rank,
            pid: self.pid,
            host: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default(),
            address: String::new(),
            regions: Vec::new(),
        }
    }

    fn register(&self, id: u32, len: usize) -> Result<LocalRegion> {
        if id >= MAX_REGIONS {
            return Err(Error::transport(
                "register",
                format!("region id {id} >= {MAX_REGIONS}"),
            ));
        }
        let seg = Segment::create(
            &segment_name(&self.prefix, self.rank, self.pid, id),
            len.max(64),
        )?;
        let desc = RegionDesc {
            owner: u32::try_from(self.rank).unwrap_or(u32::MAX),
            id,
            len: seg.len() as u64,
            key: 0,
        };
        let (ptr, len) = (seg.ptr, seg.len());
        // SAFETY: the mapping is page aligned, `len` bytes long and lives as
        // long as `seg`, which the region owns.
        Ok(unsafe { LocalRegion::new(ptr, len, desc, Box::new(seg)) })
    }

    fn connect(&self, peer: usize, endpoint: &Endpoint, regions: &[RegionDesc]) -> Result<()> {
        let slot = self
            .peers
            .get(peer)
            .ok_or_else(|| Error::transport("connect", format!("rank {peer} out of range")))?;
        let bell = Segment::open(&segment_name(&self.prefix, peer, endpoint.pid, BELL_ID))?;
        if bell.len() < BELL_LEN || bell.word(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(Error::transport(
                "connect",
                format!("rank {peer}: bad bell page"),
            ));
        }
        let mut maps: Vec<Option<Segment>> = Vec::new();
        for desc in regions {
            let i = usize::try_from(desc.id).unwrap_or(usize::MAX);
            if desc.id >= MAX_REGIONS {
                return Err(Error::transport(
                    "connect",
                    format!("rank {peer}: region id {}", desc.id),
                ));
            }
            let seg = Segment::open(&segment_name(&self.prefix, peer, endpoint.pid, desc.id))?;
            if (seg.len() as u64) < desc.len {
                return Err(Error::transport(
                    "connect",
                    format!(
                        "rank {peer}: region {} is {} bytes, descriptor says {}",
                        desc.id,
                        seg.len(),
                        desc.len
                    ),
                ));
            }
            if maps.len() <= i {
                maps.resize_with(i + 1, || None);
            }
            maps[i] = Some(seg);
        }
        slot.set(Peer {
            pid: endpoint.pid,
            bell,
            regions: maps,
        })
        .map_err(|_| Error::transport("connect", format!("rank {peer} connected twice")))
    }

    fn prefault(
        &self,
        peer: usize,
        remote: &RegionDesc,
        range: std::ops::Range<usize>,
        write: bool,
    ) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        let base = self.remote(peer, remote, range.start, range.len())?;
        prefault_pages(base, range.len(), write);
        Ok(())
    }

    fn mapped(&self, peer: usize, remote: &RegionDesc) -> Option<NonNull<u8>> {
        let len = usize::try_from(remote.len).ok()?;
        NonNull::new(self.remote(peer, remote, 0, len).ok()?)
    }

    fn get(&self, peer: usize, remote: &RegionDesc, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.remote(peer, remote, offset, dst.len())?;
        // A large read (a gathered shard) streams past the cache: on a
        // memory-bound host that is up to twice as fast as memcpy.
        // SAFETY: `src` is valid for dst.len() bytes (bounds checked), a
        // mapping never overlaps a caller's buffer, and the protocol keeps
        // the owner from writing the range while it is read.
        unsafe { odc_kernels::cpu::copy_raw(dst.as_mut_ptr(), src, dst.len()) };
        Ok(())
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
        let total: usize = src.iter().map(|s| s.len()).sum();
        let mut dst = self.remote(peer, remote, offset, total)?;
        let sig = self.remote(peer, remote, signal.offset, 8)?;
        if signal.offset % 8 != 0 {
            return Err(Error::transport(
                "put_signal",
                format!("signal offset {} unaligned", signal.offset),
            ));
        }
        // A landing-slot chunk is a plain (cached) copy, never streamed: the
        // owner's daemon reads it right after, and streaming it to memory
        // made 64 MiB scatter-accumulates slower (3.1 against 3.9 GB/s
        // busbw, 2 ranks). Were it streamed, the fence `copy_raw` ends with
        // would order the chunk before the release store of the signal.
        for part in src {
            // SAFETY: the destination range was bounds checked for the total
            // length; source buffers never overlap a shared mapping.
            unsafe {
                odc_kernels::cpu::copy_raw_cached(dst, part.as_ptr(), part.len());
                dst = dst.add(part.len());
            }
        }
        // SAFETY: `sig` is in range and 8-aligned (checked); signal words are
        // accessed only atomically.
        let word = unsafe { &*sig.cast::<AtomicU64>() };
        if total == 0 {
            word.fetch_max(value, Ordering::Release);
        } else {
            // A count (the trait's contract): its one writer stores it.
            word.store(value, Ordering::Release);
        }
        self.peer(peer)?
            .bell
            .event_count(bell_offset(signal.bell))
            .notify();
        Ok(())
    }

    fn bell_epoch(&self, bell: Bell) -> u32 {
        self.own_bell(bell).epoch()
    }

    fn bell_wait(&self, bell: Bell, epoch: u32, timeout: Duration) -> Result<()> {
        self.own_bell(bell).wait(epoch, timeout);
        Ok(())
    }

    fn ring(&self, bell: Bell) {
        self.own_bell(bell).notify();
    }

    fn peer_status(&self, peer: usize) -> PeerStatus {
        if peer == self.rank {
            return PeerStatus::Alive;
        }
        let Ok(p) = self.peer(peer) else {
            return PeerStatus::Alive;
        };
        let closed = p.bell.word(OFF_STATE).load(Ordering::Acquire) == STATE_CLOSED;
        // Nobody holds its bell page's lock: its process is gone (the pid
        // would mean nothing in another pid namespace).
        if closed || !p.bell.held() {
            let blame = p.bell.word(OFF_BLAME).load(Ordering::Acquire);
            let blamed = blame.checked_sub(1).and_then(|b| usize::try_from(b).ok());
            return PeerStatus::Dead { pid: p.pid, blamed };
        }
        PeerStatus::Alive
    }

    fn retire(&self) {
        self.bell
            .word(OFF_STATE)
            .store(STATE_CLOSED, Ordering::Release);
    }

    fn set_blame(&self, peer: usize) {
        let _ = self.bell.word(OFF_BLAME).compare_exchange(
            0,
            peer as u64 + 1,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    fn report_dropped(&self, nodes: u64) {
        self.bell
            .word(OFF_DROPPED)
            .fetch_or(nodes, Ordering::AcqRel);
    }
}

impl ShmTransport {
    /// Rings `peer`'s (connected) `bell`, as a signal to it would.
    pub fn ring_peer(&self, peer: usize, bell: Bell) {
        if let Ok(p) = self.peer(peer) {
            p.bell.event_count(bell_offset(bell)).notify();
        }
    }

    /// The nodes that rank `peer` (connected, or this rank) knows the
    /// elastic membership rounds dropped: a load from its bell page.
    pub fn dropped_of(&self, peer: usize) -> u64 {
        if peer == self.rank {
            return self.bell.word(OFF_DROPPED).load(Ordering::Acquire);
        }
        self.peer(peer)
            .map_or(0, |p| p.bell.word(OFF_DROPPED).load(Ordering::Acquire))
    }

    /// The rank `peer` (connected) recorded as the one it failed because
    /// of, if it failed on one: a load from its bell page.
    pub fn blame_of(&self, peer: usize) -> Option<usize> {
        let p = self.peer(peer).ok()?;
        let blame = p.bell.word(OFF_BLAME).load(Ordering::Acquire);
        blame.checked_sub(1).and_then(|b| usize::try_from(b).ok())
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        // Peers that still wait on this rank see it as gone at once.
        self.bell
            .word(OFF_STATE)
            .store(STATE_CLOSED, Ordering::Release);
        self.own_bell(Bell::Client).notify();
    }
}
