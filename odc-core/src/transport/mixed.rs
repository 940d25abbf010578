//! `shm+fabric`: one transport per peer, by placement. Peers on this
//! rank's node (and the rank itself) are reached over [`ShmTransport`],
//! peers on other nodes over [`FabricTransport`]; the engine sees one
//! [`Transport`].
//!
//! # Regions
//!
//! Every region is a shared-memory segment (so local peers map it) that is
//! also registered with libfabric (so remote peers read and write it): one
//! piece of memory, two ways in. The returned region's descriptor carries
//! the fabric key (`shm` needs only the id and length); its backing is the
//! fabric registration, whose backing is the `shm` region, so the memory
//! registration closes before the segment is unmapped, and not before the
//! fabric progress thread stopped storing signals into it.
//!
//! # Bells
//!
//! This rank sleeps on its `shm` bell page, because local peers ring it
//! directly (a futex wake on their mapping of it). Signals from remote
//! peers arrive through the fabric progress thread, which rings the fabric
//! transport's bells; those are forwarded to the `shm` bell
//! ([`FabricTransport::forward_bells`]). Either way a sleeper wakes.
//!
//! # Liveness
//!
//! A local peer is judged by `shm` (pid, bell page), a remote one by
//! `fabric` (failed operations, probes, close notices). Blame is recorded
//! in both, so a local peer and a remote peer each learn whom this rank
//! blamed. The endpoint is the fabric one: it carries the pid `shm` needs.

use std::sync::Arc;
use std::time::Duration;

use super::fabric::{FabricConfig, FabricTransport};
use super::shm::ShmTransport;
use super::{run_one, Op, PeerStatus, Transport};
use crate::region::{Bell, Endpoint, LocalRegion, RegionDesc, SignalRef};
use crate::topology::Topology;
use crate::{Error, Result};

/// `shm` to peers on this node, `fabric` to the others. See the module docs.
#[derive(Debug)]
pub struct MixedTransport {
    // Field order: the fabric transport (its progress thread, and with it
    // the bell forwarding that holds a reference to `shm`) goes first.
    fabric: FabricTransport,
    shm: Arc<ShmTransport>,
    topo: Topology,
}

impl MixedTransport {
    /// Creates this rank's transports for job `job_id` under `job_key`
    /// (`shm` segment names) with [`FabricConfig::default`]; `timeout`
    /// bounds every fabric operation.
    pub fn new(
        topo: Topology,
        job_key: &str,
        job_id: &str,
        timeout: Duration,
    ) -> Result<MixedTransport> {
        MixedTransport::with_config(topo, job_key, job_id, timeout, &FabricConfig::default())
    }

    /// As [`MixedTransport::new`] with explicit fabric settings.
    pub fn with_config(
        topo: Topology,
        job_key: &str,
        job_id: &str,
        timeout: Duration,
        config: &FabricConfig,
    ) -> Result<MixedTransport> {
        let (rank, world) = (topo.rank(), topo.world());
        let shm = Arc::new(ShmTransport::new(rank, world, job_key, job_id)?);
        let fabric = FabricTransport::with_config(rank, world, timeout, config)?;
        let bell = Arc::clone(&shm);
        fabric.forward_bells(Arc::new(move |b| bell.ring(b)))?;
        // A killed remote peer is seen at once by the ranks of its node
        // (`shm` liveness), which fail naming it; so may ranks of this node
        // be before this one: their blame words (one load each) end this
        // rank's probe of the peer and its posts to it. So does a node that
        // the elastic rounds dropped, once any rank of this node (this one
        // too) learnt it (`report_dropped`).
        let (node, local) = (topo.node_of(rank) * topo.local_world(), topo.local_world());
        let blames = Arc::clone(&shm);
        fabric.forward_reports(Arc::new(move |peer| {
            let dropped = 1u64.checked_shl((peer / local) as u32).unwrap_or(0);
            (node..node + local).filter(|&q| q != peer).find(|&q| {
                (q != rank && blames.blame_of(q) == Some(peer))
                    || blames.dropped_of(q) & dropped != 0
            })
        }))?;
        Ok(MixedTransport { fabric, shm, topo })
    }

