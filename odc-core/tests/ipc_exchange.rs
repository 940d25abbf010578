//! `gpu::ipc::exchange` with host `memfd` memory standing in for device
//! memory: the same allocation, descriptor serving, Store publication,
//! import and final barrier the `cuda-ipc` transport runs, between ranks
//! that are threads of this process (descriptor passing across processes is
//! covered by `fdshare`'s tests). Each rank fills its regions before the
//! exchange; afterwards every rank reads every peer's regions through its
//! mappings, and a write through a mapping shows in the owner's region.

use std::sync::Arc;
use std::time::{Duration, Instant};

use odc_core::gpu::fdshare::SharePolicy;
use odc_core::gpu::ipc::{exchange, MemfdMemory, SharedMemory};
use odc_core::{Error, FileStore, Store};

const REGIONS: &[(u32, usize)] = &[(1, 4096 + 17), (2, 1 << 20), (7, 1)];

fn pattern(rank: usize, id: u32, i: usize) -> u8 {
    (rank as u8).wrapping_mul(31) ^ (id as u8).wrapping_mul(7) ^ (i as u8)
}

fn job(tag: &str) -> String {
    format!("ipc-test-{tag}-{}", std::process::id())
}

#[test]
fn every_rank_maps_every_peers_regions() {
    // Both import paths: pidfd (this process is its own peer) and socket.
    for policy in ["pidfd", "socket"] {
        let share = SharePolicy::parse(policy).expect("policy");
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn Store> = Arc::new(FileStore::new(dir.path()).expect("store"));
        let world = 3;
        let peers: Vec<usize> = (0..world).collect();
        let key = job(policy);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (store, peers, key) = (Arc::clone(&store), peers.clone(), key.clone());
                std::thread::spawn(move || {
                    let mem = MemfdMemory;
                    // Regions are filled after the exchange by their owner;
                    // a barrier through the store orders fill and read.
                    let regions = exchange(
                        &mem,
                        store.as_ref(),
                        "t",
                        &key,
                        rank,
                        &peers,
                        REGIONS,
                        share,
                        Duration::from_secs(20),
                    )
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    for (r, &(id, len)) in regions.local.iter().zip(REGIONS) {
                        assert!(r.len() >= len);
                        // SAFETY: the region maps `len` bytes.
                        let bytes = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), len) };
                        assert!(bytes.iter().all(|&b| b == 0), "new region not zeroed");
                        for (i, b) in bytes.iter_mut().enumerate() {
                            *b = pattern(rank, id, i);
                        }
                    }
                    store.set(&format!("t/filled/{rank}"), b"1").expect("set");
                    let keys: Vec<String> = peers.iter().map(|p| format!("t/filled/{p}")).collect();
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    store
                        .wait(&keys, Instant::now() + Duration::from_secs(20))
                        .expect("filled");
                    for &peer in &peers {
                        for (i, &(id, len)) in REGIONS.iter().enumerate() {
                            let addr = regions.addr(rank, peer, i).expect("mapped");
                            // SAFETY: a mapping of at least `len` bytes.
                            let bytes =
                                unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                            let bad = bytes
                                .iter()
                                .enumerate()
                                .position(|(j, &b)| b != pattern(peer, id, j));
                            assert_eq!(bad, None, "rank {rank} reading rank {peer} region {id}");
                        }
                    }
                    // Everyone has read before anyone writes.
                    store.set(&format!("t/read/{rank}"), b"1").expect("set");
                    let keys: Vec<String> = peers.iter().map(|p| format!("t/read/{p}")).collect();
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    store
                        .wait(&keys, Instant::now() + Duration::from_secs(20))
                        .expect("read");
                    // Write into the next rank's last region; it checks.
                    let next = (rank + 1) % peers.len();
                    let addr = regions.addr(rank, next, 2).expect("mapped");
                    // SAFETY: one mapped byte, written by this rank only.
                    unsafe { *(addr as *mut u8) = 0xA0 + rank as u8 };
                    store.set(&format!("t/wrote/{rank}"), b"1").expect("set");
                    let prev = (rank + peers.len() - 1) % peers.len();
                    store
                        .wait(
                            &[format!("t/wrote/{prev}").as_str()],
                            Instant::now() + Duration::from_secs(20),
                        )
                        .expect("wrote");
                    // SAFETY: the region maps at least one byte.
                    let got = unsafe { *regions.local[2].as_ptr() };
                    assert_eq!(
                        got,
                        0xA0 + prev as u8,
                        "rank {rank}: write through a mapping lost"
                    );
                    store.set(&format!("t/done/{rank}"), b"1").expect("set");
                    let keys: Vec<String> = peers.iter().map(|p| format!("t/done/{p}")).collect();
                    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                    store
                        .wait(&keys, Instant::now() + Duration::from_secs(20))
                        .expect("done");
                    regions
                        .local
                        .iter()
                        .map(<MemfdMemory as SharedMemory>::size)
                        .sum::<usize>()
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().expect("rank thread") >= REGIONS.iter().map(|r| r.1).sum::<usize>());
        }
    }
}

#[test]
fn a_peer_that_never_publishes_fails_within_the_deadline() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = FileStore::new(dir.path()).expect("store");
    let t = Instant::now();
    let err = exchange(
        &MemfdMemory,
        &store,
        "t",
        &job("absent"),
        0,
        &[0, 1],
        REGIONS,
        SharePolicy::Auto,
        Duration::from_millis(500),
    )
    .expect_err("rank 1 never comes");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    let msg = err.to_string();
    assert!(matches!(err, Error::Store { .. }), "{msg}");
    assert!(msg.contains("ipc/1"), "{msg}");
}

#[test]
fn a_peer_with_other_regions_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn Store> = Arc::new(FileStore::new(dir.path()).expect("store"));
    let key = job("mismatch");
    let other = {
        let (store, key) = (Arc::clone(&store), key.clone());
        std::thread::spawn(move || {
            exchange(
                &MemfdMemory,
                store.as_ref(),
                "t",
                &key,
                1,
                &[0, 1],
                &[(1, 64)],
                SharePolicy::Auto,
                Duration::from_secs(2),
            )
            .map(|_| ())
        })
    };
    let err = exchange(
        &MemfdMemory,
        store.as_ref(),
        "t",
        &key,
        0,
        &[0, 1],
        REGIONS,
        SharePolicy::Auto,
        Duration::from_secs(2),
    )
    .expect_err("region lists differ");
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(err.to_string().contains("rank 1"), "{err}");
    // Rank 1 fails too (on rank 0's list, or waiting for rank 0's barrier).
    assert!(other.join().expect("thread").is_err());
}
