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
    job(2, len)
}

/// `world` transports of one job, every one connected to every other
/// through one region of `len` bytes each.
fn job(world: usize, len: usize) -> (Vec<FabricTransport>, Vec<LocalRegion>) {
    let ts: Vec<FabricTransport> = (0..world)
        .map(|r| FabricTransport::new(r, world, Duration::from_secs(20)).unwrap())
        .collect();
    let regions: Vec<LocalRegion> = ts.iter().map(|t| t.register(0, len).unwrap()).collect();
    for t in &ts {
        for (peer, other) in ts.iter().enumerate() {
            t.connect(peer, &other.endpoint(), &[regions[peer].desc()])
                .unwrap();
        }
    }
    (ts, regions)
}

#[test]
fn immediates_fit_four_bytes_and_round_trip() {
    for imm in [
        Imm {
            region: 3,
            offset: 8 * 12345,
            bell: Bell::Server,
            update: Update::Count,
        },
        Imm {
            region: STATUS_ID,
            offset: (8 << WORD_BITS) - 8,
            bell: Bell::Client,
            update: Update::Raise,
        },
        Imm {
            region: 0,
            offset: 0,
            bell: Bell::Client,
            update: Update::Raise,
        },
    ] {
        let data = imm.encode().unwrap();
        assert_eq!(Imm::decode(u64::from(data)), imm);
        // Bits a provider with 8-byte CQ data may set above the 32 are
        // ignored.
        assert_eq!(Imm::decode(u64::from(data) | 0xdead_beef << 32), imm);
    }
    let at = |offset, region| {
        Imm {
            region,
            offset,
            bell: Bell::Client,
            update: Update::Raise,
        }
        .encode()
    };
    assert!(at(8 << WORD_BITS, 0).is_err());
    assert!(at(12, 0).is_err());
    assert!(at(0, STATUS_ID + 1).is_err());
}

#[test]
fn an_immediate_names_only_words_inside_its_region() {
    let imm = |offset, update| Imm {
        region: 0,
        offset,
        bell: Bell::Server,
        update,
    };
    assert_eq!(imm(0, Update::Count).words(8), Some((0, None)));
    assert_eq!(imm(0, Update::Raise).words(16), Some((0, Some(8))));
    // A raise needs its mailbox inside the region too.
    assert_eq!(imm(8, Update::Raise).words(16), None);
    assert_eq!(imm(8, Update::Count).words(16), Some((8, None)));
    assert_eq!(imm(1 << 29, Update::Count).words(4096), None);
}

#[test]
fn a_peer_address_must_be_hex_of_the_providers_length() {
    assert_eq!(peer_address(1, "00ff", 2).unwrap(), vec![0, 255]);
    assert_eq!(peer_address(1, "ABcd", 2).unwrap(), vec![0xab, 0xcd]);
    // A short (or empty) address made fi_av_insert read past the buffer.
    for (hex, len) in [
        ("", 16),
        ("00", 16),
        ("00ff00", 2),
        ("+f", 1),
        ("0g", 1),
        ("\u{e9}0", 1),
    ] {
        match peer_address(3, hex, len) {
            Err(
                e @ Error::Malformed {
                    peer: 3,
                    field: "address",
                    ..
                },
            ) => {
                assert!(e.to_string().contains("rank 3"), "{e}")
            }
            other => panic!("{hex:?}: {other:?}"),
        }
    }
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
    data_visible(None);
}

#[test]
fn data_is_visible_when_the_signal_is_with_shuffled_completions() {
    need_libfabric!();
    data_visible(Some(11));
}

fn data_visible(seed: Option<u64>) {
    let (ts, regions) = match seed {
        Some(seed) => shuffled_pair(1 << 20, seed),
        None => pair(1 << 20),
    };
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
    ts[0].put_signal(0, &own, 32, &[&[9u8; 8]], sig, 1).unwrap();
    assert_eq!(regions[0].signal(8).unwrap().load(Ordering::Acquire), 1);
    ts[0].put_signal(0, &own, 0, &[], sig, 9).unwrap();
    ts[0].put_signal(0, &own, 0, &[], sig, 4).unwrap();
    assert_eq!(regions[0].signal(8).unwrap().load(Ordering::Acquire), 9);
}

