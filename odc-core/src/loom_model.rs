//! Model check of the landing-slot protocol with loom: a client pushes N
//! chunks through two slots (write data, release-store the slot signal), a
//! server scans the signals (acquire), adds the data and acknowledges
//! (release-store the ack word); the client reuses a slot only after its
//! last signal was acknowledged. loom's `UnsafeCell` flags any overlap of a
//! client write and a server read of the same slot, i.e. a slot overwritten
//! before its acknowledgement.

use loom::cell::UnsafeCell;
use loom::sync::Arc;

use crate::sync::{yield_now, AtomicU64, Backoff, Ordering};

struct Slot {
    signal: AtomicU64,
    data: UnsafeCell<u64>,
}

struct Pair {
    slots: [Slot; 2],
    acks: [AtomicU64; 2],
}

impl Pair {
    fn new() -> Pair {
        let slot = || Slot {
            signal: AtomicU64::new(0),
            data: UnsafeCell::new(0),
        };
        Pair {
            slots: [slot(), slot()],
            acks: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }
}

fn payload(seq: u64) -> u64 {
    seq * 10 + 1
}

fn client(pair: &Pair, chunks: u64) {
    let mut sent = [0u64; 2];
    for seq in 1..=chunks {
        let s = (seq % 2) as usize;
        let mut backoff = Backoff::new();
        while pair.acks[s].load(Ordering::Acquire) != sent[s] {
            backoff.snooze();
        }
        // SAFETY (model): the server acknowledged this slot's last chunk, so
        // it no longer reads it; loom checks exactly this claim.
        pair.slots[s]
            .data
            .with_mut(|d| unsafe { *d = payload(seq) });
        pair.slots[s].signal.store(seq, Ordering::Release);
        sent[s] = seq;
    }
    for s in 0..2 {
        while pair.acks[s].load(Ordering::Acquire) != sent[s] {
            yield_now();
        }
    }
}

fn server(pair: &Pair, chunks: u64) -> u64 {
    let mut last = [0u64; 2];
    let (mut processed, mut sum) = (0, 0);
    while processed < chunks {
        let mut progressed = false;
        for s in 0..2 {
            let seq = pair.slots[s].signal.load(Ordering::Acquire);
            if seq != last[s] {
                // SAFETY (model): the client wrote the data before the signal
                // we observed and waits for our acknowledgement.
                sum += pair.slots[s].data.with(|d| unsafe { *d });
                pair.acks[s].store(seq, Ordering::Release);
                last[s] = seq;
                processed += 1;
                progressed = true;
            }
        }
        if !progressed {
            yield_now();
        }
    }
    sum
}

#[test]
fn loom_landing_slots_two_slots_three_chunks() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let chunks = 3;
        let pair = Arc::new(Pair::new());
        let p = Arc::clone(&pair);
        let srv = loom::thread::spawn(move || server(&p, chunks));
        client(&pair, chunks);
        let sum = srv.join().unwrap();
        assert_eq!(sum, (1..=chunks).map(payload).sum::<u64>());
        for s in 0..2 {
            assert_eq!(
                pair.acks[s].load(Ordering::Acquire),
                pair.slots[s].signal.load(Ordering::Acquire)
            );
        }
    });
}
