//! The fabric transport alone over loopback: two transports in one process
//! (each with its own endpoint and progress thread), as two ranks.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::sync::AtomicU64 as SyncU64;

/// Skips (with a message) where libfabric cannot be loaded.
macro_rules! need_libfabric {
    () => {
        if !is_present() {
            eprintln!("skipped: libfabric.so.1 cannot be loaded here");
            return;
        }
    };
}

fn pair(len: usize) -> (Vec<FabricTransport>, Vec<LocalRegion>) {
    let ts: Vec<FabricTransport> = (0..2)
        .map(|r| FabricTransport::new(r, 2, Duration::from_secs(20)).unwrap())
        .collect();
    let regions: Vec<LocalRegion> = ts.iter().map(|t| t.register(0, len).unwrap()).collect();
    for (me, t) in ts.iter().enumerate() {
        for (peer, other) in ts.iter().enumerate() {
            let _ = me;
            t.connect(peer, &other.endpoint(), &[regions[peer].desc()])
                .unwrap();
        }
    }
    (ts, regions)
}

#[test]
fn signal_encoding_round_trips_and_refuses_overflow() {
    let d = encode_signal(3, 8 * 12345, Bell::Server, (1 << 36) - 1).unwrap();
    assert_eq!(
        decode_signal(d),
        (3, 8 * 12345, Bell::Server, (1 << 36) - 1)
    );
    let d = encode_signal(0, 0, Bell::Client, 7).unwrap();
    assert_eq!(decode_signal(d), (0, 0, Bell::Client, 7));
    assert!(encode_signal(0, 0, Bell::Client, 1 << 36).is_err());
    assert!(encode_signal(0, 128 << 20, Bell::Client, 1).is_err());
    assert!(encode_signal(0, 12, Bell::Client, 1).is_err());
}

#[test]
fn get_reads_the_peer_region() {
    need_libfabric!();
    let (ts, regions) = pair(3 << 20);
    let n = regions[1].len();
    for i in 0..n {
        // SAFETY: own region, in range, nobody else writes it in this test.
        unsafe { *regions[1].as_ptr().add(i) = (i * 7 % 251) as u8 };
    }
    let mut dst = vec![0u8; n - 100];
    ts[0].get(1, &regions[1].desc(), 100, &mut dst).unwrap();
    assert!(dst
        .iter()
        .enumerate()
        .all(|(i, &b)| b == ((i + 100) * 7 % 251) as u8));
}

#[test]
fn out_of_range_is_refused_before_posting() {
    need_libfabric!();
    let (ts, regions) = pair(4096);
    let desc = regions[1].desc();
    let mut dst = vec![0u8; 64];
    let e = ts[0]
        .get(1, &desc, desc.len as usize - 8, &mut dst)
        .unwrap_err();
    assert!(e.to_string().contains("exceed"), "{e}");
    let sig = SignalRef {
        offset: 0,
        bell: Bell::Client,
    };
    assert!(ts[0]
        .put_signal(1, &desc, 4090, &[&[1u8; 16]], sig, 1)
        .is_err());
    let far = SignalRef {
        offset: 4096,
        bell: Bell::Client,
    };
    assert!(ts[0].put_signal(1, &desc, 0, &[], far, 1).is_err());
    // The connection still works (nothing was posted).
    ts[0].get(1, &desc, 0, &mut dst).unwrap();
    assert_eq!(ts[0].peer_status(1), PeerStatus::Alive);
}

#[test]
fn data_is_visible_when_the_signal_is() {
    need_libfabric!();
    let (ts, regions) = pair(1 << 20);
    let desc = regions[1].desc();
    let rounds = 200u64;
    let chunk = 64 << 10;
    let reader = {
        let sig: &SyncU64 = regions[1].signal(0).unwrap();
        let sig = sig as *const SyncU64 as usize;
        let base = regions[1].as_ptr() as usize;
        let t1 = &ts[1];
        let ack = std::sync::atomic::AtomicU64::new(0);
        let ack = &ack;
        std::thread::scope(|s| {
            let h = s.spawn(move || {
                // SAFETY: the signal word lives as long as `regions`.
                let word = unsafe { &*(sig as *const SyncU64) };
                let mut seen = 0;
                let deadline = Instant::now() + Duration::from_secs(30);
                while seen < rounds {
                    let epoch = t1.bell_epoch(Bell::Server);
                    let v = word.load(Ordering::Acquire);
                    if v > seen {
                        // Every byte of the chunk carries the round that
                        // wrote it: data of round v must be complete.
                        let data = (base + 64) as *const u8;
                        // SAFETY: in range; the writer waits for our ack.
                        let bytes = unsafe { std::slice::from_raw_parts(data, chunk) };
                        assert!(
                            bytes.iter().all(|&b| b == v as u8),
                            "torn data at round {v}"
                        );
                        seen = v;
                        ack.store(v, Ordering::Release);
                        continue;
                    }
                    assert!(Instant::now() < deadline, "stuck at round {seen}");
                    t1.bell_wait(Bell::Server, epoch, Duration::from_millis(50))
                        .unwrap();
                }
                seen
            });
            for round in 1..=rounds {
                let data = vec![round as u8; chunk];
                let s = SignalRef {
                    offset: 0,
                    bell: Bell::Server,
                };
                ts[0]
                    .put_signal(1, &desc, 64, &[&data[..16], &data[16..]], s, round)
                    .unwrap();
                // Wait until the reader checked it.
                let until = Instant::now() + Duration::from_secs(10);
                while ack.load(Ordering::Acquire) < round {
                    assert!(Instant::now() < until);
                    std::thread::yield_now();
                }
            }
            h.join().unwrap()
        })
    };
    assert_eq!(reader, rounds);
}

