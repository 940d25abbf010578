//! Model check of the landing-slot protocol with loom: a client pushes N
//! chunks through two slots (write data, release-increment the slot's
//! count, as a network transport's progress thread does on each arrived
//! write), a server scans the counts (acquire), adds the data and acknowledges
//! (release-store the ack word); the client reuses a slot only after its
//! last signal was acknowledged. loom's `UnsafeCell` flags any overlap of a
//! client write and a server read of the same slot, i.e. a slot overwritten
//! before its acknowledgement.

use loom::cell::UnsafeCell;
use loom::sync::Arc;

use crate::control::slot_seq;
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
        pair.slots[s].signal.fetch_add(1, Ordering::Release);
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
            let seq = slot_seq(s, pair.slots[s].signal.load(Ordering::Acquire));
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
                slot_seq(s, pair.slots[s].signal.load(Ordering::Acquire))
            );
        }
    });
}

/// The own-slice hand-off (`crate::handoff`): the server reads the client's
/// buffer only under a claim; once the client saw `done` or revoked, it
/// reuses the buffer (a write loom checks against every server read).
mod own_handoff {
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    use crate::handoff::{OwnPush, OwnSlice};
    use crate::sync::yield_now;

    struct Shared {
        own: OwnPush,
        buffer: UnsafeCell<u64>,
    }

    const CHUNKS: usize = 2;

    fn slice() -> OwnSlice {
        OwnSlice {
            bucket: 0,
            offset: 0,
            len: CHUNKS,
            addr: 0,
            dtype: 0,
            scale: 1.0,
        }
    }

    /// The daemon's side: take the post, add it chunk by chunk under claims.
    fn server(s: &Shared) -> u64 {
        let (gen, slice) = loop {
            match s.own.take(0) {
                Some(p) => break p,
                None => yield_now(),
            }
        };
        let mut sum = 0;
        for done in 1..=slice.len {
            if !s.own.claim(gen) {
                break;
            }
            // SAFETY (model): the claim keeps the client off the buffer.
            sum += s.buffer.with(|b| unsafe { *b });
            s.own.unclaim(gen, done == slice.len);
        }
        sum
    }

    fn run(revoke: bool) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let s = Arc::new(Shared {
                own: OwnPush::new(),
                buffer: UnsafeCell::new(7),
            });
            let srv = {
                let s = Arc::clone(&s);
                loom::thread::spawn(move || server(&s))
            };
            s.own.post(1, slice());
            if revoke {
                s.own.revoke(1);
            } else {
                while !s.own.is_done(1) {
                    yield_now();
                }
            }
            // The call returns: the caller reuses its buffer.
            // SAFETY (model): done or revoked, so no server read is pending.
            s.buffer.with_mut(|b| unsafe { *b = 0 });
            let sum = srv.join().unwrap();
            if !revoke {
                assert_eq!(sum, 7 * CHUNKS as u64);
            }
        });
    }

    #[test]
    fn loom_own_handoff_completes() {
        run(false);
    }

    #[test]
    fn loom_own_handoff_revoked_mid_way() {
        run(true);
    }
}
