//! Exchanging shareable memory between the ranks of one node: the
//! connection half of the `cuda-ipc` transport.
//!
//! Every rank allocates its regions from a [`SharedMemory`] provider,
//! serves their file descriptors with an [`FdServer`], publishes where to
//! find them through the [`Store`], maps every peer's regions
//! ([`fdshare::import`], or a legacy handle from the Store), and waits until
//! every rank has mapped everything before its server stops. The result,
//! [`NodeRegions`], holds this rank's regions and every peer's mappings.
//!
//! The provider is [`Gpu`] for device memory; [`MemfdMemory`] (anonymous
//! `memfd` files, mapped with `mmap`) is the same contract in host memory,
//! so the whole exchange runs, and is tested, on machines without a GPU.
//!
//! Store keys (under the caller's prefix): `ipc/<rank>` (JSON
//! [`IpcPost`]) and `ipc-mapped/<rank>`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::device::{DeviceRegion, Gpu, PeerRegion, Shareable};
use super::fdshare::{self, FdServer, SharePolicy};
use crate::store::{wait_get, Store};
use crate::{Error, Result};

/// Memory that one process allocates and other processes of the node map.
pub trait SharedMemory: Send + Sync {
    /// A region this process owns.
    type Region: Send + Sync;
    /// A peer's region mapped here.
    type Mapping: Send + Sync;

    /// Allocates `len` zeroed bytes.
    fn alloc(&self, len: usize) -> Result<Self::Region>;
    /// Bytes actually allocated (what a peer maps).
    fn size(region: &Self::Region) -> usize;
    /// Address of byte 0 of a region, in this process.
    fn region_addr(region: &Self::Region) -> u64;
    /// A handle a peer maps the region with.
    fn export(&self, region: &Self::Region) -> Result<Shareable>;
    /// Maps a peer's region of `size` bytes.
    fn import(&self, shareable: Shareable, size: usize) -> Result<Self::Mapping>;
    /// Address of byte 0 of a mapping, in this process.
    fn mapping_addr(mapping: &Self::Mapping) -> u64;
}

impl SharedMemory for Arc<Gpu> {
    type Region = DeviceRegion;
    type Mapping = PeerRegion;

    fn alloc(&self, len: usize) -> Result<DeviceRegion> {
        Gpu::alloc(self, len)
    }
    fn size(region: &DeviceRegion) -> usize {
        region.size()
    }
    fn region_addr(region: &DeviceRegion) -> u64 {
        region.ptr()
    }
    fn export(&self, region: &DeviceRegion) -> Result<Shareable> {
        region.export()
    }
    fn import(&self, shareable: Shareable, size: usize) -> Result<PeerRegion> {
        Gpu::import(self, shareable, size)
    }
    fn mapping_addr(mapping: &PeerRegion) -> u64 {
        mapping.ptr()
    }
}

/// Host memory in anonymous `memfd` files: [`SharedMemory`] without a GPU.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemfdMemory;

/// A `memfd` file mapped shared into this process; unmapped on drop.
#[derive(Debug)]
pub struct MemfdRegion {
    fd: OwnedFd,
    map: memmap2::MmapRaw,
}

impl MemfdRegion {
    /// The mapped bytes.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the region is empty (never: at least one byte).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
}

fn map_fd(fd: &OwnedFd, size: usize) -> Result<memmap2::MmapRaw> {
    memmap2::MmapOptions::new()
        .len(size)
        .map_raw(fd.as_raw_fd())
        .map_err(|e| Error::transport_io("mmap", format!("memfd of {size} bytes"), e))
}

impl SharedMemory for MemfdMemory {
    type Region = MemfdRegion;
    type Mapping = MemfdRegion;