    /// Whether `peer` is reached over `shm` (this rank's node, itself too).
    pub fn is_local(&self, peer: usize) -> bool {
        self.topo.is_local(peer)
    }

    /// The fabric transport (remote peers).
    pub fn fabric(&self) -> &FabricTransport {
        &self.fabric
    }
}

impl Transport for MixedTransport {
    fn name(&self) -> &'static str {
        "shm+fabric"
    }

    fn endpoint(&self) -> Endpoint {
        self.fabric.endpoint()
    }

    fn register(&self, id: u32, len: usize) -> Result<LocalRegion> {
        let shm = self.shm.register(id, len)?;
        let ptr = std::ptr::NonNull::new(shm.as_ptr())
            .ok_or_else(|| Error::transport("register", "null shm mapping"))?;
        let len = shm.len();
        // SAFETY: the shm region is a page-aligned mapping of `len` bytes
        // that stays mapped until the region itself, moved into the
        // backing, is dropped; nothing else unmaps it.
        unsafe { self.fabric.register_foreign(id, ptr, len, Box::new(shm)) }
    }

    fn connect(&self, peer: usize, endpoint: &Endpoint, regions: &[RegionDesc]) -> Result<()> {
        if self.is_local(peer) {
            self.shm.connect(peer, endpoint, regions)
        } else {
            self.fabric.connect(peer, endpoint, regions)
        }
    }

    fn put_signals(
        &self,
        targets: &[(usize, RegionDesc)],
        signal: SignalRef,
        value: u64,
    ) -> Result<()> {
        // The remote ones overlap (each a round trip); the local ones are
        // stores into mapped memory.
        let remote = self.fabric.put_signals_to(
            targets.iter().filter(|(p, _)| !self.is_local(*p)),
            signal,
            value,
        );
        let local = targets
            .iter()
            .filter(|(p, _)| self.is_local(*p))
            .try_for_each(|(p, desc)| self.shm.put_signal(*p, desc, 0, &[], signal, value));
        local.and(remote)
    }

    unsafe fn run_batch(&self, ops: &mut dyn Iterator<Item = Op>) -> Result<()> {
        // The local ones are copies, made while the remote ones are in
        // flight.
        let shm = &*self.shm;
        let topo = self.topo;
        let mut local = |op: Op| {
            // SAFETY: the caller's contract, passed on.
            topo.is_local(op.peer())
                .then(|| unsafe { run_one(shm, op) })
        };
        // SAFETY: the caller's contract, passed on.
        unsafe { self.fabric.run_ops(ops, &mut local) }
    }

    fn prefault(
        &self,
        peer: usize,
        remote: &RegionDesc,
        range: std::ops::Range<usize>,
        write: bool,
    ) -> Result<()> {
        if self.is_local(peer) {
            self.shm.prefault(peer, remote, range, write)
        } else {
            Ok(())
        }
    }

    fn mapped(&self, peer: usize, remote: &RegionDesc) -> Option<std::ptr::NonNull<u8>> {
        if self.is_local(peer) {
            self.shm.mapped(peer, remote)
        } else {
            None
        }
    }

    fn get(&self, peer: usize, remote: &RegionDesc, offset: usize, dst: &mut [u8]) -> Result<()> {
        if self.is_local(peer) {
            self.shm.get(peer, remote, offset, dst)
        } else {
            self.fabric.get(peer, remote, offset, dst)
        }
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
        if self.is_local(peer) {
            self.shm
                .put_signal(peer, remote, offset, src, signal, value)
        } else {
            self.fabric
                .put_signal(peer, remote, offset, src, signal, value)
        }
    }

    fn bell_epoch(&self, bell: Bell) -> u32 {
        self.shm.bell_epoch(bell)
    }

    fn bell_wait(&self, bell: Bell, epoch: u32, timeout: Duration) -> Result<()> {
        // The fabric progress thread runs on its own; this only sleeps.
        self.shm.bell_wait(bell, epoch, timeout)
    }

    fn ring(&self, bell: Bell) {
        self.shm.ring(bell);
    }

    fn peer_status(&self, peer: usize) -> PeerStatus {
        if self.is_local(peer) {
            self.shm.peer_status(peer)
        } else {
            self.fabric.peer_status(peer)
        }
    }

    fn set_blame(&self, peer: usize) {
        self.shm.set_blame(peer);
        self.fabric.set_blame(peer);
    }

    fn retire(&self) {
        self.shm.retire();
        self.fabric.retire();
    }

    fn failure(&self) -> Option<Error> {
        self.fabric.failure()
    }

    fn report_dropped(&self, nodes: u64) {
        // Node-mates read it through the reports the fabric side consults.
        self.shm.report_dropped(nodes);
    }

    fn wake_node_on(&self, region: &LocalRegion, words: std::ops::Range<usize>) -> bool {
        let (rank, local) = (self.topo.rank(), self.topo.local_world());
        let first = self.topo.node_of(rank) * local;
        let shm = Arc::clone(&self.shm);
        let ring = Arc::new(move || {
            for q in (first..first + local).filter(|&q| q != rank) {
                shm.ring_peer(q, Bell::Client);
            }
        });
        self.fabric
            .ring_node_on(region.desc().id, words, ring)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Instant;

    use super::*;
    use crate::sync::Ordering;

    /// Four ranks in this process, two per "node".
    fn job(key: &str, len: usize) -> Option<(Vec<MixedTransport>, Vec<LocalRegion>)> {
        if !super::super::fabric::is_present() {
            eprintln!("skipped: libfabric.so.1 cannot be loaded here");
            return None;
        }
        let timeout = Duration::from_secs(20);
        let ts: Vec<MixedTransport> = (0..4)
            .map(|r| {
                let topo = Topology::new(r, 4, 2).unwrap();
                MixedTransport::new(topo, key, "j", timeout).unwrap()
            })
            .collect();
        let regions: Vec<LocalRegion> = ts.iter().map(|t| t.register(0, len).unwrap()).collect();
        for t in &ts {
            for (peer, other) in ts.iter().enumerate() {
                t.connect(peer, &other.endpoint(), &[regions[peer].desc()])
                    .unwrap();
            }
        }
        Some((ts, regions))
    }

    fn key(name: &str) -> String {
        format!("mx{}_{name}", std::process::id())
    }

    #[test]
    fn local_and_remote_peers_reach_the_same_memory() {
        let Some((ts, regions)) = job(&key("mem"), 1 << 16) else {
            return;
        };
        assert_eq!(ts[0].name(), "shm+fabric");
        assert!(ts[0].is_local(1) && !ts[0].is_local(2) && ts[0].is_local(0));
        for i in 0..4096 {
            // SAFETY: own region, in range, no peer writes it in this test.
            unsafe { *regions[1].as_ptr().add(i) = (i % 251) as u8 };
        }
        // Rank 1's memory, read by a local peer (shm) and a remote one
        // (fabric).
        for reader in [0, 2, 3] {
            let mut dst = vec![0u8; 4096];
            ts[reader].get(1, &regions[1].desc(), 0, &mut dst).unwrap();
            assert!(
                dst.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8),
                "rank {reader}"
            );
        }
    }

    #[test]
    fn remote_and_local_signals_wake_the_shm_bell() {
        let Some((ts, regions)) = job(&key("bell"), 1 << 16) else {
            return;
        };
        let desc = regions[0].desc();
        // A put with data counts: each word goes from 0 to 1.
        for (writer, value) in [(1usize, 1u64), (2, 1), (3, 1)] {
            let at = 1024 * writer;
            let sig = SignalRef {
                offset: 16 * writer,
                bell: Bell::Server,
            };
            let epoch = ts[0].bell_epoch(Bell::Server);
            let data = vec![writer as u8; 512];
            ts[writer]
                .put_signal(0, &desc, at, &[&data], sig, value)
                .unwrap();
            let word = regions[0].signal(16 * writer).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while word.load(Ordering::Acquire) != value {
                assert!(Instant::now() < deadline, "signal from rank {writer} lost");
                std::thread::sleep(Duration::from_millis(1));
            }
            // The shm bell moved past `epoch` (a forwarded ring, for the
            // remote writers): the wait returns at once instead of sleeping.
            let t0 = Instant::now();
            ts[0]
                .bell_wait(Bell::Server, epoch, Duration::from_secs(3))
                .unwrap();
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "rank {writer}'s signal did not ring the shm bell"
            );
            // SAFETY: in range; the signal (acquire) ordered the data.
            let got = unsafe { std::slice::from_raw_parts(regions[0].as_ptr().add(at), 512) };
            assert!(got.iter().all(|&b| b == writer as u8), "rank {writer}");
        }
    }

    #[test]
    fn a_remote_peer_that_a_failed_rank_blames_is_reported_without_a_probe() {
        let name = key("report");
        let Some((mut ts, regions)) = job(&name, 4096) else {
            return;
        };
        assert_eq!(ts[0].peer_status(2), PeerStatus::Alive);
        // Rank 1 (rank 0's node) failed because of rank 2 (the other node):
        // rank 0 reads it from rank 1's blame word, although rank 2 still
        // runs and answers probes.
        ts[1].set_blame(2);
        assert_eq!(ts[0].peer_status(2), PeerStatus::Reported { by: 1 });
        assert_eq!(ts[0].peer_status(3), PeerStatus::Alive);
        // A local peer is judged by shm alone.
        ts[1].set_blame(0);
        assert_eq!(ts[1].peer_status(0), PeerStatus::Alive);
        // Rank 3 (rank 2's node) failed because of rank 2 and closed: its
        // close notice tells rank 1, whose own node reports nothing of 2.
        ts[3].set_blame(2);
        drop(ts.remove(3));
        let deadline = Instant::now() + Duration::from_secs(10);
        while ts[1].peer_status(2) != (PeerStatus::Reported { by: 3 }) {
            assert!(
                Instant::now() < deadline,
                "rank 1 never read rank 3's notice"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(ts);
        drop(regions);
    }

    #[test]
    fn a_dropped_node_is_reported_to_every_rank_of_a_node_that_learnt_it() {
        let name = key("dropped");
        let Some((ts, regions)) = job(&name, 4096) else {
            return;
        };
        assert_eq!(ts[0].peer_status(3), PeerStatus::Alive);
        // Rank 1 learnt that the elastic rounds dropped node 1 (ranks 2
        // and 3): rank 0's waits on them give up without a probe, and so do
        // rank 1's own.
        ts[1].report_dropped(1 << 1);
        assert_eq!(ts[0].peer_status(3), PeerStatus::Reported { by: 1 });
        assert_eq!(ts[0].peer_status(2), PeerStatus::Reported { by: 1 });
        assert_eq!(ts[1].peer_status(2), PeerStatus::Reported { by: 1 });
        // Node 0 is not dropped in node 1's eyes, nor its own ranks.
        assert_eq!(ts[2].peer_status(0), PeerStatus::Alive);
        assert_eq!(ts[0].peer_status(1), PeerStatus::Alive);
        drop(ts);
        drop(regions);
    }

    #[test]
    fn blame_and_closing_reach_local_and_remote_peers() {
        let name = key("close");
        let Some((mut ts, regions)) = job(&name, 4096) else {
            return;
        };
        assert_eq!(ts[0].peer_status(1), PeerStatus::Alive);
        assert_eq!(ts[0].peer_status(2), PeerStatus::Alive);
        // Rank 1 blames rank 3 and closes; its regions outlive it.
        ts[1].set_blame(3);
        let closed = ts.remove(1);
        drop(closed);
        // SAFETY: rank 1's own region, still mapped by its backing.
        unsafe { *regions[1].as_ptr() = 7 };
        let dead = PeerStatus::Dead {
            pid: std::process::id(),
            blamed: Some(3),
        };
        // Rank 0 (its node) sees it over shm; rank 2 (former rank 3's
        // neighbour) through the fabric close notice.
        assert_eq!(ts[0].peer_status(1), dead);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match ts[1].peer_status(1) {
                PeerStatus::Dead { blamed, .. } => {
                    assert_eq!(blamed, Some(3));
                    break;
                }
                PeerStatus::Alive => {
                    assert!(Instant::now() < deadline, "rank 2 never saw rank 1 close");
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => panic!("rank 2 sees rank 1 as {other:?}"),
            }
        }
        drop(ts);
        drop(regions);
        assert!(
            std::fs::read_dir("/dev/shm")
                .unwrap()
                .flatten()
                .all(|e| !e.file_name().to_string_lossy().contains(&name)),
            "segments left behind"
        );
    }
}