#[test]
fn many_signals_from_many_threads() {
    need_libfabric!();
    let (ts, regions) = pair(8192);
    let ts = Arc::new(ts);
    let desc = regions[1].desc();
    let per = 300u64;
    std::thread::scope(|s| {
        for w in 0..4usize {
            let ts = Arc::clone(&ts);
            s.spawn(move || {
                for v in 1..=per {
                    let sig = SignalRef {
                        offset: 64 * (w + 1),
                        bell: Bell::Client,
                    };
                    ts[0].put_signal(1, &desc, 0, &[], sig, v).unwrap();
                }
            });
        }
    });
    for w in 0..4usize {
        let word = regions[1].signal(64 * (w + 1)).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while word.load(Ordering::Acquire) != per {
            assert!(
                Instant::now() < until,
                "signal {w} stuck at {}",
                word.load(Ordering::Acquire)
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Signals to self never touch the fabric but behave the same.
    let own = regions[0].desc();
    let sig = SignalRef {
        offset: 8,
        bell: Bell::Client,
    };
    ts[0].put_signal(0, &own, 16, &[&[9u8; 8]], sig, 5).unwrap();
    assert_eq!(regions[0].signal(8).unwrap().load(Ordering::Acquire), 5);
}

#[test]
fn a_closed_peer_is_reported_dead() {
    need_libfabric!();
    let (mut ts, regions) = pair(4096);
    let t1 = ts.pop().unwrap();
    assert_eq!(ts[0].peer_status(1), PeerStatus::Alive);
    t1.set_blame(0);
    drop(t1);
    std::thread::sleep(PROBE_PERIOD + Duration::from_millis(50));
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if let PeerStatus::Dead { pid, .. } = ts[0].peer_status(1) {
            assert_eq!(pid, 0);
            break;
        }
        assert!(Instant::now() < until, "peer never reported dead");
        std::thread::sleep(PROBE_PERIOD);
    }
    drop(regions);
}

#[test]
fn large_writes_both_ways() {
    need_libfabric!();
    let (ts, regions) = pair(5 << 20);
    let big = vec![3u8; 2 << 20];
    std::thread::scope(|s| {
        for me in 0..2usize {
            let (ts, regions, big) = (&ts, &regions, &big);
            s.spawn(move || {
                let peer = 1 - me;
                for v in 1..=20u64 {
                    let sig = SignalRef {
                        offset: 0,
                        bell: Bell::Server,
                    };
                    ts[me]
                        .put_signal(
                            peer,
                            &regions[peer].desc(),
                            4096,
                            &[&big[..64], &big[64..]],
                            sig,
                            v,
                        )
                        .unwrap();
                }
            });
        }
    });
}

#[test]
fn concurrent_gets_share_one_read_credit() {
    need_libfabric!();
    let config = FabricConfig {
        read_credits: 1,
        ..FabricConfig::default()
    };
    let ts: Vec<FabricTransport> = (0..2)
        .map(|r| FabricTransport::with_config(r, 2, Duration::from_secs(20), &config).unwrap())
        .collect();
    let regions: Vec<LocalRegion> = ts.iter().map(|t| t.register(1, 1 << 20).unwrap()).collect();
    for t in &ts {
        for (peer, other) in ts.iter().enumerate() {
            t.connect(peer, &other.endpoint(), &[regions[peer].desc()])
                .unwrap();
        }
    }
    // SAFETY: own region, in range, written before any reader starts.
    unsafe { std::ptr::write_bytes(regions[1].as_ptr(), 0x5a, regions[1].len()) };
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (t, desc) = (&ts[0], regions[1].desc());
            s.spawn(move || {
                for _ in 0..20 {
                    let mut dst = vec![0u8; 256 << 10];
                    t.get(1, &desc, 4096, &mut dst).unwrap();
                    assert!(dst.iter().all(|&b| b == 0x5a));
                }
            });
        }
    });
    assert_eq!(ts[0].core.credits.load(Ordering::Acquire), 1);
}