    fn alloc(&self, len: usize) -> Result<MemfdRegion> {
        let len = len.max(1);
        let fd = nix::sys::memfd::memfd_create(c"odc-ipc", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .map_err(|e| Error::transport_io("memfd_create", "odc-ipc", e.into()))?;
        nix::unistd::ftruncate(&fd, len as i64)
            .map_err(|e| Error::transport_io("ftruncate", format!("memfd to {len}"), e.into()))?;
        let map = map_fd(&fd, len)?;
        Ok(MemfdRegion { fd, map })
    }
    fn size(region: &MemfdRegion) -> usize {
        region.len()
    }
    fn region_addr(region: &MemfdRegion) -> u64 {
        region.as_ptr() as u64
    }
    fn export(&self, region: &MemfdRegion) -> Result<Shareable> {
        let fd = region
            .fd
            .try_clone()
            .map_err(|e| Error::transport_io("dup", "memfd", e))?;
        Ok(Shareable::Fd(fd))
    }
    fn import(&self, shareable: Shareable, size: usize) -> Result<MemfdRegion> {
        match shareable {
            Shareable::Fd(fd) => {
                let map = map_fd(&fd, size)?;
                Ok(MemfdRegion { fd, map })
            }
            Shareable::Legacy(_) => Err(Error::Config(
                "memfd memory has no legacy IPC handles".into(),
            )),
        }
    }
    fn mapping_addr(mapping: &MemfdRegion) -> u64 {
        mapping.as_ptr() as u64
    }
}

/// What a rank publishes about its regions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcPost {
    /// Its process id (for `pidfd_getfd` and liveness).
    pub pid: u32,
    /// Its [`FdServer`]'s abstract socket name.
    pub socket: String,
    /// Its regions, in registration order.
    pub regions: Vec<IpcRegion>,
}

/// How a peer maps one region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcRegion {
    /// The owner's region id.
    pub id: u32,
    /// Bytes to map.
    pub size: u64,
    /// Descriptor number in the owner's process (file-descriptor handles).
    pub fd: Option<i32>,
    /// Hex of a legacy IPC handle.
    pub legacy: Option<String>,
}

/// This rank's regions and every peer's, mapped; see the module docs.
pub struct NodeRegions<M: SharedMemory> {
    /// This rank's regions, by position in the `regions` argument.
    pub local: Vec<M::Region>,
    /// `peers[p][i]`: region `i` of rank `p`, mapped here; `None` for this
    /// rank (use `local`) and for ranks not in `peers`.
    pub peers: Vec<Option<Vec<M::Mapping>>>,
}