/// Waits until `word` reads `want` (10 s at most).
fn wait_for(word: &SyncU64, want: u64, what: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while word.load(Ordering::Acquire) != want {
        assert!(
            Instant::now() < until,
            "{what}: stuck at {} (want {want})",
            word.load(Ordering::Acquire)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn pure_signals_raise_and_never_lower_the_word() {
    need_libfabric!();
    let (ts, regions) = pair(4096);
    let desc = regions[1].desc();
    let sig = SignalRef {
        offset: 64,
        bell: Bell::Client,
    };
    ts[0].put_signal(1, &desc, 0, &[], sig, 7).unwrap();
    wait_for(regions[1].signal(64).unwrap(), 7, "first raise");
    // The value travelled in the mailbox, the 8 bytes after the word.
    let mailbox = regions[1].signal(64 + MAILBOX).unwrap();
    assert_eq!(u64::from_le(mailbox.load(Ordering::Acquire)), 7);
    ts[0].put_signal(1, &desc, 0, &[], sig, 3).unwrap();
    // A lower value arrived (the mailbox holds it) and left the word alone.
    let until = Instant::now() + Duration::from_secs(10);
    while u64::from_le(mailbox.load(Ordering::Acquire)) != 3 {
        assert!(Instant::now() < until, "second write never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(regions[1].signal(64).unwrap().load(Ordering::Acquire), 7);
    // Values past 32 bits travel whole: nothing is a 4-byte field.
    ts[0].put_signal(1, &desc, 0, &[], sig, 1 << 40).unwrap();
    wait_for(regions[1].signal(64).unwrap(), 1 << 40, "a 41-bit value");
}

#[test]
fn region_keys_are_random_per_transport() {
    need_libfabric!();
    let (ts, regions) = pair(4096);
    let keys: Vec<u64> = regions.iter().map(|r| r.desc().key).collect();
    // Same region id on both ranks, yet unrelated keys; never `id + 1`.
    assert_ne!(keys[0], keys[1]);
    assert!(keys.iter().all(|&k| k > 1 << 16), "{keys:?}");
    // A guessed key is refused by the owner: the read fails (and the
    // transport counts the peer dead, as for any failed operation).
    let mut forged = regions[1].desc();
    forged.key = 1;
    let mut table = ts[0].core.peer(1).unwrap().regions.clone();
    if let Some(r) = table[0].as_mut() {
        r.key = forged.key;
    }
    let p = ts[0].core.peer(1).unwrap();
    let r = table[0].unwrap();
    let mut dst = [0u8; 8];
    let got = ts[0].core.read(
        1,
        p,
        &r,
        0,
        &mut dst,
        Instant::now() + Duration::from_secs(5),
    );
    assert!(got.is_err(), "a read with a guessed key succeeded");
}

/// Two transports whose progress threads shuffle completions (seeded).
fn shuffled_pair(len: usize, seed: u64) -> (Vec<FabricTransport>, Vec<LocalRegion>) {
    let config = FabricConfig {
        reorder: Some(seed),
        ..FabricConfig::default()
    };
    let ts: Vec<FabricTransport> = (0..2)
        .map(|r| FabricTransport::with_config(r, 2, Duration::from_secs(20), &config).unwrap())
        .collect();
    let regions: Vec<LocalRegion> = ts.iter().map(|t| t.register(0, len).unwrap()).collect();
    for t in &ts {
        for (peer, other) in ts.iter().enumerate() {
            t.connect(peer, &other.endpoint(), &[regions[peer].desc()])
                .unwrap();
        }
    }
    (ts, regions)
}

#[test]
fn shuffled_completions_keep_counts_and_maxima() {
    need_libfabric!();
    let (ts, regions) = shuffled_pair(1 << 16, 7);
    let desc = regions[1].desc();
    let per = 60u64;
    std::thread::scope(|s| {
        for w in 0..4usize {
            let (ts, desc) = (&ts, &desc);
            s.spawn(move || {
                let data = vec![w as u8; 1000];
                for v in 1..=per {
                    // A count (data) and a raise (pure) per round, to
                    // separate words.
                    let count = SignalRef {
                        offset: 64 * (2 * w + 1),
                        bell: Bell::Server,
                    };
                    let raise = SignalRef {
                        offset: 64 * (2 * w + 2),
                        bell: Bell::Client,
                    };
                    ts[0]
                        .put_signal(1, desc, 4096 + 1024 * w, &[&data], count, v)
                        .unwrap();
                    ts[0].put_signal(1, desc, 0, &[], raise, v).unwrap();
                }
            });
        }
    });
    for w in 0..4usize {
        wait_for(regions[1].signal(64 * (2 * w + 1)).unwrap(), per, "count");
        wait_for(regions[1].signal(64 * (2 * w + 2)).unwrap(), per, "raise");
    }
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
fn a_report_cuts_a_hanging_probe_short() {
    need_libfabric!();
    let (mut ts, regions) = pair(4096);
    assert_eq!(ts[0].peer_status(1), PeerStatus::Alive);
    // Rank 1 stops answering: its progress thread ends, so a read of its
    // status hangs as one of a killed process does over tcp.
    ts[1].core.stop.store(true, Ordering::Release);
    ts[1].core.cq.signal().unwrap();
    ts[1].progress.take().unwrap().join().unwrap();
    std::thread::sleep(PROBE_PERIOD + Duration::from_millis(50));
    // 200 ms into the probe, word arrives that rank 1 is gone (this test's
    // stand-in for a node-mate's report, which a mixed transport forwards).
    let reported = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&reported);
    ts[0]
        .forward_reports(Arc::new(move |peer| {
            (peer == 1 && flag.load(Ordering::Acquire)).then_some(0)
        }))
        .unwrap();
    let t0 = Instant::now();
    let status = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            reported.store(true, Ordering::Release);
        });
        ts[0].peer_status(1)
    });
    let took = t0.elapsed();
    assert_eq!(status, PeerStatus::Reported { by: 0 });
    assert!(
        took < PROBE_TIMEOUT / 2,
        "the probe ran {took:?}: the report did not cut it short"
    );
    // The abandoned probe is not retried, and the peer is not marked dead
    // by it: the report stands.
    assert_eq!(ts[0].peer_status(1), PeerStatus::Reported { by: 0 });
    drop(ts);
    drop(regions);
}

#[test]
fn a_running_peer_that_failed_on_a_third_rank_counts_as_dead_blaming_it() {
    need_libfabric!();
    let (ts, regions) = job(3, 4096);
    assert_eq!(ts[0].peer_status(1), PeerStatus::Alive);
    // Rank 1 failed on rank 2 (and runs on, its engine open).
    ts[1].set_blame(2);
    std::thread::sleep(PROBE_PERIOD + Duration::from_millis(50));
    let dead = PeerStatus::Dead {
        pid: 0,
        blamed: Some(2),
    };
    // Its notice says so, and so would a probe of its status.
    assert_eq!(ts[0].peer_status(1), dead, "rank 0 learns the blame");
    // Rank 2, the one blamed, is not told that rank 1 is gone by it.
    assert_eq!(ts[2].peer_status(1), PeerStatus::Alive);
    drop(ts);
    drop(regions);
}

#[test]
fn a_failing_peer_that_exits_without_closing_is_named_by_its_blame() {
    need_libfabric!();
    let (mut ts, regions) = job(3, 4096);
    assert_eq!(ts[0].peer_status(1), PeerStatus::Alive);
    // Rank 1 fails because of rank 2, then its process is gone before
    // anyone probes it again and without closing its engine (no close
    // notice): its progress thread stops, so a probe reads nothing.
    ts[1].set_blame(2);
    ts[1].core.stop.store(true, Ordering::Release);
    ts[1].core.cq.signal().unwrap();
    ts[1].progress.take().unwrap().join().unwrap();
    std::thread::sleep(PROBE_PERIOD + Duration::from_millis(50));
    let t0 = Instant::now();
    let dead = PeerStatus::Dead {
        pid: 0,
        blamed: Some(2),
    };
    assert_eq!(
        ts[0].peer_status(1),
        dead,
        "rank 0 learns the root cause from rank 1's notice"
    );
    assert!(t0.elapsed() < PROBE_TIMEOUT / 2, "rank 0 waited on a probe");
    // A wait on rank 2 is cut short the same way: rank 1 reported it.
    assert_eq!(ts[0].peer_status(2), PeerStatus::Reported { by: 1 });
    // Rank 2, the one blamed, is not told.
    assert!(ts[2].core.notice(1).is_none());
    drop(ts);
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

#[test]
fn the_shuffler_holds_back_and_reorders_completions() {
    let mut s = shared::Shuffler::new(3);
    let entries: Vec<sys::CqEntry> = (0..64u64)
        .map(|i| sys::CqEntry {
            data: i,
            ..sys::CqEntry::default()
        })
        .collect();
    entries.iter().for_each(|e| s.hold(*e));
    let mut out = Vec::new();
    s.take_due(None, &mut out);
    let order: Vec<u64> = out.iter().map(|e| e.data).collect();
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (0..64).collect::<Vec<_>>(),
        "every completion comes out once"
    );
    assert_ne!(order, sorted, "the shuffler kept the posted order");
    // Held back: nothing is due right after holding (up to 3 ms each).
    let mut s = shared::Shuffler::new(5);
    entries.iter().for_each(|e| s.hold(*e));
    let mut early = Vec::new();
    s.take_due(Some(Instant::now() - Duration::from_millis(1)), &mut early);
    assert!(early.is_empty());
    assert!(s.next_due().is_some());
}

#[test]
fn a_batch_keeps_many_operations_in_flight_and_completes_them_all() {
    need_libfabric!();
    for seed in [None, Some(5)] {
        let (ts, regions) = match seed {
            Some(seed) => shuffled_pair(1 << 20, seed),
            None => pair(1 << 20),
        };
        eprintln!(
            "provider {}: transmit queue {}, batch window {}",
            ts[0].granted().provider,
            ts[0].granted().tx_size,
            ts[0].batch_window()
        );
        let desc = regions[1].desc();
        // The pattern from 4 KiB on: the signal words below stay zero.
        for i in 0..(64 << 10) {
            // SAFETY: own region, in range, nobody writes it yet.
            unsafe { *regions[1].as_ptr().add(4096 + i) = (i % 253) as u8 };
        }
        // 300 reads of 200 bytes (more than a window) into one buffer.
        let mut dst = vec![0u8; 300 * 200];
        let base = dst.as_mut_ptr();
        let mut reads = (0..300usize).map(|i| Op::Get {
            peer: 1,
            remote: desc,
            offset: 4096 + i * 200,
            // SAFETY: inside `dst`.
            dst: unsafe { base.add(i * 200) },
            len: 200,
        });
        // SAFETY: `dst` outlives the batch; each read has its own bytes.
        unsafe { ts[0].run_batch(&mut reads) }.unwrap();
        assert!(dst.iter().enumerate().all(|(i, &b)| b == (i % 253) as u8));
        // 200 writes with data, each counted into one of 8 words, and a
        // pure signal raising a ninth word, all in one batch.
        let src: Vec<u8> = (0..200 * 64).map(|i| (i % 13) as u8).collect();
        let head = [7u8; 8];
        let mut puts = (0..201usize).map(|i| {
            if i == 200 {
                return Op::Put {
                    peer: 1,
                    remote: desc,
                    offset: 0,
                    parts: [(std::ptr::null(), 0); 2],
                    signal: SignalRef {
                        offset: 8 * 16,
                        bell: Bell::Client,
                    },
                    value: 99,
                };
            }
            Op::Put {
                peer: 1,
                remote: desc,
                offset: (256 << 10) + i * 72,
                parts: [(head.as_ptr(), 8), (src[i * 64..].as_ptr(), 64)],
                signal: SignalRef {
                    offset: 16 * (i % 8),
                    bell: Bell::Server,
                },
                value: 0,
            }
        });
        // SAFETY: `src` and `head` outlive the batch.
        unsafe { ts[0].run_batch(&mut puts) }.unwrap();
        for w in 0..8 {
            wait_for(regions[1].signal(16 * w).unwrap(), 25, "a counted word");
        }
        wait_for(regions[1].signal(8 * 16).unwrap(), 99, "the raised word");
        for i in 0..200 {
            // SAFETY: in range; the counts (acquire) ordered the data.
            let got = unsafe {
                std::slice::from_raw_parts(regions[1].as_ptr().add((256 << 10) + i * 72), 72)
            };
            assert_eq!(&got[..8], &head);
            assert_eq!(&got[8..], &src[i * 64..i * 64 + 64], "write {i}");
        }
        // Out of range in the middle: an error, the connection still works.
        let mut bad = (0..3usize).map(|i| Op::Get {
            peer: 1,
            remote: desc,
            offset: if i == 1 { 1 << 21 } else { 0 },
            dst: base,
            len: 8,
        });
        // SAFETY: as above.
        assert!(unsafe { ts[0].run_batch(&mut bad) }.is_err());
        ts[0].get(1, &desc, 0, &mut dst[..8]).unwrap();
    }
}

#[test]
fn a_panic_in_the_progress_thread_fails_this_ranks_operations_naming_it() {
    need_libfabric!();
    let (ts, regions) = pair(4096);
    let mut dst = vec![0u8; 64];
    ts[0].get(1, &regions[1].desc(), 0, &mut dst).unwrap();
    ts[0].core.inject_panic.store(true, Ordering::Release);
    ts[0].core.cq.signal().unwrap(); // wakes the thread from its CQ read
    let until = Instant::now() + Duration::from_secs(10);
    while ts[0].failure().is_none() {
        assert!(Instant::now() < until, "the panic was never recorded");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The next operation fails at once (the deadline is 20 s), naming this
    // rank and its progress thread, instead of blaming the peer.
    let start = Instant::now();
    let e = ts[0].get(1, &regions[1].desc(), 0, &mut dst).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5), "{e}");
    let s = e.to_string();
    assert!(
        matches!(e, Error::Internal { rank: 0, .. })
            && s.contains("progress thread")
            && s.contains("injected into the progress thread"),
        "{s}"
    );
    assert_eq!(e.blamed_peer(), None);
    drop(regions);
}