impl<M: SharedMemory> std::fmt::Debug for NodeRegions<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeRegions")
            .field("local", &self.local.len())
            .field(
                "peers",
                &self
                    .peers
                    .iter()
                    .map(|p| p.as_ref().map(Vec::len))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl<M: SharedMemory> NodeRegions<M> {
    /// Address of byte 0 of rank `peer`'s region `index` in this process
    /// (`peer == rank` gives the local region).
    pub fn addr(&self, rank: usize, peer: usize, index: usize) -> Option<u64> {
        if peer == rank {
            return self.local.get(index).map(M::region_addr);
        }
        self.peers
            .get(peer)?
            .as_ref()?
            .get(index)
            .map(M::mapping_addr)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(peer: usize, s: &str) -> Result<[u8; 64]> {
    let bad = |detail: String| Error::malformed(peer, "IPC post", "legacy", detail);
    let digit = |c: u8| char::from(c).to_digit(16);
    let mut out = [0u8; 64];
    if s.len() != 2 * out.len() {
        return Err(bad(format!(
            "handle is {} hex digits, not {}",
            s.len(),
            2 * out.len()
        )));
    }
    for (b, pair) in out.iter_mut().zip(s.as_bytes().chunks_exact(2)) {
        *b = match (digit(pair[0]), digit(pair[1])) {
            (Some(hi), Some(lo)) => (hi << 4 | lo) as u8,
            _ => return Err(bad(format!("handle {s:?} is not hex"))),
        };
    }
    Ok(out)
}

/// How this rank maps one region of a peer: the peer's descriptor number
/// (imported by [`fdshare::import_with`]) or a legacy IPC handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handle {
    /// A descriptor number in the owner's process.
    Fd(i32),
    /// A legacy IPC handle.
    Legacy([u8; 64]),
}

/// Rank `peer`'s post `bytes` (the JSON value of its `ipc/<peer>` key),
/// checked against the regions this rank registered (`regions`, `(id,
/// len)`, the same on every rank): the same ids in the same order, each at
/// least `len` bytes (this rank touches that much of the mapping), each
/// with a descriptor or a legacy handle of 64 bytes. Returns the post and,
/// per region, the bytes to map and how.
///
/// Errors: [`Error::Config`] when the ids differ (the ranks registered
/// different regions); [`Error::Malformed`] naming the peer and the field
/// for a post that does not parse, a region smaller than this rank's, too
/// large to map, or without a usable handle.
pub fn parse_post(
    peer: usize,
    bytes: &[u8],
    regions: &[(u32, usize)],
) -> Result<(IpcPost, Vec<(usize, Handle)>)> {
    const WHAT: &str = "IPC post";
    let theirs: IpcPost = serde_json::from_slice(bytes)
        .map_err(|e| Error::malformed(peer, WHAT, "value", format!("does not parse: {e}")))?;
    let ids: Vec<u32> = theirs.regions.iter().map(|r| r.id).collect();
    let want: Vec<u32> = regions.iter().map(|r| r.0).collect();
    if ids != want {
        return Err(Error::Config(format!(
            "rank {peer} registered regions {ids:?}, this rank {want:?}"
        )));
    }
    let handles = theirs
        .regions
        .iter()
        .zip(regions)
        .map(|(r, &(_, len))| {
            let size = usize::try_from(r.size)
                .ok()
                .filter(|&s| s >= len && s <= isize::MAX as usize)
                .ok_or_else(|| {
                    Error::malformed(
                        peer,
                        WHAT,
                        "size",
                        format!(
                            "of region {} is {} bytes, this rank's needs {len}",
                            r.id, r.size
                        ),
                    )
                })?;
            let handle = match (r.fd, &r.legacy) {
                (Some(fd), _) => Handle::Fd(fd),
                (None, Some(h)) => Handle::Legacy(unhex(peer, h)?),
                (None, None) => {
                    return Err(Error::malformed(
                        peer,
                        WHAT,
                        "fd",
                        format!("region {} has neither a descriptor nor a handle", r.id),
                    ))
                }
            };
            Ok((size, handle))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((theirs, handles))
}

/// Allocates `regions` (`(id, len)`) from `memory`, exchanges them with
/// `peers` (global ranks on this node, this one included) through `store`
/// under `prefix`, and maps every peer's regions, importing descriptors as
/// `policy` says (the transport passes [`SharePolicy::from_env`]).
/// Collective over `peers`; every wait ends at `timeout`.
///
/// Errors: a peer that never publishes is a Store timeout naming its key; a
/// peer that dies is [`Error::PeerDied`]; a peer whose region list differs
/// is [`Error::Config`]; provider failures as the provider reports them.
#[allow(clippy::too_many_arguments)]
pub fn exchange<M: SharedMemory>(
    memory: &M,
    store: &dyn Store,
    prefix: &str,
    job_key: &str,
    rank: usize,
    peers: &[usize],
    regions: &[(u32, usize)],
    policy: SharePolicy,
    timeout: Duration,
) -> Result<NodeRegions<M>> {
    let deadline = Instant::now() + timeout;
    let mut local = Vec::with_capacity(regions.len());
    let mut served = Vec::new();
    let mut posts = Vec::with_capacity(regions.len());
    for &(id, len) in regions {
        let region = memory.alloc(len)?;
        let size = M::size(&region) as u64;
        let post = match memory.export(&region)? {
            Shareable::Fd(fd) => {
                let raw = fd.as_raw_fd();
                served.push((id, fd));
                IpcRegion {
                    id,
                    size,
                    fd: Some(raw),
                    legacy: None,
                }
            }
            Shareable::Legacy(handle) => IpcRegion {
                id,
                size,
                fd: None,
                legacy: Some(hex(&handle)),
            },
        };
        posts.push(post);
        local.push(region);
    }
    let socket = fdshare::socket_name(job_key, rank);
    // Keeps the descriptors open (under the numbers published, for pidfd)
    // and serves them until every peer has mapped them.
    let server = FdServer::start(&socket, served)?;
    let mine = IpcPost {
        pid: std::process::id(),
        socket,
        regions: posts,
    };
    let key = format!("{prefix}/ipc/{rank}");
    let value = serde_json::to_vec(&mine)
        .map_err(|e| Error::protocol(None, format!("encoding {key}: {e}")))?;
    store.set(&key, &value)?;

    let world = peers
        .iter()
        .copied()
        .max()
        .map_or(0, |m| m + 1)
        .max(rank + 1);
    let mut mapped: Vec<Option<Vec<M::Mapping>>> = (0..world).map(|_| None).collect();
    for &peer in peers {
        if peer == rank {
            continue;
        }
        let key = format!("{prefix}/ipc/{peer}");
        let (theirs, handles) = parse_post(peer, &wait_get(store, &key, deadline)?, regions)?;
        let mut maps = Vec::with_capacity(handles.len());
        for (r, (size, handle)) in theirs.regions.iter().zip(handles) {
            let shareable = match handle {
                Handle::Fd(fd) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let (fd, _path) = fdshare::import_with(
                        policy,
                        peer,
                        theirs.pid,
                        fd,
                        &theirs.socket,
                        r.id,
                        left,
                    )?;
                    Shareable::Fd(fd)
                }
                Handle::Legacy(h) => Shareable::Legacy(h),
            };
            maps.push(memory.import(shareable, size)?);
        }
        mapped[peer] = Some(maps);
    }
    // Nobody stops serving until everyone has mapped everything.
    store.set(&format!("{prefix}/ipc-mapped/{rank}"), b"1")?;
    let keys: Vec<String> = peers
        .iter()
        .map(|p| format!("{prefix}/ipc-mapped/{p}"))
        .collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&keys, deadline)?;
    drop(server);
    Ok(NodeRegions {
        local,
        peers: mapped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_handles_round_trip_through_hex() {
        let mut h = [0u8; 64];
        for (i, b) in h.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        assert_eq!(unhex(1, &hex(&h)).ok(), Some(h));
        assert!(unhex(1, "zz").is_err());
        assert!(unhex(1, &"g".repeat(128)).is_err());
        assert!(unhex(1, &format!("+f{}", "0".repeat(126))).is_err());
        // 128 bytes with a two-byte character across a digit pair: slicing
        // the text by bytes panicked.
        let e = unhex(2, &format!("a\u{e9}{}", "0".repeat(125))).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Malformed {
                    peer: 2,
                    field: "legacy",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn a_post_is_checked_against_this_ranks_regions() {
        let post = |regions: &str| {
            format!(r#"{{"pid": 7, "socket": "s", "regions": [{regions}]}}"#).into_bytes()
        };
        let ours = [(1, 4096), (2, 64)];
        let h = "ab".repeat(64);
        let good = post(&format!(
            r#"{{"id": 1, "size": 8192, "fd": 5, "legacy": null}},
               {{"id": 2, "size": 64, "fd": null, "legacy": "{h}"}}"#
        ));
        let (p, handles) = parse_post(3, &good, &ours).unwrap();
        assert_eq!(p.pid, 7);
        assert_eq!(
            handles,
            vec![(8192, Handle::Fd(5)), (64, Handle::Legacy([0xab; 64]))]
        );
        // A region smaller than this rank touches would be mapped short.
        let small = post(r#"{"id": 1, "size": 4095, "fd": 5}, {"id": 2, "size": 64, "fd": 6}"#);
        let e = parse_post(3, &small, &ours).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Malformed {
                    peer: 3,
                    field: "size",
                    ..
                }
            ),
            "{e}"
        );
        let none = post(r#"{"id": 1, "size": 4096}, {"id": 2, "size": 64, "fd": 6}"#);
        let e = parse_post(3, &none, &ours).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Malformed {
                    peer: 3,
                    field: "fd",
                    ..
                }
            ),
            "{e}"
        );
        let e = parse_post(3, b"{", &ours).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Malformed {
                    peer: 3,
                    field: "value",
                    ..
                }
            ),
            "{e}"
        );
        let e = parse_post(3, &post(r#"{"id": 2, "size": 64, "fd": 6}"#), &ours).unwrap_err();
        assert!(
            matches!(e, Error::Config(_)) && e.to_string().contains("rank 3"),
            "{e}"
        );
    }
}
